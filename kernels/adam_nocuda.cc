// Built instead of adam_cuda.cu when nvcc is absent: the CUDA entry points
// exist and report cudaErrorNotSupported (801).
#include "kernels/adam.h"
#include "kernels/internal/launch_config.h"

namespace optstate::kernels {
namespace {
constexpr int kCudaErrorNotSupported = 801;
}  // namespace

int AdamStepCuda(const AdamTensors&, size_t, const AdamParams&, void*) {
  return kCudaErrorNotSupported;
}
int AdamStepCudaQ8(const AdamQ8Tensors&, size_t, const AdamParams&, void*) { return kCudaErrorNotSupported; }
bool CudaKernelsBuilt() { return false; }

namespace internal {
int AdamStepCudaWithConfig(const AdamTensors&, size_t, const AdamParams&, const LaunchConfig&,
                           void*) {
  return kCudaErrorNotSupported;
}
}  // namespace internal
}  // namespace optstate::kernels
