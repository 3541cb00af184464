// Exact 1-bit masks and the nonzeros of a ReLU output (src/daf/kernels/mask_reference.py is the
// plain-PyTorch statement; the tests hold both byte for byte).
//
// Bit j of a mask sits in byte j / 8 at bit j % 8 (little-endian in each byte), elements in memory
// order. Every test here is done on the elements' bit patterns as unsigned integers: the same code
// serves float16, bfloat16, float32 and float64 (no conversion), keeps NaN payloads and signed
// zeros, and is plain integer arithmetic that GCC vectorizes. Element tests run 64 at a time into
// one-byte 0/1 codes, which pack64<1> / unpack64<1> (codes.h) turn into bits and back.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <vector>

#include "codes.h"
#include "transpose.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#define DAF_MASKS_AVX2 1
#endif

namespace daf {
namespace masks {

// Elements per parallel work unit (a multiple of 64, so units start on whole bytes of a mask).
constexpr int64_t kUnit = 8192;
constexpr int64_t kGrainUnits = 4;  // below 4 units (32768 elements) one thread is faster

inline int64_t units(int64_t n) { return (n + kUnit - 1) / kUnit; }

// The bit pattern of positive infinity; a float's bits u (sign cleared) above it are NaN.
template <typename U>
struct Bits;
template <>
struct Bits<uint16_t> {
  static constexpr uint16_t sign = 0x8000u;
};
template <>
struct Bits<uint32_t> {
  static constexpr uint32_t sign = 0x80000000u;
};
template <>
struct Bits<uint64_t> {
  static constexpr uint64_t sign = 0x8000000000000000ull;
};

// threshold_backward's own test, negated: not (x <= 0), that is x > 0 or NaN. On bits: the
// magnitude is above +inf (NaN), or the sign is clear and the value is not +0.
template <typename U>
struct ReluBit {
  U inf;
  uint8_t operator()(U u) const {
    const U magnitude = static_cast<U>(u & static_cast<U>(~Bits<U>::sign));
    return static_cast<uint8_t>((magnitude > inf) | ((u == magnitude) & (u != 0)));
  }
#ifdef DAF_MASKS_AVX2
  // The same test on 8 float32 bit patterns (U = uint32_t): as int32, u > 0 is "sign clear, not +0".
  __m256i lanes(__m256i u) const {
    const __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    return _mm256_or_si256(_mm256_cmpgt_epi32(u, _mm256_setzero_si256()),
                           _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(static_cast<int32_t>(inf))));
  }
#endif
};

// Two-valued masks: the element differs bitwise from the first one.
template <typename U>
struct DiffersBit {
  U first;
  uint8_t operator()(U u) const { return static_cast<uint8_t>(u != first); }
#ifdef DAF_MASKS_AVX2
  __m256i lanes(__m256i u) const {  // U = uint32_t
    const __m256i equal = _mm256_cmpeq_epi32(u, _mm256_set1_epi32(static_cast<int32_t>(first)));
    return _mm256_xor_si256(equal, _mm256_set1_epi32(-1));
  }
#endif
};

// codes[k] = bit(x[k]) for 64 elements. A function of its own, on local copies and restrict
// pointers: inside the parallel lambda GCC saw loads through captured references and did not
// vectorize ("evolution of base is not affine").
template <typename U, typename F>
inline void bits64(const U* __restrict x, const F bit, uint8_t* __restrict codes) {
  for (int k = 0; k < kChunk; ++k) codes[k] = bit(x[k]);
}

// The 8 mask bytes of 64 elements. For 4-byte elements on AVX2, each 8 lanes' test goes straight
// to a byte through movemask (lane i -> bit i, the mask's order): 4x faster than codes then pack64
// (a float32 ReLU mask of 6.4M elements on one thread: 6.8 ms, now 1.75).
template <typename U, typename F>
inline void bytes64(const U* x, const F bit, uint8_t* out) {
#ifdef DAF_MASKS_AVX2
  if constexpr (sizeof(U) == 4) {
    for (int b = 0; b < kChunk / 8; ++b) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * b));
      out[b] = static_cast<uint8_t>(_mm256_movemask_ps(_mm256_castsi256_ps(bit.lanes(u))));
    }
    return;
  }
#endif
  alignas(64) uint8_t codes[kChunk];
  bits64(x, bit, codes);
  pack64<1>(codes, out);
}

// Bits of x[0, n) under `bit` into out[0, ceil(n / 8)); the last byte is zero-padded.
template <typename U, typename F>
void pack(const U* x, int64_t n, const F bit, uint8_t* out) {
  at::parallel_for(0, units(n), kGrainUnits, [=](int64_t first, int64_t last) {
    const int64_t end = std::min(n, last * kUnit);
    int64_t j = first * kUnit;
    for (; j + kChunk <= end; j += kChunk) bytes64(x + j, bit, out + j / 8);
    if (j < end) {
      const int64_t m = end - j;
      alignas(64) U tail[kChunk] = {};
      alignas(64) uint8_t packed[kChunk / 8];
      std::memcpy(tail, x + j, m * sizeof(U));
      bytes64(tail, bit, packed);
      if (m % 8) packed[m / 8] &= static_cast<uint8_t>((1u << (m % 8)) - 1u);  // zero padding
      std::memcpy(out + j / 8, packed, (m + 7) / 8);
    }
  });
}

// Where the second bit pattern of x[0, n) is (the first element that differs from x[0]; 0 when none
// does), or -1 when x holds three or more: whether x can be a two-valued mask, in one pass with no
// temporaries (the plain-PyTorch scan made three full-size comparisons per slice). The search for the
// second value runs on the calling thread (it is nearly always within the first elements); the check
// of the rest is split over threads, in blocks, each stopping once any has found a third value.
template <typename U>
int64_t second_value(const U* x, int64_t n) {
  const U first = x[0];
  int64_t where = 1;
  while (where < n && x[where] == first) ++where;
  if (where == n) return 0;
  const U second = x[where];
  std::atomic<bool> third{false};
  at::parallel_for(where + 1, n, kUnit * kGrainUnits, [&](int64_t begin, int64_t end) {
    for (int64_t start = begin; start < end && !third.load(std::memory_order_relaxed); start += kUnit) {
      const int64_t stop = std::min(end, start + kUnit);
      uint8_t other = 0;
      for (int64_t j = start; j < stop; ++j) other |= static_cast<uint8_t>((x[j] != first) & (x[j] != second));
      if (other) third.store(true, std::memory_order_relaxed);
    }
  });
  return third.load() ? -1 : where;
}

// The mask's codes 0/1 of elements [j, j + m) (m <= 64; j a multiple of 64) into codes.
inline void codes_at(const uint8_t* bits, int64_t j, int64_t m, uint8_t* codes) {
  if (m == kChunk) {
    unpack64<1>(bits + j / 8, codes);
  } else {
    alignas(64) uint8_t bytes[kChunk / 8] = {0};
    std::memcpy(bytes, bits + j / 8, (m + 7) / 8);
    unpack64<1>(bytes, codes);
  }
}

template <typename U>
inline void select64(const uint8_t* __restrict codes, const U low, const U high, U* __restrict out) {
  for (int k = 0; k < kChunk; ++k) out[k] = codes[k] ? high : low;
}

// out[j] = bit j ? high : low for j in [0, n), the bits starting on a whole byte.
template <typename U>
inline void select_span(const uint8_t* bits, int64_t n, U low, U high, U* out) {
  alignas(64) uint8_t codes[kChunk];
  alignas(64) U tail[kChunk];
  for (int64_t j = 0; j < n; j += kChunk) {
    const int64_t m = std::min(kChunk, n - j);
    codes_at(bits, j, m, codes);
    if (m == kChunk) {
      select64(codes, low, high, out + j);
    } else {
      select64(codes, low, high, tail);
      std::memcpy(out + j, tail, m * sizeof(U));
    }
  }
}

// out[j] = values[bit j]: the two values as bit patterns (U is bool's uint8_t for bool masks).
template <typename U>
void select(const uint8_t* bits, int64_t n, U low, U high, U* out) {
  at::parallel_for(0, units(n), kGrainUnits, [=](int64_t first, int64_t last) {
    const int64_t start = first * kUnit, end = std::min(n, last * kUnit);
    select_span(bits + start / 8, end - start, low, high, out + start);
  });
}

// out[j] = codes[j] ? high : low for one-byte codes 0/1: a plain loop GCC vectorizes.
template <typename U>
inline void widen(const uint8_t* __restrict codes, int64_t n, U low, U high, U* __restrict out) {
  for (int64_t j = 0; j < n; ++j) out[j] = codes[j] ? high : low;
}

// select() of n images of c x hw elements whose bits are in NCHW order, written channels-last
// (NHWC), one pass over the output. Per image, the bits become one byte each, the bytes are moved
// transposed (16 x 16 blocks), and each byte is widened to its value as the output is written in
// order: the transpose moves a quarter of what moving the values would for 4-byte ones (a float32
// ReLU mask of 128 x 64 x 28 x 28 in ResNet-18's step: 1.34 ms when the values were moved). Values
// of one byte are selected into place and moved as they are. c * hw must be a multiple of 8, so
// that every image's bits start on a whole byte.
template <typename U>
void select_channels_last(const uint8_t* bits, int64_t n, int64_t c, int64_t hw, U low, U high, U* out) {
  const int64_t image = c * hw;
  at::parallel_for(0, n, std::max<int64_t>(1, transpose::kGrainElements / std::max<int64_t>(1, image)),
                   [&](int64_t first, int64_t last) {
    std::vector<uint8_t> codes(image), moved(sizeof(U) == 1 ? 0 : image);
    for (int64_t i = first; i < last; ++i) {
      if constexpr (sizeof(U) == 1) {
        select_span(bits + i * image / 8, image, low, high, reinterpret_cast<U*>(codes.data()));
        transpose::image_to_nhwc(reinterpret_cast<const U*>(codes.data()), out + i * image, c, hw);
      } else {
        select_span<uint8_t>(bits + i * image / 8, image, 0, 1, codes.data());
        transpose::image_to_nhwc(codes.data(), moved.data(), c, hw);
        widen(moved.data(), image, low, high, out + i * image);
      }
    }
  });
}

// Per unit of kUnit elements: how many are > 0; -1 in `bad` when some element is neither > 0 nor
// a zero (negative or NaN). Returns the total, or -1.
template <typename U>
int64_t count_positive(const U* x, int64_t n, U inf, int64_t* counts) {
  std::atomic<bool> bad{false};
  at::parallel_for(0, units(n), kGrainUnits, [&](int64_t first, int64_t last) {
    for (int64_t u = first; u < last; ++u) {
      const int64_t start = u * kUnit, end = std::min(n, start + kUnit);
      int64_t positive = 0, other = 0;
      for (int64_t j = start; j < end; ++j) {
        const U v = x[j];
        const U magnitude = static_cast<U>(v & static_cast<U>(~Bits<U>::sign));
        const bool is_positive = (v == magnitude) & (v != 0) & (v <= inf);  // (0, +inf]
        positive += is_positive;
        other += !is_positive & (magnitude != 0);
      }
      counts[u] = positive;
      if (other) bad.store(true, std::memory_order_relaxed);
    }
  });
  if (bad.load()) return -1;
  int64_t total = 0;
  for (int64_t u = 0; u < units(n); ++u) total += counts[u];
  return total;
}

// kRank.r[b][i]: how many bits of b below bit i are set, which of a byte's values element i takes.
struct RankTable {
  uint8_t r[256][8];
};
constexpr RankTable make_rank_table() {
  RankTable t{};
  for (int b = 0; b < 256; ++b) {
    for (int i = 0; i < 8; ++i) t.r[b][i] = static_cast<uint8_t>(__builtin_popcount(b & ((1 << i) - 1)));
  }
  return t;
}
inline constexpr RankTable kRank = make_rank_table();

// kPack.r[b][i]: the lane of the i-th set bit of b (0 past the last): the permutation that moves a
// byte's selected lanes to the front.
constexpr RankTable make_pack_table() {
  RankTable t{};
  for (int b = 0; b < 256; ++b) {
    int k = 0;
    for (int i = 0; i < 8; ++i) {
      if ((b >> i) & 1) t.r[b][k++] = static_cast<uint8_t>(i);
    }
  }
  return t;
}
inline constexpr RankTable kPack = make_pack_table();

#ifdef DAF_MASKS_AVX2
// Eight int32 lane indices from a table row.
inline __m256i lanes_of(const uint8_t* row) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row)));
}

// The elements > 0 of 4-byte x[j, end), 8 at a time while 8 are left, to buf[k...]: each group's
// positive lanes permuted to the front and all 8 stored at the cursor (buf has 8 lanes of room past
// its last element). Positive is "> 0 as int32": count_positive refused negatives and NaN. Returns
// where it stopped; k moves on by the positives written.
template <typename U>
inline int64_t left_pack8(const U* x, int64_t j, int64_t end, U* buf, int64_t& k) {
  for (; j + 8 <= end; j += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j));
    const int b = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, _mm256_setzero_si256())));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf + k), _mm256_permutevar8x32_epi32(v, lanes_of(kPack.r[b])));
    k += __builtin_popcount(b);
  }
  return j;
}

// One mask byte b of 8 elements from 4-byte values[k, k + 8) (all readable): lane i takes
// values[k + rank of i] where bit i is set, +0 elsewhere.
template <typename U>
inline void expand8(const U* values, int64_t k, uint8_t b, U* out) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + k));
  const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(b), select), select);
  const __m256i spread = _mm256_permutevar8x32_epi32(v, lanes_of(kRank.r[b]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_and_si256(spread, set));
}
#endif

// The elements > 0 of x in memory order into out, given count_positive's counts. Branch-free:
// every element is written at the cursor, which moves on past the positive ones only; a unit's
// staging buffer keeps the extra write inside this thread's memory.
template <typename U>
void compact_positive(const U* x, int64_t n, U inf, const int64_t* counts, U* out) {
  std::vector<int64_t> offset(units(n) + 1, 0);
  for (int64_t u = 0; u < units(n); ++u) offset[u + 1] = offset[u] + counts[u];
  at::parallel_for(0, units(n), kGrainUnits, [&](int64_t first, int64_t last) {
    std::vector<U> buf(kUnit + 8);  // room for a full 8-lane store at the cursor
    for (int64_t u = first; u < last; ++u) {
      const int64_t start = u * kUnit, end = std::min(n, start + kUnit);
      int64_t k = 0, j = start;
#ifdef DAF_MASKS_AVX2
      if constexpr (sizeof(U) == 4) j = left_pack8(x, j, end, buf.data(), k);
#endif
      for (; j < end; ++j) {
        const U v = x[j];
        buf[k] = v;
        k += (v != 0) & (v <= inf);  // count_positive refused negatives and NaN: this is v > 0
      }
      std::memcpy(out + offset[u], buf.data(), k * sizeof(U));
    }
  });
}

// The m <= 8 elements of one mask byte b, whose first set bit takes values[k]. Each element's
// index comes from the table, not from a running count: no dependency between elements and no
// branch on the (random) bits.
template <typename U>
inline void scatter8(const U* values, int64_t k, int64_t top, uint8_t b, int m, U* out) {
  const uint8_t* rank = kRank.r[b];
  for (int i = 0; i < m; ++i) {
    const U v = values[std::min<int64_t>(k + rank[i], top)];
    out[i] = (b >> i) & 1 ? v : U(0);
  }
}

// offset[u]: the set bits of the mask's n elements before unit u (units(n) + 1 entries; the last is
// the total). The padding bits of the last byte count not.
inline std::vector<int64_t> unit_offsets(const uint8_t* bits, int64_t n) {
  std::vector<int64_t> offset(units(n) + 1, 0);
  at::parallel_for(0, units(n), kGrainUnits, [&](int64_t first, int64_t last) {
    for (int64_t u = first; u < last; ++u) {
      const int64_t begin = u * kUnit / 8, end = (std::min(n, (u + 1) * kUnit) + 7) / 8;
      int64_t ones = 0;
      for (int64_t b = begin; b < end; ++b) ones += __builtin_popcount(bits[b]);
      if (end * 8 > n) ones -= __builtin_popcount(bits[end - 1] >> (n % 8));
      offset[u + 1] = ones;
    }
  });
  for (int64_t u = 0; u < units(n); ++u) offset[u + 1] += offset[u];
  return offset;
}

// out[j] = the next of `values` where bit j is set, +0 elsewhere. Returns the mask's count of set
// bits; when it is not `count` (the record and its mask disagree) nothing is written.
template <typename U>
int64_t scatter(const U* values, int64_t count, const uint8_t* bits, int64_t n, U* out) {
  const std::vector<int64_t> offset = unit_offsets(bits, n);
  if (offset[units(n)] != count) return offset[units(n)];
  if (count == 0) {  // all zeros; and `values` may not even have an address to read
    std::memset(out, 0, n * sizeof(U));
    return 0;
  }
  const int64_t top = std::max<int64_t>(count - 1, 0);  // a clamped read never leaves `values`
  at::parallel_for(0, units(n), kGrainUnits, [&](int64_t first, int64_t last) {
    for (int64_t u = first; u < last; ++u) {
      const int64_t end = std::min(n, (u + 1) * kUnit);
      int64_t k = offset[u];
      for (int64_t j = u * kUnit; j < end; j += 8) {
        const int m = static_cast<int>(std::min<int64_t>(8, end - j));
        const uint8_t b = static_cast<uint8_t>(bits[j / 8] & ((1u << m) - 1u));  // the padding's bits: not ours
#ifdef DAF_MASKS_AVX2
        if constexpr (sizeof(U) == 4) {
          if (m == 8 && k + 8 <= count) {  // a full byte whose 8-lane read stays inside values
            expand8(values, k, b, out + j);
            k += __builtin_popcount(b);
            continue;
          }
        }
#endif
        scatter8(values, k, top, b, m, out + j);
        k += __builtin_popcount(b);
      }
    }
  });
  return count;
}

// The mask's count of set bits among its n elements (the padding bits of the last byte count not).
inline int64_t count(const uint8_t* bits, int64_t n) { return unit_offsets(bits, n)[units(n)]; }

// The elements of x whose bit is set, in memory order, to kept; the others, in memory order, to
// others (a norm's input split by the ReLU mask after it, daf.codec.split). Branch-free: each
// element is written at both cursors, which move on by its bit. Returns the mask's count of set
// bits; when it is not `kept_count` nothing is written.
template <typename U>
int64_t split(const U* x, const uint8_t* bits, int64_t n, int64_t kept_count, U* kept, U* others) {
  const std::vector<int64_t> offset = unit_offsets(bits, n);
  if (offset[units(n)] != kept_count) return offset[units(n)];
  at::parallel_for(0, units(n), kGrainUnits, [&](int64_t first, int64_t last) {
    std::vector<U> a(kUnit), b(kUnit);
    for (int64_t u = first; u < last; ++u) {
      const int64_t start = u * kUnit, end = std::min(n, start + kUnit);
      int64_t ka = 0, kb = 0;
      for (int64_t j = start; j < end; ++j) {
        const U v = x[j];
        const int64_t set = (bits[j >> 3] >> (j & 7)) & 1;
        a[ka] = v;
        b[kb] = v;
        ka += set;
        kb += 1 - set;
      }
      std::memcpy(kept + offset[u], a.data(), ka * sizeof(U));
      std::memcpy(others + (start - offset[u]), b.data(), kb * sizeof(U));
    }
  });
  return kept_count;
}

}  // namespace masks
}  // namespace daf
