"""``python -m jax_avgpool demo --devices N``: data parallel against one device.

The command runs in a child process with 4 CPU host devices
(``--xla_force_host_platform_device_count=4``), a few steps of each layout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from jax_avgpool import __main__ as cli

pytest.importorskip("sklearn")


def run_demo(tmp_path, devices: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    ).strip()
    return subprocess.run(
        [sys.executable, "-m", "jax_avgpool", "demo", *args],
        cwd=tmp_path,  # import the installed package
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_parses_as_before() -> None:
    args = cli.build_parser().parse_args(["demo"])
    assert args.devices is None and args.layout is None  # trains, NHWC
    args = cli.build_parser().parse_args(["demo", "--devices", "all", "--steps", "3"])
    assert (args.devices, args.steps) == ("all", 3)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["demo", "--devices", "0"])


def test_data_parallel_agrees_with_one_device(tmp_path) -> None:
    # 30 is not a multiple of 4: the command says so and uses 28.
    proc = run_demo(tmp_path, 4, "--devices", "4", "--steps", "2", "--batch-size", "30")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    out = proc.stdout
    assert "global batch 28 (7 per device)" in out, out
    for layout in ("NCHW", "NHWC"):
        section = out.split(f"{layout}:")[1].split(":\n")[0]
        assert "-> agree" in section, out
        assert re.search(r"median step: 1 device [\d.]+ ms, 4 devices [\d.]+ ms", section), out
        # The gradients are summed over devices; nothing else moves.
        seen = re.search(r"collectives in the 4-device step: (.*)", section)
        assert seen and seen.group(1).startswith("all-reduce x"), out
        assert "all-gather" not in seen.group(1).replace("(no all-gather)", ""), out


def test_more_devices_than_there_are(tmp_path) -> None:
    proc = run_demo(tmp_path, 2, "--devices", "3")
    assert proc.returncode != 0
    assert "only 2 local cpu device(s)" in proc.stderr and "device_count=3" in proc.stderr


def test_disagreement_fails(monkeypatch, capsys) -> None:
    from jax_avgpool import _demo as demo

    monkeypatch.setattr(demo, "TOLERANCE", -1.0)  # nothing agrees
    argv = ["demo", "--devices", "1", "--steps", "1", "--layout", "NHWC", "--batch-size", "8"]
    assert cli.main(argv) == 1
    assert "DISAGREE" in capsys.readouterr().out
