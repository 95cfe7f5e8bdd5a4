// Launch-shape knobs of the CUDA Adam kernel, for benchmarks and tuning
// (kernels/bench/). Internal to kernels/; AdamStepCuda uses the defaults.
#pragma once

#include <cstddef>

#include "kernels/adam.h"

namespace optstate::kernels::internal {

// Defaults: the fastest shape of the H200 sweep on 2^28 elements
// (docs/KERNELS.md): 512 threads, 4 groups per thread, a grid of up to 32
// blocks per SM (more than are resident: shorter grid-stride loops balance
// better than one wave of long ones).
struct LaunchConfig {
  int threads_per_block = 512;  // 128, 256 or 512
  int unroll = 4;               // 4-element groups per thread per loop trip: 1, 2 or 4
  int blocks_per_sm = 32;       // grid cap in blocks per SM; 0 = resident maximum (occupancy)
  // Shrink unroll, then threads_per_block, until the grid has >= 4 blocks per
  // SM, so small ranges (one 2 MiB chunk) still spread over every SM.
  bool adaptive = true;
};

// AdamStepCuda with an explicit launch shape; same contract and return codes
// (cudaErrorInvalidValue for a config outside the values above).
int AdamStepCudaWithConfig(const AdamTensors& t, size_t count, const AdamParams& p,
                           const LaunchConfig& config, void* stream);

}  // namespace optstate::kernels::internal
