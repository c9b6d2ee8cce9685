"""The one static step: the fixed-address device inputs of a decode step that a compiled forward or a
captured CUDA graph reads, and the write and the decode it runs over a cache's storage.

A compiled or captured step cannot plan, map or read a Python length, so its varying inputs live
in device tensors filled at an eager point before each run (:meth:`StaticStep.load`). A cache of
layer groups has a part per group. Shapes of a part (``capacity`` rows)::

    columns   int64 [capacity]          each row's first new position in its sequence
    slots     int64 [capacity]          slots: each row's slot; blocks: 0 (the pool's token rows)
    write_at  int64 [capacity]          the row's column (slots) or pool row (blocks)
    kv_lens   int32 [capacity]          keys of each row once the step is written
    table     int32 [capacity, width]   slots: each row's slot ([:, 0]); blocks: its block table

Users: ``vmkv.hf.compiled`` and ``vmkv.engine.graphs``; nothing here is shared between caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.step import StepPlan, slot_slice
from ..vmm.views import unguarded
from .base import MODE_ADDRESSING
from .capturable import DecodeWorkspace, decode_attention, decode_store, stores_of, write_columns
from .registry import KernelSpec, choose_capturable


@dataclass(frozen=True)
class PadRow:
    """Where padding rows of a captured bucket point: a scratch sequence's first token."""

    slot: int
    blocks: tuple[int, ...]

    @classmethod
    def of(cls, cache: Any, plan: Any) -> "PadRow":
        """The scratch sequence of ``plan`` (a step of one token, its only sequence)."""
        plans = getattr(plan, "plans", (plan,))
        return cls(int(plan.slots[0]), tuple(int(p.block_table[0, 0]) if p.block_table is not None else 0 for p in plans))


class _Part:
    """The static step over one core cache (one layer group): its stores, positions, table, kernel."""

    COLUMNS, SLOTS, WRITE_AT, KV_LENS = range(4)

    def __init__(self, core: Any, capacity: int, max_len: int) -> None:
        config = core.config
        self.device = torch.device(config.device)
        self.addressing = MODE_ADDRESSING[core.mode]
        spec = KernelSpec(self.addressing, self.device, config.dtype, config.num_kv_heads, config.head_dim,
                          features=config.features)
        self.choice = choose_capturable(spec)
        self.kernel = self.choice.decode
        self.window = config.window or 0
        layers = range(config.num_layers)
        if self.addressing == "blocks":
            self.stores = stores_of([core.block_pool(layer) for layer in layers])  # [blocks, size, H, D]
            self.targets = [(k.token_rows(), v.token_rows()) for k, v in self.stores]  # [1, blocks * size, H, D]
            width = -(-max_len // core.tokens_per_page)
        else:
            self.stores = stores_of([tuple(map(unguarded, core.kv_cache(layer))) for layer in layers])
            self.targets = self.stores
            width = 1
        self.host = torch.zeros(4, capacity, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self.rows = torch.zeros(4, capacity, dtype=torch.int64, device=self.device)  # COLUMNS, SLOTS, WRITE_AT, KV_LENS
        self.kv_lens = torch.zeros(capacity, dtype=torch.int32, device=self.device)
        self.table = torch.zeros(capacity, width, dtype=torch.int32, device=self.device)
        for tensor in (self.rows, self.kv_lens, self.table, *{id(s.base): s.base for p in self.stores for s in p}.values()):
            torch._dynamo.mark_static_address(tensor, guard=False)  # inputs of every graph over this cache

    def load(self, plan: StepPlan, rows: int, pad: PadRow | None, group: int) -> None:
        batch = plan.batch_size
        host = self.host[:, :rows]
        slots = plan.slots if self.addressing == "slots" else (0,) * batch
        host[:, :batch] = torch.tensor((plan.starts, slots, plan.starts, plan.kv_lens))  # write_at: the column (slots)
        if rows > batch:
            pad_slot = pad.slot if self.addressing == "slots" else 0
            pad_at = 0 if self.addressing == "slots" else pad.blocks[group] * self.stores[0][0].size[1]
            host[:, batch:] = torch.tensor([[0], [pad_slot], [pad_at], [1]])
        self.rows[:, :rows].copy_(host, non_blocking=True)
        self.kv_lens[:rows].copy_(self.rows[self.KV_LENS, :rows])
        if self.addressing == "blocks":
            self.rows[self.WRITE_AT, :batch].copy_(plan.write_rows)  # decode: one token, one pool row per row
            self.table[:batch, : plan.block_table.shape[1]].copy_(plan.block_table)
            self.table[batch:rows, 0] = pad.blocks[group] if rows > batch else 0
        else:
            self.table[:rows, 0].copy_(self.rows[self.SLOTS, :rows])


class StaticStep:
    """The fixed-address device inputs of one cache's compiled or captured decode steps.

    Args:
        cache: the cache whose storage the step writes and reads (either mode, or LayerGroups).
        capacity: the most rows a step has.
        max_len: the most keys a row reaches (``max_seq_len``): fixes the decode launch.

    Attributes:
        addressing: ``"slots"`` (VMM) or ``"blocks"`` (paged).
        kernel: the capturable decode kernel (each group's, joined by ``+``).
        rows: the slots of the last plan as a slice where evenly spaced, else ``None``.

    Invariant: after :meth:`load` of a plan from ``cache.begin_step``, every position the step
    writes is in a mapped page its row owns alone.
    """

    def __init__(self, cache: Any, capacity: int, max_len: int) -> None:
        groups = getattr(cache, "groups", [cache])
        layers = getattr(cache, "layers", [list(range(cache.config.num_layers))])
        self.device = torch.device(cache.config.device)
        self.capacity, self.max_len = capacity, max_len
        self.parts = [_Part(core, capacity, max_len) for core in groups]
        self.addressing = self.parts[0].addressing
        self.kernel = "+".join(dict.fromkeys(part.kernel for part in self.parts))
        self._where = [None] * cache.config.num_layers  # layer -> (part, its index there)
        for part, group_layers in zip(self.parts, layers):
            for local, layer in enumerate(group_layers):
                self._where[layer] = (part, local)
        self.rows: slice | None = slice(0, 0)

    @property
    def columns(self) -> torch.Tensor:
        """int64 ``[capacity]``: each row's first new position in its sequence (the model's positions)."""
        return self.parts[0].rows[_Part.COLUMNS]

    @property
    def slots(self) -> torch.Tensor:
        """int64 ``[capacity]``: each row's slot (paged mode: 0, the pools' token rows)."""
        return self.parts[0].rows[_Part.SLOTS]

    # ---- the eager point -----------------------------------------------------------------------
    def load(self, plan: StepPlan, rows: int | None = None, pad: PadRow | None = None) -> None:
        """Fill rows ``0 .. plan.batch_size - 1`` from ``plan`` and rows up to ``rows`` from ``pad``.

        Raises:
            ValueError: more rows than ``capacity``, or padding rows without ``pad``.
        """
        batch, rows = plan.batch_size, rows or plan.batch_size
        if rows > self.capacity or (rows > batch and pad is None):
            raise ValueError(f"{rows} rows (batch {batch}) for a step of capacity {self.capacity}, pad={pad}")
        for group, (part, group_plan) in enumerate(zip(self.parts, getattr(plan, "plans", (plan,)))):
            part.load(group_plan, rows, pad, group)
        self.rows = slot_slice(plan.slots) if rows == batch else None

    # ---- inside the graph -------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v`` ``[b, Hkv, S, D]`` at each row's position (``S`` > 1 only over slots)."""
        part, local = self._where[layer]
        b = k.shape[0]
        k_store, v_store = part.targets[local]
        write_columns(k_store, v_store, k, v, part.rows[_Part.SLOTS, :b], part.rows[_Part.WRITE_AT, :b])

    def attend(self, layer: int, q: torch.Tensor, scale: float | None, *, softcap: float = 0.0,
               sinks: torch.Tensor | None = None, out: torch.Tensor | None = None,
               workspace: DecodeWorkspace | None = None) -> torch.Tensor:
        """After :meth:`write` of ``layer``: each row's new token over its keys, ``q: [b, Hq, D]`` -> ``[b, Hq, D]``
        (through ``torch.ops.vmkv.decode_store`` inside a compiled region).
        """
        part, local = self._where[layer]
        b = q.shape[0]
        k_store, v_store = part.stores[local]
        where = {"block_table": part.table[:b]} if part.addressing == "blocks" else {"slots": part.table[:b, 0]}
        variant = dict(window=part.window, softcap=softcap, sinks=sinks)
        if torch.compiler.is_compiling():
            scale = q.shape[-1] ** -0.5 if scale is None else scale
            return decode_store(q, k_store, v_store, part.kv_lens[:b], scale, self.max_len, part.kernel, **where, **variant)
        return decode_attention(q, k_store.view(), v_store.view(), part.kv_lens[:b], kernel=part.kernel, scale=scale,
                                max_kv_len=self.max_len, out=out, workspace=workspace, **where, **variant)

    def views(self, layer: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots: ``layer``'s K and V of the step's rows, ``[b, Hkv, max_len, D]`` (zeros past each length):
        views where the slots are evenly spaced, else a copy.
        """
        part, local = self._where[layer]
        k_store, v_store = (store.view()[:, : self.max_len] for store in part.stores[local])
        if self.rows is not None:
            return k_store[self.rows].transpose(1, 2), v_store[self.rows].transpose(1, 2)
        slots = part.rows[_Part.SLOTS, :b]
        return k_store.index_select(0, slots).transpose(1, 2), v_store.index_select(0, slots).transpose(1, 2)
