"""The oracle comparisons on a GPU; skipped when JAX sees no GPU."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import (
    BF16,
    DTYPES,
    F32,
    F64,
    FLAX_CASES,
    LOW_PRECISION,
    TORCH_CASES,
    FlaxCase,
    TorchCase,
    assert_close,
    dtype_mode,
    dtype_name,
    random_array,
)
from jax.test_util import check_grads

from jax_avgpool import avg_pool, avg_pool2d, build_info, plan

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpu() -> jax.Device:
    devices = cases.gpu_devices()
    if not devices:  # pragma: no cover - the marker already skips
        pytest.skip("no GPU visible to JAX")
    return devices[0]


def _on(device: jax.Device, *arrays: np.ndarray) -> list[jax.Array]:
    return [jax.device_put(a, device) for a in arrays]


def test_cuda_handlers_built() -> None:
    """A GPU is visible, so the package must have been built with its CUDA handlers."""
    info = build_info()
    assert info["cuda"] is True and "cuda" in info["platforms"], info


@functools.cache
def _forward_and_gradients_of(case: TorchCase):
    """Jitted ``(x, g) -> (y, gather dx, scatter dx)`` for ``case``."""

    def run(x, g):
        y, pull_gather = jax.vjp(functools.partial(avg_pool2d, **case.kwargs("gather")), x)
        _, pull_scatter = jax.vjp(functools.partial(avg_pool2d, **case.kwargs("scatter")), x)
        return y, pull_gather(g)[0], pull_scatter(g)[0]

    return jax.jit(run)


def _forward_and_gradients(case: TorchCase, x: jax.Array, g: jax.Array) -> tuple:
    """The forward and the gather and scatter gradients for cotangent g."""
    return _forward_and_gradients_of(case)(x, g)


def _assert_non_finite_as_on_cpu(
    case: TorchCase, x: np.ndarray, g: np.ndarray, dtype: np.dtype, gpu: jax.Device
) -> None:
    """The forward and both gradients of x and g, which hold infinities and
    NaNs, equal the CPU's: the same NaNs and infinities, the finite values
    close."""
    cpu = jax.devices("cpu")[0]
    with dtype_mode(dtype):
        on_gpu = _forward_and_gradients(case, *_on(gpu, x, g))
        on_cpu = _forward_and_gradients(case, *_on(cpu, x, g))
    whats = ("forward", "gather gradient", "scatter gradient")
    for what, got, want in zip(whats, on_gpu, on_cpu, strict=True):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.isinf(want).any() and np.isnan(want).any(), what
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=what)
        np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg=what)
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=what)
        assert_close(got, want, dtype, what)


GPU_TORCH_PARAMS = [
    pytest.param(case, DTYPES[i % 4], id=f"{i}-{case}-{dtype_name(DTYPES[i % 4])}")
    for i, case in enumerate(TORCH_CASES[::3])
]


@pytest.mark.parametrize(("case", "dtype"), GPU_TORCH_PARAMS)
def test_avg_pool2d_on_gpu_matches_oracle(
    case: TorchCase, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """Forward and both gradient strategies, computed on the GPU, equal the oracle."""
    x, g = random_array(rng, case.shape, dtype), random_array(rng, case.out_shape, dtype)

    with dtype_mode(dtype):
        y, dx_gather, dx_scatter = _forward_and_gradients(case, *_on(gpu, x, g))
    assert y.devices() == {gpu} and dx_gather.devices() == {gpu}
    assert y.dtype == dx_gather.dtype == dx_scatter.dtype == dtype
    assert_close(y, case.oracle_forward(x), dtype, "forward")
    assert_close(dx_gather, case.oracle_vjp(g), dtype, "gather gradient")
    assert_close(dx_scatter, case.oracle_vjp(g), dtype, "scatter gradient")


@pytest.mark.parametrize("case", FLAX_CASES[::4], ids=str)
def test_avg_pool_on_gpu_matches_oracle(
    case: FlaxCase, gpu: jax.Device, rng: np.random.Generator
) -> None:
    x = random_array(rng, case.shape, F32)
    (xd,) = _on(gpu, x)
    y, pullback = jax.vjp(functools.partial(avg_pool, **case.kwargs()), xd)
    g = random_array(rng, y.shape, F32)
    assert y.devices() == {gpu}
    assert_close(y, case.oracle_forward(x), F32, "forward")
    assert_close(pullback(jax.device_put(g, gpu))[0], case.oracle_vjp(g), F32, "gradient")


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_gather_gradient_bitwise_deterministic_on_gpu(
    layout: str, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """Gather gradients are bitwise identical across runs; scatter agrees within tolerance."""
    case = TorchCase(
        (8, 16, 33, 31), 5, 2, 2, ceil_mode=True, count_include_pad=False, layout=layout
    )
    x, g = random_array(rng, case.shape, dtype), random_array(rng, case.out_shape, dtype)
    with dtype_mode(dtype):
        xd, gd = _on(gpu, x, g)
        grads = {}
        for backward in ("gather", "scatter"):
            f = functools.partial(avg_pool2d, **case.kwargs(backward))
            grad = jax.jit(lambda v, f=f: jax.vjp(f, v)[1](gd)[0])
            grads[backward] = [np.asarray(grad(xd)) for _ in range(5)]
    for other in grads["gather"][1:]:
        np.testing.assert_array_equal(grads["gather"][0], other)
    assert_close(grads["gather"][0], case.oracle_vjp(g), dtype, "gather")
    for run in grads["scatter"]:
        assert_close(run, grads["gather"][0], dtype, "scatter vs gather")


def test_nan_propagation_on_gpu_matches_cpu(gpu: jax.Device, rng: np.random.Generator) -> None:
    case = TorchCase((2, 3, 9, 8), 3, 2, 1, ceil_mode=True)
    x = random_array(rng, case.shape, F32)
    x[0, 1, 4, 4], x[1, 2, 0, 7], x[1, 0, 8, 0] = np.nan, np.inf, -np.inf
    f = functools.partial(avg_pool2d, **case.kwargs())
    y_gpu = np.asarray(f(jax.device_put(x, gpu)))
    y_cpu = np.asarray(f(jax.device_put(x, jax.devices("cpu")[0])))
    np.testing.assert_array_equal(np.isnan(y_gpu), np.isnan(y_cpu))
    np.testing.assert_allclose(y_gpu, y_cpu, rtol=1e-6, atol=1e-6)


@pytest.mark.usefixtures("x64")
def test_vmap_and_check_grads_on_gpu(gpu: jax.Device, rng: np.random.Generator) -> None:
    case = TorchCase((2, 3, 7, 6), 3, 2, 1, ceil_mode=True, count_include_pad=False)
    f = functools.partial(avg_pool2d, **case.kwargs())
    stacked = random_array(rng, (3, *case.shape), F64)
    xs = jax.device_put(jnp.asarray(np.moveaxis(stacked, 0, 2)), gpu)
    assert_close(jax.vmap(f, in_axes=2)(xs), case.oracle_forward(stacked), F64)
    check_grads(f, (xs[:, :, 0],), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize(
    ("shape", "layout", "workspace"),
    [
        ((2, 3, 12, 16), "NCHW", False),  # rows of whole runs of four
        ((2, 3, 12, 13), "NCHW", True),  # ragged rows
        ((2, 8, 12, 12), "NHWC", False),  # channels in runs of four
        ((2, 6, 12, 12), "NHWC", True),  # ragged channels
    ],
)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_name)
def test_16bit_scatter_gets_a_workspace_only_where_it_needs_one(
    shape: tuple,
    layout: str,
    workspace: bool,
    dtype: np.dtype,
    gpu: jax.Device,
    rng: np.random.Generator,
) -> None:
    """The lowering gives the CUDA 16-bit scatter its float32 workspace (a second
    result) only where its tiles cannot add to dx itself with 16-bit atomics on
    aligned runs of four (shapes in NCHW order); the gradient matches the oracle
    either way."""
    case = TorchCase(shape, 3, 2, 1, layout=layout)
    x, g = random_array(rng, case.shape, dtype), random_array(rng, case.out_shape, dtype)
    xs, gs = _on(gpu, x, g)

    def pull(x, g):
        return jax.vjp(functools.partial(avg_pool2d, **case.kwargs("scatter")), x)[1](g)[0]

    text = jax.jit(pull).lower(xs, gs).as_text()
    calls = [line for line in text.splitlines() if "@jax_avgpool_backward" in line]
    assert len(calls) == 1, text
    assert ("xf32>" in calls[0]) == workspace, calls[0]
    with dtype_mode(dtype):
        assert_close(jax.jit(pull)(xs, gs), case.oracle_vjp(g), dtype, "scatter gradient")


def _param(case: TorchCase, dtype: np.dtype) -> object:
    """A (case, dtype) parameter, named after both."""
    return pytest.param(case, dtype, id=f"{case}-{dtype_name(dtype)}")


def _every_dtype(calls: Iterable[TorchCase]) -> list:
    """Each call in every dtype, dtype by dtype."""
    calls = tuple(calls)
    return [_param(case, dtype) for dtype in DTYPES for case in calls]


def _specialised_cases() -> list:
    """Every specialised window at every left padding up to k // 2, under each
    divisor rule (shapes in NCHW order). NCHW: rows wide enough to span several
    warps of 16-byte chunks and short enough to leave ragged row blocks. NHWC:
    heights and widths that leave ragged blocks of rows and columns, with
    channels that fill 16-byte vectors and channels that do not, and images
    more than 32 rows high, which the stride-1 kernels cover in several
    segments of rows, and rows wide enough that the 7x7/1 box filter covers
    them in several strips of columns."""
    shapes = {
        "NCHW": (
            ((2, 3, 13, 8 * 37), {}),
            ((3, 2, 11, 16), {"ceil_mode": True, "count_include_pad": False}),
            ((1, 4, 9, 24), {"divisor_override": 5}),
        ),
        "NHWC": (
            ((2, 24, 13, 19), {}),
            ((3, 16, 11, 10), {"ceil_mode": True, "count_include_pad": False}),
            ((1, 5, 10, 9), {"divisor_override": 5}),
            ((2, 64, 23, 30), {}),
            ((1, 32, 40, 17), {"ceil_mode": True, "count_include_pad": False}),
            ((1, 8, 9, 300), {}),
        ),
    }
    params = []
    for k, s in ((2, 2), (3, 1), (3, 2), (7, 1)):
        for pad in range(k // 2 + 1):
            for layout in ("NCHW", "NHWC"):
                for i, (shape, extra) in enumerate(shapes[layout]):
                    dtype = DTYPES[(k + pad + i) % 4]
                    case = TorchCase(shape, k, s, pad, layout=layout, **extra)
                    params.append(_param(case, dtype))
    return params


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_name)
@pytest.mark.parametrize(
    ("shape", "extra"),
    [
        ((2, 3, 14, 48), {}),
        ((1, 5, 6, 8), {"divisor_override": 3}),
        ((3, 2, 10, 16), {"ceil_mode": True, "count_include_pad": False}),
        ((2, 2, 10, 36), {}),
    ],
    ids=str,
)
def test_16bit_nchw_gather_of_tiling_windows_on_gpu(
    shape: tuple, extra: dict, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """16-bit NCHW 2x2/2 gathers whose windows tile the input exactly, on rows of
    whole 16-byte vectors (the flat upsampling kernel; W = 36 leaves the row
    kernels), against the oracle under each divisor rule, bitwise repeatable."""
    case = TorchCase(shape, 2, 2, 0, **extra)
    x, g = random_array(rng, case.shape, dtype), random_array(rng, case.out_shape, dtype)

    with dtype_mode(dtype):
        _, dx, _ = _forward_and_gradients(case, *_on(gpu, x, g))
        again = _forward_and_gradients(case, *_on(gpu, x, g))[1]
    assert_close(dx, case.oracle_vjp(g), dtype, "gather gradient")
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(again))


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_name)
@pytest.mark.parametrize(
    ("shape", "window", "extra"),
    [
        ((3, 5, 56, 56), (3, 2, 0), {}),
        ((2, 7, 12, 48), (3, 2, 0), {"count_include_pad": False}),
        ((1, 9, 15, 16), (3, 2, 0), {"divisor_override": 7}),
        ((2, 3, 21, 64), (3, 2, 1), {"ceil_mode": True}),
        ((2, 3, 21, 64), (3, 2, 1), {"ceil_mode": True, "count_include_pad": False}),
        ((5, 3, 9, 32), (2, 2, 1), {}),
        ((2, 5, 3, 56), (3, 2, 0), {}),
        ((1, 3, 7, 2000), (3, 2, 0), {}),
        ((2, 5, 56, 56), (3, 2, (1, 0)), {}),
        ((1, 4, 13, 16), (3, 2, 1), {"ceil_mode": True, "divisor_override": 5}),
        ((1, 3, 12, 24), (3, 2, (0, 1)), {"ceil_mode": True, "divisor_override": 4}),
        ((16, 1024, 16, 16), (3, 2, 0), {}),
        ((64, 64, 56, 56), (3, 2, 0), {}),
        ((4, 6, 28, 28), (3, 2, 0), {}),
        ((1, 2, 9, 12), (3, 2, 0), {"count_include_pad": False}),
        ((2, 3, 20, 20), (3, 2, 1), {"ceil_mode": True, "divisor_override": 3}),
        ((120, 64, 28, 28), (3, 2, 0), {}),
    ],
    ids=str,
)
def test_16bit_nchw_stride2_forward_of_odd_rows_on_gpu(
    shape: tuple,
    window: tuple,
    extra: dict,
    dtype: np.dtype,
    gpu: jax.Device,
    rng: np.random.Generator,
) -> None:
    """16-bit NCHW stride-2 forwards whose output rows have odd length. 3x3
    windows over rows of whole 8-byte pieces go to the kernel of whole planes
    in shared memory: rows of 16-byte pieces and of 8 but not 16, groups of
    planes whose outputs start at every alignment, partial last groups, blocks
    that take several groups, padding at the top, left or both, windows past
    the last column under ceil_mode. The others go to the row kernel, which
    stores their outputs one by one: planes and row blocks that straddle warps
    and thread blocks, ragged last row blocks. Rows of one output and of 999,
    every divisor rule, against the oracle, every element checked."""
    case = TorchCase(shape, *window, **extra)
    assert case.out_shape[-1] % 2 == 1
    x = random_array(rng, case.shape, dtype)

    with dtype_mode(dtype):
        y = avg_pool2d(_on(gpu, x)[0], *window, **extra)
    assert_close(y, case.oracle_forward(x), dtype, "forward")
    k = window[0]
    assert f"__{k}__{k}__2__2__" in plan(x, *window, layout="NCHW", **extra)["forward"]


def _check_forward_and_gather(
    case: TorchCase, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """Forward and gather against the oracle, the gather bitwise repeatable."""
    x, g = random_array(rng, case.shape, dtype), random_array(rng, case.out_shape, dtype)

    with dtype_mode(dtype):
        y, dx_gather, _ = _forward_and_gradients(case, *_on(gpu, x, g))
        again = _forward_and_gradients(case, *_on(gpu, x, g))[1]
    assert_close(y, case.oracle_forward(x), dtype, "forward")
    assert_close(dx_gather, case.oracle_vjp(g), dtype, "gather gradient")
    np.testing.assert_array_equal(np.asarray(dx_gather), np.asarray(again))


def _plane_cases() -> list:
    """7x7/1 NCHW calls whose planes fit in shared memory (the plane kernel for
    the forward, and for the 16-bit gathers), in every dtype: 28x28 planes at
    each padding and divisor rule, fifteen of them so that the last group of
    planes is partial; odd widths (no aligned pairs of columns); and planes
    whose bytes are not a multiple of 16 (copied in smaller pieces, or by the
    row kernels where a 16-bit plane has an odd number of elements)."""
    params = []
    shapes = ((3, 5, 28, 28), (2, 3, 14, 15), (1, 7, 9, 9))
    for i, dtype in enumerate(DTYPES):
        for pad in range(4):
            for extra in ({}, {"count_include_pad": False}, {"divisor_override": 11}):
                shape = shapes[(i + pad) % 3]
                case = TorchCase(shape, 7, 1, pad, **extra)
                params.append(_param(case, dtype))
    return params


@pytest.mark.parametrize(("case", "dtype"), _plane_cases())
def test_plane_kernel_on_gpu_matches_oracle(
    case: TorchCase, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """Whole planes in shared memory: forward and gather against the oracle, the
    gather bitwise repeatable."""
    _check_forward_and_gather(case, dtype, gpu, rng)


def _plane_fallback_cases() -> list:
    """NCHW calls whose rows the row kernels cannot take (widths not a
    multiple of four), which the plane kernel takes where its groups of
    planes fit, in every dtype, forward and gather alike (the gather also
    in 4- and 8-byte types and where every window shares one divisor):
    3x3/1 over Inception's 35x35 and 17x17 maps, 14x14 and 7x7 planes,
    under each divisor rule and with ceil_mode; 7x7/1 over 31x45 planes,
    whose 16-bit planes hold an odd number of elements (copied in by
    words); counts of planes that leave the last group partial; and enough
    17x17 planes (18000) that each block takes several groups in turn."""
    calls = (
        TorchCase((2, 5, 35, 35), 3, 1, 1),
        TorchCase((24, 750, 17, 17), 3, 1, 1),
        TorchCase((3, 3, 17, 17), 3, 1, 1, count_include_pad=False),
        TorchCase((1, 11, 14, 14), 3, 1, 0),
        TorchCase((2, 7, 7, 7), 3, 1, 1, divisor_override=4),
        TorchCase((1, 9, 35, 35), 3, 1, 1, ceil_mode=True),
        TorchCase((2, 3, 31, 45), 7, 1, 0),
        TorchCase((1, 5, 31, 45), 7, 1, 3, count_include_pad=False),
    )
    return _every_dtype(calls)


@pytest.mark.parametrize(("case", "dtype"), _plane_fallback_cases())
def test_plane_kernel_where_row_kernels_cannot_on_gpu(
    case: TorchCase, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """Forward and gather of calls the row kernels cannot take, against the
    oracle, the gather bitwise repeatable."""
    _check_forward_and_gather(case, dtype, gpu, rng)


@pytest.mark.parametrize(
    "case",
    [TorchCase((2, 9, 17, 17), 3, 1, 1), TorchCase((2, 5, 14, 14), 3, 1, 0)],
    ids=["17x17-pad1", "14x14-pad0"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_plane_one_pass_keeps_infinities_and_nans_in_their_windows(
    case: TorchCase, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """The 3x3/1 one pass reads the elements beside its columns and rows in
    place (the row before or after, the neighbouring plane, the margins of the
    group) and masks them: an infinity or NaN at a plane's first or last row
    or column must reach exactly the outputs whose windows hold it, in the
    forward and both gradients, as on the CPU."""
    x, g = random_array(rng, case.shape, dtype), random_array(rng, case.out_shape, dtype)
    spots = (  # (image, channel, row, column): the edges of the planes
        ((0, 0, 0, -1), np.inf),
        ((0, 1, -1, 0), -np.inf),
        ((0, 2, -1, -1), np.nan),
        ((0, 3, 0, 0), np.inf),
        ((1, 2, 5, -1), -np.inf),
        ((1, 3, 6, 0), np.nan),
        ((1, 4, -1, -1), np.inf),
    )
    for a in (x, g):
        for spot, value in spots:
            a[spot] = value
    _assert_non_finite_as_on_cpu(case, x, g, dtype, gpu)


def _strip_cases() -> list:
    """7x7/1 NCHW calls that the strip kernel takes (planes of at most 32 rows
    and 32 strips of four columns, windows sharing one divisor): 16-bit
    forwards whose output rows are whole strips, 16-bit and float32 gathers
    whose dy columns pair up (the other dtypes and directions go to the other
    kernels). The number of planes is not a multiple of the planes a warp
    takes; plane sizes give copies in pieces of 16, 8 and 4 bytes; one gather
    has 32 strips a plane, one forward 31; 32-row planes; and the calls just
    past its limits (33 rows, 33 strips, unpaired columns, divisors per
    window), which go to the other kernels."""
    calls = (
        ((2, 9, 28, 28), 0, {}),  # gather: 22-wide dy in pairs, 16-bit fixed form
        ((2, 9, 28, 28), 1, {}),  # forward: 24-wide rows
        ((2, 9, 28, 28), 2, {}),  # gather: odd offsets, even rows
        ((2, 9, 28, 28), 3, {}),  # forward and gather: 28-wide rows
        ((2, 9, 28, 28), 3, {"divisor_override": 11}),
        ((2, 9, 28, 28), 3, {"count_include_pad": False}),
        ((1, 37, 14, 14), 0, {}),
        ((2, 5, 13, 14), 0, {}),
        ((3, 5, 20, 130), 0, {}),  # forward: 124 outputs, 31 strips
        ((1, 3, 12, 128), 0, {}),  # gather: 128 inputs, 32 strips
        ((1, 3, 12, 134), 0, {}),  # 33 strips
        ((2, 6, 32, 32), 0, {}),
        ((1, 4, 33, 32), 0, {}),
    )
    return _every_dtype(TorchCase(shape, 7, 1, pad, **extra) for shape, pad, extra in calls)


@pytest.mark.parametrize(("case", "dtype"), _strip_cases())
def test_strip_kernel_on_gpu_matches_oracle(
    case: TorchCase, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """Strips of registers down small planes: forward and gather against the
    oracle, the gather bitwise repeatable."""
    _check_forward_and_gather(case, dtype, gpu, rng)


def _half_strip_cases() -> list:
    """3x3/2 and 2x2/2 NCHW gathers that the stride-2 strip kernel takes (16-bit
    dtypes, and float32 where the row kernels do not: rows not a multiple of
    their chunks; windows sharing one divisor; dx rows of whole 16-byte strips,
    or for 16-bit dtypes of 8-byte ones, at most 16 of them; a dy plane within
    a warp's shared memory): 56x56 planes
    in pairs per warp, unpadded and padded; odd plane heights, whose row pairs
    start on odd rows in every other plane; a dy range ending off a 16-byte
    boundary; 16 strips a row; the largest dy plane that fits; and the calls
    just past its limits (17 strips, a dy plane too large, divisors per window),
    which go to the other kernels. Then 16-bit rows of 8-byte strips (widths a
    multiple of 4, not of 8): 28x28 planes with padding 1, three and fifteen
    strips, 2x2/2, and 17 strips (other kernels). Forwards of the same calls
    take the usual kernels."""
    calls = (
        ((2, 9, 56, 56), 3, 0, {}),
        ((2, 9, 56, 56), 3, 1, {}),
        ((1, 7, 45, 56), 3, 0, {}),
        ((1, 7, 45, 56), 3, 1, {"divisor_override": 5}),
        ((3, 5, 21, 24), 3, 1, {}),
        ((2, 3, 40, 128), 3, 1, {}),  # 16 strips of 16-bit columns
        ((2, 3, 40, 136), 3, 0, {}),  # 17 strips
        ((1, 2, 150, 128), 3, 1, {}),  # 16-bit dy planes of 9600 bytes
        ((1, 2, 200, 128), 3, 1, {}),  # 12800 bytes
        ((2, 5, 30, 28), 3, 1, {"count_include_pad": False}),
        ((2, 5, 41, 24), 2, 1, {}),
        ((2, 5, 30, 28), 2, 0, {}),  # float32: 28 is not a multiple of 8
        ((2, 4, 28, 28), 3, 1, {}),  # 16-bit: 7 strips of 8 bytes
        ((2, 3, 33, 12), 3, 0, {}),
        ((1, 3, 20, 60), 3, 1, {}),  # 15 strips of 8 bytes
        ((2, 3, 22, 20), 2, 0, {}),
        ((1, 2, 16, 68), 3, 1, {}),  # 17 strips of 8 bytes
    )
    return _every_dtype(TorchCase(shape, k, 2, pad, **extra) for shape, k, pad, extra in calls)


@pytest.mark.parametrize(("case", "dtype"), _half_strip_cases())
def test_stride2_strip_kernel_on_gpu_matches_oracle(
    case: TorchCase, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """Strips of registers down small planes for stride-2 gathers: forward and
    gather against the oracle, the gather bitwise repeatable."""
    _check_forward_and_gather(case, dtype, gpu, rng)


@pytest.mark.parametrize(("case", "dtype"), _specialised_cases())
def test_specialised_kernels_on_gpu_match_oracle(
    case: TorchCase, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """The compile-time kernels (row-chunked in NCHW when W allows) against the oracle."""
    x, g = random_array(rng, case.shape, dtype), random_array(rng, case.out_shape, dtype)

    with dtype_mode(dtype):
        y, dx_gather, dx_scatter = _forward_and_gradients(case, *_on(gpu, x, g))
        again = _forward_and_gradients(case, *_on(gpu, x, g))[1]
    assert_close(y, case.oracle_forward(x), dtype, "forward")
    assert_close(dx_gather, case.oracle_vjp(g), dtype, "gather gradient")
    assert_close(dx_scatter, case.oracle_vjp(g), dtype, "scatter gradient")
    np.testing.assert_array_equal(np.asarray(dx_gather), np.asarray(again))


def _generic_gather_cases() -> list:
    """NCHW calls of the generic gather, in every dtype. Windows that do not
    overlap (the flat kernel, 16 bytes of dx a work item, on rows of at
    least 16 bytes): rows of whole windows, rows and columns that no window
    reaches, windows apart with padding, odd rows with ceil_mode, and a
    divisor override. Overlapping 5x5/3 with padding (the direct kernel, a
    row's run of inputs a work item)."""
    calls = (
        TorchCase((2, 3, 24, 64), 4),
        TorchCase((2, 3, 23, 30), 4),
        TorchCase((1, 4, 19, 26), (3, 2), (5, 4), 1, count_include_pad=False),
        TorchCase((2, 5, 30, 37), (4, 3), (4, 5), 1, ceil_mode=True),
        TorchCase((1, 2, 9, 50), (2, 5), (3, 6), (1, 2), divisor_override=3),
        TorchCase((2, 6, 17, 17), 5, 3, 2, count_include_pad=False),
    )
    return _every_dtype(calls)


@pytest.mark.parametrize(("case", "dtype"), _generic_gather_cases())
def test_generic_nchw_gather_on_gpu_matches_oracle(
    case: TorchCase, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """The runtime-parameter NCHW gathers against the oracle and bitwise
    repeatable; the forward too."""
    assert plan(
        jax.ShapeDtypeStruct(case.shape, dtype),
        case.kernel_size,
        case.stride,
        case.padding,
        ceil_mode=case.ceil_mode,
        platform="gpu",
    )["backward"].endswith("__generic")
    _check_forward_and_gather(case, dtype, gpu, rng)


def _global_pool_cases() -> list:
    """Global average pools (one window over each whole plane: the kernels of
    cuda_global.cu), in every dtype (shapes in NCHW order). NCHW planes of up
    to 512 bytes staged 32 to a warp in shared memory: 7x7 (ResNet's, at stride
    7 and at stride 1, a specialised window; float64 ones with fewer warps a
    block), 8x8 (64 elements, whose lanes would share one bank of shared memory
    without their staggered starts) with a partial last warp, 4x4 (16-byte and
    smaller planes, also the specialised 2x2/2 over 2x2 planes), 3x5 (planes
    that straddle 16-byte pieces), 14x14 in 16-bit types; larger planes a warp
    or a block each: 14x14 in float32 and float64, and 56x56 with few planes.
    NHWC: channels in 16-byte vectors or not (6 channels), few images of many
    pixels (many threads an item), a row of 24 pixels. Divisor rules: an
    override, ceil_mode and the real count, which without padding all agree
    with the window's size but the override."""
    calls = (
        TorchCase((3, 40, 7, 7), 7),
        TorchCase((2, 24, 7, 7), 7, 1),
        TorchCase((2, 37, 8, 8), 8, ceil_mode=True),
        TorchCase((4, 33, 4, 4), 4, count_include_pad=False),
        TorchCase((2, 3, 2, 2), 2),
        TorchCase((7, 33, 3, 5), (3, 5), divisor_override=10),
        TorchCase((1, 5, 14, 14), 14),
        TorchCase((2, 3, 56, 56), 56),
        TorchCase((3, 40, 7, 7), 7, layout="NHWC"),
        TorchCase((2, 6, 8, 8), 8, 3, layout="NHWC"),
        TorchCase((2, 64, 56, 56), 56, layout="NHWC", divisor_override=-9),
        TorchCase((5, 24, 1, 24), (1, 24), layout="NHWC"),
    )
    return _every_dtype(calls)


@pytest.mark.parametrize(("case", "dtype"), _global_pool_cases())
def test_global_pools_on_gpu(
    case: TorchCase, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """Forward and gather against the oracle, the gather bitwise repeatable, and
    the scatter, which runs the gather's kernel (the windows do not overlap),
    equal to it bit for bit on every architecture."""
    _check_forward_and_gather(case, dtype, gpu, rng)
    x, g = random_array(rng, case.shape, dtype), random_array(rng, case.out_shape, dtype)
    with dtype_mode(dtype):
        _, dx_gather, dx_scatter = _forward_and_gradients(case, *_on(gpu, x, g))
    np.testing.assert_array_equal(np.asarray(dx_scatter), np.asarray(dx_gather))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_name)
def test_16bit_scatter_of_a_global_pool_needs_no_workspace(
    layout: str, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """The lowering gives the 16-bit scatter of a global pool no float32
    workspace: the gather's kernel writes dx itself. The same planes (7x13,
    six channels: ragged rows and ragged channel vectors) under a window that
    is not global take the scatter tiles' workspace."""
    for case, workspace in (
        (TorchCase((2, 6, 7, 13), (7, 13), layout=layout), False),
        (TorchCase((2, 6, 7, 13), (7, 7), (3, 3), layout=layout), True),
    ):
        x, g = random_array(rng, case.shape, dtype), random_array(rng, case.out_shape, dtype)
        xs, gs = _on(gpu, x, g)

        def pull(x, g, case=case):
            return jax.vjp(functools.partial(avg_pool2d, **case.kwargs("scatter")), x)[1](g)[0]

        text = jax.jit(pull).lower(xs, gs).as_text()
        calls = [line for line in text.splitlines() if "@jax_avgpool_backward" in line]
        assert len(calls) == 1, text
        assert ("xf32>" in calls[0]) == workspace, (case, calls[0])


def _scatter_tile_cases() -> list:
    """Scatters whose shared-memory tiles take the paths that small tensors do
    not (shapes in NCHW order): several planes a tile (from 2048 planes on),
    the last group of planes partial; bands of rows in tall planes; chunks of
    columns in wide rows; NHWC channel slices. Strided windows and float32
    tiles of whole planes prefetch their dx lines into L2 (as one range, one
    per plane, one per row or one per position), the rest do not. The 7x7/1
    calls are ones that the gather's kernels leave to the tiles (an odd left
    padding in NCHW, channels not in fours in NHWC)."""
    configs = (
        ((5, 461, 9, 10), 3, 2, 1, {}),
        ((3, 700, 28, 28), 7, 1, 1, {}),
        ((3, 700, 28, 28), 7, 1, 3, {"count_include_pad": False}),
        ((1, 2, 600, 20), 3, 2, 0, {}),
        ((1, 2, 600, 20), 3, 1, 1, {"divisor_override": 7}),
        ((1, 3, 40, 1000), 2, 2, 0, {"ceil_mode": True}),
        ((2, 96, 14, 15), 3, 2, 1, {"layout": "NHWC"}),
        ((2, 42, 30, 17), 7, 1, 2, {"layout": "NHWC", "count_include_pad": False}),
    )
    params = []
    for i, (shape, k, s, pad, extra) in enumerate(configs):
        for dtype in dict.fromkeys((DTYPES[i % 4], F32)):
            case = TorchCase(shape, k, s, pad, **extra)
            params.append(_param(case, dtype))
    return params


@pytest.mark.parametrize(("case", "dtype"), _scatter_tile_cases())
def test_scatter_tiles_on_gpu_match_oracle(
    case: TorchCase, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """The scatter's tiles, with and without prefetching, against the oracle."""
    x, g = random_array(rng, case.shape, dtype), random_array(rng, case.out_shape, dtype)

    def pull(x, g):
        return jax.vjp(functools.partial(avg_pool2d, **case.kwargs("scatter")), x)[1](g)[0]

    with dtype_mode(dtype):
        dx = jax.jit(pull)(*_on(gpu, x, g))
    assert_close(dx, case.oracle_vjp(g), dtype, "scatter gradient")


def _check_scatter_by_the_gather(
    case: TorchCase, dtype: np.dtype, taken: bool, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """The scatter against the oracle; where a gather kernel adds its results to
    the zeroed dx (``taken``, on sm_90 and later), each dx element gets one
    atomic, onto zero, so dx is the gather's, bitwise."""
    x, g = random_array(rng, case.shape, dtype), random_array(rng, case.out_shape, dtype)
    with dtype_mode(dtype):
        _, dx_gather, dx_scatter = _forward_and_gradients(case, *_on(gpu, x, g))
    assert_close(dx_scatter, case.oracle_vjp(g), dtype, "scatter gradient")
    if taken and float(getattr(gpu, "compute_capability", "0")) >= 9:
        np.testing.assert_array_equal(np.asarray(dx_scatter), np.asarray(dx_gather))


def _adding_gather_cases() -> list:
    """7x7/1 scatters that, on sm_90, the gather's kernels take, adding their
    results to the zeroed dx with atomics (shapes in NCHW order), each with
    whether they do: NCHW planes of the strip kernel (windows sharing a divisor,
    an even left padding, rows of whole 4-column strips, planes of whole
    16-byte pieces), 4 to 2 planes a warp and a partial last warp, at paddings 0
    and 2 and with a divisor override; NHWC float32 (the box filter, every
    padding and divisor rule, ceil_mode); NHWC 16-bit (the tensor-core box
    filter, windows sharing a divisor, channels in 64s; on an H200 the last
    three with enough blocks that its ring rows hold only the source's
    columns, and one of more items than blocks stay resident, each block a
    share of the items' rows); NCHW planes with an odd left padding, which
    the row kernel takes. Then calls left to the tiles: 16-bit planes of
    1512 bytes (float32 ones of 3024 are taken), NHWC 16-bit channels not in
    64s. The NHWC 16-bit calls whose gathers the whole-tile gather takes (48
    to 80 images of 28x28 at paddings 0 and 1, on an H200) are marked not
    taken: their scatters still add the box filter's sums, whose order of
    additions differs from the gather's, so they are held to the oracle
    only."""
    nchw, nhwc, low = "NCHW", "NHWC", LOW_PRECISION
    every = (*LOW_PRECISION, F32)
    calls = (
        ((2, 6, 28, 28), 0, {}, nchw, every, True),
        ((2, 5, 28, 28), 2, {}, nchw, every, True),
        ((3, 3, 32, 32), 2, {"divisor_override": 11}, nchw, every, True),
        ((1, 7, 20, 24), 0, {}, nchw, every, True),
        ((2, 64, 28, 28), 0, {}, nhwc, (F32,), True),
        ((2, 16, 30, 26), 3, {"count_include_pad": False}, nhwc, (F32,), True),
        ((3, 8, 33, 20), 1, {"ceil_mode": True, "divisor_override": 5}, nhwc, (F32,), True),
        ((16, 64, 28, 28), 0, {}, nhwc, low, True),
        ((16, 64, 28, 28), 3, {"divisor_override": 11}, nhwc, low, True),
        ((2, 128, 45, 70), 3, {}, nhwc, low, True),
        ((64, 512, 28, 28), 0, {}, nhwc, low, False),
        ((48, 448, 28, 28), 1, {"divisor_override": 30}, nhwc, low, False),
        ((50, 384, 28, 28), 3, {}, nhwc, low, True),
        ((80, 512, 28, 28), 0, {}, nhwc, low, False),
        ((2, 6, 28, 28), 1, {}, nchw, every, True),
        ((2, 3, 27, 28), 0, {}, nchw, low, False),
        ((2, 3, 27, 28), 0, {}, nchw, (F32,), True),
        ((16, 96, 28, 28), 0, {}, nhwc, low, False),
    )
    return [
        pytest.param(
            TorchCase(shape, 7, 1, pad, layout=layout, **extra),
            dtype,
            taken,
            id=f"{TorchCase(shape, 7, 1, pad, layout=layout, **extra)}-{dtype_name(dtype)}",
        )
        for shape, pad, extra, layout, dtypes, taken in calls
        for dtype in dtypes
    ]


@pytest.mark.parametrize(("case", "dtype", "taken"), _adding_gather_cases())
def test_scatter_by_the_gather_kernels_on_gpu(
    case: TorchCase, dtype: np.dtype, taken: bool, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """The scatter against the oracle; where the gather's kernels take it (on
    sm_90 and later), each dx element gets one atomic, onto zero, so dx is the
    gather's, bitwise."""
    _check_scatter_by_the_gather(case, dtype, taken, gpu, rng)


def _plane_scatter_cases() -> list:
    """3x3/1 NCHW scatters over planes the row kernels cannot take, which on
    sm_90 the plane kernel's gather takes, adding its results to the zeroed dx
    with 16-byte atomics (float16, bfloat16, float32), each with whether it
    does: Inception's 35x35 and 17x17 maps under each divisor rule and with
    ceil_mode; 18000 planes of 17x17 (blocks taking several groups); 14x14
    planes without padding whose last group ends inside a 16-byte piece; 7x7
    planes; 61x61 planes in groups of two, whose groups start inside a 16-byte
    piece of dx (their float32 planes, of which two do not fit, go to the
    tiles)."""
    every = (*LOW_PRECISION, F32)
    calls = (
        ((2, 5, 35, 35), 1, {}, every),
        ((1, 9, 35, 35), 1, {"ceil_mode": True}, every),
        ((3, 3, 17, 17), 1, {"count_include_pad": False}, every),
        ((24, 750, 17, 17), 1, {}, (BF16, F32)),
        ((1, 11, 14, 14), 0, {}, every),
        ((2, 7, 7, 7), 1, {"divisor_override": 4}, every),
        ((1, 5, 61, 61), 1, {}, every),
    )
    return [
        pytest.param(
            TorchCase(shape, 3, 1, pad, **extra),
            dtype,
            not (shape[2] == 61 and dtype == F32),
            id=f"{TorchCase(shape, 3, 1, pad, **extra)}-{dtype_name(dtype)}",
        )
        for shape, pad, extra, dtypes in calls
        for dtype in dtypes
    ]


@pytest.mark.parametrize(("case", "dtype", "taken"), _plane_scatter_cases())
def test_scatter_of_3x3_planes_by_the_gather_kernel_on_gpu(
    case: TorchCase, dtype: np.dtype, taken: bool, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """The scatter against the oracle; where the plane kernel takes it (on sm_90
    and later), each dx element gets one atomic, onto zero, so dx is the
    gather's, bitwise."""
    _check_scatter_by_the_gather(case, dtype, taken, gpu, rng)


def _scatter_params(calls: tuple, **fixed: str) -> list:
    """Parameters ``(case, dtype, taken)`` of ``(shape, kernel, stride, padding,
    extra keywords, dtypes, taken)`` calls, ``fixed`` keywords for every case."""
    params = []
    for shape, k, st, pad, extra, dtypes, taken in calls:
        case = TorchCase(shape, k, st, pad, **fixed, **extra)
        params += [
            pytest.param(case, dtype, taken, id=f"{case}-{dtype_name(dtype)}") for dtype in dtypes
        ]
    return params


def _strided_nhwc_scatter_cases() -> list:
    """NHWC 2x2/2 and 3x3/2 scatters (shapes in NCHW order), each with whether,
    on sm_90, the strided gather kernel takes it, adding its results to the
    zeroed dx with 16-byte atomics: channels that fill 16-byte vectors, under
    each divisor rule, with ceil_mode, odd sizes whose last items cover part
    of a row or column group, and a batch of images that spans many blocks.
    Float64, and channels that do not fill vectors, stay with the tiles."""
    every = (*LOW_PRECISION, F32)
    calls = (
        ((2, 16, 14, 14), 3, 2, 1, {}, every, True),
        ((3, 24, 13, 11), 3, 2, 0, {"ceil_mode": True}, every, True),
        ((2, 8, 15, 17), 3, 2, 1, {"count_include_pad": False}, every, True),
        ((2, 32, 12, 10), 3, 2, 1, {"divisor_override": 5}, every, True),
        ((16, 64, 28, 28), 3, 2, 1, {}, (BF16, F32), True),
        ((3, 24, 13, 11), 2, 2, 0, {}, every, True),
        ((2, 16, 9, 7), 2, 2, 0, {"ceil_mode": True}, every, True),
        ((2, 16, 14, 14), 3, 2, 1, {}, (F64,), False),
        ((2, 12, 14, 14), 3, 2, 1, {}, LOW_PRECISION, False),
    )
    return _scatter_params(calls, layout="NHWC")


@pytest.mark.parametrize(("case", "dtype", "taken"), _strided_nhwc_scatter_cases())
def test_scatter_of_strided_nhwc_windows_by_the_gather_kernel_on_gpu(
    case: TorchCase, dtype: np.dtype, taken: bool, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """The scatter against the oracle; where the strided gather kernel takes it
    (on sm_90 and later), each dx element gets one atomic, onto zero, so dx is
    the gather's, bitwise."""
    _check_scatter_by_the_gather(case, dtype, taken, gpu, rng)


def _row_kernel_scatter_cases() -> list:
    """NCHW scatters of the row kernels' calls (rows of whole chunks), each
    with whether, on sm_90, their gather kernel takes it, adding each lane's
    16 bytes (8 for 16-bit 3x3/1) of results to the zeroed dx with atomics:
    float32 3x3/1 under each divisor rule, with ceil_mode and over many rows;
    16-bit 3x3/2 and 2x2/2 (rows of 16 and 24 elements), with padding and
    ceil_mode; 16-bit 3x3/1. Float32 with stride 2 stays with the tiles."""
    calls = (
        ((2, 5, 20, 16), 3, 1, 1, {}, (F32,), True),
        ((3, 4, 13, 12), 3, 1, 0, {"count_include_pad": False}, (F32,), True),
        ((2, 3, 19, 8), 3, 1, 1, {"ceil_mode": True, "divisor_override": 7}, (F32,), True),
        ((4, 64, 56, 56), 3, 1, 1, {}, (F32,), True),
        ((2, 6, 16, 16), 3, 2, 1, {}, LOW_PRECISION, True),
        ((3, 5, 17, 24), 3, 2, 0, {"ceil_mode": True}, LOW_PRECISION, True),
        ((2, 4, 12, 16), 3, 2, 1, {"count_include_pad": False}, LOW_PRECISION, True),
        ((3, 5, 18, 24), 2, 2, 0, {}, LOW_PRECISION, True),
        ((2, 5, 20, 16), 3, 1, 1, {}, LOW_PRECISION, True),
        ((3, 4, 13, 12), 3, 1, 0, {"count_include_pad": False}, LOW_PRECISION, True),
        ((2, 6, 16, 16), 3, 2, 1, {}, (F32,), False),
    )
    return _scatter_params(calls)


@pytest.mark.parametrize(("case", "dtype", "taken"), _row_kernel_scatter_cases())
def test_scatter_of_row_kernel_calls_by_the_gather_kernel_on_gpu(
    case: TorchCase, dtype: np.dtype, taken: bool, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """The scatter against the oracle; where the row kernel takes it (on sm_90
    and later), each dx element gets one atomic, onto zero, so dx is the
    gather's, bitwise."""
    _check_scatter_by_the_gather(case, dtype, taken, gpu, rng)


def _tensor_core_box_cases() -> list:
    """7x7/1 NHWC calls of 16-bit types whose channels come in slabs of 64, with
    destination images of 20 rows or more and 16 blocks or more, which the
    tensor-core box filter takes (its gather only where every window shares one
    divisor, and the whole-tile gather, below, does not take it: here the calls
    of 48 to 92 images of 27x27 and 28x28 at paddings 0 and 1; shapes in NCHW
    order): 28x28 images at each padding (rows 22 to 28
    wide, strips of 24 or 32 columns; the forward at padding 0 with 16 blocks
    or more on the kernel that stores its results from registers, with each
    divisor rule, one to three slabs of channels an image at run time and
    eight fixed at compile time) and divisor rule; images taller than 32
    rows (segments of rows) and wider than 32 columns (strips, the last one
    partial); two slabs of channels; calls of enough blocks (on an H200) that
    the ring rows hold only the source columns a strip meets, its other
    columns read from one pixel of zeros (the gather at paddings 0 and 1, and
    at padding 3 with 300 blocks, the forward too); calls where one stage
    buffer lets more blocks stay resident (padding 3 with 448 blocks, with
    compact rows; 56x56 images with 640, with whole ones); calls of up to a
    half more items than blocks stay resident on an H200, where each block
    takes a share of the items' rows in pieces that start and end inside
    items (640 items of 22 or 28 rows, and 736 of 21 or 27, odd numbers;
    the gathers' whole items would run on fewer resident blocks); and
    three calls it leaves to the other kernels (too few rows, too few blocks,
    channels not in slabs of 64)."""
    calls = (
        ((16, 64, 28, 28), 0, {}),
        ((16, 64, 28, 28), 1, {}),
        ((16, 64, 28, 28), 2, {"count_include_pad": False}),
        ((16, 64, 28, 28), 3, {"divisor_override": 11}),
        ((16, 128, 28, 28), 0, {"divisor_override": 11}),
        ((6, 192, 28, 28), 0, {"count_include_pad": False}),
        ((2, 128, 45, 70), 3, {}),
        ((8, 64, 33, 40), 1, {"ceil_mode": True}),
        ((6, 192, 26, 20), 2, {"count_include_pad": False}),
        ((16, 64, 19, 19), 3, {}),
        ((2, 64, 28, 28), 0, {}),
        ((16, 96, 28, 28), 0, {}),
        ((64, 512, 28, 28), 0, {}),
        ((48, 448, 28, 28), 1, {"divisor_override": 30}),
        ((50, 384, 28, 28), 3, {}),
        ((64, 448, 28, 28), 3, {}),
        ((160, 64, 56, 56), 3, {}),
        ((80, 512, 28, 28), 0, {}),
        ((92, 512, 27, 27), 0, {}),
    )
    return _low_precision_7x7(calls, "NHWC")


def _low_precision_7x7(calls: tuple, layout: str) -> list:
    """7x7/1 cases of (NCHW shape, padding, other arguments) in each 16-bit dtype."""
    return [
        _param(TorchCase(shape, 7, 1, pad, layout=layout, **extra), dtype)
        for dtype in LOW_PRECISION
        for shape, pad, extra in calls
    ]


def _tensor_core_plane_cases() -> list:
    """7x7/1 NCHW forwards of 16-bit types with rows of even width, destination
    rows 18 to 32 wide and at least two groups of 16 planes for each resident
    block (at least 8,448 planes on an H200), which the tensor-core plane
    kernel takes: planes of 28x28 at paddings 0 to 2 (K sides starting at even
    and odd columns, tiles of 24 and 32 columns) and each divisor rule, with
    ceil_mode; a last group of 13 planes; rows of 30 columns; planes of 32x32
    and 30x30 (at padding 3), whose buffers and stage take more than 72 KiB of
    shared memory; and calls it leaves to the other kernels (too few planes,
    an odd width, destination rows of 16 columns). Their gathers where dy's
    columns start at an odd offset (paddings 1 and 3 over the columns), which
    the strip kernel does not take, run on it too, as forwards over dy, where
    every window shares one divisor: planes of 28x28 at padding 1, with
    ceil_mode, and at padding 3 over the rows and 1 over the columns; of 32x32
    and 24x30 at padding 1; of 26x26 at padding 3 under an override. The
    others run on the strip kernel or the other kernels."""
    calls = (
        ((64, 256, 28, 28), 0, {}),
        ((64, 256, 32, 32), 1, {}),
        ((70, 129, 30, 30), 3, {"count_include_pad": False}),
        ((64, 256, 28, 28), 1, {}),
        ((64, 256, 28, 28), (3, 1), {}),
        ((64, 256, 28, 28), 2, {"count_include_pad": False}),
        ((64, 256, 26, 26), 3, {"divisor_override": 11}),
        ((65, 253, 28, 28), 1, {"ceil_mode": True}),
        ((64, 256, 24, 30), 1, {}),
        ((2, 8, 28, 28), 0, {}),
        ((64, 256, 28, 27), 0, {}),
        ((64, 256, 20, 20), 0, {}),
    )
    return _low_precision_7x7(calls, "NCHW")


def _tile_gather_cases() -> list:
    """7x7/1 NHWC gathers of 16-bit types whose windows share one divisor, with
    channels in slabs of 64, dx images of 20 to 32 rows and columns whose dy
    tiles fit shared memory twice and at least two units of 32 channels for
    each resident block (264 on an H200), which the whole-tile gather takes
    (its row tiles store dx rows 0 to 13 and 14 to 27 of 28, 0 to 10 and 11 to
    20 of 21, 0 to 15 and 16 to 31 of 32): 28x28 images at paddings 0 and 1
    (images fixed at compile time; at 0 also under an override) and 3 (each
    row tile's windows reach 17 dy rows, two products a column); 24x30 at
    padding 1; 21x32 (an odd number of rows, six blocks of columns) under an
    override; 32x24; 20x20 where padded cells do not count, which at padding 0
    leaves one divisor. Their forwards run on the other kernels."""
    calls = (
        ((33, 256, 28, 28), 0, {}),
        ((40, 384, 28, 28), 1, {}),
        ((36, 320, 28, 28), 0, {"divisor_override": 30}),
        ((33, 256, 28, 20), 3, {}),
        ((66, 128, 24, 30), 1, {}),
        ((40, 384, 21, 32), 0, {"divisor_override": 11}),
        ((33, 256, 32, 24), 0, {}),
        ((33, 256, 20, 20), 0, {"count_include_pad": False}),
    )
    return _low_precision_7x7(calls, "NHWC")


@pytest.mark.parametrize(("case", "dtype"), _tile_gather_cases())
def test_tensor_core_tile_gather_on_gpu_matches_oracle(
    case: TorchCase, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """Sums down H by mma.sync (16 dx rows a product) and along W by suffix and
    prefix sums: the gather against the oracle, bitwise repeatable (and the
    forward)."""
    _check_forward_and_gather(case, dtype, gpu, rng)


@pytest.mark.parametrize(("case", "dtype"), _tensor_core_box_cases() + _tensor_core_plane_cases())
def test_tensor_core_box_filter_on_gpu_matches_oracle(
    case: TorchCase, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """Window sums by mma.sync with a 0/1 matrix (of 16 channels in NHWC, of 16
    planes in NCHW): forward and gather against the oracle, the gather bitwise
    repeatable."""
    _check_forward_and_gather(case, dtype, gpu, rng)


def test_tensor_core_plane_forward_hands_out_groups_call_after_call(
    gpu: jax.Device, rng: np.random.Generator
) -> None:
    """The tensor-core plane kernel hands out groups of planes from a counter
    that each forward custom call owns and that must be back at zero after
    every call. Calls of one jitted function on alternating inputs (a group
    left out would keep the other input's result in a reused buffer), and a
    function with two such forwards of different sizes (two counters, with
    different numbers of groups), each call against the oracle."""
    dtype = BF16
    a = TorchCase((48, 256, 28, 28), 7, 1, 0)  # 768 groups of 16 planes
    b = TorchCase((41, 259, 28, 28), 7, 1, 1)  # 664 groups, the last of 11 planes
    one = jax.jit(functools.partial(avg_pool2d, **a.kwargs("gather")))

    def both(x, z):
        return (
            avg_pool2d(x, **a.kwargs("gather")),
            avg_pool2d(z, **b.kwargs("gather")),
        )

    both = jax.jit(both)
    xs = [random_array(rng, a.shape, dtype) for _ in range(2)]
    zs = [random_array(rng, b.shape, dtype) for _ in range(2)]
    want_x = [a.oracle_forward(x) for x in xs]
    want_z = [b.oracle_forward(z) for z in zs]
    with dtype_mode(dtype):
        on_gpu_x = [_on(gpu, x)[0] for x in xs]
        on_gpu_z = [_on(gpu, z)[0] for z in zs]
        for i in range(6):
            k = i % 2
            assert_close(one(on_gpu_x[k]), want_x[k], dtype, f"forward, call {i}")
            y, w = both(on_gpu_x[1 - k], on_gpu_z[k])
            assert_close(y, want_x[1 - k], dtype, f"first of two forwards, call {i}")
            assert_close(w, want_z[k], dtype, f"second of two forwards, call {i}")


def _check_parts_of_a_large_call(
    case: TorchCase, parts: list[tuple[int, slice]], gpu: jax.Device, rng: np.random.Generator
) -> None:
    """Pools a bfloat16 ``case`` of more than 2**31 elements (x and g drawn on
    the card), forward and gather by ``jax.vjp`` in one jitted call, and checks
    the (image, channels) ``parts`` of both against the oracle on those
    channels alone: images and channels are pooled independently."""
    if (gpu.memory_stats() or {}).get("bytes_limit", 0) < 40 * 2**30:
        pytest.skip("needs a GPU with 40 GiB of memory for JAX")
    assert np.prod(case.nchw) > 2**31
    every = slice(None)
    at = [
        (slice(i, i + 1), c) if case.layout == "NCHW" else (slice(i, i + 1), every, every, c)
        for i, c in parts
    ]

    @jax.jit
    def run(kx, kg):
        x = jax.random.uniform(kx, case.shape, jnp.bfloat16, -1.0, 1.0)
        g = jax.random.uniform(kg, case.out_shape, jnp.bfloat16, -1.0, 1.0)
        y, pull = jax.vjp(functools.partial(avg_pool2d, **case.kwargs("gather")), x)
        dx = pull(g)[0]
        return [(x[p], g[p], y[p], dx[p]) for p in at]

    with jax.default_device(gpu):
        kx, kg = jax.random.split(jax.random.key(int(rng.integers(2**31))))
        for x, g, y, dx in run(kx, kg):
            nchw = x.shape if case.layout == "NCHW" else tuple(np.take(x.shape, (0, 3, 1, 2)))
            part = dataclasses.replace(case, nchw=nchw)
            assert_close(y, part.oracle_forward(x), BF16, "forward")
            assert_close(dx, part.oracle_vjp(g), BF16, "gather gradient")


@pytest.mark.parametrize("pad", [0, 1, 3])
def test_more_than_2_31_elements_through_the_tensor_core_plane_kernel(
    pad: int, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """64-bit offsets: a bfloat16 NCHW tensor of 4096x700x28x28 (2.25e9
    elements) pooled 7x7/1, the forward on the tensor-core plane kernel at
    each padding, the gather on it at paddings 1 and 3 (on the strip kernel at
    padding 0). Three groups of planes of the forward and the gather (the
    first, the last, and 33 of the middle image) are checked against the
    oracle. Needs about 25 GiB of GPU memory."""
    case = TorchCase((4096, 700, 28, 28), 7, 1, pad)
    n, c = case.nchw[:2]
    parts = [(0, slice(0, 16)), (n - 1, slice(c - 16, c)), (n // 2, slice(300, 333))]
    _check_parts_of_a_large_call(case, parts, gpu, rng)


@pytest.mark.parametrize("pad", [0, 1, 3])
def test_more_than_2_31_elements_through_the_nhwc_tensor_core_kernels(
    pad: int, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """64-bit offsets in NHWC: a bfloat16 tensor of 2800x28x28x1024 (2.25e9
    elements) pooled 7x7/1, the forward on the tensor-core box filter at each
    padding, the gather on the whole-tile kernel at paddings 0 and 1 (28x28
    images fixed at compile time) and on the box filter at padding 3. Three
    slices of channels of the forward and the gather (of the first image, of
    the last, and 64 channels across a slab's edge of the middle one) are
    checked against the oracle. Needs about 25 GiB of GPU memory."""
    case = TorchCase((2800, 1024, 28, 28), 7, 1, pad, layout="NHWC")
    n, c = case.nchw[:2]
    parts = [(0, slice(0, 32)), (n - 1, slice(c - 32, c)), (n // 2, slice(480, 544))]
    _check_parts_of_a_large_call(case, parts, gpu, rng)


def test_more_than_2_31_elements_through_the_whole_plane_stride2_kernel(
    gpu: jax.Device, rng: np.random.Generator
) -> None:
    """64-bit offsets: a bfloat16 NCHW tensor of 1024x700x56x56 (2.25e9
    elements) pooled 3x3/2 without padding (27x27 outputs a plane), the
    forward on the kernel of whole planes in shared memory, the gather on the
    strip kernel of whole dy planes. Three groups of planes of the forward and the
    gather (the first, the last, and 33 of the middle image) are checked
    against the oracle. Needs about 20 GiB of GPU memory."""
    case = TorchCase((1024, 700, 56, 56), 3, 2, 0)
    n, c = case.nchw[:2]
    parts = [(0, slice(0, 16)), (n - 1, slice(c - 16, c)), (n // 2, slice(300, 333))]
    _check_parts_of_a_large_call(case, parts, gpu, rng)


def _with_non_finite(
    case: TorchCase, dtype: np.dtype, rng: np.random.Generator, far_column: int
) -> tuple[np.ndarray, np.ndarray]:
    """Random x and g for a 7x7/1 ``case`` with infinities and a NaN at the same
    (image, channel, row, column) spots of both, one of them at ``far_column``:
    two of opposite sign in one window, one in the first column."""
    x, g = random_array(rng, case.shape, dtype), random_array(rng, case.out_shape, dtype)
    spots = (
        ((0, 7, 3, 5), np.inf),
        ((0, 7, 6, 9), -np.inf),
        ((1, 40, 20, far_column), -np.inf),
        ((1, 63, 2, 2), np.nan),
        ((2, 0, 9, 0), np.inf),
    )
    for a in (x, g):
        for (n, c, i, j), value in spots:
            a[(n, c, i, j) if case.layout == "NCHW" else (n, i, j, c)] = value
    return x, g


def _block_sums_cases() -> list:
    """7x7/1 NHWC calls in float32 whose channels come in slabs of 64, which the
    box filter by sums over blocks of rows takes (its gather only where every
    window shares one divisor) with at least as many blocks as stay resident
    on an H200 (shapes in NCHW order): 28x28 images at each padding and
    divisor rule (the forward at padding 0 on its form with the image fixed
    at compile time), with ceil_mode; images of fewer rows than a block of seven
    and of many blocks; images wider than 32 destination columns (windows of
    columns, the last strip of each partial); two slabs of channels; and
    calls it leaves to the other kernels (too few blocks, channels not in
    slabs of 64)."""
    calls = (
        ((40, 448, 28, 28), 0, {}),
        ((280, 64, 28, 28), 1, {}),
        ((280, 64, 28, 28), 2, {"count_include_pad": False}),
        ((140, 128, 28, 28), 3, {"divisor_override": 11}),
        ((280, 64, 27, 29), 1, {"ceil_mode": True}),
        ((300, 64, 9, 12), 0, {}),
        ((300, 64, 8, 13), 3, {"count_include_pad": False}),
        ((140, 128, 40, 33), 2, {}),
        ((60, 64, 40, 150), 3, {}),
        ((300, 64, 19, 70), 0, {"count_include_pad": False}),
        ((4, 64, 28, 28), 0, {}),
        ((100, 96, 28, 28), 0, {}),
    )
    return [
        _param(TorchCase(shape, 7, 1, pad, layout="NHWC", **extra), F32)
        for shape, pad, extra in calls
    ]


@pytest.mark.parametrize(("case", "dtype"), _block_sums_cases())
def test_block_sums_box_filter_on_gpu_matches_oracle(
    case: TorchCase, dtype: np.dtype, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """Window sums along W, then down H as suffix and prefix sums of blocks of
    seven rows: forward and gather against the oracle, the gather bitwise
    repeatable."""
    _check_forward_and_gather(case, dtype, gpu, rng)


@pytest.mark.parametrize("pad", [0, 3])
def test_block_sums_box_filter_keeps_infinities_and_nans(
    pad: int, gpu: jax.Device, rng: np.random.Generator
) -> None:
    """The sums over blocks of rows only add, so an infinity or NaN reaches
    exactly the windows that hold it: the forward and both gradients equal the
    CPU's, infinities, NaNs (inf - inf in one window) and finite sums beside
    them alike."""
    case = TorchCase((270, 64, 28, 28), 7, 1, pad, layout="NHWC")
    # Column 21: the last of the 22 of dy at padding 0.
    x, g = _with_non_finite(case, F32, rng, far_column=21)
    _assert_non_finite_as_on_cpu(case, x, g, F32, gpu)


@pytest.mark.parametrize(
    ("layout", "shape", "pad"),
    [
        # In NCHW, padding 1 and enough planes for the plane kernel's forward.
        ("NCHW", (64, 256, 28, 28), 1),
        ("NHWC", (16, 64, 28, 28), 3),
        # Enough units (on an H200) for the whole-tile gather, whose images
        # at paddings 1 and 0 are fixed at compile time.
        ("NHWC", (64, 512, 28, 28), 1),
        ("NHWC", (48, 512, 28, 28), 0),
    ],
)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_name)
def test_tensor_core_box_filter_keeps_infinities_and_nans(
    dtype: np.dtype,
    layout: str,
    shape: tuple,
    pad: int,
    gpu: jax.Device,
    rng: np.random.Generator,
) -> None:
    """On the tensor cores an infinity or NaN times one of the 0/1 matrix's zeros
    is NaN, which would spoil the sums of windows that do not hold it: the
    forward and both gradients (in NHWC the scatter adds the same sums to dx)
    must still equal the CPU's, infinities, NaNs (inf - inf in one window) and
    finite sums beside them alike. In NCHW the tiles also
    reach into the neighbouring rows of a plane, here the row above an
    infinity at the start of a row."""
    case = TorchCase(shape, 7, 1, pad, layout=layout)
    # Column 22 at padding 1 and more; at padding 0 dy's last, 21.
    x, g = _with_non_finite(case, dtype, rng, far_column=22 if pad else 21)
    _assert_non_finite_as_on_cpu(case, x, g, dtype, gpu)
