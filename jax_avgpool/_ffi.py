"""Loads the compiled extension and registers its FFI targets with XLA."""

from __future__ import annotations

from typing import Any

import jax

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


def _register() -> tuple[str, ...]:
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
