// Quantize and pack 64 elements in AVX2 registers, for 1, 2 and 4 bits: the codes never go through
// a byte buffer. The portable path (codes.h: quantize64 then pack64) stores 64 one-byte codes and
// reads them back as words, and at 2 bits that round trip cost more than the quantizing itself
// (2-bit encode 60% slower than 4-bit on this machine's AVX2). Same arithmetic, in the same order,
// as quantize64: the bytes are identical (the tests hold native against the reference codec).
#pragma once

#include <immintrin.h>

#include "format1.h"

namespace daf {
namespace avx2 {

// reference.mix32 on 8 lanes.
inline __m256i mix32(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0x7FEB352Du)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0x846CA68Bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// Codes of x[0, 8) (element indices index0 .. index0 + 7) as 8 int32 lanes: quantize64's loop body.
template <int BITS, bool STOCHASTIC>
inline __m256i quantize8(const float* x, __m256 lo, __m256 inv, uint32_t index0, __m256i key) {
  const __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x), lo), inv);
  __m256 u = _mm256_set1_ps(0.5f);
  if constexpr (STOCHASTIC) {
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(index0)),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i h = mix32(_mm256_xor_si256(index, key));
    u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), _mm256_set1_ps(0x1p-24f));
  }
  const __m256i q = _mm256_cvttps_epi32(_mm256_add_ps(v, u));
  return _mm256_min_epi32(q, _mm256_set1_epi32((1 << BITS) - 1));
}

// Sums of 4 adjacent lanes of a, b, c, d (each lane already shifted to its bit slot, so a sum is an
// OR): [a0..3, b0..3, c0..3, d0..3 | a4..7, b4..7, c4..7, d4..7].
inline __m256i sum_quads(__m256i a, __m256i b, __m256i c, __m256i d) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
}

// Codes and packed bytes of 64 elements starting at element `index0`; out gets 64 * BITS / 8 bytes.
template <int BITS, bool STOCHASTIC>
inline void encode64(const float* x, const Scale& s, uint32_t index0, uint32_t key, uint8_t* out) {
  static_assert(BITS == 1 || BITS == 2 || BITS == 4, "the fused path packs 1, 2 or 4 bits");
  const __m256 lo = _mm256_set1_ps(s.lo), inv = _mm256_set1_ps(s.inv);
  const __m256i k = _mm256_set1_epi32(static_cast<int32_t>(key));
  __m256i q[8];
  for (int v = 0; v < 8; ++v) q[v] = quantize8<BITS, STOCHASTIC>(x + 8 * v, lo, inv, index0 + 8 * v, k);
  if constexpr (BITS == 1) {
    // Lane i of vector v to bit i of byte v.
    const __m256i shift = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int v = 0; v < 8; ++v) q[v] = _mm256_sllv_epi32(q[v], shift);
    const __m256i a = sum_quads(q[0], q[1], q[2], q[3]), b = sum_quads(q[4], q[5], q[6], q[7]);
    // Each 128-bit half holds the low or high nibble-quad of bytes 0-3 (a) and 4-7 (b).
    const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
    const __m256i w16 = _mm256_packus_epi32(sums, sums);  // per half: bytes 0-3 (low), 4-7 (high), twice
    const __m256i w8 = _mm256_packus_epi16(w16, w16);
    const uint32_t first = static_cast<uint32_t>(_mm256_extract_epi32(w8, 0));
    const uint32_t second = static_cast<uint32_t>(_mm256_extract_epi32(w8, 4));
    std::memcpy(out, &first, 4);
    std::memcpy(out + 4, &second, 4);
  } else if constexpr (BITS == 2) {
    // Lane i of vector v to bit 2 * (i % 4) of byte 2 * v + i / 4.
    const __m256i shift = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    for (int v = 0; v < 8; ++v) q[v] = _mm256_sllv_epi32(q[v], shift);
    // [B0 B2 B4 B6 | B1 B3 B5 B7] and [B8 .. B14 | B9 .. B15]
    const __m256i a = sum_quads(q[0], q[1], q[2], q[3]), b = sum_quads(q[4], q[5], q[6], q[7]);
    const __m256i w16 = _mm256_packus_epi32(a, b);  // [B0 B2 .. B14 | B1 B3 .. B15]
    const __m256i w8 = _mm256_packus_epi16(w16, w16);
    const __m128i even = _mm256_castsi256_si128(w8), odd = _mm256_extracti128_si256(w8, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi8(even, odd));
  } else {
    // Lane i of vector v to bit 4 * (i % 2) of byte 4 * v + i / 2.
    const __m256i shift = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
    for (int v = 0; v < 8; ++v) q[v] = _mm256_sllv_epi32(q[v], shift);
    // hadd of pairs: [v0 bytes 0,1, v1 bytes 0,1 | v0 bytes 2,3, v1 bytes 2,3]
    __m256i w[4];
    for (int p = 0; p < 4; ++p) w[p] = _mm256_hadd_epi32(q[2 * p], q[2 * p + 1]);
    const __m256i w16a = _mm256_packus_epi32(w[0], w[1]);  // [v0 0,1 v1 0,1 v2 0,1 v3 0,1 | ... 2,3 ...]
    const __m256i w16b = _mm256_packus_epi32(w[2], w[3]);
    const __m256i w8 = _mm256_packus_epi16(w16a, w16b);  // [v0-3 (0,1), v4-7 (0,1) | v0-3 (2,3), v4-7 (2,3)]
    // Bytes of vector v: (0,1) in the low half at 2v, (2,3) in the high half at 2v: interleave 16-bit pairs.
    const __m128i low = _mm256_castsi256_si128(w8), high = _mm256_extracti128_si256(w8, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi16(low, high));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm_unpackhi_epi16(low, high));
  }
}

}  // namespace avx2
}  // namespace daf
