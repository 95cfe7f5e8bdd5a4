// The element dtypes of optstate, one table for every folder, and the moment
// encodings of the optimizer.
//
// DType is what one element of a stored field or a kernel operand is. Its
// integer values are stored on disk (index records, manifests keep names):
// never renumber a row. MomentDType is how the optimizer keeps its two Adam
// moments: f32, bf16, or q8 (exp_avg as q8s codes, exp_avg_sq as q8u codes,
// each with a field of f32 absmax scales), so one MomentDType spans several
// fields of different DTypes.
// Thread-safety: pure functions over constant tables.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "base/status.h"

namespace optstate {

// f32/bf16/f16: IEEE-style floats. q8s/q8u: 8-bit codes of a block-scaled
// field (one byte per element; element i decodes to map[code] x the fp32
// absmax of its block): q8s uses the signed dynamic map (exp_avg), q8u the
// unsigned one (exp_avg_sq); docs/MOMENTS.md.
enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2, kQ8S = 3, kQ8U = 4 };

// "f32", "bf16", "f16", "q8s", "q8u"; "?" for a value outside the table.
const char* DTypeName(DType d);
// The safetensors header's spelling: "F32", "BF16", "F16", and "U8" for both q8s and q8u.
const char* SafetensorsDTypeName(DType d);
// Bytes per element: 4, 2, 2, 1, 1.
uint32_t DTypeSize(DType d);
inline bool IsQ8(DType d) { return d == DType::kQ8S || d == DType::kQ8U; }
// f32, bf16 or f16: what a gradient, a model parameter or initial weights may be.
inline bool IsFloat(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

// A name of the table, or a torch-style alias of a float ("float32",
// "bfloat16", "float16"). The error names what was given and what is accepted.
Result<DType> ParseDType(std::string_view s);
// Only the table's own names (what the checkpoint manifest stores); nullopt otherwise.
std::optional<DType> ParseDTypeName(std::string_view s);

// Elements per block of a q8 field: each block of this many consecutive
// elements has one fp32 absmax scale.
inline constexpr uint64_t kQ8BlockElems = 256;
// Blocks (scales) of n elements of a q8 field: ceil(n / kQ8BlockElems).
constexpr uint64_t Q8Blocks(uint64_t n) { return (n + kQ8BlockElems - 1) / kQ8BlockElems; }

enum class MomentDType : uint8_t { kF32 = 0, kBF16 = 1, kQ8 = 2 };

// "f32", "bf16", "q8".
const char* MomentDTypeName(MomentDType m);
// "f32", "bf16" or "q8"; otherwise kInvalidArgument "moment dtype '<s>' is
// not supported (f32, bf16, q8)", which a caller prefixes with what it parsed.
Result<MomentDType> ParseMomentDType(std::string_view s);
// The DType of moment field `field` ("exp_avg" or "exp_avg_sq") in a store
// with moments `m`: f32 or bf16 for both, and for q8 kQ8S codes for exp_avg,
// kQ8U codes for exp_avg_sq.
DType MomentFieldDType(MomentDType m, std::string_view field);

}  // namespace optstate
