"""The FFI handlers reject inconsistent calls with an error (not a crash); build_info()."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

import jax_avgpool
from jax_avgpool import _ffi, avg_pool2d

# Geometry of every call: kernel 2, stride 2, NCHW, on a (2, 3, 8, 7) image,
# whose pooled shape is (2, 3, 4, 3).
X_SHAPE, Y_SHAPE = (2, 3, 8, 7), (2, 3, 4, 3)


def call(expect: str, **changes) -> dict:
    """One FFI call: a forward call on consistent shapes, with ``changes``.

    ``attrs`` changes the geometry attributes (None drops one); ``expect`` is
    a fragment of the expected error message.
    """
    spec = dict(
        kind="forward", in_shape=X_SHAPE, in_dtype="float32", out_shape=Y_SHAPE,
        out_dtype="float32", attrs={}, strategy=None, expect=expect,
    )  # fmt: skip
    spec.update(changes)
    return spec


def backward_call(expect: str, **changes) -> dict:
    """A backward call (dy -> dx), gather strategy unless changed."""
    return call(
        expect,
        **{"kind": "backward", "in_shape": Y_SHAPE, "out_shape": X_SHAPE, "strategy": 0, **changes},
    )


BAD_CALLS = {
    "out-height": call("pooled size", out_shape=(2, 3, 5, 3)),
    "out-width": call("pooled size", out_shape=(2, 3, 4, 4)),
    "out-batch": call("leading dimensions", out_shape=(3, 3, 4, 3)),
    "out-channels": call("channel", out_shape=(2, 4, 4, 3)),
    "out-rank": call("rank", out_shape=(3, 4, 3)),
    "in-rank-2": call("rank", in_shape=(8, 7), out_shape=(4, 3)),
    "out-dtype": call("element types", out_dtype="float16"),
    "int32": call("unsupported element type", in_dtype="int32", out_dtype="int32"),
    "no-window-fits": call("pooled size", attrs={"kernel_h": 9}),
    "kernel-0": call("kernel", attrs={"kernel_w": 0}),
    "stride-0": call("stride", attrs={"stride_h": 0}),
    "pad-negative": call("padding", attrs={"pad_left": -1}),
    "ceil-2": call("ceil_mode", attrs={"ceil_mode": 2}),
    "divisor-mode-7": call("divisor_mode", attrs={"divisor_mode": 7}),
    "override-0": call("divisor_override", attrs={"divisor_mode": 2, "divisor_override": 0}),
    "layout-5": call("layout", attrs={"layout": 5}),
    "bwd-strategy-2": backward_call("strategy", strategy=2),
    "bwd-dx-shape": backward_call("pooled size", out_shape=(2, 3, 10, 7)),
    "bwd-dy-shape": backward_call("pooled size", in_shape=(2, 3, 4, 4), strategy=1),
    "bwd-stride-0": backward_call("stride", attrs={"stride_w": 0}),
    "bwd-int16": backward_call("unsupported element type", in_dtype="int16", out_dtype="int16"),
    "missing-attr": call("geometry attribute", attrs={"layout": None}),
    "extra-attr": call("geometry attribute", attrs={"extra": 1}),
}

# The child process makes every bad call, records type and message, then
# runs a good pooling: it must get there and exit normally.
CHILD = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax_avgpool import _ffi, avg_pool2d

    calls = json.loads(sys.argv[1])
    results = {}
    for name, c in calls.items():
        attrs = {
            "kernel_h": 2, "kernel_w": 2, "stride_h": 2, "stride_w": 2, "pad_top": 0,
            "pad_bottom": 0, "pad_left": 0, "pad_right": 0, "ceil_mode": 0,
            "divisor_mode": 0, "divisor_override": 0, "layout": 0,
        }
        attrs.update(c["attrs"])
        attrs = {k: np.int64(v) for k, v in attrs.items() if v is not None}
        target = _ffi.FORWARD_TARGET if c["kind"] == "forward" else _ffi.BACKWARD_TARGET
        extra = {} if c["strategy"] is None else {"strategy": np.int64(c["strategy"])}
        x = jnp.ones(c["in_shape"], c["in_dtype"])
        out = jax.ShapeDtypeStruct(tuple(c["out_shape"]), c["out_dtype"])
        call = jax.ffi.ffi_call(target, out)
        try:
            jax.block_until_ready(call(x, geometry=attrs, **extra))
            results[name] = None
        except Exception as err:
            results[name] = [type(err).__name__, str(err)]
    y = avg_pool2d(jnp.arange(16.0).reshape(1, 1, 4, 4), 2)
    results["__after__"] = np.asarray(y).ravel().tolist()
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def bad_call_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Runs every bad call in one child process (so a crash cannot take pytest down)."""
    cwd = tmp_path_factory.mktemp("ffi")  # not the repository root: import the installed package
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(BAD_CALLS)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"child died (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_handler_rejects_bad_call(name: str, bad_call_results: dict) -> None:
    """Each inconsistent call raises a runtime error naming the rule it broke."""
    result = bad_call_results[name]
    assert result is not None, f"{name}: the handler accepted an inconsistent call"
    kind, message = result
    assert "RuntimeError" in kind or "Error" in kind, kind
    assert "jax_avgpool" in message, message
    assert BAD_CALLS[name]["expect"] in message, message


def test_process_survives_bad_calls(bad_call_results: dict) -> None:
    """After all the bad calls the child still pools correctly."""
    assert bad_call_results["__after__"] == [2.5, 4.5, 10.5, 12.5]


def test_in_process_error_then_success() -> None:
    """In this process too: an inconsistent call raises, and pooling still works after it."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal(X_SHAPE), jnp.float32)
    geometry = jax.make_jaxpr(lambda v: avg_pool2d(v, 2))(x).eqns[0].params["geometry"]
    attrs = geometry.attributes()
    assert set(attrs) == {
        "kernel_h", "kernel_w", "stride_h", "stride_w", "pad_top", "pad_bottom",
        "pad_left", "pad_right", "ceil_mode", "divisor_mode", "divisor_override", "layout",
    }  # fmt: skip
    call = jax.ffi.ffi_call(_ffi.FORWARD_TARGET, jax.ShapeDtypeStruct((2, 3, 4, 4), x.dtype))
    with pytest.raises(Exception, match="jax_avgpool") as info:
        jax.block_until_ready(call(x, geometry=attrs))
    assert isinstance(info.value, (jax.errors.JaxRuntimeError, RuntimeError))
    bad = dict(attrs, divisor_mode=np.int64(7))
    call = jax.ffi.ffi_call(_ffi.FORWARD_TARGET, jax.ShapeDtypeStruct(Y_SHAPE, x.dtype))
    with pytest.raises(Exception, match="jax_avgpool.*divisor_mode"):
        jax.block_until_ready(call(x, geometry=bad))
    # The correct call through ffi_call equals avg_pool2d.
    good = call(x, geometry=attrs)
    np.testing.assert_array_equal(good, avg_pool2d(x, 2))
    windows = x[..., :6].reshape(2, 3, 4, 2, 3, 2)
    np.testing.assert_allclose(good, windows.mean((3, 5)), rtol=1e-6)


# --------------------------------------------------------------------------
# build_info()


def test_build_info() -> None:
    info = jax_avgpool.build_info()
    expected_types = {
        "version": str,
        "jax": str,
        "jaxlib": str,
        "cpu": bool,
        "cuda": bool,
        "platforms": list,
        "numpy": str,
        "xla_ffi_api": str,
    }
    for key, kind in expected_types.items():
        assert isinstance(info[key], kind), (key, info.get(key))
    assert info["version"] == jax_avgpool.__version__ == importlib.metadata.version("jax_avgpool")
    assert info["jax"] == jax.__version__
    assert info["jaxlib"] == jaxlib.__version__
    assert info["numpy"] == np.__version__
    assert info["cpu"] is True and "cpu" in info["platforms"]
    assert ("cuda" in info["platforms"]) == info["cuda"]
    assert set(info["platforms"]) <= {"cpu", "cuda"}
    assert re.fullmatch(r"\d+\.\d+", info["xla_ffi_api"])
    assert all(isinstance(k, str) for k in info)
    # A fresh dict each call: callers may mutate it.
    info["version"] = "changed"
    assert jax_avgpool.build_info()["version"] == jax_avgpool.__version__


def test_ffi_api_rule() -> None:
    """Handlers run under a jaxlib of the same FFI major version and the same or a
    newer minor one; the running jaxlib's version is read from its own header, and
    this installation's extension passes."""
    running = _ffi.running_ffi_api()
    assert running is not None
    assert _ffi.ffi_api_mismatch(jax_avgpool.build_info()["xla_ffi_api"], running) is None
    assert _ffi.ffi_api_mismatch("0.3", (0, 4)) is None
    assert _ffi.ffi_api_mismatch("0.4", (0, 4)) is None
    assert _ffi.ffi_api_mismatch("0.9", None) is None  # unknown: no verdict
    message = _ffi.ffi_api_mismatch("0.5", (0, 4))
    assert message is not None
    assert "built against XLA FFI API 0.5" in message and "takes API 0.4" in message
    assert jaxlib.__version__ in message and "--no-build-isolation" in message
    assert _ffi.ffi_api_mismatch("1.0", (0, 9)) is not None
    assert _ffi.ffi_api_mismatch("0.1", (1, 0)) is not None


def test_import_refuses_an_ffi_api_newer_than_jaxlibs(tmp_path: Path) -> None:
    """Under a jaxlib whose FFI API is older than the extension's, importing the
    package raises ImportError and registers nothing: XLA would refuse the
    handlers when the CPU backend starts, and that backend would then fail for
    every program. Simulated by a jaxlib header that declares API 0.0."""
    header = tmp_path / "include" / "xla" / "ffi" / "api" / "c_api.h"
    header.parent.mkdir(parents=True)
    header.write_text("#define XLA_FFI_API_MAJOR 0\n#define XLA_FFI_API_MINOR 0\n")
    child = textwrap.dedent(
        f"""
        import jax
        import jax.ffi
        jax.ffi.include_dir = lambda: {str(tmp_path / "include")!r}
        try:
            import jax_avgpool
        except ImportError as err:
            print("refused:", err)
        import jax.numpy as jnp
        print("jax still runs:", float(jnp.arange(4.0).sum()))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", child], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "refused: jax_avgpool's extension was built against XLA FFI API" in proc.stdout
    assert "takes API 0.0" in proc.stdout
    assert "jax still runs: 6.0" in proc.stdout


def test_targets_registered_for_cpu() -> None:
    """The two custom-call targets are what the primitives lower to on the CPU."""
    assert _ffi.FORWARD_TARGET == "jax_avgpool_forward"
    assert _ffi.BACKWARD_TARGET == "jax_avgpool_backward"
    assert "cpu" in _ffi.REGISTERED_PLATFORMS
    x = jnp.ones((1, 1, 4, 4))
    text = jax.jit(lambda v: avg_pool2d(v, 2)).lower(x).as_text()
    assert f'"{_ffi.FORWARD_TARGET}"' in text or _ffi.FORWARD_TARGET in text


def test_compiled_extension_is_loaded() -> None:
    """The package found its compiled extension (also when run from a clone)."""
    extension = Path(_ffi._ext.__file__)
    assert extension.name.startswith("_jax_avgpool") and extension.is_file(), extension


@pytest.mark.parametrize(
    ("shape", "k", "s", "layout", "dtype", "blocks"),
    [
        # (forward, gather, scatter) BLOCK of the kernels each call launches.
        ((2, 4, 28, 28), 7, 1, "NCHW", jnp.float32, (4, 4, 4)),
        ((2, 28, 28, 8), 7, 1, "NHWC", jnp.float32, (1, 1, 4)),
        ((2, 28, 28, 8), 7, 1, "NHWC", jnp.bfloat16, (1, 1, 4)),
        ((2, 12, 12, 8), 3, 1, "NHWC", jnp.float32, (4, 2, 4)),
        ((2, 12, 12, 8), 3, 2, "NHWC", jnp.float32, (4, 4, 4)),
        ((2, 12, 12, 8), 3, 2, "NHWC", jnp.float16, (1, 4, 4)),
        ((2, 12, 12, 8), 2, 2, "NHWC", jnp.bfloat16, (4, 4, 4)),
    ],
)
def test_plan_ids_name_the_block_of_the_launched_kernel(
    shape: tuple, k: int, s: int, layout: str, dtype: np.dtype, blocks: tuple
) -> None:
    """Kernel ids end in the BLOCK that the launched kernel takes: the NHWC
    sliding-window kernels take 2 columns where 4 would not fit or be slower,
    1 for the 16-bit 3x3/2 forward (so that four blocks fit a multiprocessor)
    and for the 7x7/1 box filter, which sums along W in shared memory."""
    x = jax.ShapeDtypeStruct(shape, dtype)
    gather = jax_avgpool.plan(x, k, s, layout=layout)
    scatter = jax_avgpool.plan(x, k, s, layout=layout, backward="scatter")
    ids = (gather["forward"], gather["backward"], scatter["backward"])
    for kernel_id, block in zip(ids, blocks, strict=True):
        assert kernel_id.endswith(f"__{k}__{k}__{s}__{s}__{block}"), kernel_id


@pytest.mark.skipif(
    not hasattr(_ffi._ext, "cuda_scatter_needs_workspace"), reason="built without CUDA"
)
def test_scatter_workspace_query_rejects_an_unknown_dtype_name() -> None:
    """The CUDA build's workspace query names the parameter it cannot read."""
    x = jnp.zeros(X_SHAPE, jnp.float32)
    geometry = jax.make_jaxpr(lambda v: avg_pool2d(v, 2))(x).eqns[0].params["geometry"]
    attrs = {key: int(v) for key, v in geometry.attributes().items()}
    with pytest.raises(ValueError, match="dtype"):
        _ffi._ext.cuda_scatter_needs_workspace(attrs, list(X_SHAPE), "i32")
    assert _ffi._ext.cuda_scatter_needs_workspace(attrs, list(X_SHAPE), "f32") is False
