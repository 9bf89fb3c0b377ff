"""2-D average pooling for JAX as XLA FFI kernels (C++ on CPU, CUDA on GPU).

``avg_pool2d`` follows ``torch.nn.functional.avg_pool2d``; ``avg_pool``
follows ``flax.linen.avg_pool``. Both are differentiable to any order and
work under ``jit``, ``grad``, ``jvp``, ``vmap`` and their compositions.
"""

from ._api import __version__, avg_pool, avg_pool2d, build_info

__all__ = ["__version__", "avg_pool", "avg_pool2d", "build_info"]
