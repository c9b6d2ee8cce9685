"""The one kernel interface of both modes: plan once per step, then run per layer.

A step's metadata that every layer shares (which decode rows batch together, a block table's
CSR arrays, ...) is computed once by :meth:`AttentionKernel.plan` and handed to
:meth:`AttentionKernel.run` for each layer, as FlashInfer's plan/run does. Calling a kernel
(``kernel(q, k, v, plan, scale, variant)``) does both, planning only on the first layer of a
step that asks for that window and soft-cap.

Shapes, both addressings: ``q: [T, Hq, D]`` packed in the plan's order (``T = sum(q_lens)``),
returns ``[T, Hq, D]``: causal within each sequence's new tokens, bottom-right aligned over its
cached prefix (new token ``j`` of sequence ``i`` sits at position ``starts[i] + j`` and sees keys
``0 ..`` that position), grouped-query when ``Hq`` is a multiple of ``Hkv``.

* ``"slots"`` (VMM mode): ``k, v: [max_batch, capacity, Hkv, D]`` (any strides with a unit last
  one), sequence ``i`` in row ``plan.slots[i]``, its first ``plan.kv_lens[i]`` keys valid;
* ``"blocks"`` (paged mode): ``k, v: [num_blocks, block_size, Hkv, D]`` pools read through
  ``plan.block_table``.

A layer's :class:`Variant` (a sliding window, logit soft-capping, attention sinks) changes which
keys a query sees and how its scores become weights, with transformers' semantics. With a
window the memory before it may be gone: in a block table, the entries of blocks that lie wholly
before the window of a sequence's earliest query of the step may be ``-1``; in a slot, positions
before the window may read zeros. No kernel reads those entries, and none spends time on those
keys.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, overload

import torch

from ..core.step import StepPlan
from ..errors import InvalidDevice, InvalidDtype, InvalidInput, InvalidShape, Unsupported

ADDRESSINGS = ("slots", "blocks")

FEATURES = {"window": "a sliding window", "softcap": "soft-capping", "sinks": "attention sinks"}
"""Every variant feature, and how messages name it."""

ALL_FEATURES = frozenset(FEATURES)


def describe_features(features: Iterable[str]) -> str:
    """``features`` for a message, in :data:`FEATURES` order: ``"soft-capping and attention sinks"``."""
    names = [text for name, text in FEATURES.items() if name in set(features)]
    return " and ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} and {names[-1]}"


@dataclass(frozen=True, eq=False)
class Variant:
    """How one layer's attention differs from plain causal attention (transformers' semantics,
    ``masking_utils`` and the models' own attention functions).

    Attributes:
        window: sliding window: a query at position ``p`` sees keys ``p - window + 1 .. p``
            (transformers: ``kv_idx > q_idx - sliding_window``); 0: every earlier key.
        softcap: logit soft-capping (Gemma 2): scores, after scaling, become
            ``softcap * tanh(scores / softcap)``; 0: none.
        sinks: attention sinks (GPT-OSS, transformers' ``s_aux``): float32 ``[Hq]``, one logit per
            query head that joins the softmax's denominator only (it is not scaled and has no
            value); ``None``: none.

    Two variants are equal when their window and softcap are and they hold the same sinks tensor
    (identity: a layer's own parameter, compared without reading the device).

    Raises:
        InvalidInput, InvalidDtype, InvalidShape: a negative or non-int window, a negative or
            non-finite softcap, sinks that are not a 1-D float32 tensor.
    """

    window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        window, softcap, sinks = self.window, self.softcap, self.sinks
        if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
            raise InvalidInput(f"window must be a non-negative int (0: no window), got {window!r}")
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) or softcap < 0:
            raise InvalidInput(f"softcap must be a finite number >= 0 (0: none), got {softcap!r}")
        if sinks is not None:
            if not isinstance(sinks, torch.Tensor):
                raise InvalidInput(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
            if sinks.dtype != torch.float32:
                raise InvalidDtype(f"sinks must be float32, got {sinks.dtype}")
            if sinks.dim() != 1:
                raise InvalidShape(f"sinks must have shape [q_heads], got {list(sinks.shape)}")
        object.__setattr__(self, "window", int(window))
        object.__setattr__(self, "softcap", float(softcap))

    @cached_property
    def features(self) -> frozenset[str]:
        """The names of the features this variant uses (keys of :data:`FEATURES`)."""
        present = {"window": self.window > 0, "softcap": self.softcap > 0, "sinks": self.sinks is not None}
        return frozenset(name for name, on in present.items() if on)

    def check(self, q_heads: int, device: torch.device) -> None:
        """The sinks fit queries of ``q_heads`` heads on ``device``.

        Raises:
            InvalidShape, InvalidDevice: they do not.
        """
        if self.sinks is None:
            return
        if self.sinks.shape[0] != q_heads:
            raise InvalidShape(f"sinks must have one logit per query head ([{q_heads}]), got {list(self.sinks.shape)}")
        if self.sinks.device != device:
            raise InvalidDevice(f"sinks are on {self.sinks.device}, q on {device}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Variant):
            return NotImplemented
        return (self.window, self.softcap) == (other.window, other.softcap) and self.sinks is other.sinks

    def __hash__(self) -> int:
        return hash((self.window, self.softcap, id(self.sinks)))


PLAIN = Variant()
"""No window, no soft-capping, no sinks: plain causal attention."""


@overload
def first_key(position: int, window: int) -> int: ...


@overload
def first_key(position: torch.Tensor, window: int) -> torch.Tensor: ...


def first_key(position: int | torch.Tensor, window: int) -> int | torch.Tensor:
    """The first key a query at ``position`` sees: ``position - window + 1``, at least 0; 0
    without a window (``window == 0``). ``position``: an int, or an integer tensor (then
    elementwise). The one statement of the window for every torch kernel."""
    if isinstance(position, torch.Tensor):
        return (position - window + 1).clamp_min(0) if window > 0 else torch.zeros_like(position)
    return max(0, position - window + 1) if window > 0 else 0


class AttentionKernel(ABC):
    """An attention kernel over one addressing.

    Attributes:
        name: what ``stats()["kernel"]`` shows.
        addressing: ``"slots"`` or ``"blocks"``.
        features: the variant features it supports (keys of :data:`FEATURES`); calling it with
            a variant that uses another raises ``Unsupported``.
    """

    name: str
    addressing: str
    features: frozenset[str] = frozenset()

    _memo: tuple[StepPlan, dict[tuple[int, float | None, int, float], Any]] | None = None

    def plan(self, plan: StepPlan, q_heads: int, scale: float | None, variant: Variant = PLAIN) -> Any:
        """Per-step metadata shared by every layer of one window and soft-cap (``None`` when the
        kernel needs none). It may read ``variant.window`` and ``variant.softcap`` (host
        numbers), never ``variant.sinks``: layers with other sinks share it."""
        return None

    @abstractmethod
    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, meta: Any,
            scale: float | None, variant: Variant = PLAIN) -> torch.Tensor:
        """Attention of ``q: [T, Hq, D]`` over ``k``, ``v`` for one layer; returns ``[T, Hq, D]``."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan,
                 scale: float | None, variant: Variant = PLAIN) -> torch.Tensor:
        """:meth:`plan` (once per step, window and soft-cap: the last step's plans are remembered)
        then :meth:`run`. A plan is immutable, so a stale memo only costs planning again.

        Raises:
            Unsupported: the kernel lacks a feature ``variant`` uses (before anything runs).
            InvalidShape, InvalidDevice: ``variant.sinks`` does not fit ``q``.
        """
        if variant is not PLAIN:
            missing = variant.features - self.features
            if missing:
                raise Unsupported(f"attention kernel {self.name} does not support {describe_features(missing)}")
            variant.check(q.shape[1], q.device)
        memo = self._memo
        if memo is None or memo[0] is not plan:
            memo = self._memo = (plan, {})
        key = (q.shape[1], scale, variant.window, variant.softcap)
        metas = memo[1]
        if key not in metas:
            metas[key] = self.plan(plan, q.shape[1], scale, variant)
        return self.run(q, k, v, plan, metas[key], scale, variant)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class PhaseSplit(AttentionKernel):
    """One kernel for decode steps (one new token per sequence) and another for the rest; it
    supports the variant features both support.

    Args:
        decode: runs steps where every sequence adds one token.
        other: runs every other step (prefill, chunked prefill, mixed).
    """

    def __init__(self, decode: AttentionKernel, other: AttentionKernel) -> None:
        self.decode, self.other = decode, other
        self.name = f"{decode.name}+{other.name}"
        self.addressing = decode.addressing
        self.features = decode.features & other.features

    def plan(self, plan: StepPlan, q_heads: int, scale: float | None, variant: Variant = PLAIN) -> Any:
        return (self.decode if plan.is_decode else self.other).plan(plan, q_heads, scale, variant)

    def run(self, q, k, v, plan, meta, scale, variant=PLAIN):
        return (self.decode if plan.is_decode else self.other).run(q, k, v, plan, meta, scale, variant)
