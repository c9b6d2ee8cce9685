"""A :class:`~vmkv.kernels.base.Variant` in plain torch, shared by the CPU kernels: window masks,
soft-capping, sinks, and one sequence's attention over a slice of its keys (SDPA where it can
express the variant, explicit float32 scores where it cannot).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.step import StepPlan, causal_mask
from .base import Variant, first_key


def key_mask(start: int, q_len: int, lo: int, window: int, device: torch.device | str) -> torch.Tensor:
    """Bool ``[q_len, start + q_len - lo]``, True = attend: query ``j`` sees key ``lo + c`` inside its window."""
    keys = torch.arange(lo, start + q_len, device=device)
    positions = torch.arange(start, start + q_len, device=device)
    return (keys[None, :] <= positions[:, None]) & (keys[None, :] >= first_key(positions, window)[:, None])


def sequence_mask(plan: StepPlan, i: int, lo: int, window: int, device: torch.device) -> torch.Tensor | None:
    """The mask of sequence ``i``'s queries over keys ``lo .. kv_len - 1``, or ``None`` where SDPA needs none."""
    n, start = plan.q_lens[i], plan.starts[i]
    if n == 1:
        return None
    if first_key(start + n - 1, window) == 0:  # the window (if any) cuts nothing: plain causal
        mask = plan.causal_masks[i] if plan.causal_masks else causal_mask(start, n)
        return None if mask is None else mask.to(device)
    return key_mask(start, n, lo, window, device)


def soft_cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` (Gemma 2); unchanged when ``softcap`` is 0."""
    return torch.tanh(scores / softcap) * softcap if softcap > 0 else scores


def variant_softmax(scores: torch.Tensor, softcap: float, sinks: torch.Tensor | None,
                    allowed: torch.Tensor | None) -> torch.Tensor:
    """Attention weights from scaled scores ``[..., L]``: soft-capped, masked (``allowed`` False: weight
    0), softmaxed with ``exp(sink)`` in the denominator when ``sinks`` is given.
    """
    scores = soft_cap(scores, softcap)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    lse = torch.logaddexp(torch.logsumexp(scores, dim=-1), sinks)
    return torch.exp(scores - lse[..., None])


def sink_weight(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The share of the softmax mass the keys keep next to the sinks, ``exp(lse) / (exp(lse) + exp(sinks))``."""
    return torch.exp(lse - torch.logaddexp(lse, sinks))


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, variant: Variant,
                       allowed: torch.Tensor | None) -> torch.Tensor:
    """``variant_softmax(q @ k^T * scale) @ v`` as two float32 GEMMs, for what SDPA cannot express.

    Shapes: ``q: [..., Hkv, G, n, D]``, ``k, v: [..., Hkv, L, D]`` (each KV head read once),
    ``allowed``: bool broadcastable to ``[..., Hkv, G, n, L]`` or ``None``; returns ``q``'s shape and dtype.
    """
    *lead, kv_heads, group, n, dim = q.shape
    scores = torch.matmul(q.reshape(*lead, kv_heads, group * n, dim).float(), k.float().transpose(-1, -2)).mul_(scale)
    sinks = None if variant.sinks is None else variant.sinks.view(kv_heads, group, 1)  # one logit per query head
    probs = variant_softmax(scores.view(*lead, kv_heads, group, n, -1), variant.softcap, sinks, allowed)
    out = torch.matmul(probs.view(*lead, kv_heads, group * n, -1), v.float())  # [..., Hkv, G * n, D]
    return out.view(*lead, kv_heads, group, n, dim).to(q.dtype)


def needs_scores(variant: Variant) -> bool:
    """Whether ``variant`` needs explicit scores: SDPA has no soft-capping and no sinks."""
    return variant.softcap > 0 or variant.sinks is not None


def attend_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, variant: Variant,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """One sequence's queries ``q: [n, Hq, D]`` over a contiguous slice ``k, v: [1, Hkv, L, D]`` of its
    keys; returns ``[n, Hq, D]``. ``mask``: bool ``[n, L]`` or ``None`` (:func:`sequence_mask`).

    Inputs go to SDPA as 4-D tensors (3-D ones take a slower CPU path), and a single GQA query as
    ``[1, Hkv, G, D]`` so each KV head is read once.
    """
    n, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    if needs_scores(variant):
        if mask is None and n > 1:  # plain causal without a prefix: L == n
            mask = key_mask(0, n, 0, 0, q.device)
        q5 = q.transpose(0, 1).reshape(kv_heads, group, n, dim)  # [Hkv, G, n, D]
        out = explicit_attention(q5, k[0], v[0], dim ** -0.5 if scale is None else scale, variant, mask)
        return out.permute(2, 0, 1, 3).reshape(n, q_heads, dim)
    if n == 1:  # no mask; the query heads of one KV head act as its queries
        q4 = q.reshape(1, kv_heads, group, dim)  # [1, Hkv, G, D]
        return F.scaled_dot_product_attention(q4, k, v, scale=scale).reshape(1, q_heads, dim)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v,  # q: [1, Hq, n, D]
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=q_heads != kv_heads,
    )
    return out[0].transpose(0, 1)
