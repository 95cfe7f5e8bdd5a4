// CUDA implementation of Lion and SGD with momentum (see kernels/momentum.h).
//
// One grid-stride kernel per rule and type combination, one element per
// thread per trip: loads and stores of consecutive threads are coalesced, and
// a step streams its state from disk far slower than this kernel reads it.
// State is touched once: streaming cache hints (ld/st.global.cs) keep it from
// evicting other data in L2. Compiled with -fmad=false so its rounding equals
// the CPU loop's (kernels/internal/momentum_math.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "kernels/internal/adam_math.h"
#include "kernels/internal/momentum_math.h"
#include "kernels/momentum.h"

namespace optstate::kernels {
namespace {

using internal::LoadAs;
using internal::StorageOf;
using internal::StoreAs;

template <DType T>
using Storage = typename StorageOf<T>::type;

constexpr int kThreads = 256;

template <typename Rule, DType kMoment, DType kGrad, DType kParam, bool kCopy, bool kUsesMoment>
__global__ void __launch_bounds__(kThreads)
    MomentumKernel(float* __restrict__ main, Storage<kMoment>* __restrict__ m,
                   const Storage<kGrad>* __restrict__ grad, Storage<kParam>* __restrict__ param, size_t count,
                   Rule rule, const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    float p = __ldcs(main + i);
    float mi = 0.0f;
    if constexpr (kUsesMoment) mi = LoadAs<kMoment>(__ldcs(m + i));
    rule(LoadAs<kGrad>(__ldcs(grad + i)), p, mi);
    __stcs(main + i, p);
    if constexpr (kUsesMoment) __stcs(m + i, StoreAs<kMoment>(mi));
    if constexpr (kCopy) __stcs(param + i, StoreAs<kParam>(p));
  }
}

// Multiprocessor count of the current device, looked up once per device.
cudaError_t Sms(int* sms) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  *sms = cache[device].load(std::memory_order_relaxed);
  if (*sms > 0) return cudaSuccess;
  err = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  if (*sms <= 0) return cudaErrorInvalidDevice;
  cache[device].store(*sms, std::memory_order_relaxed);
  return cudaSuccess;
}

template <typename Rule, DType kMoment, DType kGrad, DType kParam, bool kCopy, bool kUses>
cudaError_t Launch(const MomentumTensors& t, size_t count, const Rule& rule, cudaStream_t stream) {
  int sms = 0;
  cudaError_t err = Sms(&sms);
  if (err != cudaSuccess) return err;
  // Up to 8 blocks of 256 threads per SM (every thread slot of sm_90):
  // grid-stride beyond that.
  const size_t needed = (count + kThreads - 1) / kThreads;
  const size_t grid = std::max<size_t>(1, std::min(needed, static_cast<size_t>(sms) * 8));
  MomentumKernel<Rule, kMoment, kGrad, kParam, kCopy, kUses><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      t.main, static_cast<Storage<kMoment>*>(t.moment), static_cast<const Storage<kGrad>*>(t.grad),
      static_cast<Storage<kParam>*>(t.param), count, rule, t.found_inf);
  return cudaPeekAtLastError();
}

template <typename Rule, DType kMoment, DType kGrad, bool kUses>
cudaError_t DispatchParam(const MomentumTensors& t, size_t count, const Rule& r, cudaStream_t s) {
  if (!t.param_type) return Launch<Rule, kMoment, kGrad, DType::kF32, false, kUses>(t, count, r, s);
  switch (*t.param_type) {
    case DType::kF32: return Launch<Rule, kMoment, kGrad, DType::kF32, true, kUses>(t, count, r, s);
    case DType::kBF16: return Launch<Rule, kMoment, kGrad, DType::kBF16, true, kUses>(t, count, r, s);
    case DType::kF16: return Launch<Rule, kMoment, kGrad, DType::kF16, true, kUses>(t, count, r, s);
    default: return cudaErrorInvalidValue;
  }
}

template <typename Rule, DType kMoment, bool kUses>
cudaError_t DispatchGrad(const MomentumTensors& t, size_t count, const Rule& r, cudaStream_t s) {
  switch (t.grad_type) {
    case DType::kF32: return DispatchParam<Rule, kMoment, DType::kF32, kUses>(t, count, r, s);
    case DType::kBF16: return DispatchParam<Rule, kMoment, DType::kBF16, kUses>(t, count, r, s);
    case DType::kF16: return DispatchParam<Rule, kMoment, DType::kF16, kUses>(t, count, r, s);
    default: return cudaErrorInvalidValue;
  }
}

bool Aligned(const void* p, size_t elem_size) { return reinterpret_cast<uintptr_t>(p) % elem_size == 0; }

bool FloatType(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

template <typename Rule>
int Run(const MomentumTensors& t, size_t count, const Rule& rule, bool uses_moment, void* stream) {
  const bool moment_ok = !uses_moment || t.moment_type == MomentDType::kF32 || t.moment_type == MomentDType::kBF16;
  if (!FloatType(t.grad_type) || (t.param_type && !FloatType(*t.param_type)) || !moment_ok) {
    return cudaErrorInvalidValue;
  }
  if (count == 0) return cudaSuccess;
  if (t.main == nullptr || t.grad == nullptr || (uses_moment && t.moment == nullptr) ||
      (t.param_type && t.param == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const size_t moment_size = DTypeSize(internal::MomentElement(t.moment_type));
  if (!Aligned(t.main, 4) || (uses_moment && !Aligned(t.moment, moment_size)) ||
      !Aligned(t.grad, DTypeSize(t.grad_type)) || (t.param_type && !Aligned(t.param, DTypeSize(*t.param_type)))) {
    return cudaErrorInvalidValue;
  }
  auto s = static_cast<cudaStream_t>(stream);
  if (!uses_moment) return DispatchGrad<Rule, DType::kF32, false>(t, count, rule, s);
  if (t.moment_type == MomentDType::kBF16) return DispatchGrad<Rule, DType::kBF16, true>(t, count, rule, s);
  return DispatchGrad<Rule, DType::kF32, true>(t, count, rule, s);
}

}  // namespace

int LionStepCuda(const MomentumTensors& t, size_t count, const LionParams& p, void* stream) {
  return Run(t, count, internal::MakeLionScalars(p), /*uses_moment=*/true, stream);
}

int SgdStepCuda(const MomentumTensors& t, size_t count, const SgdParams& p, void* stream) {
  if (!internal::SgdParamsValid(p)) return cudaErrorInvalidValue;
  return Run(t, count, internal::MakeSgdScalars(p), /*uses_moment=*/p.momentum != 0.0, stream);
}

}  // namespace optstate::kernels
