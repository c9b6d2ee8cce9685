"""VMM mode: every K and V tensor is one virtually contiguous range, backed by pages on demand.

Per-layer layout (``layout="per_layer"``), one reserved range per layer and per K/V::

    K[layer]  slot 0 | page 0 | page 1 | page 2 | ........ unmapped ........ |
              slot 1 | page 0 | ... unmapped ...                             |
              ...      each slot is ``seq_capacity`` tokens, a whole number of pages

    view: [max_batch, max_seq_len, kv_heads, head_dim], contiguous except the batch stride

All-layers layout (``layout="all_layers"``): one range for K and one for V shaped
``[max_batch, seq_capacity, num_layers, kv_heads, head_dim]``; a layer's view is a strided
slice of it and a page covers ``num_layers`` times fewer tokens.

A pool page ``p`` is backed by ``num_tensors`` physical pages of the backend, one per range:
physical page ``t * num_pages + p`` is what range ``t`` maps for it, so pool pages ``p`` and
``p + 1`` are neighbours in the page store and, mapped side by side, merge into one mapping.

Every page of a range that holds no data reads as zeros (the backend's shared zero page): a
read past a sequence's length never faults, and views outlive ``free``, ``trim`` and ``close``.
"""

from __future__ import annotations

import torch

from .attention import select_contiguous_kernel
from .base import KVCacheBase, SeqId, _Sequence
from .config import KVCacheConfig, vmm_geometry
from .step import StepPlan
from .vm import granularity, open_backend


class VirtualKVCache(KVCacheBase):
    """KV cache whose tensors are virtually contiguous and physically paged (vAttention style).

    Args:
        config: the cache configuration; ``page_size`` and ``layout`` decide the pages.

    Example::

        cache = VirtualKVCache(KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=64,
                                             dtype="float32", page_size="64KiB"))
        cache.add("a")
        plan = cache.begin_step({"a": 5})          # 5 prompt tokens
        for layer in range(2):
            cache.write(layer, k, v, plan)          # k, v: [5, 2, 64]
            out = cache.attention(layer, q, plan)   # q: [5, q_heads, 64]
    """

    mode = "vmm"

    def __init__(self, config: KVCacheConfig) -> None:
        geometry = vmm_geometry(config, granularity(config.device))
        self.kernel, self._kernel = select_contiguous_kernel(config.device, config.dtype, config.head_dim)
        tpp = geometry.tokens_per_page
        self.seq_capacity = -(-config.max_seq_len // tpp) * tpp
        self.slot_bytes = self.seq_capacity * geometry.piece_bytes // tpp
        self._vm = open_backend(config.device, geometry.piece_bytes, geometry.num_pages * geometry.num_tensors)
        range_bytes = config.max_batch_size * self.slot_bytes
        self._bases: list[int] = []
        try:
            for _ in range(geometry.num_tensors):
                self._bases.append(self._vm.reserve(range_bytes))
        except Exception:
            self._vm.close()
            raise
        self._k, self._v = self._make_views(config)
        # each layer's K/V flattened to [rows, heads, dim] once: ``view`` (never a silent copy)
        rows = (config.max_batch_size * self.seq_capacity, config.num_kv_heads, config.head_dim)
        self._rows = [(k.view(rows), v.view(rows)) for k, v in zip(self._k, self._v)]
        super().__init__(config, geometry)

    def _make_views(self, config: KVCacheConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zero-copy tensors over the reserved ranges: ``[max_batch, seq_capacity, heads, dim]`` per layer."""
        heads, dim, layers = config.num_kv_heads, config.head_dim, config.num_layers
        shape = (config.max_batch_size, self.seq_capacity)
        if config.layout == "per_layer":
            views = [self._vm.tensor(base, (*shape, heads, dim), config.dtype) for base in self._bases]
            return views[0::2], views[1::2]
        k_all, v_all = (self._vm.tensor(base, (*shape, layers, heads, dim), config.dtype) for base in self._bases)
        return [k_all[:, :, layer] for layer in range(layers)], [v_all[:, :, layer] for layer in range(layers)]

    # ---- what the model and kernels read ---------------------------------------------------
    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K and V of a layer, ``[max_batch, max_seq_len, kv_heads, head_dim]`` (zero-copy).

        Only positions below each sequence's length are mapped: read them through the lengths
        of a plan (``kv_lens``); touching anything past them faults.
        """
        seq = self.config.max_seq_len
        return self._k[layer][:, :seq], self._v[layer][:, :seq]

    def kv(self, seq_id: SeqId, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self._get(seq_id)
        return self._k[layer][seq.slot, : seq.length], self._v[layer][seq.slot, : seq.length]

    def layer_storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rows[layer]

    def attention(self, layer: int, q: torch.Tensor, plan: StepPlan, *, scale: float | None = None) -> torch.Tensor:
        self._check_plan(plan, layer)
        self._check_query(q, plan)
        return self._kernel(q, self._k[layer], self._v[layer], plan, scale)

    # ---- the mode's hooks ------------------------------------------------------------------
    def _addr(self, tensor: int, slot: int, index: int) -> int:
        return self._bases[tensor] + slot * self.slot_bytes + index * self.geometry.piece_bytes

    def _piece(self, page: int, tensor: int) -> int:
        """The backend page that range ``tensor`` maps for pool page ``page``."""
        return tensor * self.geometry.num_pages + page

    def _attach(self, slot: int, index: int, page: int, old: int | None, keep: int) -> None:
        count = self.geometry.num_tensors
        nbytes = keep * self.geometry.piece_bytes // self.tokens_per_page  # the stored tokens only
        addrs = [self._addr(t, slot, index) for t in range(count)]
        saved = [self._vm.tensor(a, (nbytes,), torch.uint8).clone() for a in addrs] if keep else []
        if old is not None:
            self._vm.synchronize()
            for addr in addrs:
                self._vm.unmap(addr)
        for t, addr in enumerate(addrs):
            self._vm.map(addr, self._piece(page, t))
        for addr, data in zip(addrs, saved):
            self._vm.tensor(addr, (nbytes,), torch.uint8).copy_(data)

    def _detach(self, slot: int, index: int) -> None:
        self._vm.synchronize()
        for t in range(self.geometry.num_tensors):
            self._vm.unmap(self._addr(t, slot, index))

    def _release(self, pages: list[int]) -> None:
        count = self.geometry.num_tensors
        for page in pages:
            for t in range(count):
                self._vm.release_page(self._piece(page, t))

    def _token_rows(self, slot: int, pages: list[int], start: int, count: int) -> torch.Tensor:
        return torch.arange(start, start + count) + slot * self.seq_capacity

    def _block_table(self, seqs: list[_Sequence]) -> None:
        return None

    # ---- memory ----------------------------------------------------------------------------
    def stats(self) -> dict:
        stats = super().stats()
        stats.update(
            backend=self._vm.name,
            layout=self.config.layout,
            page_size=self.geometry.piece_bytes,
            resident_bytes=self._vm.resident_bytes(),
            reserved_bytes=len(self._bases) * self.config.max_batch_size * self.slot_bytes,
            pages_mapped_ahead=self.counters["pages_mapped_ahead"],
        )
        return stats

    def close(self) -> None:
        if getattr(self, "_vm", None) is None:
            return
        self._stop_map_ahead()
        self._vm.synchronize()
        self._k = self._v = self._rows = []
        self._vm.close()
        self._vm = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
