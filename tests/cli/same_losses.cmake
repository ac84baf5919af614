# A program run twice, as given and with EXTRA arguments added (a list): both must succeed,
# the second's output must match MUST, and every "Rank r, Step s, Loss: x" line the two print
# must be the same, bit for bit (flags that change how training is distributed, not what it computes).
#   cmake "-DEXTRA=--flag;value" "-DMUST=regex" -P same_losses.cmake -- program args...
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
if(NOT plain STREQUAL changed)
  message(FATAL_ERROR "the losses differ with ${EXTRA}:\n${plain}\nagainst\n${changed}")
endif()
