// A ReLU output rebuilt from the format-1 codes of its nonzeros and its 1-bit mask in one pass:
// what decode_into followed by masks::scatter computes, without the compact tensor between them
// (written in full, then read again). The reference is that composition; the tests hold the bytes equal.
#pragma once

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "kernels.h"
#include "masks.h"

namespace daf {
namespace nonzeros {

// Decode values [first, last) of the float32 rows into buf[0, last - first + (first % kChunk)):
// from the 64-aligned element below `first` (codes start on whole bytes there), group by group.
// Returns where values[first] landed in buf.
template <int BITS>
inline int64_t decode_range(const uint8_t* payload, Layout layout, int64_t first, int64_t last, float* buf) {
  const int64_t start = first / kChunk * kChunk;
  for (int64_t s = start; s < last;) {
    const int64_t g = s / layout.group_size;
    const int64_t e = std::min(last, (g + 1) * layout.group_size);
    const uint8_t* row = payload + g * layout.row_bytes();
    float lo, step;
    read_meta(row, lo, step);
    decode_span<BITS>(row + 4 + (s - g * layout.group_size) * BITS / 8, e - s, lo, step, buf + (s - start));
    s = e;
  }
  return first - start;
}

// out[j] = the next of the layout.numel decoded values where bit j of the mask is set; elsewhere +0, or
// with `means` (a norm input split by its ReLU mask, daf.codec.split) means[(others before j) >> mean_shift].
// Returns the mask's count of set bits; when it is not layout.numel nothing is written.
template <int BITS>
int64_t decode_scatter(const uint8_t* payload, Layout layout, const uint8_t* bits, int64_t n, float* out,
                       const float* means = nullptr, int mean_shift = 0) {
  using masks::kUnit;
  using masks::units;
  const int64_t count = layout.numel;
  const std::vector<int64_t> offset = masks::unit_offsets(bits, n);
  if (offset[units(n)] != count) return offset[units(n)];
  at::parallel_for(0, units(n), masks::kGrainUnits, [&](int64_t first, int64_t last) {
    // a unit's values, from the 64-aligned one before its first, and 8 lanes of room past the last
    std::vector<float> buf(kUnit + kChunk + 8, 0.0f);
    for (int64_t u = first; u < last; ++u) {
      const int64_t k0 = offset[u], k1 = offset[u + 1], end = std::min(n, (u + 1) * kUnit);
      const uint32_t* values = reinterpret_cast<const uint32_t*>(buf.data());
      if (k1 > k0) values += decode_range<BITS>(payload, layout, k0, k1, buf.data());
      const int64_t top = std::max<int64_t>(k1 - k0 - 1, 0);
      uint32_t* dst = reinterpret_cast<uint32_t*>(out);
      int64_t k = 0, other = u * kUnit - k0;  // the others before this unit
      for (int64_t j = u * kUnit; j < end; j += 8) {
        const int m = static_cast<int>(std::min<int64_t>(8, end - j));
        const uint8_t b = static_cast<uint8_t>(bits[j / 8] & ((1u << m) - 1u));  // the padding's bits: not ours
        bool written = false;
#ifdef DAF_MASKS_AVX2
        if (m == 8) {  // lanes past the unit's last value read the buffer's room and are cleared
          masks::expand8(values, k, b, dst + j);
          written = true;
        }
#endif
        if (!written) masks::scatter8(values, k, top, b, m, dst + j);
        const int set = __builtin_popcount(b);
        if (means != nullptr) {
          for (unsigned rest = ~static_cast<unsigned>(b) & ((1u << m) - 1u); rest; rest &= rest - 1) {
            const int i = __builtin_ctz(rest);
            out[j + i] = means[(other + i - masks::kRank.r[b][i]) >> mean_shift];
          }
          other += m - set;
        }
        k += set;
      }
    }
  });
  return count;
}

}  // namespace nonzeros
}  // namespace daf
