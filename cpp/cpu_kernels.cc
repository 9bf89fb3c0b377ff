// CPU kernels for 2-D average pooling, forward and backward, and their XLA
// FFI handlers.
//
// Every kernel works on the folded logical shape of pooling.h (leading
// dimensions folded into one batch) in either layout. 16-bit types are
// loaded into float32 accumulators one element at a time; float32 and
// float64 accumulate in their own type. Offsets are 64-bit throughout.
#include "cpu_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ffi_common.h"
#include "pooling.h"
#include "xla/ffi/api/ffi.h"

namespace jax_avgpool {
namespace {

namespace ffi = ::xla::ffi;

// ---------------------------------------------------------------------------
// Element types. 16-bit floats are stored as their bit patterns and widened
// to float32 for arithmetic; narrowing rounds to nearest even.

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float Widen(Half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exponent = (h.bits >> 10) & 0x1fu;
  const uint32_t mantissa = h.bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact
    const float v = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exponent == 31) return BitsFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline Half NarrowHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {  // Inf or NaN (kept quiet)
    return {static_cast<uint16_t>(sign | 0x7c00u |
                                  (ax > 0x7f800000u ? 0x200u : 0u))};
  }
  if (ax >= 0x477ff000u) return {static_cast<uint16_t>(sign | 0x7c00u)};
  if (ax < 0x38800000u) {  // below the smallest normal half: round in float
    const float v = BitsFloat(ax) + 0.5f;
    return {static_cast<uint16_t>(sign | (FloatBits(v) - 0x3f000000u))};
  }
  ax += 0xc8000fffu + ((ax >> 13) & 1u);  // rebias the exponent, round even
  return {static_cast<uint16_t>(sign | (ax >> 13))};
}

inline float Widen(BFloat16 b) {
  return BitsFloat(static_cast<uint32_t>(b.bits) << 16);
}

inline BFloat16 NarrowBFloat16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return {static_cast<uint16_t>((u >> 16) | 0x40u)};
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}

template <typename T>
struct Num {  // float, double: accumulate in the type itself
  using Acc = T;
  static Acc Load(T v) { return v; }
  static T Store(Acc v) { return v; }
};
template <>
struct Num<Half> {
  using Acc = float;
  static Acc Load(Half v) { return Widen(v); }
  static Half Store(Acc v) { return NarrowHalf(v); }
};
template <>
struct Num<BFloat16> {
  using Acc = float;
  static Acc Load(BFloat16 v) { return Widen(v); }
  static BFloat16 Store(Acc v) { return NarrowBFloat16(v); }
};

// ---------------------------------------------------------------------------
// Geometry tables computed once per call.

struct Tables {
  std::vector<Window> rows;      // per output row
  std::vector<Window> cols;      // per output column
  std::vector<Cover> row_cover;  // per input row: covering output rows
  std::vector<Cover> col_cover;  // per input column
};

Tables MakeTables(const PoolAttrs& a, const PoolShape& s) {
  Tables t;
  t.rows.resize(s.out_h);
  t.cols.resize(s.out_w);
  t.row_cover.resize(s.in_h);
  t.col_cover.resize(s.in_w);
  for (int64_t o = 0; o < s.out_h; ++o)
    t.rows[o] =
        WindowAt(o, s.in_h, a.kernel_h, a.stride_h, a.pad_top, a.pad_bottom);
  for (int64_t o = 0; o < s.out_w; ++o)
    t.cols[o] =
        WindowAt(o, s.in_w, a.kernel_w, a.stride_w, a.pad_left, a.pad_right);
  for (int64_t i = 0; i < s.in_h; ++i)
    t.row_cover[i] = CoverOf(i, s.out_h, a.kernel_h, a.stride_h, a.pad_top);
  for (int64_t i = 0; i < s.in_w; ++i)
    t.col_cover[i] = CoverOf(i, s.out_w, a.kernel_w, a.stride_w, a.pad_left);
  return t;
}

// Divisors of every window, as the accumulator type, row-major (oh, ow).
template <typename Acc>
std::vector<Acc> Divisors(const PoolAttrs& a, const PoolShape& s,
                          const Tables& t) {
  std::vector<Acc> d(static_cast<size_t>(s.out_h * s.out_w));
  for (int64_t oh = 0; oh < s.out_h; ++oh)
    for (int64_t ow = 0; ow < s.out_w; ++ow)
      d[oh * s.out_w + ow] =
          static_cast<Acc>(Divisor(a, t.rows[oh], t.cols[ow]));
  return d;
}

// ---------------------------------------------------------------------------
// Forward: y[oh, ow] = sum of x over the window / divisor.

template <typename T>
void Forward(const PoolAttrs& a, const PoolShape& s, const T* x, T* y) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  const Tables t = MakeTables(a, s);
  const std::vector<Acc> div = Divisors<Acc>(a, s, t);
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const int64_t C = s.channels;
  if (a.layout == kNCHW) {
    for (int64_t p = 0; p < s.batch * C; ++p) {
      const T* xp = x + p * H * W;
      T* yp = y + p * OH * OW;
      for (int64_t oh = 0; oh < OH; ++oh) {
        const Window& wh = t.rows[oh];
        for (int64_t ow = 0; ow < OW; ++ow) {
          const Window& ww = t.cols[ow];
          Acc sum = 0;
          for (int64_t h = wh.start; h < wh.end; ++h)
            for (int64_t w = ww.start; w < ww.end; ++w)
              sum += N::Load(xp[h * W + w]);
          yp[oh * OW + ow] = N::Store(sum / div[oh * OW + ow]);
        }
      }
    }
    return;
  }
  std::vector<Acc> acc(static_cast<size_t>(C));
  for (int64_t n = 0; n < s.batch; ++n) {
    const T* xn = x + n * H * W * C;
    T* yn = y + n * OH * OW * C;
    for (int64_t oh = 0; oh < OH; ++oh) {
      const Window& wh = t.rows[oh];
      for (int64_t ow = 0; ow < OW; ++ow) {
        const Window& ww = t.cols[ow];
        std::fill(acc.begin(), acc.end(), Acc(0));
        for (int64_t h = wh.start; h < wh.end; ++h)
          for (int64_t w = ww.start; w < ww.end; ++w) {
            const T* xc = xn + (h * W + w) * C;
            for (int64_t c = 0; c < C; ++c) acc[c] += N::Load(xc[c]);
          }
        const Acc d = div[oh * OW + ow];
        T* yc = yn + (oh * OW + ow) * C;
        for (int64_t c = 0; c < C; ++c) yc[c] = N::Store(acc[c] / d);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Backward, gather: dx[h, w] = sum over the windows (oh, ow) that cover
// (h, w) of dy[oh, ow] / divisor, in ascending (oh, ow) order. Each dx
// element is written once.

template <typename T>
void BackwardGather(const PoolAttrs& a, const PoolShape& s, const T* dy,
                    T* dx) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  const Tables t = MakeTables(a, s);
  const std::vector<Acc> div = Divisors<Acc>(a, s, t);
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const int64_t C = s.channels;
  if (a.layout == kNCHW) {
    for (int64_t p = 0; p < s.batch * C; ++p) {
      const T* gp = dy + p * OH * OW;
      T* dp = dx + p * H * W;
      for (int64_t h = 0; h < H; ++h) {
        const Cover& ch = t.row_cover[h];
        for (int64_t w = 0; w < W; ++w) {
          const Cover& cw = t.col_cover[w];
          Acc sum = 0;
          for (int64_t oh = ch.first; oh <= ch.last; ++oh)
            for (int64_t ow = cw.first; ow <= cw.last; ++ow)
              sum += N::Load(gp[oh * OW + ow]) / div[oh * OW + ow];
          dp[h * W + w] = N::Store(sum);
        }
      }
    }
    return;
  }
  std::vector<Acc> acc(static_cast<size_t>(C));
  for (int64_t n = 0; n < s.batch; ++n) {
    const T* gn = dy + n * OH * OW * C;
    T* dn = dx + n * H * W * C;
    for (int64_t h = 0; h < H; ++h) {
      const Cover& ch = t.row_cover[h];
      for (int64_t w = 0; w < W; ++w) {
        const Cover& cw = t.col_cover[w];
        std::fill(acc.begin(), acc.end(), Acc(0));
        for (int64_t oh = ch.first; oh <= ch.last; ++oh)
          for (int64_t ow = cw.first; ow <= cw.last; ++ow) {
            const T* gc = gn + (oh * OW + ow) * C;
            const Acc d = div[oh * OW + ow];
            for (int64_t c = 0; c < C; ++c) acc[c] += N::Load(gc[c]) / d;
          }
        T* dc = dn + (h * W + w) * C;
        for (int64_t c = 0; c < C; ++c) dc[c] = N::Store(acc[c]);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Backward, scatter: zero an accumulator image, spread each dy[oh, ow] /
// divisor uniformly over its window, then narrow into dx.

template <typename T>
void BackwardScatter(const PoolAttrs& a, const PoolShape& s, const T* dy,
                     T* dx) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  const Tables t = MakeTables(a, s);
  const std::vector<Acc> div = Divisors<Acc>(a, s, t);
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const int64_t C = s.channels;
  const bool nchw = a.layout == kNCHW;
  // One accumulator image: a (H, W) plane for NCHW, an (H, W, C) image for
  // NHWC.
  const int64_t image = nchw ? H * W : H * W * C;
  const int64_t images = nchw ? s.batch * C : s.batch;
  const int64_t lanes = nchw ? 1 : C;
  std::vector<Acc> acc(static_cast<size_t>(image));
  for (int64_t p = 0; p < images; ++p) {
    const T* gp = dy + p * OH * OW * lanes;
    std::fill(acc.begin(), acc.end(), Acc(0));
    for (int64_t oh = 0; oh < OH; ++oh) {
      const Window& wh = t.rows[oh];
      for (int64_t ow = 0; ow < OW; ++ow) {
        const Window& ww = t.cols[ow];
        const Acc d = div[oh * OW + ow];
        const T* gc = gp + (oh * OW + ow) * lanes;
        for (int64_t h = wh.start; h < wh.end; ++h)
          for (int64_t w = ww.start; w < ww.end; ++w) {
            Acc* ac = acc.data() + (h * W + w) * lanes;
            for (int64_t c = 0; c < lanes; ++c) ac[c] += N::Load(gc[c]) / d;
          }
      }
    }
    T* dp = dx + p * image;
    for (int64_t i = 0; i < image; ++i) dp[i] = N::Store(acc[i]);
  }
}

// ---------------------------------------------------------------------------
// Dispatch on the runtime element type.

template <typename Fn>
ffi::Error DispatchFloat(ffi::DataType type, Fn&& fn) {
  switch (type) {
    case ffi::DataType::F16:
      fn(Half{});
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      fn(BFloat16{});
      return ffi::Error::Success();
    case ffi::DataType::F32:
      fn(float{});
      return ffi::Error::Success();
    case ffi::DataType::F64:
      fn(double{});
      return ffi::Error::Success();
    default:
      return UnsupportedType(type);
  }
}

ffi::Error ForwardImpl(ffi::AnyBuffer x,               // x
                       ffi::Result<ffi::AnyBuffer> y,  // y
                       ffi::Dictionary geometry_attr) {           // geometry
  PoolAttrs geometry;
  if (ffi::Error e = DecodeGeometry(geometry_attr, &geometry); e.failure()) {
    return e;
  }
  PoolShape s;
  if (ffi::Error e = CheckShapes(geometry, x, *y, &s); e.failure()) return e;
  return DispatchFloat(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    Forward<T>(geometry, s, static_cast<const T*>(x.untyped_data()),
               static_cast<T*>(y->untyped_data()));
  });
}

ffi::Error BackwardImpl(ffi::AnyBuffer dy,               // dy
                        ffi::Result<ffi::AnyBuffer> dx,  // dx
                        ffi::Dictionary geometry_attr,              // geometry
                        int64_t strategy) {              // strategy
  if (ffi::Error e = CheckStrategy(strategy); e.failure()) return e;
  PoolAttrs geometry;
  if (ffi::Error e = DecodeGeometry(geometry_attr, &geometry); e.failure()) {
    return e;
  }
  PoolShape s;
  if (ffi::Error e = CheckShapes(geometry, *dx, dy, &s); e.failure()) return e;
  return DispatchFloat(dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* g = static_cast<const T*>(dy.untyped_data());
    T* d = static_cast<T*>(dx->untyped_data());
    if (strategy == kGather) {
      BackwardGather<T>(geometry, s, g, d);
    } else {
      BackwardScatter<T>(geometry, s, g, d);
    }
  });
}

}  // namespace
}  // namespace jax_avgpool

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxAvgPoolForwardCpu, jax_avgpool::ForwardImpl,
    xla::ffi::Ffi::Bind()
        .Arg<xla::ffi::AnyBuffer>()                  // x
        .Ret<xla::ffi::AnyBuffer>()                  // y
        .Attr<xla::ffi::Dictionary>("geometry"));  // geometry

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxAvgPoolBackwardCpu, jax_avgpool::BackwardImpl,
    xla::ffi::Ffi::Bind()
        .Arg<xla::ffi::AnyBuffer>()                // dy
        .Ret<xla::ffi::AnyBuffer>()                // dx
        .Attr<xla::ffi::Dictionary>("geometry")  // geometry
        .Attr<int64_t>("strategy"));               // strategy
