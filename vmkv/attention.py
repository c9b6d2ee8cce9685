"""Attention over the contiguous (VMM) cache: one entry point, the fastest stock kernel available.

Every kernel here gets the whole virtual K/V of a layer, ``k_cache: [max_batch, capacity,
kv_heads, head_dim]``, plus the plan's slots and lengths, and reads only ``k_cache[slot,
:kv_len]`` of each sequence: nothing past its mapped pages.

Kernel choice, by device and what is installed (logged once, shown in ``stats()["kernel"]``):

    cpu   sdpa_per_sequence        torch SDPA on each sequence's exact-length slice
    cuda  flash_attn_with_kvcache  flash-attn installed (cache_seqlens + cache_batch_idx)
          varlen_attn(seqused_k)   torch >= 2.10 FlashAttention varlen kernel
          sdpa_per_sequence        otherwise
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from itertools import accumulate
from typing import Callable

import torch
import torch.nn.functional as F

from .step import StepPlan, causal_mask

log = logging.getLogger("vmkv")

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, StepPlan, "float | None"], torch.Tensor]


def sdpa_per_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float | None) -> torch.Tensor:
    """Stock ``scaled_dot_product_attention`` on each sequence's exact-length K/V slice.

    Shapes: ``q: [T, Hq, D]``, ``k_cache, v_cache: [B, S, Hkv, D]``; returns ``[T, Hq, D]``.
    """
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[2]
    offsets = [0, *accumulate(plan.q_lens)]
    masks = plan.causal_masks or tuple(causal_mask(s, n) for s, n in zip(plan.starts, plan.q_lens))
    for i, (slot, n, kv_len) in enumerate(zip(plan.slots, plan.q_lens, plan.kv_lens)):
        q_i = q[offsets[i] : offsets[i + 1]].transpose(0, 1)  # [Hq, n, D]
        k_i = k_cache[slot, :kv_len].transpose(0, 1)  # [Hkv, kv_len, D]
        v_i = v_cache[slot, :kv_len].transpose(0, 1)
        mask = masks[i]
        if mask is not None:
            mask = mask.to(q.device)
        o_i = F.scaled_dot_product_attention(
            q_i, k_i, v_i, attn_mask=mask, is_causal=mask is None and n > 1, scale=scale, enable_gqa=gqa
        )
        out[offsets[i] : offsets[i + 1]] = o_i.transpose(0, 1)
    return out


def flash_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float | None) -> torch.Tensor:
    """flash-attn's ``flash_attn_with_kvcache`` on the slot-indexed virtual tensors.

    Decode steps run as one batched call (``cache_batch_idx`` picks each sequence's slot,
    ``cache_seqlens`` its length). Steps with prefill chunks run one call per sequence, with
    flash-attn's bottom-right aligned causal mask covering the cached prefix.
    """
    from flash_attn import flash_attn_with_kvcache

    if plan.is_decode:
        out = flash_attn_with_kvcache(
            q.unsqueeze(1), k_cache, v_cache,
            cache_seqlens=plan.kv_lens_t, cache_batch_idx=plan.slots_t, softmax_scale=scale, causal=True,
        )  # [B, 1, Hq, D]
        return out.squeeze(1)
    out = torch.empty_like(q)
    offsets = [0, *accumulate(plan.q_lens)]
    for i, slot in enumerate(plan.slots):
        a, b = offsets[i], offsets[i + 1]
        out[a:b] = flash_attn_with_kvcache(
            q[a:b].unsqueeze(0), k_cache[slot : slot + 1], v_cache[slot : slot + 1],
            cache_seqlens=plan.kv_lens_t[i : i + 1], softmax_scale=scale, causal=True,
        ).squeeze(0)
    return out


def varlen_seqused(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float | None) -> torch.Tensor:
    """PyTorch's FlashAttention varlen kernel reading each slot's valid prefix (``seqused_k``).

    The virtual tensors are flattened to ``[B * S, Hkv, D]``; sequence ``i`` starts at row
    ``slot_i * S`` and ``seqused_k`` stops it at ``kv_len_i``.
    """
    from torch.nn.attention.varlen import varlen_attn

    batch, capacity = k_cache.shape[:2]
    k_rows = k_cache.reshape(batch * capacity, *k_cache.shape[2:])
    v_rows = v_cache.reshape(batch * capacity, *v_cache.shape[2:])
    cu_k = torch.cat([plan.slots_t, plan.slots_t[-1:] + 1]) * capacity
    return varlen_attn(
        q, k_rows, v_rows, plan.cu_q, cu_k.to(torch.int32), plan.max_q, plan.max_kv,
        scale=scale, window_size=(-1, 0), enable_gqa=q.shape[1] != k_cache.shape[2], seqused_k=plan.kv_lens_t,
    )


def has_flash_attn() -> bool:
    """Whether the optional ``flash-attn`` package is installed (not imported)."""
    return importlib.util.find_spec("flash_attn") is not None


def torch_varlen_features() -> set[str]:
    """Optional arguments of ``torch.nn.attention.varlen.varlen_attn`` in this torch (may be empty)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return set()
    params = inspect.signature(varlen_attn).parameters
    return {name for name in ("seqused_k", "block_table", "window_size", "enable_gqa") if name in params}


_LOGGED: set[str] = set()


def select_contiguous_kernel(device: torch.device) -> tuple[str, Kernel]:
    """The contiguous-mode kernel for ``device``: ``(name, function)``; logs the choice once."""
    if device.type != "cuda":
        name, kernel, why = "sdpa_per_sequence", sdpa_per_sequence, "CPU: torch SDPA per sequence"
    elif has_flash_attn():
        name, kernel, why = "flash_attn_with_kvcache", flash_kvcache, "flash-attn is installed"
    elif {"seqused_k", "window_size", "enable_gqa"} <= torch_varlen_features():
        name, kernel, why = "varlen_attn_seqused", varlen_seqused, "torch varlen_attn has seqused_k; flash-attn not installed"
    else:
        name, kernel, why = "sdpa_per_sequence", sdpa_per_sequence, "no flash-attn and no torch varlen_attn(seqused_k)"
    if name not in _LOGGED:
        _LOGGED.add(name)
        log.info("vmkv contiguous attention kernel: %s (%s)", name, why)
    return name, kernel
