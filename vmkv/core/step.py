"""Per-step metadata: built once by ``cache.begin_step``, then read by every layer.

Tokens of a step are packed along one axis (varlen style), sequence after sequence in the
order the batch named them::

    q, k, v : [T, heads, head_dim]       T = sum(q_lens)
    cu_q    : [0, q_lens[0], q_lens[0]+q_lens[1], ..., T]

For sequence ``i`` the new tokens take positions ``starts[i] .. kv_lens[i]-1``; its attention
reads keys ``0 .. kv_lens[i]-1``::

    positions   0 ............ starts[i]-1 | starts[i] ....... kv_lens[i]-1
                cached before this step    | written by this step (q_lens[i] tokens)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Hashable, Sequence

import torch


@dataclass(frozen=True)
class StepPlan:
    """Everything a layer needs to write and attend for one step, computed once per step.

    Attributes:
        seq_ids: the sequences of the step, in packing order.
        slots: each sequence's slot (batch row of the VMM tensors / block-table row).
        starts: tokens each sequence held before the step.
        q_lens: new tokens per sequence.
        kv_lens: tokens per sequence after the step (``starts + q_lens``).
        cu_q: int32 ``[B + 1]`` offsets of each sequence's tokens in the packed axis (device).
        write_rows: int64 ``[T]`` row of each new token in a layer's flattened K/V storage.
        slots_t: int32 ``[B]`` ``slots`` on the device.
        kv_lens_t: int32 ``[B]`` ``kv_lens`` on the device.
        block_table: paged mode: int32 ``[B, max_pages]`` pool page of each logical page.
        causal_masks: per sequence, a bool ``[q_len, kv_len]`` mask (True = attend) when the
            step both has several new tokens and a cached prefix; ``None`` where plain causal
            (no prefix) or no mask (one token) is right.
        version: the cache version this plan belongs to (a stale plan is refused).
        owner: identifies the cache that built the plan (a plan of another cache is refused).

    Invariant: every cached property depends on ``q_lens`` alone (``next_decode`` hands them on).
    """

    seq_ids: tuple[Hashable, ...]
    slots: tuple[int, ...]
    starts: tuple[int, ...]
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    cu_q: torch.Tensor
    write_rows: torch.Tensor
    slots_t: torch.Tensor
    kv_lens_t: torch.Tensor
    block_table: torch.Tensor | None
    causal_masks: tuple[torch.Tensor | None, ...]
    version: int
    owner: object = None

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """``cu_q`` as Python ints: sequence ``i``'s tokens are ``offsets[i] .. offsets[i + 1] - 1``."""
        return (0, *accumulate(self.q_lens))

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    @cached_property
    def num_tokens(self) -> int:
        """T, the packed length of the step's new tokens."""
        return sum(self.q_lens)

    @property
    def max_q(self) -> int:
        return max(self.q_lens)

    @property
    def max_kv(self) -> int:
        return max(self.kv_lens)

    @cached_property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token."""
        return all(n == 1 for n in self.q_lens)

    def next_decode(self, version: int) -> "StepPlan":
        """The plan of the decode step after this one (a decode step) for the same sequences, valid
        only where each new token lands in the page that holds the token before it, whose mapping
        has not changed: its storage row is then the previous row + 1 in every mode, and the
        pages (block table) are the same. The caller (``begin_step``) checks that.

        Args:
            version: the cache version the new plan commits.

        Returns:
            A new plan sharing ``cu_q``, ``slots_t`` and ``block_table`` with this one (never
            written in place), the rows and lengths one further; its ``write_rows`` and
            ``kv_lens_t`` are made from the last built plan's when first read (a step whose
            layers read neither, a transformers batch's, runs no tensor op to plan).
        """
        plan = object.__new__(_NextDecode)  # a copy without __init__: frozen fields live in __dict__
        plan.__dict__.update(self.__dict__)  # with the cached properties, which depend on q_lens only
        for name in _NextDecode.LAZY:
            plan.__dict__.pop(name, None)
        base = self.__dict__.get("_base", self)
        plan.__dict__.update(starts=self.kv_lens, kv_lens=tuple(n + 1 for n in self.kv_lens), version=version,
                             _base=base, _ahead=self.__dict__.get("_ahead", 0) + 1)
        return plan


class _NextDecode(StepPlan):
    """A plan made by :meth:`StepPlan.next_decode`, ``_ahead`` decode steps past ``_base`` (a plan
    that was built): every row and length is ``_ahead`` further than there."""

    LAZY = ("write_rows", "kv_lens_t")

    @cached_property
    def write_rows(self) -> torch.Tensor:  # type: ignore[override]
        return self._base.write_rows + self._ahead

    @cached_property
    def kv_lens_t(self) -> torch.Tensor:  # type: ignore[override]
        return self._base.kv_lens_t + self._ahead


def slot_slice(slots: Sequence[int]) -> slice | None:
    """A slice selecting ``slots`` in order where they are evenly spaced (an arithmetic
    progression, rising), else ``None``: the rows a zero-copy view of a batch can take."""
    stride = slots[1] - slots[0] if len(slots) > 1 else 1
    if stride > 0 and all(b - a == stride for a, b in zip(slots, slots[1:])):
        return slice(slots[0], slots[-1] + 1, stride)
    return None


def make_plan(seq_ids: tuple[Hashable, ...], slots: list[int], starts: list[int], counts: list[int], *,
              device: torch.device, write_rows: torch.Tensor, block_table: torch.Tensor | None = None,
              version: int = 0, owner: object = None) -> StepPlan:
    """The :class:`StepPlan` of sequences ``seq_ids`` in ``slots`` holding ``starts`` tokens and
    adding ``counts`` (the one way plans are built: the caches' ``begin_step`` and vLLM's
    contiguous backend, :mod:`vmkv.vllm.contiguous`).

    Args:
        seq_ids, slots, starts, counts: per sequence, in packing order.
        device: where the plan's tensors live (CPU plans carry the prefill masks).
        write_rows: int64 ``[T]`` storage row of each new token (what the cache's ``write`` uses).
        block_table, version, owner: as :class:`StepPlan`.
    """
    kv_lens = [s + n for s, n in zip(starts, counts)]
    cu_q = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return StepPlan(
        seq_ids=tuple(seq_ids),
        slots=tuple(slots),
        starts=tuple(starts),
        q_lens=tuple(counts),
        kv_lens=tuple(kv_lens),
        cu_q=cu_q.to(device),
        write_rows=write_rows,
        slots_t=torch.tensor(slots, dtype=torch.int32, device=device),
        kv_lens_t=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        block_table=block_table,
        causal_masks=tuple(causal_mask(s, n) for s, n in zip(starts, counts)) if device.type == "cpu" else (),
        version=version,
        owner=owner,
    )


def causal_mask(start: int, q_len: int) -> torch.Tensor | None:
    """Bool mask ``[q_len, start + q_len]`` letting query ``j`` see keys ``0 .. start + j``.

    Returns ``None`` when no mask is needed beyond what SDPA's ``is_causal`` (start == 0) or no
    masking (a single query sees every key) gives.
    """
    if q_len == 1 or start == 0:
        return None
    keys = torch.arange(start + q_len)
    queries = torch.arange(start, start + q_len)
    return keys[None, :] <= queries[:, None]
