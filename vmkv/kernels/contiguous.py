"""Attention over the contiguous (VMM) cache: kernels that read each sequence's slot.

Every kernel gets the whole virtual K/V of a layer, ``k_cache: [max_batch, capacity,
kv_heads, head_dim]``, plus the plan's slots and lengths. Per-sequence kernels read only
``k_cache[slot, :kv_len]``; the batched CPU kernels read a run of slots up to the longest
length, past shorter sequences' data: those reads see stale-but-finite K/V inside a partly
filled page, or the zero page past it (both backends back every empty page with it), and
a per-row length mask gives them probability exactly 0.

The kernels (which one runs is :mod:`vmkv.kernels.registry`'s choice, named in ``stats()["kernel"]``):

    flash_attn_with_kvcache   CUDA  flash-attn, installed and importable (cache_seqlens + cache_batch_idx)
    varlen_attn_seqused       CUDA  torch's FlashAttention varlen op with seqused_k (torch >= 2.5)
    sdpa_adaptive             CPU   per step: decode rows in one batched SDPA call, or one call per
                                    sequence, whichever :class:`BatchRule` predicts faster
    gemm_adaptive             CPU   (by name; float32) decode rows as GEMMs (torch.matmul) over the
                                    run of slots or per sequence, as BatchRule predicts faster;
                                    prefill chunks as sdpa_adaptive
    sdpa_batched              CPU   (by name) decode rows always batched
    gemm_batched              CPU   (by name) decode rows always as GEMMs over the run
    sdpa_per_sequence         any   torch SDPA on each sequence's exact-length slice

The two FlashAttention kernels need what :func:`vmkv.kernels.facts.flash_attention_blockers` lists.

Variants (:data:`SLOT_KERNELS` says which kernel has which): the CPU kernels read each sequence's
keys from the first one its earliest query's window reaches (:func:`vmkv.kernels.base.first_key`),
so positions before a window, which may read zeros, are never read; a window inside the slice is
an SDPA mask; soft-capping and sinks take explicit scores (:mod:`vmkv.kernels.variants`). The
FlashAttention kernels pass the window (and flash-attn the soft-cap) to the kernel.
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
    """Sequences ``indexes`` of ``plan``, one call each (:func:`~vmkv.kernels.variants.attend_sequence`)
    on its K/V slice from the first key its earliest query's window reaches to its length;
    writes their rows of ``out``."""
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
    """Stock ``scaled_dot_product_attention`` on each sequence's exact K/V slice (from its
    window's first key to its length), one call per sequence; explicit scores where the variant
    has soft-capping or sinks. Reads nothing past any sequence's length or before its window.

    Shapes: ``q: [T, Hq, D]``, ``k_cache, v_cache: [B, S, Hkv, D]``; returns ``[T, Hq, D]``.
    """
    out = torch.empty_like(q)
    _sdpa_rows(q, k_cache, v_cache, plan, scale, range(plan.batch_size), out, variant)
    return out


def _gemm_decode_rows(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float | None,
    indexes: Iterable[int], out: torch.Tensor, variant: Variant = PLAIN,
) -> None:
    """Decode rows (one new token each) of sequences ``indexes``, two GEMMs each
    (:func:`~vmkv.kernels.variants.explicit_attention`) on the sequence's exact K/V slice (from
    its window's first key to its length); writes their rows of ``out``."""
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
    """Whether the slot and head axes of ``cache`` (``[B, S, Hkv, D]``) fold into one batch axis
    without a copy (head-major slots: slot stride = heads x head stride)."""
    return cache.stride(0) == cache.shape[2] * cache.stride(2)


@dataclass(frozen=True)
class BatchRule:
    """When one batched call beats one call per sequence, from a cost model fitted to
    measurements (``python -m benchmarks.contiguous_decode``), all times in microseconds::

        per-sequence  call_us * B + key_us * sum(L)
        batched       fixed_us + run_key_us * span * max_kv + real_key_us * sum(L)

    ``span * max_kv`` is what the batched call reads (every slot of the run, dummies included,
    to the longest length); the CPU kernel still pays part of the cost of keys the mask
    removes (``run_key_us``), and full cost only for real ones (``run_key_us + real_key_us``).
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
"""The CPU rule, fitted by ``python -m benchmarks.contiguous_decode`` (its constants, machine,
command and date: ``vmkv/kernels/measured.json``; what it predicts and how well:
docs/benchmarks.md)."""


@dataclass(frozen=True)
class DecodeBatch:
    """How one step's decode rows run as one SDPA call over a run of consecutive slots.

    The call reads ``k_cache[first_slot : first_slot + span, first_key : max_kv]``: every slot of
    the run, the same keys of each, through the zero-page-backed range (nothing there faults).
    Slots of the run that hold no decode row of the step are *dummy* rows: zero queries whose
    outputs are dropped (rows of SDPA never mix, so whatever they read cannot reach a real row).

    Attributes:
        seqs: plan index of each decode row, in the order of ``rows``/``at``.
        rows: int64 ``[Bd]`` packed index of each decode query; ``None``: every row of the step,
            in packing order, and ``at`` is ``None`` too.
        at: int64 ``[Bd]`` each decode query's row in the run (``slot - first_slot``); ``None``:
            row ``i`` of the run is packed row ``i`` (no gather, no scatter).
        first_slot, span: the run of slots read.
        first_key: the first key read in every slot: the earliest first key of the rows' windows
            (0 without a window).
        max_kv: one past the last key read (the longest decode row's length).
        mask: bool ``[span, 1, 1, max_kv - first_key]``, True = attend: key ``first_key + j`` of
            row ``r`` counts iff it lies in the row's window and ``first_key + j < kv_len(r)``
            (dummy rows: every key), so stale-but-finite data past a sequence's length inside its
            last page (and the zeros past its pages, or before its window) gets probability
            exactly 0; ``None`` when every real row reads every key of the run.
        batched: the rule's choice: True = one batched call, False = one call per sequence.
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
    """The batched call for sequences ``decode`` of ``plan`` (their indexes; one new token each).

    Args:
        plan: the step.
        decode: indexes into the plan of the sequences with one new token (non-empty).
        rule: decides batched vs per-sequence from the step's shape (the keys each call would
            read); ``None``: always batched.
        window: the layers' sliding window (0: none).
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
    """The operands of a batched decode call over the batch's run of slots: ``(q_run, k, v)``.

    Shapes: ``q: [Bd, Hq, D]`` the decode rows (packed order); ``q_run: [span, Hkv, G, D]`` (the
    ``G`` query heads of a KV head as its queries; dummy rows zero), ``k, v: [span, Hkv, L, D]``
    (``L = max_kv - first_key``) strided views of the slots, never copied.
    """
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
    """One SDPA call for every decode row of a step (see :class:`DecodeBatch`; its mask holds the
    lengths and windows).

    Under GQA the ``group`` query heads of a KV head act as its ``group`` queries
    (``[span, Hkv, group, D]`` against ``[span, Hkv, L, D]``): each KV head is read once.
    K/V are strided views of the slots (``[B, S, Hkv, D]`` transposed), never copied.

    Shapes: ``q: [Bd, Hq, D]`` the decode rows (packed order); returns ``[Bd, Hq, D]``.
    """
    q_run, k, v = _decode_run(q, k_cache, v_cache, batch)
    out = F.scaled_dot_product_attention(q_run, k, v, attn_mask=batch.mask, scale=scale)  # [span, Hkv, G, D]
    return _decode_rows(out, batch)


def gemm_decode_batched(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, scale: float | None,
    variant: Variant = PLAIN,
) -> torch.Tensor:
    """The decode rows of a step as two batched GEMMs over their run of slots (see
    :class:`DecodeBatch`; :func:`~vmkv.kernels.variants.explicit_attention`): scores
    ``[span, Hkv, G, L]`` = the ``G`` query heads of each KV head against its keys (no repeat of
    K/V), soft-capped, masked, a softmax (with sinks), times V. K/V are strided views of the
    slots; with head-major slots (:func:`heads_merge`) the GEMMs run on them without a copy.

    Shapes: ``q: [Bd, Hq, D]`` the decode rows (packed order); returns ``[Bd, Hq, D]``.
    """
    q_run, k, v = _decode_run(q, k_cache, v_cache, batch)
    allowed = None if batch.mask is None else batch.mask[..., None, :]  # [span, 1, 1, 1, L]
    out = explicit_attention(q_run[..., None, :], k, v, q.shape[2] ** -0.5 if scale is None else scale, variant, allowed)
    return _decode_rows(out[..., 0, :], batch)


class SdpaDecodeKernel(AttentionKernel):
    """Torch SDPA with the decode rows of a step in one batched call (prefill rows: one call
    per sequence, as :func:`sdpa_per_sequence`), or, with ``gemm``, the decode rows as GEMMs.

    Args:
        name: the name it is registered under.
        rule: decides per step between the batched call and one call per sequence
            (:class:`BatchRule`); ``None``: always batched.
        gemm: decode rows run as two GEMMs and a softmax (:func:`gemm_decode_batched` over the
            run of slots, or :func:`_gemm_decode_rows` per sequence), not SDPA: torch's CPU
            flash kernel is slow for one query token under grouped-query attention (``python -m
            benchmarks.vllm_slot_layouts``). The batched GEMM is taken only where the slot and
            head axes fold without a copy (:func:`heads_merge`); prefill rows stay SDPA.

    A variant with soft-capping or sinks, which SDPA cannot express, runs every kernel's decode
    rows as the GEMMs run them (and its prefill rows with explicit scores).

    :meth:`plan` computes the step's :class:`DecodeBatch` once per window; every layer's
    :meth:`run` reuses it.

    Shapes: ``q: [T, Hq, D]``, ``k_cache, v_cache: [B, S, Hkv, D]`` (any strides with a unit
    last one); returns ``[T, Hq, D]``.
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
        """Recompute, one call per sequence on its exact slice, the decode rows the batched call
        made non-finite. A mask gives stale keys probability 0, but stale data that is itself
        inf/NaN (written by an earlier sequence of the page) still poisons the row (``-inf + inf``,
        ``0 * inf``); the exact slice never reads it, so the answer is the per-sequence one."""
        decode = out if batch.rows is None else out[batch.rows]  # [Bd, Hq, D]
        if bool(torch.isfinite(decode.sum())):  # one reduction: a finite sum means every entry is finite
            return
        bad = (~torch.isfinite(decode).flatten(1).all(1)).nonzero().flatten().tolist()
        _sdpa_rows(q, k_cache, v_cache, plan, scale, [batch.seqs[i] for i in bad], out, variant)


def flash_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float | None,
                  variant: Variant = PLAIN) -> torch.Tensor:
    """flash-attn's ``flash_attn_with_kvcache`` on the slot-indexed virtual tensors.

    Semantics (flash-attn ``flash_attn_interface.flash_attn_with_kvcache`` docstring and
    ``mha_fwd_kvcache``): ``k_cache`` is ``[batch_cache, seqlen_cache, Hkv, D]`` and only its last
    dim must be contiguous, so the whole virtual tensor is passed; ``cache_batch_idx`` (int32
    ``[B]``) picks each query row's slot; ``cache_seqlens`` (int32 ``[B]``, indexed by query
    row, not by slot) stops each sequence at its length, so nothing past the mapped pages is
    read; ``causal=True`` aligns the mask to the bottom-right corner, i.e. query ``j`` of ``n``
    new tokens sees keys ``0 .. kv_len - n + j``: the cached prefix plus causal new tokens.

    Decode steps run as one batched call. Steps with prefill chunks (``seqlen_q`` must be
    equal across the batch) run one call per sequence on its own slot. A window and a soft-cap go
    to the kernel (:func:`~vmkv.kernels.facts.flash_attn_variant`), which reads no key before a
    query's window (reasoned from flash-attn's sources, not run here: GPU only).

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
    """View ``[B, S, H, D]`` slots as one row axis ``[(B - 1) * R + S, H, D]`` without copying.

    ``R`` = slot stride / token stride (whatever ``S`` the view shows), so slot ``b`` starts at
    row ``b * R``. Works for a layer of any layout (per-layer tensors, token- or head-major, or
    a strided layer slice of the all-layers tensor) and for ``[:, :n]`` slices of them. The
    view has ``(B - 1) * R + S`` rows: its last row is the last token of the last slot, so
    no element of it lies past the last slot (with head-major slots, ``B * R`` rows would reach
    ``(H - 1) * S_max`` rows beyond the tensor).

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
    """PyTorch's FlashAttention varlen kernel reading each slot's valid prefix (``seqused_k``).

    Calls ``torch.ops.aten._flash_attention_forward``, the op behind
    ``torch.nn.attention.varlen.varlen_attn`` (``varlen_attn`` exposes ``seqused_k`` only
    from torch 2.12; the op has had it since 2.5). The virtual tensors are flattened to
    ``[(B_max - 1) * R + S, Hkv, D]`` by :func:`_slot_rows` (a strided view, never a copy: a copy would
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
    kernel's grouped-query decode path (``seqlenq_ngroups_swapped``) and split-KV. A window is
    ``window_size_left = window - 1, window_size_right = 0`` (local attention, bottom-right
    aligned; it turns the grouped-query decode path off): keys before a query's window are not
    read (reasoned from ``flash_api.cpp`` and the kernel's ``n_block_min``, not run here).

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
    """A slots kernel with no per-step metadata: ``function(q, k_cache, v_cache, plan, scale,
    variant)``, or, while it declares no variant feature (``features``, set by its builder:
    :func:`slot_kernel`), ``function(q, k_cache, v_cache, plan, scale)`` (its variant is then always
    plain: :meth:`AttentionKernel.__call__` refuses others).

    Args:
        name: the name it is registered under.
        function: the kernel (:func:`sdpa_per_sequence`, :func:`flash_kvcache`, :func:`varlen_seqused`).
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
"""Every slots kernel of this module by name, with the variant features it supports (what the
registry declares for it)."""


def slot_kernel(name: str) -> AttentionKernel:
    """A new kernel object of slots kernel ``name`` (any of the module docstring's table).

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
