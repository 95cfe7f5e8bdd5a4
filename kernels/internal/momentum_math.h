// Per-element math of Lion, SGD with momentum and Muon's elementwise parts
// (its momentum and its final apply), shared by the CPU loops and the CUDA
// kernels. Internal to kernels/.
//
// As kernels/internal/adam_math.h: both builds execute the same IEEE fp32
// operations in the same order (host files -ffp-contract=off, .cu files
// -fmad=false), so CPU and GPU results are bit-identical.
#pragma once

#include <cstdint>

#include "kernels/internal/adam_math.h"
#include "kernels/momentum.h"
#include "kernels/muon.h"

namespace optstate::kernels::internal {

// sign(c) with sign(+-0) = c (so p - lr * sign stays p) and NaN propagated,
// as torch.sign.
OPTSTATE_HD float SignOf(float c) { return c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c); }

struct LionScalars {
  float decay = 1.0f;  // 1 - lr * weight_decay
  float lr = 1e-4f;
  float beta1 = 0.9f, one_minus_beta1 = 0.1f;
  float beta2 = 0.99f, one_minus_beta2 = 0.01f;
  float grad_scale = 1.0f;
  bool has_scale = false;
  bool has_decay = false;

  OPTSTATE_HD void operator()(float g, float& p, float& m) const {
    if (has_scale) g = g / grad_scale;
    if (has_decay) p = p * decay;
    const float c = beta1 * m + one_minus_beta1 * g;
    p = p - lr * SignOf(c);
    m = beta2 * m + one_minus_beta2 * g;
  }
};

inline LionScalars MakeLionScalars(const LionParams& p) {
  LionScalars s;
  s.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  s.has_decay = p.weight_decay != 0.0;
  s.lr = static_cast<float>(p.lr);
  s.beta1 = static_cast<float>(p.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - p.beta1);
  s.beta2 = static_cast<float>(p.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  s.grad_scale = p.grad_scale;
  s.has_scale = p.grad_scale != 1.0f;
  return s;
}

struct SgdScalars {
  float lr = 1e-3f;
  float weight_decay = 0.0f;
  float momentum = 0.0f;
  float one_minus_dampening = 1.0f;
  float grad_scale = 1.0f;
  bool has_scale = false;
  bool has_wd = false;
  bool has_momentum = false;
  bool first = true;  // the buffer starts as the gradient
  bool nesterov = false;
  bool maximize = false;

  // m is the momentum buffer (untouched without momentum).
  OPTSTATE_HD void operator()(float g, float& p, float& m) const {
    if (has_scale) g = g / grad_scale;
    if (maximize) g = -g;
    if (has_wd) g = g + weight_decay * p;
    if (has_momentum) {
      m = first ? g : momentum * m + one_minus_dampening * g;
      g = nesterov ? g + momentum * m : m;
    }
    p = p - lr * g;
  }
};

inline SgdScalars MakeSgdScalars(const SgdParams& p) {
  SgdScalars s;
  s.lr = static_cast<float>(p.lr);
  s.weight_decay = static_cast<float>(p.weight_decay);
  s.has_wd = p.weight_decay != 0.0;
  s.momentum = static_cast<float>(p.momentum);
  s.has_momentum = p.momentum != 0.0;
  s.one_minus_dampening = static_cast<float>(1.0 - p.dampening);
  s.first = p.step == 1;
  s.nesterov = p.nesterov;
  s.maximize = p.maximize;
  s.grad_scale = p.grad_scale;
  s.has_scale = p.grad_scale != 1.0f;
  return s;
}

inline bool SgdParamsValid(const SgdParams& p) {
  return p.step >= 1 && (!p.nesterov || (p.momentum > 0.0 && p.dampening == 0.0));
}

// Muon's momentum (Keller Jordan's form, an EMA):
//   m = beta*m + (1-beta)*g;  u = (1-beta)*g + beta*m (Nesterov) or m.
// u is the matrix Newton-Schulz orthogonalises.
struct MuonMomentumScalars {
  float beta = 0.95f, one_minus_beta = 0.05f;
  float grad_scale = 1.0f;
  bool has_scale = false;
  bool nesterov = true;

  OPTSTATE_HD float operator()(float g, float& m) const {
    if (has_scale) g = g / grad_scale;
    m = beta * m + one_minus_beta * g;
    return nesterov ? one_minus_beta * g + beta * m : m;
  }
};

// Muon's apply: p = p*(1 - lr*wd) - (lr * shape scale) * o, o the
// orthogonalised update.
struct MuonApplyScalars {
  float decay = 1.0f;
  float step = 0.02f;  // lr * shape scale
  bool has_decay = false;

  OPTSTATE_HD float operator()(float p, float o) const {
    if (has_decay) p = p * decay;
    return p - step * o;
  }
};

inline MuonMomentumScalars MakeMuonMomentumScalars(const MuonParams& p) {
  MuonMomentumScalars s;
  s.beta = static_cast<float>(p.momentum);
  s.one_minus_beta = static_cast<float>(1.0 - p.momentum);
  s.nesterov = p.nesterov;
  s.grad_scale = p.grad_scale;
  s.has_scale = p.grad_scale != 1.0f;
  return s;
}

inline MuonApplyScalars MakeMuonApplyScalars(const MuonParams& p, size_t rows, size_t cols) {
  MuonApplyScalars s;
  s.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  s.has_decay = p.weight_decay != 0.0;
  s.step = static_cast<float>(p.lr * MuonShapeScale(p.scale, rows, cols));
  return s;
}

// Newton-Schulz quintic coefficients, rounded to fp32 once.
struct NsCoefficients {
  float a = static_cast<float>(kMuonNsA);
  float b = static_cast<float>(kMuonNsB);
  float c = static_cast<float>(kMuonNsC);
};

inline NsCoefficients MakeNsCoefficients(const MuonParams& p) {
  NsCoefficients k;
  k.a = static_cast<float>(p.ns_a);
  k.b = static_cast<float>(p.ns_b);
  k.c = static_cast<float>(p.ns_c);
  return k;
}

// The fp32 divisor of Newton-Schulz's first iterate from the sum of squares.
OPTSTATE_HD float MuonNormDivisor(double sum_squares, double eps, bool clamp) {
  const double norm = sqrt(sum_squares);
  return static_cast<float>(clamp ? (norm > eps ? norm : eps) : norm + eps);
}

}  // namespace optstate::kernels::internal
