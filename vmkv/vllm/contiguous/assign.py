"""Scheduler side of contiguous mode (``kv_mode="contiguous"``): which slot each request holds and
what each slot maps, step by step.

vLLM keeps its own per-request block lists (``req_to_blocks``); :class:`SlotAssigner` turns them
into slot changes (:class:`SlotDelta`), which travel to every rank in the KV connector's per-step
metadata (:class:`vmkv.vllm.metadata.VmkvMetadata`) next to the paged backing's page lists; the
worker side (:class:`vmkv.vllm.contiguous.slots.SlotSpace`) maps them. :class:`WriteGuard` proves
at every step that no block is written after it was full, so sharing a page between slots never
needs a copy (vLLM shares only full blocks and never writes them).

This module imports no vLLM code.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from ...errors import BackendError, InvalidConfig


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
