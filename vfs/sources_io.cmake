list(APPEND OPTSTATE_VFS_SOURCES posix_file_system.cc)
