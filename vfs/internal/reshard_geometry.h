// Helpers of reshard's shard geometry shared by the reshard_*.cc files.
// Internal to vfs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace optstate::vfs::internal {

// "[a, b, c]": a shape or an offset, for messages.
std::string Dims(const std::vector<uint64_t>& v);

// The number of elements of `shape` (exact: the product can pass 2^64).
unsigned __int128 Volume(const std::vector<uint64_t>& shape);

}  // namespace optstate::vfs::internal
