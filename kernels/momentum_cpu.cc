// CPU implementation of Lion and SGD with momentum (see kernels/momentum.h).
// Compiled like adam_cpu.cc (-O3 -fno-math-errno -ffp-contract=off) so its
// rounding equals the CUDA kernels' (kernels/internal/momentum_math.h).
#include <algorithm>
#include <thread>
#include <vector>

#include "kernels/internal/adam_math.h"
#include "kernels/internal/momentum_math.h"
#include "kernels/momentum.h"

namespace optstate::kernels {
namespace {

using internal::LoadAs;
using internal::StoreAs;

// kUsesMoment false (SGD without momentum): the moment is neither read nor
// written. kCopy: the parameter copy is written as kParam.
template <typename Rule, DType kMoment, DType kGrad, DType kParam, bool kCopy, bool kUsesMoment>
void RangeLoop(const MomentumTensors& t, size_t begin, size_t end, const Rule& rule) {
  using MomentT = typename internal::StorageOf<kMoment>::type;
  using GradT = typename internal::StorageOf<kGrad>::type;
  using ParamT = typename internal::StorageOf<kParam>::type;
  float* __restrict main = t.main;
  MomentT* __restrict m = static_cast<MomentT*>(t.moment);
  const GradT* __restrict grad = static_cast<const GradT*>(t.grad);
  ParamT* __restrict param = static_cast<ParamT*>(t.param);
  const Rule r = rule;  // local copy: kept in registers
  for (size_t i = begin; i < end; ++i) {
    float p = main[i];
    float mi = 0.0f;
    if constexpr (kUsesMoment) mi = LoadAs<kMoment>(m[i]);
    r(LoadAs<kGrad>(grad[i]), p, mi);
    main[i] = p;
    if constexpr (kUsesMoment) m[i] = StoreAs<kMoment>(mi);
    if constexpr (kCopy) param[i] = StoreAs<kParam>(p);
  }
}

template <typename Rule>
using RangeFn = void (*)(const MomentumTensors&, size_t, size_t, const Rule&);

template <typename Rule, DType kMoment, DType kGrad, bool kUses>
RangeFn<Rule> PickParam(std::optional<DType> param) {
  if (!param) return &RangeLoop<Rule, kMoment, kGrad, DType::kF32, false, kUses>;
  switch (*param) {
    case DType::kF32: return &RangeLoop<Rule, kMoment, kGrad, DType::kF32, true, kUses>;
    case DType::kBF16: return &RangeLoop<Rule, kMoment, kGrad, DType::kBF16, true, kUses>;
    case DType::kF16: return &RangeLoop<Rule, kMoment, kGrad, DType::kF16, true, kUses>;
    default: return nullptr;
  }
}

template <typename Rule, DType kMoment, bool kUses>
RangeFn<Rule> PickGrad(DType grad, std::optional<DType> param) {
  switch (grad) {
    case DType::kF32: return PickParam<Rule, kMoment, DType::kF32, kUses>(param);
    case DType::kBF16: return PickParam<Rule, kMoment, DType::kBF16, kUses>(param);
    case DType::kF16: return PickParam<Rule, kMoment, DType::kF16, kUses>(param);
    default: return nullptr;
  }
}

template <typename Rule>
RangeFn<Rule> Pick(const MomentumTensors& t, bool uses_moment) {
  if (!uses_moment) return PickGrad<Rule, DType::kF32, false>(t.grad_type, t.param_type);
  switch (t.moment_type) {
    case MomentDType::kF32: return PickGrad<Rule, DType::kF32, true>(t.grad_type, t.param_type);
    case MomentDType::kBF16: return PickGrad<Rule, DType::kBF16, true>(t.grad_type, t.param_type);
    case MomentDType::kQ8: return nullptr;
  }
  return nullptr;
}

template <typename Rule>
bool Run(const MomentumTensors& t, size_t count, const Rule& rule, bool uses_moment, int threads) {
  if (t.param_type && t.param == nullptr) return false;
  RangeFn<Rule> fn = Pick<Rule>(t, uses_moment);
  if (fn == nullptr) return false;
  if (count == 0) return true;
  if (t.main == nullptr || t.grad == nullptr || (uses_moment && t.moment == nullptr)) return false;
  if (t.found_inf != nullptr && *t.found_inf != 0.0f) return true;  // skipped, as torch does
  // Below ~64K elements per thread, starting threads costs more than it saves.
  constexpr size_t kMinPerThread = size_t{1} << 16;
  size_t n_threads = threads < 1 ? 1 : static_cast<size_t>(threads);
  n_threads = std::min(n_threads, std::max<size_t>(1, count / kMinPerThread));
  if (n_threads <= 1) {
    fn(t, 0, count, rule);
    return true;
  }
  // 64-element boundaries: no two threads share a cache line.
  const size_t per = ((count + n_threads - 1) / n_threads + 63) / 64 * 64;
  std::vector<std::thread> workers;
  for (size_t k = 0; k < n_threads; ++k) {
    const size_t b = std::min(count, k * per), e = std::min(count, b + per);
    if (b >= e) break;
    workers.emplace_back([=, &t, &rule] { fn(t, b, e, rule); });
  }
  for (auto& w : workers) w.join();
  return true;
}

}  // namespace

bool LionStepCpu(const MomentumTensors& t, size_t count, const LionParams& p, int threads) {
  return Run(t, count, internal::MakeLionScalars(p), /*uses_moment=*/true, threads);
}

bool SgdStepCpu(const MomentumTensors& t, size_t count, const SgdParams& p, int threads) {
  if (!internal::SgdParamsValid(p)) return false;
  return Run(t, count, internal::MakeSgdScalars(p), /*uses_moment=*/p.momentum != 0.0, threads);
}

}  // namespace optstate::kernels
