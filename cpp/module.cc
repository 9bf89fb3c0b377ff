// The package's one extension module: the FFI handlers as capsules, per
// platform, and a description of how it was built.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <type_traits>

#include "cpu_kernels.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an FFI handler takes an XLA_FFI_CallFrame*");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// {platform: {target name: handler capsule}}
nb::dict Registrations() {
  nb::dict cpu;
  cpu["jax_avgpool_forward"] = Capsule(JaxAvgPoolForwardCpu);
  cpu["jax_avgpool_backward"] = Capsule(JaxAvgPoolBackwardCpu);
  nb::dict out;
  out["cpu"] = cpu;
  return out;
}

nb::dict BuildInfo() {
  nb::dict info;
  info["cpu"] = true;
  info["cuda"] = false;
#if defined(__clang__)
  info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = std::string("gcc ") + __VERSION__;
#endif
  info["xla_ffi_api"] = std::to_string(XLA_FFI_API_MAJOR) + "." +
                        std::to_string(XLA_FFI_API_MINOR);
  return info;
}

}  // namespace

NB_MODULE(_jax_avgpool, m) {
  m.doc() = "XLA FFI handlers of jax_avgpool";
  m.def("registrations", &Registrations,
        "Handler capsules as {platform: {target name: capsule}}.");
  m.def("build_info", &BuildInfo, "How this extension was built.");
}
