// Which kernel a call launches: compile-time specialisations of the common
// pooling configurations, a runtime-parameter ("generic") kernel for every
// other one, and the kernel ids that name them. Shared by the CPU and CUDA
// code so that both choose, and name, their kernels the same way.
#ifndef JAX_AVGPOOL_KERNEL_SPEC_H_
#define JAX_AVGPOOL_KERNEL_SPEC_H_

#include <cstdint>
#include <string>

#include "pooling.h"

namespace jax_avgpool {

// Compile-time constants of one kernel: window KH x KW, strides SH, SW, and
// BLOCK adjacent outputs along W per thread (for the gather backward: the
// inputs under BLOCK adjacent outputs in the NCHW row kernels, BLOCK
// adjacent inputs elsewhere; BlockOf below for the NHWC sliding kernel).
// KH == 0 marks the generic kernel, whose window and strides are runtime
// values.
template <int KH_, int KW_, int SH_, int SW_, int BLOCK_>
struct Spec {
  static constexpr int KH = KH_;
  static constexpr int KW = KW_;
  static constexpr int SH = SH_;
  static constexpr int SW = SW_;
  static constexpr int BLOCK = BLOCK_;
  static constexpr bool kGeneric = KH_ == 0;
};

using GenericSpec = Spec<0, 0, 0, 0, 1>;

// Calls fn(Spec<...>{}) with the specialisation matching the attributes, or
// GenericSpec. Every platform compiles exactly these.
template <typename Fn>
decltype(auto) WithSpec(const PoolAttrs& a, Fn&& fn) {
  const auto is = [&](int kh, int kw, int sh, int sw) {
    return a.kernel_h == kh && a.kernel_w == kw && a.stride_h == sh &&
           a.stride_w == sw;
  };
  if (is(2, 2, 2, 2)) return fn(Spec<2, 2, 2, 2, 4>{});
  if (is(3, 3, 1, 1)) return fn(Spec<3, 3, 1, 1, 4>{});
  if (is(3, 3, 2, 2)) return fn(Spec<3, 3, 2, 2, 4>{});
  if (is(7, 7, 1, 1)) return fn(Spec<7, 7, 1, 1, 4>{});
  return fn(GenericSpec{});
}

// Kernel names; NHWC kernels carry an "_nhwc" suffix.
enum class Op { kForward, kBackwardGather, kBackwardScatter };

inline std::string KernelName(Op op, int64_t layout) {
  std::string name = op == Op::kForward          ? "avgpool2d_forward"
                     : op == Op::kBackwardGather ? "avgpool2d_backward_gather"
                                                 : "avgpool2d_backward_scatter";
  if (layout == kNHWC) name += "_nhwc";
  return name;
}

// Whether op runs the NHWC sliding-window kernel, whose work items walk
// down a segment of rows holding the output rows still open in registers:
// for stride 1, and for the forward of square windows of equal strides
// that overlap vertically (3x3/2).
template <typename S>
constexpr bool NhwcSlides(Op op) {
  if (S::kGeneric || op == Op::kBackwardScatter) return false;
  if (S::SH == 1 && S::SW == 1) return true;
  return op == Op::kForward && S::SH == S::SW && S::KH == S::KW &&
         S::KH > S::SH;
}

// Whether the NHWC stride-1 kernels of S sum along W through shared memory
// (the box filter, a thread per column): for windows wider than 3.
template <typename S>
constexpr bool NhwcBox() {
  return !S::kGeneric && S::SH == 1 && S::SW == 1 && S::KW > 3;
}

// Adjacent columns per work item of the sliding kernels, for elements of
// `bytes` bytes: one for windows wider than 3 columns at stride 1, which
// sum along W through shared memory with a thread per column, and for
// 16-bit strided windows, whose items then fit four blocks per
// multiprocessor; two for the other gathers, whose accumulators would
// otherwise overflow the registers or measured slower; the Spec's BLOCK
// for the others.
template <typename S>
constexpr int NhwcSlideBlock(Op op, int bytes) {
  if (NhwcBox<S>() || (S::SW > 1 && bytes == 2)) return 1;
  return op == Op::kBackwardGather || S::KW > 3 ? 2 : S::BLOCK;
}

// The BLOCK of the kernel that op launches for layout and elements of
// `bytes` bytes.
template <typename S>
constexpr int BlockOf(Op op, int64_t layout, int bytes) {
  return layout == kNHWC && NhwcSlides<S>(op) ? NhwcSlideBlock<S>(op, bytes)
                                              : S::BLOCK;
}

// Bytes per element of a dtype name: f16, bf16, f32 or f64.
inline int DtypeBytes(const std::string& dtype) {
  return dtype == "f64" ? 8 : dtype == "f32" ? 4 : 2;
}

// name + dtype + constants joined by "__", e.g.
// avgpool2d_backward_gather__bf16__3__3__2__2__4, or ...__f32__generic.
template <typename S>
std::string KernelId(Op op, int64_t layout, const std::string& dtype) {
  std::string id = KernelName(op, layout) + "__" + dtype;
  if constexpr (S::kGeneric) {
    return id + "__generic";
  } else {
    for (int v : {S::KH, S::KW, S::SH, S::SW,
                  BlockOf<S>(op, layout, DtypeBytes(dtype))}) {
      id += "__" + std::to_string(v);
    }
    return id;
  }
}

inline std::string KernelIdFor(Op op, const PoolAttrs& a,
                               const std::string& dtype) {
  return WithSpec(a, [&](auto spec) {
    return KernelId<decltype(spec)>(op, a.layout, dtype);
  });
}

}  // namespace jax_avgpool

#endif  // JAX_AVGPOOL_KERNEL_SPEC_H_
