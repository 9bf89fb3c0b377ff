"""``python -m jax_avgpool demo``: a small CNN on scikit-learn's 8x8 digits.

Plain JAX (hand-written Adam, no flax/optax). The network pools twice with
:func:`jax_avgpool.avg_pool2d`; the same network with pooling written as
``jax.lax.reduce_window`` (sum / window size) is the reference it is timed
and checked against.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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
    """Train, print a line per epoch, then (unless ``--no-compare``) compare with reduce_window."""
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
