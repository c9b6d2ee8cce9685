"""Paged mode: K/V live in block pools; each sequence finds its blocks through a block table.

Storage, allocated once from the memory budget (a pool page = one block in every layer's K and V)::

    K pool  [num_layers, num_blocks, block_size, kv_heads, head_dim]     (V alike)
            layer l's pool: K[l] = [num_blocks, block_size, kv_heads, head_dim]

    block table  int32 [max_batch_size, max_pages_per_seq]   (host memory; -1 = no block)

        slot 0 | 7 | 2 | 9 | -1 | -1 ...     logical block i of the sequence in slot 0 is pool block table[0, i]
        slot 1 | 3 | -1 ...

Token ``t`` of a sequence lives in row ``table[slot, t // B] * B + t % B`` of a layer's pool
flattened to ``[num_blocks * B, kv_heads, head_dim]`` (``B`` = block_size). The lifecycle
(ownership, copy-on-write, prefix cache) is :class:`vmkv.core.base.KVCacheBase`; this module only
addresses blocks.

Invariant: ``table[slot, i] == seq.pages[i]`` for every live sequence and ``i < len(seq.pages)``,
and ``-1`` everywhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..config import KVCacheConfig, as_config, check_budget_fits, check_page_size, paged_geometry
from ..core.base import KVCacheBase
from ..core.calls import exclusive
from ..core.sequence import LiveSequence, SeqId
from ..core.step import StepPlan
from ..errors import BackendUnavailable, InvalidConfig
from ..kernels.paged import DEFAULT_CHUNK_TOKENS, PagedKernel, make_paged_kernel
from ..sizes import format_size
from ..validate import as_layer, as_scale
from ..vm import granularity

NO_BLOCK = -1


class PagedKVCache(KVCacheBase):
    """KV cache over block pools and block tables (PagedAttention style), same API as VMM mode.

    Args:
        config: the cache configuration; ``block_size`` (tokens per block) and
            ``memory_budget`` decide the pool, which is allocated (zeroed) up front.
            A mapping of its fields is accepted too.
        kernel: force an attention kernel by name (see :mod:`vmkv.kernels.paged`); default: the
            fastest one that runs here.
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
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        config = as_config(config)
        geometry = paged_geometry(config)
        check_budget_fits(config)
        if config.shared_budget is not None:
            raise InvalidConfig("shared_budget needs VMM mode: paged mode's block pool is one allocation made up "
                                "front, which cannot give memory back to other members")
        if config.device.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable("CUDA driver not available: torch.cuda.is_available() is False")
        check_page_size(config, granularity(config.device))  # unused here, but never accepted silently
        block, heads, dim = config.block_size, config.num_kv_heads, config.head_dim
        self._kernel: PagedKernel = make_paged_kernel(
            config.device, config.dtype, heads, dim, block, forced=kernel, chunk_tokens=chunk_tokens
        )
        self.kernel = self._kernel.name
        super().__init__(config, geometry)
        self.block_size = block
        self.num_blocks = geometry.num_pages
        self._step_meta: tuple[tuple[int, int, float], Any] | None = None
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        shape = (config.num_layers, geometry.num_pages, block, heads, dim)
        try:
            # Zeroed so that no read (kv(), a kernel's masked tail) ever sees uninitialised memory.
            self._k = torch.zeros(shape, dtype=config.dtype, device=config.device)
            self._v = torch.zeros(shape, dtype=config.dtype, device=config.device)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            self.close()
            raise InvalidConfig(
                f"memory_budget {format_size(config.memory_budget)}: the block pools could not be allocated "
                f"on {config.device} ({type(exc).__name__}: {str(exc).splitlines()[0]})"
            ) from None
        self.block_table = torch.full((config.max_batch_size, self.max_pages_per_seq), NO_BLOCK, dtype=torch.int32)

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
        """The stored K and V of one sequence in one layer, each ``[length, kv_heads, head_dim]``.

        Paged storage is not contiguous per sequence, so this gathers its blocks (a copy).

        Raises:
            UnknownSequence, InvalidInput.
        """
        seq = self._get(seq_id)
        layer = as_layer(layer, self.config.num_layers)
        blocks = torch.tensor(seq.pages[: self.pages_for(seq.length)], dtype=torch.long, device=self.config.device)
        k = self._k[layer][blocks].flatten(0, 1)[: seq.length]
        v = self._v[layer][blocks].flatten(0, 1)[: seq.length]
        return k, v

    @exclusive
    def attention(self, layer: int, q: torch.Tensor, plan: StepPlan, *, scale: float | None = None) -> torch.Tensor:
        """See :meth:`vmkv.core.base.KVCacheBase.attention`; runs ``stats()["kernel"]``.

        Raises:
            StalePlan, InvalidShape, InvalidDtype, InvalidDevice, InvalidInput.
        """
        layer = self._check_plan(plan, layer)
        self._check_query(q, plan)
        scale = as_scale(scale, self.config.head_dim)
        meta = self._prepared(plan, q.shape[1], scale)
        return self._kernel(q, self._k[layer], self._v[layer], plan, meta, scale)

    def _prepared(self, plan: StepPlan, q_heads: int, scale: float) -> Any:
        """The kernel's per-step metadata, computed by the step's first layer and reused by the rest."""
        key = (plan.version, q_heads, scale)
        if self._step_meta is None or self._step_meta[0] != key:
            self._step_meta = (key, self._kernel.prepare(plan, q_heads, scale))
        return self._step_meta[1]

    # ---- the mode's hooks ------------------------------------------------------------------
    def _attach(self, slot: int, index: int, page: int, old: int | None, keep: int) -> None:
        """Point table entry ``slot``/``index`` at block ``page`` (journaled), after copying the
        first ``keep`` tokens of ``old`` into it (copy-on-write)."""
        if keep:  # copy-on-write: the stored tokens of the block in every layer, K and V (one op each)
            self._k[:, page, :keep].copy_(self._k[:, old, :keep])
            self._v[:, page, :keep].copy_(self._v[:, old, :keep])
        self._set_entry(slot, index, page)

    def _detach(self, slot: int, index: int, page: int) -> None:
        """Clear table entry ``slot``/``index`` (journaled)."""
        self._set_entry(slot, index, NO_BLOCK)

    def _set_entry(self, slot: int, index: int, block: int) -> None:
        before = int(self.block_table[slot, index])
        self.block_table[slot, index] = block
        self.guard.log(lambda: self.block_table.__setitem__((slot, index), before))

    def _release(self, pages: list[int]) -> None:
        """Nothing to give back: the pools are single tensors allocated up front, so a free block
        is only a free index (on CUDA the memory belongs to torch's caching allocator, on the
        host to one allocation); returning it per block is not possible. ``close()`` frees all."""

    def _token_rows(self, slot: int, pages: list[int], start: int, count: int) -> torch.Tensor:
        block = self.block_size
        first = start // block
        positions = torch.arange(start, start + count)
        blocks = torch.tensor(pages[first : (start + count - 1) // block + 1], dtype=torch.long)
        return blocks[positions // block - first] * block + positions % block  # the slot mapping

    def _block_table(self, seqs: list[LiveSequence], kv_lens: list[int]) -> torch.Tensor:
        """int32 ``[B, max_blocks]`` rows of the step's sequences, on the cache's device;
        ``max_blocks`` covers the longest sequence. Entries past the blocks a sequence's length
        needs are whatever its row holds there (-1, or blocks ``reserve`` mapped ahead): kernels
        read only ``kv_lens`` tokens."""
        width = max(self.pages_for(n) for n in kv_lens)
        slots = torch.tensor([seq.slot for seq in seqs], dtype=torch.long)
        return self.block_table[slots, :width].to(self.config.device)

    def _check_storage(self) -> None:
        """Each live sequence's block-table row lists exactly its pages, then -1; a free slot's
        row is all -1."""
        expected = torch.full_like(self.block_table, NO_BLOCK)
        for seq in self._seqs.values():
            expected[seq.slot, : len(seq.pages)] = torch.tensor(seq.pages, dtype=torch.int32)
        bad = (self.block_table != expected).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"block table rows {bad} disagree with the sequences' pages"

    # ---- memory ----------------------------------------------------------------------------
    def stats(self) -> dict:
        stats = super().stats()
        k = self._k  # read once: close() may run on another thread (stats() is thread-free)
        stats.update(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            pool_bytes=2 * k.numel() * k.element_size() if k is not None else 0,
        )
        return stats

    def _close_storage(self) -> None:
        """Free the pools (views handed out keep their own reference to the memory)."""
        self._k = self._v = None
        self._step_meta = None
