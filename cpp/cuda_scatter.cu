// CUDA scatter backward: the target (dx, or the float32 workspace of a
// 16-bit dx) is zeroed, then each dy / divisor is added with atomics to every
// element of its window. See cuda_kernels.h. Stride-1 windows of 5 and more,
// and 3x3/1 windows over planes the row kernels cannot take, on sm_90 first
// try the gather's kernels adding their results to a zeroed dx
// (LaunchAddingGather, cuda_kernels.cu). Where the tiles below apply
// with aligned runs of four elements and give each dx element a single
// atomic, a 16-bit dx is the target itself: each tile's float32 sums are
// rounded and added by 16-bit atomics, four elements at a time on sm_90.
//
// The main kernel (ScatterTiled) adds up on chip before it touches global
// memory. Average pooling is separable: the contribution of a set of dy rows
// to dx is a sum along W followed by a sum along H. A thread block takes a
// tile: P images (NCHW planes or NHWC images), a band of nb consecutive dy
// rows, a chunk of nw consecutive dx columns and, in NHWC, a slice of cs
// channels. For each tile it
//   1. copies the dy values of the band whose windows meet the chunk into
//      shared memory (cp.async on sm_80 and later) and divides each by its
//      window's divisor: G[image][row][dy column][c];
//   2. sums G along W: T[image][row][dx column][c] is the sum of G over the
//      windows of the row that contain the column;
//   3. sums T along H: dx row h of the tile gets the sum of the T rows whose
//      windows contain h, added to the target with one atomic per element
//      (a 16-byte vector atomic on sm_90 where the layout allows).
// Between steps 1 and 2, tiles of strided windows and float32 tiles of whole
// NCHW planes ask L2 for the target lines they will add to (PrefetchTarget),
// so that the atomics find them there.
// Chunks own their dx columns (a dy column whose windows straddle two chunks
// is loaded by both), so only bands overlap: the KH - SH dx rows shared by
// two adjacent bands get one atomic from each. Each dy element is loaded and
// divided once per chunk that needs it, and each dx element gets one atomic
// per band that covers it: one in the common case of whole images per tile.
// The terms are the per-element scatter's, summed in another order.
//
// In the specialisations, a thread of step 2 produces a run of adjacent
// columns and a thread of step 3 a run of adjacent rows, loading each G or T
// value that the run shares once; the window and stride are compile-time
// constants, the padding is not, so the few possible alignments of a run
// against the windows ("phases") are compiled separately. The generic kernel
// loops. PlanTiles chooses the tile on the host.
//
// The simple kernels (one thread per dy element, one atomic per window
// element) remain for what the tiles cannot hold: extents, windows or
// paddings of 2^28 or more, or windows so wide that a single tile row does
// not fit in shared memory.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "cuda_common.cuh"

namespace jax_avgpool::cuda {
namespace {

// ---------------------------------------------------------------------------
// Simple kernels: each dy / divisor is added with atomics to every element of
// its window, in the accumulator type.

// The outputs of one scatter thread: BLOCK of them, 32 apart, so that the
// lanes of a warp work on consecutive outputs and their atomics coalesce.
// Calls fn(o) for each output index o < count.
template <int B, typename Fn>
__device__ __forceinline__ void ForEachWarpInterleaved(int64_t count, Fn fn) {
  const int64_t lane = threadIdx.x % 32;
  const int64_t step = ThreadCount() * B;
  for (int64_t base = (FirstThread() - lane) * B + lane; base < count;
       base += step) {
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int64_t o = base + 32 * b;
      if (o < count) fn(o);
    }
  }
}

// NCHW: outputs flat over (plane, oh, ow).
template <typename T, typename S>
__global__ void __launch_bounds__(kThreads)
    ScatterNchw(const PoolAttrs a, const PoolShape s, const T* __restrict__ dy,
                typename Num<T>::Acc* __restrict__ dx, const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  const Consts<S> k(a);
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const bool narrow = total <= INT32_MAX;
  ForEachWarpInterleaved<S::BLOCK>(total, [&](int64_t o) {
    const Split3 at = Decompose(o, OH, OW, narrow);
    const int64_t p = at.outer, oh = at.mid, ow = at.inner;
    const Window wh = WindowAt(oh, H, k.kh, k.sh, a.pad_top, a.pad_bottom);
    const Window ww = WindowAt(ow, W, k.kw, k.sw, a.pad_left, a.pad_right);
    const Acc g = N::Load(dy[o]) / static_cast<Acc>(Divisor(a, wh, ww));
    Acc* plane = dx + p * H * W;
    for (int64_t h = wh.start; h < wh.end; ++h)
      for (int64_t w = ww.start; w < ww.end; ++w)
        atomicAdd(plane + h * W + w, g);
  });
}

// NHWC: outputs flat over (n and oh, ow, c).
template <typename T, typename S>
__global__ void __launch_bounds__(kThreads)
    ScatterNhwc(const PoolAttrs a, const PoolShape s, const T* __restrict__ dy,
                typename Num<T>::Acc* __restrict__ dx, const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  const Consts<S> k(a);
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const int64_t C = s.channels;
  const bool narrow = total <= INT32_MAX;
  ForEachWarpInterleaved<S::BLOCK>(total, [&](int64_t o) {
    const Split3 at = Decompose(o, OW, C, narrow);
    const Split2 n_oh = DivMod(at.outer, OH, narrow);
    const int64_t n = n_oh.quot, oh = n_oh.rem, ow = at.mid, c = at.inner;
    const Window wh = WindowAt(oh, H, k.kh, k.sh, a.pad_top, a.pad_bottom);
    const Window ww = WindowAt(ow, W, k.kw, k.sw, a.pad_left, a.pad_right);
    const Acc g = N::Load(dy[o]) / static_cast<Acc>(Divisor(a, wh, ww));
    Acc* image = dx + n * H * W * C + c;
    for (int64_t h = wh.start; h < wh.end; ++h)
      for (int64_t w = ww.start; w < ww.end; ++w)
        atomicAdd(image + (h * W + w) * C, g);
  });
}

// ---------------------------------------------------------------------------
// Tiled kernel: helpers.

// Shared memory a tile may use: below the 48 KiB that needs no opt-in, and
// small enough for five blocks per SM on sm_80 and sm_90 (registers allow
// four to five).
constexpr int kTileBudget = 44 * 1024;
// Extents, windows, strides and paddings below this take the tiled kernel;
// sums of a few of them then fit in 32-bit arithmetic.
constexpr int64_t kTileLimit = int64_t{1} << 28;
// Adjacent dx columns per thread in step 2 (for channel vectors of V) and dx
// rows per thread in step 3, in the specialisations; the generic kernel does
// one. An odd run keeps the lanes' shared-memory accesses, a run apart, on
// distinct banks.
constexpr int RunW(int V) { return V == 1 ? 7 : 5; }
constexpr int kRunH = 4;
// Tiles whose target spans more bytes than this do not prefetch it: the
// lines of all resident tiles must fit in L2 together.
constexpr int64_t kPrefetchLimit = 256 * 1024;
// Blocks per SM the tiled kernel's register use must allow.
constexpr int kTileBlocks = 4;
// Tiles that keep a large GPU busy (132 SMs of kTileBlocks blocks on an
// H100 or H200); the tiling takes smaller tiles rather than fewer.
constexpr int64_t kTileSlots = 528;

// Calls f(std::integral_constant<int, I>) for I = 0 .. N - 1.
template <typename F, int... I>
__device__ __forceinline__ void UnrollSeq(F& f,
                                          std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
__device__ __forceinline__ void Unroll(F&& f) {
  UnrollSeq(f, std::make_integer_sequence<int, N>{});
}

// Calls f(std::integral_constant<int, ph>) for the runtime ph in [0, S).
template <int S, int P = 0, typename F>
__device__ __forceinline__ void WithPhase(int ph, F&& f) {
  if constexpr (P + 1 >= S) {
    f(std::integral_constant<int, P>{});
  } else if (ph == P) {
    f(std::integral_constant<int, P>{});
  } else {
    WithPhase<S, P + 1>(ph, f);
  }
}

// floor(u / S) for any sign of u.
template <int S>
__device__ __forceinline__ int FloorDiv(int u) {
  if constexpr (S == 1) {
    return u;
  } else {
    return u >= 0 ? u / S : -((S - 1 - u) / S);
  }
}

template <typename A, int V>
__device__ __forceinline__ Vec<A, V> Zero() {
  Vec<A, V> v;
#pragma unroll
  for (int e = 0; e < V; ++e) v.v[e] = A(0);
  return v;
}

template <typename A, int V>
__device__ __forceinline__ void AddTo(Vec<A, V>& acc, const Vec<A, V>& v) {
#pragma unroll
  for (int e = 0; e < V; ++e) acc.v[e] += v.v[e];
}

template <typename A, int V>
__device__ __forceinline__ Vec<A, V> LoadVec(const A* p) {
  return *reinterpret_cast<const Vec<A, V>*>(p);
}

template <typename A, int V>
__device__ __forceinline__ void StoreVec(A* p, const Vec<A, V>& v) {
  *reinterpret_cast<Vec<A, V>*>(p) = v;
}

// A run of B adjacent positions x0 .. x0 + B - 1 along one axis, and the
// windows (size K, stride S) that contain them. Writing
// x0 + lo - K + 1 = q * S + ph with 0 <= ph < S, the windows that can contain
// a position of the run are q + j for j < kCandidates, and window q + j
// contains x0 + b exactly when Covers(ph, b, j).
template <int K, int S, int B>
struct Run {
  static constexpr int kCandidates = (S + B + K - 3) / S + 1;
  static constexpr bool Covers(int ph, int b, int j) {
    return j * S >= ph + b && j * S <= ph + b + K - 1;
  }
  static constexpr bool Used(int ph, int j) {
    for (int b = 0; b < B; ++b) {
      if (Covers(ph, b, j)) return true;
    }
    return false;
  }
  // Whether j is the first window that contains x0 + b.
  static constexpr bool First(int ph, int b, int j) {
    return Covers(ph, b, j) && (j == 0 || !Covers(ph, b, j - 1));
  }
};

// The number of windows (size k, stride s) on either side of a tile whose
// values a run inside the tile may load (see ScatterTiled).
constexpr int Margin(int k, int s) { return (k - 1 + s - 1) / s; }

// acc[b] = the sum over the windows j that contain x0 + b of load(j), for
// the run of Run<K, S, B> in phase ph. At stride 1 (a single phase) output
// b sums load(b) .. load(b + K - 1), and adjacent outputs share K - 1 of
// them: SlidingSums adds what they share once (for 7x7/1, 19 additions a
// channel instead of 30 for a run of 5, 13 instead of 24 for a run of 4).
template <int K, int S, int B, typename A, int V, typename Load>
__device__ __forceinline__ void SumRun(int ph, const Load& load,
                                       Vec<A, V> (&acc)[B]) {
  using R = Run<K, S, B>;
  if constexpr (S == 1) {
    static_assert(R::kCandidates == B + K - 1);
    Vec<A, V> v[B + K - 1];
#pragma unroll
    for (int j = 0; j < B + K - 1; ++j) v[j] = load(j);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      A out[B];
      SlidingSums<K, B>([&](int j) { return v[j].v[e]; }, out);
#pragma unroll
      for (int b = 0; b < B; ++b) acc[b].v[e] = out[b];
    }
  } else {
#pragma unroll
    for (int b = 0; b < B; ++b) acc[b] = Zero<A, V>();
    WithPhase<S>(ph, [&](auto phase) {
      constexpr int kPh = decltype(phase)::value;
      Unroll<R::kCandidates>([&](auto jc) {
        constexpr int kJ = decltype(jc)::value;
        if constexpr (R::Used(kPh, kJ)) {
          const Vec<A, V> v = load(kJ);
          Unroll<B>([&](auto bc) {
            constexpr int kB = decltype(bc)::value;
            if constexpr (R::First(kPh, kB, kJ)) {
              acc[kB] = v;
            } else if constexpr (R::Covers(kPh, kB, kJ)) {
              AddTo(acc[kB], v);
            }
          });
        }
      });
    });
  }
}

// The windows (size k, stride s, padding lo before) that contain x are
// FirstCover .. LastCover (CoverOf without the clamp to the output count).
__device__ __forceinline__ int FirstCover(int x, int k, int s, int lo) {
  const int low = x + lo - k + 1;
  return low <= 0 ? 0 : (low + s - 1) / s;
}
__device__ __forceinline__ int LastCover(int x, int s, int lo) {
  return (x + lo) / s;
}

// The sum of the vectors base[(o - lo) * stride] over the outputs o in
// [lo, hi) whose windows (k, s, pad) cover position x: a generic tile's
// pass along one axis.
template <typename A, int V>
__device__ __forceinline__ Vec<A, V> CoverSum(const A* base, int stride, int x,
                                              int k, int s, int pad, int lo,
                                              int hi) {
  const int first = max(FirstCover(x, k, s, pad), lo);
  const int last = min(LastCover(x, s, pad), hi - 1);
  Vec<A, V> acc = Zero<A, V>();
  for (int o = first; o <= last; ++o) {
    AddTo(acc, LoadVec<A, V>(base + (o - lo) * stride));
  }
  return acc;
}

// The factor of one axis in Divisor(): the window of output o clipped to
// [lo_clip, hi_clip), which is [-lo, in + hi) for WindowAt's padded count and
// [0, in) for its real count.
__device__ __forceinline__ int AxisCount(int o, int k, int s, int lo,
                                         int lo_clip, int hi_clip) {
  const int begin = o * s - lo;
  return max(min(begin + k, hi_clip) - max(begin, lo_clip), 0);
}

// Adds V consecutive values to global memory: one vector atomic on sm_90
// for four floats (16-byte aligned), else one atomic per value.
template <typename A, int V>
__device__ __forceinline__ void AtomicAddVec(A* p, const Vec<A, V>& v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kVector = std::is_same_v<A, float> && V == 4;
#else
  constexpr bool kVector = false;
#endif
  if constexpr (kVector) {
    atomicAdd(reinterpret_cast<float4*>(p),
              make_float4(v.v[0], v.v[1], v.v[2], v.v[3]));
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) atomicAdd(p + e, v.v[e]);
  }
}

// Adds a and b, rounded to T, to the adjacent 16-bit elements p[0] and p[1]
// (4-byte aligned) with one atomic: the hardware's paired 16-bit atomic
// where the architecture has it, else a compare-and-swap loop.
template <typename T>
__device__ __forceinline__ void CasAddPair(T* p, float a, float b) {
  unsigned int* word = reinterpret_cast<unsigned int*>(p);
  unsigned int seen = *word, expected;
  do {
    expected = seen;
    Vec<T, 2> pair;
    memcpy(&pair, &expected, sizeof(pair));
    pair.v[0] = Num<T>::Store(Num<T>::Load(pair.v[0]) + a);
    pair.v[1] = Num<T>::Store(Num<T>::Load(pair.v[1]) + b);
    unsigned int bits;
    memcpy(&bits, &pair, sizeof(bits));
    seen = atomicCAS(word, expected, bits);
  } while (seen != expected);
}

template <typename T>
__device__ __forceinline__ void AtomicAddPair(T* p, float a, float b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    CasAddPair(p, a, b);
#else
    atomicAdd(reinterpret_cast<__nv_bfloat162*>(p),
              __floats2bfloat162_rn(a, b));
#endif
  } else {
    static_assert(std::is_same_v<T, __half>);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 600
    CasAddPair(p, a, b);
#else
    atomicAdd(reinterpret_cast<__half2*>(p), __floats2half2_rn(a, b));
#endif
  }
}

// The bits of a and b rounded to the 16-bit T, a in the low half.
template <typename T>
__device__ __forceinline__ unsigned int PackPair(float a, float b) {
  Vec<T, 2> pair;
  pair.v[0] = Num<T>::Store(a);
  pair.v[1] = Num<T>::Store(b);
  unsigned int bits;
  memcpy(&bits, &pair, sizeof(bits));
  return bits;
}

// Adds v[0..3], rounded to the 16-bit T, to p[0..3] (8-byte aligned): one
// 8-byte vector atomic on sm_90, else two paired ones. Each element is
// rounded and added as by the paired atomic; half as many atomics reach L2
// (on the H200 the bfloat16 scatter of the bench took 240 against 310 us
// on 128x256x56x56 3x3/2 and 2x2/2; 16-byte atomics, on runs of 8, were
// no faster).
template <typename T>
__device__ __forceinline__ void AtomicAddQuad(T* p, const float (&v)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kVector = true;
#else
  constexpr bool kVector = false;
#endif
  if constexpr (kVector) {
    const size_t at = __cvta_generic_to_global(p);
    const unsigned int lo = PackPair<T>(v[0], v[1]);
    const unsigned int hi = PackPair<T>(v[2], v[3]);
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      asm volatile("red.global.add.noftz.v2.bf16x2 [%0], {%1, %2};" ::"l"(at),
                   "r"(lo), "r"(hi)
                   : "memory");
    } else {
      static_assert(std::is_same_v<T, __half>);
      asm volatile("red.global.add.noftz.v2.f16x2 [%0], {%1, %2};" ::"l"(at),
                   "r"(lo), "r"(hi)
                   : "memory");
    }
  } else {
    AtomicAddPair(p, v[0], v[1]);
    AtomicAddPair(p + 2, v[2], v[3]);
  }
}

// Adds V accumulated values to the target D: the accumulator type itself
// (AtomicAddVec), or a 16-bit dx, rounded, by fours (V a multiple of 4, p
// 8-byte aligned).
template <typename A, int V, typename D>
__device__ __forceinline__ void AtomicAddTo(D* p, const Vec<A, V>& v) {
  if constexpr (std::is_same_v<D, A>) {
    AtomicAddVec<A, V>(p, v);
  } else {
    static_assert(V % 4 == 0 && sizeof(D) == 2);
#pragma unroll
    for (int e = 0; e < V; e += 4) {
      const float quad[4] = {v.v[e], v.v[e + 1], v.v[e + 2], v.v[e + 3]};
      AtomicAddQuad(p + e, quad);
    }
  }
}

// Starts a copy of kBytes (4, 8 or 16, aligned) from global to shared memory
// that WaitCopies() completes; a plain copy before sm_80.
template <int kBytes, typename D, typename S>
__device__ __forceinline__ void CopyAsync(D* dst, const S* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to),
                 "l"(src)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(to),
                 "l"(src), "n"(kBytes)
                 : "memory");
  }
#else
  struct alignas(kBytes) Bytes {
    unsigned char b[kBytes];
  };
  *reinterpret_cast<Bytes*>(dst) = *reinterpret_cast<const Bytes*>(src);
#endif
}

__device__ __forceinline__ void WaitCopies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

template <typename A>
__device__ __forceinline__ A* DynamicShared() {
  extern __shared__ __align__(16) unsigned char scatter_shared[];
  return reinterpret_cast<A*>(scatter_shared);
}

// The value of type V at p (aligned to sizeof(V)), read with one load of
// its width: a vector of 16-bit elements read as it is declared takes one
// load per element.
template <typename V>
__device__ __forceinline__ V LoadRaw(const void* p) {
  static_assert(sizeof(V) == 2 || sizeof(V) == 4 || sizeof(V) == 8 ||
                sizeof(V) == 16);
  using Word = std::conditional_t<
      sizeof(V) == 2, unsigned short,
      std::conditional_t<sizeof(V) == 4, unsigned int,
                         std::conditional_t<sizeof(V) == 8, uint2, uint4>>>;
  const Word w = *static_cast<const Word*>(p);
  V v;
  memcpy(&v, &w, sizeof(V));
  return v;
}

// Asks L2 to fetch the target elements a tile will add to, ahead of its
// atomics: nr ranges of len elements, range k = (image pl, row hi, position
// wi) in (np, nh, nwp) starting at base + pl * image_stride + hi * row_stride
// + wi * C. A reduction that misses L2 waits there for its line, and the
// misses of many in flight hold L2's atomic units; lines fetched by plain
// prefetches ahead of them let the reductions hit. Ranges of at most a few
// lines go one per thread; longer ones are split into 128-byte lines
// across the block.
template <typename D>
__device__ __forceinline__ void PrefetchTarget(const D* base,
                                               int64_t image_stride,
                                               int64_t row_stride, int C,
                                               int np, int nh, int nwp,
                                               int len) {
  const int bytes = len * static_cast<int>(sizeof(D));
  const int nr = np * nh * nwp;
  const auto start = [&](int k) {
    const int wi = k % nwp;
    k /= nwp;
    const int hi = k % nh;
    const int pl = k / nh;
    return reinterpret_cast<uintptr_t>(base + pl * image_stride +
                                       hi * row_stride +
                                       static_cast<int64_t>(wi) * C);
  };
  const auto fetch = [](uintptr_t at) {
    PrefetchL2(reinterpret_cast<const void*>(at));
  };
  const int nl = bytes / 128 + 2;  // lines a range can touch, at most
  if (nl <= 4) {
    for (int k = threadIdx.x; k < nr; k += blockDim.x) {
      const uintptr_t a0 = start(k);
      for (uintptr_t line = a0 & ~uintptr_t{127}; line < a0 + bytes;
           line += 128) {
        fetch(line < a0 ? a0 : line);
      }
    }
  } else {
    for (int it = threadIdx.x; it < nr * nl; it += blockDim.x) {
      const int k = it / nl;
      const uintptr_t a0 = start(k);
      const uintptr_t line =
          (a0 & ~uintptr_t{127}) + uintptr_t{128} * (it - k * nl);
      if (line < a0 + bytes) fetch(line < a0 ? a0 : line);
    }
  }
}

// Runs of zeros that a kernel writes into shared memory: `len` elements
// each, in pieces of `piece` elements (one store each), with `by_pieces`
// dividing by the pieces of a run.
struct ZeroPlan {
  int len, piece;
  FastDiv by_pieces;
};

ZeroPlan PlanZeros(int len, int stride, int offset, int acc_size) {
  const int vec = 16 / acc_size;  // elements per 16-byte store
  ZeroPlan z;
  z.len = len;
  z.piece = len % vec == 0 && stride % vec == 0 && offset % vec == 0 ? vec : 1;
  z.by_pieces = FastDiv::Of(std::max(len / z.piece, 1));
  return z;
}

// Zeroes `count` runs of z.len elements, `stride` apart from `at`.
template <typename A>
__device__ __forceinline__ void ZeroRuns(A* at, int count, int stride,
                                         const ZeroPlan& z) {
  const int pieces = z.len / z.piece;
  for (int i = threadIdx.x; i < count * pieces; i += blockDim.x) {
    const int run = z.by_pieces(i);
    A* const p = at + run * stride + (i - run * pieces) * z.piece;
    if (z.piece == 1) {
      *p = A(0);
    } else if constexpr (sizeof(A) == 4) {
      *reinterpret_cast<float4*>(p) = make_float4(0.f, 0.f, 0.f, 0.f);
    } else {
      *reinterpret_cast<double2*>(p) = make_double2(0.0, 0.0);
    }
  }
}

// Geometry and tiling of one launch, computed on the host (PlanTiles).
// Positions are W indices (columns); a position holds C channels in memory
// (C = 1 in NCHW, where the "images" are the planes).
struct TileGeom {
  int H, W, OH, OW, C;
  int kh, kw, sh, sw;
  int pad_top, pad_bottom, pad_left, pad_right;
  int divisor_mode;
  int64_t divisor_override;
  // Window clipping of the divisor's counts (AxisCount), rows and columns.
  int clip_top, clip_bottom, clip_left, clip_right;
  int64_t images;        // planes (NCHW) or images (NHWC)
  int64_t image_stride;  // H * W * C
  int64_t row_stride;    // W * C
  int64_t tiles;
  // Tile: P images x nb dy rows x nw dx columns x cs channels. The last of
  // each may be cut short by the extent.
  int P, nb, nw, cs;
  int bands, chunks, slices;
  // Threads: cv vectors of V channels per position, ps positions at a time;
  // in step 1, a thread takes G columns s1_cols apart and G rows s1_rows
  // apart.
  int cv, ps, s1_cols, s1_rows;
  int64_t dy_row;  // OW * C
  // Whether a tile prefetches its target lines into L2 (PrefetchTarget).
  int prefetch;
  // Shared memory, in accumulator elements (see ScatterTiled): G rows of gw
  // columns gp apart after gm margin columns, T planes of nb rows tp apart
  // after tm margin rows, from t_offset; smem in all.
  int gw, gm, gp, nwT, tm, tp, t_offset, smem;
  // Work items per row: runs of step 2 per G row, row runs of step 3 per
  // image, column groups of step 3 per row.
  int runs_w, runs_h, groups;
  FastDiv by_nb, by_runs_w, by_runs_h, by_groups;
  FastDiv by_slices, by_chunks, by_bands;
  // Threads: position lanes (by_cv); step 1's first G row (by_s1_cols) and
  // the advance of its row in the image per step (s1_r).
  FastDiv by_cv, by_s1_cols;
  int s1_r;
  // The margins' zeros, G then T.
  ZeroPlan g_zero, t_zero;
};

// ---------------------------------------------------------------------------
// Tiled kernel. V: channels per vector (NHWC with C % 4 == 0 in float; else
// 1). L: consecutive values per atomic in step 3, V in NHWC, 4 adjacent
// columns in NCHW when W % 4 == 0 (else 1). D: the target's element type,
// the accumulator's, or a 16-bit dx itself (then L = 4: runs of four
// rounded sums added by 16-bit atomics, AtomicAddQuad).
//
// Shared memory layout (positions of cs channels each):
//   G: gm + P * nb * gp positions; G row i = (image, dy row) = (pl, r),
//      i = pl * nb + r, holds dy column ga + j at position gm + i * gp + j,
//      0 <= j < gw, with zeros at the gm = gp - gw positions between rows
//      and before the first.
//   T: tm + P * tp rows of nwT positions; T row (pl, r) is row
//      tm + pl * tp + r, 0 <= r < nb, with tm = tp - nb zero rows between
//      images and before the first.
// The margins are zeroed once; G columns past the tile's and T rows past its
// band are zeroed per tile. A run of step 2 or 3 that ends inside the tile
// then loads its windows' values without bounds checks: the windows it may
// reach outside the tile (Margin() on either side) read zeros. Runs that
// end past the tile check.
template <typename T, typename S, int V, int L, typename D>
__global__ void __launch_bounds__(kThreads, kTileBlocks)
    ScatterTiled(const TileGeom g, const T* __restrict__ dy,
                 D* __restrict__ dx) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  using VecA = Vec<Acc, V>;
  using VecL = Vec<Acc, L>;
  using VecT = Vec<T, V>;
  static_assert(V == 1 || V == L, "channel vectors are the atomic unit");
  constexpr bool kGeneric = S::kGeneric;
  constexpr int kRw = kGeneric ? 1 : RunW(V);
  constexpr int kRh = kGeneric ? 1 : kRunH;
  constexpr int kCols = V == 1 ? L : 1;  // columns per item of step 3
  // Step 1 copies values of 4 bytes or more asynchronously into shared
  // memory; narrower ones go through registers, kBatch at a time.
  constexpr bool kAsync = sizeof(VecT) >= 4;
  constexpr int kBatch = 4;

  const int kh = kGeneric ? g.kh : S::KH;
  const int kw = kGeneric ? g.kw : S::KW;
  const int sh = kGeneric ? g.sh : S::SH;
  const int sw = kGeneric ? g.sw : S::SW;
  const bool fixed = g.divisor_mode == kOverride;
  const Acc fixed_divisor = static_cast<Acc>(g.divisor_override);

  // Zero the margins: the gm positions before each G row and after the
  // last, and the tm rows of T before each image and after the last.
  Acc* const smem = DynamicShared<Acc>();
  ZeroRuns(smem, g.P * g.nb + 1, g.gp * g.cs, g.g_zero);
  ZeroRuns(smem + g.t_offset, g.P + 1, g.tp * g.nwT * g.cs, g.t_zero);
  __syncthreads();

  // This thread's channel vector and position lane.
  const int pos_lane = g.by_cv(static_cast<int>(threadIdx.x));
  const int c_off = (static_cast<int>(threadIdx.x) - pos_lane * g.cv) * V;
  // G position j of G row i: gs[(i * gp + j) * cs], this thread's channels.
  // Channels per position: one in NCHW (the only layout with L > V).
  const int cs = V == 1 && L > 1 ? 1 : g.cs;
  Acc* const gs = smem + g.gm * cs + c_off;
  // T position x of T row (pl, r): ts[((pl * tp + r) * nwT + x) * cs].
  Acc* const ts = smem + g.t_offset + g.tm * g.nwT * cs + c_off;
  const int g_row = g.gp * cs;
  const int t_row = g.nwT * cs;
  // Step 1: this thread takes G columns s1_col0 + m * s1_cols and, in each,
  // G rows s1_row0 + k * s1_rows, whose rows in their image are r0 first,
  // advancing by s1_r modulo nb.
  const int s1_row0 = g.by_s1_cols(pos_lane);
  const int s1_col0 = pos_lane - s1_row0 * g.s1_cols;
  const int r0 = s1_row0 - g.by_nb(s1_row0) * g.nb;
  const int s1_r = g.s1_r;

  for (int64_t tile = blockIdx.x; tile < g.tiles; tile += gridDim.x) {
    // Tile coordinates, channel slice fastest, then chunk, band, images.
    int slice, chunk, band;
    int64_t group;
    if (tile <= INT32_MAX) {
      const int t0 = static_cast<int>(tile);
      const int t1 = g.by_slices(t0);
      const int t2 = g.by_chunks(t1);
      const int t3 = g.by_bands(t2);
      slice = t0 - t1 * g.slices;
      chunk = t1 - t2 * g.chunks;
      band = t2 - t3 * g.bands;
      group = t3;
    } else {
      int64_t t = tile;
      slice = static_cast<int>(t % g.slices);
      t /= g.slices;
      chunk = static_cast<int>(t % g.chunks);
      t /= g.chunks;
      band = static_cast<int>(t % g.bands);
      group = t / g.bands;
    }
    const int64_t img0 = group * g.P;
    const int np = static_cast<int>(min(int64_t{g.P}, g.images - img0));
    const int oh0 = band * g.nb;
    const int nbt = min(g.nb, g.OH - oh0);
    const int w0 = chunk * g.nw;
    const int w1 = min(g.W, w0 + g.nw);
    const int c0 = slice * cs;
    const bool active = pos_lane < g.ps && c_off < g.C - c0;
    // The dy columns [ga, gb) whose windows meet dx columns [w0, w1), and the
    // dx rows [hs, he) that the windows of dy rows [oh0, oh0 + nbt) meet.
    const int ga = FirstCover(w0, kw, sw, g.pad_left);
    const int gb = min(g.OW, LastCover(w1 - 1, sw, g.pad_left) + 1);
    const int hs = max(oh0 * sh - g.pad_top, 0);
    const int he = [&] {
      const int begin = (oh0 + nbt - 1) * sh - g.pad_top;
      const int stop = min(min(begin + kh, g.H + g.pad_bottom), g.H);
      return max(stop, hs);
    }();
    if (ga >= gb || hs >= he) continue;  // nothing to add; uniform per block
    const int gwt = gb - ga;

    // Step 1: G = dy / divisor, zeros in G columns gwt .. gw - 1. G rows
    // below `rows` are in the tile; G row i is dy row i of the tile, counted
    // from its first (several images per tile only come with whole images).
    if (active && s1_row0 < g.s1_rows) {
      const int rows = (np - 1) * g.nb + nbt;
      const int slot_step = g.s1_rows * g_row;
      const int64_t dy_step = static_cast<int64_t>(g.s1_rows) * g.dy_row;
      for (int j = s1_col0; j < g.gw; j += g.s1_cols) {
        Acc* const col = gs + j * cs;
        if (j >= gwt) {
          for (int i = s1_row0; i < rows; i += g.s1_rows) {
            StoreVec(col + i * g_row, Zero<Acc, V>());
          }
          continue;
        }
        const T* const src = dy + ((img0 * g.OH + oh0) * g.OW + ga + j) * g.C +
                             c0 + c_off + s1_row0 * g.dy_row;
        const Acc cf = static_cast<Acc>(
            AxisCount(ga + j, kw, sw, g.pad_left, g.clip_left, g.clip_right));
        // Divides the raw value of G row i (row r of its image) into slot.
        const auto divide = [&](const VecT& raw, Acc* slot, int r) {
          const Acc rf = static_cast<Acc>(
              AxisCount(oh0 + r, kh, sh, g.pad_top, g.clip_top, g.clip_bottom));
          const Acc d = fixed ? fixed_divisor : rf * cf;
          VecA v;
          if constexpr (V == 1) {
            v.v[0] = N::Load(raw.v[0]) / d;
          } else {
            // The V channels share the divisor: one division for its
            // reciprocal y, then each quotient q = x * y corrected once by
            // the exact residual x - q * d (Markstein), which rounds as x / d
            // does away from the subnormal range.
            static_assert(std::is_same_v<Acc, float>);
            const float y = 1.0f / d;
#pragma unroll
            for (int e = 0; e < V; ++e) {
              const float x = N::Load(raw.v[e]);
              const float q = x * y;
              v.v[e] = __fmaf_rn(__fmaf_rn(-q, d, x), y, q);
            }
          }
          StoreVec(slot, v);
        };
        const auto next_row = [&](int& r) {
          r += s1_r;
          if (r >= g.nb) r -= g.nb;
        };
        if constexpr (kAsync) {
          // Copy the raw values into their G slots, then divide them in
          // place: each thread only touches its own slots.
          {
            Acc* slot = col + s1_row0 * g_row;
            const T* from = src;
            for (int i = s1_row0; i < rows; i += g.s1_rows) {
              CopyAsync<sizeof(VecT)>(slot, from);
              slot += slot_step;
              from += dy_step;
            }
          }
          WaitCopies();
          Acc* slot = col + s1_row0 * g_row;
          for (int i = s1_row0, r = r0; i < rows; i += g.s1_rows) {
            divide(LoadRaw<VecT>(slot), slot, r);
            slot += slot_step;
            next_row(r);
          }
        } else {
          // Values narrower than a copy: kBatch loads in flight.
          Acc* slot = col + s1_row0 * g_row;
          const T* from = src;
          for (int i = s1_row0, r = r0; i < rows;) {
            VecT raw[kBatch];
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
              if (i + u * g.s1_rows < rows) {
                raw[u] = *reinterpret_cast<const VecT*>(from + u * dy_step);
              }
            }
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
              if (i < rows) divide(raw[u], slot, r);
              i += g.s1_rows;
              slot += slot_step;
              next_row(r);
            }
            from += kBatch * dy_step;
          }
        }
      }
    }
    __syncthreads();

    // The target lines of the tile, fetched into L2 while steps 2 and 3 run
    // (after step 1, so that they do not delay its dy loads).
    if (g.prefetch) {
      const int cw = min(cs, g.C - c0);
      const D* const base = dx + img0 * g.image_stride + hs * g.row_stride +
                            static_cast<int64_t>(w0) * g.C + c0;
      const int64_t rows = he - hs;
      if (cw < g.C) {  // one range per position
        PrefetchTarget(base, g.image_stride, g.row_stride, g.C, np, he - hs,
                       w1 - w0, cw);
      } else if (w0 > 0 || w1 < g.W) {  // one per row
        PrefetchTarget(base, g.image_stride, g.row_stride, g.C, np, he - hs, 1,
                       (w1 - w0) * g.C);
      } else if (rows < g.H) {  // one per image
        PrefetchTarget(base, g.image_stride, g.row_stride, g.C, np, 1, 1,
                       static_cast<int>(rows * g.row_stride));
      } else {  // the images are one range
        PrefetchTarget(base, g.image_stride, g.row_stride, g.C, 1, 1, 1,
                       static_cast<int>(np * g.image_stride));
      }
    }

    // Step 2: T = G summed along W; zeros in T rows nbt .. nb - 1.
    {
      const int count = g.P * g.nb * g.runs_w;
      for (int p = pos_lane; active && p < count; p += g.ps) {
        const int row = g.by_runs_w(p);
        const int x0 = w0 + (p - row * g.runs_w) * kRw;
        const int pl = g.by_nb(row);
        const int r = row - pl * g.nb;
        if (pl >= np || x0 >= w1) continue;
        const int n_out = min(w1 - x0, kRw);
        Acc* const trow = ts + (pl * g.tp + r) * t_row + (x0 - w0) * cs;
        if (r >= nbt) {
          for (int b = 0; b < n_out; ++b) {
            StoreVec(trow + b * cs, Zero<Acc, V>());
          }
          continue;
        }
        // G value of dy column ow: grow[(ow - ga) * cs].
        const Acc* const grow = gs + row * g_row;
        if constexpr (kGeneric) {
          StoreVec(trow,
                   CoverSum<Acc, V>(grow, cs, x0, kw, sw, g.pad_left, ga, gb));
        } else {
          const int u = x0 + g.pad_left - S::KW + 1;
          const int q = FloorDiv<S::SW>(u);
          const int ph = u - q * S::SW;
          const Acc* const gq = grow + (q - ga) * cs;
          VecA acc[kRw];
          if (n_out == kRw) {
            SumRun<S::KW, S::SW>(
                ph, [&](int j) { return LoadVec<Acc, V>(gq + j * cs); }, acc);
#pragma unroll
            for (int b = 0; b < kRw; ++b) StoreVec(trow + b * cs, acc[b]);
          } else {
            SumRun<S::KW, S::SW>(
                ph,
                [&](int j) {
                  const int ow = q + j;
                  return ow >= ga && ow < gb ? LoadVec<Acc, V>(gq + j * cs)
                                             : Zero<Acc, V>();
                },
                acc);
#pragma unroll
            for (int b = 0; b < kRw; ++b) {
              if (b < n_out) StoreVec(trow + b * cs, acc[b]);
            }
          }
        }
      }
    }
    __syncthreads();

    // Step 3: dx rows = T summed along H, added to the target. The next
    // tile's step 1 writes only G, and its step 2 (the first to write T)
    // follows a barrier, so no barrier is needed after this step.
    {
      const int count = g.P * g.runs_h * g.groups;
      for (int p = pos_lane; active && p < count; p += g.ps) {
        const int q1 = g.by_groups(p);
        const int xo = (p - q1 * g.groups) * kCols;
        const int pl = g.by_runs_h(q1);
        const int h0 = hs + (q1 - pl * g.runs_h) * kRh;
        if (pl >= np || h0 >= he || w0 + xo >= w1) continue;
        // T value of dy row oh: tcol[(oh - oh0) * t_row].
        const Acc* const tcol = ts + pl * g.tp * t_row + xo * cs;
        D* const out = dx + (img0 + pl) * g.image_stride + h0 * g.row_stride +
                       static_cast<int64_t>(w0 + xo) * g.C + c0 + c_off;
        if constexpr (kGeneric) {
          AtomicAddTo(out, CoverSum<Acc, L>(tcol, t_row, h0, kh, sh, g.pad_top,
                                            oh0, oh0 + nbt));
        } else {
          const int u = h0 + g.pad_top - S::KH + 1;
          const int q = FloorDiv<S::SH>(u);
          const int ph = u - q * S::SH;
          const int n_out = he - h0;
          const Acc* const tq = tcol + (q - oh0) * t_row;
          VecL acc[kRh];
          if (n_out >= kRh) {
            SumRun<S::KH, S::SH>(
                ph, [&](int j) { return LoadVec<Acc, L>(tq + j * t_row); },
                acc);
#pragma unroll
            for (int b = 0; b < kRh; ++b) {
              AtomicAddTo(out + b * g.row_stride, acc[b]);
            }
          } else {
            SumRun<S::KH, S::SH>(
                ph,
                [&](int j) {
                  const int oh = q + j;
                  return oh >= oh0 && oh < oh0 + nbt
                             ? LoadVec<Acc, L>(tq + j * t_row)
                             : Zero<Acc, L>();
                },
                acc);
#pragma unroll
            for (int b = 0; b < kRh; ++b) {
              if (b < n_out) AtomicAddTo(out + b * g.row_stride, acc[b]);
            }
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Tiling, on the host.

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// What the tiled kernel needs from the tiling: its runs (kRw, kRh of
// ScatterTiled) and the zero margins they may read (Margin), per axis.
struct RunShape {
  int run_w, run_h, margin_w, margin_h;
};

template <typename S>
RunShape RunShapeOf(int V) {
  if constexpr (S::kGeneric) {
    return {1, 1, 0, 0};
  } else {
    return {RunW(V), kRunH, Margin(S::KW, S::SW), Margin(S::KH, S::SH)};
  }
}

// Chooses the tile for a launch, or returns false when the tiled kernel does
// not apply. V, L: as ScatterTiled's.
//
// Candidates: channel slices of 32, 16, 8 or 4 (NHWC), chunks of W / 2^k
// columns, and for each the tallest band that fits the budget, or several
// whole images. Each is scored by an estimate of its memory traffic per dx
// element: the atomics (twice the halo rows' share, and whole 32-byte sectors
// when a slice of dx elements of dx_size bytes is narrower), the dy loads
// (more with narrower chunks), and a per-tile cost. With `single_atomic`,
// only tilings that give each dx element one atomic: one band per image, or
// bands whose windows share no dx rows.
bool PlanTiles(const PoolAttrs& a, const PoolShape& s, int V, int L,
               const RunShape& run, int acc_size, int dy_size, int dx_size,
               bool single_atomic, int budget, TileGeom* out) {
  const bool nchw = a.layout == kNCHW;
  const int64_t channels = nchw ? 1 : s.channels;
  for (int64_t v : {s.batch, s.channels, s.in_h, s.in_w, s.out_h, s.out_w,
                    a.kernel_h, a.kernel_w, a.stride_h, a.stride_w}) {
    if (v < 1) return false;
  }
  for (int64_t v : {s.in_h, s.in_w, s.out_h, s.out_w, channels, a.kernel_h,
                    a.kernel_w, a.stride_h, a.stride_w, a.pad_top, a.pad_bottom,
                    a.pad_left, a.pad_right}) {
    if (v < 0 || v >= kTileLimit) return false;
  }
  // The divisor's factors, at most the window's extents, must be exact in
  // the accumulator type so that their product rounds as Divisor()'s does.
  if (acc_size == 4 && std::max(a.kernel_h, a.kernel_w) > (int64_t{1} << 24)) {
    return false;
  }
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  const int64_t kh = a.kernel_h, kw = a.kernel_w, sh = a.stride_h,
                sw = a.stride_w;
  const int64_t gm = run.margin_w, tm = run.margin_h;
  const int64_t images = nchw ? s.batch * s.channels : s.batch;
  const int64_t budget_elems = budget / acc_size;
  const int cols = V == 1 ? L : 1;

  int64_t cs_options[4] = {};
  int num_cs = 0;
  for (int64_t c : {32, 16, 8, 4}) {
    const int64_t cs = nchw ? 1 : std::min<int64_t>(c, channels);
    if (cs % V != 0) continue;
    bool seen = false;
    for (int i = 0; i < num_cs; ++i) seen = seen || cs_options[i] == cs;
    if (!seen) cs_options[num_cs++] = cs;
  }

  struct Choice {
    int64_t P, nb, nw, cs, gw, nwT, bands, chunks, rows;
  };
  Choice best{};
  double best_cost = 0;
  bool found = false;
  for (int i = 0; i < num_cs; ++i) {
    const int64_t cs = cs_options[i];
    for (int64_t split = 1;; split *= 2) {
      int64_t nw = CeilDiv(W, split);
      int64_t chunks = CeilDiv(W, nw);
      nw = CeilDiv(W, chunks);
      if (nchw) nw = RoundUp(nw, 4);
      chunks = CeilDiv(W, nw);
      // At most (nw - 1 + kw - 1) / sw + 1 windows meet nw columns.
      const int64_t gw = std::min(OW, (nw + kw - 2) / sw + 1);
      const int64_t nwT = nchw ? RoundUp(nw, 4) : nw;
      // Shared memory: fixed + rows * per_row + images * per_image.
      const int64_t fixed = (gm + tm * nwT) * cs + 3;
      const int64_t per_row = (gw + gm + nwT) * cs;
      const int64_t per_image = tm * nwT * cs;
      const int64_t max_rows = (budget_elems - fixed - per_image) / per_row;
      // The tallest band that fits, then shorter ones for more tiles.
      for (int64_t rows_try = std::min(OH, max_rows); rows_try >= 1;
           rows_try = rows_try == 1 ? 0 : CeilDiv(rows_try, 2)) {
        const int64_t bands = CeilDiv(OH, rows_try);
        const int64_t nb = CeilDiv(OH, bands);
        // Bands whose windows share dx rows add to them twice.
        if (single_atomic && bands > 1 && kh > sh) break;
        // Several images per tile only with whole images (ScatterTiled's
        // step 1 relies on it).
        int64_t P = 1;
        if (bands == 1) {
          P = std::min({(budget_elems - fixed) / (OH * per_row + per_image),
                        int64_t{8}, images,
                        std::max<int64_t>(1, images / 1024)});
          P = std::max<int64_t>(P, 1);
        }
        const int64_t tiles =
            CeilDiv(images, P) * bands * chunks * CeilDiv(channels, cs);
        const int64_t rows = std::min(H, (nb - 1) * sh + kh);
        const double halo =
            bands == 1 ? 1.0
                       : std::max(1.0, static_cast<double>(rows) / (nb * sh));
        const double sector =
            !nchw && cs * dx_size < 32 ? 32.0 / (cs * dx_size) : 1.0;
        const double loads =
            static_cast<double>(gw) / nw / sh * dy_size / acc_size;
        const double per_tile =
            768.0 / (static_cast<double>(P) * nb * sh * nw * cs);
        // Fewer tiles than kTileSlots leave the GPU partly idle.
        const double idle =
            std::max(1.0, static_cast<double>(kTileSlots) / tiles);
        const double cost = (2 * halo * sector + loads + per_tile) * idle;
        if (!found || cost < best_cost) {
          found = true;
          best_cost = cost;
          best = {P, nb, nw, cs, gw, nwT, bands, chunks, rows};
        }
        if (tiles >= kTileSlots) break;
      }
      // Narrower chunks: NCHW rows of at least 128 bytes, NHWC of 8 columns.
      if (nw <= (nchw ? 128 / acc_size : 8) || chunks >= W) break;
    }
  }
  if (!found) return false;

  TileGeom& g = *out;
  g.H = static_cast<int>(H);
  g.W = static_cast<int>(W);
  g.OH = static_cast<int>(OH);
  g.OW = static_cast<int>(OW);
  g.C = static_cast<int>(channels);
  g.kh = static_cast<int>(kh);
  g.kw = static_cast<int>(kw);
  g.sh = static_cast<int>(sh);
  g.sw = static_cast<int>(sw);
  g.pad_top = static_cast<int>(a.pad_top);
  g.pad_bottom = static_cast<int>(a.pad_bottom);
  g.pad_left = static_cast<int>(a.pad_left);
  g.pad_right = static_cast<int>(a.pad_right);
  g.divisor_mode = static_cast<int>(a.divisor_mode);
  g.divisor_override = a.divisor_override;
  const bool padded = a.divisor_mode == kCountPadded;
  g.clip_top = padded ? -g.pad_top : 0;
  g.clip_bottom = padded ? g.H + g.pad_bottom : g.H;
  g.clip_left = padded ? -g.pad_left : 0;
  g.clip_right = padded ? g.W + g.pad_right : g.W;
  g.images = images;
  g.image_stride = H * W * channels;
  g.row_stride = W * channels;
  g.P = static_cast<int>(best.P);
  g.nb = static_cast<int>(best.nb);
  g.nw = static_cast<int>(best.nw);
  g.cs = static_cast<int>(best.cs);
  g.bands = static_cast<int>(best.bands);
  g.chunks = static_cast<int>(best.chunks);
  g.slices = static_cast<int>(CeilDiv(channels, best.cs));
  g.tiles = CeilDiv(images, best.P) * g.bands * g.chunks * g.slices;
  g.cv = g.cs / V;
  g.ps = kThreads / g.cv;
  g.dy_row = OW * channels;
  // Prefetching pays where the reductions are what holds the kernel back:
  // strided windows, whose terms per dx element are few, and float32 NCHW
  // tiles of whole planes. On the H200 (the bench's shapes, CUDA events) it
  // took the float32 scatter from 1.32 to 1.02 times its floor on 3x3/2 and
  // 2x2/2 NCHW, 1.50 to 1.24 in NHWC, 1.26 to 1.14 on 7x7/1 NCHW, and the
  // bfloat16 3x3/2 and 2x2/2 from 1.45-1.50 to 1.27-1.38. Stride-1 windows
  // over bands of rows or channel slices, and 16-bit 7x7/1 planes, went
  // 2-10% slower with it.
  const bool strided = sh > 1 || sw > 1;
  const bool whole_planes =
      nchw && best.bands == 1 && best.chunks == 1 && dx_size == 4;
  g.prefetch =
      (strided || whole_planes) &&
      best.P * best.rows * best.nw * best.cs * dx_size <= kPrefetchLimit;
  g.gw = static_cast<int>(best.gw);
  g.gm = static_cast<int>(gm);
  g.gp = g.gw + g.gm;
  g.nwT = static_cast<int>(best.nwT);
  g.tm = static_cast<int>(tm);
  g.tp = g.nb + g.tm;
  g.t_offset =
      static_cast<int>(RoundUp((gm + best.P * best.nb * g.gp) * best.cs, 4));
  g.smem = g.t_offset + (g.tm + g.P * g.tp) * g.nwT * g.cs;
  g.s1_cols = std::min(g.gw, g.ps);
  g.s1_rows = g.ps / g.s1_cols;
  g.runs_w = static_cast<int>(CeilDiv(best.nw, run.run_w));
  g.runs_h = static_cast<int>(CeilDiv(best.rows, run.run_h));
  g.groups = static_cast<int>(CeilDiv(best.nw, cols));
  g.by_nb = FastDiv::Of(g.nb);
  g.by_runs_w = FastDiv::Of(g.runs_w);
  g.by_runs_h = FastDiv::Of(g.runs_h);
  g.by_groups = FastDiv::Of(g.groups);
  g.by_cv = FastDiv::Of(g.cv);
  g.by_s1_cols = FastDiv::Of(g.s1_cols);
  g.s1_r = g.s1_rows % g.nb;
  g.g_zero = PlanZeros(g.gm * g.cs, g.gp * g.cs, 0, acc_size);
  g.t_zero =
      PlanZeros(g.tm * g.nwT * g.cs, g.tp * g.nwT * g.cs, g.t_offset, acc_size);
  g.by_slices = FastDiv::Of(g.slices);
  g.by_chunks = FastDiv::Of(g.chunks);
  g.by_bands = FastDiv::Of(g.bands);
  return static_cast<int64_t>(g.smem) * acc_size <= budget;
}

bool Aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Plans the tiled kernel's launch for a target of type D, given whether the
// target and dy are aligned to four elements: the vector widths V and L of
// ScatterTiled and the tile, or false when the tiled kernel does not apply.
// The answer depends on the batch only through the tile's shape, never on
// whether the kernel applies.
template <typename T, typename S, typename D>
bool PlanScatterTiles(const PoolAttrs& a, const PoolShape& s,
                      bool target_aligned, bool dy_aligned, int budget, int* V,
                      int* L, TileGeom* g) {
  using Acc = typename Num<T>::Acc;
  constexpr bool kFloat = std::is_same_v<Acc, float>;
  constexpr bool kPairs = !std::is_same_v<D, Acc>;
  static_assert(!kPairs || (kFloat && sizeof(D) == 2));
  *V = *L = 1;
  if (kFloat && target_aligned) {
    if (a.layout == kNCHW) {
      if (s.in_w % 4 == 0) *L = 4;
    } else if (s.channels % 4 == 0 && dy_aligned) {
      *V = *L = 4;
    }
  }
  if (kPairs && *L != 4) return false;
  // Each 16-bit atomic rounds: only where every dx element gets a single one
  // (one band per image, or bands whose windows share no dx rows) is dx its
  // float32 sum rounded once. Where two bands add to a row, the rounded
  // halves of a sum that cancels could be many ulps off.
  return PlanTiles(a, s, *V, *L, RunShapeOf<S>(*V), sizeof(Acc), sizeof(T),
                   sizeof(D), kPairs, budget, g);
}

// Launches the tiled kernel when it applies, after zeroing the `elements` of
// the target; *launched says whether it did. D: the accumulator type, or
// T itself for a 16-bit dx, which takes the tiles' float32 sums rounded, by
// 16-bit atomics on runs of four, with no float32 workspace and no
// narrowing pass: only where every atomic can take an aligned run and every
// dx element gets one atomic.
template <typename T, typename S, typename D>
cudaError_t LaunchTiled(cudaStream_t stream, const PoolAttrs& a,
                        const PoolShape& s, const T* dy, D* target,
                        int64_t elements, int budget, bool* launched) {
  using Acc = typename Num<T>::Acc;
  *launched = false;
  constexpr bool kFloat = std::is_same_v<Acc, float>;
  constexpr bool kPairs = !std::is_same_v<D, Acc>;
  int V, L;
  TileGeom g;
  if (!PlanScatterTiles<T, S, D>(a, s, Aligned(target, 4 * sizeof(D)),
                                 Aligned(dy, 4 * sizeof(T)), budget, &V, &L,
                                 &g)) {
    return cudaSuccess;
  }
  if (cudaError_t e = cudaMemsetAsync(
          target, 0, static_cast<size_t>(elements) * sizeof(D), stream);
      e != cudaSuccess) {
    return e;
  }
  constexpr int kL = kPairs ? 4 : 1;  // pairs need runs of four
  auto kernel = ScatterTiled<T, S, 1, kL, D>;
  if constexpr (kFloat) {
    if (V == 4) {
      kernel = ScatterTiled<T, S, 4, 4, D>;
    } else if (L == 4) {
      kernel = ScatterTiled<T, S, 1, 4, D>;
    }
  }
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>(g.tiles, INT32_MAX));
  kernel<<<blocks, kThreads, g.smem * sizeof(Acc), stream>>>(g, dy, target);
  *launched = true;
  return cudaGetLastError();
}

// Narrows the float32 workspace of a 16-bit scatter into dx.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    Narrow(const float* __restrict__ acc, T* __restrict__ dx,
           const int64_t total) {
  for (int64_t i = FirstThread(); i < total; i += ThreadCount()) {
    dx[i] = Num<T>::Store(acc[i]);
  }
}

// Whether the scatter of 16-bit T needs the float32 workspace, for buffers
// aligned to 16 bytes: where the tiles with 16-bit atomics do not apply.
template <typename T>
bool NeedsWorkspace(const PoolAttrs& a, const PoolShape& s) {
  if (s.batch * s.channels * s.in_h * s.in_w == 0 ||
      s.batch * s.channels * s.out_h * s.out_w == 0) {
    return false;
  }
  return WithSpec(a, [&](auto spec) {
    int V, L;
    TileGeom g;
    return !PlanScatterTiles<T, decltype(spec), T>(a, s, true, true,
                                                   kTileBudget, &V, &L, &g);
  });
}

}  // namespace

bool ScatterNeedsWorkspace(DType dtype, const PoolAttrs& a,
                           const PoolShape& s) {
  if (IsGlobalPool(a, s)) return false;  // the gather's kernels, on dx
  switch (dtype) {
    case DType::kF16:
      return NeedsWorkspace<__half>(a, s);
    case DType::kBF16:
      return NeedsWorkspace<__nv_bfloat16>(a, s);
    default:
      return false;
  }
}

cudaError_t LaunchBackwardScatter(cudaStream_t stream, DType dtype,
                                  const PoolAttrs& a, const PoolShape& s,
                                  const void* dy, void* dx, void* workspace) {
  if (s.batch * s.channels * s.out_h * s.out_w > 0) {
    cudaError_t err = cudaSuccess;
    if (LaunchGlobalPool(stream, dtype, a, s, dy, dx, true, err)) return err;
    if (LaunchAddingGather(stream, dtype, a, s, dy, dx, err)) return err;
  }
  return WithType(dtype, [&](auto tag) {
    using T = decltype(tag);
    using Acc = typename Num<T>::Acc;
    constexpr bool kNarrow = !std::is_same_v<T, Acc>;
    const int64_t elements = s.batch * s.channels * s.in_h * s.in_w;
    if (elements == 0) return cudaSuccess;
    const int64_t outputs = s.batch * s.channels * s.out_h * s.out_w;
    if (outputs == 0) {
      return cudaMemsetAsync(dx, 0, static_cast<size_t>(elements) * sizeof(T),
                             stream);
    }
    const T* in = static_cast<const T*>(dy);
    return WithSpec(a, [&](auto spec) {
      using S = decltype(spec);
      bool launched = false;
      if constexpr (kNarrow) {
        const cudaError_t direct =
            LaunchTiled<T, S, T>(stream, a, s, in, static_cast<T*>(dx),
                                 elements, kTileBudget, &launched);
        if (launched || direct != cudaSuccess) return direct;
        if (workspace == nullptr) return cudaErrorInvalidValue;
      }
      Acc* target = static_cast<Acc*>(kNarrow ? workspace : dx);
      const cudaError_t tiled = LaunchTiled<T, S, Acc>(
          stream, a, s, in, target, elements, kTileBudget, &launched);
      if (tiled != cudaSuccess) return tiled;
      if (!launched) {
        if (cudaError_t e = cudaMemsetAsync(
                target, 0, static_cast<size_t>(elements) * sizeof(Acc), stream);
            e != cudaSuccess) {
          return e;
        }
        // One thread per BLOCK outputs; the kernels take the output count.
        const auto kernel =
            a.layout == kNCHW ? ScatterNchw<T, S> : ScatterNhwc<T, S>;
        const int64_t blocks = Groups(Groups(outputs, S::BLOCK), kThreads);
        kernel<<<static_cast<unsigned>(std::min<int64_t>(blocks, INT32_MAX)),
                 kThreads, 0, stream>>>(a, s, in, target, outputs);
        if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
      }
      if constexpr (!kNarrow) {
        return cudaSuccess;
      } else {
        return Launch(Narrow<T>, stream, elements,
                      static_cast<const float*>(workspace),
                      static_cast<T*>(dx));
      }
    });
  });
}

}  // namespace jax_avgpool::cuda
