# Store tests: part of vfs_test (label unit), plus the crash-loop child process
# and a slow binary with the long crash loop (label slow).
list(APPEND OPTSTATE_VFS_TEST_SOURCES store_basic_test.cc store_crash_test.cc store_fault_test.cc
     store_enospc_test.cc store_alloc_test.cc store_copy_test.cc)

# The child the crash tests fork+exec; found next to the test binary.
add_executable(store_crash_child crash_child.cc)
target_link_libraries(store_crash_child PRIVATE optstate_vfs optstate_test_util)

# >= 1000 kills; `ctest -L slow`. Prefixed: vfs_test has the 100-kill test of the same name
# (a second add_test of one name would take the unit label and timeout).
add_executable(store_slow_test store_crash_test.cc)
target_compile_definitions(store_slow_test PRIVATE OPTSTATE_CRASH_KILLS_DEFAULT=1000)
target_link_libraries(store_slow_test PRIVATE optstate_vfs optstate_test_util GTest::gtest GTest::gtest_main)
add_dependencies(store_slow_test store_crash_child)
gtest_discover_tests(store_slow_test TEST_PREFIX "slow." TEST_FILTER "StoreCrashTest.KillLoop*"
                     PROPERTIES LABELS slow TIMEOUT 3600 DISCOVERY_TIMEOUT 60)

# vfs_test is defined after this file is included: attach the child and the
# shared test helpers (tests/common/test_util.h) then.
cmake_language(DEFER CALL add_dependencies vfs_test store_crash_child)
cmake_language(DEFER CALL target_link_libraries vfs_test PRIVATE optstate_test_util)
