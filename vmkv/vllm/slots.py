"""Request slots of vLLM's contiguous mode (``kv_mode="contiguous"``): vLLM's block table is the page table.

Every layer's K and V get one reserved virtual range each, of ``max_num_seqs`` head-major
*slots* ``[kv_heads, max_model_len, head_dim]`` (rounded up to whole blocks; the pages of
:func:`~vmkv.vllm.contiguous_pages.plan_contiguous_pages` in its ``head_major`` layout). Logical
block ``j`` of the request in slot ``s`` is, for every head ``h``, one page at
``page_offset(s, j, h)`` mapped from the physical memory of head ``h``'s K (or V) in vLLM's block
``block_table[j]`` (the memory the paged backing, :mod:`vmkv.vllm.kvbuffer`, already maps for
that block), so the stock kernel reads one contiguous K/V per request and head::

    vLLM's KV buffer   | blk 0 | blk 1 | blk 2 | blk 3 | blk 4 | ...      (paged, what vLLM writes)
                           .------------'       |
    slot 0 (request a) | blk 2 | blk 4 | zero page ...                     (virtual, what attention reads)
    slot 1 (request b) | blk 2 | blk 3 | zero page ...    blk 2: one physical page in both slots

Two halves, like the map/unmap lists of the paged backing:

* :class:`SlotAssigner` (scheduler side) decides which slot each request holds and which blocks
  each slot maps, step by step, from vLLM's own per-request block lists; the lists travel to every
  rank in the KV connector's metadata (:class:`SlotDelta`). :class:`WriteGuard` proves at every
  step that no block is written after it was full, so sharing a page between slots never needs a
  copy (vLLM shares only full blocks and never writes them).
* :class:`SlotSpace` (worker side) reserves the slot ranges, maps and unmaps block memory into
  them, and finds the slot of every batch row of a step from the row's block table (the block
  holding a row's newest token is written by this step, hence held by that request alone),
  checking that the slot maps exactly the row's blocks.

This module imports no vLLM code.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from ..config import KVShape
from ..errors import BackendError, InvalidConfig
from .contiguous_pages import plan_contiguous_pages
from .kvbuffer import KVBuffer


@dataclass(frozen=True)
class SlotDelta:
    """A step's slot changes, applied by every worker before the step's forward pass.

    Attributes:
        frees: slots whose requests finished or were preempted: everything they map goes
            (applied first, before the KV buffer's own unmaps).
        maps: ``(slot, j, block_id)``: logical block ``j`` of the slot is vLLM block ``block_id``
            (applied after the KV buffer's maps).
    """

    frees: tuple[int, ...] = ()
    maps: tuple[tuple[int, int, int], ...] = ()


class SlotAssigner:
    """Scheduler side: which slot each request holds, and what each slot maps.

    Args:
        max_slots: slots per layer (vLLM's ``max_num_seqs``).
        max_blocks: blocks one slot holds (``max_model_len`` in blocks).

    Slots are handed out lowest first (decode rows of a step then lie in a short run of slots,
    which the batched CPU kernel reads in one call) and given back when the request stops
    holding blocks (finished or preempted; a resumed request gets a slot anew).
    """

    def __init__(self, max_slots: int, max_blocks: int) -> None:
        if max_slots <= 0 or max_blocks <= 0:
            raise InvalidConfig(f"contiguous mode: {max_slots} slots of {max_blocks} blocks: both must be positive")
        self.max_slots = max_slots
        self.max_blocks = max_blocks
        self._slot_of: dict[str, int] = {}
        self._tables: dict[int, list[int]] = {}
        self._free = list(range(max_slots))  # a heap

    def slot_of(self, request_id: str) -> int | None:
        return self._slot_of.get(request_id)

    def has_stale(self, holding: Mapping[str, object]) -> bool:
        """Whether a slot still belongs to a request that holds no blocks any more (its free
        waits for a step to carry it)."""
        return any(request not in holding for request in self._slot_of)

    def update(self, holding: Mapping[str, Sequence[int]]) -> SlotDelta:
        """The changes since the previous call, given every request that holds blocks now.

        Args:
            holding: request id -> its block ids in order (vLLM's block table row).

        Raises:
            BackendError: more requests than slots, a request longer than a slot, or a block
                table entry that changed (vLLM replaces entries only for sliding-window and
                Mamba layers, which contiguous mode refuses at start).
        """
        gone = [request for request in self._slot_of if request not in holding]
        frees = []
        for request in gone:
            slot = self._slot_of.pop(request)
            del self._tables[slot]
            heapq.heappush(self._free, slot)
            frees.append(slot)
        maps = []
        for request, blocks in holding.items():
            slot = self._slot_of.get(request)
            if slot is None:
                if not self._free:
                    raise BackendError(f"contiguous mode: {len(self._slot_of) + 1} requests hold blocks, "
                                       f"{self.max_slots} slots (max_num_seqs)")
                slot = self._slot_of[request] = heapq.heappop(self._free)
                self._tables[slot] = []
            table = self._tables[slot]
            if len(blocks) > self.max_blocks:
                raise BackendError(f"contiguous mode: request {request} holds {len(blocks)} blocks, a slot {self.max_blocks}")
            if len(blocks) < len(table) or (table and blocks[len(table) - 1] != table[-1]):
                raise BackendError(f"contiguous mode: vLLM changed block table entries of request {request} "
                                   "(only full attention is supported)")
            for j in range(len(table), len(blocks)):
                maps.append((slot, j, blocks[j]))
            table.extend(blocks[len(table):])
        return SlotDelta(tuple(frees), tuple(maps))


class WriteGuard:
    """Proves that no block is written after it was full: sharing full blocks between slots then
    never needs copy-on-write.

    A block counts as full from the step whose writes complete it until vLLM hands it out again
    as a fresh block (:meth:`fresh`). Several requests may hold a block while it fills (vLLM
    lets a request hit blocks being computed in the same step; each layer writes every row's K/V
    before any row attends), but none may write a block that was full before the step.

    Args:
        block_size: tokens per block.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._full_since: dict[int, int] = {}
        self.checked_writes = 0

    def fresh(self, block_ids: Iterable[int]) -> None:
        """vLLM handed these blocks out empty: whatever they held is gone."""
        for block_id in block_ids:
            self._full_since.pop(block_id, None)

    def step(self, step: int, writes: Iterable[tuple[Sequence[int], int, int]]) -> None:
        """Check and record one step's writes.

        Args:
            step: the step number (increasing).
            writes: ``(block ids, computed tokens before the step, tokens the step adds)`` per
                scheduled request.

        Raises:
            BackendError: a block full before this step would be written (a copy would be needed).
        """
        size = self.block_size
        for blocks, computed, count in writes:
            end = computed + count
            for j in range(computed // size, -(-end // size)):
                full = self._full_since.get(blocks[j])
                if full is not None and full < step:
                    raise BackendError(f"contiguous mode: step {step} writes block {blocks[j]}, full since step {full}: "
                                       "a shared page would need copy-on-write")
                self.checked_writes += 1
            for j in range(computed // size, end // size):
                self._full_since.setdefault(blocks[j], step)


@dataclass(frozen=True)
class _ViewGeometry:
    """Where one layer's blocks lie in the KV buffer (bytes from its start)."""

    base: int  # block 0
    stride: int  # block b starts at base + b * stride


class SlotSpace:
    """Worker side: the slot ranges of every layer and the blocks mapped into them.

    Each layer has a K and a V range of ``max_slots`` head-major slots, ``[slots, kv_heads,
    tokens, head_dim]`` (the ``head_major`` layout of :class:`~vmkv.cache.VirtualKVCache`; its
    pages are placed by :meth:`~vmkv.vllm.contiguous_pages.ContiguousPagePlan.page_offset`):
    every head's tokens are contiguous, which CPU SDPA reads fastest (``python -m
    benchmarks.vllm_slot_layouts``: 1.6x over token-major slots in decode). The K (V) of one head
    of vLLM's block ``b`` is one page of that piece: block memory is read as ``[kv_heads, K|V,
    block_size, head_dim]``, the interior vLLM's own CPU kernel uses.

    Args:
        buffer: the worker's KV buffer (its backend reserves the slot ranges and maps the pages).
        views: vLLM's per-layer KV tensors over ``buffer``, logical ``[num_blocks, kv_heads,
            block_size, 2 * head_dim]`` in head-major memory order (``LBHNC``: a block is
            ``[kv_heads, block_size, 2 * head_dim]`` contiguous, each head's run read as its
            ``block_size`` K rows then its ``block_size`` V rows).
        num_blocks, block_size: vLLM's.
        max_slots, max_blocks: as :class:`SlotAssigner`.

    Raises:
        InvalidConfig: not the host backend, one head's K of a block is not a whole number of
            OS pages (the mapping granule), or a view is not head-major.
    """

    def __init__(self, buffer: KVBuffer, views: Mapping[str, torch.Tensor], num_blocks: int, block_size: int,
                 max_slots: int, max_blocks: int) -> None:
        if buffer.backend.name != "host":
            raise InvalidConfig(f"vmkv kv_mode='contiguous' runs on the host backend (CPU) only for now, not on "
                                f"{buffer.backend.name}: CUDA maps 2 MiB pages, whose size decision (issue 20, part 3) "
                                "is not made yet; use kv_mode='paged'")
        self.buffer = buffer
        self.backend = buffer.backend
        self.block_size = block_size
        self.max_slots, self.max_blocks = max_slots, max_blocks
        unique: dict[int, torch.Tensor] = {}
        for view in views.values():
            unique.setdefault(view.data_ptr(), view)
        first = next(iter(unique.values()))
        self.num_heads, self.head_dim = first.shape[1], first.shape[3] // 2
        self.dtype = first.dtype
        self.plan = plan_contiguous_pages(
            KVShape(1, self.num_heads, self.head_dim, first.element_size()), self.backend.granularity,
            max_model_len=max_blocks * block_size, max_num_seqs=max_slots, block_size=block_size, layout="head_major")
        self.block_bytes = self.plan.block_bytes  # one layer's block: every head's K and V
        self._geometry = [self._geometry_of(view, num_blocks) for view in unique.values()]
        self.layer_index = {name: list(unique).index(view.data_ptr()) for name, view in views.items()}
        page = self.backend.page_size
        self._range_bytes = -(-self.plan.reservation_bytes // page) * page
        self._bases = [(self.backend.reserve(self._range_bytes), self.backend.reserve(self._range_bytes))
                       for _ in self._geometry]  # (K, V) per layer
        shape = (max_slots, self.num_heads, self.plan.slot_tokens, self.head_dim)
        tensors = [[self.backend.tensor(base, shape, self.dtype).transpose(1, 2) for base in pair] for pair in self._bases]
        self.k = [pair[0] for pair in tensors]  # [slots, capacity, Hkv, D] views of head-major slots; zero page where unmapped
        self.v = [pair[1] for pair in tensors]
        self._tables = np.full((max_slots, max_blocks), -1, dtype=np.int64)
        self._lengths = [0] * max_slots
        self._holders: dict[tuple[int, int], set[int]] = {}  # (j, block) -> slots mapping it there
        self.maps = self.unmaps = self.frees = 0
        self.kernel_calls: dict[str, int] = {}
        self.kernel_seconds = 0.0
        self.mode_seconds = 0.0  # the mode's own per-step work on the worker: step metadata and K/V writes
        self.foreign_calls = 0  # kernel calls given K/V outside the slots or a block table: must stay 0

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

    def _geometry_of(self, view: torch.Tensor, num_blocks: int) -> _ViewGeometry:
        element = view.element_size()
        tokens, width = view.shape[2], view.shape[3]
        head_major = view.stride()[1:] == (tokens * width, width, 1)
        if view.shape[0] != num_blocks or tokens != self.block_size or not head_major:
            raise InvalidConfig(f"contiguous mode needs head-major KV blocks (layout LBHNC), got a view of shape "
                                f"{tuple(view.shape)} and strides {view.stride()}")
        base = view.data_ptr() - self.buffer.addr
        stride = view.stride(0) * element
        grain = self.backend.granularity
        if base % grain or stride % grain:
            raise InvalidConfig(f"contiguous mode maps KV blocks in OS pages of {grain} B, but a layer's blocks start "
                                f"at offset {base} with stride {stride}")
        return _ViewGeometry(base, stride)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in a slot range (what the tests check the kernel was given)."""
        address = tensor.data_ptr()
        return any(base <= address < base + self._range_bytes for pair in self._bases for base in pair)

    # ---- changes --------------------------------------------------------------------------------
    def free(self, slots: Iterable[int]) -> None:
        """Unmap everything ``slots`` map (they read zeros again)."""
        for slot in slots:
            self.frees += 1
            count = self._lengths[slot]
            if count:
                for base in (base for pair in self._bases for base in pair):
                    for head in range(self.num_heads):  # a head's pages are consecutive in its slot
                        self.backend.unmap_range(base + self.plan.page_offset(slot, 0, head), count * self.plan.page_bytes)
                self.unmaps += count * len(self._bases)
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
        one physical page, in one call).

        Raises:
            BackendError: an entry is out of order (not the slot's next block), or its block's
                page is not mapped in the KV buffer (the scheduler's lists disagree).
        """
        for slot, j, block in maps:
            self._record(slot, j, block)
        page_bytes = self.plan.page_bytes
        for pair, geometry in zip(self._bases, self._geometry):
            for half, base in enumerate(pair):
                for head in range(self.num_heads):
                    run: list[int] | None = None  # [addr, physical, offset, nbytes]
                    for slot, j, block in maps:
                        source = geometry.base + block * geometry.stride + (2 * head + half) * page_bytes
                        for physical, offset, done, nbytes in self._pieces(source, page_bytes):
                            addr = base + self.plan.page_offset(slot, j, head) + done
                            if run and run[0] + run[3] == addr and run[1] == physical and run[2] + run[3] == offset:
                                run[3] += nbytes
                                continue
                            if run:
                                self.backend.map_range(*run)
                            run = [addr, physical, offset, nbytes]
                    if run:
                        self.backend.map_range(*run)
        self.maps += len(maps) * len(self._bases)

    def _record(self, slot: int, j: int, block: int) -> None:
        if j != self._lengths[slot] or j >= self.max_blocks:
            raise BackendError(f"contiguous mode: slot {slot} got block {j} after {self._lengths[slot]} blocks")
        self._tables[slot, j] = block
        self._lengths[slot] = j + 1
        self._holders.setdefault((j, block), set()).add(slot)

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
        mode's step metadata and K/V writes, :meth:`record_mode_work`): slots in use, blocks mapped into slots (all layers count once),
        distinct blocks among them, blocks mapped/unmapped (per layer), slots freed, the kernels called (name ->
        calls) and calls that read anything but slots (``foreign_calls``, always 0)."""
        mapped = int((self._tables >= 0).sum())
        distinct = len(np.unique(self._tables[self._tables >= 0]))
        return {"slots_in_use": sum(1 for n in self._lengths if n), "slot_blocks_mapped": mapped,
                "slot_blocks_distinct": distinct, "slot_block_bytes": self.block_bytes,
                "slot_maps": self.maps, "slot_unmaps": self.unmaps, "slot_frees": self.frees,
                "slot_reserved_bytes": 2 * len(self._bases) * self._range_bytes,
                "kernel_calls": dict(self.kernel_calls), "kernel_seconds": self.kernel_seconds,
                "mode_seconds": self.mode_seconds,
                "foreign_calls": self.foreign_calls}

    def close(self) -> None:
        """Give the slot ranges back (their views then read zeros)."""
        for base in (base for pair in self._bases for base in pair):
            try:
                self.backend.free_reservation(base, self._range_bytes)
            except BackendError:
                pass  # the backend was closed already: its reservations are gone with it
        self._bases = []
