"""Loads the compiled extension and registers its FFI targets with XLA."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax
import jaxlib

FORWARD_TARGET = "jax_avgpool_forward"
BACKWARD_TARGET = "jax_avgpool_backward"

try:
    from . import _jax_avgpool as _ext
except ImportError as err:  # pragma: no cover - only without a build
    raise ImportError(
        "jax_avgpool's compiled extension (_jax_avgpool) could not be imported. "
        "Install the package with `pip install .` so that CMake builds it."
    ) from err

# XLA's platform names for the registrations the extension reports.
_XLA_PLATFORMS = {"cpu": "cpu", "cuda": "CUDA"}


def running_ffi_api() -> tuple[int, int] | None:
    """The XLA FFI API version (major, minor) of the running jaxlib.

    Read from the C API header that jaxlib ships with itself (the one a build
    against it would use); None where the header cannot be read or parsed.
    """
    header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
    try:
        text = header.read_text()
    except OSError:
        return None
    found = [re.search(rf"#define XLA_FFI_API_{part} (\d+)", text) for part in ("MAJOR", "MINOR")]
    if not all(found):
        return None
    return int(found[0].group(1)), int(found[1].group(1))


def ffi_api_mismatch(built: str, running: tuple[int, int] | None) -> str | None:
    """Why handlers built against FFI API ``built`` ("major.minor") cannot run
    under a jaxlib whose FFI API is ``running``, or None where they can.

    XLA takes handlers of its own major version and of its minor version or
    an older one; it refuses the others when a backend starts, which leaves
    that backend unusable for every program, not only this package's.
    """
    if running is None:
        return None
    major, minor = (int(v) for v in built.split("."))
    if major == running[0] and minor <= running[1]:
        return None
    return (
        f"jax_avgpool's extension was built against XLA FFI API {built}, and the "
        f"running jaxlib ({jaxlib.__version__}) takes API {running[0]}.{running[1]} or "
        f"older of the same major version. Rebuild jax_avgpool against this jaxlib "
        f"(`pip install --no-build-isolation --force-reinstall --no-deps .` from its "
        f"source) or install a jaxlib whose FFI API is {built} or newer."
    )


_mismatch = ffi_api_mismatch(_ext.build_info()["xla_ffi_api"], running_ffi_api())
if _mismatch is not None:
    raise ImportError(_mismatch)


def _register() -> tuple[str, ...]:
    # The handlers' state types first: a target whose instantiate stage
    # makes one is refused until its type is known.
    for platform, types in _ext.types().items():
        for name, registration in types.items():
            jax.ffi.register_ffi_type(name, registration, platform=_XLA_PLATFORMS[platform])
    platforms = []
    for platform, targets in _ext.registrations().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=_XLA_PLATFORMS[platform])
        platforms.append(platform)
    return tuple(platforms)


REGISTERED_PLATFORMS = _register()


# The element types' names in kernel ids.
DTYPE_NAMES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}


def kernel_id(op: str, geometry: dict[str, int], dtype: str) -> str:
    """Id of the kernel that ``op`` launches (cpp/kernel_spec.h names them)."""
    return _ext.kernel_id(op, geometry, dtype)


def cuda_scatter_needs_workspace(geometry: dict[str, int], dx: Any) -> bool:
    """Whether the CUDA scatter backward into ``dx`` (its abstract value) needs its workspace.

    Only a CUDA build has the answer, and only 16-bit types ever say yes: where
    the shared-memory tiles cannot add to dx itself with 16-bit atomics.
    The batch (every axis before the last three) does not change it.
    """
    attrs = {k: int(v) for k, v in geometry.items()}
    return bool(
        _ext.cuda_scatter_needs_workspace(attrs, list(dx.shape), DTYPE_NAMES[dx.dtype.name])
    )


def extension_info() -> dict[str, Any]:
    """What the extension says about its own build."""
    return dict(_ext.build_info())
