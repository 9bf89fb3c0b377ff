// Global average pools: one window over each whole plane (the kernel the
// size of the input, no padding, a 1x1 output), the last pooling of most
// classification networks (ResNet's and DenseNet's 7x7, Inception's 8x8,
// CIFAR ResNets' 4x4). The kernels of the other calls walk a window at a time
// with its bounds and divisor; here every plane is one window of one divisor,
// so the forward is a segmented sum of the input read once, contiguously,
// and the gather writes dx once from one dy element a plane:
//
// - NCHW forward, planes of at most kSmallPlaneBytes: a warp copies the
//   contiguous bytes of 32 planes into its shared memory in 16-byte pieces,
//   then each lane sums one plane (GlobalSumSmallNchw). Larger planes: a warp
//   or more a plane, its threads reading the plane's 16-byte pieces
//   (GlobalSumNchw).
// - NHWC forward: R threads per vector of one image's channels, each summing
//   every R-th pixel, their partial sums added pairwise in a fixed order
//   through shared memory (GlobalSumNhwc).
// - Gathers, both layouts: dx as one flat range of 16-byte pieces, each
//   filled with dy / divisor of the planes (NCHW) or the channels (NHWC) it
//   covers (GlobalSpreadNchw, GlobalSpreadNhwc).
//
// The scatter of such calls runs the gather (LaunchBackwardScatter): windows
// that do not overlap leave it nothing to add, so it writes each dx element
// once, as the gather does, without zeroing dx first.
//
// Each result divides by the divisor, as the CPU kernels do; the gathers'
// results are the CPU's bit for bit.
#include <cstdint>

#include "cuda_common.cuh"

namespace jax_avgpool::cuda {
namespace {

// Planes of up to 512 bytes (float64 7x7 and 8x8, 16-bit 14x14) take the
// kernel of small planes, with fewer warps a block where four warps'
// staging would not fit 48 KiB. Before, planes over 352 bytes took a warp
// each (GlobalSumNchw), which read them at a third of the bandwidth (H200,
// float64 128x2048x7x7: 69.5 us against 29.2 now; 64x1024x8x8: 17.9
// against 12.0).
constexpr int kSmallPlaneBytes = 512;
constexpr int kWarpsPerBlock = 4;  // at most
constexpr int kSmallStaging = 48 * 1024;
// Threads that fill an H200 (2048 resident on each of 132 multiprocessors).
constexpr int64_t kFillThreads = 132 * 2048;

// The divisor of the one window of a global pool.
template <typename Acc>
Acc GlobalDivisor(const PoolAttrs& a, const PoolShape& s) {
  const Window wh = WindowAt(0, s.in_h, a.kernel_h, a.stride_h, 0, 0);
  const Window ww = WindowAt(0, s.in_w, a.kernel_w, a.stride_w, 0, 0);
  return static_cast<Acc>(Divisor(a, wh, ww));
}

// (i / n, i % n) by FastDiv where i and n fit 31 bits, else by division.
__device__ __forceinline__ Split2 QuotRem(int64_t i, int64_t n,
                                          const FastDiv& by_n) {
  if (i <= INT32_MAX && n <= INT32_MAX) {
    const int q = by_n(static_cast<int>(i));
    return {q, i - static_cast<int64_t>(q) * n};
  }
  const int64_t q = i / n;
  return {q, i - q * n};
}

// NCHW forward, planes of at most kSmallPlaneBytes. Warp w of the grid takes
// planes [32 w, 32 w + 32): it copies their bytes, one contiguous range of
// x, into its part of shared memory in 16-byte pieces (cp.async, all in
// flight at once; aligned down to 16 bytes at the range's start; the bytes
// past the last whole piece of x element by element), then lane l sums
// plane 32 w + l. Lane l starts its
// walk of the plane at element l mod hw, so that the lanes' reads fall on
// different banks whatever the plane size (planes of 64 elements would
// otherwise put all 32 lanes on one bank).
template <typename T>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    GlobalSumSmallNchw(const T* __restrict__ x, T* __restrict__ y,
                       const int64_t planes, const int hw, const int warp_bytes,
                       const typename Num<T>::Acc divisor) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  extern __shared__ __align__(16) unsigned char global_shared[];
  const int lane = static_cast<int>(threadIdx.x & 31);
  unsigned char* const mine =
      global_shared + static_cast<int>(threadIdx.x >> 5) * warp_bytes;
  const int64_t warp = FirstThread() >> 5;
  const int64_t warps = ThreadCount() >> 5;
  const uintptr_t base = reinterpret_cast<uintptr_t>(x);
  const uintptr_t x_end =
      base + static_cast<uintptr_t>(planes) * hw * sizeof(T);
  const uintptr_t whole_end = x_end & ~uintptr_t{15};
  for (int64_t w = warp; 32 * w < planes; w += warps) {
    const int64_t p0 = 32 * w;
    const int np = static_cast<int>(planes - p0 < 32 ? planes - p0 : 32);
    const uintptr_t begin = base + static_cast<uintptr_t>(p0) * hw * sizeof(T);
    const uintptr_t end = begin + static_cast<uintptr_t>(np) * hw * sizeof(T);
    const uintptr_t from = begin & ~uintptr_t{15};
    // Whole pieces of x that hold bytes of the range.
    const uintptr_t up = (end + 15) & ~uintptr_t{15};
    const uintptr_t pieces_end = up < whole_end ? up : whole_end;
    const int pieces =
        pieces_end > from ? static_cast<int>((pieces_end - from) >> 4) : 0;
    for (int i = lane; i < pieces; i += 32) {
      CopyAsync<16>(
          mine + 16 * i,
          reinterpret_cast<const void*>(from + 16 * static_cast<uintptr_t>(i)),
          true);
    }
    // The range's bytes past them, at the end of x.
    const uintptr_t tail = from + 16 * static_cast<uintptr_t>(pieces);
    if (tail < end) {
      const int n = static_cast<int>((end - tail) / sizeof(T));
      for (int i = lane; i < n; i += 32) {
        reinterpret_cast<T*>(mine + (tail - from))[i] =
            reinterpret_cast<const T*>(tail)[i];
      }
    }
    CopyWait<0>();
    __syncwarp();
    if (lane < np) {
      const T* plane =
          reinterpret_cast<const T*>(mine + (begin - from)) + lane * hw;
      int e = lane % hw;
      Acc acc = Acc(0);
      for (int i = 0; i < hw; ++i) {
        acc += N::Load(plane[e]);
        e = e + 1 == hw ? 0 : e + 1;
      }
      y[p0 + lane] = N::Store(acc / divisor);
    }
    __syncwarp();
  }
}

// NCHW forward, larger planes: `group` threads (a multiple of 32 dividing
// kThreads) per plane, so that a few planes still fill the card. Thread t of
// a plane's group takes the 16-byte pieces t, t + group, ... of x that hold
// bytes of the plane, adding the elements that lie in it; the threads' sums
// are then added in a fixed order: by shuffles within each warp, then the
// warps' through shared memory.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    GlobalSumNchw(const T* __restrict__ x, T* __restrict__ y,
                  const int64_t planes, const int64_t hw, const int group,
                  const typename Num<T>::Acc divisor) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  constexpr int V = kWide<T>;
  __shared__ Acc warp_sums[kThreads / 32];
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int t = static_cast<int>(threadIdx.x) % group;
  const int per_block = kThreads / group;
  const int64_t step = static_cast<int64_t>(gridDim.x) * per_block;
  for (int64_t p0 = static_cast<int64_t>(blockIdx.x) * per_block; p0 < planes;
       p0 += step) {
    const int64_t p = p0 + static_cast<int>(threadIdx.x) / group;
    Acc acc = Acc(0);
    if (p < planes) {
      const int64_t first = p * hw, last = first + hw;  // [first, last)
      const int64_t e0 = first & ~int64_t{V - 1};       // x is 16-byte aligned
      for (int64_t e = e0 + int64_t{t} * V; e < last; e += int64_t{group} * V) {
        if (e >= first && e + V <= last) {
          const Vec<T, V> v = *reinterpret_cast<const Vec<T, V>*>(x + e);
#pragma unroll
          for (int k = 0; k < V; ++k) acc += N::Load(v.v[k]);
        } else {
          // A piece the plane shares with its neighbours: its elements
          // [lo, hi) (last <= the elements of x, so none past its end).
          const int lo = e < first ? static_cast<int>(first - e) : 0;
          const int hi = last - e < V ? static_cast<int>(last - e) : V;
#pragma unroll
          for (int k = 0; k < V; ++k) {
            if (k >= lo && k < hi) acc += N::Load(x[e + k]);
          }
        }
      }
    }
#pragma unroll
    for (int d = 16; d > 0; d /= 2) {
      acc += __shfl_xor_sync(0xffffffffu, acc, d);
    }
    if (group > 32) {
      if (lane == 0) warp_sums[threadIdx.x / 32] = acc;
      __syncthreads();
      if (t == 0) {
        for (int w = 1; w < group / 32; ++w) {
          acc += warp_sums[threadIdx.x / 32 + w];
        }
      }
      __syncthreads();
    }
    const Acc mean = acc / divisor;
    if (t == 0 && p < planes) y[p] = N::Store(mean);
  }
}

// NHWC forward: an item is (image n, vector v of V channels); `parts`
// threads (a power of two, dividing kThreads) share each item, thread r
// summing pixels r, r + parts, ...; the parts are then added pairwise
// through shared memory, in a fixed order, and part 0 stores. Items of a block
// are adjacent vectors, so a warp's loads of one pixel are contiguous.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    GlobalSumNhwc(const T* __restrict__ x, T* __restrict__ y,
                  const int64_t images, const int64_t hw, const int64_t cv,
                  const FastDiv by_cv, const int parts,
                  const typename Num<T>::Acc divisor) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  using VecT = Vec<T, V>;
  extern __shared__ __align__(16) unsigned char global_shared[];
  Acc* const partial = reinterpret_cast<Acc*>(global_shared);
  const int per_block = kThreads / parts;
  const int slot = static_cast<int>(threadIdx.x) % per_block;
  const int r = static_cast<int>(threadIdx.x) / per_block;
  const int64_t items = images * cv;
  const int64_t C = cv * V;
  for (int64_t i0 = static_cast<int64_t>(blockIdx.x) * per_block; i0 < items;
       i0 += static_cast<int64_t>(gridDim.x) * per_block) {
    const int64_t item = i0 + slot;
    Acc acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = Acc(0);
    if (item < items) {
      const Split2 nv = QuotRem(item, cv, by_cv);
      const int64_t n = nv.quot, v = nv.rem;
      const T* p = x + n * hw * C + v * V;
      // Eight pixels' loads in flight at a time.
      for (int64_t pix0 = r; pix0 < hw; pix0 += 8 * int64_t{parts}) {
        VecT u[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int64_t pix = pix0 + j * int64_t{parts};
          u[j] = LoadOrZero<T, V>(p + (pix < hw ? pix : 0) * C, pix < hw);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int k = 0; k < V; ++k) acc[k] += N::Load(u[j].v[k]);
        }
      }
    }
    if (parts > 1) {
      // Halving: part r adds part r + h, for h = parts / 2, ..., 1.
      Acc* const mine = partial + (r * per_block + slot) * V;
#pragma unroll
      for (int k = 0; k < V; ++k) mine[k] = acc[k];
      for (int h = parts / 2; h > 0; h /= 2) {
        __syncthreads();
        if (r < h) {
          const Acc* const other = mine + h * per_block * V;
#pragma unroll
          for (int k = 0; k < V; ++k) mine[k] = acc[k] += other[k];
        }
      }
      __syncthreads();
    }
    if (r == 0 && item < items) {
      VecT out;
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = N::Store(acc[k] / divisor);
      *reinterpret_cast<VecT*>(y + item * V) = out;
    }
  }
}

// Gathers: dx as flat pieces of V elements (16 bytes, or 1 element where dx
// is not aligned for them). Element e of dx takes dy[e / run] / divisor for
// NCHW (run = h * w: one dy element a plane). For NHWC, element e of image
// n, channel c, takes dy[n * C + c]: with q = e / C, c = e - q * C and
// n = q / hw. A piece spans at most two planes (NCHW) where run >= V, else
// the element's plane is stepped to one element at a time; in NHWC a piece
// lies in one pixel (C is a multiple of V).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    GlobalSpreadNchw(const T* __restrict__ dy, T* __restrict__ dx,
                     const int64_t elements, const int64_t run,
                     const FastDiv by_run, const int64_t planes,
                     const typename Num<T>::Acc divisor, const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  for (int64_t item = FirstThread(); item < total; item += ThreadCount()) {
    const int64_t e0 = item * V;
    const Split2 at = QuotRem(e0, run, by_run);
    int64_t p = at.quot, off = at.rem;
    Acc out[V];
    if (run >= V) {
      // Planes p and p + 1 at most.
      const Acc g0 = N::Load(dy[p]) / divisor;
      const Acc g1 = p + 1 < planes ? N::Load(dy[p + 1]) / divisor : Acc(0);
#pragma unroll
      for (int k = 0; k < V; ++k) out[k] = off + k < run ? g0 : g1;
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        out[k] = p < planes ? N::Load(dy[p]) / divisor : Acc(0);
        if (++off == run) off = 0, ++p;
      }
    }
    if (e0 + V <= elements) {
      Vec<T, V> vec;
#pragma unroll
      for (int k = 0; k < V; ++k) vec.v[k] = N::Store(out[k]);
      *reinterpret_cast<Vec<T, V>*>(dx + e0) = vec;
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if (e0 + k < elements) dx[e0 + k] = N::Store(out[k]);
      }
    }
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    GlobalSpreadNhwc(const T* __restrict__ dy, T* __restrict__ dx,
                     const int64_t C, const int64_t hw, const FastDiv by_c,
                     const FastDiv by_hw, const typename Num<T>::Acc divisor,
                     const int64_t total) {
  using N = Num<T>;
  using Acc = typename N::Acc;
  using VecT = Vec<T, V>;
  for (int64_t item = FirstThread(); item < total; item += ThreadCount()) {
    const int64_t e0 = item * V;
    const Split2 qc = QuotRem(e0, C, by_c);  // (n * hw + pixel, c)
    const int64_t n = QuotRem(qc.quot, hw, by_hw).quot;
    const VecT g = *reinterpret_cast<const VecT*>(dy + n * C + qc.rem);
    VecT out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.v[k] = N::Store(N::Load(g.v[k]) / divisor);
    *reinterpret_cast<VecT*>(dx + e0) = out;
  }
}

// Launch's flat grid of `total` work items, capped at the blocks that stay
// resident together: each thread loops over several items, which keeps
// more of dx's stores in flight than blocks that each end after one.
template <typename... KArgs, typename... Args>
cudaError_t LaunchResident(void (*kernel)(KArgs...), cudaStream_t stream,
                           int64_t total, Args... args) {
  if (total == 0) return cudaSuccess;
  int64_t resident = 0;
  if (cudaError_t e = ResidentBlocks(kernel, kThreads, 0, resident);
      e != cudaSuccess) {
    return e;
  }
  const int64_t blocks = std::min<int64_t>(
      std::min(Groups(total, kThreads), std::max<int64_t>(resident, 1)),
      INT32_MAX);
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args...,
                                                                 total);
  return cudaGetLastError();
}

// A FastDiv by n where n fits, else an unused one (QuotRem divides then).
FastDiv FastDivOf(int64_t n) {
  return FastDiv::Of(n <= INT32_MAX ? static_cast<uint32_t>(n) : 1u);
}

bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

template <typename T>
cudaError_t LaunchGlobalForward(cudaStream_t stream, const PoolAttrs& a,
                                const PoolShape& s, const T* x, T* y) {
  using Acc = typename Num<T>::Acc;
  const Acc divisor = GlobalDivisor<Acc>(a, s);
  const int64_t hw = s.in_h * s.in_w;
  if (a.layout == kNCHW) {
    const int64_t planes = s.batch * s.channels;
    const int64_t bytes = hw * static_cast<int64_t>(sizeof(T));
    if (bytes <= kSmallPlaneBytes) {
      // 32 planes a warp, and up to 15 bytes before the range's start and
      // after its end in its first and last pieces.
      const int warp_bytes = static_cast<int>(32 * bytes + 32);
      // As many blocks as stay resident, each warp looping over groups of
      // planes: the warps drift apart, some copying while others sum.
      const int warps = std::min(kWarpsPerBlock, kSmallStaging / warp_bytes);
      const size_t smem = static_cast<size_t>(warps) * warp_bytes;
      int64_t resident = 0;
      if (cudaError_t e = ResidentBlocks(GlobalSumSmallNchw<T>,
                                         32 * warps, smem, resident);
          e != cudaSuccess) {
        return e;
      }
      const int64_t blocks =
          std::min<int64_t>(std::min(Groups(Groups(planes, 32), warps),
                                     std::max<int64_t>(resident, 1)),
                            INT32_MAX);
      GlobalSumSmallNchw<T>
          <<<static_cast<unsigned>(blocks), 32 * warps, smem,
             stream>>>(x, y, planes, static_cast<int>(hw), warp_bytes, divisor);
      return cudaGetLastError();
    }
    // Threads per plane: a warp, or more where that fills the card, up to
    // a block, each thread with at least 8 pieces of the plane.
    int group = 32;
    while (group < kThreads && planes * group < kFillThreads &&
           hw * static_cast<int64_t>(sizeof(T)) >= 2 * 16 * 8 * group) {
      group *= 2;
    }
    const int64_t blocks =
        std::min<int64_t>(Groups(planes, kThreads / group), INT32_MAX);
    GlobalSumNchw<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        x, y, planes, hw, group, divisor);
    return cudaGetLastError();
  }
  // NHWC: parts per item, up to enough threads to fill the card, at most a
  // block, each part with at least 8 pixels (a round of its loads).
  const auto launch = [&](auto v) {
    constexpr int V = decltype(v)::value;
    const int64_t cv = s.channels / V;
    const int64_t items = s.batch * cv;
    int parts = 1;
    while (parts < kThreads && items * parts < kFillThreads &&
           hw >= 16 * int64_t{parts}) {
      parts *= 2;
    }
    const int per_block = kThreads / parts;
    const int64_t blocks =
        std::min<int64_t>(Groups(items, per_block), INT32_MAX);
    const size_t smem = parts > 1 ? kThreads * V * sizeof(Acc) : 0;
    GlobalSumNhwc<T, V>
        <<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
            x, y, s.batch, hw, cv, FastDivOf(cv), parts, divisor);
    return cudaGetLastError();
  };
  if (CanVectorise<T>(s, x, y)) {
    return launch(std::integral_constant<int, kWide<T>>{});
  }
  return launch(std::integral_constant<int, 1>{});
}

template <typename T>
cudaError_t LaunchGlobalGather(cudaStream_t stream, const PoolAttrs& a,
                               const PoolShape& s, const T* dy, T* dx) {
  using Acc = typename Num<T>::Acc;
  const Acc divisor = GlobalDivisor<Acc>(a, s);
  const int64_t hw = s.in_h * s.in_w;
  const int64_t elements = s.batch * s.channels * hw;
  constexpr int kV = kWide<T>;
  if (a.layout == kNCHW) {
    if (Aligned16(dx)) {
      return LaunchResident(GlobalSpreadNchw<T, kV>, stream,
                            Groups(elements, kV), dy, dx, elements, hw,
                            FastDivOf(hw), s.batch * s.channels, divisor);
    }
    return LaunchResident(GlobalSpreadNchw<T, 1>, stream, elements, dy, dx,
                          elements, hw, FastDivOf(hw), s.batch * s.channels,
                          divisor);
  }
  const auto launch = [&](auto v) {
    constexpr int V = decltype(v)::value;
    return LaunchResident(GlobalSpreadNhwc<T, V>, stream, elements / V, dy, dx,
                          s.channels, hw, FastDivOf(s.channels), FastDivOf(hw),
                          divisor);
  };
  if (CanVectorise<T>(s, dy, dx)) {
    return launch(std::integral_constant<int, kWide<T>>{});
  }
  return launch(std::integral_constant<int, 1>{});
}

}  // namespace

bool IsGlobalPool(const PoolAttrs& a, const PoolShape& s) {
  return s.out_h == 1 && s.out_w == 1 && a.kernel_h == s.in_h &&
         a.kernel_w == s.in_w && a.pad_top == 0 && a.pad_bottom == 0 &&
         a.pad_left == 0 && a.pad_right == 0 && s.in_h * s.in_w <= INT32_MAX;
}

bool LaunchGlobalPool(cudaStream_t stream, DType dtype, const PoolAttrs& a,
                      const PoolShape& s, const void* src, void* dst,
                      bool gather, cudaError_t& error) {
  if (!IsGlobalPool(a, s)) return false;
  // The NCHW forward reads x in 16-byte pieces (XLA's buffers are aligned).
  if (!gather && a.layout == kNCHW && !Aligned16(src)) return false;
  if (s.batch * s.channels * s.in_h * s.in_w == 0) {
    error = cudaSuccess;
    return true;
  }
  error = WithType(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(src);
    T* out = static_cast<T*>(dst);
    return gather ? LaunchGlobalGather<T>(stream, a, s, in, out)
                  : LaunchGlobalForward<T>(stream, a, s, in, out);
  });
  return true;
}

}  // namespace jax_avgpool::cuda
