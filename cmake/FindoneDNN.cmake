# FindoneDNN — oneDNN's C API (dnnl_sgemm, for ops::gemm) and the OpenMP runtime it threads with.
# Not oneDNN's own dnnl-config.cmake: that one also requires OpenCL's development files, and gives
# no handle on the OpenMP runtime, whose omp_set_num_threads ops/gemm.hpp calls to keep each rank
# on one thread. Only OpenMP builds count (Debian's libdnnl-dev is one); the runtime searched is GNU
# libgomp, the one Debian's build links.
# Defines oneDNN_FOUND, oneDNN_VERSION and the IMPORTED target oneDNN::oneDNN. Hints: oneDNN_ROOT.
find_path(oneDNN_INCLUDE_DIR oneapi/dnnl/dnnl.h HINTS ${oneDNN_ROOT} ENV oneDNN_ROOT PATH_SUFFIXES include)
find_library(oneDNN_LIBRARY dnnl HINTS ${oneDNN_ROOT} ENV oneDNN_ROOT PATH_SUFFIXES lib lib64)
find_library(oneDNN_OPENMP_LIBRARY NAMES gomp libgomp.so.1)
if(oneDNN_INCLUDE_DIR AND EXISTS "${oneDNN_INCLUDE_DIR}/oneapi/dnnl/dnnl_version.h")
  file(STRINGS "${oneDNN_INCLUDE_DIR}/oneapi/dnnl/dnnl_version.h" _dnnl_defs
       REGEX "^#define DNNL_VERSION_(MAJOR|MINOR|PATCH) ")
  foreach(part MAJOR MINOR PATCH)
    string(REGEX REPLACE ".*#define DNNL_VERSION_${part} ([0-9]+).*" "\\1" _dnnl_${part} "${_dnnl_defs}")
  endforeach()
  set(oneDNN_VERSION "${_dnnl_MAJOR}.${_dnnl_MINOR}.${_dnnl_PATCH}")
  file(STRINGS "${oneDNN_INCLUDE_DIR}/oneapi/dnnl/dnnl_config.h" _dnnl_runtime
       REGEX "^#define DNNL_CPU_THREADING_RUNTIME DNNL_RUNTIME_OMP")
  if(_dnnl_runtime)
    set(oneDNN_THREADING OMP)
  endif()
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(oneDNN REQUIRED_VARS oneDNN_LIBRARY oneDNN_INCLUDE_DIR oneDNN_THREADING
                                                       oneDNN_OPENMP_LIBRARY VERSION_VAR oneDNN_VERSION)
if(oneDNN_FOUND AND NOT TARGET oneDNN::oneDNN)
  add_library(oneDNN::oneDNN UNKNOWN IMPORTED)
  set_target_properties(oneDNN::oneDNN PROPERTIES IMPORTED_LOCATION "${oneDNN_LIBRARY}"
                                                  INTERFACE_INCLUDE_DIRECTORIES "${oneDNN_INCLUDE_DIR}"
                                                  INTERFACE_LINK_LIBRARIES "${oneDNN_OPENMP_LIBRARY}")
endif()
mark_as_advanced(oneDNN_INCLUDE_DIR oneDNN_LIBRARY oneDNN_OPENMP_LIBRARY)
