// CUDA implementation of Muon (see kernels/muon.h): elementwise kernels for
// the momentum and the apply, a one-block deterministic norm, and cuBLAS
// SGEMM for Newton-Schulz.
//
// cuBLAS is loaded with dlopen on first use rather than linked: every binary
// and liboptstate.so link the kernels, and must start on machines without
// the CUDA toolkit's libraries (as cudart is linked statically for the same
// reason). In a process that already loaded cuBLAS (torch does), dlopen finds
// that copy by its soname. Compiled with -fmad=false so the elementwise
// steps round as the CPU's (kernels/internal/momentum_math.h).
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <climits>
#include <cstdint>
#include <mutex>

#include "kernels/internal/adam_math.h"
#include "kernels/internal/momentum_math.h"
#include "kernels/internal/muon_layout.h"
#include "kernels/muon.h"

namespace optstate::kernels {
namespace {

using internal::LoadAs;
using internal::MuonLayout;
using internal::StorageOf;
using internal::StoreAs;

template <DType T>
using Storage = typename StorageOf<T>::type;

constexpr int kThreads = 256;
constexpr int kNormThreads = 1024;

// The cuBLAS entry points Muon uses, resolved once.
struct Cublas {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  bool ok = false;
};

const Cublas& LoadCublas() {
  static Cublas c;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = nullptr;
    for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
    }
    if (lib == nullptr) return;
    c.create = reinterpret_cast<decltype(c.create)>(dlsym(lib, "cublasCreate_v2"));
    c.set_stream = reinterpret_cast<decltype(c.set_stream)>(dlsym(lib, "cublasSetStream_v2"));
    c.set_math_mode = reinterpret_cast<decltype(c.set_math_mode)>(dlsym(lib, "cublasSetMathMode"));
    c.sgemm = reinterpret_cast<decltype(c.sgemm)>(dlsym(lib, "cublasSgemm_v2"));
    c.ok = c.create && c.set_stream && c.set_math_mode && c.sgemm;
  });
  return c;
}

cudaError_t FromCublas(cublasStatus_t s) {
  if (s == CUBLAS_STATUS_SUCCESS) return cudaSuccess;
  if (s == CUBLAS_STATUS_ALLOC_FAILED) return cudaErrorMemoryAllocation;
  return cudaErrorUnknown;
}

// One handle per thread and device, kept for the thread's life and never
// destroyed: destroying it at exit may run after the CUDA context is gone.
cudaError_t HandleFor(const Cublas& c, cublasHandle_t* out) {
  constexpr int kMaxDevices = 64;
  thread_local cublasHandle_t handles[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (handles[device] == nullptr) {
    cublasHandle_t h = nullptr;
    err = FromCublas(c.create(&h));
    if (err != cudaSuccess) return err;
    // fp32 throughout: no TF32 or reduced-precision reductions.
    err = FromCublas(c.set_math_mode(h, CUBLAS_PEDANTIC_MATH));
    if (err != cudaSuccess) return err;
    handles[device] = h;
  }
  *out = handles[device];
  return cudaSuccess;
}

template <DType kMoment, DType kGrad>
__global__ void __launch_bounds__(kThreads)
    MuonMomentumKernel(Storage<kMoment>* m, const Storage<kGrad>* g, float* x, size_t rows, size_t cols,
                       bool transposed, internal::MuonMomentumScalars s, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const size_t n = rows * cols;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float mi = LoadAs<kMoment>(m[i]);
    const float u = s(LoadAs<kGrad>(g[i]), mi);
    m[i] = StoreAs<kMoment>(mi);
    x[transposed ? (i % cols) * rows + i / cols : i] = u;
  }
}

// Sum of squares of x in fp64, one block, a fixed order: deterministic.
__global__ void __launch_bounds__(kNormThreads) SumSquaresKernel(const float* x, size_t n, double* out) {
  __shared__ double part[kNormThreads];
  double acc = 0.0;
  for (size_t i = threadIdx.x; i < n; i += kNormThreads) acc += static_cast<double>(x[i]) * x[i];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int w = kNormThreads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = part[0];
}

__global__ void __launch_bounds__(kThreads)
    NormalizeKernel(float* x, size_t n, const double* ss, double eps, bool clamp_eps) {
  const float denom = internal::MuonNormDivisor(*ss, eps, clamp_eps);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    x[i] = x[i] / denom;
  }
}

template <DType kParam, bool kCopy>
__global__ void __launch_bounds__(kThreads)
    MuonApplyKernel(float* main, Storage<kParam>* param, const float* x, size_t rows, size_t cols, bool transposed,
                    internal::MuonApplyScalars s, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const size_t n = rows * cols;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float p = s(main[i], x[transposed ? (i % cols) * rows + i / cols : i]);
    main[i] = p;
    if constexpr (kCopy) param[i] = StoreAs<kParam>(p);
  }
}

unsigned GridFor(size_t n) {
  // Grid-stride kernels: 1024 blocks of 256 cover 132 SMs many times over.
  const size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 1024 ? 1024 : blocks));
}

template <DType kMoment>
cudaError_t LaunchMomentum(const MuonTensors& t, size_t rows, size_t cols, bool tr,
                           const internal::MuonMomentumScalars& s, float* x, cudaStream_t st) {
  auto* m = static_cast<Storage<kMoment>*>(t.momentum);
  const unsigned grid = GridFor(rows * cols);
  switch (t.grad_type) {
    case DType::kF32:
      MuonMomentumKernel<kMoment, DType::kF32><<<grid, kThreads, 0, st>>>(
          m, static_cast<const float*>(t.grad), x, rows, cols, tr, s, t.found_inf);
      break;
    case DType::kBF16:
      MuonMomentumKernel<kMoment, DType::kBF16><<<grid, kThreads, 0, st>>>(
          m, static_cast<const uint16_t*>(t.grad), x, rows, cols, tr, s, t.found_inf);
      break;
    case DType::kF16:
      MuonMomentumKernel<kMoment, DType::kF16><<<grid, kThreads, 0, st>>>(
          m, static_cast<const uint16_t*>(t.grad), x, rows, cols, tr, s, t.found_inf);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaPeekAtLastError();
}

cudaError_t LaunchApply(const MuonTensors& t, size_t rows, size_t cols, bool tr, const internal::MuonApplyScalars& s,
                        const float* x, cudaStream_t st) {
  const unsigned grid = GridFor(rows * cols);
  if (!t.param_type) {
    MuonApplyKernel<DType::kF32, false><<<grid, kThreads, 0, st>>>(t.main, nullptr, x, rows, cols, tr, s, t.found_inf);
  } else if (*t.param_type == DType::kF32) {
    MuonApplyKernel<DType::kF32, true><<<grid, kThreads, 0, st>>>(t.main, static_cast<float*>(t.param), x, rows,
                                                                   cols, tr, s, t.found_inf);
  } else if (*t.param_type == DType::kBF16) {
    MuonApplyKernel<DType::kBF16, true><<<grid, kThreads, 0, st>>>(t.main, static_cast<uint16_t*>(t.param), x,
                                                                    rows, cols, tr, s, t.found_inf);
  } else {
    MuonApplyKernel<DType::kF16, true><<<grid, kThreads, 0, st>>>(t.main, static_cast<uint16_t*>(t.param), x, rows,
                                                                   cols, tr, s, t.found_inf);
  }
  return cudaPeekAtLastError();
}

bool FloatType(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }
bool Aligned(const void* p, size_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

#define OPTSTATE_RETURN_IF_CUDA(expr)   \
  do {                                  \
    const cudaError_t err_ = (expr);    \
    if (err_ != cudaSuccess) return err_; \
  } while (0)

}  // namespace

int MuonStepCuda(const MuonTensors& t, size_t rows, size_t cols, const MuonParams& p, void* d_workspace,
                 void* stream) {
  const bool moment_ok = t.moment_type == MomentDType::kF32 || t.moment_type == MomentDType::kBF16;
  if (!FloatType(t.grad_type) || (t.param_type && !FloatType(*t.param_type)) || !moment_ok || p.ns_steps < 0 ||
      rows == 0 || cols == 0 || rows > static_cast<size_t>(INT_MAX) || cols > static_cast<size_t>(INT_MAX)) {
    return cudaErrorInvalidValue;
  }
  if (t.main == nullptr || t.momentum == nullptr || t.grad == nullptr || d_workspace == nullptr ||
      (t.param_type && t.param == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const size_t moment_size = DTypeSize(internal::MomentElement(t.moment_type));
  if (!Aligned(t.main, 4) || !Aligned(t.momentum, moment_size) || !Aligned(t.grad, DTypeSize(t.grad_type)) ||
      (t.param_type && !Aligned(t.param, DTypeSize(*t.param_type))) || !Aligned(d_workspace, MuonLayout::kAlign)) {
    return cudaErrorInvalidValue;
  }
  const Cublas& cublas = LoadCublas();
  if (!cublas.ok) return cudaErrorSharedObjectInitFailed;
  cublasHandle_t h = nullptr;
  OPTSTATE_RETURN_IF_CUDA(HandleFor(cublas, &h));
  auto st = static_cast<cudaStream_t>(stream);
  OPTSTATE_RETURN_IF_CUDA(FromCublas(cublas.set_stream(h, st)));

  const MuonLayout l(rows, cols);
  char* ws = static_cast<char*>(d_workspace);
  float* x = reinterpret_cast<float*>(ws + l.x_offset);
  float* y = reinterpret_cast<float*>(ws + l.y_offset);
  float* a = reinterpret_cast<float*>(ws + l.a_offset);
  float* b = reinterpret_cast<float*>(ws + l.b_offset);
  double* ss = reinterpret_cast<double*>(ws + l.norm_offset);
  const size_t n = rows * cols;
  const internal::MuonMomentumScalars ms = internal::MakeMuonMomentumScalars(p);
  if (t.moment_type == MomentDType::kBF16) {
    OPTSTATE_RETURN_IF_CUDA(LaunchMomentum<DType::kBF16>(t, rows, cols, l.transposed, ms, x, st));
  } else {
    OPTSTATE_RETURN_IF_CUDA(LaunchMomentum<DType::kF32>(t, rows, cols, l.transposed, ms, x, st));
  }
  SumSquaresKernel<<<1, kNormThreads, 0, st>>>(x, n, ss);
  OPTSTATE_RETURN_IF_CUDA(cudaPeekAtLastError());
  NormalizeKernel<<<GridFor(n), kThreads, 0, st>>>(x, n, ss, p.eps, p.norm_eps == MuonNormEps::kClamp);
  OPTSTATE_RETURN_IF_CUDA(cudaPeekAtLastError());

  // X is s x l row-major; cuBLAS is column-major, so it sees M = X^T (l x s,
  // ld l). A = X X^T = M^T M; B = b*A + c*A A (symmetric, so its memory is
  // the same either way); Y = a*X + B X, i.e. Y^T = a*M + M B^T.
  const int s = static_cast<int>(l.short_side), lo = static_cast<int>(l.long_side);
  const internal::NsCoefficients k = internal::MakeNsCoefficients(p);
  const float one = 1.0f, zero = 0.0f;
  for (int it = 0; it < p.ns_steps; ++it) {
    OPTSTATE_RETURN_IF_CUDA(FromCublas(cublas.sgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, s, s, lo, &one, x, lo, x, lo, &zero, a, s)));
    OPTSTATE_RETURN_IF_CUDA(cudaMemcpyAsync(b, a, sizeof(float) * s * s, cudaMemcpyDeviceToDevice, st));
    OPTSTATE_RETURN_IF_CUDA(FromCublas(cublas.sgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, s, s, s, &k.c, a, s, a, s, &k.b, b, s)));
    OPTSTATE_RETURN_IF_CUDA(cudaMemcpyAsync(y, x, sizeof(float) * n, cudaMemcpyDeviceToDevice, st));
    OPTSTATE_RETURN_IF_CUDA(FromCublas(cublas.sgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, lo, s, s, &one, x, lo, b, s, &k.a, y, lo)));
    float* tmp = x;
    x = y;
    y = tmp;
  }
  return LaunchApply(t, rows, cols, l.transposed, internal::MakeMuonApplyScalars(p, rows, cols), x, st);
}

}  // namespace optstate::kernels
