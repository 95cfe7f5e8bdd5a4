// Built instead of momentum_cuda.cu and muon_cuda.cu when nvcc is absent: the
// CUDA entry points of Lion, SGD and Muon exist and report
// cudaErrorNotSupported (801).
#include "kernels/momentum.h"
#include "kernels/muon.h"

namespace optstate::kernels {
namespace {
constexpr int kCudaErrorNotSupported = 801;
}  // namespace

int LionStepCuda(const MomentumTensors&, size_t, const LionParams&, void*) { return kCudaErrorNotSupported; }
int SgdStepCuda(const MomentumTensors&, size_t, const SgdParams&, void*) { return kCudaErrorNotSupported; }
int MuonStepCuda(const MuonTensors&, size_t, size_t, const MuonParams&, void*, void*) {
  return kCudaErrorNotSupported;
}

}  // namespace optstate::kernels
