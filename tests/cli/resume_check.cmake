# A run that saves sharded checkpoints every EVERY steps into DIR, then a run resumed from the
# first of them (DIR/step-<EVERY, 8 digits>): the resumed run must say it resumed there, start
# its loss lines at that step, and every "Rank r, Step s, Loss: x" line it prints must be the
# first run's (at the same world size training goes on bit for bit).
# With RESUMER (a program and its arguments, as a list) that program resumes instead, and
# only where it resumes is checked (its world size or dtype may differ, and so its losses).
#   cmake -DDIR=dir -DEVERY=n [-DRESUMER=program;args...] -P resume_check.cmake -- program args...
cmake_policy(VERSION 3.25)  # IN_LIST
include(${CMAKE_CURRENT_LIST_DIR}/command_after_dashes.cmake)
file(REMOVE_RECURSE "${DIR}")
string(REPLACE ";" " " shown "${command}")
include(${CMAKE_CURRENT_LIST_DIR}/loss_lines.cmake)

run(whole --checkpoint-dir "${DIR}" --checkpoint-every ${EVERY})
string(LENGTH "0000000${EVERY}" n)
math(EXPR from "${n} - 8")
string(SUBSTRING "0000000${EVERY}" ${from} 8 digits)
if(DEFINED RESUMER)  # another program resumes (a list: program and its arguments)
  set(command ${RESUMER})
  string(REPLACE ";" " " shown "${command}")
endif()
run(resumed --resume "${DIR}/step-${digits}")
# It resumed (a run that ignored --resume would print the whole run's lines too), and its
# first loss line is the step after the checkpoint's.
if(NOT resumed_text MATCHES "resumed from [^\n]* at step ${EVERY}\n")
  message(FATAL_ERROR "the resumed run does not say it resumed at step ${EVERY}")
endif()
list(GET resumed 0 first_line)
if(NOT first_line MATCHES "Step ${EVERY},")
  message(FATAL_ERROR "the resumed run's first loss line is '${first_line}', not step ${EVERY}'s")
endif()
if(DEFINED RESUMER)  # its own world size and dtype: other losses
  return()
endif()
foreach(line IN LISTS resumed)
  if(NOT line IN_LIST whole)
    message(FATAL_ERROR "the resumed run printed '${line}', which the whole run did not:\n${whole}")
  endif()
endforeach()
