// CUDA kernels for 2-D average pooling: forward and deterministic gather
// backward, in NCHW and NHWC, and their launchers (the atomic scatter is in
// cuda_scatter.cu).
//
// Four families:
// - NCHW row kernels (the specialisations, when W is a multiple of the
//   16-byte chunk): the lanes of a warp cover consecutive chunks of the same
//   rows and exchange the columns at chunk edges by warp shuffles; see
//   "NCHW row kernels" below.
// - NHWC kernels: a work item is BLOCK adjacent outputs (forward) or inputs
//   (gather) along W times one vector of V channels, so a warp's accesses
//   are contiguous channel vectors. For the specialisations, of a segment
//   of rows that the item walks down, loading each source row once, for
//   stride 1 and the 3x3/2 forward (see "NHWC: a sliding window down H";
//   windows wider than 3 at stride 1 sum along W through shared memory,
//   see "the box filter", and for 16-bit types with channels in 64s on the
//   tensor cores, in cuda_box_mma.cu); of a block of rows for the others.
// - NCHW planes in shared memory, for stride-1 windows of 5 and more (7x7/1)
//   on planes small enough that a few fit in a block's shared memory. Where
//   every window shares one divisor and the rows allow, a lane per strip of
//   four columns walks down its plane with its sums in registers (the 16-bit
//   forwards, the 16-bit and float32 gathers; see "strips of registers");
//   else the forward, and the 16-bit gathers, as two separable passes
//   through shared memory (see "whole planes in shared memory"). The 16-bit
//   forwards of calls of many planes with rows of 18 to 32 columns take the
//   sums on the tensor cores instead (cuda_box_mma.cu).
// - Direct NCHW kernels for every other call: grid-stride loops over BLOCK
//   adjacent outputs or inputs along W, and a shared-memory tiled gather for
//   heavily overlapping generic windows.
// KH, KW, SH, SW and BLOCK are compile-time constants for the
// specialisations of kernel_spec.h and runtime values in the generic kernels
// (BLOCK 1). 16-bit types accumulate in float32. Offsets are 64-bit; index
// decomposition uses 32-bit arithmetic where it fits.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda_common.cuh"

namespace jax_avgpool::cuda {
namespace {

// SlidingSums down the first axis of a table, column by column:
// out[o][j] = in[o][j] + ... + in[o + K - 1][j].
template <int K, typename Acc, int M, int N, int R>
__device__ __forceinline__ void SlidingRows(const Acc (&in)[M][N],
                                            Acc (&out)[R][N]) {
  static_assert(M >= R + K - 1);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    Acc col[R];
    SlidingSums<K, R>([&](int i) { return in[i][j]; }, col);
#pragma unroll
    for (int o = 0; o < R; ++o) out[o][j] = col[o];
  }
}

// ---------------------------------------------------------------------------
// Forward.

// NCHW: a work item is (plane p, output row oh, group g of BLOCK outputs).
template <typename T, typename S>
__global__ void __launch_bounds__(kThreads)
    ForwardNchw(const PoolAttrs a, const PoolShape s, const T* __restrict__ x,
                T* __restrict__ y, const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  constexpr int B = S::BLOCK;
  const Consts<S> k(a);
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const int64_t groups = (OW + B - 1) / B;
  const int64_t ncol = (B - 1) * k.sw + k.kw;
  const bool narrow = total <= INT32_MAX;
  const bool whole_vectors = CanStoreRuns<T, B>(y, OW);
  for (int64_t i = FirstThread(); i < total; i += ThreadCount()) {
    const Split3 at = Decompose(i, OH, groups, narrow);
    const int64_t p = at.outer, oh = at.mid, ow0 = at.inner * B;
    const Window wh = WindowAt(oh, H, k.kh, k.sh, a.pad_top, a.pad_bottom);
    const int64_t c0 = ow0 * k.sw - a.pad_left;
    const T* plane = x + p * H * W;
    Acc acc[B];
#pragma unroll
    for (int b = 0; b < B; ++b) acc[b] = Acc(0);
    for (int64_t h = wh.start; h < wh.end; ++h) {
      const T* row = plane + h * W;
#pragma unroll
      for (int64_t j = 0; j < ncol; ++j) {
        const int64_t c = c0 + j;
        if (c < 0 || c >= W) continue;
        const Acc v = N::Load(row[c]);
#pragma unroll
        for (int b = 0; b < B; ++b) {
          const int64_t kk = j - b * k.sw;
          if (kk >= 0 && kk < k.kw) acc[b] += v;
        }
      }
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const Window ww =
          WindowAt(ow0 + b, W, k.kw, k.sw, a.pad_left, a.pad_right);
      acc[b] /= static_cast<Acc>(Divisor(a, wh, ww));
    }
    StoreRun<T, B>(y + (p * OH + oh) * OW + ow0, acc, OW - ow0, whole_vectors);
  }
}

// NHWC, generic: a work item is (image n and output row oh, group g of
// BLOCK outputs, vector v of V channels).
template <typename T, typename S, int V>
__global__ void __launch_bounds__(kThreads)
    ForwardNhwc(const PoolAttrs a, const PoolShape s, const T* __restrict__ x,
                T* __restrict__ y, const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  using VecT = Vec<T, V>;
  constexpr int B = S::BLOCK;
  const Consts<S> k(a);
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const int64_t C = s.channels, CV = C / V;
  const int64_t groups = (OW + B - 1) / B;
  const int64_t ncol = (B - 1) * k.sw + k.kw;
  const bool narrow = total <= INT32_MAX;
  for (int64_t i = FirstThread(); i < total; i += ThreadCount()) {
    const Split3 at = Decompose(i, groups, CV, narrow);
    const int64_t row_id = at.outer;  // n * OH + oh
    const Split2 n_oh = DivMod(row_id, OH, narrow);
    const int64_t n = n_oh.quot, oh = n_oh.rem;
    const int64_t ow0 = at.mid * B, c_off = at.inner * V;
    const Window wh = WindowAt(oh, H, k.kh, k.sh, a.pad_top, a.pad_bottom);
    const int64_t c0 = ow0 * k.sw - a.pad_left;
    Acc acc[B][V];
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
      for (int e = 0; e < V; ++e) acc[b][e] = Acc(0);
    const int64_t h_first = wh.start, rows = wh.end - wh.start;
#pragma unroll
    for (int64_t dr = 0; dr < rows; ++dr) {
      const int64_t h = h_first + dr;
      const bool row_ok = h >= 0 && h < H;
      const T* row = x + (n * H + (row_ok ? h : 0)) * W * C + c_off;
#pragma unroll
      for (int64_t j = 0; j < ncol; ++j) {
        const int64_t c = c0 + j;
        const bool ok = row_ok && c >= 0 && c < W;
        const VecT v = LoadOrZero<T, V>(row + c * C, ok);
#pragma unroll
        for (int b = 0; b < B; ++b) {
          const int64_t kk = j - b * k.sw;
          if (kk >= 0 && kk < k.kw) {
#pragma unroll
            for (int e = 0; e < V; ++e) acc[b][e] += N::Load(v.v[e]);
          }
        }
      }
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int64_t ow = ow0 + b;
      if (ow < OW) {
        const Window ww = WindowAt(ow, W, k.kw, k.sw, a.pad_left, a.pad_right);
        const Acc r = Reciprocal(static_cast<Acc>(Divisor(a, wh, ww)));
        VecT out;
#pragma unroll
        for (int e = 0; e < V; ++e) out.v[e] = N::Store(acc[b][e] * r);
        *reinterpret_cast<VecT*>(y + (row_id * OW + ow) * C + c_off) = out;
      }
    }
  }
}

// Stores the first min(n, B) of B adjacent NHWC positions, C elements apart,
// each a vector of V channels: acc[b] times scale(b), narrowed.
// With kAdd (the scatter, LaunchAddingGather), each vector of 16 bytes is
// added to the zeroed destination with one vector atomic instead.
template <typename T, int B, int V, bool kAdd = false, typename Acc,
          typename Scale>
__device__ __forceinline__ void StoreChannelRun(T* row, int64_t C, int64_t n,
                                                const Acc (&acc)[B][V],
                                                Scale scale) {
  using VecT = Vec<T, V>;
  static_assert(!kAdd || sizeof(VecT) == 16);
#pragma unroll
  for (int b = 0; b < B; ++b) {
    if (b < n) {
      const Acc f = scale(b);
      VecT out;
#pragma unroll
      for (int e = 0; e < V; ++e) out.v[e] = Num<T>::Store(acc[b][e] * f);
      if constexpr (kAdd) {
        uint4 bits;
        memcpy(&bits, &out, sizeof(bits));
        AtomicAdd16(row + b * C, bits);
      } else {
        *reinterpret_cast<VecT*>(row + b * C) = out;
      }
    }
  }
}

// Work item i of the NHWC row kernels, over (image, block of `rows` rows,
// group of `cols` columns, vector of V channels), the last varying
// fastest: image n, first row r0, first column w0 and first channel c0.
struct NhwcItem {
  int64_t n, r0, w0, c0;
};
__device__ __forceinline__ NhwcItem NhwcItemAt(int64_t i, int64_t blocks,
                                               int64_t groups, int64_t vectors,
                                               int rows, int cols, int V,
                                               bool narrow) {
  const Split3 at = Decompose(i, groups, vectors, narrow);
  const Split2 n_blk = DivMod(at.outer, blocks, narrow);
  return {n_blk.quot, n_blk.rem * rows, at.mid * cols, at.inner * V};
}

// NHWC row kernels of the specialisations that do not slide (NhwcSlides
// in kernel_spec.h: the forward of windows that do not overlap vertically,
// 2x2/2, and the strided gathers): how many output rows (forward) or input
// rows (gather) a work item covers, so that the input rows which
// vertically overlapping windows share are loaded once, and how many
// channels it takes (kNhwcForwardWide below; 16 bytes for the gather).
// Chosen by timing on the H200 (bench shapes):
// - Forward: two rows for float32 (2x2/2: 124 against 138 us with one),
//   else one.
// - Gather: a multiple of SH; two for 3x3/2.
template <typename T, typename S>
constexpr int kNhwcRows = sizeof(T) == 4 ? 2 : 1;
template <typename S>
constexpr int kNhwcGatherRows = S::SH >= S::KH ? S::SH : 2;

// Blocks per multiprocessor the NHWC forward row-block kernel is compiled
// for: two for 16-bit types, whose 2x2/2 item of eight channels then takes
// 106 registers instead of 84 and measured faster (65 against 76 us); 0
// leaves the others to the compiler.
template <typename T, typename S>
constexpr int kNhwcForwardBlocks = sizeof(T) == 2 ? 2 : 0;

// NHWC forward, specialisations of windows that do not overlap vertically
// (SlideNhwc does the others): a work item is (image n, block of R output
// rows, group of BLOCK outputs along W, vector of V channels). Each of the
// (R - 1) * SH + KH input rows under the block is loaded once (the
// (BLOCK - 1) * SW + KW columns under the group) and summed along W into
// the BLOCK window sums of that row, which are added to the output row
// whose window holds the row. Rows and columns outside the input are
// predicated off.
template <typename T, typename S, int V, int R>
__global__ void __launch_bounds__(kThreads, kNhwcForwardBlocks<T, S>)
    ForwardNhwcRows(const PoolAttrs a, const PoolShape s,
                    const T* __restrict__ x, T* __restrict__ y,
                    const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  using VecT = Vec<T, V>;
  constexpr int KH = S::KH, KW = S::KW, SH = S::SH, SW = S::SW, B = S::BLOCK;
  static_assert(SH >= KH);
  constexpr int NCOL = (B - 1) * SW + KW;  // input columns per item
  constexpr int NR = (R - 1) * SH + KH;    // input rows per item
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const int64_t C = s.channels, CV = C / V;
  const int64_t groups = (OW + B - 1) / B, blocks = (OH + R - 1) / R;
  const bool narrow = total <= INT32_MAX;
  for (int64_t i = FirstThread(); i < total; i += ThreadCount()) {
    const NhwcItem it = NhwcItemAt(i, blocks, groups, CV, R, B, V, narrow);
    const int64_t n = it.n, oh0 = it.r0, ow0 = it.w0, c_off = it.c0;
    const int64_t top = oh0 * SH - a.pad_top, c0 = ow0 * SW - a.pad_left;
    const T* image = x + n * H * W * C + c_off;
    Acc acc[R][B][V];
    FillZero(acc);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const int64_t h = top + r;
      const bool row_ok = h >= 0 && h < H;
      // Column c0 + j of row h (zeros outside the input).
      const auto load = [&](int j) {
        const int64_t c = c0 + j;
        const bool ok = row_ok && c >= 0 && c < W;
        return LoadOrZero<T, V>(image + (h * W + c) * C, ok);
      };
      Acc ws[B][V];  // row h summed over the columns of each window
#pragma unroll
      for (int b = 0; b < B; ++b)
#pragma unroll
        for (int e = 0; e < V; ++e) ws[b][e] = Acc(0);
#pragma unroll
      for (int j = 0; j < NCOL; ++j) {
        const VecT v = load(j);
#pragma unroll
        for (int b = 0; b < B; ++b) {
          if (j - b * SW >= 0 && j - b * SW < KW) {
#pragma unroll
            for (int e = 0; e < V; ++e) ws[b][e] += N::Load(v.v[e]);
          }
        }
      }
#pragma unroll
      for (int o = 0; o < R; ++o) {
        if (r - o * SH >= 0 && r - o * SH < KH) {
#pragma unroll
          for (int b = 0; b < B; ++b)
#pragma unroll
            for (int e = 0; e < V; ++e) acc[o][b][e] += ws[b][e];
        }
      }
    }
    Acc wf[B];
#pragma unroll
    for (int b = 0; b < B; ++b) {
      wf[b] = Reciprocal(WindowFactor<Acc>(
          a, WindowAt(ow0 + b, W, KW, SW, a.pad_left, a.pad_right), false));
    }
#pragma unroll
    for (int o = 0; o < R; ++o) {
      const int64_t oh = oh0 + o;
      if (oh >= OH) break;
      const Acc hf = Reciprocal(WindowFactor<Acc>(
          a, WindowAt(oh, H, KH, SH, a.pad_top, a.pad_bottom), true));
      StoreChannelRun<T>(y + ((n * OH + oh) * OW + ow0) * C + c_off, C,
                         OW - ow0, acc[o], [&](int b) { return hf * wf[b]; });
    }
  }
}

// ---------------------------------------------------------------------------
// Backward, gather: dx[h, w] = sum over the windows (oh, ow) covering (h, w)
// of dy[oh, ow] / divisor, in ascending (oh, ow) order (the CPU's order).

// Inputs per work item of GatherNchw: the Spec's BLOCK, or for the generic
// kernel 16 bytes of them, over which it shares the covers' divisions by
// its runtime strides (in 32-bit arithmetic where the geometry allows).
// On the H200, with one input an item and 64-bit covers, against 16 bytes
// and 32-bit covers (bench, us): the bfloat16 gather of 7x7/7 windows over
// 128x2048 planes of 7x7 (a global average pool) 187 against 51.5 (XLA's
// backward 16.6); float32 176 against 80; 5x5/3 over 64x768 planes of
// 17x17, float32, 308 against 150 (XLA 165); 4x4/4 over 128x256 planes of
// 56x56, bfloat16, 1722 against 363 (XLA 862). Windows that do not
// overlap mostly go to GatherNchwDisjoint (below) instead.
template <typename T, typename S>
constexpr int kNchwGatherBlock =
    S::kGeneric ? static_cast<int>(16 / sizeof(T)) : S::BLOCK;

// NCHW: a work item is (plane p, input row h, group of kNchwGatherBlock
// inputs).
template <typename T, typename S>
__global__ void __launch_bounds__(kThreads)
    GatherNchw(const PoolAttrs a, const PoolShape s, const T* __restrict__ dy,
               T* __restrict__ dx, const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  constexpr int B = kNchwGatherBlock<T, S>;
  const Consts<S> k(a);
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const int64_t groups = (W + B - 1) / B;
  const bool narrow = total <= INT32_MAX;
  const bool small = SmallGeometry(a, s);
  const bool whole_vectors = CanStoreRuns<T, B>(dx, W);
  for (int64_t i = FirstThread(); i < total; i += ThreadCount()) {
    const Split3 at = Decompose(i, H, groups, narrow);
    const int64_t p = at.outer, h = at.mid, w0 = at.inner * B;
    const int64_t w_last = (w0 + B < W ? w0 + B : W) - 1;
    const Cover ch = CoverOfFast(h, OH, k.kh, k.sh, a.pad_top, small);
    const int64_t ow_first =
        CoverOfFast(w0, OW, k.kw, k.sw, a.pad_left, small).first;
    const int64_t ow_last =
        CoverOfFast(w_last, OW, k.kw, k.sw, a.pad_left, small).last;
    Acc acc[B];
#pragma unroll
    for (int b = 0; b < B; ++b) acc[b] = Acc(0);
    for (int64_t oh = ch.first; oh <= ch.last; ++oh) {
      const Window wh = WindowAt(oh, H, k.kh, k.sh, a.pad_top, a.pad_bottom);
      const T* grow = dy + (p * OH + oh) * OW;
      for (int64_t ow = ow_first; ow <= ow_last; ++ow) {
        const Window ww = WindowAt(ow, W, k.kw, k.sw, a.pad_left, a.pad_right);
        const Acc g = N::Load(grow[ow]) / static_cast<Acc>(Divisor(a, wh, ww));
        const int64_t start = ow * k.sw - a.pad_left;
#pragma unroll
        for (int b = 0; b < B; ++b) {
          const int64_t w = w0 + b;
          if (w >= start && w < start + k.kw) acc[b] += g;
        }
      }
    }
    T* out = dx + (p * H + h) * W + w0;
    StoreRun<T, B>(out, acc, W - w0, whole_vectors);
  }
}

// NCHW gather of windows that do not overlap (strides at least as long as
// the window: each dx element lies under one window or none), for the
// generic kernel's calls, among them global average pools and k x k / k
// windows. dx is one flat range, 16 bytes of it a work item stored by one
// aligned vector; the item's first element is placed by fast divisions,
// the rest by stepping along the row, and each dy element is divided by its
// divisor once for the run of the row its window covers. Geometry below
// 2**30 (DisjointFits); the flat index may be 64-bit.
struct DisjointDivs {
  FastDiv by_w, by_h, by_sw, by_sh;
};

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    GatherNchwDisjoint(const PoolAttrs a, const PoolShape s,
                       const DisjointDivs d, const T* __restrict__ dy,
                       T* __restrict__ dx, const int64_t elements,
                       const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  const int H = static_cast<int>(s.in_h), W = static_cast<int>(s.in_w);
  const int OH = static_cast<int>(s.out_h), OW = static_cast<int>(s.out_w);
  const int kh = static_cast<int>(a.kernel_h);
  const int kw = static_cast<int>(a.kernel_w);
  const int sh = static_cast<int>(a.stride_h);
  const int sw = static_cast<int>(a.stride_w);
  const int pt = static_cast<int>(a.pad_top);
  const int pl = static_cast<int>(a.pad_left);
  // The column window of w = 0 and the offset of w in it.
  const int ow_start = d.by_sw(pl), r_start = pl - ow_start * sw;
  for (int64_t item = FirstThread(); item < total; item += ThreadCount()) {
    const int64_t e0 = item * V;
    int64_t row_id;  // plane * H + h
    int w;
    if (e0 <= INT32_MAX) {
      const int e = static_cast<int>(e0);
      const int q = d.by_w(e);
      row_id = q, w = e - q * W;
    } else {
      row_id = e0 / W, w = static_cast<int>(e0 - row_id * W);
    }
    int64_t p;
    int h;
    if (row_id <= INT32_MAX) {
      const int r = static_cast<int>(row_id);
      const int q = d.by_h(r);
      p = q, h = r - q * H;
    } else {
      p = row_id / H, h = static_cast<int>(row_id - p * H);
    }
    // The row's window oh, whether h lies in it, and its extent.
    int oh = 0;
    bool row_in = false;
    Window wh{};
    const auto set_row = [&]() {
      oh = d.by_sh(h + pt);
      row_in = h + pt - oh * sh < kh && oh < OH;
      wh = WindowAt(oh, H, kh, sh, pt, a.pad_bottom);
    };
    set_row();
    int ow = d.by_sw(w + pl);
    int r = w + pl - ow * sw;  // w's offset in window ow
    Acc g = Acc(0);
    bool have = false;  // g is dy[oh, ow] / divisor
    Acc out[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      Acc val = Acc(0);
      if (row_in && r < kw && ow < OW && e0 + v < elements) {
        if (!have) {
          const Window ww = WindowAt(ow, W, kw, sw, pl, a.pad_right);
          g = N::Load(dy[(p * OH + oh) * OW + ow]) /
              static_cast<Acc>(Divisor(a, wh, ww));
          have = true;
        }
        val += g;
      }
      out[v] = val;
      if (++w == W) {
        w = 0;
        if (++h == H) h = 0, ++p;
        set_row();
        ow = ow_start, r = r_start, have = false;
      } else if (++r == sw) {
        r = 0, ++ow, have = false;
      }
    }
    T* const o = dx + e0;
    if (e0 + V <= elements) {
      Vec<T, V> vec;
#pragma unroll
      for (int v = 0; v < V; ++v) vec.v[v] = N::Store(out[v]);
      *reinterpret_cast<Vec<T, V>*>(o) = vec;
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        if (e0 + v < elements) o[v] = N::Store(out[v]);
      }
    }
  }
}

// Whether GatherNchwDisjoint takes a call: NCHW, windows that do not
// overlap, rows of at least one work item (16 bytes), geometry below 2**30.
// On rows shorter than an item, where every item crosses a row and the
// lanes of a warp step apart, GatherNchw's runs of a row were faster in
// 16-bit types (H200, bench, us, 7x7/7 over 128x2048 planes of 7x7:
// bfloat16 51.5 against 68.6 here; float32, whose items are four
// elements, 80.1 against 68.1 here).
template <typename T>
bool DisjointFits(const PoolAttrs& a, const PoolShape& s) {
  return a.layout == kNCHW && s.in_w * sizeof(T) >= 16 &&
         a.stride_h >= a.kernel_h && a.stride_w >= a.kernel_w &&
         SmallGeometry(a, s);
}

template <typename T>
cudaError_t LaunchGatherNchwDisjoint(cudaStream_t stream, const PoolAttrs& a,
                                     const PoolShape& s, const T* dy, T* dx) {
  DisjointDivs d;
  d.by_w = FastDiv::Of(static_cast<uint32_t>(s.in_w));
  d.by_h = FastDiv::Of(static_cast<uint32_t>(s.in_h));
  d.by_sw = FastDiv::Of(static_cast<uint32_t>(a.stride_w));
  d.by_sh = FastDiv::Of(static_cast<uint32_t>(a.stride_h));
  const int64_t elements = s.batch * s.channels * s.in_h * s.in_w;
  constexpr int V = static_cast<int>(16 / sizeof(T));
  if (reinterpret_cast<uintptr_t>(dx) % 16 == 0) {
    return Launch(GatherNchwDisjoint<T, V>, stream, Groups(elements, V), a, s,
                  d, dy, dx, elements);
  }
  return Launch(GatherNchwDisjoint<T, 1>, stream, elements, a, s, d, dy, dx,
                elements);
}

// NHWC, generic: a work item is (image n and input row h, group of BLOCK
// inputs, vector of V channels).
template <typename T, typename S, int V>
__global__ void __launch_bounds__(kThreads)
    GatherNhwc(const PoolAttrs a, const PoolShape s, const T* __restrict__ dy,
               T* __restrict__ dx, const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  using VecT = Vec<T, V>;
  constexpr int B = S::BLOCK;
  const Consts<S> k(a);
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const int64_t C = s.channels, CV = C / V;
  const int64_t groups = (W + B - 1) / B;
  const bool narrow = total <= INT32_MAX;
  for (int64_t i = FirstThread(); i < total; i += ThreadCount()) {
    const Split3 at = Decompose(i, groups, CV, narrow);
    const int64_t row_id = at.outer;  // n * H + h
    const Split2 n_h = DivMod(row_id, H, narrow);
    const int64_t n = n_h.quot, h = n_h.rem;
    const int64_t w0 = at.mid * B, c_off = at.inner * V;
    const int64_t w_last = (w0 + B < W ? w0 + B : W) - 1;
    const Cover ch = CoverOf(h, OH, k.kh, k.sh, a.pad_top);
    const int64_t ow_first = CoverOf(w0, OW, k.kw, k.sw, a.pad_left).first;
    const int64_t ow_last = CoverOf(w_last, OW, k.kw, k.sw, a.pad_left).last;
    Acc acc[B][V];
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
      for (int e = 0; e < V; ++e) acc[b][e] = Acc(0);
    const int64_t nrows = ch.last - ch.first + 1;
    const int64_t ncols = ow_last - ow_first + 1;
    // 1 / divisor = (1 / row factor) * (1 / column factor), within two ulps.
#pragma unroll
    for (int64_t t = 0; t < nrows; ++t) {
      const int64_t oh = ch.first + t;
      const bool row_ok = oh <= ch.last;
      const Window wh = WindowAt(row_ok ? oh : ch.first, H, k.kh, k.sh,
                                 a.pad_top, a.pad_bottom);
      const Acc rh = Reciprocal(WindowFactor<Acc>(a, wh, true));
      const T* grow = dy + (n * OH + (row_ok ? oh : 0)) * OW * C + c_off;
#pragma unroll
      for (int64_t u = 0; u < ncols; ++u) {
        const int64_t ow = ow_first + u;
        const bool ok = row_ok && ow <= ow_last;
        const Window ww = WindowAt(ok ? ow : ow_first, W, k.kw, k.sw,
                                   a.pad_left, a.pad_right);
        const Acc r = rh * Reciprocal(WindowFactor<Acc>(a, ww, false));
        const VecT v = LoadOrZero<T, V>(grow + ow * C, ok);
        Acc g[V];
#pragma unroll
        for (int e = 0; e < V; ++e) g[e] = N::Load(v.v[e]) * r;
        const int64_t start = ow * k.sw - a.pad_left;
#pragma unroll
        for (int b = 0; b < B; ++b) {
          const int64_t w = w0 + b;
          if (ok && w >= start && w < start + k.kw) {
#pragma unroll
            for (int e = 0; e < V; ++e) acc[b][e] += g[e];
          }
        }
      }
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      if (w0 + b < W) {
        VecT out;
#pragma unroll
        for (int e = 0; e < V; ++e) out.v[e] = N::Store(acc[b][e]);
        *reinterpret_cast<VecT*>(dx + (row_id * W + w0 + b) * C + c_off) = out;
      }
    }
  }
}

// Blocks per multiprocessor that GatherNhwcRows is compiled for: three for
// 16-bit types with stride 2, which then take 80 registers or fewer instead
// of 124 (bfloat16 3x3/2 on the H200: 72.3 against 76.0 us; 2x2/2: 67.0
// against 68.6).
template <typename T, typename S>
constexpr int kNhwcGatherBlocks = sizeof(T) == 2 && S::SH > 1 ? 3 : 0;

// NHWC gather, specialisations of stride 2 (SlideNhwc does stride 1): a
// work item is (image n, block of R input rows, group of BLOCK inputs along
// W, vector of V channels), R and BLOCK multiples of SH and SW. The first
// dy column whose window reaches column w0 of the group is
// ceil((w0 + pad_left - KW + 1) / SW); as w0 is a multiple of SW, its
// window starts KW - 1 - EW columns before w0 for EW = (KW - 1 - pad_left)
// mod SW, and likewise for the rows with EH; both are template parameters,
// so which dy row and column covers which dx row and column is known at
// compile time. Each dy row over the block is loaded once: its elements are
// divided by their column factors and summed along W into the BLOCK dx
// columns they cover, and those sums, times the row's factor, are added to
// the dx rows the dy row covers.
template <typename T, typename S, int V, int R, int EW, int EH, bool kAdd>
__global__ void __launch_bounds__(kThreads, kNhwcGatherBlocks<T, S>)
    GatherNhwcRows(const PoolAttrs a, const PoolShape s,
                   const T* __restrict__ dy, T* __restrict__ dx,
                   const SharedFactor<typename Num<T>::Acc> shared,
                   const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  using VecT = Vec<T, V>;
  constexpr int KH = S::KH, KW = S::KW, SH = S::SH, SW = S::SW, B = S::BLOCK;
  static_assert(B % SW == 0 && R % SH == 0);
  static_assert(EW >= 0 && EW < SW && EH >= 0 && EH < SH);
  constexpr int CW = KW - 1 - EW, CH = KH - 1 - EH;  // window starts before
  constexpr int NU = (B - 1 + CW) / SW + 1;  // dy columns over the group
  constexpr int NT = (R - 1 + CH) / SH + 1;  // dy rows over the block
  // The group's columns in parts of BP. For 16-bit types whose windows
  // overlap along W, the R * B * V accumulators of a whole group outgrow
  // the registers of three blocks a multiprocessor and spill (48 to 208
  // bytes); in halves they fit (76 to 80 registers), at the price of
  // loading the dy columns both halves meet twice (bfloat16 3x3/2,
  // 128x56x56x256 on the H200, CUDA events: 69.8 against 72.6 us, and
  // with padding 1, 69.9 against 80.2).
  constexpr int BP =
      sizeof(T) == 2 && KW > SW && R * B * V > 48 && B % 2 == 0 ? B / 2 : B;
  // Whether dy column ow_lo + u reaches a column of the part from p0.
  const auto Meets = [](int u, int p0) {
    return u * SW - CW < p0 + BP && u * SW - CW + KW > p0;
  };
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const int64_t C = s.channels, CV = C / V;
  const int64_t groups = (W + B - 1) / B, blocks = (H + R - 1) / R;
  const bool narrow = total <= INT32_MAX;
  for (int64_t i = FirstThread(); i < total; i += ThreadCount()) {
    const NhwcItem it = NhwcItemAt(i, blocks, groups, CV, R, B, V, narrow);
    const int64_t n = it.n, h0 = it.r0, w0 = it.w0, c_off = it.c0;
    const int64_t ow_lo = (w0 + a.pad_left - CW) / SW;  // exact
    const int64_t oh_lo = (h0 + a.pad_top - CH) / SH;   // exact
    const T* image = dy + n * OH * OW * C + c_off;
    if constexpr (kAdd) {
      // The scatter: L2 fetches the destination lines while the dy rows load
      // and sum (PrefetchL2).
#pragma unroll
      for (int o = 0; o < R; ++o) {
#pragma unroll
        for (int b = 0; b < B; ++b) {
          if (h0 + o < H && w0 + b < W) {
            PrefetchL2(dx + ((n * H + h0 + o) * W + w0 + b) * C + c_off);
          }
        }
      }
    }
    Acc wf[NU];  // 1 / column factor, 0 for columns outside dy
#pragma unroll
    for (int u = 0; u < NU; ++u) {
      const int64_t ow = ow_lo + u;
      wf[u] = ow < 0 || ow >= OW ? Acc(0)
              : shared.all
                  ? shared.col
                  : Reciprocal(WindowFactor<Acc>(
                        a, WindowAt(ow, W, KW, SW, a.pad_left, a.pad_right),
                        false));
    }
#pragma unroll
    for (int p0 = 0; p0 < B; p0 += BP) {  // columns w0 + p0 .. w0 + p0 + BP - 1
      Acc acc[R][BP][V];
      FillZero(acc);
      // dy row oh_lo + t starts at row + t * OW * C, its columns C apart (the
      // pointers of rows and columns outside dy are never read).
      const T* row = image + (oh_lo * OW + ow_lo) * C;
#pragma unroll
      for (int t = 0; t < NT; ++t, row += OW * C) {
        const int64_t oh = oh_lo + t;
        const bool row_ok = oh >= 0 && oh < OH;
        Acc q[NU][V];  // dy / column factor, of the columns the part meets
        const T* at = row;
#pragma unroll
        for (int u = 0; u < NU; ++u, at += C) {
          if (!Meets(u, p0)) continue;
          const int64_t ow = ow_lo + u;
          const bool ok = row_ok && ow >= 0 && ow < OW;
          const VecT v = LoadOrZero<T, V>(at, ok);
#pragma unroll
          for (int e = 0; e < V; ++e) q[u][e] = N::Load(v.v[e]) * wf[u];
        }
        const Acc hf =
            !row_ok ? Acc(0)
            : shared.all
                ? shared.row
                : Reciprocal(WindowFactor<Acc>(
                      a, WindowAt(oh, H, KH, SH, a.pad_top, a.pad_bottom),
                      true));
        Acc sums[BP][V];  // dy row oh over column w0 + p0 + b
#pragma unroll
        for (int b = 0; b < BP; ++b) {
#pragma unroll
          for (int e = 0; e < V; ++e) sums[b][e] = Acc(0);
#pragma unroll
          for (int u = 0; u < NU; ++u) {
            const int k = p0 + b + CW - u * SW;  // the column in window u
            if (k >= 0 && k < KW) {
#pragma unroll
              for (int e = 0; e < V; ++e) sums[b][e] += q[u][e];
            }
          }
        }
#pragma unroll
        for (int b = 0; b < BP; ++b) {
          const Acc(&cs)[V] = sums[b];
#pragma unroll
          for (int o = 0; o < R; ++o) {
            const int k = o + CH - t * SH;  // row h0 + o in window t
            if (k >= 0 && k < KH) {
#pragma unroll
              for (int e = 0; e < V; ++e) acc[o][b][e] += cs[e] * hf;
            }
          }
        }
      }
#pragma unroll
      for (int o = 0; o < R; ++o) {
        if (h0 + o >= H) break;
        StoreChannelRun<T, BP, V, kAdd>(
            dx + ((n * H + h0 + o) * W + w0 + p0) * C + c_off, C, W - w0 - p0,
            acc[o], [](int) { return Acc(1); });
      }
    }
  }
}

// ---------------------------------------------------------------------------
// NCHW row kernels for the specialisations, when W is a multiple of the
// chunk width. The lanes of a warp take consecutive chunks of the same rows:
// a chunk is V = BLOCK * SW adjacent input columns, aligned, and the BLOCK
// outputs whose windows start in it (offset by the left padding PL, a
// compile-time constant here). Each lane loads its chunk of a row with
// 16-byte accesses, so a warp reads whole contiguous row segments once, and
// takes what its windows need of the neighbouring chunks from the
// neighbouring lanes by warp shuffles. The first HL and last HR lanes of a
// warp only load and share: their chunks are produced by the neighbouring
// warps, so no lane ever waits on a second, divergent load. A work item
// covers R output rows (forward) or R input rows (gather) so that the rows
// that vertically overlapping windows share are loaded once; all of an
// item's loads are issued before any is used.

constexpr int FloorDiv(int n, int d) {
  return n >= 0 ? n / d : -((-n + d - 1) / d);
}
constexpr int CeilDiv(int n, int d) { return -FloorDiv(-n, d); }

__device__ __forceinline__ int FloorDivInt(int n, int d) {
  return n >= 0 ? n / d : -((-n + d - 1) / d);
}

// Loads N adjacent elements from p (aligned to the access size) into out,
// widened; zeros when !ok.
template <typename T, int N>
__device__ __forceinline__ void LoadRun(const T* p, bool ok,
                                        typename Num<T>::Acc (&out)[N]) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
  constexpr int kPiece = kBytes < 16 ? kBytes : 16;
  constexpr int kPer = kPiece / static_cast<int>(sizeof(T));
  static_assert(kPiece % sizeof(T) == 0 && N % kPer == 0);
#pragma unroll
  for (int q = 0; q < N / kPer; ++q) {
    const Vec<T, kPer> v = LoadOrZero<T, kPer>(p + q * kPer, ok);
#pragma unroll
    for (int e = 0; e < kPer; ++e) out[q * kPer + e] = Num<T>::Load(v.v[e]);
  }
}

// Stores N accumulated values as adjacent elements at p (aligned).
template <typename T, int N, typename Acc>
__device__ __forceinline__ void StoreAligned(T* p, const Acc (&in)[N]) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
  constexpr int kPiece = kBytes < 16 ? kBytes : 16;
  constexpr int kPer = kPiece / static_cast<int>(sizeof(T));
#pragma unroll
  for (int q = 0; q < N / kPer; ++q) {
    Vec<T, kPer> v;
#pragma unroll
    for (int e = 0; e < kPer; ++e) v.v[e] = Num<T>::Store(in[q * kPer + e]);
    reinterpret_cast<Vec<T, kPer>*>(p)[q] = v;
  }
}

// Stores each lane's N values at its own aligned `dst` when `ok`, as a warp.
// When a lane's values span more than 16 bytes, a plain store would leave
// every warp store instruction with gaps between the lanes' 16-byte pieces;
// here the pieces go through the warp's `stage` in shared memory (32 * N
// elements) so that each store instruction writes consecutive pieces.
// Every lane of the warp must call it. With kAdd (the scatter,
// LaunchAddingGather; N elements of 8 bytes or of whole 16), each 8- or
// 16-byte piece is added to the zeroed destination with one vector atomic
// instead.
template <typename T, int N, bool kAdd = false, typename Acc>
__device__ __forceinline__ void WarpStore(T* dst, bool ok, const Acc (&in)[N],
                                          T* stage, int lane) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
  static_assert(!kAdd || kBytes % 16 == 0 || kBytes == 8);
  if constexpr (kAdd && kBytes <= 16) {
    if (ok) {
      Vec<T, N> v;
#pragma unroll
      for (int e = 0; e < N; ++e) v.v[e] = Num<T>::Store(in[e]);
      if constexpr (kBytes == 16) {
        uint4 bits;
        memcpy(&bits, &v, sizeof(bits));
        AtomicAdd16(dst, bits);
      } else {
        uint2 bits;
        memcpy(&bits, &v, sizeof(bits));
        AtomicAdd8(dst, bits);
      }
    }
  } else if constexpr (kBytes <= 16) {
    if (ok) StoreAligned<T, N>(dst, in);
  } else {
    constexpr int kPer = 16 / static_cast<int>(sizeof(T));  // per piece
    constexpr int kPieces = N / kPer;                       // per lane
    using Piece = Vec<T, kPer>;
    Piece* pieces = reinterpret_cast<Piece*>(stage);
#pragma unroll
    for (int q = 0; q < kPieces; ++q) {
      Piece v;
#pragma unroll
      for (int e = 0; e < kPer; ++e) v.v[e] = Num<T>::Store(in[q * kPer + e]);
      pieces[lane * kPieces + q] = v;
    }
    __syncwarp();
#pragma unroll
    for (int q = 0; q < kPieces; ++q) {
      const int k = q * 32 + lane;  // piece k of the warp
      const int src = k / kPieces;
      T* to = reinterpret_cast<T*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(dst), src));
      if (__shfl_sync(0xffffffffu, ok, src)) {
        if constexpr (kAdd) {
          uint4 bits;
          memcpy(&bits, &pieces[k], sizeof(bits));
          AtomicAdd16(to + (k % kPieces) * kPer, bits);
        } else {
          reinterpret_cast<Piece*>(to)[k % kPieces] = pieces[k];
        }
      }
    }
    __syncwarp();
  }
}

// The launch-wide divisors of a row kernel's item index: chunks per row
// block and row blocks per plane.
struct RowDivs {
  FastDiv by_chunks, by_blocks;
};

// A row kernel's work item (plane, row block, chunk): `active` when it
// exists, `owned` when this lane also produces it.
struct RowItem {
  bool active, owned;
  int64_t plane;
  int block, chunk;
};

// The lanes of a warp of a row kernel whose items reach HL chunks to the
// left and HR to the right: item = first + lane - HL; the lanes in
// [HL, 32 - HR) own their items, the others only share their loads.
template <int HL, int HR>
struct RowLanes {
  static_assert(HL + HR < 16);
  static constexpr int kPerWarp = 32 - HL - HR;
  int lane;
  __device__ __forceinline__ RowLanes() : lane(threadIdx.x % 32) {}
  __device__ __forceinline__ bool Owns() const {
    return lane >= HL && lane < 32 - HR;
  }
  __device__ __forceinline__ int64_t Item(int64_t warp) const {
    return warp * kPerWarp + lane - HL;
  }
  static __device__ __forceinline__ int64_t Warps(int64_t items) {
    return (items + kPerWarp - 1) / kPerWarp;
  }
  // This lane's item in `warp`, of `total` items.
  __device__ __forceinline__ RowItem At(int64_t warp, int64_t total,
                                        int64_t row_blocks,
                                        int64_t chunks) const {
    const int64_t i = Item(warp);
    const bool active = i >= 0 && i < total;
    const Split3 at =
        Decompose(active ? i : 0, row_blocks, chunks, total + 32 <= INT32_MAX);
    return {active, active && Owns(), at.outer, static_cast<int>(at.mid),
            static_cast<int>(at.inner)};
  }
  // The same, by multiplications where the item indices fit 32 bits.
  __device__ __forceinline__ RowItem At(int64_t warp, int64_t total,
                                        int64_t row_blocks, int64_t chunks,
                                        const RowDivs& d) const {
    if (total + 32 > INT32_MAX) return At(warp, total, row_blocks, chunks);
    const int64_t i = Item(warp);
    const bool active = i >= 0 && i < total;
    const int n = active ? static_cast<int>(i) : 0;
    const int t = d.by_chunks(n), plane = d.by_blocks(t);
    return {active, active && Owns(), plane,
            t - plane * static_cast<int>(row_blocks),
            n - t * static_cast<int>(chunks)};
  }
};

__device__ __forceinline__ int64_t FirstWarp() { return FirstThread() / 32; }
__device__ __forceinline__ int64_t WarpCount() { return ThreadCount() / 32; }

// What the lane D chunks to the right of this one (D < 0: to the left) holds
// in `value`, when that chunk is in the same row (0 <= g + D < chunks), else
// 0. Every lane of the warp must call it; lanes whose source lies outside the
// warp get garbage, but they never own an item that uses it.
template <int D, typename Acc>
__device__ __forceinline__ Acc FromChunk(Acc value, int lane, int64_t g,
                                         int64_t chunks) {
  const Acc got = __shfl_sync(0xffffffffu, value, (lane + D) & 31);
  return g + D >= 0 && g + D < chunks ? got : Acc(0);
}

// buf[slot] = element e of the lane D chunks away, for the halo entries of a
// row buffer; D is a compile-time function of the unrolled loop index.
template <typename Acc, int N>
__device__ __forceinline__ Acc Halo(const Acc (&own)[N], int c, int lane,
                                    int64_t g, int64_t chunks) {
  const int d = FloorDiv(c, N), e = c - d * N;
  if (d == -2) return FromChunk<-2>(own[e], lane, g, chunks);
  if (d == -1) return FromChunk<-1>(own[e], lane, g, chunks);
  if (d == 1) return FromChunk<1>(own[e], lane, g, chunks);
  return FromChunk<2>(own[e], lane, g, chunks);
}

// A window's divisor, Divisor(a, wh, ww), is the product of two factors, one
// per axis, which a row kernel computes once per output row and once per
// output column. Both are small integers (or 1 and the override), so their
// product is exact. The row kernels multiply by the correctly rounded
// reciprocals of the two factors instead of dividing by their product: two
// reciprocals per row and column instead of a division per element, within
// two ulps of the quotient (the division is the single most expensive
// operation of these kernels). `is_row` puts the override in the row
// factor. 32-bit arithmetic: the row kernels only take extents and pads
// below 2^30.

template <typename Acc>
__device__ __forceinline__ Acc AxisFactor(const PoolAttrs& a, int o, int in,
                                          int k, int s, int lo, int hi,
                                          bool is_row) {
  if (a.divisor_mode == kOverride) {
    return is_row ? static_cast<Acc>(a.divisor_override) : Acc(1);
  }
  const int begin = o * s - lo;
  const int stop = min(begin + k, in + hi);
  if (a.divisor_mode == kCountPadded) return static_cast<Acc>(stop - begin);
  return static_cast<Acc>(max(min(stop, in) - max(begin, 0), 0));
}

// 1 / AxisFactor for a window of compile-time size K: for a window inside
// the input (every window of an unpadded call) with a count divisor, the
// factor is K and its reciprocal a constant.
template <typename Acc, int K>
__device__ __forceinline__ Acc InverseFactor(const PoolAttrs& a, int o, int in,
                                             int s, int lo, int hi,
                                             bool is_row) {
  const int begin = o * s - lo;
  if (a.divisor_mode != kOverride && begin >= 0 && begin + K <= in) {
    return Acc(1) / Acc(K);  // correctly rounded, as Reciprocal
  }
  return Reciprocal(AxisFactor<Acc>(a, o, in, K, s, lo, hi, is_row));
}

// Which NCHW row kernels take SharedFactor's path where a call has one. On
// the H200, CUDA events, us, against the per-window path: forward 3x3/2
// float32 118.5 against 122.5, bfloat16 71.5 against 79.2 (with padding 1
// 65.8 against 71.0), 2x2/2 bfloat16 62.9 against 64.0, 7x7/1 float32 50.0
// against 52.6; gather 7x7/1 float32 54.7 against 61.2 (before its pair
// loads), bfloat16 47.0 against 60.3. Elsewhere it measured slower, by
// 3-7%: the bfloat16 7x7/1 forward (44.2 against 41.3) and 3x3/2 gather
// (81.2 against 79.2; 84.3 against 78.6 with padding 1).
template <typename T, typename S>
constexpr bool kSharedForward = S::SH == 2 || (sizeof(T) >= 4 && S::KH == 7);
template <typename S>
constexpr bool kSharedGather = S::KH >= 5;

// Whether a forward row kernel takes its items' indices by multiplications
// (RowDivs) and the reciprocals of inner windows' factors as constants
// (InverseFactor): fewer instructions, which pays where they bound it. On
// the H200, CUDA events, us, against the kernels without: bfloat16 7x7/1
// (64x512x28x28) 40.9 against 44.1; bfloat16 3x3/2 with padding 1
// (128x256x56x56) 70.9 against 75.2, unpadded 79.4 against 79.3 (float16
// 77.8 against 78.4). Elsewhere they cost more than they save: bfloat16
// 2x2/2 77.0 against 63.7 us, float32 7x7/1 57.3 against 52.1, float32
// 3x3/2 124.7 against 122.5.
template <typename T, typename S>
constexpr bool kLeanRows =
    sizeof(T) == 2 && ((S::KH == 3 && S::SH == 2) || S::KH == 7);

// Forward: a work item is (plane p, block of R output rows, chunk g). Per
// output row it sums the KH window rows of each of its columns, takes the
// column sums of the neighbouring chunks it needs, and sums KW of them per
// output.
template <typename T, typename S, int PL, int R, int PIECE>
__global__ void __launch_bounds__(kThreads)
    ForwardNchwRows(const PoolAttrs a, const PoolShape s,
                    const T* __restrict__ x, T* __restrict__ y,
                    const int64_t chunks, const RowDivs divs,
                    const SharedFactor<typename Num<T>::Acc> shared,
                    const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  constexpr int KH = S::KH, KW = S::KW, SH = S::SH, SW = S::SW, B = S::BLOCK;
  constexpr int V = B * SW;
  constexpr int LH = PL;                                   // halo columns
  constexpr int RH = KW - SW - PL > 0 ? KW - SW - PL : 0;  // left, right
  constexpr int NR = (R - 1) * SH + KH;  // input rows per item
  using Lanes = RowLanes<CeilDiv(LH, V), CeilDiv(RH, V)>;
  const int H = static_cast<int>(s.in_h), W = static_cast<int>(s.in_w);
  const int OH = static_cast<int>(s.out_h), OW = static_cast<int>(s.out_w);
  const int64_t row_blocks = (OH + R - 1) / R;
  const Lanes lanes;
  const int lane = lanes.lane;
  // Always true where PIECE == B; kept as a run-time test, as without it
  // the bfloat16 2x2/2 forward took 69 against 64 us on the H200.
  const bool whole_vectors = CanStoreRuns<T, B>(y, OW);
  const int64_t warps = Lanes::Warps(total);
  for (int64_t warp = FirstWarp(); warp < warps; warp += WarpCount()) {
    const auto item = kLeanRows<T, S>
                          ? lanes.At(warp, total, row_blocks, chunks, divs)
                          : lanes.At(warp, total, row_blocks, chunks);
    const bool active = item.active;
    const int64_t p = item.plane;
    const int oh0 = item.block * R, g = item.chunk;
    const int top = oh0 * SH - static_cast<int>(a.pad_top), col0 = g * V;
    Acc own[NR][V];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const int h = top + r;
      const bool ok = active && h >= 0 && h < H && col0 < W;
      LoadRun<T, V>(x + (p * H + (ok ? h : 0)) * W + (ok ? col0 : 0), ok,
                    own[r]);
    }
    // With stride 1, the column sums of all R output rows at once, sharing
    // what neighbouring windows hold.
    Acc sliding[SH == 1 ? R : 1][V];
    if constexpr (SH == 1) SlidingRows<KH>(own, sliding);
    Acc acc[R][B];
#pragma unroll
    for (int o = 0; o < R; ++o) {
      Acc cs[V];  // column sums over the window rows of output row o
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if constexpr (SH == 1) {
          cs[j] = sliding[o][j];
        } else {
          cs[j] = own[o * SH][j];
#pragma unroll
          for (int k = 1; k < KH; ++k) cs[j] += own[o * SH + k][j];
        }
      }
      Acc buf[LH + V + RH];  // columns [col0 - LH, col0 + V + RH)
#pragma unroll
      for (int j = 0; j < LH; ++j) buf[j] = Halo(cs, j - LH, lane, g, chunks);
#pragma unroll
      for (int j = 0; j < V; ++j) buf[LH + j] = cs[j];
#pragma unroll
      for (int j = 0; j < RH; ++j)
        buf[LH + V + j] = Halo(cs, V + j, lane, g, chunks);
      if constexpr (SW == 1) {
        SlidingSums<KW, B>([&](int i) { return buf[i]; }, acc[o]);
      } else {
#pragma unroll
        for (int b = 0; b < B; ++b) {
          acc[o][b] = buf[b * SW];
#pragma unroll
          for (int k = 1; k < KW; ++k) acc[o][b] += buf[b * SW + k];
        }
      }
    }
    if (!item.owned || g * B >= OW) continue;
    const bool all = kSharedForward<T, S> && shared.all;
    Acc wf[B];
    if (all) {
#pragma unroll
      for (int b = 0; b < B; ++b) wf[b] = shared.value;
    } else {
#pragma unroll
      for (int b = 0; b < B; ++b) {
        wf[b] =
            kLeanRows<T, S>
                ? InverseFactor<Acc, KW>(a, g * B + b, W, SW, PL,
                                         static_cast<int>(a.pad_right), false)
                : Reciprocal(AxisFactor<Acc>(a, g * B + b, W, KW, SW, PL,
                                             static_cast<int>(a.pad_right),
                                             false));
      }
    }
#pragma unroll
    for (int o = 0; o < R; ++o) {
      const int oh = oh0 + o;
      if (oh >= OH) break;
      const int pt = static_cast<int>(a.pad_top),
                pb = static_cast<int>(a.pad_bottom);
      const Acc hf =
          all ? Acc(1)
          : kLeanRows<T, S>
              ? InverseFactor<Acc, KH>(a, oh, H, SH, pt, pb, true)
              : Reciprocal(AxisFactor<Acc>(a, oh, H, KH, SH, pt, pb, true));
      Acc out[B];
#pragma unroll
      for (int b = 0; b < B; ++b) out[b] = acc[o][b] * (hf * wf[b]);
      T* to = y + (p * OH + oh) * OW + g * B;
      if constexpr (PIECE == B) {
        StoreRun<T, B>(to, out, OW - g * B, whole_vectors);
      } else {
        StorePieces<T, B, PIECE>(to, out, OW - g * B);
      }
    }
  }
}

// Gather backward: a work item is (plane p, block of R input rows, chunk g),
// R a multiple of SH. It reads the BLOCK dy elements of chunk g in each dy
// row over the block and divides them by their divisors; per input row it
// sums the quotients of the dy rows whose windows cover it, takes the sums
// of the neighbouring chunks whose windows reach into chunk g, and sums
// those covering each column. The first dy row of a block is
// ceil((h0 + pad_top - KH + 1) / SH); as h0 is a multiple of SH, its window
// starts C0 = KH - 1 - E rows above h0 for a constant E in [0, SH): a
// template parameter, so which dy rows cover which dx rows is known at
// compile time.
template <typename T, typename S, int PL, int E, int R, bool kAdd>
__global__ void __launch_bounds__(kThreads)
    GatherNchwRows(const PoolAttrs a, const PoolShape s,
                   const T* __restrict__ dy, T* __restrict__ dx,
                   const int64_t chunks,
                   const SharedFactor<typename Num<T>::Acc> shared,
                   const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  constexpr int KH = S::KH, KW = S::KW, SH = S::SH, SW = S::SW, B = S::BLOCK;
  constexpr int V = B * SW;
  static_assert(R % SH == 0 && E >= 0 && E < SH);
  // Outputs b (relative to the chunk's first, g * B) whose windows reach
  // columns [0, V) of the chunk: [BMIN, BMAX].
  constexpr int BMIN = CeilDiv(PL - KW + 1, SW);
  constexpr int BMAX = FloorDiv(V - 1 + PL, SW);
  constexpr int LO = -BMIN, RO = BMAX - (B - 1);
  static_assert(LO >= 0 && RO >= 0);
  constexpr int C0 = KH - 1 - E;  // h0 - (window start of dy row t = 0)
  constexpr int NOH = (R - 1 + C0) / SH + 1;  // dy rows over the block
  using Lanes = RowLanes<CeilDiv(LO, B), CeilDiv(RO, B)>;
  const int H = static_cast<int>(s.in_h), W = static_cast<int>(s.in_w);
  const int OH = static_cast<int>(s.out_h), OW = static_cast<int>(s.out_w);
  const int64_t row_blocks = (H + R - 1) / R;
  const Lanes lanes;
  const int lane = lanes.lane;
  const bool whole_vectors = CanStoreRuns<T, B>(dy, OW);
  // Else aligned pairs where dy rows are of even length (the 22 of 7x7/1
  // on 28x28 planes): half the load instructions of single elements. On the
  // H200 the float32 7x7/1 gather took 50.8 against 54.7 us with them; the
  // bfloat16 one 86 against 47 (its third load path in registers), so
  // 16-bit types load single elements.
  const bool pairs = sizeof(T) >= 4 && B % 2 == 0 && CanStoreRuns<T, 2>(dy, OW);
  // Per warp, the staging area of WarpStore (unused for 16 bytes or less).
  constexpr int kStage = sizeof(T) * V > 16 ? 32 * V : 1;
  __shared__ __align__(16) T stage[kThreads / 32][kStage];
  const int64_t warps = Lanes::Warps(total);
  for (int64_t warp = FirstWarp(); warp < warps; warp += WarpCount()) {
    const auto item = lanes.At(warp, total, row_blocks, chunks);
    const bool active = item.active;
    const int64_t p = item.plane;
    const int h0 = item.block * R, g = item.chunk;
    const int ow0 = g * B;
    const int oh_lo = FloorDivInt(h0 + static_cast<int>(a.pad_top) - C0, SH);
    if constexpr (kAdd) {
      // The scatter: L2 fetches the destination lines while the dy rows load
      // and sum (PrefetchL2).
      if (item.owned && g * V < W) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (h0 + r < H) PrefetchL2(dx + (p * H + h0 + r) * W + g * V);
        }
      }
    }
    Acc q[NOH][B];  // dy / divisor
#pragma unroll
    for (int t = 0; t < NOH; ++t) {
      const int oh = oh_lo + t;
      const bool ok = active && oh >= 0 && oh < OH && ow0 < OW;
      const T* grow = dy + (p * OH + (ok ? oh : 0)) * OW + (ok ? ow0 : 0);
      if (whole_vectors) {
        LoadRun<T, B>(grow, ok, q[t]);
      } else if (pairs) {
#pragma unroll
        for (int b = 0; b < B; b += 2) {
          const Vec<T, 2> v = LoadOrZero<T, 2>(grow + b, ok && ow0 + b < OW);
          q[t][b] = N::Load(v.v[0]);
          q[t][b + 1] = N::Load(v.v[1]);
        }
      } else {
#pragma unroll
        for (int b = 0; b < B; ++b) {
          q[t][b] =
              N::Load(LoadOrZero<T, 1>(grow + b, ok && ow0 + b < OW).v[0]);
        }
      }
    }
    if (kSharedGather<S> && shared.all) {
      // The loads left zeros outside dy.
#pragma unroll
      for (int t = 0; t < NOH; ++t) {
#pragma unroll
        for (int b = 0; b < B; ++b) q[t][b] *= shared.value;
      }
    } else {
      Acc wf[B];
#pragma unroll
      for (int b = 0; b < B; ++b) {
        wf[b] = Reciprocal(AxisFactor<Acc>(
            a, ow0 + b, W, KW, SW, PL, static_cast<int>(a.pad_right), false));
      }
#pragma unroll
      for (int t = 0; t < NOH; ++t) {
        const int oh = oh_lo + t;
        const bool ok = active && oh >= 0 && oh < OH;
        const Acc hf = Reciprocal(AxisFactor<Acc>(
            a, ok ? oh : 0, H, KH, SH, static_cast<int>(a.pad_top),
            static_cast<int>(a.pad_bottom), true));
#pragma unroll
        for (int b = 0; b < B; ++b) {
          q[t][b] = ok && ow0 + b < OW ? q[t][b] * (hf * wf[b]) : Acc(0);
        }
      }
    }
    // Per input row r, the sums over the dy rows whose windows cover row
    // h0 + r: with stride 1, dy rows r .. r + KH - 1 (C0 = KH - 1).
    Acc sums[R][B];
    if constexpr (SH == 1) {
      static_assert(C0 == KH - 1 && NOH == R + KH - 1);
      SlidingRows<KH>(q, sums);
    } else {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int b = 0; b < B; ++b) {
          sums[r][b] = Acc(0);
#pragma unroll
          for (int t = 0; t < NOH; ++t) {
            const int k = r + C0 - t * SH;  // row h0 + r in window t
            if (k >= 0 && k < KH) sums[r][b] += q[t][b];
          }
        }
      }
    }
    const bool store = item.owned && g * V < W;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const Acc(&vs)[B] = sums[r];
      Acc buf[LO + B + RO];  // for outputs [ow0 - LO, ow0 + B + RO)
#pragma unroll
      for (int j = 0; j < LO; ++j) buf[j] = Halo(vs, j - LO, lane, g, chunks);
#pragma unroll
      for (int b = 0; b < B; ++b) buf[LO + b] = vs[b];
#pragma unroll
      for (int j = 0; j < RO; ++j)
        buf[LO + B + j] = Halo(vs, B + j, lane, g, chunks);
      Acc out[V];
      if constexpr (SW == 1) {
        // Column j is in the windows of outputs j + PL - KW + 1 .. j + PL:
        // buf[j .. j + KW - 1].
        static_assert(V == B && LO == KW - 1 - PL && RO == PL);
        SlidingSums<KW, V>([&](int i) { return buf[i]; }, out);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          out[j] = Acc(0);
#pragma unroll
          for (int b = BMIN; b <= BMAX; ++b) {
            const int k = j + PL - b * SW;  // column j in window b
            if (k >= 0 && k < KW) out[j] += buf[LO + b];
          }
        }
      }
      const bool ok = store && h0 + r < H;
      WarpStore<T, V, kAdd>(dx + (ok ? (p * H + h0 + r) * W + g * V : 0), ok,
                            out, stage[threadIdx.x / 32], lane);
    }
  }
}

// Rows per work item of the row kernels: enough to share the rows that
// vertically overlapping windows have in common, and to keep enough loads
// in flight, within registers that leave several blocks per multiprocessor.
// Chosen by timing R on the H200 (bench shapes; float64 at half the batch):
// - Forward. 3x3/1 float32: 8 rows, 233 against 259 us for 4 (bfloat16 and
//   float64 were slower with 8). 7x7/1: 4, as 6, 8 and 11 took 82-89 us
//   against 77 in float32 and 76-91 against 71 in bfloat16. Stride 2: 2;
//   the 3x3/2 kernel with 4 takes 88 registers in bfloat16 and 96 in
//   float32, and was slower in both (110 against 87 us, 142 against 134).
//   Those stride-1 timings were on rows stored element by element (22 and
//   222 outputs wide). Stored in pairs (PIECE 2) more rows pay: 16-bit
//   types take 8 (7x7/1 bfloat16 41 against 51 us, 3x3/1 131 against
//   172), float32 7x7/1 takes 6 (53 against 54 us; 8 took 53 as well).
// - Gather. 7x7: 14 rows, which load 20 dy rows per 14 dx rows instead of
//   10 per 4 (11% faster in float32, 24% in bfloat16). 3x3/1: 6, or 8 for
//   16-bit types (float32 202 against 211 us with 4, bfloat16 168 against
//   204). 2x2/2: 2, or 4 for 16-bit types (float32 131 against 136 us with
//   4). 3x3/2: 4, or 8 for 16-bit types (79 against 83 us).
template <typename T, typename S, int PIECE>
constexpr int kRowsPerItem =
    S::SH != 1                     ? 2
    : PIECE == 2 && sizeof(T) == 2 ? 8
    : PIECE == 2 && sizeof(T) == 4 ? (S::KH <= 3 ? 8 : 6)
    : S::KH <= 3 && sizeof(T) == 4 ? 8
                                   : 4;
template <typename T, typename S>
constexpr int kGatherRowsPerItem = S::KH >= 5   ? 2 * S::KH
                                   : S::SH == 1 ? (sizeof(T) == 2 ? 8 : 6)
                                   : S::KH == 2 ? (sizeof(T) == 2 ? 4 : 2)
                                                : (sizeof(T) == 2 ? 8 : 4);

// Calls fn(std::integral_constant<int, e>) with the phase of a gather's
// first covering window along an axis of window K, stride ST and leading
// padding `pad`: e = (K - 1 - pad) mod ST (the E of GatherNchwRows, the EW
// and EH of GatherNhwcRows). The specialisations' strides are 1 or 2.
template <int K, int ST, typename Fn>
cudaError_t WithPhase(int64_t pad, Fn&& fn) {
  static_assert(ST == 1 || ST == 2);
  const int64_t e = ((K - 1 - pad) % ST + ST) % ST;
  if constexpr (ST == 2) {
    if (e == 1) return fn(std::integral_constant<int, 1>{});
  }
  return fn(std::integral_constant<int, 0>{});
}

// Calls fn(std::integral_constant<int, pl>) for pl = pad_left in [0, MAX].
template <int MAX, typename Fn>
cudaError_t WithPadLeft(int64_t pad_left, Fn&& fn) {
  if constexpr (MAX < 0) {
    return cudaErrorInvalidValue;
  } else {
    if (pad_left == MAX) return fn(std::integral_constant<int, MAX>{});
    return WithPadLeft<MAX - 1>(pad_left, fn);
  }
}

// Calls fn(std::integral_constant<int, p>) with the piece in which the
// forward row kernel stores its runs of B = S::BLOCK outputs in rows `row`
// long from `base` (RunPiece): whole runs as one vector (p = B), aligned
// pairs (2) or single elements (1). Each is a kernel of its own. On the
// H200, against one kernel storing whole runs or else element by element:
// pairs on 22-wide rows (7x7/1 on 28x28 planes) took the float32 forward
// from 69 to 54 us, and on 222-wide ones (3x3/1) from 233 to 213 us; the
// element-wise kernel alone on 27-wide rows (3x3/2 on 56x56) from 133 to
// 123 us (float32) and 87 to 80 us (bfloat16). With stride 2 the row
// kernels need W to be a multiple of 2B, and PyTorch padding then leaves
// output rows of whole runs or of odd length, so no pair kernels for them.
template <typename T, typename S, typename Fn>
cudaError_t WithPiece(const void* base, int64_t row, Fn&& fn) {
  constexpr int B = S::BLOCK;
  const int piece = RunPiece<T, B>(base, row);
  if constexpr (sizeof(T) * B <= 16) {
    if (piece == B) return fn(std::integral_constant<int, B>{});
  }
  if constexpr (S::SW == 1 && B % 2 == 0 && B > 2) {
    if (piece >= 2) return fn(std::integral_constant<int, 2>{});
  }
  return fn(std::integral_constant<int, 1>{});
}

// Launches a row kernel over `items`: 32 threads per 28 items or more (the
// edge lanes of a warp share but do not own items), capped.
template <typename... KArgs, typename... Args>
cudaError_t LaunchRows(void (*kernel)(KArgs...), cudaStream_t stream,
                       int64_t items, Args... args) {
  if (items == 0) return cudaSuccess;
  const int64_t threads = Groups(items, 28) * 32;
  const int64_t blocks = std::min<int64_t>(Groups(threads, kThreads), 1 << 20);
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args...,
                                                                 items);
  return cudaGetLastError();
}

// Whether the NCHW row kernels take a call of specialisation S: W a multiple
// of the chunk width, 16-byte aligned buffers, and pad_left <= KW / 2 (every
// PyTorch padding; flax's SAME).
template <typename T, typename S>
bool RowKernelsFit(const PoolAttrs& a, const PoolShape& s, const void* in,
                   const void* out) {
  if constexpr (S::kGeneric) {
    return false;
  } else {
    const auto aligned = [](const void* p) {
      return reinterpret_cast<uintptr_t>(p) % 16 == 0;
    };
    constexpr int64_t kSmall = int64_t{1} << 30;  // 32-bit index math
    return a.layout == kNCHW && s.in_w % (S::BLOCK * S::SW) == 0 &&
           a.pad_left <= S::KW / 2 && aligned(in) && aligned(out) &&
           s.in_h < kSmall && s.in_w < kSmall && a.pad_top < kSmall &&
           a.pad_bottom < kSmall && a.pad_right < kSmall;
  }
}

// Chunks per row: enough for every output and every input column.
template <typename S>
int64_t RowChunks(const PoolShape& s) {
  return std::max(Groups(s.out_w, S::BLOCK), s.in_w / (S::BLOCK * S::SW));
}

// ---------------------------------------------------------------------------
// NCHW gather through shared memory, for heavily overlapping windows. A block
// owns a tile of whole dx rows of one plane: it divides each dy element it
// needs by its divisor once, then sums in two separable passes (along W,
// then along H), and writes each dx element once, coalesced.

// Gather backward: a block computes input rows [h0, h0 + tile) of plane p
// from the dy rows that cover them, each dy divided by its divisor once.
template <typename T, typename S>
__global__ void __launch_bounds__(kThreads)
    GatherNchwTiled(const PoolAttrs a, const PoolShape s,
                    const T* __restrict__ dy, T* __restrict__ dx,
                    const int64_t tile, const int64_t capacity,
                    const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  extern __shared__ __align__(16) unsigned char smem[];
  const Consts<S> k(a);
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const int64_t tiles = (H + tile - 1) / tile;
  Acc* g = reinterpret_cast<Acc*>(smem);  // `capacity` rows of dy / divisor
  Acc* wsum = g + capacity * OW;          // the same rows summed along W
  for (int64_t blk = blockIdx.x; blk < total; blk += gridDim.x) {
    const int64_t p = blk / tiles, h0 = (blk % tiles) * tile;
    const int64_t h1 = h0 + tile < H ? h0 + tile : H;
    const int64_t o_lo = CoverOf(h0, OH, k.kh, k.sh, a.pad_top).first;
    const int64_t o_hi = CoverOf(h1 - 1, OH, k.kh, k.sh, a.pad_top).last;
    const int64_t rows = o_hi >= o_lo ? o_hi - o_lo + 1 : 0;
    __syncthreads();  // the previous tile is done with shared memory
    const T* src = dy + (p * OH + o_lo) * OW;
    for (int64_t i = threadIdx.x; i < rows * OW; i += blockDim.x) {
      const Split2 r_ow = DivMod(i, OW, true);
      const int64_t oh = o_lo + r_ow.quot, ow = r_ow.rem;
      const Window wh = WindowAt(oh, H, k.kh, k.sh, a.pad_top, a.pad_bottom);
      const Window ww = WindowAt(ow, W, k.kw, k.sw, a.pad_left, a.pad_right);
      g[i] = N::Load(src[i]) / static_cast<Acc>(Divisor(a, wh, ww));
    }
    __syncthreads();
    // Along W: wsum[r][w] = sum of g[r][ow] over the windows covering w.
    for (int64_t i = threadIdx.x; i < rows * W; i += blockDim.x) {
      const Split2 r_w = DivMod(i, W, true);
      const int64_t r = r_w.quot, w = r_w.rem;
      const Cover cw = CoverOf(w, OW, k.kw, k.sw, a.pad_left);
      const Acc* grow = g + r * OW;
      Acc sum = Acc(0);
      for (int64_t ow = cw.first; ow <= cw.last; ++ow) sum += grow[ow];
      wsum[i] = sum;
    }
    __syncthreads();
    // Along H: dx row after dx row, coalesced, each element written once.
    for (int64_t i = threadIdx.x; i < (h1 - h0) * W; i += blockDim.x) {
      const Split2 r_w = DivMod(i, W, true);
      const int64_t h = h0 + r_w.quot, w = r_w.rem;
      const Cover ch = CoverOf(h, OH, k.kh, k.sh, a.pad_top);
      Acc sum = Acc(0);
      for (int64_t oh = ch.first; oh <= ch.last; ++oh)
        sum += wsum[(oh - o_lo) * W + w];
      dx[(p * H + h) * W + w] = N::Store(sum);
    }
  }
}

// Channels per vector access in NHWC: 16 bytes (kWide) when C and both
// buffers allow it, else one. The stride-1 forward of 16-bit types takes
// four channels per thread (8-byte accesses): with eight, its KH rows of
// accumulators overflow the registers (bfloat16 7x7/1 on the H200: 68-75
// against 66 us; 3x3/1 level). Its gather takes eight (7x7/1: 79 against
// 84 us).
template <typename T, typename S>
constexpr int kNhwcForwardWide =
    S::SH == 1 && S::KH > 1 && kWide<T> > 4 ? 4 : kWide<T>;

// Shared memory of a tiled block: aim for several blocks per multiprocessor,
// and never more than the default per-block limit.
constexpr size_t kTileBudget = 24 * 1024;
constexpr size_t kTileLimit = 48 * 1024;

// The tile (rows per block) for a tiled kernel whose shared memory for t rows
// is bytes(t): the whole extent when it fits the budget, else halves of it.
// 0 when even one row exceeds the limit.
template <typename Bytes>
int64_t ChooseTile(int64_t extent, Bytes bytes) {
  int64_t tile = extent;
  while (tile > 1 && bytes(tile) > kTileBudget) tile = (tile + 1) / 2;
  return bytes(tile) <= kTileLimit ? tile : 0;
}

template <typename... KArgs, typename... Args>
cudaError_t LaunchTiled(void (*kernel)(KArgs...), cudaStream_t stream,
                        int64_t blocks, size_t smem, Args... args) {
  if (blocks == 0) return cudaSuccess;
  const unsigned grid =
      static_cast<unsigned>(std::min<int64_t>(blocks, INT32_MAX));
  kernel<<<grid, kThreads, smem, stream>>>(args..., blocks);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------
// NHWC: a sliding window down H, for stride 1 (forward and gather) and the
// forward of square strided windows that overlap vertically (3x3/2); see
// NhwcSlides in kernel_spec.h. With stride 1 the gather is the forward's
// box filter run backwards: dx[h, w] sums dy over rows h - LEAD_H .. h -
// LEAD_H + KH - 1 (LEAD_H = KH - 1 - pad_top) and likewise along W, each dy
// element first divided by its divisor; the forward sums x over rows
// oh - pad_top .. oh - pad_top + KH - 1 and divides the sum. So one kernel
// does both. A work item is (image n, segment of up to `rows` destination
// rows, B adjacent destination columns, vector of V channels). It walks
// down the source rows under the segment, loading each once: the
// (B - 1) * SS + KW columns of a row are summed along W into the B window
// sums of that row, which are added to the destination rows whose windows
// hold the row, NS = ceil(KH / SS) of them at most. Those NS rows of
// accumulators form a ring in registers (row o in slot o mod NS; the loop
// unrolled NS * SS rows at a time, so that which slots a row goes to is
// known at compile time); a destination row is stored as soon as its last
// source row is added, and its slot restarts with the first row of the
// destination row NS below. Each destination row sums its source rows in
// ascending order.
//
// The register kernels it replaced held R whole rows of outputs per item
// and loaded the (R - 1) * SS + KH source rows under them, so each source
// row was loaded about KH / (R * SS) + 1 times, and stride 1 left one block
// of those registers per multiprocessor; a shared-memory box kernel did
// the 16-bit 7x7/1. On the H200 (bench shapes, us, forward / gather):
// float32 3x3/1 219 / 227 against 258 / 280, float32 7x7/1 78 / 90 against
// 87 / 123, bfloat16 7x7/1 66 / 79 against 81 / 103; forward 3x3/2 123
// against 131 (float32) and 75 against 80 (bfloat16).
//
// B is NhwcSlideBlock (kernel_spec.h): the Spec's four for the forward of
// 3-column windows in float32; one for the 16-bit 3x3/2 (below); two for
// the gather, which measured faster with two (float32 3x3/1: 227 against
// 233 us; bfloat16 146 against 158). Windows wider
// than 3 take BoxNhwc below when their channels fill vectors, and one
// column per item here when they do not (so that the kernel id's BLOCK
// holds for both; their KH rows of four columns overflow the registers).
//
// Blocks per multiprocessor it is compiled for: two for the float32 7x7/1
// and 3x3/2, which then take 128 registers (the 7x7/1 spills a few bytes)
// and measured faster than uncapped at 136 and 140 (forward 78 against
// 97 us and 123 against 151); four for the 16-bit 3x3/2, whose items of
// eight channels and one column then take 64 registers; 0 leaves the
// others to the compiler. Its walk down a segment loads one source row at
// a time and waits for it (a tiny call takes about a DRAM round trip per
// row), so what keeps the memory busy is the number of items in flight.
// On the H200 (bfloat16 3x3/2, 128x56x56x256, CUDA events, us): one column
// an item at four blocks 66.6-66.9, with padding 1 69.9-70.1, against two
// columns at two blocks 72.0-72.3 and 74.6-74.9 (and 74.8-75.1 and
// 77.3-77.9 when each load's address was computed from its row and column
// rather than stepped from the last); one column at three blocks 93.2-93.6,
// uncapped (70 registers) 95.3-95.6; four channels and two columns at four
// blocks 69.5-69.6, at three 99.0-99.2; segments of 14 rows instead of 27,
// 69.8-70.2 with the first. Tried, not kept: blocks of 32 to 128 threads
// (the same as 256); loading the next rows into registers before summing
// a row (one row ahead: 101, the registers doubled) or prefetching them
// into L1 or L2 (71.3 to 102).
template <typename T, typename S>
constexpr int kNhwcSlideBlocks = (S::KH > 3 || S::SH > 1) && sizeof(T) == 4 ? 2
                                 : S::SH > 1 && sizeof(T) == 2              ? 4
                                                                            : 0;

template <typename T, typename S, int V, int B, bool kGather>
__global__ void __launch_bounds__(kThreads, kNhwcSlideBlocks<T, S>)
    SlideNhwc(const PoolAttrs a, const PoolShape s, const T* __restrict__ src,
              T* __restrict__ dst, const int rows,
              const SharedFactor<typename Num<T>::Acc> shared,
              const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  using VecT = Vec<T, V>;
  constexpr int KH = S::KH, KW = S::KW, SS = S::SH;
  constexpr int NCOL = (B - 1) * SS + KW;  // source columns per item
  constexpr int NS = (KH + SS - 1) / SS;   // ring slots
  constexpr int P = NS * SS;               // rows per unrolled period
  static_assert(S::SW == SS && (SS == 1 || !kGather));
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const int64_t src_h = kGather ? OH : H, src_w = kGather ? OW : W;
  const int64_t dst_h = kGather ? H : OH, dst_w = kGather ? W : OW;
  const int64_t C = s.channels, CV = C / V;
  const int64_t groups = (dst_w + B - 1) / B, segs = (dst_h + rows - 1) / rows;
  // Source row (column) of destination row (column) 0's first window row.
  const int64_t lead_h = kGather ? KH - 1 - a.pad_top : a.pad_top;
  const int64_t lead_w = kGather ? KW - 1 - a.pad_left : a.pad_left;
  const bool narrow = total <= INT32_MAX;
  // The shared factor measured slower in the gather (3x3/1 float32 232
  // against 226 us on the H200), so only the forward takes it.
  const bool all = !kGather && shared.all;
  for (int64_t i = FirstThread(); i < total; i += ThreadCount()) {
    const NhwcItem it = NhwcItemAt(i, segs, groups, CV, rows, B, V, narrow);
    const int64_t top = it.r0 * SS - lead_h, c0 = it.w0 * SS - lead_w;
    const int nout =
        static_cast<int>(dst_h - it.r0 < rows ? dst_h - it.r0 : rows);
    const T* image = src + it.n * src_h * src_w * C + it.c0;
    T* out = dst + it.n * dst_h * dst_w * C + it.c0;
    // 1 / column factor: of the dy columns for the gather (0 outside dy),
    // of the output columns for the forward.
    constexpr int NF = kGather ? NCOL : B;
    Acc wf[NF];
#pragma unroll
    for (int u = 0; u < NF; ++u) {
      const int64_t ow = kGather ? c0 + u : it.w0 + u;
      wf[u] = ow < 0 || ow >= OW ? Acc(0)
              : all ? shared.col
                    : Reciprocal(WindowFactor<Acc>(
                          a, WindowAt(ow, W, KW, SS, a.pad_left, a.pad_right),
                          false));
    }
    Acc acc[NS][B][V];
    const int nr = (nout - 1) * SS + KH;  // source rows under the segment
    // Which source columns exist; source row top + r starts at row + r *
    // src_w * C, its columns C apart (the pointers of rows and columns
    // outside the source are never read).
    bool cok[NCOL];
#pragma unroll
    for (int j = 0; j < NCOL; ++j) cok[j] = c0 + j >= 0 && c0 + j < src_w;
    const int64_t row_step = src_w * C;
    const T* row = image + (top * src_w + c0) * C;
    for (int base = 0; base < nr; base += P) {
#pragma unroll
      for (int k = 0; k < P; ++k, row += row_step) {
        const int r = base + k;
        if (r >= nr) break;
        const int64_t h = top + r;
        const bool row_ok = h >= 0 && h < src_h;
        Acc col[NCOL][V];
        const T* at = row;
#pragma unroll
        for (int j = 0; j < NCOL; ++j, at += C) {
          const VecT v = LoadOrZero<T, V>(at, row_ok && cok[j]);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            col[j][e] = kGather ? N::Load(v.v[e]) * wf[j] : N::Load(v.v[e]);
          }
        }
        Acc ws[B][V];  // row r summed over the columns of each window
        if constexpr (SS == 1) {
          SlidingRows<KW>(col, ws);  // sharing the windows' common columns
        } else {
          FillZero(ws);
#pragma unroll
          for (int j = 0; j < NCOL; ++j) {
#pragma unroll
            for (int b = 0; b < B; ++b) {
              if (j - b * SS >= 0 && j - b * SS < KW) {
#pragma unroll
                for (int e = 0; e < V; ++e) ws[b][e] += col[j][e];
              }
            }
          }
        }
        // 1 / the dy row's factor for the gather.
        Acc hf = Acc(1);
        if constexpr (kGather) {
          hf = row_ok ? Reciprocal(WindowFactor<Acc>(
                            a, WindowAt(h, H, KH, 1, a.pad_top, a.pad_bottom),
                            true))
                      : Acc(0);
        }
        // Slot q holds destination row r / SS - t, whose window holds row
        // r if it reaches that far (with stride 1, every slot's does); row r
        // starts it when t = 0 and k is a multiple of SS (slot k with
        // stride 1). The stride-1 conditions are spelled apart: the general
        // ones, equal after unrolling, cost the float32 7x7/1 forward 216
        // bytes of spills instead of 44, and its bfloat16 instance 156
        // registers instead of 128.
#pragma unroll
        for (int q = 0; q < NS; ++q) {
          const int t = (k / SS - q + NS) % NS;
          if (SS == 1 || k % SS + t * SS < KH) {
#pragma unroll
            for (int b = 0; b < B; ++b) {
#pragma unroll
              for (int e = 0; e < V; ++e) {
                if (SS == 1 ? q == k : t == 0 && k % SS == 0) {
                  acc[q][b][e] = Acc(0);
                }
                if constexpr (kGather) {
                  acc[q][b][e] += ws[b][e] * hf;
                } else {
                  acc[q][b][e] += ws[b][e];
                }
              }
            }
          }
        }
        // Destination row o / SS has all its rows when SS divides o.
        const int o = r - (KH - 1);
        if (o >= 0 && (SS == 1 || (k - KH + 1) % SS == 0)) {
          const int slot =
              SS == 1 ? (k + 1) % NS : ((k - KH + 1) / SS % NS + NS) % NS;
          const int64_t oh = it.r0 + o / SS;
          Acc of = Acc(1);
          if constexpr (!kGather) {
            of = all ? shared.row
                     : Reciprocal(WindowFactor<Acc>(
                           a, WindowAt(oh, H, KH, SS, a.pad_top, a.pad_bottom),
                           true));
          }
          StoreChannelRun<T>(
              out + (oh * dst_w + it.w0) * C, C, dst_w - it.w0, acc[slot],
              [&](int b) { return kGather ? Acc(1) : of * wf[b]; });
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// NHWC, stride 1, windows wider than 3: the box filter of SlideNhwc with
// its sums along W taken through shared memory. A block takes a segment of
// up to `rows` destination rows, a strip of `strip_w` destination columns
// and a slab of 2^nv_log2 channel vectors of one image. Walking down the
// source rows under the segment, the thread of (j, v) copies element v of
// source column cb + j of each row into its own slot of a stage in shared
// memory, kBoxAhead - 1 rows ahead (cp.async: in flight without holding
// registers), and adds it to the KH - 1 destination rows of column sums
// still open in registers, which completes one. The completed column sums
// go to shared memory; after one barrier per two rows, the thread of
// (j, v) adds the KW column sums of the windows of destination columns
// 2j and 2j + 1, which share KW - 1 of them. So each source element is
// loaded from global memory once per strip (the whole width, where it
// fits), where SlideNhwc loads it (B - 1 + KW) / B times from L1 or L2,
// and a thread holds one column of one vector. Four buffers of column
// sums (a destination row o goes to buffer o mod 4) let a thread write a
// buffer again only after every thread has passed the barrier behind
// which they last read it.
//
// The kernel is bound by instruction issue and barrier waits more than by
// DRAM. On the H200 (64x28x28x512 7x7/1, us, forward / gather): float32
// 48.0 / 53.0, bfloat16 36.8 / 42.1, against SlideNhwc's 94.2 / 119.0 and
// 90.1 / 83.7; one destination column per thread and a barrier per row
// took 48.8 / 59.2 and 45.0 / 59.9. For 3x3/1 the box filter measured no
// faster (float32 32x224x224x64: 233 against 216 us), so SlideNhwc keeps
// those. Tried: the rows ahead in registers instead of the stage (85 us
// float32 forward); 6, 8 or 10 rows ahead (1-10 us slower than 4);
// 16-byte vectors for 16-bit types (whose eight accumulators per column
// spill: 50-56 against 45 us); caps of 56 and of 128 registers instead of
// 64 (55-63 and 60-71 us; with 16-byte bfloat16 vectors at 128 registers,
// 52.4 / 69.7); for 16-bit types, a warp per tile of one image and eight
// channels in shared memory, its lanes walking strips of registers as
// StripsNchw's (55-67 / 68-76 us: 23% occupancy, and each warp's walk
// serial after its copy). 16-bit calls whose channels come in 64s, with
// destination images of 20 rows or more and 16 blocks of work or more,
// take the sums on the tensor cores instead (cuda_box_mma.cu: bfloat16
// 28.8 / 38.7 us); its first forms, with tiles of two destination rows as
// the M side, ran 46 / 52 us at best (BENCHMARKS.md).
constexpr int kBoxAhead = 4;
constexpr int kBoxBuffers = 4;
// kAdd, the float32 scatter (LaunchAddingGather): the gather adding each
// result to the zeroed dx with one vector atomic, and asking L2 for the
// lines of the destination row kBoxAddAhead rows below first. On the H200
// (64x28x28x512 7x7/1, memset included): 104.0 us against the tiles'
// 134.2 of cuda_scatter.cu; 116.3 without the prefetch, 108.1 five rows
// ahead, 125.5 with the segment's lines all asked for at its start.
constexpr int kBoxAddAhead = 2;
constexpr int kBoxMaxThreads = 512;

template <typename T, typename S, int V, bool kGather, bool kAdd>
__global__ void __launch_bounds__(kBoxMaxThreads, 2)
    BoxNhwc(const PoolAttrs a, const PoolShape s, const T* __restrict__ src,
            T* __restrict__ dst, const int rows, const int strip_w,
            const int nv_log2, const int64_t items) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  using VecT = Vec<T, V>;
  using AccV = Vec<Acc, V>;
  constexpr int KH = S::KH, KW = S::KW, D = kBoxAhead;
  constexpr int NB = kBoxBuffers;
  static_assert(NhwcBox<S>() && KH > 1 && (D & (D - 1)) == 0 && NB == 4);
  extern __shared__ __align__(16) unsigned char box_shared[];
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const int64_t src_h = kGather ? OH : H, src_w = kGather ? OW : W;
  const int64_t dst_h = kGather ? H : OH, dst_w = kGather ? W : OW;
  const int64_t C = s.channels;
  const int64_t slabs = (C / V) >> nv_log2;
  const int64_t strips = (dst_w + strip_w - 1) / strip_w;
  const int64_t segs = (dst_h + rows - 1) / rows;
  const int64_t lead_h = kGather ? KH - 1 - a.pad_top : a.pad_top;
  const int64_t lead_w = kGather ? KW - 1 - a.pad_left : a.pad_left;
  const int nv = 1 << nv_log2;
  const int v = static_cast<int>(threadIdx.x) & (nv - 1);
  const int j = static_cast<int>(threadIdx.x) >> nv_log2;
  const int threads = static_cast<int>(blockDim.x);
  // NB buffers of column sums, each [nv][ncs]: a vector's columns are
  // adjacent, so that a window's KW column sums sit at fixed offsets from
  // its first, and the odd row length ncs keeps the 16-byte accesses of
  // the nv vectors of one column on distinct banks. Then the stage of D
  // rows of copies, then the row factors.
  const int ncs = (strip_w + KW) | 1;
  const int buf_len = nv * ncs;
  AccV* const sums = reinterpret_cast<AccV*>(box_shared);
  VecT* const stage = reinterpret_cast<VecT*>(sums + NB * buf_len);
  Acc* const row_factor = reinterpret_cast<Acc*>(stage + D * threads);
  VecT* const my_stage = stage + threadIdx.x;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    int64_t rest = item;
    const int64_t slab = rest % slabs;
    rest /= slabs;
    const int64_t strip = rest % strips;
    rest /= strips;
    const int64_t o0 = rest % segs * rows, n = rest / segs;
    const int64_t w0 = strip * strip_w;
    const int nout = static_cast<int>(dst_h - o0 < rows ? dst_h - o0 : rows);
    const int nwo =
        static_cast<int>(dst_w - w0 < strip_w ? dst_w - w0 : strip_w);
    // The strip's windows reach source columns c0 .. c0 + nwo + KW - 2;
    // of those, the thread of j loads column cb + j, those in the source.
    const int64_t c0 = w0 - lead_w;
    const int64_t cb = c0 > 0 ? c0 : 0;
    const int64_t ce = c0 + nwo + KW - 1 < src_w ? c0 + nwo + KW - 1 : src_w;
    const int nsrc = static_cast<int>(ce - cb);
    const int64_t c = cb + j;  // this thread's source column
    const bool col_ok = j < nsrc;
    const int64_t cv = (slab << nv_log2) + v;
    const int64_t row_step = src_w * C;
    const int64_t top = o0 - lead_h;
    // 1 / column factor: of this thread's dy column for the gather (folded
    // into the row factor as each row is scaled), of its two destination
    // columns for the forward.
    const auto col_factor = [&](bool ok, int64_t at) {
      return ok ? Reciprocal(WindowFactor<Acc>(
                      a, WindowAt(at, W, KW, 1, a.pad_left, a.pad_right),
                      false))
                : Acc(0);
    };
    const Acc cf =
        kGather ? col_factor(col_ok, c) : col_factor(2 * j < nwo, w0 + 2 * j);
    const Acc cf1 =
        kGather ? Acc(0) : col_factor(2 * j + 1 < nwo, w0 + 2 * j + 1);
    const int nr = nout + KH - 1;  // source rows under the segment
    // The column sums of columns outside the source stay zero. The row
    // factors are taken once per block: 1 / the factor of dy row top + r
    // (0 outside dy) for the gather, of destination row o0 + r for the
    // forward.
    for (int i = threadIdx.x; i < NB * buf_len; i += threads) sums[i] = AccV{};
    for (int i = threadIdx.x; i < nr; i += threads) {
      const int64_t h = kGather ? top + i : o0 + i;
      row_factor[i] =
          h >= 0 && h < (kGather ? src_h : dst_h)
              ? Reciprocal(WindowFactor<Acc>(
                    a, WindowAt(h, H, KH, 1, a.pad_top, a.pad_bottom), true))
              : Acc(0);
    }
    __syncthreads();
    // Row r is copied into stage slot r mod D, D - 1 rows ahead; each
    // thread reads back only its own copies, so waiting for its own copy
    // groups is all the synchronisation the stage needs.
    // Rows above the source add nothing: the walk starts at the first row
    // in it (top >= 1 - KH, so no destination row is skipped); this
    // thread copies rows r < r_end.
    const int r0 = top < 0 ? static_cast<int>(-top) : 0;
    const int r_end =
        col_ok ? static_cast<int>(src_h - top < nr ? src_h - top : nr) : 0;
    const T* p = src + n * src_h * row_step + c * C + cv * V +
                 (top + r0) * row_step;  // the next row to copy
    T* q = dst + ((n * dst_h + o0) * dst_w + w0 + 2 * j) * C + cv * V;
    const int64_t q_step = dst_w * C;
    // This thread's column sums go to `put`; those of the windows of its
    // destination columns 2j and 2j + 1 are read from `get` onwards; both
    // in buffer o mod NB for destination row o.
    AccV* const put = sums + v * ncs + static_cast<int>(c - c0);
    const AccV* const get = sums + v * ncs + 2 * j;
    const auto copy = [&](int r) {
      const bool ok = r < r_end;
      CopyAsync<sizeof(VecT)>(my_stage + (r & (D - 1)) * threads, ok ? p : src,
                              ok);
      p += row_step;
    };
#pragma unroll
    for (int d = 0; d + 1 < D; ++d) copy(r0 + d);
    // open[t]: the column sums of destination row r - KH + 1 + t so far
    // (rows r - KH + 1 + t .. r - 1), t < KH - 1, before row r is added.
    Acc open[KH - 1][V];
    FillZero(open);
    // Adds source row r; its completed column sums go to shared memory.
    const auto vertical = [&](int r) {
      copy(r + D - 1);
      CopyWait<D - 1>();
      const VecT x = my_stage[(r & (D - 1)) * threads];
      const Acc hf = kGather ? row_factor[r] * cf : Acc(1);
      // Row r completes destination row r - KH + 1 and starts row r.
      AccV done;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const Acc xv = kGather ? N::Load(x.v[e]) * hf : N::Load(x.v[e]);
        done.v[e] = open[0][e] + xv;
#pragma unroll
        for (int t = 0; t + 2 < KH; ++t) open[t][e] = open[t + 1][e] + xv;
        open[KH - 2][e] = xv;
      }
      const int o = r - (KH - 1);
      if (o >= 0 && col_ok) put[(o & (NB - 1)) * buf_len] = done;
    };
    // Sums and stores destination row o at columns 2j and 2j + 1. The two
    // windows share the column sums 1 .. KW - 1 from g; the padding of ncs
    // keeps g[KW] inside the row where 2j + 1 = nwo.
    const auto horizontal = [&](int o) {
      if (kAdd && 2 * j < nwo && o + kBoxAddAhead < nout) {
        // The scatter: L2 fetches the lines of row o + kBoxAddAhead ahead of
        // their reductions, which would otherwise wait there for them.
        const T* const ahead = q + kBoxAddAhead * q_step;
        PrefetchL2(ahead);
        if (2 * j + 1 < nwo) PrefetchL2(ahead + C);
      }
      if (2 * j < nwo) {
        const AccV* const g = get + (o & (NB - 1)) * buf_len;
        AccV mid = g[1];
#pragma unroll
        for (int t = 2; t < KW; ++t) {
          const AccV u = g[t];
#pragma unroll
          for (int e = 0; e < V; ++e) mid.v[e] += u.v[e];
        }
        const AccV first = g[0], last = g[KW];
        Acc f0 = Acc(1), f1 = Acc(1);
        if constexpr (!kGather) {
          const Acc hf = row_factor[o];
          f0 = cf * hf;
          f1 = cf1 * hf;
        }
        VecT y0, y1;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          y0.v[e] = N::Store((first.v[e] + mid.v[e]) * f0);
          y1.v[e] = N::Store((mid.v[e] + last.v[e]) * f1);
        }
        if constexpr (kAdd) {
          // The scatter: added to the zeroed destination (LaunchAddingGather).
          static_assert(sizeof(VecT) == 16);
          uint4 bits;
          memcpy(&bits, &y0, sizeof(bits));
          AtomicAdd16(q, bits);
          if (2 * j + 1 < nwo) {
            memcpy(&bits, &y1, sizeof(bits));
            AtomicAdd16(q + C, bits);
          }
        } else {
          *reinterpret_cast<VecT*>(q) = y0;
          if (2 * j + 1 < nwo) *reinterpret_cast<VecT*>(q + C) = y1;
        }
      }
      q += q_step;
    };
    // Two source rows per barrier, completing destination rows o - 1 and
    // o (those that exist); o is uniform across the block.
    for (int r = r0; r < nr; r += 2) {
      vertical(r);
      const bool two = r + 1 < nr;
      if (two) vertical(r + 1);
      const int o = r + 1 - (KH - 1);
      if (o < 0) continue;
      __syncthreads();
      if (o >= 1) horizontal(o - 1);
      if (two) horizontal(o);
    }
    CopyWait<0>();    // no copy may land in the next item's stage
    __syncthreads();  // the next item writes the buffers again
  }
}

// Launches BoxNhwc with V channels per thread: slabs of 128 bytes (or the
// largest power of two of vectors dividing C / V below that), segments as
// in SlideRows.
template <typename T, bool kGather, typename S, int V, bool kAdd = false>
cudaError_t LaunchBoxNhwc(cudaStream_t stream, const PoolAttrs& a,
                          const PoolShape& s, const T* src, T* dst) {
  using Acc = typename Num<T>::Acc;
  const int64_t dst_h = kGather ? s.in_h : s.out_h;
  const int64_t dst_w = kGather ? s.in_w : s.out_w;
  const int64_t cvs = s.channels / V;
  int nv_log2 = 0;
  while ((V * static_cast<int>(sizeof(T)) << (nv_log2 + 1)) <= 128 &&
         cvs % (int64_t{1} << (nv_log2 + 1)) == 0) {
    ++nv_log2;
  }
  const int64_t src_w = kGather ? s.out_w : s.in_w;
  // Threads: the larger of a strip's columns and the source columns under
  // them, times nv; at most kBoxMaxThreads, and 45 KiB of shared memory
  // for the column sums and the stage. The rest of the default 48 KiB
  // holds the padding of the column sums (at most 2 columns of 16 vectors
  // in kBoxBuffers buffers: 2 KiB) and the row factors. Fewer vectors per
  // block (down to 32 bytes) where that keeps the whole width in one strip.
  const size_t per_thread =
      V * (kBoxBuffers * sizeof(Acc) + kBoxAhead * sizeof(T));
  const int max_threads = static_cast<int>(
      std::min<size_t>(kBoxMaxThreads, 45 * 1024 / per_thread));
  while (nv_log2 > 0 && (V * static_cast<int>(sizeof(T)) << nv_log2) > 32 &&
         (max_threads >> nv_log2) - (S::KW - 1) < dst_w) {
    --nv_log2;
  }
  const int nv = 1 << nv_log2;
  const int max_w = max_threads / nv - (S::KW - 1);
  if (max_w < 1) return cudaErrorInvalidConfiguration;
  const int64_t strips = (dst_w + max_w - 1) / max_w;
  const int strip_w = static_cast<int>((dst_w + strips - 1) / strips);
  const int ncol = strip_w + S::KW - 1;
  const int rows = SlideRows(dst_h);
  const int64_t items =
      s.batch * Groups(dst_h, rows) * strips * (cvs >> nv_log2);
  if (items == 0) return cudaSuccess;
  const int threads = static_cast<int>(std::max<int64_t>(
                          strip_w, std::min<int64_t>(ncol, src_w))) *
                      nv;
  const size_t smem =
      static_cast<size_t>((ncol + 1) | 1) * nv * V * kBoxBuffers * sizeof(Acc) +
      static_cast<size_t>(threads) * V * kBoxAhead * sizeof(T) +
      static_cast<size_t>(rows + S::KH - 1) * sizeof(Acc);
  const unsigned grid =
      static_cast<unsigned>(std::min<int64_t>(items, INT32_MAX));
  if constexpr (kAdd) {
    if (cudaError_t e = ZeroInputShape(dst, s, stream); e != cudaSuccess) {
      return e;
    }
  }
  BoxNhwc<T, S, V, kGather, kAdd><<<grid, threads, smem, stream>>>(
      a, s, src, dst, rows, strip_w, nv_log2, items);
  return cudaGetLastError();
}

template <typename T, bool kGather, typename S>
cudaError_t LaunchSlideNhwc(cudaStream_t stream, const PoolAttrs& a,
                            const PoolShape& s, const T* src, T* dst) {
  constexpr Op kOp = kGather ? Op::kBackwardGather : Op::kForward;
  static_assert(NhwcSlides<S>(kOp));
  constexpr int B = NhwcSlideBlock<S>(kOp, static_cast<int>(sizeof(T)));
  const int64_t dst_h = kGather ? s.in_h : s.out_h;
  const int64_t dst_w = kGather ? s.in_w : s.out_w;
  const int rows = SlideRows(dst_h);
  const auto launch = [&](auto v) {
    constexpr int V = decltype(v)::value;
    const int64_t items =
        s.batch * Groups(dst_h, rows) * Groups(dst_w, B) * (s.channels / V);
    return Launch(SlideNhwc<T, S, V, B, kGather>, stream, items, a, s, src, dst,
                  rows, SharedFactorOf<typename Num<T>::Acc>(a, s));
  };
  if constexpr (NhwcBox<S>()) {
    if constexpr (sizeof(T) == 2) {
      // The tensor-core kernels, where they apply: for gathers first the
      // one of whole dy tiles, for forwards the one that stores from
      // registers, then the box filter.
      cudaError_t error = cudaSuccess;
      if constexpr (kGather) {
        if (LaunchMmaTileGatherNhwc<T>(stream, a, s, src, dst, error)) {
          return error;
        }
      } else {
        if (LaunchLaneBoxNhwc<T>(stream, a, s, src, dst, error)) {
          return error;
        }
      }
      if (LaunchMmaBoxNhwc<T, kGather>(stream, a, s, src, dst, error)) {
        return error;
      }
    }
    if constexpr (std::is_same_v<T, float>) {
      // Sums over blocks of rows, where they apply (cuda_box_sums.cu).
      cudaError_t error = cudaSuccess;
      if (LaunchBlockSumsNhwc<kGather>(stream, a, s, src, dst, error)) {
        return error;
      }
    }
    // Eight bytes for 16-bit types; cp.async moves 4, 8 or 16 bytes, so
    // one-element accesses take SlideNhwc with one column per item.
    constexpr int VB = sizeof(T) == 2 ? 4 : kWide<T>;
    if (CanVectorise<T, VB>(s, src, dst)) {
      return LaunchBoxNhwc<T, kGather, S, VB>(stream, a, s, src, dst);
    }
  } else {
    constexpr int VW = kGather ? kWide<T> : kNhwcForwardWide<T, S>;
    if (CanVectorise<T, VW>(s, src, dst)) {
      return launch(std::integral_constant<int, VW>{});
    }
  }
  return launch(std::integral_constant<int, 1>{});
}

// ---------------------------------------------------------------------------
// NCHW, stride 1, whole planes in shared memory (7x7/1 on 28x28 planes, the
// last stages of ResNet-style networks). The row kernels load each source
// row once per item of R destination rows, so the rows that the windows of
// adjacent items share come from L2 (R + K - 1) / R times, and they spend
// most of their instructions on the shuffles and sums of chunks too narrow
// for a 28-wide row. Here a block takes groups of P consecutive planes,
// which are one contiguous range of global memory: it copies each group's
// source planes into shared memory with cp.async (16-byte pieces where the
// plane allows), then sums in two separable passes, as the forward and the
// gather are the same box filter with different offsets:
//   destination (i, j) = sum of source rows i + off_h .. i + off_h + K - 1
//                        and columns j + off_w .. j + off_w + K - 1,
// off = -pad for the forward (source x, destination y) and pad - K + 1 for
// the gather (source dy, destination dx), rows and columns outside the
// source being zero. Pass 1 (a thread per two columns and G destination
// rows) sums down the columns into `tmp`, float32 for 16-bit types; pass 2
// (a thread per C destination columns of a row, adjacent lanes on adjacent
// rows) sums along the rows of `tmp` and writes the group's destination
// planes contiguously into a stage, which the block then copies out in
// 16-byte pieces where the range allows. The gather divides each dy element
// by its divisor as pass 1 loads it (as dy * (1 / row factor * 1 / column
// factor), the row kernels' product); the forward multiplies its sums in
// pass 2, by the one divisor where every window shares it. The zero
// rows and columns around the source planes in shared memory are cleared
// once, as nothing writes them again. The next group's copy is issued as
// soon as pass 1 is done with the source planes, so it overlaps pass 2 and
// the copy-out; the grid keeps every block resident. The same sums on the
// tensor cores (mma.sync with a 0/1 matrix, 16 planes a block) measured
// slower for the bfloat16 7x7/1 (37.9 against 33.1 us; BENCHMARKS.md).
//
// 3x3 windows take one pass instead (`fused` in the kernel): a thread sums
// kSmallPlaneCols destination columns over G rows straight from the source
// planes into the stage, with no tmp, and the group's range is copied in as
// it lies in global memory (CopyInRange: 16-byte pieces from the 16 bytes
// holding its first byte, whatever the planes' size); columns outside a
// plane are masked to zero as they are loaded and rows outside it read
// from a row of zeros. On the H200 (CUDA events, us, forward / gather,
// padding 1), with two columns a task, each element checked for its row
// and column as it was loaded, and groups of at most 16 planes, against
// the two passes with 11 and 7 rows a pass-1 task: 64x288 planes of 35x35,
// bfloat16 41.6 / 41.5 against 78.7 / 68.1, float32 55.4 / 55.6 against 65.5
// / 67.7, with count_include_pad=False bfloat16 46.2 / 46.4 against 81.7
// / 70.5; 64x768 of 17x17, bfloat16 34.2 / 35.1 against 53.4 / 52.4,
// float32 38.1 / 38.7 against 47.0 / 48.3; 128x512 of 14x14, bfloat16 27.2
// / 27.8 against 34.7 / 32.6, and float32 41.9 / 41.9 against 38.5 / 35.1, the
// one call measured slower (4 rows a task took it to 34.5 / 34.6 but the others
// 4-15% longer; one column a task, 37.7 / 38.3, and the others 6-22%
// longer). Most of the gain is the copy in: the two passes with the
// planes copied into their slots (16-bit planes of an odd number of
// elements through registers, CopyInPlaneWords) took 70.0 / 69.4 for the
// bfloat16 35x35 planes, and the one pass from those slots about the same.
// Then four columns a task, the masks, groups of up to 32 planes and four
// blocks a multiprocessor (kPlaneBlocks), against two columns (the same
// harness and session): 35x35 bfloat16 36.2 / 36.5 against 41.5 / 41.2,
// with count_include_pad=False 41.3 / 38.0 against 46.2 / 46.6, float32
// 56.3 / 56.2 against 55.3 / 55.2; 17x17 bfloat16 27.8 / 27.9 against 34.4
// / 35.1, float32 36.1 / 36.2 against 38.2 / 38.5; 14x14 float32 36.2 /
// 36.1 against 41.8 / 41.7, but bfloat16 29.6 / 29.4 against 27.2 / 27.8
// (14 columns fill 14 of the 16 that four tasks take, and 64 registers
// let four blocks stay resident, against six at 40). The masks alone,
// two columns a task, took the bfloat16 gathers 4-9% less and the
// forwards about the same (40 registers became 48). Four columns at the
// compiler's 74 registers in the gather took it 2-12% longer than at 64
// (the float32 35x35 call 3% less); a cap of 48 spilled, up to 17%
// slower (a few 14x14 calls 3-6% faster).

// Destination rows per thread of pass 1 and destination columns per thread
// of pass 2: for 7x7/1 on 28x28 planes, whole multiples of the forward's 22
// and the gather's 28 rows and columns, or nearly. On the H200 (CUDA
// events), 11 rows took the bfloat16 forward 32.6 us against 35.7 for 8
// (and with padding 3, over 28 rows, 49.7 against 47.0); choosing 7 or 11
// rows at run time cost the gathers 3 us, as both passes then hold the
// registers of the larger. 3x3 windows: 7 rows a task of the one pass, a
// divisor of 35 and 14 (the bfloat16 forward of 35x35 planes took 66.2 us
// against 76.8 with the two passes at 7 rows instead of 11; 9 and 5 rows
// took 76.8 and 67.7).
template <bool kGather, int K>
constexpr int kPlaneRows = kGather || K == 3 ? 7 : 11;
template <bool kGather>
constexpr int kPlaneCols = kGather ? 4 : 8;
// 3x3 windows: destination columns per task of the one pass (pairs, whose
// sums along W share two of their three terms).
constexpr int kSmallPlaneCols = 4;
// A block takes the largest power of two of planes, at most
// kPlaneMaxGroup (32 for 3x3 windows, whose groups hold no tmp: with two
// columns a task, 17x17 and 14x14 planes took 6-20% less in groups of 16
// than of 8; with four, 14x14 bfloat16 planes 29.3 / 29.9 us in groups of
// 32 against 30.8 / 34.4, where 16 leave half of the threads without a
// task), whose shared memory fits
// the 48 KiB that need no opt-in;
// where the row kernels take a call, calls where fewer than kPlaneMinGroup
// fit keep them, as do the 4- and 8-byte gathers and the gathers whose
// windows share one divisor. Where they cannot (rows not a whole number of
// their chunks), every call whose group of two planes fits comes here,
// the 3x3/1 ones too (SmallPlaneSpec); before, those went to the kernels
// that load and store element by element (H200, bench, us, forward /
// gather, against them, the 3x3/1 calls with the two passes, before the
// one pass above): 3x3/1 with padding 1 over 64x288 planes of
// 35x35, bfloat16 77.7 / 67.5 against 95.7 / 264.7, float32 64.9 / 67.0
// against 94.0 / 264.8; over 64x768 of 17x17, bfloat16 52.8 / 51.8
// against 78.5 / 246.2; 128x512 of 14x14, 33.7 / 31.9 against 65.8 /
// 262.8; 7x7/1 over 64x512 of 31x45, bfloat16 123.8 / 144.5 against
// 291.4 / 534.3, float32 121.3 / 131.8 against 277.8 / 533.8.
// On the H200 (CUDA events, us, 64x512 planes of 28x28, 7x7/1, against the
// row kernels), forward: bfloat16 32.6 against 40.6 (float16 32.5 against
// 39.8; padding 3: 49.7 against 58.0, and with count_include_pad=False
// 54.3 against 58.0), float32 46.7 against 49.6. Gather, bfloat16 with
// padding 3 and count_include_pad=False: 52.9 against 58.2. Slower, hence
// left to the row kernels: the bfloat16 gathers whose windows share a
// divisor (unpadded 47.1 against 46.4, padding 3 46.0 against 42.4), the
// float32 gather (55.8 against 50.2), the float32 forward with padding 3
// (62.5 against 58.2 with 7 rows per pass 1 task, when four planes fit)
// and 56x56 planes (16-bit gather 47.8 against 44.4, two planes in 64 KiB).
constexpr size_t kPlaneBudget = 48 * 1024;
template <typename T, bool kGather>
constexpr int kPlaneMinGroup = sizeof(T) == 2 && !kGather ? 2 : 4;
// Where the row kernels cannot take a call: groups of two planes or more.
// Groups are powers of two, so even: a group of 16-bit planes of an odd
// number of elements starts 4-byte aligned, as CopyInPlaneWords needs.
constexpr int kPlaneFallbackGroup = 2;
static_assert(kPlaneFallbackGroup % 2 == 0);
template <int K>
constexpr int kPlaneMaxGroup = K == 3 ? 32 : 8;

// The specialisations that take it: stride 1, square windows of 5 and more.
template <typename S>
constexpr bool PlaneSpec() {
  if constexpr (S::kGeneric) {
    return false;
  } else {
    return S::SH == 1 && S::SW == 1 && S::KH == S::KW && S::KH >= 5;
  }
}

// Stride-1 windows of 3x3, which PlanesNchw takes only where the row
// kernels cannot (rows not a whole number of their chunks: the 35x35 and
// 17x17 maps of Inception-style networks, 14x14, 7x7; see kPlaneMinGroup).
template <typename S>
constexpr bool SmallPlaneSpec() {
  if constexpr (S::kGeneric) {
    return false;
  } else {
    return S::SH == 1 && S::SW == 1 && S::KH == S::KW && S::KH == 3;
  }
}

// The geometry of a call, computed on the host. Extents in elements;
// shared-memory offsets (`*_at`) in bytes.
struct PlaneGeom {
  int group;                     // P, planes per group
  int in_h, in_w, out_h, out_w;  // a source and a destination plane
  int off_h, off_w;              // see above
  int src_slot;   // elements of T per source plane in shared memory
  int src_data;   // where the plane's row 0 starts in its slot
  int tmp_w;      // row stride of tmp
  int tmp_a;      // where column 0 is in a row of tmp
  int piece;      // bytes per piece of the copy-in: 16, 8, 4 or 2 (words)
  int out_piece;  // bytes per piece of a whole group's copy-out
  int tmp_at, stage_at, rf_at, cf_at, bytes;
  // The factor tables: rf[i - rf_lo] for the pooled rows i in
  // [rf_lo, rf_lo + rf_len) that a pass reads, cf[j] for j < cf_len, zero
  // outside the pooled extents.
  int rf_lo, rf_len, cf_len;
  int pairs, row_groups, col_groups;  // pass 1 and pass 2 extents
  int col_tasks;                      // 3x3: tasks across a destination row
  FastDiv by_pairs, by_row_groups, by_rows2, by_out_h, by_pieces;
  FastDiv by_col_tasks;
};

// Pass 1 for a task: the column sums of source columns c and c + 1 (when
// `second`) over the windows of destination rows i0 .. i0 + G - 1, read at
// `col` (row i0 + off_h, column c) and written to `to` (tmp row i0, column
// c), rows below `rows` only. kEven: the row width is even, so the two
// columns are one aligned pair and both exist; kPair: they are stored as
// one aligned pair too. kScale: each value is first multiplied by its
// divisor factors, rfp[u] * c0 (c1) for source row i0 + off_h + u.
template <int K, int G, bool kEven, bool kPair, bool kScale, typename T,
          typename Acc>
__device__ __forceinline__ void ColumnSums(const T* col, int in_w, Acc* to,
                                           int tmp_w, int rows, bool second,
                                           const Acc* rfp, Acc c0, Acc c1) {
  using N = Num<T>;
  Acc v0[G + K - 1], v1[G + K - 1];
#pragma unroll
  for (int u = 0; u < G + K - 1; ++u) {
    const T* at = col + u * in_w;
    if constexpr (kEven && std::is_same_v<T, __nv_bfloat16>) {
      // Both halves widen by bit moves: one instruction each.
      const unsigned bits = *reinterpret_cast<const unsigned*>(at);
      v0[u] = __uint_as_float(bits << 16);
      v1[u] = __uint_as_float(bits & 0xffff0000u);
    } else if constexpr (kEven) {
      const Vec<T, 2> pair = *reinterpret_cast<const Vec<T, 2>*>(at);
      v0[u] = N::Load(pair.v[0]);
      v1[u] = N::Load(pair.v[1]);
    } else {
      v0[u] = N::Load(at[0]);
      v1[u] = N::Load(at[1]);
    }
  }
  if constexpr (kScale) {
#pragma unroll
    for (int u = 0; u < G + K - 1; ++u) {
      const Acc r = rfp[u];
      v0[u] *= r * c0;
      v1[u] *= r * c1;
    }
  }
  Acc s0[G], s1[G];
  SlidingSums<K, G>([&](int u) { return v0[u]; }, s0);
  SlidingSums<K, G>([&](int u) { return v1[u]; }, s1);
  const auto store = [&](int o) {
    Acc* at = to + o * tmp_w;
    if constexpr (kPair && std::is_same_v<Acc, float>) {
      *reinterpret_cast<float2*>(at) = make_float2(s0[o], s1[o]);
    } else if constexpr (kPair) {
      *reinterpret_cast<double2*>(at) = make_double2(s0[o], s1[o]);
    } else {
      at[0] = s0[o];
      if (kEven || second) at[1] = s1[o];
    }
  };
  if (rows >= G) {
#pragma unroll
    for (int o = 0; o < G; ++o) store(o);
  } else {
#pragma unroll
    for (int o = 0; o < G; ++o) {
      if (o < rows) store(o);
    }
  }
}

// Copies `bytes` (a multiple of Q) from the 16-byte aligned shared `from`
// to global `to` (aligned to Q), a Q-byte piece per thread.
template <int Q>
__device__ __forceinline__ void CopyOutPieces(const unsigned char* from,
                                              unsigned char* to, int bytes) {
  using Raw = typename RawBits<Q>::type;
  for (int i = threadIdx.x; i < bytes / Q; i += blockDim.x) {
    reinterpret_cast<Raw*>(to)[i] = reinterpret_cast<const Raw*>(from)[i];
  }
}

// Copies np planes of `per` Q-byte pieces each from global `from`
// (contiguous) into their slots in shared memory, as one commit group.
template <int Q>
__device__ __forceinline__ void CopyInPlanes(unsigned char* slots,
                                             int slot_bytes,
                                             const unsigned char* from, int per,
                                             FastDiv by_per, int np) {
  for (int i = threadIdx.x; i < np * per; i += blockDim.x) {
    const int p = by_per(i);
    StartCopy<Q, false>(slots + p * slot_bytes + (i - p * per) * Q,
                        from + i * Q, true);
  }
  CommitCopies();
}

// Copies bytes [a, b) of global `from` (16-byte aligned) into shared `to`
// at the same offsets from a rounded down to 16: whole 16-byte pieces, the
// last one read only up to b (the rest of it zeros), as one commit group.
__device__ __forceinline__ void CopyInRange(unsigned char* to,
                                            const unsigned char* from,
                                            int64_t a, int64_t b) {
  const int64_t a0 = a / 16 * 16;
  const int n = static_cast<int>((b - a0 + 15) / 16);
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(to));
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t o = a0 + 16 * int64_t{i};
    const int bytes = static_cast<int>(min(int64_t{16}, b - o));
#if __CUDA_ARCH__ >= 800
    StartCopyPart(at + 16 * i, from + o, bytes);
#else
    uint4 v = make_uint4(0, 0, 0, 0);
    if (bytes == 16) {
      v = *reinterpret_cast<const uint4*>(from + o);
    } else {
      memcpy(&v, from + o, bytes);
    }
    reinterpret_cast<uint4*>(to)[i] = v;
#endif
  }
  CommitCopies();
}

// CopyInPlanes for 16-bit planes of an odd number of elements, which no
// cp.async piece of 4 bytes or more fits: the range's 4-byte words (`from`
// is 4-byte aligned) through registers, each element to its plane's slot;
// `per` elements a plane. Windows larger than 3x3 only (3x3: CopyInRange).
__device__ __forceinline__ void CopyInPlaneWords(unsigned char* slots,
                                                 int slot_bytes,
                                                 const unsigned char* from,
                                                 int per, FastDiv by_per,
                                                 int np) {
  const int n = np * per;
#pragma unroll 4
  for (int i = threadIdx.x; 2 * i < n; i += blockDim.x) {
    const int e = 2 * i;
    const unsigned word =
        e + 1 < n ? reinterpret_cast<const unsigned*>(from)[i]
                  : reinterpret_cast<const unsigned short*>(from)[e];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (e + h < n) {
        const int p = by_per(e + h);
        unsigned short* const plane =
            reinterpret_cast<unsigned short*>(slots + p * slot_bytes);
        plane[e + h - p * per] = static_cast<unsigned short>(word >> (16 * h));
      }
    }
  }
}

// An element of shared memory widened to its accumulator where `m` is
// kOn, zero where it is 0, whatever bits lie there: the mask goes on the
// raw bits, so no NaN or infinity outside the source reaches a sum. For
// bfloat16 the widening and the mask are one multiplication (the bits
// times 0x10000 or 0), for the others an AND.
template <typename T>
struct Masked {
  using Bits = typename RawBits<sizeof(T)>::type;
  static constexpr Bits kOn = static_cast<Bits>(~Bits{0});
  static __device__ __forceinline__ typename Num<T>::Acc Load(const T* p,
                                                              Bits m) {
    const Bits bits = static_cast<Bits>(*reinterpret_cast<const Bits*>(p) & m);
    T v;
    memcpy(&v, &bits, sizeof(T));
    return Num<T>::Load(v);
  }
};
template <>
struct Masked<double> {
  using Bits = unsigned long long;
  static constexpr Bits kOn = ~Bits{0};
  static __device__ __forceinline__ double Load(const double* p, Bits m) {
    return __longlong_as_double(static_cast<long long>(
        *reinterpret_cast<const unsigned long long*>(p) & m));
  }
};
template <>
struct Masked<__nv_bfloat16> {
  using Bits = unsigned;
  static constexpr Bits kOn = 0x10000u;
  static __device__ __forceinline__ float Load(const __nv_bfloat16* p, Bits m) {
    return __uint_as_float(
        static_cast<unsigned>(*reinterpret_cast<const unsigned short*>(p)) * m);
  }
};

// 3x3 windows: bytes of shared memory before a group's range and at least
// after it, and before and after the row of zeros: the one pass reads up to
// two elements before a row and kSmallPlaneCols + 1 after it (with a right
// padding of two), of up to 8 bytes each.
constexpr int kFusedMargin = (8 * (kSmallPlaneCols + 1) + 15) / 16 * 16;
static_assert(kFusedMargin >= 8 * 2);

// Blocks a multiprocessor PlanesNchw is compiled for: four for the one
// pass of 3x3 windows up to 4-byte types (64 registers; see the comment
// above kPlaneRows); 0 leaves the others to the compiler.
template <typename T, typename S>
constexpr int kPlaneBlocks = S::KH == 3 && sizeof(T) <= 4 ? 4 : 0;

// Adds bytes [a, b) of the 16-byte aligned shared `from` to the 16-byte
// aligned global `to` at the same offsets, a 16-byte piece per thread, each
// one vector atomic (AtomicAdd16); the bytes of the first and last pieces
// outside [a, b) add zeros.
template <typename T>
__device__ __forceinline__ void AddOutPieces(const unsigned char* from,
                                             unsigned char* to, int a, int b) {
  for (int i = threadIdx.x; 16 * i < b; i += blockDim.x) {
    uint4 bits = reinterpret_cast<const uint4*>(from)[i];
    if (16 * i < a || 16 * i + 16 > b) {
      unsigned* const w = reinterpret_cast<unsigned*>(&bits);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        unsigned keep = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int at = 16 * i + 4 * k + e;
          if (at >= a && at < b) keep |= 0xffu << (8 * e);
        }
        w[k] &= keep;
      }
    }
    AtomicAdd16(reinterpret_cast<T*>(to + 16 * i), bits);
  }
}

// kAdd, the scatter of 3x3/1 windows (LaunchAddingGather): the gather
// adding its results to the zeroed dx, a 16-byte vector atomic a piece. A
// group's destination planes are staged from the offset they have in
// their 16 bytes of dx, so that the pieces of the stage are those of dx.
// On the H200 (CUDA events, us, padding 1, the memset included, against
// the tiles of cuda_scatter.cu): 64x288 planes of 35x35, bfloat16 59.3
// against 194.9, float32 110.3 against 120.1; 64x768 of 17x17, 38.2
// against 155.3 and 69.6 against 105.5; 128x512 of 14x14, 38.4 against
// 152.1 and 61.1 against 107.4. Asking L2 for the group's destination
// range as its source lands then took them (same order) to 56.3 from
// 58.8, 99.8 from 110.2, 38.6 from 39.0, 63.9 from 70.4, 37.3 from 38.7
// and 56.7 from 62.8.
template <typename T, typename S, bool kGather, bool kAdd = false>
__global__ void __launch_bounds__(kThreads, kPlaneBlocks<T, S>)
    PlanesNchw(const PoolAttrs a, const PoolShape s, const T* __restrict__ src,
               T* __restrict__ dst, const PlaneGeom g,
               const SharedFactor<typename Num<T>::Acc> shared,
               const int64_t planes) {
  static_assert(!kAdd ||
                (kGather && S::KH == 3 && (sizeof(T) == 2 || sizeof(T) == 4)));
  using N = Num<T>;
  using Acc = typename N::Acc;
  constexpr int K = S::KH, G = kPlaneRows<kGather, K>, C = kPlaneCols<kGather>;
  constexpr int VA = 16 / static_cast<int>(sizeof(Acc));  // per 16 bytes
  constexpr int KR = (C + K - 1 + VA - 1) / VA * VA;      // pass 2 loads
  extern __shared__ __align__(16) unsigned char smem[];
  const T* src_s = reinterpret_cast<const T*>(smem);
  Acc* tmp = reinterpret_cast<Acc*>(smem + g.tmp_at);
  unsigned char* stage = smem + g.stage_at;
  T* stage_t = reinterpret_cast<T*>(stage);
  Acc* rf = reinterpret_cast<Acc*>(smem + g.rf_at);
  Acc* cf = reinterpret_cast<Acc*>(smem + g.cf_at);
  const int tid = threadIdx.x, nthreads = blockDim.x;
  // Zeros around the planes, and the factor tables.
  for (int i = tid; i < g.stage_at / 16; i += nthreads) {
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  }
  const bool scaled = !shared.all;
  if (scaled) {
    const int H = static_cast<int>(s.in_h), W = static_cast<int>(s.in_w);
    const int OH = static_cast<int>(s.out_h), OW = static_cast<int>(s.out_w);
    for (int k = tid; k < g.rf_len; k += nthreads) {
      const int o = k + g.rf_lo;
      rf[k] = o >= 0 && o < OH ? Reciprocal(AxisFactor<Acc>(
                                     a, o, H, K, 1, static_cast<int>(a.pad_top),
                                     static_cast<int>(a.pad_bottom), true))
                               : Acc(0);
    }
    for (int o = tid; o < g.cf_len; o += nthreads) {
      cf[o] = o < OW ? Reciprocal(AxisFactor<Acc>(
                           a, o, W, K, 1, static_cast<int>(a.pad_left),
                           static_cast<int>(a.pad_right), false))
                     : Acc(0);
    }
  }
  __syncthreads();
  const int64_t groups = (planes + g.group - 1) / g.group;
  const int64_t in_plane = static_cast<int64_t>(g.in_h) * g.in_w;
  const int64_t out_plane = static_cast<int64_t>(g.out_h) * g.out_w;
  const int in_bytes = static_cast<int>(in_plane * sizeof(T));
  const int slot_bytes = g.src_slot * static_cast<int>(sizeof(T));
  const auto count = [&](int64_t grp) {
    return static_cast<int>(
        min(static_cast<int64_t>(g.group), planes - grp * g.group));
  };
  // 3x3 windows: the group's range of the source as it lies in global
  // memory, from the 16 bytes that hold its first byte, kFusedMargin bytes
  // in; `lead` elements before the group's first plane.
  const auto lead = [&](int64_t grp) {
    return static_cast<int>((kFusedMargin + grp * g.group * in_bytes % 16) /
                            sizeof(T));
  };
  // kAdd: elements of dx before the group's first in its 16 bytes.
  const auto out_lead = [&](int64_t grp) {
    return kAdd ? static_cast<int>(grp * g.group * out_plane * sizeof(T) % 16 /
                                   sizeof(T))
                : 0;
  };
  const auto copy_in = [&](int64_t grp) {
    if constexpr (K == 3) {
      const int64_t a0 = grp * g.group * in_bytes;
      CopyInRange(smem + kFusedMargin,
                  reinterpret_cast<const unsigned char*>(src), a0,
                  a0 + count(grp) * int64_t{in_bytes});
    } else {
      const unsigned char* from = reinterpret_cast<const unsigned char*>(
          src + grp * g.group * in_plane);
      unsigned char* to = smem + g.src_data * sizeof(T);
      const int np = count(grp), per = in_bytes / g.piece;
      if (g.piece == 16) {
        CopyInPlanes<16>(to, slot_bytes, from, per, g.by_pieces, np);
      } else if (g.piece == 8) {
        CopyInPlanes<8>(to, slot_bytes, from, per, g.by_pieces, np);
      } else if (g.piece == 4) {
        CopyInPlanes<4>(to, slot_bytes, from, per, g.by_pieces, np);
      } else {
        CopyInPlaneWords(to, slot_bytes, from, per, g.by_pieces, np);
      }
    }
  };
  // Pass 1, with its compile-time choices.
  const auto pass1 = [&](int np, auto even, auto pair, auto scale) {
    constexpr bool kEven = decltype(even)::value;
    constexpr bool kPair = decltype(pair)::value;
    constexpr bool kScale = decltype(scale)::value;
    const int tasks = np * g.pairs * g.row_groups;
    for (int t = tid; t < tasks; t += nthreads) {
      const int q = g.by_pairs(t), c = (t - q * g.pairs) * 2;
      const int p = g.by_row_groups(q), i0 = (q - p * g.row_groups) * G;
      const T* col =
          src_s + p * g.src_slot + g.src_data + (i0 + g.off_h) * g.in_w + c;
      Acc* to = tmp + (p * g.out_h + i0) * g.tmp_w + g.tmp_a + c;
      const Acc* rfp = rf + (i0 + g.off_h - g.rf_lo);
      ColumnSums<K, G, kEven, kPair, kScale, T>(
          col, g.in_w, to, g.tmp_w, g.out_h - i0, c + 1 < g.in_w, rfp,
          kScale ? cf[c] : Acc(0), kScale ? cf[c + 1] : Acc(0));
    }
  };
  // 3x3 windows: one pass from the source planes straight into the stage.
  // A task takes the NC = 2 destination columns from j0 over rows i0 .. i0
  // + G - 1: the sums along W of the G + 2 source rows under them, then
  // down H. The planes lie in shared memory as in global memory (from
  // `first` elements on), so the task reads its NC + 2 columns of each row
  // in place, whether or not they lie in the plane (the neighbouring rows,
  // planes or margins of the group): columns outside it are masked to zero
  // as they are loaded (Masked, the masks taken once per task), and rows
  // outside it are read from a row of zeros (at tmp_at, kFusedMargin bytes
  // in, which nothing writes after the block's first barrier). kScale as
  // in pass 1.
  const auto fused = [&](int np, int first, int out_first, auto scale) {
    constexpr bool kScale = decltype(scale)::value;
    constexpr int NC = kSmallPlaneCols;
    static_assert(NC % 2 == 0);
    using M = Masked<T>;
    using Bits = typename M::Bits;
    const int tasks = np * g.col_tasks * g.row_groups;
    const bool even_out = g.out_w % 2 == 0;
    for (int t = tid; t < tasks; t += nthreads) {
      const int q = g.by_col_tasks(t), j0 = (t - q * g.col_tasks) * NC;
      const int p = g.by_row_groups(q), i0 = (q - p * g.row_groups) * G;
      const int c0 = j0 + g.off_w, r0 = i0 + g.off_h;
      const T* const plane =
          src_s + first + p * static_cast<int>(in_plane) + c0;
      const T* const zeros =
          reinterpret_cast<const T*>(smem + g.tmp_at + kFusedMargin) + c0;
      Bits m[NC + 2];
      Acc cw[NC + 2];
#pragma unroll
      for (int u = 0; u < NC + 2; ++u) {
        const bool in =
            static_cast<unsigned>(c0 + u) < static_cast<unsigned>(g.in_w);
        m[u] = in ? M::kOn : Bits{0};
        cw[u] = kScale && in ? cf[c0 + u] : Acc(0);
      }
      Acc h[NC][G + 2];
#pragma unroll
      for (int r = 0; r < G + 2; ++r) {
        const int rr = r0 + r;
        const T* const row =
            static_cast<unsigned>(rr) < static_cast<unsigned>(g.in_h)
                ? plane + rr * g.in_w
                : zeros;
        Acc x[NC + 2];
#pragma unroll
        for (int u = 0; u < NC + 2; ++u) x[u] = M::Load(row + u, m[u]);
        if constexpr (kScale) {
          const Acc rs = rf[r0 - g.rf_lo + r];
#pragma unroll
          for (int u = 0; u < NC + 2; ++u) x[u] *= rs * cw[u];
        }
        // Columns b and b + 1 share two of their three terms.
#pragma unroll
        for (int b = 0; b < NC; b += 2) {
          const Acc mid = x[b + 1] + x[b + 2];
          h[b][r] = x[b] + mid;
          h[b + 1][r] = mid + x[b + 3];
        }
      }
      // Down H: rows o and o + 1 share the sum of rows o + 1 and o + 2.
      const int nrow = g.out_h - i0;
      const int left = g.out_w - j0;
      const bool pair = even_out;
      T* to = stage_t + out_first + (p * g.out_h + i0) * g.out_w + j0;
#pragma unroll
      for (int o = 0; o < G; o += 2) {
        if (o >= nrow) break;
#pragma unroll
        for (int d = 0; d < 2 && o + d < G; ++d) {
          if (d == 1 && o + 1 >= nrow) break;
          Acc y[NC];
#pragma unroll
          for (int b = 0; b < NC; ++b) {
            const Acc shared_rows = h[b][o + 1] + h[b][o + 2];
            y[b] = d == 0 ? h[b][o] + shared_rows : shared_rows + h[b][o + 3];
            if (!scaled) {
              y[b] *= shared.value;
            } else if (!kGather) {
              y[b] *= rf[i0 + o + d] * cf[j0 + b];
            }
          }
          if (pair) {
#pragma unroll
            for (int b = 0; b < NC; b += 2) {
              if (b < left) {
                Vec<T, 2> v;
                v.v[0] = N::Store(y[b]);
                v.v[1] = N::Store(y[b + 1]);
                *reinterpret_cast<Vec<T, 2>*>(to + b) = v;
              }
            }
          } else {
#pragma unroll
            for (int b = 0; b < NC; ++b) {
              if (b < left) to[b] = N::Store(y[b]);
            }
          }
          to += g.out_w;
        }
      }
    }
  };
  using True = std::true_type;
  using False = std::false_type;
  const bool even = g.in_w % 2 == 0, pair = even && g.tmp_a % 2 == 0;
  int64_t grp = blockIdx.x;
  if (grp < groups) copy_in(grp);
  for (; grp < groups; grp += gridDim.x) {
    const int np = count(grp);
    if (kAdd && tid == 0) {
      // L2 fetches the group's destination range (from the start of its
      // first 16 bytes, to the end of its last whole 16) while its source
      // lands, for the atomics of the copy-out.
      const int64_t head = out_lead(grp) * static_cast<int64_t>(sizeof(T));
      const int64_t len =
          (head + np * out_plane * static_cast<int64_t>(sizeof(T))) & ~15;
      if (len > 0) {
        PrefetchL2Range(reinterpret_cast<const unsigned char*>(
                            dst + grp * g.group * out_plane) -
                            head,
                        static_cast<int>(len));
      }
    }
    CopyWait<0>();
    __syncthreads();
    if constexpr (K == 3) {
      if (kGather && scaled) {
        fused(np, lead(grp), out_lead(grp), True{});
      } else {
        fused(np, lead(grp), out_lead(grp), False{});
      }
    } else if (kGather && scaled) {
      // Pass 1: down the columns.
      if (pair) {
        pass1(np, True{}, True{}, True{});
      } else if (even) {
        pass1(np, True{}, False{}, True{});
      } else {
        pass1(np, False{}, False{}, True{});
      }
    } else {
      if (pair) {
        pass1(np, True{}, True{}, False{});
      } else if (even) {
        pass1(np, True{}, False{}, False{});
      } else {
        pass1(np, False{}, False{}, False{});
      }
    }
    __syncthreads();
    if (grp + gridDim.x < groups) copy_in(grp + gridDim.x);
    // Pass 2, for windows larger than 3x3 (the one pass has filled the
    // stage before the barrier above).
    if constexpr (K != 3) {
      // Along the rows, into the stage. Adjacent lanes take the same
      // columns of adjacent rows (q, over the group's planes), whose loads
      // fall on distinct banks as the rows of tmp are 16 bytes apart modulo
      // the 128 bytes of the banks (an odd multiple of 16 bytes apart).
      const int rows2 = g.group * g.out_h, live = np * g.out_h;
      const int tasks2 = rows2 * g.col_groups;
      const bool even_out = g.out_w % 2 == 0;
      for (int t = tid; t < tasks2; t += nthreads) {
        const int k = g.by_rows2(t), q = t - k * rows2, j0 = k * C;
        if (q >= live) continue;
        const Acc* row = tmp + q * g.tmp_w + j0 + g.off_w + g.tmp_a;
        Acc v[KR];
#pragma unroll
        for (int u = 0; u < KR / VA; ++u) {
          const Vec<Acc, VA> piece =
              reinterpret_cast<const Vec<Acc, VA>*>(row)[u];
#pragma unroll
          for (int e = 0; e < VA; ++e) v[u * VA + e] = piece.v[e];
        }
        Acc out[C];
        SlidingSums<K, C>([&](int u) { return v[u]; }, out);
        if (!scaled) {
#pragma unroll
          for (int b = 0; b < C; ++b) out[b] *= shared.value;
        } else if (!kGather) {
          const int i = q - g.by_out_h(q) * g.out_h;
          const Acc r = rf[i];
#pragma unroll
          for (int b = 0; b < C; ++b) out[b] *= r * cf[j0 + b];
        }
        T* to = stage_t + q * g.out_w + j0;
        const int left = g.out_w - j0;
        if (even_out) {
          const auto put = [&](int b) {
            Vec<T, 2> pair;
            pair.v[0] = N::Store(out[b]);
            pair.v[1] = N::Store(out[b + 1]);
            *reinterpret_cast<Vec<T, 2>*>(to + b) = pair;
          };
          if (left >= C) {
#pragma unroll
            for (int b = 0; b < C; b += 2) put(b);
          } else {
#pragma unroll
            for (int b = 0; b < C; b += 2) {
              if (b < left) put(b);
            }
          }
        } else {
#pragma unroll
          for (int b = 0; b < C; ++b) {
            if (b < left) to[b] = N::Store(out[b]);
          }
        }
      }
      __syncthreads();
    }
    // Copy-out: the group's destination planes are contiguous.
    unsigned char* out_at =
        reinterpret_cast<unsigned char*>(dst + grp * g.group * out_plane);
    const int bytes = static_cast<int>(np * out_plane * sizeof(T));
    if constexpr (kAdd) {
      const int head = out_lead(grp) * static_cast<int>(sizeof(T));
      AddOutPieces<T>(stage, out_at - head, head, head + bytes);
      continue;
    }
    int q = g.out_piece;
    if (np < g.group) {  // the last group
      q = 16;
      while (q > static_cast<int>(sizeof(T)) &&
             (bytes % q != 0 || reinterpret_cast<uintptr_t>(out_at) % q != 0)) {
        q /= 2;
      }
    }
    if (q == 16) {
      CopyOutPieces<16>(stage, out_at, bytes);
    } else if (q == 8) {
      CopyOutPieces<8>(stage, out_at, bytes);
    } else if (q == 4) {
      CopyOutPieces<4>(stage, out_at, bytes);
    } else {
      CopyOutPieces<2>(stage, out_at, bytes);
    }
    // The next group's first barrier orders these reads of the stage
    // before pass 2 writes it again.
  }
}

// The geometry of a PlanesNchw call, or false when it does not take it:
// NCHW, the left and top padding at most K / 2 and the others below K, a
// source aligned for pieces of 4 bytes or more (16-bit planes of an odd
// number of elements: copied by words, CopyInPlaneWords), 16-byte aligned
// for 3x3 windows (CopyInRange), and `min_group` planes or more per group
// in the budget.
template <typename T, typename S, bool kGather>
bool PlaneGeometry(const PoolAttrs& a, const PoolShape& s, const void* src,
                   const void* dst, int64_t min_group, PlaneGeom& g) {
  using Acc = typename Num<T>::Acc;
  constexpr int K = S::KH, G = kPlaneRows<kGather, K>, C = kPlaneCols<kGather>;
  constexpr int64_t VA = 16 / static_cast<int>(sizeof(Acc));
  constexpr int64_t KR = (C + K - 1 + VA - 1) / VA * VA;
  constexpr int64_t sz = sizeof(T), acc = sizeof(Acc);
  constexpr int64_t kSmall = 1 << 12;
  if (a.layout != kNCHW || a.pad_top > K / 2 || a.pad_left > K / 2 ||
      a.pad_bottom >= K || a.pad_right >= K || s.in_h >= kSmall ||
      s.in_w >= kSmall || s.out_h < 1 || s.out_w < 1) {
    return false;
  }
  const auto round = [](int64_t n, int64_t m) { return (n + m - 1) / m * m; };
  const int64_t in_h = kGather ? s.out_h : s.in_h;
  const int64_t in_w = kGather ? s.out_w : s.in_w;
  const int64_t out_h = kGather ? s.in_h : s.out_h;
  const int64_t out_w = kGather ? s.in_w : s.out_w;
  const int64_t off_h = kGather ? a.pad_top - K + 1 : -a.pad_top;
  const int64_t off_w = kGather ? a.pad_left - K + 1 : -a.pad_left;
  const int64_t in_bytes = in_h * in_w * sz;
  int64_t piece = 16;
  while (piece >= 4 && (in_bytes % piece != 0 ||
                        reinterpret_cast<uintptr_t>(src) % piece != 0)) {
    piece /= 2;
  }
  if (K == 3) {
    // The group's range as it lies in global memory (CopyInRange).
    if (reinterpret_cast<uintptr_t>(src) % 16 != 0) return false;
  } else if (piece < 4) {
    // Groups hold an even number of planes, so each starts 4-byte aligned.
    if (sz != 2 || reinterpret_cast<uintptr_t>(src) % 4 != 0) return false;
    piece = 2;
  }
  if (reinterpret_cast<uintptr_t>(dst) % sz != 0) return false;
  const int64_t pairs = (in_w + 1) / 2;
  const int64_t row_groups = (out_h + G - 1) / G;
  const int64_t col_groups = (out_w + C - 1) / C;
  // Source rows that pass 1 reads: first .. last, in a slot whose row 0
  // starts 16-byte aligned; one row of slack for the odd-width pairs.
  const int64_t first = std::min<int64_t>(off_h, 0);
  const int64_t last =
      std::max<int64_t>(in_h - 1, row_groups * G - 1 + off_h + K - 1);
  const int64_t data = round(-first * in_w * sz, 16) / sz;
  const int64_t slot = round((data + (last + 2) * in_w) * sz, 16) / sz;
  // tmp: column 0 at tmp_a, with (j0 + off_w + tmp_a) a multiple of VA for
  // j0 a multiple of C, and a row stride of an odd number of 16 bytes.
  const int64_t start = round(std::max<int64_t>(off_w, 0), VA);
  const int64_t tmp_a = start - off_w;
  const int64_t width =
      std::max((col_groups - 1) * C + start + KR, tmp_a + in_w);
  int64_t tmp_w = round(width, VA);
  while ((tmp_w / VA) % 2 == 0) tmp_w += VA;
  const int64_t rf_lo = kGather ? first : 0;
  const int64_t rf_len = kGather ? last - first + 1 : out_h;
  const int64_t cf_len = round(std::max(pairs * 2, col_groups * C), 4);
  const auto layout = [&](int64_t p, PlaneGeom& o) {
    // 3x3 windows: the group's range from 16 bytes before, with margins
    // (kFusedMargin), and in place of tmp a row of zeros with margins.
    const int64_t tmp_at = K == 3
                               ? round(p * in_bytes + 15 + 2 * kFusedMargin, 16)
                               : p * slot * sz;
    const int64_t stage_at =
        tmp_at + (K == 3 ? round(in_w * sz + 2 * kFusedMargin, 16)
                         : round(p * out_h * tmp_w * acc, 16));
    // The stage; for 3x3 windows 16 bytes more, where the scatter stages a
    // group from its offset in its 16 bytes of dx (kAdd).
    const int64_t rf_at =
        stage_at + round(p * out_h * out_w * sz + (K == 3 ? 16 : 0), 16);
    const int64_t cf_at = rf_at + round(rf_len * acc, 16);
    const int64_t bytes = cf_at + cf_len * acc;
    o.tmp_at = static_cast<int>(tmp_at);
    o.stage_at = static_cast<int>(stage_at);
    o.rf_at = static_cast<int>(rf_at);
    o.cf_at = static_cast<int>(cf_at);
    o.bytes = static_cast<int>(std::min<int64_t>(bytes, INT32_MAX));
    return bytes;
  };
  constexpr int64_t kBudget = kPlaneBudget;
  int64_t p = kPlaneMaxGroup<K>;
  while (p >= min_group && layout(p, g) > kBudget) p /= 2;
  if (p < min_group) return false;
  g.group = static_cast<int>(p);
  g.in_h = static_cast<int>(in_h);
  g.in_w = static_cast<int>(in_w);
  g.out_h = static_cast<int>(out_h);
  g.out_w = static_cast<int>(out_w);
  g.off_h = static_cast<int>(off_h);
  g.off_w = static_cast<int>(off_w);
  g.src_slot = static_cast<int>(slot);
  g.src_data = static_cast<int>(data);
  g.tmp_w = static_cast<int>(tmp_w);
  g.tmp_a = static_cast<int>(tmp_a);
  g.piece = static_cast<int>(piece);
  g.rf_lo = static_cast<int>(rf_lo);
  g.rf_len = static_cast<int>(rf_len);
  g.cf_len = static_cast<int>(cf_len);
  g.pairs = static_cast<int>(pairs);
  g.row_groups = static_cast<int>(row_groups);
  g.col_groups = static_cast<int>(col_groups);
  g.col_tasks = static_cast<int>(Groups(out_w, kSmallPlaneCols));
  g.by_pairs = FastDiv::Of(static_cast<uint32_t>(pairs));
  g.by_col_tasks = FastDiv::Of(static_cast<uint32_t>(g.col_tasks));
  g.by_row_groups = FastDiv::Of(static_cast<uint32_t>(row_groups));
  g.by_rows2 = FastDiv::Of(static_cast<uint32_t>(p * out_h));
  g.by_out_h = FastDiv::Of(static_cast<uint32_t>(out_h));
  g.by_pieces = FastDiv::Of(static_cast<uint32_t>(in_bytes / piece));
  // Whole groups start at multiples of their size from dst.
  const int64_t out_group = p * out_h * out_w * sz;
  int64_t out_piece = 16;
  while (out_piece > sz &&
         (out_group % out_piece != 0 ||
          reinterpret_cast<uintptr_t>(dst) % out_piece != 0)) {
    out_piece /= 2;
  }
  g.out_piece = static_cast<int>(out_piece);
  return true;
}

// rows_fit: whether the row kernels take the call, which they then keep
// where they were faster (see kPlaneMinGroup). kAdd: the scatter, on sm_90
// (vector atomics) and a 16-byte aligned dx, zeroed here first.
template <typename T, typename S, bool kGather, bool kAdd = false>
bool LaunchPlaneKernel(cudaStream_t stream, const PoolAttrs& a,
                       const PoolShape& s, const T* src, T* dst, bool rows_fit,
                       cudaError_t& err) {
  using Acc = typename Num<T>::Acc;
  const SharedFactor<Acc> shared = SharedFactorOf<Acc>(a, s);
  if (rows_fit && kGather && (shared.all || sizeof(T) != 2)) return false;
  PlaneGeom g;
  if (!PlaneGeometry<T, S, kGather>(
          a, s, src, dst,
          rows_fit ? kPlaneMinGroup<T, kGather> : kPlaneFallbackGroup, g)) {
    return false;
  }
  const int64_t planes = s.batch * s.channels;
  const int64_t groups = (planes + g.group - 1) / g.group;
  if (groups == 0) {
    err = cudaSuccess;
    return true;
  }
  const auto kernel = PlanesNchw<T, S, kGather, kAdd>;
  if constexpr (kAdd) {
    if (CodeOf(kernel).binary < 90 ||
        reinterpret_cast<uintptr_t>(dst) % 16 != 0) {
      return false;
    }
    err = ZeroInputShape(dst, s, stream);
    if (err != cudaSuccess) return true;
  }
  int64_t resident = 0;
  err = ResidentBlocks(kernel, kThreads, g.bytes, resident);
  if (err != cudaSuccess) return true;
  resident = std::max<int64_t>(resident, 1);
  const unsigned grid = static_cast<unsigned>(
      std::min<int64_t>(std::min(groups, resident), INT32_MAX));
  kernel<<<grid, kThreads, g.bytes, stream>>>(a, s, src, dst, g, shared,
                                              planes);
  err = cudaGetLastError();
  return true;
}

// Launches PlanesNchw with as many blocks as stay resident together (each
// loops over groups), or returns false where it does not take the call
// (3x3/1 windows: only where the row kernels cannot, SmallPlaneSpec).
template <typename T, typename S, bool kGather>
bool LaunchPlanes(cudaStream_t stream, const PoolAttrs& a, const PoolShape& s,
                  const T* src, T* dst, cudaError_t& err) {
  const bool rows_fit = RowKernelsFit<T, S>(a, s, src, dst);
  if (SmallPlaneSpec<S>() && rows_fit) return false;
  return LaunchPlaneKernel<T, S, kGather>(stream, a, s, src, dst, rows_fit,
                                          err);
}

// ---------------------------------------------------------------------------
// NCHW, stride 1, K x K windows (7x7/1) on planes of at most 32 rows and
// 32 strips; strips of registers: a lane per strip of kStripCols adjacent
// destination columns of one plane, walking down the plane with its sums in
// registers. The forward and the gather are the box filter of PlanesNchw
// (destination (i, j) sums source rows i + off_h .. i + off_h + K - 1 and
// columns j + off_w .. j + off_w + K - 1, zero outside the source), here only
// where every window shares one divisor, whose factor multiplies each
// destination sum (float32) or, fused into their last additions, the sums
// along W (16-bit types).
// A warp takes `per_warp` consecutive planes, one contiguous range of the
// source, and copies them into its own part of shared memory (cp.async, in the
// largest pieces the range allows). Per source row a lane then loads the
// kStripCols + K - 1 source columns under its strip (in aligned pairs where
// the rows and offsets allow), sums them along W into its kStripCols window
// sums; every kStripRows rows it adds those of the new rows to sums down H
// of the K - 1 rows before them, carried from the step before, into
// kStripRows destination rows, which it stores. Rows outside the source
// are skipped by a branch that every lane takes alike, and steps whose rows
// are all inside take no checks. No barrier but the warp's own, no shuffle, and
// per output the additions of sliding sums in the two directions: PlanesNchw
// spends most of its instructions moving values through shared memory between
// its two passes, and waits at the block's barriers between them; the row
// kernels shuffle the columns of 16-byte chunks too narrow for these rows.
//
// Where it is taken (StripsTake), against the kernels it replaces, on the
// H200 (CUDA events, us, 64x512 planes of 28x28 unless said): gather,
// bfloat16 26.8 against 47.2, float16 28.2 against 47.7, float32 48.6
// against 51.3 (with padding 2, 53.7 against 56.1); bfloat16 forward with
// padding 1 35.7 against 46.1 and with padding 3 33.3 against 50.2; 14x14
// planes 9.3 against 16.5 (forward) and 33.7 against 117 (gather). Those
// figures are of the kernel's form before the carried sums down H and the
// scaled sums along W, which took the 16-bit gathers from 27.3 (bfloat16)
// and 28.2 (float16) to 26.4 and 26.7, the bfloat16 forward with padding 3
// from 33.3 to 31.7, with 12% fewer instructions (bfloat16 gather: 14.25 M
// against 16.18 M; the sums kept down H had moved between registers every
// step). Not taken, as slower (most on the kernel's first forms, which
// took 1.2-1.4 times as long as this one): the forward of 22-wide rows, whose
// stores then go in pairs (32.6 for PlanesNchw against 37.4 with the pairs
// realigned by a shuffle for 8-byte stores, 41.7 staged through shared
// memory and copied out whole, 56.8 stored in pairs; 55.0-55.2 on this
// form, in pairs or one element at a time; 30.2-30.5 on it with each
// destination plane staged in its source's slot behind the walk and the
// warp's planes copied out as one range, against MmaPlanesNchw's
// 29.5-29.6); gathers whose source columns do not pair up (padding 1: 46.7
// against 42.4); 56x56 planes (16x512, padding 3: 62-66 against 42-59); float32
// forwards (60-79 against 47-59) and float64. Tried, not kept: loading the
// source straight from global memory instead of shared (bfloat16 forward 78.6,
// gather 56.7: the lanes of five planes reach five places of memory per
// instruction); the rows outside the source loaded as predicated-off zeros
// rather than skipped (gather 43.4 against 36.7 then); steps of six rows
// over two halves of the row sums that swap roles, so that no sums move
// between registers (gather 28.5 against 26.8: 80 registers, spilling in
// some forms); as many blocks as stay resident, each warp looping over its
// groups with two buffers, the next group's copy in flight while it sums
// one (gather 30.4-30.9 against 27.2-27.5).
constexpr int kStripCols = 4;
constexpr int kStripRows = 4;
constexpr int kStripThreads = 128;
constexpr int kStripWarpBytes = 48 * 1024 / (kStripThreads / 32);
constexpr int kStripMaxRows = 32;
// The planes of the calling warp in StripsNchw and HalfStripsNchw, whose
// geometry g gives per_warp and warp_bytes: warp w of the grid takes the
// per_warp consecutive planes from p0 = w * per_warp (np of them, fewer at
// the end) and its own warp_bytes of the block's shared memory (`mine`);
// false for the warps past the last plane.
template <typename Geom>
__device__ __forceinline__ bool WarpPlanesOf(const Geom& g, int64_t planes,
                                             int64_t& p0, int& np,
                                             unsigned char*& mine) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t warp =
      (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  p0 = warp * g.per_warp;
  if (p0 >= planes) return false;
  np = static_cast<int>(min(static_cast<int64_t>(g.per_warp), planes - p0));
  mine = smem + (threadIdx.x >> 5) * g.warp_bytes;
  return true;
}

// Blocks per multiprocessor StripsNchw is compiled for: without it, ptxas
// held the paired kernels to 64 registers and spilled.
constexpr int kStripBlocks = 6;

struct StripGeom {
  int in_h, in_w, out_h, out_w;  // a source and a destination plane
  int off_h, off_w;              // as in PlaneGeom
  int lanes;                     // strips per plane
  int per_warp;                  // planes per warp
  int slot;        // bytes per plane in shared memory: the plane's, or 4 more
  int warp_bytes;  // shared memory per warp, a multiple of 16
  int in_q;        // bytes per piece of a plane-by-plane copy in
  int store;       // stores whole strips (2), aligned pairs (1) or elements
  int stage;       // kAdd: the offset of the destination planes in warp_bytes
};

template <int Q>
__device__ __forceinline__ void CopyPiece(unsigned char* to,
                                          const unsigned char* from) {
  using Raw = typename RawBits<Q>::type;
  *reinterpret_cast<Raw*>(to) = *reinterpret_cast<const Raw*>(from);
}

// StripsNchw's geometry: the call's, at run time, or fixed at compile time
// for a common one (the launcher's list), so that the compiler folds the
// planes' sizes, offsets and strips into constants. The 16-bit gather of
// 28x28 planes from 22x22 (7x7, no padding) went from 1784 instructions of
// code to 840, and on the H200 (bfloat16, 64 calls replayed from a CUDA
// graph, best of seven, three runs each) from 24.63-24.73 us to
// 23.96-24.09 for 64x512 planes, 45.81 to 45.08 for 128x512, 13.58 to
// 13.18 for 33x512, with the same outputs bit for bit.
struct RuntimeStrips {
  static constexpr bool kFixed = false;
};
template <int kInH, int kInW, int kOutH, int kOutW, int kOffH, int kOffW,
          int kLanes, int kPerWarp, int kStore>
struct FixedStrips {
  static constexpr bool kFixed = true;
  template <int kSize>
  static constexpr int kSlot = (kInH * kInW * kSize + 3) / 4 * 4;
  template <int kSize>
  static constexpr int kWarpBytes = (kPerWarp * kSlot<kSize> + 15) / 16 * 16;
  // Whether the call's geometry is this one, for elements of kSize bytes.
  template <int kSize>
  static bool Is(const StripGeom& g) {
    return g.in_h == kInH && g.in_w == kInW && g.out_h == kOutH &&
           g.out_w == kOutW && g.off_h == kOffH && g.off_w == kOffW &&
           g.lanes == kLanes && g.per_warp == kPerWarp && g.store == kStore &&
           g.slot == kSlot<kSize> && g.warp_bytes == kWarpBytes<kSize> &&
           g.stage == 0;
  }
  // The geometry as constants but for the call's piece size of its copy in
  // (from g), which depends on the source's alignment.
  template <int kSize>
  static __device__ StripGeom Of(const StripGeom& g) {
    return {kInH,   kInW,   kOutH,    kOutW,        kOffH,
            kOffW,  kLanes, kPerWarp, kSlot<kSize>, kWarpBytes<kSize>,
            g.in_q, kStore, 0};
  }
};

template <typename T, typename S, bool kPairs, bool kWhole, bool kAdd,
          typename Geo = RuntimeStrips>
__global__ void __launch_bounds__(kStripThreads, kStripBlocks)
    StripsNchw(const T* __restrict__ src, T* __restrict__ dst,
               const StripGeom call_g, const typename Num<T>::Acc value,
               const int64_t planes) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  constexpr int K = S::KH, B = kStripCols, G = kStripRows;
  constexpr int NC = B + K - 1;  // source columns under a strip
  constexpr int sz = static_cast<int>(sizeof(T));
  static_assert(!kPairs || NC % 2 == 0);
  // 16-bit types: the row sums along W come out multiplied by the divisor's
  // factor (ByFactor), three operations fewer a row than the destination
  // sums multiplied; float32 keeps its products of whole sums.
  constexpr bool kScaled = sz == 2;
  // kAdd: the gather adding into a zeroed destination, for the scatter
  // (LaunchStripsScatter): the warp's destination planes go to shared
  // memory, then to global memory by one bulk reduction.
  static_assert(!kAdd || kWhole);
  const StripGeom g = [&] {
    if constexpr (Geo::kFixed) {
      return Geo::template Of<sz>(call_g);
    } else {
      return call_g;
    }
  }();
  const int lane = static_cast<int>(threadIdx.x & 31);
  int64_t p0;
  int np;
  unsigned char* mine;
  if (!WarpPlanesOf(g, planes, p0, np, mine)) return;
  const int in_bytes = g.in_h * g.in_w * sz;
  const int out_plane = g.out_h * g.out_w;
  // kAdd: the warp's destination range, asked of L2 ahead of the
  // reduction, which would otherwise wait there for its lines.
  [[maybe_unused]] unsigned char* const out_range =
      reinterpret_cast<unsigned char*>(dst) +
      p0 * static_cast<int64_t>(out_plane * sz);
  [[maybe_unused]] const int out_bytes = np * out_plane * sz;
  if (kAdd && lane == 0) PrefetchL2Range(out_range, out_bytes);
  {
    const unsigned char* from = reinterpret_cast<const unsigned char*>(src) +
                                p0 * static_cast<int64_t>(in_bytes);
    // Pieces of Q bytes: over the whole range where the slots are the
    // planes themselves (g.slot == in_bytes), else plane by plane.
    const auto copy = [&](auto q) {
      constexpr int Q = decltype(q)::value;
      if (g.slot == in_bytes) {
        for (int i = lane * Q; i < np * in_bytes; i += 32 * Q) {
          if constexpr (Q >= 4) {
            StartCopy<Q, false>(mine + i, from + i, true);
          } else {
            CopyPiece<Q>(mine + i, from + i);
          }
        }
      } else {
        for (int k = 0; k < np; ++k) {
          for (int i = lane * Q; i < in_bytes; i += 32 * Q) {
            if constexpr (Q >= 4) {
              StartCopy<Q, false>(mine + k * g.slot + i,
                                  from + k * in_bytes + i, true);
            } else {
              CopyPiece<Q>(mine + k * g.slot + i, from + k * in_bytes + i);
            }
          }
        }
      }
    };
    const int fit =
        g.slot == in_bytes
            ? (np * in_bytes) |
                  static_cast<int>(reinterpret_cast<uintptr_t>(from) & 15)
            : g.in_q;
    if (fit % 16 == 0) {
      copy(std::integral_constant<int, 16>{});
    } else if (fit % 8 == 0) {
      copy(std::integral_constant<int, 8>{});
    } else if (fit % 4 == 0) {
      copy(std::integral_constant<int, 4>{});
    } else {
      copy(std::integral_constant<int, 2>{});
    }
    CommitCopies();
    CopyWait<0>();
    __syncwarp();
  }
  const int pw = lane / g.lanes, strip = lane - pw * g.lanes;
  if (pw >= np) return;
  const T* sp = reinterpret_cast<const T*>(mine + pw * g.slot);
  T* dp = dst + (p0 + pw) * static_cast<int64_t>(g.out_h * g.out_w);
  const int j0 = strip * B, c0 = j0 + g.off_w;
  // Which source columns exist (pairs: both or neither, as in_w and c0 are
  // even).
  bool cok[NC];
#pragma unroll
  for (int u = 0; u < NC; ++u) cok[u] = c0 + u >= 0 && c0 + u < g.in_w;
  // The window sums along W of source row r (zeros outside the source).
  // kInside: the row is known to be inside the source.
  const auto row_sums = [&](int r, Acc(&h)[B], auto inside) {
    if (!decltype(inside)::value && (r < 0 || r >= g.in_h)) {
      // The same for every lane.
#pragma unroll
      for (int b = 0; b < B; ++b) h[b] = Acc(0);
      return;
    }
    const T* at = sp + r * g.in_w + c0;
    Acc v[NC];
    if constexpr (kPairs) {
#pragma unroll
      for (int q = 0; q < NC / 2; ++q) {
        if constexpr (std::is_same_v<T, __nv_bfloat16>) {
          // Both halves widen by bit moves, from the raw word.
          const unsigned bits =
              cok[2 * q] ? *reinterpret_cast<const unsigned*>(at + 2 * q) : 0u;
          v[2 * q] = __uint_as_float(bits << 16);
          v[2 * q + 1] = __uint_as_float(bits & 0xffff0000u);
        } else {
          const Vec<T, 2> two = LoadOrZero<T, 2>(at + 2 * q, cok[2 * q]);
          v[2 * q] = N::Load(two.v[0]);
          v[2 * q + 1] = N::Load(two.v[1]);
        }
      }
    } else {
#pragma unroll
      for (int u = 0; u < NC; ++u) {
        v[u] = N::Load(LoadOrZero<T, 1>(at + u, cok[u]).v[0]);
      }
    }
    if constexpr (kScaled) {
      SlidingSums<K, B>([&](int u) { return v[u]; }, h, ByFactor{value});
    } else {
      SlidingSums<K, B>([&](int u) { return v[u]; }, h);
    }
  };
  const bool whole = j0 + B <= g.out_w;
  T* const stage = reinterpret_cast<T*>(mine + g.stage);
  const auto put = [&](int i, Acc(&o)[B]) {
    if constexpr (!kScaled) {
#pragma unroll
      for (int b = 0; b < B; ++b) o[b] *= value;
    }
    T* at = dp + i * g.out_w + j0;
    if constexpr (kAdd) {
      Vec<T, B> all;
#pragma unroll
      for (int b = 0; b < B; ++b) all.v[b] = N::Store(o[b]);
      *reinterpret_cast<Vec<T, B>*>(stage + pw * out_plane + i * g.out_w + j0) =
          all;
    } else if (kWhole || (whole && g.store == 2)) {
      Vec<T, B> all;
#pragma unroll
      for (int b = 0; b < B; ++b) all.v[b] = N::Store(o[b]);
      *reinterpret_cast<Vec<T, B>*>(at) = all;
    } else if (whole && g.store == 1) {
#pragma unroll
      for (int b = 0; b < B; b += 2) {
        Vec<T, 2> two;
        two.v[0] = N::Store(o[b]);
        two.v[1] = N::Store(o[b + 1]);
        *reinterpret_cast<Vec<T, 2>*>(at + b) = two;
      }
    } else {
#pragma unroll
      for (int b = 0; b < B; ++b) {
        if (j0 + b < g.out_w) at[b] = N::Store(o[b]);
      }
    }
  };
  using Inside = std::true_type;
  using Checked = std::false_type;
  // Down H, per strip column: a step adds G new rows under the K - 1 rows
  // before them. Destination row i0 + t sums the earlier rows from t on and
  // the new rows up to t, so a step carries the first sums (`from`) and, for
  // the next step's, those of the earlier rows past G (`tail`), both built
  // from suffix sums of the new rows: 3G - 3 + M additions a column (11 for
  // 7x7), where sliding sums over rows kept in registers took K + 3G - 6
  // and moved the K - 1 rows kept between steps.
  constexpr int M = K - 1 - G;
  static_assert(M >= 0 && G >= M, "StripsNchw: G <= K - 1 <= 2G");
  Acc from[G][B];              // from[t]: earlier rows t .. K - 2
  Acc tail[M > 0 ? M : 1][B];  // tail[t]: earlier rows G + t .. K - 2
  {
    Acc first[K - 1][B];
#pragma unroll
    for (int u = 0; u < K - 1; ++u) {
      row_sums(g.off_h + u, first[u], Checked{});
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      Acc q = first[K - 2][b];
#pragma unroll
      for (int j = K - 2; j >= 0; --j) {
        if (j < K - 2) q = first[j][b] + q;
        if (j < G) {
          from[j][b] = q;
        } else {
          tail[j - G][b] = q;
        }
      }
    }
  }
  for (int i0 = 0; i0 < g.out_h; i0 += G) {
    // The step's G new source rows, without the checks where all of them
    // are inside the source.
    const int r0 = g.off_h + i0 + K - 1;
    Acc h[G][B];
    if (r0 >= 0 && r0 + G <= g.in_h) {
#pragma unroll
      for (int u = 0; u < G; ++u) row_sums(r0 + u, h[u], Inside{});
    } else {
#pragma unroll
      for (int u = 0; u < G; ++u) row_sums(r0 + u, h[u], Checked{});
    }
    Acc o[G][B];
#pragma unroll
    for (int b = 0; b < B; ++b) {
      Acc upto = h[0][b];  // new rows 0 .. t
      o[0][b] = from[0][b] + upto;
#pragma unroll
      for (int t = 1; t < G; ++t) {
        upto += h[t][b];
        o[t][b] = from[t][b] + upto;
      }
      Acc on[G];  // on[j]: new rows j .. G - 1
      on[G - 1] = h[G - 1][b];
#pragma unroll
      for (int j = G - 2; j > 0; --j) on[j] = h[j][b] + on[j + 1];
      on[0] = upto;
      // The next step's earlier rows: this step's from G on, then the new.
#pragma unroll
      for (int t = 0; t < G; ++t) {
        from[t][b] = t < M ? tail[t][b] + on[0] : on[t - M];
      }
#pragma unroll
      for (int t = 0; t < M; ++t) tail[t][b] = on[G - M + t];
    }
    if (i0 + G <= g.out_h) {
#pragma unroll
      for (int t = 0; t < G; ++t) put(i0 + t, o[t]);
    } else {
#pragma unroll
      for (int t = 0; t < G; ++t) {
        if (i0 + t < g.out_h) put(i0 + t, o[t]);
      }
    }
  }
  if constexpr (kAdd) {
    // The lanes that hold strips (np * lanes, from lane 0) have staged the
    // warp's destination planes, one range of global memory.
    const int active = np * g.lanes;
    const unsigned mask = active == 32 ? 0xffffffffu : (1u << active) - 1u;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // The stores above, made visible to the bulk copy's reads.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp(mask);
    if (lane == 0) {
      const unsigned from =
          static_cast<unsigned>(__cvta_generic_to_shared(stage));
      const size_t to = __cvta_generic_to_global(out_range);
      if constexpr (std::is_same_v<T, float>) {
        asm volatile(
            "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 "
            "[%0], [%1], %2;" ::"l"(to),
            "r"(from), "r"(out_bytes)
            : "memory");
      } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        asm volatile(
            "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz."
            "bf16 [%0], [%1], %2;" ::"l"(to),
            "r"(from), "r"(out_bytes)
            : "memory");
      } else {
        static_assert(std::is_same_v<T, __half>);
        asm volatile(
            "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz."
            "f16 [%0], [%1], %2;" ::"l"(to),
            "r"(from), "r"(out_bytes)
            : "memory");
      }
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      // Shared memory stays the block's until the copy has read it.
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
#else
    // Not launched below sm_90 (LaunchStripsScatter); element atomics.
    __syncwarp(mask);
    T* const out = reinterpret_cast<T*>(out_range);
    for (int k = lane; k < np * out_plane; k += active) {
      atomicAdd(out + k, stage[k]);
    }
#endif
  }
}

// Whether a StripsNchw call loads its source columns in aligned pairs: rows
// and column offsets of even length (slots start 16-byte aligned).
inline bool StripPairs(const StripGeom& g) {
  return g.in_w % 2 == 0 && g.off_w % 2 == 0;
}

// The geometry of a StripsNchw call, and whether it takes it (see above):
// NCHW, windows that share one divisor, the left and top padding at most
// K / 2 and the others below K, planes of at most kStripMaxRows rows and 32
// strips whose slot fits a warp's share of shared memory; 16-bit forwards
// whose destination rows take whole-strip stores; 16-bit and float32
// gathers whose source columns pair up.
template <typename T, typename S, bool kGather>
bool StripsTake(const PoolAttrs& a, const PoolShape& s, const void* src,
                const void* dst, bool shared, StripGeom& g) {
  constexpr int K = S::KH;
  constexpr int64_t sz = sizeof(T);
  if (!shared || (sz == 4 && !kGather) || a.layout != kNCHW ||
      a.pad_top > K / 2 || a.pad_left > K / 2 || a.pad_bottom >= K ||
      a.pad_right >= K || s.out_h < 1 || s.out_w < 1 ||
      s.in_h > kStripMaxRows || s.in_w > 32 * kStripCols + K ||
      reinterpret_cast<uintptr_t>(src) % sz != 0 ||
      reinterpret_cast<uintptr_t>(dst) % sz != 0) {
    return false;
  }
  const int64_t in_h = kGather ? s.out_h : s.in_h;
  const int64_t in_w = kGather ? s.out_w : s.in_w;
  const int64_t out_h = kGather ? s.in_h : s.out_h;
  const int64_t out_w = kGather ? s.in_w : s.out_w;
  const int64_t off_w = kGather ? a.pad_left - K + 1 : -a.pad_left;
  const int64_t lanes = (out_w + kStripCols - 1) / kStripCols;
  // Slots hold planes of whole pairs of 16-bit elements, 4-byte aligned.
  const int64_t slot = (in_h * in_w * sz + 3) / 4 * 4;
  const int64_t per_warp =
      std::min<int64_t>(32 / lanes, (kStripWarpBytes - 12) / slot);
  if (lanes > 32 || per_warp < 1) return false;
  g.in_h = static_cast<int>(in_h);
  g.in_w = static_cast<int>(in_w);
  g.out_h = static_cast<int>(out_h);
  g.out_w = static_cast<int>(out_w);
  g.off_h = static_cast<int>(kGather ? a.pad_top - K + 1 : -a.pad_top);
  g.off_w = static_cast<int>(off_w);
  g.lanes = static_cast<int>(lanes);
  g.per_warp = static_cast<int>(per_warp);
  g.slot = static_cast<int>(slot);
  g.warp_bytes = static_cast<int>((per_warp * slot + 15) / 16 * 16);
  g.in_q = PieceOf(in_h * in_w * sz, src, sz);
  const auto aligned = [&](int64_t n) {
    return reinterpret_cast<uintptr_t>(dst) % (n * sz) == 0;
  };
  g.store = out_w % kStripCols == 0 && aligned(kStripCols) ? 2
            : out_w % 2 == 0 && aligned(2)                 ? 1
                                                           : 0;
  g.stage = 0;
  if (kGather) return StripPairs(g);
  return g.store == 2;
}

// The grid of StripsNchw and HalfStripsNchw, whose warps each take
// `per_warp` consecutive planes and warp_bytes of shared memory: false where
// it would take more blocks than a grid holds (the caller then leaves the
// call to the other kernels).
struct StripGrid {
  int64_t blocks;  // 0 where there are no planes
  int bytes;       // shared memory per block
};
inline bool StripGridOf(int64_t planes, int per_warp, int warp_bytes,
                        StripGrid& grid) {
  constexpr int64_t kWarps = kStripThreads / 32;
  const int64_t warps = (planes + per_warp - 1) / per_warp;
  grid.blocks = (warps + kWarps - 1) / kWarps;
  grid.bytes = static_cast<int>(kWarps * warp_bytes);
  return grid.blocks <= INT32_MAX;
}

// Launches StripsNchw where StripsTake takes the call; false elsewhere.
template <typename T, typename S, bool kGather>
bool LaunchStrips(cudaStream_t stream, const PoolAttrs& a, const PoolShape& s,
                  const T* src, T* dst, cudaError_t& err) {
  using Acc = typename Num<T>::Acc;
  if constexpr (sizeof(T) == 8) {
    return false;
  } else {
    const SharedFactor<Acc> shared = SharedFactorOf<Acc>(a, s);
    StripGeom g;
    if (!StripsTake<T, S, kGather>(a, s, src, dst, shared.all, g)) {
      return false;
    }
    const int64_t planes = s.batch * s.channels;
    StripGrid grid;
    if (!StripGridOf(planes, g.per_warp, g.warp_bytes, grid)) return false;
    err = cudaSuccess;
    if (grid.blocks == 0) return true;
    const auto launch = [&](auto pairs, auto whole) {
      StripsNchw<T, S, decltype(pairs)::value, decltype(whole)::value, false>
          <<<static_cast<unsigned>(grid.blocks), kStripThreads, grid.bytes,
             stream>>>(src, dst, g, shared.value, planes);
    };
    using True = std::true_type;
    using False = std::false_type;
    // The 16-bit gather of 28x28 planes from 22x22 under 7x7 windows
    // without padding: its geometry fixed at compile time.
    if constexpr (sizeof(T) == 2 && S::KH == 7 && S::KW == 7) {
      using Fixed = FixedStrips<22, 22, 28, 28, -6, -6, 7, 4, 2>;
      if (kGather && Fixed::template Is<sizeof(T)>(g)) {
        StripsNchw<T, S, true, true, false, Fixed>
            <<<static_cast<unsigned>(grid.blocks), kStripThreads, grid.bytes,
               stream>>>(src, dst, g, shared.value, planes);
        err = cudaGetLastError();
        return true;
      }
    }
    // kWhole: every strip is whole and stored as one vector.
    if (g.store == 2) {
      StripPairs(g) ? launch(True{}, True{}) : launch(False{}, True{});
    } else {
      StripPairs(g) ? launch(True{}, False{}) : launch(False{}, False{});
    }
    err = cudaGetLastError();
    return true;
  }
}

// The scatter of the calls whose gather StripsNchw takes with whole-strip
// stores, on sm_90 and later: dx is zeroed on the stream, then the gather's
// kernel adds its results to it (kAdd). A warp stages its destination
// planes in shared memory and adds them, one range of global memory, with
// one bulk reduction (cp.reduce.async.bulk, element-wise atomic adds done
// by L2), having asked L2 for the range when it started. Each dx element
// gets one atomic, onto zero, so dx is the gather's, bitwise; the terms
// are the per-element scatter's, summed in another order, as in the tiles
// of cuda_scatter.cu. On the H200 (CUDA events, 64x512 planes of 28x28,
// memset included, against those tiles): bfloat16 56.7 against 95.0 us,
// float32 102.5 against 113.4. Atomics from the lanes instead took the
// L1 pipeline the gather needs: 67.2 us for bfloat16 by 16-byte vector
// reductions from the stage, 121.6 for float32 by each lane's 16 bytes.
template <typename T, typename S>
bool LaunchStripsScatter(cudaStream_t stream, const PoolAttrs& a,
                         const PoolShape& s, const T* dy, T* dx,
                         cudaError_t& err) {
  using Acc = typename Num<T>::Acc;
  if constexpr (sizeof(T) == 8) {
    return false;
  } else {
    constexpr int64_t sz = sizeof(T);
    const SharedFactor<Acc> shared = SharedFactorOf<Acc>(a, s);
    StripGeom g;
    if (!StripsTake<T, S, true>(a, s, dy, dx, shared.all, g) || g.store != 2) {
      return false;
    }
    // The bulk reduction takes 16-byte aligned ranges of whole planes.
    const int64_t out_plane = int64_t{g.out_h} * g.out_w * sz;
    if (PieceOf(out_plane, dx, sz) != 16) return false;
    const auto kernel = StripsNchw<T, S, true, true, true>;
    if (CodeOf(kernel).binary < 90) return false;
    // The warp's planes, then (past the reads' 12 bytes of slack) their
    // destination planes.
    const int64_t per_warp = std::min<int64_t>(
        32 / g.lanes, (kStripWarpBytes - 28) / (g.slot + out_plane));
    if (per_warp < 1) return false;
    g.per_warp = static_cast<int>(per_warp);
    g.stage = static_cast<int>((per_warp * g.slot + 12 + 15) / 16 * 16);
    g.warp_bytes = static_cast<int>(g.stage + per_warp * out_plane);
    const int64_t planes = s.batch * s.channels;
    StripGrid grid;
    if (!StripGridOf(planes, g.per_warp, g.warp_bytes, grid)) return false;
    err = ZeroInputShape(dx, s, stream);
    if (err != cudaSuccess || grid.blocks == 0) return true;
    kernel<<<static_cast<unsigned>(grid.blocks), kStripThreads, grid.bytes,
             stream>>>(dy, dx, g, shared.value, planes);
    err = cudaGetLastError();
    return true;
  }
}

// ---------------------------------------------------------------------------
// NCHW gather of windows of stride 2 (3x3/2, 2x2/2) on small planes, in
// strips of registers as StripsNchw: a warp copies `per_warp` consecutive dy
// planes, one contiguous range, into its own part of shared memory, and
// walks down them, a lane per strip of 16 (or 8) bytes of dx columns of one
// plane and per parity of dx rows. With stride 2 and windows of at most 3, dx
// row h lies in the windows of dy row floor((h + pad_top) / 2) and, for K = 3
// and h + pad_top even, of the row above it; likewise for the columns. So
// per step a lane loads the dy columns under its strip in one dy row (C / 2
// + 1 or C / 2 of them, for the strip's C columns), multiplies them by the
// divisor that every window shares, adds the previous step's row where its
// dx row needs both, sums along W, and stores its strip of one dx row. The
// lanes of the two parities store two adjacent rows, and one store
// instruction writes both: 16-bit rows of 56 (the 3x3/2 gather on 56x56
// planes) are 112 bytes, and a lane per strip and row would leave every
// other 32-byte sector in two halves, written by two instructions. Rows
// that no window covers come out zero. A few instructions per dx element,
// against the row kernels' division per work item, 64-bit addressing per dy
// row and loads of single elements from the odd-length 16-bit dy rows of
// the usual shapes. The sums are the row kernels', in the same order, and
// the divisor theirs, so the results are bitwise theirs.
//
// Where it is taken (HalfStripsTake, LaunchBackwardGather), on the H200
// (CUDA events, us, 128x256 planes of 56x56 unless said), against the row
// kernels: bfloat16 71.3 against 79.3, with padding 1 72.2 against 78.6
// (float16 as bfloat16); 50x100 planes of 48x40 9.8 against 13.4. Left to
// the row kernels where they take the call: float32 (140.5 against 132.6;
// 2x2/2 139.9 against 130.3). Where they do not (rows not a multiple of
// their chunks), it replaces the one-thread-per-element kernel: float32
// 2x2/2 on 30x28 planes 5.1 against 9.7. Tried, not kept: a lane per strip
// storing all the rows of its strip, each dy row loaded once (91.0: the
// half sectors, and 1.7 waves of longer warps). 16-bit rows that 16-byte
// strips do not divide but 8-byte ones do (widths a multiple of 4, not of
// 8) take strips of 8 bytes (CB); they went to the one-thread-per-element
// kernel, at a tenth of the copy bandwidth. Bfloat16 (us, against it):
// 64x512 planes of 28x28, 3x3/2 with padding 1, 22.0 against 169.8, 2x2/2
// 23.4 against 98.7; 32x64 of 60x60 2x2/2 8.5 against 30.6; 16x128 of
// 36x36 3x3/2 with padding 1 5.1 against 20.0.

// The dy columns under a strip of C dx columns whose first column w0 is
// even, with pad_left PL: w0 / 2 + kFirst .. w0 / 2 + kFirst + kCount - 1;
// dx column w0 + c lies in the windows of columns w0 / 2 + First(c) .. w0 /
// 2 + Last(c).
template <int K, int PL, int C>
struct HalfCols {
  static constexpr int First(int c) { return CeilDiv(c + PL - K + 1, 2); }
  static constexpr int Last(int c) { return FloorDiv(c + PL, 2); }
  static constexpr int kFirst = First(0);
  static constexpr int kCount = Last(C - 1) - kFirst + 1;
};

struct HalfGeom {
  int in_h, in_w;    // a dy plane
  int out_h, out_w;  // a dx plane
  int pad_top;
  int lanes;        // strips per dx row
  int per_warp;     // planes per warp
  int warp_bytes;   // shared memory per warp, a multiple of 16
  int strip_bytes;  // of a lane's dx columns: 16, or 8 for 16-bit types
};

template <typename T, int K, int PL, int CB>
__global__ void __launch_bounds__(kStripThreads, kStripBlocks)
    HalfStripsNchw(const T* __restrict__ dy, T* __restrict__ dx,
                   const HalfGeom g, const typename Num<T>::Acc value,
                   const int64_t planes) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  constexpr int C = CB / static_cast<int>(sizeof(T));
  using Cols = HalfCols<K, PL, C>;
  constexpr int NC = Cols::kCount;
  const int lane = static_cast<int>(threadIdx.x & 31);
  int64_t p0;
  int np;
  unsigned char* mine;
  if (!WarpPlanesOf(g, planes, p0, np, mine)) return;
  const int in_bytes = g.in_h * g.in_w * static_cast<int>(sizeof(T));
  // The range in 16-byte pieces from the aligned address at or below its
  // start (dy is 16-byte aligned), and the elements after the last whole
  // piece one by one. The 16 bytes before it in shared memory are read by
  // the first strips of the first plane and ignored, as are those after it.
  const unsigned char* from = reinterpret_cast<const unsigned char*>(dy) +
                              p0 * static_cast<int64_t>(in_bytes);
  const int lead = static_cast<int>(reinterpret_cast<uintptr_t>(from) & 15);
  const int span = lead + np * in_bytes, whole = span & ~15;
  for (int i = lane * 16; i < whole; i += 32 * 16) {
    StartCopy<16, false>(mine + 16 + i, from - lead + i, true);
  }
  CommitCopies();
  const int tail = whole + lane * static_cast<int>(sizeof(T));
  if (tail < span) {
    *reinterpret_cast<T*>(mine + 16 + tail) =
        *reinterpret_cast<const T*>(from - lead + tail);
  }
  CopyWait<0>();
  __syncwarp();
  // Lane (plane pw, parity e, strip).
  const int pw = lane / (2 * g.lanes), within = lane - pw * 2 * g.lanes;
  if (pw >= np) return;
  const int e = within >= g.lanes ? 1 : 0;
  const int strip = within - e * g.lanes;
  const int n0 = strip * (C / 2) + Cols::kFirst;  // first dy column
  const T* col =
      reinterpret_cast<const T*>(mine + 16 + lead) + pw * g.in_h * g.in_w + n0;
  bool cok[NC];  // which of the strip's dy columns exist
#pragma unroll
  for (int u = 0; u < NC; ++u) cok[u] = n0 + u >= 0 && n0 + u < g.in_w;
  T* const plane = dx + (p0 + pw) * static_cast<int64_t>(g.out_h) * g.out_w;
  // Dx rows 2j - b + e at step j: pairs that start on a 32-byte boundary
  // where rows are 16 bytes off one (b = 1 where row 0 is).
  const int b =
      g.out_w * static_cast<int>(sizeof(T)) % 32 == 16
          ? static_cast<int>((reinterpret_cast<uintptr_t>(plane) >> 4) & 1)
          : 0;
  const int t = e - b + g.pad_top;          // in [-1, 2]
  const int d = (t + 2) / 2 - 1;            // the step's dy row is j + d
  const bool two = K == 3 && (t & 1) == 0;  // and the one above it
  // dy row m under the strip divided by the shared divisor; zeros for the
  // rows outside dy.
  const auto load = [&](int m, Acc(&v)[NC]) {
    if (m < 0 || m >= g.in_h) {
#pragma unroll
      for (int u = 0; u < NC; ++u) v[u] = Acc(0);
      return;
    }
    const T* at = col + m * g.in_w;
#pragma unroll
    for (int u = 0; u < NC; ++u) {
      const Acc x = N::Load(at[u]) * value;
      v[u] = cok[u] ? x : Acc(0);
    }
  };
  Acc prev[NC];
  load(d - 1, prev);
  T* out = plane + static_cast<int64_t>(e - b) * g.out_w + strip * C;
  const int64_t step = 2 * static_cast<int64_t>(g.out_w);
  const int steps = (g.out_h + b + 1) / 2;
  // Four steps unrolled (bfloat16: 71.3 us, against 72.3 for two and 74.2
  // for none).
#pragma unroll 4
  for (int j = 0; j < steps; ++j, out += step) {
    Acc cur[NC];
    load(j + d, cur);
    const int h = 2 * j - b + e;
    if (h >= 0 && h < g.out_h) {
      Acc v[NC];
#pragma unroll
      for (int u = 0; u < NC; ++u) v[u] = two ? prev[u] + cur[u] : cur[u];
      // For each column, the sum of the dy columns whose windows hold it.
      Vec<T, C> o;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        Acc sum = v[Cols::First(c) - Cols::kFirst];
#pragma unroll
        for (int n = Cols::First(c) + 1; n <= Cols::Last(c); ++n) {
          sum += v[n - Cols::kFirst];
        }
        o.v[c] = N::Store(sum);
      }
      *reinterpret_cast<Vec<T, C>*>(out) = o;
    }
#pragma unroll
    for (int u = 0; u < NC; ++u) prev[u] = cur[u];
  }
}

// The specialisations that take it: square windows of 2 or 3, stride 2.
template <typename S>
constexpr bool HalfSpec() {
  if constexpr (S::kGeneric) {
    return false;
  } else {
    return S::SH == 2 && S::SW == 2 && S::KH == S::KW &&
           (S::KH == 2 || S::KH == 3);
  }
}

// The geometry of a HalfStripsNchw call, and whether it takes it: NCHW,
// windows that share one divisor, the top and left padding at most K / 2
// (as every PyTorch padding), dx rows of whole 16-byte strips (16-bit
// types: else of whole 8-byte ones), at most 16 of them (two lanes each), a
// dy plane that fits a warp's share of shared memory, both buffers 16-byte
// aligned; not float64.
template <typename T, typename S>
bool HalfStripsTake(const PoolAttrs& a, const PoolShape& s, const void* dy,
                    const void* dx, bool shared, HalfGeom& g) {
  constexpr int64_t sz = sizeof(T), C = 16 / sz, K = S::KH;
  const auto aligned = [](const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0;
  };
  const auto fits = [&](int64_t c) {
    return s.in_w % c == 0 && s.in_w / c <= 16;
  };
  const int64_t strip = fits(C) ? 16 : sz == 2 && fits(C / 2) ? 8 : 0;
  if (!shared || sz > 4 || a.layout != kNCHW || a.pad_top > K / 2 ||
      a.pad_left > K / 2 || s.out_h < 1 || s.out_w < 1 || strip == 0 ||
      !aligned(dy) || !aligned(dx)) {
    return false;
  }
  const int64_t in_bytes = s.out_h * s.out_w * sz;
  const int64_t lanes = s.in_w / (strip / sz);
  // Room for the 16 bytes before the range, its lead (up to 15 bytes) and
  // the element read after it, in whole 16 bytes.
  const int64_t per_warp =
      std::min<int64_t>(16 / lanes, (kStripWarpBytes - 64) / in_bytes);
  if (per_warp < 1 || s.in_h > INT32_MAX / 2) return false;
  g.in_h = static_cast<int>(s.out_h);
  g.in_w = static_cast<int>(s.out_w);
  g.out_h = static_cast<int>(s.in_h);
  g.out_w = static_cast<int>(s.in_w);
  g.pad_top = static_cast<int>(a.pad_top);
  g.lanes = static_cast<int>(lanes);
  g.per_warp = static_cast<int>(per_warp);
  g.warp_bytes = static_cast<int>((per_warp * in_bytes + 63) / 16 * 16);
  g.strip_bytes = static_cast<int>(strip);
  return true;
}

// Launches HalfStripsNchw where HalfStripsTake takes the call; false
// elsewhere.
template <typename T, typename S>
bool LaunchHalfStrips(cudaStream_t stream, const PoolAttrs& a,
                      const PoolShape& s, const T* dy, T* dx,
                      cudaError_t& err) {
  using Acc = typename Num<T>::Acc;
  const SharedFactor<Acc> shared = SharedFactorOf<Acc>(a, s);
  HalfGeom g;
  if (!HalfStripsTake<T, S>(a, s, dy, dx, shared.all, g)) return false;
  const int64_t planes = s.batch * s.channels;
  StripGrid grid;
  if (!StripGridOf(planes, g.per_warp, g.warp_bytes, grid)) return false;
  err = cudaSuccess;
  if (grid.blocks == 0) return true;
  err = WithPadLeft<S::KW / 2>(a.pad_left, [&](auto pl) {
    constexpr int PL = decltype(pl)::value;
    auto kernel = HalfStripsNchw<T, S::KH, PL, 16>;
    if constexpr (sizeof(T) == 2) {
      if (g.strip_bytes == 8) kernel = HalfStripsNchw<T, S::KH, PL, 8>;
    }
    kernel<<<static_cast<unsigned>(grid.blocks), kStripThreads, grid.bytes,
             stream>>>(dy, dx, g, shared.value, planes);
    return cudaGetLastError();
  });
  return true;
}

template <typename S>
int64_t RuntimeKh(const PoolAttrs& a) {
  return S::kGeneric ? a.kernel_h : S::KH;
}
template <typename S>
int64_t RuntimeSh(const PoolAttrs& a) {
  return S::kGeneric ? a.stride_h : S::SH;
}

}  // namespace

cudaError_t LaunchForward(cudaStream_t stream, DType dtype, const PoolAttrs& a,
                          const PoolShape& s, const void* x, void* y,
                          int schedule) {
  if (cudaError_t err = cudaSuccess;
      LaunchGlobalPool(stream, dtype, a, s, x, y, false, err)) {
    return err;
  }
  return WithType(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x);
    T* out = static_cast<T*>(y);
    return WithSpec(a, [&](auto spec) {
      using S = decltype(spec);
      const int64_t rows = s.batch * s.out_h,
                    groups = Groups(s.out_w, S::BLOCK);
      if constexpr (PlaneSpec<S>()) {
        cudaError_t err = cudaSuccess;
        if constexpr (sizeof(T) == 2) {
          // The tensor-core plane kernel, where it applies.
          if (LaunchMmaPlanesNchw<T>(stream, a, s, in, out, schedule, err)) {
            return err;
          }
        }
        if (LaunchStrips<T, S, false>(stream, a, s, in, out, err)) return err;
        if (LaunchPlanes<T, S, false>(stream, a, s, in, out, err)) return err;
      }
      if constexpr (SmallPlaneSpec<S>()) {
        cudaError_t err = cudaSuccess;
        if (LaunchPlanes<T, S, false>(stream, a, s, in, out, err)) return err;
      }
      if constexpr (sizeof(T) == 2 && !S::kGeneric) {
        if constexpr (S::KH == 3 && S::KW == 3 && S::SH == 2 && S::SW == 2) {
          // Whole planes in shared memory, for odd-length output rows: the
          // row kernel would store them one by one, or not take them.
          cudaError_t err = cudaSuccess;
          if (LaunchPlanesS2Nchw<T>(stream, a, s, in, out, err)) return err;
        }
      }
      if (RowKernelsFit<T, S>(a, s, x, y)) {
        if constexpr (!S::kGeneric) {
          const int64_t chunks = RowChunks<S>(s);
          return WithPadLeft<S::KW / 2>(a.pad_left, [&](auto pl) {
            return WithPiece<T, S>(y, s.out_w, [&](auto piece) {
              constexpr int P = decltype(piece)::value;
              constexpr int R = kRowsPerItem<T, S, P>;
              const int64_t row_blocks = Groups(s.out_h, R);
              const int64_t items = s.batch * s.channels * row_blocks * chunks;
              const RowDivs divs{
                  FastDiv::Of(static_cast<uint32_t>(chunks)),
                  FastDiv::Of(static_cast<uint32_t>(row_blocks))};
              return LaunchRows(
                  ForwardNchwRows<T, S, decltype(pl)::value, R, P>, stream,
                  items, a, s, in, out, chunks, divs,
                  SharedFactorOf<typename Num<T>::Acc>(a, s));
            });
          });
        }
      }
      if (a.layout == kNCHW) {
        return Launch(ForwardNchw<T, S>, stream, rows * s.channels * groups, a,
                      s, in, out);
      }
      if constexpr (NhwcSlides<S>(Op::kForward)) {
        return LaunchSlideNhwc<T, false, S>(stream, a, s, in, out);
      } else if constexpr (!S::kGeneric) {
        const auto launch = [&](auto v) {
          constexpr int V = decltype(v)::value;
          constexpr int R = kNhwcRows<T, S>;
          return Launch(
              ForwardNhwcRows<T, S, V, R>, stream,
              s.batch * Groups(s.out_h, R) * groups * (s.channels / V), a, s,
              in, out);
        };
        if (CanVectorise<T, kNhwcForwardWide<T, S>>(s, x, y)) {
          return launch(std::integral_constant<int, kNhwcForwardWide<T, S>>{});
        }
        return launch(std::integral_constant<int, 1>{});
      } else {
        if (CanVectorise<T>(s, x, y)) {
          return Launch(ForwardNhwc<T, S, kWide<T>>, stream,
                        rows * groups * (s.channels / kWide<T>), a, s, in, out);
        }
        return Launch(ForwardNhwc<T, S, 1>, stream, rows * groups * s.channels,
                      a, s, in, out);
      }
    });
  });
}

// NCHW gather of 16-bit windows that tile the input exactly (KH = SH,
// KW = SW, no padding, H = OH * KH, W = OW * KW): dx is dy upsampled, times
// the one factor that every window shares. An item is a run of U adjacent
// dy elements of one row, loaded once (U * 2 bytes), and the KH runs of
// V = U * KW adjacent dx elements under them, stored as 16-byte vectors: a
// flat walk over whole rows, with none of the row kernels' shuffles.
// On the H200 (128x256x56x56 bfloat16 2x2/2) the row kernels took 78 us
// (81% of the copy bandwidth), their float32 twins 91%: the 16-bit items
// issue as many instructions for half the bytes.
template <typename T, typename S>
__global__ void __launch_bounds__(kThreads)
    GatherNchwUpsample(const PoolAttrs a, const PoolShape s,
                       const T* __restrict__ dy, T* __restrict__ dx,
                       const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  constexpr int KH = S::KH, KW = S::KW, V = 16 / static_cast<int>(sizeof(T));
  constexpr int U = V / KW;
  static_assert(sizeof(T) == 2 && V % KW == 0);
  const int64_t OW = s.out_w, W = s.in_w;
  const int64_t runs = OW / U;   // per dy row
  const int64_t runs_w = W / V;  // dx vectors per row: as many
  const Acc r =
      Reciprocal(
          WindowFactor<Acc>(a, WindowAt(0, s.in_h, KH, KH, 0, 0), true)) *
      Reciprocal(WindowFactor<Acc>(a, WindowAt(0, W, KW, KW, 0, 0), false));
  const bool narrow = total <= INT32_MAX;
  for (int64_t i = FirstThread(); i < total; i += ThreadCount()) {
    // dy row (plane * OH + oh) and run; its dx rows start at row * KH.
    const int64_t row =
        narrow ? static_cast<uint32_t>(i) / static_cast<uint32_t>(runs)
               : i / runs;
    const int64_t run = i - row * runs;
    const Vec<T, U> g =
        *reinterpret_cast<const Vec<T, U>*>(dy + row * OW + run * U);
    Vec<T, V> out;
#pragma unroll
    for (int e = 0; e < V; ++e) out.v[e] = N::Store(N::Load(g.v[e / KW]) * r);
    // Addressed in whole vectors: through element pointers the compiler
    // split the stores after the first into 2-byte ones (362 against 78 us
    // on the H200).
    Vec<T, V>* const p = reinterpret_cast<Vec<T, V>*>(dx) + row * KH * runs_w;
#pragma unroll
    for (int t = 0; t < KH; ++t) p[t * runs_w + run] = out;
  }
}

// The specialisations GatherNchwUpsample is compiled for: 16-bit windows
// with KH = SH and KW = SW (2x2/2).
template <typename T, typename S>
constexpr bool UpsampleSpec() {
  if constexpr (S::kGeneric) {
    return false;
  } else {
    return sizeof(T) == 2 && S::KH == S::SH && S::KW == S::SW &&
           (16 / sizeof(T)) % S::KW == 0;
  }
}

// Whether GatherNchwUpsample takes a gather of such a spec: NCHW, windows
// that tile the input exactly, rows of whole 16-byte dx vectors, dy and dx
// aligned for the vectors.
template <typename T, typename S>
bool UpsampleFits(const PoolAttrs& a, const PoolShape& s, const void* dy,
                  const void* dx) {
  constexpr int64_t V = 16 / sizeof(T);
  const auto aligned = [](const void* p, size_t n) {
    return reinterpret_cast<uintptr_t>(p) % n == 0;
  };
  return a.layout == kNCHW && a.pad_top == 0 && a.pad_bottom == 0 &&
         a.pad_left == 0 && a.pad_right == 0 && s.in_h == s.out_h * S::KH &&
         s.in_w == s.out_w * S::KW && s.in_w % V == 0 &&
         aligned(dy, sizeof(T) * V / S::KW) && aligned(dx, 16);
}

// GatherNchwRows over the whole call (RowKernelsFit); with kAdd, the
// scatter: dx is zeroed first and each result added to it.
template <typename T, typename S, bool kAdd = false>
cudaError_t LaunchGatherNchwRows(cudaStream_t stream, const PoolAttrs& a,
                                 const PoolShape& s, const T* dy, T* dx) {
  constexpr int R = kGatherRowsPerItem<T, S>;
  const int64_t chunks = RowChunks<S>(s);
  const int64_t items = s.batch * s.channels * Groups(s.in_h, R) * chunks;
  if constexpr (kAdd) {
    if (cudaError_t e = ZeroInputShape(dx, s, stream); e != cudaSuccess) {
      return e;
    }
  }
  return WithPadLeft<S::KW / 2>(a.pad_left, [&](auto pl) {
    return WithPhase<S::KH, S::SH>(a.pad_top, [&](auto e) {
      return LaunchRows(GatherNchwRows<T, S, decltype(pl)::value,
                                       decltype(e)::value, R, kAdd>,
                        stream, items, a, s, dy, dx, chunks,
                        SharedFactorOf<typename Num<T>::Acc>(a, s));
    });
  });
}

// GatherNhwcRows over the whole call, V channels a thread; with kAdd, the
// scatter: dx is zeroed first and each result added to it.
template <typename T, typename S, int V, bool kAdd = false>
cudaError_t LaunchGatherNhwcRows(cudaStream_t stream, const PoolAttrs& a,
                                 const PoolShape& s, const T* dy, T* dx) {
  constexpr int R = kNhwcGatherRows<S>;
  const int64_t items =
      s.batch * Groups(s.in_h, R) * Groups(s.in_w, S::BLOCK) * (s.channels / V);
  if constexpr (kAdd) {
    if (cudaError_t e = ZeroInputShape(dx, s, stream); e != cudaSuccess) {
      return e;
    }
  }
  return WithPhase<S::KW, S::SW>(a.pad_left, [&](auto ew) {
    return WithPhase<S::KH, S::SH>(a.pad_top, [&](auto eh) {
      return Launch(GatherNhwcRows<T, S, V, R, decltype(ew)::value,
                                   decltype(eh)::value, kAdd>,
                    stream, items, a, s, dy, dx,
                    SharedFactorOf<typename Num<T>::Acc>(a, s));
    });
  });
}

// The scatter where a gather kernel can add its results instead of storing
// them (see cuda_common.cuh), on sm_90: 7x7/1-like windows, NCHW planes that
// StripsNchw takes, NHWC calls that MmaBoxNhwc (16-bit) or BoxNhwc
// (float32) takes; 3x3/1 windows over NCHW planes that PlanesNchw takes
// (rows the row kernels cannot take: Inception's 35x35 and 17x17 maps). Each dx
// element gets one atomic, onto zero. On the H200 (CUDA events, memset
// included, 7x7/1 on 64x512 planes of 28x28) against the tiles of
// cuda_scatter.cu, us: NCHW bfloat16 56.7 against 95.0, float32 102.5 against
// 113.4; NHWC bfloat16 57.8 against 112.9, float32 104.0 against 134.2. 16-bit
// NHWC calls that take BoxNhwc keep the tiles: its 8-byte vectors would take as
// many atomics as theirs.
// The NHWC 2x2/2 and 3x3/2 calls whose channels fill 16-byte vectors take
// GatherNhwcRows, adding each vector with one atomic after asking L2 for
// the item's destination lines. On the H200 (CUDA events, memset included,
// us, this against the tiles; x the scatter's floor, 3 |dx| + |dy| bytes at
// the copy's bandwidth of the same run): 128x56x56x256 3x3/2 bfloat16 162.4
// (1.02x) against 200.0 (1.25x), float32 319.6 (1.02x) against 380.0
// (1.21x); 2x2/2 bfloat16 175.3 (1.09x) against 199.0 (1.24x), float32
// 343.3 (1.08x) against 385.5 (1.22x); 64x28x28x512 3x3/2 padding 1
// bfloat16 46.5 against 58.9, float32 91.2 against 90.4. Without the
// prefetches the atomics waited on L2's misses: 194.7, 385.6, 196.3 and
// 390.0 us on the first four.
// NCHW calls that the row kernels take (RowKernelsFit) go likewise to
// GatherNchwRows, a lane's results added in 16-byte pieces, or 8 bytes
// (AtomicAdd8) for 16-bit types with stride 1: 16-bit types, and float32
// with stride 1. Bfloat16 32x64x224x224 3x3/1: 236.7 (1.20x) against
// 854.3 (4.34x); 7x7/1 with padding 1 on 64x512x28x28: 66.1 against
// 103.9. Against the tiles on
// the H200 (same measure), float32 32x64x224x224 3x3/1 386.1 (1.00x)
// against 464.3 (1.20x), 7x7/1 with padding 1 on 64x512x28x28 105.1
// against 120.2; bfloat16 128x256x56x56 3x3/2 165.6 (1.04x) against 190.2
// (1.19x), 2x2/2 162.5 (1.02x) against 193.7 (1.21x). Float32 with stride
// 2 keeps the tiles (3x3/2: 316.0, against 330.0 this way).
bool LaunchAddingGather(cudaStream_t stream, DType dtype, const PoolAttrs& a,
                        const PoolShape& s, const void* dy, void* dx,
                        cudaError_t& error) {
  bool taken = false;
  error = WithType(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(dy);
    T* out = static_cast<T*>(dx);
    return WithSpec(a, [&](auto spec) {
      using S = decltype(spec);
      cudaError_t err = cudaSuccess;
      if constexpr (PlaneSpec<S>()) {
        if (a.layout == kNCHW) {
          taken = LaunchStripsScatter<T, S>(stream, a, s, in, out, err);
        }
      }
      if constexpr (SmallPlaneSpec<S>() && sizeof(T) <= 4) {
        if (a.layout == kNCHW && !RowKernelsFit<T, S>(a, s, in, out)) {
          taken = LaunchPlaneKernel<T, S, true, true>(stream, a, s, in, out,
                                                      false, err);
        }
      }
      if constexpr (NhwcBox<S>()) {
        if (a.layout == kNHWC) {
          if constexpr (sizeof(T) == 2) {
            taken = LaunchMmaBoxNhwc<T, true, true>(stream, a, s, in, out, err);
          } else if constexpr (sizeof(T) == 4) {
            if (CanVectorise<T>(s, in, out) &&
                CodeOf(BoxNhwc<T, S, kWide<T>, true, true>).binary >= 90) {
              taken = true;
              err = LaunchBoxNhwc<T, true, S, kWide<T>, true>(stream, a, s, in,
                                                              out);
            }
          }
        }
      }
      if constexpr (!S::kGeneric && (sizeof(T) == 2 || S::SH == 1) &&
                    sizeof(T) <= 4 &&
                    (S::BLOCK * S::SW * sizeof(T) % 16 == 0 ||
                     S::BLOCK * S::SW * sizeof(T) == 8)) {
        if (a.layout == kNCHW && !taken && RowKernelsFit<T, S>(a, s, in, out) &&
            CodeOf(GatherNchwRows<T, S, 0, 0, kGatherRowsPerItem<T, S>, true>)
                    .binary >= 90) {
          taken = true;
          err = LaunchGatherNchwRows<T, S, true>(stream, a, s, in, out);
        }
      }
      if constexpr (!S::kGeneric && !NhwcSlides<S>(Op::kBackwardGather) &&
                    sizeof(T) <= 4) {
        constexpr int V = kWide<T>;
        constexpr int R = kNhwcGatherRows<S>;
        if (a.layout == kNHWC && CanVectorise<T>(s, in, out) &&
            CodeOf(GatherNhwcRows<T, S, V, R, 0, 0, true>).binary >= 90) {
          taken = true;
          err = LaunchGatherNhwcRows<T, S, V, true>(stream, a, s, in, out);
        }
      }
      return err;
    });
  });
  return taken;
}

cudaError_t LaunchBackwardGather(cudaStream_t stream, DType dtype,
                                 const PoolAttrs& a, const PoolShape& s,
                                 const void* dy, void* dx) {
  if (cudaError_t err = cudaSuccess;
      LaunchGlobalPool(stream, dtype, a, s, dy, dx, true, err)) {
    return err;
  }
  return WithType(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(dy);
    T* out = static_cast<T*>(dx);
    return WithSpec(a, [&](auto spec) {
      using S = decltype(spec);
      const int64_t rows = s.batch * s.in_h, groups = Groups(s.in_w, S::BLOCK);
      if constexpr (UpsampleSpec<T, S>()) {
        if (UpsampleFits<T, S>(a, s, dy, dx)) {
          constexpr int U = 16 / sizeof(T) / S::KW;
          return Launch(GatherNchwUpsample<T, S>, stream,
                        s.batch * s.channels * s.out_h * (s.out_w / U), a, s,
                        in, out);
        }
      }
      if constexpr (PlaneSpec<S>()) {
        cudaError_t err = cudaSuccess;
        if (LaunchStrips<T, S, true>(stream, a, s, in, out, err)) return err;
        if constexpr (sizeof(T) == 2) {
          // Where StripsNchw does not take it (dy's columns at an odd
          // offset: 7x7/1 at paddings 1 and 3), the tensor-core plane
          // kernel, as the forward over dy that the gather is. H200, CUDA
          // events, us, against the kernels taken before: bfloat16 64x512
          // planes of 28x28 at padding 1 31.5 against 42.3, at padding 3
          // 35.5 against 43.1; float16 the same; 128x128 of 24x24 and 64x256
          // of 18x18 at padding 3 16.6 against 21.3 and 12.2 against 16.4.
          // Slower where StripsNchw takes the call: without padding 30.6
          // against 26.0, at padding 2 34.2 against 28.9.
          if (LaunchMmaPlanesNchwGather<T>(stream, a, s, in, out, err)) {
            return err;
          }
        }
        if (LaunchPlanes<T, S, true>(stream, a, s, in, out, err)) return err;
      }
      if constexpr (SmallPlaneSpec<S>()) {
        cudaError_t err = cudaSuccess;
        if (LaunchPlanes<T, S, true>(stream, a, s, in, out, err)) return err;
      }
      if constexpr (HalfSpec<S>() && sizeof(T) <= 4) {
        // float32 only where the row kernels do not take the call (see
        // HalfStripsNchw).
        cudaError_t err = cudaSuccess;
        if ((sizeof(T) == 2 || !RowKernelsFit<T, S>(a, s, dy, dx)) &&
            LaunchHalfStrips<T, S>(stream, a, s, in, out, err)) {
          return err;
        }
      }
      if (RowKernelsFit<T, S>(a, s, dy, dx)) {
        if constexpr (!S::kGeneric) {
          return LaunchGatherNchwRows<T, S>(stream, a, s, in, out);
        }
      }
      if (a.layout == kNCHW) {
        using Acc = typename Num<T>::Acc;
        const int64_t kh = RuntimeKh<S>(a), sh = RuntimeSh<S>(a);
        const auto capacity = [&](int64_t t) {
          return std::min<int64_t>((t + kh - 2) / sh + 1, s.out_h);
        };
        const auto bytes = [&](int64_t t) {
          return static_cast<size_t>(capacity(t) * (s.out_w + s.in_w) *
                                     sizeof(Acc));
        };
        // Each dy element is read by about (kh / sh) * (kw / sw) threads of
        // the direct kernel; past a few, staging it once pays.
        const int64_t kw = S::kGeneric ? a.kernel_w : S::KW;
        const int64_t sw = S::kGeneric ? a.stride_w : S::SW;
        const bool overlapping = kh * kw >= 4 * sh * sw;
        const int64_t tile = overlapping ? ChooseTile(s.in_h, bytes) : 0;
        if (tile > 0) {
          const int64_t planes = s.batch * s.channels;
          return LaunchTiled(GatherNchwTiled<T, S>, stream,
                             planes * Groups(s.in_h, tile), bytes(tile), a, s,
                             in, out, tile, capacity(tile));
        }
        if constexpr (S::kGeneric) {
          if (DisjointFits<T>(a, s)) {
            return LaunchGatherNchwDisjoint<T>(stream, a, s, in, out);
          }
        }
        return Launch(
            GatherNchw<T, S>, stream,
            rows * s.channels * Groups(s.in_w, kNchwGatherBlock<T, S>), a, s,
            in, out);
      }
      if constexpr (NhwcSlides<S>(Op::kBackwardGather)) {
        return LaunchSlideNhwc<T, true, S>(stream, a, s, in, out);
      } else if constexpr (!S::kGeneric) {
        if (CanVectorise<T>(s, dy, dx)) {
          return LaunchGatherNhwcRows<T, S, kWide<T>>(stream, a, s, in, out);
        }
        return LaunchGatherNhwcRows<T, S, 1>(stream, a, s, in, out);
      } else {
        if (CanVectorise<T>(s, dy, dx)) {
          return Launch(GatherNhwc<T, S, kWide<T>>, stream,
                        rows * groups * (s.channels / kWide<T>), a, s, in, out);
        }
        return Launch(GatherNhwc<T, S, 1>, stream, rows * groups * s.channels,
                      a, s, in, out);
      }
    });
  });
}

}  // namespace jax_avgpool::cuda
