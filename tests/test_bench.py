"""Smoke tests of ``python -m jax_avgpool bench`` on tiny cases on the CPU."""

from __future__ import annotations

import argparse
import json
import math
import sys

import jax
import pytest

import jax_avgpool
from jax_avgpool import __main__ as cli
from jax_avgpool import _bench as bench

FAST = bench.Settings(repeat=2, min_time=0.0, torch=True)


@pytest.fixture(autouse=True)
def _cpu_only() -> None:
    if jax.default_backend() != "cpu":
        pytest.skip("the bench smoke tests run on the CPU")


def test_parse_case() -> None:
    case = bench.parse_case("8x16x32x32:k3s2")
    assert case == bench.Case((8, 16, 32, 32), (3, 3), (2, 2), (0, 0), "f32", "NCHW")
    assert case.label == "8x16x32x32 k3s2 f32 NCHW"
    case = bench.parse_case("2x9x7x4:k3x2s1x2p1x0:bf16:nhwc")
    assert (case.kernel, case.stride, case.padding) == ((3, 2), (1, 2), (1, 0))
    assert (case.dtype, case.layout) == ("bf16", "NHWC")
    assert case.label == "2x9x7x4 k3x2s1x2p1x0 bf16 NHWC"
    assert bench.parse_case("1x1x4x4:k2").stride == (2, 2)  # PyTorch's default
    for defaults in (bench.CPU_CASES, bench.GPU_CASES):
        for text in defaults:
            bench.check_case(bench.parse_case(text))


def test_gpu_cases_pool_the_same_tensor_in_both_layouts() -> None:
    """Each NHWC default case is its NCHW twin's tensor in channels-last order."""
    cases = [bench.parse_case(text) for text in bench.GPU_CASES]
    nchw = {(c.kernel, c.stride, c.dtype): c.shape for c in cases if c.layout == "NCHW"}
    nhwc = {(c.kernel, c.stride, c.dtype): c.shape for c in cases if c.layout == "NHWC"}
    assert nchw.keys() == nhwc.keys() and len(nchw) == len(cases) // 2
    for key, (n, c, h, w) in nchw.items():
        assert nhwc[key] == (n, h, w, c), key


@pytest.mark.parametrize(
    "text",
    ["8x16x32", "8x16x32x32", "8x16x32x32:3s2", "8x16x32x32:k3:f8", "8x16x32x32:k3:f32:NWCH"],
)
def test_parse_case_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="case"):
        bench.parse_case(text)


def test_check_case_rejects_bad_geometry() -> None:
    with pytest.raises(ValueError, match="padding"):
        bench.check_case(bench.parse_case("1x2x8x8:k2s1p2"))


def test_bench_case_rows() -> None:
    case = bench.parse_case("2x3x9x9:k3s2p1:f32:NCHW")
    result = bench.bench_case(case, FAST)
    impls = [r.impl for r in result.rows]
    expected = ["copy", "scale x*0.5", "xla fwd", "ours fwd", "xla bwd"]
    expected += ["ours bwd gather", "ours bwd scatter", "copy, again"]
    assert impls[: len(expected)] == expected
    assert set(impls[len(expected) :]) <= {"torch fwd", "torch bwd"}
    assert result.copy_bandwidth > 0 and math.isfinite(result.copy_bandwidth)
    for r in result.rows:
        assert math.isfinite(r.seconds) and r.seconds > 0, r
        assert len(r.repeats) == FAST.repeat and r.calls >= 1
        assert r.bytes > 0 and r.pct_copy_bw is not None and r.pct_copy_bw > 0
    assert max(r.pct_copy_bw for r in result.rows if r.kind == "copy") == pytest.approx(100.0)

    x = jax.ShapeDtypeStruct(case.shape, jax.numpy.float32)
    gather = jax_avgpool.plan(x, 3, 2, 1)
    scatter = jax_avgpool.plan(x, 3, 2, 1, backward="scatter")
    rows = {r.impl: r for r in result.rows}
    assert rows["ours fwd"].kernel_id == gather["forward"]
    assert rows["ours bwd gather"].kernel_id == gather["backward"]
    assert rows["ours bwd scatter"].kernel_id == scatter["backward"]
    # the timed programs are our kernels alone
    assert rows["ours fwd"].hlo_ops == ["custom-call:jax_avgpool_forward"]
    for strategy in ("gather", "scatter"):
        assert rows[f"ours bwd {strategy}"].hlo_ops == ["custom-call:jax_avgpool_backward"]
        assert rows[f"ours bwd {strategy}"].speedup_vs_xla > 0
    assert rows["copy"].hlo_ops  # the copy really runs
    assert rows["copy, again"].hlo_ops == rows["copy"].hlo_ops
    assert rows["ours fwd"].speedup_vs_xla > 0 and rows["xla fwd"].speedup_vs_xla is None
    assert not [n for n in result.notes if "WARNING" in n]
    assert result.scatter_floor_s is not None and result.scatter_floor_s > 0
    assert set(result.checks) == {"fwd ours-xla", "bwd gather-xla", "bwd scatter-xla"}
    assert max(result.checks.values()) < 1e-5

    table = bench.format_table([result])
    assert case.label in table and gather["backward"] in table and "scatter floor" in table


def test_entry_ops() -> None:
    compiled, ops = bench.compile_jax(lambda t: -t, jax.numpy.ones((4, 4)))
    assert ops == ["fusion"] or ops == ["negate"]
    assert bench.entry_ops(compiled.as_text()) == ops


def test_time_per_call_batches_calls_per_dispatch(monkeypatch) -> None:
    """K calls a dispatch: one program over K distinct copies, timed per call."""
    x = jax.numpy.arange(64.0).reshape(1, 1, 8, 8)
    settings = bench.Settings(repeat=2, min_time=0.0, torch=False, per_dispatch=3)
    seen = []

    def fn(t):
        seen.append(t.shape)
        return t * 2.0

    timing = bench.time_per_call(fn, x, settings)
    assert seen == [x.shape] * 3  # traced once per copy, into one program
    assert timing.calls % 3 == 0 and len(timing.repeats) == 2 and timing.seconds > 0

    timed = []

    def fake_time_fn(compiled, *args, **kwargs):
        outs = compiled(*args)
        timed.append((len(args), len(outs), [float(o.sum()) for o in outs]))
        return bench.Timing(6.0, [6.0, 3.0], 5)

    monkeypatch.setattr(bench, "time_fn", fake_time_fn)
    timing = bench.time_per_call(fn, x, settings)
    assert timed == [(3, 3, [2 * float(x.sum())] * 3)]  # each copy holds the argument
    assert (timing.seconds, timing.repeats, timing.calls) == (2.0, [2.0, 1.0], 15)
    monkeypatch.undo()
    result = bench.bench_case(bench.parse_case("1x2x8x8:k2"), settings)
    rows = {r.impl: r for r in result.rows}
    assert rows["ours fwd"].calls % 3 == 0
    assert rows["ours fwd"].hlo_ops == ["custom-call:jax_avgpool_forward"]
    assert max(result.checks.values()) < 1e-5


def test_time_fn_chain() -> None:
    timing = bench.time_fn(lambda n: n + 1, 0, repeat=3, min_time=0.0, block=lambda _: None)
    assert len(timing.repeats) == 3 and timing.seconds > 0 and timing.calls >= 1


def test_train_step_bench() -> None:
    train = bench.train_step_bench(2, 8, (4, 8), FAST)
    assert train["custom_calls"] == {"forward": 2, "backward": 2}  # stem + 1 between stages
    assert train["ours_ms"] > 0 and train["xla_ms"] > 0 and train["speedup"] > 0
    assert train["xla_unfused_ms"] > 0 and train["speedup_vs_unfused"] > 0
    assert train["loss_ours"] == pytest.approx(train["loss_xla"], rel=1e-5)
    assert train["loss_xla_unfused"] == pytest.approx(train["loss_xla"], rel=1e-5)
    text = bench.format_train(train)
    assert "speed-up" in text and "unfused" in text


def test_cli_json(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "--case", "1x2x6x6:k2s2:f32:NHWC", "--repeat", "1", "--min-time", "0"]
    argv += ["--per-dispatch", "2"]
    assert cli.main([*argv, "--no-train", "--no-torch", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "1x2x6x6 k2s2 f32 NHWC" in printed.out and "[1/1]" in printed.err
    data = json.loads(out.read_text())
    (case,) = data["cases"]
    assert case["layout"] == "NHWC" and data["train"] is None
    assert {r["impl"] for r in case["rows"]} >= {"copy", "ours fwd", "ours bwd scatter"}
    assert all(r["us"] > 0 for r in case["rows"])
    assert data["settings"]["per_dispatch"] == 2
    assert all(r["calls_per_repeat"] % 2 == 0 for r in case["rows"])


def test_cli_rejects_bad_case(capsys) -> None:
    assert cli.main(["bench", "--case", "1x2x6x6:q2", "--no-train"]) == 2
    assert "window" in capsys.readouterr().err


def test_png_without_matplotlib(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    path = tmp_path / "x.png"
    assert bench.write_png([], str(path)) is False
    assert not path.exists() and "matplotlib" in capsys.readouterr().err


def test_no_kernels_for_platform(monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench, "kernel_platform", lambda: "rocm")  # never built
    args = argparse.Namespace(case=None, repeat=1, min_time=0.0, train=False, torch=False)
    args.json = args.png = None
    assert bench.run(args) == 2
    assert "no kernels" in capsys.readouterr().err
