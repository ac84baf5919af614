# A program run twice, as given and with EXTRA arguments added (a list): both must succeed,
# the second's output must match MUST, and every "Rank r, Step s, Loss: x" line the two print
# must be the same, bit for bit (flags that change how training is distributed, not what it
# computes); with TOLERANCE=N, the losses within N units of their sixth decimal (printf's %f),
# the lines otherwise the same (flags that sum the same terms in another order). A loss that
# is not a number (nan, inf) fails either way.
#   cmake "-DEXTRA=--flag;value" "-DMUST=regex" [-DTOLERANCE=N] -P same_losses.cmake -- program args...
cmake_policy(VERSION 3.25)
include(${CMAKE_CURRENT_LIST_DIR}/command_after_dashes.cmake)
string(REPLACE ";" " " shown "${command}")
include(${CMAKE_CURRENT_LIST_DIR}/loss_lines.cmake)

run(plain)
run(changed ${EXTRA})
if(NOT changed_text MATCHES "${MUST}")
  message(FATAL_ERROR "the run with ${EXTRA} does not print '${MUST}'")
endif()
if(plain STREQUAL "")
  message(FATAL_ERROR "the runs print no loss lines")
endif()
list(SORT plain)  # ranks print in whatever order their threads reach the line
list(SORT changed)
if(NOT DEFINED TOLERANCE)
  if(NOT plain STREQUAL changed)
    message(FATAL_ERROR "the losses differ with ${EXTRA}:\n${plain}\nagainst\n${changed}")
  endif()
  return()
endif()
# "Rank r, Step s, Loss: 5.537024" -> the line before the number, and the number in millionths
function(millionths line prefix_var value_var)
  if(NOT line MATCHES "^(.*Loss: )(-?)([0-9]+)\\.([0-9][0-9][0-9][0-9][0-9][0-9])$")
    message(FATAL_ERROR "not a finite loss with six decimals: '${line}'")
  endif()
  set(prefix "${CMAKE_MATCH_1}")
  string(REGEX REPLACE "^0+([0-9])" "\\1" digits "${CMAKE_MATCH_3}${CMAKE_MATCH_4}")  # no leading zeros
  set(${prefix_var} "${prefix}" PARENT_SCOPE)
  set(${value_var} "${CMAKE_MATCH_2}${digits}" PARENT_SCOPE)
endfunction()
list(LENGTH plain count)
list(LENGTH changed changed_count)
if(NOT count EQUAL changed_count)
  message(FATAL_ERROR "${count} loss lines against ${changed_count} with ${EXTRA}")
endif()
math(EXPR last "${count} - 1")
foreach(i RANGE ${last})
  list(GET plain ${i} a)
  list(GET changed ${i} b)
  millionths("${a}" a_line a_value)
  millionths("${b}" b_line b_value)
  math(EXPR apart "${a_value} - ${b_value}")
  if(apart LESS 0)
    math(EXPR apart "0 - ${apart}")
  endif()
  if(NOT a_line STREQUAL b_line OR apart GREATER TOLERANCE)
    message(FATAL_ERROR "'${a}' against '${b}' with ${EXTRA}: more than ${TOLERANCE} millionths apart")
  endif()
endforeach()
