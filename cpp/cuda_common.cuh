// Device helpers shared by the CUDA kernel files: element types and their
// accumulators, vector accesses, compile-time or runtime constants, flat-index
// decomposition and launching. Included only from .cu files.
#ifndef JAX_AVGPOOL_CUDA_COMMON_CUH_
#define JAX_AVGPOOL_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "cuda_kernels.h"
#include "kernel_spec.h"
#include "pooling.h"

namespace jax_avgpool::cuda {

constexpr int kThreads = 256;

// ---------------------------------------------------------------------------
// Element types: accumulator type, widening load, narrowing store.

template <typename T>
struct Num {
  using Acc = T;
  static __device__ __forceinline__ Acc Load(T v) { return v; }
  static __device__ __forceinline__ T Store(Acc v) { return v; }
};
template <>
struct Num<__half> {
  using Acc = float;
  static __device__ __forceinline__ Acc Load(__half v) {
    return __half2float(v);
  }
  static __device__ __forceinline__ __half Store(Acc v) {
    return __float2half_rn(v);
  }
};
// bfloat16 widens exactly by moving its bits to the top of a float32. The
// kernels do that themselves: for sm_90 the CUDA headers widen with a
// conversion instruction (cvt.f32.bf16) instead, which on the H200 made the
// bfloat16 2x2/2 NCHW forward take 76 us against 64 us for the same kernel
// in float16, and with the bit move 64 us as well.
template <>
struct Num<__nv_bfloat16> {
  using Acc = float;
  static __device__ __forceinline__ Acc Load(__nv_bfloat16 v) {
    return __uint_as_float(static_cast<unsigned>(__bfloat16_as_ushort(v))
                           << 16);
  }
  static __device__ __forceinline__ __nv_bfloat16 Store(Acc v) {
    return __float2bfloat16_rn(v);
  }
};

// V channels moved as one access (16 bytes when V = 16 / sizeof(T)).
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// The V elements at p (aligned to the whole vector) when `ok`, else zeros.
// Moved as raw bits, so the zeros need no conversion (all-zero bits are +0
// in every element type) and the compiler emits one predicated load rather
// than a branch around it, which for 16-bit types kept loads from being in
// flight together.
template <int kBytes>
struct RawBits;
template <>
struct RawBits<2> {
  using type = unsigned short;
};
template <>
struct RawBits<4> {
  using type = unsigned int;
};
template <>
struct RawBits<8> {
  using type = uint2;
};
template <>
struct RawBits<16> {
  using type = uint4;
};

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> LoadOrZero(const T* p, bool ok) {
  using Raw = typename RawBits<static_cast<int>(sizeof(T)) * V>::type;
  Raw raw{};
  if (ok) raw = *reinterpret_cast<const Raw*>(p);
  Vec<T, V> v;
  static_assert(sizeof(v) == sizeof(raw));
  memcpy(&v, &raw, sizeof(v));
  return v;
}

// ---------------------------------------------------------------------------
// Window sums.

// How SlidingGroup finishes its sums: as they are, or (ByFactor) times f,
// the products fused into the last additions. A group then multiplies its
// core once and adds each suffix and prefix to it by an FMA: K + 3G - 5
// operations where the sums and then their products take K + 4G - 6. The
// products round before the sum, so the results may differ from f times
// the plain sums in the last place.
struct Unscaled {
  template <typename Acc>
  __device__ __forceinline__ Acc Of(Acc sum) const {
    return sum;
  }
  template <typename Acc>
  __device__ __forceinline__ Acc Add(Acc part, Acc sum) const {
    return part + sum;
  }
  template <typename Acc>
  __device__ __forceinline__ Acc AddTo(Acc sum, Acc part) const {
    return sum + part;
  }
};
struct ByFactor {
  float f;
  __device__ __forceinline__ float Of(float sum) const { return sum * f; }
  __device__ __forceinline__ float Add(float part, float sum) const {
    return __fmaf_rn(part, f, sum);
  }
  __device__ __forceinline__ float AddTo(float sum, float part) const {
    return __fmaf_rn(part, f, sum);
  }
};

// Sums of K consecutive values at stride 1: out[o] = in(o) + ... +
// in(o + K - 1) for o < N (finished by `scale`), `in` a function of a
// compile-time index (after unrolling). Adjacent windows share K - 1
// values, so the windows are taken in groups of G: the core in(O0 + G - 1
// .. O0 + K - 1) that every window of the group holds is summed once, and
// each window adds a suffix of the values before the core and a prefix of
// those after it, both built up incrementally: K + 3G - 6 additions per
// group instead of G(K - 1) (13 instead of 24 for four 7-wide windows, 3
// instead of 4 for two 3-wide).
template <int K, int G, int O0, typename Acc, typename In, int N,
          typename Scale>
__device__ __forceinline__ void SlidingGroup(const In& in, Acc (&out)[N],
                                             const Scale& scale) {
  static_assert(G >= 1 && G <= K && O0 + G <= N);
  if constexpr (G == 1) {
    Acc sum = in(O0);
#pragma unroll
    for (int i = 1; i < K; ++i) sum += in(O0 + i);
    out[O0] = scale.Of(sum);
  } else {
    Acc core = in(O0 + G - 1);
#pragma unroll
    for (int i = O0 + G; i < O0 + K; ++i) core += in(i);
    const Acc whole = scale.Of(core);
    Acc suffix = in(O0 + G - 2);
    out[O0 + G - 2] = scale.Add(suffix, whole);
#pragma unroll
    for (int o = O0 + G - 3; o >= O0; --o) {
      suffix = in(o) + suffix;
      out[o] = scale.Add(suffix, whole);
    }
    out[O0 + G - 1] = whole;
    Acc prefix = in(O0 + K);
    out[O0 + 1] = scale.AddTo(out[O0 + 1], prefix);
#pragma unroll
    for (int o = O0 + 2; o < O0 + G; ++o) {
      prefix += in(o + K - 1);
      out[o] = scale.AddTo(out[o], prefix);
    }
  }
}

template <int K, int N, int O0 = 0, typename Acc, typename In,
          typename Scale = Unscaled>
__device__ __forceinline__ void SlidingSums(const In& in, Acc (&out)[N],
                                            const Scale& scale = {}) {
  if constexpr (O0 < N) {
    constexpr int kGroup = K >= 4 ? 4 : (K >= 2 ? 2 : 1);
    constexpr int kG = N - O0 < kGroup ? N - O0 : kGroup;
    SlidingGroup<K, kG, O0>(in, out, scale);
    SlidingSums<K, N, O0 + kG>(in, out, scale);
  }
}

// ---------------------------------------------------------------------------
// Divisors, copies into shared memory, vector accesses and segments of rows,
// shared by the kernel files.

// Correctly rounded reciprocals: the kernels multiply by 1 / divisor rather
// than divide, computing one reciprocal per window instead of one division
// per element (within one ulp of the quotient; the division is the most
// expensive operation of these kernels).
__device__ __forceinline__ float Reciprocal(float v) { return __frcp_rn(v); }
__device__ __forceinline__ double Reciprocal(double v) { return __drcp_rn(v); }

// The divisor factors that every window of a call shares, when they all
// share them: under an override, or when each axis's first and last windows
// (hence all of them: a factor only shrinks towards the ends of an axis)
// have the kernel's extent as their factor, as every window does in a call
// without padding or ceil_mode overhang, and under the padded count in any
// call without overhang. `row`, `col` and `value` are then the reciprocals
// that the per-window path would compute, in the same arithmetic (host IEEE
// division is correctly rounded, as Reciprocal), so kernels that take them
// instead (the NCHW row kernels, the NHWC strided gather and sliding
// forward) give bitwise the same results, for fewer instructions: in the
// 7x7/1 NCHW gather the per-window reciprocals were half of them.
template <typename Acc>
struct SharedFactor {
  bool all;
  Acc row, col;  // 1 / row factor, 1 / column factor
  Acc value;     // row * col
};

template <typename Acc>
SharedFactor<Acc> SharedFactorOf(const PoolAttrs& a, const PoolShape& s) {
  if (a.divisor_mode == kOverride) {
    const Acc row = Acc(1) / static_cast<Acc>(a.divisor_override);
    return {true, row, Acc(1), row};
  }
  const auto full = [&](int64_t in, int64_t out, int64_t k, int64_t st,
                        int64_t lo, int64_t hi) {
    for (const int64_t o : {int64_t{0}, out - 1}) {
      const Window w = WindowAt(o, in, k, st, lo, hi);
      const int64_t f =
          a.divisor_mode == kCountPadded ? w.padded_count : w.end - w.start;
      if (f != k) return false;
    }
    return out > 0;
  };
  if (!full(s.in_h, s.out_h, a.kernel_h, a.stride_h, a.pad_top, a.pad_bottom) ||
      !full(s.in_w, s.out_w, a.kernel_w, a.stride_w, a.pad_left, a.pad_right)) {
    return {false, Acc(0), Acc(0), Acc(0)};
  }
  const Acc row = Acc(1) / static_cast<Acc>(a.kernel_h),
            col = Acc(1) / static_cast<Acc>(a.kernel_w);
  return {true, row, col, row * col};
}

// The divisor factor of a window along one axis (the override goes with the
// rows): Divisor(a, wh, ww) is the product of the two, an exact small
// integer, so 1 / divisor is taken as the product of the correctly rounded
// reciprocals of the factors, within two ulps.
template <typename Acc>
__device__ __forceinline__ Acc WindowFactor(const PoolAttrs& a, const Window& w,
                                            bool is_row) {
  return a.divisor_mode == kCountPadded ? static_cast<Acc>(w.padded_count)
         : a.divisor_mode == kCountReal ? static_cast<Acc>(w.end - w.start)
         : is_row                       ? static_cast<Acc>(a.divisor_override)
                                        : Acc(1);
}

// Channels in a 16-byte vector access, and whether NHWC accesses of V
// channels fit a call: C a multiple of V, both buffers aligned to the vector.
template <typename T>
constexpr int kWide = 16 / static_cast<int>(sizeof(T));
template <typename T, int V = kWide<T>>
bool CanVectorise(const PoolShape& s, const void* in, const void* out) {
  const auto aligned = [](const void* p) {
    return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * V) == 0;
  };
  return s.channels % V == 0 && aligned(in) && aligned(out);
}

// Sets every element of an accumulator array of any rank to zero.
template <typename Acc>
__device__ __forceinline__ void FillZero(Acc& v) {
  v = Acc(0);
}
template <typename Acc, int N>
__device__ __forceinline__ void FillZero(Acc (&v)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) FillZero(v[i]);
}

// Destination rows per item of SlideNhwc: the whole extent in segments of
// at most 32 rows, split evenly. Each segment reloads the source rows that
// the one above it loaded too, but the items of one segment per image were
// too few to fill the H200 on the 224-row bench case (float32 3x3/1:
// 225 us with two segments, 219 with seven).
inline int SlideRows(int64_t dst_h) {
  const int64_t segs = std::max<int64_t>((dst_h + 31) / 32, 1);
  return static_cast<int>(std::max<int64_t>((dst_h + segs - 1) / segs, 1));
}

// Starts copying kBytes (4, 8 or 16) from global `from` to shared `to`
// without passing through registers; with kZeroFill, zeros instead when
// !ok. StartCopyTo takes the shared-memory address instead (sm_80 and
// later, where cp.async exists). CommitCopies makes the copies this thread
// started since its last commit one group; CopyAsync does both; CopyWait
// waits until at most `kPending` of this thread's groups are in flight.
//
// Each copy asks L2 to fetch the whole 128-byte line around it
// (.L2::128B). On the H200 (CUDA events, us) that took the 16-bit 7x7/1
// NCHW forward of 64x512x28x28 from 26.9-27.1 to 26.4-26.6 and its gather
// from 26.3-26.6 to 26.1-26.3, the float32 ones from 46.7 to 45.9-46.2 and
// from 48.7-48.9 to 48.2-48.4, and left the other bench calls as they were
// (within 1%); 256-byte lines and an evict-first policy did not help.
//
// StartCopyPart copies 16 bytes to shared `dst` of which only the first
// `bytes` (0 to 16) are read from `from`, the rest zeros.
__device__ __forceinline__ void StartCopyPart(unsigned dst, const void* from,
                                              int bytes) {
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst),
      "l"(from), "r"(bytes));
#endif
}
template <int kBytes, bool kZeroFill>
__device__ __forceinline__ void StartCopyTo(unsigned dst, const void* from,
                                            bool ok) {
#if __CUDA_ARCH__ >= 800
  if constexpr (kZeroFill && kBytes == 16) {
    StartCopyPart(dst, from, ok ? 16 : 0);
  } else if constexpr (kZeroFill) {
    asm volatile(
        "cp.async.ca.shared.global.L2::128B [%0], [%1], %2, %3;\n" ::"r"(dst),
        "l"(from), "n"(kBytes), "r"(ok ? kBytes : 0));
  } else if constexpr (kBytes == 16) {
    asm volatile(
        "cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst),
        "l"(from));
  } else {
    asm volatile(
        "cp.async.ca.shared.global.L2::128B [%0], [%1], %2;\n" ::"r"(dst),
        "l"(from), "n"(kBytes));
  }
#endif
}
template <int kBytes, bool kZeroFill>
__device__ __forceinline__ void StartCopy(void* to, const void* from, bool ok) {
#if __CUDA_ARCH__ >= 800
  StartCopyTo<kBytes, kZeroFill>(
      static_cast<unsigned>(__cvta_generic_to_shared(to)), from, ok);
#else
  using Raw = typename RawBits<kBytes>::type;
  Raw raw{};
  if (!kZeroFill || ok) raw = *static_cast<const Raw*>(from);
  *static_cast<Raw*>(to) = raw;
#endif
}
__device__ __forceinline__ void CommitCopies() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int kBytes>
__device__ __forceinline__ void CopyAsync(void* to, const void* from, bool ok) {
  StartCopy<kBytes, true>(to, from, ok);
  CommitCopies();
}
template <int kPending>
__device__ __forceinline__ void CopyWait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Asks L2 to fetch the line of global `p`. The gathers that add their
// results to dx (kAdd) ask for their destination lines before they sum: a
// reduction that misses L2 waits there for its line, and many such misses
// in flight hold L2's atomic units.
__device__ __forceinline__ void PrefetchL2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(__cvta_generic_to_global(p)));
}
// The same for the `bytes` (a multiple of 16) from global `p` (16-byte
// aligned), one instruction for the whole range; sm_90 only, nothing below.
__device__ __forceinline__ void PrefetchL2Range(const void* p, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(
                   __cvta_generic_to_global(p)),
               "r"(bytes)
               : "memory");
#endif
}

// Adds the 16 bytes of T values in `bits` to global `to` (16-byte aligned)
// with atomics: one vector reduction on sm_90 (float32, or 16-bit pairs),
// else one atomic per 16-bit pair or per element.
template <typename T>
__device__ __forceinline__ void AtomicAdd16(T* to, const uint4& bits) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const size_t at = __cvta_generic_to_global(to);
  if constexpr (std::is_same_v<T, float>) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(at),
                 "f"(__uint_as_float(bits.x)), "f"(__uint_as_float(bits.y)),
                 "f"(__uint_as_float(bits.z)), "f"(__uint_as_float(bits.w))
                 : "memory");
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(at),
        "r"(bits.x), "r"(bits.y), "r"(bits.z), "r"(bits.w)
        : "memory");
  } else {
    asm volatile(
        "red.global.add.noftz.v4.f16x2 [%0], {%1, %2, %3, %4};" ::"l"(at),
        "r"(bits.x), "r"(bits.y), "r"(bits.z), "r"(bits.w)
        : "memory");
  }
#else
  const unsigned w[4] = {bits.x, bits.y, bits.z, bits.w};
  for (int k = 0; k < 4; ++k) {
    if constexpr (sizeof(T) == 4) {
      atomicAdd(reinterpret_cast<float*>(to) + k, __uint_as_float(w[k]));
    } else {
      using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2,
                                      __nv_bfloat162>;
      Pair p;
      memcpy(&p, &w[k], sizeof(p));
      atomicAdd(reinterpret_cast<Pair*>(to) + k, p);
    }
  }
#endif
}

// The same for 8 bytes of 16-bit values (8-byte aligned): one vector
// reduction of two pairs on sm_90, else one atomic per pair.
template <typename T>
__device__ __forceinline__ void AtomicAdd8(T* to, const uint2& bits) {
  static_assert(sizeof(T) == 2);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const size_t at = __cvta_generic_to_global(to);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("red.global.add.noftz.v2.bf16x2 [%0], {%1, %2};" ::"l"(at),
                 "r"(bits.x), "r"(bits.y)
                 : "memory");
  } else {
    asm volatile("red.global.add.noftz.v2.f16x2 [%0], {%1, %2};" ::"l"(at),
                 "r"(bits.x), "r"(bits.y)
                 : "memory");
  }
#else
  using Pair =
      std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  const unsigned w[2] = {bits.x, bits.y};
  for (int k = 0; k < 2; ++k) {
    Pair p;
    memcpy(&p, &w[k], sizeof(p));
    atomicAdd(reinterpret_cast<Pair*>(to) + k, p);
  }
#endif
}

// ---------------------------------------------------------------------------
// Constants: compile-time for a specialisation, runtime for the generic
// kernel.

template <typename S>
struct Consts {
  int64_t kh, kw, sh, sw;
  __device__ __forceinline__ explicit Consts(const PoolAttrs& a) {
    if constexpr (S::kGeneric) {
      kh = a.kernel_h;
      kw = a.kernel_w;
      sh = a.stride_h;
      sw = a.stride_w;
    } else {
      kh = S::KH;
      kw = S::KW;
      sh = S::SH;
      sw = S::SW;
    }
  }
};

__device__ __forceinline__ int64_t FirstThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t ThreadCount() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Splits a flat index into (outer, mid, inner) of extents (., m, n): the
// last varies fastest. 32-bit division when the index fits, which is much
// cheaper than 64-bit division on the GPU; the branch is uniform.
struct Split3 {
  int64_t outer, mid, inner;
};
__device__ __forceinline__ Split3 Decompose(int64_t i, int64_t m, int64_t n,
                                            bool narrow) {
  if (narrow) {
    const uint32_t i32 = static_cast<uint32_t>(i);
    const uint32_t n32 = static_cast<uint32_t>(n);
    const uint32_t m32 = static_cast<uint32_t>(m);
    const uint32_t t = i32 / n32;
    return {t / m32, t % m32, i32 % n32};
  }
  const int64_t t = i / n;
  return {t / m, t % m, i % n};
}

// CoverOf (pooling.h) in 32-bit arithmetic when `narrow`: every extent,
// padding, window and stride of the call below 2**30, so that no sum here
// leaves 32 bits. The generic kernels divide by runtime strides, and 64-bit
// division costs several times as many instructions.
__device__ __forceinline__ Cover CoverOfFast(int64_t i, int64_t out, int64_t k,
                                             int64_t s, int64_t lo,
                                             bool narrow) {
  if (!narrow) return CoverOf(i, out, k, s, lo);
  const int32_t low = static_cast<int32_t>(i + lo - k + 1);
  const uint32_t s32 = static_cast<uint32_t>(s);
  Cover c;
  c.first = low <= 0 ? 0 : (static_cast<uint32_t>(low) + s32 - 1) / s32;
  const int64_t high = static_cast<uint32_t>(i + lo) / s32;
  c.last = high < out - 1 ? high : out - 1;
  return c;
}

// Whether every extent, padding, window and stride of a call is below
// 2**30 (CoverOfFast's `narrow`); the launchers ask it too.
__host__ __device__ __forceinline__ bool SmallGeometry(const PoolAttrs& a,
                                                       const PoolShape& s) {
  constexpr int64_t kSmall = int64_t{1} << 30;
  return (s.in_h | s.in_w | s.out_h | s.out_w | a.kernel_h | a.kernel_w |
          a.stride_h | a.stride_w | a.pad_top | a.pad_bottom | a.pad_left |
          a.pad_right) < kSmall;
}

// (i / n, i % n), in 32-bit arithmetic when `narrow`.
struct Split2 {
  int64_t quot, rem;
};
__device__ __forceinline__ Split2 DivMod(int64_t i, int64_t n, bool narrow) {
  if (narrow) {
    const uint32_t i32 = static_cast<uint32_t>(i);
    const uint32_t n32 = static_cast<uint32_t>(n);
    return {i32 / n32, i32 % n32};
  }
  return {i / n, i % n};
}

// Stores a run of up to B accumulated values at out[0, n): one vector store
// when `whole_vectors` (every run starts aligned and rows hold whole runs),
// else element by element.
template <typename T, int B>
__device__ __forceinline__ bool CanStoreRuns(const T* base, int64_t row) {
  constexpr size_t kBytes = sizeof(T) * B;
  return kBytes <= 16 && (kBytes & (kBytes - 1)) == 0 && row % B == 0 &&
         reinterpret_cast<uintptr_t>(base) % kBytes == 0;
}

template <typename T, int B, typename Acc>
__device__ __forceinline__ void StoreRun(T* out, const Acc (&acc)[B], int64_t n,
                                         bool whole_vectors) {
  using N = Num<T>;
  if constexpr (sizeof(T) * B <= 16 && B > 1) {
    if (whole_vectors) {
      Vec<T, B> v;
#pragma unroll
      for (int b = 0; b < B; ++b) v.v[b] = N::Store(acc[b]);
      *reinterpret_cast<Vec<T, B>*>(out) = v;
      return;
    }
  }
#pragma unroll
  for (int b = 0; b < B; ++b) {
    if (b < n) out[b] = N::Store(acc[b]);
  }
}

// The widest piece, in elements, in which runs of B elements that start at
// multiples of B in rows of `row` elements from `base` can all be moved by
// aligned accesses: a power of two that divides B and `row`, of at most 16
// bytes, to whose size `base` is aligned. On rows whose length is even but
// not a multiple of B (a 22-wide output row of 4-element runs) that is 2:
// half the accesses of element-wise ones, each touching fewer sectors.
template <typename T, int B>
inline int RunPiece(const void* base, int64_t row) {
  static_assert(B > 0 && (B & (B - 1)) == 0);
  int p = B;
  while (p > 1 && (sizeof(T) * p > 16 || row % p != 0 ||
                   reinterpret_cast<uintptr_t>(base) % (sizeof(T) * p) != 0)) {
    p /= 2;
  }
  return p;
}

// Stores the first n (a multiple of P) of B accumulated values at out, in
// aligned pieces of P elements.
template <typename T, int B, int P, typename Acc>
__device__ __forceinline__ void StorePieces(T* out, const Acc (&acc)[B],
                                            int64_t n) {
  static_assert(B % P == 0 && sizeof(T) * P <= 16);
  // Each piece under its own condition rather than a loop left at the
  // first missing one: with the early exit the 3x3/2 forward, its rows of
  // odd length stored element by element, took 102 against 80 us
  // (bfloat16) on the H200.
#pragma unroll
  for (int q = 0; q < B / P; ++q) {
    if (q * P >= n) continue;
    Vec<T, P> v;
#pragma unroll
    for (int e = 0; e < P; ++e) v.v[e] = Num<T>::Store(acc[q * P + e]);
    reinterpret_cast<Vec<T, P>*>(out)[q] = v;
  }
}

// Quotient of a non-negative int below 2^31 by a divisor fixed for the launch:
// a multiply-high, an add and a shift.
struct FastDiv {
  uint32_t mul;
  uint32_t shift;
  static FastDiv Of(uint32_t d) {
    uint32_t l = 0;
    while ((uint64_t{1} << l) < d) ++l;
    FastDiv f;
    f.mul = static_cast<uint32_t>(
        ((uint64_t{1} << 32) * ((uint64_t{1} << l) - d)) / d + 1);
    f.shift = l;
    return f;
  }
  __device__ __forceinline__ int operator()(int n) const {
    const uint32_t u = static_cast<uint32_t>(n);
    return static_cast<int>((__umulhi(u, mul) + u) >> shift);
  }
};

// Launching.

template <typename... KArgs, typename... Args>
cudaError_t Launch(void (*kernel)(KArgs...), cudaStream_t stream, int64_t total,
                   Args... args) {
  if (total == 0) return cudaSuccess;
  const int64_t blocks =
      std::min<int64_t>((total + kThreads - 1) / kThreads, INT32_MAX);
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args...,
                                                                 total);
  return cudaGetLastError();
}

inline int64_t Groups(int64_t n, int block) { return (n + block - 1) / block; }

// Zeroes dx (the input's shape) on `stream`: the gathers that add their
// results to it (the scatter's kAdd forms) launch after this.
template <typename T>
cudaError_t ZeroInputShape(T* dx, const PoolShape& s, cudaStream_t stream) {
  return cudaMemsetAsync(
      dx, 0,
      static_cast<size_t>(s.batch * s.channels * s.in_h * s.in_w) * sizeof(T),
      stream);
}

// The largest piece, of 16 bytes or fewer and at least `element`, that
// divides `bytes` and the alignment of `p`.
inline int PieceOf(int64_t bytes, const void* p, int64_t element) {
  int64_t q = 16;
  while (q > element &&
         (bytes % q != 0 || reinterpret_cast<uintptr_t>(p) % q != 0)) {
    q /= 2;
  }
  return static_cast<int>(q);
}

// What the launchers ask the runtime about a kernel on a device (the blocks
// that stay resident together, the architecture of its code, leave to use
// more than 48 KiB of dynamic shared memory) does not change once asked, and
// asking costs a microsecond or more per question; a launcher choosing among
// several forms of a kernel asked a dozen questions a call. The answers are
// kept per device and kernel (and threads and shared memory, where they
// matter), in maps shared by the threads that call the handlers.
struct KernelKey {
  const void* kernel;
  int device;
  int threads;
  size_t smem;
  bool operator==(const KernelKey& o) const {
    return kernel == o.kernel && device == o.device && threads == o.threads &&
           smem == o.smem;
  }
};
struct KernelKeyHash {
  size_t operator()(const KernelKey& k) const {
    size_t h = std::hash<const void*>()(k.kernel);
    for (const size_t v : {static_cast<size_t>(k.device),
                           static_cast<size_t>(k.threads), k.smem}) {
      h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return h;
  }
};
template <typename V>
struct KernelFacts {
  std::mutex mutex;
  std::unordered_map<KernelKey, V, KernelKeyHash> known;
  bool Find(const KernelKey& key, V& value) {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto it = known.find(key);
    if (it == known.end()) return false;
    value = it->second;
    return true;
  }
  void Keep(const KernelKey& key, const V& value) {
    const std::lock_guard<std::mutex> lock(mutex);
    known[key] = value;
  }
};

template <typename Kernel>
cudaError_t KeyOf(Kernel kernel, int threads, size_t smem, KernelKey& key) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  key = KernelKey{reinterpret_cast<const void*>(kernel), device, threads, smem};
  return err;
}

// The multiprocessors of `device`, into `sms`.
inline cudaError_t Multiprocessors(int device, int& sms) {
  return cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
}

// How many blocks of `kernel` (threads and dynamic shared memory as given)
// stay resident together on the current device, into `blocks`.
inline KernelFacts<int64_t>& ResidentFacts() {
  static KernelFacts<int64_t> facts;
  return facts;
}
template <typename Kernel>
cudaError_t ResidentBlocks(Kernel kernel, int threads, size_t smem,
                           int64_t& blocks) {
  KernelKey key;
  cudaError_t err = KeyOf(kernel, threads, smem, key);
  if (err != cudaSuccess || ResidentFacts().Find(key, blocks)) return err;
  int sms = 0, per_sm = 0;
  err = Multiprocessors(key.device, sms);
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel,
                                                        threads, smem);
  }
  blocks = int64_t{sms} * per_sm;
  if (err == cudaSuccess) ResidentFacts().Keep(key, blocks);
  return err;
}

// Lets `kernel` launch with `smem` bytes of dynamic shared memory on the
// current device: raises its limit where that is more than 48 KiB and more
// than it was raised to before (never lowers it, so that the launches of
// other calls stay within it).
inline KernelFacts<size_t>& SharedMemoryFacts() {
  static KernelFacts<size_t> facts;
  return facts;
}
template <typename Kernel>
cudaError_t AllowSharedMemory(Kernel kernel, size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  KernelKey key;
  cudaError_t err = KeyOf(kernel, 0, 0, key);
  if (err != cudaSuccess) return err;
  KernelFacts<size_t>& facts = SharedMemoryFacts();
  // One lock over the check and the raise: two threads raising the same
  // kernel's limit must not leave it at the lower of their values.
  const std::lock_guard<std::mutex> lock(facts.mutex);
  size_t& allowed = facts.known[key];
  if (allowed >= smem) return cudaSuccess;
  err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem));
  if (err == cudaSuccess) allowed = smem;
  return err;
}

// The architecture of the code the device runs for `kernel`: the PTX and
// binary versions (major * 10 + minor), zeros where the runtime cannot say.
struct KernelCode {
  int ptx, binary;
};
inline KernelFacts<KernelCode>& CodeFacts() {
  static KernelFacts<KernelCode> facts;
  return facts;
}
template <typename Kernel>
KernelCode CodeOf(Kernel kernel) {
  KernelKey key;
  KernelCode code{0, 0};
  if (KeyOf(kernel, 0, 0, key) != cudaSuccess) {
    cudaGetLastError();
    return code;
  }
  if (CodeFacts().Find(key, code)) return code;
  cudaFuncAttributes attrs;
  if (cudaFuncGetAttributes(&attrs, kernel) != cudaSuccess) {
    cudaGetLastError();
    return code;
  }
  code = KernelCode{attrs.ptxVersion, attrs.binaryVersion};
  CodeFacts().Keep(key, code);
  return code;
}

template <typename Fn>
cudaError_t WithType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF16:
      return fn(__half{});
    case DType::kBF16:
      return fn(__nv_bfloat16{});
    case DType::kF32:
      return fn(float{});
    case DType::kF64:
      return fn(double{});
  }
  return cudaErrorInvalidValue;
}

// The NHWC stride-1 box filter of 16-bit types on the tensor cores
// (cuda_box_mma.cu): launches it and returns true where it applies, the
// launch's error in `error`; returns false, launching nothing, elsewhere.
// kAdd (gathers, on sm_90 builds): the scatter, zeroing dst on the stream
// first and adding each result to it with atomics (LaunchAddingGather).
template <typename T, bool kGather, bool kAdd = false>
bool LaunchMmaBoxNhwc(cudaStream_t stream, const PoolAttrs& a,
                      const PoolShape& s, const T* src, T* dst,
                      cudaError_t& error);

// The NHWC 16-bit forward of 7x7/1 windows over 28x28 images without
// padding, its results stored straight from registers (LaneBoxNhwc,
// cuda_box_mma.cu): launches it and returns true where it applies, the
// launch's error in `error`; returns false, launching nothing, elsewhere.
template <typename T>
bool LaunchLaneBoxNhwc(cudaStream_t stream, const PoolAttrs& a,
                       const PoolShape& s, const T* src, T* dst,
                       cudaError_t& error);

// The NCHW 16-bit forward of 3x3/2 windows that share one factor, with
// padding of at most 1 at the top and left, over planes whose rows are whole
// 8-byte pieces and whose output rows have an odd number of elements, by
// whole planes in shared memory (cuda_planes_s2.cu). False where it does
// not take the call; else `error` holds the launch's result.
template <typename T>
bool LaunchPlanesS2Nchw(cudaStream_t stream, const PoolAttrs& a,
                        const PoolShape& s, const T* src, T* dst,
                        cudaError_t& error);

// The NHWC gather of stride-1 windows that share one factor, over
// destination images of 20 to 32 rows and columns, by whole dy tiles (also
// cuda_box_mma.cu), alike; on sm_90 builds.
template <typename T>
bool LaunchMmaTileGatherNhwc(cudaStream_t stream, const PoolAttrs& a,
                             const PoolShape& s, const T* dy, T* dx,
                             cudaError_t& error);

// The NCHW forward's counterpart (also cuda_box_mma.cu), alike; `schedule`
// is the calling instance's slot (AcquireScheduleSlot) or -1.
template <typename T>
bool LaunchMmaPlanesNchw(cudaStream_t stream, const PoolAttrs& a,
                         const PoolShape& s, const T* src, T* dst, int schedule,
                         cudaError_t& error);
// The NCHW gather of stride-1 windows that share one factor, as that
// forward over dy (also cuda_box_mma.cu), alike.
template <typename T>
bool LaunchMmaPlanesNchwGather(cudaStream_t stream, const PoolAttrs& a,
                               const PoolShape& s, const T* dy, T* dx,
                               cudaError_t& error);

// The scatter of 7x7/1-like windows by the gather's kernels, adding their
// results to a zeroed dx with atomics in place of their stores
// (cuda_kernels.cu; StripsNchw in NCHW, MmaBoxNhwc and BoxNhwc in NHWC, on
// sm_90 builds), of 3x3/1 windows over the NCHW planes that PlanesNchw
// takes, of NHWC 2x2/2 and 3x3/2 windows by GatherNhwcRows whose
// channels fill 16-byte vectors, and of NCHW rows that GatherNchwRows
// takes, in pieces of 16 bytes (8 for 16-bit stride-1 windows): zeroes dx
// and launches one where it applies, returning true and the first error in
// `error`; returns false, launching nothing, elsewhere.
bool LaunchAddingGather(cudaStream_t stream, DType dtype, const PoolAttrs& a,
                        const PoolShape& s, const void* dy, void* dx,
                        cudaError_t& error);

// The float32 NHWC stride-1 box filter by sums over blocks of rows
// (cuda_box_sums.cu): launches it and returns true where it applies, the
// launch's error in `error`; returns false, launching nothing, elsewhere.
template <bool kGather>
bool LaunchBlockSumsNhwc(cudaStream_t stream, const PoolAttrs& a,
                         const PoolShape& s, const float* src, float* dst,
                         cudaError_t& error);

// Global average pools (cuda_global.cu): whether a call is one, a single
// window over each whole plane (kernel = input, no padding, 1x1 output);
// and the launch of its forward or gather (which is also its scatter: dx is
// written once), returning true and the launch's error in `error`, or false,
// launching nothing, where the call is not one (or, for the NCHW forward,
// where x is not 16-byte aligned).
bool IsGlobalPool(const PoolAttrs& a, const PoolShape& s);
bool LaunchGlobalPool(cudaStream_t stream, DType dtype, const PoolAttrs& a,
                      const PoolShape& s, const void* src, void* dst,
                      bool gather, cudaError_t& error);

}  // namespace jax_avgpool::cuda

#endif  // JAX_AVGPOOL_CUDA_COMMON_CUH_
