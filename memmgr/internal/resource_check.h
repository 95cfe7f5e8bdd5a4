// Start-up checks of process limits, so that a limit too low for streaming is
// a clear error when the manager is created, never a failure in the middle of
// a step: a too-low fd limit is a clear message at start.
#pragma once

#include <string>

#include "base/status.h"

namespace optstate::memmgr::internal {

// Descriptors a MemoryManager and its StreamedAdam may open after Create:
// io_uring rings (one per ChunkIo), the host backend's memfd, data files the
// store opens as it grows, RocksDB files rotated during commits, and slack.
inline constexpr int kDescriptorHeadroom = 32;

// kResourceExhausted naming RLIMIT_NOFILE, the descriptors in use and the
// limit when fewer than `needed` descriptors are left; OK otherwise.
Status CheckDescriptorHeadroom(const std::string& store_path, int needed);

}  // namespace optstate::memmgr::internal
