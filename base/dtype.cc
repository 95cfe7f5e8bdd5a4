#include "base/dtype.h"

#include <string>

namespace optstate {
namespace {

struct DTypeRow {
  DType dtype;
  const char* name;
  const char* alias;  // torch's spelling, nullptr where it has none
  const char* safetensors;
  uint32_t size_bytes;
};

constexpr DTypeRow kDTypes[] = {
    {DType::kF32, "f32", "float32", "F32", 4},  {DType::kBF16, "bf16", "bfloat16", "BF16", 2},
    {DType::kF16, "f16", "float16", "F16", 2},  {DType::kQ8S, "q8s", nullptr, "U8", 1},
    {DType::kQ8U, "q8u", nullptr, "U8", 1},
};

const DTypeRow* Row(DType d) {
  for (const DTypeRow& r : kDTypes) {
    if (r.dtype == d) return &r;
  }
  return nullptr;
}

struct MomentRow {
  MomentDType moment;
  const char* name;
  DType exp_avg;
  DType exp_avg_sq;
};

constexpr MomentRow kMoments[] = {
    {MomentDType::kF32, "f32", DType::kF32, DType::kF32},
    {MomentDType::kBF16, "bf16", DType::kBF16, DType::kBF16},
    {MomentDType::kQ8, "q8", DType::kQ8S, DType::kQ8U},
};

}  // namespace

const char* DTypeName(DType d) {
  const DTypeRow* r = Row(d);
  return r != nullptr ? r->name : "?";
}

const char* SafetensorsDTypeName(DType d) {
  const DTypeRow* r = Row(d);
  return r != nullptr ? r->safetensors : "?";
}

uint32_t DTypeSize(DType d) {
  const DTypeRow* r = Row(d);
  return r != nullptr ? r->size_bytes : 4;
}

std::optional<DType> ParseDTypeName(std::string_view s) {
  for (const DTypeRow& r : kDTypes) {
    if (s == r.name) return r.dtype;
  }
  return std::nullopt;
}

Result<DType> ParseDType(std::string_view s) {
  for (const DTypeRow& r : kDTypes) {
    if (s == r.name || (r.alias != nullptr && s == r.alias)) return r.dtype;
  }
  return InvalidArgument("unknown dtype '" + std::string(s) + "' (expected f32, bf16, f16, q8s or q8u)");
}

const char* MomentDTypeName(MomentDType m) {
  for (const MomentRow& r : kMoments) {
    if (r.moment == m) return r.name;
  }
  return "?";
}

Result<MomentDType> ParseMomentDType(std::string_view s) {
  for (const MomentRow& r : kMoments) {
    if (s == r.name) return r.moment;
  }
  return InvalidArgument("moment dtype '" + std::string(s) + "' is not supported (f32, bf16, q8)");
}

DType MomentFieldDType(MomentDType m, std::string_view field) {
  for (const MomentRow& r : kMoments) {
    if (r.moment == m) return field == "exp_avg_sq" ? r.exp_avg_sq : r.exp_avg;
  }
  return DType::kF32;
}

}  // namespace optstate
