// Internal seams of the POSIX file system (vfs/posix_file_system.cc) for tests.
//
// Thread-safety: the functions are safe to call from any thread; they change
// process-wide state, so tests that use them must restore the old value.
#pragma once

#include <cstdint>

namespace optstate::vfs::internal {

// Makes every O_DIRECT open behave as if the filesystem refused O_DIRECT with
// EINVAL (old tmpfs, some FUSE filesystems), so the buffered fallback and its
// one warning can be tested on a machine whose filesystems all accept it.
void SetDirectRefusedForTesting(bool refused);

// How many times the "O_DIRECT refused, falling back to buffered I/O" warning
// was logged in this process (0 or 1: it is logged once per process).
uint64_t DirectFallbackWarningCount();

// How many opens fell back from O_DIRECT to buffered I/O in this process.
uint64_t DirectFallbackCount();

}  // namespace optstate::vfs::internal
