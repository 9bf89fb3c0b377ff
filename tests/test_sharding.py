"""Pooling on sharded arrays, on 8 CPU host devices.

The checks run in one child process started with
``--xla_force_host_platform_device_count=8`` (the rest of the suite keeps
JAX's default device count); it prints one JSON object of results that the
tests below assert on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")

CHILD = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from jax_avgpool import avg_pool, avg_pool2d

    COLLECTIVES = @COLLECTIVES@
    assert jax.device_count() == 8, jax.devices()
    out = {}
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def collectives(fn, *args):
        text = jax.jit(fn).lower(*args).compile().as_text()
        return [c for c in COLLECTIVES if c in text]

    def names(spec, ndim):
        entries = [None if e is None else str(e) for e in spec]
        return entries + [None] * (ndim - len(entries))

    def spec(a):
        return names(a.sharding.spec, a.ndim)

    def pool(layout, backward):
        return lambda t: avg_pool2d(t, 3, 2, 1, layout=layout, backward=backward)

    def loss(layout, backward):
        return lambda t: jnp.sum(jnp.sin(pool(layout, backward)(t)))

    def check(x0, x, f, g, reference=None):
        # jit(f) and jit(g) on sharded x against the reference pair on unsharded x0.
        f0, g0 = reference or (f, g)
        y, dx = jax.jit(f)(x), jax.jit(g)(x)
        return dict(
            spec_in=spec(x),
            spec_y=spec(y),
            spec_dx=spec(dx),
            collectives_fwd=collectives(f, x),
            collectives_bwd=collectives(g, x),
            y_equal=bool(np.array_equal(np.asarray(y), np.asarray(f0(x0)))),
            dx_equal=bool(np.array_equal(np.asarray(dx), np.asarray(g0(x0)))),
        )

    CASES = {
        "nchw_batch_channel": ("NCHW", (4, 8, 10, 9), P("data", "model", None, None)),
        "nhwc_batch": ("NHWC", (8, 10, 9, 4), P(("data", "model"), None, None, None)),
        "nhwc_batch_channel": ("NHWC", (4, 10, 9, 8), P("data", None, None, "model")),
        "nhwc_channel": ("NHWC", (3, 10, 9, 8), P(None, None, None, ("model", "data"))),
        "nchw_h": ("NCHW", (2, 3, 16, 9), P(None, None, "model", None)),
        "nhwc_w": ("NHWC", (2, 9, 16, 3), P(None, None, "data", None)),
        "nhwc_h_channel": ("NHWC", (2, 16, 9, 8), P(None, "data", None, "model")),
    }
    for name, (layout, shape, pspec) in CASES.items():
        x0 = np.asarray(jax.random.normal(jax.random.key(1), shape))
        x = jax.device_put(x0, NamedSharding(mesh, pspec))
        for backward in ("gather", "scatter"):
            f, g = pool(layout, backward), jax.grad(loss(layout, backward))
            out[f"{name}/{backward}"] = check(x0, x, f, g)

    # NHWC, rank 5 (a vmapped avg_pool2d, Flax-style avg_pool), channel sharded.
    x0 = np.asarray(jax.random.normal(jax.random.key(5), (2, 3, 10, 9, 8)))
    x = jax.device_put(x0, NamedSharding(mesh, P("data", None, None, None, "model")))
    for backward in ("gather", "scatter"):
        f = jax.vmap(pool("NHWC", backward))
        out[f"nhwc_rank5_channel/{backward}"] = check(
            x0, x, f, jax.grad(lambda t: jnp.sum(jnp.sin(f(t))))
        )
    f = lambda t: avg_pool(t, (3, 3), strides=(2, 2), padding="SAME")
    out["flax_rank5_channel"] = check(x0, x, f, jax.grad(lambda t: jnp.sum(jnp.sin(f(t)))))

    # GSPMD instead of Shardy (while JAX has it): the same shards, the same values.
    if hasattr(jax.config, "jax_use_shardy_partitioner"):
        jax.config.update("jax_use_shardy_partitioner", False)
        layout, shape, pspec = CASES["nhwc_batch_channel"]
        x0 = np.asarray(jax.random.normal(jax.random.key(1), shape))
        x = jax.device_put(x0, NamedSharding(mesh, pspec))
        for backward in ("gather", "scatter"):
            f, g = pool(layout, backward), jax.grad(loss(layout, backward))
            out[f"gspmd_nhwc_batch_channel/{backward}"] = check(x0, x, f, g)
        jax.config.update("jax_use_shardy_partitioner", True)

    # One device: the plain custom call, nothing around it.
    x = jnp.ones((2, 8, 8, 4))
    g = jax.grad(lambda t: jnp.sum(avg_pool2d(t, 2, layout="NHWC") ** 2))
    text = jax.jit(g).lower(x).as_text()
    out["single_device"] = dict(
        forward=text.count("@jax_avgpool_forward"),
        backward=text.count("@jax_avgpool_backward"),
        custom_calls=text.count("stablehlo.custom_call"),
    )

    # vmap of grad over a sharded leading axis; Flax-style avg_pool, rank 5.
    x0 = np.asarray(jax.random.normal(jax.random.key(2), (2, 4, 8, 6, 6)))
    x = jax.device_put(x0, NamedSharding(mesh, P("data", "model")))
    f = jax.vmap(jax.grad(lambda t: jnp.sum(avg_pool2d(t, 2) ** 2)))
    h = lambda t: avg_pool(t, (3, 3), padding="SAME")
    out["vmap_grad"] = dict(
        spec=spec(jax.jit(f)(x)),
        collectives=collectives(f, x),
        equal=bool(np.array_equal(np.asarray(jax.jit(f)(x)), np.asarray(f(x0)))),
    )
    out["flax_rank5"] = dict(
        spec=spec(jax.jit(h)(x)),
        collectives=collectives(h, x),
        equal=bool(np.array_equal(np.asarray(jax.jit(h)(x)), np.asarray(h(x0)))),
    )

    # Explicit sharding mode: the types carry the shardings.
    emesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    x0 = np.asarray(jax.random.normal(jax.random.key(3), (4, 8, 8, 8)))
    with jax.set_mesh(emesh):
        res = {}
        for name, layout, pspec in (
            ("bc", "NCHW", P("data", "model")),
            ("h", "NCHW", P(None, None, "model")),
            ("nhwc_bc", "NHWC", P("data", None, None, "model")),
        ):
            x = jax.device_put(x0, pspec)
            f = lambda t: avg_pool2d(t, 2, layout=layout)
            h = lambda t: avg_pool2d(t, 2, layout=layout, backward="scatter")
            g = jax.grad(lambda t: jnp.sum(h(t) ** 2))
            y, dx = jax.jit(f)(x), jax.jit(g)(x)
            res[name] = dict(
                type_y=names(jax.typeof(y).sharding.spec, y.ndim),
                type_dx=names(jax.typeof(dx).sharding.spec, dx.ndim),
                type_eager=names(jax.typeof(f(x)).sharding.spec, 4),
                collectives=collectives(f, x) + collectives(g, x),
                y_equal=bool(np.array_equal(np.asarray(y), np.asarray(f(x0)))),
                dx_equal=bool(np.array_equal(np.asarray(dx), np.asarray(g(x0)))),
            )
        try:
            x12 = jax.device_put(np.zeros((4, 8, 12, 8), np.float32), P(None, None, "model"))
            jax.jit(lambda t: avg_pool2d(t, 2))(x12)  # H: 12 -> 6, not over 4 devices
            res["uneven"] = None
        except ValueError as err:
            res["uneven"] = str(err)
        out["explicit"] = res

    # shard_map over a pooling call, forward and backward.
    mesh8 = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    x0 = np.asarray(jax.random.normal(jax.random.key(4), (16, 3, 8, 8)))
    x = jax.device_put(x0, NamedSharding(mesh8, P("d")))
    sm = jax.shard_map(lambda t: avg_pool2d(t, 2), mesh=mesh8, in_specs=P("d"), out_specs=P("d"))
    g = jax.grad(lambda t: jnp.sum(sm(t) ** 2))
    gref = jax.grad(lambda t: jnp.sum(avg_pool2d(t, 2) ** 2))
    out["shard_map"] = dict(
        y_equal=bool(np.array_equal(np.asarray(jax.jit(sm)(x)), np.asarray(avg_pool2d(x0, 2)))),
        dx_equal=bool(np.array_equal(np.asarray(jax.jit(g)(x)), np.asarray(gref(x0)))),
        spec=spec(jax.jit(g)(x)),
        collectives=collectives(g, x),
    )

    # shard_map manual over "data" only: XLA still splits the rest ("model").
    for layout, pspec in (("NCHW", P("data", "model")), ("NHWC", P("data", None, None, "model"))):
        x0 = np.asarray(jax.random.normal(jax.random.key(6), (4, 8, 8, 8)))
        x = jax.device_put(x0, NamedSharding(mesh, pspec))
        f = pool(layout, "gather")
        sm = jax.shard_map(
            f, mesh=mesh, in_specs=P("data"), out_specs=P("data"), axis_names={"data"}
        )
        g = jax.grad(lambda t: jnp.sum(jnp.sin(sm(t))))
        reference = (f, jax.grad(loss(layout, "gather")))
        out[f"shard_map_partial/{layout}"] = check(x0, x, sm, g, reference)
    print(json.dumps(out))
    """
).replace("@COLLECTIVES@", repr(COLLECTIVES))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=tmp_path_factory.mktemp("sharding"),  # import the installed package
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"child failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


PER_SHARD = (
    "nchw_batch_channel",
    "nhwc_batch",
    "nhwc_batch_channel",
    "nhwc_channel",
    "nhwc_rank5_channel",
    "gspmd_nhwc_batch_channel",
)
BACKWARDS = ("gather", "scatter")


def assert_per_shard(r: dict) -> None:
    """Same values as unsharded, same sharding in and out, no collective."""
    assert r["y_equal"] and r["dx_equal"], r
    assert r["spec_y"] == r["spec_in"] and r["spec_dx"] == r["spec_in"], r
    assert r["collectives_fwd"] == [], r
    assert r["collectives_bwd"] == [], r


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("case", PER_SHARD)
def test_batch_and_channel_shards_pool_without_communication(results, case, backward):
    if case.startswith("gspmd") and f"{case}/{backward}" not in results:
        pytest.skip("this JAX has no GSPMD partitioner")
    assert_per_shard(results[f"{case}/{backward}"])


def test_flax_avg_pool_rank5_channel_sharded(results):
    assert_per_shard(results["flax_rank5_channel"])


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("case", ("nchw_h", "nhwc_w", "nhwc_h_channel"))
def test_spatial_shards_give_the_unsharded_result(results, case, backward):
    """H and W shards are gathered for the call: the values are unchanged."""
    r = results[f"{case}/{backward}"]
    assert r["y_equal"] and r["dx_equal"], r


def test_single_device_lowers_to_the_plain_call(results):
    assert results["single_device"] == dict(forward=1, backward=1, custom_calls=2)


def test_vmap_of_grad_on_sharded_batch(results):
    r = results["vmap_grad"]
    assert r["equal"], r
    assert r["spec"] == ["data", "model", None, None, None], r
    assert r["collectives"] == [], r


def test_flax_avg_pool_rank5_sharded(results):
    r = results["flax_rank5"]
    assert r["equal"], r
    assert r["spec"] == ["data", "model", None, None, None], r
    assert r["collectives"] == [], r


@pytest.mark.parametrize(
    "case, sharding",
    [("bc", ["data", "model", None, None]), ("nhwc_bc", ["data", None, None, "model"])],
)
def test_explicit_mode_types_carry_the_sharding(results, case, sharding):
    r = results["explicit"][case]
    assert r["y_equal"] and r["dx_equal"], r
    assert r["type_y"] == r["type_dx"] == r["type_eager"] == sharding, r
    assert r["collectives"] == [], r


def test_explicit_mode_spatial_sharding(results):
    r = results["explicit"]["h"]
    assert r["y_equal"] and r["dx_equal"], r
    assert r["type_y"] == r["type_dx"] == [None, None, "model", None], r
    assert "reshard" in results["explicit"]["uneven"], results["explicit"]


def test_shard_map(results):
    r = results["shard_map"]
    assert r["y_equal"] and r["dx_equal"], r
    assert r["spec"] == ["d", None, None, None], r
    assert r["collectives"] == [], r


@pytest.mark.parametrize("layout", ("NCHW", "NHWC"))
def test_shard_map_partially_manual(results, layout):
    """Manual over "data": the channel shards over "model" still pool in place."""
    assert_per_shard(results[f"shard_map_partial/{layout}"])
