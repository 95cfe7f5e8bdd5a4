// Helpers shared by the checkpoint format's files (names, manifest, parser,
// layout): the manifest's dtype spellings and small arithmetic.
#ifndef OPTSTATE_VFS_INTERNAL_CHECKPOINT_UTIL_H_
#define OPTSTATE_VFS_INTERNAL_CHECKPOINT_UTIL_H_

#include <cstdint>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "vfs/store.h"

namespace optstate::vfs::internal {

// Local dtype helpers so the format code does not depend on the store's
// definitions (same names as DTypeName/ParseDType).
inline const char* DtName(DType d) {
  switch (d) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kQ8S: return "q8s";
    case DType::kQ8U: return "q8u";
  }
  return "?";
}
inline const char* SafetensorsDtName(DType d) {
  switch (d) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kQ8S:
    case DType::kQ8U: return "U8";
  }
  return "?";
}
inline uint32_t DtSize(DType d) { return d == DType::kF32 ? 4 : IsQ8(d) ? 1 : 2; }
inline bool DtParse(std::string_view s, DType* out) {
  if (s == "f32") { *out = DType::kF32; return true; }
  if (s == "bf16") { *out = DType::kBF16; return true; }
  if (s == "f16") { *out = DType::kF16; return true; }
  if (s == "q8s") { *out = DType::kQ8S; return true; }
  if (s == "q8u") { *out = DType::kQ8U; return true; }
  return false;
}

inline std::string Hex16(uint64_t v) { return fmt::format("{:016x}", v); }

inline uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

}  // namespace optstate::vfs::internal

#endif  // OPTSTATE_VFS_INTERNAL_CHECKPOINT_UTIL_H_
