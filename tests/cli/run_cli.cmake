# Runs a command line and checks how it ends: exit status STATUS and output (stdout and stderr)
# matching OUTPUT. A crash, a signal, a hang (60 s) or another status fails.
#   cmake -DSTATUS=2 -DOUTPUT=regex -P run_cli.cmake -- program args...
set(command "")
math(EXPR last "${CMAKE_ARGC} - 1")
foreach(i RANGE ${last})
  if(DEFINED program_args)
    list(APPEND command "${CMAKE_ARGV${i}}")
  elseif(CMAKE_ARGV${i} STREQUAL "--")
    set(program_args TRUE)
  endif()
endforeach()
execute_process(COMMAND ${command} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
string(REPLACE ";" " " shown "${command}")
if(NOT status STREQUAL STATUS OR NOT "${out}${err}" MATCHES "${OUTPUT}")
  message(FATAL_ERROR "$ ${shown}\nexpected exit status ${STATUS} and output matching '${OUTPUT}', "
                      "got status '${status}':\n${out}${err}")
endif()
message("$ ${shown}\n${out}${err}")
