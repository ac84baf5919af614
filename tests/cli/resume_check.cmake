# A run that saves sharded checkpoints every EVERY steps into DIR, then a run resumed from the
# first of them (DIR/step-<EVERY, 8 digits>): every "Rank r, Step s, Loss: x" line the resumed
# run prints must be the first run's (at the same world size training goes on bit for bit),
# and it must print at least one.
#   cmake -DDIR=dir -DEVERY=n -P resume_check.cmake -- program args...
cmake_policy(VERSION 3.25)  # IN_LIST
include(${CMAKE_CURRENT_LIST_DIR}/command_after_dashes.cmake)
file(REMOVE_RECURSE "${DIR}")
string(REPLACE ";" " " shown "${command}")

function(run out_var)
  execute_process(COMMAND ${command} ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err
                  TIMEOUT 120)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "$ ${shown} ${ARGN}\nexit status ${status}:\n${out}${err}")
  endif()
  message("$ ${shown} ${ARGN}\n${out}${err}")
  string(REGEX MATCHALL "Rank [0-9]+, Step [0-9]+, Loss: [^\n]*" lines "${out}")
  set(${out_var} "${lines}" PARENT_SCOPE)
endfunction()

run(whole --checkpoint-dir "${DIR}" --checkpoint-every ${EVERY})
string(LENGTH "0000000${EVERY}" n)
math(EXPR from "${n} - 8")
string(SUBSTRING "0000000${EVERY}" ${from} 8 digits)
run(resumed --resume "${DIR}/step-${digits}")
list(LENGTH resumed count)
if(count EQUAL 0)
  message(FATAL_ERROR "the resumed run printed no loss line")
endif()
foreach(line IN LISTS resumed)
  if(NOT line IN_LIST whole)
    message(FATAL_ERROR "the resumed run printed '${line}', which the whole run did not:\n${whole}")
  endif()
endforeach()
