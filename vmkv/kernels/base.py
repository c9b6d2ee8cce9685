"""The one kernel interface of both modes: plan once per step, then run per layer (as FlashInfer's
plan/run).

Shapes: ``q: [T, Hq, D]`` packed in plan order, returns ``[T, Hq, D]``, causal and bottom-right
aligned over each sequence's cached prefix, grouped-query when ``Hq`` is a multiple of ``Hkv``.

* ``"slots"`` (VMM): ``k, v: [max_batch, capacity, Hkv, D]``, sequence ``i`` in row ``plan.slots[i]``;
* ``"blocks"`` (paged): ``k, v: [num_blocks, block_size, Hkv, D]`` read through ``plan.block_table``.

Invariant: with a window, the memory before it may be gone (block-table entries ``-1``, slot
positions reading zeros); no kernel reads it.
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
from ..validate import is_int

ADDRESSINGS = ("slots", "blocks")
"""What a kernel reads: ``"slots"`` (VMM mode's) or ``"blocks"`` through a block table (paged mode's)."""

MODE_ADDRESSING = {"vmm": "slots", "paged": "blocks"}
"""The addressing each of :data:`vmkv.config.MODES` reads: the kernels' word for the mode."""

FEATURES = {"window": "a sliding window", "softcap": "soft-capping", "sinks": "attention sinks"}
"""Every variant feature, and how messages name it."""

ALL_FEATURES = frozenset(FEATURES)


def describe_features(features: Iterable[str]) -> str:
    """``features`` for a message, in :data:`FEATURES` order: ``"soft-capping and attention sinks"``."""
    names = [text for name, text in FEATURES.items() if name in set(features)]
    return " and ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} and {names[-1]}"


@dataclass(frozen=True, eq=False)
class Variant:
    """How one layer's attention differs from plain causal attention (transformers' semantics).

    Attributes:
        window: a query at position ``p`` sees keys ``p - window + 1 .. p``; 0: every earlier key.
        softcap: scores become ``softcap * tanh(scores / softcap)`` (Gemma 2); 0: none.
        sinks: float32 ``[Hq]``, a logit per query head that joins the softmax's denominator only
            (GPT-OSS's ``s_aux``); ``None``: none.

    Variants are equal when window and softcap are and they hold the same sinks tensor (identity).

    Raises:
        InvalidInput, InvalidDtype, InvalidShape: a negative or non-int window, a negative or
            non-finite softcap, sinks that are not a 1-D float32 tensor.
    """

    window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        window, softcap, sinks = self.window, self.softcap, self.sinks
        if not is_int(window, 0, numbers.Integral):
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
    """The first key a query at ``position`` (int or tensor) sees: ``max(position - window + 1, 0)``;
    0 without a window. The one statement of the window for every torch kernel.
    """
    if isinstance(position, torch.Tensor):
        return (position - window + 1).clamp_min(0) if window > 0 else torch.zeros_like(position)
    return max(0, position - window + 1) if window > 0 else 0


class AttentionKernel(ABC):
    """An attention kernel over one addressing.

    Attributes:
        name: what ``stats()["kernel"]`` shows.
        addressing: ``"slots"`` or ``"blocks"``.
        features: the variant features it supports; a variant using another raises ``Unsupported``.
    """

    name: str
    addressing: str
    features: frozenset[str] = frozenset()

    _memo: tuple[StepPlan, dict[tuple[int, float | None, int, float], Any]] | None = None

    def plan(self, plan: StepPlan, q_heads: int, scale: float | None, variant: Variant = PLAIN) -> Any:
        """Per-step metadata shared by every layer of one window and soft-cap (``None``: none needed). Never
        reads ``variant.sinks``: layers with other sinks share it.
        """
        return None

    @abstractmethod
    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, meta: Any,
            scale: float | None, variant: Variant = PLAIN) -> torch.Tensor:
        """Attention of ``q: [T, Hq, D]`` over ``k``, ``v`` for one layer; returns ``[T, Hq, D]``."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan,
                 scale: float | None, variant: Variant = PLAIN) -> torch.Tensor:
        """:meth:`plan` (memoised per step, window and soft-cap) then :meth:`run`.

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
    """One kernel for decode steps (``decode``) and another for every other step (``other``); supports
    the variant features both support.
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
