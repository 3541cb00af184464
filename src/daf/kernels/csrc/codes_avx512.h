// Quantize and pack 64 elements in AVX-512 registers, for 1, 2 and 4 bits: 16 lanes per vector
// where codes_avx2.h has 8. Same arithmetic, in the same order, as quantize64 (codes.h), so the
// bytes are those of the reference codec (the tests hold native against it).
//
// Packing: the 64 codes (each < 2^BITS) are narrowed to one byte each, then each group of 8 / BITS
// bytes is read as one word, its bytes slid down to their bit slots, and the word narrowed to its
// low byte: pack64's little-endian trick, in registers.
#pragma once

#include <immintrin.h>

#include "format1.h"

namespace daf {
namespace avx512 {

// reference.mix32 on 16 lanes.
inline __m512i mix32(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int32_t>(0x7FEB352Du)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int32_t>(0x846CA68Bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// Codes of x[0, 16) (element indices index0 .. index0 + 15), one byte each: quantize64's loop body.
template <int BITS, bool STOCHASTIC>
inline __m128i quantize16(const float* x, __m512 lo, __m512 inv, uint32_t index0, __m512i key) {
  const __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x), lo), inv);
  __m512 u = _mm512_set1_ps(0.5f);
  if constexpr (STOCHASTIC) {
    const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(index0)),
                                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i h = mix32(_mm512_xor_si512(index, key));
    u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8)), _mm512_set1_ps(0x1p-24f));
  }
  const __m512i q = _mm512_cvttps_epi32(_mm512_add_ps(v, u));
  return _mm512_cvtepi32_epi8(_mm512_min_epi32(q, _mm512_set1_epi32((1 << BITS) - 1)));
}

// Codes and packed bytes of 64 elements starting at element `index0`; out gets 64 * BITS / 8 bytes.
template <int BITS, bool STOCHASTIC>
inline void encode64(const float* x, const Scale& s, uint32_t index0, uint32_t key, uint8_t* out) {
  static_assert(BITS == 1 || BITS == 2 || BITS == 4, "the fused path packs 1, 2 or 4 bits");
  const __m512 lo = _mm512_set1_ps(s.lo), inv = _mm512_set1_ps(s.inv);
  const __m512i k = _mm512_set1_epi32(static_cast<int32_t>(key));
  __m512i codes = _mm512_castsi128_si512(quantize16<BITS, STOCHASTIC>(x, lo, inv, index0, k));
  codes = _mm512_inserti32x4(codes, quantize16<BITS, STOCHASTIC>(x + 16, lo, inv, index0 + 16, k), 1);
  codes = _mm512_inserti32x4(codes, quantize16<BITS, STOCHASTIC>(x + 32, lo, inv, index0 + 32, k), 2);
  codes = _mm512_inserti32x4(codes, quantize16<BITS, STOCHASTIC>(x + 48, lo, inv, index0 + 48, k), 3);
  if constexpr (BITS == 4) {  // 32 words of two codes -> 32 bytes
    const __m512i w = _mm512_or_si512(codes, _mm512_srli_epi16(codes, 4));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi16_epi8(w));
  } else if constexpr (BITS == 2) {  // 16 double words of four codes -> 16 bytes
    const __m512i w = _mm512_or_si512(_mm512_or_si512(codes, _mm512_srli_epi32(codes, 6)),
                                      _mm512_or_si512(_mm512_srli_epi32(codes, 12), _mm512_srli_epi32(codes, 18)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(w));
  } else {  // 8 quad words of eight codes -> 8 bytes
    __m512i w = codes;
    for (int shift = 7; shift <= 49; shift += 7) w = _mm512_or_si512(w, _mm512_srli_epi64(codes, shift));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm512_cvtepi64_epi8(w));
  }
}

}  // namespace avx512
}  // namespace daf
