"""Paged mode: K/V live in block pools (:mod:`vmkv.paged.blocks`), found through a block table; the
lifecycle is :class:`vmkv.core.base.KVCacheBase`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..config import KVCacheConfig, as_config
from ..core.base import KVCacheBase
from ..core.calls import exclusive
from ..core.sequence import RELEASED, SeqId
from ..core.step import StepPlan
from ..errors import BackendUnavailable, InvalidConfig
from ..kernels.base import AttentionKernel
from ..kernels.registry import KernelSpec, make_kernel
from ..sizing import check_budget_fits, check_page_size, paged_geometry, resolve
from ..validate import as_layer, as_scale
from ..vm import granularity
from .blocks import BlockPools


class PagedKVCache(KVCacheBase):
    """KV cache over block pools and block tables (PagedAttention style), same API as VMM mode.

    Args:
        config: the cache configuration (or a mapping of its fields); ``block_size`` and
            ``memory_budget`` decide the pool, allocated (zeroed) up front.
        kernel: force an attention kernel over blocks by name (:mod:`vmkv.kernels.registry`);
            default: the one the rule chooses for the device.
        chunk_tokens: keys per chunk of the blockwise kernel.

    Raises:
        InvalidConfig: the budget holds no block, or ``kernel`` names no kernel.
        BackendUnavailable: CUDA was asked for but is not available, or the forced kernel
            cannot run here.

    Example::

        cache = PagedKVCache(KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=64,
                                           dtype="float32", memory_budget="16MiB"))
        cache.add("a")
        plan = cache.begin_step({"a": 5})
        for layer in range(2):
            cache.write(layer, k, v, plan)          # k, v: [5, 2, 64]
            out = cache.attention(layer, q, plan)   # q: [5, q_heads, 64]
    """

    mode = "paged"

    def __init__(
        self, config: KVCacheConfig | Mapping[str, Any], *, kernel: str | None = None,
        chunk_tokens: int | None = None,
    ) -> None:
        config = as_config(config)
        geometry = paged_geometry(config)
        check_budget_fits(config)
        if config.shared_budget is not None:
            raise InvalidConfig("shared_budget needs VMM mode: paged mode's block pool is one allocation made up "
                                "front, which cannot give memory back to other members")
        if config.device.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable("CUDA driver not available: torch.cuda.is_available() is False")
        if config.page_size is not None:  # unused here, but never accepted silently
            check_page_size(resolve(config), granularity(config.device))
        block, heads, dim = config.block_size, config.num_kv_heads, config.head_dim
        self._kernel: AttentionKernel = make_kernel(
            KernelSpec("blocks", config.device, config.dtype, heads, dim, block, chunk_tokens, features=config.features),
            forced=kernel
        )
        self.kernel = self._kernel.name
        super().__init__(config, geometry)
        self.block_size = block
        self.num_blocks = geometry.num_pages
        self.blocks: BlockPools | None = None
        try:
            self.blocks = BlockPools(config, geometry, self.max_pages_per_seq, self.guard.log)
        except BaseException:
            self.close()
            raise
        self._open(self.blocks)
        self.block_table = self.blocks.table
        self._k, self._v = self.blocks.k, self.blocks.v

    # ---- what the model and kernels read ---------------------------------------------------
    @exclusive
    def block_pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V block pools, each ``[num_blocks, block_size, kv_heads, head_dim]`` (zero-copy)."""
        layer = as_layer(layer, self.config.num_layers)
        return self._k[layer], self._v[layer]

    @exclusive
    def layer_storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = as_layer(layer, self.config.num_layers)
        rows = (self.num_blocks * self.block_size, self.config.num_kv_heads, self.config.head_dim)
        return self._k[layer].view(rows), self._v[layer].view(rows)

    @exclusive
    def kv(self, seq_id: SeqId, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K and V of one sequence in one layer, each ``[length, kv_heads, head_dim]``: a copy
        gathered from its blocks (blocks a window released read zeros).

        Raises:
            UnknownSequence, InvalidInput.
        """
        seq = self._get(seq_id)
        layer = as_layer(layer, self.config.num_layers)
        blocks = torch.tensor(seq.pages[: self.pages_for(seq.length)], dtype=torch.long, device=self.config.device)
        held = (blocks != RELEASED)[:, None, None, None]  # [blocks, 1, 1, 1]
        k, v = (torch.where(held, pool[blocks.clamp(min=0)], 0).flatten(0, 1)[: seq.length]
                for pool in (self._k[layer], self._v[layer]))
        return k, v

    @exclusive
    def attention(self, layer: int, q: torch.Tensor, plan: StepPlan, *, scale: float | None = None,
                  softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """See :meth:`vmkv.core.base.KVCacheBase.attention`; runs ``stats()["kernel"]``.

        Raises:
            StalePlan, InvalidShape, InvalidDtype, InvalidDevice, InvalidInput (also: ``layer`` not
            written in this step yet).
        """
        layer = self._check_plan(plan, layer)
        self._require_written(layer)
        self._check_query(q, plan)
        scale = as_scale(scale, self.config.head_dim)
        return self._kernel(q, self._k[layer], self._v[layer], plan, scale, self._variant(softcap, sinks))

    # ---- memory ----------------------------------------------------------------------------
    def stats(self) -> dict:
        stats = super().stats()
        k = self._k if self.blocks is not None else None  # read once: close() may run on another thread
        stats.update(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            pool_bytes=2 * k.numel() * k.element_size() if k is not None else 0,
        )
        return stats

    def _close_storage(self) -> None:
        """Free the pools (views handed out keep their own reference to the memory)."""
        self.blocks = self._k = self._v = None
