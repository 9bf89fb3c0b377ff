// FFI handlers of the CUDA kernels (cuda_handlers.cc).
#ifndef JAX_AVGPOOL_CUDA_HANDLERS_H_
#define JAX_AVGPOOL_CUDA_HANDLERS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "pooling.h"
#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxAvgPoolForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxAvgPoolBackwardCuda);

namespace jax_avgpool {

// Whether the CUDA scatter backward of a dx of `dx_dims` and element type
// `dtype` (a kernel-id name: "f16", "bf16", "f32" or "f64") needs the float32
// workspace as the custom call's second result; for the lowering. Throws
// std::invalid_argument for any other dtype name.
bool CudaScatterNeedsWorkspace(const PoolAttrs& a,
                               const std::vector<int64_t>& dx_dims,
                               const std::string& dtype);

}  // namespace jax_avgpool

#endif  // JAX_AVGPOOL_CUDA_HANDLERS_H_
