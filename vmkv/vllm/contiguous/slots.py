"""Worker side of contiguous mode (``kv_mode="contiguous"``): the request slots, where vLLM's block
table is the page table.

On the host every layer's K and V get one reserved virtual range each, of ``max_num_seqs``
head-major *slots* ``[kv_heads, max_model_len, head_dim]`` (rounded up to whole blocks; the pages
of :func:`~vmkv.vllm.contiguous.pages.plan_contiguous_pages` in its ``head_major`` layout); on
CUDA, whose pages are 2 MiB, one K and one V range hold every layer (``all_layers``, see
:data:`SLOT_LAYOUTS`). Logical block ``j`` of the request in slot ``s`` is, for every piece (a
head's K or V on the host, all layers' K or V on CUDA), one page at ``page_offset(s, j, h)``
mapped from the physical memory of that piece of vLLM's block ``block_table[j]`` (the memory the
paged backing, :mod:`vmkv.vllm.worker.kvbuffer`, already maps for that block), so the stock kernel reads
one contiguous K/V per request (and head)::

    vLLM's KV buffer   | blk 0 | blk 1 | blk 2 | blk 3 | blk 4 | ...      (paged, what vLLM writes)
                           .------------'       |
    slot 0 (request a) | blk 2 | blk 4 | zero page ...                     (virtual, what attention reads)
    slot 1 (request b) | blk 2 | blk 3 | zero page ...    blk 2: one physical page in both slots

Two halves, like the map/unmap lists of the paged backing: the scheduler side
(:mod:`vmkv.vllm.contiguous.assign`) decides which slot each request holds and which blocks each
slot maps, and the lists travel to every rank in the KV connector's metadata
(:class:`~vmkv.vllm.contiguous.assign.SlotDelta`). Here, :class:`SlotSpace` reserves the slot
ranges, maps and unmaps block memory into them (undoing everything when the OS or driver refuses
a call), and finds the slot of every batch row of a step from the row's block table (the block
holding a row's newest token is written by this step, hence held by that request alone),
checking that the slot maps exactly the row's blocks.

This module imports no vLLM code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from ...config import KVShape
from ...errors import BackendError, InvalidConfig
from ..worker.kvbuffer import KVBuffer
from .pages import ContiguousPagePlan, plan_contiguous_pages


@dataclass(frozen=True)
class SlotLayout:
    """How one device's slots and vLLM's blocks are laid out (one choice per device type).

    Attributes:
        slots: the slots' VMM layout (:func:`~vmkv.vllm.contiguous.pages.plan_contiguous_pages`).
        vllm_layout: the ``KVCacheLayout`` name vLLM is asked for (the backend's
            ``supported_kv_cache_layouts``).
        why: the reason, for docs and errors.
    """

    slots: str
    vllm_layout: str
    why: str


SLOT_LAYOUTS: dict[str, SlotLayout] = {
    "cpu": SlotLayout("head_major", "LBHNC", "OS pages of 4 KiB hold one head's K of a block; CPU SDPA reads "
                      "head-major slots fastest (docs/vllm.md, \"Contiguous mode\")"),
    "cuda": SlotLayout("all_layers", "BLHNC", "2 MiB VMM pages: all layers' K of a block is the smallest piece "
                       "that is whole pages at vLLM-sized blocks (docs/vllm.md, \"Contiguous mode: page size on CUDA\")"),
}
"""The slot layout of each device type: head-major per-layer slots on the host, one all-layers
K and V range on CUDA (FlashAttention reads a layer's strided slice of it as it is)."""


def slot_layout(device_type: str) -> SlotLayout:
    """The :data:`SLOT_LAYOUTS` entry of ``device_type``.

    Raises:
        InvalidConfig: contiguous mode has no layout for that device.
    """
    layout = SLOT_LAYOUTS.get(device_type)
    if layout is None:
        raise InvalidConfig(f"vmkv kv_mode='contiguous' runs on {' and '.join(SLOT_LAYOUTS)}, not {device_type}: "
                            "use kv_mode='paged'")
    return layout


@dataclass(frozen=True)
class _Group:
    """One pair of slot ranges (K, V) and where its blocks lie in the KV buffer (bytes)."""

    base: int  # block 0 of this group (head-major: one layer; all-layers: every layer)
    stride: int  # block b starts at base + b * stride


class SlotSpace:
    """Worker side: the slot ranges of every layer and the blocks mapped into them.

    One implementation for both backends; the layout follows the device
    (:data:`SLOT_LAYOUTS`), the mapping unit the backend (``map_granule``: OS pages on the host,
    whole pages on CUDA, whose ``cuMemMap`` maps a handle from offset 0 only):

    * host (``head_major``): each layer has a K and a V range of ``max_slots`` head-major slots,
      ``[slots, kv_heads, tokens, head_dim]`` (the ``head_major`` layout of
      :class:`~vmkv.vmm.cache.VirtualKVCache`), which CPU SDPA reads fastest. vLLM's blocks are
      layer-outermost (``LBHNC``); one layer's block is read as ``[kv_heads, K|V, block_size,
      head_dim]``, so the K (V) of one head of a block is one page of that head's slot.
    * CUDA (``all_layers``): one K and one V range of ``[slots, tokens, layers, kv_heads,
      head_dim]``; a layer's view is a strided slice. vLLM's blocks are block-outermost
      (``BLHNC``: every layer of a block in one run); a block is read as ``[K|V, block_size,
      layers, kv_heads, head_dim]``, so its K (V) is one page of the slot (whole 2 MiB granules:
      the plan's block size), mapped from the buffer's pages behind it.

    Pages are placed by :meth:`~vmkv.vllm.contiguous.pages.ContiguousPagePlan.page_offset`.
    Every change is undone if the backend refuses a call: a failed ``map`` or ``free`` leaves the
    slots, and the backend's mappings, as they were.

    Args:
        buffer: the worker's KV buffer (its backend reserves the slot ranges and maps the pages).
        views: vLLM's per-layer KV tensors over ``buffer``, logical ``[num_blocks, kv_heads,
            block_size, 2 * head_dim]``, each block's ``[kv_heads, block_size, 2 * head_dim]``
            contiguous, in the device's ``vllm_layout``.
        num_blocks, block_size: vLLM's.
        max_slots, max_blocks: as :class:`~vmkv.vllm.contiguous.assign.SlotAssigner`.

    Raises:
        InvalidConfig: the device has no slot layout, the block size makes pages that are not
            whole granules (the message names the block sizes that work), a piece is not whole
            mapping units of the backend (``page_size`` on CUDA), or the views are not in the
            layout asked for.
        BackendError: the backend refused to reserve the slot ranges (nothing stays reserved).
    """

    def __init__(self, buffer: KVBuffer, views: Mapping[str, torch.Tensor], num_blocks: int, block_size: int,
                 max_slots: int, max_blocks: int) -> None:
        self.buffer = buffer
        self.backend = buffer.backend
        self.layout = slot_layout(self.backend.device.type)
        self.block_size = block_size
        self.max_slots, self.max_blocks = max_slots, max_blocks
        unique: dict[int, torch.Tensor] = {}
        for view in views.values():
            unique.setdefault(view.data_ptr(), view)
        ordered = [unique[ptr] for ptr in sorted(unique)]
        first = ordered[0]
        self.num_heads, self.head_dim = first.shape[1], first.shape[3] // 2
        self.dtype = first.dtype
        self.num_layers = len(ordered)
        layers = 1 if self.layout.slots == "head_major" else self.num_layers
        self.plan = self._plan(KVShape(layers, self.num_heads, self.head_dim, first.element_size()))
        self.block_bytes = self.plan.block_bytes // layers  # one layer's block: every head's K and V
        for view in ordered:
            self._check_view(view, num_blocks)
        self._groups, layer_of_view = self._place(ordered)
        self.layer_index = {name: layer_of_view[view.data_ptr()] for name, view in views.items()}
        page = self.backend.page_size
        self._range_bytes = -(-self.plan.reservation_bytes // page) * page
        self._bases: list[tuple[int, int]] = []  # (K, V) range per group
        reserved: list[int] = []
        try:
            for _ in self._groups:
                for _half in range(2):
                    reserved.append(self.backend.reserve(self._range_bytes))
                self._bases.append((reserved[-2], reserved[-1]))
            self.k, self.v = self._slot_views()  # [slots, capacity, Hkv, D] per layer; zero page where unmapped
        except BaseException:
            self._free_ranges(reserved)
            raise
        self.write_views = self._write_views(ordered)
        self._tables = np.full((max_slots, max_blocks), -1, dtype=np.int64)
        self._lengths = [0] * max_slots
        self._holders: dict[tuple[int, int], set[int]] = {}  # (j, block) -> slots mapping it there
        self.maps = self.unmaps = self.frees = 0
        self.kernel_calls: dict[str, int] = {}
        self.kernel_seconds = 0.0
        self.mode_seconds = 0.0  # the mode's own per-step work on the worker: step metadata and K/V writes
        self.foreign_calls = 0  # kernel calls given K/V outside the slots or a block table: must stay 0

    def _plan(self, shape: KVShape) -> ContiguousPagePlan:
        """The slots' page plan at vLLM's block size.

        Raises:
            InvalidConfig: that block size makes pages that are not whole granules of this backend;
                the message names the block size to start vLLM with.
        """
        kw: dict[str, Any] = dict(max_model_len=self.max_blocks * self.block_size, max_num_seqs=self.max_slots,
                                  layout=self.layout.slots)
        try:
            return plan_contiguous_pages(shape, self.backend.granularity, block_size=self.block_size, **kw)
        except InvalidConfig as exc:
            works = plan_contiguous_pages(shape, self.backend.granularity, **kw).block_size
            raise InvalidConfig(f"vmkv kv_mode='contiguous' on {self.backend.device.type}: vLLM's block_size "
                                f"{self.block_size} does not make whole pages; start vLLM with block_size={works} "
                                f"(--block-size {works}) or a multiple of it ({exc})") from None

    def record_call(self, kernel: str, k: torch.Tensor, plan: Any, seconds: float) -> None:
        """Count one kernel call and its time, and whether it read anything but slots (it must not)."""
        self.kernel_calls[kernel] = self.kernel_calls.get(kernel, 0) + 1
        self.kernel_seconds += seconds
        if plan.block_table is not None or not self.owns(k):
            self.foreign_calls += 1

    def record_mode_work(self, seconds: float) -> None:
        """Count time the mode spends per step beside the kernel (the attention builder's slot
        lookup and plan, the K/V writes): what contiguous mode adds to a vLLM step."""
        self.mode_seconds += seconds

    # ---- geometry -------------------------------------------------------------------------------
    def _check_view(self, view: torch.Tensor, num_blocks: int) -> None:
        tokens, width = view.shape[2], view.shape[3]
        block_contiguous = view.stride()[1:] == (tokens * width, width, 1)
        if view.shape[0] != num_blocks or tokens != self.block_size or not block_contiguous:
            raise InvalidConfig(f"contiguous mode on {self.backend.device.type} needs KV blocks in layout "
                                f"{self.layout.vllm_layout} ({self.layout.why}), got a view of shape {tuple(view.shape)} "
                                f"and strides {view.stride()}")

    def _place(self, ordered: Sequence[torch.Tensor]) -> tuple[list[_Group], dict[int, int]]:
        """The groups of slot ranges and each view's layer (its index in ``ordered``).

        Raises:
            InvalidConfig: pieces are not whole mapping units, or all-layers views are not the
                layers of one block-outermost run.
        """
        element = ordered[0].element_size()
        bases = [view.data_ptr() - self.buffer.addr for view in ordered]
        strides = [view.stride(0) * element for view in ordered]
        layer_bytes = self.block_bytes
        if self.layout.slots == "head_major":
            groups = [_Group(base, stride) for base, stride in zip(bases, strides)]
        else:
            one_run = (len(set(strides)) == 1 and strides[0] >= self.num_layers * layer_bytes
                       and bases == [bases[0] + layer * layer_bytes for layer in range(len(bases))])
            if not one_run:
                raise InvalidConfig(f"contiguous mode on {self.backend.device.type} needs every layer of a block in one "
                                    f"run (layout {self.layout.vllm_layout}); got layer offsets {bases[:4]}... and block "
                                    f"strides {sorted(set(strides))}")
            groups = [_Group(bases[0], strides[0])]
        grain = self.backend.map_granule
        for group in groups:
            if group.base % grain or group.stride % grain or self.plan.page_bytes % grain:
                unit = "whole pages (page_size)" if grain == self.backend.page_size else "OS pages"
                raise InvalidConfig(
                    f"contiguous mode maps K/V pieces of {self.plan.page_bytes} B from the KV buffer in {unit} of "
                    f"{grain} B, but a layer's blocks start at offset {group.base} with stride {group.stride}"
                    + ("; set page_size to a divisor of the piece (vmkv.vllm.engine_args(page_size=...))"
                       if grain == self.backend.page_size else ""))
        return groups, {view.data_ptr(): layer for layer, view in enumerate(ordered)}

    def _slot_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's K and V slot views, ``[slots, slot_tokens, kv_heads, head_dim]``."""
        slots, tokens, heads = self.max_slots, self.plan.slot_tokens, (self.num_heads, self.head_dim)
        if self.layout.slots == "head_major":
            pairs = [[self.backend.tensor(base, (slots, self.num_heads, tokens, self.head_dim), self.dtype).transpose(1, 2)
                      for base in pair] for pair in self._bases]
            return [pair[0] for pair in pairs], [pair[1] for pair in pairs]
        k_all, v_all = (self.backend.tensor(base, (slots, tokens, self.num_layers, *heads), self.dtype)
                        for base in self._bases[0])
        return ([k_all[:, :, layer] for layer in range(self.num_layers)],
                [v_all[:, :, layer] for layer in range(self.num_layers)])

    def _write_views(self, ordered: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per layer, vLLM's blocks as ``[num_blocks, block_size, K|V, kv_heads, head_dim]``
        (strided views of the buffer, where the slots read them): what the attention backend
        writes new K/V into."""
        element = ordered[0].element_size()
        raw = self.buffer.tensor().view(self.dtype)
        size = (ordered[0].shape[0], self.block_size, 2, self.num_heads, self.head_dim)
        d, page = self.head_dim, self.plan.page_bytes // element
        out = []
        for layer, view in enumerate(ordered):
            if self.layout.slots == "head_major":  # a layer's block: [heads, K|V, tokens, D]
                group = self._groups[layer]
                strides, offset = (group.stride // element, d, page, 2 * page, 1), group.base // element
            else:  # a block: [K|V, tokens, layers, heads, D]
                group = self._groups[0]
                strides = (group.stride // element, self.num_layers * self.num_heads * d, page, d, 1)
                offset = group.base // element + layer * self.num_heads * d
            out.append(raw.as_strided(size, strides, offset))
        return out

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in a slot range (what the tests check the kernel was given)."""
        address = tensor.data_ptr()
        return any(base <= address < base + self._range_bytes for pair in self._bases for base in pair)

    # ---- changes --------------------------------------------------------------------------------
    def _runs(self, maps: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
        """The backend calls that map ``(slot, j, block)`` entries: ``(addr, physical page, offset,
        bytes)`` runs, pieces that continue the previous one in the slot and in one physical page
        merged. Pure: raises before anything changes.

        Raises:
            InvalidInput: a block's page is not mapped in the KV buffer.
        """
        page_bytes = self.plan.page_bytes
        runs: list[tuple[int, int, int, int]] = []
        for pair, group in zip(self._bases, self._groups):
            for half, base in enumerate(pair):
                for head in range(self.plan.heads_per_range):
                    run: list[int] | None = None  # [addr, physical, offset, nbytes]
                    for slot, j, block in maps:
                        source = group.base + block * group.stride + (half + 2 * head) * page_bytes
                        for physical, offset, done, nbytes in self._pieces(source, page_bytes):
                            addr = base + self.plan.page_offset(slot, j, head) + done
                            if run and run[0] + run[3] == addr and run[1] == physical and run[2] + run[3] == offset:
                                run[3] += nbytes
                                continue
                            if run:
                                runs.append(tuple(run))  # type: ignore[arg-type]
                            run = [addr, physical, offset, nbytes]
                    if run:
                        runs.append(tuple(run))  # type: ignore[arg-type]
        return runs

    def _map_runs(self, runs: Sequence[tuple[int, int, int, int]]) -> None:
        """Map ``runs``; if the backend refuses one, unmap those mapped and raise."""
        done: list[tuple[int, int, int, int]] = []
        try:
            for run in runs:
                self.backend.map_range(*run)
                done.append(run)
        except BackendError as exc:
            raise self._undo(exc, done, self.backend.unmap_range, lambda run: (run[0], run[3])) from None

    def _undo(self, exc: BackendError, done: Sequence[tuple[int, int, int, int]], call: Any, args: Any) -> BackendError:
        """Apply ``call(*args(run))`` to ``done`` in reverse; the error to raise (naming failed undos)."""
        failed: list[str] = []
        for run in reversed(done):
            try:
                call(*args(run))
            except BackendError as undo:
                failed.append(str(undo))
        if failed:
            return BackendError(f"{exc}; undoing {len(failed)} of {len(done)} slot mappings failed too: {failed[0]}")
        return exc

    def free(self, slots: Iterable[int]) -> None:
        """Unmap everything ``slots`` map (they read zeros again), after the device is done with
        them (``backend.synchronize()``).

        Raises:
            BackendError: the backend refused a call (what was unmapped is mapped back first).
        """
        slots = list(slots)
        runs = self._runs([(slot, j, int(self._tables[slot, j])) for slot in slots for j in range(self._lengths[slot])])
        if runs:
            self.backend.synchronize()
        done: list[tuple[int, int, int, int]] = []
        try:
            for run in runs:
                self.backend.unmap_range(run[0], run[3])
                done.append(run)
        except BackendError as exc:
            raise self._undo(exc, done, self.backend.map_range, lambda run: run) from None
        for slot in slots:
            self.frees += 1
            count = self._lengths[slot]
            self.unmaps += count * self.num_layers
            for j in range(count):
                key = (j, int(self._tables[slot, j]))
                self._holders[key].discard(slot)
                if not self._holders[key]:
                    del self._holders[key]
            self._tables[slot, :count] = -1
            self._lengths[slot] = 0

    def map(self, maps: Sequence[tuple[int, int, int]]) -> None:
        """Map ``(slot, j, block)``: block ``block``'s memory at logical block ``j`` of ``slot``, in
        every layer, head and K/V piece (pieces that continue the previous one, in the slot and in
        one physical page, in one call). No synchronize is needed: no kernel reads a slot past
        the blocks it holds (CUDA's kernels read exact lengths; the CPU's run synchronously).

        Raises:
            BackendError: an entry is out of order (not the slot's next block), or the backend
                refused a call (the slots and mappings stay as they were).
            InvalidInput: a block's page is not mapped in the KV buffer (the scheduler's lists
                disagree); nothing changed.
        """
        lengths = list(self._lengths)
        for slot, j, _ in maps:
            if j != lengths[slot] or j >= self.max_blocks:
                raise BackendError(f"contiguous mode: slot {slot} got block {j} after {lengths[slot]} blocks")
            lengths[slot] = j + 1
        self._map_runs(self._runs(maps))
        for slot, j, block in maps:
            self._tables[slot, j] = block
            self._lengths[slot] = j + 1
            self._holders.setdefault((j, block), set()).add(slot)
        self.maps += len(maps) * self.num_layers

    def _pieces(self, start: int, length: int) -> list[tuple[int, int, int, int]]:
        """``(physical page, offset in it, offset from start, bytes)`` of the buffer's bytes
        ``[start, start + length)``, split where they cross a buffer page."""
        page_size = self.buffer.page_size
        pieces, done = [], 0
        while done < length:
            page, offset = divmod(start + done, page_size)
            nbytes = min(length - done, page_size - offset)
            pieces.append((self.buffer.physical_page(page), offset, done, nbytes))
            done += nbytes
        return pieces

    # ---- a step's rows --------------------------------------------------------------------------
    def rows_to_slots(self, block_table: torch.Tensor, seq_lens: Sequence[int]) -> list[int] | None:
        """The slot of each batch row, or ``None`` for a dummy batch (vLLM's profiling runs: rows
        on the null block 0).

        A row's newest token lies in a block this step writes, which only its request holds, so
        ``(j, block_table[row, j])`` for that block names one slot; the slot must then map exactly
        the row's first ``ceil(seq_len / block_size)`` blocks.

        Raises:
            BackendError: a row has no slot, or its slot maps other blocks than its block table.
        """
        table = block_table.cpu().numpy()
        slots = []
        for row, length in enumerate(seq_lens):
            j = (length - 1) // self.block_size
            block = int(table[row, j])
            if block == 0:
                if row == 0:
                    return None
                raise BackendError(f"contiguous mode: batch row {row} writes into vLLM's null block")
            holders = self._holders.get((j, block), ())
            if len(holders) != 1:
                raise BackendError(f"contiguous mode: batch row {row} writes block {block} (its block {j}), mapped in "
                                   f"{len(holders)} slots instead of one")
            slots.append(next(iter(holders)))
        counts = [-(-length // self.block_size) for length in seq_lens]
        width = max(counts)
        mapped = self._tables[slots, :width]
        wanted = np.where(np.arange(width)[None, :] < np.array(counts)[:, None], table[: len(slots), :width], -1)
        mapped = np.where(np.arange(width)[None, :] < np.array(counts)[:, None], mapped, -1)
        if not np.array_equal(mapped, wanted):
            bad = int(np.nonzero((mapped != wanted).any(axis=1))[0][0])
            raise BackendError(f"contiguous mode: slot {slots[bad]} maps blocks {mapped[bad].tolist()}, batch row {bad}'s "
                               f"block table says {wanted[bad].tolist()}")
        return slots

    def stats(self) -> dict[str, Any]:
        """Slot counters (``kernel_seconds``: time in the attention kernel; ``mode_seconds``: in the
        mode's step metadata and K/V writes, :meth:`record_mode_work`): slots in use, blocks mapped into slots
        (all layers count once), distinct blocks among them, blocks mapped/unmapped (per layer), slots freed,
        the kernels called (name -> calls) and calls that read anything but slots (``foreign_calls``, always 0)."""
        mapped = int((self._tables >= 0).sum())
        distinct = len(np.unique(self._tables[self._tables >= 0]))
        return {"slots_in_use": sum(1 for n in self._lengths if n), "slot_blocks_mapped": mapped,
                "slot_blocks_distinct": distinct, "slot_block_bytes": self.block_bytes,
                "slot_maps": self.maps, "slot_unmaps": self.unmaps, "slot_frees": self.frees,
                "slot_reserved_bytes": 2 * len(self._bases) * self._range_bytes,
                "kernel_calls": dict(self.kernel_calls), "kernel_seconds": self.kernel_seconds,
                "mode_seconds": self.mode_seconds,
                "foreign_calls": self.foreign_calls}

    def _free_ranges(self, bases: Iterable[int]) -> None:
        for base in bases:
            try:
                self.backend.free_reservation(base, self._range_bytes)
            except BackendError:
                pass  # the backend was closed already: its reservations are gone with it

    def close(self) -> None:
        """Give the slot ranges back (their views then read zeros)."""
        self._free_ranges([base for pair in self._bases for base in pair])
        self._bases = []
