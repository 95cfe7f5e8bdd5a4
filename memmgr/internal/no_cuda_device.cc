// Built instead of cuda_device.cc when this build has no CUDA toolkit.
#include "memmgr/internal/device.h"

namespace optstate::memmgr::internal {

int CudaDeviceCount() { return 0; }

Result<std::unique_ptr<Device>> NewCudaDevice(int, bool) {
  return Unimplemented("cuda backend: this build of optstate has no CUDA support (OPTSTATE_WITH_CUDA=OFF)");
}

}  // namespace optstate::memmgr::internal
