// CPU implementation of the fused Adam/AdamW step (see kernels/adam.h).
//
// The per-element math lives in kernels/internal/adam_math.h and is shared,
// operation for operation, with the CUDA kernel; this file is compiled with
// -O3 -fno-math-errno -ffp-contract=off (kernels/CMakeLists.txt) so the loop
// vectorises (sqrt without errno) and rounds exactly like the GPU build, which
// is compiled with -fmad=false.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "kernels/adam.h"
#include "kernels/internal/adam_math.h"

namespace optstate::kernels {
namespace {

using internal::AdamScalars;
using internal::AdamUpdate;
using internal::LoadAs;
using internal::StoreAs;

// Moments are decoded to fp32 (kMoment bf16: exact), updated in fp32 and
// rounded back to nearest even, in the same pass as the f32 case.
template <ScalarType kMoment, ScalarType kGrad, ScalarType kParam>
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
    if constexpr (kParam != ScalarType::kNone) param[i] = StoreAs<kParam>(p);
  }
}

using RangeFn = void (*)(float*, void*, void*, const void*, void*, size_t, size_t,
                         const AdamScalars&);

template <ScalarType kMoment, ScalarType kGrad>
RangeFn PickParam(ScalarType param) {
  switch (param) {
    case ScalarType::kF32: return &RangeLoop<kMoment, kGrad, ScalarType::kF32>;
    case ScalarType::kBF16: return &RangeLoop<kMoment, kGrad, ScalarType::kBF16>;
    case ScalarType::kF16: return &RangeLoop<kMoment, kGrad, ScalarType::kF16>;
    case ScalarType::kNone: return &RangeLoop<kMoment, kGrad, ScalarType::kNone>;
  }
  return nullptr;
}

template <ScalarType kMoment>
RangeFn PickGrad(ScalarType grad, ScalarType param) {
  switch (grad) {
    case ScalarType::kF32: return PickParam<kMoment, ScalarType::kF32>(param);
    case ScalarType::kBF16: return PickParam<kMoment, ScalarType::kBF16>(param);
    case ScalarType::kF16: return PickParam<kMoment, ScalarType::kF16>(param);
    case ScalarType::kNone: return nullptr;
  }
  return nullptr;
}

// Moments: f32 or bf16 (f16's range is too narrow for exp_avg_sq).
RangeFn Pick(ScalarType moment, ScalarType grad, ScalarType param) {
  switch (moment) {
    case ScalarType::kF32: return PickGrad<ScalarType::kF32>(grad, param);
    case ScalarType::kBF16: return PickGrad<ScalarType::kBF16>(grad, param);
    default: return nullptr;
  }
}

}  // namespace

bool AdamStepCpu(const AdamTensors& t, size_t count, const AdamParams& p, int threads) {
  if (p.maximize || p.step == 0) return false;
  if (t.param_type != ScalarType::kNone && t.param == nullptr) return false;
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

}  // namespace optstate::kernels
