"""The two primitives: average pooling and its transpose.

Pooling is linear in its input, so the forward primitive's JVP is itself and
its transpose is the backward primitive; the backward primitive's transpose
is the forward one. That pair is all JAX needs for ``grad``, ``jvp``,
``jacfwd``/``jacrev``, ``hessian`` and any higher order.

Both primitives take an array of rank >= 3 whose last three axes are
(C, H, W) or (H, W, C) by the geometry's layout; every leading axis is a
batch axis, folded into one by the kernels. ``vmap`` therefore only has to
place the mapped axis among the leading ones, which costs nothing when it is
already there.

Each lowers to its FFI custom call, made batch partitionable; an NHWC call
that XLA partitions over several devices is lowered through custom
partitioning instead (see ``_sharding``), whose per-device body is
:data:`local_p`, the plain call. ``local_p`` exists only while lowering.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _ffi, _sharding
from ._geometry import Geometry

pool_p = Primitive("jax_avgpool_pool")
pool_transpose_p = Primitive("jax_avgpool_pool_transpose")


@functools.lru_cache(maxsize=256)
def _compiled(prim: Primitive, geometry: Geometry):
    return jax.jit(functools.partial(prim.bind, geometry=geometry))


def _impl(prim: Primitive):
    def impl(x, *, geometry: Geometry):
        return _compiled(prim, geometry)(x)

    return impl


def _check_operand(x, geometry: Geometry, expected_hw, role: str) -> None:
    if x.ndim < 3:
        raise ValueError(f"{role} must have rank >= 3, got shape {x.shape}")
    if tuple(geometry.spatial(x.shape)) != tuple(expected_hw):
        raise ValueError(
            f"{role} has spatial size {geometry.spatial(x.shape)} but the pooling geometry "
            f"expects {tuple(expected_hw)}"
        )


def _pool_abstract_eval(x, *, geometry: Geometry):
    _check_operand(x, geometry, geometry.in_hw, "x")
    shape = geometry.with_spatial(x.shape, geometry.out_hw)
    _sharding.check_spatial_sharding(x, shape, geometry)
    return x.update(shape=shape)


def _pool_transpose_abstract_eval(dy, *, geometry: Geometry):
    _check_operand(dy, geometry, geometry.out_hw, "dy")
    shape = geometry.with_spatial(dy.shape, geometry.in_hw)
    _sharding.check_spatial_sharding(dy, shape, geometry)
    return dy.update(shape=shape)


_SIXTEEN_BIT = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def _emit(platform: str, ctx, x, geometry: Geometry, transpose: bool, partitionable: bool):
    """The FFI custom call itself: forward, or backward when ``transpose``."""

    def extra(ctx):
        return _sharding.call_attributes(ctx, geometry, ctx.avals_out) if partitionable else {}

    if not transpose:
        lower = jax.ffi.ffi_lowering(_ffi.FORWARD_TARGET, extra_attributes=extra(ctx))
        return lower(ctx, x, geometry=geometry.attributes())
    attrs = dict(geometry=geometry.attributes(), strategy=geometry.strategy_attribute())
    (dx,) = ctx.avals_out
    if (
        platform == "cuda"
        and geometry.backward == "scatter"
        and dx.dtype in _SIXTEEN_BIT
        and _ffi.cuda_scatter_needs_workspace(geometry.attributes(), dx)
    ):
        # Where its shared-memory tiles cannot add to a 16-bit dx directly,
        # the CUDA scatter accumulates with float32 atomics: XLA provides
        # the float32 workspace as a second result.
        workspace = dx.update(dtype=np.dtype(np.float32), weak_type=False)
        ctx = ctx.replace(avals_out=[dx, workspace])
        lower = jax.ffi.ffi_lowering(_ffi.BACKWARD_TARGET, extra_attributes=extra(ctx))
        return lower(ctx, x, **attrs)[:1]
    lower = jax.ffi.ffi_lowering(_ffi.BACKWARD_TARGET, extra_attributes=extra(ctx))
    return lower(ctx, x, **attrs)


# The plain call on one device's block: what each device runs when an NHWC
# call is custom partitioned (_sharding.channels_last_call). Only ever bound
# while lowering, so it needs no implementation or transformation rules.
local_p = Primitive("jax_avgpool_local")


def _local_abstract_eval(x, *, geometry: Geometry, transpose: bool):
    in_hw, out_hw = (
        (geometry.out_hw, geometry.in_hw) if transpose else (geometry.in_hw, geometry.out_hw)
    )
    _check_operand(x, geometry, in_hw, "dy" if transpose else "x")
    return x.update(shape=geometry.with_spatial(x.shape, out_hw))


def _local_lowering(platform: str):
    def lowering(ctx, x, *, geometry: Geometry, transpose: bool):
        return _emit(platform, ctx, x, geometry, transpose, partitionable=False)

    return lowering


_per_shard_call = _sharding.channels_last_call(
    lambda x, geometry, transpose: local_p.bind(x, geometry=geometry, transpose=transpose)
)


def _lowering(transpose: bool):
    def for_platform(platform: str):
        def lowering(ctx, x, *, geometry: Geometry):
            if _sharding.partitions_per_shard(ctx, geometry):
                return _sharding.lower_per_shard(ctx, x, _per_shard_call, geometry, transpose)
            return _emit(platform, ctx, x, geometry, transpose, partitionable=True)

        return lowering

    return for_platform


def _pool_transpose_rule(ct, x, *, geometry: Geometry):
    assert ad.is_undefined_primal(x)
    return [pool_transpose_p.bind(ct, geometry=geometry)]


def _pool_transpose_transpose_rule(ct, dy, *, geometry: Geometry):
    assert ad.is_undefined_primal(dy)
    return [pool_p.bind(ct, geometry=geometry)]


def _unavailable_lowering(platform: str):
    def lowering(ctx, *args, **params):
        raise NotImplementedError(
            f"jax_avgpool has no {platform} kernels in this build "
            f"(built for: {', '.join(_ffi.REGISTERED_PLATFORMS)}). Rebuild it where a CUDA "
            "compiler is available (JAX_AVGPOOL_CUDA=ON pip install .), or place the arrays "
            "on the CPU."
        )

    return lowering


def _batcher(prim: Primitive):
    def rule(args, dims, *, geometry: Geometry):
        (x,), (d,) = args, dims
        # The last three axes are pooled; any other axis is a batch axis.
        if d >= x.ndim - 3:
            x = jnp.moveaxis(x, d, 0)
            d = 0
        return prim.bind(x, geometry=geometry), d

    return rule


_sharding.register((_ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET), (pool_p, pool_transpose_p))

for _prim, _abstract, _lower, _transpose in (
    (pool_p, _pool_abstract_eval, _lowering(transpose=False), _pool_transpose_rule),
    (
        pool_transpose_p,
        _pool_transpose_abstract_eval,
        _lowering(transpose=True),
        _pool_transpose_transpose_rule,
    ),
    (local_p, _local_abstract_eval, _local_lowering, None),
):
    _prim.def_abstract_eval(_abstract)
    for _platform in ("cpu", "cuda", "rocm"):
        if _platform in _ffi.REGISTERED_PLATFORMS:
            mlir.register_lowering(_prim, _lower(_platform), platform=_platform)
        else:
            mlir.register_lowering(_prim, _unavailable_lowering(_platform), platform=_platform)
    if _transpose is not None:
        _prim.def_impl(_impl(_prim))
        ad.deflinear2(_prim, _transpose)
        batching.primitive_batchers[_prim] = _batcher(_prim)
