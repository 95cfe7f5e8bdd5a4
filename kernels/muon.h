// Muon (Keller Jordan, "Muon: An optimizer for hidden layers in neural
// networks", 2024; Moonlight, Liu et al. 2025) over one whole matrix.
//
// A matrix is the unit of work: Newton-Schulz needs all of it. One call, for
// a rows x cols matrix stored row-major (a contiguous 2-D torch tensor):
//   1. momentum, elementwise (Keller Jordan's EMA form):
//        m = beta*m + (1-beta)*g;  u = (1-beta)*g + beta*m (Nesterov) or m
//      stored as the field "momentum_buffer" (fp32 or bf16);
//   2. Newton-Schulz orthogonalisation of u: X = u / (||u||_F + eps)
//      (Keller Jordan's reference; torch.optim.Muon divides by
//      max(||u||_F, eps) instead: MuonNormEps), taken with the short side
//      first (X is min x max), then ns_steps times
//        A = X X^T;  B = b*A + c*A A;  X = a*X + B X
//      with (a, b, c) by default the quintic coefficients of Keller Jordan's
//      reference (3.4445, -4.7750, 2.0315);
//   3. p = p*(1 - lr*wd) - lr*scale*X (decoupled weight decay), scale the
//      shape scale of MuonScale, and the parameter copy written as for Adam.
// Newton-Schulz runs in fp32 on both backends (Keller's reference runs it in
// bf16; fp32 costs 2-4x the FLOPs of bf16 tensor cores but a matrix step is
// small beside its disk I/O): the CPU reference stores X, A and B in fp32
// and accumulates each dot product in fp64; CUDA uses cuBLAS SGEMM in fp32
// (CUBLAS_COMPUTE_32F, no TF32). The elementwise steps 1 and 3 share their
// math with the CPU (kernels/internal/momentum_math.h) and are bit-identical;
// the matrix products differ in summation order, so CUDA results agree with
// the CPU's to the bound kernels_gpu_test states, not bit for bit.
// found_inf and grad_scale as kernels/adam.h.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "base/dtype.h"

namespace optstate::kernels {

inline constexpr double kMuonNsA = 3.4445;
inline constexpr double kMuonNsB = -4.7750;
inline constexpr double kMuonNsC = 2.0315;

// The shape scale of the orthogonalised update.
enum class MuonScale : uint8_t {
  // Moonlight's: 0.2 * sqrt(max(rows, cols)), which gives the update the RMS
  // of a typical AdamW update, so one lr serves the Muon and AdamW params of
  // one optimizer (Moonlight, Megatron-core's "unit_rms_norm").
  kMatchAdamW = 0,
  // Keller Jordan's reference (torch.optim.Muon's "original"):
  // sqrt(max(1, rows / cols)).
  kShape = 1,
  // Bernstein's spectral condition (torch.optim.Muon's
  // "spectral_unclamped"): sqrt(rows / cols).
  kSpectral = 2,
};

// How eps enters the Frobenius norm Newton-Schulz divides by.
enum class MuonNormEps : uint8_t {
  kAdd = 0,    // ||u|| + eps (Keller Jordan's reference)
  kClamp = 1,  // max(||u||, eps) (torch.optim.Muon)
};

inline double MuonShapeScale(MuonScale s, size_t rows, size_t cols) {
  const double r = static_cast<double>(rows), c = static_cast<double>(cols);
  if (s == MuonScale::kShape) return std::sqrt(std::fmax(1.0, r / c));
  if (s == MuonScale::kSpectral) return std::sqrt(r / c);
  return 0.2 * std::sqrt(std::fmax(r, c));
}

struct MuonParams {
  double lr = 0.02;
  double momentum = 0.95;
  bool nesterov = true;
  double weight_decay = 0.0;  // decoupled: p *= 1 - lr * weight_decay
  int ns_steps = 5;           // Newton-Schulz iterations, >= 0
  MuonScale scale = MuonScale::kMatchAdamW;
  double eps = 1e-7;          // joins the Frobenius norm before dividing (norm_eps)
  MuonNormEps norm_eps = MuonNormEps::kAdd;
  double ns_a = kMuonNsA, ns_b = kMuonNsB, ns_c = kMuonNsC;  // Newton-Schulz coefficients (rounded to fp32)
  float grad_scale = 1.0f;    // grads are multiplied by 1/grad_scale
};

struct MuonTensors {
  float* main = nullptr;                  // rows x cols fp32 master weights (in/out)
  void* momentum = nullptr;               // in/out, moment_type
  MomentDType moment_type = MomentDType::kF32;  // kF32 or kBF16
  const void* grad = nullptr;             // in
  DType grad_type = DType::kF32;          // kF32, kBF16, kF16
  void* param = nullptr;                  // model-parameter copy (out), may be null
  std::optional<DType> param_type = std::nullopt;
  const float* found_inf = nullptr;       // device (CUDA) / host (CPU) flag; may be null
};

// Bytes of scratch one matrix step needs beside its tensors: X and its next
// iterate (2 x rows x cols fp32), A and B (2 x min^2 fp32) and 256 bytes for
// the norm. With the tensors themselves (main 4, momentum 2-4, grad 2-4 B
// per element) this is a matrix's working set, which a device budget must
// hold for the largest matrix. (cuBLAS keeps a small workspace of its own
// per handle, outside this.)
size_t MuonWorkspaceBytes(size_t rows, size_t cols);

// CPU reference. `workspace` is MuonWorkspaceBytes(rows, cols) bytes, 8-byte
// aligned. Returns false (and writes nothing) for unsupported types, null
// pointers, ns_steps < 0 or an empty matrix.
bool MuonStepCpu(const MuonTensors& t, size_t rows, size_t cols, const MuonParams& p, void* workspace,
                 int threads = 1);

// CUDA: elementwise kernels and cuBLAS (loaded at run time: libcublas.so.13
// or .12, so binaries start without it), on `stream` (a cudaStream_t) with a
// cuBLAS handle per calling thread. `d_workspace` is device memory of
// MuonWorkspaceBytes(rows, cols), 256-byte aligned. Returns a cudaError_t as
// int: cudaErrorInvalidValue (1) as MuonStepCpu's false;
// cudaErrorSharedObjectInitFailed (303) when cuBLAS cannot be loaded;
// cudaErrorMemoryAllocation (2) when cuBLAS cannot allocate; cudaErrorUnknown
// (999) for another cuBLAS failure; cudaErrorNotSupported (801) without CUDA.
int MuonStepCuda(const MuonTensors& t, size_t rows, size_t cols, const MuonParams& p, void* d_workspace,
                 void* stream);

// Newton-Schulz alone on the CPU (for tests and references): x is a rows x
// cols row-major fp32 matrix, replaced by its orthogonalisation (step 2
// above); workspace as MuonStepCpu's.
void NewtonSchulzCpu(float* x, size_t rows, size_t cols, int ns_steps, double eps, void* workspace,
                     int threads = 1);

}  // namespace optstate::kernels
