// CPU kernels for 2-D average pooling, forward and backward, and their XLA
// FFI handlers.
//
// Every kernel works on the folded logical shape of pooling.h (leading
// dimensions folded into one batch) in either layout, one output row (or
// image) at a time, so that XLA's intra-op thread pool can take disjoint
// ranges of rows (cpu_parallel.h). Each is a template on the Spec that
// WithSpec picks (kernel_spec.h): window and strides are compile-time
// constants in the specialisations, runtime values in the generic kernel.
// Inner loops run along W for NCHW and along C for NHWC, and vectorise.
// 16-bit types are widened row by row into float32 accumulators; float32
// and float64 accumulate in their own type. Offsets are 64-bit throughout.
#include "cpu_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"
#include "ffi_common.h"
#include "kernel_spec.h"
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

// The conversions compute every case and select one, without branches, so
// that the loops that call them vectorise.

inline float Widen(Half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t em = h.bits & 0x7fffu;  // exponent and mantissa
  // Zero or subnormal: mantissa * 2^-24, exact.
  const uint32_t tiny =
      FloatBits(static_cast<float>(em) * 5.9604644775390625e-8f);
  const uint32_t special = (em << 13) | 0x7f800000u;  // Inf or NaN
  const uint32_t normal = (em << 13) + (112u << 23);  // rebias the exponent
  const uint32_t bits =
      em < 0x0400u ? tiny : (em >= 0x7c00u ? special : normal);
  return BitsFloat(sign | bits);
}

inline Half NarrowHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  // Inf, or NaN kept quiet.
  const uint32_t special = 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u);
  // Below the smallest normal half: let float addition round.
  const uint32_t tiny = FloatBits(BitsFloat(ax) + 0.5f) - 0x3f000000u;
  // Rebias the exponent, round to nearest even.
  const uint32_t normal = (ax + 0xc8000fffu + ((ax >> 13) & 1u)) >> 13;
  const uint32_t bits = ax >= 0x7f800000u   ? special
                        : ax >= 0x477ff000u ? 0x7c00u  // overflows to Inf
                        : ax < 0x38800000u  ? tiny
                                            : normal;
  return {static_cast<uint16_t>(sign | bits)};
}

inline float Widen(BFloat16 b) {
  return BitsFloat(static_cast<uint32_t>(b.bits) << 16);
}

inline BFloat16 NarrowBFloat16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t quiet = (u >> 16) | 0x40u;  // NaN stays NaN, made quiet
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return {
      static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded)};
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
// Per-call geometry, computed once and shared by all threads.

struct Tables {
  std::vector<Window> rows;      // per output row
  std::vector<Window> cols;      // per output column
  std::vector<Cover> row_cover;  // per input row: covering output rows
};

Tables MakeTables(const PoolAttrs& a, const PoolShape& s) {
  Tables t;
  t.rows.resize(s.out_h);
  t.cols.resize(s.out_w);
  t.row_cover.resize(s.in_h);
  for (int64_t o = 0; o < s.out_h; ++o)
    t.rows[o] =
        WindowAt(o, s.in_h, a.kernel_h, a.stride_h, a.pad_top, a.pad_bottom);
  for (int64_t o = 0; o < s.out_w; ++o)
    t.cols[o] =
        WindowAt(o, s.in_w, a.kernel_w, a.stride_w, a.pad_left, a.pad_right);
  for (int64_t i = 0; i < s.in_h; ++i)
    t.row_cover[i] = CoverOf(i, s.out_h, a.kernel_h, a.stride_h, a.pad_top);
  return t;
}

// Divisors of every window, as the accumulator type, row-major (oh, ow).
// As large as the output plane, so filled by the pool too.
template <typename Acc>
std::vector<Acc> Divisors(const PoolAttrs& a, const PoolShape& s,
                          const Tables& t, ffi::ThreadPool* pool) {
  std::vector<Acc> d(static_cast<size_t>(s.out_h * s.out_w));
  ParallelFor(pool, s.out_h, s.out_w, [&](int64_t begin, int64_t end) {
    for (int64_t oh = begin; oh < end; ++oh)
      for (int64_t ow = 0; ow < s.out_w; ++ow)
        d[oh * s.out_w + ow] =
            static_cast<Acc>(Divisor(a, t.rows[oh], t.cols[ow]));
  });
  return d;
}

// Window and strides: compile-time constants in a specialised kernel (so
// that the tap loops unroll), the attributes in the generic one.
struct Taps {
  int64_t kh, kw, sh, sw;
};

template <typename S>
Taps TapsOf(const PoolAttrs& a) {
  if constexpr (S::kGeneric) {
    return {a.kernel_h, a.kernel_w, a.stride_h, a.stride_w};
  } else {
    return {S::KH, S::KW, S::SH, S::SW};
  }
}

// What the kernels of one call share. An "image" is what one pooled row
// lives in: a (H, W) plane for NCHW, an (H, W, C) image for NHWC, whose
// rows are then W pixels of C contiguous "lanes".
template <typename Acc>
struct Call {
  const PoolAttrs& a;
  PoolShape s;
  Tables t;
  std::vector<Acc> div;
  int64_t images;
  int64_t lanes;

  Call(const PoolAttrs& attrs, const PoolShape& shape, ffi::ThreadPool* pool)
      : a(attrs),
        s(shape),
        t(MakeTables(attrs, shape)),
        div(Divisors<Acc>(attrs, shape, t, pool)),
        images(attrs.layout == kNHWC ? shape.batch
                                     : shape.batch * shape.channels),
        lanes(attrs.layout == kNHWC ? shape.channels : 1) {}

  // Columns of a zero-padded input row that holds every window along W:
  // real column w sits at w + pad_left.
  int64_t PaddedWidth() const {
    return std::max((s.out_w - 1) * a.stride_w + a.kernel_w,
                    a.pad_left + s.in_w);
  }
};

// The hot loops are compiled for baseline x86-64 and for x86-64-v3 (AVX2,
// FMA, F16C), and the best one the host supports is picked at load time, so
// the wheel runs on any x86-64 yet uses AVX2 where present. Not AVX-512:
// rows of typical feature maps are short (56 columns), and its wider
// vectors leave most of a row to the loop's scalar remainder; measured
// slower. Elsewhere (aarch64: NEON is baseline) the compiler's default.
#if defined(__x86_64__) && defined(__ELF__) && \
    (defined(__GNUC__) || defined(__clang__))
#define JAX_AVGPOOL_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define JAX_AVGPOOL_CPU_CLONES
#endif

// ---------------------------------------------------------------------------
// Forward: y[oh, ow] = sum of x over the window / divisor.
//
// Per output row: sum the window's input rows into a zero-padded row of
// column sums (vectorised along W, or along C for NHWC), then sum KW
// adjacent column sums per output. Overlapping windows share the column
// sums instead of re-reading the input.

template <typename S, bool kNhwc, typename T>
JAX_AVGPOOL_CPU_CLONES void ForwardRows(const Call<typename Num<T>::Acc>& c,
                                        const T* __restrict x, T* __restrict y,
                                        int64_t begin, int64_t end) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  const Taps k = TapsOf<S>(c.a);
  const int64_t W = c.s.in_w, OH = c.s.out_h, OW = c.s.out_w;
  const int64_t L = kNhwc ? c.lanes : 1;
  const int64_t row = W * L;
  std::vector<Acc> padded(static_cast<size_t>(c.PaddedWidth() * L), Acc(0));
  Acc* __restrict col = padded.data();
  Acc* __restrict real = col + c.a.pad_left * L;  // the padding stays 0
  for (int64_t r = begin; r < end; ++r) {
    const int64_t image = r / OH, oh = r % OH;
    const Window& wh = c.t.rows[oh];
    const T* xr = x + (image * c.s.in_h + wh.start) * row;
    const int64_t rows = wh.end - wh.start;
    if (!S::kGeneric && rows == k.kh) {
      for (int64_t i = 0; i < row; ++i) {
        Acc sum = 0;
        for (int64_t h = 0; h < k.kh; ++h) sum += N::Load(xr[h * row + i]);
        real[i] = sum;
      }
    } else {
      for (int64_t i = 0; i < row; ++i) real[i] = 0;
      for (int64_t h = 0; h < rows; ++h)
        for (int64_t i = 0; i < row; ++i) real[i] += N::Load(xr[h * row + i]);
    }
    const Acc* d = c.div.data() + oh * OW;
    T* yr = y + (image * OH + oh) * OW * L;
    for (int64_t ow = 0; ow < OW; ++ow) {
      const Acc* win = col + ow * k.sw * L;
      for (int64_t l = 0; l < L; ++l) {
        Acc sum = 0;
        for (int64_t j = 0; j < k.kw; ++j) sum += win[j * L + l];
        yr[ow * L + l] = N::Store(sum / d[ow]);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Backward, gather: dx[h, w] = sum over the windows (oh, ow) that cover
// (h, w) of dy[oh, ow] / divisor, in ascending (oh, ow) order. Each dx
// element is written once, by one thread.
//
// The dy rows are divided by their divisors once per thread into "q rows"
// with zero columns on both sides, and cached while the dx rows that they
// cover are computed (at most ceil(KH / SH) of them cover one dx row). In
// zero-padded coordinates p = w + pad_left = i * SW + r, the outputs that
// cover p are ow = i - m_r ... i with m_r = floor((KW - 1 - r) / SW): the
// same taps for every i of a phase r. Taps outside [0, OW) read zeros, and
// adding +0 to a sum that started at +0 changes no bit, so the sums are
// bitwise those of the plain loop, and of the scatter kernel.
//
// A specialised kernel sums every dx element over the same number of rows
// (missing ones read a zero row) and taps, constants, in a register; the
// loop around that straight-line sum, over C for NHWC or over the groups of
// SW positions for NCHW, vectorises. The generic kernel adds row by row and
// tap by tap instead, each pass a vectorised loop: over C into an
// accumulator row for NHWC; for NCHW, over a block of i in registers, one
// phase after another, interleaved into dx at the end.

// The most dy rows (or columns) that cover one dx row (or column).
constexpr int64_t MaxCover(int64_t k, int64_t s) { return (k + s - 1) / s; }

// Taps m_r + 1 of the positions of phase r (none when r >= KW).
constexpr int64_t PhaseTaps(int64_t k, int64_t s, int64_t r) {
  return r < k ? (k - 1 - r) / s + 1 : 0;
}

// The sum of kRows q rows times kTaps taps, q[t][at + j * step], in (t, j)
// order.
template <int64_t kRows, int64_t kTaps, typename Acc>
inline Acc SumTaps(const Acc* const* q, int64_t at, int64_t step) {
  Acc sum = 0;
  for (int64_t t = 0; t < kRows; ++t)
    for (int64_t j = 0; j < kTaps; ++j) sum += q[t][at + j * step];
  return sum;
}

// Calls fn(std::integral_constant<int64_t, phase>) for a runtime phase
// in [0, S::SW).
template <typename S, int64_t kPhase = 0, typename Fn>
inline void WithPhase(int64_t phase, Fn&& fn) {
  if constexpr (kPhase + 1 < S::SW) {
    if (phase != kPhase) return WithPhase<S, kPhase + 1>(phase, fn);
  }
  fn(std::integral_constant<int64_t, kPhase>{});
}

// dx at the SW positions of group i, for phases kPhase... (NCHW).
template <typename S, typename N, int64_t kPhase = 0, typename Acc, typename T>
inline void GatherGroup(const Acc* const* q, int64_t i, T* out) {
  if constexpr (kPhase < S::SW) {
    constexpr int64_t kTaps = PhaseTaps(S::KW, S::SW, kPhase);
    constexpr int64_t kRows = MaxCover(S::KH, S::SH);
    out[kPhase] = N::Store(SumTaps<kRows, kTaps>(q, i - kTaps + 1, 1));
    GatherGroup<S, N, kPhase + 1>(q, i, out);
  }
}

template <typename S, bool kNhwc, typename T>
JAX_AVGPOOL_CPU_CLONES void GatherRows(const Call<typename Num<T>::Acc>& c,
                                       const T* __restrict dy, T* __restrict dx,
                                       int64_t begin, int64_t end) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  const Taps k = TapsOf<S>(c.a);
  const int64_t H = c.s.in_h, W = c.s.in_w, OH = c.s.out_h, OW = c.s.out_w;
  const int64_t L = kNhwc ? c.lanes : 1;
  const int64_t pl = c.a.pad_left;
  const int64_t groups = (pl + W - 1) / k.sw + 1;  // i ranges over them
  const int64_t lead = MaxCover(k.kw, k.sw) - 1;   // the largest m_r
  const int64_t slots = MaxCover(k.kh, k.sh);
  // Cached q rows and a row of zeros: `lead` zero columns, OW quotients,
  // zero columns up to the last group.
  // The generic NCHW kernel reads a block of kBlock groups past the last.
  constexpr int64_t kBlock = 16;
  const int64_t width =
      (std::max(OW, groups) + lead + (S::kGeneric && !kNhwc ? kBlock : 0)) * L;
  std::vector<Acc> qbuf(static_cast<size_t>((slots + 1) * width), Acc(0));
  const Acc* zeros = qbuf.data() + slots * width + lead * L;
  std::vector<int64_t> held(static_cast<size_t>(slots), -1);  // dy row ids
  std::vector<const Acc*> qrows(static_cast<size_t>(slots));
  const Acc* const* q = qrows.data();
  // The generic kernel's accumulator: a zero-padded dx row.
  std::vector<Acc> abuf(
      static_cast<size_t>(S::kGeneric ? groups * k.sw * L : 0));
  // Groups whose SW positions all are real columns.
  const int64_t first = (pl + k.sw - 1) / k.sw;
  const int64_t last = std::max(first, (pl + W) / k.sw);
  for (int64_t r = begin; r < end; ++r) {
    const int64_t image = r / H, h = r % H;
    const Cover& cover = c.t.row_cover[h];
    const int64_t rows = std::max<int64_t>(cover.last - cover.first + 1, 0);
    for (int64_t t = 0; t < slots; ++t) {
      const int64_t oh = cover.first + t;
      if (t >= rows) {
        qrows[t] = zeros;
        continue;
      }
      // Consecutive dy rows take distinct slots, and one cover spans at
      // most `slots` of them.
      const int64_t slot = oh % slots;
      Acc* row = qbuf.data() + slot * width + lead * L;
      if (held[slot] != image * OH + oh) {
        held[slot] = image * OH + oh;
        const T* g = dy + (image * OH + oh) * OW * L;
        const Acc* d = c.div.data() + oh * OW;
        for (int64_t ow = 0; ow < OW; ++ow)
          for (int64_t l = 0; l < L; ++l)
            row[ow * L + l] = N::Load(g[ow * L + l]) / d[ow];
      }
      qrows[t] = row;
    }
    T* out = dx + (image * H + h) * W * L;
    if constexpr (S::kGeneric && kNhwc) {
      Acc* acc = abuf.data();  // position-major, lanes contiguous
      for (int64_t i = 0; i < groups * k.sw * L; ++i) acc[i] = 0;
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t i = 0; i < groups; ++i)
          for (int64_t phase = 0; phase < k.sw; ++phase) {
            const int64_t taps = PhaseTaps(k.kw, k.sw, phase);
            Acc* a = acc + (i * k.sw + phase) * L;
            for (int64_t j = 0; j < taps; ++j) {
              const Acc* tap = q[t] + (i - taps + 1 + j) * L;
              for (int64_t l = 0; l < L; ++l) a[l] += tap[l];
            }
          }
      for (int64_t i = 0; i < W * L; ++i) out[i] = N::Store(acc[pl * L + i]);
    } else if constexpr (S::kGeneric) {
      // Phase-major; kBlock groups at a time summed in registers.
      Acc* acc = abuf.data();
      for (int64_t phase = 0; phase < k.sw; ++phase) {
        const int64_t taps = PhaseTaps(k.kw, k.sw, phase);
        for (int64_t i0 = 0; i0 < groups; i0 += kBlock) {
          Acc block[kBlock] = {};
          for (int64_t t = 0; t < rows; ++t)
            for (int64_t j = 0; j < taps; ++j) {
              const Acc* tap = q[t] + i0 + j - taps + 1;
              for (int64_t b = 0; b < kBlock; ++b) block[b] += tap[b];
            }
          Acc* a = acc + phase * groups + i0;
          for (int64_t b = 0; b < std::min(kBlock, groups - i0); ++b)
            a[b] = block[b];
        }
      }
      // Interleave: phase r of group i is column i * SW + r - pad_left.
      for (int64_t phase = 0; phase < k.sw; ++phase) {
        const int64_t lo = std::max<int64_t>(pl - phase + k.sw - 1, 0) / k.sw;
        for (int64_t i = lo, w = i * k.sw + phase - pl; w < W; ++i, w += k.sw)
          out[w] = N::Store(acc[phase * groups + i]);
      }
    } else {
      constexpr int64_t kRows = MaxCover(S::KH, S::SH);
      // One position, any phase: lanes in a vectorised loop.
      const auto at = [&](int64_t w) {
        const int64_t p = w + pl;
        WithPhase<S>(p % S::SW, [&](auto phase) {
          constexpr int64_t kTaps = PhaseTaps(S::KW, S::SW, phase);
          const int64_t tap = (p / S::SW - kTaps + 1) * L;
          for (int64_t l = 0; l < L; ++l)
            out[w * L + l] = N::Store(SumTaps<kRows, kTaps>(q, tap + l, L));
        });
      };
      if constexpr (kNhwc) {
        for (int64_t w = 0; w < W; ++w) at(w);
      } else {
        // The edges, groups with a position in the padding, one by one;
        // full groups vectorised along i.
        for (int64_t w = 0; w < std::min(W, first * S::SW - pl); ++w) at(w);
        for (int64_t w = last * S::SW - pl; w < W; ++w) at(w);
        T* o = out + first * S::SW - pl;
        for (int64_t i = first; i < last; ++i)
          GatherGroup<S, N>(q, i, o + (i - first) * S::SW);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Backward, scatter: zero an accumulator image, spread each dy[oh, ow] /
// divisor uniformly over its window in ascending (oh, ow) order, then
// narrow into dx. Images are independent, so threads take whole images.
// The accumulator rows are zero-padded like the forward's column sums, so
// that a window needs no clipping along W.

template <typename S, bool kNhwc, typename T>
JAX_AVGPOOL_CPU_CLONES void ScatterImages(const Call<typename Num<T>::Acc>& c,
                                          const T* __restrict dy,
                                          T* __restrict dx, int64_t begin,
                                          int64_t end) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  const Taps k = TapsOf<S>(c.a);
  const int64_t H = c.s.in_h, W = c.s.in_w, OH = c.s.out_h, OW = c.s.out_w;
  const int64_t L = kNhwc ? c.lanes : 1;
  const int64_t wp = c.PaddedWidth();
  std::vector<Acc> abuf(static_cast<size_t>(H * wp * L));
  Acc* __restrict acc = abuf.data();
  std::vector<Acc> qbuf(static_cast<size_t>(OW * L));
  Acc* __restrict q = qbuf.data();
  for (int64_t image = begin; image < end; ++image) {
    for (int64_t i = 0; i < H * wp * L; ++i) acc[i] = 0;
    for (int64_t oh = 0; oh < OH; ++oh) {
      const T* g = dy + (image * OH + oh) * OW * L;
      const Acc* d = c.div.data() + oh * OW;
      for (int64_t ow = 0; ow < OW; ++ow)
        for (int64_t l = 0; l < L; ++l)
          q[ow * L + l] = N::Load(g[ow * L + l]) / d[ow];
      const Window& wh = c.t.rows[oh];
      for (int64_t h = wh.start; h < wh.end; ++h) {
        Acc* ar = acc + h * wp * L;
        if constexpr (kNhwc) {
          for (int64_t ow = 0; ow < OW; ++ow) {
            Acc* a = ar + ow * k.sw * L;
            const Acc* qc = q + ow * L;
            for (int64_t j = 0; j < k.kw; ++j)
              for (int64_t l = 0; l < L; ++l) a[j * L + l] += qc[l];
          }
        } else {
          // Tap by tap, the last first: within one tap the windows write
          // distinct columns (no chain through memory, vectorisable), and
          // a column still receives its windows in ascending ow.
          for (int64_t j = k.kw - 1; j >= 0; --j)
            for (int64_t ow = 0; ow < OW; ++ow) ar[ow * k.sw + j] += q[ow];
        }
      }
    }
    T* out = dx + image * H * W * L;
    for (int64_t h = 0; h < H; ++h) {
      const Acc* real = acc + (h * wp + c.a.pad_left) * L;
      for (int64_t i = 0; i < W * L; ++i)
        out[h * W * L + i] = N::Store(real[i]);
    }
  }
}

// ---------------------------------------------------------------------------
// Dispatch: the runtime element type, the kernel specialisation (the same
// choice, and so the same kernel ids, as jax_avgpool.plan() reports) and
// the layout select one instantiation; ParallelFor splits its work.

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

// Calls fn(spec, layout tag) with the kernel's compile-time choices.
template <typename Fn>
void WithKernel(const PoolAttrs& a, Fn&& fn) {
  WithSpec(a, [&](auto spec) {
    if (a.layout == kNHWC) {
      fn(spec, std::true_type{});
    } else {
      fn(spec, std::false_type{});
    }
  });
}

ffi::Error ForwardImpl(ffi::ThreadPool pool,             // thread pool
                       ffi::AnyBuffer x,                 // x
                       ffi::Result<ffi::AnyBuffer> y,    // y
                       ffi::Dictionary geometry_attr) {  // geometry
  PoolAttrs geometry;
  PoolShape s;
  if (ffi::Error e = DecodeCall(geometry_attr, x, *y, &geometry, &s);
      e.failure()) {
    return e;
  }
  return DispatchFloat(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.untyped_data());
    T* out = static_cast<T*>(y->untyped_data());
    const Call<typename Num<T>::Acc> c(geometry, s, &pool);
    WithKernel(geometry, [&](auto spec, auto nhwc) {
      using S = decltype(spec);
      // One unit is one output row: its window rows, then its columns.
      const int64_t work =
          (geometry.kernel_h * s.in_w + geometry.kernel_w * s.out_w) * c.lanes;
      ParallelFor(&pool, c.images * s.out_h, work,
                  [&](int64_t begin, int64_t end) {
                    ForwardRows<S, nhwc.value>(c, in, out, begin, end);
                  });
    });
  });
}

ffi::Error BackwardImpl(ffi::ThreadPool pool,            // thread pool
                        ffi::AnyBuffer dy,               // dy
                        ffi::Result<ffi::AnyBuffer> dx,  // dx
                        ffi::Dictionary geometry_attr,   // geometry
                        int64_t strategy) {              // strategy
  if (ffi::Error e = CheckStrategy(strategy); e.failure()) return e;
  PoolAttrs geometry;
  PoolShape s;
  if (ffi::Error e = DecodeCall(geometry_attr, *dx, dy, &geometry, &s);
      e.failure()) {
    return e;
  }
  return DispatchFloat(dy.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* g = static_cast<const T*>(dy.untyped_data());
    T* d = static_cast<T*>(dx->untyped_data());
    const Call<typename Num<T>::Acc> c(geometry, s, &pool);
    WithKernel(geometry, [&](auto spec, auto nhwc) {
      using S = decltype(spec);
      if (strategy == kGather) {
        // One unit is one dx row: its terms, and about one dy row divided.
        const int64_t terms = MaxCover(geometry.kernel_h, geometry.stride_h) *
                              MaxCover(geometry.kernel_w, geometry.stride_w);
        const int64_t work = (terms * s.in_w + s.out_w) * c.lanes;
        ParallelFor(&pool, c.images * s.in_h, work,
                    [&](int64_t begin, int64_t end) {
                      GatherRows<S, nhwc.value>(c, g, d, begin, end);
                    });
      } else {
        // One unit is one whole image: its accumulator is private.
        const int64_t work =
            (s.out_h * s.out_w * geometry.kernel_h * geometry.kernel_w +
             s.in_h * s.in_w) *
            c.lanes;
        ParallelFor(&pool, c.images, work, [&](int64_t begin, int64_t end) {
          ScatterImages<S, nhwc.value>(c, g, d, begin, end);
        });
      }
    });
  });
}

}  // namespace
}  // namespace jax_avgpool

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxAvgPoolForwardCpu, jax_avgpool::ForwardImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::ThreadPool>()               // thread pool
        .Arg<xla::ffi::AnyBuffer>()                // x
        .Ret<xla::ffi::AnyBuffer>()                // y
        .Attr<xla::ffi::Dictionary>("geometry"));  // geometry

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxAvgPoolBackwardCpu, jax_avgpool::BackwardImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::ThreadPool>()             // thread pool
        .Arg<xla::ffi::AnyBuffer>()              // dy
        .Ret<xla::ffi::AnyBuffer>()              // dx
        .Attr<xla::ffi::Dictionary>("geometry")  // geometry
        .Attr<int64_t>("strategy"));             // strategy
