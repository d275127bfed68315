# Probes the libtorch in use for the c10d API differences that
# lib/distributed/include/evenstep/internal/c10d_compat.h hides, and writes the answers to
# the generated header evenstep/internal/build_config.h. The version macros
# (TORCH_VERSION_MAJOR/MINOR) pick the code path; these try-compiles confirm
# the places where the API moved between releases, so a libtorch that does not
# match its version's expectations fails at configure time with a clear message
# instead of deep inside a compile.

# The language standard: evenstep's sources are C++17; a libtorch that
# requires C++20 of its users (the newest torch wheels, 2.15: TorchConfig puts
# cxx_std_20 on the torch target and ATen.h stops on an older standard)
# builds the whole project, probes included, as C++20.
set(EVENSTEP_CXX_STANDARD 17)
get_target_property(_torch_features torch INTERFACE_COMPILE_FEATURES)
if(_torch_features AND "cxx_std_20" IN_LIST _torch_features)
  set(EVENSTEP_CXX_STANDARD 20)
endif()
set(CMAKE_CXX_STANDARD ${EVENSTEP_CXX_STANDARD})
message(STATUS "evenstep: C++${EVENSTEP_CXX_STANDARD} (libtorch ${Torch_VERSION})")

set(_checks "${CMAKE_CURRENT_LIST_DIR}/compat_checks")
separate_arguments(_torch_flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
# A CUDA torch's headers (ProcessGroupNCCL.hpp reaches <cuda.h>) also need the
# CUDA toolkit's, which its CMake package finds (CUDAToolkit, or the older
# FindCUDA) and gives its targets but not TORCH_INCLUDE_DIRS.
foreach(_dir IN LISTS TORCH_INCLUDE_DIRS CUDAToolkit_INCLUDE_DIRS CUDA_INCLUDE_DIRS)
  list(APPEND _torch_flags "-I${_dir}")
endforeach()

# A CUDA torch wheel's NCCL header lives in its nvidia-nccl package
# (site-packages/nvidia/nccl/include), outside the include directories its
# CMake package names, and ProcessGroupNCCL.hpp includes <nccl.h>: without
# it the NCCL probe below fails and a CUDA build runs without NCCL (found on
# a lent H200 with torch 2.11.0+cu130, whose CUDA toolkit has no nccl.h).
get_filename_component(_torch_site "${Torch_DIR}/../../../.." ABSOLUTE)
file(GLOB _wheel_nccl "${_torch_site}/nvidia/nccl/include/nccl.h"
     "${_torch_site}/nvidia/*/include/nccl.h")
if(_wheel_nccl)
  list(GET _wheel_nccl 0 _wheel_nccl)
  get_filename_component(EVENSTEP_WHEEL_NCCL_INCLUDE "${_wheel_nccl}" DIRECTORY)
  message(STATUS "evenstep: NCCL's header from the torch wheel: ${EVENSTEP_WHEEL_NCCL_INCLUDE}")
  list(APPEND _torch_flags "-I${EVENSTEP_WHEEL_NCCL_INCLUDE}")
  set_property(TARGET torch APPEND PROPERTY INTERFACE_INCLUDE_DIRECTORIES
                                            "${EVENSTEP_WHEEL_NCCL_INCLUDE}")
endif()

function(evenstep_torch_probe var source)
  if(DEFINED ${var})
    return()
  endif()
  message(STATUS "evenstep: probing libtorch: ${var}")
  # Compile only (a static library, no link): the probes ask about the API's
  # shape, and linking inside try_compile cannot resolve the transitive
  # imported targets of the torch wheels' CMake packages (protobuf, cudart).
  set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)
  try_compile(_ok "${CMAKE_BINARY_DIR}/compat_probe/${var}"
    SOURCES "${_checks}/${source}"
    COMPILE_DEFINITIONS ${_torch_flags} -DUSE_C10D_GLOO ${ARGN}
    CXX_STANDARD ${EVENSTEP_CXX_STANDARD}
    OUTPUT_VARIABLE _out)
  if(_ok)
    set(${var} 1 CACHE INTERNAL "evenstep libtorch probe")
  else()
    # Not cached: a fixed environment (a package installed, a flag changed)
    # is probed again on the next configure.
    set(${var} 0)
    set(${var} 0 PARENT_SCOPE)
    file(WRITE "${CMAKE_BINARY_DIR}/compat_probe/${var}.log" "${_out}")
  endif()
  message(STATUS "evenstep: probing libtorch: ${var} = ${${var}}")
endfunction()

evenstep_torch_probe(EVENSTEP_HAVE_GLOO have_gloo.cc)
if(NOT EVENSTEP_HAVE_GLOO)
  message(FATAL_ERROR
    "evenstep: the c10d Gloo headers of this libtorch do not compile "
    "(see ${CMAKE_BINARY_DIR}/compat_probe/EVENSTEP_HAVE_GLOO.log). On Debian install "
    "libgloo-dev (scripts/install_deps.sh does).")
endif()
evenstep_torch_probe(EVENSTEP_GLOO_IS_PROCESS_GROUP gloo_is_process_group.cc)
evenstep_torch_probe(EVENSTEP_HAVE_NCCL have_nccl.cc -DUSE_C10D_NCCL)
evenstep_torch_probe(EVENSTEP_HAVE_EVENT_TIMING event_timing.cc)
if(EVENSTEP_HAVE_NCCL)
  evenstep_torch_probe(EVENSTEP_HAVE_CUDA_MEMORY_FRACTION cuda_memory_fraction.cc)
else()
  set(EVENSTEP_HAVE_CUDA_MEMORY_FRACTION 0)
endif()
if(NOT EVENSTEP_GLOO_IS_PROCESS_GROUP)
  evenstep_torch_probe(EVENSTEP_PG_CTOR_TAKES_OPTIONS pg_ctor_options.cc)
else()
  set(EVENSTEP_PG_CTOR_TAKES_OPTIONS 0)
endif()

if(Torch_VERSION VERSION_LESS 2.0 AND NOT EVENSTEP_GLOO_IS_PROCESS_GROUP)
  message(FATAL_ERROR "evenstep: libtorch ${Torch_VERSION} is 1.x but its ProcessGroupGloo "
                      "is not a ProcessGroup; c10d_compat.h does not know this layout.")
endif()
if(Torch_VERSION VERSION_GREATER_EQUAL 2.0 AND EVENSTEP_GLOO_IS_PROCESS_GROUP)
  message(FATAL_ERROR "evenstep: libtorch ${Torch_VERSION} is 2.x but its ProcessGroupGloo "
                      "is still a ProcessGroup; c10d_compat.h does not know this layout.")
endif()

configure_file("${CMAKE_CURRENT_LIST_DIR}/build_config.h.in"
               "${CMAKE_BINARY_DIR}/generated/evenstep/internal/build_config.h" @ONLY)
