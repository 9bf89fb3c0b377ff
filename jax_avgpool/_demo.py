"""``python -m jax_avgpool demo``: a small CNN on scikit-learn's 8x8 digits.

Plain JAX (hand-written Adam, no flax/optax). The network pools twice with
:func:`jax_avgpool.avg_pool2d`; the same network with pooling written as
``jax.lax.reduce_window`` (sum / window size) is the reference it is timed
and checked against.

``demo --devices N`` trains nothing: it runs the same jitted training step
data parallel (batch sharded over a 1-D mesh of N local devices, parameters
replicated) and on one device, from the same parameters and batches, checks
that losses and parameters agree, and times both (:func:`run_data_parallel`).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ._api import avg_pool2d

Params = dict[str, jax.Array]
Batch = tuple[jax.Array, jax.Array]
LEARNING_RATE, BETA1, BETA2, EPS = 1e-2, 0.9, 0.999, 1e-8


@dataclasses.dataclass(frozen=True)
class Pool:
    """An average-pooling implementation for one layout: ``pool(x, kernel, stride, padding)``."""

    name: str
    layout: str
    fn: Callable[..., jax.Array]

    def __call__(self, x: jax.Array, kernel: int, stride: int, padding: int) -> jax.Array:
        return self.fn(x, kernel, stride, padding, self.layout)


def _ffi_pool(x: jax.Array, kernel: int, stride: int, padding: int, layout: str) -> jax.Array:
    return avg_pool2d(x, kernel, stride, padding, layout=layout)


def _reduce_window_pool(
    x: jax.Array, kernel: int, stride: int, padding: int, layout: str
) -> jax.Array:
    """avg_pool2d with count_include_pad=True and no ceil_mode: window sum / kernel**2."""
    spatial = (1, 2) if layout == "NHWC" else (2, 3)
    dims, strides, pads = [1] * 4, [1] * 4, [(0, 0)] * 4
    for axis in spatial:
        dims[axis], strides[axis], pads[axis] = kernel, stride, (padding, padding)
    summed = lax.reduce_window(x, np.zeros((), x.dtype), lax.add, dims, strides, pads)
    return summed / (kernel * kernel)


class AdamState(NamedTuple):
    count: jax.Array
    mu: Params
    nu: Params


def load_data(seed: int, layout: str) -> tuple[Batch, Batch]:
    """The digits as float32 images in ``layout`` scaled to [0, 1]; shuffled, last 20% test."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        sys.exit("the demo needs scikit-learn: pip install 'jax_avgpool[demo]'")
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]  # (N, 8, 8, 1)
    if layout == "NCHW":
        images = images.transpose(0, 3, 1, 2)
    order = np.random.default_rng(seed).permutation(len(images))
    images, labels = images[order], digits.target[order].astype(np.int32)
    split = int(0.8 * len(images))
    return (images[:split], labels[:split]), (images[split:], labels[split:])


def init_params(key: jax.Array) -> Params:
    """He-normal conv(1->16, 3x3), conv(16->32, 3x3), dense(32*2*2 -> 10); zero biases."""
    k1, k2, k3 = jax.random.split(key, 3)

    def he(k: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return jax.random.normal(k, shape) * jnp.sqrt(2.0 / fan_in)

    return {
        "w1": he(k1, (3, 3, 1, 16), 9),
        "b1": jnp.zeros(16),
        "w2": he(k2, (3, 3, 16, 32), 144),
        "b2": jnp.zeros(32),
        "w3": he(k3, (128, 10), 128) / jnp.sqrt(2.0),
        "b3": jnp.zeros(10),
    }


def forward(params: Params, x: jax.Array, pool: Pool) -> jax.Array:
    """Logits: conv-relu-pool(2, 2) 8x8 -> 4x4, conv-relu-pool(3, 2, pad 1) -> 2x2, dense."""
    c = -1 if pool.layout == "NHWC" else 1
    shape = [1, 1, 1, 1]
    shape[c] = -1
    dims = (pool.layout, "HWIO", pool.layout)

    def conv(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
        y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims)
        return jax.nn.relu(y + b.reshape(shape))

    x = pool(conv(x, params["w1"], params["b1"]), 2, 2, 0)
    x = pool(conv(x, params["w2"], params["b2"]), 3, 2, 1)
    return x.reshape(x.shape[0], -1) @ params["w3"] + params["b3"]


def loss_fn(params: Params, x: jax.Array, y: jax.Array, pool: Pool) -> tuple[jax.Array, Any]:
    """Mean cross-entropy, and the number of correct predictions as aux."""
    logits = forward(params, x, pool)
    logp = jax.nn.log_softmax(logits)
    loss = -jnp.take_along_axis(logp, y[:, None], axis=1).mean()
    return loss, (jnp.argmax(logits, axis=1) == y).sum()


def adam_init(params: Params) -> AdamState:
    """Zero first and second moments."""
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return AdamState(jnp.zeros((), jnp.int32), zeros, zeros)


def adam_update(params: Params, grads: Params, state: AdamState) -> tuple[Params, AdamState]:
    """One bias-corrected Adam step."""
    count = state.count + 1
    tm = jax.tree_util.tree_map
    mu = tm(lambda m, g: BETA1 * m + (1 - BETA1) * g, state.mu, grads)
    nu = tm(lambda v, g: BETA2 * v + (1 - BETA2) * g * g, state.nu, grads)
    scale = LEARNING_RATE * jnp.sqrt(1 - BETA2**count) / (1 - BETA1**count)
    params = tm(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + EPS), params, mu, nu)
    return params, AdamState(count, mu, nu)


def make_train_step(pool: Pool) -> Callable[..., tuple[Params, AdamState, jax.Array, jax.Array]]:
    """A jitted ``step(params, state, x, y) -> (params, state, loss, n_correct)``."""

    @jax.jit
    def step(params: Params, state: AdamState, x: jax.Array, y: jax.Array):
        (loss, correct), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y, pool)
        params, state = adam_update(params, grads, state)
        return params, state, loss, correct

    return step


def _timed(step: Callable, *args: Any) -> tuple[tuple, float]:
    """Run ``step``, wait for its results; return them and the seconds taken."""
    start = time.perf_counter()
    out = jax.block_until_ready(step(*args))
    return out, time.perf_counter() - start


def _batches(data: Batch, batch_size: int, rng: np.random.Generator) -> list[Batch]:
    """One shuffled epoch of full batches on the device (the remainder is dropped)."""
    order = rng.permutation(len(data[0]))
    n = len(order) // batch_size
    return [jax.device_put((data[0][i], data[1][i])) for i in np.split(order[: n * batch_size], n)]


def _compare(params: Params, state: AdamState, batches: list[Batch], pools: list[Pool]) -> None:
    """Median step time of each pool (interleaved rounds) and their loss/gradient agreement."""
    steps = [make_train_step(p) for p in pools]
    times: list[list[float]] = [[] for _ in pools]
    for step in steps:  # compile outside the timing
        _timed(step, params, state, *batches[0])
    for _ in range(5):
        for step, ts in zip(steps, times, strict=True):
            p, s = params, state
            for x, y in batches:
                (p, s, _, _), t = _timed(step, p, s, x, y)
                ts.append(t)
    ms = [1e3 * statistics.median(ts) for ts in times]
    print(f"\nvs jax.lax.reduce_window (median of {len(times[0])} interleaved steps each):")
    print(f"  step time: {pools[0].name} {ms[0]:.3f} ms vs {pools[1].name} {ms[1]:.3f} ms", end="")
    print(f" (speed-up {ms[1] / ms[0]:.2f} x)")
    x, y = batches[0]
    grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=3)
    (l0, _), g0 = grad(params, x, y, pools[0])
    (l1, _), g1 = grad(params, x, y, pools[1])
    dg = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(g0.values(), g1.values(), strict=True))
    dl = abs(float(l0) - float(l1))
    verdict = "agree" if dl <= 1e-5 and dg <= 1e-5 else "DISAGREE"
    print(f"  loss:      {float(l0):.7f} vs {float(l1):.7f} (same params and batch)")
    print(f"  |diff|:    loss {dl:.1e}, gradient max {dg:.1e} -> {verdict} (tolerance 1e-5)")


def run(args: argparse.Namespace) -> int:
    """Train, print a line per epoch, then (unless ``--no-compare``) compare with reduce_window.

    With ``--devices``, run :func:`run_data_parallel` instead.
    """
    if getattr(args, "devices", None) is not None:
        return run_data_parallel(args)
    args.layout = args.layout or "NHWC"
    (train, test) = load_data(args.seed, args.layout)
    if args.batch_size > len(train[0]):
        sys.exit(f"--batch-size must be at most the {len(train[0])} training images")
    pool = Pool("jax_avgpool", args.layout, _ffi_pool)
    print(f"device: {jax.devices()[0]}   layout: {args.layout}   seed: {args.seed}")
    print(f"digits: {len(train[0])} train / {len(test[0])} test, batch {args.batch_size}\n")
    params = init_params(jax.random.key(args.seed))
    state = adam_init(params)
    step = make_train_step(pool)
    evaluate = jax.jit(lambda p, x, y: loss_fn(p, x, y, pool)[1])
    rng = np.random.default_rng(args.seed)
    print(f"{'epoch':>5}  {'train loss':>10}  {'train acc':>9}  {'test acc':>8}  {'step ms':>8}")
    start, times = time.perf_counter(), []
    for epoch in range(1, args.epochs + 1):
        losses, correct, epoch_times = [], 0, []
        for x, y in (batches := _batches(train, args.batch_size, rng)):
            (params, state, loss, n), t = _timed(step, params, state, x, y)
            losses.append(float(loss))
            correct += int(n)
            epoch_times.append(t)
        if epoch == 1:
            epoch_times = epoch_times[1:] or epoch_times  # drop the compile step
        times += epoch_times
        train_acc = correct / (len(batches) * args.batch_size)
        test_acc = int(evaluate(params, *test)) / len(test[0])
        step_ms = 1e3 * statistics.fmean(epoch_times)
        print(
            f"{epoch:>5}  {statistics.fmean(losses):>10.4f}  {train_acc:>9.1%}  "
            f"{test_acc:>8.1%}  {step_ms:>8.3f}"
        )
    print(f"\ntrained in {time.perf_counter() - start:.1f} s, final test accuracy {test_acc:.1%}")
    if args.compare:
        reference = Pool("reduce_window", args.layout, _reduce_window_pool)
        _compare(params, state, batches, [pool, reference])
    return 0


# ---------------------------------------------------------------------------
# Data parallel: the same step on N devices and on one.

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
# float32 sums in another order, through one Adam step: far below this.
TOLERANCE = 1e-4


def collectives(compiled_text: str) -> dict[str, int]:
    """How many of each collective op a compiled HLO module holds (async pairs once)."""
    counts = {}
    for name in COLLECTIVES:
        n = len(re.findall(rf"\s{name}(?:-start)?\(", compiled_text))
        if n:
            counts[name] = n
    return counts


def _device_count(args: argparse.Namespace) -> int:
    available = jax.local_device_count()
    n = available if args.devices == "all" else int(args.devices)
    if n > available:
        hint = ""
        if jax.default_backend() == "cpu":
            hint = (
                "; on the CPU, start with XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{n} to split it into {n} devices"
            )
        sys.exit(f"--devices {n}: only {available} local {jax.default_backend()} device(s){hint}")
    return n


def _max_diff(a: Any, b: Any) -> float:
    """Largest absolute difference between two pytrees of arrays."""
    pairs = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in pairs)


def compare_data_parallel(
    layout: str, n: int, batch_size: int, steps: int, seed: int, warmup: int = 2
) -> dict[str, Any]:
    """``steps`` training steps on 1 device and data parallel on ``n``, compared step by step.

    The one-device steps run in a chain. Each ``n``-device step starts from
    the parameters and optimizer state that its one-device counterpart
    started from, on the same batch, so that the two are compared on equal
    inputs: free-running chains drift apart once rounding flips a ReLU,
    however correct both are. Every step is timed on its own (inputs on the
    devices, results waited for), after ``warmup`` untimed steps.

    Returns the median step times, the largest loss and parameter
    differences, the last losses, and the collectives of the compiled
    ``n``-device step.
    """
    if batch_size % n:
        raise ValueError(f"the global batch {batch_size} must be divisible by {n} devices")
    devices = jax.local_devices()[:n]
    mesh = Mesh(np.array(devices), ("data",), axis_types=(AxisType.Auto,))
    replicated = NamedSharding(mesh, PartitionSpec())
    sharded = NamedSharding(mesh, PartitionSpec("data"))
    one_device = jax.sharding.SingleDeviceSharding(devices[0])

    (train, _) = load_data(seed, layout)
    order = np.random.default_rng(seed).permutation(len(train[0]))
    picks = [order[(i * batch_size + np.arange(batch_size)) % len(order)] for i in range(steps)]
    batches = [(train[0][i], train[1][i]) for i in picks]
    params = jax.device_get(init_params(jax.random.key(seed)))
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    state = AdamState(np.zeros((), np.int32), zeros, zeros)  # adam_init's, on the host
    step = make_train_step(Pool("jax_avgpool", layout, _ffi_pool))

    # Full float32 matmuls and convolutions (not TF32 on GPUs) on both sides:
    # what is compared is the sharding, not the algorithms picked per batch size.
    with jax.default_matmul_precision("highest"):
        p, s = jax.device_put((params, state), one_device)
        one_batches = [jax.device_put(b, one_device) for b in batches]
        for _ in range(warmup):  # chained, as the timed steps are
            (p, s, _, _), _ = _timed(step, p, s, *one_batches[0])
        p, s = jax.device_put((params, state), one_device)
        inputs, one, one_times = [], [], []
        for x, y in one_batches:
            inputs.append((p, s))
            (p, s, loss, _), t = _timed(step, p, s, x, y)
            one.append((float(loss), p))
            one_times.append(t)

        many_batches = [jax.device_put(b, sharded) for b in batches]
        for _ in range(warmup):
            _timed(step, *jax.device_put(inputs[0], replicated), *many_batches[0])
        dl = dp = 0.0
        many_times = []
        for (p, s), (x, y), (loss_1, p_1) in zip(inputs, many_batches, one, strict=True):
            (p, s, loss, _), t = _timed(step, *jax.device_put((p, s), replicated), x, y)
            many_times.append(t)
            dl = max(dl, abs(float(loss) - loss_1))
            dp = max(dp, _max_diff(p, p_1))
        text = step.lower(*jax.device_put(inputs[0], replicated), *many_batches[0])
        text = text.compile().as_text()

    return dict(
        layout=layout,
        devices=n,
        batch_size=batch_size,
        steps=steps,
        step_ms_1=1e3 * statistics.median(one_times),
        step_ms_n=1e3 * statistics.median(many_times),
        loss_1=one[-1][0],
        loss_n=float(loss),
        max_loss_diff=dl,
        max_param_diff=dp,
        params_sharding=str(jax.tree_util.tree_leaves(p)[0].sharding.spec),
        collectives=collectives(text),
        agree=bool(dl <= TOLERANCE and dp <= TOLERANCE),
    )


def run_data_parallel(args: argparse.Namespace) -> int:
    """``demo --devices N``: 1 vs N devices per layout; exit status 1 if they disagree."""
    n = _device_count(args)
    batch = args.batch_size
    if batch % n:
        batch = max(n, batch - batch % n)
        print(
            f"note: --batch-size {args.batch_size} is not divisible by {n} devices: using {batch}"
        )
    layouts = [args.layout] if args.layout else ["NCHW", "NHWC"]
    kind = jax.local_devices()[0].device_kind
    print(
        f"data parallel: 1 vs {n} of {jax.local_device_count()} local device(s) ({kind}), "
        f"global batch {batch} ({batch // n} per device), {args.steps} steps, seed {args.seed}"
    )
    print(
        f"parameters replicated, batch sharded over a 1-D mesh; float32 matmul precision "
        f"'highest'; tolerance {TOLERANCE:.0e}\n"
    )
    ok = True
    for layout in layouts:
        r = compare_data_parallel(layout, n, batch, args.steps, args.seed)
        ok &= r["agree"]
        seen = ", ".join(f"{k} x{v}" for k, v in r["collectives"].items()) or "none"
        gathered = "all-gather" in r["collectives"]
        print(f"{layout}:")
        print(
            f"  median step: 1 device {r['step_ms_1']:.3f} ms, {n} devices "
            f"{r['step_ms_n']:.3f} ms (speed-up {r['step_ms_1'] / r['step_ms_n']:.2f} x)"
        )
        print(
            f"  last loss:   {r['loss_1']:.7f} vs {r['loss_n']:.7f}; max |diff| over "
            f"{r['steps']} steps (each from the same inputs): loss {r['max_loss_diff']:.1e}, "
            f"params {r['max_param_diff']:.1e} -> {'agree' if r['agree'] else 'DISAGREE'}"
        )
        print(
            f"  collectives in the {n}-device step: {seen}"
            + (" (activations gathered: unexpected)" if gathered else " (no all-gather)")
        )
    return 0 if ok else 1
