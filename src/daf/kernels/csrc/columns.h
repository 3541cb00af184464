// The largest magnitude of each column of a row-major float32 matrix (src/daf/kernels/reduce_ops.py
// holds the plain-PyTorch statement; the tests hold both equal).
//
// Why a kernel: the Outliers codec picks its outlier channels, and scales its tokens, by this
// reduction over every save it splits; PyTorch's way without a full-size temporary is two
// reductions (amax, then amin), two passes over the matrix: 26 ms of a SmolLM2 step at batch 8.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace daf {
namespace columns {

constexpr int64_t kColumns = 256;  // columns per work unit: their maxima stay in L1 across the rows

// out[c] = max over r of |m[r][c]| for m [rows, cols] (rows >= 1); NaN where the column holds a NaN.
// The running maximum takes a NaN and then keeps it (no value compares above NaN), as
// torch.maximum propagates it. One pass over m; each thread owns whole blocks of columns.
inline void absmax(const float* m, int64_t rows, int64_t cols, float* out) {
  const int64_t blocks = (cols + kColumns - 1) / kColumns;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, rows * kColumns));
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    alignas(64) float peak[kColumns];
    for (int64_t b = first; b < last; ++b) {
      const int64_t c0 = b * kColumns, n = std::min(kColumns, cols - c0);
      std::fill(peak, peak + n, 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = m + r * cols + c0;
        for (int64_t j = 0; j < n; ++j) {
          const float a = std::fabs(row[j]);
          peak[j] = (a > peak[j] || a != a) ? a : peak[j];
        }
      }
      std::memcpy(out + c0, peak, n * sizeof(float));
    }
  });
}

}  // namespace columns
}  // namespace daf
