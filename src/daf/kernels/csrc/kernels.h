// The format-1 encode kernel (two reduction strategies) and decode kernel, on raw buffers.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "codes.h"
#include "transpose.h"

namespace daf {

// Elements handled as one unit: one float32 staging buffer (8 KiB) per thread for half types,
// and the unit of work of the split strategy. A power of two, so blocks never straddle a group
// boundary or a 2^32 element boundary (where the noise key changes).
constexpr int64_t kBlock = 2048;
// Below this many elements per thread, threads cost more than they save.
constexpr int64_t kGrainElements = 16384;

enum Strategy : int64_t { kWholeGroups = 0, kSplitRange = 1 };

struct Layout {
  int64_t numel, group_size, bits;
  int64_t groups() const { return (numel + group_size - 1) / group_size; }
  int64_t code_bytes() const { return group_size * bits / 8; }
  int64_t row_bytes() const { return 4 + code_bytes(); }
  int64_t group_length(int64_t g) const { return std::min(group_size, numel - g * group_size); }
  int64_t grain(int64_t unit) const { return std::max<int64_t>(1, kGrainElements / unit); }
};

// at::parallel_for on torch's intra-op threads, or the calling thread alone (serial): a
// background packer encodes on one thread while forward keeps torch's threads busy.
template <typename F>
void for_range(bool serial, int64_t end, int64_t grain, const F& f) {
  if (serial) {
    if (end > 0) f(0, end);
  } else {
    at::parallel_for(0, end, grain, f);
  }
}

template <typename T, int BITS, bool STOCHASTIC>
class Encoder {
 public:
  Encoder(const T* x, uint8_t* payload, Layout layout, uint32_t seed32, bool serial)
      : x_(x), payload_(payload), layout_(layout), seed32_(seed32), serial_(serial) {}

  // Returns false if some group holds an exceptional value (the payload is then incomplete).
  bool run(Strategy strategy) { return strategy == kSplitRange ? split_range() : whole_groups(); }

 private:
  // Strategy A: each thread owns whole groups; one pass reads a group, finds its range and
  // encodes it while it is still in cache. Best for many small groups.
  bool whole_groups() {
    std::atomic<bool> regular{true};
    for_range(serial_, layout_.groups(), layout_.grain(layout_.group_size), [&](int64_t first, int64_t last) {
      alignas(64) float buf[kBlock];
      for (int64_t g = first; g < last; ++g) {
        if (!encode_group(g, buf)) regular.store(false, std::memory_order_relaxed);
      }
    });
    return regular.load();
  }

  bool encode_group(int64_t g, float* buf) {
    const int64_t start = g * layout_.group_size, n = layout_.group_length(g);
    uint8_t* row = payload_ + g * layout_.row_bytes();
    if (n <= kBlock) {  // the whole group fits the staging buffer: convert once
      const float* xf = as_float(x_ + start, n, buf);
      Range r = min_max(xf, n);
      if (!is_regular(r)) return false;
      Scale s = scale_of(r, BITS);
      write_meta(row, s);
      encode_span<BITS, STOCHASTIC>(xf, n, s, start, noise_key(seed32_, start), row + 4);
    } else {
      Range r{INFINITY, -INFINITY};
      for (int64_t b = 0; b < n; b += kBlock) {
        const int64_t m = std::min(kBlock, n - b);
        r = merge(r, min_max(as_float(x_ + start + b, m, buf), m));
      }
      if (!is_regular(r)) return false;
      Scale s = scale_of(r, BITS);
      write_meta(row, s);
      for (int64_t b = 0; b < n; b += kBlock) {
        const int64_t m = std::min(kBlock, n - b);
        encode_span<BITS, STOCHASTIC>(as_float(x_ + start + b, m, buf), m, s, start + b,
                                      noise_key(seed32_, start + b), row + 4 + b * BITS / 8);
      }
    }
    zero_padding(row, n);
    return true;
  }

  // Strategy B: threads split the element range into blocks regardless of groups; partial
  // ranges of a group's blocks are merged, then a second parallel pass encodes the blocks.
  // Keeps every thread busy when there are fewer groups than threads (per-channel or
  // per-tensor ranges), at the price of reading the input twice.
  bool split_range() {
    const int64_t block = std::min(layout_.group_size, kBlock);
    const int64_t blocks = (layout_.numel + block - 1) / block;
    const int64_t per_group = layout_.group_size / block;
    std::vector<Range> partial(blocks);
    for_range(serial_, blocks, layout_.grain(block), [&](int64_t first, int64_t last) {
      alignas(64) float buf[kBlock];
      for (int64_t b = first; b < last; ++b) {
        const int64_t m = std::min(block, layout_.numel - b * block);
        partial[b] = min_max(as_float(x_ + b * block, m, buf), m);
      }
    });
    std::vector<Scale> scales(layout_.groups());
    for (int64_t g = 0; g < layout_.groups(); ++g) {
      Range r{INFINITY, -INFINITY};
      for (int64_t b = g * per_group; b < std::min(blocks, (g + 1) * per_group); ++b) r = merge(r, partial[b]);
      if (!is_regular(r)) return false;
      scales[g] = scale_of(r, BITS);
      write_meta(payload_ + g * layout_.row_bytes(), scales[g]);
    }
    for_range(serial_, blocks, layout_.grain(block), [&](int64_t first, int64_t last) {
      alignas(64) float buf[kBlock];
      for (int64_t b = first; b < last; ++b) {
        const int64_t start = b * block, m = std::min(block, layout_.numel - start);
        const int64_t g = start / layout_.group_size, offset = start - g * layout_.group_size;
        uint8_t* row = payload_ + g * layout_.row_bytes();
        encode_span<BITS, STOCHASTIC>(as_float(x_ + start, m, buf), m, scales[g], start,
                                      noise_key(seed32_, start), row + 4 + offset * BITS / 8);
        if (start + m == layout_.numel) zero_padding(row, layout_.group_length(g));
      }
    });
    return true;
  }

  // Codes of the padding of a short last group are 0: clear the bytes past its n elements.
  void zero_padding(uint8_t* row, int64_t n) const {
    const int64_t used = (n * BITS + 7) / 8;
    if (used < layout_.code_bytes()) std::memset(row + 4 + used, 0, layout_.code_bytes() - used);
  }

  const T* x_;
  uint8_t* payload_;
  Layout layout_;
  uint32_t seed32_;
  bool serial_;
};

// The blocks of min(group_size, kBlock) elements a decode works in, in parallel: for each,
// f(start, m, codes, lo, step) with its first element, its length, its group's codes from the
// block's first element on, and the group's minimum and step.
template <typename F>
void for_each_block(const uint8_t* payload, Layout layout, const F& f) {
  const int64_t block = std::min(layout.group_size, kBlock);
  const int64_t blocks = (layout.numel + block - 1) / block;
  at::parallel_for(0, blocks, layout.grain(block), [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t start = b * block, m = std::min(block, layout.numel - start);
      const int64_t g = start / layout.group_size, offset = start - g * layout.group_size;
      const uint8_t* row = payload + g * layout.row_bytes();
      float lo, step;
      read_meta(row, lo, step);
      f(start, m, row + 4 + offset * layout.bits / 8, lo, step);
    }
  });
}

// Decode: each block dequantized straight into the output (through a staging buffer for half types).
template <typename T, int BITS>
void decode(const uint8_t* payload, T* out, Layout layout) {
  for_each_block(payload, layout, [&](int64_t start, int64_t m, const uint8_t* codes, float lo, float step) {
    alignas(64) float buf[kBlock];
    float* dst = std::is_same_v<T, float> ? reinterpret_cast<float*>(out + start) : buf;
    decode_span<BITS>(codes, m, lo, step, dst);
    if constexpr (std::is_same_v<T, c10::Half>) clamp_to_half_range(buf, m);
    if constexpr (!std::is_same_v<T, float>) from_float(buf, out + start, m);
  });
}

// A decoded span's elements given the sign their bit says (bit i of signs, little-endian in each byte,
// for element i of the span; the span starts at a multiple of 8): set -> max(v, floor), clear ->
// min(v, 0). NaN stays NaN and an equal value stays itself, as torch.where(bit, v.clamp_min(floor),
// v.clamp_max(0)) gives, which the reference computes.
inline void apply_signs(float* v, const uint8_t* signs, int64_t m, float floor) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 zero = _mm512_setzero_ps(), low = _mm512_set1_ps(floor);
  for (; i + 16 <= m; i += 16) {
    uint16_t bits;
    std::memcpy(&bits, signs + (i >> 3), sizeof(bits));
    const __m512 x = _mm512_loadu_ps(v + i);  // (constant, x): the second operand on NaN or equality
    _mm512_storeu_ps(v + i, _mm512_mask_blend_ps(bits, _mm512_min_ps(zero, x), _mm512_max_ps(low, x)));
  }
#endif
  for (; i < m; ++i) {
    const float x = v[i];
    v[i] = (signs[i >> 3] >> (i & 7)) & 1 ? (x < floor ? floor : x) : (0.0f < x ? 0.0f : x);
  }
}

// Decode with the exact signs of a ReLU output (a compiled graph's "codes+sign" save): each block is
// decoded and given its signs while it is in L1, one pass over the output where a decode, a bool
// mask and a select took three.
template <int BITS>
void decode_signed(const uint8_t* payload, const uint8_t* signs, float* out, Layout layout, float floor) {
  for_each_block(payload, layout, [&](int64_t start, int64_t m, const uint8_t* codes, float lo, float step) {
    decode_span<BITS>(codes, m, lo, step, out + start);
    apply_signs(out + start, signs + start / 8, m, floor);  // a block starts at a multiple of 8 (group_size >= 8)
  });
}

// Decode into a channels-last (NHWC) output of n images of c x hw values, which the payload holds
// in NCHW order with every image starting a group (c * hw a multiple of group_size: the caller
// checks). One image at a time per thread: its values are decoded into a staging buffer (200 KiB
// at 64 x 28 x 28, so it stays in L2) and moved transposed into the output, one pass over the
// output instead of a decode and a separate transposing copy. Values equal decode()'s bit for bit.
template <typename T, int BITS>
void decode_channels_last(const uint8_t* payload, T* out, Layout layout, int64_t n, int64_t c, int64_t hw) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>;
  const int64_t image = c * hw, block = std::min(layout.group_size, kBlock);
  at::parallel_for(0, n, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, image)),
                   [&](int64_t first, int64_t last) {
    std::vector<float> values(image);
    std::vector<T> typed(std::is_same_v<T, float> ? 0 : image);
    for (int64_t i = first; i < last; ++i) {
      for (int64_t start = 0; start < image; start += block) {
        const int64_t at = i * image + start, m = std::min(block, image - start);
        const int64_t g = at / layout.group_size, offset = at - g * layout.group_size;
        const uint8_t* row = payload + g * layout.row_bytes();
        float lo, step;
        read_meta(row, lo, step);
        decode_span<BITS>(row + 4 + offset * BITS / 8, m, lo, step, values.data() + start);
      }
      const void* src = values.data();
      if constexpr (!std::is_same_v<T, float>) {
        if constexpr (std::is_same_v<T, c10::Half>) clamp_to_half_range(values.data(), image);
        from_float(values.data(), typed.data(), image);
        src = typed.data();
      }
      transpose::image_to_nhwc(static_cast<const U*>(src), reinterpret_cast<U*>(out + i * image), c, hw);
    }
  });
}

}  // namespace daf
