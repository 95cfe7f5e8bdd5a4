// Built instead of adam_cuda.cu when nvcc is absent.
#include "kernels/adam.h"
namespace optstate::kernels {
int AdamStepCuda(const AdamTensors&, size_t, const AdamParams&, void*) { return 801; }  // cudaErrorNotSupported
bool CudaKernelsBuilt() { return false; }
}  // namespace optstate::kernels
