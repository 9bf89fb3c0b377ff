// Launchers of the CUDA kernels (cuda_kernels.cu). No XLA or nanobind types
// here: the FFI handlers (cuda_handlers.cc) decode buffers and attributes and
// call these on XLA's stream.
#ifndef JAX_AVGPOOL_CUDA_KERNELS_H_
#define JAX_AVGPOOL_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include "pooling.h"

namespace jax_avgpool::cuda {

enum class DType { kF16, kBF16, kF32, kF64 };

// y = avgpool(x). Never synchronises; returns the first launch error.
// `schedule`: a slot of AcquireScheduleSlot owned by the caller, or -1.
cudaError_t LaunchForward(cudaStream_t stream, DType dtype, const PoolAttrs& a,
                          const PoolShape& s, const void* x, void* y,
                          int schedule = -1);

// A slot of its own, for life, for each caller whose calls follow one
// another on each device (one custom call instance): the counter of slot
// that hands out work to the blocks of the NCHW 16-bit forward as they
// free up (cuda_box_mma.cu), zero between calls. -1 once all 65536 are
// taken; the kernel then takes its work in a fixed order. Thread-safe.
int AcquireScheduleSlot();

// dx = transpose of avgpool applied to dy, each dx element summing the dy
// windows that cover it; dx is written once, no zeroing, no atomics.
cudaError_t LaunchBackwardGather(cudaStream_t stream, DType dtype,
                                 const PoolAttrs& a, const PoolShape& s,
                                 const void* dy, void* dx);

// The same gradient by scattering: the target is zeroed on `stream`, then
// each dy / divisor is added to every element of its window with atomics.
// A global average pool (one window over each whole plane) has nothing to
// add: the gather's kernel writes dx once, with no zeroing and no workspace
// (cuda_global.cu).
// The target is dx for float32 and float64. For 16-bit types it is dx
// itself where the shared-memory tiles of cuda_scatter.cu apply with aligned
// runs of four elements and one atomic per dx element (their float32 sums
// rounded and added by 16-bit atomics), or where a gather kernel adds its
// results to dx with one atomic per element (7x7/1-like windows, where
// float32 NHWC calls whose gather sums over blocks of rows (cuda_box_sums.cu)
// still add BoxNhwc's sums, equal to the gather's within rounding; 3x3/1
// windows over NCHW planes the row kernels cannot take, NCHW rows the row
// kernels take in 16-byte pieces, and NHWC 2x2/2 and 3x3/2 windows whose
// channels fill 16-byte vectors, on sm_90;
// cuda_kernels.cu), else `workspace`, a float32 buffer of dx's shape,
// narrowed into dx afterwards (nullptr is an error there).
cudaError_t LaunchBackwardScatter(cudaStream_t stream, DType dtype,
                                  const PoolAttrs& a, const PoolShape& s,
                                  const void* dy, void* dx, void* workspace);

// Whether the scatter of `dtype` needs the float32 workspace for a call of
// attributes `a` and shape `s` with 16-byte aligned buffers (XLA's are):
// for 16-bit types where the tiles with 16-bit atomics do not apply, never for
// float32 and float64. Host code; the batch does not change the answer, so
// a call split over devices along its leading axes needs the workspace on
// every device or on none.
bool ScatterNeedsWorkspace(DType dtype, const PoolAttrs& a, const PoolShape& s);

}  // namespace jax_avgpool::cuda

#endif  // JAX_AVGPOOL_CUDA_KERNELS_H_
