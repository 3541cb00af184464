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
#include <vector>

namespace daf {
namespace columns {

constexpr int64_t kColumns = 256;  // columns per work unit: their maxima stay in L1 across the rows
constexpr int64_t kChunkElements = 1 << 15;  // rows are cut into chunks of at least this many elements

// The NaN-keeping maximum: a NaN, once taken, stays (no value compares above NaN), as torch.maximum.
inline float keep_max(float peak, float a) { return (a > peak || a != a) ? a : peak; }

// peak[j] = max over rows [r0, r1) of |m[r][c0 + j]|, j < n (0 for no rows).
inline void block_peaks(const float* m, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t n, float* peak) {
  std::fill(peak, peak + n, 0.0f);
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = m + r * cols + c0;
    for (int64_t j = 0; j < n; ++j) peak[j] = keep_max(peak[j], std::fabs(row[j]));
  }
}

// out[c] = max over r of |m[r][c]| for m [rows, cols] (rows >= 1); NaN where the column holds a NaN.
// One pass over m. Each work unit is a block of columns over a chunk of rows: a matrix with fewer than
// four column blocks per thread (attention's q, k, v: 32-64 columns, one block; a MiniLM norm input: 384,
// a block and a half) has its rows cut into chunks, one per thread, whose maxima are combined after (the
// maximum is the same in any order): whole blocks alone left threads idle or unevenly loaded.
inline void absmax(const float* m, int64_t rows, int64_t cols, float* out) {
  const int64_t blocks = (cols + kColumns - 1) / kColumns;
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = blocks >= 4 * threads ? 1
      : std::max<int64_t>(1, std::min<int64_t>(threads, rows * cols / kChunkElements));
  const int64_t per = (rows + chunks - 1) / chunks;
  std::vector<float> partial(static_cast<size_t>(chunks == 1 ? 0 : chunks * cols));
  float* target = chunks == 1 ? out : partial.data();
  const int64_t grain = chunks > 1 ? 1 : std::max<int64_t>(1, 32768 / std::max<int64_t>(1, rows * kColumns));
  at::parallel_for(0, chunks * blocks, grain, [&](int64_t first, int64_t last) {
    alignas(64) float peak[kColumns];
    for (int64_t u = first; u < last; ++u) {
      const int64_t chunk = u / blocks, b = u % blocks;
      const int64_t c0 = b * kColumns, n = std::min(kColumns, cols - c0);
      const int64_t r0 = std::min(rows, chunk * per), r1 = std::min(rows, r0 + per);
      block_peaks(m, cols, r0, r1, c0, n, peak);
      std::memcpy(target + chunk * cols + c0, peak, n * sizeof(float));
    }
  });
  if (chunks == 1) return;
  for (int64_t c = 0; c < cols; ++c) {
    float p = partial[c];
    for (int64_t k = 1; k < chunks; ++k) p = keep_max(p, partial[k * cols + c]);
    out[c] = p;
  }
}

}  // namespace columns
}  // namespace daf
