// Helpers shared by the checkpoint format's files (names, manifest, parser,
// layout): small formatting and arithmetic. Dtype names are base/dtype.h's.
#ifndef OPTSTATE_VFS_INTERNAL_CHECKPOINT_UTIL_H_
#define OPTSTATE_VFS_INTERNAL_CHECKPOINT_UTIL_H_

#include <cstdint>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "vfs/store.h"

namespace optstate::vfs::internal {

inline std::string Hex16(uint64_t v) { return fmt::format("{:016x}", v); }

inline uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

}  // namespace optstate::vfs::internal

#endif  // OPTSTATE_VFS_INTERNAL_CHECKPOINT_UTIL_H_
