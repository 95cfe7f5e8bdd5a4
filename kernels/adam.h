// Fused Adam / AdamW over one contiguous element range.
//
// One pass reads fp32 main, exp_avg and exp_avg_sq (fp32 or bf16: moment_type)
// and the gradient (bf16, fp16 or fp32), writes all three back, and writes the
// updated model-parameter copy (bf16, fp16, fp32, or none) in the same pass.
// Element types are base's DType and MomentDType (base/dtype.h), the one dtype
// vocabulary of optstate. Numerics follow torch.optim.AdamW (decoupled weight
// decay) and torch.optim.Adam (L2 weight decay added to the gradient), with
// bias correction from `step` (>= 1, the
// step count *after* this update, as torch counts). Optional gradient scale
// (grads multiplied by 1/grad_scale) and a found-inf flag: when *found_inf is
// nonzero the update is skipped entirely (nothing is written), like torch's
// fused AdamW.
//
// Launchers follow CUB: pointers, count, parameters, stream last; they return
// cudaError_t, allocate nothing, are correct for any count (0 included) and any
// 4-byte-aligned pointers, and take a 16-byte vectorised path when every
// pointer allows it. The CPU implementation (AdamStepCpu) is the same math for
// the host backend and the tests. kernels/ depends only on base/ of ours.
//
// This header has no CUDA include: the stream is passed as void* (a
// cudaStream_t) and the result as int (a cudaError_t), so host-only code can
// include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "base/dtype.h"

namespace optstate::kernels {

enum class AdamMode : uint8_t { kAdam = 0, kAdamW = 1 };

// Hyperparameters in double, as a trainer holds them (torch's param_groups
// are Python floats). The launchers derive every per-call constant (1 - beta,
// bias corrections, lr / (1 - beta1^step), lr * weight_decay) in double and
// round each to fp32 once, as torch.optim.AdamW does; rounding beta2 = 0.999
// to fp32 first would put 1 - beta2 1.3e-5 relative off.
struct AdamParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  AdamMode mode = AdamMode::kAdamW;
  uint64_t step = 1;          // step count after this update (>= 1)
  float grad_scale = 1.0f;    // grads are multiplied by 1/grad_scale
  bool maximize = false;      // reserved; must be false
};

// The tensors of one update. bf16 moments are decoded to fp32 (exactly),
// updated with the same fp32 operations as fp32 moments, and rounded back to
// nearest even: each stored moment is within a relative 2^-8 of the fp32
// value of that step (half a bf16 ulp: 8 significand bits), normal range.
struct AdamTensors {
  float* main = nullptr;                      // fp32 master weights (in/out)
  void* exp_avg = nullptr;                    // in/out, moment_type
  void* exp_avg_sq = nullptr;                 // in/out, moment_type
  // kF32 or kBF16; q8 moments take AdamQ8Tensors.
  MomentDType moment_type = MomentDType::kF32;
  const void* grad = nullptr;                 // in
  DType grad_type = DType::kF32;              // kF32, kBF16, kF16
  void* param = nullptr;                      // model-parameter copy (out), may be null
  std::optional<DType> param_type = std::nullopt;  // kF32, kBF16, kF16; none: no copy written
  const float* found_inf = nullptr;           // device (CUDA) / host (CPU) flag; may be null
};

// CUDA launcher. Returns a cudaError_t as int (0 = cudaSuccess); 
// cudaErrorInvalidValue (1) for unsupported types or misaligned pointers (fp32
// arrays need 4-byte, bf16/fp16 arrays 2-byte alignment). Bit-identical to
// AdamStepCpu for every supported type combination.
// `stream` is a cudaStream_t. Available only when built with CUDA; otherwise
// returns cudaErrorNotSupported (801).
int AdamStepCuda(const AdamTensors& t, size_t count, const AdamParams& p, void* stream);

// True when this build contains the CUDA kernels.
bool CudaKernelsBuilt();

// CPU implementation of the same math (vectorisable loop). With threads > 1
// the range is split across that many std::threads. Returns false (and writes
// nothing) for unsupported types.
bool AdamStepCpu(const AdamTensors& t, size_t count, const AdamParams& p, int threads = 1);

// 8-bit block-wise quantized moments (Dettmers et al., "8-bit Optimizers via
// Block-wise Quantization"; bitsandbytes' dynamic map with 7 exponent bits,
// signed for exp_avg, unsigned for exp_avg_sq; kernels/internal/adam_q8.h).
// Each block of kQ8BlockElems consecutive elements has one fp32 absmax per
// moment; an element is stored as the code whose map value is nearest to
// x / absmax. 256 elements per block as bitsandbytes' 8-bit Adam: 1/64 byte
// of scale per element and moment, and a block small enough that one outlier
// coarsens only 255 neighbours. The step decodes, updates in fp32 (the new
// main uses the unrounded moments), takes each block's new absmax and
// requantizes, in one pass; error per stored moment <= half the gap of the
// map around it times its block's absmax (<= 0.0071 x absmax, much finer
// near 0).
inline constexpr size_t kQ8BlockElems = optstate::kQ8BlockElems;  // base/dtype.h

struct AdamQ8Tensors {
  float* main = nullptr;                // fp32 master weights (in/out)
  uint8_t* exp_avg = nullptr;           // codes (in/out)
  float* exp_avg_absmax = nullptr;      // one per block (in/out)
  uint8_t* exp_avg_sq = nullptr;        // codes (in/out)
  float* exp_avg_sq_absmax = nullptr;   // one per block (in/out)
  const void* grad = nullptr;           // in
  DType grad_type = DType::kF32;        // kF32, kBF16, kF16
  void* param = nullptr;                // model-parameter copy (out), may be null
  std::optional<DType> param_type = std::nullopt;  // kF32, kBF16, kF16; none: no copy written
  const float* found_inf = nullptr;
};

// CPU and CUDA implementations of the q8 step over count elements whose first
// element starts a block (the last block may be partial): bit-identical to
// each other. Return values as AdamStepCpu / AdamStepCuda.
bool AdamStepCpuQ8(const AdamQ8Tensors& t, size_t count, const AdamParams& p, int threads = 1);
int AdamStepCudaQ8(const AdamQ8Tensors& t, size_t count, const AdamParams& p, void* stream);

// The value of code c of the exp_avg (signed) or exp_avg_sq (unsigned) map.
float Q8MapValue(bool is_signed, uint8_t c);

// Quantizes count fp32 values (the first starts a block) as the step stores
// a moment: each block's absmax = its max |x|, each code the map value
// nearest to x / absmax. codes: count bytes; absmax: ceil(count / 256).
void Q8Quantize(bool is_signed, const float* x, size_t count, uint8_t* codes, float* absmax);
// out[i] = map[codes[i]] x absmax[i / 256]: exactly the values the step decodes.
void Q8Dequantize(bool is_signed, const uint8_t* codes, const float* absmax, size_t count, float* out);

// Conversions used by both implementations (round-to-nearest-even).
uint16_t FloatToBf16(float f);
float Bf16ToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);

// The integer the C entry points (kernels/capi.cc; optstate/c.h's
// OPTSTATE_NONE, checked against it when the C ABI is built) pass where no
// tensor, and so no dtype, is given: outside base's DType table.
inline constexpr int kNoDTypeCode = 255;

// Element i of a host buffer of float dtype d (f32, bf16 or f16) as fp32,
// exactly: the one reader of "element i as float" for every folder (q8 codes
// decode only with their block's scale: Q8Dequantize). NaN for another d.
float ElementAsFloat(DType d, const void* data, uint64_t i);

}  // namespace optstate::kernels
