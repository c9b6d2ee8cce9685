"""How an eager forward stores its K/V, per attention style: :class:`DenseWrites` (``"model"``,
every column stored, views returned) or :class:`RaggedWrites` (``"vmkv"``, real tokens only,
the cache's kernel attends). Each begins one step per forward, at its first layer.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ..core.base import KVCacheBase
from ..core.step import StepPlan, slot_slice
from ..errors import InvalidInput
from .compiled import CompiledStep
from .rows import RowTable

log = logging.getLogger("vmkv")


@dataclass(slots=True)
class Forward:
    """One forward's step: the core plan and, where padding is dropped, the kept tokens."""

    plan: StepPlan
    keep: torch.Tensor | None = None  # int64 [T]: rows of the flattened [B * S] new tokens that are stored
    gathered: bool = False  # "model" style: rows not in evenly spaced slots, so write_batch returns copies

    @classmethod
    def dense(cls, plan: StepPlan) -> "Forward":
        return cls(plan, gathered=slot_slice(plan.slots) is None)


def note_peak(core: KVCacheBase, counters: Counter[str]) -> None:
    """After a step began: ``counters["peak_bytes"]``, the most pool bytes in use so far."""
    counters["peak_bytes"] = max(counters["peak_bytes"], core.bytes_in_use)


def pack(states: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` -> contiguous ``[B * S, H, D]`` (row after row: the plan's packing order)."""
    batch, heads, q_len, dim = states.shape
    if q_len == 1:  # decode: no transpose needed (one reshape, a view of a contiguous tensor)
        return states.reshape(batch, heads, dim).contiguous()
    return states.transpose(1, 2).reshape(batch * q_len, heads, dim).contiguous()


class DenseWrites:
    """The ``"model"`` style: every row stores all ``S`` new columns; the model attends over views."""

    name = "model"

    def __init__(self, table: RowTable, counters: Counter[str]) -> None:
        self.table, self.counters = table, counters

    def begin(self, core: KVCacheBase, q_len: int, compiled: CompiledStep | None) -> Forward:
        """A step of ``q_len`` new columns for every row."""
        plan = core.begin_step(dict.fromkeys(self.table.seq_ids, q_len))
        self.table.columns += q_len
        if compiled is not None:
            compiled.static.load(plan)
        note_peak(core, self.counters)
        return Forward.dense(plan)

    def write(self, core: KVCacheBase, layer: int, k: torch.Tensor, v: torch.Tensor, forward: Forward,
              compiled: CompiledStep | None, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` ``[B, H, S, D]`` and return ``[B, H, columns, D]`` views (a copy where slots are
        not evenly spaced); a sliding layer from its window's first column; ``compiled``: ``max_seq_len`` long.
        """
        keys, values = core.write_batch(layer, k, v, forward.plan)
        if window and compiled is None:
            offset = max(forward.plan.starts[0] - window + 1, 0)
            keys, values = keys[:, :, offset:], values[:, :, offset:]
        if compiled is not None:
            if compiled.live:
                compiled.finish(layer, "eager")
            return compiled.static.views(layer, k.shape[0])
        if forward.gathered:
            self.counters["gathered_views"] += 1
            if self.counters["gathered_views"] == 1:
                log.info("vmkv.hf: rows are not in consecutive slots (beam reorder); views are gathered (a copy). "
                         "attn_implementation='vmkv' avoids this")
        return keys, values


class RaggedWrites:
    """The ``"vmkv"`` style: each row stores only its real new columns; the attention writes them."""

    name = "vmkv"

    def __init__(self, table: RowTable, counters: Counter[str]) -> None:
        self.table, self.counters = table, counters

    def begin(self, core: KVCacheBase, mask: torch.Tensor | None, batch: int, q_len: int,
              windows: tuple[int, ...] | None = None) -> Forward:
        """A step of each row's real columns among the last ``q_len`` (``mask``: True for real tokens).

        Raises:
            InvalidInput: a 4D mask, a step of padding only, or (sliding ``windows``) padding that is
                not the start of a new row.
        """
        real = None
        if mask is not None:
            if mask.dim() != 2:
                raise InvalidInput("the vmkv attention takes a 2D padding mask; 4D masks are not supported")
            real = mask[:, -q_len:].to(torch.bool)
            if bool(real.all()):
                real = None
            elif windows and (self.table.columns or bool((real[:, 1:] < real[:, :-1]).any())):
                raise InvalidInput("with sliding windows the vmkv attention takes padding only on the left of a first "
                                   "prompt (a window counts padding columns, which it does not store); use the model's "
                                   "attention for padded follow-up prompts")
        counts = [q_len] * batch if real is None else real.sum(1).tolist()
        batch_plan = {seq_id: n for seq_id, n in zip(self.table.seq_ids, counts) if n > 0}
        if not batch_plan:
            raise InvalidInput("every row of this step is padding")
        plan = core.begin_step(batch_plan)
        columns = self.table.columns
        if real is not None:
            for row, flags in enumerate(real.tolist()):
                self.table.dropped[row].extend(columns + j for j, ok in enumerate(flags) if not ok)
        self.table.columns += q_len
        note_peak(core, self.counters)
        keep = None if real is None else real.reshape(-1).nonzero().squeeze(1).to(mask.device)
        return Forward(plan, keep)

    @staticmethod
    def attend(core: KVCacheBase, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               forward: Forward, scaling: float | None, compiled: CompiledStep | None, variant: Any) -> torch.Tensor:
        """Write one layer's real new tokens and run the cache's kernel.

        Shapes: ``query: [B, Hq, S, D]``, ``key, value: [B, Hkv, S, D]``; returns ``[B, S, Hq, D]``.
        """
        batch, q_heads, q_len, dim = query.shape
        q, k, v = pack(query), pack(key), pack(value)
        keep = forward.keep
        if keep is not None:
            q, k, v = q.index_select(0, keep), k.index_select(0, keep), v.index_select(0, keep)
        core.write(layer, k, v, forward.plan)
        out = core.attention(layer, q, forward.plan, scale=scaling, softcap=variant.softcap, sinks=variant.sinks)  # [T, Hq, D]
        if keep is not None:
            full = out.new_zeros(batch * q_len, q_heads, dim)
            full[keep] = out
            out = full
        if compiled is not None and compiled.live:
            compiled.finish(layer, "eager")
        return out.view(batch, q_len, q_heads, dim)
