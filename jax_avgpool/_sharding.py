"""How XLA may split a pooling custom call over devices.

Pooling works on each (H, W) plane on its own: every axis but H and W is a
batch axis of the kernels, so a shard that holds whole planes is pooled on
its device with the same geometry (it is per image), and the result keeps
the operand's sharding. Two mechanisms tell XLA so.

*Leading axes* (NCHW: batch and channel; NHWC: batch). Both FFI targets are
registered with XLA as *batch partitionable*: when the operand is sharded
over leading axes, XLA's SPMD partitioner runs the custom call once per
shard, on the local block. The number of such axes is a frontend attribute
of the call, ``num_batch_dims``: every axis before H. This needs no Python
at compile time, and it is all that NCHW uses.

*The NHWC channel axis* comes after H and W, where the batch partitioner
cannot split. So where XLA partitions an NHWC call over several devices
(under ``jit``, or over the automatic axes of a ``shard_map`` with Shardy),
the primitives' lowering wraps it in ``jax.experimental.custom_partitioning``
(:func:`channels_last_call`): its Shardy rule and GSPMD callbacks keep the
operand's sharding on every axis but H and W, which are replicated, and its
partition callback emits the plain custom call on each device's block. The
wrapper exists only in the lowering, so ``grad``, ``vmap`` and the other
transformations see our two primitives alone, and a single-device program,
a fully manual ``shard_map`` body or ``pmap`` get the plain custom call.

custom_partitioning needs the devices when it is lowered, which JAX grants
to the primitives in its registry of such primitives (:func:`register`; the
one name taken from ``jax._src``, as JAX's own cuDNN attention does). The
cost: a program with our primitives cannot be lowered for an
``AbstractMesh`` alone. Where the registry is missing, or for ``jax.export``
(the callbacks cannot be serialized), NHWC calls stay batch partitionable:
correct, with the channel axis gathered.

Shardy (JAX's default partitioner) also needs a sharding rule on the plain
call: one factor per dimension, the H and W factors of operand and result
marked ``need_replication`` so that a spatially sharded operand is gathered
before the call rather than pooled in pieces.

In explicit sharding mode the result's type carries the operand's sharding
(``aval.update`` keeps it, and shard_map's varying axes). An explicitly
sharded H or W axis stays sharded in the result's type, which is only
possible where the mesh axes divide the pooled size evenly; otherwise
abstract evaluation asks for a reshard.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.interpreters.mlir import ir
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._geometry import Geometry

try:  # primitives whose lowering needs the device assignment (custom_partitioning's)
    from jax._src.dispatch import prim_requires_devices_during_lowering as _NEEDS_DEVICES
except ImportError:  # pragma: no cover - not in this JAX
    _NEEDS_DEVICES = None


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


def _shardy() -> bool:
    return bool(getattr(jax.config, "jax_use_shardy_partitioner", True))


def call_attributes(ctx, geometry: Geometry, avals_out) -> dict[str, ir.Attribute]:
    """The extra attributes that make the custom call batch partitionable."""
    (x,) = ctx.avals_in
    nbd = num_batch_dims(geometry, x.ndim)
    attrs = {
        "mhlo.frontend_attributes": ir.DictAttr.get({"num_batch_dims": ir.StringAttr.get(str(nbd))})
    }
    if _shardy():
        attrs["sdy.sharding_rule"] = sharding_rule(geometry, x.shape, [a.shape for a in avals_out])
    return attrs


def register(targets: Sequence[str], primitives: Sequence) -> None:
    """Make ``targets`` batch partitionable; let ``primitives`` see devices when lowered."""
    for target in targets:
        jax.ffi.register_ffi_target_as_batch_partitionable(target)
    if isinstance(_NEEDS_DEVICES, set):
        _NEEDS_DEVICES.update(primitives)


# ---------------------------------------------------------------------------
# NHWC: custom partitioning that keeps batch and channel shards.


def _lowering_devices(ctx) -> int:
    """Devices that XLA's partitioner may split this call over (0: unknown).

    Under ``jit`` the context knows its device assignment when some primitive
    asked for it (see :func:`register`); inside ``shard_map`` only the mesh
    axes that are not manual count; ``pmap`` leaves nothing to partition.
    """
    context = ctx.module_context.axis_context
    manual = getattr(context, "manual_axes", None)
    if manual is not None:  # inside shard_map: only its automatic axes are left to XLA
        if not _shardy():  # GSPMD hands partially manual shardings to the callbacks
            return 0
        mesh = context.mesh
        return int(np.prod([mesh.shape[a] for a in mesh.axis_names if a not in manual]))
    devices = getattr(context, "device_assignment", None)
    return len(devices) if devices else 0


def partitions_per_shard(ctx, geometry: Geometry) -> bool:
    """Whether to lower through :func:`channels_last_call`'s custom partitioning.

    Not for ``jax.export``: custom partitioning's compile-time callbacks
    cannot be serialized, so exported NHWC calls stay batch partitionable.
    """
    parameters = getattr(ctx.module_context, "lowering_parameters", None)
    if getattr(parameters, "for_export", False):
        return False
    return geometry.layout == "NHWC" and _lowering_devices(ctx) > 1


def _whole_planes(sharding, shape: Sequence[int], geometry: Geometry):
    """``sharding`` with H and W replicated: every other axis keeps its shards."""
    ndim = len(shape)
    if isinstance(sharding, NamedSharding):
        spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
        for axis in geometry.spatial_axes:
            spec[ndim + axis] = None
        return NamedSharding(sharding.mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)
    if sharding is None or _keeps_planes(sharding, shape, geometry):
        return sharding
    # Not over a named mesh (none in context), and H or W split: replicate.
    devices = np.array(sorted(sharding.device_set, key=lambda d: d.id))
    return NamedSharding(Mesh(devices, ("devices",)), PartitionSpec())


def _keeps_planes(sharding, shape: Sequence[int], geometry: Geometry) -> bool:
    """Whether every shard of an array of ``shape`` holds whole (H, W) planes."""
    try:
        block = sharding.shard_shape(tuple(shape))
    except (ValueError, NotImplementedError):  # uneven or not a tiling
        return False
    return all(block[a] == shape[a] for a in geometry.spatial_axes)


def _infer_sharding(geometry, transpose, mesh, arg_shapes, result_shape):
    (x,) = arg_shapes
    return _whole_planes(x.sharding, x.shape, geometry)


def _propagate_user_sharding(geometry, transpose, mesh, user_shape):
    return _whole_planes(user_shape.sharding, user_shape.shape, geometry)


def _partition(local: Callable, geometry, transpose, mesh, arg_shapes, result_shape):
    (x,) = arg_shapes
    sharding = _whole_planes(x.sharding, x.shape, geometry)
    if isinstance(sharding, NamedSharding) and mesh.empty:
        mesh = sharding.mesh

    def lower_fn(block):
        return local(block, geometry, transpose)

    return mesh, lower_fn, sharding, (sharding,)


# Shardy: batch and channel factors pass through, H and W need replication
# (the result's H and W are other factors: their sizes change).
_SHARDY_RULE = "... h w c -> ... p q c"
_SHARDY_REPLICATED = ("h", "w", "p", "q")


def channels_last_call(local: Callable) -> Callable:
    """``call(geometry, transpose, x)``: ``local`` under NHWC custom partitioning.

    ``local(x, geometry, transpose)`` binds the plain (unpartitioned) call on
    a block; XLA runs it once per device on blocks that hold whole (H, W)
    planes, and the result keeps the operand's batch and channel sharding.
    """

    def call(geometry: Geometry, transpose: bool, x):
        return local(x, geometry, transpose)

    wrapped = custom_partitioning(call, static_argnums=(0, 1))
    wrapped.def_partition(
        partition=functools.partial(_partition, local),
        infer_sharding_from_operands=_infer_sharding,
        propagate_user_sharding=_propagate_user_sharding,
        sharding_rule=_SHARDY_RULE,
        need_replication_factors=_SHARDY_REPLICATED,
    )
    return wrapped


def lower_per_shard(ctx, x, call: Callable, geometry: Geometry, transpose: bool):
    """Lower ``call(geometry, transpose, x)`` (see :func:`channels_last_call`)."""
    return mlir.lower_fun(lambda t: call(geometry, transpose, t), multiple_results=False)(ctx, x)
