// The package's one extension module: the FFI handlers as capsules, per
// platform, and a description of how it was built.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#if defined(JAX_AVGPOOL_WITH_CUDA)
#include "cuda_handlers.h"
#endif
#include "kernel_spec.h"
#include "pooling.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an FFI handler takes an XLA_FFI_CallFrame*");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// {platform: {target name: handler capsule, or {stage: capsule}}}
nb::dict Registrations() {
  nb::dict cpu;
  cpu["jax_avgpool_forward"] = Capsule(JaxAvgPoolForwardCpu);
  cpu["jax_avgpool_backward"] = Capsule(JaxAvgPoolBackwardCpu);
  nb::dict out;
  out["cpu"] = cpu;
#if defined(JAX_AVGPOOL_WITH_CUDA)
  nb::dict cuda, forward;
  forward["instantiate"] = Capsule(JaxAvgPoolForwardCudaInstantiate);
  forward["execute"] = Capsule(JaxAvgPoolForwardCuda);
  cuda["jax_avgpool_forward"] = forward;
  cuda["jax_avgpool_backward"] = Capsule(JaxAvgPoolBackwardCuda);
  out["cuda"] = cuda;
#endif
  return out;
}

// {platform: {type name: {"type_id": capsule, "type_info": capsule}}}: the
// handlers' state types, for XLA to register before their targets.
nb::dict Types() {
  nb::dict out;
#if defined(JAX_AVGPOOL_WITH_CUDA)
  nb::dict forward_state;
  forward_state["type_id"] =
      nb::capsule(reinterpret_cast<void*>(&jax_avgpool::ForwardState::id));
  forward_state["type_info"] = nb::capsule(const_cast<void*>(
      static_cast<const void*>(JaxAvgPoolForwardStateInfo())));
  nb::dict cuda;
  cuda["jax_avgpool.forward_state"] = forward_state;
  out["cuda"] = cuda;
#endif
  return out;
}

nb::dict BuildInfo() {
  nb::dict info;
  info["cpu"] = true;
#if defined(JAX_AVGPOOL_WITH_CUDA)
  info["cuda"] = true;
  info["cuda_architectures"] = std::string(JAX_AVGPOOL_CUDA_ARCHITECTURES);
  info["cuda_compiler"] = std::string(JAX_AVGPOOL_CUDA_COMPILER_VERSION);
#else
  info["cuda"] = false;
#endif
#if defined(__clang__)
  info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = std::string("gcc ") + __VERSION__;
#endif
  info["xla_ffi_api"] = std::to_string(XLA_FFI_API_MAJOR) + "." +
                        std::to_string(XLA_FFI_API_MINOR);
  return info;
}

// The attributes from the `geometry` dictionary of a custom call.
jax_avgpool::PoolAttrs AttrsOf(const nb::dict& geometry) {
  const auto get = [&](const char* key) {
    return nb::cast<int64_t>(geometry[key]);
  };
  return {get("kernel_h"),     get("kernel_w"),         get("stride_h"),
          get("stride_w"),     get("pad_top"),          get("pad_bottom"),
          get("pad_left"),     get("pad_right"),        get("ceil_mode"),
          get("divisor_mode"), get("divisor_override"), get("layout")};
}

// The id of the kernel that `op` ("forward", "backward_gather" or
// "backward_scatter") launches for these attributes and dtype name.
std::string KernelIdOf(const std::string& op, const nb::dict& geometry,
                       const std::string& dtype) {
  const jax_avgpool::PoolAttrs a = AttrsOf(geometry);
  using jax_avgpool::Op;
  Op kind;
  if (op == "forward") {
    kind = Op::kForward;
  } else if (op == "backward_gather") {
    kind = Op::kBackwardGather;
  } else if (op == "backward_scatter") {
    kind = Op::kBackwardScatter;
  } else {
    throw nb::value_error(("unknown op " + op).c_str());
  }
  return jax_avgpool::KernelIdFor(kind, a, dtype);
}

#if defined(JAX_AVGPOOL_WITH_CUDA)
// Whether the CUDA scatter backward of dx (shape `dx_shape`, the pooled
// side) needs its float32 workspace result.
bool ScatterNeedsWorkspaceOf(const nb::dict& geometry,
                             const std::vector<int64_t>& dx_shape,
                             const std::string& dtype) {
  if (dx_shape.size() < 3) throw nb::value_error("dx_shape: rank below 3");
  return jax_avgpool::CudaScatterNeedsWorkspace(AttrsOf(geometry), dx_shape,
                                                dtype);
}
#endif

}  // namespace

NB_MODULE(_jax_avgpool, m) {
  m.doc() = "XLA FFI handlers of jax_avgpool";
  m.def("registrations", &Registrations,
        "Handler capsules as {platform: {target name: capsule or "
        "{stage: capsule}}}.");
  m.def("types", &Types,
        "State types as {platform: {type name: {'type_id': capsule, "
        "'type_info': capsule}}}.");
  m.def("build_info", &BuildInfo, "How this extension was built.");
  m.def("kernel_id", &KernelIdOf, nb::arg("op"), nb::arg("geometry"),
        nb::arg("dtype"), "Id of the kernel a call launches.");
#if defined(JAX_AVGPOOL_WITH_CUDA)
  m.def("cuda_scatter_needs_workspace", &ScatterNeedsWorkspaceOf,
        nb::arg("geometry"), nb::arg("dx_shape"), nb::arg("dtype"),
        "Whether the CUDA scatter backward needs its float32 workspace.");
#endif
}
