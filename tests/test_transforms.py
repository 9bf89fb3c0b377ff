"""Every JAX transformation of avg_pool2d / avg_pool, checked against the NumPy oracle.

Runs in float64 (the ``x64`` fixture) so that comparisons can be tight.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from cases import F64, FlaxCase, TorchCase, assert_close, random_array
from jax.test_util import check_grads

from jax_avgpool import avg_pool, avg_pool2d

pytestmark = pytest.mark.usefixtures("x64")

CASES = (
    TorchCase((2, 3, 7, 6), 3, 2, 1, ceil_mode=True, count_include_pad=False),
    TorchCase((2, 3, 7, 6), 3, 2, 1, ceil_mode=True, count_include_pad=False, layout="NHWC"),
    TorchCase((1, 2, 5, 6), (2, 3), (1, 2), (1, 0), divisor_override=-3),
    TorchCase((2, 4, 5), 2, 1, 1, layout="NHWC"),  # unbatched (H, W, C)
)
BACKWARDS = ("gather", "scatter")


def pool_fn(case: TorchCase, backward: str) -> Callable[[jax.Array], jax.Array]:
    return functools.partial(avg_pool2d, **case.kwargs(backward))


@pytest.fixture(params=CASES, ids=str)
def case(request: pytest.FixtureRequest) -> TorchCase:
    return request.param


@pytest.fixture(params=BACKWARDS)
def backward(request: pytest.FixtureRequest) -> str:
    return request.param


def _inputs(case: TorchCase, rng: np.random.Generator):
    x = jnp.asarray(random_array(rng, case.shape, F64))
    t = jnp.asarray(random_array(rng, case.shape, F64))
    g = jnp.asarray(random_array(rng, case.out_shape, F64))
    return x, t, g


# --------------------------------------------------------------------------
# jit, grad, jvp, linearize, vjp, linear_transpose.


def test_jit(case: TorchCase, backward: str, rng: np.random.Generator) -> None:
    """jit gives the eager result bitwise, and both equal the oracle."""
    f = pool_fn(case, backward)
    x, _, _ = _inputs(case, rng)
    y_jit, y_eager = jax.jit(f)(x), f(x)
    np.testing.assert_array_equal(y_jit, y_eager)
    assert_close(y_jit, case.oracle_forward(x), F64)


def test_grad(case: TorchCase, backward: str, rng: np.random.Generator) -> None:
    """grad of <pool(x), g> is the oracle's vjp, eager and under jit."""
    f = pool_fn(case, backward)
    x, _, g = _inputs(case, rng)

    def loss(x):
        return jnp.vdot(f(x), g)

    expected = case.oracle_vjp(g)
    assert_close(jax.grad(loss)(x), expected, F64)
    assert_close(jax.jit(jax.grad(loss))(x), expected, F64)


def test_jvp(case: TorchCase, backward: str, rng: np.random.Generator) -> None:
    """jvp(f)(x, t) = (f(x), f(t)) (f is linear) and matches central differences."""
    f = pool_fn(case, backward)
    x, t, _ = _inputs(case, rng)
    y, y_dot = jax.jvp(f, (x,), (t,))
    assert_close(y, case.oracle_forward(x), F64)
    assert_close(y_dot, case.oracle_forward(t), F64)
    h = 1e-3
    finite_difference = (f(x + h * t) - f(x - h * t)) / (2 * h)
    np.testing.assert_allclose(y_dot, finite_difference, rtol=1e-8, atol=1e-8)


def test_linearize_and_linear_transpose(
    case: TorchCase, backward: str, rng: np.random.Generator
) -> None:
    """linearize's function is the pooling; its linear_transpose is the oracle's vjp."""
    f = pool_fn(case, backward)
    x, t, g = _inputs(case, rng)
    y, f_lin = jax.linearize(f, x)
    assert_close(y, case.oracle_forward(x), F64)
    assert_close(f_lin(t), case.oracle_forward(t), F64)
    (dx,) = jax.linear_transpose(f_lin, x)(g)
    assert_close(dx, case.oracle_vjp(g), F64)
    (dx,) = jax.linear_transpose(f, x)(g)
    assert_close(dx, case.oracle_vjp(g), F64)


def test_vjp(case: TorchCase, backward: str, rng: np.random.Generator) -> None:
    """vjp's pullback, eager and jitted, is the oracle's."""
    f = pool_fn(case, backward)
    x, _, g = _inputs(case, rng)
    y, pullback = jax.vjp(f, x)
    assert_close(y, case.oracle_forward(x), F64)
    assert_close(pullback(g)[0], case.oracle_vjp(g), F64)
    assert_close(jax.jit(pullback)(g)[0], case.oracle_vjp(g), F64)


def test_grad_of_grad_through_transpose(
    case: TorchCase, backward: str, rng: np.random.Generator
) -> None:
    """Differentiating the gradient (pool_transpose) w.r.t. the cotangent gives pool again."""
    f = pool_fn(case, backward)
    x, t, g = _inputs(case, rng)

    def vjp_dot_t(g):  # <vjp(g), t> = <g, pool(t)>  =>  gradient w.r.t. g is pool(t)
        return jnp.vdot(jax.vjp(f, x)[1](g)[0], t)

    assert_close(jax.grad(vjp_dot_t)(g), case.oracle_forward(t), F64)


# --------------------------------------------------------------------------
# Jacobians, Hessians, check_grads.

SMALL = (
    TorchCase((1, 2, 5, 4), 3, 2, 1, ceil_mode=True, count_include_pad=False),
    TorchCase((2, 4, 3, 1), (2, 3), 1, (1, 1), layout="NHWC", divisor_override=-2),
)


@pytest.mark.parametrize("small", SMALL, ids=str)
def test_jacfwd_jacrev(small: TorchCase, backward: str, rng: np.random.Generator) -> None:
    """Both Jacobians equal the oracle's Jacobian."""
    f = pool_fn(small, backward)
    x = jnp.asarray(random_array(rng, small.shape, F64))
    nchw_jac = oracle.np_jacobian(
        small.nchw, small.kernel, small.strides, small.pads, small.ceil_mode, small.divisor
    )
    expected = _jacobian_in_layout(small, nchw_jac)
    assert_close(jax.jacfwd(f)(x), expected, F64)
    assert_close(jax.jacrev(f)(x), expected, F64)


def _jacobian_in_layout(case: TorchCase, jac: np.ndarray) -> np.ndarray:
    """An NCHW Jacobian (out_nchw + in_nchw) permuted to the case's layout."""
    if case.layout == "NCHW":
        return jac
    r = len(case.nchw)
    jac = np.moveaxis(jac, r - 3, r - 1)  # output C to the end of the output dims
    return np.moveaxis(jac, 2 * r - 3, 2 * r - 1)


NONLINEAR = {
    "sum_sin": (lambda y: jnp.sum(jnp.sin(y)), lambda y: -np.sin(y)),
    "sum_cube": (lambda y: jnp.sum(y**3), lambda y: 6 * y),
}


@pytest.mark.parametrize("loss", NONLINEAR, ids=str)
@pytest.mark.parametrize("small", SMALL, ids=str)
def test_hessian(small: TorchCase, loss: str, backward: str, rng: np.random.Generator) -> None:
    """hessian(sum(phi(pool(x)))) = J^T diag(phi''(y)) J with the oracle's J."""
    f = pool_fn(small, backward)
    phi, phi2 = NONLINEAR[loss]
    x = jnp.asarray(random_array(rng, small.shape, F64))
    jac = _jacobian_in_layout(
        small,
        oracle.np_jacobian(
            small.nchw, small.kernel, small.strides, small.pads, small.ceil_mode, small.divisor
        ),
    )
    j = jac.reshape(-1, x.size)
    y = small.oracle_forward(np.asarray(x)).reshape(-1)
    expected = j.T @ (phi2(y)[:, None] * j)
    hess = jax.hessian(lambda v: phi(f(v)))(x)
    assert_close(np.asarray(hess).reshape(x.size, x.size), expected, F64)
    assert_close(
        jax.jit(jax.hessian(lambda v: phi(f(v))))(x).reshape(x.size, x.size), expected, F64
    )


def test_check_grads(case: TorchCase, backward: str, rng: np.random.Generator) -> None:
    """jax.test_util.check_grads to second order, forward and reverse, plain and composed."""
    f = pool_fn(case, backward)
    x = jnp.asarray(random_array(rng, case.shape, F64))
    check_grads(f, (x,), order=2, modes=("fwd", "rev"))
    check_grads(lambda v: jnp.sin(f(v)) * f(v * v), (x,), order=2, modes=("fwd", "rev"))


def test_check_grads_flax_path(rng: np.random.Generator) -> None:
    """avg_pool with asymmetric padding, count_include_pad=False, to second order."""
    x = jnp.asarray(random_array(rng, (2, 6, 5, 3), F64))
    f = functools.partial(avg_pool, window_shape=(3, 2), strides=(2, 1), padding=((2, 0), (0, 1)))
    check_grads(lambda v: jnp.tanh(f(v)), (x,), order=2, modes=("fwd", "rev"))
    g = functools.partial(f, count_include_pad=False)
    check_grads(lambda v: g(v) ** 2, (x,), order=2, modes=("fwd", "rev"))


# --------------------------------------------------------------------------
# vmap.

VMAP_CASES = (
    TorchCase((2, 3, 7, 6), 3, 2, 1, ceil_mode=True, count_include_pad=False),
    TorchCase((2, 3, 7, 6), (2, 3), (2, 1), (1, 0), divisor_override=5, layout="NHWC"),
)


def _mapped(x: np.ndarray, axis: int) -> np.ndarray:
    """Place the leading (mapped) axis of ``x`` at ``axis``."""
    return np.moveaxis(x, 0, axis)


def _no_loops(jaxpr: str) -> None:
    for loop in ("while", "scan", "fori"):
        assert loop not in jaxpr, jaxpr


@pytest.mark.parametrize("out_axes", [0, 1, -1])
@pytest.mark.parametrize("in_axes", [0, 1, 2, 3, 4, -1, -2])
@pytest.mark.parametrize("vcase", VMAP_CASES, ids=str)
def test_vmap_axes(
    vcase: TorchCase, in_axes: int, out_axes: int, backward: str, rng: np.random.Generator
) -> None:
    """vmap over any axis of a 5-D input (also between the pooled axes), any out_axes."""
    f = pool_fn(vcase, backward)
    stacked = random_array(rng, (3, *vcase.shape), F64)  # mapped axis first
    xs = jnp.asarray(_mapped(stacked, in_axes))
    ys = jax.vmap(f, in_axes=in_axes, out_axes=out_axes)(xs)
    expected = np.moveaxis(vcase.oracle_forward(stacked), 0, out_axes)
    assert_close(ys, expected, F64)
    # One pooling op, no loop, in the batched program.
    jaxpr = str(jax.make_jaxpr(jax.vmap(f, in_axes=in_axes, out_axes=out_axes))(xs))
    _no_loops(jaxpr)
    assert jaxpr.count("jax_avgpool_pool") == 1, jaxpr


@pytest.mark.parametrize("in_axes", [0, 2, -1])
@pytest.mark.parametrize("vcase", VMAP_CASES, ids=str)
def test_vmap_of_grad(
    vcase: TorchCase, in_axes: int, backward: str, rng: np.random.Generator
) -> None:
    """vmap(grad) over a (possibly pooled-position) axis: per-example oracle vjps."""
    f = pool_fn(vcase, backward)
    xs_first = random_array(rng, (3, *vcase.shape), F64)
    gs_first = random_array(rng, (3, *vcase.out_shape), F64)

    def loss(x, g):
        return jnp.vdot(f(x), g)

    batched = jax.vmap(jax.grad(loss), in_axes=(in_axes, in_axes), out_axes=in_axes)
    args = (jnp.asarray(_mapped(xs_first, in_axes)), jnp.asarray(_mapped(gs_first, in_axes)))
    dxs = batched(*args)
    expected = np.stack([vcase.oracle_vjp(g) for g in gs_first])
    assert_close(dxs, _mapped(expected, in_axes), F64)
    jaxpr = str(jax.make_jaxpr(batched)(*args))
    _no_loops(jaxpr)
    assert "jax_avgpool_pool_transpose" in jaxpr


@pytest.mark.parametrize("in_axes", [0, 2, -1])
@pytest.mark.parametrize("vcase", VMAP_CASES, ids=str)
def test_grad_of_vmap(
    vcase: TorchCase, in_axes: int, backward: str, rng: np.random.Generator
) -> None:
    """grad of a loss over vmap(pool): the oracle's vjp slice by slice."""
    f = pool_fn(vcase, backward)
    xs_first = random_array(rng, (3, *vcase.shape), F64)
    gs_first = random_array(rng, (3, *vcase.out_shape), F64)
    gs = jnp.asarray(gs_first)

    def loss(xs):
        return jnp.vdot(jax.vmap(f, in_axes=in_axes)(xs), gs)

    dxs = jax.grad(loss)(jnp.asarray(_mapped(xs_first, in_axes)))
    expected = np.stack([vcase.oracle_vjp(g) for g in gs_first])
    assert_close(dxs, _mapped(expected, in_axes), F64)


@pytest.mark.parametrize("vcase", VMAP_CASES, ids=str)
def test_nested_vmap(vcase: TorchCase, backward: str, rng: np.random.Generator) -> None:
    """vmap(vmap(f, in_axes=2), in_axes=-1): two extra axes, neither leading."""
    f = pool_fn(vcase, backward)
    first = random_array(rng, (2, 3, *vcase.shape), F64)  # outer, inner, example
    # inner mapped axis at position 2 of the 5-D inner input, outer axis last.
    xs = np.moveaxis(np.moveaxis(first, 1, 3), 0, -1)
    nested = jax.vmap(jax.vmap(f, in_axes=2, out_axes=1), in_axes=-1, out_axes=0)
    ys = nested(jnp.asarray(xs))
    expected = vcase.oracle_forward(first)  # (outer, inner, *out)
    assert_close(ys, np.moveaxis(expected, 1, 2), F64)
    _no_loops(str(jax.make_jaxpr(nested)(jnp.asarray(xs))))


@pytest.mark.parametrize("in_axes", [0, 1, 2, 3])
def test_vmap_unbatched_and_flax(in_axes: int, rng: np.random.Generator) -> None:
    """vmap over 3-D (C, H, W) avg_pool2d and 3-D (H, W, C) avg_pool inputs."""
    chw = TorchCase((3, 7, 6), 3, 2, 1, ceil_mode=True)
    stacked = random_array(rng, (2, *chw.shape), F64)
    ys = jax.vmap(pool_fn(chw, "gather"), in_axes=in_axes)(jnp.asarray(_mapped(stacked, in_axes)))
    assert_close(ys, chw.oracle_forward(stacked), F64)

    hwc = FlaxCase((7, 6, 3), (3, 2), (2, 1), ((1, 2), (0, 1)), count_include_pad=False)
    stacked = random_array(rng, (2, *hwc.shape), F64)
    f = functools.partial(avg_pool, **hwc.kwargs())
    ys = jax.vmap(f, in_axes=in_axes)(jnp.asarray(_mapped(stacked, in_axes)))
    assert_close(ys, hwc.oracle_forward(stacked), F64)


def test_jitted_program_calls_the_ffi_kernels(rng: np.random.Generator) -> None:
    """The lowered forward and gradient are the package's custom calls, not reduce_window."""
    from jax_avgpool import _ffi

    x = jnp.asarray(random_array(rng, (2, 3, 7, 6), F64))
    for backward, strategy in (("gather", 0), ("scatter", 1)):
        f = functools.partial(avg_pool2d, kernel_size=3, stride=2, backward=backward)
        hlo = jax.jit(jax.grad(lambda v, f=f: jnp.sum(jnp.sin(f(v))))).lower(x).as_text()
        assert _ffi.FORWARD_TARGET in hlo and _ffi.BACKWARD_TARGET in hlo
        assert "reduce_window" not in hlo
        assert f"strategy = {strategy}" in hlo, hlo
