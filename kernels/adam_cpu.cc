// CPU implementation of the fused Adam/AdamW step (see kernels/adam.h).
//
// The per-element math lives in kernels/internal/adam_math.h and is shared,
// operation for operation, with the CUDA kernel; this file is compiled with
// -O3 -fno-math-errno -ffp-contract=off (kernels/CMakeLists.txt) so the loop
// vectorises (sqrt without errno) and rounds exactly like the GPU build, which
// is compiled with -fmad=false.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "kernels/adam.h"
#include "kernels/internal/adam_math.h"
#include "kernels/internal/adam_q8.h"

namespace optstate::kernels {
namespace {

using internal::AdamScalars;
using internal::AdamUpdate;
using internal::LoadAs;
using internal::StoreAs;

// Moments are decoded to fp32 (kMoment bf16: exact), updated in fp32 and
// rounded back to nearest even, in the same pass as the f32 case. kCopy:
// the pass also writes the parameter copy as kParam (ignored when false).
template <DType kMoment, DType kGrad, DType kParam, bool kCopy>
void RangeLoop(float* __restrict main, void* __restrict m_v, void* __restrict v_v,
               const void* __restrict grad_v, void* __restrict param_v, size_t begin,
               size_t end, const AdamScalars& s) {
  using MomentT = typename internal::StorageOf<kMoment>::type;
  using GradT = typename internal::StorageOf<kGrad>::type;
  using ParamT = typename internal::StorageOf<kParam>::type;
  MomentT* __restrict m = static_cast<MomentT*>(m_v);
  MomentT* __restrict v = static_cast<MomentT*>(v_v);
  const GradT* __restrict grad = static_cast<const GradT*>(grad_v);
  ParamT* __restrict param = static_cast<ParamT*>(param_v);
  const AdamScalars sc = s;  // local copy: lets the compiler keep it in registers
  for (size_t i = begin; i < end; ++i) {
    float p = main[i];
    float mi = LoadAs<kMoment>(m[i]);
    float vi = LoadAs<kMoment>(v[i]);
    AdamUpdate(LoadAs<kGrad>(grad[i]), sc, p, mi, vi);
    main[i] = p;
    m[i] = StoreAs<kMoment>(mi);
    v[i] = StoreAs<kMoment>(vi);
    if constexpr (kCopy) param[i] = StoreAs<kParam>(p);
  }
}

using RangeFn = void (*)(float*, void*, void*, const void*, void*, size_t, size_t,
                         const AdamScalars&);

template <DType kMoment, DType kGrad>
RangeFn PickParam(std::optional<DType> param) {
  if (!param) return &RangeLoop<kMoment, kGrad, DType::kF32, false>;
  switch (*param) {
    case DType::kF32: return &RangeLoop<kMoment, kGrad, DType::kF32, true>;
    case DType::kBF16: return &RangeLoop<kMoment, kGrad, DType::kBF16, true>;
    case DType::kF16: return &RangeLoop<kMoment, kGrad, DType::kF16, true>;
    case DType::kQ8S:
    case DType::kQ8U: return nullptr;
  }
  return nullptr;
}

template <DType kMoment>
RangeFn PickGrad(DType grad, std::optional<DType> param) {
  switch (grad) {
    case DType::kF32: return PickParam<kMoment, DType::kF32>(param);
    case DType::kBF16: return PickParam<kMoment, DType::kBF16>(param);
    case DType::kF16: return PickParam<kMoment, DType::kF16>(param);
    default: return nullptr;
  }
}

// Moments: f32 or bf16 (f16's range is too narrow for exp_avg_sq).
RangeFn Pick(MomentDType moment, DType grad, std::optional<DType> param) {
  switch (moment) {
    case MomentDType::kF32: return PickGrad<DType::kF32>(grad, param);
    case MomentDType::kBF16: return PickGrad<DType::kBF16>(grad, param);
    case MomentDType::kQ8: return nullptr;
  }
  return nullptr;
}

// q8 moments, blocks [block_begin, block_end) of a range of count elements.
template <DType kGrad, DType kParam, bool kCopy>
void Q8BlockLoop(const AdamQ8Tensors& t, size_t count, size_t block_begin, size_t block_end,
                 const AdamScalars& s, const internal::Q8Maps& maps) {
  using GradT = typename internal::StorageOf<kGrad>::type;
  using ParamT = typename internal::StorageOf<kParam>::type;
  const GradT* grad = static_cast<const GradT*>(t.grad);
  ParamT* param = static_cast<ParamT*>(t.param);
  float m[kQ8BlockElems], v[kQ8BlockElems];
  for (size_t b = block_begin; b < block_end; ++b) {
    const size_t first = b * kQ8BlockElems;
    const size_t n = std::min(kQ8BlockElems, count - first);
    const float am = t.exp_avg_absmax[b], av = t.exp_avg_sq_absmax[b];
    float new_am = 0.0f, new_av = 0.0f;
    for (size_t k = 0; k < n; ++k) {
      const size_t i = first + k;
      float p = t.main[i];
      m[k] = internal::Q8Decode(maps.signed_map, t.exp_avg[i], am);
      v[k] = internal::Q8Decode(maps.unsigned_map, t.exp_avg_sq[i], av);
      AdamUpdate(LoadAs<kGrad>(grad[i]), s, p, m[k], v[k]);
      t.main[i] = p;
      if constexpr (kCopy) param[i] = StoreAs<kParam>(p);
      new_am = std::max(new_am, std::fabs(m[k]));
      new_av = std::max(new_av, std::fabs(v[k]));
    }
    for (size_t k = 0; k < n; ++k) {
      t.exp_avg[first + k] = internal::Q8Encode(maps.signed_map, internal::Q8Normalize(m[k], new_am));
      t.exp_avg_sq[first + k] = internal::Q8Encode(maps.unsigned_map, internal::Q8Normalize(v[k], new_av));
    }
    t.exp_avg_absmax[b] = new_am;
    t.exp_avg_sq_absmax[b] = new_av;
  }
}

using Q8Fn = void (*)(const AdamQ8Tensors&, size_t, size_t, size_t, const AdamScalars&, const internal::Q8Maps&);

template <DType kGrad>
Q8Fn PickQ8Param(std::optional<DType> param) {
  if (!param) return &Q8BlockLoop<kGrad, DType::kF32, false>;
  switch (*param) {
    case DType::kF32: return &Q8BlockLoop<kGrad, DType::kF32, true>;
    case DType::kBF16: return &Q8BlockLoop<kGrad, DType::kBF16, true>;
    case DType::kF16: return &Q8BlockLoop<kGrad, DType::kF16, true>;
    case DType::kQ8S:
    case DType::kQ8U: return nullptr;
  }
  return nullptr;
}

Q8Fn PickQ8(DType grad, std::optional<DType> param) {
  switch (grad) {
    case DType::kF32: return PickQ8Param<DType::kF32>(param);
    case DType::kBF16: return PickQ8Param<DType::kBF16>(param);
    case DType::kF16: return PickQ8Param<DType::kF16>(param);
    default: return nullptr;
  }
}

}  // namespace

bool AdamStepCpuQ8(const AdamQ8Tensors& t, size_t count, const AdamParams& p, int threads) {
  if (p.maximize || p.step == 0) return false;
  if (t.param_type && t.param == nullptr) return false;
  Q8Fn fn = PickQ8(t.grad_type, t.param_type);
  if (fn == nullptr) return false;
  if (count == 0) return true;
  if (t.main == nullptr || t.exp_avg == nullptr || t.exp_avg_sq == nullptr || t.exp_avg_absmax == nullptr ||
      t.exp_avg_sq_absmax == nullptr || t.grad == nullptr) {
    return false;
  }
  if (t.found_inf != nullptr && *t.found_inf != 0.0f) return true;
  const AdamScalars s = internal::MakeAdamScalars(p);
  const internal::Q8Maps& maps = internal::GetQ8Maps();
  const size_t blocks = Q8Blocks(count);
  constexpr size_t kMinBlocksPerThread = 256;
  size_t n_threads = threads < 1 ? 1 : static_cast<size_t>(threads);
  n_threads = std::min(n_threads, std::max<size_t>(1, blocks / kMinBlocksPerThread));
  if (n_threads <= 1) {
    fn(t, count, 0, blocks, s, maps);
    return true;
  }
  const size_t per = (blocks + n_threads - 1) / n_threads;
  std::vector<std::thread> workers;
  for (size_t k = 0; k < n_threads; ++k) {
    const size_t b = std::min(blocks, k * per), e = std::min(blocks, b + per);
    if (b >= e) break;
    workers.emplace_back([=, &t, &s, &maps] { fn(t, count, b, e, s, maps); });
  }
  for (auto& w : workers) w.join();
  return true;
}

float Q8MapValue(bool is_signed, uint8_t c) {
  const internal::Q8Maps& maps = internal::GetQ8Maps();
  return is_signed ? maps.signed_map[c] : maps.unsigned_map[c];
}

void Q8Quantize(bool is_signed, const float* x, size_t count, uint8_t* codes, float* absmax) {
  const internal::Q8Maps& maps = internal::GetQ8Maps();
  const float* map = is_signed ? maps.signed_map : maps.unsigned_map;
  for (size_t first = 0, b = 0; first < count; first += kQ8BlockElems, ++b) {
    const size_t n = std::min(kQ8BlockElems, count - first);
    float a = 0.0f;
    for (size_t k = 0; k < n; ++k) a = std::max(a, std::fabs(x[first + k]));
    for (size_t k = 0; k < n; ++k) codes[first + k] = internal::Q8Encode(map, internal::Q8Normalize(x[first + k], a));
    absmax[b] = a;
  }
}

void Q8Dequantize(bool is_signed, const uint8_t* codes, const float* absmax, size_t count, float* out) {
  const internal::Q8Maps& maps = internal::GetQ8Maps();
  const float* map = is_signed ? maps.signed_map : maps.unsigned_map;
  for (size_t i = 0; i < count; ++i) out[i] = internal::Q8Decode(map, codes[i], absmax[i / kQ8BlockElems]);
}

bool AdamStepCpu(const AdamTensors& t, size_t count, const AdamParams& p, int threads) {
  if (p.maximize || p.step == 0) return false;
  if (t.param_type && t.param == nullptr) return false;
  RangeFn fn = Pick(t.moment_type, t.grad_type, t.param_type);
  if (fn == nullptr) return false;
  if (count == 0) return true;
  if (t.main == nullptr || t.exp_avg == nullptr || t.exp_avg_sq == nullptr || t.grad == nullptr) {
    return false;
  }
  if (t.found_inf != nullptr && *t.found_inf != 0.0f) return true;  // skipped, as torch does

  const AdamScalars s = internal::MakeAdamScalars(p);
  void* m = t.exp_avg;
  void* v = t.exp_avg_sq;
  // Below ~64K elements per thread, starting threads costs more than it saves.
  constexpr size_t kMinPerThread = size_t{1} << 16;
  size_t n_threads = threads < 1 ? 1 : static_cast<size_t>(threads);
  n_threads = std::min(n_threads, std::max<size_t>(1, count / kMinPerThread));
  if (n_threads <= 1) {
    fn(t.main, m, v, t.grad, t.param, 0, count, s);
    return true;
  }
  // Split on 64-element boundaries so no two threads share a cache line.
  const size_t per = ((count + n_threads - 1) / n_threads + 63) / 64 * 64;
  std::vector<std::thread> workers;
  workers.reserve(n_threads);
  for (size_t k = 0; k < n_threads; ++k) {
    const size_t b = std::min(count, k * per);
    const size_t e = std::min(count, b + per);
    if (b >= e) break;
    workers.emplace_back([=, &t, &s] { fn(t.main, m, v, t.grad, t.param, b, e, s); });
  }
  for (auto& w : workers) w.join();
  return true;
}

uint16_t FloatToBf16(float f) { return internal::FloatToBf16Bits(f); }
float Bf16ToFloat(uint16_t h) { return internal::Bf16BitsToFloat(h); }
uint16_t FloatToHalf(float f) { return internal::FloatToHalfBits(f); }
float HalfToFloat(uint16_t h) { return internal::HalfBitsToFloat(h); }

float ElementAsFloat(DType d, const void* data, uint64_t i) {
  // memcpy: a field buffer of bytes need not be aligned for its dtype.
  const char* at = static_cast<const char*>(data) + i * DTypeSize(d);
  switch (d) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, at, sizeof f);
      return f;
    }
    case DType::kBF16:
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, at, sizeof h);
      return d == DType::kBF16 ? internal::Bf16BitsToFloat(h) : internal::HalfBitsToFloat(h);
    }
    case DType::kQ8S:
    case DType::kQ8U: break;
  }
  return std::numeric_limits<float>::quiet_NaN();
}

}  // namespace optstate::kernels
