// Python entry points of the native format-1 kernels.
//
// The functions take buffer addresses (tensor.data_ptr()) rather than tensors: that keeps
// the build to pybind11 and the ATen vector headers (about 5 s instead of about 25 s with
// torch/extension.h). daf/kernels/backend.py checks dtype, device, contiguity and sizes
// before calling, and keeps the tensors alive across the call.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "channels.h"
#include "columns.h"
#include "kernels.h"
#include "masks.h"
#include "nonzeros.h"
#include "transpose.h"

namespace daf {
namespace {

enum DType : int64_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct EncodeOptions {
  bool stochastic;
  uint32_t seed32;
  Strategy strategy;
  bool serial;
};

template <typename T, int BITS>
bool encode_typed(const void* x, uint8_t* payload, Layout layout, EncodeOptions o) {
  const T* typed = static_cast<const T*>(x);
  if (o.stochastic) return Encoder<T, BITS, true>(typed, payload, layout, o.seed32, o.serial).run(o.strategy);
  return Encoder<T, BITS, false>(typed, payload, layout, o.seed32, o.serial).run(o.strategy);
}

template <typename T>
bool encode_bits(const void* x, uint8_t* payload, Layout layout, EncodeOptions o) {
  switch (layout.bits) {
    case 1: return encode_typed<T, 1>(x, payload, layout, o);
    case 2: return encode_typed<T, 2>(x, payload, layout, o);
    case 4: return encode_typed<T, 4>(x, payload, layout, o);
    case 8: return encode_typed<T, 8>(x, payload, layout, o);
  }
  throw std::invalid_argument("bits must be 1, 2, 4 or 8, got " + std::to_string(layout.bits));
}

template <typename T>
void decode_bits(const uint8_t* payload, void* out, Layout layout) {
  T* typed = static_cast<T*>(out);
  switch (layout.bits) {
    case 1: return decode<T, 1>(payload, typed, layout);
    case 2: return decode<T, 2>(payload, typed, layout);
    case 4: return decode<T, 4>(payload, typed, layout);
    case 8: return decode<T, 8>(payload, typed, layout);
  }
  throw std::invalid_argument("bits must be 1, 2, 4 or 8, got " + std::to_string(layout.bits));
}

template <typename T>
void decode_channels_last_bits(const uint8_t* payload, void* out, Layout layout, int64_t n, int64_t c, int64_t hw) {
  T* typed = static_cast<T*>(out);
  switch (layout.bits) {
    case 1: return decode_channels_last<T, 1>(payload, typed, layout, n, c, hw);
    case 2: return decode_channels_last<T, 2>(payload, typed, layout, n, c, hw);
    case 4: return decode_channels_last<T, 4>(payload, typed, layout, n, c, hw);
    case 8: return decode_channels_last<T, 8>(payload, typed, layout, n, c, hw);
  }
  throw std::invalid_argument("bits must be 1, 2, 4 or 8, got " + std::to_string(layout.bits));
}

Layout checked_layout(int64_t numel, int64_t bits, int64_t group_size) {
  if (numel < 0) throw std::invalid_argument("numel must be >= 0");
  if (group_size < 8 || (group_size & (group_size - 1)) != 0) {
    throw std::invalid_argument("group_size must be a power of two >= 8, got " + std::to_string(group_size));
  }
  return Layout{numel, group_size, bits};
}

// x: address of numel elements of dtype (0 float32, 1 float16, 2 bfloat16), contiguous;
// payload: address of groups * row_bytes writable bytes. Returns false when an exceptional
// value was met (the caller then encodes the tensor with the reference). serial: use the
// calling thread only.
bool encode(int64_t x, int64_t numel, int64_t dtype, int64_t payload, int64_t bits, int64_t group_size,
            bool stochastic, int64_t seed32, int64_t strategy, bool serial) {
  Layout layout = checked_layout(numel, bits, group_size);
  if (strategy != kWholeGroups && strategy != kSplitRange) throw std::invalid_argument("unknown strategy");
  const void* src = reinterpret_cast<const void*>(x);
  uint8_t* dst = reinterpret_cast<uint8_t*>(payload);
  const EncodeOptions o{stochastic, static_cast<uint32_t>(seed32), static_cast<Strategy>(strategy), serial};
  switch (dtype) {
    case kFloat32: return encode_bits<float>(src, dst, layout, o);
    case kFloat16: return encode_bits<c10::Half>(src, dst, layout, o);
    case kBFloat16: return encode_bits<c10::BFloat16>(src, dst, layout, o);
  }
  throw std::invalid_argument("dtype code must be 0 (float32), 1 (float16) or 2 (bfloat16)");
}

void decode_into(int64_t payload, int64_t numel, int64_t bits, int64_t group_size, int64_t dtype, int64_t out) {
  Layout layout = checked_layout(numel, bits, group_size);
  const uint8_t* src = reinterpret_cast<const uint8_t*>(payload);
  void* dst = reinterpret_cast<void*>(out);
  switch (dtype) {
    case kFloat32: return decode_bits<float>(src, dst, layout);
    case kFloat16: return decode_bits<c10::Half>(src, dst, layout);
    case kBFloat16: return decode_bits<c10::BFloat16>(src, dst, layout);
  }
  throw std::invalid_argument("dtype code must be 0 (float32), 1 (float16) or 2 (bfloat16)");
}

// out: numel float32, the decoded values with the sign each bit of signs says (kernels.h, decode_signed).
void decode_signed_into(int64_t payload, int64_t signs, int64_t numel, int64_t bits, int64_t group_size, double floor,
                        int64_t out) {
  Layout layout = checked_layout(numel, bits, group_size);
  const uint8_t* src = reinterpret_cast<const uint8_t*>(payload);
  const uint8_t* sign_bits = reinterpret_cast<const uint8_t*>(signs);
  float* dst = reinterpret_cast<float*>(out);
  const float low = static_cast<float>(floor);
  switch (bits) {
    case 1: return decode_signed<1>(src, sign_bits, dst, layout, low);
    case 2: return decode_signed<2>(src, sign_bits, dst, layout, low);
    case 4: return decode_signed<4>(src, sign_bits, dst, layout, low);
    case 8: return decode_signed<8>(src, sign_bits, dst, layout, low);
  }
  throw std::invalid_argument("bits must be 1, 2, 4 or 8");
}

// out: n * c * hw elements written channels-last; the payload's values are in NCHW order and
// c * hw must be a multiple of group_size (each image starts a group).
void decode_channels_last_into(int64_t payload, int64_t n, int64_t c, int64_t hw, int64_t bits, int64_t group_size,
                               int64_t dtype, int64_t out) {
  if (n < 0 || c < 0 || hw < 0) throw std::invalid_argument("sizes must be >= 0");
  Layout layout = checked_layout(n * c * hw, bits, group_size);
  if ((c * hw) % group_size != 0) throw std::invalid_argument("c * hw must be a multiple of group_size");
  const uint8_t* src = reinterpret_cast<const uint8_t*>(payload);
  void* dst = reinterpret_cast<void*>(out);
  switch (dtype) {
    case kFloat32: return decode_channels_last_bits<float>(src, dst, layout, n, c, hw);
    case kFloat16: return decode_channels_last_bits<c10::Half>(src, dst, layout, n, c, hw);
    case kBFloat16: return decode_channels_last_bits<c10::BFloat16>(src, dst, layout, n, c, hw);
  }
  throw std::invalid_argument("dtype code must be 0 (float32), 1 (float16) or 2 (bfloat16)");
}

// ---- masks (masks.h): element dtypes by their bit patterns ----

enum MaskDType : int64_t { kMaskFloat32 = 0, kMaskFloat16 = 1, kMaskBFloat16 = 2, kMaskFloat64 = 3 };

// Calls f(U{}, inf) with the unsigned type of the dtype's width and the bits of its +inf.
template <typename F>
auto with_float_bits(int64_t dtype, const F& f) {
  switch (dtype) {
    case kMaskFloat32: return f(uint32_t{0}, uint32_t{0x7F800000u});
    case kMaskFloat16: return f(uint16_t{0}, uint16_t{0x7C00u});
    case kMaskBFloat16: return f(uint16_t{0}, uint16_t{0x7F80u});
    case kMaskFloat64: return f(uint64_t{0}, uint64_t{0x7FF0000000000000ull});
  }
  throw std::invalid_argument("mask dtype code must be 0 (float32), 1 (float16), 2 (bfloat16) or 3 (float64)");
}

// Calls f(U{}) with the unsigned type of `width` bytes.
template <typename F>
auto with_width(int64_t width, const F& f) {
  switch (width) {
    case 1: return f(uint8_t{0});
    case 2: return f(uint16_t{0});
    case 4: return f(uint32_t{0});
    case 8: return f(uint64_t{0});
  }
  throw std::invalid_argument("element width must be 1, 2, 4 or 8 bytes, got " + std::to_string(width));
}

template <typename T>
T* at_address(int64_t address) {
  return reinterpret_cast<T*>(address);
}

// x: n elements of a float dtype; out: ceil(n / 8) bytes. Bit: not (x <= 0).
void relu_mask_encode(int64_t x, int64_t n, int64_t dtype, int64_t out) {
  with_float_bits(dtype, [&](auto zero, auto inf) {
    using U = decltype(zero);
    masks::pack(at_address<const U>(x), n, masks::ReluBit<U>{inf}, at_address<uint8_t>(out));
  });
}

// x: n >= 1 elements of `width` bytes; bit: the element's bits differ from the first element's.
void mask_encode(int64_t x, int64_t n, int64_t width, int64_t out) {
  with_width(width, [&](auto zero) {
    using U = decltype(zero);
    const U* typed = at_address<const U>(x);
    masks::pack(typed, n, masks::DiffersBit<U>{typed[0]}, at_address<uint8_t>(out));
  });
}

// x: n >= 1 elements of `width` bytes. masks::second_value: the index of the second bit pattern, 0, or -1.
int64_t mask_second(int64_t x, int64_t n, int64_t width) {
  if (n < 1) throw std::invalid_argument("mask_second needs at least one element");
  return with_width(width, [&](auto zero) {
    using U = decltype(zero);
    return masks::second_value(at_address<const U>(x), n);
  });
}

// out[j] = values[bit j], values: 2 elements of `width` bytes (low, high), copied bitwise.
void mask_select(int64_t bits, int64_t n, int64_t width, int64_t values, int64_t out) {
  with_width(width, [&](auto zero) {
    using U = decltype(zero);
    const U* two = at_address<const U>(values);
    masks::select(at_address<const uint8_t>(bits), n, two[0], two[1], at_address<U>(out));
  });
}

// mask_select of n x c x hw elements (NCHW bits) written NHWC; c * hw a multiple of 8.
void mask_select_channels_last(int64_t bits, int64_t n, int64_t c, int64_t hw, int64_t width, int64_t values,
                               int64_t out) {
  if (n < 0 || c < 0 || hw < 0) throw std::invalid_argument("sizes must be >= 0");
  if ((c * hw) % 8) throw std::invalid_argument("c * hw must be a multiple of 8, got " + std::to_string(c * hw));
  with_width(width, [&](auto zero) {
    using U = decltype(zero);
    const U* two = at_address<const U>(values);
    masks::select_channels_last(at_address<const uint8_t>(bits), n, c, hw, two[0], two[1], at_address<U>(out));
  });
}

// counts: units(n) int64 slots. Returns how many elements are > 0, or -1 if one is negative or NaN.
int64_t nonzeros_count(int64_t x, int64_t n, int64_t dtype, int64_t counts) {
  return with_float_bits(dtype, [&](auto zero, auto inf) {
    using U = decltype(zero);
    return masks::count_positive(at_address<const U>(x), n, inf, at_address<int64_t>(counts));
  });
}

void nonzeros_compact(int64_t x, int64_t n, int64_t dtype, int64_t counts, int64_t out) {
  with_float_bits(dtype, [&](auto zero, auto inf) {
    using U = decltype(zero);
    masks::compact_positive(at_address<const U>(x), n, inf, at_address<const int64_t>(counts), at_address<U>(out));
  });
}

// Returns the mask's count of set bits; out is written only when it equals count.
int64_t mask_scatter(int64_t values, int64_t count, int64_t bits, int64_t n, int64_t width, int64_t out) {
  return with_width(width, [&](auto zero) {
    using U = decltype(zero);
    return masks::scatter(at_address<const U>(values), count, at_address<const uint8_t>(bits), n, at_address<U>(out));
  });
}

int64_t mask_count(int64_t bits, int64_t n) { return masks::count(at_address<const uint8_t>(bits), n); }

// Returns the mask's count of set bits; kept and others are written only when it equals kept_count.
int64_t split_by_mask(int64_t x, int64_t bits, int64_t n, int64_t width, int64_t kept_count, int64_t kept,
                      int64_t others) {
  return with_width(width, [&](auto zero) {
    using U = decltype(zero);
    return masks::split(at_address<const U>(x), at_address<const uint8_t>(bits), n, kept_count, at_address<U>(kept),
                        at_address<U>(others));
  });
}

// float32 out[n]: the `count` values of format-1 rows at `payload` where the mask bit is set, +0
// elsewhere. Returns the mask's count of set bits; out is written only when it equals count.
int64_t nonzeros_decode_scatter(int64_t payload, int64_t count, int64_t bits, int64_t group_size, int64_t mask,
                                int64_t n, int64_t out) {
  Layout layout = checked_layout(count, bits, group_size);
  const uint8_t* src = reinterpret_cast<const uint8_t*>(payload);
  const uint8_t* mask_bits = reinterpret_cast<const uint8_t*>(mask);
  float* dst = reinterpret_cast<float*>(out);
  switch (bits) {
    case 1: return nonzeros::decode_scatter<1>(src, layout, mask_bits, n, dst);
    case 2: return nonzeros::decode_scatter<2>(src, layout, mask_bits, n, dst);
    case 4: return nonzeros::decode_scatter<4>(src, layout, mask_bits, n, dst);
    case 8: return nonzeros::decode_scatter<8>(src, layout, mask_bits, n, dst);
  }
  throw std::invalid_argument("bits must be 1, 2, 4 or 8, got " + std::to_string(bits));
}

// float32 out[n]: nonzeros_decode_scatter's values where the mask bit is set, and elsewhere the mean of
// each run of group_size others (`means`): a norm input split by its ReLU mask, decoded in one pass.
int64_t split_decode(int64_t payload, int64_t count, int64_t bits, int64_t group_size, int64_t means, int64_t mask,
                     int64_t n, int64_t out) {
  Layout layout = checked_layout(count, bits, group_size);
  if (group_size & (group_size - 1)) throw std::invalid_argument("group_size must be a power of two");
  const uint8_t* src = reinterpret_cast<const uint8_t*>(payload);
  const uint8_t* mask_bits = reinterpret_cast<const uint8_t*>(mask);
  const float* run_means = reinterpret_cast<const float*>(means);
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(group_size));
  float* dst = reinterpret_cast<float*>(out);
  switch (bits) {
    case 1: return nonzeros::decode_scatter<1>(src, layout, mask_bits, n, dst, run_means, shift);
    case 2: return nonzeros::decode_scatter<2>(src, layout, mask_bits, n, dst, run_means, shift);
    case 4: return nonzeros::decode_scatter<4>(src, layout, mask_bits, n, dst, run_means, shift);
    case 8: return nonzeros::decode_scatter<8>(src, layout, mask_bits, n, dst, run_means, shift);
  }
  throw std::invalid_argument("bits must be 1, 2, 4 or 8, got " + std::to_string(bits));
}

// x: n * c * hw contiguous elements of `width` bytes (NCHW); out: the same count, written NHWC.
void channels_last_copy(int64_t x, int64_t n, int64_t c, int64_t hw, int64_t width, int64_t out) {
  if (n < 0 || c < 0 || hw < 0) throw std::invalid_argument("sizes must be >= 0");
  with_width(width, [&](auto zero) {
    using U = decltype(zero);
    transpose::nchw_to_nhwc(at_address<const U>(x), at_address<U>(out), n, c, hw);
  });
}

// m: rows x cols contiguous float32 (rows >= 1); out: cols float32, the largest |m| of each column.
void column_absmax(int64_t m, int64_t rows, int64_t cols, int64_t out) {
  if (rows < 1 || cols < 0) throw std::invalid_argument("column_absmax needs rows >= 1 and cols >= 0");
  columns::absmax(at_address<const float>(m), rows, cols, at_address<float>(out));
}

// payload: format-1 rows of coded [n, rows] float32 (groups of group_size, rows % 8 == 0); scale: rows float32;
// values: rows x k float32; out: rows x cols float32 (channels.h decode_join).
void channel_decode_join(int64_t payload, int64_t bits, int64_t group_size, int64_t scale, int64_t rows, int64_t cols,
                         int64_t inliers, int64_t n, int64_t outliers, int64_t values, int64_t k, int64_t out) {
  if (rows < 0 || cols < 0 || n < 0 || k < 0 || n + k != cols || rows % 8 != 0)
    throw std::invalid_argument("channel_decode_join: bad sizes (rows must be a multiple of 8)");
  checked_layout(n * rows, bits, group_size);
  const uint8_t* src = at_address<const uint8_t>(payload);
  const float* s = at_address<const float>(scale);
  const int64_t* in = at_address<const int64_t>(inliers);
  const int64_t* outl = at_address<const int64_t>(outliers);
  const float* v = at_address<const float>(values);
  float* o = at_address<float>(out);
  switch (bits) {
    case 1: return channels::decode_join<1>(src, group_size, s, rows, cols, in, n, outl, v, k, o);
    case 2: return channels::decode_join<2>(src, group_size, s, rows, cols, in, n, outl, v, k, o);
    case 4: return channels::decode_join<4>(src, group_size, s, rows, cols, in, n, outl, v, k, o);
    case 8: return channels::decode_join<8>(src, group_size, s, rows, cols, in, n, outl, v, k, o);
  }
  throw std::invalid_argument("bits must be 1, 2, 4 or 8, got " + std::to_string(bits));
}

// m: rows x cols contiguous elements of dtype (0 float32, 1 float16, 2 bfloat16); inliers: n int64 channel
// numbers < cols; coded: n x rows float32; scale: rows float32 (channels.h). Returns whether an inlier is NaN.
bool channel_split(int64_t m, int64_t rows, int64_t cols, int64_t dtype, int64_t inliers, int64_t n, int64_t coded,
                   int64_t scale) {
  if (rows < 0 || cols < 0 || n < 0 || n > cols) throw std::invalid_argument("channel_split: bad sizes");
  const int64_t* in = at_address<const int64_t>(inliers);
  float* c = at_address<float>(coded);
  float* s = at_address<float>(scale);
  switch (dtype) {
    case kFloat32: return channels::split(at_address<const float>(m), rows, cols, in, n, c, s);
    case kFloat16: return channels::split(at_address<const c10::Half>(m), rows, cols, in, n, c, s);
    case kBFloat16: return channels::split(at_address<const c10::BFloat16>(m), rows, cols, in, n, c, s);
  }
  throw std::invalid_argument("dtype code must be 0 (float32), 1 (float16) or 2 (bfloat16)");
}

// coded: n x rows float32, scale: rows float32, values: rows x k float32; out: rows x cols float32.
void channel_join(int64_t coded, int64_t scale, int64_t rows, int64_t cols, int64_t inliers, int64_t n,
                  int64_t outliers, int64_t values, int64_t k, int64_t out) {
  if (rows < 0 || cols < 0 || n < 0 || k < 0 || n + k != cols) throw std::invalid_argument("channel_join: bad sizes");
  channels::join(at_address<const float>(coded), at_address<const float>(scale), rows, cols,
                 at_address<const int64_t>(inliers), n, at_address<const int64_t>(outliers),
                 at_address<const float>(values), k, at_address<float>(out));
}

// The digest of csrc/, the flags and torch's version at build time (-DDAF_BUILD_KEY=k..., build.py's
// build_key): kernels built at install are used only while that still holds (an editable checkout may
// have changed the sources since, or another torch been installed).
#define DAF_STRINGIFY2(x) #x
#define DAF_STRINGIFY(x) DAF_STRINGIFY2(x)
#ifndef DAF_BUILD_KEY
#define DAF_BUILD_KEY unknown
#endif

std::string build_key() { return DAF_STRINGIFY(DAF_BUILD_KEY); }

std::string build_info() {
#if defined(CPU_CAPABILITY_AVX512)
  const char* isa = "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  const char* isa = "avx2";
#else
  const char* isa = "portable";
#endif
  return std::string(isa) + ", " + std::to_string(Vec::size()) + " floats per vector";
}

}  // namespace
}  // namespace daf

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "DAF format-1 encode/decode kernels (see docs/kernels.md)";
  m.def("encode", &daf::encode, "quantize and pack into format-1 rows; False if exceptional values",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_into", &daf::decode_into, "unpack and dequantize format-1 rows into a buffer",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_signed_into", &daf::decode_signed_into, "format-1 decode with exact sign bits, float32",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_channels_last_into", &daf::decode_channels_last_into,
        "unpack and dequantize format-1 rows of NCHW values into a channels-last buffer",
        py::call_guard<py::gil_scoped_release>());
  m.def("relu_mask_encode", &daf::relu_mask_encode, "ReLU mask bits not (x <= 0)", py::call_guard<py::gil_scoped_release>());
  m.def("mask_encode", &daf::mask_encode, "two-valued mask bits", py::call_guard<py::gil_scoped_release>());
  m.def("mask_second", &daf::mask_second, "where the second bit pattern is, or -1 for a third",
        py::call_guard<py::gil_scoped_release>());
  m.def("mask_select", &daf::mask_select, "mask bits to one of two values", py::call_guard<py::gil_scoped_release>());
  m.def("mask_select_channels_last", &daf::mask_select_channels_last,
        "mask bits of NCHW elements to one of two values, written channels-last",
        py::call_guard<py::gil_scoped_release>());
  m.def("nonzeros_count", &daf::nonzeros_count, "positives per unit; -1 if negatives or NaN",
        py::call_guard<py::gil_scoped_release>());
  m.def("nonzeros_compact", &daf::nonzeros_compact, "the positives in memory order",
        py::call_guard<py::gil_scoped_release>());
  m.def("mask_scatter", &daf::mask_scatter, "values where the bit is set, zero elsewhere; returns the set bits",
        py::call_guard<py::gil_scoped_release>());
  m.def("nonzeros_decode_scatter", &daf::nonzeros_decode_scatter,
        "a ReLU output from the codes of its nonzeros and its mask; returns the set bits",
        py::call_guard<py::gil_scoped_release>());
  m.def("mask_count", &daf::mask_count, "the mask's set bits", py::call_guard<py::gil_scoped_release>());
  m.def("split_by_mask", &daf::split_by_mask, "elements where the bit is set, then the others; returns the set bits",
        py::call_guard<py::gil_scoped_release>());
  m.def("split_decode", &daf::split_decode,
        "a norm input split by its ReLU mask: codes where the bit is set, group means elsewhere; returns the set bits",
        py::call_guard<py::gil_scoped_release>());
  m.def("channels_last_copy", &daf::channels_last_copy, "NCHW elements copied in NHWC order",
        py::call_guard<py::gil_scoped_release>());
  m.def("column_absmax", &daf::column_absmax, "the largest magnitude of each column, NaN where one is",
        py::call_guard<py::gil_scoped_release>());
  m.def("channel_split", &daf::channel_split, "inlier channels scaled per token, transposed; the token scales",
        py::call_guard<py::gil_scoped_release>());
  m.def("channel_decode_join", &daf::channel_decode_join,
        "channel_join of coded values read from their format-1 payload, a block of tokens at a time",
        py::call_guard<py::gil_scoped_release>());
  m.def("channel_join", &daf::channel_join, "the inverse of channel_split, outlier channels put back",
        py::call_guard<py::gil_scoped_release>());
  m.def("mask_unit", []() { return daf::masks::kUnit; });
  m.def("build_info", &daf::build_info);
  m.def("build_key", &daf::build_key);
}
