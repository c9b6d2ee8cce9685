"""How a ``VirtualCache`` sizes its core cache from the first K/V it sees: slots, length, page
size, layout and memory budget (the defaults are documented in docs/hf.md, "Sizing")."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ..base import KVCacheBase
from ..config import KVCacheConfig, vmm_pieces

log = logging.getLogger("vmkv")

DEFAULT_MAX_SEQ_LEN = 8192
MIN_TOKENS_PER_PAGE = 64


def default_page_size(token_bytes: int, granularity: int, min_tokens: int = MIN_TOKENS_PER_PAGE) -> int:
    """Smallest page that is a multiple of ``granularity`` and ``token_bytes`` and holds ``min_tokens``."""
    step = math.lcm(granularity, token_bytes)
    return step * max(1, -(-min_tokens * token_bytes // step))


@dataclass(frozen=True)
class CacheOptions:
    """What the user gave ``VirtualCache(...)``; ``None``: the default (see :func:`open_core`)."""

    max_batch_size: int | None = None
    max_seq_len: int | None = None
    memory_budget: int | str | None = None
    page_size: int | str | None = None
    layout: str = "per_layer"
    block_size: int = 16
    deferred_reclaim: bool = False
    map_ahead: bool = False


def open_core(mode: str, options: CacheOptions, like: torch.Tensor, num_layers: int) -> KVCacheBase:
    """The core cache for K/V shaped like ``like`` (``[B, kv_heads, S, head_dim]``).

    Defaults: ``max(8, 4 * B)`` slots, :data:`DEFAULT_MAX_SEQ_LEN` tokens, pages of
    :func:`default_page_size`, and a budget with room for every slot full plus one page per slot
    (copy-on-write), capped on CUDA at half the free memory and on the host (VMM) at half the
    mappings ``vm.max_map_count`` still allows.
    """
    from .. import open_cache
    from ..vm import granularity

    batch, heads, _, head_dim = like.shape
    max_batch = options.max_batch_size or max(8, 4 * batch)
    max_seq = options.max_seq_len or DEFAULT_MAX_SEQ_LEN
    config = KVCacheConfig(
        num_layers=num_layers, num_kv_heads=heads, head_dim=head_dim, dtype=like.dtype, device=like.device,
        max_batch_size=max_batch, max_seq_len=max_seq, memory_budget=1, page_size=1,
        layout=options.layout, block_size=options.block_size, prefix_caching=False,
        deferred_reclaim=options.deferred_reclaim, map_ahead=options.map_ahead,
    )
    token_bytes = config.tensor_token_bytes()  # of one VMM piece: a layer, all layers, or one head
    page = options.page_size or default_page_size(token_bytes, granularity(config.device))
    config = config.replace(page_size=page)
    if mode == "vmm":
        tokens_per_page, page_bytes = config.page_size // token_bytes, vmm_pieces(config) * config.page_size
    else:
        tokens_per_page = config.block_size
        page_bytes = 2 * num_layers * config.block_size * config.layer_token_bytes
    budget = options.memory_budget
    if budget is None:  # every slot full, plus one page per slot for copy-on-write
        budget = (max_batch * -(-max_seq // tokens_per_page) + max_batch) * page_bytes
        if config.device.type == "cuda":  # CUDA pages are allocated up front: at most half the free memory
            budget = min(budget, torch.cuda.mem_get_info(config.device)[0] // 2)
        elif mode == "vmm":  # each mapped page costs host mappings: stay within half of those left
            budget = min(budget, mappable_pages(config) * page_bytes)
    core = open_cache(config.replace(memory_budget=budget), mode=mode)
    log.info("vmkv.hf: %s cache, %d layers, %d B budget, kernel %s", mode, num_layers, budget, core.kernel)
    return core


def mappable_pages(config: KVCacheConfig) -> int:
    """Pool pages whose mappings (two per page and range when fragmented) fit in half of what
    Linux's ``vm.max_map_count`` still allows this process (unbounded when unknown)."""
    from ..vm import mapping_room

    room = mapping_room()
    if room is None:
        return 1 << 62
    pieces = vmm_pieces(config)
    return max(1, (room // 2 // pieces - 1) // 2)
