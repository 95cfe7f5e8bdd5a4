// Launch-shape knobs of the CUDA Adam kernel, for benchmarks and tuning
// (kernels/bench/). Internal to kernels/; AdamStepCuda uses the defaults.
#pragma once

#include <cstddef>

#include "kernels/adam.h"

namespace optstate::kernels::internal {

struct LaunchConfig {
  int threads_per_block = 256;  // 128, 256 or 512
  int unroll = 2;               // 4-element groups per thread per loop trip: 1, 2 or 4
  int blocks_per_sm = 0;        // resident blocks per SM to launch; 0 = occupancy maximum
  bool force_scalar = false;    // take the scalar path even when aligned (tests)
};

// AdamStepCuda with an explicit launch shape; same contract and return codes
// (cudaErrorInvalidValue for a config outside the values above).
int AdamStepCudaWithConfig(const AdamTensors& t, size_t count, const AdamParams& p,
                           const LaunchConfig& config, void* stream);

}  // namespace optstate::kernels::internal
