# FindNCCL — NCCL ships neither a CMake config nor a pkg-config file.
# Defines NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_VERSION, the IMPORTED target NCCL::NCCL, and
# NCCL_SEARCHED (where it looked besides the system's paths, for a message when it is not found).
# Looks in NCCL_ROOT (variable or environment), the CUDA toolkit, the system, then in Python's NCCL
# package (pip's nvidia-nccl-cu*, which PyTorch installs: nvidia/nccl/{include,lib}, libnccl.so.2 with no
# unversioned libnccl.so), where python3 (else python) imports it from, else in the usual site-packages
# folders: lib*/python3*/*-packages/nvidia/nccl under a virtualenv, conda, ~/.local, /usr/local, /usr and /opt/*.
find_package(CUDAToolkit QUIET)

set(_nccl_python_dirs "")
foreach(_nccl_python python3 python)
  find_program(_nccl_python_exe ${_nccl_python} NO_CACHE)
  if(_nccl_python_exe AND NOT _nccl_python_dirs)
    execute_process(COMMAND "${_nccl_python_exe}" -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
                    OUTPUT_VARIABLE _nccl_python_dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET TIMEOUT 20)
  endif()
  unset(_nccl_python_exe)
endforeach()
set(_nccl_site_globs "")
foreach(prefix $ENV{VIRTUAL_ENV} $ENV{CONDA_PREFIX} $ENV{HOME}/.local /usr/local /usr /opt/*)
  list(APPEND _nccl_site_globs "${prefix}/lib*/python3*/*-packages/nvidia/nccl")
endforeach()
file(GLOB _nccl_site_dirs LIST_DIRECTORIES true ${_nccl_site_globs})
list(APPEND _nccl_python_dirs ${_nccl_site_dirs})

find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${NCCL_ROOT} ENV NCCL_ROOT ${CUDAToolkit_INCLUDE_DIRS}
          PATHS ${_nccl_python_dirs} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${NCCL_ROOT} ENV NCCL_ROOT
             ${CUDAToolkit_LIBRARY_DIR} PATHS ${_nccl_python_dirs} PATH_SUFFIXES lib lib64)
set(NCCL_SEARCHED ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_LIBRARY_DIR}
    ${_nccl_python_dirs} ${_nccl_site_globs})
list(REMOVE_DUPLICATES NCCL_SEARCHED)
if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_defs REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  foreach(part MAJOR MINOR PATCH)
    string(REGEX REPLACE ".*#define NCCL_${part} ([0-9]+).*" "\\1" NCCL_${part} "${_nccl_defs}")
  endforeach()
  set(NCCL_VERSION "${NCCL_MAJOR}.${NCCL_MINOR}.${NCCL_PATCH}")
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR VERSION_VAR NCCL_VERSION)
if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                                              INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
