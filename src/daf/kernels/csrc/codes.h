// Quantize-and-pack and unpack-and-dequantize of kChunk (64) elements, the inner loops of the
// kernels. Written as plain fixed-length loops over small buffers, which GCC and Clang
// vectorize at -O3 for the target the build enables (AVX-512, AVX2, NEON).
#pragma once

#include "format1.h"

#if defined(CPU_CAPABILITY_AVX512)
#include "codes_avx512.h"
#define DAF_CODES_AVX512 1
#elif defined(CPU_CAPABILITY_AVX2)
#include "codes_avx2.h"
#define DAF_CODES_AVX2 1
#endif

namespace daf {

// Codes of x[0, 64) under lo/inv, format step 5. Elements of a regular group satisfy x >= lo,
// so v + u >= 0 and truncation toward zero equals the reference's floor.
template <int BITS, bool STOCHASTIC>
inline void quantize64(const float* x, const Scale& s, uint32_t index0, uint32_t key, uint8_t* codes) {
  constexpr int32_t levels = (1 << BITS) - 1;
  for (int j = 0; j < kChunk; ++j) {
    float v = (x[j] - s.lo) * s.inv;
    float u = 0.5f;
    if constexpr (STOCHASTIC) {
      uint32_t h = mix32((index0 + static_cast<uint32_t>(j)) ^ key);
      u = static_cast<float>(static_cast<int32_t>(h >> 8)) * 0x1p-24f;
    }
    int32_t q = static_cast<int32_t>(v + u);
    codes[j] = static_cast<uint8_t>(q < levels ? q : levels);
  }
}

// 64 one-byte codes -> 64 * BITS / 8 bytes. Element j lands in byte j / (8 / BITS) at bit
// (j % (8 / BITS)) * BITS: read the codes as little-endian words of 8 / BITS bytes and slide
// each byte down to its slot; the mask of the final narrowing drops what slid past.
template <int BITS>
inline void pack64(const uint8_t* codes, uint8_t* out) {
  if constexpr (BITS == 8) {
    std::memcpy(out, codes, kChunk);
  } else if constexpr (BITS == 4) {
    uint16_t w[kChunk / 2];
    std::memcpy(w, codes, kChunk);
    for (int k = 0; k < kChunk / 2; ++k) out[k] = static_cast<uint8_t>(w[k] | (w[k] >> 4));
  } else if constexpr (BITS == 2) {
    uint32_t w[kChunk / 4];
    std::memcpy(w, codes, kChunk);
    for (int k = 0; k < kChunk / 4; ++k) {
      uint32_t v = w[k];
      out[k] = static_cast<uint8_t>(v | (v >> 6) | (v >> 12) | (v >> 18));
    }
  } else {
    static_assert(BITS == 1, "bits must be 1, 2, 4 or 8");
    uint64_t w[kChunk / 8];
    std::memcpy(w, codes, kChunk);
    for (int k = 0; k < kChunk / 8; ++k) {
      uint64_t v = w[k];
      out[k] = static_cast<uint8_t>(v | (v >> 7) | (v >> 14) | (v >> 21) | (v >> 28) | (v >> 35) | (v >> 42) |
                                    (v >> 49));
    }
  }
}

// Inverse of pack64: 64 * BITS / 8 bytes -> 64 one-byte codes.
template <int BITS>
inline void unpack64(const uint8_t* in, uint8_t* codes) {
  if constexpr (BITS == 8) {
    std::memcpy(codes, in, kChunk);
  } else if constexpr (BITS == 4) {
    uint16_t w[kChunk / 2];
    for (int k = 0; k < kChunk / 2; ++k) {
      uint16_t b = in[k];
      w[k] = static_cast<uint16_t>((b | (b << 4)) & 0x0F0Fu);
    }
    std::memcpy(codes, w, kChunk);
  } else if constexpr (BITS == 2) {
    uint32_t w[kChunk / 4];
    for (int k = 0; k < kChunk / 4; ++k) {
      uint32_t b = in[k];
      w[k] = (b | (b << 6) | (b << 12) | (b << 18)) & 0x03030303u;
    }
    std::memcpy(codes, w, kChunk);
  } else {
    uint64_t w[kChunk / 8];
    for (int k = 0; k < kChunk / 8; ++k) {
      uint64_t b = in[k];
      w[k] = (b | (b << 7) | (b << 14) | (b << 21) | (b << 28) | (b << 35) | (b << 42) | (b << 49)) &
             0x0101010101010101ull;
    }
    std::memcpy(codes, w, kChunk);
  }
}

// Format step 6: value = code * step + lo, two roundings (no fused multiply-add).
inline void dequantize64(const uint8_t* codes, float lo, float step, float* out) {
  for (int j = 0; j < kChunk; ++j) out[j] = static_cast<float>(codes[j]) * step + lo;
}

// Quantize and pack n (<= any multiple of 64) elements starting at element index `index`
// of the tensor into out; writes ceil(n * BITS / 8) bytes. A short tail is padded with lo,
// whose code is 0 under both roundings (u < 1), as the format wants for padding.
template <int BITS, bool STOCHASTIC>
inline void encode_span(const float* x, int64_t n, const Scale& s, int64_t index, uint32_t key,
                        uint8_t* out) {
  alignas(64) uint8_t codes[kChunk];
  alignas(64) uint8_t packed[kChunk];
  int64_t j = 0;
#if defined(DAF_CODES_AVX512)
  if constexpr (BITS < 8) {
    for (; j + kChunk <= n; j += kChunk)
      avx512::encode64<BITS, STOCHASTIC>(x + j, s, static_cast<uint32_t>(index + j), key, out + j * BITS / 8);
  }
#elif defined(DAF_CODES_AVX2)
  if constexpr (BITS < 8) {
    for (; j + kChunk <= n; j += kChunk)
      avx2::encode64<BITS, STOCHASTIC>(x + j, s, static_cast<uint32_t>(index + j), key, out + j * BITS / 8);
  }
#endif
  for (; j + kChunk <= n; j += kChunk) {
    quantize64<BITS, STOCHASTIC>(x + j, s, static_cast<uint32_t>(index + j), key, codes);
    pack64<BITS>(codes, out + j * BITS / 8);
  }
  if (j < n) {
    alignas(64) float tail[kChunk];
    std::fill(tail, tail + kChunk, s.lo);
    std::memcpy(tail, x + j, (n - j) * sizeof(float));
    quantize64<BITS, STOCHASTIC>(tail, s, static_cast<uint32_t>(index + j), key, codes);
    pack64<BITS>(codes, packed);
    std::memcpy(out + j * BITS / 8, packed, ((n - j) * BITS + 7) / 8);
  }
}

// Unpack and dequantize n elements whose codes start at `in` (byte aligned) into out.
template <int BITS>
inline void decode_span(const uint8_t* in, int64_t n, float lo, float step, float* out) {
  alignas(64) uint8_t codes[kChunk];
  int64_t j = 0;
  for (; j + kChunk <= n; j += kChunk) {
    unpack64<BITS>(in + j * BITS / 8, codes);
    dequantize64(codes, lo, step, out + j);
  }
  if (j < n) {
    alignas(64) uint8_t bytes[kChunk] = {0};
    alignas(64) float tail[kChunk];
    std::memcpy(bytes, in + j * BITS / 8, ((n - j) * BITS + 7) / 8);
    unpack64<BITS>(bytes, codes);
    dequantize64(codes, lo, step, tail);
    std::memcpy(out + j, tail, (n - j) * sizeof(float));
  }
}

}  // namespace daf
