// CUDA scatter backward: each dy / divisor is added with atomics to every
// element of its window. See cuda_kernels.h.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda_common.cuh"

namespace jax_avgpool::cuda {
namespace {

// ---------------------------------------------------------------------------
// Backward, scatter: each dy / divisor is added with atomics to every element
// of its window, in the accumulator type: into dx itself for float32 and
// float64, into a float32 workspace for 16-bit types, narrowed into dx
// afterwards. The target must be zero before the launch.

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

// Narrows the float32 workspace of a 16-bit scatter into dx.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    Narrow(const float* __restrict__ acc, T* __restrict__ dx,
           const int64_t total) {
  for (int64_t i = FirstThread(); i < total; i += ThreadCount()) {
    dx[i] = Num<T>::Store(acc[i]);
  }
}

}  // namespace

cudaError_t LaunchBackwardScatter(cudaStream_t stream, DType dtype,
                                  const PoolAttrs& a, const PoolShape& s,
                                  const void* dy, void* dx, void* workspace) {
  return WithType(dtype, [&](auto tag) {
    using T = decltype(tag);
    using Acc = typename Num<T>::Acc;
    constexpr bool kNarrow = !std::is_same_v<T, Acc>;
    const int64_t elements = s.batch * s.channels * s.in_h * s.in_w;
    if (elements == 0) return cudaSuccess;
    if (kNarrow && workspace == nullptr) return cudaErrorInvalidValue;
    Acc* target = static_cast<Acc*>(kNarrow ? workspace : dx);
    if (cudaError_t e = cudaMemsetAsync(
            target, 0, static_cast<size_t>(elements) * sizeof(Acc), stream);
        e != cudaSuccess) {
      return e;
    }
    const T* in = static_cast<const T*>(dy);
    const cudaError_t scattered = WithSpec(a, [&](auto spec) {
      using S = decltype(spec);
      // One thread per BLOCK outputs; the kernels take the output count.
      const int64_t outputs = s.batch * s.channels * s.out_h * s.out_w;
      if (outputs == 0) return cudaSuccess;
      const auto kernel =
          a.layout == kNCHW ? ScatterNchw<T, S> : ScatterNhwc<T, S>;
      const int64_t blocks = Groups(Groups(outputs, S::BLOCK), kThreads);
      kernel<<<static_cast<unsigned>(std::min<int64_t>(blocks, INT32_MAX)),
               kThreads, 0, stream>>>(a, s, in, target, outputs);
      return cudaGetLastError();
    });
    if (scattered != cudaSuccess || !kNarrow) return scattered;
    return Launch(Narrow<T>, stream, elements,
                  static_cast<const float*>(workspace), static_cast<T*>(dx));
  });
}

}  // namespace jax_avgpool::cuda
