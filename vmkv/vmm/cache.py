"""VMM mode: every K and V tensor is one virtually contiguous range, backed by pages on demand.

Layouts (``config.layout``; drawn in docs/how-it-works.md, "The memory picture"):

    per_layer     one range per layer and K/V, view [max_batch, max_seq_len, kv_heads, head_dim]
    all_layers    one range for K, one for V: [max_batch, seq_capacity, num_layers, kv_heads, head_dim]
    head_major    one range per layer and K/V: [max_batch, kv_heads, seq_capacity, head_dim]
                  (a page is one head's run of tokens: a pool page takes kv_heads pieces)

Every page holding no data reads as zeros (the backend's shared zero page), so reads past a length
never fault. A write into an empty page does fault (SIGSEGV on the host), so the views users get
are read-only (:mod:`vmkv.vmm.views`) and only :meth:`write` and :meth:`write_batch` write, on the
plain tensors underneath.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ..config import KVCacheConfig, as_config
from ..core.base import KVCacheBase
from ..core.calls import exclusive
from ..core.checks import check_tensor
from ..core.sequence import SeqId
from ..core.step import StepPlan, slot_slice
from ..errors import InvalidInput
from ..kernels.registry import KernelSpec, make_kernel
from ..sizing import DeviceFacts, check_budget_fits, resolve, vmm_geometry
from ..validate import as_layer, as_scale
from .ranges import SlotRanges
from .views import ReadOnlyView, read_only

log = logging.getLogger("vmkv")


class VirtualKVCache(KVCacheBase):
    """KV cache whose tensors are virtually contiguous and physically paged (vAttention style).

    Args:
        config: the cache configuration (or a mapping of its fields); ``page_size`` and ``layout``
            decide the pages.
        kernel: force an attention kernel over slots by name (:mod:`vmkv.kernels.registry`);
            default: the one the rule chooses for the device.

    Raises:
        InvalidConfig: bad geometry, an unknown kernel, a budget above the device's memory, or
            (host) more mappings than Linux's ``vm.max_map_count`` leaves (the message names a
            page size that fits).
        BackendUnavailable: CUDA was asked for but is not available, or the forced kernel
            cannot run here.

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

    def __init__(self, config: KVCacheConfig | Mapping[str, Any], *, kernel: str | None = None) -> None:
        facts = DeviceFacts.probe(as_config(config).device)  # read once: the layout, the page, the mappings
        config = resolve(as_config(config), facts)
        geometry = vmm_geometry(config, facts.granularity)
        check_budget_fits(config)
        self._kernel = make_kernel(KernelSpec("slots", config.device, config.dtype, config.num_kv_heads, config.head_dim,
                                              features=config.features),
                                   forced=kernel)
        self.kernel = self._kernel.name
        super().__init__(config, geometry)
        self._hm_rows: tuple[StepPlan, torch.Tensor] | None = None  # head-major write rows of the last plan
        self._batch: tuple[StepPlan, tuple[int, ...], list | None, int] | None = None  # write_batch's last plan (_batch_memo)
        self._slot_views: tuple[tuple[int, ...], list | None] | None = None  # (slots, per-layer [B, H, capacity, D] views)
        self.ranges: SlotRanges | None = None
        try:
            self.ranges = ranges = SlotRanges(config, geometry, facts, self.guard.log)
            self._open(ranges)
            self.seq_capacity, self.slot_bytes = ranges.seq_capacity, ranges.slot_bytes
            self._k, self._v = ranges.k, ranges.v
            if config.shared_budget is not None:
                ranges.budget = self._join_budget(config.shared_budget, ranges.memory)
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

    # ---- what the model and kernels read ---------------------------------------------------
    @exclusive
    def kv_cache(self, layer: int) -> tuple[ReadOnlyView, ReadOnlyView]:
        """The whole K and V of a layer, ``[max_batch, max_seq_len, kv_heads, head_dim]``: zero-copy
        read-only views. Past each length: zeros or stale data (read through a plan's ``kv_lens``).

        Raises:
            InvalidInput: no such layer.
        """
        layer = as_layer(layer, self.config.num_layers)
        seq = self.config.max_seq_len
        return read_only(self._k[layer][:, :seq]), read_only(self._v[layer][:, :seq])

    @exclusive
    def kv(self, seq_id: SeqId, layer: int) -> tuple[ReadOnlyView, ReadOnlyView]:
        """The stored K and V of one sequence in one layer, each ``[length, kv_heads, head_dim]``: zero-copy
        read-only views of its slot; after ``free`` or ``close`` they read what the pages then hold
        (``clone()`` to keep them).

        Raises:
            UnknownSequence, InvalidInput.
        """
        seq = self._get(seq_id)
        layer = as_layer(layer, self.config.num_layers)
        return read_only(self._k[layer][seq.slot, : seq.length]), read_only(self._v[layer][seq.slot, : seq.length])

    @exclusive
    def layer_storage(self, layer: int) -> tuple[ReadOnlyView, ReadOnlyView]:
        """A layer's K and V flattened to rows, zero-copy and read-only: ``[max_batch * capacity, kv_heads,
        head_dim]`` (row ``slot * capacity + position``), or head-major ``[max_batch * kv_heads * capacity,
        head_dim]`` (row ``(slot * kv_heads + head) * capacity + position``).

        Raises:
            InvalidInput: no such layer.
        """
        k_rows, v_rows = self._rows[as_layer(layer, self.config.num_layers)]
        return read_only(k_rows), read_only(v_rows)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> None:
        """Copy validated ``k``, ``v`` ``[T, kv_heads, head_dim]`` to their (plain) rows of ``layer``."""
        k_rows, v_rows = self._rows[layer]
        rows = plan.write_rows
        if self.config.layout == "head_major":  # a row per (token, head): [T * H, D]
            rows = self._head_major_rows(plan)
            k, v = k.reshape(-1, self.config.head_dim), v.reshape(-1, self.config.head_dim)
        k_rows.index_copy_(0, rows, k)
        v_rows.index_copy_(0, rows, v)

    @exclusive
    def write_batch(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a dense step's new K/V given per sequence (a transformers batch: equal lengths, ``S`` new
        tokens each), and return what a stock kernel reads: views where the slots are evenly spaced,
        else a gathered copy.

        Args:
            layer: layer index.
            k, v: ``[B, kv_heads, S, head_dim]`` (any strides), one row per plan sequence, in plan order.
            plan: this step's plan from ``begin_step``.

        Returns:
            ``(keys, values)``, each ``[B, kv_heads, start + S, head_dim]``, this step's tokens included:
            for the kernel that reads them now; never write them or keep them past the next call.

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
        """``write_batch``'s per-plan facts ``(plan, shape, slot views or None, length after)``.

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
            layers = None if rows is None else [(k.transpose(1, 2)[rows], v.transpose(1, 2)[rows])
                                                for k, v in zip(self._k, self._v)]
            views = self._slot_views = (plan.slots, layers)
        shape = (plan.batch_size, self.config.num_kv_heads, plan.q_lens[0], self.config.head_dim)
        return plan, shape, views[1], plan.kv_lens[0]

    def _head_major_rows(self, plan: StepPlan) -> torch.Tensor:
        """Head-major rows of the plan's new tokens, ``[T * kv_heads]``, computed once per plan."""
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
    def attention(self, layer: int, q: torch.Tensor, plan: StepPlan, *, scale: float | None = None,
                  softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        layer = self._check_plan(plan, layer)
        self._require_written(layer)
        self._check_query(q, plan)
        return self._kernel(q, self._k[layer], self._v[layer], plan, as_scale(scale, self.config.head_dim),
                            self._variant(softcap, sinks))

    def _piece(self, page: int, tensor: int) -> int:
        """The backend page that range ``tensor`` maps for pool page ``page``."""
        return self.ranges.memory.piece(page, tensor)

    # ---- memory ----------------------------------------------------------------------------
    def stats(self) -> dict:
        stats = super().stats()
        ranges = self.ranges
        vm = ranges.vm if ranges is not None else None
        stats.update(
            backend=vm.name if vm is not None else "closed",
            layout=self.config.layout,
            page_size=self.geometry.piece_bytes,
            resident_bytes=vm.resident_bytes() if vm is not None else 0,
            reserved_bytes=ranges.reserved_bytes if ranges is not None else 0,
            pages_mapped_ahead=self.counters["pages_mapped_ahead"],
        )
        budget = self.budget
        if budget is not None:
            stats.update(budget.stats())
        return stats

    def _close_storage(self) -> None:
        ranges = getattr(self, "ranges", None)
        if ranges is None:
            return
        self._k = self._v = self._rows = []
        self._slot_views = self._batch = None  # (both hold views)
        ranges.close()
