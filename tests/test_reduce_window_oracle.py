"""avg_pool2d and avg_pool against the lax.reduce_window oracle and its jax.vjp."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from cases import (
    DTYPES,
    F32,
    FLAX_CASES,
    TORCH_CASES,
    FlaxCase,
    TorchCase,
    assert_close,
    case_ids,
    dtype_mode,
    dtype_name,
    random_array,
)

from jax_avgpool import avg_pool, avg_pool2d


def _lax_torch_rule(case: TorchCase, x: jax.Array) -> jax.Array:
    """The reduce_window oracle for a TorchCase, in the case's layout."""
    if case.layout == "NHWC":
        x = jnp.moveaxis(x, -1, -3)
    y = oracle.lax_pool(x, case.kernel, case.strides, case.pads, case.ceil_mode, case.divisor)
    return jnp.moveaxis(y, -3, -1) if case.layout == "NHWC" else y


def _lax_flax_rule(case: FlaxCase, x: jax.Array) -> jax.Array:
    y = oracle.lax_pool(
        jnp.moveaxis(x, -1, -3), case.window_shape, case.stride_pair, case.pads, False, case.divisor
    )
    return jnp.moveaxis(y, -3, -1)


def _compare(ours, reference, x: np.ndarray, g: np.ndarray, dtype: np.dtype) -> None:
    def run(x, g):
        y, pull = jax.vjp(ours, x)
        y_ref, pull_ref = jax.vjp(reference, x)
        return y, y_ref, pull(g)[0], pull_ref(g)[0]

    with dtype_mode(dtype):
        y, y_ref, dx, dx_ref = jax.jit(run)(x, g)
    assert y.dtype == y_ref.dtype == dx.dtype == dtype
    assert_close(y, y_ref, dtype, "forward")
    assert_close(dx, dx_ref, dtype, "gradient")


# Each configuration runs in one dtype, the dtypes taking turns (compiling the
# reduce_window gradient is what costs time here).
TORCH_PARAMS = [
    pytest.param(case, DTYPES[i % 4], id=f"{i}-{case}-{dtype_name(DTYPES[i % 4])}")
    for i, case in enumerate(TORCH_CASES[::2])
]
FLAX_PARAMS = [
    pytest.param(case, DTYPES[i % 4], id=f"{i}-{case}-{dtype_name(DTYPES[i % 4])}")
    for i, case in enumerate(FLAX_CASES)
]


@pytest.mark.parametrize(("case", "dtype"), TORCH_PARAMS)
def test_avg_pool2d_matches_reduce_window(
    case: TorchCase, dtype: np.dtype, rng: np.random.Generator
) -> None:
    """Forward and vjp equal the reduce_window formula's (ceil_mode, all divisor rules)."""
    x = random_array(rng, case.shape, dtype)
    g = random_array(rng, case.out_shape, dtype)
    backward = str(rng.choice(["gather", "scatter"]))
    ours = functools.partial(avg_pool2d, **case.kwargs(backward))
    _compare(ours, functools.partial(_lax_torch_rule, case), x, g, dtype)


@pytest.mark.parametrize(("case", "dtype"), FLAX_PARAMS)
def test_avg_pool_matches_reduce_window(
    case: FlaxCase, dtype: np.dtype, rng: np.random.Generator
) -> None:
    """avg_pool (asymmetric pads, SAME, VALID) equals the reduce_window formula."""
    x = random_array(rng, case.shape, dtype)
    out = case.oracle_forward(x).shape
    g = random_array(rng, out, dtype)
    ours = functools.partial(avg_pool, **case.kwargs())
    _compare(ours, functools.partial(_lax_flax_rule, case), x, g, dtype)


@pytest.mark.parametrize("case", FLAX_CASES[::3], ids=case_ids(FLAX_CASES[::3]))
def test_avg_pool_matches_numpy_oracle(case: FlaxCase, rng: np.random.Generator) -> None:
    """avg_pool against the NumPy loops (all-padding windows give NaN without count_include_pad)."""
    x = random_array(rng, case.shape, F32)
    y, pull = jax.vjp(functools.partial(avg_pool, **case.kwargs()), x)
    g = random_array(rng, y.shape, F32)
    assert_close(y, case.oracle_forward(x), F32, "forward")
    assert_close(pull(g)[0], case.oracle_vjp(g), F32, "gradient")
