// CPU reference implementation of Muon (see kernels/muon.h). Compiled with
// -ffp-contract=off like adam_cpu.cc, so its elementwise steps round exactly
// like the CUDA kernels'.
#include <algorithm>
#include <cmath>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/internal/adam_math.h"
#include "kernels/internal/momentum_math.h"
#include "kernels/internal/muon_layout.h"
#include "kernels/muon.h"

namespace optstate::kernels {
namespace {

using internal::LoadAs;
using internal::MuonLayout;
using internal::StoreAs;

// fn(begin, end) over [0, n) on up to `threads` threads; each output row is
// computed by one thread in a fixed order, so results do not depend on it.
template <typename Fn>
void ParallelRows(size_t n, int threads, size_t work_per_row, Fn fn) {
  // Below ~1M multiply-adds per thread a thread costs more than it saves.
  size_t k = threads < 1 ? 1 : static_cast<size_t>(threads);
  k = std::min(k, std::max<size_t>(1, n * work_per_row / (size_t{1} << 20)));
  if (k <= 1) {
    fn(size_t{0}, n);
    return;
  }
  const size_t per = (n + k - 1) / k;
  std::vector<std::thread> ts;
  for (size_t j = 0; j < k; ++j) {
    const size_t b = std::min(n, j * per), e = std::min(n, b + per);
    if (b >= e) break;
    ts.emplace_back([=, &fn] { fn(b, e); });
  }
  for (auto& t : ts) t.join();
}

// Newton-Schulz on x (s x l row-major, s <= l), in place; y, a, bm are
// scratch of s*l, s*s and s*s floats.
void NewtonSchulzCore(float* x, float* y, float* a, float* bm, size_t s, size_t l, int steps, double eps,
                      bool clamp_eps, const internal::NsCoefficients& k, int threads) {
  double ss = 0.0;
  for (size_t i = 0; i < s * l; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float denom = internal::MuonNormDivisor(ss, eps, clamp_eps);
  for (size_t i = 0; i < s * l; ++i) x[i] = x[i] / denom;
  for (int it = 0; it < steps; ++it) {
    // A = X X^T (symmetric: each pair computed once).
    ParallelRows(s, threads, s * l / 2, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        for (size_t j = i; j < s; ++j) {
          double acc = 0.0;
          const float* xi = x + i * l;
          const float* xj = x + j * l;
          for (size_t q = 0; q < l; ++q) acc += static_cast<double>(xi[q]) * xj[q];
          a[i * s + j] = static_cast<float>(acc);
        }
      }
    });
    for (size_t i = 0; i < s; ++i) {
      for (size_t j = 0; j < i; ++j) a[i * s + j] = a[j * s + i];
    }
    // B = b*A + c*A A (A A = A A^T, A symmetric; B symmetric likewise).
    ParallelRows(s, threads, s * s / 2, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        for (size_t j = i; j < s; ++j) {
          double acc = 0.0;
          const float* ai = a + i * s;
          const float* aj = a + j * s;
          for (size_t q = 0; q < s; ++q) acc += static_cast<double>(ai[q]) * aj[q];
          bm[i * s + j] = static_cast<float>(static_cast<double>(k.b) * a[i * s + j] + static_cast<double>(k.c) * acc);
        }
      }
    });
    for (size_t i = 0; i < s; ++i) {
      for (size_t j = 0; j < i; ++j) bm[i * s + j] = bm[j * s + i];
    }
    // Y = a*X + B X, one row of Y per task, accumulated in fp64.
    ParallelRows(s, threads, s * l, [&](size_t b, size_t e) {
      std::vector<double> acc(l);
      for (size_t i = b; i < e; ++i) {
        const float* xi = x + i * l;
        for (size_t q = 0; q < l; ++q) acc[q] = static_cast<double>(k.a) * xi[q];
        for (size_t r = 0; r < s; ++r) {
          const double w = bm[i * s + r];
          const float* xr = x + r * l;
          for (size_t q = 0; q < l; ++q) acc[q] += w * xr[q];
        }
        float* yi = y + i * l;
        for (size_t q = 0; q < l; ++q) yi[q] = static_cast<float>(acc[q]);
      }
    });
    std::swap(x, y);
  }
  // An odd number of swaps left the result in the caller's y buffer.
  if (steps % 2 == 1) std::copy(x, x + s * l, y);
}

template <DType kMoment, DType kGrad>
void Momentum(const MuonTensors& t, size_t rows, size_t cols, bool transposed, const MuonParams& p,
              float* x) {
  using MomentT = typename internal::StorageOf<kMoment>::type;
  using GradT = typename internal::StorageOf<kGrad>::type;
  MomentT* m = static_cast<MomentT*>(t.momentum);
  const GradT* g = static_cast<const GradT*>(t.grad);
  const internal::MuonMomentumScalars s = internal::MakeMuonMomentumScalars(p);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < cols; ++c) {
      const size_t i = r * cols + c;
      float mi = LoadAs<kMoment>(m[i]);
      const float u = s(LoadAs<kGrad>(g[i]), mi);
      m[i] = StoreAs<kMoment>(mi);
      x[transposed ? c * rows + r : i] = u;
    }
  }
}

template <DType kParam, bool kCopy>
void Apply(const MuonTensors& t, size_t rows, size_t cols, bool transposed, const internal::MuonApplyScalars& s,
           const float* x) {
  using ParamT = typename internal::StorageOf<kParam>::type;
  ParamT* param = static_cast<ParamT*>(t.param);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < cols; ++c) {
      const size_t i = r * cols + c;
      const float p = s(t.main[i], x[transposed ? c * rows + r : i]);
      t.main[i] = p;
      if constexpr (kCopy) param[i] = StoreAs<kParam>(p);
    }
  }
}

template <DType kMoment>
bool MomentumFor(const MuonTensors& t, size_t rows, size_t cols, bool tr, const MuonParams& p, float* x) {
  switch (t.grad_type) {
    case DType::kF32: Momentum<kMoment, DType::kF32>(t, rows, cols, tr, p, x); return true;
    case DType::kBF16: Momentum<kMoment, DType::kBF16>(t, rows, cols, tr, p, x); return true;
    case DType::kF16: Momentum<kMoment, DType::kF16>(t, rows, cols, tr, p, x); return true;
    default: return false;
  }
}

}  // namespace

size_t MuonWorkspaceBytes(size_t rows, size_t cols) { return MuonLayout(rows, cols).total_bytes; }

void NewtonSchulzCpu(float* x, size_t rows, size_t cols, int ns_steps, double eps, void* workspace,
                     int threads) {
  if (rows == 0 || cols == 0 || ns_steps < 0) return;
  const MuonLayout l(rows, cols);
  char* ws = static_cast<char*>(workspace);
  float* wx = reinterpret_cast<float*>(ws + l.x_offset);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < cols; ++c) wx[l.transposed ? c * rows + r : r * cols + c] = x[r * cols + c];
  }
  NewtonSchulzCore(wx, reinterpret_cast<float*>(ws + l.y_offset), reinterpret_cast<float*>(ws + l.a_offset),
                   reinterpret_cast<float*>(ws + l.b_offset), l.short_side, l.long_side, ns_steps, eps,
                   /*clamp_eps=*/false, internal::NsCoefficients{}, threads);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < cols; ++c) x[r * cols + c] = wx[l.transposed ? c * rows + r : r * cols + c];
  }
}

bool MuonStepCpu(const MuonTensors& t, size_t rows, size_t cols, const MuonParams& p, void* workspace,
                 int threads) {
  const bool grad_ok = t.grad_type == DType::kF32 || t.grad_type == DType::kBF16 || t.grad_type == DType::kF16;
  const bool param_ok = !t.param_type || *t.param_type == DType::kF32 || *t.param_type == DType::kBF16 ||
                        *t.param_type == DType::kF16;
  const bool moment_ok = t.moment_type == MomentDType::kF32 || t.moment_type == MomentDType::kBF16;
  if (!grad_ok || !param_ok || !moment_ok || p.ns_steps < 0 || rows == 0 || cols == 0) return false;
  if (t.main == nullptr || t.momentum == nullptr || t.grad == nullptr || workspace == nullptr ||
      (t.param_type && t.param == nullptr)) {
    return false;
  }
  if (t.found_inf != nullptr && *t.found_inf != 0.0f) return true;  // skipped, as torch does
  const MuonLayout l(rows, cols);
  char* ws = static_cast<char*>(workspace);
  float* x = reinterpret_cast<float*>(ws + l.x_offset);
  if (t.moment_type == MomentDType::kBF16) {
    MomentumFor<DType::kBF16>(t, rows, cols, l.transposed, p, x);
  } else {
    MomentumFor<DType::kF32>(t, rows, cols, l.transposed, p, x);
  }
  NewtonSchulzCore(x, reinterpret_cast<float*>(ws + l.y_offset), reinterpret_cast<float*>(ws + l.a_offset),
                   reinterpret_cast<float*>(ws + l.b_offset), l.short_side, l.long_side, p.ns_steps, p.eps,
                   p.norm_eps == MuonNormEps::kClamp, internal::MakeNsCoefficients(p), threads);
  const internal::MuonApplyScalars s = internal::MakeMuonApplyScalars(p, rows, cols);
  if (!t.param_type) {
    Apply<DType::kF32, false>(t, rows, cols, l.transposed, s, x);
  } else if (*t.param_type == DType::kF32) {
    Apply<DType::kF32, true>(t, rows, cols, l.transposed, s, x);
  } else if (*t.param_type == DType::kBF16) {
    Apply<DType::kBF16, true>(t, rows, cols, l.transposed, s, x);
  } else {
    Apply<DType::kF16, true>(t, rows, cols, l.transposed, s, x);
  }
  return true;
}

}  // namespace optstate::kernels
