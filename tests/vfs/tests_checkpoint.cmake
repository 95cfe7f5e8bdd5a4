# Checkpoint format + restore tests. Owned by the mount work.
list(APPEND OPTSTATE_VFS_TEST_SOURCES checkpoint_format_test.cc checkpoint_restore_test.cc)
