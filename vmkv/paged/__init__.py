"""Paged mode: block pools and block tables (PagedAttention), the same API as VMM mode (docs/paged.md)."""

from __future__ import annotations

from ..kernels.registry import names
from .cache import PagedKVCache

KERNELS = tuple(names("blocks"))
"""The kernels paged mode can run (``PagedKVCache(config, kernel=NAME)``)."""

__all__ = ["PagedKVCache", "KERNELS"]
