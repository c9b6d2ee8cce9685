"""The ``"vmkv"`` attention: ``attn_implementation="vmkv"``, its mask, and how it finds its cache.

Always from its own call: compiled, the prepared step arrives in the attention kwargs
(``vmkv_step=``); eager, ``update`` leaves ``vmkv_cache=`` there, or, where a model does not pass
the kwargs, a per-thread note (:data:`HANDOFF`) the same layer takes back only for the very K
tensor it returned. Without a ``VirtualCache`` the stock SDPA kernel runs (docs/hf.md, "How the
"vmkv" attention finds its cache").
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Any, NamedTuple, Protocol

import torch

from ..errors import InvalidConfig
from ..kernels.base import Variant
from ..kernels.variants import explicit_attention
from .compat import AttentionInterface, AttentionMaskInterface

log = logging.getLogger("vmkv")

ATTN_IMPLEMENTATION = "vmkv"
# what a model the "vmkv" kernels cannot run should use instead
WAY_OUT = ("load the model with its own attention (attn_implementation='sdpa' or 'eager') and pass "
           "VirtualCache('vmm'): update() then returns zero-copy views of every stored token, the model's "
           "own mask and kernel apply, and the tokens are identical to transformers' own cache")

class AttendingCache(Protocol):
    """What the ``"vmkv"`` attention needs of a cache (:class:`vmkv.hf.VirtualCache` is one)."""

    attention_style: str | None
    """``"vmkv"``: the cache runs this attention; ``"model"``: the model's attention reads its views;
    ``None``: not known before the first forward.
    """

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float | None, variant: "LayerVariant") -> torch.Tensor:
        """Write one layer's new K/V and attend: ``query: [B, Hq, S, D]`` -> ``[B, S, Hq, D]``."""


# ---- how the "vmkv" attention finds its cache ----------------------------------------------------
class _Handoff(threading.local):
    """What the last ``VirtualCache.update`` of this thread handed its layer's attention (weak
    references only: an untaken note keeps nothing alive).
    """

    def __init__(self) -> None:
        self.cache: weakref.ref | None = None
        self.key: weakref.ref | None = None
        self.layer = -1

    def give(self, cache: "AttendingCache", key: torch.Tensor, layer: int) -> None:
        self.cache, self.key, self.layer = weakref.ref(cache), weakref.ref(key), layer

    def take(self, module: torch.nn.Module, key: torch.Tensor) -> "AttendingCache | None":
        """The cache whose ``update`` returned ``key``, or ``None``.

        Raises:
            InvalidConfig: a "vmkv"-style cache's update of this layer returned another tensor: the
                model changed K between ``cache.update`` and its attention.
        """
        cache = self.cache() if self.cache is not None else None
        handed = self.key() if self.key is not None else None
        layer, self.cache, self.key, self.layer = self.layer, None, None, -1
        if cache is None:
            return None
        if handed is key:
            return cache
        if layer == getattr(module, "layer_idx", None) and cache.attention_style == ATTN_IMPLEMENTATION:
            raise InvalidConfig(
                f"{type(module).__name__} changes the key states between cache.update() and its attention, so "
                f"attn_implementation='vmkv' cannot run it; {WAY_OUT}"
            )
        return None


HANDOFF = _Handoff()


# ---- the registered attention -----------------------------------------------------------------
def vmkv_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask the ``"vmkv"`` attention gets: the 2D padding mask ``[B, kv_length]`` (True: a real
    token), right-aligned to ``kv_length`` (padded left with False), or ``None`` without padding
    (eager). Causality is the kernel's job.
    """
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    if mask.shape[1] < kv_length:
        mask = torch.nn.functional.pad(mask, (kv_length - mask.shape[1], 0), value=False)
    if not torch.compiler.is_compiling() and bool(mask.all()):
        return None
    return mask


def causal_padding_mask(
    padding: torch.Tensor | None, q_len: int, kv_len: int, device: torch.device, window: int = 0,
) -> torch.Tensor | None:
    """The boolean SDPA mask ``[B or 1, 1, q_len, kv_len]`` for queries that are the last ``q_len`` of ``kv_len``.

    Args:
        padding: ``[B, kv_len]`` True for real tokens, or ``None`` (no padding).
        window: a sliding window (0: none): a query sees the keys ``window - 1`` before it and itself.

    Returns:
        ``None`` when SDPA's ``is_causal`` gives the same answer. Rows that may attend to nothing
        (left padding) attend to everything instead, since a fully masked row gives NaN.
    """
    if padding is None and not window and (q_len == 1 or q_len == kv_len):
        return None
    positions = torch.arange(kv_len, device=device)
    queries = positions[kv_len - q_len :, None]
    mask = positions[None, :] <= queries
    if window:
        mask = mask & (positions[None, :] > queries - window)
    mask = mask[None, None]  # [1, 1, q, kv]
    if padding is not None:
        mask = mask & padding.to(device=device, dtype=torch.bool)[:, None, None, :]
    return mask | ~mask.any(-1, keepdim=True)


def vmkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    vmkv_cache: "AttendingCache | None" = None,
    vmkv_step: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``attn_implementation="vmkv"``: write the step into the cache and run the cache's kernel; with
    another cache (or the model style) the stock SDPA kernel runs with a causal + padding mask.

    Args:
        module: the attention module (its ``layer_idx`` and ``config`` are read).
        query: ``[B, q_heads, S, head_dim]``.
        key, value: the step's new states ``[B, kv_heads, S, head_dim]``, or all states
            ``[B, kv_heads, L, head_dim]`` from another cache.
        attention_mask: 2D padding mask from :func:`vmkv_attention_mask`, or ``None``.
        scaling: softmax scale.
        vmkv_cache: set by ``VirtualCache.update`` in the attention kwargs (else found through its note).
        vmkv_step: a ``VirtualCache(compile=True)``'s prepared step, inside a compiled forward.

    Returns:
        ``([B, S, q_heads, head_dim], None)``; padding positions give zeros. Sliding windows,
        soft-capping and sinks apply in every path.

    Raises:
        InvalidConfig: dropout, chunked attention, or a sliding window the cache was not made
            for (made without ``config=``); or the model changes K between ``cache.update`` and
            its attention.
    """
    variant = _variant_of(module, kwargs, dropout)
    if vmkv_step is not None:
        return vmkv_step.attend(module.layer_idx, query, scaling, variant), None
    if torch.compiler.is_compiling():
        return _eager_attention_at_graph_break(module, query, key, value, attention_mask, scaling, variant,
                                               vmkv_cache, **kwargs)
    return _eager_attention(module, query, key, value, attention_mask, scaling, variant, vmkv_cache, **kwargs)


class LayerVariant(NamedTuple):
    """What a layer's attention adds to causal attention, as its model passes it."""

    window: int  # sliding window (0: none)
    softcap: float  # logit soft-capping (0: none)
    sinks: torch.Tensor | None  # attention sinks, float32 [q_heads]


def _variant_of(module: torch.nn.Module, kwargs: dict[str, Any], dropout: float) -> LayerVariant:
    """The layer's window, soft-cap and sinks from the attention's kwargs (and the module).

    Raises:
        InvalidConfig: dropout, or chunked attention (Llama 4), which the kernels do not have.
    """
    if dropout:
        raise InvalidConfig("the vmkv attention has no dropout; call model.eval()")
    if getattr(module, "attention_chunk_size", None) or getattr(getattr(module, "config", None), "attention_chunk_size", None):
        raise InvalidConfig(f"{type(module).__name__} uses chunked attention, which the vmkv attention's kernels do not "
                            f"have; {WAY_OUT}")
    window = kwargs.pop("sliding_window", None) or getattr(module, "sliding_window", None) or 0
    sinks = kwargs.pop("s_aux", None)
    return LayerVariant(int(window), float(kwargs.pop("softcap", None) or 0.0),
                        None if sinks is None else sinks.detach().float())


def _eager_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None, variant: LayerVariant,
    vmkv_cache: "AttendingCache | None", **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Outside a compiled step: the cache that handed ``key`` over attends, or the stock kernel runs."""
    handed = HANDOFF.take(module, key)
    cache = vmkv_cache if vmkv_cache is not None else handed
    if cache is None or cache.attention_style == "model":
        return _stock_attention(module, query, key, value, attention_mask, scaling, variant, **kwargs)
    return cache.attend(module, query, key, value, attention_mask, scaling, variant), None


# a compiled forward with no prepared step: the eager attention at a graph break (the cache's
# update fell back the same way, vmkv.hf.compiled.eager_update, and said so)
_eager_attention_at_graph_break = torch.compiler.disable(_eager_attention)


def _stock_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    padding: torch.Tensor | None, scaling: float | None, variant: LayerVariant, **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """Attention over K/V holding every token (``[B, H, L, D]``): SDPA, or explicit scores for variants."""
    _log_stock_kernel()
    batch, q_heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if variant == LayerVariant(0, 0.0, None):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        mask = causal_padding_mask(padding, q_len, kv_len, query.device)
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scaling, **kwargs)
    allowed = causal_padding_mask(padding, q_len, kv_len, query.device, variant.window)
    group = q_heads // kv_heads
    q = query.view(batch, kv_heads, group, q_len, dim)
    allowed = None if allowed is None else allowed[:, :, None]  # [B or 1, 1, 1, q, L]
    out = explicit_attention(q, key, value, dim ** -0.5 if scaling is None else scaling,
                             Variant(0, variant.softcap, variant.sinks), allowed)  # [B, Hkv, G, q, D]
    return out.reshape(batch, q_heads, q_len, dim).transpose(1, 2), None


@functools.cache
def _log_stock_kernel() -> None:
    log.info("vmkv attention: the cache is not a VirtualCache in 'vmkv' style; running the stock SDPA kernel")


def register() -> None:
    """Register ``attn_implementation="vmkv"`` (attention and mask) with transformers; idempotent, run on import."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, vmkv_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, vmkv_attention_mask)
