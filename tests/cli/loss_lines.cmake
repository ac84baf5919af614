# run(out_var [extra args...]): runs `command` (command_after_dashes.cmake's list; `shown` is
# how messages spell it) with the extra arguments; a nonzero status is a fatal error. Sets
# out_var to its "Rank r, Step s, Loss: x" lines (a list) and out_var_text to its output.
function(run out_var)
  execute_process(COMMAND ${command} ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err
                  TIMEOUT 120)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "$ ${shown} ${ARGN}\nexit status ${status}:\n${out}${err}")
  endif()
  message("$ ${shown} ${ARGN}\n${out}${err}")
  string(REGEX MATCHALL "Rank [0-9]+, Step [0-9]+, Loss: [^\n]*" lines "${out}")
  set(${out_var} "${lines}" PARENT_SCOPE)
  set(${out_var}_text "${out}" PARENT_SCOPE)
endfunction()
