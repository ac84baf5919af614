# FindNCCL — NCCL ships neither a CMake config nor a pkg-config file.
# Defines NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_VERSION and the IMPORTED target NCCL::NCCL.
# Looks in NCCL_ROOT (variable or environment), the CUDA toolkit, the system, then in Python's NCCL
# package (pip's nvidia-nccl-cu*, which PyTorch installs: nvidia/nccl/{include,lib}, libnccl.so.2 with no
# unversioned libnccl.so), where python3 imports it from, else in the usual site-packages folders.
find_package(CUDAToolkit QUIET)

find_program(NCCL_PYTHON_EXECUTABLE NAMES python3 python)
set(_nccl_python_dirs "")
if(NCCL_PYTHON_EXECUTABLE)
  execute_process(COMMAND "${NCCL_PYTHON_EXECUTABLE}" -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
                  OUTPUT_VARIABLE _nccl_python_dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
foreach(prefix $ENV{VIRTUAL_ENV} $ENV{CONDA_PREFIX} $ENV{HOME}/.local /usr/local /usr /opt/conda)
  file(GLOB _nccl_site_dirs LIST_DIRECTORIES true "${prefix}/lib/python3*/*-packages/nvidia/nccl")
  list(APPEND _nccl_python_dirs ${_nccl_site_dirs})
endforeach()

find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${NCCL_ROOT} ENV NCCL_ROOT ${CUDAToolkit_INCLUDE_DIRS}
          PATHS ${_nccl_python_dirs} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${NCCL_ROOT} ENV NCCL_ROOT
             ${CUDAToolkit_LIBRARY_DIR} PATHS ${_nccl_python_dirs} PATH_SUFFIXES lib lib64)
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
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY NCCL_PYTHON_EXECUTABLE)
