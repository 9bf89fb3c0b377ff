// FFI handlers of the CUDA kernels (cuda_handlers.cc).
#ifndef JAX_AVGPOOL_CUDA_HANDLERS_H_
#define JAX_AVGPOOL_CUDA_HANDLERS_H_

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxAvgPoolForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxAvgPoolBackwardCuda);

#endif  // JAX_AVGPOOL_CUDA_HANDLERS_H_
