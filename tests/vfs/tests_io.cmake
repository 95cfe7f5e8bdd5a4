list(APPEND OPTSTATE_VFS_TEST_SOURCES file_system_test.cc io_engine_test.cc)
