"""The Triton kernels (:mod:`vmkv.kernels.triton_attention`) behind the one kernel interface:
``"triton"``, for either addressing. Decode steps run split-KV decode; every other step runs
the causal prefill kernel (which also takes decode rows mixed into it). Both take every variant
feature: a window as a key range per query, a soft-cap, sinks."""

from __future__ import annotations

from typing import Any

import torch

from ..core.step import StepPlan
from .base import ALL_FEATURES, PLAIN, AttentionKernel, Variant
from .capturable import decode_attention
from .triton_attention import DecodeWorkspace, choose_num_splits, multiprocessor_count, prefill_attention


class TritonAttention(AttentionKernel):
    """Triton attention over slots (VMM mode) or blocks (paged mode).

    :meth:`plan` sizes a decode step's split count from the keys its longest sequence reads (at
    most its window's) and allocates the split scratch once for every layer of the step and window.

    Args:
        addressing: ``"slots"`` or ``"blocks"``.
        device: where the cache lives.
        kv_heads, head_dim: of the cache.
    """

    name = "triton"
    features = ALL_FEATURES

    def __init__(self, addressing: str, device: torch.device, kv_heads: int, head_dim: int) -> None:
        self.addressing = addressing
        self._device = device
        self._kv_heads, self._head_dim = kv_heads, head_dim
        self._sms = multiprocessor_count(device)

    def plan(self, plan: StepPlan, q_heads: int, scale: float | None,
             variant: Variant = PLAIN) -> tuple[int, DecodeWorkspace | None] | None:
        """Decode steps: ``(splits, scratch or None)``; other steps: ``None``."""
        if not plan.is_decode:
            return None
        keys = min(plan.max_kv, variant.window) if variant.window else plan.max_kv
        splits = choose_num_splits(plan.batch_size, self._kv_heads, keys, self._sms)
        if splits == 1:
            return splits, None
        return splits, DecodeWorkspace.allocate(plan.batch_size, q_heads, self._head_dim, splits, self._device)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StepPlan, meta: Any,
            scale: float | None, variant: Variant = PLAIN) -> torch.Tensor:
        where = {"block_table": plan.block_table} if self.addressing == "blocks" else {"slots": plan.slots_t}
        variant_args = {"window": variant.window, "softcap": variant.softcap, "sinks": variant.sinks}
        if meta is None:  # q: [T, Hq, D] packed
            return prefill_attention(q, k, v, plan.cu_q, plan.kv_lens_t, scale=scale, **variant_args, **where)
        splits, workspace = meta
        return decode_attention(q, k, v, plan.kv_lens_t, kernel=self.name, scale=scale, max_kv_len=plan.max_kv,
                                num_splits=splits, workspace=workspace, **variant_args, **where)
