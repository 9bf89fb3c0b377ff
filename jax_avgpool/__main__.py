"""Command line: ``python -m jax_avgpool {bench,demo,info}``.

Every subcommand is one :class:`Subcommand` entry in :data:`SUBCOMMANDS`: a
help line, a function that adds its options to its parser (argparse only,
nothing heavy), and a function that runs it. Run functions import their
module only when called, so parsing the command line and ``info`` stay fast
whatever the other subcommands need. Adding one is adding an entry whose
run function is ``_lazy("jax_avgpool._<module>", "run")``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

RunFn = Callable[[argparse.Namespace], int | None]


class Subcommand(NamedTuple):
    """One subcommand: its help line, its options and what runs it."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: RunFn


def _lazy(module: str, function: str) -> RunFn:
    """A run function that imports ``module`` only when it is called."""

    def run(args: argparse.Namespace) -> int | None:
        return getattr(importlib.import_module(module), function)(args)

    return run


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    """argparse type: a float >= 0."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--case",
        action="append",
        metavar="SHAPE:WINDOW[:DTYPE[:LAYOUT]]",
        help="a case to run instead of the defaults, repeatable: SHAPE in the layout's order, "
        "WINDOW k<kernel>[s<stride>][p<padding>] (each N or HxW; stride defaults to the "
        "kernel), DTYPE f16|bf16|f32|f64 (default f32), LAYOUT NCHW|NHWC (default NCHW); "
        "e.g. 8x16x32x32:k3s2:f32:NCHW or 16x56x56x64:k3s2p1:bf16:NHWC",
    )
    parser.add_argument(
        "--repeat", type=_positive_int, default=7, help="timed repeats (default: 7)"
    )
    parser.add_argument(
        "--min-time",
        type=_non_negative_float,
        default=0.05,
        metavar="SECONDS",
        help="each repeat lasts at least this long; sizes the calls per repeat (default: 0.05)",
    )
    parser.add_argument(
        "--per-dispatch",
        type=_positive_int,
        default=None,
        metavar="K",
        help="calls of each JAX program per dispatch, on K copies of its argument, so that "
        "Python's dispatch does not pace short calls (default: 8 on an accelerator, 1 on "
        "the CPU)",
    )
    parser.add_argument("--json", metavar="PATH", help="write every number to PATH as JSON")
    parser.add_argument(
        "--png", metavar="PATH", help="write a bar chart to PATH (needs matplotlib)"
    )
    parser.add_argument(
        "--no-train", dest="train", action="store_false", help="skip the training-step timing"
    )
    parser.add_argument(
        "--no-torch", dest="torch", action="store_false", help="skip PyTorch even where installed"
    )


def _info_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the build info as JSON")


def _info(args: argparse.Namespace) -> int:
    """Print :func:`jax_avgpool.build_info` as ``key: value`` lines or JSON."""
    from . import build_info

    info = build_info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(map(len, info)) + 1
    for key, value in info.items():
        if isinstance(value, bool):
            value = "yes" if value else "no"
        elif isinstance(value, list | tuple):
            value = ", ".join(map(str, value)) or "-"
        print(f"{key + ':':<{width}} {value}")
    return 0


def _devices(text: str) -> str:
    """argparse type: ``all`` or an int >= 1."""
    if text == "all":
        return text
    return str(_positive_int(text))


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=_positive_int, default=10, help="default: 10")
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=64,
        help="global batch (default: 64); with --devices N, rounded down to a multiple of N",
    )
    parser.add_argument("--seed", type=int, default=0, help="data split and init (default: 0)")
    parser.add_argument(
        "--layout",
        choices=("NCHW", "NHWC"),
        default=None,
        help="default: NHWC; with --devices, both one after the other",
    )
    parser.add_argument(
        "--no-compare",
        dest="compare",
        action="store_false",
        help="skip the timing against jax.lax.reduce_window",
    )
    parser.add_argument(
        "--devices",
        type=_devices,
        metavar="N",
        help="instead of training: run the training step data parallel on N local devices "
        "(or 'all'), batch sharded and parameters replicated, and on one device; check that "
        "losses and parameters agree (exit status 1 if not) and time both",
    )
    parser.add_argument(
        "--steps",
        type=_positive_int,
        default=20,
        help="with --devices: steps run, compared and timed on each side (default: 20)",
    )


SUBCOMMANDS: dict[str, Subcommand] = {
    "bench": Subcommand(
        "time our kernels against XLA's reduce_window, a device copy and PyTorch",
        _bench_arguments,
        _lazy("jax_avgpool._bench", "run"),
    ),
    "demo": Subcommand(
        "train a small CNN on scikit-learn's 8x8 digits with avg_pool2d",
        _demo_arguments,
        _lazy("jax_avgpool._demo", "run"),
    ),
    "info": Subcommand(
        "show how this installation was built",
        _info_arguments,
        _info,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The parser with one subparser per entry of :data:`SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="python -m jax_avgpool",
        description="2-D average pooling for JAX as XLA FFI kernels.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand, return its status."""
    args = build_parser().parse_args(argv)
    return args.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
