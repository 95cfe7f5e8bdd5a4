// Helpers shared by kernels_test and kernels_gpu_test: random data, an
// independent decoder of the 16-bit formats, and the fp64 reference step.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kernels/adam.h"

namespace optstate::kernels::testing {

inline std::string TypeName(std::optional<DType> t) {
  if (!t) return "none";
  switch (*t) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kQ8S: return "q8s";
    case DType::kQ8U: return "q8u";
  }
  return "?";
}
inline std::string TypeName(MomentDType t) {
  return t == MomentDType::kF32 ? "f32" : t == MomentDType::kBF16 ? "bf16" : "q8";
}

inline size_t TypeSize(std::optional<DType> t) {
  return !t ? 0 : *t == DType::kF32 ? 4 : (*t == DType::kQ8S || *t == DType::kQ8U) ? 1 : 2;
}

// Decoders written independently of kernels/internal (ldexp, no bit tricks).
inline double DecodeBf16(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 7) & 0xFF, mant = h & 0x7F;
  double v = exp == 0 ? std::ldexp(mant, -133)
             : exp == 0xFF ? (mant ? NAN : INFINITY)
                           : std::ldexp(128 + mant, exp - 134);
  return sign ? -v : v;
}
inline double DecodeHalf(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  double v = exp == 0 ? std::ldexp(mant, -24)
             : exp == 0x1F ? (mant ? NAN : INFINITY)
                           : std::ldexp(1024 + mant, exp - 25);
  return sign ? -v : v;
}

// Element i of a buffer of type t, as a double.
inline double Decode(const void* data, DType t, size_t i) {
  if (t == DType::kF32) return static_cast<const float*>(data)[i];
  const uint16_t h = static_cast<const uint16_t*>(data)[i];
  return t == DType::kBF16 ? DecodeBf16(h) : DecodeHalf(h);
}

inline void Encode(void* data, DType t, size_t i, float f) {
  if (t == DType::kF32) {
    static_cast<float*>(data)[i] = f;
  } else if (t == DType::kBF16) {
    static_cast<uint16_t*>(data)[i] = FloatToBf16(f);
  } else if (t == DType::kF16) {
    static_cast<uint16_t*>(data)[i] = FloatToHalf(f);
  }
}

// Rounds a double to the nearest bf16 value, ties to even (frexp/nearbyint,
// independent of the kernels' bit tricks); the result as a double. Normal
// range only (|x| >= 2^-126 or 0), which is all the tests produce.
inline double RoundToBf16(double x) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  int e = 0;
  const double f = std::frexp(x, &e);           // x = f * 2^e, 0.5 <= |f| < 1
  return std::ldexp(std::nearbyint(std::ldexp(f, 8)), e - 8);  // 8 significant bits
}

// Deterministic counter-based random numbers (splitmix64), parallel-friendly.
inline uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// Uniform in [-1, 1).
inline float Uniform(uint64_t seed, size_t i) {
  return static_cast<float>(static_cast<double>(Mix(seed * 0x100000001B3ull + i) >> 11) * 0x1p-52 - 1.0);
}
// Gradient-like values: sign * magnitude spread over 10^-4 .. 1, some exact zeros.
inline float GradValue(uint64_t seed, size_t i) {
  const uint64_t r = Mix(seed * 0x100000001B3ull + i + 0x5555);
  if (r % 64 == 0) return 0.0f;
  const float u = Uniform(seed, i);
  const double mag = std::pow(10.0, -4.0 * static_cast<double>((r >> 20) & 0xFFFF) / 65535.0);
  return static_cast<float>(u * mag);
}

// Runs fn(begin, end) over [0, n) on all hardware threads.
template <typename Fn>
void ParallelFor(size_t n, Fn fn) {
  const size_t k = std::max(1u, std::thread::hardware_concurrency());
  if (n < (size_t{1} << 16) || k == 1) {
    fn(size_t{0}, n);
    return;
  }
  std::vector<std::thread> ts;
  const size_t per = (n + k - 1) / k;
  for (size_t j = 0; j < k; ++j) {
    const size_t b = std::min(n, j * per), e = std::min(n, b + per);
    ts.emplace_back([=] { fn(b, e); });
  }
  for (auto& t : ts) t.join();
}

// The fp64 reference: a plain loop, written from the torch.optim.AdamW /
// torch.optim.Adam documentation, not from kernels/internal.
struct RefState {
  std::vector<double> main, m, v;
};
inline void RefStep(RefState& st, const std::vector<double>& grad, const AdamParams& p) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(p.beta1), static_cast<double>(p.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(p.beta2), static_cast<double>(p.step));
  for (size_t i = 0; i < st.main.size(); ++i) {
    double g = grad[i] / static_cast<double>(p.grad_scale);
    double w = st.main[i];
    if (p.mode == AdamMode::kAdamW) {
      w *= 1.0 - static_cast<double>(p.lr) * p.weight_decay;
    } else {
      g += static_cast<double>(p.weight_decay) * w;
    }
    st.m[i] = p.beta1 * st.m[i] + (1.0 - p.beta1) * g;
    st.v[i] = p.beta2 * st.v[i] + (1.0 - p.beta2) * g * g;
    const double m_hat = st.m[i] / bc1;
    const double v_hat = st.v[i] / bc2;
    st.main[i] = w - static_cast<double>(p.lr) * m_hat / (std::sqrt(v_hat) + p.eps);
  }
}

}  // namespace optstate::kernels::testing
