"""``python -m jax_avgpool bench``: our kernels against XLA, a copy and PyTorch.

For each case (shape, window, dtype, layout) on JAX's default device it times

* our forward (:func:`jax_avgpool.avg_pool2d`) and our two backward kernels
  (``gather`` and ``scatter``), each alone: the backward is a jitted function
  of the output gradient that calls ``jax.linear_transpose`` of the pool, so
  its compiled program is the one custom call;
* XLA's own average pool, ``jax.lax.reduce_window`` sum / window size
  (``count_include_pad=True``, no ``ceil_mode``), and its transpose;
* a device copy of the input and a scale ``x * 0.5``, and the copy again
  after the pools (``copy, again``): the fastest of the three is the
  bandwidth ceiling that the "% of copy bandwidth" column refers to (on an
  H200 one timing of the copy of a 51 MB tensor took twice as long as
  another in the same run);
* PyTorch's ``avg_pool2d`` forward and backward (``aten.avg_pool2d_backward``)
  on the CPU, NCHW or channels_last, when the device is the CPU and torch is
  installed; on a GPU, PyTorch on CUDA if it has CUDA.

Every jitted program is compiled once, ahead of time, and its HLO is
checked: ours must be exactly one ``jax_avgpool_*`` custom call, the copy
must really copy. Timing: after a warm-up, each repeat dispatches N times
back to back (N chosen so that a repeat lasts ``--min-time``), blocks on the
last result and counts elapsed / N; the median over ``--repeat`` repeats is
reported. Each dispatch of a JAX program runs K calls (``--per-dispatch``,
default 8 on an accelerator): one program that applies the function to K
copies of its argument, timed per call. One dispatch from Python takes tens
of microseconds, so without it calls shorter than that are timed at the
pace of the dispatches (on an H200, XLA's copy of a 51 MB tensor took 39-45
us a call, against 27 us on the card). PyTorch's calls are timed one at a
time.

Then one SGD step of a ResNet-style network pooled by us is timed against
the same step pooled by ``reduce_window``, as XLA fuses it and unfused
(``--no-train`` skips it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._api import avg_pool2d, build_info, plan

Pair = tuple[int, int]
Params = dict[str, jax.Array]

DTYPES: dict[str, Any] = {
    "f16": jnp.float16,
    "bf16": jnp.bfloat16,
    "f32": jnp.float32,
    "f64": jnp.float64,
}
LAYOUTS = ("NCHW", "NHWC")


def _in_layout(nchw: str, layout: str) -> str:
    """An ``NxCxHxW`` shape written in ``layout``'s axis order."""
    n, c, h, w = nchw.split("x")
    return nchw if layout == "NCHW" else "x".join((n, h, w, c))


# Cases as ``parse_case`` reads them: the shape is the array's, in its layout,
# so each tensor below is the same (N, C, H, W) in both layouts.
GPU_CASES = tuple(
    f"{_in_layout(nchw, layout)}:{window}:{dtype}:{layout}"
    for nchw, window, dtypes in (
        ("128x256x56x56", "k3s2", ("f32", "bf16")),
        ("128x256x56x56", "k2s2", ("f32", "bf16")),
        ("32x64x224x224", "k3s1", ("f32",)),
        ("64x512x28x28", "k7s1", ("f32", "bf16")),
    )
    for dtype in dtypes
    for layout in LAYOUTS
)
CPU_CASES = (
    "16x64x56x56:k3s2:f32:NCHW",
    "16x64x56x56:k2s2:f32:NCHW",
    "8x32x112x112:k3s1:f32:NCHW",
    "16x56x56x64:k3s2:f32:NHWC",
    "16x64x56x56:k3s2:bf16:NCHW",
)
# JAX's backend name -> the platform name of our kernels (build_info()["platforms"]).
KERNEL_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}
# Ops of a compiled program's entry computation that move no data.
_TRIVIAL_OPS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
_TOLERANCE = {"f16": 1e-2, "bf16": 5e-2, "f32": 1e-5, "f64": 1e-12}


# --------------------------------------------------------------------------
# Cases.


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark configuration; ``shape`` is the input's, in ``layout`` order."""

    shape: tuple[int, int, int, int]
    kernel: Pair
    stride: Pair
    padding: Pair = (0, 0)
    dtype: str = "f32"
    layout: str = "NCHW"

    @property
    def label(self) -> str:
        """E.g. ``16x64x56x56 k3s2 f32 NCHW`` (``k3x2s2x1p1x0`` for unequal pairs)."""

        def pair(p: Pair) -> str:
            return str(p[0]) if p[0] == p[1] else f"{p[0]}x{p[1]}"

        window = f"k{pair(self.kernel)}s{pair(self.stride)}"
        if any(self.padding):
            window += f"p{pair(self.padding)}"
        return f"{'x'.join(map(str, self.shape))} {window} {self.dtype} {self.layout}"

    @property
    def jnp_dtype(self) -> Any:
        return DTYPES[self.dtype]

    def input_struct(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, self.jnp_dtype)

    def output_struct(self) -> jax.ShapeDtypeStruct:
        """Output shape and dtype; raises ``ValueError``/``TypeError`` for a bad case."""
        return jax.eval_shape(lambda x: ours(x, self), self.input_struct())

    def plan(self, backward: str = "gather", platform: str | None = None) -> dict[str, str]:
        """:func:`jax_avgpool.plan` for this case."""
        return plan(
            self.input_struct(),
            self.kernel,
            self.stride,
            self.padding,
            layout=self.layout,
            backward=backward,
            platform=platform,
        )


_PAIR = r"(\d+)(?:x(\d+))?"
_WINDOW = re.compile(rf"k{_PAIR}(?:s{_PAIR})?(?:p{_PAIR})?")


def parse_case(text: str) -> Case:
    """Parse ``SHAPE:WINDOW[:DTYPE[:LAYOUT]]``, e.g. ``8x16x32x32:k3s2p1:bf16:NHWC``.

    SHAPE is the input's four sizes in the layout's order (``NxHxWxC`` for
    NHWC). WINDOW is ``k<kernel>[s<stride>][p<padding>]``, each an int or
    ``<h>x<w>``; the stride defaults to the kernel (as in PyTorch), the
    padding to 0. DTYPE is one of f16, bf16, f32 (default), f64; LAYOUT NCHW
    (default) or NHWC. Raises ``ValueError`` naming what is wrong.
    """
    parts = text.strip().split(":")
    if not 2 <= len(parts) <= 4:
        raise ValueError(f"case {text!r}: expected SHAPE:WINDOW[:DTYPE[:LAYOUT]]")
    try:
        shape = tuple(int(s) for s in parts[0].lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"case {text!r}: shape must be four positive sizes like 8x16x32x32")
    match = _WINDOW.fullmatch(parts[1].lower())
    if match is None:
        raise ValueError(f"case {text!r}: window must look like k3, k3s2 or k3s2p1 (or k3x2...)")
    groups = match.groups()

    def pair(i: int, default: Pair) -> Pair:
        if groups[i] is None:
            return default
        first = int(groups[i])
        return (first, first if groups[i + 1] is None else int(groups[i + 1]))

    kernel = pair(0, (0, 0))  # always given: the pattern requires it
    dtype = parts[2].lower() if len(parts) > 2 else "f32"
    if dtype not in DTYPES:
        raise ValueError(f"case {text!r}: dtype must be one of {', '.join(DTYPES)}")
    layout = parts[3].upper() if len(parts) > 3 else "NCHW"
    if layout not in LAYOUTS:
        raise ValueError(f"case {text!r}: layout must be NCHW or NHWC")
    n, c, h, w = shape
    return Case((n, c, h, w), kernel, pair(2, kernel), pair(4, (0, 0)), dtype, layout)


def check_case(case: Case) -> None:
    """Raise ``ValueError`` if the case can't run here (bad geometry, f64 without x64)."""
    if case.dtype == "f64" and not jax.config.read("jax_enable_x64"):
        raise ValueError(f"{case.label}: f64 needs JAX_ENABLE_X64=1")
    try:
        case.output_struct()
    except (TypeError, ValueError) as err:
        raise ValueError(f"{case.label}: {err}") from err


# --------------------------------------------------------------------------
# The implementations.


def ours(x: jax.Array, case: Case, backward: str = "gather") -> jax.Array:
    """:func:`jax_avgpool.avg_pool2d` with the case's window."""
    return avg_pool2d(
        x, case.kernel, case.stride, case.padding, layout=case.layout, backward=backward
    )


def reduce_window_pool(
    x: jax.Array, kernel: Pair, stride: Pair, padding: Pair, layout: str
) -> jax.Array:
    """XLA's average pool: window sum / kernel area.

    The same as ``avg_pool2d`` with ``count_include_pad=True`` and no
    ``ceil_mode``: every window then lies inside the padded input.
    """
    spatial = (1, 2) if layout == "NHWC" else (2, 3)
    dims, strides, pads = [1] * 4, [1] * 4, [(0, 0)] * 4
    for i, axis in enumerate(spatial):
        dims[axis], strides[axis] = kernel[i], stride[i]
        pads[axis] = (padding[i], padding[i])
    summed = lax.reduce_window(x, np.zeros((), x.dtype), lax.add, dims, strides, pads)
    return summed / (kernel[0] * kernel[1])


def xla(x: jax.Array, case: Case) -> jax.Array:
    """:func:`reduce_window_pool` with the case's window."""
    return reduce_window_pool(x, case.kernel, case.stride, case.padding, case.layout)


def backward_of(pool: Callable[[jax.Array], jax.Array], x: jax.ShapeDtypeStruct) -> Callable:
    """``g -> dx``: the transpose of the linear ``pool`` at inputs shaped like ``x``."""
    transpose = jax.linear_transpose(pool, x)
    return lambda g: transpose(g)[0]


def entry_ops(compiled_hlo: str) -> list[str]:
    """The data-moving ops of a compiled HLO module's entry computation.

    Parameters, constants, tuples and bitcasts are left out; a custom call
    is ``custom-call:<target>``. E.g. ``["custom-call:jax_avgpool_backward"]``
    for our backward alone, ``["copy"]`` or ``["fusion"]`` for a copy.
    """
    entry = re.search(r"^ENTRY .*?^}", compiled_hlo, re.MULTILINE | re.DOTALL)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    ops = []
    for line in entry.group(0).splitlines()[1:]:
        match = re.search(r"=\s*(?:\([^)]*\)|\S+)\s+([\w-]+)\(", line)
        if match is None or match.group(1) in _TRIVIAL_OPS:
            continue
        op = match.group(1)
        if op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', line)
            op += f":{target.group(1) if target else '?'}"
        ops.append(op)
    return ops


def compile_jax(fn: Callable, *args: Any) -> tuple[Callable, list[str]]:
    """Compile ``jax.jit(fn)`` for ``args``; return the executable and its :func:`entry_ops`."""
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, entry_ops(compiled.as_text())


# --------------------------------------------------------------------------
# Timing.


@dataclasses.dataclass
class Timing:
    """Seconds per call: the median over repeats, every repeat, calls per repeat."""

    seconds: float
    repeats: list[float]
    calls: int


def time_fn(
    fn: Callable[..., Any],
    *args: Any,
    repeat: int = 7,
    min_time: float = 0.05,
    block: Callable[[Any], Any] = jax.block_until_ready,
    chain: bool = False,
    max_calls: int = 100_000,
) -> Timing:
    """Time ``fn(*args)``: median over ``repeat`` repeats of N back-to-back calls.

    A first call warms up (compiles, allocates). Then batches of 1, 2, 4, ...
    calls run until one lasts ``min_time`` seconds: its size is N, and they
    are dropped too (they settle clocks, caches, the allocator and thread
    pools). Each repeat then dispatches N calls, blocks on the last result
    (``block``) and counts elapsed / N. With ``chain``, ``fn`` takes one
    argument and each call's result is the next call's argument (a training
    step's parameters, say).
    """

    def calls(n: int, state: tuple) -> tuple[float, tuple]:
        start = time.perf_counter()
        out = None
        for _ in range(n):
            out = fn(*state)
            if chain:
                state = (out,)
        block(out)
        return time.perf_counter() - start, state

    _, state = calls(1, tuple(args))  # compiles
    n = 1
    while True:
        elapsed, state = calls(n, state)
        if elapsed >= min_time or n >= max_calls:
            break
        n = min(max_calls, 2 * n)
    repeats = []
    for _ in range(repeat):
        elapsed, state = calls(n, state)
        repeats.append(elapsed / n)
    return Timing(statistics.median(repeats), repeats, n)


def time_per_call(
    fn: Callable, arg: jax.Array, settings: Settings, compiled: Callable | None = None
) -> Timing:
    """:func:`time_fn` of ``jax.jit(fn)`` on ``arg``, ``settings.per_dispatch`` calls a
    dispatch: K > 1 compiles one program that applies ``fn`` to K distinct copies of
    ``arg`` (so that XLA cannot merge the calls) and reports its times divided by K.
    With K = 1 it times ``compiled`` (``fn`` compiled for ``arg``) where given.
    """
    k = settings.per_dispatch
    args = [arg] + [jnp.array(arg, copy=True) for _ in range(k - 1)]
    if k > 1 or compiled is None:
        compiled = jax.jit(lambda *ts: tuple(fn(t) for t in ts)).lower(*args).compile()
    timing = time_fn(compiled, *args, repeat=settings.repeat, min_time=settings.min_time)
    return Timing(timing.seconds / k, [t / k for t in timing.repeats], timing.calls * k)


# --------------------------------------------------------------------------
# One case.


@dataclasses.dataclass
class Row:
    """One implementation's result in one case.

    ``kind`` is ``"copy"``, ``"fwd"`` or ``"bwd"``; ``bytes`` is what it
    must read and write at least (input + output); ``kernel_id`` is ours
    only (from :func:`jax_avgpool.plan`); ``hlo_ops`` the compiled entry
    ops for JAX programs.
    """

    impl: str
    kind: str
    seconds: float
    bytes: int
    repeats: list[float]
    calls: int
    kernel_id: str | None = None
    hlo_ops: list[str] | None = None
    pct_copy_bw: float | None = None
    speedup_vs_xla: float | None = None


@dataclasses.dataclass
class CaseResult:
    """All rows of one case, the copy bandwidth (bytes/s) and notes."""

    case: Case
    rows: list[Row]
    copy_bandwidth: float
    notes: list[str]
    checks: dict[str, float]
    scatter_floor_s: float | None = None

    def row(self, impl: str) -> Row | None:
        return next((r for r in self.rows if r.impl == impl), None)


@dataclasses.dataclass
class Settings:
    """What :func:`bench_case` needs besides the case."""

    repeat: int = 7
    min_time: float = 0.05
    torch: bool = True
    progress: Callable[[str], None] = lambda line: None
    per_dispatch: int = 1  # calls of a JAX program per dispatch


def random_normal(
    rng: np.random.Generator, shape: Sequence[int], dtype: Any, scale: float = 1.0
) -> jax.Array:
    """Standard normal values times ``scale``, made on the host (no JAX program to
    compile), cast to ``dtype`` and put on the default device once."""
    host = (scale * rng.standard_normal(tuple(shape), dtype=np.float32)).astype(dtype)
    return jax.device_put(host)


def _nbytes(s: Any) -> int:
    return math.prod(s.shape) * np.dtype(s.dtype).itemsize


def kernel_platform() -> str:
    """Our kernels' platform name for JAX's default backend (``gpu`` -> ``cuda``)."""
    backend = jax.default_backend()
    return KERNEL_PLATFORMS.get(backend, backend)


def _torch_impls(case: Case, x: jax.Array, g: jax.Array) -> list[tuple[str, str, Callable]]:
    """PyTorch's forward and backward on this device, or none (not installed, no CUDA)."""
    try:
        import torch
    except ImportError:
        return []
    backend = jax.default_backend()
    if backend == "cpu":
        device, label = "cpu", "torch"
    elif backend in ("gpu", "cuda") and torch.cuda.is_available():
        device, label = "cuda", "torch-cuda"
    else:
        return []
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}.get(
        case.dtype, torch.float64
    )

    def tensor(a: jax.Array) -> Any:
        host = np.array(a, dtype=np.float32 if case.dtype == "bf16" else None)  # no bf16 in numpy
        t = torch.from_numpy(host).to(device=device, dtype=dtype)
        if case.layout == "NHWC":  # the NCHW view of channels_last memory
            t = t.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        return t

    tx, tg = tensor(x), tensor(g)
    args = (list(case.kernel), list(case.stride), list(case.padding))
    fwd = torch.nn.functional.avg_pool2d
    bwd = torch.ops.aten.avg_pool2d_backward
    with torch.inference_mode():
        fwd(tx, *args)  # fails here, not in the timing, if torch lacks the dtype
    return [
        (f"{label} fwd", "fwd", lambda: fwd(tx, *args)),
        (f"{label} bwd", "bwd", lambda: bwd(tg, tx, *args, False, True, None)),
    ]


def _torch_block(impl: str) -> Callable[[Any], Any]:
    if impl.startswith("torch-cuda"):
        import torch

        return lambda _: torch.cuda.synchronize()
    return lambda _: None


def bench_case(case: Case, settings: Settings) -> CaseResult:
    """Time every implementation on ``case``; fill in bandwidth, speed-ups and notes."""
    x_struct, y_struct = case.input_struct(), case.output_struct()
    rng = np.random.default_rng(0)
    x = random_normal(rng, case.shape, case.jnp_dtype)
    g = random_normal(rng, y_struct.shape, case.jnp_dtype)
    io_bytes = _nbytes(x_struct) + _nbytes(y_struct)
    platform = kernel_platform()
    ids = {b: case.plan(backward=b, platform=platform) for b in ("gather", "scatter")}

    # name, kind, function, argument, bytes, kernel id, entry ops it must be
    jax_impls: list[tuple[str, str, Callable, jax.Array, int, str | None, list[str] | None]] = [
        ("copy", "copy", lambda t: t.copy(), x, 2 * _nbytes(x_struct), None, None),
        ("scale x*0.5", "copy", lambda t: t * 0.5, x, 2 * _nbytes(x_struct), None, None),
        ("xla fwd", "fwd", lambda t: xla(t, case), x, io_bytes, None, None),
        (
            "ours fwd",
            "fwd",
            lambda t: ours(t, case),
            x,
            io_bytes,
            ids["gather"]["forward"],
            ["custom-call:jax_avgpool_forward"],
        ),
        ("xla bwd", "bwd", backward_of(lambda t: xla(t, case), x_struct), g, io_bytes, None, None),
    ]
    for strategy in ("gather", "scatter"):
        jax_impls.append(
            (
                f"ours bwd {strategy}",
                "bwd",
                backward_of(lambda t, s=strategy: ours(t, case, s), x_struct),
                g,
                io_bytes,
                ids[strategy]["backward"],
                ["custom-call:jax_avgpool_backward"],
            )
        )

    rows: list[Row] = []
    notes: list[str] = []
    outputs: dict[str, jax.Array] = {}

    def add(row: Row) -> None:
        rows.append(row)
        settings.progress(f"  {row.impl:<18} {1e6 * row.seconds:10.1f} us  ({row.calls} calls)")

    copy_again = None
    for impl, kind, fn, arg, nbytes, kernel_id, expected in jax_impls:
        compiled, ops = compile_jax(fn, arg)
        if kind == "copy" and not ops:
            notes.append(f"{impl}: XLA elided it (no op in the compiled program); not timed")
            continue
        if expected is not None and ops != expected:
            notes.append(f"WARNING {impl}: compiled program runs {ops}, not just {expected}")
        timing = time_per_call(fn, arg, settings, compiled)
        add(Row(impl, kind, timing.seconds, nbytes, timing.repeats, timing.calls, kernel_id, ops))
        if kind != "copy":
            outputs[impl] = compiled(arg)
        elif impl == "copy":
            copy_again = (fn, compiled, arg, nbytes, ops)
    if copy_again is not None:
        fn, compiled, arg, nbytes, ops = copy_again
        timing = time_per_call(fn, arg, settings, compiled)
        add(
            Row(
                "copy, again",
                "copy",
                timing.seconds,
                nbytes,
                timing.repeats,
                timing.calls,
                None,
                ops,
            )
        )

    if settings.torch:
        try:
            torch_impls = _torch_impls(case, x, g)
        except (RuntimeError, TypeError, NotImplementedError) as err:
            notes.append(f"torch skipped: {str(err).splitlines()[0]}")
            torch_impls = []
        for impl, kind, fn in torch_impls:
            timing = time_fn(
                fn, repeat=settings.repeat, min_time=settings.min_time, block=_torch_block(impl)
            )
            add(Row(impl, kind, timing.seconds, io_bytes, timing.repeats, timing.calls))

    copy_bandwidth = max(r.bytes / r.seconds for r in rows if r.kind == "copy")
    reference = {r.kind: r.seconds for r in rows if r.impl in ("xla fwd", "xla bwd")}
    for r in rows:
        r.pct_copy_bw = 100.0 * (r.bytes / r.seconds) / copy_bandwidth
        if r.kind in reference and not r.impl.startswith("xla"):
            r.speedup_vs_xla = reference[r.kind] / r.seconds

    result = CaseResult(case, rows, copy_bandwidth, notes, _checks(outputs, case.dtype))
    scatter = result.row("ours bwd scatter")
    if scatter is not None:
        # zero dx (write), read-modify-write dx (read + write), read dy
        floor_bytes = 3 * _nbytes(x_struct) + _nbytes(y_struct)
        result.scatter_floor_s = floor_bytes / copy_bandwidth
        notes.append(
            f"scatter floor (zero dx + RMW dx + read dy = {floor_bytes / 1e6:.1f} MB at copy "
            f"bandwidth): {1e6 * result.scatter_floor_s:.1f} us; scatter takes "
            f"{scatter.seconds / result.scatter_floor_s:.2f} x that"
        )
    return result


def _checks(outputs: dict[str, jax.Array], dtype: str) -> dict[str, float]:
    """Max |difference| of ours against XLA (forward, both backwards), on the device."""
    pairs = {
        "fwd ours-xla": ("ours fwd", "xla fwd"),
        "bwd gather-xla": ("ours bwd gather", "xla bwd"),
        "bwd scatter-xla": ("ours bwd scatter", "xla bwd"),
    }
    pairs = {k: v for k, v in pairs.items() if v[0] in outputs and v[1] in outputs}
    wide = jnp.float64 if dtype == "f64" else jnp.float32

    @jax.jit  # one program for all pairs
    def diffs(outs: dict[str, jax.Array]) -> dict[str, jax.Array]:
        def diff(a: jax.Array, b: jax.Array) -> jax.Array:
            return jnp.max(jnp.abs(a.astype(wide) - b.astype(wide)), initial=0.0)

        return {name: diff(outs[a], outs[b]) for name, (a, b) in pairs.items()}

    values = diffs(outputs)  # a dict in sorted key order: keep the pairs' order
    return {name: float(values[name]) for name in pairs}


# --------------------------------------------------------------------------
# Output.


def format_table(results: Sequence[CaseResult]) -> str:
    """The results as a text table, then each case's notes.

    Columns: case, impl, microseconds per call, % of copy bandwidth (input +
    output bytes per second against the copy's), speed-up over XLA (forward
    rows against XLA's forward, backward rows against its backward) and our
    kernel id.
    """
    header = ("case", "impl", "µs", "% copy BW", "vs XLA", "kernel id")
    lines: list[tuple[str, ...]] = []
    for res in results:
        for i, r in enumerate(res.rows):
            lines.append(
                (
                    res.case.label if i == 0 else "",
                    r.impl,
                    f"{1e6 * r.seconds:.1f}",
                    f"{r.pct_copy_bw:.1f}%" if r.pct_copy_bw is not None else "-",
                    f"{r.speedup_vs_xla:.2f}x" if r.speedup_vs_xla is not None else "-",
                    r.kernel_id or "-",
                )
            )
        lines.append(())
    widths = [max(len(h), *(len(line[i]) for line in lines if line)) for i, h in enumerate(header)]
    right = {2, 3, 4}

    def fmt(cells: Sequence[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    text = [fmt(header), rule]
    text += [fmt(line) if line else rule for line in lines]
    text.append("")
    for res in results:
        bw = f"copy bandwidth {res.copy_bandwidth / 1e9:.1f} GB/s"
        checks = ", ".join(f"{k} {v:.1e}" for k, v in res.checks.items())
        tol = _TOLERANCE[res.case.dtype]
        verdict = "ok" if all(v <= tol for v in res.checks.values()) else "MISMATCH"
        text.append(f"{res.case.label}: {bw}; max |diff| {checks} ({verdict}, tolerance {tol:g})")
        text += [f"  {note}" for note in res.notes]
    return "\n".join(text)


def write_png(results: Sequence[CaseResult], path: str, title: str = "") -> bool:
    """Bar chart of % of copy bandwidth per case and implementation (forward, backward).

    Returns ``False`` (and says so) when matplotlib isn't installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print(f"matplotlib is not installed: no chart written to {path}", file=sys.stderr)
        return False
    labels = [res.case.label for res in results]
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.5 * len(results) + 4), 9.0))
    for ax, kind, name in zip(axes, ("fwd", "bwd"), ("forward", "backward"), strict=True):
        impls = list(dict.fromkeys(r.impl for res in results for r in res.rows if r.kind == kind))
        width = 0.8 / max(1, len(impls))
        for j, impl in enumerate(impls):
            xs, values = [], []
            for i, res in enumerate(results):
                row = res.row(impl)
                if row is not None and row.pct_copy_bw is not None:
                    xs.append(i + (j - (len(impls) - 1) / 2) * width)
                    values.append(row.pct_copy_bw)
            ax.bar(xs, values, width, label=impl)
        ax.axhline(100.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}%"))
        ax.set_xticks(range(len(results)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("% of copy bandwidth (log)")
        ax.set_title(f"{name}: (input + output bytes) / time, against a device copy")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------
# A training step of a small ResNet-style network.

Pool = Callable[[jax.Array, int, int, int], jax.Array]


def init_resnet(rng: np.random.Generator, widths: Sequence[int], classes: int = 10) -> Params:
    """He-normal float32 weights (HWIO) of :func:`resnet_logits`: stem, per stage a
    1x1 projection (after the first) and a two-conv residual block, a dense head."""

    def he(shape: tuple[int, ...]) -> jax.Array:
        fan_in = math.prod(shape[:-1])
        return random_normal(rng, shape, np.float32, math.sqrt(2.0 / fan_in))

    params = {"stem": he((3, 3, 3, widths[0]))}
    for i, w in enumerate(widths):
        if i:
            params[f"proj{i}"] = he((1, 1, widths[i - 1], w))
        params[f"conv{i}a"] = he((3, 3, w, w))
        params[f"conv{i}b"] = 0.1 * he((3, 3, w, w))
    params["head"] = he((widths[-1], classes))
    return params


def resnet_logits(params: Params, x: jax.Array, pool: Pool) -> jax.Array:
    """NHWC images -> logits: conv-relu stem, ``pool(3, 2, 1)``, then stages of a
    residual block, each but the first after ``pool(2, 2, 0)`` and a 1x1
    projection; global average pool, dense."""

    def conv(h: jax.Array, w: jax.Array) -> jax.Array:
        dims = ("NHWC", "HWIO", "NHWC")
        return lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=dims)

    h = pool(jax.nn.relu(conv(x, params["stem"])), 3, 2, 1)
    stage = 0
    while f"conv{stage}a" in params:
        if stage:
            h = conv(pool(h, 2, 2, 0), params[f"proj{stage}"])
        inner = jax.nn.relu(conv(h, params[f"conv{stage}a"]))
        h = jax.nn.relu(h + conv(inner, params[f"conv{stage}b"]))
        stage += 1
    return h.mean(axis=(1, 2)) @ params["head"]


def make_sgd_step(pool: Pool, lr: float = 0.01) -> Callable:
    """``step(params, x, labels) -> (params, loss)``: one SGD step on the cross-entropy."""

    def loss_fn(params: Params, x: jax.Array, labels: jax.Array) -> jax.Array:
        logp = jax.nn.log_softmax(resnet_logits(params, x, pool))
        return -jnp.take_along_axis(logp, labels[:, None], axis=1).mean()

    def step(params: Params, x: jax.Array, labels: jax.Array) -> tuple[Params, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, labels)
        return jax.tree_util.tree_map(lambda p, d: p - lr * d, params, grads), loss

    return step


def _ours_nhwc(h: jax.Array, k: int, s: int, p: int) -> jax.Array:
    return avg_pool2d(h, k, s, p, layout="NHWC")


def _xla_nhwc(h: jax.Array, k: int, s: int, p: int) -> jax.Array:
    return reduce_window_pool(h, (k, k), (s, s), (p, p), "NHWC")


def _xla_unfused_nhwc(h: jax.Array, k: int, s: int, p: int) -> jax.Array:
    # Optimization barriers keep XLA from fusing the pooling (and, through
    # their JVP, its gradient) with the ops around it: it reads its operand
    # from memory and writes its result there, as a custom call does.
    h = lax.optimization_barrier(h)
    return lax.optimization_barrier(reduce_window_pool(h, (k, k), (s, s), (p, p), "NHWC"))


def train_step_bench(
    batch: int, size: int, widths: Sequence[int], settings: Settings
) -> dict[str, Any]:
    """Median SGD step of :func:`resnet_logits` pooled by us and by ``reduce_window``.

    ``reduce_window`` is timed twice: as XLA compiles it (``xla``), fused with
    its neighbours where XLA chooses, and unfused (``xla_unfused``), its
    operand and result kept in memory as a custom call's are.

    Returns a dict: the network's shape, ``ours_ms``, ``xla_ms``,
    ``xla_unfused_ms``, ``speedup`` (``xla_ms / ours_ms``),
    ``speedup_vs_unfused``, the first losses (same parameters and batch;
    they must agree) and the custom calls in our compiled step.
    """
    rng = np.random.default_rng(1)
    params = init_resnet(rng, widths)
    x = random_normal(rng, (batch, size, size, 3), np.float32)
    labels = jax.device_put(rng.integers(0, 10, batch, dtype=np.int32))
    result: dict[str, Any] = {"images": [batch, size, size, 3], "layout": "NHWC"}
    result["widths"] = list(widths)
    pools = (("ours", _ours_nhwc), ("xla", _xla_nhwc), ("xla_unfused", _xla_unfused_nhwc))
    for name, pool in pools:
        compiled, _ = compile_jax(make_sgd_step(pool), params, x, labels)
        text = compiled.as_text()
        if name == "ours":
            result["custom_calls"] = {
                op: text.count(f'custom_call_target="jax_avgpool_{op}"')
                for op in ("forward", "backward")
            }
        result[f"loss_{name}"] = float(compiled(params, x, labels)[1])
        timing = time_fn(
            lambda p, c=compiled: c(p, x, labels)[0],
            params,
            repeat=settings.repeat,
            min_time=settings.min_time,
            chain=True,
        )
        result[f"{name}_ms"] = 1e3 * timing.seconds
        settings.progress(
            f"train step {name:<11} {1e3 * timing.seconds:9.3f} ms ({timing.calls} steps)"
        )
    result["speedup"] = result["xla_ms"] / result["ours_ms"]
    result["speedup_vs_unfused"] = result["xla_unfused_ms"] / result["ours_ms"]
    return result


def format_train(train: dict[str, Any]) -> str:
    """The training-step comparison in a few lines."""
    shape = "x".join(map(str, train["images"]))
    calls = train["custom_calls"]
    return "\n".join(
        [
            f"ResNet-style SGD step, {shape} {train['layout']} images, widths "
            f"{'/'.join(map(str, train['widths']))}, 10 classes (median step):",
            f"  pooled by jax_avgpool:   {train['ours_ms']:9.3f} ms  "
            f"({calls['forward']} forward + {calls['backward']} backward custom calls)",
            f"  pooled by reduce_window: {train['xla_ms']:9.3f} ms",
            f"  reduce_window, unfused:  {train['xla_unfused_ms']:9.3f} ms  "
            "(operand and result in memory, as a custom call's)",
            f"  speed-up {train['speedup']:.2f} x ({train['speedup_vs_unfused']:.2f} x against "
            f"unfused); first-step loss {train['loss_ours']:.6f} vs {train['loss_xla']:.6f}",
        ]
    )


# --------------------------------------------------------------------------
# The command.


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the bench as the command line asks; print the tables; write JSON/PNG."""
    backend = jax.default_backend()
    platform = kernel_platform()
    built = build_info()["platforms"]
    if platform not in built:
        print(
            f"jax_avgpool has no kernels for JAX's default backend {backend!r} (this build "
            f"has: {', '.join(built) or 'none'}). Rebuild with the {platform} kernels, or "
            "bench another backend, e.g. JAX_PLATFORMS=cpu.",
            file=sys.stderr,
        )
        return 2
    try:
        cases = [parse_case(c) for c in args.case or (CPU_CASES if backend == "cpu" else GPU_CASES)]
        for case in cases:
            check_case(case)
    except ValueError as err:
        print(f"bench: {err}", file=sys.stderr)
        return 2

    device = jax.devices()[0]
    per_dispatch = args.per_dispatch or (1 if backend == "cpu" else 8)
    settings = Settings(args.repeat, args.min_time, args.torch, _progress, per_dispatch)
    kind = f"CPU, {os.cpu_count()} cores" if backend == "cpu" else device.device_kind
    header = f"device: {kind} ({backend}), jax {jax.__version__}"
    print(
        header + f", median of {args.repeat} repeats of >= {args.min_time:g} s, "
        f"{per_dispatch} call(s) per dispatch",
        flush=True,
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if backend == "cpu" and load > 0.5:
        print(
            f"note: the machine is busy before the bench starts (load average {load:.1f}): "
            "CPU timings will be noisy",
            flush=True,
        )
    start = time.perf_counter()
    results = []
    for i, case in enumerate(cases, 1):
        _progress(f"[{i}/{len(cases)}] {case.label}")
        results.append(bench_case(case, settings))
    train = None
    if args.train:
        _progress("[train] ResNet-style SGD step")
        # On a GPU, a network that keeps the card busy: with 32 x 64 x 64
        # images the step took under a millisecond and its time moved by up
        # to 1.6x between processes; at this size it repeats within 1%.
        batch, size, widths = (
            (8, 32, (16, 32, 64)) if backend == "cpu" else (128, 112, (64, 128, 256))
        )
        train = train_step_bench(batch, size, widths, settings)
    elapsed = time.perf_counter() - start

    print()
    print(format_table(results))
    if train is not None:
        print()
        print(format_train(train))
    print(f"\nbench ran {elapsed:.1f} s")
    if args.json:
        payload = {
            "device": str(device),
            "device_kind": device.device_kind,
            "backend": backend,
            "build_info": build_info(),
            "settings": {
                "repeat": args.repeat,
                "min_time": args.min_time,
                "per_dispatch": per_dispatch,
            },
            "cases": [_case_json(res) for res in results],
            "train": train,
            "seconds": elapsed,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.json}")
    if args.png and write_png(results, args.png, header):
        print(f"wrote {args.png}")
    return 0


def _case_json(res: CaseResult) -> dict[str, Any]:
    c = res.case
    return {
        "label": c.label,
        "shape": list(c.shape),
        "kernel": list(c.kernel),
        "stride": list(c.stride),
        "padding": list(c.padding),
        "dtype": c.dtype,
        "layout": c.layout,
        "copy_bandwidth_gb_s": res.copy_bandwidth / 1e9,
        "scatter_floor_us": None if res.scatter_floor_s is None else 1e6 * res.scatter_floor_s,
        "max_abs_diff": res.checks,
        "notes": res.notes,
        "rows": [
            {
                "impl": r.impl,
                "kind": r.kind,
                "us": 1e6 * r.seconds,
                "repeats_us": [1e6 * t for t in r.repeats],
                "calls_per_repeat": r.calls,
                "bytes": r.bytes,
                "pct_copy_bw": r.pct_copy_bw,
                "speedup_vs_xla": r.speedup_vs_xla,
                "kernel_id": r.kernel_id,
                "hlo_ops": r.hlo_ops,
            }
            for r in res.rows
        ],
    }
