# Resharding tests (box geometry, layout JSON, round trips, crash).
list(APPEND OPTSTATE_VFS_TEST_SOURCES reshard_test.cc)
