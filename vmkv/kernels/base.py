"""The one kernel interface of both modes: plan once per step, then run per layer.

A step's metadata that every layer shares (which decode rows batch together, a block table's
CSR arrays, ...) is computed once by :meth:`AttentionKernel.plan` and handed to
:meth:`AttentionKernel.run` for each layer, as FlashInfer's plan/run does. Calling a kernel
(``kernel(q, k, v, plan, scale)``) does both, planning only on the first layer of a step.

Shapes, both addressings: ``q: [T, Hq, D]`` packed in the plan's order (``T = sum(q_lens)``),
returns ``[T, Hq, D]``: causal within each sequence's new tokens, bottom-right aligned over its
cached prefix (new token ``j`` of sequence ``i`` sees keys ``0 .. starts[i] + j``), grouped-query
when ``Hq`` is a multiple of ``Hkv``.

* ``"slots"`` (VMM mode): ``k, v: [max_batch, capacity, Hkv, D]`` (any strides with a unit last
  one), sequence ``i`` in row ``plan.slots[i]``, its first ``plan.kv_lens[i]`` keys valid;
* ``"blocks"`` (paged mode): ``k, v: [num_blocks, block_size, Hkv, D]`` pools read through
  ``plan.block_table``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from ..core.step import StepPlan

ADDRESSINGS = ("slots", "blocks")


class AttentionKernel(ABC):
    """An attention kernel over one addressing.

    Attributes:
        name: what ``stats()["kernel"]`` shows.
        addressing: ``"slots"`` or ``"blocks"``.
    """

    name: str
    addressing: str

    _memo: tuple[StepPlan, int, float | None, Any] | None = None

    def plan(self, plan: StepPlan, q_heads: int, scale: float | None) -> Any:
        """Per-step metadata shared by every layer (``None`` when the kernel needs none)."""
        return None

    @abstractmethod
    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, meta: Any,
            scale: float | None) -> torch.Tensor:
        """Attention of ``q: [T, Hq, D]`` over ``k``, ``v`` for one layer; returns ``[T, Hq, D]``."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan,
                 scale: float | None) -> torch.Tensor:
        """:meth:`plan` (once per step: the last plan seen is remembered) then :meth:`run`. A plan
        is immutable, so a stale memo only costs planning again."""
        memo, q_heads = self._memo, q.shape[1]
        if memo is None or memo[0] is not plan or memo[1] != q_heads or memo[2] != scale:
            memo = self._memo = (plan, q_heads, scale, self.plan(plan, q_heads, scale))
        return self.run(q, k, v, plan, memo[3], scale)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class PhaseSplit(AttentionKernel):
    """One kernel for decode steps (one new token per sequence) and another for the rest.

    Args:
        decode: runs steps where every sequence adds one token.
        other: runs every other step (prefill, chunked prefill, mixed).
    """

    def __init__(self, decode: AttentionKernel, other: AttentionKernel) -> None:
        self.decode, self.other = decode, other
        self.name = f"{decode.name}+{other.name}"
        self.addressing = decode.addressing

    def plan(self, plan: StepPlan, q_heads: int, scale: float | None) -> Any:
        return (self.decode if plan.is_decode else self.other).plan(plan, q_heads, scale)

    def run(self, q, k, v, plan, meta, scale):
        return (self.decode if plan.is_decode else self.other).run(q, k, v, plan, meta, scale)
