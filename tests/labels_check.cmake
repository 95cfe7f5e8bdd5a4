# Fails when a ctest test has none of the labels the test commands select by
# (unit, fuse, gpu, slow, perf): such a test runs in no labelled pass and its
# timeout class is unknown. Run by ctest as tests.labels (see
# tests/CMakeLists.txt) with -DCTEST=<ctest> -DBUILD_DIR=<build tree>.
#
# ctest -LE lists the tests none of whose labels match; a gtest binary that is
# not built yet appears as one <target>_NOT_BUILT placeholder, which fails on
# its own and is not counted here.
set(known "^(unit|fuse|gpu|slow|perf)$")
execute_process(COMMAND ${CTEST} -N -LE "${known}"
                WORKING_DIRECTORY ${BUILD_DIR}
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ctest -N -LE in ${BUILD_DIR} failed (${rc}): ${err}")
endif()
string(REGEX MATCHALL "Test +#[0-9]+: [^\n]+" lines "${out}")
set(unlabelled "")
foreach(line IN LISTS lines)
  string(REGEX REPLACE "^Test +#[0-9]+: " "" name "${line}")
  if(name MATCHES "_NOT_BUILT$")
    continue()
  endif()
  string(APPEND unlabelled "  ${name}\n")
endforeach()
if(NOT unlabelled STREQUAL "")
  message(FATAL_ERROR "tests without a label matching ${known} (give each LABELS in its CMakeLists.txt):\n"
                      "${unlabelled}")
endif()
message(STATUS "every test in ${BUILD_DIR} has a known label")
