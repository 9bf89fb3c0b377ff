"""avg_pool against flax.linen.avg_pool: a drop-in replacement, values and gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import (
    DTYPES,
    F32,
    F64,
    FLAX_CASES,
    FlaxCase,
    assert_close,
    dtype_mode,
    dtype_name,
    random_array,
)

from jax_avgpool import avg_pool

linen = pytest.importorskip("flax.linen")


def flax_avg_pool(x: jax.Array, **kwargs) -> jax.Array:
    """flax.linen.avg_pool, with several leading batch dims folded into one.

    (flax's ``pool`` pads only one leading axis when ``padding`` is explicit,
    so it fails on two or more batch dims.)
    """
    if x.ndim <= 4:
        return linen.avg_pool(x, **kwargs)
    y = linen.avg_pool(x.reshape((-1, *x.shape[-3:])), **kwargs)
    return y.reshape((*x.shape[:-3], *y.shape[-3:]))


def _both(case: FlaxCase, x: np.ndarray, rng: np.random.Generator, dtype: np.dtype):
    """(ours, flax) outputs and gradients for one random cotangent, in one jit."""
    ours = functools.partial(avg_pool, **case.kwargs())
    theirs = functools.partial(flax_avg_pool, **case.kwargs())
    with dtype_mode(dtype):
        out = jax.eval_shape(theirs, jax.ShapeDtypeStruct(x.shape, x.dtype))
        g = random_array(rng, out.shape, dtype)

        def run(x, g):
            y, pull = jax.vjp(ours, x)
            y_ref, pull_ref = jax.vjp(theirs, x)
            return y, y_ref, pull(g)[0], pull_ref(g.astype(y_ref.dtype))[0]

        return (*jax.jit(run)(x, g), g)


# Each configuration in one dtype, the four dtypes taking turns.
FLAX_PARAMS = [
    pytest.param(case, DTYPES[i % 4], id=f"{i}-{case}-{dtype_name(DTYPES[i % 4])}")
    for i, case in enumerate(FLAX_CASES + FLAX_CASES[1::2])
]


@pytest.mark.parametrize(("case", "dtype"), FLAX_PARAMS)
def test_matches_flax(case: FlaxCase, dtype: np.dtype, rng: np.random.Generator) -> None:
    """Same shape, values (NaN where flax has NaN) and gradient as flax.

    Our output keeps the input dtype; for 16-bit inputs flax may promote to
    float32 and rounds its gradient at every step, so there values are
    compared and the gradient is checked against the float64 oracle.
    """
    x = random_array(rng, case.shape, dtype)
    y, y_ref, dx, dx_ref, g = _both(case, x, rng, dtype)
    assert y.shape == y_ref.shape
    assert y.dtype == dtype and dx.dtype == dtype
    np.testing.assert_array_equal(np.isnan(y), np.isnan(y_ref))
    assert_close(y, y_ref, dtype, "forward")
    if dtype in (F32, F64):
        assert_close(dx, dx_ref, dtype, "gradient")
    else:
        assert_close(dx, case.oracle_vjp(g), dtype, "gradient")


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("padding", ["SAME", "VALID", ((0, 2), (1, 0)), ((2, 1), (3, 0))], ids=str)
@pytest.mark.parametrize("lead", [(), (2,), (2, 3)], ids=lambda s: f"batch{len(s)}")
def test_leading_batch_dims(
    lead: tuple[int, ...], padding, count_include_pad: bool, rng: np.random.Generator
) -> None:
    """0, 1 and 2 leading batch dims each give flax's result (and each slice pools alone)."""
    x = random_array(rng, (*lead, 9, 8, 3), F32)
    kwargs = dict(
        window_shape=(3, 2), strides=(2, 1), padding=padding, count_include_pad=count_include_pad
    )
    y = avg_pool(x, **kwargs)
    y_ref = flax_avg_pool(jnp.asarray(x), **kwargs)
    assert y.shape == y_ref.shape
    assert_close(y, y_ref, F32)
    if lead:
        flat = x.reshape((-1, *x.shape[-3:]))
        per_slice = np.stack([np.asarray(avg_pool(s, **kwargs)) for s in flat])
        assert_close(y, per_slice.reshape(y.shape), F32)


def test_window_only_in_padding_is_nan_like_flax() -> None:
    """count_include_pad=False and a window holding padding only: 0/0 = NaN, as in flax."""
    x = np.random.default_rng(3).standard_normal((1, 3, 3, 2)).astype(np.float32)
    kwargs = dict(window_shape=(2, 2), strides=(1, 1), padding=((3, 0), (0, 0)))
    y = np.asarray(avg_pool(x, **kwargs, count_include_pad=False))
    y_ref = np.asarray(linen.avg_pool(jnp.asarray(x), **kwargs, count_include_pad=False))
    assert np.isnan(y[:, :2]).all() and np.isfinite(y[:, 2:]).all()
    np.testing.assert_array_equal(np.isnan(y), np.isnan(y_ref))
    # With count_include_pad those windows average to 0.
    y_pad = np.asarray(avg_pool(x, **kwargs, count_include_pad=True))
    np.testing.assert_array_equal(y_pad[:, :2], 0.0)
    assert_close(y_pad, linen.avg_pool(jnp.asarray(x), **kwargs), F32)
    # And the gradient stays finite: those windows cover no input.
    dx = jax.grad(lambda v: jnp.nansum(avg_pool(v, **kwargs, count_include_pad=False)))(x)
    assert np.isfinite(np.asarray(dx)).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_default_arguments_match_flax(dtype: np.dtype, rng: np.random.Generator) -> None:
    """Defaults: strides (1, 1), padding VALID, count_include_pad True."""
    x = random_array(rng, (2, 6, 7, 3), dtype)
    with dtype_mode(dtype):
        y = avg_pool(x, (2, 3))
        y_ref = linen.avg_pool(jnp.asarray(x), (2, 3))
    assert y.shape == (2, 5, 5, 3) and y.dtype == dtype
    assert_close(y, y_ref, dtype)
