// CUDA kernels for 2-D average pooling: forward, deterministic gather
// backward and atomic scatter backward, in NCHW and NHWC, and their
// launchers.
//
// Every kernel is a grid-stride loop over a flat 1-D index of its work
// items. A work item is BLOCK adjacent outputs along W (forward, scatter) or
// BLOCK adjacent inputs along W (gather) of one row, times one vector of V
// channels in NHWC. Columns that adjacent outputs share are loaded once per
// thread. KH, KW, SH, SW and BLOCK are compile-time constants for the
// specialisations of kernel_spec.h and runtime values in the generic kernel
// (BLOCK 1). 16-bit types accumulate in float32. Offsets are 64-bit; the
// decomposition of the flat index uses 32-bit arithmetic when it fits.
#include <algorithm>
#include <cstdint>

#include "cuda_common.cuh"

namespace jax_avgpool::cuda {
namespace {

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

// NHWC: a work item is (image n and output row oh, group g of BLOCK outputs,
// vector v of V channels).
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
    for (int64_t h = wh.start; h < wh.end; ++h) {
      const T* row = x + (n * H + h) * W * C + c_off;
#pragma unroll
      for (int64_t j = 0; j < ncol; ++j) {
        const int64_t c = c0 + j;
        if (c < 0 || c >= W) continue;
        const VecT v = *reinterpret_cast<const VecT*>(row + c * C);
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
        const Acc d = static_cast<Acc>(Divisor(a, wh, ww));
        VecT out;
#pragma unroll
        for (int e = 0; e < V; ++e) out.v[e] = N::Store(acc[b][e] / d);
        *reinterpret_cast<VecT*>(y + (row_id * OW + ow) * C + c_off) = out;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Backward, gather: dx[h, w] = sum over the windows (oh, ow) covering (h, w)
// of dy[oh, ow] / divisor, in ascending (oh, ow) order (the CPU's order).

// NCHW: a work item is (plane p, input row h, group of BLOCK inputs).
template <typename T, typename S>
__global__ void __launch_bounds__(kThreads)
    GatherNchw(const PoolAttrs a, const PoolShape s, const T* __restrict__ dy,
               T* __restrict__ dx, const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  constexpr int B = S::BLOCK;
  const Consts<S> k(a);
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const int64_t groups = (W + B - 1) / B;
  const bool narrow = total <= INT32_MAX;
  const bool whole_vectors = CanStoreRuns<T, B>(dx, W);
  for (int64_t i = FirstThread(); i < total; i += ThreadCount()) {
    const Split3 at = Decompose(i, H, groups, narrow);
    const int64_t p = at.outer, h = at.mid, w0 = at.inner * B;
    const int64_t w_last = (w0 + B < W ? w0 + B : W) - 1;
    const Cover ch = CoverOf(h, OH, k.kh, k.sh, a.pad_top);
    const int64_t ow_first = CoverOf(w0, OW, k.kw, k.sw, a.pad_left).first;
    const int64_t ow_last = CoverOf(w_last, OW, k.kw, k.sw, a.pad_left).last;
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

// NHWC: a work item is (image n and input row h, group of BLOCK inputs,
// vector of V channels).
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
    for (int64_t oh = ch.first; oh <= ch.last; ++oh) {
      const Window wh = WindowAt(oh, H, k.kh, k.sh, a.pad_top, a.pad_bottom);
      const T* grow = dy + (n * OH + oh) * OW * C + c_off;
      for (int64_t ow = ow_first; ow <= ow_last; ++ow) {
        const Window ww = WindowAt(ow, W, k.kw, k.sw, a.pad_left, a.pad_right);
        const Acc d = static_cast<Acc>(Divisor(a, wh, ww));
        const VecT v = *reinterpret_cast<const VecT*>(grow + ow * C);
        Acc g[V];
#pragma unroll
        for (int e = 0; e < V; ++e) g[e] = N::Load(v.v[e]) / d;
        const int64_t start = ow * k.sw - a.pad_left;
#pragma unroll
        for (int b = 0; b < B; ++b) {
          const int64_t w = w0 + b;
          if (w >= start && w < start + k.kw) {
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

// Channels per vector access in NHWC: 16 bytes when C and both buffers
// allow it, else one.
template <typename T>
constexpr int kWide = 16 / static_cast<int>(sizeof(T));

template <typename T>
bool CanVectorise(const PoolShape& s, const void* in, const void* out) {
  const auto aligned = [](const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0;
  };
  return s.channels % kWide<T> == 0 && aligned(in) && aligned(out);
}

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
                          const PoolShape& s, const void* x, void* y) {
  return WithType(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x);
    T* out = static_cast<T*>(y);
    return WithSpec(a, [&](auto spec) {
      using S = decltype(spec);
      const int64_t rows = s.batch * s.out_h,
                    groups = Groups(s.out_w, S::BLOCK);
      if (a.layout == kNCHW) {
        return Launch(ForwardNchw<T, S>, stream, rows * s.channels * groups, a,
                      s, in, out);
      }
      if (CanVectorise<T>(s, x, y)) {
        return Launch(ForwardNhwc<T, S, kWide<T>>, stream,
                      rows * groups * (s.channels / kWide<T>), a, s, in, out);
      }
      return Launch(ForwardNhwc<T, S, 1>, stream, rows * groups * s.channels, a,
                    s, in, out);
    });
  });
}

cudaError_t LaunchBackwardGather(cudaStream_t stream, DType dtype,
                                 const PoolAttrs& a, const PoolShape& s,
                                 const void* dy, void* dx) {
  return WithType(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(dy);
    T* out = static_cast<T*>(dx);
    return WithSpec(a, [&](auto spec) {
      using S = decltype(spec);
      const int64_t rows = s.batch * s.in_h, groups = Groups(s.in_w, S::BLOCK);
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
        return Launch(GatherNchw<T, S>, stream, rows * s.channels * groups, a,
                      s, in, out);
      }
      if (CanVectorise<T>(s, dy, dx)) {
        return Launch(GatherNhwc<T, S, kWide<T>>, stream,
                      rows * groups * (s.channels / kWide<T>), a, s, in, out);
      }
      return Launch(GatherNhwc<T, S, 1>, stream, rows * groups * s.channels, a,
                    s, in, out);
    });
  });
}

}  // namespace jax_avgpool::cuda
