// C ABI over the Adam and Muon kernels, for Python (ctypes) and other foreign callers:
// liboptstate_kernels_capi.so. Types are DType values (base/dtype.h: 0 = fp32,
// 1 = bf16, 2 = fp16; kernels::kNoDTypeCode = no parameter copy); mode is AdamMode (0 = Adam, 1 = AdamW).
// Hyperparameters are doubles (Python floats, passed as they are).
// Pointers are device pointers for the CUDA entry points and host pointers for
// the CPU one; nothing is allocated or retained. Thread-safety: as the
// launchers (any thread; calls on one stream run in order).
#include <cstdint>

#include "kernels/adam.h"
#include "kernels/internal/launch_config.h"
#include "kernels/muon.h"

#define OPTSTATE_CAPI extern "C" __attribute__((visibility("default")))

namespace {

using optstate::kernels::AdamMode;
using optstate::kernels::AdamParams;
using optstate::kernels::AdamTensors;

// t with the operands every kernel takes alike, from the C codes.
template <typename Tensors>
Tensors WithOperands(Tensors t, const void* grad, int grad_type, void* param, int param_type,
                     const float* found_inf) {
  t.grad = grad;
  t.grad_type = static_cast<optstate::DType>(grad_type);
  t.param = param;
  if (param_type != optstate::kernels::kNoDTypeCode) t.param_type = static_cast<optstate::DType>(param_type);
  t.found_inf = found_inf;
  return t;
}

AdamTensors MakeTensors(float* main, void* exp_avg, void* exp_avg_sq, const void* grad,
                        int grad_type, void* param, int param_type, const float* found_inf) {
  AdamTensors t;
  t.main = main;
  t.exp_avg = exp_avg;
  t.exp_avg_sq = exp_avg_sq;
  return WithOperands(t, grad, grad_type, param, param_type, found_inf);
}

AdamParams MakeParams(double lr, double beta1, double beta2, double eps, double weight_decay, int mode,
                      uint64_t step, float grad_scale) {
  AdamParams p;
  p.lr = lr;
  p.beta1 = beta1;
  p.beta2 = beta2;
  p.eps = eps;
  p.weight_decay = weight_decay;
  p.mode = static_cast<AdamMode>(mode);
  p.step = step;
  p.grad_scale = grad_scale;
  return p;
}

}  // namespace

// AdamStepCuda; returns a cudaError_t (0 = success). `stream` is a cudaStream_t.
OPTSTATE_CAPI int optstate_adam_step(float* main, void* exp_avg, void* exp_avg_sq,
                                     const void* grad, int grad_type, void* param, int param_type,
                                     const float* found_inf, uint64_t count, double lr, double beta1,
                                     double beta2, double eps, double weight_decay, int mode,
                                     uint64_t step, float grad_scale, void* stream) {
  return optstate::kernels::AdamStepCuda(
      MakeTensors(main, exp_avg, exp_avg_sq, grad, grad_type, param, param_type, found_inf),
      count, MakeParams(lr, beta1, beta2, eps, weight_decay, mode, step, grad_scale), stream);
}

// Same with an explicit launch shape (benchmarks): threads_per_block in
// {128, 256, 512}, unroll in {1, 2, 4}, blocks_per_sm 0 = occupancy max;
// used as given (no adaptation to small counts).
OPTSTATE_CAPI int optstate_adam_step_config(float* main, void* exp_avg, void* exp_avg_sq,
                                            const void* grad, int grad_type, void* param,
                                            int param_type, const float* found_inf,
                                            uint64_t count, double lr, double beta1, double beta2,
                                            double eps, double weight_decay, int mode, uint64_t step,
                                            float grad_scale, int threads_per_block, int unroll,
                                            int blocks_per_sm, void* stream) {
  optstate::kernels::internal::LaunchConfig c;
  c.threads_per_block = threads_per_block;
  c.unroll = unroll;
  c.blocks_per_sm = blocks_per_sm;
  c.adaptive = false;
  return optstate::kernels::internal::AdamStepCudaWithConfig(
      MakeTensors(main, exp_avg, exp_avg_sq, grad, grad_type, param, param_type, found_inf),
      count, MakeParams(lr, beta1, beta2, eps, weight_decay, mode, step, grad_scale), c, stream);
}

// AdamStepCpu on host pointers; returns 0 on success, 1 for unsupported input.
OPTSTATE_CAPI int optstate_adam_step_cpu(float* main, void* exp_avg, void* exp_avg_sq,
                                         const void* grad, int grad_type, void* param,
                                         int param_type, const float* found_inf, uint64_t count,
                                         double lr, double beta1, double beta2, double eps,
                                         double weight_decay, int mode, uint64_t step,
                                         float grad_scale, int threads) {
  return optstate::kernels::AdamStepCpu(
             MakeTensors(main, exp_avg, exp_avg_sq, grad, grad_type, param, param_type, found_inf),
             count, MakeParams(lr, beta1, beta2, eps, weight_decay, mode, step, grad_scale),
             threads)
             ? 0
             : 1;
}

namespace {

optstate::kernels::MuonTensors MakeMuonTensors(float* main, void* momentum, int moment_type, const void* grad,
                                               int grad_type, void* param, int param_type,
                                               const float* found_inf) {
  optstate::kernels::MuonTensors t;
  t.main = main;
  t.momentum = momentum;
  t.moment_type = static_cast<optstate::MomentDType>(moment_type);
  return WithOperands(t, grad, grad_type, param, param_type, found_inf);
}

optstate::kernels::MuonParams MakeMuonParams(double lr, double momentum, int nesterov, double weight_decay,
                                             int ns_steps, int scale, float grad_scale) {
  optstate::kernels::MuonParams p;
  p.lr = lr;
  p.momentum = momentum;
  p.nesterov = nesterov != 0;
  p.weight_decay = weight_decay;
  p.ns_steps = ns_steps;
  p.scale = static_cast<optstate::kernels::MuonScale>(scale);
  p.grad_scale = grad_scale;
  return p;
}

}  // namespace

// Bytes of workspace one Muon step of a rows x cols matrix needs (MuonWorkspaceBytes).
OPTSTATE_CAPI uint64_t optstate_muon_workspace_bytes(uint64_t rows, uint64_t cols) {
  return optstate::kernels::MuonWorkspaceBytes(rows, cols);
}

// MuonStepCpu on host pointers (moment_type: MomentDType, 0 = f32, 1 = bf16;
// scale: MuonScale, 0 = Moonlight's 0.2 sqrt(max), 1 = Keller's); returns 0
// on success, 1 for unsupported input.
OPTSTATE_CAPI int optstate_muon_step_cpu(float* main, void* momentum, int moment_type, const void* grad,
                                         int grad_type, void* param, int param_type, const float* found_inf,
                                         uint64_t rows, uint64_t cols, double lr, double momentum_beta,
                                         int nesterov, double weight_decay, int ns_steps, int scale,
                                         float grad_scale, void* workspace, int threads) {
  return optstate::kernels::MuonStepCpu(
             MakeMuonTensors(main, momentum, moment_type, grad, grad_type, param, param_type, found_inf), rows,
             cols, MakeMuonParams(lr, momentum_beta, nesterov, weight_decay, ns_steps, scale, grad_scale),
             workspace, threads)
             ? 0
             : 1;
}

// MuonStepCuda on device pointers; returns a cudaError_t (0 = success).
OPTSTATE_CAPI int optstate_muon_step(float* main, void* momentum, int moment_type, const void* grad, int grad_type,
                                     void* param, int param_type, const float* found_inf, uint64_t rows,
                                     uint64_t cols, double lr, double momentum_beta, int nesterov,
                                     double weight_decay, int ns_steps, int scale, float grad_scale,
                                     void* workspace, void* stream) {
  return optstate::kernels::MuonStepCuda(
      MakeMuonTensors(main, momentum, moment_type, grad, grad_type, param, param_type, found_inf), rows, cols,
      MakeMuonParams(lr, momentum_beta, nesterov, weight_decay, ns_steps, scale, grad_scale), workspace, stream);
}

// 1 when the library contains the CUDA kernels, else 0.
OPTSTATE_CAPI int optstate_kernels_cuda_built() {
  return optstate::kernels::CudaKernelsBuilt() ? 1 : 0;
}
