"""How XLA may split a pooling custom call over devices.

Pooling works on each (H, W) plane on its own: every axis but H and W is a
batch axis of the kernels. Both FFI targets are registered with XLA as
*batch partitionable*: when the operand is sharded over leading batch axes,
XLA's SPMD partitioner runs the custom call once per shard, on the local
block, with the same geometry (it is per image), and the result keeps the
operand's sharding. The number of such axes is a frontend attribute of the
call, ``num_batch_dims``: every axis before H, i.e. batch and channel for
NCHW, batch only for NHWC (its channel axis is the last one, after H and
W, where the batch partitioner cannot split).

Shardy (JAX's default partitioner) also needs a sharding rule on the call:
one factor per dimension, the H and W factors of operand and result marked
``need_replication`` so that a spatially sharded operand is gathered before
the call rather than pooled in pieces.

In explicit sharding mode the result's type carries the operand's sharding
(``aval.update`` keeps it, and shard_map's varying axes). An explicitly
sharded H or W axis stays sharded in the result's type, which is only
possible where the mesh axes divide the pooled size evenly; otherwise
abstract evaluation asks for a reshard.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.interpreters.mlir import ir

from ._geometry import Geometry


def _axis_size(mesh, entry) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    size = 1
    for name in names:
        size *= mesh.shape[name]
    return size


def check_spatial_sharding(aval, out_shape: Sequence[int], geometry: Geometry) -> None:
    """Explicitly sharded H/W axes must still divide evenly after pooling."""
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if not spec:
        return
    ndim = len(out_shape)
    for name, axis in zip("HW", geometry.spatial_axes, strict=True):
        d = ndim + axis
        entry = spec[d] if d < len(spec) else None
        if entry is None:
            continue
        parts = _axis_size(sharding.mesh, entry)
        if out_shape[d] % parts:
            fixed = [None if i == d else e for i, e in enumerate(spec)]
            raise ValueError(
                f"jax_avgpool: axis {d} ({name}) is explicitly sharded over mesh axes "
                f"{entry!r} ({parts} parts), which do not divide its pooled size "
                f"{out_shape[d]}; reshard it first, e.g. "
                f"jax.sharding.reshard(x, jax.sharding.PartitionSpec(*{fixed!r}))"
            )


def num_batch_dims(geometry: Geometry, ndim: int) -> int:
    """Leading axes of a rank-``ndim`` operand that the partitioner may split."""
    return ndim + geometry.spatial_axes[0]  # the axes before H


def _factor(k: int) -> str:
    # Shardy names factors i, j, ..., z, then z_1, z_2, ...
    return chr(ord("i") + k) if k < 18 else f"z_{k - 17}"


def sharding_rule(geometry: Geometry, in_shape: Sequence[int], out_shapes) -> ir.Attribute:
    """The ``sdy.sharding_rule`` of a call from ``in_shape`` to ``out_shapes``.

    All results share one shape (the CUDA 16-bit scatter adds a float32
    workspace shaped like its result).
    """
    ndim = len(in_shape)
    spatial = [ndim + a for a in geometry.spatial_axes]
    operand = [_factor(k) for k in range(ndim)]
    result = list(operand)
    for n, axis in enumerate(spatial):
        result[axis] = _factor(ndim + n)
    (out_shape,) = {tuple(s) for s in out_shapes}
    sizes = {operand[d]: in_shape[d] for d in range(ndim)}
    sizes.update({result[d]: out_shape[d] for d in spatial})
    replicated = [operand[d] for d in spatial] + [result[d] for d in spatial]
    results = ", ".join(f"[{', '.join(result)}]" for _ in out_shapes)
    text = (
        f"#sdy.op_sharding_rule<([{', '.join(operand)}])->({results}) "
        f"{{{', '.join(f'{k}={v}' for k, v in sizes.items())}}} "
        f"need_replication={{{', '.join(replicated)}}}, custom>"
    )
    return ir.Attribute.parse(text)


def call_attributes(ctx, geometry: Geometry, avals_out) -> dict[str, ir.Attribute]:
    """The extra attributes that make the custom call batch partitionable."""
    (x,) = ctx.avals_in
    nbd = num_batch_dims(geometry, x.ndim)
    attrs = {
        "mhlo.frontend_attributes": ir.DictAttr.get({"num_batch_dims": ir.StringAttr.get(str(nbd))})
    }
    if getattr(jax.config, "jax_use_shardy_partitioner", True):
        attrs["sdy.sharding_rule"] = sharding_rule(geometry, x.shape, [a.shape for a in avals_out])
    return attrs


def register(targets: Sequence[str]) -> None:
    for target in targets:
        jax.ffi.register_ffi_target_as_batch_partitionable(target)
