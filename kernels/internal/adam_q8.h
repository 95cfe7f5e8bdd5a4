// 8-bit block-wise dynamic quantization of Adam moments (Dettmers et al.,
// "8-bit Optimizers via Block-wise Quantization", 2022), shared operation for
// operation by the CPU loop and the CUDA kernel. Internal to kernels/.
//
// Maps: bitsandbytes' dynamic data type (create_dynamic_map, 7 exponent
// bits): a signed map for exp_avg and an unsigned one for exp_avg_sq (which is
// never negative), 256 values each in [-1, 1] resp. [0, 1], 0 and 1 included,
// dense near 0 (a decimal exponent per step, fraction bits for the rest). Each
// value is computed in double and rounded to fp32 once (Q8Maps), so both
// builds hold the same table. A block of kQ8BlockElems consecutive elements
// shares one fp32 absmax; an element is stored as the code whose map value is
// nearest to x / absmax (ties to the smaller value) and decodes to
// map[code] * absmax.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/adam.h"
#include "kernels/internal/adam_math.h"

namespace optstate::kernels::internal {

struct Q8Maps {
  float signed_map[256];    // ascending
  float unsigned_map[256];  // ascending
};

// bitsandbytes' create_dynamic_map(signed, max_exponent_bits = 7, total_bits = 8),
// sorted ascending, in double rounded to fp32.
inline void BuildDynamicMap(bool is_signed, float out[256]) {
  constexpr int kMaxExponentBits = 7, kTotalBits = 8;
  std::vector<double> data;
  const int non_sign_bits = kTotalBits - 1;
  const int additional_items = (1 << (non_sign_bits - kMaxExponentBits)) - 1;
  auto add_means = [&](int fraction_items, int i) {
    // torch.linspace(0.1, 1, fraction_items) and the midpoints of its steps.
    std::vector<double> b(static_cast<size_t>(fraction_items));
    for (int k = 0; k < fraction_items; ++k) {
      b[static_cast<size_t>(k)] = 0.1 + 0.9 * static_cast<double>(k) / static_cast<double>(fraction_items - 1);
    }
    const double scale = std::pow(10.0, static_cast<double>(-(kMaxExponentBits - 1) + i));
    for (int k = 0; k + 1 < fraction_items; ++k) {
      const double mean = (b[static_cast<size_t>(k)] + b[static_cast<size_t>(k) + 1]) / 2.0;
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-scale * mean);
    }
  };
  int i = 0;
  for (i = 0; i < kMaxExponentBits; ++i) {
    const int fraction_items = is_signed ? (1 << (i + non_sign_bits - kMaxExponentBits)) + 1
                                         : (1 << (i + non_sign_bits - kMaxExponentBits + 1)) + 1;
    add_means(fraction_items, i);
  }
  if (additional_items > 0) add_means(additional_items + 1, i - 1);
  data.push_back(0.0);
  data.push_back(1.0);
  while (data.size() < 256) data.push_back(0.0);  // bitsandbytes pads the unsigned map with zeros
  std::sort(data.begin(), data.end());
  for (size_t k = 0; k < 256; ++k) out[k] = static_cast<float>(data[k]);
}

inline const Q8Maps& GetQ8Maps() {
  static const Q8Maps maps = [] {
    Q8Maps m;
    BuildDynamicMap(true, m.signed_map);
    BuildDynamicMap(false, m.unsigned_map);
    return m;
  }();
  return maps;
}

// The code of the map value nearest to x (map ascending; ties to the smaller
// value). Comparisons only: the same result on every build.
OPTSTATE_HD uint8_t Q8Encode(const float* map, float x) {
  int lo = 0, hi = 255;  // first index with map[idx] >= x, by bisection
  if (x <= map[0]) return 0;
  if (x >= map[255]) return 255;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (map[mid] < x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  // map[lo - 1] < x <= map[lo]
  const float below = x - map[lo - 1], above = map[lo] - x;
  return static_cast<uint8_t>(above < below ? lo : lo - 1);
}

// The fp32 value stored for x in a block of absmax a (> 0): x / a in fp32.
OPTSTATE_HD float Q8Normalize(float x, float a) { return a > 0.0f ? x / a : 0.0f; }

OPTSTATE_HD float Q8Decode(const float* map, uint8_t code, float absmax) { return map[code] * absmax; }

}  // namespace optstate::kernels::internal
