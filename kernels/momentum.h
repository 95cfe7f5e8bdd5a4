// Lion and SGD with momentum over one contiguous element range: the
// single-moment elementwise update rules.
//
// One pass reads fp32 main, the rule's one moment (fp32 or bf16:
// moment_type) and the gradient (bf16, fp16 or fp32), writes main and the
// moment back, and writes the updated model-parameter copy (bf16, fp16, fp32,
// or none) in the same pass, with the conventions of kernels/adam.h: an
// optional gradient scale (grads multiplied by 1/grad_scale), a found-inf
// flag that skips the update entirely (nothing is written), launchers that
// return a cudaError_t as int, allocate nothing, take the stream last and
// accept any count (0 included) and element-aligned pointers. The CPU and
// CUDA implementations share their per-element math
// (kernels/internal/momentum_math.h) and are bit-identical.
//
//  - Lion (Chen et al. 2023, "Symbolic Discovery of Optimization
//    Algorithms"): c = beta1*m + (1-beta1)*g; p = p*(1 - lr*wd) - lr*sign(c);
//    m = beta2*m + (1-beta2)*g. sign(0) = 0, as torch.sign. The moment is
//    stored as the field "exp_avg".
//  - SGD with momentum, as torch.optim.SGD: g = -g if maximize; g += wd*p;
//    b = g on a tensor's first update, else b = momentum*b + (1-dampening)*g;
//    g = g + momentum*b (Nesterov) or b; p = p - lr*g. The buffer is stored as
//    the field "momentum_buffer"; with momentum 0 it is neither read nor
//    written (and may be null), as torch keeps none.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "base/dtype.h"

namespace optstate::kernels {

// Hyperparameters in double as a trainer holds them; every per-call constant
// (1 - beta, 1 - lr*wd, ...) is derived in double and rounded to fp32 once.
struct LionParams {
  double lr = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.99;
  double weight_decay = 0.0;  // decoupled: p *= 1 - lr * weight_decay
  float grad_scale = 1.0f;    // grads are multiplied by 1/grad_scale
};

struct SgdParams {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;  // L2, added to the gradient (torch.optim.SGD)
  bool nesterov = false;      // REQUIRES: momentum > 0 and dampening == 0, as torch
  bool maximize = false;
  // This tensor's update count after this update (>= 1); 1 starts the
  // momentum buffer as the gradient itself, as torch does on its first step.
  uint64_t step = 1;
  float grad_scale = 1.0f;
};

// The tensors of one update; bf16 moments are decoded exactly, updated in
// fp32 and rounded back to nearest even, as AdamTensors' are.
struct MomentumTensors {
  float* main = nullptr;             // fp32 master weights (in/out)
  void* moment = nullptr;            // in/out, moment_type (Lion exp_avg, SGD momentum_buffer)
  MomentDType moment_type = MomentDType::kF32;  // kF32 or kBF16
  const void* grad = nullptr;        // in
  DType grad_type = DType::kF32;     // kF32, kBF16, kF16
  void* param = nullptr;             // model-parameter copy (out), may be null
  std::optional<DType> param_type = std::nullopt;  // kF32, kBF16, kF16; none: no copy
  const float* found_inf = nullptr;  // device (CUDA) / host (CPU) flag; may be null
};

// CPU implementations; with threads > 1 the range is split across that many
// std::threads. Return false (and write nothing) for unsupported types,
// null pointers, step 0 or an invalid combination (nesterov without momentum
// or with dampening).
bool LionStepCpu(const MomentumTensors& t, size_t count, const LionParams& p, int threads = 1);
bool SgdStepCpu(const MomentumTensors& t, size_t count, const SgdParams& p, int threads = 1);

// CUDA launchers (stream: a cudaStream_t). cudaErrorInvalidValue (1) where
// the CPU versions return false or a pointer is misaligned for its type;
// cudaErrorNotSupported (801) in a build without CUDA. Bit-identical to the
// CPU versions.
int LionStepCuda(const MomentumTensors& t, size_t count, const LionParams& p, void* stream);
int SgdStepCuda(const MomentumTensors& t, size_t count, const SgdParams& p, void* stream);

}  // namespace optstate::kernels
