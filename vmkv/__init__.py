"""vmkv: a KV-cache memory manager for LLM inference, managed like an operating system's memory.

Two modes behind one API: ``VirtualKVCache`` (VMM: virtually contiguous tensors backed by pages
on demand, read by stock attention kernels) and ``PagedKVCache`` (block tables).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import errors, sizing  # noqa: F401 - vmkv.sizing, the page decisions (public)
from .config import KVCacheConfig, as_config, check_mode
from .core.base import KVCacheBase
from .core.groups import GroupedPlan, LayerGroups
from .core.step import StepPlan
from .errors import *  # noqa: F403 - every typed error, as listed in errors.__all__
from .paged import PagedKVCache
from .sizes import parse_size
from .vmm.cache import VirtualKVCache

__version__ = "0.1.0"  # the package version: pyproject.toml reads it from here


def open_cache(config: KVCacheConfig | Mapping[str, Any], mode: str = "vmm", *, kernel: str | None = None) -> KVCacheBase:
    """Open a KV cache in ``mode`` ``"vmm"`` (virtual memory) or ``"paged"`` (block tables).

    Args:
        config: a :class:`KVCacheConfig`, or a mapping of its fields (``dict(num_layers=2, ...)``).
        mode: ``"vmm"`` or ``"paged"``.
        kernel: force an attention kernel by name (``vmkv info`` lists them; default: the one
            :mod:`vmkv.kernels.registry` chooses for the device).

    Returns:
        The open cache; ``close()`` it (or use it as a context manager).

    Raises:
        InvalidConfig: unknown mode or kernel name, or a config that is neither a
            KVCacheConfig nor a mapping of its fields, or whose values are invalid.
        BackendUnavailable: the forced kernel (or the device's backend) cannot run here.
    """
    check_mode(mode)
    config = as_config(config)
    if config.window is None:  # layers of different windows: a cache of each (vmkv.core.groups)
        groups = []
        try:
            for layers, sub in sizing.layer_groups(config):
                groups.append((layers, open_cache(sub, mode, kernel=kernel)))
        except BaseException:
            for _, core in groups:
                core.close()
            raise
        return LayerGroups(config, groups)
    return (VirtualKVCache if mode == "vmm" else PagedKVCache)(config, kernel=kernel)


__all__ = [
    "KVCacheBase",
    "KVCacheConfig",
    "LayerGroups",
    "GroupedPlan",
    "VirtualKVCache",
    "PagedKVCache",
    "StepPlan",
    "open_cache",
    "parse_size",
    *errors.__all__,
]
