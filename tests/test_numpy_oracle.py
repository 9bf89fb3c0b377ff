"""avg_pool2d against the float64 NumPy loop oracle: many configurations, all dtypes."""

from __future__ import annotations

import functools

import jax
import numpy as np
import oracle
import pytest
from cases import (
    DTYPES,
    EDGE_TORCH_CASES,
    RANDOM_TORCH_CASES,
    TORCH_CASES,
    TorchCase,
    assert_close,
    case_ids,
    dtype_mode,
    dtype_name,
    random_array,
)

from jax_avgpool import avg_pool2d

# --------------------------------------------------------------------------
# The oracle itself, on values worked out by hand.


def test_oracle_hand_computed_values() -> None:
    """3x3 input, 2x2 kernel, stride 1, pad 1 under the three divisor rules."""
    x = np.arange(1.0, 10.0).reshape(3, 3)
    # Windows of the padded 5x5 image; their sums, real counts:
    sums = np.array([[1, 3, 5, 3], [5, 12, 16, 9], [11, 24, 28, 15], [7, 15, 17, 9]], float)
    counts = np.array([[1, 2, 2, 1], [2, 4, 4, 2], [2, 4, 4, 2], [1, 2, 2, 1]], float)
    pads = ((1, 1), (1, 1))
    np.testing.assert_array_equal(oracle.np_pool(x, (2, 2), (1, 1), pads), sums / 4)
    np.testing.assert_array_equal(
        oracle.np_pool(x, (2, 2), (1, 1), pads, divisor="real"), sums / counts
    )
    np.testing.assert_array_equal(oracle.np_pool(x, (2, 2), (1, 1), pads, divisor=-2), sums / -2)


def test_oracle_ceil_mode_rules() -> None:
    """ceil_mode: an extra window (padded count clipped); one starting in padding is dropped."""
    # n=4, k=3, s=2, p=1: 3 windows, the last [3, 6) clipped to [3, 5): padded count 2.
    assert oracle.windows(4, 3, 2, 1, 1, True) == [(0, 2, 3), (1, 4, 3), (3, 4, 2)]
    assert oracle.windows(4, 3, 2, 1, 1, False) == [(0, 2, 3), (1, 4, 3)]
    # n=5, k=2, s=2, p=1: ceil(5/2)+1 = 4, but window 3 would start at 5 = n + p: dropped.
    assert oracle.out_size(5, 2, 2, 1, 1, True) == 3
    assert oracle.out_size(5, 2, 2, 1, 1, False) == 3
    assert oracle.out_size(6, 2, 2, 1, 1, True) == 4
    assert oracle.out_size(2, 3, 1, 0, 0, False) == 0


def test_oracle_vjp_is_transpose_of_forward() -> None:
    """<np_pool(x), g> == <x, np_pool_vjp(g)> for the oracle itself."""
    rng = np.random.default_rng(0)
    for case in EDGE_TORCH_CASES[:10]:
        x, g = rng.standard_normal(case.nchw), rng.standard_normal(case.out_nchw)
        y = oracle.np_pool(x, case.kernel, case.strides, case.pads, case.ceil_mode, case.divisor)
        dx = oracle.np_pool_vjp(
            g, case.nchw[-2:], case.kernel, case.strides, case.pads, case.ceil_mode, case.divisor
        )
        np.testing.assert_allclose(np.vdot(y, g), np.vdot(x, dx), rtol=1e-12)


def test_generated_cases_cover_the_rules() -> None:
    """The random configurations exercise every rule the tests claim to cover."""
    cases = RANDOM_TORCH_CASES

    def dropped(c: TorchCase) -> bool:
        return any(
            oracle.out_size(n, k, s, p, p, True) < -(-(n + 2 * p - k) // s) + 1
            for n, k, s, (p, _) in zip(c.nchw[-2:], c.kernel, c.strides, c.pads, strict=True)
        )

    def ceil_extra(c: TorchCase) -> bool:
        return (
            c.ceil_mode and c.out_hw != TorchCase(c.nchw, c.kernel_size, c.stride, c.padding).out_hw
        )

    checks = {
        "ceil_mode drop": any(c.ceil_mode and dropped(c) for c in cases),
        "ceil_mode extra window": any(ceil_extra(c) for c in cases),
        "padding, count real": any(
            max(c.pads[0][0], c.pads[1][0]) > 0 and c.divisor == "real" for c in cases
        ),
        "padding, count padded": any(
            max(c.pads[0][0], c.pads[1][0]) > 0 and c.divisor == "padded" for c in cases
        ),
        "negative override": any(isinstance(c.divisor, int) and c.divisor < 0 for c in cases),
        "positive override": any(isinstance(c.divisor, int) and c.divisor > 0 for c in cases),
        "stride None": any(c.stride is None for c in cases),
        "stride > kernel": any(
            s > k for c in cases for s, k in zip(c.strides, c.kernel, strict=True)
        ),
        "non-square kernel": any(c.kernel[0] != c.kernel[1] for c in cases),
        "non-square input": any(c.nchw[-2] != c.nchw[-1] for c in cases),
        "unbatched": any(len(c.nchw) == 3 for c in cases),
        "NHWC": any(c.layout == "NHWC" for c in cases),
        "NCHW": any(c.layout == "NCHW" for c in cases),
        "kernel 5": any(5 in c.kernel for c in cases),
        "stride 4": any(4 in c.strides for c in cases),
        "size 1": any(1 in c.nchw[-2:] for c in cases),
        "size 17": any(17 in c.nchw[-2:] for c in cases),
    }
    assert all(checks.values()), [name for name, ok in checks.items() if not ok]


# --------------------------------------------------------------------------
# The package against the oracle.


def _forward_and_gradients(case: TorchCase, x: np.ndarray, g: np.ndarray):
    """y, and the vjp of g by the gather and the scatter strategy, in one jit."""

    def run(x, g):
        y, pull_gather = jax.vjp(functools.partial(avg_pool2d, **case.kwargs("gather")), x)
        _, pull_scatter = jax.vjp(functools.partial(avg_pool2d, **case.kwargs("scatter")), x)
        return y, pull_gather(g)[0], pull_scatter(g)[0]

    return jax.jit(run)(x, g)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("case", TORCH_CASES, ids=case_ids(TORCH_CASES))
def test_forward_and_backward_match_oracle(
    case: TorchCase, dtype: np.dtype, rng: np.random.Generator
) -> None:
    """Output and both gradient strategies equal the oracle, in the input dtype."""
    x = random_array(rng, case.shape, dtype)
    g = random_array(rng, case.out_shape, dtype)
    with dtype_mode(dtype):
        y, dx_gather, dx_scatter = _forward_and_gradients(case, x, g)
    for name, value in (("y", y), ("dx_gather", dx_gather), ("dx_scatter", dx_scatter)):
        assert value.dtype == dtype, name
    assert y.shape == case.out_shape
    assert_close(y, case.oracle_forward(x), dtype, "forward")
    expected = case.oracle_vjp(g)
    assert_close(dx_gather, expected, dtype, "gather gradient")
    assert_close(dx_scatter, expected, dtype, "scatter gradient")
