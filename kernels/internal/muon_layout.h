// Where Muon's scratch lives in its workspace (kernels/muon.h), for the CPU
// and CUDA implementations alike. Internal to kernels/.
#pragma once

#include <algorithm>
#include <cstddef>

namespace optstate::kernels::internal {

// X is the update with its short side first: a rows x cols matrix with
// rows > cols is orthogonalised as its transpose (short_side x long_side,
// row-major). Each section starts at a 256-byte boundary.
struct MuonLayout {
  MuonLayout(size_t rows, size_t cols)
      : transposed(rows > cols), short_side(std::min(rows, cols)), long_side(std::max(rows, cols)) {
    const size_t matrix = Align(rows * cols * sizeof(float));
    const size_t square = Align(short_side * short_side * sizeof(float));
    x_offset = 0;
    y_offset = matrix;
    a_offset = 2 * matrix;
    b_offset = 2 * matrix + square;
    norm_offset = 2 * matrix + 2 * square;
    total_bytes = norm_offset + kAlign;
  }
  static size_t Align(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
  static constexpr size_t kAlign = 256;

  bool transposed;
  size_t short_side, long_side;
  size_t x_offset, y_offset, a_offset, b_offset, norm_offset, total_bytes;
};

}  // namespace optstate::kernels::internal
