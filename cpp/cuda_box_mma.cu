// The stride-1 box filter of 16-bit types on the tensor cores: in NHWC the
// forward and the gather of windows 4 to 9 columns wide (7x7/1), where
// BoxNhwc (cuda_kernels.cu) spends most of its time on the instructions of
// its sums; in NCHW the forward of such windows over planes with rows of 18
// to 32 columns, and the gathers that are such forwards over dy
// (MmaPlanesNchw, below).
//
// A window sum along W is a product with a 0/1 matrix: for 8 adjacent
// destination columns j, the sums over the 16 source columns k under them
// (k - j in [0, KW)) are D[ch][j] = sum_k X[ch][k] * B[k][j], with X the
// source row's pixels, 16 channels of each. The tensor cores multiply
// 16-bit operands exactly and add in float32, so one mma.sync m16n8k16 takes
// 128 such sums, and adding the KH source rows of a window into the same
// accumulators makes them the window sums. B is one fixed pair of registers.
//
// A block takes 128 bytes of channels (64) of one image, a strip of 8 * NT
// destination columns and a segment of destination rows. It streams the source
// rows under them through a ring in shared memory (cp.async, zeros outside the
// source; or kCompact, below), kMmaRows destination rows a step: per source row
// a warp (16 channels) loads the NT + 1 halves of 8 columns its NT tiles of 8
// destination columns read (ldmatrix, transposed: channels become the M side)
// and adds them into every destination row of the step whose window holds that
// row, the rows both windows hold once for both (see the step). The sums are
// scaled, rounded and stored transposed back into pixels of
// channels in a stage in shared memory (stmatrix), which the block copies out
// at its next step in whole 128-byte pieces of pixels.
//
// Items (64 channels, a strip, a segment) are a block each, in waves of
// the blocks that stay resident; where they overflow one wave by a half or
// less, each resident block takes an equal share of the items' rows in
// order instead, in pieces that end at the items' ends, so that no second
// wave, partly empty, follows the first (see the launcher).
//
// kCompact: a ring row holds only the strip's source columns that lie in
// the source, and one pixel of zeros that the lanes of ldmatrix read for
// every column outside it (each lane gives its own row address). Over
// narrow sources that frees shared memory for more resident blocks: the
// gather of 28x28 images from 22x22 dy rows (a strip of 32 destination
// columns over 40 source columns, 22 of them in dy) fits four blocks a
// multiprocessor instead of two. The launcher takes it where the blocks
// resident together grow and the items' waves over them take no longer
// (waves times blocks a multiprocessor): on the H200, 64x28x28x512, the
// gather took 33.2 us against 38.6 (CUDA events); with padding 3, where
// three blocks would stay resident instead of two, 512 items make 1.3
// waves instead of 1.9, and it took 44 us against 40.5, so the launcher
// keeps the plain rows there.
//
// The zeros of B do not hide what they multiply: 0 * inf is NaN, so an
// infinity or NaN among the 16 source columns of a tile spoils every sum of
// that tile. A NaN or infinity among a warp's rounded results is the only
// sign needed: the warp then sums its part of the item again, element by
// element from global memory, which gives what the other kernels give.
//
// Only the uniform divisor for the gather, whose factors would weight the
// source before the sums; every divisor for the forward.
//
// On the H200 (CUDA events, us, forward / gather, 64x28x28x512; the gather
// before kCompact): bfloat16 28.8 / 38.7 against BoxNhwc's 37.2 / 42.6, float16
// 28.8 / 38.6 against 37.2 / 41.5; with padding 3 (28 destination columns both
// ways) 41.1 / 41.0 against 45.1 / 45.5; 2x230x230x64 17.8 / 17.4 against
// 27.1 / 27.3. Without the kernel's stores the forward took 21.9 and its loads
// alone 17-18, about 2.9 TB/s. Tried, not kept: each warp storing its results
// straight from registers (movmatrix, 4-byte stores: 29-30 / 40-44), a block of
// 128 channels (256 bytes a pixel: the same), rows brought into L2 two to six
// steps ahead (1-5 us slower), 16-column strips (34.6 / 41.3); one step of
// rows in flight for 32-column strips (44.5 against 38.7: the gather's 28
// columns take those), three for the gather (32.7-32.9 against 31.1); on
// sm_90, the rows copied in and out by the tensor memory accelerator (one
// thread issuing a row's copy, completion on mbarriers, zeros outside the
// source from the hardware), which left the threads only the sums: bench,
// bfloat16, 26.1 / 29.8 against 26.0 / 29.3, and 150 / 150 against 141 /
// 142 for 128x56x56x256 with padding 3 (BENCHMARKS.md). The
// tensor cores are not what holds it: summing the rows a step's two
// destination rows share once (8 products a tile a step instead of 14) and
// skipping the rows of zeros at the ends of the gather's segments took the
// bfloat16 forward from 28.9-29.0 to 28.8-29.0 and the gather from 32.7-32.9
// to 31.5-31.6. Nor were chains of products: sliding accumulators (one
// source row a step, added into each of the KH destination rows whose
// windows hold it, 21 independent products a step for 24 columns): the
// forward took 27.3-27.7 against 27.4-27.6, the gather (28 products a
// step, 164 registers, three blocks) 39.7-40.2 against 30.8-31.0.
// Nor the instructions around the products, nor too few warps: B kept in
// registers (the compiler computed b1 again at every row) and one ldmatrix
// a tile (no moves of the halves that neighbouring tiles share) took the
// gather's 14.7 M warp instructions to 13.1 M and its time from 30.5 to
// 31.8 us; 8 or 16 warps a block, sharing each group of 16 channels'
// tiles, to 39 and 46 (BENCHMARKS.md). Nor the barriers: steps of four
// rows took the copies alone (no sums) as long, and warps copying their
// own 32 bytes of each pixel with no block barriers made them 4 us slower;
// segments of rows, walked down or toward each other, 3 us or more.
//
// Stage buffers (ST): two let a step stage its rows while the block copies
// out the last step's; one costs a second barrier a step and frees 6 KB (24
// columns) or 8 KB (32). Two steps of rows in flight for 24-column strips
// fit four blocks a multiprocessor only with one: the forward took 27.5-28.0
// against 28.5-28.6 with one step and two buffers (32.6 with two steps and
// two buffers, at three blocks). For 32-column strips the launcher takes one
// buffer where that lets more blocks stay resident: with padding 3 (28
// columns both ways), 36.6-36.7 against 40.5-40.6 (forward and gather alike);
// where it does not (the bench's gather), two stay (31.1 against 31.7).
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cuda_common.cuh"

namespace jax_avgpool::cuda {
namespace {

constexpr int kMmaWarps = 4;  // 16 channels each: 128 bytes of a pixel
constexpr int kMmaRows = 2;   // destination rows per step
constexpr int kMmaThreads = 32 * kMmaWarps;
// Where it is taken: destination images of at least kMmaMinRows rows and
// calls of at least kMmaMinItems blocks. On fewer rows the rows a block
// loads before its first sums weigh more, and on fewer blocks BoxNhwc's
// more, smaller items fill the card better (H200, bfloat16 and float16,
// us, forward / gather, against BoxNhwc: 64x14x14x512 with padding 3,
// 20.9 / 20.9 against 15.1 / 15.2; 3x19x37x192 with padding 2, 10.6 /
// 11.3 against 10.0 / 10.3; the gather of 7x23x30x64 with padding 1, 7
// blocks, 12.8 against 9.9; of 3x60x75x64 with padding 3, 18 blocks, 15.2
// against 17.0).
constexpr int kMmaMinRows = 20;
constexpr int kMmaMinItems = 16;
constexpr int kPixelBytes = 128;

// The rows an item spans in the order that shares of rows cut (MmaBoxNhwc):
// `rows` rounded up to whole steps, so that a share, whole steps too, starts
// at a step of its item.
__host__ __device__ constexpr int MmaSpan(int rows) {
  return (rows + kMmaRows - 1) / kMmaRows * kMmaRows;
}

// Source rows the ring holds: a step's rows and P steps' new ones.
template <typename S>
constexpr int MmaRing(int P) {
  return (P + 1) * kMmaRows + S::KH - 1;
}

// The divisors that decode a position in the items' rows into the item
// (span), and an item into its slab, strip, segment and image: multiplies
// by FastDiv, for calls whose items' rows fit an int.
struct MmaItemDivs {
  FastDiv span, slabs, strips, segs;
  int n_slabs, n_strips, n_segs;
};

template <typename T>
struct MmaOne;  // the bits of 1 in T
template <>
struct MmaOne<__half> {
  static constexpr unsigned kBits = 0x3C00u;
};
template <>
struct MmaOne<__nv_bfloat16> {
  static constexpr unsigned kBits = 0x3F80u;
};

// acc = A (16 x 16, row-major, 4 registers) * B (16 x 8, 2 registers) plus
// c (which may be acc), or plus zero where `first`.
template <typename T>
__device__ __forceinline__ void MmaAdd(float (&acc)[4], const float (&c)[4],
                                       unsigned a0, unsigned a1, unsigned a2,
                                       unsigned a3, unsigned b0, unsigned b1,
                                       bool first) {
#if __CUDA_ARCH__ >= 800
  const float c0 = first ? 0.f : c[0], c1 = first ? 0.f : c[1],
              c2 = first ? 0.f : c[2], c3 = first ? 0.f : c[3];
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(acc[0]), "=f"(acc[1]), "=f"(acc[2]), "=f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c0),
          "f"(c1), "f"(c2), "f"(c3));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(acc[0]), "=f"(acc[1]), "=f"(acc[2]), "=f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c0),
          "f"(c1), "f"(c2), "f"(c3));
  }
#endif
}

// Four (two) 8x8 matrices of 16-bit elements from shared memory,
// transposed: lanes 8i .. 8i + 7 give the addresses of matrix i's rows.
__device__ __forceinline__ void LoadFour(unsigned (&m)[4], unsigned at) {
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(m[0]), "=r"(m[1]), "=r"(m[2]), "=r"(m[3])
      : "r"(at)
      : "memory");
#endif
}
__device__ __forceinline__ void LoadTwo(unsigned (&m)[2], unsigned at) {
#if __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(m[0]), "=r"(m[1])
               : "r"(at)
               : "memory");
#endif
}

// Four (two) 8x8 matrices of 16-bit elements to shared memory, transposed:
// lane 4g + t holds row g, columns 2t and 2t + 1 of matrix i in m[i], which
// land as column g of rows 2t and 2t + 1 at the row addresses that lanes
// 8i .. 8i + 7 give (stmatrix on sm_90, else transposed across the warp by
// movmatrix and stored a lane at a time).
template <int N>
__device__ __forceinline__ void StoreTransposed(unsigned at,
                                                const unsigned (&m)[N]) {
#if __CUDA_ARCH__ >= 900
  if constexpr (N == 4) {
    asm volatile(
        "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], "
        "{%1,%2,%3,%4};\n" ::"r"(at),
        "r"(m[0]), "r"(m[1]), "r"(m[2]), "r"(m[3])
        : "memory");
  } else {
    static_assert(N == 2);
    asm volatile(
        "stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1,%2};\n" ::"r"(
            at),
        "r"(m[0]), "r"(m[1])
        : "memory");
  }
#elif __CUDA_ARCH__ >= 800
  const int lane = static_cast<int>(threadIdx.x & 31);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const unsigned row = __shfl_sync(0xffffffffu, at, 8 * i + (lane >> 2));
    unsigned v;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n"
        : "=r"(v)
        : "r"(m[i]));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(row + 4 * (lane & 3)), "r"(v)
                 : "memory");
  }
#endif
}

// The bits of a and b rounded to T, a in the low half: one paired
// conversion, where cuda_scatter.cu's PackPair converts each on its own.
template <typename T>
__device__ __forceinline__ unsigned Pack(float a, float b) {
  unsigned bits;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    memcpy(&bits, &v, 4);
  } else {
    const __half2 v = __floats2half2_rn(a, b);
    memcpy(&bits, &v, 4);
  }
  return bits;
}

// flag stays +0 while both halves of v are finite: v * 0 + flag.
template <typename T>
__device__ __forceinline__ unsigned FiniteFlag(unsigned v, unsigned flag) {
  using T2 =
      std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  T2 x, f;
  memcpy(&x, &v, 4);
  memcpy(&f, &flag, 4);
  const T2 r = __hfma2(x, T2{}, f);
  unsigned bits;
  memcpy(&bits, &r, 4);
  return bits;
}

// The geometry of MmaBoxNhwc's images: the call's, at run time, or fixed at
// compile time for a common one (the launcher's list), so that the compiler
// folds each item's rows, columns, offsets and checks into constants. The
// forward of 28x28 images without padding (7x7) took 82 registers instead
// of 96, and on the H200 (bfloat16, 64 calls replayed from a CUDA graph,
// best of seven, runs alternating) 25.01-25.29 us instead of 25.20-25.46
// for 64x28x28x512, 30.47 against 30.82 for 72 images (shares of rows),
// with the same outputs bit for bit. Its ring rows compact as well (28
// pixels and one of zeros, no copies of zeros): 25.50-25.62.
struct RuntimeBox {
  static constexpr bool kFixed = false;
  static constexpr int kSrcH = 0, kSrcW = 0, kDstH = 0, kDstW = 0;
  static constexpr int kOffH = 0, kOffW = 0, kRows = 0;
};
// Source and destination images, the source offsets of the first window
// (off_h, off_w) and the destination rows of an item (SlideRows).
template <int kSH, int kSW, int kDH, int kDW, int kOH, int kOW, int kR>
struct FixedBox {
  static constexpr bool kFixed = true;
  static constexpr int kSrcH = kSH, kSrcW = kSW, kDstH = kDH, kDstW = kDW;
  static constexpr int kOffH = kOH, kOffW = kOW, kRows = kR;
};

template <typename T, typename S, bool kGather, int NT, int P, int ST,
          bool kAdd, bool kCompact, typename G = RuntimeBox>
__global__ void __launch_bounds__(kMmaThreads, 4)
    MmaBoxNhwc(const PoolAttrs a, const PoolShape s, const T* __restrict__ src,
               T* __restrict__ dst, const int call_rows,
               const SharedFactor<float> shared, const int ring_px,
               const int64_t items, const int64_t share,
               const MmaItemDivs divs) {
#if __CUDA_ARCH__ >= 800
  constexpr int KH = S::KH, KW = S::KW, R = kMmaRows;
  constexpr int NR = MmaRing<S>(P);
  constexpr int NC = 8 * NT + 8;  // source columns under a strip
  constexpr int kStageRow = 8 * NT * kPixelBytes;  // a staged output row
  constexpr int kCopies = (NC + 15) / 16;
  constexpr int kOutCopies = (8 * NT + 15) / 16;
  static_assert(NhwcBox<S>() && KW <= 9 && sizeof(T) == 2);
  static_assert(R == 2 && KH >= R);  // the step's shared rows, below
  static_assert(ST == 1 || ST == 2);
  // Destination rows of an item.
  const int rows = G::kFixed ? G::kRows : call_rows;
  extern __shared__ __align__(128) unsigned char mma_ring[];
  // A ring row holds the NC source columns under a strip, zeros for those
  // outside the source; kCompact, only those in the source (at most
  // ring_px - 1), then one pixel of zeros that the tiles read for every
  // column outside it.
  const int row_bytes = (kCompact ? ring_px : NC) * kPixelBytes;
  const int zero_px = ring_px - 1;
  unsigned char* const stage = mma_ring + NR * row_bytes;  // [ST][R] rows
  float* const row_f = reinterpret_cast<float*>(stage + ST * R * kStageRow);
  float* const col_f = row_f + rows;
  const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
  constexpr bool kFixed = G::kFixed;
  const int64_t src_h = kFixed ? G::kSrcH : kGather ? OH : H;
  const int64_t src_w = kFixed ? G::kSrcW : kGather ? OW : W;
  const int64_t dst_h = kFixed ? G::kDstH : kGather ? H : OH;
  const int64_t dst_w = kFixed ? G::kDstW : kGather ? W : OW;
  const int64_t C = s.channels;
  const int64_t off_h = kFixed    ? G::kOffH
                        : kGather ? a.pad_top - KH + 1
                                  : -a.pad_top;
  const int64_t off_w = kFixed    ? G::kOffW
                        : kGather ? a.pad_left - KW + 1
                                  : -a.pad_left;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  // B[k][j] = 1 where source column k of a tile's 16 lies in the window of
  // its destination column j; lane 4g + t holds k = 2t, 2t + 1 (b0) and
  // 2t + 8, 2t + 9 (b1) of column g.
  const auto one = [&](int k) {
    return k >= g && k < g + KW ? MmaOne<T>::kBits : 0u;
  };
  const unsigned b0 = one(2 * t) | one(2 * t + 1) << 16;
  const unsigned b1 = one(2 * t + 8) | one(2 * t + 9) << 16;
  // Pixel p of a ring row, and of a staged output row, holds its 16-byte
  // chunk q (8 channels) at position q ^ (p & 7), so that the eight pixels
  // of one chunk that ldmatrix and stmatrix reach together fall on distinct
  // banks. Thread tid copies chunk tid & 7 of pixels (tid >> 3) + 16i, in
  // and out.
  const int cq = tid & 7, cp0 = tid >> 3;
  const unsigned ring =
      static_cast<unsigned>(__cvta_generic_to_shared(mma_ring));
  const unsigned ring_end = ring + NR * row_bytes;
  const unsigned copy_at = cp0 * kPixelBytes + ((cq ^ (cp0 & 7)) << 4);
  // ldmatrix and stmatrix: matrix i of a pair of 8-pixel halves is pixel
  // (lane & 7) + 8 * (i >> 1) of the pair, chunk 2 * warp + (i & 1).
  const int lane_px = (lane & 7) + 8 * (lane >> 4);
  const int lane_chunk = 2 * warp + ((lane >> 3) & 1);
  const unsigned lane_at =
      lane_px * kPixelBytes + ((lane_chunk ^ (lane & 7)) << 4);
  const unsigned stage_at =
      static_cast<unsigned>(__cvta_generic_to_shared(stage)) + lane_at;
  // The zero pixels of the ring rows, written once (the copies in never
  // reach them); the first step's barrier orders them before any read.
  for (int i = tid; kCompact && i < NR * 8; i += kMmaThreads) {
    *reinterpret_cast<uint4*>(mma_ring + (i >> 3) * row_bytes +
                              zero_px * kPixelBytes + (i & 7) * 16) = uint4{};
  }
  const int64_t row_step = src_w * C, out_step = dst_w * C;
  // The work: the items' rows in order, item u's row i at u * span + i,
  // span the even number of rows at or above `rows` (the rows past an
  // item's are empty). share == 0: whole items, the block's every
  // gridDim.x-th. Else the block's `share` rows (even) from blockIdx.x *
  // share, in pieces that end at the items' ends: each piece starts at an
  // even row of its item, so its steps pair the rows that the item's own
  // steps pair, and its sums are the same, bit for bit.
  // The items' rows fit an int (the launcher), so they are decoded by
  // multiplies (divs): the 64-bit divisions before each block's first
  // copies cost 0.3-0.7 us a call on the H200 (bfloat16 64x28x28x512,
  // replayed from a CUDA graph: 25.9-26.0 us against 25.3-25.5; 33 images
  // at padding 1 17.9 against 17.3; 64 at padding 3 35.3 against 34.7).
  const int span = MmaSpan(rows);
  const int all = static_cast<int>(items) * span;
  int at =
      static_cast<int>(share ? share : span) * static_cast<int>(blockIdx.x);
  const int at_end = share ? min(all, at + static_cast<int>(share)) : all;
  const int stride = share ? 0 : span * static_cast<int>(gridDim.x);
  while (at < at_end) {
    const int item = divs.span(at);
    const int lo = at - item * span;
    const int hi = min(span, at_end - item * span);
    at = share ? item * span + hi : at + stride;
    const int by_slab = divs.slabs(item);
    const int64_t slab = item - by_slab * divs.n_slabs;
    int64_t strip = 0, o0 = lo, n = by_slab;
    // A fixed image of one strip and one segment: the item is its image's.
    if constexpr (!kFixed || (G::kDstW > 8 * NT || G::kDstH > G::kRows)) {
      const int by_strip = divs.strips(by_slab);
      strip = by_slab - by_strip * divs.n_strips;
      const int by_seg = divs.segs(by_strip);
      o0 = int64_t{by_strip - by_seg * divs.n_segs} * rows + lo;
      n = by_seg;
    }
    const int64_t w0 = strip * 8 * NT;
    const int nrow =
        static_cast<int>(min(int64_t{min(hi, rows) - lo}, dst_h - o0));
    if (nrow <= 0) continue;  // empty rows only
    const int ncol = static_cast<int>(min(int64_t{8 * NT}, dst_w - w0));
    const int64_t top = o0 + off_h, left = w0 + off_w;
    const int nsrc = nrow + KH - 1;
    if (!shared.all) {
      // 1 / factor of each destination row, then of each column.
      for (int i = tid; i < rows + 8 * NT; i += kMmaThreads) {
        const bool is_row = i < rows;
        const int64_t o = is_row ? o0 + i : w0 + i - rows;
        row_f[i] =
            o < (is_row ? dst_h : dst_w)
                ? Reciprocal(WindowFactor<float>(
                      a,
                      is_row ? WindowAt(o, H, KH, 1, a.pad_top, a.pad_bottom)
                             : WindowAt(o, W, KW, 1, a.pad_left, a.pad_right),
                      is_row))
                : 0.f;
      }
    }
    // Pixels 0 .. nin - 1 of a ring row are source columns cs onwards:
    // kCompact, those in the source; else all NC from column left.
    const int64_t cs = kCompact ? min(max(left, int64_t{0}), src_w) : left;
    const int nin =
        kCompact ? static_cast<int>(min(left + NC, src_w) - cs) : NC;
    // The tiles' reads: pixel lane_px + 16j from column left (a pair of
    // halves of 8 columns), or kCompact, the zero pixel where its column is
    // outside the source.
    unsigned read_at[(NT + 2) / 2];
#pragma unroll
    for (int j = 0; j < (NT + 2) / 2; ++j) {
      const int64_t at = left + lane_px + 16 * j - cs;
      const int px =
          !kCompact || (at >= 0 && at < nin) ? static_cast<int>(at) : zero_px;
      read_at[j] = px * kPixelBytes + ((lane_chunk ^ (px & 7)) << 4);
    }
    // The copies in: ring row r is source row top + r, in slot r mod NR;
    // rows r_lo .. r_hi - 1 are inside the source (rows past the segment's
    // are copied as zeros). Bit i of `have`: pixel cp0 + 16i is one of the
    // nin of a ring row; of `inside`: its column is in the source too.
    const int r_lo = static_cast<int>(max(int64_t{0}, -top));
    const unsigned r_count = static_cast<unsigned>(
        max(int64_t{0}, min(int64_t{nsrc}, src_h - top) - r_lo));
    unsigned have = 0, inside = 0, out_ok = 0;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int64_t c = cs + cp0 + 16 * i;
      if (cp0 + 16 * i < nin) {
        have |= 1u << i;
        if (c >= 0 && c < src_w) inside |= 1u << i;
      }
      if (cp0 + 16 * i < ncol) out_ok |= 1u << i;
    }
    const int64_t pixel_step = 16 * C;
    const T* from = src + (n * src_h + top) * row_step + (cs + cp0) * C +
                    slab * 64 + cq * 8;
    unsigned to = ring + copy_at;
    int r_next = 0;
    const auto copy_row = [&]() {
      const unsigned ok_bits =
          static_cast<unsigned>(r_next - r_lo) < r_count ? inside : 0u;
      const T* at = from;
#pragma unroll
      for (int i = 0; i < kCopies; ++i, at += pixel_step) {
        if (have & 1u << i) {
          const bool ok = (ok_bits >> i) & 1u;
          StartCopyTo<16, true>(to + i * 16 * kPixelBytes, ok ? at : src, ok);
        }
      }
      ++r_next;
      from += row_step;
      to = to + row_bytes < ring_end ? to + row_bytes
                                     : to + row_bytes - NR * row_bytes;
    };
    // The copies out: the rows of step k, staged in buffer k mod ST.
    T* const out =
        dst + ((n * dst_h + o0) * dst_w + w0 + cp0) * C + slab * 64 + cq * 8;
    const auto copy_out = [&](int k) {
      const unsigned char* const from_stage =
          stage + (k % ST) * R * kStageRow + copy_at;
#pragma unroll
      for (int o = 0; o < R; ++o) {
        if (k * R + o >= nrow) break;
        T* const q = out + static_cast<int64_t>(k * R + o) * out_step;
#pragma unroll
        for (int i = 0; i < kOutCopies; ++i) {
          if (out_ok & 1u << i) {
            const uint4 bits = *reinterpret_cast<const uint4*>(
                from_stage + o * kStageRow + i * 16 * kPixelBytes);
            if constexpr (kAdd) {
              AtomicAdd16(q + i * pixel_step, bits);
            } else {
              *reinterpret_cast<uint4*>(q + i * pixel_step) = bits;
            }
          }
        }
      }
    };
    // Step 0 adds rows 0 .. R + KH - 2, step k > 0 R more.
#pragma unroll 1
    for (int r = 0; r < KH - 1; ++r) copy_row();
#pragma unroll
    for (int k = 0; k < P; ++k) {
#pragma unroll
      for (int r = 0; r < R; ++r) copy_row();
      CommitCopies();
    }
    unsigned flag = 0;
    unsigned base = ring;  // the step's first ring row
    const int steps = (nrow + R - 1) / R;
    for (int k = 0; k < steps; ++k) {
      CopyWait<P - 1>();
      __syncthreads();  // the step's rows are in; the last step's are read
#pragma unroll
      for (int r = 0; r < R; ++r) copy_row();
      CommitCopies();
      if (k > 0) copy_out(k - 1);
      // Rows 1 .. KH - 1 of the step lie in both destination rows' windows:
      // their products are summed once, into acc[1], from which acc[0]
      // takes its sum plus row 0's before acc[1] adds row KH (R + KH - 1
      // products a tile instead of R * KH). kChecked: skips the rows
      // outside the source, zeros whose products add nothing (the steps
      // at a segment's ends where the source's first or last rows are in
      // the windows).
      float acc[R][NT][4];
      const auto add_rows = [&](auto checked) {
        constexpr bool kChecked = decltype(checked)::value;
        const auto inside = [&](int i) {
          return !kChecked || static_cast<unsigned>(k * R + i - r_lo) < r_count;
        };
        // The step's row i as the NT + 1 halves of 8 columns (channels
        // 0-7, 8-15) the tiles read.
        const auto load = [&](int i, unsigned (&half)[NT + 1][2]) {
          const unsigned at = base + i * row_bytes < ring_end
                                  ? base + i * row_bytes
                                  : base + i * row_bytes - NR * row_bytes;
#pragma unroll
          for (int h = 0; h + 1 <= NT; h += 2) {
            unsigned m[4];
            LoadFour(m, at + read_at[h / 2]);
            half[h][0] = m[0], half[h][1] = m[1];
            half[h + 1][0] = m[2], half[h + 1][1] = m[3];
          }
          if constexpr (NT % 2 == 0) {
            unsigned m[2];
            LoadTwo(m, at + read_at[NT / 2]);
            half[NT][0] = m[0], half[NT][1] = m[1];
          }
        };
        // acc[d] = acc[c] plus the products of the step's row i.
        const auto add = [&](int d, int c, int i, bool first) {
          unsigned half[NT + 1][2];
          load(i, half);
#pragma unroll
          for (int u = 0; u < NT; ++u) {
            MmaAdd<T>(acc[d][u], acc[c][u], half[u][0], half[u][1],
                      half[u + 1][0], half[u + 1][1], b0, b1, first);
          }
        };
        if constexpr (kChecked) FillZero(acc[1]);
#pragma unroll
        for (int i = 1; i < KH; ++i) {
          if (inside(i)) add(1, 1, i, !kChecked && i == 1);
        }
        if (inside(0)) {
          add(0, 1, 0, false);
        } else {
#pragma unroll
          for (int u = 0; u < NT; ++u) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[0][u][e] = acc[1][u][e];
          }
        }
        if (inside(KH)) add(1, 1, KH, false);
      };
      if (k * R >= r_lo &&
          static_cast<unsigned>(k * R + R + KH - 1 - r_lo) <= r_count) {
        add_rows(std::false_type{});
      } else {
        add_rows(std::true_type{});
      }
      // One stage buffer: every thread has copied the last step's rows out.
      if constexpr (ST == 1) __syncthreads();
      const unsigned stage_k = stage_at + (k % ST) * R * kStageRow;
#pragma unroll
      for (int o = 0; o < R; ++o) {
        if (k * R + o >= nrow) break;
        const float fr = shared.all ? shared.value : row_f[k * R + o];
        unsigned v[NT][2];  // [tile][channels 0-7, 8-15]
#pragma unroll
        for (int u = 0; u < NT; ++u) {
          // acc: channels g and g + 8 of columns 8u + 2t and 8u + 2t + 1.
          float f0 = fr, f1 = fr;
          if (!shared.all) {
            f0 *= col_f[8 * u + 2 * t];
            f1 *= col_f[8 * u + 2 * t + 1];
          }
          v[u][0] = Pack<T>(acc[o][u][0] * f0, acc[o][u][1] * f1);
          v[u][1] = Pack<T>(acc[o][u][2] * f0, acc[o][u][3] * f1);
          flag = FiniteFlag<T>(v[u][1], FiniteFlag<T>(v[u][0], flag));
        }
        // Transposed into pixels of channels, two tiles at a time.
#pragma unroll
        for (int u = 0; u + 1 < NT; u += 2) {
          const unsigned m[4] = {v[u][0], v[u][1], v[u + 1][0], v[u + 1][1]};
          StoreTransposed(stage_k + o * kStageRow + u * 8 * kPixelBytes, m);
        }
        if constexpr (NT % 2 == 1) {
          const unsigned m[2] = {v[NT - 1][0], v[NT - 1][1]};
          StoreTransposed(stage_k + o * kStageRow + (NT - 1) * 8 * kPixelBytes,
                          m);
        }
      }
      base = base + R * row_bytes < ring_end
                 ? base + R * row_bytes
                 : base + R * row_bytes - NR * row_bytes;
    }
    __syncthreads();  // the last step's rows are staged
    copy_out(steps - 1);
    // Every copy out is done before a warp sums its part again.
    if (__syncthreads_or(flag != 0) && __any_sync(0xffffffffu, flag != 0)) {
      // Element by element: lane pairs of channels, columns, rows.
      const T* const x0 = src + n * src_h * row_step + slab * 64 + warp * 16;
      T* const y0 =
          dst + ((n * dst_h + o0) * dst_w + w0) * C + slab * 64 + warp * 16;
      for (int i = lane; i < nrow * ncol * 8; i += 32) {
        const int e = i & 7, jc = (i >> 3) % ncol, oi = (i >> 3) / ncol;
        float s0 = 0.f, s1 = 0.f;
        for (int dh = 0; dh < KH; ++dh) {
          const int64_t h = top + oi + dh;
          if (h < 0 || h >= src_h) continue;
          for (int dw = 0; dw < KW; ++dw) {
            const int64_t c = left + jc + dw;
            if (c < 0 || c >= src_w) continue;
            const T* const x = x0 + h * row_step + c * C + 2 * e;
            s0 += Num<T>::Load(x[0]);
            s1 += Num<T>::Load(x[1]);
          }
        }
        // kAdd: a plain store, after this block's atomics to the element,
        // its only ones (ordered by the barrier above).
        const float f = shared.all ? shared.value : row_f[oi] * col_f[jc];
        *reinterpret_cast<unsigned*>(y0 + oi * out_step + jc * C + 2 * e) =
            Pack<T>(s0 * f, s1 * f);
      }
    }
    CopyWait<0>();    // no copy may land in the next item's ring
    __syncthreads();  // the next item writes the ring, stage and factors
  }
#endif
}

// ---------------------------------------------------------------------------
// NCHW forward: the same sums with 16 planes on the M side. A block takes
// groups of 16 consecutive planes (one contiguous range of the source,
// copied into shared memory while the block sums the group before it), each
// plane at a pitch of an odd multiple of 16 bytes, so that the lanes reading
// one 4-byte pair of columns of eight planes fall on distinct banks. A is
// read straight from the planes' rows as pairs of columns (4-byte loads:
// rows of 28 columns are not 16-byte aligned, as ldmatrix would want). A
// tile is 8 destination columns of the 16 planes; its K side, the 16 source
// columns from an even column at or before its first window's, runs past
// the row into the neighbouring rows or the zeros around the planes, so B
// also holds zeros where a column lies outside the source row. Each warp
// takes steps of kPlaneMmaRows destination rows, the source rows under a
// step adding into the sums of each row whose window holds them. The
// rounded sums go to a stage of whole destination planes, which leaves as
// one contiguous range. As in MmaBoxNhwc, a warp that finds an infinity or
// NaN among its results sums its rows again element by element (here from
// the planes in shared memory).
//
// Eight warps a block, two blocks a multiprocessor (by registers): over
// 28x28 planes each warp takes one step of the 22 destination rows. On the
// H200 (CUDA events, us, 64x512 planes of 28x28): bfloat16 26.7-27.1,
// float16 26.9-27.0, against 28.2-28.9 and 28.7-28.8 with four warps at
// three blocks (12 warps a multiprocessor where now 16) and PlanesNchw's
// 33.0; with padding 1, 30.6-30.9 against 32.8-33.3. Eight warps at three
// blocks (80 registers, spills) and the stage copied out by one bulk copy
// (cp.async.bulk, two stages) were slower: 34.4 with padding 1, and 32.1
// for 28x28. Before the sums over shared rows, the R * KH products a step
// took 30.4-31.3 with four warps. Its copies in and out alone (one group a
// block, no sums, four warps) took 26.0. Not taken for the gathers that
// StripsNchw takes, where that is faster (26.0 against 30.6 over 64x512
// planes of 28x28; 27.2 against 41 for a first form of this kernel); the
// others come here as forwards over dy (LaunchMmaPlanesNchwGather); nor
// where two buffers of planes and the stage take more than
// kPlaneMmaMaxShared. Its first forms took 51 us, then 39: the compiler
// computed B and the lanes' addresses again at each product (hence the
// opaque moves); then steps of two rows, every source row checked against
// the source's rows, and checks of planes and columns at every store took
// 12 M instructions against 9.5 M with four warps (bound then by the
// latency of too few warps: 46% of issue slots used). Every change to the
// copies in flight was slower (us, 64x512 planes of 28x28): a third
// buffer, the group after next copied into the buffer just summed, the
// next group's copy issued only after the sums (30.0 against 26.2), and
// the group after next asked of L2 (cp.async.bulk.prefetch.L2: 26.4
// against 26.1). Over 64 to 128 images of 512 28x28 planes each image
// adds 0.32 us (4.1 TB/s, the copy's 4.3); the rest is a cost of each
// call (BENCHMARKS.md).
constexpr int kPlaneMmaPlanes = 16;
constexpr int kPlaneMmaWarps = 8;
constexpr int kPlaneMmaThreads = 32 * kPlaneMmaWarps;
// Destination rows of a warp's step. Over 25 to 32 destination rows, where
// two of the eight warps take a second step, steps of four rows (one each,
// R + KH + 1 products a tile, 128 registers and a few spilled) were no
// faster: H200, bfloat16, us, 64x512 planes of 28x28 at padding 3 35.4
// against 35.9 (forward and gather alike), and 5-11% slower over 64x256 of
// 32x32 at padding 1 (forward 23.4 against 21.6), 70x256 of 30x30 and
// 64x256 of 26x26 at padding 3.
constexpr int kPlaneMmaRows = 3;
// At most this much shared memory a block: two blocks a multiprocessor on
// the H200 (228 KiB, 1 KiB of it reserved a block), and the launcher takes
// the kernel only where two blocks stay resident. With a limit of 72 KiB
// before (three blocks of four warps), larger planes went to StripsNchw.
// Of 15 forwards of 8192 to 32768 planes of 28 to 36 rows and columns at
// paddings 0 to 3 that now come here (H200, us), 12 took 12-30% less time
// (32x32 21.6-21.7 against 25.9-26.4; with padding 1 21.9-22.2 against
// 30.8-31.1; 30x30 with padding 3 21.3-21.4 against 30.4-30.9; 36x36 25.3
// against 30.5-31.0), 34x30 planes with padding 1 the same (17.7-17.8),
// and two took longer: 28x28 planes with padding 3 35.0-35.5 against
// 31.8-32.4, and 30x30 float16 planes with padding 2 22.0-22.1 against
// 21.2-21.5.
constexpr size_t kPlaneMmaMaxShared = 112 * 1024;
// Taken for calls of at least this many groups for each block that stays
// resident. With fewer, the copies of a block's groups barely overlap its
// sums, and the other kernels were faster (H200, us, four warps a block at
// three blocks a multiprocessor, against them: 128 planes
// of 28x28, 8.0 against 5.5; 448 planes of 23x30 with padding 1, 7.2
// against 5.1; 8192 planes of 20x26 with padding 2, 512 groups for 396
// blocks, 10.5 against 9.9).
constexpr int64_t kPlaneMmaMinLoops = 2;

// Which groups a block takes. The blocks of a call do not finish together:
// the multiprocessors get unequal shares of the memory bandwidth, and over
// the H200's 64x512 planes of 28x28 the blocks' ends spread over 4-5 us,
// the multiprocessors busy 88-91% of the call, even where every block has
// the same number of groups (BENCHMARKS.md). So, given a counter of its
// own, a block takes its first two groups by its index (b and b + G, G
// blocks) and every later one from the counter as it frees up: group 2G +
// the counter's value. Each block asks for its next group one group ahead
// (atomicInc, its answer wanted only at the end of the next group's sums)
// and stops at its first answer past the groups, so a call asks exactly
// D + G times (D groups handed out, one answer past them a block); with
// D + G - 1 as atomicInc's bound the counter is back at zero when the call
// ends, ready for the next with no reset. The counter must be zero when a
// call starts and no other call may use it meanwhile: each instance of the
// forward custom call owns one (cuda_handlers.cc), and calls of one
// instance on one device follow each other on its stream. Without one, the
// block takes groups b, b + G, b + 2G, ... H200 (CUDA events, us), the
// bfloat16 forward over N x 512 planes of 28x28: 26.0-26.3 against
// 26.6-27.1 (N = 64), 35.9-36.2 against 36.9-37.4 (96), 45.6-46.0 against
// 47.1-47.7 (128); with padding 1 30.3-30.5 against 30.6-30.9. Slower: the
// counter asked when the next group's copy starts, its answer needed
// before the group's stores (28.0), or zeroed before each call by a memset
// (27.4-27.6, the memset alone 1.2 us) or by block 0 behind a grid barrier
// of a cooperative launch (28.3-28.4); one group a block, the hardware
// giving blocks to free multiprocessors (29.1 with four warps a block, 33.4
// with eight).
constexpr int kScheduleSlots = 1 << 16;
__device__ unsigned schedule_counters[kScheduleSlots];

// The current device's counter of `slot`, its address asked of the runtime
// once a device (kept with the launchers' other per-device facts).
inline KernelFacts<unsigned*>& CounterFacts() {
  static KernelFacts<unsigned*> facts;
  return facts;
}
cudaError_t ScheduleCounter(int slot, unsigned*& counter) {
  KernelKey key;
  cudaError_t err = KeyOf(&schedule_counters, 0, 0, key);
  if (err != cudaSuccess) return err;
  unsigned* base = nullptr;
  if (!CounterFacts().Find(key, base)) {
    void* p = nullptr;
    err = cudaGetSymbolAddress(&p, schedule_counters);
    if (err != cudaSuccess) return err;
    base = static_cast<unsigned*>(p);
    CounterFacts().Keep(key, base);
  }
  counter = base + slot;
  return cudaSuccess;
}

struct MmaPlaneGeom {
  int src_h, src_w, dst_h, dst_w;  // a source and a destination plane
  // Destination (i, j) sums source rows i + off_h .. i + off_h + KH - 1 and
  // columns j + off_w .. j + off_w + KW - 1 (zero outside the source).
  int off_h, off_w;
  int lead;          // bytes of zeros before the first plane of a buffer
  int pitch;         // bytes from one plane to the next in shared memory
  int buffer;        // bytes from one buffer of planes to the next
  int in_bytes;      // bytes of a source plane
  int in_q;          // bytes per piece of the copy in: 16, 8 or 4
  FastDiv plane_of;  // piece index / pieces a plane
  int out_bytes;     // bytes of a destination plane
  int out_at;        // the stage's offset in shared memory
  int factors_at;    // the offset of the row, then column, factors
};

__device__ __forceinline__ unsigned Opaque(unsigned v) {
  unsigned r;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(r) : "r"(v));
  return r;
}

__device__ __forceinline__ void StoreShared32(unsigned at, unsigned v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned LoadShared32(unsigned at) {
  unsigned v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(at));
  return v;
}

// kShared: every window shares one divisor (shared.value).
template <typename T, typename S, int NT, bool kShared>
__global__ void __launch_bounds__(kPlaneMmaThreads, 2)
    MmaPlanesNchw(const PoolAttrs a, const MmaPlaneGeom g,
                  const T* __restrict__ src, T* __restrict__ dst,
                  const SharedFactor<float> shared, const int64_t planes,
                  unsigned* const counter) {
#if __CUDA_ARCH__ >= 800
  constexpr int KH = S::KH, KW = S::KW, NP = kPlaneMmaPlanes;
  constexpr int R = kPlaneMmaRows;
  static_assert(sizeof(T) == 2 && KW <= 8);
  extern __shared__ __align__(16) unsigned char mma_planes[];
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, t = lane & 3;
  const unsigned base =
      static_cast<unsigned>(__cvta_generic_to_shared(mma_planes));
  const int64_t groups = (planes + NP - 1) / NP;
  // Two buffers of planes where a block takes more than one group.
  const int nbuf = gridDim.x < groups ? 2 : 1;
  // Starts the copy of the block's k-th group into buffer k mod nbuf: the
  // group's range of the source in pieces of Q bytes, piece i of the range
  // to piece j of plane p (i = p * pieces + j).
  const int pieces = g.in_bytes / g.in_q;
  const auto copy_pieces = [&](auto q, const unsigned char* from, unsigned to,
                               int np) {
    constexpr int Q = decltype(q)::value;
    for (int i = tid; i < np * pieces; i += kPlaneMmaThreads) {
      const int p = g.plane_of(i), j = i - p * pieces;
      StartCopyTo<Q, false>(to + p * g.pitch + Q * j, from + Q * i, true);
    }
  };
  const auto copy_in = [&](int64_t group, int64_t k) {
    const int64_t p0 = group * NP;
    const int np = static_cast<int>(min(int64_t{NP}, planes - p0));
    const unsigned char* const from =
        reinterpret_cast<const unsigned char*>(src) + p0 * g.in_bytes;
    const unsigned to = base + (k & (nbuf - 1)) * g.buffer + g.lead;
    if (g.in_q == 16) {
      copy_pieces(std::integral_constant<int, 16>{}, from, to, np);
    } else if (g.in_q == 8) {
      copy_pieces(std::integral_constant<int, 8>{}, from, to, np);
    } else {
      copy_pieces(std::integral_constant<int, 4>{}, from, to, np);
    }
    CommitCopies();
  };
  if (blockIdx.x < groups) copy_in(blockIdx.x, 0);
  // With a counter (see kScheduleSlots): `handed` groups come from it, each
  // block's next group waits in next_of[k & 1] for the block's step k - 1
  // to read, and thread 0 holds the counter's answer for the group after
  // it in `asked` (the launcher gives every block two groups at least).
  __shared__ int64_t next_of[2];
  const int64_t blocks = gridDim.x;
  const int64_t handed = groups - 2 * blocks;
  const unsigned bound = static_cast<unsigned>(handed + blocks - 1);
  unsigned asked = 0;
  bool asking = counter != nullptr && tid == 0;
  if (asking) asked = atomicInc(counter, bound);
  // Zeros around the planes of each buffer, before the first and after
  // each, where the tiles' K sides reach past a plane's rows.
  {
    unsigned* const words = reinterpret_cast<unsigned*>(mma_planes);
    const int gap = (g.pitch - g.in_bytes) / 4;
    for (int k = 0; k < nbuf; ++k) {
      unsigned* const buf = words + k * g.buffer / 4;
      for (int i = tid; i < g.lead / 4; i += kPlaneMmaThreads) buf[i] = 0u;
      for (int p = warp; p < NP; p += kPlaneMmaWarps) {
        unsigned* const w = buf + (g.lead + p * g.pitch + g.in_bytes) / 4;
        for (int i = lane; i < gap; i += 32) w[i] = 0u;
      }
    }
  }
  float* const row_f = reinterpret_cast<float*>(mma_planes + g.factors_at);
  float* const col_f = row_f + g.dst_h;
  if constexpr (!kShared) {
    // 1 / factor of each destination row, then of each column.
    for (int i = tid; i < g.dst_h + 8 * NT; i += kPlaneMmaThreads) {
      const bool is_row = i < g.dst_h;
      const int o = is_row ? i : i - g.dst_h;
      row_f[i] =
          o < (is_row ? g.dst_h : g.dst_w)
              ? Reciprocal(WindowFactor<float>(
                    a,
                    is_row
                        ? WindowAt(o, g.src_h, KH, 1, a.pad_top, a.pad_bottom)
                        : WindowAt(o, g.src_w, KW, 1, a.pad_left, a.pad_right),
                    is_row))
              : 0.f;
    }
  }
  // B of tile u: source column cs + 8u + k (cs = off_w rounded down to
  // even) under destination column 8u + gq where it lies in that column's
  // window and inside the source row.
  const int shift = g.off_w & 1;
  const int cs = g.off_w - shift;
  unsigned b0[NT], b1[NT];
#pragma unroll
  for (int u = 0; u < NT; ++u) {
    const auto one = [&](int k) {
      const int d = k - gq - shift, c = cs + 8 * u + k;
      return d >= 0 && d < KW && c >= 0 && c < g.src_w ? MmaOne<T>::kBits : 0u;
    };
    // Through an opaque move, as the lanes' addresses below: else the
    // compiler computes them again at every use, some 30 instructions a
    // product.
    b0[u] = Opaque(one(2 * t) | one(2 * t + 1) << 16);
    b1[u] = Opaque(one(2 * t + 8) | one(2 * t + 9) << 16);
  }
  // Lane (gq, t) reads planes gq and gq + 8, columns cs + 8h + 2t, + 1, and
  // writes their destination columns 8u + 2t, + 1.
  const unsigned lane_in =
      Opaque(base + g.lead + gq * g.pitch + 2 * cs + 4 * t);
  const unsigned lane_out = Opaque(base + g.out_at + gq * g.out_bytes + 4 * t);
  const unsigned hi_in = 8 * g.pitch, hi_out = 8 * g.out_bytes;
  const int row_in = 2 * g.src_w, row_out = 2 * g.dst_w;
  const int steps = (g.dst_h + R - 1) / R;
  int64_t next = 0;
  for (int64_t group = blockIdx.x, k = 0; group < groups; group = next, ++k) {
    const int64_t p0 = group * NP;
    const int np = static_cast<int>(min(int64_t{NP}, planes - p0));
    CopyWait<0>();
    // This group's planes are in; every thread is done with the other
    // buffer and the stage.
    __syncthreads();
    next = counter == nullptr || k == 0 ? group + blocks : next_of[(k + 1) & 1];
    if (next < groups) copy_in(next, k + 1);
    const unsigned in_k = lane_in + (k & (nbuf - 1)) * g.buffer;
    // Planes past the group's last hold stale values: their sums land in
    // the stage but are not copied out, and their flags are dropped.
    unsigned flag_lo = 0, flag_hi = 0;
    for (int st = warp; st < steps; st += kPlaneMmaWarps) {
      // Destination rows o0 .. o0 + R - 1 add source rows r0 .. r0 + R +
      // KH - 2, row i into the rows o whose window holds it.
      const int o0 = R * st, r0 = o0 + g.off_h;
      // Rows 2 .. KH - 1 of the step lie in all three destination rows'
      // windows, rows 1 and KH in two: acc[1] sums the first, acc[0] takes
      // it plus row 1, acc[2] it plus row KH, acc[1] becomes acc[0] plus
      // row KH, and rows 0 and KH + 1 complete acc[0] and acc[2] (R + KH
      // products a tile instead of R * KH). kChecked: skips the rows
      // outside the source, zeros whose products add nothing.
      static_assert(R == 3 && KH >= R);
      float acc[R][NT][4];
      const auto sums = [&](auto checked) {
        constexpr bool kChecked = decltype(checked)::value;
        const auto inside = [&](int i) {
          return !kChecked ||
                 static_cast<unsigned>(r0 + i) < static_cast<unsigned>(g.src_h);
        };
        // Row i's A registers, each tile's four loaded on their own:
        // shared with the neighbouring tile, they would be moved into
        // place instead.
        const auto load = [&](int i, unsigned (&m)[NT][4]) {
          const unsigned at = in_k + (r0 + i) * row_in;
#pragma unroll
          for (int u = 0; u < NT; ++u) {
            m[u][0] = LoadShared32(at + 16 * u);
            m[u][1] = LoadShared32(at + hi_in + 16 * u);
            m[u][2] = LoadShared32(at + 16 * u + 16);
            m[u][3] = LoadShared32(at + hi_in + 16 * u + 16);
          }
        };
        // acc[d] = acc[c] plus the products of m.
        const auto add = [&](int d, int c, const unsigned (&m)[NT][4],
                             bool first) {
#pragma unroll
          for (int u = 0; u < NT; ++u) {
            MmaAdd<T>(acc[d][u], acc[c][u], m[u][0], m[u][1], m[u][2], m[u][3],
                      b0[u], b1[u], first);
          }
        };
        const auto copy = [&](int d, int c) {
#pragma unroll
          for (int u = 0; u < NT; ++u) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[d][u][e] = acc[c][u][e];
          }
        };
        if constexpr (kChecked) FillZero(acc[1]);
#pragma unroll
        for (int i = 2; i < KH; ++i) {
          if (!inside(i)) continue;
          unsigned m[NT][4];
          load(i, m);
          add(1, 1, m, !kChecked && i == 2);
        }
        unsigned m[NT][4];
        if (inside(1)) {
          load(1, m);
          add(0, 1, m, false);
        } else {
          copy(0, 1);
        }
        if (inside(KH)) {
          load(KH, m);
          add(2, 1, m, false);
          add(1, 0, m, false);
        } else {
          copy(2, 1);
          copy(1, 0);
        }
        if (inside(0)) {
          load(0, m);
          add(0, 0, m, false);
        }
        if (inside(KH + 1)) {
          load(KH + 1, m);
          add(2, 2, m, false);
        }
      };
      if (r0 >= 0 && r0 + R + KH - 1 <= g.src_h) {
        sums(std::false_type{});
      } else {
        sums(std::true_type{});
      }
#pragma unroll
      for (int o = 0; o < R; ++o) {
        const int oo = o0 + o;
        if (oo >= g.dst_h) break;
        const float fr = kShared ? shared.value : row_f[oo];
        const unsigned row_at = lane_out + oo * row_out;
#pragma unroll
        for (int u = 0; u < NT; ++u) {
          // Columns c and c + 1 (dst_w is even); only the last tile can
          // reach past the row.
          const int c = 8 * u + 2 * t;
          if (u == NT - 1 && c >= g.dst_w) continue;
          float f0 = fr, f1 = fr;
          if constexpr (!kShared) {
            f0 *= col_f[c];
            f1 *= col_f[c + 1];
          }
          const unsigned v0 = Pack<T>(acc[o][u][0] * f0, acc[o][u][1] * f1);
          const unsigned v1 = Pack<T>(acc[o][u][2] * f0, acc[o][u][3] * f1);
          flag_lo = FiniteFlag<T>(v0, flag_lo);
          flag_hi = FiniteFlag<T>(v1, flag_hi);
          StoreShared32(row_at + 16 * u, v0);
          StoreShared32(row_at + hi_out + 16 * u, v1);
        }
      }
    }
    const bool bad = (gq < np && flag_lo != 0) || (gq + 8 < np && flag_hi != 0);
    if (__any_sync(0xffffffffu, bad)) {
      // Element by element, the warp's rows of every plane.
      __syncwarp();
      const unsigned char* const in =
          mma_planes + (k & (nbuf - 1)) * g.buffer + g.lead;
      const int n = np * g.dst_w;
      for (int st = warp; st < steps; st += kPlaneMmaWarps) {
        for (int oo = R * st; oo < min(R * st + R, g.dst_h); ++oo) {
          for (int e = lane; e < n; e += 32) {
            const int p = e / g.dst_w, j = e - p * g.dst_w;
            const T* const x = reinterpret_cast<const T*>(in + p * g.pitch);
            float sum = 0.f;
            for (int i = 0; i < KH; ++i) {
              const int r = oo + g.off_h + i;
              if (r < 0 || r >= g.src_h) continue;
              for (int c = max(j + g.off_w, 0);
                   c < min(j + g.off_w + KW, g.src_w); ++c) {
                sum += Num<T>::Load(x[r * g.src_w + c]);
              }
            }
            const float f = kShared ? shared.value : row_f[oo] * col_f[j];
            reinterpret_cast<T*>(mma_planes + g.out_at +
                                 p * g.out_bytes)[oo * g.dst_w + j] =
                Num<T>::Store(sum * f);
          }
        }
      }
    }
    if (counter != nullptr && tid == 0) {
      // The block's group after next, read at its next step: from the
      // answer asked one group ago, then the next question; or none.
      int64_t after = groups;
      if (asking && asked < handed) {
        after = 2 * blocks + asked;
        asked = atomicInc(counter, bound);
      } else {
        asking = false;
      }
      next_of[k & 1] = after;
    }
    __syncthreads();  // the stage holds the group's destination planes
    // The copy out: the stage is the destination's range of these planes.
    unsigned char* const to =
        reinterpret_cast<unsigned char*>(dst) + p0 * g.out_bytes;
    const unsigned char* const from = mma_planes + g.out_at;
    const int bytes = np * g.out_bytes;
    const int whole = bytes / 16;
    for (int i = tid; i < whole; i += kPlaneMmaThreads) {
      reinterpret_cast<uint4*>(to)[i] = reinterpret_cast<const uint4*>(from)[i];
    }
    for (int i = 16 * whole + 4 * tid; i < bytes; i += 4 * kPlaneMmaThreads) {
      *reinterpret_cast<unsigned*>(to + i) =
          *reinterpret_cast<const unsigned*>(from + i);
    }
  }
#endif
}

// ---------------------------------------------------------------------------
// The 16-bit NHWC forward of KxK/1 windows over images of one size fixed at
// compile time, without padding, whose results leave straight from
// registers (LaneBoxNhwc): for the forward of 28x28 images under 7x7
// windows, in place of MmaBoxNhwc.
//
// MmaBoxNhwc reads its operands with ldmatrix.trans, which gives a lane one
// channel of its pixels, so its results have one channel a lane as well and
// go out through a stage in shared memory (stmatrix, a barrier, copies of
// whole pixels). Here a lane reads 8 bytes (four channels) of each of its
// source pixels from the ring (ld.shared) and pairs the pixels itself
// (prmt): the M rows of its products are those four channels, so each lane
// ends with four channels of two adjacent destination pixels, 8 bytes
// each, which it stores to global memory itself; the two warps of a tile
// write whole 128-byte pieces of pixels between them.
//
// A block takes 128 bytes of channels (64) of one image and walks all its
// rows, two destination rows a step, the source rows through a ring in
// shared memory (cp.async, kLaneAhead steps ahead, one barrier a step). Its
// warps: (tile t of 8 destination columns, half h of the channels); lane 4r
// + q holds channels c0 .. c0 + 3, c0 = 8 (4h + r / 2) + 4 (r % 2), of the
// source columns 8t + 2q, +1, +8, +9 (the A operand: M rows r and r + 8 are
// channels c0 + 2i and c0 + 2i + 1 of product i), the 0/1 band of B the
// same as MmaBoxNhwc's. The rows both destination rows of a step hold are
// summed once. Chunk c of source pixel p sits at 16-byte slot (c + 2 ((p /
// 2) % 4)) % 8 of its 128 bytes, so that a half warp's 8-byte reads fall in
// distinct banks; each ring row ends in a pixel of zeros, read for the
// columns past the source.
//
// An infinity or NaN among the 16 source columns of a tile spoils every sum
// of the tile (0 * inf), and a lane that stored one non-finite result sums
// all of its destination elements again, element by element from global
// memory, as the other kernels do.
//
// On the H200 (bfloat16 64x28x28x512, 64 calls replayed from a CUDA graph,
// best of seven): 23.84-23.90 us with the 8 slabs of its 512 channels fixed
// at compile time, 24.08-24.17 with them at run time, against MmaBoxNhwc's
// 25.27-25.28 (its fixed form) the same hour; outputs equal MmaBoxNhwc's bit
// for bit on that call. Tried on the way (BENCHMARKS.md): one warp a tile
// with all 64 channels (16-byte reads, 12 warps a multiprocessor) 25.0-25.3;
// operands straight from global memory, the rows a block reads again left
// to L1, 47; images in two segments of rows, 25.8-27.7; this kernel as the
// NHWC gather of 28x28 from 22x22 dy, 27.3-29.4 against MmaTileGatherNhwc's
// 25.7-25.9.
constexpr int kLaneAhead = 2;  // steps of source rows in flight

__host__ __device__ constexpr int LaneTiles(int dst_w) {
  return (dst_w + 7) / 8;
}
template <int K, int kSW>
constexpr int LaneThreads() {
  return 64 * LaneTiles(kSW - K + 1);
}
template <int K, int kSW>
constexpr size_t LaneSmem() {
  return static_cast<size_t>(K + 1 + 2 * kLaneAhead) * (kSW + 1) * kPixelBytes;
}

template <typename T, int K, int kSH, int kSW, int kSlabs>
__global__ void __launch_bounds__(LaneThreads<K, kSW>(), 4)
    LaneBoxNhwc(const T* __restrict__ src, T* __restrict__ dst, const int slabs,
                const float f) {
#if __CUDA_ARCH__ >= 800
  constexpr int kDH = kSH - K + 1, kDW = kSW - K + 1;
  static_assert(K % 2 == 1 && K <= 9 && kDH % 2 == 0 && kDW % 2 == 0);
  constexpr int kTiles = LaneTiles(kDW), kThreads = LaneThreads<K, kSW>();
  constexpr int kRing = K + 1 + 2 * kLaneAhead;  // rows
  constexpr int kRowBytes = (kSW + 1) * kPixelBytes;
  constexpr int kSteps = kDH / 2;
  constexpr int kPair = 2 * kSW * 8;  // 16-byte chunks of two source rows
  constexpr int kPer = (kPair + kThreads - 1) / kThreads;
  extern __shared__ __align__(16) unsigned char lane_ring[];
  const unsigned ring =
      static_cast<unsigned>(__cvta_generic_to_shared(lane_ring));
  const int tid = static_cast<int>(threadIdx.x);
  // kSlabs: the slabs of channels an image, fixed at compile time (every
  // offset below a constant), or 0: `slabs`, whose strides are computed
  // once and then added (asm: else the compiler derives each address from
  // `slabs` again, several multiplies each).
  const int n_slabs = kSlabs > 0 ? kSlabs : slabs;
  const int64_t n = blockIdx.x / n_slabs;
  const int slab = static_cast<int>(blockIdx.x - n * n_slabs);
  int64_t px = int64_t{n_slabs} * kPixelBytes;  // bytes a pixel
  if constexpr (kSlabs == 0) asm volatile("" : "+l"(px));
  const unsigned char* const in = reinterpret_cast<const unsigned char*>(src) +
                                  n * kSH * kSW * px + slab * kPixelBytes;
  // The zero pixel at the end of each ring row.
  for (int i = tid; i < kRing * 8; i += kThreads) {
    *reinterpret_cast<uint4*>(lane_ring + (i >> 3) * kRowBytes +
                              kSW * kPixelBytes + (i & 7) * 16) =
        make_uint4(0, 0, 0, 0);
  }
  // This thread's chunks of the next two source rows to copy (from) and
  // where they go past the first ring row's start (to).
  const unsigned char* from[kPer];
  unsigned to[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = min(tid + kThreads * j, kPair - 1);
    const int c = i & 7, p = (i >> 3) % kSW, rr = (i >> 3) / kSW;
    from[j] = in + (rr * kSW + p) * px + c * 16;
    to[j] =
        rr * kRowBytes + p * kPixelBytes + ((c + 2 * ((p >> 1) & 3)) & 7) * 16;
  }
  const int64_t pair_bytes = 2 * kSW * px;  // two source rows
  // Source rows v and v + 1 (v even) into their ring rows; `from` moves on
  // to the next two.
  const auto copy_pair = [&](int v) {
    const unsigned at = ring + (v % kRing) * kRowBytes;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (kPair % kThreads == 0 || tid + kThreads * j < kPair) {
        StartCopyTo<16, false>(at + to[j], from[j], true);
      }
      from[j] += pair_bytes;
    }
  };
  for (int v = 0; v <= K; v += 2) copy_pair(v);
  CommitCopies();
#pragma unroll
  for (int g = 1; g < kLaneAhead; ++g) {
    if (g < kSteps) copy_pair(2 * g + K - 1);
    CommitCopies();
  }
  const int lane = tid & 31, warp = tid >> 5;
  const int r = lane >> 2, q = lane & 3;
  const int tile = warp % kTiles, chunk = 4 * (warp / kTiles) + (r >> 1);
  const int half = r & 1;
  // The ring addresses of this lane's source pixels (column pairs m = 0, 1
  // of the tile), their first row's; kept in registers rather than
  // computed again at every row.
  unsigned at[2][2];
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * tile + 8 * m + 2 * q + e;
      const int c = col < kSW ? col : kSW;
      at[m][e] = ring + c * kPixelBytes +
                 ((chunk + 2 * ((c >> 1) & 3)) & 7) * 16 + half * 8;
      asm volatile("" : "+r"(at[m][e]));
    }
  }
  // B: source column k (rows) of destination column r (columns).
  const auto band = [&](int k) {
    return k - r >= 0 && k - r < K ? MmaOne<T>::kBits : 0u;
  };
  unsigned b0 = band(2 * q) | band(2 * q + 1) << 16;
  unsigned b1 = band(2 * q + 8) | band(2 * q + 9) << 16;
  asm volatile("" : "+r"(b0), "+r"(b1));
  const int o0 = 8 * tile + 2 * q;  // destination columns o0, o0 + 1
  const bool stores = o0 < kDW;
  unsigned char* const out = reinterpret_cast<unsigned char*>(dst) +
                             (n * kDH * kDW + o0) * px + slab * kPixelBytes +
                             chunk * 16 + half * 8;
  // A source row's A operands: a[m][j] pairs the two pixels of column pair
  // m for channel c0 + j.
  const auto operands = [&](unsigned row_at, unsigned (&a)[2][4]) {
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      uint2 v0, v1;
      asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n"
                   : "=r"(v0.x), "=r"(v0.y)
                   : "r"(at[m][0] + row_at));
      asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n"
                   : "=r"(v1.x), "=r"(v1.y)
                   : "r"(at[m][1] + row_at));
      a[m][0] = __byte_perm(v0.x, v1.x, 0x5410);
      a[m][1] = __byte_perm(v0.x, v1.x, 0x7632);
      a[m][2] = __byte_perm(v0.y, v1.y, 0x5410);
      a[m][3] = __byte_perm(v0.y, v1.y, 0x7632);
    }
  };
  unsigned flag = 0;  // +0 while every stored result is finite
  // The steps in runs of kPeriod, after which the ring rows repeat: unrolled
  // over a run, every ring address is a register plus a constant. `y` is
  // the step's first destination row.
  constexpr int kPeriod = kRing / 2;
  static_assert(kRing % 2 == 0);
  unsigned char* y = out;
  const int64_t row_out = kDW * px;  // bytes a destination row
  for (int k0 = 0; k0 < kSteps; k0 += kPeriod) {
#pragma unroll
    for (int kk = 0; kk < kPeriod; ++kk) {
      const int k = k0 + kk;
      if (k >= kSteps) break;
      CopyWait<kLaneAhead - 1>();
      __syncthreads();  // the step's rows are in; the last step's are free
      if (k + kLaneAhead < kSteps) copy_pair(2 * (kk + kLaneAhead) + K - 1);
      CommitCopies();
      // The ring row of the step's row i (its first at ring row 2 kk).
      const auto row_at = [&](int i) {
        return static_cast<unsigned>((2 * kk + i) % kRing) * kRowBytes;
      };
      float shared[2][4] = {}, acc[2][4];
      unsigned a[2][4];
#pragma unroll
      for (int i = 1; i < K; ++i) {
        operands(row_at(i), a);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          MmaAdd<T>(shared[j], shared[j], a[0][2 * j], a[0][2 * j + 1],
                    a[1][2 * j], a[1][2 * j + 1], b0, b1, i == 1);
        }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        operands(row_at(e * K), a);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          MmaAdd<T>(acc[j], shared[j], a[0][2 * j], a[0][2 * j + 1],
                    a[1][2 * j], a[1][2 * j + 1], b0, b1, false);
        }
        if (stores) {
          // Column o0: channels c0, c0 + 1 (product 0), c0 + 2, c0 + 3
          // (product 1) in acc[.][0] and [2]; column o0 + 1 in [1] and [3].
          const unsigned w0 = Pack<T>(acc[0][0] * f, acc[0][2] * f);
          const unsigned w1 = Pack<T>(acc[1][0] * f, acc[1][2] * f);
          const unsigned w2 = Pack<T>(acc[0][1] * f, acc[0][3] * f);
          const unsigned w3 = Pack<T>(acc[1][1] * f, acc[1][3] * f);
          flag = FiniteFlag<T>(w0, flag);
          flag = FiniteFlag<T>(w1, flag);
          flag = FiniteFlag<T>(w2, flag);
          flag = FiniteFlag<T>(w3, flag);
          unsigned char* const to_row = y + e * row_out;
          *reinterpret_cast<uint2*>(to_row) = make_uint2(w0, w1);
          *reinterpret_cast<uint2*>(to_row + px) = make_uint2(w2, w3);
        }
      }
      y += 2 * row_out;
    }
  }
  if (stores && flag != 0u) {
    // Element by element, this lane's destination elements.
    const unsigned char* const x = in + o0 * px + chunk * 16 + half * 8;
    for (int row = 0; row < kDH; ++row) {
      for (int e = 0; e < 2; ++e) {
        float sum[4] = {0.f, 0.f, 0.f, 0.f};
        for (int i = 0; i < K; ++i) {
          for (int j = 0; j < K; ++j) {
            const T* const v =
                reinterpret_cast<const T*>(x + ((row + i) * kSW + e + j) * px);
#pragma unroll
            for (int c = 0; c < 4; ++c) sum[c] += Num<T>::Load(v[c]);
          }
        }
        T* const to = reinterpret_cast<T*>(out + (row * kDW + e) * px);
#pragma unroll
        for (int c = 0; c < 4; ++c) to[c] = Num<T>::Store(sum[c] * f);
      }
    }
  }
#endif
}

// Whether the kernel was compiled for sm_80 or later (mma.sync, ldmatrix,
// cp.async), as the code the device runs: a build for older targets alone
// leaves its body empty, and the caller takes another kernel.
template <typename Kernel>
bool MmaCompiled(Kernel kernel) {
  const KernelCode code = CodeOf(kernel);
  return code.ptx >= 80 && code.binary >= 80;
}

}  // namespace

int AcquireScheduleSlot() {
  static std::atomic<int64_t> taken{0};
  const int64_t slot = taken.fetch_add(1, std::memory_order_relaxed);
  return slot < kScheduleSlots ? static_cast<int>(slot) : -1;
}

template <typename T, bool kGather, bool kAdd>
bool LaunchMmaBoxNhwc(cudaStream_t stream, const PoolAttrs& a,
                      const PoolShape& s, const T* src, T* dst,
                      cudaError_t& error) {
  // Set here: the forms considered below keep the first error they meet.
  error = cudaSuccess;
  return WithSpec(a, [&](auto spec) {
    using S = decltype(spec);
    if constexpr (!NhwcBox<S>() || S::KW > 9) {
      return false;
    } else {
      const SharedFactor<float> shared = SharedFactorOf<float>(a, s);
      if ((kGather && !shared.all) || s.channels % 64 != 0 ||
          !CanVectorise<T, 8>(s, src, dst)) {
        return false;
      }
      const int64_t dst_h = kGather ? s.in_h : s.out_h;
      const int64_t dst_w = kGather ? s.in_w : s.out_w;
      const int64_t src_w = kGather ? s.out_w : s.in_w;
      if (dst_h < kMmaMinRows) return false;
      const int rows = SlideRows(dst_h);
      // Strips of 8 * NT columns with rows P steps ahead, and ST stage
      // buffers tried in the order given.
      const auto launch = [&](auto nt, auto pp, auto... st) {
        constexpr int NT = decltype(nt)::value;
        constexpr int P = decltype(pp)::value;
        using Kernel =
            void (*)(PoolAttrs, PoolShape, const T*, T*, int,
                     SharedFactor<float>, int, int64_t, int64_t, MmaItemDivs);
        const int64_t segs = Groups(dst_h, rows);
        const int64_t strips = Groups(dst_w, 8 * NT);
        const int64_t slabs = s.channels / 64;
        const int64_t items = s.batch * segs * strips * slabs;
        // The kernel's positions in the items' rows are ints, up to twice
        // their number (a share past the last).
        if (items < kMmaMinItems ||
            items > int64_t{INT32_MAX} / (2 * (MmaSpan(rows) + 1))) {
          return false;
        }
        const MmaItemDivs divs{
            FastDiv::Of(static_cast<uint32_t>(MmaSpan(rows))),
            FastDiv::Of(static_cast<uint32_t>(slabs)),
            FastDiv::Of(static_cast<uint32_t>(strips)),
            FastDiv::Of(static_cast<uint32_t>(segs)),
            static_cast<int>(slabs),
            static_cast<int>(strips),
            static_cast<int>(segs)};
        // Compact ring rows: the source columns a strip can meet, and a
        // zero pixel.
        const int ring_px =
            static_cast<int>(std::min<int64_t>(8 * NT + 8, src_w)) + 1;
        const size_t ring_rows = MmaRing<S>(P);
        // Each form of the kernel (stage buffers, plain or compact rows)
        // in turn, from the first; a later one is taken where more blocks
        // stay resident and the items' waves over them take no longer:
        // waves times blocks per multiprocessor, the time of a wave that
        // shares the multiprocessors' throughput.
        Kernel kernel = nullptr, most_kernel = nullptr;
        size_t smem = 0, most_smem = 0;
        int64_t resident = 0, most = 0;
        const auto cost = [&](int64_t r) { return (items + r - 1) / r * r; };
        const auto consider = [&](Kernel form, size_t form_smem) {
          if (!MmaCompiled(form) || (kAdd && CodeOf(form).binary < 90)) {
            return;
          }
          int64_t r = 0;
          cudaError_t e = AllowSharedMemory(form, form_smem);
          if (e == cudaSuccess) {
            e = ResidentBlocks(form, kMmaThreads, form_smem, r);
          }
          if (e != cudaSuccess) {
            if (error == cudaSuccess) error = e;
            return;
          }
          if (r > resident && (resident == 0 || cost(r) <= cost(resident))) {
            kernel = form, smem = form_smem, resident = r;
          }
          if (r > most) most_kernel = form, most_smem = form_smem, most = r;
        };
        const auto consider_stages = [&](auto stages) {
          constexpr int ST = decltype(stages)::value;
          const size_t rest =
              static_cast<size_t>(ST * kMmaRows) * 8 * NT * kPixelBytes +
              static_cast<size_t>(rows + 8 * NT) * sizeof(float);
          const size_t plain_smem =
              ring_rows * (8 * NT + 8) * kPixelBytes + rest;
          const size_t compact_smem = ring_rows * ring_px * kPixelBytes + rest;
          Kernel plain = MmaBoxNhwc<T, S, kGather, NT, P, ST, kAdd, false>;
          // The forward of 28x28 images under 7x7 windows without padding:
          // its image fixed at compile time.
          if constexpr (!kGather && !kAdd && S::KH == 7 && S::KW == 7 &&
                        NT == 3) {
            if (s.in_h == 28 && s.in_w == 28 && a.pad_top == 0 &&
                a.pad_left == 0 && dst_h == 22 && dst_w == 22 && rows == 22) {
              plain = MmaBoxNhwc<T, S, false, NT, P, ST, false, false,
                                 FixedBox<28, 28, 22, 22, 0, 0, 22>>;
            }
          }
          consider(plain, plain_smem);
          if (compact_smem < plain_smem) {
            consider(MmaBoxNhwc<T, S, kGather, NT, P, ST, kAdd, true>,
                     compact_smem);
          }
        };
        (consider_stages(st), ...);
        if (error != cudaSuccess) return true;
        if (kernel == nullptr) return false;
        if constexpr (kAdd) {
          error = ZeroInputShape(dst, s, stream);
          if (error != cudaSuccess) return true;
        }
        // A block an item, in waves of the blocks that stay resident. Where
        // those overflow one wave but the items overflow the most blocks any
        // form keeps resident by a half or less, that form's blocks take an
        // equal share of the items' rows each, in order, so that no second
        // wave, partly empty, follows the first (a share that starts inside
        // an item reads the KH - 1 source rows above its first again). With
        // more items whole items in waves were faster. H200, bfloat16
        // 64-channel slabs of 28x28 images, us, forward / gather, whole items
        // (the gather's 536 to 768 in waves of 396) against shares (of 528):
        // 536 items 33.1 / 41.0 against 31.3 / 35.6; 640 items 39.9 / 45.1
        // against 37.1 / 40.5; 768 items 43.1 / 46.8 against 42.1 / 45.2;
        // 896 items, forward, 44.9 against 50.1 (hence the half). At padding
        // 3, 768 items took 52.8 / 52.9 by shares against 51.7 / 51.6 in
        // waves of 396, the one call measured slower.
        int64_t blocks = items, share = 0;
        if (items > resident && 2 * items <= 3 * most) {
          kernel = most_kernel, smem = most_smem;
          if (items > most) {
            blocks = most;
            const int64_t all = items * MmaSpan(rows);
            share = (all + kMmaRows * blocks - 1) / (kMmaRows * blocks) *
                    kMmaRows;
          }
        }
        const unsigned grid =
            static_cast<unsigned>(std::min<int64_t>(blocks, INT32_MAX));
        kernel<<<grid, kMmaThreads, smem, stream>>>(
            a, s, src, dst, rows, shared, ring_px, items, share, divs);
        error = cudaGetLastError();
        return true;
      };
      using std::integral_constant;
      // Strips of 24 columns where the rows fit them, rows two steps ahead
      // and one stage buffer (four blocks a multiprocessor still); else of
      // 32, two steps ahead, two stage buffers or one where that lets more
      // blocks stay resident.
      return dst_w <= 24 ? launch(integral_constant<int, 3>{},
                                  integral_constant<int, 2>{},
                                  integral_constant<int, 1>{})
                         : launch(integral_constant<int, 4>{},
                                  integral_constant<int, 2>{},
                                  integral_constant<int, 2>{},
                                  integral_constant<int, 1>{});
    }
  });
}

template bool LaunchMmaBoxNhwc<__half, false, false>(cudaStream_t,
                                                     const PoolAttrs&,
                                                     const PoolShape&,
                                                     const __half*, __half*,
                                                     cudaError_t&);
template bool LaunchMmaBoxNhwc<__half, true, false>(cudaStream_t,
                                                    const PoolAttrs&,
                                                    const PoolShape&,
                                                    const __half*, __half*,
                                                    cudaError_t&);
template bool LaunchMmaBoxNhwc<__half, true, true>(cudaStream_t,
                                                   const PoolAttrs&,
                                                   const PoolShape&,
                                                   const __half*, __half*,
                                                   cudaError_t&);
template bool LaunchMmaBoxNhwc<__nv_bfloat16, false, false>(
    cudaStream_t, const PoolAttrs&, const PoolShape&, const __nv_bfloat16*,
    __nv_bfloat16*, cudaError_t&);
template bool LaunchMmaBoxNhwc<__nv_bfloat16, true, false>(
    cudaStream_t, const PoolAttrs&, const PoolShape&, const __nv_bfloat16*,
    __nv_bfloat16*, cudaError_t&);
template bool LaunchMmaBoxNhwc<__nv_bfloat16, true, true>(
    cudaStream_t, const PoolAttrs&, const PoolShape&, const __nv_bfloat16*,
    __nv_bfloat16*, cudaError_t&);

template <typename T>
bool LaunchLaneBoxNhwc(cudaStream_t stream, const PoolAttrs& a,
                       const PoolShape& s, const T* src, T* dst,
                       cudaError_t& error) {
  error = cudaSuccess;
  // The forms compiled: 28x28 images under 7x7 windows.
  constexpr int K = 7, kSH = 28, kSW = 28;
  if (a.kernel_h != K || a.kernel_w != K || a.stride_h != 1 ||
      a.stride_w != 1 || a.pad_top != 0 || a.pad_bottom != 0 ||
      a.pad_left != 0 || a.pad_right != 0 || s.in_h != kSH || s.in_w != kSW ||
      s.out_h != kSH - K + 1 || s.out_w != kSW - K + 1 ||
      s.channels % 64 != 0 || !CanVectorise<T, 8>(s, src, dst)) {
    return false;
  }
  const SharedFactor<float> shared = SharedFactorOf<float>(a, s);
  const int64_t slabs = s.channels / 64, blocks = s.batch * slabs;
  if (!shared.all || blocks < kMmaMinItems || blocks > INT32_MAX) {
    return false;
  }
  // 512 channels (ResNets' 28x28 stage): every offset a constant.
  const auto kernel = slabs == 8 ? LaneBoxNhwc<T, K, kSH, kSW, 8>
                                 : LaneBoxNhwc<T, K, kSH, kSW, 0>;
  if (!MmaCompiled(kernel)) return false;
  constexpr size_t smem = LaneSmem<K, kSW>();
  error = AllowSharedMemory(kernel, smem);
  if (error != cudaSuccess) return true;
  kernel<<<static_cast<unsigned>(blocks), LaneThreads<K, kSW>(), smem,
           stream>>>(src, dst, static_cast<int>(slabs), shared.value);
  error = cudaGetLastError();
  return true;
}

template bool LaunchLaneBoxNhwc<__half>(cudaStream_t, const PoolAttrs&,
                                        const PoolShape&, const __half*,
                                        __half*, cudaError_t&);
template bool LaunchLaneBoxNhwc<__nv_bfloat16>(cudaStream_t, const PoolAttrs&,
                                               const PoolShape&,
                                               const __nv_bfloat16*,
                                               __nv_bfloat16*, cudaError_t&);

namespace {

// ---------------------------------------------------------------------------
// NHWC gather of stride-1 windows that share one factor, over destination
// images of 20 to 32 rows and columns whose dy tiles fit shared memory twice
// (MmaTileGatherNhwc): the sums down H on the tensor cores, along W in
// registers.
//
// A unit is 32 channels (64 bytes of a pixel) of one image. A block takes
// units blockIdx.x, + gridDim.x, ... in turn, the whole dy tile of each in
// shared memory (cp.async, two buffers: the unit after next is copied in
// while the block sums this one). Warp w takes channels 8 (w & 3) .. + 7 and
// row tile w >> 2: 16 dx rows (the first 16, or the last 16), of which it
// stores one half of the image's rows. Per dy column, one product
// D = A * B sums down H: B is the column's 16 dy rows from the first that
// the windows of the stored rows reach (ldmatrix, transposed: rows as K,
// channels as N), A the 0/1 matrix of which of them each dx row's window
// holds; where those windows reach more than 16 rows of dy, a second
// product takes 8 more. Along W the column sums go into suffix and prefix
// sums over blocks of KW columns held in registers (as BlockSumsNhwc does
// down H, cuda_box_sums.cu): a dx column's window is the suffix of one
// block and the prefix of the next, two additions. The walk along W is
// unrolled (NB blocks, a kernel each); columns outside dy read a zero pixel
// past each tile row, and blocks wholly outside take no products. Each
// block of KW dx columns is scaled, rounded, stored transposed back into
// pixels (stmatrix) in a stage, and copied out in 64-byte pieces by the row
// tile's four warps behind a barrier of their own.
//
// MmaBoxNhwc takes 16 channels of 16 dy columns into 8 dx columns of one row
// per product, a row at a time, and its gather of 64x28x28x512 reads each dy
// row from shared memory for every pair of dx rows whose windows hold it. Here
// a product takes 16 dx rows of one column, and each dy column is read once per
// row tile. On the H200 (CUDA events, us, against MmaBoxNhwc's gather in the
// same runs): bfloat16 64x28x28x512 28.9 against 30.9, float16 29.3 against
// 31.1, with padding 1 31.7 against 32.7; 80x28x28x512 35.0 against 40.8,
// 92x27x27x512 38.8 against 45.2. Outputs equal MmaBoxNhwc's byte for byte on
// those calls' random inputs (both sum exactly in float32 there). Images of
// 28x28 at padding 0 and 1 have kernels with the image fixed at compile time
// (FixedImage, below): 86-87 registers against 114-126, 12.8 M warp
// instructions against 13.6 M, and in the bench (bfloat16 64x28x28x512, against
// the runtime form's run of the day before) 26.3 us against 27.6, 27.7 against
// 30.0 at padding 1, 31.7 against 33.3 for 80 images. A form fixing only the
// columns ran about as fast in the harness (27.0-27.4 against 27.7-27.8 in the
// same runs). Slower forms tried: the walk as a runtime loop (29.7-48.0),
// branches around the products of columns outside dy (31.3), a form of its own
// for blocks wholly inside dy (29.8), the copy out in whole rows of every other
// column a thread (32.2: spills), units handed out by a counter (27.9-28.2 in
// the prototype against 26.1-26.3 in a fixed order; in this kernel, as
// MmaPlanes hands out its groups, 27.9-28.4 against 27.3-27.8), streaming
// stores (within the noise), one tile buffer and three blocks a multiprocessor
// (27.9-28.1), the forward in the same shape (31.4 against MmaBoxNhwc's 27.7:
// its 28-row tiles leave room for fewer units in flight). BENCHMARKS.md has the
// forms and the bench. Elsewhere (channels not in 64s, fewer rows) it was not
// measured against the kernels that take those calls, so it leaves them.
//
// Most of its instructions went to addresses: the copy out found each piece's
// stage and dx offsets again in every block (35 instructions a 16-byte store),
// and the compiler derived the 0/1 fragments again in every block. Each thread
// now finds its pieces' offsets once, before the first unit (a whole block's
// pieces are the same in every block and unit), and holds them and the
// fragments in registers: 12.4 M warp instructions against 8.6 M, bfloat16
// 64x28x28x512 (64 calls from a CUDA graph) 24.4-24.7 us against 26.0-26.2 in
// the same runs; reading all of a thread's pieces from the stage before it
// stores any, 23.8 against 24.2-24.3. The outputs are the same bit for bit. One
// barrier a unit in place of two (the one past the copy in also closes the last
// unit) ran within the noise of that (23.68-23.87 against 23.77-23.83); the
// copy in with its offsets found once likewise took fewer instructions (8.2 M)
// but no less time (24.68-24.79 against 24.46-24.65).
//
// The 0/1 matrix does not hide what it multiplies (0 * inf is NaN): an
// infinity or NaN among a unit's column sums (seen in each block's sum)
// makes the block sum the unit again, element by element from global
// memory.
constexpr int kTileThreads = 256;
constexpr int kTileChannels = 32;
constexpr int kTileMinRows = kMmaMinRows, kTileMaxRows = 32;

// The walk along W is unrolled: blocks of KW columns, NB of them (4 to 6 for
// 20 to 32 columns of 7x7 windows).
constexpr int kTileMinBlocks = 4, kTileMaxBlocks = 6;
template <int NB, int kMax, typename Fn>
void WithTileBlocks(int nb, Fn&& fn) {
  if constexpr (NB <= kMax) {
    if (nb == NB) {
      fn(std::integral_constant<int, NB>{});
    } else {
      WithTileBlocks<NB + 1, kMax>(nb, fn);
    }
  }
}

// The images of a call: dy's rows and columns, dx's, and how far dy leads
// (dx row i takes dy rows i - lead_h .. + KH - 1).
struct TileImage {
  int src_h, src_w, dst_h, dst_w, lead_h, lead_w;
};
// Bytes of a tile row (an odd number of pixels, one past dy's at least) and
// of a tile (its rows and one of zeros).
__host__ __device__ constexpr int TilePitch(const TileImage& im) {
  return ((im.src_w + 1) | 1) * 64;
}
__host__ __device__ constexpr int TileBytes(const TileImage& im) {
  return (im.src_h + 1) * TilePitch(im);
}
// Bytes of a stage row (KW dx columns and one more where KW is even: an odd
// number of pixels) and of a stage buffer (16 rows). A block holds two tiles
// and, per row tile, two stage buffers.
__host__ __device__ constexpr int TileStageRow(int kw) { return (kw | 1) * 64; }
__host__ __device__ constexpr int TileStageBytes(int kw) {
  return 16 * TileStageRow(kw);
}
__host__ __device__ constexpr size_t TileSmemBytes(const TileImage& im,
                                                   int kw) {
  return 2 * static_cast<size_t>(TileBytes(im)) +
         4 * static_cast<size_t>(TileStageBytes(kw));
}
// The images at run time (the kernel's argument), or fixed at compile time
// for common ones (the launcher's list), which lets the compiler lay out
// the whole unit as for one call: its addresses, row tiles and walk along W.
struct RuntimeImage {
  static constexpr bool kFixed = false;
  __host__ __device__ static constexpr TileImage Image() { return {}; }
};
template <int kSrcH, int kSrcW, int kDstH, int kDstW, int kLeadH, int kLeadW>
struct FixedImage {
  static constexpr bool kFixed = true;
  __host__ __device__ static constexpr TileImage Image() {
    return {kSrcH, kSrcW, kDstH, kDstW, kLeadH, kLeadW};
  }
};

// m8n8 matrices to shared memory as they are: lane 4g + t holds row g,
// columns 2t and 2t + 1 of matrix i in m[i], which land at the row address
// that lane 8i + g gives.
__device__ __forceinline__ void StoreRowsTwo(unsigned at, unsigned m0,
                                             unsigned m1) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1,%2};\n" ::"r"(at),
      "r"(m0), "r"(m1)
      : "memory");
#endif
}

// One 16-byte store to global memory (the compiler splits some such
// stores through a computed pointer in four).
__device__ __forceinline__ void StoreGlobal16(void* at, const uint4& v) {
  asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"l"(at), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// acc += A (16 x 8, 2 registers) * B (8 x 8, 1 register).
template <typename T>
__device__ __forceinline__ void MmaAddEight(float (&acc)[4], unsigned a0,
                                            unsigned a1, unsigned b0) {
#if __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(b0));
  } else {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(b0));
  }
#endif
}

template <typename T, typename S, int NB, typename I>
__global__ void __launch_bounds__(kTileThreads, 2)
    MmaTileGatherNhwc(const T* __restrict__ dy, T* __restrict__ dx,
                      const TileImage image, const float factor,
                      const int64_t channels, const int64_t units,
                      const FastDiv by_groups) {
#if __CUDA_ARCH__ >= 900
  constexpr int KH = S::KH, KW = S::KW;
  extern __shared__ __align__(128) unsigned char tile_smem[];
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5;
  const int q = warp & 3, h = warp >> 2;  // channels 8q .. 8q + 7, row tile
  const int g = lane >> 2, t4 = lane & 3;
  // An image's elements fit an int (the launcher), so offsets inside one
  // are ints.
  // Unit u is group u - n * groups of image n = u / groups, by a multiply
  // (units fit an int: the launcher) rather than a 64-bit division before
  // each unit's copy in and sums. H200, harness, us: bfloat16
  // 64x28x28x512 27.1-27.6 against 27.6-28.0, 92x27x27x512 36.9-37.2
  // against 37.8-38.1; with padding 1 30.1-30.4 against 30.0-30.1.
  const int64_t C = channels;
  const int groups = static_cast<int>(C / kTileChannels);
  const int c32 = static_cast<int>(channels);
  const TileImage geo = I::kFixed ? I::Image() : image;
  const int pitch = TilePitch(geo), buf = TileBytes(geo);
  constexpr int stage_row = TileStageRow(KW);
  const int src_px = geo.src_h * geo.src_w;
  const int64_t dst_px = static_cast<int64_t>(geo.dst_h) * geo.dst_w;
  const unsigned smem =
      static_cast<unsigned>(__cvta_generic_to_shared(tile_smem));
  // Chunk c (16 bytes, 8 channels) of pixel p of tile row r sits at
  // c ^ ((r >> 1) & 3): with rows an odd number of 64-byte pixels apart, the
  // eight rows that one matrix of ldmatrix reads fall on distinct banks.
  const auto at_of = [&](int r, int p, int c) {
    return static_cast<unsigned>(r * pitch + p * 64 +
                                 ((c ^ ((r >> 1) & 3)) << 4));
  };
  // The zero row after each tile's rows and the zero pixels past each row's
  // last, written once (no copy reaches them); the first unit's barrier
  // orders them before any read.
  const int row_px = pitch / 64;
  const int spare = (geo.src_h + 1) * row_px - geo.src_h * geo.src_w;
  for (int i = tid; i < 2 * 4 * spare; i += kTileThreads) {
    const int b = i / (4 * spare), c = i & 3;
    int px = i % (4 * spare) >> 2, r = geo.src_h, p = px;
    if (px < geo.src_h * (row_px - geo.src_w)) {
      r = px / (row_px - geo.src_w);
      p = geo.src_w + px % (row_px - geo.src_w);
    } else {
      p = px - geo.src_h * (row_px - geo.src_w);
    }
    *reinterpret_cast<uint4*>(tile_smem + b * buf + at_of(r, p, c)) =
        make_uint4(0, 0, 0, 0);
  }
  const float inv_w = 1.0f / geo.src_w;
  const auto load = [&](int64_t u, int b) {
    if (u < units) {
      const int n = by_groups(static_cast<int>(u));
      const int cg = static_cast<int>(u) - n * groups;
      const T* const base =
          dy + static_cast<int64_t>(n) * src_px * C + cg * kTileChannels;
      for (int i = tid; i < 4 * src_px; i += kTileThreads) {
        const int c = i & 3, pix = i >> 2;
        // pix / src_w (pix < 2^16: exact through the float reciprocal)
        const int r = __float2int_rz((pix + 0.5f) * inv_w);
        const int p = pix - r * geo.src_w;
        StartCopyTo<16, false>(smem + b * buf + at_of(r, p, c),
                               base + (pix * c32 + c * 8), true);
      }
    }
    CommitCopies();
  };
  // Row tile 0 holds dx rows [0, 16) and stores [0, split); row tile 1
  // holds [dst_h - 16, dst_h) and stores [split, dst_h). Each reads the dy
  // rows from the first its stored rows' windows reach: 16 (one product) or
  // 24 (two).
  const int split = (geo.dst_h + 1) / 2;
  const int m0 = h ? geo.dst_h - 16 : 0;
  const int lo = h ? split : 0, hi = h ? geo.dst_h : split;
  const int first = max(lo - geo.lead_h, 0);
  const int last = min(hi - 1 - geo.lead_h + KH - 1, geo.src_h - 1);
  const int k0 = min(first, geo.src_h);
  const int chunks = last - first + 1 > 16 ? 2 : 1;
  // A[m][k] = 1 where dy row k0 + k lies in the window of dx row m0 + m;
  // a0 .. a3 the first product's fragment, e0 and e1 the second's (k from
  // 16).
  const auto one = [&](int m, int k) {
    const int d = k0 + k - m0 - m;
    return d >= -geo.lead_h && d < KH - geo.lead_h ? MmaOne<T>::kBits : 0u;
  };
  const auto pair = [&](int m, int k) {
    return one(m, k) | one(m, k + 1) << 16;
  };
  unsigned a0 = pair(g, 2 * t4), a1 = pair(g + 8, 2 * t4);
  unsigned a2 = pair(g, 2 * t4 + 8), a3 = pair(g + 8, 2 * t4 + 8);
  unsigned e0 = pair(g, 2 * t4 + 16), e1 = pair(g + 8, 2 * t4 + 16);
  // Held in registers: the compiler would otherwise derive them again in
  // every block of every unit.
  asm volatile("" : "+r"(a0), "+r"(a1), "+r"(a2), "+r"(a3), "+r"(e0), "+r"(e1));
  // Lane L < 24 gives the address of dy row k0 + L, or of the zero row past
  // dy's last.
  const int lr = lane < 24 ? k0 + lane : k0;
  const unsigned read_at = at_of(lr < geo.src_h ? lr : geo.src_h, 0, q);
  // The stage: [row tile][buffer][16 rows][stage_row bytes], chunks placed
  // as in the tiles.
  constexpr int stage_bytes = TileStageBytes(KW);
  const unsigned stage = smem + 2 * buf;
  const auto stage_of = [&](int row, int j, int c) {
    return static_cast<unsigned>(row * stage_row + j * 64 +
                                 ((c ^ ((row >> 1) & 3)) << 4));
  };
  // Lane L of stmatrix gives dx row m0 + L's address: stage row
  // m0 + L - lo, those stored in [0, hi - lo), the others, as many, in the
  // rows left.
  const unsigned st_at = stage + 2 * h * stage_bytes +
                         stage_of((m0 + (lane & 15) - lo) & 15, 0, q);
  const unsigned char* const my_stage =
      tile_smem + 2 * buf + 2 * h * stage_bytes;
  // The copy out of a whole block (KW columns): piece i = (tid & 127) +
  // 128 k of its (hi - lo) * KW * 4 is the same in every block and unit, so
  // each thread finds its stage offsets and dx offsets (elements, from the
  // block's first column of the unit's first row) once.
  constexpr int kPieceSteps = (16 * KW * 4 + 127) / 128;
  unsigned piece_at[kPieceSteps];
  int piece_off[kPieceSteps];
#pragma unroll
  for (int k = 0; k < kPieceSteps; ++k) {
    const int i = (tid & 127) + 128 * k;
    const int c = i & 3, px = i >> 2, row = px / KW, j = px - row * KW;
    const bool valid = i < (hi - lo) * KW * 4;
    piece_at[k] = valid ? stage_of(row, j, c) : 0u;
    piece_off[k] = valid ? ((lo + row) * geo.dst_w + j) * c32 + c * 8 : -1;
    asm volatile("" : "+r"(piece_at[k]), "+r"(piece_off[k]));
  }
  // The unit summed element by element from global memory, where its
  // column sums were not all finite.
  const auto fallback = [&](int n, int cg) {
    const T* const x0 =
        dy + static_cast<int64_t>(n) * src_px * C + cg * kTileChannels;
    T* const out = dx + n * dst_px * C + cg * kTileChannels;
    for (int64_t i = tid; i < dst_px * 16; i += kTileThreads) {
      const int e = static_cast<int>(i & 15);
      const int pix = static_cast<int>(i >> 4);
      const int oi = pix / geo.dst_w, oj = pix - oi * geo.dst_w;
      float s0 = 0.f, s1 = 0.f;
      for (int dh = 0; dh < KH; ++dh) {
        const int r = oi - geo.lead_h + dh;
        if (r < 0 || r >= geo.src_h) continue;
        for (int dw = 0; dw < KW; ++dw) {
          const int c = oj - geo.lead_w + dw;
          if (c < 0 || c >= geo.src_w) continue;
          const T* const x =
              x0 + (static_cast<int64_t>(r) * geo.src_w + c) * C + 2 * e;
          s0 += Num<T>::Load(x[0]);
          s1 += Num<T>::Load(x[1]);
        }
      }
      *reinterpret_cast<unsigned*>(out + pix * C + 2 * e) =
          Pack<T>(s0 * factor, s1 * factor);
    }
  };
  const int64_t step = gridDim.x;
  load(blockIdx.x, 0);
  load(blockIdx.x + step, 1);
  // 0 while every column sum of the unit is finite (x * 0 + check).
  float check = 0.f;
  int last_n = 0, last_cg = 0;
  int k = 0;
  for (int64_t unit = blockIdx.x; unit < units; unit += step, ++k) {
    if (k == 0) {
      CopyWait<1>();
    } else {
      CopyWait<0>();
    }
    // One barrier a unit: past it, this unit's tile is in, and every read
    // of the last unit's tile and every copy out of the last unit is done,
    // so its buffer takes the next unit, and the last unit, where it held
    // an infinity or NaN, is summed again.
    if (__syncthreads_or(!(check == 0.f))) fallback(last_n, last_cg);
    if (k > 0) load(unit + step, (k + 1) & 1);
    check = 0.f;
    const unsigned tile = smem + (k & 1) * buf + read_at;
    const unsigned zero_at = tile + geo.src_w * 64;
    const int n = by_groups(static_cast<int>(unit));
    const int cg = static_cast<int>(unit) - n * groups;
    last_n = n;
    last_cg = cg;
    T* const out = dx + n * dst_px * C + cg * kTileChannels;
    // Column sums numbered t: dx column o sums t = o .. o + KW - 1, t being
    // dy column t - lead_w, or the zero pixel past each tile row's last.
    // Lane 4g + t4 holds rows g and g + 8, channels 2 t4 and 2 t4 + 1.
    const auto columns = [&](auto two) {
      float ring[KW][4], pre[4];
      FillZero(ring);
      FillZero(pre);
      // The sums of KW columns from t0 into ring (the suffix sums of the
      // block once done), and with `out`, dx columns t0 - KW .. t0 - 1 into
      // stage buffer b & 1.
      // `any`: some column of the block lies in dy (else no products).
      const auto block = [&](int t0, int b, auto out, auto any) {
#pragma unroll
        for (int j = 0; j < KW; ++j) {
          float v[4] = {0.f, 0.f, 0.f, 0.f};
          if constexpr (decltype(any)::value) {
            const int u = t0 + j - geo.lead_w;
            const unsigned at =
                static_cast<unsigned>(u) < static_cast<unsigned>(geo.src_w)
                    ? tile + u * 64
                    : zero_at;
            if constexpr (decltype(two)::value) {
              unsigned m[4];
              LoadFour(m, at);
              MmaAdd<T>(v, v, a0, a1, a2, a3, m[0], m[1], true);
              MmaAddEight<T>(v, e0, e1, m[2]);
            } else {
              unsigned m[2];
              LoadTwo(m, at);
              MmaAdd<T>(v, v, a0, a1, a2, a3, m[0], m[1], true);
            }
          }
          if constexpr (decltype(out)::value) {
            // dx column t0 + j - KW: the suffix of the last block from j and
            // the prefix of this one before j.
            float r[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              r[e] = (j > 0 ? ring[j][e] + pre[e] : ring[j][e]) * factor;
            }
            const unsigned w0 = Pack<T>(r[0], r[1]), w1 = Pack<T>(r[2], r[3]);
            StoreRowsTwo(st_at + (b & 1) * stage_bytes + j * 64, w0, w1);
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            pre[e] = j > 0 ? pre[e] + v[e] : v[e];
            ring[j][e] = v[e];
          }
        }
#pragma unroll
        for (int j = KW - 2; j >= 0; --j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) ring[j][e] += ring[j + 1][e];
        }
        // An infinity or NaN among the block's column sums makes its sum
        // one too (or a NaN).
#pragma unroll
        for (int e = 0; e < 4; ++e) check = fmaf(ring[0][e], 0.f, check);
      };
      const auto any_block = [&](int t0, int b, auto out) {
        const int u0 = t0 - geo.lead_w, u1 = u0 + KW - 1;
        if (u1 < 0 || u0 >= geo.src_w) {
          block(t0, b, out, std::false_type{});
        } else {
          block(t0, b, out, std::true_type{});
        }
      };
      // dx columns o0 .. o0 + cols - 1 of stage buffer b & 1: the row
      // tile's four warps copy its rows out. A whole block (KW columns)
      // takes each thread's pieces as found before the first unit, its
      // reads from the stage all issued before its stores.
      const auto copy_out = [&](int o0, int b, auto whole) {
        const unsigned char* const sb = my_stage + (b & 1) * stage_bytes;
        if constexpr (decltype(whole)::value) {
          T* const ob = out + o0 * C;
          uint4 val[kPieceSteps];
#pragma unroll
          for (int k = 0; k < kPieceSteps; ++k) {
            val[k] = *reinterpret_cast<const uint4*>(sb + piece_at[k]);
          }
#pragma unroll
          for (int k = 0; k < kPieceSteps; ++k) {
            if (piece_off[k] >= 0) StoreGlobal16(ob + piece_off[k], val[k]);
          }
        } else {
          const int cols = geo.dst_w - o0;
          const float inv_cols = 1.0f / cols;
          const int pieces = (hi - lo) * cols * 4;
#pragma unroll 1
          for (int i = tid & 127; i < pieces; i += 128) {
            const int c = i & 3, px = i >> 2;
            const int row = __float2int_rz((px + 0.5f) * inv_cols);
            const int j = px - row * cols;
            const uint4 val =
                *reinterpret_cast<const uint4*>(sb + stage_of(row, j, c));
            *reinterpret_cast<uint4*>(
                out +
                ((lo + row) * static_cast<int64_t>(geo.dst_w) + o0 + j) * C +
                c * 8) = val;
          }
        }
      };
      any_block(0, 0, std::false_type{});
#pragma unroll
      for (int b = 1; b < NB; ++b) {
        const int t0 = KW * b;
        any_block(t0, b, std::true_type{});
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + h) : "memory");
        if (t0 <= geo.dst_w) {
          copy_out(t0 - KW, b, std::true_type{});
        } else {
          copy_out(t0 - KW, b, std::false_type{});
        }
      }
    };
    if (chunks == 2) {
      columns(std::true_type{});
    } else {
      columns(std::false_type{});
    }
  }
  if (__syncthreads_or(!(check == 0.f))) fallback(last_n, last_cg);
  CopyWait<0>();
#endif
}

}  // namespace

template <typename T>
bool LaunchMmaTileGatherNhwc(cudaStream_t stream, const PoolAttrs& a,
                             const PoolShape& s, const T* dy, T* dx,
                             cudaError_t& error) {
  error = cudaSuccess;
  return WithSpec(a, [&](auto spec) {
    using S = decltype(spec);
    if constexpr (!NhwcBox<S>() || S::KW > 9 || S::KH > 9) {
      return false;
    } else {
      constexpr int KH = S::KH, KW = S::KW;
      const SharedFactor<float> shared = SharedFactorOf<float>(a, s);
      // Channels in 64s, as MmaBoxNhwc takes them: only there was it
      // measured against the kernels that take the call otherwise.
      if (!shared.all || s.channels % 64 != 0 ||
          !CanVectorise<T, 8>(s, dy, dx)) {
        return false;
      }
      const int64_t dst_h = s.in_h, dst_w = s.in_w;
      const int64_t src_h = s.out_h, src_w = s.out_w;
      const int64_t lead_h = KH - 1 - a.pad_top, lead_w = KW - 1 - a.pad_left;
      if (dst_h < kTileMinRows || dst_h > kTileMaxRows || lead_h < 0 ||
          lead_w < 0 || src_h < 1 || src_w < 1 || src_w > 64 ||
          dst_w < kTileMinRows || dst_w > kTileMaxRows ||
          dst_h * dst_w * s.channels > int64_t{INT32_MAX} ||
          src_h * src_w * s.channels > int64_t{INT32_MAX}) {
        return false;
      }
      const TileImage geo{static_cast<int>(src_h),  static_cast<int>(src_w),
                          static_cast<int>(dst_h),  static_cast<int>(dst_w),
                          static_cast<int>(lead_h), static_cast<int>(lead_w)};
      const size_t smem = TileSmemBytes(geo, KW);
      using Kernel =
          void (*)(const T*, T*, TileImage, float, int64_t, int64_t, FastDiv);
      Kernel kernel = nullptr;
      // 28x28 dx images under 7x7 windows, padding 0 or 1: fixed images.
      const auto fixed = [&](auto kind) {
        using F = decltype(kind);
        constexpr TileImage im = F::Image();
        if (kernel == nullptr && geo.src_h == im.src_h &&
            geo.src_w == im.src_w && geo.dst_h == im.dst_h &&
            geo.dst_w == im.dst_w && geo.lead_h == im.lead_h &&
            geo.lead_w == im.lead_w) {
          kernel = MmaTileGatherNhwc<T, S, (im.dst_w + 2 * KW - 1) / KW, F>;
        }
      };
      if constexpr (KH == 7 && KW == 7) {
        fixed(FixedImage<22, 22, 28, 28, 6, 6>{});
        fixed(FixedImage<24, 24, 28, 28, 5, 5>{});
      }
      // Blocks of KW columns the walk along W takes (dst_w + KW columns).
      const int nb = (geo.dst_w + 2 * KW - 1) / KW;
      if (kernel == nullptr) {
        WithTileBlocks<kTileMinBlocks, kTileMaxBlocks>(nb, [&](auto n) {
          kernel = MmaTileGatherNhwc<T, S, decltype(n)::value, RuntimeImage>;
        });
      }
      if (kernel == nullptr) return false;
      const KernelCode code = CodeOf(kernel);
      if (code.binary < 90) return false;
      int device = 0, sms = 0;
      int64_t resident = 0;
      error = cudaGetDevice(&device);
      if (error == cudaSuccess) error = Multiprocessors(device, sms);
      if (error == cudaSuccess) error = AllowSharedMemory(kernel, smem);
      if (error == cudaSuccess) {
        error = ResidentBlocks(kernel, kTileThreads, smem, resident);
      }
      if (error != cudaSuccess) return true;
      // Two blocks a multiprocessor at least, and units for every block.
      const int64_t units = s.batch * (s.channels / kTileChannels);
      if (resident < 2 * int64_t{sms} || units < resident ||
          units > INT32_MAX) {
        return false;
      }
      const unsigned grid = static_cast<unsigned>(resident);
      const FastDiv by_groups =
          FastDiv::Of(static_cast<uint32_t>(s.channels / kTileChannels));
      kernel<<<grid, kTileThreads, smem, stream>>>(
          dy, dx, geo, shared.value, s.channels, units, by_groups);
      error = cudaGetLastError();
      return true;
    }
  });
}

template bool LaunchMmaTileGatherNhwc<__half>(cudaStream_t, const PoolAttrs&,
                                              const PoolShape&, const __half*,
                                              __half*, cudaError_t&);
template bool LaunchMmaTileGatherNhwc<__nv_bfloat16>(
    cudaStream_t, const PoolAttrs&, const PoolShape&, const __nv_bfloat16*,
    __nv_bfloat16*, cudaError_t&);

namespace {

// The launcher of both: the forward of stride-1 windows under attributes
// `a` over planes of shape `s`, each window's sum scaled by `shared` where
// all share one factor.
template <typename T>
bool LaunchMmaPlanes(cudaStream_t stream, const PoolAttrs& a,
                     const PoolShape& s, const SharedFactor<float>& shared,
                     const T* src, T* dst, int schedule, cudaError_t& error) {
  return WithSpec(a, [&](auto spec) {
    using S = decltype(spec);
    if constexpr (!NhwcBox<S>() || S::KW > 8) {
      return false;
    } else {
      constexpr int KW = S::KW;
      if (a.layout != kNCHW) return false;
      const int64_t H = s.in_h, W = s.in_w, OH = s.out_h, OW = s.out_w;
      const int64_t off_w = -a.pad_left;
      // Pairs of columns: rows of even width, and the K side starting at an
      // even column that leaves the windows of a tile inside its 16.
      if (W % 2 != 0 || OW % 2 != 0 || OW <= 16 || OW > 32 || OH < 1 ||
          H > 64 || W > 64 || KW + (off_w & 1) > 9 || a.pad_top > 16 ||
          a.pad_left > 16 || reinterpret_cast<uintptr_t>(src) % 4 != 0 ||
          reinterpret_cast<uintptr_t>(dst) % 16 != 0) {
        return false;
      }
      const auto launch = [&](auto nt) {
        constexpr int NT = decltype(nt)::value;
        MmaPlaneGeom g;
        const int64_t cs = off_w - (off_w & 1);
        const int64_t in_bytes = 2 * H * W;
        // Bytes a plane's tiles read: from column cs of its first row to
        // 16 (NT + 1) bytes further in its last.
        const int64_t reach =
            std::max(in_bytes, 2 * ((H - 1) * W + cs) + 16 * (NT + 1));
        int64_t pitch = (reach + 15) / 16 * 16;
        if (pitch % 32 == 0) pitch += 16;  // an odd multiple of 16 bytes
        g.src_h = static_cast<int>(H);
        g.src_w = static_cast<int>(W);
        g.dst_h = static_cast<int>(OH);
        g.dst_w = static_cast<int>(OW);
        g.off_h = static_cast<int>(-a.pad_top);
        g.off_w = static_cast<int>(off_w);
        g.lead =
            static_cast<int>(std::max<int64_t>(16, (-2 * cs + 15) / 16 * 16));
        g.pitch = static_cast<int>(pitch);
        g.buffer = g.lead + kPlaneMmaPlanes * g.pitch;
        g.in_bytes = static_cast<int>(in_bytes);
        g.in_q = PieceOf(in_bytes, src, 4);
        g.plane_of = FastDiv::Of(static_cast<uint32_t>(in_bytes / g.in_q));
        g.out_bytes = static_cast<int>(2 * OH * OW);
        g.out_at = 2 * g.buffer;
        g.factors_at =
            g.out_at + (kPlaneMmaPlanes * g.out_bytes + 15) / 16 * 16;
        const size_t smem =
            static_cast<size_t>(g.factors_at) + (OH + 8 * NT) * sizeof(float);
        if (smem > kPlaneMmaMaxShared) return false;
        const auto kernel = shared.all ? MmaPlanesNchw<T, S, NT, true>
                                       : MmaPlanesNchw<T, S, NT, false>;
        if (!MmaCompiled(kernel)) return false;
        const int64_t groups = Groups(s.batch * s.channels, kPlaneMmaPlanes);
        error = cudaSuccess;
        if (groups == 0) return true;
        int device = 0, sms = 0;
        error = cudaGetDevice(&device);
        if (error == cudaSuccess) error = Multiprocessors(device, sms);
        if (error != cudaSuccess) return true;
        error = AllowSharedMemory(kernel, smem);
        if (error != cudaSuccess) return true;
        // As many blocks as stay resident together, each looping over
        // groups of planes with the next group's copy in flight.
        int64_t blocks = 0;
        error = ResidentBlocks(kernel, kPlaneMmaThreads, smem, blocks);
        if (error != cudaSuccess) return true;
        // Two blocks a multiprocessor (16 warps), or the other kernels.
        if (blocks < 2 * int64_t{sms} || groups < kPlaneMmaMinLoops * blocks) {
          return false;
        }
        unsigned* counter = nullptr;
        if (schedule >= 0 && schedule < kScheduleSlots &&
            groups - blocks < int64_t{UINT32_MAX}) {
          error = ScheduleCounter(schedule, counter);
          if (error != cudaSuccess) return true;
        }
        kernel<<<static_cast<unsigned>(blocks), kPlaneMmaThreads, smem,
                 stream>>>(a, g, src, dst, shared, s.batch * s.channels,
                           counter);
        error = cudaGetLastError();
        return true;
      };
      return OW <= 24 ? launch(std::integral_constant<int, 3>{})
                      : launch(std::integral_constant<int, 4>{});
    }
  });
}

}  // namespace

template <typename T>
bool LaunchMmaPlanesNchw(cudaStream_t stream, const PoolAttrs& a,
                         const PoolShape& s, const T* src, T* dst, int schedule,
                         cudaError_t& error) {
  return LaunchMmaPlanes<T>(stream, a, s, SharedFactorOf<float>(a, s), src, dst,
                            schedule, error);
}

// The gather of stride-1 windows that share one factor is a forward over
// dy: dx(i, j) sums dy over rows i + pad_top - KH + 1 .. i + pad_top and
// the columns alike (zero outside dy), the forward's windows over dy
// padded by KH - 1 - pad_top above and KW - 1 - pad_left on the left,
// scaled by the same factor.
template <typename T>
bool LaunchMmaPlanesNchwGather(cudaStream_t stream, const PoolAttrs& a,
                               const PoolShape& s, const T* dy, T* dx,
                               cudaError_t& error) {
  const SharedFactor<float> shared = SharedFactorOf<float>(a, s);
  if (!shared.all || a.layout != kNCHW || a.stride_h != 1 || a.stride_w != 1) {
    return false;
  }
  PoolAttrs f = a;
  const PoolShape g{s.batch, s.channels, s.out_h, s.out_w, s.in_h, s.in_w};
  f.pad_top = a.kernel_h - 1 - a.pad_top;
  f.pad_left = a.kernel_w - 1 - a.pad_left;
  f.pad_bottom = g.out_h - g.in_h - f.pad_top + a.kernel_h - 1;
  f.pad_right = g.out_w - g.in_w - f.pad_left + a.kernel_w - 1;
  f.ceil_mode = 0;
  if (f.pad_top < 0 || f.pad_left < 0 || f.pad_bottom < 0 || f.pad_right < 0) {
    return false;
  }
  return LaunchMmaPlanes<T>(stream, f, g, shared, dy, dx, -1, error);
}

template bool LaunchMmaPlanesNchw<__half>(cudaStream_t, const PoolAttrs&,
                                          const PoolShape&, const __half*,
                                          __half*, int, cudaError_t&);
template bool LaunchMmaPlanesNchw<__nv_bfloat16>(cudaStream_t, const PoolAttrs&,
                                                 const PoolShape&,
                                                 const __nv_bfloat16*,
                                                 __nv_bfloat16*, int,
                                                 cudaError_t&);
template bool LaunchMmaPlanesNchwGather<__half>(cudaStream_t, const PoolAttrs&,
                                                const PoolShape&, const __half*,
                                                __half*, cudaError_t&);
template bool LaunchMmaPlanesNchwGather<__nv_bfloat16>(
    cudaStream_t, const PoolAttrs&, const PoolShape&, const __nv_bfloat16*,
    __nv_bfloat16*, cudaError_t&);

}  // namespace jax_avgpool::cuda
