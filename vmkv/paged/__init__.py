"""Paged mode of vmkv: block pools and block tables (the PagedAttention idea), same API as VMM mode.

``PagedKVCache(config)`` or ``vmkv.open_cache(config, mode="paged")``; see docs/paged.md.
"""

from __future__ import annotations

from ..kernels.registry import names
from .cache import PagedKVCache

KERNELS = tuple(names("blocks"))
"""The kernels paged mode can run (``PagedKVCache(config, kernel=NAME)``)."""

__all__ = ["PagedKVCache", "KERNELS"]
