// Per-element Adam/AdamW math and dtype conversions shared by the CPU loop
// (adam_cpu.cc) and the CUDA kernel (adam_cuda.cu). Internal to kernels/.
//
// Both builds execute the same IEEE fp32 operations in the same order: the
// host file is compiled with -ffp-contract=off and the .cu with -fmad=false,
// division and sqrt are correctly rounded on both (nvcc's default
// -prec-div/-prec-sqrt), and all conversions round to nearest even, so CPU and
// GPU results are bit-identical for finite inputs. The operation order follows
// torch's fused Adam (aten/src/ATen/native/cuda/fused_adam_utils.cuh), which
// does the same steps with some products in double; results agree with it to
// a few fp32 ulps.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/adam.h"

#if defined(__CUDACC__)
#define OPTSTATE_HD __host__ __device__ __forceinline__
#else
#define OPTSTATE_HD inline
#endif

namespace optstate::kernels::internal {

// Per-call constants, computed once on the host (MakeAdamScalars).
struct AdamScalars {
  float lr_wd = 0.0f;            // lr * weight_decay (AdamW: p -= lr_wd * p)
  float weight_decay = 0.0f;     // Adam (L2): g += weight_decay * p
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float step_size = 1e-3f;       // lr / (1 - beta1^step)
  float bc2_sqrt = 1.0f;         // sqrt(1 - beta2^step)
  float eps = 1e-8f;
  float grad_scale = 1.0f;       // grads are divided by it when has_scale
  bool has_scale = false;
  bool l2 = false;               // Adam with weight decay
  bool decoupled = false;        // AdamW with weight decay
};

inline AdamScalars MakeAdamScalars(const AdamParams& p) {
  AdamScalars s;
  // Like torch.optim.AdamW: every derived constant in double from the
  // hyperparameters' doubles, rounded to fp32 once.
  const double lr = p.lr, wd = p.weight_decay, b1 = p.beta1, b2 = p.beta2;
  const double step = static_cast<double>(p.step);
  const double bc1 = 1.0 - std::pow(b1, step);
  const double bc2 = 1.0 - std::pow(b2, step);
  s.lr_wd = static_cast<float>(lr * wd);
  s.weight_decay = static_cast<float>(wd);
  s.beta1 = static_cast<float>(b1);
  s.one_minus_beta1 = static_cast<float>(1.0 - b1);
  s.beta2 = static_cast<float>(b2);
  s.one_minus_beta2 = static_cast<float>(1.0 - b2);
  s.step_size = static_cast<float>(lr / bc1);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.eps = static_cast<float>(p.eps);
  s.grad_scale = p.grad_scale;
  s.has_scale = p.grad_scale != 1.0f;
  s.l2 = p.mode == AdamMode::kAdam && wd != 0.0;
  s.decoupled = p.mode == AdamMode::kAdamW && wd != 0.0;
  return s;
}

// One element: g is the (converted) gradient; p, m, v are updated in place.
OPTSTATE_HD void AdamUpdate(float g, const AdamScalars& s, float& p, float& m, float& v) {
  if (s.has_scale) g = g / s.grad_scale;
  if (s.l2) g = g + s.weight_decay * p;
  if (s.decoupled) p = p - s.lr_wd * p;
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * g * g;
#if defined(__CUDA_ARCH__)
  const float denom = sqrtf(v) / s.bc2_sqrt + s.eps;  // IEEE sqrt (nvcc -prec-sqrt=true)
#else
  const float denom = std::sqrt(v) / s.bc2_sqrt + s.eps;
#endif
  p = p - (s.step_size * m) / denom;
}

OPTSTATE_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

OPTSTATE_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Round to nearest even; NaN becomes the canonical 0x7FFF (as CUDA's cvt does).
OPTSTATE_HD uint16_t FloatToBf16Bits(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(is_nan ? 0x7FFFu : rounded);
}

OPTSTATE_HD float Bf16BitsToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, with subnormals and overflow to inf (after F. Giesen,
// "float->half variants"); NaN becomes 0x7FFF (as CUDA's cvt.rn.f16.f32 does).
OPTSTATE_HD uint16_t FloatToHalfBits(float f) {
  uint32_t x = FloatBits(f);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint32_t o;
  if (x >= 0x47800000u) {  // >= 65536 (or inf/NaN): all of these round to inf
    o = x > 0x7F800000u ? 0x7FFFu : 0x7C00u;
  } else if (x < 0x38800000u) {  // below 2^-14: subnormal half or zero
    // Adding 0.5f aligns the half's subnormal mantissa with the float's LSBs
    // and lets the FPU do the rounding.
    o = FloatBits(BitsFloat(x) + 0.5f) - 0x3F000000u;
  } else {
    const uint32_t mant_odd = (x >> 13) & 1u;
    x += (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFu + mant_odd;
    o = x >> 13;
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

OPTSTATE_HD float HalfBitsToFloat(uint16_t h) {
  constexpr uint32_t kShiftedExp = 0x7C00u << 13;
  uint32_t o = (static_cast<uint32_t>(h) & 0x7FFFu) << 13;
  const uint32_t exp = kShiftedExp & o;
  o += static_cast<uint32_t>(127 - 15) << 23;
  float f;
  if (exp == kShiftedExp) {  // inf / NaN
    f = BitsFloat(o + (static_cast<uint32_t>(128 - 16) << 23));
  } else if (exp == 0) {  // zero / subnormal: renormalise through the FPU
    f = BitsFloat(o + (1u << 23)) - BitsFloat(113u << 23);
  } else {
    f = BitsFloat(o);
  }
  return BitsFloat(FloatBits(f) | ((static_cast<uint32_t>(h) & 0x8000u) << 16));
}

// Storage type of each operand DType, and load/store through it.
template <DType T> struct StorageOf;
template <> struct StorageOf<DType::kF32> { using type = float; };
template <> struct StorageOf<DType::kBF16> { using type = uint16_t; };
template <> struct StorageOf<DType::kF16> { using type = uint16_t; };

template <DType T>
OPTSTATE_HD float LoadAs(typename StorageOf<T>::type x) {
  if constexpr (T == DType::kF32) {
    return x;
  } else if constexpr (T == DType::kBF16) {
    return Bf16BitsToFloat(x);
  } else {
    return HalfBitsToFloat(x);
  }
}

template <DType T>
OPTSTATE_HD typename StorageOf<T>::type StoreAs(float f) {
  if constexpr (T == DType::kF32) {
    return f;
  } else if constexpr (T == DType::kBF16) {
    return FloatToBf16Bits(f);
  } else if constexpr (T == DType::kF16) {
    return FloatToHalfBits(f);
  } else {
    return 0;
  }
}

// The element DType of f32 or bf16 moments (q8 moments have kernels of their own).
inline DType MomentElement(MomentDType m) { return m == MomentDType::kBF16 ? DType::kBF16 : DType::kF32; }

}  // namespace optstate::kernels::internal
