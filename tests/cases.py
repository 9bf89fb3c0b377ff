"""Test configurations, random inputs, dtypes, tolerances and comparisons."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import oracle

# --------------------------------------------------------------------------
# dtypes and tolerances.

F16, BF16, F32, F64 = (np.dtype(t) for t in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))
DTYPES = (F16, BF16, F32, F64)
LOW_PRECISION = (F16, BF16)

# Relative tolerance of one pooled value or gradient (also used, scaled by
# the largest magnitude, as the absolute tolerance).
TOLERANCE = {F64: 1e-12, F32: 1e-5, BF16: 2e-2, F16: 2e-3}


def dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


@contextlib.contextmanager
def dtype_mode(dtype: Any) -> Iterator[None]:
    """64-bit mode on exactly when ``dtype`` is float64."""
    with jax.enable_x64(np.dtype(dtype) == F64):
        yield


def to_f64(a: Any) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def assert_close(actual: Any, expected: Any, dtype: Any, what: str = "") -> None:
    """Values (not dtypes) agree within ``dtype``'s tolerance; NaNs must match."""
    actual, expected = to_f64(actual), to_f64(expected)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    tol = TOLERANCE[np.dtype(dtype)]
    finite = expected[np.isfinite(expected)]
    scale = max(1.0, float(np.max(np.abs(finite)))) if finite.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=what)


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Standard normal values (never all zeros or ones), exactly representable in ``dtype``."""
    values = rng.standard_normal(shape) + 0.25
    return values.astype(np.dtype(dtype))


def nchw_to_nhwc(a: Any) -> Any:
    return np.moveaxis(np.asarray(a), -3, -1)


def nhwc_to_nchw(a: Any) -> Any:
    return np.moveaxis(np.asarray(a), -1, -3)


def gpu_devices() -> list[jax.Device]:
    """The GPUs JAX can use (empty on a CPU-only installation)."""
    try:
        return list(jax.devices("gpu"))
    except RuntimeError:
        return []


# --------------------------------------------------------------------------
# PyTorch-style configurations (avg_pool2d).


def pair(value: int | tuple[int, int] | None) -> tuple[int, int]:
    assert value is not None
    return (value, value) if isinstance(value, int) else (value[0], value[1])


@dataclasses.dataclass(frozen=True)
class TorchCase:
    """One ``avg_pool2d`` configuration; ``nchw`` is the shape in NCHW order."""

    nchw: tuple[int, ...]
    kernel_size: int | tuple[int, int]
    stride: int | tuple[int, int] | None = None
    padding: int | tuple[int, int] = 0
    ceil_mode: bool = False
    count_include_pad: bool = True
    divisor_override: int | None = None
    layout: str = "NCHW"

    @property
    def kernel(self) -> tuple[int, int]:
        return pair(self.kernel_size)

    @property
    def strides(self) -> tuple[int, int]:
        return self.kernel if self.stride is None else pair(self.stride)

    @property
    def pads(self) -> oracle.Pads:
        ph, pw = pair(self.padding)
        return (ph, ph), (pw, pw)

    @property
    def divisor(self) -> oracle.Divisor:
        if self.divisor_override is not None:
            return self.divisor_override
        return "padded" if self.count_include_pad else "real"

    @property
    def shape(self) -> tuple[int, ...]:
        """The input shape in this case's layout."""
        if self.layout == "NCHW":
            return self.nchw
        *lead, c, h, w = self.nchw
        return (*lead, h, w, c)

    @property
    def out_hw(self) -> tuple[int, int]:
        h, w = self.nchw[-2:]
        return tuple(
            oracle.out_size(n, k, s, lo, hi, self.ceil_mode)
            for n, k, s, (lo, hi) in zip((h, w), self.kernel, self.strides, self.pads, strict=True)
        )

    @property
    def out_nchw(self) -> tuple[int, ...]:
        return (*self.nchw[:-2], *self.out_hw)

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The output shape in this case's layout."""
        return dataclasses.replace(self, nchw=self.out_nchw).shape

    def torch_args(self) -> dict[str, Any]:
        """Keyword arguments shared by ``avg_pool2d`` and torch's function."""
        return dict(
            kernel_size=self.kernel_size,
            stride=self.stride,
            padding=self.padding,
            ceil_mode=self.ceil_mode,
            count_include_pad=self.count_include_pad,
            divisor_override=self.divisor_override,
        )

    def kwargs(self, backward: str = "gather") -> dict[str, Any]:
        """Keyword arguments of ``jax_avgpool.avg_pool2d``."""
        return dict(self.torch_args(), layout=self.layout, backward=backward)

    def oracle_forward(self, x: Any) -> np.ndarray:
        """The NumPy oracle's output, for ``x`` in this case's layout."""
        nchw = np.asarray(x) if self.layout == "NCHW" else nhwc_to_nchw(x)
        y = oracle.np_pool(nchw, self.kernel, self.strides, self.pads, self.ceil_mode, self.divisor)
        return y if self.layout == "NCHW" else nchw_to_nhwc(y)

    def oracle_vjp(self, g: Any) -> np.ndarray:
        """The NumPy oracle's input gradient for cotangent ``g`` (this layout)."""
        nchw = np.asarray(g) if self.layout == "NCHW" else nhwc_to_nchw(g)
        dx = oracle.np_pool_vjp(
            nchw, self.nchw[-2:], self.kernel, self.strides, self.pads, self.ceil_mode, self.divisor
        )
        return dx if self.layout == "NCHW" else nchw_to_nhwc(dx)

    def __str__(self) -> str:
        parts = [
            self.layout,
            "x".join(map(str, self.nchw)),
            f"k{self.kernel_size}",
            f"s{self.stride}",
            f"p{self.padding}",
        ]
        if self.ceil_mode:
            parts.append("ceil")
        if not self.count_include_pad:
            parts.append("real")
        if self.divisor_override is not None:
            parts.append(f"d{self.divisor_override}")
        return "-".join(parts).replace(" ", "")


def _maybe_pair(rng: np.random.Generator, a: int, b: int) -> int | tuple[int, int]:
    """``a`` as an int when ``a == b`` (half the time), else the pair."""
    return a if a == b and rng.random() < 0.5 else (a, b)


def random_torch_case(rng: np.random.Generator) -> TorchCase:
    """A legal ``avg_pool2d`` configuration with odd, often non-square, sizes."""
    while True:
        kh = int(rng.integers(1, 6))
        kw = kh if rng.random() < 0.4 else int(rng.integers(1, 6))
        if rng.random() < 0.2:
            stride = None
        else:
            sh = int(rng.integers(1, 5))
            sw = sh if rng.random() < 0.5 else int(rng.integers(1, 5))
            stride = _maybe_pair(rng, sh, sw)
        ph, pw = int(rng.integers(0, kh // 2 + 1)), int(rng.integers(0, kw // 2 + 1))
        h, w = (int(v) for v in rng.integers(1, 18, 2))
        lead = () if rng.random() < 0.15 else (int(rng.integers(1, 4)),)
        case = TorchCase(
            nchw=(*lead, int(rng.integers(1, 5)), h, w),
            kernel_size=_maybe_pair(rng, kh, kw),
            stride=stride,
            padding=_maybe_pair(rng, ph, pw),
            ceil_mode=bool(rng.random() < 0.5),
            count_include_pad=bool(rng.random() < 0.5),
            divisor_override=(
                None if rng.random() < 0.65 else int(rng.choice([-7, -3, -1, 1, 2, 5, 9, 13]))
            ),
            layout=str(rng.choice(["NCHW", "NHWC"])),
        )
        if min(case.out_hw) >= 1:
            return case


# Hand-picked cases for the rules random draws hit rarely.
EDGE_TORCH_CASES = (
    # ceil_mode: the last window would start in the padding and is dropped.
    TorchCase((2, 3, 5, 5), 2, 2, 1, ceil_mode=True),
    TorchCase((1, 2, 5, 7), 2, 2, 1, ceil_mode=True, count_include_pad=False),
    # ceil_mode: an extra window past the padded end (padded count clipped).
    TorchCase((2, 2, 4, 6), 3, 2, 1, ceil_mode=True),
    TorchCase((1, 3, 6, 6), 3, 4, 0, ceil_mode=True),
    # stride > kernel: inputs no window covers get a zero gradient.
    TorchCase((2, 2, 9, 11), (2, 1), (4, 3), 0),
    # one-pixel images, 1x1 kernels, full-image windows.
    TorchCase((3, 2, 1, 1), 1),
    TorchCase((1, 1, 1, 17), (1, 3), 1, (0, 1), count_include_pad=False),
    TorchCase((2, 3, 17, 17), 5, 1, 2, divisor_override=-3),
    TorchCase((2, 4, 5, 4), (5, 4)),
    # unbatched input
    TorchCase((3, 7, 6), 3, 2, 1, ceil_mode=True, count_include_pad=False),
)
EDGE_TORCH_CASES = EDGE_TORCH_CASES + tuple(
    dataclasses.replace(c, layout="NHWC") for c in EDGE_TORCH_CASES
)

RANDOM_TORCH_CASES = tuple(random_torch_case(np.random.default_rng(1000 + i)) for i in range(150))
TORCH_CASES = EDGE_TORCH_CASES + RANDOM_TORCH_CASES


# --------------------------------------------------------------------------
# Flax-style configurations (avg_pool).


@dataclasses.dataclass(frozen=True)
class FlaxCase:
    """One ``avg_pool`` configuration; ``shape`` is (batch..., H, W, C)."""

    shape: tuple[int, ...]
    window_shape: tuple[int, int]
    strides: tuple[int, int] | None = None
    padding: str | tuple[tuple[int, int], tuple[int, int]] = "VALID"
    count_include_pad: bool = True

    @property
    def stride_pair(self) -> tuple[int, int]:
        return self.strides or (1, 1)

    @property
    def pads(self) -> oracle.Pads:
        """Explicit pads, computed independently of the package and of flax."""
        if not isinstance(self.padding, str):
            return self.padding
        if self.padding == "VALID":
            return (0, 0), (0, 0)
        lower = self.padding == "SAME_LOWER"
        h, w = self.shape[-3:-1]
        return tuple(
            oracle.same_pads(n, k, s, lower)
            for n, k, s in zip((h, w), self.window_shape, self.stride_pair, strict=True)
        )

    @property
    def divisor(self) -> oracle.Divisor:
        kh, kw = self.window_shape
        return kh * kw if self.count_include_pad else "real"

    def kwargs(self) -> dict[str, Any]:
        return dict(
            window_shape=self.window_shape,
            strides=self.strides,
            padding=self.padding,
            count_include_pad=self.count_include_pad,
        )

    def oracle_forward(self, x: Any) -> np.ndarray:
        nchw = nhwc_to_nchw(x)
        y = oracle.np_pool(
            nchw, self.window_shape, self.stride_pair, self.pads, False, self.divisor
        )
        return nchw_to_nhwc(y)

    def oracle_vjp(self, g: Any) -> np.ndarray:
        args = (self.shape[-3:-1], self.window_shape, self.stride_pair, self.pads)
        dx = oracle.np_pool_vjp(nhwc_to_nchw(g), *args, False, self.divisor)
        return nchw_to_nhwc(dx)

    def __str__(self) -> str:
        pad = self.padding if isinstance(self.padding, str) else str(self.padding).replace(" ", "")
        parts = ["x".join(map(str, self.shape)), f"w{self.window_shape}", f"s{self.strides}", pad]
        if not self.count_include_pad:
            parts.append("real")
        return "-".join(parts).replace(" ", "")


def random_flax_case(rng: np.random.Generator) -> FlaxCase:
    """A legal ``avg_pool`` configuration with 0, 1 or 2 leading batch dims."""
    while True:
        window = (int(rng.integers(1, 6)), int(rng.integers(1, 6)))
        strides = None if rng.random() < 0.2 else (int(rng.integers(1, 5)), int(rng.integers(1, 5)))
        kind = rng.choice(["VALID", "SAME", "SAME_LOWER", "explicit", "explicit"])
        if kind == "explicit":
            # Asymmetric, sometimes wider than the window (all-padding windows).
            padding: Any = tuple(
                (int(rng.integers(0, k + 2)), int(rng.integers(0, k + 2))) for k in window
            )
        else:
            padding = str(kind)
        lead = tuple(int(v) for v in rng.integers(1, 4, int(rng.integers(0, 3))))
        h, w = (int(v) for v in rng.integers(1, 18, 2))
        case = FlaxCase(
            shape=(*lead, h, w, int(rng.integers(1, 5))),
            window_shape=window,
            strides=strides,
            padding=padding,
            count_include_pad=bool(rng.random() < 0.5),
        )
        hw = case.shape[-3:-1]
        outs = [
            oracle.out_size(n, k, s, lo, hi, False)
            for n, k, s, (lo, hi) in zip(hw, window, case.stride_pair, case.pads, strict=True)
        ]
        if min(outs) >= 1:
            return case


FLAX_CASES = (
    FlaxCase((5, 5, 2), (2, 2), (2, 2), "SAME", count_include_pad=False),
    FlaxCase((2, 7, 6, 3), (3, 3), None, "SAME", count_include_pad=True),
    FlaxCase((2, 7, 6, 3), (3, 2), (2, 3), ((2, 0), (0, 3)), count_include_pad=False),
    # padding wider than the window: some windows hold padding only
    FlaxCase((1, 4, 5, 2), (2, 2), (1, 1), ((3, 2), (0, 4)), count_include_pad=False),
    FlaxCase((2, 2, 4, 5, 2), (2, 3), (2, 1), ((3, 2), (0, 4)), count_include_pad=True),
) + tuple(random_flax_case(np.random.default_rng(5000 + i)) for i in range(60))


def case_ids(cases: Any) -> list[str]:
    return [f"{i}-{c}" for i, c in enumerate(cases)]
