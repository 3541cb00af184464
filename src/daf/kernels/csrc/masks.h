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
};

// Two-valued masks: the element differs bitwise from the first one.
template <typename U>
struct DiffersBit {
  U first;
  uint8_t operator()(U u) const { return static_cast<uint8_t>(u != first); }
};

// Bits of x[0, n) under `bit` into out[0, ceil(n / 8)); the last byte is zero-padded.
template <typename U, typename F>
void pack(const U* x, int64_t n, const F& bit, uint8_t* out) {
  at::parallel_for(0, units(n), kGrainUnits, [&](int64_t first, int64_t last) {
    alignas(64) uint8_t codes[kChunk];
    const int64_t end = std::min(n, last * kUnit);
    int64_t j = first * kUnit;
    for (; j + kChunk <= end; j += kChunk) {
      for (int k = 0; k < kChunk; ++k) codes[k] = bit(x[j + k]);
      pack64<1>(codes, out + j / 8);
    }
    if (j < end) {
      alignas(64) uint8_t packed[kChunk / 8];
      std::fill(codes, codes + kChunk, 0);
      for (int64_t k = 0; k < end - j; ++k) codes[k] = bit(x[j + k]);
      pack64<1>(codes, packed);
      std::memcpy(out + j / 8, packed, (end - j + 7) / 8);
    }
  });
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

// out[j] = values[bit j]: the two values as bit patterns (U is bool's uint8_t for bool masks).
template <typename U>
void select(const uint8_t* bits, int64_t n, U low, U high, U* out) {
  at::parallel_for(0, units(n), kGrainUnits, [&](int64_t first, int64_t last) {
    alignas(64) uint8_t codes[kChunk];
    const int64_t end = std::min(n, last * kUnit);
    for (int64_t j = first * kUnit; j < end; j += kChunk) {
      const int64_t m = std::min(kChunk, end - j);
      codes_at(bits, j, m, codes);
      for (int64_t k = 0; k < m; ++k) out[j + k] = codes[k] ? high : low;
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

// The elements > 0 of x in memory order into out, given count_positive's counts. Branch-free:
// every element is written at the cursor, which moves on past the positive ones only; a unit's
// staging buffer keeps the extra write inside this thread's memory.
template <typename U>
void compact_positive(const U* x, int64_t n, U inf, const int64_t* counts, U* out) {
  std::vector<int64_t> offset(units(n) + 1, 0);
  for (int64_t u = 0; u < units(n); ++u) offset[u + 1] = offset[u] + counts[u];
  at::parallel_for(0, units(n), kGrainUnits, [&](int64_t first, int64_t last) {
    std::vector<U> buf(kUnit + 1);
    for (int64_t u = first; u < last; ++u) {
      const int64_t start = u * kUnit, end = std::min(n, start + kUnit);
      int64_t k = 0;
      for (int64_t j = start; j < end; ++j) {
        const U v = x[j];
        buf[k] = v;
        k += (v != 0) & (v <= inf);  // count_positive refused negatives and NaN: this is v > 0
      }
      std::memcpy(out + offset[u], buf.data(), k * sizeof(U));
    }
  });
}

// out[j] = the next of `values` where bit j is set, +0 elsewhere. Returns the mask's count of set
// bits; when it is not `count` (the record and its mask disagree) nothing is written.
template <typename U>
int64_t scatter(const U* values, int64_t count, const uint8_t* bits, int64_t n, U* out) {
  std::vector<int64_t> offset(units(n) + 1, 0);
  at::parallel_for(0, units(n), kGrainUnits, [&](int64_t first, int64_t last) {
    for (int64_t u = first; u < last; ++u) {
      const int64_t begin = u * kUnit / 8, end = (std::min(n, (u + 1) * kUnit) + 7) / 8;
      int64_t ones = 0;
      for (int64_t b = begin; b < end; ++b) ones += __builtin_popcount(bits[b]);
      if (end * 8 > n) ones -= __builtin_popcount(bits[end - 1] >> (n % 8));  // the padding's bits count not
      offset[u + 1] = ones;
    }
  });
  for (int64_t u = 0; u < units(n); ++u) offset[u + 1] += offset[u];
  if (offset[units(n)] != count) return offset[units(n)];
  at::parallel_for(0, units(n), kGrainUnits, [&](int64_t first, int64_t last) {
    alignas(64) uint8_t codes[kChunk];
    for (int64_t u = first; u < last; ++u) {
      const int64_t start = u * kUnit, end = std::min(n, start + kUnit);
      int64_t k = offset[u];
      const int64_t top = std::max<int64_t>(count - 1, 0);  // a clamped read never leaves `values`
      for (int64_t j = start; j < end; j += kChunk) {
        const int64_t m = std::min(kChunk, end - j);
        codes_at(bits, j, m, codes);
        for (int64_t i = 0; i < m; ++i) {
          const U v = count ? values[std::min(k, top)] : U(0);
          out[j + i] = codes[i] ? v : U(0);
          k += codes[i];
        }
      }
    }
  });
  return count;
}

}  // namespace masks
}  // namespace daf
