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
#include <utility>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace daf {
namespace transpose {

constexpr int64_t kTile = 32;
constexpr int64_t kGrainElements = 32768;  // below this one thread is faster

#if defined(__SSE2__)
// A 16 x 16 block of bytes (ReLU masks restored as bool): four rounds of SSE2 unpacks, each
// interleaving twice as many bytes as the last; out row k is column k of the block.
inline void transpose_16x16_bytes(const uint8_t* src, int64_t ld_src, uint8_t* dst, int64_t ld_dst) {
  __m128i r[16], b[16], c[16], d[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ld_src));
  for (int i = 0; i < 8; ++i) {  // rows 2i, 2i+1: columns 0-7, then 8-15
    b[2 * i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
    b[2 * i + 1] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
  }
  for (int q = 0; q < 4; ++q) {  // rows 4q..4q+3: columns 0-3, 4-7, 8-11, 12-15
    c[4 * q] = _mm_unpacklo_epi16(b[4 * q], b[4 * q + 2]);
    c[4 * q + 1] = _mm_unpackhi_epi16(b[4 * q], b[4 * q + 2]);
    c[4 * q + 2] = _mm_unpacklo_epi16(b[4 * q + 1], b[4 * q + 3]);
    c[4 * q + 3] = _mm_unpackhi_epi16(b[4 * q + 1], b[4 * q + 3]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 8h..8h+7: columns 2k, 2k+1 in d[8h + k]
    for (int j = 0; j < 4; ++j) {
      d[8 * h + 2 * j] = _mm_unpacklo_epi32(c[8 * h + j], c[8 * h + 4 + j]);
      d[8 * h + 2 * j + 1] = _mm_unpackhi_epi32(c[8 * h + j], c[8 * h + 4 + j]);
    }
  }
  for (int k = 0; k < 8; ++k) {  // all 16 rows: columns 2k and 2k+1
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * k) * ld_dst), _mm_unpacklo_epi64(d[k], d[8 + k]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * k + 1) * ld_dst), _mm_unpackhi_epi64(d[k], d[8 + k]));
  }
}
#endif

#if defined(__SSE2__)
// An 8 x 8 block of 16-bit values (bfloat16 and float16 bit patterns): three rounds of SSE2 unpacks.
inline void transpose_8x8_halfwords(const uint16_t* src, int64_t ld_src, uint16_t* dst, int64_t ld_dst) {
  __m128i r[8], a[8], b[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ld_src));
  for (int i = 0; i < 4; ++i) {  // rows 2i, 2i+1 interleaved: columns 0-3, then 4-7
    a[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 4h..4h+3: columns (0,1), (2,3), (4,5), (6,7)
    b[4 * h] = _mm_unpacklo_epi32(a[4 * h], a[4 * h + 2]);
    b[4 * h + 1] = _mm_unpackhi_epi32(a[4 * h], a[4 * h + 2]);
    b[4 * h + 2] = _mm_unpacklo_epi32(a[4 * h + 1], a[4 * h + 3]);
    b[4 * h + 3] = _mm_unpackhi_epi32(a[4 * h + 1], a[4 * h + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // columns 2k and 2k+1 of all 8 rows
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * k) * ld_dst), _mm_unpacklo_epi64(b[k], b[4 + k]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * k + 1) * ld_dst), _mm_unpackhi_epi64(b[k], b[4 + k]));
  }
}
#endif

#if defined(__AVX__)
// An 8 x 8 block of 32-bit values: unpacks, shuffles and lane swaps move bit patterns unchanged.
// Written here because at::vec's 8 x 8 transpose is vectorized only in its AVX2 build; under
// CPU_CAPABILITY_AVX512 it falls back to a scalar loop (5x slower than PyTorch's own copy).
inline void transpose_8x8_words(const float* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  __m256 r[8], t[8], s[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld_src);
  for (int i = 0; i < 4; ++i) {  // t[2i], t[2i+1]: rows 2i, 2i+1 interleaved
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // four rows' worth of each column pair, per 128-bit lane
    s[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {  // out rows k and k + 4: the low and the high lanes
    _mm256_storeu_ps(dst + k * ld_dst, _mm256_permute2f128_ps(s[k], s[4 + k], 0x20));
    _mm256_storeu_ps(dst + (k + 4) * ld_dst, _mm256_permute2f128_ps(s[k], s[4 + k], 0x31));
  }
}
#endif

// Square B x B blocks of [c0, c1) x [p0, p1), each moved by transpose(block src, block dst); returns the
// ends the whole blocks reached (c0 + whole multiples of B, p0 + the same), for the caller's tail.
template <int B, typename U, typename Transpose>
inline std::pair<int64_t, int64_t> move_whole_blocks(const U* src, int64_t ld_src, U* dst, int64_t ld_dst, int64_t c0,
                                                      int64_t c1, int64_t p0, int64_t p1, Transpose transpose) {
  const int64_t c_blocks = c0 + (c1 - c0) / B * B, p_blocks = p0 + (p1 - p0) / B * B;
  for (int64_t ch = c0; ch < c_blocks; ch += B) {
    for (int64_t p = p0; p < p_blocks; p += B) transpose(src + ch * ld_src + p, dst + p * ld_dst + ch);
  }
  return {c_blocks, p_blocks};
}

// dst[p * ld_dst + ch] = src[ch * ld_src + p] for ch in [c0, c1), p in [p0, p1): whole blocks through
// registers where the element width has a block transpose (moving bit patterns is exact), then the rest.
template <typename U>
inline void move_block(const U* src, int64_t ld_src, U* dst, int64_t ld_dst, int64_t c0, int64_t c1, int64_t p0,
                       int64_t p1) {
  std::pair<int64_t, int64_t> reached{c0, p0};
  if constexpr (sizeof(U) == 4) {
    reached = move_whole_blocks<8>(src, ld_src, dst, ld_dst, c0, c1, p0, p1, [&](const U* from, U* to) {
#if defined(__AVX__)
      transpose_8x8_words(reinterpret_cast<const float*>(from), ld_src, reinterpret_cast<float*>(to), ld_dst);
#else
      at::vec::transpose_mxn<float, 8, 8>(reinterpret_cast<const float*>(from), ld_src, reinterpret_cast<float*>(to),
                                          ld_dst);
#endif
    });
  }
#if defined(__SSE2__)
  if constexpr (sizeof(U) == 2) {
    reached = move_whole_blocks<8>(src, ld_src, dst, ld_dst, c0, c1, p0, p1, [&](const U* from, U* to) {
      transpose_8x8_halfwords(reinterpret_cast<const uint16_t*>(from), ld_src, reinterpret_cast<uint16_t*>(to), ld_dst);
    });
  }
  if constexpr (sizeof(U) == 1) {
    reached = move_whole_blocks<16>(src, ld_src, dst, ld_dst, c0, c1, p0, p1, [&](const U* from, U* to) {
      transpose_16x16_bytes(reinterpret_cast<const uint8_t*>(from), ld_src, reinterpret_cast<uint8_t*>(to), ld_dst);
    });
  }
#endif
  const auto [c_blocks, p_blocks] = reached;
  for (int64_t p = p0; p < p1; ++p) {  // what the blocks left: the last rows and columns
    U* row = dst + p * ld_dst;
    for (int64_t ch = (p < p_blocks ? c_blocks : c0); ch < c1; ++ch) row[ch] = src[ch * ld_src + p];
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
