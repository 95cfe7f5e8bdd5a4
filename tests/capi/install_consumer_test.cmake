# cmake --install into a fresh prefix, then configure, build and run a C
# program that uses find_package(optstate) against it; the tools, the mount's
# systemd unit (naming the installed optstate-mount) and the fstab example are
# where the docs say they live. Then the same program against the build tree
# (-Doptstate_DIR=<build>/capi, docs/PYTHON.md), without an install.
# -DBUILD_DIR=... -DSOURCE_DIR=<tests/capi/consumer> -DWORK_DIR=...
file(REMOVE_RECURSE ${WORK_DIR})
foreach(step
    "${CMAKE_COMMAND};--install;${BUILD_DIR};--prefix;${WORK_DIR}/prefix"
    "${CMAKE_COMMAND};-S;${SOURCE_DIR};-B;${WORK_DIR}/build;-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix"
    "${CMAKE_COMMAND};--build;${WORK_DIR}/build"
    "${WORK_DIR}/build/consumer")
  execute_process(COMMAND ${step} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install consumer test: '${step}' failed (${rc})")
  endif()
endforeach()
set(prefix ${WORK_DIR}/prefix)
foreach(f bin/optstate-mount bin/optstate-inspect bin/optstate-restore bin/optstate-reshard bin/optstate-demo
          lib/systemd/system/optstate-mount.service share/doc/optstate/fstab.example share/doc/optstate/README.md
          share/doc/optstate/docs/ARCHITECTURE.md)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "install consumer test: cmake --install did not install ${prefix}/${f}")
  endif()
endforeach()
file(STRINGS ${prefix}/lib/systemd/system/optstate-mount.service exec REGEX "^ExecStart=")
if(NOT exec MATCHES "^ExecStart=${prefix}/bin/optstate-mount ")
  message(FATAL_ERROR "install consumer test: the installed unit starts '${exec}', not ${prefix}/bin/optstate-mount")
endif()

# find_package(optstate) against the build tree, as docs/PYTHON.md says.
foreach(step
    "${CMAKE_COMMAND};-S;${SOURCE_DIR};-B;${WORK_DIR}/build-tree;-Doptstate_DIR=${BUILD_DIR}/capi"
    "${CMAKE_COMMAND};--build;${WORK_DIR}/build-tree"
    "${WORK_DIR}/build-tree/consumer")
  execute_process(COMMAND ${step} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "build-tree consumer test: '${step}' failed (${rc})")
  endif()
endforeach()
