# ctest driver: install the build tree into a fresh prefix, configure and build
# tests/consumer against it with find_package(evenstep), run the result.
# Inputs: BUILD_DIR, SOURCE_DIR, WORK_DIR, TORCH_DIR, PREFIX_PATH (the
# parent build's CMAKE_PREFIX_PATH: where its libtorch's libraries are found
# before the system's), GENERATOR, LINKER_FLAGS.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()
run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
# Only public headers are installed: internal/ ones are evenstep's own.
file(GLOB_RECURSE installed_internal "${WORK_DIR}/prefix/include/evenstep/internal/*")
if(installed_internal)
  message(FATAL_ERROR "internal headers were installed: ${installed_internal}")
endif()
# The prefix path is a list: its separators are escaped so that passing it
# through run()'s ARGN keeps it one argument (unescaped, PREFIX_PATH was
# dropped and the consumer found Debian's libtorch beside the wheel's).
string(REPLACE ";" "\\;" prefix_path "${WORK_DIR}/prefix;${PREFIX_PATH}")
run(${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
    "-DCMAKE_PREFIX_PATH=${prefix_path}" "-DTorch_DIR=${TORCH_DIR}"
    "-DCMAKE_EXE_LINKER_FLAGS=${LINKER_FLAGS}")
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
# libtorch's own directory (TORCH_DIR is <root>/share/cmake/Torch): the torch
# wheel's libtorch.so finds its sibling libtorch_cuda.so only through it.
get_filename_component(torch_lib "${TORCH_DIR}/../../../lib" ABSOLUTE)
run(${CMAKE_COMMAND} -E env "LD_LIBRARY_PATH=${torch_lib}:$ENV{LD_LIBRARY_PATH}"
    "${WORK_DIR}/build/consumer")
if(NOT last_output MATCHES "consumer: rank 0/1 \\(local 0/1\\) via single process, backend gloo")
  message(FATAL_ERROR "unexpected consumer output: ${last_output}")
endif()
message(STATUS "${last_output}")
# Checkpoint retention through several rotations and a tree removal.
run(${CMAKE_COMMAND} -E env "LD_LIBRARY_PATH=${torch_lib}:$ENV{LD_LIBRARY_PATH}"
    "${WORK_DIR}/build/consumer" "${WORK_DIR}/rotations")
if(NOT last_output MATCHES "kept: 4 5\nremoved: yes")
  message(FATAL_ERROR "unexpected consumer output (checkpoint rotations): ${last_output}")
endif()
message(STATUS "${last_output}")
# The installed tools start from the prefix as they are, without
# LD_LIBRARY_PATH (their RUNPATH finds libevenstep.so and libtorch).
run(${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH
    "${WORK_DIR}/prefix/bin/evenstep-run" -n 1 -- /bin/true)
file(MAKE_DIRECTORY "${WORK_DIR}/no-checkpoints")
run(${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH
    "${WORK_DIR}/prefix/bin/evenstep-ckpt" ls "${WORK_DIR}/no-checkpoints")
if(NOT last_output MATCHES "committed")
  message(FATAL_ERROR "unexpected evenstep-ckpt output: ${last_output}")
endif()
message(STATUS "installed evenstep-run and evenstep-ckpt start")
