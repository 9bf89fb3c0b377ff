"""Shared fixtures and hooks of the jax_avgpool test suite.

* The suite tests the installed package (``pip install .`` builds its
  extension into site-packages). The report header says which copy is
  tested and whether its Python sources match the working tree.
* ``rng``: a NumPy generator seeded from the test's node id (and
  ``--avgpool-seed``); the seed is printed in the report of a failing test.
* ``x64``: enables 64-bit types for the duration of one test.
* ``@pytest.mark.gpu``: the test is skipped unless JAX sees a GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import cases
import jax
import numpy as np
import pytest

import jax_avgpool

ROOT = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------
# Options, markers, report header.


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--avgpool-seed",
        type=int,
        default=0,
        help="base seed mixed into every test's random inputs (default 0)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a GPU visible to JAX; skipped otherwise")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not cases.gpu_devices():
        pytest.skip("no GPU visible to JAX")


def _sources_match_working_tree() -> bool:
    installed = Path(jax_avgpool.__file__).resolve().parent
    for src in (ROOT / "jax_avgpool").glob("*.py"):
        other = installed / src.name
        if not other.exists() or other.read_bytes() != src.read_bytes():
            return False
    return True


def pytest_report_header(config: pytest.Config) -> list[str]:
    where = Path(jax_avgpool.__file__).resolve().parent
    note = "" if _sources_match_working_tree() else "  (WARNING: differs from ./jax_avgpool)"
    return [
        f"jax_avgpool {jax_avgpool.__version__} from {where}{note}",
        f"jax {jax.__version__}, devices {[d.platform for d in jax.devices()]}, "
        f"base seed {config.getoption('--avgpool-seed')}",
    ]


# --------------------------------------------------------------------------
# Random inputs, reproducible per test.


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A seed derived from the test's node id and ``--avgpool-seed``."""
    base = request.config.getoption("--avgpool-seed")
    digest = hashlib.sha256(f"{base}:{request.node.nodeid}".encode()).digest()
    value = int.from_bytes(digest[:8], "little")
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture
def rng(seed: int) -> np.random.Generator:
    """A fresh generator per test (see ``seed``)."""
    return np.random.default_rng(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator:
    report = yield
    if report.failed:
        for name, value in item.user_properties:
            if name == "seed":
                report.sections.append(
                    ("random seed", f"np.random.default_rng({value})  # from node id")
                )
    return report


# --------------------------------------------------------------------------
# 64-bit mode.


@pytest.fixture
def x64() -> Iterator[None]:
    """Run the test with ``jax_enable_x64`` on; the previous value is restored."""
    with jax.enable_x64(True):
        yield
