// Pooling geometry shared by the host and device code: attribute validation,
// output sizes, window bounds and divisors. Nothing here knows about XLA,
// nanobind or any particular backend.
#ifndef JAX_AVGPOOL_POOLING_H_
#define JAX_AVGPOOL_POOLING_H_

#include <cstdint>

#if defined(__CUDACC__)
#define JAX_AVGPOOL_HD __host__ __device__ __forceinline__
#else
#define JAX_AVGPOOL_HD inline
#endif

namespace jax_avgpool {

// How each window's sum is turned into an average.
enum DivisorMode : int64_t {
  kCountPadded = 0,  // window size clipped to the padded extent
  kCountReal = 1,    // number of real (non-padding) elements in the window
  kOverride = 2,     // a fixed user-given divisor
};

enum Layout : int64_t {
  kNCHW = 0,  // (..., C, H, W)
  kNHWC = 1,  // (..., H, W, C)
};

enum BackwardStrategy : int64_t {
  kGather = 0,   // each dx element sums the dy windows that cover it
  kScatter = 1,  // zero dx, then spread each dy uniformly over its window
};

// The static pooling constants. Field order is the order of the custom
// call's `geometry` dictionary attribute members (see ffi_common.h).
struct PoolAttrs {
  int64_t kernel_h;
  int64_t kernel_w;
  int64_t stride_h;
  int64_t stride_w;
  int64_t pad_top;
  int64_t pad_bottom;
  int64_t pad_left;
  int64_t pad_right;
  int64_t ceil_mode;         // 0 or 1
  int64_t divisor_mode;      // a DivisorMode
  int64_t divisor_override;  // used when divisor_mode == kOverride
  int64_t layout;            // a Layout
};

// Returns nullptr when the attributes are valid, else a description of the
// first rule they break.
inline const char* ValidateAttrs(const PoolAttrs& a) {
  if (a.kernel_h < 1 || a.kernel_w < 1) return "kernel size must be >= 1";
  if (a.stride_h < 1 || a.stride_w < 1) return "stride must be >= 1";
  if (a.pad_top < 0 || a.pad_bottom < 0 || a.pad_left < 0 || a.pad_right < 0)
    return "padding must be >= 0";
  if (a.ceil_mode != 0 && a.ceil_mode != 1) return "ceil_mode must be 0 or 1";
  if (a.divisor_mode < kCountPadded || a.divisor_mode > kOverride)
    return "divisor_mode must be 0 (count padded), 1 (count real) or 2 "
           "(override)";
  if (a.divisor_mode == kOverride && a.divisor_override == 0)
    return "divisor_override must not be 0";
  if (a.layout != kNCHW && a.layout != kNHWC)
    return "layout must be 0 (NCHW) or 1 (NHWC)";
  return nullptr;
}

// Number of windows along one axis of extent `in`, following PyTorch's rule
// generalised to asymmetric padding: floor((in + lo + hi - k) / s) + 1, or
// with ceil_mode ceil(...) + 1 minus a last window that would start at or
// past in + lo. Returns 0 when no window fits.
JAX_AVGPOOL_HD int64_t PooledSize(int64_t in, int64_t k, int64_t s, int64_t lo,
                                  int64_t hi, bool ceil_mode) {
  const int64_t span = in + lo + hi - k;
  if (span < 0) return 0;
  int64_t out = (ceil_mode ? (span + s - 1) / s : span / s) + 1;
  if (ceil_mode && (out - 1) * s >= in + lo) --out;
  return out;
}

// One window along one axis: [start, end) in input coordinates, clipped to
// the real extent [0, in), and the count used by the padded divisor rule
// (the window clipped to [-lo, in + hi)).
struct Window {
  int64_t start;
  int64_t end;
  int64_t padded_count;
};

JAX_AVGPOOL_HD Window WindowAt(int64_t o, int64_t in, int64_t k, int64_t s,
                               int64_t lo, int64_t hi) {
  const int64_t begin = o * s - lo;
  const int64_t stop = begin + k < in + hi ? begin + k : in + hi;
  Window w;
  w.start = begin > 0 ? begin : 0;
  w.end = stop < in ? stop : in;
  if (w.end < w.start) w.end = w.start;
  w.padded_count = stop - begin;
  return w;
}

// The outputs along one axis whose windows cover input index i:
// [first, last] (empty when first > last).
struct Cover {
  int64_t first;
  int64_t last;
};

JAX_AVGPOOL_HD Cover CoverOf(int64_t i, int64_t out, int64_t k, int64_t s,
                             int64_t lo) {
  const int64_t low = i + lo - k + 1;
  Cover c;
  c.first = low <= 0 ? 0 : (low + s - 1) / s;
  const int64_t high = (i + lo) / s;
  c.last = high < out - 1 ? high : out - 1;
  return c;
}

// Divisor of the window (wh, ww). Under the count-real rule a window with no
// real element (possible only with padding wider than the window) gets 0,
// so its average is 0 / 0 = NaN, as in flax.linen.avg_pool. PyTorch's
// padding rule (pad <= kernel / 2, ceil_mode windows starting inside the
// input) never produces such a window.
JAX_AVGPOOL_HD int64_t Divisor(const PoolAttrs& a, const Window& wh,
                               const Window& ww) {
  switch (a.divisor_mode) {
    case kCountPadded:
      return wh.padded_count * ww.padded_count;
    case kCountReal:
      return (wh.end - wh.start) * (ww.end - ww.start);
    default:
      return a.divisor_override;
  }
}

// Logical shape of one call: leading dimensions folded into `batch`.
struct PoolShape {
  int64_t batch;
  int64_t channels;
  int64_t in_h, in_w;
  int64_t out_h, out_w;
};

// The logical shape of a call whose pooled side (x for the forward, dx for
// the backward) has the dimensions `dims` (any indexable sequence of rank 3
// or more): all but the last three folded into the batch, the pooled sizes
// from the attributes.
template <typename Dims>
PoolShape FoldShape(const PoolAttrs& a, const Dims& dims) {
  const size_t r = dims.size();
  int64_t batch = 1;
  for (size_t i = 0; i + 3 < r; ++i) batch *= dims[i];
  const bool nhwc = a.layout == kNHWC;
  const int64_t c = dims[nhwc ? r - 1 : r - 3];
  const int64_t h = dims[nhwc ? r - 3 : r - 2];
  const int64_t w = dims[nhwc ? r - 2 : r - 1];
  return PoolShape{
      batch,
      c,
      h,
      w,
      PooledSize(h, a.kernel_h, a.stride_h, a.pad_top, a.pad_bottom,
                 a.ceil_mode != 0),
      PooledSize(w, a.kernel_w, a.stride_w, a.pad_left, a.pad_right,
                 a.ceil_mode != 0)};
}

}  // namespace jax_avgpool

#endif  // JAX_AVGPOOL_POOLING_H_
