// The Outliers codec's split and join along axis "channel" (src/daf/kernels/channel_ops.py holds the
// plain-PyTorch statement; tests/kernels/test_channel_ops.py holds both equal bit for bit).
//
// split: m [R, C] row-major, inliers [n] ascending channel numbers ->
//   scale[r]    = max over inliers j of |m[r, j]|, 1 where that is NaN, infinite or 0   (float32 [R])
//   coded[i, r] = float(m[r, inliers[i]]) / scale[r]                                    (float32 [n, R])
// join: coded [n, R], scale [R], outlier channels [k] with values [R, k] (float32) ->
//   out[r, inliers[i]] = coded[i, r] * scale[r], out[r, outliers[i]] = values[r, i]      (float32 [R, C])
//
// Why a kernel: the statement is a transposing copy, a row gather, a reduction and a division (the join:
// a product, two scattering copies and a transposing copy), each a full pass over the save. Here each
// thread takes kRows tokens at a time, gathers and scales them in a buffer that stays in L1/L2 and moves
// it into coded's columns in 8 x 8 register transposes: one read of m and one write of coded.
// Exactness: a maximum and one IEEE division (product) per element, as the statement; no FMA
// (-ffp-contract=off), and the bfloat16/float16 to float32 widening is exact (a narrow NaN excepted,
// whose float32 payload PyTorch's cast chooses: split reports NaN and channel_ops.py runs the statement).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "codes.h"
#include "transpose.h"

namespace daf {
namespace channels {

constexpr int64_t kRows = 64;                 // tokens per block: 64 x 4 bytes, four cache lines per channel
constexpr int64_t kGrainElements = 1 << 16;  // below this one thread is faster

inline int64_t grain_blocks(int64_t cols) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, kRows * cols));
}

// The largest |row[i]| (row already gathered), 1 where a NaN is (the statement's maximum propagates it;
// columns.h) or where the largest is infinite or 0. Sets `nan` when the row holds a NaN. In vectors:
// one running maximum is a chain of dependent max instructions, 4 cycles per element.
inline float row_scale(const float* row, int64_t n, bool& nan) {
  using V = at::vec::Vectorized<float>;
  V peak(0.0f);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) peak = at::vec::maximum(peak, V::loadu(row + i).abs());  // NaN-propagating
  alignas(64) float lanes[V::size()];
  peak.store(lanes);
  float largest = 0.0f;
  bool seen = false;
  for (int64_t l = 0; l < V::size(); ++l) {
    largest = lanes[l] > largest ? lanes[l] : largest;
    seen |= lanes[l] != lanes[l];
  }
  for (; i < n; ++i) {
    const float a = std::fabs(row[i]);
    largest = a > largest ? a : largest;
    seen |= a != a;
  }
  nan |= seen;
  return (!seen && std::isfinite(largest) && largest > 0.0f) ? largest : 1.0f;
}

// The inliers as runs of consecutive channels (all but the k outliers: at most k + 1 runs), so that a
// token's inliers move as a few contiguous copies instead of n one-element gathers.
struct Run {
  int64_t channel;  // first channel of the run in m's row
  int64_t offset;   // its position among the inliers
  int64_t length;
};

inline std::vector<Run> runs_of(const int64_t* inliers, int64_t n) {
  std::vector<Run> runs;
  for (int64_t i = 0; i < n;) {
    int64_t j = i + 1;
    while (j < n && inliers[j] == inliers[j - 1] + 1) ++j;
    runs.push_back(Run{inliers[i], i, j - i});
    i = j;
  }
  return runs;
}

// dst[p * ld_dst + c] = src[c * ld_src + p] for c < cs, p < ps, in 8 x 8 register transposes, p outermost:
// each destination row's values [0, cs) are written together (kRows floats, whole cache lines), where
// transpose.h's move_block goes c outermost and comes back to each destination row cs / 8 times. At
// [2048, 384], one thread: this part 0.5 ms with 32-token blocks, 0.22 ms with 64.
inline void transpose_rows_first(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t cs, int64_t ps) {
  const int64_t c8 = cs / 8 * 8, p8 = ps / 8 * 8;
  for (int64_t p = 0; p < p8; p += 8) {
    for (int64_t c = 0; c < c8; c += 8) {
#if defined(__AVX__)
      transpose::transpose_8x8_words(src + c * ld_src + p, ld_src, dst + p * ld_dst + c, ld_dst);
#else
      at::vec::transpose_mxn<float, 8, 8>(src + c * ld_src + p, ld_src, dst + p * ld_dst + c, ld_dst);
#endif
    }
    for (int64_t q = p; q < p + 8; ++q) {
      for (int64_t c = c8; c < cs; ++c) dst[q * ld_dst + c] = src[c * ld_src + q];
    }
  }
  for (int64_t q = p8; q < ps; ++q) {
    for (int64_t c = 0; c < cs; ++c) dst[q * ld_dst + c] = src[c * ld_src + q];
  }
}

// Per block of kRows tokens: their inlier values gathered into rows of a [kRows, n] buffer, each row
// scaled, then the block transposed into coded's columns [r0, r0 + kRows) in 8 x 8 register moves.
// Returns whether an inlier was NaN: a float16 or bfloat16 NaN widens to a float32 NaN whose payload
// PyTorch's own cast chooses (its vector and scalar paths differ), so the caller then runs the statement.
template <typename T>
bool split(const T* m, int64_t rows, int64_t cols, const int64_t* inliers, int64_t n, float* coded, float* scale) {
  const int64_t blocks = (rows + kRows - 1) / kRows;
  std::atomic<bool> any_nan{false};
  const std::vector<Run> runs = runs_of(inliers, n);
  at::parallel_for(0, blocks, grain_blocks(cols), [&](int64_t first, int64_t last) {
    std::vector<float> buffer(static_cast<size_t>(kRows * n));
    bool nan = false;
    for (int64_t b = first; b < last; ++b) {
      const int64_t r0 = b * kRows, count = std::min(kRows, rows - r0);
      for (int64_t r = 0; r < count; ++r) {
        const T* row = m + (r0 + r) * cols;
        float* gathered = buffer.data() + r * n;
        for (const Run& run : runs) {
          const T* from = row + run.channel;
          float* to = gathered + run.offset;
          for (int64_t i = 0; i < run.length; ++i) to[i] = static_cast<float>(from[i]);
        }
        const float s = row_scale(gathered, n, nan);
        scale[r0 + r] = s;
        for (int64_t i = 0; i < n; ++i) gathered[i] = gathered[i] / s;
      }
      transpose_rows_first(buffer.data(), n, coded + r0, rows, count, n);
    }
    if (nan) any_nan = true;
  });
  return any_nan;
}

// Tokens [r0, r0 + count) of the output from their inlier values in rows of `buffer` [count, n]: inliers
// scaled back, outliers from values.
inline void place_block(const float* buffer, const float* scale, int64_t r0, int64_t count, int64_t cols,
                        const std::vector<Run>& runs, int64_t n, const int64_t* outliers, const float* values,
                        int64_t k, float* out) {
  for (int64_t r = 0; r < count; ++r) {
    const float* from = buffer + r * n;
    const float s = scale[r0 + r];
    float* row = out + (r0 + r) * cols;
    for (const Run& run : runs) {
      const float* part = from + run.offset;
      float* to = row + run.channel;
      for (int64_t i = 0; i < run.length; ++i) to[i] = part[i] * s;
    }
    const float* row_values = values + (r0 + r) * k;
    for (int64_t i = 0; i < k; ++i) row[outliers[i]] = row_values[i];
  }
}

// Per block of kRows tokens: coded's columns [r0, r0 + kRows) transposed into a [kRows, n] buffer, then
// each token's row written out: inliers scaled back, outliers from values.
inline void join(const float* coded, const float* scale, int64_t rows, int64_t cols, const int64_t* inliers, int64_t n,
                 const int64_t* outliers, const float* values, int64_t k, float* out) {
  const int64_t blocks = (rows + kRows - 1) / kRows;
  const std::vector<Run> runs = runs_of(inliers, n);
  at::parallel_for(0, blocks, grain_blocks(cols), [&](int64_t first, int64_t last) {
    std::vector<float> buffer(static_cast<size_t>(kRows * n));
    for (int64_t b = first; b < last; ++b) {
      const int64_t r0 = b * kRows, count = std::min(kRows, rows - r0);
      transpose::move_block(reinterpret_cast<const uint32_t*>(coded + r0), rows,
                            reinterpret_cast<uint32_t*>(buffer.data()), n, 0, n, 0, count);
      place_block(buffer.data(), scale, r0, count, cols, runs, n, outliers, values, k, out);
    }
  });
}

// The join with the decode folded in: coded [n, rows] is read from its format-1 payload (groups of
// group_size elements in coded's row-major order), one block of kRows tokens at a time, decoded into a
// [n, kRows] staging buffer that stays in L2 and moved from there as join moves coded's columns. The
// decode of the whole [n, rows] matrix, written to memory and read back by the join, is gone. Needs
// rows % 8 == 0, so that every block of every channel starts on a whole byte at any width. The values
// are decode-then-join's bit for bit: the same decode_span per element, the same product by the scale.
template <int BITS>
void decode_join(const uint8_t* payload, int64_t group_size, const float* scale, int64_t rows, int64_t cols,
                 const int64_t* inliers, int64_t n, const int64_t* outliers, const float* values, int64_t k,
                 float* out) {
  const int64_t row_bytes = 4 + group_size * BITS / 8;
  const int64_t blocks = (rows + kRows - 1) / kRows;
  const std::vector<Run> runs = runs_of(inliers, n);
  at::parallel_for(0, blocks, grain_blocks(cols), [&](int64_t first, int64_t last) {
    std::vector<float> staged(static_cast<size_t>(n * kRows));
    std::vector<float> buffer(static_cast<size_t>(kRows * n));
    for (int64_t b = first; b < last; ++b) {
      const int64_t r0 = b * kRows, count = std::min(kRows, rows - r0);
      for (int64_t i = 0; i < n; ++i) {
        float* dst = staged.data() + i * kRows;
        for (int64_t at = i * rows + r0, end = at + count; at < end;) {
          const int64_t g = at / group_size, offset = at - g * group_size;
          const int64_t m = std::min(end, (g + 1) * group_size) - at;
          const uint8_t* row = payload + g * row_bytes;
          float lo, step;
          read_meta(row, lo, step);
          decode_span<BITS>(row + 4 + offset * BITS / 8, m, lo, step, dst);
          dst += m;
          at += m;
        }
      }
      transpose::move_block(reinterpret_cast<const uint32_t*>(staged.data()), kRows,
                            reinterpret_cast<uint32_t*>(buffer.data()), n, 0, n, 0, count);
      place_block(buffer.data(), scale, r0, count, cols, runs, n, outliers, values, k, out);
    }
  });
}

}  // namespace channels
}  // namespace daf
