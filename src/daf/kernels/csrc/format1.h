// Format-1 arithmetic shared by the encode and decode kernels (docs/format.md).
//
// Every function here reproduces, bit for bit, one step of src/daf/codec/reference.py.
// Build with -ffp-contract=off: a fused multiply-add would round once where the
// reference rounds twice and the bytes would differ.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace daf {

using Vec = at::vec::Vectorized<float>;

constexpr float kExceptionLimit = 0x1p126f;  // |x| above this (and NaN) is exceptional
constexpr float kMinStep = 0x1p-126f;
constexpr float kTinyLimit = 0x1p-100f;  // a nonzero group below this in magnitude is exceptional
constexpr uint32_t kGolden = 0x9E3779B9u;
constexpr int64_t kChunk = 64;  // elements quantized and packed together; a multiple of 8 / bits

inline uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline float bits_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// The lowbias32 hash of reference.mix32.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// key(hi32(i)) of the stochastic-rounding generator: constant over any 2^32-aligned range.
inline uint32_t noise_key(uint32_t seed32, int64_t index) {
  return mix32(seed32 ^ mix32(static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32) + kGolden));
}

struct Range {
  float mn, mx;
};

// Min and max of n floats; NaN anywhere makes both NaN (at::vec::minimum propagates it),
// which the regularity check below turns into the "exceptional" flag.
inline Range min_max(const float* x, int64_t n) {
  constexpr int64_t K = Vec::size();
  Vec lo0(INFINITY), lo1(INFINITY), hi0(-INFINITY), hi1(-INFINITY);
  int64_t j = 0;
  for (; j + 2 * K <= n; j += 2 * K) {  // two accumulators hide the min/max latency
    Vec a = Vec::loadu(x + j), b = Vec::loadu(x + j + K);
    lo0 = at::vec::minimum(lo0, a);
    hi0 = at::vec::maximum(hi0, a);
    lo1 = at::vec::minimum(lo1, b);
    hi1 = at::vec::maximum(hi1, b);
  }
  lo0 = at::vec::minimum(lo0, lo1);
  hi0 = at::vec::maximum(hi0, hi1);
  float mn = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::minimum(a, b); }, lo0);
  float mx = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, hi0);
  for (; j < n; ++j) {
    float v = x[j];
    if (std::isnan(v)) {
      mn = mx = NAN;
    } else {  // std::min/max keep a NaN already in mn/mx
      mn = std::min(mn, v);
      mx = std::max(mx, v);
    }
  }
  return {mn, mx};
}

inline Range merge(Range a, Range b) {
  if (std::isnan(a.mn) || std::isnan(b.mn)) return {NAN, NAN};
  return {std::min(a.mn, b.mn), std::max(a.mx, b.mx)};
}

// A group is regular when its range holds no NaN, Inf or magnitude above 2^126, and is not
// tiny: a group whose largest magnitude is below 2^-100 but not zero (float32 denormals) would
// lose its scale to the step floor, so the reference stores its nonzeros exactly. All-zero
// groups (ReLU outputs) stay regular.
inline bool is_regular(Range r) {
  const float a = std::fabs(r.mn), b = std::fabs(r.mx);
  if (!(a <= kExceptionLimit && b <= kExceptionLimit)) return false;
  return !(a < kTinyLimit && b < kTinyLimit && (r.mn != 0.0f || r.mx != 0.0f));
}

// lo, step and 1/step of a group (format steps 2-4). lo is taken from mn + 0 so that a
// minimum of -0.0 and one of +0.0 give the same bytes whatever order the min was found in.
struct Scale {
  float lo, step, inv;
  uint16_t lo_bf16, step_bf16;
};

inline Scale scale_of(Range r, int bits) {
  uint32_t b = float_bits(r.mn + 0.0f);
  uint32_t lo_bits = b & 0xFFFF0000u;
  if ((b & 0x80000000u) && (b & 0xFFFFu)) lo_bits += 0x10000u;  // negative and inexact: away from zero
  float lo = bits_float(lo_bits);
  float ratio = (r.mx - lo) / static_cast<float>((1 << bits) - 1);
  uint32_t rb = float_bits(ratio);
  uint32_t step_bits = rb & 0xFFFF0000u;
  if (rb & 0xFFFFu) step_bits += 0x10000u;  // ratio >= 0: up is away from zero
  float step = std::max(bits_float(step_bits), kMinStep);
  Scale s;
  s.lo = lo;
  s.step = step;
  s.inv = 1.0f / step;
  s.lo_bf16 = static_cast<uint16_t>(lo_bits >> 16);
  s.step_bf16 = static_cast<uint16_t>(float_bits(step) >> 16);
  return s;
}

inline void write_meta(uint8_t* row, const Scale& s) {
  std::memcpy(row, &s.lo_bf16, 2);  // little-endian hosts only (the format is little-endian)
  std::memcpy(row + 2, &s.step_bf16, 2);
}

inline void read_meta(const uint8_t* row, float& lo, float& step) {
  uint16_t a, b;
  std::memcpy(&a, row, 2);
  std::memcpy(&b, row + 2, 2);
  lo = bits_float(static_cast<uint32_t>(a) << 16);
  step = bits_float(static_cast<uint32_t>(b) << 16);
}

// n elements of T as float32 (exact for half and bfloat16). Returns src itself for float.
template <typename T>
inline const float* as_float(const T* src, int64_t n, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    for (; j + Vec::size() <= n; j += Vec::size()) {
      Vec v;
      at::vec::load_to_float<T>(src + j, v);
      v.store(buf + j);
    }
#endif
    for (; j < n; ++j) buf[j] = static_cast<float>(src[j]);
    return buf;
  }
}

// Decoded values clamped to half's finite range: the original elements were finite halves (others are
// exceptions, restored exactly), but lo + code * step with a step rounded up to bfloat16 can pass
// 65504 by a fraction of a step, which the cast would turn into inf.
inline void clamp_to_half_range(float* v, int64_t n) {
  for (int64_t j = 0; j < n; ++j) v[j] = std::min(std::max(v[j], -65504.0f), 65504.0f);
}

// float32 -> T with round-to-nearest-even, as tensor.to(dtype) does.
template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    at::vec::convert(src, dst, n);
  }
}

}  // namespace daf
