// The disk space a chunk version takes in a store: the rule the store's space
// allocator follows (vfs/internal/store_core.h, "space: slots and pieces"),
// public so that tools reporting disk use count what the store allocates.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

namespace optstate::vfs {

// The smallest piece a short chunk takes: the O_DIRECT alignment.
inline constexpr uint64_t kMinPieceBytes = 4096;

// Bytes one version of a chunk of `length` logical bytes takes in a store
// whose slots are slot_bytes (the chunk size): a piece of the length rounded
// up to a power of two >= kMinPieceBytes when that divides the slot and is at
// most half of it, else the whole slot. A 10-float tensor's chunk (40 bytes)
// takes a 4 KiB piece.
inline constexpr uint64_t ChunkAllocatedBytes(uint64_t length, uint64_t slot_bytes) {
  const uint64_t piece = std::max(kMinPieceBytes, std::bit_ceil(length));
  return piece <= slot_bytes / 2 && slot_bytes % piece == 0 ? piece : slot_bytes;
}

}  // namespace optstate::vfs
