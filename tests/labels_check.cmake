# Checks the tests' registration in the build tree. Run by ctest as
# tests.labels (see tests/CMakeLists.txt) with -DCTEST=<ctest> -DBUILD_DIR=<build tree>.
#
# 1. Every ctest test has one of the labels the test commands select by (unit,
#    fuse, gpu, slow, perf): otherwise it runs in no labelled pass and its
#    timeout class is unknown. ctest -LE lists the tests none of whose labels
#    match; a gtest binary that is not built yet appears as one
#    <target>_NOT_BUILT placeholder, which fails on its own and is not counted.
# 2. No two registrations (two gtest binaries, or a binary and an add_test)
#    share a test name. ctest keeps one test per name: the later command, with
#    the labels of both. Two binaries built from the same sources (a CPU and a
#    gpu variant) then run only the second, labelled gpu too, and
#    `ctest -LE gpu` silently drops the first binary's tests (give one a
#    TEST_PREFIX).
# 3. `ctest -LE gpu` lists every test whose own registration is not labelled
#    gpu.
# The registrations are read from the CTestTestfile.cmake files ctest reads
# (from BUILD_DIR's down through subdirs() and include(), so the files of
# gtest_discover_tests too).
cmake_policy(SET CMP0057 NEW)  # if(IN_LIST) in a -P script
set(known "^(unit|fuse|gpu|slow|perf)$")

# Square brackets and semicolons would break CMake's lists: @LB@ @RB@ @SC@ instead.
function(encode out_var text)
  string(REPLACE ";" "@SC@" text "${text}")
  string(REPLACE "[" "@LB@" text "${text}")
  string(REPLACE "]" "@RB@" text "${text}")
  set(${out_var} "${text}" PARENT_SCOPE)
endfunction()
function(decode out_var text)
  string(REPLACE "@SC@" ";" text "${text}")
  string(REPLACE "@LB@" "[" text "${text}")
  string(REPLACE "@RB@" "]" text "${text}")
  set(${out_var} "${text}" PARENT_SCOPE)
endfunction()

function(run_ctest out_var)
  execute_process(COMMAND ${CTEST} -N ${ARGN}
                  WORKING_DIRECTORY ${BUILD_DIR}
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "ctest -N ${ARGN} in ${BUILD_DIR} failed (${rc}): ${err}")
  endif()
  encode(out "${out}")
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

# The (encoded) test names of `ctest -N` output.
function(listed_names out_var text)
  string(REGEX MATCHALL "Test +#[0-9]+: [^\n]+" lines "${text}")
  set(names "")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^Test +#[0-9]+: " "" name "${line}")
    string(REGEX REPLACE " +\\(Disabled\\)$" "" name "${name}")
    string(STRIP "${name}" name)
    list(APPEND names "${name}")
  endforeach()
  set(${out_var} "${names}" PARENT_SCOPE)
endfunction()

# The first argument of an add_test(...) / set_tests_properties(...) line (a
# bracket argument, a quoted one or a bare word) into name_var, encoded and
# stripped as ctest -N prints it, and the rest of the line into rest_var.
function(first_argument line name_var rest_var)
  string(REGEX REPLACE "^[ \t]*[a-z_]+\\( *" "" rest "${line}")
  if(rest MATCHES "^\\[(=*)\\[")
    set(open "[${CMAKE_MATCH_1}[")
    set(close "]${CMAKE_MATCH_1}]")
    string(LENGTH "${open}" n)
    string(FIND "${rest}" "${close}" at)
    math(EXPR len "${at} - ${n}")
    string(SUBSTRING "${rest}" ${n} ${len} name)
    math(EXPR after "${at} + ${n}")
    string(SUBSTRING "${rest}" ${after} -1 rest)
  elseif(rest MATCHES "^\"([^\"]*)\"(.*)$")
    set(name "${CMAKE_MATCH_1}")
    set(rest "${CMAKE_MATCH_2}")
  elseif(rest MATCHES "^([^ )]+)(.*)$")
    set(name "${CMAKE_MATCH_1}")
    set(rest "${CMAKE_MATCH_2}")
  endif()
  string(STRIP "${name}" name)
  encode(name "${name}")
  encode(rest "${rest}")
  set(${name_var} "${name}" PARENT_SCOPE)
  set(${rest_var} "${rest}" PARENT_SCOPE)
endfunction()

# 1. Labels.
run_ctest(out -LE "${known}")
listed_names(names "${out}")
set(unlabelled "")
foreach(name IN LISTS names)
  if(name MATCHES "_NOT_BUILT$")
    continue()
  endif()
  string(APPEND unlabelled "  ${name}\n")
endforeach()
if(NOT unlabelled STREQUAL "")
  message(FATAL_ERROR "tests without a label matching ${known} (give each LABELS in its CMakeLists.txt):\n"
                      "${unlabelled}")
endif()

# 2. Registrations: name -> where, and each one's own labels.
set(queue "${BUILD_DIR}/CTestTestfile.cmake")
set(registered "")  # encoded names, in order
set(failures "")
while(queue)
  list(POP_FRONT queue file)
  decode(file "${file}")
  if(NOT EXISTS "${file}")
    continue()
  endif()
  get_filename_component(dir "${file}" DIRECTORY)
  file(READ "${file}" content)
  encode(content "${content}")
  string(REGEX MATCHALL "subdirs\\(\"[^\"]+\"\\)" subdirs "${content}")
  foreach(s IN LISTS subdirs)
    string(REGEX REPLACE "^subdirs\\(\"([^\"]+)\"\\)$" "\\1" s "${s}")
    decode(s "${s}")
    if(NOT IS_ABSOLUTE "${s}")
      set(s "${dir}/${s}")
    endif()
    encode(s "${s}/CTestTestfile.cmake")
    list(APPEND queue "${s}")
  endforeach()
  # gtest_discover_tests: include("...<target>[1]_include.cmake"), which
  # includes <target>[1]_tests.cmake once the binary is built.
  string(REGEX MATCHALL "include\\(\"[^\"]+\"\\)" includes "${content}")
  foreach(i IN LISTS includes)
    string(REGEX REPLACE "^include\\(\"([^\"]+)\"\\)$" "\\1" i "${i}")
    list(APPEND queue "${i}")
  endforeach()
  # One line per add_test / set_tests_properties in these generated files.
  string(REPLACE "\n" ";" lines "${content}")
  foreach(line IN LISTS lines)
    decode(line "${line}")
    if(line MATCHES "^[ \t]*add_test\\(")
      first_argument("${line}" name rest)
      if(name MATCHES "_NOT_BUILT$")
        continue()
      endif()
      string(STRIP "${rest}" rest)
      string(REGEX REPLACE " .*" "" command "${rest}")
      string(MD5 key "${name}")
      if(DEFINED where_${key})
        decode(shown "${name}")
        string(APPEND failures "  ${shown}: ${where_${key}} and ${command} (${file})\n")
      else()
        set(where_${key} "${command} (${file})")
        list(APPEND registered "${name}")
      endif()
    elseif(line MATCHES "^[ \t]*set_tests_properties\\(")
      first_argument("${line}" name rest)
      string(MD5 key "${name}")
      # The labels of this registration (the first that set them).
      if(NOT DEFINED labels_${key})
        if(rest MATCHES " LABELS +\"([^\"]*)\"")
          set(labels_${key} "${CMAKE_MATCH_1}")
        elseif(rest MATCHES " LABELS +([^ )]+)")
          set(labels_${key} "${CMAKE_MATCH_1}")
        endif()
      endif()
    endif()
  endforeach()
endwhile()
if(NOT failures STREQUAL "")
  message(FATAL_ERROR "test names registered twice (ctest keeps one test of each name: the later command, "
                      "with the labels of both; give one binary's tests a TEST_PREFIX):\n${failures}")
endif()

# 3. `-LE gpu` keeps every test not registered as gpu.
run_ctest(out -LE "^gpu$")
listed_names(cpu_names "${out}")
foreach(name IN LISTS cpu_names)
  string(MD5 key "${name}")
  set(listed_${key} TRUE)
endforeach()
set(dropped "")
set(n_cpu 0)
foreach(name IN LISTS registered)
  string(MD5 key "${name}")
  string(REPLACE "@SC@" ";" labels "${labels_${key}}")
  if("gpu" IN_LIST labels)
    continue()
  endif()
  math(EXPR n_cpu "${n_cpu} + 1")
  if(NOT listed_${key})
    decode(shown "${name}")
    string(APPEND dropped "  ${shown} (labels ${labels_${key}})\n")
  endif()
endforeach()
if(NOT dropped STREQUAL "")
  message(FATAL_ERROR "`ctest -LE gpu` drops tests that are not labelled gpu:\n${dropped}")
endif()
list(LENGTH registered n_all)
message(STATUS "${n_all} tests in ${BUILD_DIR}, each with a known label and a name of its own; "
               "`ctest -LE gpu` keeps all ${n_cpu} that are not gpu tests")
