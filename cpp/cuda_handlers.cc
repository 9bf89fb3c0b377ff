// CUDA FFI handlers: XLA's stream, buffers and attributes in, a launcher of
// cuda_kernels.cu called, its error returned. Handlers never synchronise and
// are safe to capture in CUDA graphs (XLA command buffers).
#include "cuda_handlers.h"

#include <cuda_runtime_api.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_kernels.h"
#include "ffi_common.h"
#include "pooling.h"
#include "xla/ffi/api/ffi.h"

namespace jax_avgpool {
namespace {

namespace ffi = ::xla::ffi;

bool ToDType(ffi::DataType type, cuda::DType* out) {
  switch (type) {
    case ffi::DataType::F16:
      *out = cuda::DType::kF16;
      return true;
    case ffi::DataType::BF16:
      *out = cuda::DType::kBF16;
      return true;
    case ffi::DataType::F32:
      *out = cuda::DType::kF32;
      return true;
    case ffi::DataType::F64:
      *out = cuda::DType::kF64;
      return true;
    default:
      return false;
  }
}

ffi::Error FromCuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(
      std::string("jax_avgpool: ") + what +
      " kernel launch failed: " + cudaGetErrorString(err));
}

// What one instance of the forward custom call keeps from its
// instantiation on: a slot of its own (AcquireScheduleSlot), whose counter
// hands out the 16-bit NCHW tensor-core kernel's work as its blocks free
// up. XLA runs an instance's calls on one device one after another.
ffi::ErrorOr<std::unique_ptr<ForwardState>> InstantiateForward(
    ffi::Dictionary /*geometry: the call's own, decoded at each call*/) {
  auto state = std::make_unique<ForwardState>();
  state->schedule = cuda::AcquireScheduleSlot();
  return state;
}

ffi::Error ForwardCuda(cudaStream_t stream,              // stream
                       ForwardState* state,              // instance state
                       ffi::AnyBuffer x,                 // x
                       ffi::Result<ffi::AnyBuffer> y,    // y
                       ffi::Dictionary geometry_attr) {  // geometry
  PoolAttrs geometry;
  PoolShape s;
  if (ffi::Error e = DecodeCall(geometry_attr, x, *y, &geometry, &s);
      e.failure()) {
    return e;
  }
  cuda::DType dtype;
  if (!ToDType(x.element_type(), &dtype)) {
    return UnsupportedType(x.element_type());
  }
  return FromCuda(
      cuda::LaunchForward(stream, dtype, geometry, s, x.untyped_data(),
                          y->untyped_data(), state->schedule),
      "forward");
}

ffi::Error BackwardCuda(cudaStream_t stream,             // stream
                        ffi::AnyBuffer dy,               // dy
                        ffi::Result<ffi::AnyBuffer> dx,  // dx
                        ffi::RemainingRets workspaces,   // [workspace]
                        ffi::Dictionary geometry_attr,   // geometry
                        int64_t strategy) {              // strategy
  if (ffi::Error e = CheckStrategy(strategy); e.failure()) return e;
  PoolAttrs geometry;
  PoolShape s;
  if (ffi::Error e = DecodeCall(geometry_attr, *dx, dy, &geometry, &s);
      e.failure()) {
    return e;
  }
  cuda::DType dtype;
  if (!ToDType(dy.element_type(), &dtype)) {
    return UnsupportedType(dy.element_type());
  }
  if (strategy == kGather) {
    return FromCuda(
        cuda::LaunchBackwardGather(stream, dtype, geometry, s,
                                   dy.untyped_data(), dx->untyped_data()),
        "backward gather");
  }
  // The float32 workspace of dx's shape, the custom call's second result,
  // where the lowering asked for one (ScatterNeedsWorkspace).
  void* workspace = nullptr;
  if (workspaces.size() > 0) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ws =
        workspaces.get<ffi::AnyBuffer>(0);
    if (ws.has_error() || (*ws)->element_type() != ffi::DataType::F32 ||
        (*ws)->element_count() != (*dx).element_count()) {
      return ffi::Error::InvalidArgument(
          "jax_avgpool: a scatter backward's second result must be a float32 "
          "workspace of dx's shape");
    }
    workspace = (*ws)->untyped_data();
  } else if (cuda::ScatterNeedsWorkspace(dtype, geometry, s)) {
    return ffi::Error::InvalidArgument(
        "jax_avgpool: this 16-bit scatter backward needs a second result, a "
        "float32 workspace of dx's shape");
  }
  return FromCuda(
      cuda::LaunchBackwardScatter(stream, dtype, geometry, s, dy.untyped_data(),
                                  dx->untyped_data(), workspace),
      "backward scatter");
}

}  // namespace

bool CudaScatterNeedsWorkspace(const PoolAttrs& a,
                               const std::vector<int64_t>& dx_dims,
                               const std::string& dtype) {
  cuda::DType type;
  if (dtype == "f16") {
    type = cuda::DType::kF16;
  } else if (dtype == "bf16") {
    type = cuda::DType::kBF16;
  } else if (dtype == "f32") {
    type = cuda::DType::kF32;
  } else if (dtype == "f64") {
    type = cuda::DType::kF64;
  } else {
    throw std::invalid_argument("dtype: expected f16, bf16, f32 or f64, got " +
                                dtype);
  }
  return cuda::ScatterNeedsWorkspace(type, a, FoldShape(a, dx_dims));
}

}  // namespace jax_avgpool

xla::ffi::TypeId jax_avgpool::ForwardState::id = {};

const XLA_FFI_TypeInfo* JaxAvgPoolForwardStateInfo() {
  static const xla::ffi::TypeInfo info =
      xla::ffi::MakeTypeInfo<jax_avgpool::ForwardState>();
  return &info;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxAvgPoolForwardCudaInstantiate, jax_avgpool::InstantiateForward,
    xla::ffi::Ffi::BindInstantiate().Attr<xla::ffi::Dictionary>("geometry"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxAvgPoolForwardCuda, jax_avgpool::ForwardCuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
        .Ctx<xla::ffi::State<jax_avgpool::ForwardState>>()
        .Arg<xla::ffi::AnyBuffer>()               // x
        .Ret<xla::ffi::AnyBuffer>()               // y
        .Attr<xla::ffi::Dictionary>("geometry"),  // geometry
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxAvgPoolBackwardCuda, jax_avgpool::BackwardCuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
        .Arg<xla::ffi::AnyBuffer>()                     // dy
        .Ret<xla::ffi::AnyBuffer>()                     // dx
        .RemainingRets()                                // [workspace]
        .Attr<xla::ffi::Dictionary>("geometry")         // geometry
        .Attr<int64_t>("strategy"),                     // strategy
    {xla::ffi::Traits::kCmdBufferCompatible});
