// CUDA implementation of the fused Adam/AdamW step (see kernels/adam.h).
//
// Two kernels, both grid-stride and memory-bound:
//  - AdamVecKernel: when every pointer sits at the same element phase modulo 4,
//    the first `head` (< 4) and last (< 4) elements are done one by one and the
//    rest in groups of 4 elements: 16-byte loads/stores of fp32 main and
//    8-byte (16-bit types) or 16-byte (fp32) loads/stores of the moments, grad
//    and param.
//    Each thread keeps `kUnroll` groups in flight per loop trip.
//  - AdamScalarKernel: any element-aligned pointers, one element at a time.
// State is touched exactly once, so loads and stores use the streaming cache
// hints (ld.global.cs / st.global.cs) to keep it from evicting other data in L2.
// This file is compiled with -fmad=false so its rounding equals the CPU
// loop's (kernels/internal/adam_math.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "kernels/adam.h"
#include "kernels/internal/adam_math.h"
#include "kernels/internal/adam_q8.h"
#include "kernels/internal/launch_config.h"

namespace optstate::kernels {
namespace {

using internal::AdamScalars;
using internal::AdamUpdate;
using internal::LaunchConfig;
using internal::LoadAs;
using internal::StorageOf;
using internal::StoreAs;

template <DType T>
using Storage = typename StorageOf<T>::type;

// Largest block: leaves ptxas 128 registers per thread, so the unrolled loop
// never spills.
constexpr int kMaxThreads = 512;

// Four elements of type T as one aligned vector: float4 for fp32, uint2 for
// 16-bit types.
template <DType T> struct Vec4Of;
template <> struct Vec4Of<DType::kF32> { using type = float4; };
template <> struct Vec4Of<DType::kBF16> { using type = uint2; };
template <> struct Vec4Of<DType::kF16> { using type = uint2; };

template <DType T>
__device__ __forceinline__ void Unpack4(const typename Vec4Of<T>::type& x, float out[4]) {
  if constexpr (T == DType::kF32) {
    out[0] = x.x; out[1] = x.y; out[2] = x.z; out[3] = x.w;
  } else {
    out[0] = LoadAs<T>(static_cast<uint16_t>(x.x & 0xFFFFu));
    out[1] = LoadAs<T>(static_cast<uint16_t>(x.x >> 16));
    out[2] = LoadAs<T>(static_cast<uint16_t>(x.y & 0xFFFFu));
    out[3] = LoadAs<T>(static_cast<uint16_t>(x.y >> 16));
  }
}

template <DType T>
__device__ __forceinline__ typename Vec4Of<T>::type Pack4(const float in[4]) {
  if constexpr (T == DType::kF32) {
    return make_float4(in[0], in[1], in[2], in[3]);
  } else {
    uint2 r;
    r.x = static_cast<uint32_t>(StoreAs<T>(in[0])) | (static_cast<uint32_t>(StoreAs<T>(in[1])) << 16);
    r.y = static_cast<uint32_t>(StoreAs<T>(in[2])) | (static_cast<uint32_t>(StoreAs<T>(in[3])) << 16);
    return r;
  }
}

// Every kernel below: kCopy writes the parameter copy as kParam in the same
// pass (kParam is ignored when false).
template <DType kMoment, DType kGrad, DType kParam, bool kCopy>
__device__ __forceinline__ void ScalarElement(float* main, Storage<kMoment>* m, Storage<kMoment>* v,
                                              const Storage<kGrad>* grad, Storage<kParam>* param,
                                              size_t i, const AdamScalars& s) {
  float p = __ldcs(main + i);
  float mi = LoadAs<kMoment>(__ldcs(m + i));
  float vi = LoadAs<kMoment>(__ldcs(v + i));
  AdamUpdate(LoadAs<kGrad>(grad[i]), s, p, mi, vi);
  __stcs(main + i, p);
  __stcs(m + i, StoreAs<kMoment>(mi));
  __stcs(v + i, StoreAs<kMoment>(vi));
  if constexpr (kCopy) param[i] = StoreAs<kParam>(p);
}

template <DType kMoment, DType kGrad, DType kParam, bool kCopy, int kUnroll>
__global__ void __launch_bounds__(kMaxThreads) AdamVecKernel(float* __restrict__ main,
                                                      Storage<kMoment>* __restrict__ m,
                                                      Storage<kMoment>* __restrict__ v,
                                                      const Storage<kGrad>* __restrict__ grad,
                                                      Storage<kParam>* __restrict__ param,
                                                      size_t count, size_t head, size_t n_groups,
                                                      AdamScalars s,
                                                      const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  using MomentVec = typename Vec4Of<kMoment>::type;
  using GradVec = typename Vec4Of<kGrad>::type;
  using ParamVec = typename Vec4Of<kParam>::type;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  // Unaligned head (< 4 elements) and tail (< 4 elements), one thread each.
  const size_t tail_begin = head + 4 * n_groups;
  const size_t edge = head + (count - tail_begin);
  if (tid < edge) {
    const size_t i = tid < head ? tid : tail_begin + (tid - head);
    ScalarElement<kMoment, kGrad, kParam, kCopy>(main, m, v, grad, param, i, s);
  }

  const float4* main4 = reinterpret_cast<const float4*>(main + head);
  const MomentVec* m4 = reinterpret_cast<const MomentVec*>(m + head);
  const MomentVec* v4 = reinterpret_cast<const MomentVec*>(v + head);
  const GradVec* grad4 = reinterpret_cast<const GradVec*>(grad + head);
  float4* main4_out = reinterpret_cast<float4*>(main + head);
  MomentVec* m4_out = reinterpret_cast<MomentVec*>(m + head);
  MomentVec* v4_out = reinterpret_cast<MomentVec*>(v + head);
  ParamVec* param4 = reinterpret_cast<ParamVec*>(param + head);

  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x * kUnroll;
  for (size_t base = static_cast<size_t>(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x;
       base < n_groups; base += stride) {
    float4 rp[kUnroll];
    MomentVec rm[kUnroll], rv[kUnroll];
    GradVec rg[kUnroll];
    // All loads first, so kUnroll * 4 independent requests are in flight.
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t g = base + static_cast<size_t>(u) * blockDim.x;
      if (g < n_groups) {
        rp[u] = __ldcs(main4 + g);
        rm[u] = __ldcs(m4 + g);
        rv[u] = __ldcs(v4 + g);
        rg[u] = __ldcs(grad4 + g);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t g = base + static_cast<size_t>(u) * blockDim.x;
      if (g < n_groups) {
        float gf[4];
        Unpack4<kGrad>(rg[u], gf);
        float p[4] = {rp[u].x, rp[u].y, rp[u].z, rp[u].w};
        float mm[4], vv[4];
        Unpack4<kMoment>(rm[u], mm);
        Unpack4<kMoment>(rv[u], vv);
#pragma unroll
        for (int k = 0; k < 4; ++k) AdamUpdate(gf[k], s, p[k], mm[k], vv[k]);
        __stcs(main4_out + g, make_float4(p[0], p[1], p[2], p[3]));
        __stcs(m4_out + g, Pack4<kMoment>(mm));
        __stcs(v4_out + g, Pack4<kMoment>(vv));
        if constexpr (kCopy) __stcs(param4 + g, Pack4<kParam>(p));
      }
    }
  }
}

template <DType kMoment, DType kGrad, DType kParam, bool kCopy>
__global__ void __launch_bounds__(kMaxThreads) AdamScalarKernel(float* __restrict__ main,
                                                         Storage<kMoment>* __restrict__ m,
                                                         Storage<kMoment>* __restrict__ v,
                                                         const Storage<kGrad>* __restrict__ grad,
                                                         Storage<kParam>* __restrict__ param,
                                                         size_t count, AdamScalars s,
                                                         const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    ScalarElement<kMoment, kGrad, kParam, kCopy>(main, m, v, grad, param, i, s);
  }
}

// Multiprocessor count per device, looked up once (lazily: never at static
// init, so binaries start without a driver).
int MultiProcessorCount(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return 0;
  int sms = cache[device].load(std::memory_order_relaxed);
  if (sms > 0) return sms;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      sms <= 0) {
    return 0;
  }
  cache[device].store(sms, std::memory_order_relaxed);
  return sms;
}

// Grid size: enough blocks for `units` threads, at most one full wave of
// resident blocks (the kernels are grid-stride).
template <auto kKernel>
cudaError_t GridFor(const LaunchConfig& c, size_t units, unsigned* grid) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const int sms = MultiProcessorCount(device);
  if (sms == 0) return cudaErrorInvalidDevice;
  int per_sm = c.blocks_per_sm;
  if (per_sm <= 0) {
    // Cached per kernel and block size (the only inputs; one architecture).
    static std::atomic<int> cached[3];  // threads 128, 256, 512
    int idx = 0;
    while ((128 << idx) < c.threads_per_block && idx < 2) ++idx;
    per_sm = cached[idx].load(std::memory_order_relaxed);
    if (per_sm <= 0) {
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, c.threads_per_block, 0);
      if (err != cudaSuccess) return err;
      if (per_sm <= 0) per_sm = 1;
      cached[idx].store(per_sm, std::memory_order_relaxed);
    }
  }
  const size_t needed = (units + c.threads_per_block - 1) / c.threads_per_block;
  const size_t max_grid = static_cast<size_t>(sms) * static_cast<size_t>(per_sm);
  *grid = static_cast<unsigned>(std::max<size_t>(1, std::min(needed, max_grid)));
  return cudaSuccess;
}

size_t ElementPhase(const void* ptr, size_t elem_size) {
  return (reinterpret_cast<uintptr_t>(ptr) / elem_size) % 4;
}

template <DType kMoment, DType kGrad, DType kParam, bool kCopy, int kUnroll>
cudaError_t LaunchVec(const AdamTensors& t, size_t count, size_t head, const AdamScalars& s,
                      const LaunchConfig& c, cudaStream_t stream) {
  const size_t n_groups = (count - head) / 4;
  const size_t edge = head + (count - head - 4 * n_groups);
  constexpr auto kernel = &AdamVecKernel<kMoment, kGrad, kParam, kCopy, kUnroll>;
  const size_t units = std::max((n_groups + kUnroll - 1) / kUnroll, edge);
  unsigned grid = 0;
  cudaError_t err = GridFor<kernel>(c, units, &grid);
  if (err != cudaSuccess) return err;
  kernel<<<grid, c.threads_per_block, 0, stream>>>(
      t.main, static_cast<Storage<kMoment>*>(t.exp_avg), static_cast<Storage<kMoment>*>(t.exp_avg_sq),
      static_cast<const Storage<kGrad>*>(t.grad), static_cast<Storage<kParam>*>(t.param), count,
      head, n_groups, s, t.found_inf);
  return cudaPeekAtLastError();
}

template <DType kMoment, DType kGrad, DType kParam, bool kCopy>
cudaError_t Launch(const AdamTensors& t, size_t count, const AdamScalars& s,
                   const LaunchConfig& config, cudaStream_t stream) {
  LaunchConfig c = config;
  if (c.adaptive) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    const size_t min_blocks = 4 * static_cast<size_t>(MultiProcessorCount(device));
    const size_t groups = count / 4;
    auto blocks = [&] { return groups / (static_cast<size_t>(c.threads_per_block) * c.unroll); };
    while (blocks() < min_blocks && c.unroll > 1) c.unroll /= 2;
    while (blocks() < min_blocks && c.threads_per_block > 128) c.threads_per_block /= 2;
  }
  // Vector path when every array has the same element phase modulo 4.
  const size_t phase = ElementPhase(t.main, 4);
  bool vec = ElementPhase(t.exp_avg, DTypeSize(kMoment)) == phase &&
             ElementPhase(t.exp_avg_sq, DTypeSize(kMoment)) == phase &&
             ElementPhase(t.grad, DTypeSize(kGrad)) == phase;
  if constexpr (kCopy) {
    vec = vec && ElementPhase(t.param, DTypeSize(kParam)) == phase;
  }
  if (vec) {
    const size_t head = std::min(count, (4 - phase) % 4);
    switch (c.unroll) {
      case 1: return LaunchVec<kMoment, kGrad, kParam, kCopy, 1>(t, count, head, s, c, stream);
      case 2: return LaunchVec<kMoment, kGrad, kParam, kCopy, 2>(t, count, head, s, c, stream);
      case 4: return LaunchVec<kMoment, kGrad, kParam, kCopy, 4>(t, count, head, s, c, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  constexpr auto kernel = &AdamScalarKernel<kMoment, kGrad, kParam, kCopy>;
  unsigned grid = 0;
  cudaError_t err = GridFor<kernel>(c, count, &grid);
  if (err != cudaSuccess) return err;
  kernel<<<grid, c.threads_per_block, 0, stream>>>(
      t.main, static_cast<Storage<kMoment>*>(t.exp_avg), static_cast<Storage<kMoment>*>(t.exp_avg_sq),
      static_cast<const Storage<kGrad>*>(t.grad), static_cast<Storage<kParam>*>(t.param), count,
      s, t.found_inf);
  return cudaPeekAtLastError();
}

template <DType kMoment, DType kGrad>
cudaError_t DispatchParam(const AdamTensors& t, size_t count, const AdamScalars& s,
                          const LaunchConfig& c, cudaStream_t stream) {
  if (!t.param_type) return Launch<kMoment, kGrad, DType::kF32, false>(t, count, s, c, stream);
  switch (*t.param_type) {
    case DType::kF32: return Launch<kMoment, kGrad, DType::kF32, true>(t, count, s, c, stream);
    case DType::kBF16: return Launch<kMoment, kGrad, DType::kBF16, true>(t, count, s, c, stream);
    case DType::kF16: return Launch<kMoment, kGrad, DType::kF16, true>(t, count, s, c, stream);
    case DType::kQ8S:
    case DType::kQ8U: break;
  }
  return cudaErrorInvalidValue;
}

template <DType kMoment>
cudaError_t DispatchGrad(const AdamTensors& t, size_t count, const AdamScalars& s,
                         const LaunchConfig& c, cudaStream_t stream) {
  switch (t.grad_type) {
    case DType::kF32: return DispatchParam<kMoment, DType::kF32>(t, count, s, c, stream);
    case DType::kBF16: return DispatchParam<kMoment, DType::kBF16>(t, count, s, c, stream);
    case DType::kF16: return DispatchParam<kMoment, DType::kF16>(t, count, s, c, stream);
    default: break;
  }
  return cudaErrorInvalidValue;
}

// q8 moments: one thread block of kQ8BlockElems threads per quantization
// block (grid-stride over blocks); the block's new absmax is a max over
// shared memory (exact in any order), so codes equal the CPU loop's.
template <DType kGrad, DType kParam, bool kCopy>
__global__ void __launch_bounds__(kQ8BlockElems) AdamQ8Kernel(AdamQ8Tensors t, size_t count, size_t blocks,
                                                              AdamScalars s, internal::Q8Maps maps) {
  if (t.found_inf != nullptr && *t.found_inf != 0.0f) return;
  __shared__ float smap[256], umap[256];
  __shared__ float red_m[kQ8BlockElems], red_v[kQ8BlockElems];
  const unsigned k = threadIdx.x;
  smap[k] = maps.signed_map[k];
  umap[k] = maps.unsigned_map[k];
  __syncthreads();
  const Storage<kGrad>* grad = static_cast<const Storage<kGrad>*>(t.grad);
  Storage<kParam>* param = static_cast<Storage<kParam>*>(t.param);
  for (size_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const size_t i = b * kQ8BlockElems + k;
    const bool live = i < count;
    float m = 0.0f, v = 0.0f;
    if (live) {
      float p = t.main[i];
      m = internal::Q8Decode(smap, t.exp_avg[i], t.exp_avg_absmax[b]);
      v = internal::Q8Decode(umap, t.exp_avg_sq[i], t.exp_avg_sq_absmax[b]);
      AdamUpdate(LoadAs<kGrad>(grad[i]), s, p, m, v);
      t.main[i] = p;
      if constexpr (kCopy) param[i] = StoreAs<kParam>(p);
    }
    red_m[k] = fabsf(m);
    red_v[k] = fabsf(v);
    __syncthreads();
    for (unsigned w = kQ8BlockElems / 2; w > 0; w /= 2) {
      if (k < w) {
        red_m[k] = fmaxf(red_m[k], red_m[k + w]);
        red_v[k] = fmaxf(red_v[k], red_v[k + w]);
      }
      __syncthreads();
    }
    const float am = red_m[0], av = red_v[0];
    if (live) {
      t.exp_avg[i] = internal::Q8Encode(smap, internal::Q8Normalize(m, am));
      t.exp_avg_sq[i] = internal::Q8Encode(umap, internal::Q8Normalize(v, av));
    }
    if (k == 0) {
      t.exp_avg_absmax[b] = am;
      t.exp_avg_sq_absmax[b] = av;
    }
    __syncthreads();  // red_* are reused by the next block
  }
}

template <DType kGrad, DType kParam, bool kCopy>
cudaError_t LaunchQ8(const AdamQ8Tensors& t, size_t count, const AdamScalars& s, cudaStream_t stream) {
  const size_t blocks = Q8Blocks(count);
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const int sms = MultiProcessorCount(device);
  if (sms == 0) return cudaErrorInvalidDevice;
  const size_t grid = std::max<size_t>(1, std::min<size_t>(blocks, static_cast<size_t>(sms) * 8));
  AdamQ8Kernel<kGrad, kParam, kCopy><<<static_cast<unsigned>(grid), kQ8BlockElems, 0, stream>>>(
      t, count, blocks, s, internal::GetQ8Maps());
  return cudaPeekAtLastError();
}

template <DType kGrad>
cudaError_t DispatchQ8Param(const AdamQ8Tensors& t, size_t count, const AdamScalars& s, cudaStream_t stream) {
  if (!t.param_type) return LaunchQ8<kGrad, DType::kF32, false>(t, count, s, stream);
  switch (*t.param_type) {
    case DType::kF32: return LaunchQ8<kGrad, DType::kF32, true>(t, count, s, stream);
    case DType::kBF16: return LaunchQ8<kGrad, DType::kBF16, true>(t, count, s, stream);
    case DType::kF16: return LaunchQ8<kGrad, DType::kF16, true>(t, count, s, stream);
    case DType::kQ8S:
    case DType::kQ8U: break;
  }
  return cudaErrorInvalidValue;
}

bool Aligned(const void* p, size_t elem_size) {
  return reinterpret_cast<uintptr_t>(p) % elem_size == 0;
}

}  // namespace

namespace internal {

int AdamStepCudaWithConfig(const AdamTensors& t, size_t count, const AdamParams& p,
                           const LaunchConfig& c, void* stream) {
  const bool grad_ok = t.grad_type == DType::kF32 || t.grad_type == DType::kBF16 ||
                       t.grad_type == DType::kF16;
  const bool param_ok = !t.param_type || *t.param_type == DType::kF32 || *t.param_type == DType::kBF16 ||
                        *t.param_type == DType::kF16;
  const int tpb = c.threads_per_block;
  const bool config_ok = (tpb == 128 || tpb == 256 || tpb == kMaxThreads) &&
                         (c.unroll == 1 || c.unroll == 2 || c.unroll == 4);
  const bool moment_ok = t.moment_type == MomentDType::kF32 || t.moment_type == MomentDType::kBF16;
  if (!grad_ok || !param_ok || !config_ok || !moment_ok || p.maximize || p.step == 0) {
    return cudaErrorInvalidValue;
  }
  if (count == 0) return cudaSuccess;
  if (t.main == nullptr || t.exp_avg == nullptr || t.exp_avg_sq == nullptr || t.grad == nullptr ||
      (t.param_type && t.param == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const size_t moment_size = DTypeSize(MomentElement(t.moment_type));
  if (!Aligned(t.main, 4) || !Aligned(t.exp_avg, moment_size) || !Aligned(t.exp_avg_sq, moment_size) ||
      !Aligned(t.grad, DTypeSize(t.grad_type)) ||
      (t.param_type && !Aligned(t.param, DTypeSize(*t.param_type)))) {
    return cudaErrorInvalidValue;
  }
  const AdamScalars s = MakeAdamScalars(p);
  auto st = static_cast<cudaStream_t>(stream);
  if (t.moment_type == MomentDType::kBF16) return DispatchGrad<DType::kBF16>(t, count, s, c, st);
  return DispatchGrad<DType::kF32>(t, count, s, c, st);
}

}  // namespace internal

int AdamStepCuda(const AdamTensors& t, size_t count, const AdamParams& p, void* stream) {
  return internal::AdamStepCudaWithConfig(t, count, p, internal::LaunchConfig{}, stream);
}

int AdamStepCudaQ8(const AdamQ8Tensors& t, size_t count, const AdamParams& p, void* stream) {
  if (p.maximize || p.step == 0 || (t.param_type && t.param == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (count == 0) return cudaSuccess;
  if (t.main == nullptr || t.exp_avg == nullptr || t.exp_avg_sq == nullptr || t.exp_avg_absmax == nullptr ||
      t.exp_avg_sq_absmax == nullptr || t.grad == nullptr || !Aligned(t.main, 4) ||
      !Aligned(t.exp_avg_absmax, 4) || !Aligned(t.exp_avg_sq_absmax, 4)) {
    return cudaErrorInvalidValue;
  }
  const AdamScalars s = internal::MakeAdamScalars(p);
  auto st = static_cast<cudaStream_t>(stream);
  switch (t.grad_type) {
    case DType::kF32: return DispatchQ8Param<DType::kF32>(t, count, s, st);
    case DType::kBF16: return DispatchQ8Param<DType::kBF16>(t, count, s, st);
    case DType::kF16: return DispatchQ8Param<DType::kF16>(t, count, s, st);
    default: break;
  }
  return cudaErrorInvalidValue;
}

bool CudaKernelsBuilt() { return true; }

}  // namespace optstate::kernels
