// PLACEHOLDER: replaced by the kernels work.
#include "kernels/adam.h"
namespace optstate::kernels {
bool AdamStepCpu(const AdamTensors&, size_t, const AdamParams&, int) { return false; }
}  // namespace optstate::kernels
