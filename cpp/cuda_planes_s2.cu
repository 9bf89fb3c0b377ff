// The NCHW 16-bit forward of 3x3 windows at stride 2 over whole planes in
// shared memory (PlanesS2Nchw).
//
// The row kernel (ForwardNchwRows) takes two output rows of a plane an
// item, reads the five source rows under them from global memory (the row
// the items on either side share, twice) and stores each lane's four
// outputs in place. Where output rows have an odd number of elements (3x3/2
// without padding over even widths: 56 -> 27, 112 -> 55) those stores go
// out element by element, four 2-byte stores into the same 32-byte sectors,
// and the call is held by L2's throughput: over 128x256 planes of 56x56,
// 6.1 M L2 sectors written for 1.3 M of output and 9.8 M read for 6.4 M of
// input (BENCHMARKS.md).
//
// Here a block copies a group of G consecutive planes in, one contiguous
// range, by cp.async (the next group's copy in flight while it sums one),
// each thread sums 2 output rows by 4 columns of a plane from shared memory
// (16-byte loads of 8 source columns, or two of 8 bytes where rows are not
// whole 16-byte pieces, and one more element a row, the row
// the two outputs share loaded once), stages the group's outputs in shared
// memory in the order they have in global memory, and the block copies
// them out as one range in 16-byte pieces: every source byte read once,
// every output sector written whole but at the range's two ends.
//
// On the H200 (CUDA events, us, 128x256 planes of 56x56 without padding,
// against the row kernel): bfloat16 66.6-67.9 against 71.1-71.6, float16
// 67.5-67.6 against 69.7-69.9; 32x64 planes of 112x112, bfloat16, 20.6-20.7
// against 20.8. Nsight Compute, the bfloat16 call: 39.3 M warp instructions
// against 43.4 M, 2.3 M L2 sectors written against 6.1 M, L2 throughput
// 76% against 92%. Where output rows pair up the row kernel stores whole
// runs and stays: with padding 1 (28 outputs a row) 65.6 against 67.9-68.0.
// Rows of whole 8-byte pieces but not 16 (widths of 4 mod 8), which the row
// kernel does not take, went to ForwardNchw (4 outputs of a row a thread,
// loads from global memory): bfloat16
// 128x256 planes of 28x28, 23.6-23.8 against 44.8 (float16 alike); 64x128
// of 60x60, 25.0-25.3 against 47.9; 32x64 of 44x44, 7.4-7.5 against 11.1.
#include <cstdint>
#include <type_traits>

#include "cuda_common.cuh"

namespace jax_avgpool::cuda {
namespace {

constexpr int kS2Threads = 256;
// Shared memory a block may take: two buffers of G planes and the stage.
// Three blocks (24 warps) a multiprocessor on the H100 and H200.
constexpr int kS2Budget = 72 * 1024;
constexpr int kS2MaxGroup = 32;

struct S2Geom {
  int in_h, in_w, out_h, out_w;  // a source and a destination plane
  int group;                     // G, planes a group
  int in_bytes;                  // bytes of a source plane (a multiple of Q)
  int out_plane;                 // elements of a destination plane
  int col_quads;                 // 4-column tasks across a destination row
  int units;                     // tasks a plane: row pairs x col_quads
  FastDiv by_units, by_quads;
  int buffer;    // bytes of one buffer of G source planes
  int stage_at;  // the stage's offset in shared memory
};

// The low and the high 16-bit element of a word, as float32.
template <typename T>
__device__ __forceinline__ float Lo(unsigned w);
template <typename T>
__device__ __forceinline__ float Hi(unsigned w);
template <>
__device__ __forceinline__ float Lo<__nv_bfloat16>(unsigned w) {
  return __uint_as_float(w << 16);
}
template <>
__device__ __forceinline__ float Hi<__nv_bfloat16>(unsigned w) {
  return __uint_as_float(w & 0xffff0000u);
}
template <>
__device__ __forceinline__ float Lo<__half>(unsigned w) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w)));
}
template <>
__device__ __forceinline__ float Hi<__half>(unsigned w) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
}

__device__ __forceinline__ unsigned short Bits16(__nv_bfloat16 v) {
  return __bfloat16_as_ushort(v);
}
__device__ __forceinline__ unsigned short Bits16(__half v) {
  return __half_as_ushort(v);
}

// PL, PT: the left and top padding (0 or 1). Q: bytes the source rows are
// a whole number of (16, or 8 where they are not 16), the pieces of the
// copy in and of the loads of a row's 8 columns.
template <typename T, int PL, int PT, int Q>
__global__ void __launch_bounds__(kS2Threads, 3)
    PlanesS2Nchw(const T* __restrict__ src, T* __restrict__ dst, const S2Geom g,
                 const float value, const int64_t planes) {
  // Below sm_80 the copies in are plain loads and stores (StartCopy), done
  // when issued, and the waits nothing: the same order, without overlap.
  extern __shared__ __align__(16) unsigned char s2_smem[];
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t groups = (planes + g.group - 1) / g.group;
  const int64_t in_elems = static_cast<int64_t>(g.in_h) * g.in_w;
  unsigned short* const stage =
      reinterpret_cast<unsigned short*>(s2_smem + g.stage_at);
  // Group q's source planes into buffer b, Q bytes a thread at a time.
  const auto copy_in = [&](int64_t q, int b) {
    const int64_t p0 = q * g.group;
    const int np = static_cast<int>(min(int64_t{g.group}, planes - p0));
    const int chunks = np * (g.in_bytes / Q);
    const unsigned char* from =
        reinterpret_cast<const unsigned char*>(src + p0 * in_elems);
    unsigned char* to = s2_smem + b * g.buffer;
    for (int i = tid; i < chunks; i += kS2Threads) {
      StartCopy<Q, false>(to + i * Q, from + i * Q, true);
    }
  };
  int64_t q = blockIdx.x;
  if (q < groups) copy_in(q, 0);
  CommitCopies();
  for (int it = 0; q < groups; ++it, q += gridDim.x) {
    if (q + gridDim.x < groups) copy_in(q + gridDim.x, (it + 1) & 1);
    CommitCopies();
    CopyWait<1>();
    // This group's planes are in; the last group's copy out is done.
    __syncthreads();
    const int64_t p0 = q * g.group;
    const int np = static_cast<int>(min(int64_t{g.group}, planes - p0));
    const unsigned char* const buf = s2_smem + (it & 1) * g.buffer;
    // The stage holds output k of the group at element shift + k, so that
    // its 16-byte pieces are those of global memory.
    T* const out0 = dst + p0 * g.out_plane;
    const int shift =
        static_cast<int>(reinterpret_cast<uintptr_t>(out0) % 16) / 2;
    for (int u = tid; u < np * g.units; u += kS2Threads) {
      const int p = g.by_units(u);
      const int r = u - p * g.units;
      const int rp = g.by_quads(r);
      const int cq = r - rp * g.col_quads;
      const unsigned char* const plane = buf + p * g.in_bytes;
      // Source rows 4 rp - PT + d (d < 5) and columns 8 cq - PL + c (c < 9):
      // sums along W of the 3 columns of outputs 4 cq + o, for each row.
      float h[5][4];
#pragma unroll
      for (int d = 0; d < 5; ++d) {
        const int row = 4 * rp - PT + d;
        if (row < 0 || row >= g.in_h) {
#pragma unroll
          for (int o = 0; o < 4; ++o) h[d][o] = 0.f;
          continue;
        }
        // Rows are whole pieces of Q bytes, so each Q-byte piece of the 8
        // columns from 8 cq lies wholly inside the source row or wholly past
        // it (windows past its end under ceil_mode).
        const unsigned char* const at = plane + (row * g.in_w + 8 * cq) * 2;
        unsigned w[4];
        if constexpr (Q == 16) {
          const uint4 v = 8 * cq < g.in_w ? *reinterpret_cast<const uint4*>(at)
                                          : uint4{0u, 0u, 0u, 0u};
          w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
        } else {
          const uint2 v0 = 8 * cq < g.in_w ? *reinterpret_cast<const uint2*>(at)
                                           : uint2{0u, 0u};
          const uint2 v1 = 8 * cq + 4 < g.in_w
                               ? *reinterpret_cast<const uint2*>(at + 8)
                               : uint2{0u, 0u};
          w[0] = v0.x, w[1] = v0.y, w[2] = v1.x, w[3] = v1.y;
        }
        float x[9];
        if constexpr (PL == 0) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            x[2 * e] = Lo<T>(w[e]);
            x[2 * e + 1] = Hi<T>(w[e]);
          }
          const bool in = 8 * cq + 8 < g.in_w;
          const unsigned last =
              in ? *reinterpret_cast<const unsigned short*>(at + 16) : 0u;
          x[8] = Lo<T>(last);
        } else {
          const unsigned first =
              cq > 0 && 8 * cq <= g.in_w
                  ? *reinterpret_cast<const unsigned short*>(at - 2)
                  : 0u;
          x[0] = Lo<T>(first);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            x[2 * e + 1] = Lo<T>(w[e]);
            x[2 * e + 2] = Hi<T>(w[e]);
          }
        }
#pragma unroll
        for (int o = 0; o < 4; ++o) {
          h[d][o] = x[2 * o] + x[2 * o + 1] + x[2 * o + 2];
        }
      }
      const int i0 = 2 * rp, j0 = 4 * cq;
      const int base = p * g.out_plane + i0 * g.out_w + j0 + shift;
#pragma unroll
      for (int o = 0; o < 4; ++o) {
        if (j0 + o >= g.out_w) break;
        const float s0 = (h[0][o] + h[1][o] + h[2][o]) * value;
        stage[base + o] = Bits16(Num<T>::Store(s0));
        if (i0 + 1 < g.out_h) {
          const float s1 = (h[2][o] + h[3][o] + h[4][o]) * value;
          stage[base + g.out_w + o] = Bits16(Num<T>::Store(s1));
        }
      }
    }
    __syncthreads();  // the stage is whole; the buffer may be refilled
    // The copy out: whole 16-byte pieces, and the elements of the pieces
    // at the range's ends one at a time.
    const int n = np * g.out_plane;
    const int first = shift > 0 ? 1 : 0;  // the first whole piece
    const int last = (n + shift) / 8;     // one past the last
    uint4* const out_v = reinterpret_cast<uint4*>(out0 - shift);
    const uint4* const stage_v = reinterpret_cast<const uint4*>(stage);
    for (int i = first + tid; i < last; i += kS2Threads) out_v[i] = stage_v[i];
    // Elements of the partial pieces at the two ends: the first piece's
    // (shift > 0), then those past the last whole piece.
    unsigned short* const out_s = reinterpret_cast<unsigned short*>(out0);
    const int head = shift > 0 ? min(8 - shift, n) : 0;
    const int tail = max(8 * last - shift, head);
    if (tid < head) out_s[tid] = stage[shift + tid];
    if (tid >= 32 && tid - 32 < n - tail) {
      out_s[tail + tid - 32] = stage[shift + tail + tid - 32];
    }
  }
  CopyWait<0>();
}

}  // namespace

template <typename T>
bool LaunchPlanesS2Nchw(cudaStream_t stream, const PoolAttrs& a,
                        const PoolShape& s, const T* src, T* dst,
                        cudaError_t& error) {
  const SharedFactor<float> shared = SharedFactorOf<float>(a, s);
  // Rows of an odd number of outputs only: where they pair up, the row
  // kernel stores whole runs and was faster (65.6 us against 67.9-68.0
  // over 128x256 planes of 56x56 with padding 1).
  if (a.layout != kNCHW || a.kernel_h != 3 || a.kernel_w != 3 ||
      a.stride_h != 2 || a.stride_w != 2 || a.pad_top > 1 || a.pad_left > 1 ||
      !shared.all || s.in_w % 4 != 0 || s.out_h < 1 || s.out_w % 2 != 1 ||
      reinterpret_cast<uintptr_t>(src) % 8 != 0 ||
      reinterpret_cast<uintptr_t>(dst) % 2 != 0) {
    return false;
  }
  // Rows of whole 16-byte pieces, or of 8.
  const bool wide =
      s.in_w % 8 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0;
  const int64_t in_bytes = s.in_h * s.in_w * 2;
  const int64_t out_plane = s.out_h * s.out_w;
  const int64_t quads = (s.out_w + 3) / 4;
  const int64_t units = (s.out_h + 1) / 2 * quads;
  const auto smem_of = [&](int64_t G) {
    return 2 * G * in_bytes + (G * out_plane + 16) * 2;
  };
  // G: the most of the threads' tasks busy (units over whole rounds of the
  // block's threads), then the larger group.
  int64_t best = 0;
  double best_eff = 0;
  for (int64_t G = 1; G <= kS2MaxGroup && smem_of(G) <= kS2Budget; ++G) {
    const int64_t tasks = G * units;
    const double eff =
        static_cast<double>(tasks) /
        static_cast<double>(Groups(tasks, kS2Threads) * kS2Threads);
    if (eff >= best_eff) best = G, best_eff = eff;
  }
  if (best == 0) return false;
  const int64_t planes = s.batch * s.channels;
  S2Geom g;
  g.in_h = static_cast<int>(s.in_h);
  g.in_w = static_cast<int>(s.in_w);
  g.out_h = static_cast<int>(s.out_h);
  g.out_w = static_cast<int>(s.out_w);
  g.group = static_cast<int>(best);
  g.in_bytes = static_cast<int>(in_bytes);
  g.out_plane = static_cast<int>(out_plane);
  g.col_quads = static_cast<int>(quads);
  g.units = static_cast<int>(units);
  g.by_units = FastDiv::Of(static_cast<uint32_t>(units));
  g.by_quads = FastDiv::Of(static_cast<uint32_t>(quads));
  g.buffer = static_cast<int>(best * in_bytes);
  g.stage_at = 2 * g.buffer;
  const size_t smem = static_cast<size_t>(smem_of(best) + 15) / 16 * 16;
  const auto pick = [&](auto q) {
    constexpr int Q = decltype(q)::value;
    return a.pad_left == 0 ? (a.pad_top == 0 ? PlanesS2Nchw<T, 0, 0, Q>
                                             : PlanesS2Nchw<T, 0, 1, Q>)
                           : (a.pad_top == 0 ? PlanesS2Nchw<T, 1, 0, Q>
                                             : PlanesS2Nchw<T, 1, 1, Q>);
  };
  const auto kernel = wide ? pick(std::integral_constant<int, 16>{})
                           : pick(std::integral_constant<int, 8>{});
  error = cudaSuccess;
  const int64_t groups = Groups(planes, g.group);
  if (groups == 0) return true;
  error = AllowSharedMemory(kernel, smem);
  if (error != cudaSuccess) return true;
  int64_t resident = 0;
  error = ResidentBlocks(kernel, kS2Threads, smem, resident);
  if (error != cudaSuccess) return true;
  if (resident == 0) return false;
  // The resident blocks, each taking every gridDim.x-th group (with
  // a block for each group instead, 68.2 us against 67.4-67.6 over the
  // bench's 128x256 planes of 56x56).
  const int64_t blocks = std::min(groups, resident);
  kernel<<<static_cast<unsigned>(blocks), kS2Threads, smem, stream>>>(
      src, dst, g, shared.value, planes);
  error = cudaGetLastError();
  return true;
}

template bool LaunchPlanesS2Nchw<__half>(cudaStream_t, const PoolAttrs&,
                                         const PoolShape&, const __half*,
                                         __half*, cudaError_t&);
template bool LaunchPlanesS2Nchw<__nv_bfloat16>(cudaStream_t, const PoolAttrs&,
                                                const PoolShape&,
                                                const __nv_bfloat16*,
                                                __nv_bfloat16*, cudaError_t&);

}  // namespace jax_avgpool::cuda
