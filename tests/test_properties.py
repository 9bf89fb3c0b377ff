"""Structural properties: transpose identity, determinism, empty and unbatched inputs,
16-bit rounding and accumulation, accepted input types."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import (
    BF16,
    DTYPES,
    F16,
    F32,
    F64,
    FLAX_CASES,
    LOW_PRECISION,
    RANDOM_TORCH_CASES,
    TORCH_CASES,
    FlaxCase,
    TorchCase,
    assert_close,
    case_ids,
    dtype_mode,
    dtype_name,
    random_array,
    to_f64,
)

from jax_avgpool import _geometry, avg_pool, avg_pool2d
from jax_avgpool._primitives import pool_p, pool_transpose_p


def geometry_of(fn, x) -> _geometry.Geometry:
    """The ``geometry`` parameter of the pooling primitive ``fn(x)`` binds."""
    eqns = [e for e in jax.make_jaxpr(fn)(x).eqns if e.primitive is pool_p]
    assert len(eqns) == 1
    return eqns[0].params["geometry"]


# --------------------------------------------------------------------------
# The transpose identity <pool(x), g> == <x, pool_transpose(g)>.

TRANSPOSE_CASES = TORCH_CASES[::4]


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("backward", ["gather", "scatter"])
@pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=case_ids(TRANSPOSE_CASES))
def test_transpose_identity(case: TorchCase, backward: str, rng: np.random.Generator) -> None:
    """The two primitives are each other's transpose (float64, primitives bound directly)."""
    x = jnp.asarray(random_array(rng, case.shape, F64))
    g = jnp.asarray(random_array(rng, case.out_shape, F64))
    geometry = geometry_of(functools.partial(avg_pool2d, **case.kwargs(backward)), x)
    assert geometry.backward == backward
    y = pool_p.bind(x, geometry=geometry)
    dx = pool_transpose_p.bind(g, geometry=geometry)
    assert dx.shape == x.shape
    lhs, rhs = float(jnp.vdot(y, g)), float(jnp.vdot(x, dx))
    scale = float(jnp.vdot(jnp.abs(y), jnp.abs(g))) + 1.0
    assert abs(lhs - rhs) <= 1e-12 * scale, (lhs, rhs)
    assert_close(dx, case.oracle_vjp(g), F64)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("case", FLAX_CASES[::4], ids=case_ids(FLAX_CASES[::4]))
def test_transpose_identity_flax(case: FlaxCase, rng: np.random.Generator) -> None:
    """Same for avg_pool's geometries; windows of padding only (NaN) cover no input."""
    x = jnp.asarray(random_array(rng, case.shape, F64))
    geometry = geometry_of(functools.partial(avg_pool, **case.kwargs()), x)
    y = pool_p.bind(x, geometry=geometry)
    g = jnp.asarray(random_array(rng, y.shape, F64))
    dx = pool_transpose_p.bind(g, geometry=geometry)
    lhs, rhs = float(jnp.nansum(y * g)), float(jnp.vdot(x, dx))
    scale = float(jnp.nansum(jnp.abs(y * g))) + 1.0
    assert abs(lhs - rhs) <= 1e-12 * scale, (lhs, rhs)


# --------------------------------------------------------------------------
# Determinism, and gather == scatter.

# Each configuration in one dtype, the four dtypes taking turns.
DETERMINISM_PARAMS = [
    pytest.param(case, DTYPES[i % 4], id=f"{i}-{case}-{dtype_name(DTYPES[i % 4])}")
    for i, case in enumerate(RANDOM_TORCH_CASES[::5])
]


@pytest.mark.parametrize(("case", "dtype"), DETERMINISM_PARAMS)
def test_gradients_are_deterministic(
    case: TorchCase, dtype: np.dtype, rng: np.random.Generator
) -> None:
    """Gradients are bitwise identical across runs; the strategies agree.

    The gather backward is deterministic everywhere. The scatter backward is
    too on the CPU (one thread adds in a fixed order), where it equals the
    gather bitwise; on a GPU its atomics add in no fixed order.
    """
    x = random_array(rng, case.shape, dtype)
    g = jnp.asarray(random_array(rng, case.out_shape, dtype))
    on_cpu = jax.default_backend() == "cpu"
    grads = {}
    with dtype_mode(dtype):
        for backward in ("gather", "scatter"):
            f = functools.partial(avg_pool2d, **case.kwargs(backward))

            def loss(v, f=f):
                return jnp.sum(f(v).astype(jnp.float32) * g.astype(jnp.float32))

            runs = [jax.grad(loss)(x)] + [jax.jit(jax.grad(loss))(x) for _ in range(3)]
            if backward == "gather" or on_cpu:
                for other in runs[1:]:
                    np.testing.assert_array_equal(np.asarray(runs[0]), np.asarray(other))
            grads[backward] = np.asarray(runs[0])
    if dtype in (F32, F64) and on_cpu:
        # On the CPU the two strategies add the same terms in the same order.
        np.testing.assert_array_equal(grads["gather"], grads["scatter"])
    assert_close(grads["gather"], grads["scatter"], dtype)


# --------------------------------------------------------------------------
# Empty batch, unbatched inputs.


@pytest.mark.parametrize("backward", ["gather", "scatter"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_empty_batch(layout: str, backward: str) -> None:
    """N = 0: forward and backward give empty arrays of the right shapes."""
    case = TorchCase((0, 3, 7, 6), 3, 2, 1, ceil_mode=True, layout=layout)
    f = functools.partial(avg_pool2d, **case.kwargs(backward))
    x = jnp.zeros(case.shape, jnp.float32)
    y, pullback = jax.vjp(f, x)
    assert y.shape == case.out_shape == dataclasses.replace(case, nchw=(0, 3, 4, 4)).shape
    (dx,) = pullback(jnp.zeros(y.shape, y.dtype))
    assert dx.shape == x.shape and dx.dtype == x.dtype
    assert jax.jit(jax.grad(lambda v: jnp.sum(f(v))))(x).shape == x.shape
    # Zero-sized leading dims of avg_pool too.
    z = avg_pool(jnp.zeros((2, 0, 5, 5, 3)), (2, 2), (2, 2), "SAME")
    assert z.shape == (2, 0, 3, 3, 3)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_empty_batch_matches_torch_shapes(layout: str) -> None:
    torch = pytest.importorskip("torch")
    for k, s, p, ceil in ((3, 2, 1, True), (2, 3, 0, False), ((1, 3), (2, 1), (0, 1), True)):
        expected = torch.nn.functional.avg_pool2d(torch.zeros(0, 2, 9, 8), k, s, p, ceil).shape
        case = TorchCase((0, 2, 9, 8), k, s, p, ceil_mode=ceil, layout=layout)
        y = avg_pool2d(jnp.zeros(case.shape), **case.kwargs())
        assert y.shape == dataclasses.replace(case, nchw=tuple(expected)).shape


@pytest.mark.parametrize("backward", ["gather", "scatter"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_unbatched_equals_batch_of_one(
    layout: str, backward: str, rng: np.random.Generator
) -> None:
    """(C, H, W) / (H, W, C) inputs pool like a batch of one, forward and backward."""
    case = TorchCase(
        (3, 9, 7), (3, 2), (2, 1), (1, 1), ceil_mode=True, count_include_pad=False, layout=layout
    )
    f = functools.partial(avg_pool2d, **case.kwargs(backward))
    x = jnp.asarray(random_array(rng, case.shape, F32))
    g = jnp.asarray(random_array(rng, case.out_shape, F32))
    y, pullback = jax.vjp(f, x)
    y1, pullback1 = jax.vjp(f, x[None])
    np.testing.assert_array_equal(y, y1[0])
    np.testing.assert_array_equal(pullback(g)[0], pullback1(g[None])[0][0])
    assert_close(y, case.oracle_forward(np.asarray(x)), F32)


# --------------------------------------------------------------------------
# 16-bit types: conversion and float32 accumulation.


def _float32_reference(x: np.ndarray, divisor: int, dtype: np.dtype) -> np.ndarray:
    return (x.astype(np.float32) / np.float32(divisor)).astype(dtype)


@pytest.mark.parametrize("divisor", [1, 3, -7, 1000, 1 << 20])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_name)
def test_16bit_every_bit_pattern(dtype: np.dtype, divisor: int) -> None:
    """1x1 windows over all 65536 bit patterns: y = round(float32(x) / d), exactly.

    Covers widening and round-to-nearest-even narrowing of normals,
    subnormals, infinities and NaNs; and the gradient likewise. Values are
    compared as float32 (exact for 16-bit types), so -0 == +0: a window sum
    starts at +0, as in torch. XLA runs CPU code with denormals flushed to
    zero, so where the float32 input or quotient is subnormal (bfloat16
    subnormals are float32 subnormals) 0 is accepted too, as XLA's own
    reductions (and flax) give 0 there.
    """
    x = np.arange(1 << 16, dtype=np.uint16).view(dtype).reshape(1, 1, 256, 256)
    with np.errstate(invalid="ignore"):
        expected = _float32_reference(x, divisor, dtype).astype(np.float32)
    tiny = np.finfo(np.float32).tiny
    x32 = x.astype(np.float32)
    with np.errstate(invalid="ignore"):
        quotient = x32 / np.float32(divisor)  # before rounding to dtype
    flushable = ((np.abs(x32) < tiny) | (np.abs(quotient) < tiny)) & (x32 != 0)
    f = functools.partial(avg_pool2d, kernel_size=1, divisor_override=divisor)
    y, pullback = jax.vjp(f, jnp.asarray(x))
    for name, value in (("forward", y), ("gradient", pullback(jnp.asarray(x))[0])):
        assert value.dtype == dtype
        value = np.asarray(value).astype(np.float32)
        flushed = flushable & (value == 0)
        np.testing.assert_array_equal(value[~flushed], expected[~flushed], err_msg=name)
    if dtype == F16:
        assert not flushable.any()  # float16 subnormals are float32 normals


def _ulp(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    info = jnp.finfo(dtype)
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(np.abs(values)))
    return np.exp2(np.maximum(exponent, info.minexp) - info.nmant)


SIXTEEN_BIT_CASES = RANDOM_TORCH_CASES[::5]


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_name)
@pytest.mark.parametrize("case", SIXTEEN_BIT_CASES, ids=case_ids(SIXTEEN_BIT_CASES))
def test_16bit_results_within_one_ulp(
    case: TorchCase, dtype: np.dtype, rng: np.random.Generator
) -> None:
    """Output and gradients are within one 16-bit ulp of the exact (float64) value.

    Accumulating in the 16-bit type itself would be off by many ulps.
    """
    x = random_array(rng, case.shape, dtype)
    g = random_array(rng, case.out_shape, dtype)
    for backward in ("gather", "scatter"):
        y, pullback = jax.vjp(
            functools.partial(avg_pool2d, **case.kwargs(backward)), jnp.asarray(x)
        )
        for value, exact in ((y, case.oracle_forward(x)), (pullback(g)[0], case.oracle_vjp(g))):
            error = np.abs(to_f64(value) - exact)
            assert np.all(error <= _ulp(exact, dtype)), (
                backward,
                np.max(error / _ulp(exact, dtype)),
            )


def test_16bit_accumulates_in_float32() -> None:
    """Sums that overflow float16 or lose bits in bfloat16 still average correctly."""
    big = np.array([[60000.0, 50000.0], [40000.0, 30000.0]], np.float16).reshape(1, 1, 2, 2)
    y = avg_pool2d(big, 2)
    assert np.asarray(y).item() == np.float16(45000.0)
    # float16: 2048 + 1 + 1 + 1 = 2051 exactly in float32, but 2048 in float16.
    ones = np.array([[2048.0, 1.0], [1.0, 1.0]], np.float16).reshape(1, 1, 2, 2)
    assert np.asarray(avg_pool2d(ones, 2, divisor_override=1)).item() == np.float16(2051.0)
    # bfloat16: 256 + 1 + 1 + 1 = 259 in float32, /4 = 64.75 -> nearest bfloat16.
    bf = np.array([[256.0, 1.0], [1.0, 1.0]]).astype(BF16).reshape(1, 1, 2, 2)
    assert np.asarray(avg_pool2d(bf, 2)).item() == np.float32(64.75).astype(BF16)
    g = np.array([[256.0]]).astype(BF16).reshape(1, 1, 1, 1)
    (dx,) = jax.vjp(lambda v: avg_pool2d(v, 2, divisor_override=3), jnp.asarray(bf))[1](
        jnp.asarray(g)
    )
    np.testing.assert_array_equal(
        np.asarray(dx), np.full((1, 1, 2, 2), np.float32(256 / 3)).astype(BF16)
    )


# --------------------------------------------------------------------------
# Input types, output dtype.


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_output_dtype_is_input_dtype(dtype: np.dtype, rng: np.random.Generator) -> None:
    x = random_array(rng, (2, 3, 5, 5), dtype)
    with dtype_mode(dtype):
        for layout in ("NCHW", "NHWC"):
            for cip in (True, False):
                assert avg_pool2d(x, 3, 1, 1, count_include_pad=cip, layout=layout).dtype == dtype
                assert avg_pool(x, (2, 2), padding="SAME", count_include_pad=cip).dtype == dtype


def test_accepts_numpy_and_python_inputs(rng: np.random.Generator) -> None:
    """NumPy arrays and nested lists of floats are pooled like jax arrays."""
    x = random_array(rng, (1, 2, 4, 5), F32)
    expected = avg_pool2d(jnp.asarray(x), 2, 1)
    np.testing.assert_array_equal(avg_pool2d(x, 2, 1), expected)
    np.testing.assert_array_equal(avg_pool2d(x.tolist(), 2, 1), expected)
    assert isinstance(avg_pool2d(x, 2, 1), jax.Array)
    # Pairs may be lists or NumPy arrays; an empty stride means the kernel.
    np.testing.assert_array_equal(avg_pool2d(x, [2, 2], np.array([1, 1]), [0, 0]), expected)
    np.testing.assert_array_equal(avg_pool2d(x, 2, []), avg_pool2d(x, 2, 2))
    np.testing.assert_array_equal(avg_pool2d(x, np.int64(2), None), avg_pool2d(x, 2, 2))


def test_stride_defaults_to_kernel(rng: np.random.Generator) -> None:
    x = random_array(rng, (2, 3, 9, 7), F32)
    case = TorchCase((2, 3, 9, 7), (3, 2))
    y = avg_pool2d(x, (3, 2))
    assert y.shape == (2, 3, 3, 3)
    assert_close(y, case.oracle_forward(x), F32)
