"""2-D average pooling for JAX as XLA FFI kernels (C++ on CPU, CUDA on GPU).

``avg_pool2d`` follows ``torch.nn.functional.avg_pool2d``; ``avg_pool``
follows ``flax.linen.avg_pool``. Both are differentiable to any order and
work under ``jit``, ``grad``, ``jvp``, ``vmap`` and their compositions.
"""

import pkgutil

# Run from a clone, this source folder comes first on sys.path but holds no
# compiled extension; let the package also search the installed copy of
# itself for it.
__path__ = pkgutil.extend_path(__path__, __name__)

from ._api import avg_pool, avg_pool2d, build_info, plan  # noqa: E402
from ._version import __version__  # noqa: E402

__all__ = ["__version__", "avg_pool", "avg_pool2d", "build_info", "plan"]
