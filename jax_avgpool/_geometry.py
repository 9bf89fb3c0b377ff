"""Argument normalisation, validation and output-size rules.

Everything here runs in Python at call or trace time, on static values only:
a bad argument becomes a ``TypeError`` or ``ValueError`` that names the
parameter and the rule it broke, before anything reaches XLA.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

LAYOUTS = ("NCHW", "NHWC")
BACKWARD_STRATEGIES = ("gather", "scatter")
PADDING_STRINGS = ("SAME", "SAME_LOWER", "VALID")

# Divisor rules; the numbers are the kernels' `divisor_mode` attribute.
COUNT_PADDED = 0
COUNT_REAL = 1
OVERRIDE = 2

SUPPORTED_DTYPES = tuple(np.dtype(t) for t in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


def _is_int(value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _as_int(value: Any, name: str) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    return operator.index(value)


def _as_bool(value: Any, name: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if _is_int(value) and operator.index(value) in (0, 1):
        return bool(operator.index(value))
    raise TypeError(f"{name} must be a bool, got {value!r}")


def as_pair(value: Any, name: str) -> tuple[int, int]:
    """An int, or a sequence of exactly two ints, as a pair ``(h, w)``."""
    if _is_int(value):
        v = operator.index(value)
        return v, v
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence | np.ndarray):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    items = list(value)
    if len(items) != 2 or not all(_is_int(v) for v in items):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    return operator.index(items[0]), operator.index(items[1])


def _at_least_one(pair: tuple[int, int], name: str) -> tuple[int, int]:
    if min(pair) < 1:
        raise ValueError(f"{name} must be >= 1 in each dimension, got {pair}")
    return pair


def check_dtype(dtype: Any, name: str) -> np.dtype:
    """Only float16, bfloat16, float32 and float64 are pooled."""
    dt = np.dtype(dtype)
    if dt not in SUPPORTED_DTYPES:
        kind = (
            "bool"
            if dt == np.bool_
            else "integer"
            if np.issubdtype(dt, np.integer)
            else "complex"
            if np.issubdtype(dt, np.complexfloating)
            else "unsupported"
        )
        raise TypeError(
            f"{name} must have a floating dtype (float16, bfloat16, float32 or float64); "
            f"got {kind} dtype {dt}"
        )
    return dt


def pooled_size(n: int, k: int, s: int, lo: int, hi: int, ceil_mode: bool) -> int:
    """Windows along one axis (PyTorch's rule, asymmetric padding allowed).

    ``floor((n + lo + hi - k) / s) + 1``; with ``ceil_mode`` the ceiling, less
    a last window that would start at or past ``n + lo``. 0 when none fits.
    Mirrors ``PooledSize`` in ``cpp/pooling.h``.
    """
    span = n + lo + hi - k
    if span < 0:
        return 0
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= n + lo:
        out -= 1
    return out


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Every static constant of one pooling op: the primitives' only parameter.

    ``in_hw``/``out_hw`` are the spatial sizes of the pooled input and of the
    output; the primitives accept any number of leading (batch) dimensions.
    """

    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[tuple[int, int], tuple[int, int]]  # ((top, bottom), (left, right))
    ceil_mode: bool
    divisor_mode: int
    divisor_override: int
    layout: str
    backward: str
    in_hw: tuple[int, int]
    out_hw: tuple[int, int]

    @property
    def spatial_axes(self) -> tuple[int, int]:
        """Axes of H and W counted from the end (negative)."""
        return (-3, -2) if self.layout == "NHWC" else (-2, -1)

    def with_spatial(self, shape: Sequence[int], hw: tuple[int, int]) -> tuple[int, ...]:
        """``shape`` with its spatial dimensions replaced by ``hw``."""
        out = list(shape)
        h_axis, w_axis = self.spatial_axes
        out[h_axis], out[w_axis] = hw
        return tuple(out)

    def spatial(self, shape: Sequence[int]) -> tuple[int, int]:
        h_axis, w_axis = self.spatial_axes
        return shape[h_axis], shape[w_axis]

    def attributes(self) -> dict[str, np.int64]:
        """The custom call's ``geometry`` attribute (cpp/ffi_common.h)."""
        (pt, pb), (pl, pr) = self.padding
        values = {
            "kernel_h": self.kernel[0],
            "kernel_w": self.kernel[1],
            "stride_h": self.stride[0],
            "stride_w": self.stride[1],
            "pad_top": pt,
            "pad_bottom": pb,
            "pad_left": pl,
            "pad_right": pr,
            "ceil_mode": int(self.ceil_mode),
            "divisor_mode": self.divisor_mode,
            "divisor_override": self.divisor_override,
            "layout": LAYOUTS.index(self.layout),
        }
        return {k: np.int64(v) for k, v in values.items()}

    def strategy_attribute(self) -> np.int64:
        return np.int64(BACKWARD_STRATEGIES.index(self.backward))


def _make_geometry(
    shape: Sequence[int],
    *,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[tuple[int, int], tuple[int, int]],
    ceil_mode: bool,
    divisor_mode: int,
    divisor_override: int,
    layout: str,
    backward: str,
    kernel_name: str,
) -> Geometry:
    h_axis, w_axis = (-3, -2) if layout == "NHWC" else (-2, -1)
    in_hw = (int(shape[h_axis]), int(shape[w_axis]))
    out_hw = tuple(
        pooled_size(n, k, s, lo, hi, ceil_mode)
        for n, k, s, (lo, hi) in zip(in_hw, kernel, stride, padding, strict=True)
    )
    if min(out_hw) < 1:
        raise ValueError(
            f"output size must be >= 1: input spatial size {in_hw} with {kernel_name} "
            f"{kernel}, stride {stride} and padding {padding} gives {out_hw}"
        )
    return Geometry(
        kernel=kernel,
        stride=stride,
        padding=padding,
        ceil_mode=ceil_mode,
        divisor_mode=divisor_mode,
        divisor_override=divisor_override,
        layout=layout,
        backward=backward,
        in_hw=in_hw,
        out_hw=out_hw,  # type: ignore[arg-type]
    )


def _check_choice(value: Any, name: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def torch_geometry(
    shape: Sequence[int],
    dtype: Any,
    kernel_size: Any,
    stride: Any,
    padding: Any,
    ceil_mode: Any,
    count_include_pad: Any,
    divisor_override: Any,
    layout: Any,
    backward: Any,
) -> Geometry:
    """Validate ``avg_pool2d``'s arguments (PyTorch's rules)."""
    layout = _check_choice(layout, "layout", LAYOUTS)
    backward = _check_choice(backward, "backward", BACKWARD_STRATEGIES)
    if len(shape) not in (3, 4):
        names = "(C, H, W) or (N, C, H, W)" if layout == "NCHW" else "(H, W, C) or (N, H, W, C)"
        raise ValueError(
            f"x must have rank 3 or 4, {names} for layout {layout!r}; got shape {tuple(shape)}"
        )
    check_dtype(dtype, "x")
    if min(shape[-3:]) < 1:
        raise ValueError(
            f"x must have non-zero channel and spatial dimensions (only the batch may be "
            f"empty); got shape {tuple(shape)}"
        )
    kernel = _at_least_one(as_pair(kernel_size, "kernel_size"), "kernel_size")
    if stride is None or (isinstance(stride, Sequence) and len(stride) == 0):
        stride_pair = kernel
    else:
        stride_pair = _at_least_one(as_pair(stride, "stride"), "stride")
    pad = as_pair(padding, "padding")
    if min(pad) < 0:
        raise ValueError(f"padding must be >= 0, got {pad}")
    if pad[0] > kernel[0] // 2 or pad[1] > kernel[1] // 2:
        raise ValueError(
            f"padding must be at most kernel_size // 2 in each dimension; got padding {pad} "
            f"with kernel_size {kernel}"
        )
    ceil = _as_bool(ceil_mode, "ceil_mode")
    include = _as_bool(count_include_pad, "count_include_pad")
    if divisor_override is None:
        mode, override = (COUNT_PADDED if include else COUNT_REAL), 0
    else:
        override = _as_int(divisor_override, "divisor_override")
        if override == 0:
            raise ValueError("divisor_override must not be 0")
        mode = OVERRIDE
    return _make_geometry(
        shape,
        kernel=kernel,
        stride=stride_pair,
        padding=((pad[0], pad[0]), (pad[1], pad[1])),
        ceil_mode=ceil,
        divisor_mode=mode,
        divisor_override=override,
        layout=layout,
        backward=backward,
        kernel_name="kernel_size",
    )


def flax_geometry(
    shape: Sequence[int],
    dtype: Any,
    window_shape: Any,
    strides: Any,
    padding: Any,
    count_include_pad: Any,
) -> Geometry:
    """Validate ``avg_pool``'s arguments (flax.linen.avg_pool's rules)."""
    if isinstance(window_shape, (str, bytes)) or not isinstance(
        window_shape, Sequence | np.ndarray
    ):
        raise TypeError(f"window_shape must be a sequence of 2 ints, got {window_shape!r}")
    if len(window_shape) != 2:
        raise ValueError(
            f"window_shape must have length 2 (only 2-D pooling is supported), "
            f"got {tuple(window_shape)!r}"
        )
    kernel = _at_least_one(as_pair(tuple(window_shape), "window_shape"), "window_shape")
    if strides is None:
        stride = (1, 1)
    else:
        if isinstance(strides, (str, bytes)) or not isinstance(strides, Sequence | np.ndarray):
            raise TypeError(f"strides must be a sequence of 2 ints, got {strides!r}")
        if len(strides) != 2:
            raise ValueError(f"strides must have length 2, got {tuple(strides)!r}")
        stride = _at_least_one(as_pair(tuple(strides), "strides"), "strides")
    if len(shape) < 3:
        raise ValueError(
            f"inputs must have rank >= 3, (batch..., H, W, C); got shape {tuple(shape)}"
        )
    check_dtype(dtype, "inputs")
    in_hw = (int(shape[-3]), int(shape[-2]))
    if isinstance(padding, str):
        if padding.upper() not in PADDING_STRINGS:
            raise ValueError(
                f"padding must be 'SAME', 'SAME_LOWER', 'VALID' or a sequence of 2 (low, high) "
                f"pairs; got {padding!r}"
            )
        pads = tuple(
            (int(lo), int(hi))
            for lo, hi in lax.padtype_to_pads(in_hw, kernel, stride, padding.upper())
        )
    else:
        pads = _explicit_pads(padding)
    include = _as_bool(count_include_pad, "count_include_pad")
    return _make_geometry(
        shape,
        kernel=kernel,
        stride=stride,
        padding=pads,  # type: ignore[arg-type]
        ceil_mode=False,
        divisor_mode=COUNT_PADDED if include else COUNT_REAL,
        divisor_override=0,
        layout="NHWC",
        backward="gather",
        kernel_name="window_shape",
    )


def _explicit_pads(padding: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    message = (
        f"padding must be 'SAME', 'VALID' or a sequence of 2 (low, high) int pairs; got {padding!r}"
    )
    if not isinstance(padding, Sequence | np.ndarray) or len(padding) != 2:
        raise ValueError(message)
    pads = []
    for pair in padding:
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence | np.ndarray):
            raise ValueError(message)
        if len(pair) != 2:
            raise ValueError(message)
        if not all(_is_int(v) for v in pair):
            raise TypeError(message)
        lo, hi = (operator.index(v) for v in pair)
        if lo < 0 or hi < 0:
            raise ValueError(f"padding must be >= 0, got {padding!r}")
        pads.append((lo, hi))
    return pads[0], pads[1]
