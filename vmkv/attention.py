"""Attention over the contiguous (VMM) cache: one entry point, the fastest stock kernel available.

Every kernel here gets the whole virtual K/V of a layer, ``k_cache: [max_batch, capacity,
kv_heads, head_dim]``, plus the plan's slots and lengths, and reads only ``k_cache[slot,
:kv_len]`` of each sequence: nothing past its mapped pages.

Kernel choice, by device and what is installed (logged once, shown in ``stats()["kernel"]``;
see :func:`select_contiguous_kernel`):

    cuda  flash_attn_with_kvcache  flash-attn installed (cache_seqlens + cache_batch_idx)
          varlen_attn_seqused      torch's FlashAttention varlen op with seqused_k (torch >= 2.5)
          sdpa_per_sequence        otherwise, e.g. float32 or a pre-Ampere GPU
    cpu   sdpa_per_sequence        torch SDPA on each sequence's exact-length slice

The two FlashAttention kernels need sm80+, float16/bfloat16 and head_dim % 8 == 0, <= 256.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from itertools import accumulate
from typing import Callable

import torch
import torch.nn.functional as F

from .errors import InvalidShape
from .step import StepPlan, causal_mask

log = logging.getLogger("vmkv")

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, StepPlan, "float | None"], torch.Tensor]


def sdpa_per_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float | None) -> torch.Tensor:
    """Stock ``scaled_dot_product_attention`` on each sequence's exact-length K/V slice.

    Inputs are given SDPA as 4-D ``[1, heads, tokens, D]`` tensors: on the CPU, 3-D inputs take a
    slower path (about 3x for prefill). A single query token under grouped-query attention runs
    as ``[1, Hkv, group, D]`` queries against the ``Hkv`` heads (query head ``h`` reads KV head
    ``h // group``), which reads each KV head once instead of ``group`` times.

    Shapes: ``q: [T, Hq, D]``, ``k_cache, v_cache: [B, S, Hkv, D]``; returns ``[T, Hq, D]``.
    """
    out = torch.empty_like(q)
    q_heads, kv_heads = q.shape[1], k_cache.shape[2]
    offsets = [0, *accumulate(plan.q_lens)]
    masks = plan.causal_masks or tuple(causal_mask(s, n) for s, n in zip(plan.starts, plan.q_lens))
    for i, (slot, n, kv_len) in enumerate(zip(plan.slots, plan.q_lens, plan.kv_lens)):
        k_i = k_cache[slot, :kv_len].transpose(0, 1)[None]  # [1, Hkv, kv_len, D], a strided view
        v_i = v_cache[slot, :kv_len].transpose(0, 1)[None]
        rows = slice(offsets[i], offsets[i + 1])
        if n == 1:  # decode: no mask; the query heads of one KV head act as its queries
            q_i = q[rows].reshape(1, kv_heads, q_heads // kv_heads, -1)  # [1, Hkv, group, D]
            out[rows] = F.scaled_dot_product_attention(q_i, k_i, v_i, scale=scale).reshape(1, q_heads, -1)
            continue
        mask = masks[i]
        if mask is not None:
            mask = mask.to(q.device)
        o_i = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None], k_i, v_i,  # q: [1, Hq, n, D]
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=q_heads != kv_heads,
        )
        out[rows] = o_i[0].transpose(0, 1)
    return out


def flash_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float | None) -> torch.Tensor:
    """flash-attn's ``flash_attn_with_kvcache`` on the slot-indexed virtual tensors.

    Semantics (flash-attn ``flash_attn_interface.flash_attn_with_kvcache`` docstring and
    ``mha_fwd_kvcache``): ``k_cache`` is ``[batch_cache, seqlen_cache, Hkv, D]`` and only its last
    dim must be contiguous, so the whole virtual tensor is passed; ``cache_batch_idx`` (int32
    ``[B]``) picks each query row's slot; ``cache_seqlens`` (int32 ``[B]``, indexed by query
    row, not by slot) stops each sequence at its length, so nothing past the mapped pages is
    read; ``causal=True`` aligns the mask to the bottom-right corner, i.e. query ``j`` of ``n``
    new tokens sees keys ``0 .. kv_len - n + j``: the cached prefix plus causal new tokens.

    Decode steps run as one batched call. Steps with prefill chunks (``seqlen_q`` must be
    equal across the batch) run one call per sequence on its own slot.

    Shapes: ``q: [T, Hq, D]``, ``k_cache, v_cache: [B_max, S, Hkv, D]``; returns ``[T, Hq, D]``.
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


def _slot_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """View ``[B, S, H, D]`` slots as one row axis ``[B * R, H, D]`` without copying.

    ``R`` = slot stride / token stride (the slot capacity, whatever ``S`` the view shows), so
    slot ``b`` starts at row ``b * R``. Works for a layer of either layout (per-layer tensors
    or a strided layer slice of the all-layers tensor) and for ``[:, :n]`` slices of them.

    Raises:
        InvalidShape: the slot stride is not a whole number of token rows.
    """
    slot_stride, row_stride = cache.stride(0), cache.stride(1)
    if slot_stride % row_stride:
        raise InvalidShape(f"slot stride {slot_stride} is not a multiple of the token stride {row_stride}")
    rows_per_slot = slot_stride // row_stride
    shape = (cache.shape[0] * rows_per_slot, *cache.shape[2:])
    return cache.as_strided(shape, (row_stride, *cache.stride()[2:])), rows_per_slot


def varlen_seqused(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float | None) -> torch.Tensor:
    """PyTorch's FlashAttention varlen kernel reading each slot's valid prefix (``seqused_k``).

    Calls ``torch.ops.aten._flash_attention_forward``, the op behind
    ``torch.nn.attention.varlen.varlen_attn`` (``varlen_attn`` exposes ``seqused_k`` only
    from torch 2.12; the op has had it since 2.5). The virtual tensors are flattened to
    ``[B_max * R, Hkv, D]`` by :func:`_slot_rows` (a strided view, never a copy: a copy would
    read unmapped pages) and sequence ``i`` starts at row ``slot_i * R``.

    Why unsorted slot offsets are correct: with ``seqused_k`` set, FlashAttention's
    ``BlockInfo`` (``flash_attn/block_info.h``) takes the start of sequence ``i`` from
    ``cu_seq_k[i]`` and its length from ``seqused_k[i]``; ``cu_seq_k[i + 1]`` is never read
    for it, and ``mha_varlen_fwd`` only checks dtype/shape/contiguity of ``cu_seq_k``. So
    ``cu_seq_k`` holds slot starts in plan order (not monotonic) plus one unused last entry.
    Loads are predicated on ``seqused_k``: no row past a sequence's length (past its mapped
    pages) is touched. Row offsets are int32: ``B_max * R`` must stay below 2**31.

    Masking: prefill steps pass ``is_causal`` (bottom-right aligned, so the cached prefix is
    visible); decode steps pass no mask (one query sees all its keys), which also enables the
    kernel's grouped-query decode path (``seqlenq_ngroups_swapped``) and split-KV.

    Shapes: ``q: [T, Hq, D]``, ``k_cache, v_cache: [B_max, S, Hkv, D]``; returns ``[T, Hq, D]``.
    """
    k_rows, rows_per_slot = _slot_rows(k_cache)  # [B_max * R, Hkv, D] views, slot b at row b * R
    v_rows, _ = _slot_rows(v_cache)
    starts = plan.slots_t * rows_per_slot  # int32 [B]: first row of each sequence, plan order
    cu_k = torch.cat([starts, starts.new_full((1,), k_rows.shape[0])])  # last entry unused (seqused_k)
    out, *_ = torch.ops.aten._flash_attention_forward(
        q, k_rows, v_rows, plan.cu_q, cu_k, plan.max_q, plan.max_kv, 0.0, not plan.is_decode, False,
        scale=scale, seqused_k=plan.kv_lens_t,
    )
    return out


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


def flash_varlen_has_seqused_k() -> bool:
    """Whether this torch's ``aten::_flash_attention_forward`` takes ``seqused_k`` (torch >= 2.5)."""
    try:
        schema = torch.ops.aten._flash_attention_forward.default._schema
    except (AttributeError, RuntimeError):
        return False
    return any(argument.name == "seqused_k" for argument in schema.arguments)


CONTIGUOUS_KERNELS: dict[str, Kernel] = {
    "flash_attn_with_kvcache": flash_kvcache,
    "varlen_attn_seqused": varlen_seqused,
    "sdpa_per_sequence": sdpa_per_sequence,
}
"""Every contiguous-mode kernel by name, fastest first (benchmarks pick one explicitly)."""


def contiguous_kernel_unavailable(
    name: str, device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> str | None:
    """Why kernel ``name`` cannot run on ``device`` for K/V of ``dtype`` and ``head_dim``, or
    ``None`` if it can. ``dtype``/``head_dim`` of ``None`` are not checked.

    FlashAttention kernels (flash-attn and torch's) need CUDA, sm80 or newer, float16 or
    bfloat16 and a head_dim that is a multiple of 8 and at most 256 (``mha_varlen_fwd`` /
    ``mha_fwd_kvcache`` checks).
    """
    if name not in CONTIGUOUS_KERNELS:
        return f"unknown kernel {name!r}; known: {', '.join(CONTIGUOUS_KERNELS)}"
    if name == "sdpa_per_sequence":
        return None
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"{name} needs a CUDA device"
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"{name} needs float16 or bfloat16, the cache holds {dtype}"
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return f"{name} needs head_dim a multiple of 8 and <= 256, got {head_dim}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"{name} needs compute capability 8.0 or newer, cuda:{device.index} is {major}.{minor}"
    if name == "flash_attn_with_kvcache" and not has_flash_attn():
        return "flash-attn is not installed"
    if name == "varlen_attn_seqused" and not flash_varlen_has_seqused_k():
        return f"torch {torch.__version__} has no FlashAttention varlen op with seqused_k"
    return None


_LOGGED: set[str] = set()


def select_contiguous_kernel(
    device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> tuple[str, Kernel]:
    """The fastest contiguous-mode kernel that can run: ``(name, function)``; logs the choice
    (and why faster ones were passed over) once per choice.

    Args:
        device: where the cache lives.
        dtype, head_dim: of the cached K/V; ``None`` skips the checks that need them.
    """
    skipped = []
    for name, kernel in CONTIGUOUS_KERNELS.items():
        reason = contiguous_kernel_unavailable(name, device, dtype, head_dim)
        if reason is None:
            break
        skipped.append(reason)
    key = f"{name} on {device.type}: {'; '.join(skipped)}"
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("vmkv contiguous attention kernel: %s (not faster ones: %s)", name, "; ".join(skipped) or "none")
    return name, kernel
