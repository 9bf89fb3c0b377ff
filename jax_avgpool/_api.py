"""Public functions: PyTorch-style ``avg_pool2d`` and Flax-style ``avg_pool``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from ._geometry import check_dtype, flax_geometry, torch_geometry
from ._primitives import pool_p
from ._version import __version__

IntOrPair = int | tuple[int, int] | Sequence[int]
Padding = str | Sequence[tuple[int, int]]


def _as_array(x: Any, name: str) -> jax.Array:
    if not isinstance(x, jax.Array):
        dtype = getattr(x, "dtype", None)
        if dtype is not None:
            check_dtype(dtype, name)
        x = jnp.asarray(x)
    return x


def avg_pool2d(
    x: jax.typing.ArrayLike,
    kernel_size: IntOrPair,
    stride: IntOrPair | None = None,
    padding: IntOrPair = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
    *,
    layout: str = "NCHW",
    backward: str = "gather",
) -> jax.Array:
    """2-D average pooling with the semantics of ``torch.nn.functional.avg_pool2d``.

    Args:
      x: ``(N, C, H, W)`` or ``(C, H, W)``; with ``layout="NHWC"``,
        ``(N, H, W, C)`` or ``(H, W, C)``. float16, bfloat16, float32 or
        float64 (16-bit types accumulate in float32).
      kernel_size: window size, an int or a pair ``(kh, kw)``.
      stride: an int or a pair; ``None`` (the default) means ``kernel_size``.
      padding: implicit zero padding on both sides, an int or a pair, at most
        ``kernel_size // 2`` in each dimension.
      ceil_mode: use the ceiling instead of the floor for the output size; a
        last window that would start in the right/bottom padding is dropped.
      count_include_pad: divide by the window size clipped to the padded
        input (``True``) or by the number of real elements (``False``).
      divisor_override: if given, divide every window's sum by this instead.
      layout: ``"NCHW"`` (default) or ``"NHWC"``.
      backward: how the gradient is computed: ``"gather"`` (default: each
        input gradient sums the output gradients of the windows covering it,
        written once, deterministic) or ``"scatter"`` (spread each output
        gradient uniformly over its window). Both give the same gradient.

    Returns:
      The pooled array, in ``x``'s dtype and layout.

    Example:
      >>> x = jax.random.normal(jax.random.key(0), (8, 3, 32, 32))
      >>> avg_pool2d(x, 3, stride=2, padding=1).shape
      (8, 3, 16, 16)
    """
    x = _as_array(x, "x")
    geometry = torch_geometry(
        x.shape,
        x.dtype,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
        layout,
        backward,
    )
    return pool_p.bind(x, geometry=geometry)


def avg_pool(
    inputs: jax.typing.ArrayLike,
    window_shape: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: Padding = "VALID",
    count_include_pad: bool = True,
) -> jax.Array:
    """2-D average pooling with the semantics of ``flax.linen.avg_pool``.

    Args:
      inputs: ``(batch..., H, W, C)`` with zero, one or several leading batch
        dimensions.
      window_shape: the window, a pair ``(kh, kw)``; only 2-D windows.
      strides: a pair; ``None`` (the default) means ``(1, 1)``.
      padding: ``"SAME"``, ``"VALID"`` (the default), ``"SAME_LOWER"``, or
        two ``(low, high)`` pairs, asymmetric allowed.
      count_include_pad: divide by the window size (``True``) or by the number
        of real elements in the window (``False``).

    Returns:
      The pooled array, in ``inputs``' dtype.

    Example:
      >>> x = jnp.ones((4, 28, 28, 16))
      >>> avg_pool(x, (2, 2), strides=(2, 2)).shape
      (4, 14, 14, 16)
    """
    inputs = _as_array(inputs, "inputs")
    geometry = flax_geometry(
        inputs.shape, inputs.dtype, window_shape, strides, padding, count_include_pad
    )
    return pool_p.bind(inputs, geometry=geometry)


def plan(
    x: Any,
    kernel_size: IntOrPair,
    stride: IntOrPair | None = None,
    padding: IntOrPair = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
    *,
    layout: str = "NCHW",
    backward: str = "gather",
    platform: str | None = None,
) -> dict[str, str]:
    """The kernels that ``avg_pool2d`` with these arguments launches.

    ``x`` is an array or anything with ``shape`` and ``dtype``
    (``jax.ShapeDtypeStruct``). Returns ``{"platform", "forward",
    "backward"}``: the platform (``platform`` or JAX's default backend) and
    the ids of the forward and backward kernels, each its name, dtype and
    compile-time constants joined by ``"__"`` (KH, KW, STRIDE_H, STRIDE_W,
    BLOCK_OW), e.g. ``avgpool2d_backward_gather__bf16__3__3__2__2__4``, or
    ``...__generic`` for the runtime-parameter kernel.
    """
    shape, dtype = tuple(x.shape), np.dtype(x.dtype)
    geometry = torch_geometry(
        shape,
        dtype,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
        layout,
        backward,
    )
    platform = platform or jax.default_backend()
    if platform == "gpu":  # JAX's backend name; the GPU kernels are CUDA's
        platform = "cuda"
    if platform not in _ffi.REGISTERED_PLATFORMS:
        raise ValueError(
            f"platform {platform!r} has no jax_avgpool kernels in this build "
            f"(built for: {', '.join(_ffi.REGISTERED_PLATFORMS)})"
        )
    attrs = {k: int(v) for k, v in geometry.attributes().items()}
    name = _ffi.DTYPE_NAMES[dtype.name]
    return {
        "platform": platform,
        "forward": _ffi.kernel_id("forward", attrs, name),
        "backward": _ffi.kernel_id(f"backward_{geometry.backward}", attrs, name),
    }


def build_info() -> dict[str, Any]:
    """How this installation was built and what it can run on.

    Returns a dict with the package ``version``, the ``jax`` and ``jaxlib``
    versions it runs with, ``"cpu"`` and ``"cuda"`` (whether handlers for
    that platform are compiled in), the registered ``platforms``, and the
    extension's own build details (compiler, XLA FFI API version).
    """
    import jaxlib

    ext = _ffi.extension_info()
    info: dict[str, Any] = {
        "version": __version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "cpu": bool(ext.pop("cpu", False)),
        "cuda": bool(ext.pop("cuda", False)),
        "platforms": list(_ffi.REGISTERED_PLATFORMS),
        "numpy": np.__version__,
    }
    info.update(ext)
    return info
