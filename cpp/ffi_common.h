// What every FFI handler of this package shares, whatever the platform:
// decoding of the `geometry` dictionary attribute into PoolAttrs, and the
// checks that the buffers XLA hands over agree with it. The dictionary is
// decoded here, member by member, rather than by XLA's struct decoding, so
// that a malformed attribute is always this package's InvalidArgument error.
#ifndef JAX_AVGPOOL_FFI_COMMON_H_
#define JAX_AVGPOOL_FFI_COMMON_H_

#include <cstdint>
#include <iterator>
#include <string>

#include "pooling.h"
#include "xla/ffi/api/ffi.h"

namespace jax_avgpool {

namespace ffi = ::xla::ffi;

// The members of the `geometry` attribute, in PoolAttrs order.
inline constexpr struct {
  const char* name;
  int64_t PoolAttrs::* member;
} kGeometryMembers[] = {
    {"kernel_h", &PoolAttrs::kernel_h},
    {"kernel_w", &PoolAttrs::kernel_w},
    {"stride_h", &PoolAttrs::stride_h},
    {"stride_w", &PoolAttrs::stride_w},
    {"pad_top", &PoolAttrs::pad_top},
    {"pad_bottom", &PoolAttrs::pad_bottom},
    {"pad_left", &PoolAttrs::pad_left},
    {"pad_right", &PoolAttrs::pad_right},
    {"ceil_mode", &PoolAttrs::ceil_mode},
    {"divisor_mode", &PoolAttrs::divisor_mode},
    {"divisor_override", &PoolAttrs::divisor_override},
    {"layout", &PoolAttrs::layout},
};

// Decodes and validates the `geometry` dictionary attribute.
inline ffi::Error DecodeGeometry(const ffi::Dictionary& geometry,
                                 PoolAttrs* a) {
  constexpr size_t kCount = std::size(kGeometryMembers);
  if (geometry.size() != kCount) {
    return ffi::Error::InvalidArgument(
        "jax_avgpool: the geometry attribute must have exactly " +
        std::to_string(kCount) + " int64 members (kernel_h ... layout), got " +
        std::to_string(geometry.size()));
  }
  for (const auto& m : kGeometryMembers) {
    if (!geometry.contains(m.name)) {
      return ffi::Error::InvalidArgument(
          std::string("jax_avgpool: the geometry attribute lacks ") + m.name);
    }
    ffi::ErrorOr<int64_t> value = geometry.get<int64_t>(m.name);
    if (value.has_error()) {
      return ffi::Error::InvalidArgument(std::string("jax_avgpool: geometry.") +
                                         m.name + " must be an int64");
    }
    a->*m.member = *value;
  }
  if (const char* why = ValidateAttrs(*a)) {
    return ffi::Error::InvalidArgument(std::string("jax_avgpool: ") + why);
  }
  return ffi::Error::Success();
}

inline std::string DimsToString(ffi::AnyBuffer::Dimensions d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(d[i]);
  }
  return s + ")";
}

// Checks, for valid attributes `a`, that `in` (the pooled side: x for the
// forward, dx for the backward) and `out` (y, or dy) are consistent with the
// attributes, and returns the folded logical shape. Leading dimensions (all but
// the last three) are folded into one batch dimension.
inline ffi::Error CheckShapes(const PoolAttrs& a, const ffi::AnyBuffer& in,
                              const ffi::AnyBuffer& out, PoolShape* shape) {
  if (in.element_type() != out.element_type()) {
    return ffi::Error::InvalidArgument(
        "jax_avgpool: input and output element types differ");
  }
  const auto di = in.dimensions();
  const auto dout = out.dimensions();
  if (di.size() < 3 || di.size() != dout.size()) {
    return ffi::Error::InvalidArgument(
        "jax_avgpool: expected input and output of equal rank >= 3, got " +
        DimsToString(di) + " and " + DimsToString(dout));
  }
  const size_t r = di.size();
  for (size_t i = 0; i + 3 < r; ++i) {
    if (di[i] != dout[i]) {
      return ffi::Error::InvalidArgument(
          "jax_avgpool: leading dimensions differ between " + DimsToString(di) +
          " and " + DimsToString(dout));
    }
  }
  const bool nhwc = a.layout == kNHWC;
  const size_t ch = nhwc ? r - 1 : r - 3;
  const size_t hh = nhwc ? r - 3 : r - 2;
  const size_t ww = nhwc ? r - 2 : r - 1;
  if (di[ch] != dout[ch]) {
    return ffi::Error::InvalidArgument(
        "jax_avgpool: channel dimensions differ between " + DimsToString(di) +
        " and " + DimsToString(dout));
  }
  const PoolShape folded = FoldShape(a, di);
  const int64_t oh = folded.out_h, ow = folded.out_w;
  if (oh < 1 || ow < 1 || oh != dout[hh] || ow != dout[ww]) {
    return ffi::Error::InvalidArgument(
        "jax_avgpool: pooled size of " + DimsToString(di) + " is (" +
        std::to_string(oh) + ", " + std::to_string(ow) +
        ") but the output buffer is " + DimsToString(dout));
  }
  *shape = folded;
  return ffi::Error::Success();
}

// The start of every handler: the attributes decoded and validated, and the
// pooled side `in` (x, or dx) and `out` (y, or dy) checked against them.
inline ffi::Error DecodeCall(const ffi::Dictionary& geometry_attr,
                             const ffi::AnyBuffer& in,
                             const ffi::AnyBuffer& out, PoolAttrs* a,
                             PoolShape* shape) {
  if (ffi::Error e = DecodeGeometry(geometry_attr, a); e.failure()) return e;
  return CheckShapes(*a, in, out, shape);
}

inline ffi::Error CheckStrategy(int64_t strategy) {
  if (strategy != kGather && strategy != kScatter) {
    return ffi::Error::InvalidArgument(
        "jax_avgpool: strategy must be 0 (gather) or 1 (scatter), got " +
        std::to_string(strategy));
  }
  return ffi::Error::Success();
}

inline ffi::Error UnsupportedType(ffi::DataType t) {
  return ffi::Error::InvalidArgument(
      "jax_avgpool: unsupported element type " +
      std::to_string(static_cast<int>(t)) +
      "; expected float16, bfloat16, float32 or float64");
}

}  // namespace jax_avgpool

#endif  // JAX_AVGPOOL_FFI_COMMON_H_
