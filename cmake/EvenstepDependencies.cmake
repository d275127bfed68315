# Every dependency comes from find_package: Debian bookworm packages by default,
# any libtorch through CMAKE_PREFIX_PATH / Torch_DIR.
find_package(Threads REQUIRED)
find_package(Torch REQUIRED)
find_package(absl REQUIRED)
find_package(HDF5 REQUIRED COMPONENTS C)
find_package(Boost 1.74 REQUIRED COMPONENTS fiber context)
find_package(XXHash REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
if(EVENSTEP_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(EVENSTEP_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()
message(STATUS "evenstep: Torch ${Torch_VERSION} from ${Torch_DIR}")

# Torch's config exports flags (ABI define) through TORCH_CXX_FLAGS and a plain
# list of libraries; wrap them in one interface target so every evenstep target
# gets both the same way.
if(NOT TARGET evenstep_torch)
  add_library(evenstep_torch INTERFACE)
  target_link_libraries(evenstep_torch INTERFACE ${TORCH_LIBRARIES})
  separate_arguments(_evenstep_torch_flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
  target_compile_options(evenstep_torch INTERFACE ${_evenstep_torch_flags})
  # The 2.x wheels' libtorch.so exports its own copy of std::filesystem
  # (built with a newer GCC). A program whose load order has libtorch before
  # libstdc++ calls that copy, which on an older libstdc++ calls a null
  # function (torch 2.11 on Debian bookworm: every std::filesystem::remove_all
  # crashed; scripts/bundle_check.sh found it). libstdc++ first in every
  # program's load order binds std:: to the library the code was compiled for.
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    target_link_options(evenstep_torch INTERFACE
      "LINKER:--push-state,--no-as-needed,-lstdc++,--pop-state")
  endif()
endif()
