"""``import paged``: the name paged mode had before it moved to :mod:`vmkv.paged` (kept for users).

``paged.PagedKVCache`` and ``paged.KERNELS`` are :mod:`vmkv.paged`'s.
"""

from vmkv.paged import KERNELS, PagedKVCache

__all__ = ["PagedKVCache", "KERNELS"]
