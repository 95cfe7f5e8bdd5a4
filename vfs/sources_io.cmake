list(APPEND OPTSTATE_VFS_SOURCES posix_file_system.cc io_buffer.cc io_engine.cc internal/uring_io_engine.cc internal/sync_io_engine.cc fault_injection.cc)
