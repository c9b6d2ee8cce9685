"""Attention over the contiguous (VMM) cache: kernels that read each sequence's slot.

Each kernel gets a layer's whole virtual K/V, ``k_cache: [max_batch, capacity, kv_heads, head_dim]``,
and the plan's slots and lengths. Per-sequence kernels read ``k_cache[slot, :kv_len]`` only; the
batched CPU kernels read a run of slots to the longest length, and a per-row length mask gives the
stale-but-finite (or zero-page) keys past a shorter sequence probability exactly 0.

    flash_attn_with_kvcache   CUDA  flash-attn (cache_seqlens + cache_batch_idx)
    varlen_attn_seqused       CUDA  torch's FlashAttention varlen op with seqused_k (torch >= 2.5)
    sdpa_adaptive             CPU   decode rows batched or per sequence, as BatchRule predicts faster
    gemm_adaptive             CPU   (by name; float32) decode rows as GEMMs, batched or per sequence
    sdpa_batched              CPU   (by name) decode rows always batched
    gemm_batched              CPU   (by name) decode rows always as GEMMs over the run
    sdpa_per_sequence         any   torch SDPA on each sequence's exact-length slice

Which one runs is :mod:`vmkv.kernels.registry`'s choice; variants (window, soft-cap, sinks) per
kernel: :data:`SLOT_KERNELS`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from ..core.step import StepPlan
from ..errors import InvalidShape
from .base import ALL_FEATURES, PLAIN, AttentionKernel, Variant, first_key
from .facts import flash_attn_variant, flash_window_left, optional_kernel
from .measured import batch_rule_constants
from .variants import attend_sequence, explicit_attention, needs_scores, sequence_mask

log = logging.getLogger("vmkv")


def _sdpa_rows(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float | None,
    indexes: Iterable[int], out: torch.Tensor, variant: Variant = PLAIN,
) -> None:
    """Sequences ``indexes`` of ``plan``, one call each on its windowed exact slice; writes their rows of ``out``."""
    offsets = plan.offsets
    for i in indexes:
        slot, kv_len = plan.slots[i], plan.kv_lens[i]
        lo = first_key(plan.starts[i], variant.window)
        k_i = k_cache[slot, lo:kv_len].transpose(0, 1)[None]  # [1, Hkv, kv_len - lo, D], a strided view
        v_i = v_cache[slot, lo:kv_len].transpose(0, 1)[None]
        rows = slice(offsets[i], offsets[i + 1])
        mask = sequence_mask(plan, i, lo, variant.window, q.device)
        out[rows] = attend_sequence(q[rows], k_i, v_i, scale, variant, mask)


def sdpa_per_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float | None,
                      variant: Variant = PLAIN) -> torch.Tensor:
    """Stock SDPA on each sequence's exact K/V slice, one call per sequence; reads nothing past a length
    or before a window.

    Shapes: ``q: [T, Hq, D]``, ``k_cache, v_cache: [B, S, Hkv, D]``; returns ``[T, Hq, D]``.
    """
    out = torch.empty_like(q)
    _sdpa_rows(q, k_cache, v_cache, plan, scale, range(plan.batch_size), out, variant)
    return out


def _gemm_decode_rows(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float | None,
    indexes: Iterable[int], out: torch.Tensor, variant: Variant = PLAIN,
) -> None:
    """Decode rows of sequences ``indexes``, two GEMMs each on the exact slice; writes their rows of ``out``."""
    q_heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    scale = dim ** -0.5 if scale is None else scale
    offsets = plan.offsets
    for i in indexes:
        slot, kv_len, row = plan.slots[i], plan.kv_lens[i], offsets[i]
        lo = first_key(kv_len - 1, variant.window)
        k_i = k_cache[slot, lo:kv_len].transpose(0, 1)  # [Hkv, kv_len - lo, D], a strided view
        v_i = v_cache[slot, lo:kv_len].transpose(0, 1)
        q_i = q[row].reshape(kv_heads, q_heads // kv_heads, 1, dim)  # [Hkv, G, 1, D]
        out[row] = explicit_attention(q_i, k_i, v_i, scale, variant, None).reshape(q_heads, dim)


def heads_merge(cache: torch.Tensor) -> bool:
    """Whether the slot and head axes of ``cache`` (``[B, S, Hkv, D]``) fold into one batch axis without a copy."""
    return cache.stride(0) == cache.shape[2] * cache.stride(2)


@dataclass(frozen=True)
class BatchRule:
    """When one batched call beats one call per sequence (times in microseconds)::

        per-sequence  call_us * B + key_us * sum(L)
        batched       fixed_us + run_key_us * span * max_kv + real_key_us * sum(L)

    ``span * max_kv`` is what the batched call reads, masked keys included; the fit: ``batch_rule`` in
    ``measured.json``.
    """

    call_us: float
    key_us: float
    run_key_us: float
    real_key_us: float
    fixed_us: float

    def predict(self, batch: int, span_keys: int, sum_kv: int) -> tuple[float, float]:
        """Predicted ``(per_sequence_us, batched_us)`` of a decode step."""
        per_sequence = self.call_us * batch + self.key_us * sum_kv
        batched = self.fixed_us + self.run_key_us * span_keys + self.real_key_us * sum_kv
        return per_sequence, batched

    def batched(self, span: int, max_kv: int, lengths: list[int]) -> bool:
        """Whether one batched call over ``span`` slots is predicted faster for these lengths."""
        per_sequence, batched = self.predict(len(lengths), span * max_kv, sum(lengths))
        return batched < per_sequence


DEFAULT_BATCH_RULE = BatchRule(**batch_rule_constants("cpu"))
"""The CPU rule; its constants, machine and command: ``vmkv/kernels/measured.json``."""


@dataclass(frozen=True)
class DecodeBatch:
    """One step's decode rows as one SDPA call over a run of consecutive slots.

    The call reads ``k_cache[first_slot : first_slot + span, first_key : max_kv]``. Slots of the run
    without a decode row are dummy rows: zero queries whose outputs are dropped (SDPA rows never mix).

    Attributes:
        seqs: plan index of each decode row, in the order of ``rows``/``at``.
        rows: int64 ``[Bd]`` packed index of each decode query; ``None``: every row, in packing order.
        at: int64 ``[Bd]`` each query's row in the run; ``None``: run row ``i`` is packed row ``i``.
        first_slot, span: the run of slots read.
        first_key: the earliest first key of the rows' windows (0 without a window).
        max_kv: one past the last key read (the longest decode row's length).
        mask: bool ``[span, 1, 1, max_kv - first_key]``, True = attend (inside the row's window and
            length; dummy rows: every key); ``None`` when every real row reads every key.
        batched: True = one batched call, False = one call per sequence.
    """

    seqs: tuple[int, ...]
    rows: torch.Tensor | None
    at: torch.Tensor | None
    first_slot: int
    span: int
    first_key: int
    max_kv: int
    mask: torch.Tensor | None
    batched: bool


def plan_decode_batch(plan: StepPlan, decode: list[int], rule: "BatchRule | None", window: int = 0) -> DecodeBatch:
    """The batched call for the decode sequences ``decode`` (plan indexes, non-empty) of ``plan``;
    ``rule`` ``None``: always batched; ``window`` 0: none.
    """
    slots = [plan.slots[i] for i in decode]
    lens = [plan.kv_lens[i] for i in decode]
    firsts = [first_key(n - 1, window) for n in lens]  # each row's first key: its query is at n - 1
    first, span, max_kv, lo = min(slots), max(slots) - min(slots) + 1, max(lens), min(firsts)
    batched = rule is None or rule.batched(span, max_kv - lo, [n - f for n, f in zip(lens, firsts)])
    device = plan.kv_lens_t.device
    offsets = plan.offsets
    packed = [offsets[i] for i in decode]
    identity = len(decode) == plan.num_tokens and packed == [s - first for s in slots]
    rows = None if identity else torch.tensor(packed, device=device)
    at = None if identity else torch.tensor([s - first for s in slots], device=device)
    mask = None
    if batched and (min(lens) < max_kv or max(firsts) > lo):
        at_run = torch.tensor(slots) - first
        run_lens = torch.full((span,), max_kv, dtype=torch.long)  # dummy rows: any key (finite or not)
        run_lens[at_run] = torch.tensor(lens)
        run_firsts = torch.full((span,), lo, dtype=torch.long)
        run_firsts[at_run] = torch.tensor(firsts)
        keys = torch.arange(lo, max_kv)
        mask = ((keys[None, :] < run_lens[:, None]) & (keys[None, :] >= run_firsts[:, None])).to(device)[:, None, None, :]
    return DecodeBatch(tuple(decode), rows, at, first, span, lo, max_kv, mask, batched)


def _decode_run(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_run, k, v)`` of a batched decode call: ``q_run: [span, Hkv, G, D]``, ``k, v: [span, Hkv, L, D]`` strided views."""
    q_heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    run = slice(batch.first_slot, batch.first_slot + batch.span)
    k = k_cache[run, batch.first_key : batch.max_kv].transpose(1, 2)  # [span, Hkv, L, D], a view
    v = v_cache[run, batch.first_key : batch.max_kv].transpose(1, 2)
    if batch.at is None:
        return q.reshape(batch.span, kv_heads, group, dim), k, v
    q_run = q.new_zeros(batch.span, kv_heads, group, dim)  # dummy rows: zero queries
    q_run[batch.at] = q.reshape(-1, kv_heads, group, dim)
    return q_run, k, v


def _decode_rows(out: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
    """``[span, Hkv, G, D]`` results back to the decode rows, ``[Bd, Hq, D]`` (packed order)."""
    out = out.reshape(batch.span, -1, out.shape[-1])
    return out if batch.at is None else out[batch.at]


def sdpa_decode_batched(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, scale: float | None
) -> torch.Tensor:
    """One SDPA call for every decode row of a step (:class:`DecodeBatch`); each KV head is read once
    under GQA, and K/V are strided views, never copied.

    Shapes: ``q: [Bd, Hq, D]`` the decode rows (packed order); returns ``[Bd, Hq, D]``.
    """
    q_run, k, v = _decode_run(q, k_cache, v_cache, batch)
    out = F.scaled_dot_product_attention(q_run, k, v, attn_mask=batch.mask, scale=scale)  # [span, Hkv, G, D]
    return _decode_rows(out, batch)


def gemm_decode_batched(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, scale: float | None,
    variant: Variant = PLAIN,
) -> torch.Tensor:
    """The decode rows of a step as two batched GEMMs over their run of slots (no repeat of K/V).

    Shapes: ``q: [Bd, Hq, D]`` the decode rows (packed order); returns ``[Bd, Hq, D]``.
    """
    q_run, k, v = _decode_run(q, k_cache, v_cache, batch)
    allowed = None if batch.mask is None else batch.mask[..., None, :]  # [span, 1, 1, 1, L]
    out = explicit_attention(q_run[..., None, :], k, v, q.shape[2] ** -0.5 if scale is None else scale, variant, allowed)
    return _decode_rows(out[..., 0, :], batch)


class SdpaDecodeKernel(AttentionKernel):
    """Torch SDPA with a step's decode rows in one batched call (prefill rows: per sequence), or with
    ``gemm`` as GEMMs: torch's CPU flash kernel is slow for one query token under GQA (the measured
    slot-layout comparison: docs/vllm.md, "Contiguous mode"). A variant with soft-capping or sinks runs decode rows as
    the GEMMs do. :meth:`plan` computes the :class:`DecodeBatch` once a step; every layer reuses it.

    Shapes: ``q: [T, Hq, D]``, ``k_cache, v_cache: [B, S, Hkv, D]``; returns ``[T, Hq, D]``.
    """

    addressing = "slots"
    features = ALL_FEATURES

    def __init__(self, name: str, rule: BatchRule | None, gemm: bool = False) -> None:
        self.name = name
        self.rule = rule
        self.gemm = gemm

    def plan(self, plan: StepPlan, q_heads: int = 0, scale: float | None = None,
             variant: Variant = PLAIN) -> DecodeBatch | None:
        """The batched call of ``plan``'s decode rows (``None``: the step has none)."""
        decode = [i for i, n in enumerate(plan.q_lens) if n == 1]
        return plan_decode_batch(plan, decode, self.rule, variant.window) if decode else None

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan,
            batch: DecodeBatch | None, scale: float | None, variant: Variant = PLAIN) -> torch.Tensor:
        gemm = self.gemm or needs_scores(variant)
        batched = batch is not None and batch.batched and (not gemm or heads_merge(k_cache) and heads_merge(v_cache))
        if not batched and not gemm:
            return sdpa_per_sequence(q, k_cache, v_cache, plan, scale, variant)
        if batched and batch.rows is None:  # a pure decode step over a run of slots, in slot order
            out = self._decode_batched(q, k_cache, v_cache, batch, scale, variant, gemm)
        else:
            out = torch.empty_like(q)
            if batched:
                out[batch.rows] = self._decode_batched(q[batch.rows], k_cache, v_cache, batch, scale, variant, gemm)
            elif batch is not None:  # gemm, one sequence at a time
                _gemm_decode_rows(q, k_cache, v_cache, plan, scale, batch.seqs, out, variant)
            prefill = [i for i, n in enumerate(plan.q_lens) if n > 1]
            _sdpa_rows(q, k_cache, v_cache, plan, scale, prefill, out, variant)
        if batched:
            self._redo_non_finite(q, k_cache, v_cache, plan, scale, batch, out, variant)
        return out

    @staticmethod
    def _decode_batched(q, k_cache, v_cache, batch: DecodeBatch, scale: float | None, variant: Variant,
                        gemm: bool) -> torch.Tensor:
        if gemm:
            return gemm_decode_batched(q, k_cache, v_cache, batch, scale, variant)
        return sdpa_decode_batched(q, k_cache, v_cache, batch, scale)

    @staticmethod
    def _redo_non_finite(q, k_cache, v_cache, plan: StepPlan, scale: float | None, batch: DecodeBatch, out: torch.Tensor,
                         variant: Variant) -> None:
        """Recompute per sequence the decode rows the batched call made non-finite: a mask gives stale
        keys probability 0, but stale inf/NaN data still poisons the row (``-inf + inf``).
        """
        decode = out if batch.rows is None else out[batch.rows]  # [Bd, Hq, D]
        if bool(torch.isfinite(decode.sum())):  # one reduction: a finite sum means every entry is finite
            return
        bad = (~torch.isfinite(decode).flatten(1).all(1)).nonzero().flatten().tolist()
        _sdpa_rows(q, k_cache, v_cache, plan, scale, [batch.seqs[i] for i in bad], out, variant)


def flash_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float | None,
                  variant: Variant = PLAIN) -> torch.Tensor:
    """flash-attn's ``flash_attn_with_kvcache`` on the slot-indexed virtual tensors.

    ``cache_batch_idx`` picks each row's slot and ``cache_seqlens`` stops it at its length, so nothing
    past the mapped pages is read. Decode steps run as one call, steps with prefill chunks one call per
    sequence (``seqlen_q`` must be equal across the batch). Why this is correct: docs/gpu.md.

    Shapes: ``q: [T, Hq, D]``, ``k_cache, v_cache: [B_max, S, Hkv, D]``; returns ``[T, Hq, D]``.
    """
    flash_attn_with_kvcache = optional_kernel("flash_attn")
    q = q.contiguous()  # FlashAttention wants a unit last stride (any strided q is accepted here)
    extra = flash_attn_variant(variant.window, variant.softcap)
    if plan.is_decode:
        out = flash_attn_with_kvcache(
            q.unsqueeze(1), k_cache, v_cache,
            cache_seqlens=plan.kv_lens_t, cache_batch_idx=plan.slots_t, softmax_scale=scale, causal=True, **extra,
        )  # [B, 1, Hq, D]
        return out.squeeze(1)
    out = torch.empty_like(q)
    offsets = plan.offsets
    for i, slot in enumerate(plan.slots):
        a, b = offsets[i], offsets[i + 1]
        out[a:b] = flash_attn_with_kvcache(
            q[a:b].unsqueeze(0), k_cache[slot : slot + 1], v_cache[slot : slot + 1],
            cache_seqlens=plan.kv_lens_t[i : i + 1], softmax_scale=scale, causal=True, **extra,
        ).squeeze(0)
    return out


def _slot_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """View ``[B, S, H, D]`` slots as rows ``[(B - 1) * R + S, H, D]`` without copying (``R``: slot stride
    in token rows, so no row lies past the last slot).

    Raises:
        InvalidShape: the slot stride is not a whole number of token rows.
    """
    slot_stride, row_stride = cache.stride(0), cache.stride(1)
    if slot_stride % row_stride:
        raise InvalidShape(f"slot stride {slot_stride} is not a multiple of the token stride {row_stride}")
    rows_per_slot = slot_stride // row_stride
    shape = ((cache.shape[0] - 1) * rows_per_slot + cache.shape[1], *cache.shape[2:])
    return cache.as_strided(shape, (row_stride, *cache.stride()[2:])), rows_per_slot


def varlen_seqused(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float | None,
                   variant: Variant = PLAIN) -> torch.Tensor:
    """PyTorch's FlashAttention varlen op reading each slot's valid prefix (``seqused_k``).

    The slots are flattened by :func:`_slot_rows` (a view: a copy would read unmapped pages);
    ``cu_seq_k`` holds slot starts in plan order, unsorted, which is correct because with
    ``seqused_k`` FlashAttention reads only ``cu_seq_k[i]`` and ``seqused_k[i]`` (docs/gpu.md, "How
    the CUDA backend works"). Row offsets are int32: ``B_max * R`` must stay below 2**31.

    Shapes: ``q: [T, Hq, D]``, ``k_cache, v_cache: [B_max, S, Hkv, D]``; returns ``[T, Hq, D]``.
    """
    q = q.contiguous()  # FlashAttention wants a unit last stride (any strided q is accepted here)
    k_rows, rows_per_slot = _slot_rows(k_cache)  # [(B_max - 1) * R + S, Hkv, D] views, slot b at row b * R
    v_rows, _ = _slot_rows(v_cache)
    starts = plan.slots_t * rows_per_slot  # int32 [B]: first row of each sequence, plan order
    cu_k = torch.cat([starts, starts.new_full((1,), k_rows.shape[0])])  # last entry unused (seqused_k)
    window = {"window_size_left": flash_window_left(variant.window), "window_size_right": 0} if variant.window else {}
    out, *_ = torch.ops.aten._flash_attention_forward(
        q, k_rows, v_rows, plan.cu_q, cu_k, plan.max_q, plan.max_kv, 0.0, not plan.is_decode, False,
        scale=scale, seqused_k=plan.kv_lens_t, **window,
    )
    return out




class Stateless(AttentionKernel):
    """A slots kernel with no per-step metadata: ``function(q, k_cache, v_cache, plan, scale[, variant])``
    (``variant`` only once it declares a feature).
    """

    addressing = "slots"

    def __init__(self, name: str, function: Callable[..., torch.Tensor]) -> None:
        self.name = name
        self._function = function

    def run(self, q, k, v, plan, meta, scale, variant=PLAIN):
        if not self.features:
            return self._function(q, k, v, plan, scale)
        return self._function(q, k, v, plan, scale, variant)


SLOT_KERNELS: dict[str, frozenset[str]] = {
    # flash-attn's window_size and softcap (GPU only: from its signature and sources, not run here)
    "flash_attn_with_kvcache": frozenset({"window", "softcap"}),
    # aten::_flash_attention_forward's window_size_left/right (GPU only: not run here); no soft-cap, no sinks
    "varlen_attn_seqused": frozenset({"window"}),
    "sdpa_adaptive": SdpaDecodeKernel.features,
    "gemm_adaptive": SdpaDecodeKernel.features,
    "sdpa_batched": SdpaDecodeKernel.features,
    "gemm_batched": SdpaDecodeKernel.features,
    "sdpa_per_sequence": ALL_FEATURES,  # a window as slices and masks; explicit scores for soft-caps and sinks
}
"""Every slots kernel of this module by name, with the variant features it supports."""


def slot_kernel(name: str) -> AttentionKernel:
    """A new kernel object of slots kernel ``name``.

    Raises:
        KeyError: no such kernel.
    """
    rule = DEFAULT_BATCH_RULE
    features = SLOT_KERNELS[name]
    builders: dict[str, Callable[[], AttentionKernel]] = {
        "flash_attn_with_kvcache": lambda: Stateless(name, flash_kvcache),
        "varlen_attn_seqused": lambda: Stateless(name, varlen_seqused),
        "sdpa_adaptive": lambda: SdpaDecodeKernel(name, rule),
        "gemm_adaptive": lambda: SdpaDecodeKernel(name, rule, gemm=True),
        "sdpa_batched": lambda: SdpaDecodeKernel(name, None),
        "gemm_batched": lambda: SdpaDecodeKernel(name, None, gemm=True),
        "sdpa_per_sequence": lambda: Stateless(name, sdpa_per_sequence),
    }
    kernel = builders[name]()
    kernel.features = features  # what the registry declares for it (a Stateless kernel's own)
    return kernel
