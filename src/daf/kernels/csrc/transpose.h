// NCHW -> NHWC (channels-last) copy of a contiguous 4-D tensor, on elements' bit patterns
// (src/daf/kernels/layout_ops.py holds the plain-PyTorch statement; the tests hold both bit for bit).
//
// Why a kernel: PyTorch copies the batched transpose element by element along the destination, each
// read a different cache line of the source; at 64 channels x 28 x 28 x 128 that is 3.6x the time
// of decoding the same tensor. Here each thread moves kTile x kTile blocks, whose source lines
// (kTile rows) and destination lines stay in L1 while the block is moved.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

namespace daf {
namespace transpose {

constexpr int64_t kTile = 32;
constexpr int64_t kGrainElements = 32768;  // below this one thread is faster

// dst[p * ld_dst + ch] = src[ch * ld_src + p] for ch in [c0, c1), p in [p0, p1).
template <typename U>
inline void move_block(const U* src, int64_t ld_src, U* dst, int64_t ld_dst, int64_t c0, int64_t c1, int64_t p0,
                       int64_t p1) {
  int64_t c8 = c0, p8 = p0;
  if constexpr (sizeof(U) == 4) {  // 8 x 8 blocks through registers; moving float bit patterns is exact
    c8 = c0 + (c1 - c0) / 8 * 8;
    p8 = p0 + (p1 - p0) / 8 * 8;
    for (int64_t ch = c0; ch < c8; ch += 8) {
      for (int64_t p = p0; p < p8; p += 8) {
        at::vec::transpose_mxn<float, 8, 8>(reinterpret_cast<const float*>(src + ch * ld_src + p), ld_src,
                                            reinterpret_cast<float*>(dst + p * ld_dst + ch), ld_dst);
      }
    }
  }
  for (int64_t p = p0; p < p1; ++p) {  // what the 8 x 8 blocks left: the last rows and columns
    U* row = dst + p * ld_dst;
    for (int64_t ch = (p < p8 ? c8 : c0); ch < c1; ++ch) row[ch] = src[ch * ld_src + p];
  }
}

// Columns [p0, p1) of one image: dst[p][ch] = src[ch][p], in kTile x kTile blocks.
template <typename U>
inline void columns_to_nhwc(const U* src, U* dst, int64_t c, int64_t hw, int64_t p0, int64_t p1) {
  for (int64_t c0 = 0; c0 < c; c0 += kTile) move_block(src, hw, dst, c, c0, std::min(c0 + kTile, c), p0, p1);
}

// One image on the calling thread: dst[p][ch] = src[ch][p] for ch < c, p < hw.
template <typename U>
inline void image_to_nhwc(const U* src, U* dst, int64_t c, int64_t hw) {
  for (int64_t p0 = 0; p0 < hw; p0 += kTile) columns_to_nhwc(src, dst, c, hw, p0, std::min(p0 + kTile, hw));
}

// dst[i][p][ch] = src[i][ch][p] for i < n, ch < c, p < hw; U: the unsigned type of the element's width.
template <typename U>
void nchw_to_nhwc(const U* src, U* dst, int64_t n, int64_t c, int64_t hw) {
  const int64_t tiles = (hw + kTile - 1) / kTile;
  const int64_t per_tile = std::max<int64_t>(1, c * kTile);
  at::parallel_for(0, n * tiles, std::max<int64_t>(1, kGrainElements / per_tile), [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t i = t / tiles, p0 = (t % tiles) * kTile, p1 = std::min(p0 + kTile, hw);
      columns_to_nhwc(src + i * c * hw, dst + i * c * hw, c, hw, p0, p1);
    }
  });
}

}  // namespace transpose
}  // namespace daf
