"""Reference implementations that share no code with jax_avgpool.

* ``np_pool`` / ``np_pool_vjp``: float64 NumPy, plain loops over the output
  windows following PyTorch's documented rules (generalised to asymmetric
  padding for the Flax path).
* ``lax_pool``: ``jax.lax.reduce_window`` formulas (sum window over the
  padded input, divided by a divisor array that is itself a
  ``reduce_window`` over ones); its ``jax.vjp`` is the second gradient oracle.

All work on the last two axes (..., H, W); leading axes are batch axes.
``divisor`` is ``"padded"`` (count_include_pad=True: the window clipped to
the padded extent), ``"real"`` (count_include_pad=False: the number of real
elements) or an int (divisor_override; also Flax's ``kh * kw``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import jax.numpy as jnp
import numpy as np
from jax import lax

Pair = tuple[int, int]
Pads = tuple[Pair, Pair]
Divisor = str | int


def out_size(n: int, k: int, s: int, lo: int, hi: int, ceil_mode: bool) -> int:
    """Number of windows along one axis (PyTorch's rule); 0 when none fits."""
    span = n + lo + hi - k
    if span < 0:
        return 0
    quotient = Fraction(span, s)
    out = (math.ceil(quotient) if ceil_mode else math.floor(quotient)) + 1
    # ceil_mode: a last window that would start in the high padding is dropped.
    if ceil_mode and (out - 1) * s >= n + lo:
        out -= 1
    return out


def windows(
    n: int, k: int, s: int, lo: int, hi: int, ceil_mode: bool
) -> list[tuple[int, int, int]]:
    """Per output index: ``(real_start, real_end, padded_count)``.

    The window is ``[o*s - lo, o*s - lo + k)``; clipped to ``[-lo, n + hi)``
    it gives the padded count, clipped to ``[0, n)`` the real elements.
    """
    result = []
    for o in range(out_size(n, k, s, lo, hi, ceil_mode)):
        begin, end = o * s - lo, o * s - lo + k
        padded = min(end, n + hi) - max(begin, -lo)
        start, stop = max(begin, 0), min(end, n)
        result.append((start, max(start, stop), padded))
    return result


def _divisor(divisor: Divisor, rows: tuple[int, int, int], cols: tuple[int, int, int]) -> int:
    if divisor == "padded":
        return rows[2] * cols[2]
    if divisor == "real":
        return (rows[1] - rows[0]) * (cols[1] - cols[0])
    assert isinstance(divisor, int) and divisor != 0
    return divisor


def np_pool(
    x: np.ndarray,
    kernel: Pair,
    stride: Pair,
    pads: Pads,
    ceil_mode: bool = False,
    divisor: Divisor = "padded",
) -> np.ndarray:
    """Average pooling of the last two axes of ``x``, in float64."""
    x = np.asarray(x, dtype=np.float64)
    (h, w), (kh, kw), (sh, sw) = x.shape[-2:], kernel, stride
    rows = windows(h, kh, sh, *pads[0], ceil_mode)
    cols = windows(w, kw, sw, *pads[1], ceil_mode)
    y = np.empty(x.shape[:-2] + (len(rows), len(cols)), dtype=np.float64)
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            total = np.zeros(x.shape[:-2], dtype=np.float64)
            for hh in range(r[0], r[1]):
                for ww in range(c[0], c[1]):
                    total = total + x[..., hh, ww]
            with np.errstate(invalid="ignore", divide="ignore"):
                y[..., i, j] = total / np.float64(_divisor(divisor, r, c))
    return y


def np_pool_vjp(
    g: np.ndarray,
    in_hw: Pair,
    kernel: Pair,
    stride: Pair,
    pads: Pads,
    ceil_mode: bool = False,
    divisor: Divisor = "padded",
) -> np.ndarray:
    """Gradient of ``sum(np_pool(x) * g)`` with respect to ``x``, in float64."""
    g = np.asarray(g, dtype=np.float64)
    (h, w), (kh, kw), (sh, sw) = in_hw, kernel, stride
    rows = windows(h, kh, sh, *pads[0], ceil_mode)
    cols = windows(w, kw, sw, *pads[1], ceil_mode)
    assert g.shape[-2:] == (len(rows), len(cols)), (g.shape, rows, cols)
    dx = np.zeros(g.shape[:-2] + (h, w), dtype=np.float64)
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            if r[0] == r[1] or c[0] == c[1]:
                continue  # a window with no real element feeds no input
            share = g[..., i, j] / np.float64(_divisor(divisor, r, c))
            for hh in range(r[0], r[1]):
                for ww in range(c[0], c[1]):
                    dx[..., hh, ww] += share
    return dx


def np_jacobian(
    in_shape: Sequence[int],
    kernel: Pair,
    stride: Pair,
    pads: Pads,
    ceil_mode: bool = False,
    divisor: Divisor = "padded",
) -> np.ndarray:
    """The Jacobian of ``np_pool`` as an array of shape ``out_shape + in_shape``."""
    size = math.prod(in_shape)
    basis = np.eye(size).reshape((size, *in_shape))
    columns = np_pool(basis, kernel, stride, pads, ceil_mode, divisor)  # (size, *out)
    out_shape = columns.shape[1:]
    return np.moveaxis(columns, 0, -1).reshape(out_shape + tuple(in_shape))


def same_pads(n: int, k: int, s: int, lower: bool = False) -> Pair:
    """``"SAME"`` (or ``"SAME_LOWER"``) padding: ceil(n / s) outputs."""
    out = -(-n // s)
    total = max((out - 1) * s + k - n, 0)
    small, large = total // 2, total - total // 2
    return (large, small) if lower else (small, large)


def lax_pool(
    x: jnp.ndarray,
    kernel: Pair,
    stride: Pair,
    pads: Pads,
    ceil_mode: bool = False,
    divisor: Divisor = "padded",
) -> jnp.ndarray:
    """Average pooling of the last two axes from ``lax.reduce_window`` sums.

    16-bit inputs are summed in float32; the result has ``x``'s dtype.
    """
    acc = jnp.float32 if jnp.dtype(x.dtype).itemsize < 4 else x.dtype
    lead = x.ndim - 2
    hw = x.shape[-2:]
    outs = [
        out_size(n, k, s, lo, hi, ceil_mode)
        for n, k, s, (lo, hi) in zip(hw, kernel, stride, pads, strict=True)
    ]
    # ceil_mode windows may reach past the high padding: pad (with zeros that
    # count for nothing) far enough for reduce_window to produce them.
    reach = [
        max(hi, (o - 1) * s + k - n - lo)
        for n, k, s, (lo, hi), o in zip(hw, kernel, stride, pads, outs, strict=True)
    ]
    window, strides = (1,) * lead + tuple(kernel), (1,) * lead + tuple(stride)
    padding = ((0, 0),) * lead + tuple((lo, r) for (lo, _), r in zip(pads, reach, strict=True))
    sums = lax.reduce_window(x.astype(acc), np.zeros((), acc), lax.add, window, strides, padding)
    if divisor == "padded":
        ones = jnp.ones(tuple(n + lo + hi for n, (lo, hi) in zip(hw, pads, strict=True)), acc)
        ones = lax.pad(
            ones,
            np.zeros((), acc),
            tuple((0, r - hi, 0) for (_, hi), r in zip(pads, reach, strict=True)),
        )
        div = lax.reduce_window(
            ones, np.zeros((), acc), lax.add, tuple(kernel), tuple(stride), "VALID"
        )
    elif divisor == "real":
        ones = jnp.ones(hw, acc)
        ones = lax.pad(
            ones,
            np.zeros((), acc),
            tuple((lo, r, 0) for (lo, _), r in zip(pads, reach, strict=True)),
        )
        div = lax.reduce_window(
            ones, np.zeros((), acc), lax.add, tuple(kernel), tuple(stride), "VALID"
        )
    else:
        div = jnp.array(divisor, acc)
    assert sums.shape[-2:] == tuple(outs), (sums.shape, outs)
    return (sums / div).astype(x.dtype)
