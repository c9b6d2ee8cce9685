"""VMM mode: every K and V tensor is one virtually contiguous range, backed by pages on demand.

Per-layer layout (``layout="per_layer"``), one reserved range per layer and per K/V::

    K[layer]  slot 0 | page 0 | page 1 | page 2 | ........ unmapped ........ |
              slot 1 | page 0 | ... unmapped ...                             |
              ...      each slot is ``seq_capacity`` tokens, a whole number of pages

    view: [max_batch, max_seq_len, kv_heads, head_dim], contiguous except the batch stride

All-layers layout (``layout="all_layers"``): one range for K and one for V shaped
``[max_batch, seq_capacity, num_layers, kv_heads, head_dim]``; a layer's view is a strided
slice of it and a page covers ``num_layers`` times fewer tokens.

Head-major layout (``layout="head_major"``): one range per layer and per K/V shaped
``[max_batch, kv_heads, seq_capacity, head_dim]``, each head's keys of a slot contiguous
(DynamicCache's layout, what the CPU SDPA kernel reads fastest); a page is one head's run of
tokens, so a pool page takes ``kv_heads`` pieces in each range::

    K[layer]  slot 0 | head 0: page 0 | page 1 | ... | head 1: page 0 | page 1 | ... |
              slot 1 | head 0: ...

    view: the same [max_batch, max_seq_len, kv_heads, head_dim] indexing (a transposed view)

A pool page is backed by ``num_tensors`` physical pages of the backend, one per piece (range,
and head in the head-major layout): :mod:`vmkv.vmm.memory` numbers them and tracks which hold
memory.

Every page of a range that holds no data reads as zeros (the backend's shared zero page): a
read past a sequence's length never faults, and views stay readable after ``free``, ``trim``
and ``close`` (they read zeros there). Writes go through :meth:`write` only: a write through a
view into an empty page faults (SIGSEGV on the host), so views are for reading.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from ..config import KVCacheConfig, PageGeometry, as_config, check_budget_fits, vmm_geometry
from ..core.base import KVCacheBase
from ..core.budget import CacheBudget
from ..core.calls import exclusive
from ..core.checks import check_tensor
from ..core.sequence import LiveSequence, SeqId
from ..core.step import StepPlan, slot_slice
from ..errors import InvalidConfig, InvalidInput
from ..kernels.contiguous import select_contiguous_kernel
from ..sizes import format_size
from ..validate import as_layer, as_scale
from ..vm import granularity, mapping_room, open_backend
from .memory import MappedPages

log = logging.getLogger("vmkv")


class VirtualKVCache(KVCacheBase):
    """KV cache whose tensors are virtually contiguous and physically paged (vAttention style).

    Args:
        config: the cache configuration; ``page_size`` and ``layout`` decide the pages.
            A mapping of its fields is accepted too.

    Raises:
        InvalidConfig: bad geometry, a budget above the device's memory, or (host) more
            mappings than Linux's ``vm.max_map_count`` leaves (the message names a page size
            that fits).
        BackendUnavailable: CUDA was asked for but is not available.

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

    def __init__(self, config: KVCacheConfig | Mapping[str, Any]) -> None:
        config = as_config(config)
        geometry = vmm_geometry(config, granularity(config.device))
        check_budget_fits(config)
        self.kernel, self._kernel = select_contiguous_kernel(config.device, config.dtype, config.head_dim)
        super().__init__(config, geometry)
        tpp = geometry.tokens_per_page
        self.seq_capacity = -(-config.max_seq_len // tpp) * tpp
        self._heads_per_range = config.num_kv_heads if config.layout == "head_major" else 1
        self._run_bytes = self.seq_capacity * geometry.piece_bytes // tpp  # one slot (one head's run, head-major)
        self.slot_bytes = self._heads_per_range * self._run_bytes
        self._hm_rows: tuple[StepPlan, torch.Tensor] | None = None  # head-major write rows of the last plan
        self._batch: tuple[StepPlan, tuple[int, ...], list | None, int] | None = None  # write_batch's last plan (_batch_memo)
        self._slot_views: tuple[tuple[int, ...], list | None] | None = None  # (slots, per-layer [B, H, capacity, D] views)
        self._memory: MappedPages | None = None
        self._vm = None
        self._bases: list[int] = []
        try:
            self._vm = open_backend(config.device, geometry.piece_bytes, geometry.num_pages * geometry.num_tensors,
                                    max_mappings=self._check_mappings(config, geometry),
                                    on_demand=config.shared_budget is not None)
            range_bytes = config.max_batch_size * self.slot_bytes
            for _ in range(geometry.num_tensors // self._heads_per_range):
                self._bases.append(self._vm.reserve(range_bytes))
            self._k, self._v = self._make_views(config)
            self._memory = MappedPages(self._vm, geometry)
            if config.shared_budget is not None:
                self.budget = CacheBudget(config.shared_budget, geometry.page_bytes, geometry.num_pages, pool=self.pool,
                                          slots=self.slots, memory=self._memory, guard=self.guard, drop=self._drop,
                                          busy=self._step_in_flight, before_serving=self._join_ahead,
                                          counters=self.counters)
            # each layer's K/V flattened to rows once: ``view`` (never a silent copy); token rows
            # [B * S, heads, dim], or head-major (slot, head, position) rows [B * H * S, dim]
            if config.layout == "head_major":
                rows = (config.max_batch_size * config.num_kv_heads * self.seq_capacity, config.head_dim)
                self._rows = [(k.transpose(1, 2).view(rows), v.transpose(1, 2).view(rows)) for k, v in zip(self._k, self._v)]
            else:
                rows = (config.max_batch_size * self.seq_capacity, config.num_kv_heads, config.head_dim)
                self._rows = [(k.view(rows), v.view(rows)) for k, v in zip(self._k, self._v)]
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _check_mappings(config: KVCacheConfig, geometry: PageGeometry) -> int:
        """How many host mappings this cache needs, checked against Linux's ``vm.max_map_count``.

        Each range is one mapping; a run of mapped pages that are neighbours in the page store
        merges into one more, and splits the range once more. Pages mapped one by one (a
        fragmented pool) cost up to two each: if that worst case does not fit, a warning is
        logged and a map that hits the limit raises ``OutOfMappings`` (an ``OutOfPages``), rolled
        back. Returns the mappings promised (0 on CUDA: no such limit).

        Raises:
            InvalidConfig: not even one mapping per page fits; names a page size that does.
        """
        if config.device.type != "cpu":
            return 0
        tensors = geometry.num_tensors
        typical, worst = tensors * (geometry.num_pages + 1), tensors * (2 * geometry.num_pages + 1)
        room = mapping_room()
        if room is None or worst <= room:
            return typical
        step = math.lcm(granularity(config.device), geometry.piece_bytes // geometry.tokens_per_page)
        most_pages = max(1, (room // tensors - 1) // 2)
        fits = -(-config.memory_budget // (tensors * most_pages * step)) * step
        advice = (f"page_size={format_size(fits)} or larger fits even a fragmented pool (or use the all_layers "
                  "layout, a smaller memory_budget, or raise the limit: sysctl -w vm.max_map_count=N)")
        if typical > room:
            raise InvalidConfig(
                f"page_size {format_size(config.page_size)} makes {geometry.num_pages} pages in each of {tensors} "
                f"ranges: {typical} mappings or more, but this process may create only {room} more "
                f"(Linux vm.max_map_count); {advice}"
            )
        log.warning("vmkv: %d pages in %d ranges may need up to %d mappings when fragmented, %d are left "
                    "(Linux vm.max_map_count): a step may then raise OutOfMappings; %s",
                    geometry.num_pages, tensors, worst, room, advice)
        return typical

    def _make_views(self, config: KVCacheConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zero-copy tensors over the reserved ranges: ``[max_batch, seq_capacity, heads, dim]`` per layer."""
        heads, dim, layers = config.num_kv_heads, config.head_dim, config.num_layers
        shape = (config.max_batch_size, self.seq_capacity)
        if config.layout == "per_layer":
            views = [self._vm.tensor(base, (*shape, heads, dim), config.dtype) for base in self._bases]
            return views[0::2], views[1::2]
        if config.layout == "head_major":  # [B, H, S, D] ranges, seen as [B, S, H, D] like the others
            batch, capacity = shape
            views = [self._vm.tensor(base, (batch, heads, capacity, dim), config.dtype).transpose(1, 2) for base in self._bases]
            return views[0::2], views[1::2]
        k_all, v_all = (self._vm.tensor(base, (*shape, layers, heads, dim), config.dtype) for base in self._bases)
        return [k_all[:, :, layer] for layer in range(layers)], [v_all[:, :, layer] for layer in range(layers)]

    # ---- what the model and kernels read ---------------------------------------------------
    @exclusive
    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K and V of a layer, ``[max_batch, max_seq_len, kv_heads, head_dim]`` (zero-copy).

        Positions past each sequence's length hold zeros or stale data (never a fault): read
        them through the lengths of a plan (``kv_lens``). The views stay readable after the
        cache is closed (they then read zeros).
        """
        layer = as_layer(layer, self.config.num_layers)
        seq = self.config.max_seq_len
        return self._k[layer][:, :seq], self._v[layer][:, :seq]

    @exclusive
    def kv(self, seq_id: SeqId, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K and V of one sequence in one layer, each ``[length, kv_heads, head_dim]``
        (zero-copy views of its slot).

        Raises:
            UnknownSequence, InvalidInput.
        """
        seq = self._get(seq_id)
        layer = as_layer(layer, self.config.num_layers)
        return self._k[layer][seq.slot, : seq.length], self._v[layer][seq.slot, : seq.length]

    @exclusive
    def layer_storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V flattened to rows (zero-copy): ``[max_batch * capacity, kv_heads,
        head_dim]`` token rows (row ``slot * capacity + position``, as ``plan.write_rows``), or in
        the head-major layout ``[max_batch * kv_heads * capacity, head_dim]`` (row ``(slot *
        kv_heads + head) * capacity + position``)."""
        return self._rows[as_layer(layer, self.config.num_layers)]

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> None:
        if self.config.layout != "head_major":
            return super()._store(layer, k, v, plan)
        rows = self._head_major_rows(plan)  # [T * H]
        k_rows, v_rows = self._rows[layer]
        k_rows.index_copy_(0, rows, k.reshape(-1, self.config.head_dim))
        v_rows.index_copy_(0, rows, v.reshape(-1, self.config.head_dim))

    @exclusive
    def write_batch(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a dense step's new K/V given per sequence, and return what a stock kernel reads.

        A dense step: every sequence of ``plan`` held the same number of tokens and adds the same
        number ``S`` (a transformers batch). Where the plan's slots are evenly spaced (a batch
        keeps its slots) each tensor is written with one copy into the slots' views and the
        result is a zero-copy view; elsewhere the new tokens go through :meth:`write`'s rows and
        the result is gathered (a copy).

        Args:
            layer: layer index.
            k, v: ``[B, kv_heads, S, head_dim]`` (transformers' layout, any strides), one batch row
                per plan sequence in the plan's order, cache dtype and device.
            plan: this step's plan from ``begin_step``.

        Returns:
            ``(keys, values)``, each ``[B, kv_heads, start + S, head_dim]``: every token of the
            plan's sequences, this step's included.

        Raises:
            StalePlan, InvalidShape, InvalidDtype, InvalidDevice, InvalidInput (also: a plan whose
            sequences differ in length).
        """
        memo = self._batch
        if memo is None or memo[0] is not plan:
            memo = self._batch = self._batch_memo(plan)
        _, shape, views, length = memo
        if plan.version != self._version or layer.__class__ is not int or not 0 <= layer < len(self._k):
            layer = self._check_plan(plan, layer)
        if k.shape != shape or v.shape != shape or k.dtype != self.config.dtype or v.dtype != k.dtype \
                or k.device != self.config.device or v.device != k.device:
            for name, tensor in (("k", k), ("v", v)):
                check_tensor(name, tensor, shape, self.config, "[batch, kv_heads, new tokens, head_dim]")
        self._layers_written.add(layer)
        start = length - shape[2]
        if views is not None:
            k_rows, v_rows = views[layer]
            k_rows.narrow(2, start, shape[2]).copy_(k)
            v_rows.narrow(2, start, shape[2]).copy_(v)
            return k_rows.narrow(2, 0, length), v_rows.narrow(2, 0, length)
        packed = [t.transpose(1, 2).reshape(plan.num_tokens, shape[1], shape[3]) for t in (k, v)]
        self._store(layer, *packed, plan)
        index = plan.slots_t.to(torch.long)
        return tuple(t[layer].transpose(1, 2)[:, :, :length].index_select(0, index) for t in (self._k, self._v))

    def _batch_memo(self, plan: StepPlan) -> tuple[StepPlan, tuple[int, ...], list | None, int]:
        """``write_batch``'s per-plan facts, ``(plan, k/v shape, per-layer slot views or None,
        length after the step)``; the views are kept while the plan's slots stay the same.

        Raises:
            StalePlan, InvalidInput: not a plan of this cache, or not a dense step.
        """
        self._check_plan(plan, 0)
        if len(set(plan.starts)) != 1 or len(set(plan.q_lens)) != 1:
            raise InvalidInput("write_batch takes a step whose sequences all hold the same number of tokens "
                               "and add the same number; use write for ragged steps")
        views = self._slot_views
        if views is None or views[0] != plan.slots:
            rows = slot_slice(plan.slots)
            layers = None if rows is None else [(k.transpose(1, 2)[rows], v.transpose(1, 2)[rows]) for k, v in zip(self._k, self._v)]
            views = self._slot_views = (plan.slots, layers)
        shape = (plan.batch_size, self.config.num_kv_heads, plan.q_lens[0], self.config.head_dim)
        return plan, shape, views[1], plan.kv_lens[0]

    def _head_major_rows(self, plan: StepPlan) -> torch.Tensor:
        """Head-major storage rows of the plan's new tokens, ``[T * kv_heads]`` in ``k.reshape(-1, D)``
        order, computed once per plan (the first layer's write) and reused by the others."""
        memo = self._hm_rows
        if memo is not None and memo[0] is plan:
            return memo[1]
        if memo is not None and plan.starts is memo[0].kv_lens:
            rows = memo[1] + 1  # plan = memo's plan.next_decode(): every position one further
            self._hm_rows = (plan, rows)
            return rows
        heads, capacity = self.config.num_kv_heads, self.seq_capacity
        slot, position = plan.write_rows // capacity, plan.write_rows % capacity  # [T]
        head = torch.arange(heads, device=plan.write_rows.device)
        rows = ((slot[:, None] * heads + head[None, :]) * capacity + position[:, None]).reshape(-1)
        self._hm_rows = (plan, rows)
        return rows

    @exclusive
    def attention(self, layer: int, q: torch.Tensor, plan: StepPlan, *, scale: float | None = None) -> torch.Tensor:
        layer = self._check_plan(plan, layer)
        self._check_query(q, plan)
        return self._kernel(q, self._k[layer], self._v[layer], plan, as_scale(scale, self.config.head_dim))

    # ---- the mode's hooks ------------------------------------------------------------------
    def _addr(self, tensor: int, slot: int, index: int) -> int:
        """Address of piece ``tensor``'s logical page ``index`` of ``slot`` (head-major: piece
        ``t`` is head ``t % kv_heads`` of range ``t // kv_heads``)."""
        base, head = divmod(tensor, self._heads_per_range)
        return self._bases[base] + slot * self.slot_bytes + head * self._run_bytes + index * self.geometry.piece_bytes

    def _piece(self, page: int, tensor: int) -> int:
        """The backend page that range ``tensor`` maps for pool page ``page``."""
        return self._memory.piece(page, tensor)

    def _attach(self, slot: int, index: int, page: int, old: int | None, keep: int) -> None:
        """Map ``page`` in every range at ``slot``/``index`` (replacing ``old``); each backend call
        that succeeds (``map_pages`` of a new page's pieces, all or none) journals its inverse, so a failure half-way is rolled back by the caller's
        ``atomic`` block (and a failing rollback marks the cache broken)."""
        nbytes = keep * self.geometry.piece_bytes // self.tokens_per_page  # the stored tokens only
        addrs = [self._addr(t, slot, index) for t in range(self.geometry.num_tensors)]
        saved = [self._vm.tensor(a, (nbytes,), torch.uint8).clone() for a in addrs] if keep else []
        # No kernel may still read these addresses: ``old`` goes away, and on CUDA even the zero
        # page is unmapped for a moment (padded kernels read past a sequence's length).
        if self.budget is not None and self._memory.fresh([page]):
            self.budget.check_granted()
        self._vm.synchronize()
        if old is None:  # a new page (the common case): one backend call maps every piece
            self._vm.map_pages([(addr, self._piece(page, t)) for t, addr in enumerate(addrs)])
            self.guard.log(functools.partial(self._unmap_all, addrs))
        else:
            for t, addr in enumerate(addrs):
                self._vm.unmap(addr)
                self.guard.log(functools.partial(self._vm.map, addr, self._piece(old, t)))
                self._vm.map(addr, self._piece(page, t))
                self.guard.log(functools.partial(self._vm.unmap, addr))
        for addr, data in zip(addrs, saved):
            self._vm.tensor(addr, (nbytes,), torch.uint8).copy_(data)
        self._memory.mapped(page)

    def _unmap_all(self, addrs: list[int]) -> None:
        """Unmap every address of ``addrs``, last first (the undo of ``map_pages``)."""
        for addr in reversed(addrs):
            self._vm.unmap(addr)

    def _detach(self, slot: int, index: int, page: int) -> None:
        """Unmap ``page`` at ``slot``/``index`` in every range (it reads as zeros again); each
        unmap journals its inverse (see :meth:`_attach`)."""
        self._vm.synchronize()  # no kernel may still read the page we take away
        for t in range(self.geometry.num_tensors):
            addr = self._addr(t, slot, index)
            self._vm.unmap(addr)
            self.guard.log(functools.partial(self._vm.map, addr, self._piece(page, t)))

    def _release(self, pages: list[int]) -> None:
        """Give the memory of free pages back to the OS (only pages mapped since their last release)."""
        self._memory.release(pages)

    def _token_rows(self, slot: int, pages: list[int], start: int, count: int) -> torch.Tensor:
        return torch.arange(start, start + count) + slot * self.seq_capacity

    def _block_table(self, seqs: list[LiveSequence], kv_lens: list[int]) -> None:
        return None

    # ---- memory ----------------------------------------------------------------------------
    def stats(self) -> dict:
        stats = super().stats()
        vm = self._vm
        stats.update(
            backend=vm.name if vm is not None else "closed",
            layout=self.config.layout,
            page_size=self.geometry.piece_bytes,
            resident_bytes=vm.resident_bytes() if vm is not None else 0,
            reserved_bytes=len(self._bases) * self.config.max_batch_size * self.slot_bytes,
            pages_mapped_ahead=self.counters["pages_mapped_ahead"],
        )
        budget = self.budget
        if budget is not None:
            stats.update(budget.stats())
        return stats

    def _close_storage(self) -> None:
        vm = getattr(self, "_vm", None)
        if vm is None:
            return
        self._k = self._v = self._rows = []
        self._vm = None
        vm.synchronize()
        vm.close()
