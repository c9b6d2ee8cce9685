"""Per-step metadata: built once by ``cache.begin_step``, then read by every layer.

Tokens are packed along one axis (varlen style), sequence after sequence::

    q, k, v : [T, heads, head_dim]       T = sum(q_lens)
    cu_q    : [0, q_lens[0], q_lens[0]+q_lens[1], ..., T]

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
        starts, q_lens, kv_lens: tokens held before, new, and after (``starts + q_lens``).
        cu_q: int32 ``[B + 1]`` offsets of each sequence's tokens in the packed axis (device).
        write_rows: int64 ``[T]`` row of each new token in a layer's flattened K/V storage.
        slots_t, kv_lens_t: int32 ``[B]`` ``slots`` and ``kv_lens`` on the device.
        block_table: paged mode: int32 ``[B, max_pages]`` pool page of each logical page.
        causal_masks: per sequence, bool ``[q_len, kv_len]`` (True = attend) where several new
            tokens meet a cached prefix; else ``None``.
        version, owner: the cache version and cache that built it (a stale or foreign plan is refused).

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
        """The plan of the next decode step for the same sequences, valid only where each new token lands
        in the page holding the token before it (the caller checks). It shares ``cu_q``, ``slots_t`` and
        ``block_table`` with this one (never written in place); rows and lengths are one further, made
        lazily from the last built plan.
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
    """A plan ``_ahead`` decode steps past ``_base`` (a built plan): every row and length that much further."""

    LAZY = ("write_rows", "kv_lens_t")

    @cached_property
    def write_rows(self) -> torch.Tensor:  # type: ignore[override]
        return self._base.write_rows + self._ahead

    @cached_property
    def kv_lens_t(self) -> torch.Tensor:  # type: ignore[override]
        return self._base.kv_lens_t + self._ahead


def slot_slice(slots: Sequence[int]) -> slice | None:
    """A slice selecting ``slots`` where they are evenly spaced and rising, else ``None`` (zero-copy views)."""
    stride = slots[1] - slots[0] if len(slots) > 1 else 1
    if stride > 0 and all(b - a == stride for a, b in zip(slots, slots[1:])):
        return slice(slots[0], slots[-1] + 1, stride)
    return None


def make_plan(seq_ids: tuple[Hashable, ...], slots: list[int], starts: list[int], counts: list[int], *,
              device: torch.device, write_rows: torch.Tensor, block_table: torch.Tensor | None = None,
              version: int = 0, owner: object = None) -> StepPlan:
    """The :class:`StepPlan` of sequences ``seq_ids`` in ``slots`` holding ``starts`` tokens and adding
    ``counts``: the one way plans are built. ``device``: where its tensors live; other arguments as
    :class:`StepPlan`.
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
