"""avg_pool2d against torch.nn.functional.avg_pool2d on the CPU, forward and backward."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from cases import (
    BF16,
    EDGE_TORCH_CASES,
    F16,
    F32,
    F64,
    RANDOM_TORCH_CASES,
    TORCH_CASES,
    TorchCase,
    assert_close,
    case_ids,
    dtype_mode,
    dtype_name,
    nchw_to_nhwc,
    nhwc_to_nchw,
    random_array,
    to_f64,
)

from jax_avgpool import avg_pool2d

torch = pytest.importorskip("torch")

TORCH_DTYPES = {F64: torch.float64, F32: torch.float32, BF16: torch.bfloat16, F16: torch.float16}


def torch_pool(case: TorchCase, x: np.ndarray, g: np.ndarray, dtype: np.dtype):
    """torch's output and input gradient for ``x``, ``g`` in the case's layout."""
    if case.layout == "NHWC":
        x, g = nhwc_to_nchw(x), nhwc_to_nchw(g)
    tdtype = TORCH_DTYPES[np.dtype(dtype)]
    # float64 -> torch dtype is exact: the values are representable in dtype.
    xt = torch.tensor(to_f64(x)).to(tdtype).requires_grad_(True)
    yt = torch.nn.functional.avg_pool2d(xt, **case.torch_args())
    yt.backward(torch.tensor(to_f64(g)).to(tdtype))
    y, dx = (t.detach().to(torch.float64).numpy() for t in (yt, xt.grad))
    if case.layout == "NHWC":
        y, dx = nchw_to_nhwc(y), nchw_to_nhwc(dx)
    return y, dx


def _ours(case: TorchCase, x: np.ndarray, g: np.ndarray, backward: str):
    def run(x, g):
        y, pullback = jax.vjp(functools.partial(avg_pool2d, **case.kwargs(backward)), x)
        return y, pullback(g)[0]

    return jax.jit(run)(x, g)


LOW_PRECISION_CASES = EDGE_TORCH_CASES + RANDOM_TORCH_CASES[:40]


@pytest.mark.parametrize("dtype", [F64, F32], ids=dtype_name)
@pytest.mark.parametrize("case", TORCH_CASES, ids=case_ids(TORCH_CASES))
def test_matches_torch(case: TorchCase, dtype: np.dtype, rng: np.random.Generator) -> None:
    """Same output shape, values and gradient as PyTorch (float64 and float32)."""
    x = random_array(rng, case.shape, dtype)
    g = random_array(rng, case.out_shape, dtype)
    backward = str(rng.choice(["gather", "scatter"]))
    with dtype_mode(dtype):
        y, dx = _ours(case, x, g, backward)
    y_torch, dx_torch = torch_pool(case, x, g, dtype)
    assert y.shape == y_torch.shape
    assert_close(y, y_torch, dtype, "forward")
    assert_close(dx, dx_torch, dtype, f"{backward} gradient")


@pytest.mark.parametrize("dtype", [BF16, F16], ids=dtype_name)
@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=case_ids(LOW_PRECISION_CASES))
def test_matches_torch_16bit(case: TorchCase, dtype: np.dtype, rng: np.random.Generator) -> None:
    """bfloat16 and float16 (both accumulate in float32 in torch's CPU kernel too)."""
    x = random_array(rng, case.shape, dtype)
    g = random_array(rng, case.out_shape, dtype)
    y, dx = _ours(case, x, g, str(rng.choice(["gather", "scatter"])))
    assert y.dtype == dtype and dx.dtype == dtype
    y_torch, dx_torch = torch_pool(case, x, g, dtype)
    assert_close(y, y_torch, dtype, "forward")
    assert_close(dx, dx_torch, dtype, "gradient")


# --------------------------------------------------------------------------
# NaN and Inf propagate as in PyTorch.

SPECIAL_CASES = (
    TorchCase((2, 3, 9, 8), 3, 2, 1, ceil_mode=True),
    TorchCase((2, 3, 9, 8), (3, 2), 1, (1, 0), count_include_pad=False),
    TorchCase((1, 2, 7, 7), 3, (2, 1), 1, ceil_mode=True, divisor_override=-2),
    TorchCase((2, 3, 9, 8), 3, 2, 1, ceil_mode=True, layout="NHWC"),
)


def _masks(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.isnan(a), np.isposinf(a), np.isneginf(a)


@pytest.mark.parametrize("backward", ["gather", "scatter"])
@pytest.mark.parametrize("dtype", [F32, F64, BF16], ids=dtype_name)
@pytest.mark.parametrize("case", SPECIAL_CASES, ids=case_ids(SPECIAL_CASES))
def test_nan_and_inf_propagate_like_torch(
    case: TorchCase, dtype: np.dtype, backward: str, rng: np.random.Generator
) -> None:
    """NaN, +Inf, -Inf in x (and +Inf next to -Inf) and in the cotangent: same masks as torch."""
    x = random_array(rng, case.shape, dtype)
    flat = x.reshape(-1)
    spots = rng.choice(flat.size, size=4, replace=False)
    flat[spots[0]], flat[spots[1]], flat[spots[2]] = np.nan, np.inf, -np.inf
    # An +Inf and a -Inf sharing windows give NaN.
    flat[min(spots[3] + 1, flat.size - 1)], flat[spots[3]] = np.inf, -np.inf
    g = random_array(rng, case.out_shape, dtype)
    gflat = g.reshape(-1)
    gspots = rng.choice(gflat.size, size=min(3, gflat.size), replace=False)
    for spot, value in zip(gspots, (np.nan, np.inf, -np.inf)[: gspots.size], strict=True):
        gflat[spot] = value
    with dtype_mode(dtype):
        y, dx = _ours(case, x, g, backward)
    y_torch, dx_torch = torch_pool(case, x, g, dtype)
    y, dx = to_f64(y), to_f64(dx)
    assert np.isnan(y_torch).any() and np.isnan(dx_torch).any()  # the test is not vacuous
    for ours, theirs, what in ((y, y_torch, "forward"), (dx, dx_torch, "gradient")):
        for mine, ref, kind in zip(
            _masks(ours), _masks(theirs), ("nan", "+inf", "-inf"), strict=True
        ):
            np.testing.assert_array_equal(mine, ref, err_msg=f"{what} {kind} mask")
        finite = np.isfinite(theirs)
        assert_close(ours[finite], theirs[finite], dtype, what)


def test_nan_exactly_in_windows_that_contain_it() -> None:
    """One NaN: the outputs whose windows hold it are NaN, all others finite."""
    x = np.random.default_rng(7).standard_normal((1, 1, 6, 7)).astype(np.float32)
    x[0, 0, 2, 4] = np.nan
    y = np.asarray(avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True))
    expected = torch.nn.functional.avg_pool2d(
        torch.tensor(x), 3, stride=2, padding=1, ceil_mode=True
    ).numpy()
    # Rows whose windows [2o - 1, 2o + 2) hold 2: o = 1; columns holding 4: o = 2.
    mask = np.zeros(y.shape, bool)
    mask[0, 0, 1, 2] = True
    np.testing.assert_array_equal(np.isnan(y), mask)
    np.testing.assert_array_equal(np.isnan(expected), mask)
    np.testing.assert_allclose(y[~mask], expected[~mask], rtol=1e-6)
