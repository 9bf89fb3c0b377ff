"""Bad arguments raise TypeError/ValueError at call time, naming the parameter."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_avgpool import avg_pool, avg_pool2d

X = np.random.default_rng(0).standard_normal((2, 3, 8, 7)).astype(np.float32)
X_NHWC = np.random.default_rng(1).standard_normal((2, 8, 7, 3)).astype(np.float32)


def as_params(rows: list[tuple], x: Any, defaults: dict[str, Any]) -> list[Any]:
    """``(id, kwargs, error, match[, x])`` rows as params ``(x, kwargs, error, match)``."""
    params = []
    for name, kwargs, error, match, *rest in rows:
        params.append(
            pytest.param(rest[0] if rest else x, {**defaults, **kwargs}, error, match, id=name)
        )
    return params


# Keyword arguments merged into kernel_size=2.
AVG_POOL2D_ROWS = [
    # x: rank, dtype
    ("x-rank-2", {}, ValueError, r"^x\b", X[0, 0]),
    ("x-rank-5", {}, ValueError, r"^x\b", X[None]),
    ("x-rank-2-nhwc", {"layout": "NHWC"}, ValueError, r"^x\b.*NHWC", X[0, 0]),
    ("x-int32", {}, TypeError, r"^x\b.*integer", X.astype(np.int32)),
    ("x-jax-int8", {}, TypeError, r"^x\b.*integer", jnp.asarray(X, jnp.int8)),
    ("x-python-ints", {}, TypeError, r"^x\b.*integer", [[[1, 2], [3, 4]]]),
    ("x-bool", {}, TypeError, r"^x\b.*bool", X > 0),
    ("x-complex", {}, TypeError, r"^x\b.*complex", X.astype(np.complex64)),
    ("x-jax-complex", {}, TypeError, r"^x\b.*complex", jnp.asarray(X, jnp.complex64)),
    # kernel_size
    ("kernel-float", {"kernel_size": 2.0}, TypeError, "kernel_size"),
    ("kernel-str", {"kernel_size": "2"}, TypeError, "kernel_size"),
    ("kernel-bool", {"kernel_size": True}, TypeError, "kernel_size"),
    ("kernel-len-1", {"kernel_size": (2,)}, TypeError, "kernel_size"),
    ("kernel-len-3", {"kernel_size": (2, 2, 2)}, TypeError, "kernel_size"),
    ("kernel-pair-float", {"kernel_size": (2, 2.5)}, TypeError, "kernel_size"),
    ("kernel-none", {"kernel_size": None}, TypeError, "kernel_size"),
    ("kernel-0", {"kernel_size": 0}, ValueError, "kernel_size"),
    ("kernel-negative", {"kernel_size": -1}, ValueError, "kernel_size"),
    ("kernel-pair-0", {"kernel_size": (2, 0)}, ValueError, "kernel_size"),
    # stride
    ("stride-0", {"stride": 0}, ValueError, "stride"),
    ("stride-negative", {"stride": (1, -1)}, ValueError, "stride"),
    ("stride-float", {"stride": 1.5}, TypeError, "stride"),
    ("stride-len-3", {"stride": (1, 1, 1)}, TypeError, "stride"),
    # padding
    ("padding-negative", {"kernel_size": 3, "padding": -1}, ValueError, "padding"),
    ("padding-over-half", {"kernel_size": 3, "padding": 2}, ValueError, "padding"),
    ("padding-h-over-half", {"kernel_size": (3, 5), "padding": (2, 0)}, ValueError, "padding"),
    ("padding-w-over-half", {"kernel_size": (5, 3), "padding": (2, 2)}, ValueError, "padding"),
    ("padding-kernel-1", {"kernel_size": 1, "padding": 1}, ValueError, "padding"),
    ("padding-float", {"kernel_size": 3, "padding": 1.0}, TypeError, "padding"),
    ("padding-str", {"kernel_size": 3, "padding": "SAME"}, TypeError, "padding"),
    # output size
    ("output-too-small", {"kernel_size": 9}, ValueError, "output size"),
    ("output-w-too-small", {"kernel_size": (2, 8), "stride": 1}, ValueError, "output size"),
    # divisor_override
    ("divisor-0", {"divisor_override": 0}, ValueError, "divisor_override"),
    ("divisor-float", {"divisor_override": 1.5}, TypeError, "divisor_override"),
    ("divisor-bool", {"divisor_override": True}, TypeError, "divisor_override"),
    # flags
    ("ceil-mode-str", {"ceil_mode": "yes"}, TypeError, "ceil_mode"),
    ("cip-int", {"count_include_pad": 2}, TypeError, "count_include_pad"),
    # layout, backward
    ("layout-lower", {"layout": "nchw"}, ValueError, "layout"),
    ("layout-unknown", {"layout": "NCDHW"}, ValueError, "layout"),
    ("layout-none", {"layout": None}, ValueError, "layout"),
    ("backward-unknown", {"backward": "auto"}, ValueError, "backward"),
    ("backward-none", {"backward": None}, ValueError, "backward"),
]
AVG_POOL2D_CASES = as_params(AVG_POOL2D_ROWS, X, {"kernel_size": 2})


@pytest.mark.parametrize(("x", "kwargs", "error", "match"), AVG_POOL2D_CASES)
def test_avg_pool2d_rejects(
    x: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        avg_pool2d(x, **kwargs)


@pytest.mark.parametrize(
    ("x", "kwargs", "error", "match"),
    [p for p in AVG_POOL2D_CASES if not isinstance(p.values[0], list)],
)
def test_avg_pool2d_rejects_under_jit(
    x: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    """The same errors at trace time (not XLA runtime errors) when the input is traced."""
    with pytest.raises(error, match=match):
        jax.jit(lambda v: avg_pool2d(v, **kwargs))(x)


def test_valid_boundaries_are_accepted() -> None:
    """The limits themselves are legal: padding = kernel // 2, output size 1, negative divisor."""
    assert avg_pool2d(X, 3, padding=1).shape == (2, 3, 3, 3)
    assert avg_pool2d(X, (8, 7)).shape == (2, 3, 1, 1)
    assert avg_pool2d(X, (4, 5), 1, (2, 2)).shape == (2, 3, 9, 7)
    y = avg_pool2d(X, 2, divisor_override=-1)
    np.testing.assert_allclose(y, -4 * avg_pool2d(X, 2), rtol=1e-6)


# Keyword arguments merged into window_shape=(2, 2).
AVG_POOL_ROWS = [
    ("inputs-rank-2", {}, ValueError, r"^inputs\b", X_NHWC[0, 0]),
    ("inputs-int", {}, TypeError, r"^inputs\b", X_NHWC.astype(np.int64)),
    ("inputs-bool", {}, TypeError, r"^inputs\b", X_NHWC > 0),
    ("inputs-complex", {}, TypeError, r"^inputs\b", X_NHWC.astype(np.complex128)),
    ("window-len-1", {"window_shape": (2,)}, ValueError, "window_shape"),
    ("window-len-3", {"window_shape": (2, 2, 2)}, ValueError, "window_shape"),
    ("window-int", {"window_shape": 2}, TypeError, "window_shape"),
    ("window-str", {"window_shape": "22"}, TypeError, "window_shape"),
    ("window-0", {"window_shape": (0, 2)}, ValueError, "window_shape"),
    ("window-float", {"window_shape": (2.0, 2)}, TypeError, "window_shape"),
    ("window-too-big", {"window_shape": (9, 2)}, ValueError, "output size"),
    ("strides-len-1", {"strides": (1,)}, ValueError, "strides"),
    ("strides-0", {"strides": (0, 1)}, ValueError, "strides"),
    ("strides-int", {"strides": 1}, TypeError, "strides"),
    ("padding-unknown", {"padding": "FULL"}, ValueError, "padding"),
    ("padding-one-pair", {"padding": ((1, 1),)}, ValueError, "padding"),
    ("padding-triple", {"padding": ((1, 1, 1), (0, 0))}, ValueError, "padding"),
    ("padding-negative", {"padding": ((-1, 0), (0, 0))}, ValueError, "padding"),
    ("padding-float", {"padding": ((1.5, 0), (0, 0))}, TypeError, "padding"),
    ("padding-int", {"padding": 1}, ValueError, "padding"),
    ("cip-str", {"count_include_pad": "no"}, TypeError, "count_include_pad"),
]
AVG_POOL_CASES = as_params(AVG_POOL_ROWS, X_NHWC, {"window_shape": (2, 2)})


@pytest.mark.parametrize(("x", "kwargs", "error", "match"), AVG_POOL_CASES)
def test_avg_pool_rejects(
    x: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        avg_pool(x, **kwargs)


@pytest.mark.parametrize(
    ("layout", "shape", "count_include_pad"),
    [("NCHW", (1, 2, 0, 5), False), ("NHWC", (1, 5, 0, 2), True)],
)
def test_avg_pool2d_rejects_empty_spatial_dims(
    layout: str, shape: tuple[int, ...], count_include_pad: bool
) -> None:
    """H or W = 0 is bad input, as in PyTorch (which raises for it).

    With padding, such an input still has windows (of padding only): the
    package returns 0 for them, or 0 / 0 = NaN with count_include_pad=False,
    values PyTorch's semantics never produce. (Known failure: the package
    accepts this input.)
    """
    with pytest.raises(ValueError, match=r"^x\b"):
        avg_pool2d(jnp.zeros(shape), 2, 1, 1, count_include_pad=count_include_pad, layout=layout)


def test_torch_rejects_empty_spatial_dims() -> None:
    """The reference behaviour the test above asks for."""
    torch = pytest.importorskip("torch")
    with pytest.raises(RuntimeError):
        torch.nn.functional.avg_pool2d(torch.zeros(1, 2, 0, 5), 2, 1, 1)
