# ccache as compiler launcher when present. The sloppiness settings let ccache
# cache translation units that use the precompiled torch header.
if(EVENSTEP_USE_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  find_program(EVENSTEP_CCACHE ccache)
  if(EVENSTEP_CCACHE)
    set(CMAKE_CXX_COMPILER_LAUNCHER
        ${CMAKE_COMMAND} -E env
        "CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime"
        ${EVENSTEP_CCACHE})
    message(STATUS "evenstep: using ccache (${EVENSTEP_CCACHE})")
  endif()
endif()
