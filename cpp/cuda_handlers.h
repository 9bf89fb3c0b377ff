// FFI handlers of the CUDA kernels (cuda_handlers.cc).
#ifndef JAX_AVGPOOL_CUDA_HANDLERS_H_
#define JAX_AVGPOOL_CUDA_HANDLERS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "pooling.h"
#include "xla/ffi/api/ffi.h"

// The CUDA forward is a bundle: its instantiate stage makes each custom call
// instance's ForwardState, which XLA keeps and hands to every call of it.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxAvgPoolForwardCudaInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxAvgPoolForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxAvgPoolBackwardCuda);

namespace jax_avgpool {

// The state of one instance of the CUDA forward custom call; registered
// with XLA as a type (its id and JaxAvgPoolForwardStateInfo's deleter).
struct ForwardState {
  static xla::ffi::TypeId id;
  int schedule = -1;  // its slot of cuda::AcquireScheduleSlot, or -1
};

// Whether the CUDA scatter backward of a dx of `dx_dims` and element type
// `dtype` (a kernel-id name: "f16", "bf16", "f32" or "f64") needs the float32
// workspace as the custom call's second result; for the lowering. Throws
// std::invalid_argument for any other dtype name.
bool CudaScatterNeedsWorkspace(const PoolAttrs& a,
                               const std::vector<int64_t>& dx_dims,
                               const std::string& dtype);

}  // namespace jax_avgpool

// How XLA creates and deletes ForwardState.
const XLA_FFI_TypeInfo* JaxAvgPoolForwardStateInfo();

#endif  // JAX_AVGPOOL_CUDA_HANDLERS_H_
