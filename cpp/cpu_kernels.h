// FFI handlers of the CPU kernels (cpu_kernels.cc).
#ifndef JAX_AVGPOOL_CPU_KERNELS_H_
#define JAX_AVGPOOL_CPU_KERNELS_H_

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxAvgPoolForwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxAvgPoolBackwardCpu);

#endif  // JAX_AVGPOOL_CPU_KERNELS_H_
