"""Paged mode of vmkv: block pools and block tables (the PagedAttention idea), same API as VMM mode.

``PagedKVCache(config)`` or ``vmkv.open_cache(config, mode="paged")``; see docs/paged.md.
"""

from __future__ import annotations

from ..kernels.paged import KERNELS
from .cache import PagedKVCache

__all__ = ["PagedKVCache", "KERNELS"]
