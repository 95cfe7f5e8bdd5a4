# cmake --install into a fresh prefix, then configure, build and run a C
# program that uses find_package(optstate) against it.
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
