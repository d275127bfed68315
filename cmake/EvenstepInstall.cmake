# Install rules and the exported package: an external project does
#   find_package(evenstep REQUIRED)
#   target_link_libraries(app PRIVATE evenstep::evenstep)
include(CMakePackageConfigHelpers)

install(TARGETS evenstep evenstep_torch
  EXPORT evenstepTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# Public headers only: internal/ headers are evenstep's own (no public
# header includes one; tests/layering_check.py fails if one does).
install(DIRECTORY ${PROJECT_SOURCE_DIR}/base/include/evenstep
  ${PROJECT_SOURCE_DIR}/lib/distributed/include/evenstep
  ${PROJECT_SOURCE_DIR}/lib/balance/include/evenstep
  ${PROJECT_SOURCE_DIR}/lib/observe/include/evenstep
  ${PROJECT_SOURCE_DIR}/lib/train/include/evenstep
  ${PROJECT_SOURCE_DIR}/hooks/include/evenstep
  ${PROJECT_SOURCE_DIR}/io/include/evenstep
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  PATTERN internal EXCLUDE)

set(_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/evenstep)
install(EXPORT evenstepTargets NAMESPACE evenstep:: DESTINATION ${_cmake_dir})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/evenstepConfig.cmake.in
  ${CMAKE_BINARY_DIR}/evenstepConfig.cmake INSTALL_DESTINATION ${_cmake_dir})
write_basic_package_version_file(${CMAKE_BINARY_DIR}/evenstepConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/evenstepConfig.cmake
  ${CMAKE_BINARY_DIR}/evenstepConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/FindXXHash.cmake
  DESTINATION ${_cmake_dir})
