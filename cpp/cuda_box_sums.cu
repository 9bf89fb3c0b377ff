// The float32 NHWC stride-1 box filter (7x7/1) with few instructions per
// element: sums along W first, from source rows staged in shared memory,
// then down H by sums over blocks of KH rows held in registers.
//
// A block takes 64 channels of one image (two a lane, so that a warp reads
// one 256-byte pixel at a time) and a window of destination columns,
// walking all its rows. Its source rows come through a ring of D rows in
// shared memory (cp.async, D - 1 rows ahead, one barrier a row); the pixels
// of a ring row that lie outside the source stay zeros. The warp of strip w
// takes SW destination columns: from the SW + KW - 1 pixels under them it
// takes the SW window sums along W (SlidingSums: 13 additions for four
// 7-wide windows), one row sum per column and channel.
//
// Down H, with the source rows numbered t from the first window's top row
// (rows outside the source add zeros), destination row o sums the row sums
// of t = o .. o + KH - 1. Cut t into blocks of KH rows: the window of o =
// b * KH + j is the suffix of block b from j and the prefix of block b + 1
// before j. Each thread keeps the suffix sums of the last block in a ring of
// KH registers a column and channel, and the running prefix of the block it
// is reading: per row one addition for the prefix, one for the result, and
// KH - 1 per block for the suffixes. Only additions of the row sums, so an
// infinity or NaN reaches exactly the windows that hold it.
//
// On the H200 (CUDA events, us, forward / gather, against BoxNhwc, which
// sums down H first, seven additions an element, and then along W through
// shared memory): 64x28x28x512 48.0 / 48.3 against 48.1 / 53.0; with padding
// 3, 58.2 / 58.0 against 61.2 / 60.8; 128x56x56x256 with padding 3, 220.8 /
// 218.8 against 246.1 / 245.6. Forms with strips of 2 columns (half the
// registers, twice the warps) or a ring of 4 rows took within 1-2% of these.
// The same kernel for 16-bit types (pairs of channels widened from one
// 4-byte load) was slower than the tensor-core box filter of
// cuda_box_mma.cu: bfloat16 64x28x28x512 34.7 / 39.1 against 27.1 / 30.3.
//
// A block zeroes the ring's pixels outside the source while its first rows
// are copied in, over those pixels alone (it once walked every ring piece,
// dividing by the ring's width at run time, before the copies: 6% of the
// gather's instructions): the gather of 64x28x28x512, 64 calls from a CUDA
// graph, 46.02-46.07 us against 46.76-46.83, the same outputs bit for bit.
#include <algorithm>

#include "cuda_common.cuh"

namespace jax_avgpool::cuda {
namespace {

// Destination columns a warp takes (a strip), source rows the ring holds
// (D - 1 of them in flight ahead of the one summed), and warps a block at
// most: two blocks a multiprocessor by registers.
constexpr int kSumsStrip = 4;
constexpr int kSumsRing = 8;
constexpr int kSumsMaxWarps = 8;

// The images' geometry: the call's, at run time, or fixed at compile time
// for a common one (the launcher's list), so that the compiler folds the
// rows, columns and offsets into constants: source and destination images,
// the lead rows and columns of the first window (lead_h, lead_w) and the
// destination columns of a block's window.
struct SumsRuntime {
  static constexpr bool kFixed = false;
  static constexpr int kSrcH = 0, kSrcW = 0, kDstH = 0, kDstW = 0;
  static constexpr int kLeadH = 0, kLeadW = 0, kWin = 0;
};
template <int kSH, int kSW, int kDH, int kDW, int kLH, int kLW>
struct SumsFixed {
  static constexpr bool kFixed = true;
  static constexpr int kSrcH = kSH, kSrcW = kSW, kDstH = kDH, kDstW = kDW;
  static constexpr int kLeadH = kLH, kLeadW = kLW, kWin = kDW;
};

template <typename S, int SW, int D, bool kGather, typename G = SumsRuntime>
__global__ void __launch_bounds__(kSumsMaxWarps * 32, 2)
    BlockSumsNhwc(const PoolAttrs a, const PoolShape s,
                  const float* __restrict__ src, float* __restrict__ dst,
                  const int call_win, const SharedFactor<float> shared,
                  const int64_t items) {
  constexpr int KH = S::KH, KW = S::KW;
  using T = float;
  constexpr int kPixel = 64 * static_cast<int>(sizeof(T));
  constexpr int kPieces = kPixel / 16;
  constexpr int NV = SW + KW - 1;  // pixels under a strip
  static_assert(NhwcBox<S>() && (D & (D - 1)) == 0 && D >= 2);
  extern __shared__ __align__(16) unsigned char sums_ring[];
  const int H = static_cast<int>(s.in_h), W = static_cast<int>(s.in_w);
  constexpr bool kFixed = G::kFixed;
  const int src_h =
      kFixed ? G::kSrcH : static_cast<int>(kGather ? s.out_h : s.in_h);
  const int src_w =
      kFixed ? G::kSrcW : static_cast<int>(kGather ? s.out_w : s.in_w);
  const int dst_h =
      kFixed ? G::kDstH : static_cast<int>(kGather ? s.in_h : s.out_h);
  const int dst_w =
      kFixed ? G::kDstW : static_cast<int>(kGather ? s.in_w : s.out_w);
  const int lead_h =
      kFixed ? G::kLeadH
             : static_cast<int>(kGather ? KH - 1 - a.pad_top : a.pad_top);
  const int lead_w =
      kFixed ? G::kLeadW
             : static_cast<int>(kGather ? KW - 1 - a.pad_left : a.pad_left);
  const int win = kFixed ? G::kWin : call_win;
  const int64_t C = s.channels, slabs = C / 64;
  const int nwin = (dst_w + win - 1) / win;
  // Ring rows of whole strips: the last strip's pixels past the window's
  // are zeros.
  const int ncol = (win + SW - 1) / SW * SW + KW - 1;
  const int row_bytes = ncol * kPixel;
  // 1 / row factor of each destination row (forward, unless shared), after
  // the ring.
  float* const row_f = reinterpret_cast<float*>(sums_ring + D * row_bytes);
  const int threads = static_cast<int>(blockDim.x);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, u0 = (tid >> 5) * SW;
  // Rows numbered t: destination row o sums t = o .. o + KH - 1; t holds
  // source row t - lead_h, loaded for t in [t_lo, t_hi).
  const int t_lo = lead_h > 0 ? lead_h : 0;
  const int t_hi = std::min(dst_h + KH - 1, src_h + lead_h);
  const int nload = t_hi > t_lo ? t_hi - t_lo : 0;
  // The same for every item: written once, read after the first row's
  // barrier.
  if (!kGather && !shared.all) {
    for (int o = tid; o < dst_h; o += threads) {
      row_f[o] = Reciprocal(WindowFactor<float>(
          a, WindowAt(o, H, KH, 1, a.pad_top, a.pad_bottom), true));
    }
  }
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t slab = item % slabs, rest = item / slabs;
    const int w0 = static_cast<int>(rest % nwin) * win;
    const int64_t n = rest / nwin;
    const int cols = std::min(win, dst_w - w0);
    // Ring pixel u holds source column c0 + u; those in the source are
    // [ua, ub), the others zeros.
    const int c0 = w0 - lead_w;
    const int ua = c0 < 0 ? -c0 : 0;
    const int ub = std::min(cols + KW - 1, src_w - c0);
    const int npieces = ub > ua ? (ub - ua) * kPieces : 0;
    // The first loaded row's first in-source pixel, this slab.
    const T* const first =
        src + ((n * src_h + (t_lo - lead_h)) * src_w + (c0 + ua)) * C +
        slab * 64;
    const unsigned ring_at =
        static_cast<unsigned>(__cvta_generic_to_shared(sums_ring));
    const auto copy = [&](int k) {
      if (k < nload) {
        const T* const row = first + static_cast<int64_t>(k) * src_w * C;
        const unsigned to = ring_at + (k & (D - 1)) * row_bytes + ua * kPixel;
        for (int i = tid; i < npieces; i += threads) {
          const int u = i / kPieces, p = i % kPieces;
          StartCopyTo<16, false>(to + u * kPixel + p * 16,
                                 row + u * C + p * (16 / sizeof(T)), true);
        }
      }
      CommitCopies();
    };
#pragma unroll
    for (int d = 0; d + 1 < D; ++d) copy(d);
    // The ring's pixels outside the source, [0, ua) and [max(ua, ub),
    // ncol), zeroed while the first rows are copied in (the copies write
    // only [ua, ub)).
    const int zhi = std::max(ua, ub), nzero = ua + ncol - zhi;
    for (int i = tid; i < nzero * kPieces; i += threads) {
      const int j = i / kPieces, p = i % kPieces;
      const int u = j < ua ? j : j - ua + zhi;
#pragma unroll
      for (int d = 0; d < D; ++d) {
        *reinterpret_cast<uint4*>(sums_ring + d * row_bytes + u * kPixel +
                                  p * 16) = make_uint4(0, 0, 0, 0);
      }
    }
    const bool active = u0 < cols;
    // 1 / column factor of this thread's destination columns (forward).
    float cf[SW];
#pragma unroll
    for (int i = 0; i < SW; ++i) {
      cf[i] =
          kGather || shared.all
              ? 1.0f
              : Reciprocal(WindowFactor<float>(
                    a, WindowAt(w0 + u0 + i, W, KW, 1, a.pad_left, a.pad_right),
                    false));
    }
    const T* const lane_ring =
        reinterpret_cast<const T*>(sums_ring + u0 * kPixel) + 2 * lane;
    // Destination row o = t - KH: q moves down a row with each t.
    const int64_t q_step = static_cast<int64_t>(dst_w) * C;
    T* q =
        dst + ((n * dst_h - KH) * dst_w + w0 + u0) * C + slab * 64 + 2 * lane;
    float ring[KH][SW][2], pre[SW][2];
    FillZero(ring);
    FillZero(pre);
    int k = 0;                     // loaded rows taken so far
    const int t_end = dst_h + KH;  // rows up to the last destination row's
    for (int t0 = 0; t0 < t_end; t0 += KH) {
#pragma unroll
      for (int j = 0; j < KH; ++j) {
        const int t = t0 + j;
        if (t >= t_end) break;
        float h[SW][2];
        FillZero(h);
        if (t >= t_lo && t < t_hi) {
          CopyWait<D - 2>();
          __syncthreads();
          copy(k + D - 1);
          if (active) {
            const T* const at =
                lane_ring + (k & (D - 1)) * (row_bytes / sizeof(T));
            float2 v[NV];
#pragma unroll
            for (int i = 0; i < NV; ++i) {
              v[i] = *reinterpret_cast<const float2*>(at + i * 64);
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float r[SW];
              SlidingSums<KW, SW>(
                  [&](int i) { return e == 0 ? v[i].x : v[i].y; }, r);
#pragma unroll
              for (int i = 0; i < SW; ++i) h[i][e] = r[i];
            }
          }
          ++k;
        }
        if (t >= KH && active) {
          float f = shared.value;
          if (!kGather && !shared.all) f = row_f[t - KH];
#pragma unroll
          for (int i = 0; i < SW; ++i) {
            if (u0 + i < cols) {
              const float g = kGather || shared.all ? f : f * cf[i];
              const float x = j > 0 ? ring[j][i][0] + pre[i][0] : ring[j][i][0];
              const float y = j > 0 ? ring[j][i][1] + pre[i][1] : ring[j][i][1];
              *reinterpret_cast<float2*>(q + i * C) = make_float2(x * g, y * g);
            }
          }
        }
        q += q_step;
#pragma unroll
        for (int i = 0; i < SW; ++i) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            pre[i][e] = j > 0 ? pre[i][e] + h[i][e] : h[i][e];
            ring[j][i][e] = h[i][e];
          }
        }
      }
#pragma unroll
      for (int j = KH - 2; j >= 0; --j) {
#pragma unroll
        for (int i = 0; i < SW; ++i) {
#pragma unroll
          for (int e = 0; e < 2; ++e) ring[j][i][e] += ring[j + 1][i][e];
        }
      }
    }
    CopyWait<0>();
    __syncthreads();
  }
}

}  // namespace

template <bool kGather>
bool LaunchBlockSumsNhwc(cudaStream_t stream, const PoolAttrs& a,
                         const PoolShape& s, const float* src, float* dst,
                         cudaError_t& error) {
  return WithSpec(a, [&](auto spec) {
    using S = decltype(spec);
    if constexpr (!NhwcBox<S>()) {
      return false;
    } else {
      constexpr int SW = kSumsStrip, D = kSumsRing;
      const SharedFactor<float> shared = SharedFactorOf<float>(a, s);
      const int64_t dst_h = kGather ? s.in_h : s.out_h;
      const int64_t dst_w = kGather ? s.in_w : s.out_w;
      const int64_t src_h = kGather ? s.out_h : s.in_h;
      const int64_t src_w = kGather ? s.out_w : s.in_w;
      const bool row_factors = !kGather && !shared.all;
      if ((kGather && !shared.all) || s.channels % 64 != 0 ||
          !CanVectorise<float>(s, src, dst) || a.pad_top >= S::KH ||
          a.pad_bottom >= S::KH || a.pad_left >= S::KW ||
          a.pad_right >= S::KW || dst_h > (row_factors ? 4096 : 1 << 24) ||
          dst_w > (1 << 24) || src_h > (1 << 24) || src_w > (1 << 24)) {
        return false;
      }
      auto kernel = BlockSumsNhwc<S, SW, D, kGather>;
      // The forward of 28x28 images under 7x7 windows without padding:
      // fixed at compile time. H200, 64x28x28x512, 64 calls replayed from
      // a CUDA graph, best of seven, three runs each: 45.52-45.55 us
      // against 46.43-46.49, the same outputs bit for bit. The gather's
      // fixed form (22x22 dy) was slower, 47.87-47.97 against 46.79-46.83,
      // as was float32 StripsNchw's for the NCHW gather, 47.55 against
      // 46.15-46.28.
      if constexpr (!kGather && S::KH == 7 && S::KW == 7) {
        if (s.in_h == 28 && s.in_w == 28 && s.out_h == 22 && s.out_w == 22 &&
            a.pad_top == 0 && a.pad_left == 0) {
          kernel =
              BlockSumsNhwc<S, SW, D, false, SumsFixed<28, 28, 22, 22, 0, 0>>;
        }
      }
      // cp.async: compiled for sm_80 or later, as the code the device runs.
      const KernelCode code = CodeOf(kernel);
      if (code.ptx < 80 || code.binary < 80) return false;
      const int64_t nwin = Groups(dst_w, kSumsMaxWarps * SW);
      const int win = static_cast<int>(Groups(dst_w, static_cast<int>(nwin)));
      const int threads = static_cast<int>(Groups(win, SW)) * 32;
      const int64_t items = s.batch * nwin * (s.channels / 64);
      if (items == 0) return true;
      const size_t smem = static_cast<size_t>(D) *
                              (threads / 32 * SW + S::KW - 1) * 64 *
                              sizeof(float) +
                          (row_factors ? dst_h * sizeof(float) : 0);
      // A block walks every row of its image: with fewer items than the
      // blocks resident together the card is not filled, and the other
      // kernels, whose items are segments of rows, are faster (H200, us:
      // 2x230x230x64 at padding 3, 16 items, 109 against 24).
      int64_t resident = 0;
      error = AllowSharedMemory(kernel, smem);
      if (error == cudaSuccess) {
        error = ResidentBlocks(kernel, threads, smem, resident);
      }
      if (error != cudaSuccess) return true;
      if (items < resident) return false;
      const unsigned grid =
          static_cast<unsigned>(std::min<int64_t>(items, INT32_MAX));
      kernel<<<grid, threads, smem, stream>>>(a, s, src, dst, win, shared,
                                              items);
      error = cudaGetLastError();
      return true;
    }
  });
}

template bool LaunchBlockSumsNhwc<false>(cudaStream_t, const PoolAttrs&,
                                         const PoolShape&, const float*, float*,
                                         cudaError_t&);
template bool LaunchBlockSumsNhwc<true>(cudaStream_t, const PoolAttrs&,
                                        const PoolShape&, const float*, float*,
                                        cudaError_t&);

}  // namespace jax_avgpool::cuda
