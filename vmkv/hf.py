"""Hugging Face ``transformers`` integration: a ``Cache`` backed by vmkv, and the ``"vmkv"`` attention.

Three lines::

    import vmkv.hf                                            # registers attn_implementation="vmkv"
    cache = vmkv.hf.VirtualCache(mode="vmm")                  # or mode="paged"
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)

How a forward runs, per attention style (``VirtualCache.attention_style``):

``"model"`` (the model's own attention: ``sdpa``, ``eager``...; VMM mode only)
    ``update()`` writes the step's K/V in place into the virtual tensors and returns zero-copy
    views ``[B, kv_heads, length, head_dim]`` of exactly the stored length. Every batch row is a
    cache sequence and every column (padding included) a stored token, as in ``DynamicCache``.
``"vmkv"`` (``attn_implementation="vmkv"``; both modes)
    ``update()`` only hands the new K/V through; the registered attention function packs the
    step's real tokens (padding columns are dropped: they cost no memory), writes them with
    ``cache.write`` and calls the cache's own kernel ``cache.attention(layer, q, plan)``: the
    contiguous kernel in VMM mode, the paged kernel in paged mode. Nothing is materialised.

Per forward one ``begin_step`` (on the first layer), then every layer writes and attends with
that plan. Batch rows map to sequence ids; beam search's ``reorder_cache`` and
``batch_repeat_interleave`` / ``batch_select_indices`` become ``free`` + ``fork`` of sequence ids,
so a beam that continues another shares its pages (copy-on-write) instead of copying K/V.

Sizing is lazy: the first ``update`` gives batch, KV heads, head dim, dtype and device; the
layer count comes from ``config`` if given, else from the ``"vmkv"`` attention module's config,
else it is counted over the first forward (whose K/V are kept by reference and written into
the cache at the next call: the first forward has no past, so the returned K/V are just its own).

How the ``"vmkv"`` attention finds its cache: transformers 5.24 passes the attention kwargs to
``update`` (``update(k, v, layer, kwargs=...)``), 5.19 and models such as GPT-NeoX do not. So
``update`` also leaves a per-thread note (this cache, this layer, weak references to the K it
returned); the attention of the same layer takes it back if it received that very tensor. When
no ``VirtualCache`` handed the K over (a ``DynamicCache``: generate()'s assistant model, say),
the attention runs the stock SDPA kernel instead. ``cache.layers[i].keys / .values`` are
zero-copy views where the stored K/V have ``DynamicCache``'s layout; ``copy.deepcopy(cache)``
forks every row (copy-on-write: no K/V is copied).

Supported: transformers 5.x (the per-layer ``CacheLayerMixin`` API; tested with 5.19 and 5.24;
5.19 names the cache argument ``past_key_values=``, 5.24 ``cache=``: see :func:`cache_argument`).
Importing this module needs transformers; ``import vmkv`` does not.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import logging
import math
import threading
import weakref
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import torch

from .extras import install_hint

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface
except ModuleNotFoundError as exc:  # say which extra brings the missing package
    if exc.name != "transformers":
        raise
    raise ModuleNotFoundError(f"vmkv.hf needs transformers: {install_hint('hf')} ({exc})", name=exc.name) from exc

from .base import KVCacheBase
from .config import KVCacheConfig, vmm_pieces
from .errors import CacheClosed, InvalidConfig, InvalidInput, InvalidShape, NoFreeSlot, Unsupported
from .step import StepPlan

log = logging.getLogger("vmkv")

ATTN_IMPLEMENTATION = "vmkv"
MODES = ("vmm", "paged")
DEFAULT_MAX_SEQ_LEN = 8192
MIN_TOKENS_PER_PAGE = 64


_NO_LINEAR_ATTENTION = "a VirtualCache holds attention K/V only; linear-attention (Mamba-style) states are not supported"


@functools.cache
def cache_argument() -> str:
    """The keyword the installed transformers takes a cache as: ``"cache"`` (5.24) or ``"past_key_values"`` (5.19).

    Both spellings work on 5.24 (the old one until 6.0, with a deprecation warning); code that
    must run on both without a warning passes ``**{vmkv.hf.cache_argument(): cache}``.
    """
    from transformers.generation.utils import GenerationMixin

    parameters = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in parameters else "past_key_values"


# ---- how the "vmkv" attention finds its cache ----------------------------------------------------
class _Handoff(threading.local):
    """What the last ``VirtualCache.update`` of this thread handed its layer's attention.

    Weak references only: a note nobody takes back keeps neither the cache nor the tensor alive.
    """

    def __init__(self) -> None:
        self.cache: weakref.ref | None = None
        self.key: weakref.ref | None = None
        self.layer = -1

    def give(self, cache: "VirtualCache", key: torch.Tensor, layer: int) -> None:
        self.cache, self.key, self.layer = weakref.ref(cache), weakref.ref(key), layer

    def take(self, module: torch.nn.Module, key: torch.Tensor) -> "VirtualCache | None":
        """The cache whose ``update`` returned ``key``, or ``None`` if none did (the cache is not ours).

        Raises:
            InvalidConfig: a "vmkv"-style cache's update of this very layer returned another
                tensor: the model changed K between ``cache.update`` and its attention.
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
                "attn_implementation='vmkv' cannot run it; load the model with its own attention "
                "(e.g. attn_implementation='sdpa') and use VirtualCache('vmm')"
            )
        return None


_HANDOFF = _Handoff()


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
    """The mask the ``"vmkv"`` attention gets: the 2D padding mask ``[B, kv_length]`` or ``None``.

    Causality is the kernel's job; only padding is the model's information to pass on.
    """
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].to(torch.bool)
    return None if bool(attention_mask.all()) else attention_mask


def causal_padding_mask(
    padding: torch.Tensor | None, q_len: int, kv_len: int, device: torch.device
) -> torch.Tensor | None:
    """The boolean SDPA mask ``[B or 1, 1, q_len, kv_len]`` for queries that are the last ``q_len`` of ``kv_len``.

    Args:
        padding: ``[B, kv_len]`` True for real tokens, or ``None`` (no padding).

    Returns:
        ``None`` when SDPA's own ``is_causal`` gives the same answer (no padding and the queries
        are all the tokens, or a single query). Query rows that may attend to nothing (padding
        queries of a left-padded row) attend to everything instead: their outputs are meaningless
        either way, and a fully masked row would give NaN.
    """
    if padding is None and (q_len == 1 or q_len == kv_len):
        return None
    positions = torch.arange(kv_len, device=device)
    mask = (positions[None, :] <= positions[kv_len - q_len :, None])[None, None]  # [1, 1, q, kv]
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
    vmkv_cache: "VirtualCache | None" = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``attn_implementation="vmkv"``: write the step into the cache and run the cache's kernel.

    With a cache that is not a ``VirtualCache`` (``DynamicCache``, as generate() gives an
    assistant model) or a ``VirtualCache`` running the model's attention style, ``key``/``value``
    already hold every token: the stock SDPA kernel runs on them with a causal + padding mask.

    Args:
        module: the attention module (its ``layer_idx`` and ``config`` are read).
        query: ``[B, q_heads, S, head_dim]``.
        key, value: the step's new states ``[B, kv_heads, S, head_dim]`` (``update`` returns them as
            is), or all states ``[B, kv_heads, L, head_dim]`` from another cache.
        attention_mask: 2D padding mask from :func:`vmkv_attention_mask`, or ``None``.
        scaling: softmax scale.
        vmkv_cache: set by ``VirtualCache.update`` in the attention kwargs (transformers 5.24);
            otherwise found through the note ``update`` leaves for this layer.

    Returns:
        ``([B, S, q_heads, head_dim], None)``; padding positions give zeros.

    Raises:
        InvalidConfig: a feature the kernel lacks was asked for (dropout, softcap, sliding
            window), or the model changes K between ``cache.update`` and its attention.
    """
    handed = _HANDOFF.take(module, key)
    cache = vmkv_cache if vmkv_cache is not None else handed
    if dropout:
        raise InvalidConfig("the vmkv attention has no dropout; call model.eval()")
    for name in ("softcap", "sliding_window", "s_aux"):
        if kwargs.get(name) is not None:
            raise InvalidConfig(f"the vmkv attention does not support {name}")
    if getattr(module, "sliding_window", None) is not None:
        raise InvalidConfig("the vmkv attention does not support sliding-window layers")
    if cache is None or cache.attention_style == "model":
        return _stock_attention(module, query, key, value, attention_mask, scaling, **kwargs)
    return cache._attend(module, query, key, value, attention_mask, scaling), None


def _stock_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    padding: torch.Tensor | None, scaling: float | None, **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention over K/V that already hold every token (``[B, H, L, D]``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _log_stock_kernel()
    mask = causal_padding_mask(padding, query.shape[2], key.shape[2], query.device)
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scaling, **kwargs)


@functools.cache
def _log_stock_kernel() -> None:
    log.info("vmkv attention: the cache is not a VirtualCache in 'vmkv' style; running the stock SDPA kernel")


def register() -> None:
    """Register ``attn_implementation="vmkv"`` (attention and mask) with transformers (idempotent).

    Called when ``vmkv.hf`` is imported.
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, vmkv_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, vmkv_attention_mask)


register()


# ---- cache ----------------------------------------------------------------------------------------
def default_page_size(token_bytes: int, granularity: int, min_tokens: int = MIN_TOKENS_PER_PAGE) -> int:
    """Smallest page that is a multiple of ``granularity`` and ``token_bytes`` and holds ``min_tokens``."""
    step = math.lcm(granularity, token_bytes)
    return step * max(1, -(-min_tokens * token_bytes // step))


@dataclass(frozen=True)
class _Step:
    """One forward's metadata: the core plan and, when padding is dropped, the kept token indexes."""

    plan: StepPlan
    keep: torch.Tensor | None  # int64 [T]: rows of the flattened [B * S] new tokens that are stored


class _SharedCore:
    """A core cache and the ``VirtualCache`` objects over it (``copy.deepcopy`` makes more).

    Sequence ids come from here so that copies never collide; the core closes with its last
    user. A copy dropped without ``close()`` leaves its rows here (``retire``): the garbage
    collector may run it in the middle of another copy's forward, whose plan a ``free`` would
    invalidate, so the rows are freed at the next forward or row operation instead (``reap``).
    """

    def __init__(self, core: KVCacheBase) -> None:
        self.core = core
        self.users = 1
        self._ids = itertools.count()
        self._orphans: deque[int] = deque()

    def new_id(self) -> int:
        return next(self._ids)

    def retire(self, rows: list[int]) -> None:
        """A user is gone without ``close()``: free ``rows`` later; close the core if it was the last."""
        self._orphans.extend(rows)
        self.users -= 1
        if self.users == 0:
            self.core.close()

    def reap(self) -> None:
        """Free the rows of users gone without ``close()``."""
        while self._orphans:
            self.core.free(self._orphans.popleft())


class VirtualLayer(CacheLayerMixin):
    """One layer's face of a :class:`VirtualCache` (transformers' per-layer API).

    Pages hold every layer of a token, so batch operations (reorder, crop, fork) act on the
    whole cache: call them on the ``VirtualCache``, not on a layer. ``keys`` / ``values`` are
    zero-copy views ``[B, kv_heads, columns, head_dim]`` where the stored K/V have that layout
    (see :meth:`VirtualCache.layer_kv`).
    """

    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: "VirtualCache", layer_idx: int) -> None:
        super().__init__()
        self._cache_ref = weakref.ref(cache)  # not a cycle: a cache nobody holds is freed at once
        self.layer_idx = layer_idx

    @property
    def _cache(self) -> "VirtualCache":
        cache = self._cache_ref()
        if cache is None:
            raise Unsupported("this layer's VirtualCache no longer exists")
        return cache

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self._cache.is_initialized

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        """CacheLayerMixin.__init__ assigns it; the state lives in the cache."""

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        """``[B, kv_heads, columns, head_dim]`` view of this layer's K (``None`` before the first forward)."""
        return self._cache.layer_kv(self.layer_idx)[0]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        _refuse_assignment(value)

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        """``[B, kv_heads, columns, head_dim]`` view of this layer's V (``None`` before the first forward)."""
        return self._cache.layer_kv(self.layer_idx)[1]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        _refuse_assignment(value)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Sizing happens in the cache on its first update."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return self._cache.update(key_states, value_states, self.layer_idx, *args, **kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        raise Unsupported("a VirtualCache does not offload: its pages live in the vmkv pool on the model's device")

    def prefetch(self) -> None:
        raise Unsupported("a VirtualCache does not offload, so there is nothing to prefetch")

    def reset(self) -> None:
        raise Unsupported("reset the VirtualCache, not one layer: its pages hold every layer")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise Unsupported("reorder the VirtualCache, not one layer: its pages hold every layer")

    def crop(self, tokens_to_remove: int) -> None:
        raise Unsupported("crop the VirtualCache, not one layer: its pages hold every layer")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise Unsupported("call batch_repeat_interleave on the VirtualCache: its pages hold every layer")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise Unsupported("call batch_select_indices on the VirtualCache: its pages hold every layer")


def _refuse_assignment(value: Any) -> None:
    """``CacheLayerMixin.__init__`` sets ``keys``/``values`` to ``None``; any tensor is refused."""
    if value is not None:
        raise Unsupported("a VirtualCache layer's keys/values are views of the cache; write through update()")


class VirtualCache(Cache):
    """A ``transformers.Cache`` whose K/V live in a vmkv cache (VMM or paged mode).

    Args:
        mode: ``"vmm"`` (virtually contiguous tensors, stock kernels) or ``"paged"`` (block
            tables; needs ``attn_implementation="vmkv"``).
        config: the model config (optional). Gives the layer count and, through
            ``config._attn_implementation``, the attention style up front.
        max_batch_size: slots (batch rows alive at once, beam forks and deep copies included).
            Default ``max(8, 4 * batch)``.
        max_seq_len: longest row in tokens. Default 8192.
        memory_budget: bytes of physical pages (int or "1GiB"). Default: room for every slot at
            ``max_seq_len`` (host memory is only used when touched); on CUDA, where pages are
            allocated up front, at most half the free GPU memory.
        page_size: VMM page per K/V tensor. Default: the smallest multiple of the backend
            granularity and of one token's bytes holding 64 tokens.
        layout: VMM ``"per_layer"``, ``"all_layers"`` or ``"head_major"``.
        block_size: paged mode tokens per block.
        deferred_reclaim: VMM: freed rows keep their pages mapped for the next sequence. Off by
            default: beam search frees rows every step and that memory should return to the pool.
        map_ahead: VMM: map the next page on a background thread.

    Raises:
        InvalidConfig: unknown mode, or paged mode with a config whose attention is not "vmkv".

    Threads: like the core cache, one thread at a time (see ``docs/hf.md``).
    """

    def __init__(
        self,
        mode: str = "vmm",
        *,
        config: Any = None,
        max_batch_size: int | None = None,
        max_seq_len: int | None = None,
        memory_budget: int | str | None = None,
        page_size: int | str | None = None,
        layout: str = "per_layer",
        block_size: int = 16,
        deferred_reclaim: bool = False,
        map_ahead: bool = False,
    ) -> None:
        if mode not in MODES:
            raise InvalidConfig(f"mode must be 'vmm' or 'paged', got {mode!r}")
        super().__init__(layers=[])
        self.mode = mode
        self._options = dict(
            max_batch_size=max_batch_size, max_seq_len=max_seq_len, memory_budget=memory_budget,
            page_size=page_size, layout=layout, block_size=block_size,
            deferred_reclaim=deferred_reclaim, map_ahead=map_ahead,
        )
        self._num_layers: int | None = None
        self._config_style: str | None = None  # the style the config says; None: learnt per use
        if config is not None:
            text = config.get_text_config(decoder=True)
            self._num_layers = text.num_hidden_layers
            self._config_style = "vmkv" if text._attn_implementation == ATTN_IMPLEMENTATION else "model"
        self.attention_style: str | None = self._config_style  # "model" | "vmkv"; None until known
        self._require_style_fits_mode()
        self._shared: _SharedCore | None = None
        self._closed = False
        self._rows: list[int] = []  # sequence id of each batch row; empty before the first forward
        self._dropped: list[list[int]] = []  # "vmkv" style: per row, columns not stored (padding)
        self._columns = 0  # tokens per row as transformers counts them (padding included)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # first forward, style unknown
        self._step: _Step | None = None
        self._last_layer = -1
        self.peak_bytes = 0
        self.counters: Counter[str] = Counter()

    @property
    def core(self) -> KVCacheBase | None:
        """The vmkv cache holding the pages (shared with deep copies), or ``None`` before the first forward."""
        return self._shared.core if self._shared is not None else None

    @property
    def rows(self) -> list[Any]:
        """The core cache's sequence id of each batch row (read ``core.kv(seq_id, layer)``)."""
        return list(self._rows)

    # ---- what transformers asks ----------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns seen so far (padding included), as ``DynamicCache`` counts them."""
        return self._columns + (self._pending[0][0].shape[2] if self._pending else 0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the returned K/V hold exactly ``columns + query_length`` tokens."""
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1: no fixed length is attended over (the cache grows page by page)."""
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return bool(self._rows) or bool(self._pending)

    @property
    def batch_size(self) -> int:
        return self._num_rows() if self.is_initialized else -1

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new K/V (``[B, kv_heads, S, head_dim]``) and return what attention reads.

        ``"model"`` style: the K/V of every stored token, ``[B, kv_heads, columns, head_dim]``,
        zero-copy views of the VMM tensors. ``"vmkv"`` style (or before the style is known):
        the new states unchanged; the ``"vmkv"`` attention writes them.

        Raises:
            InvalidShape: the batch changed without ``reorder_cache``/``batch_*``, or a reset
                cache is used with K/V of another shape.
            InvalidConfig: paged mode with the model's own attention.
            CacheClosed: the cache was closed.
            SequenceTooLong, OutOfPages, NoFreeSlot: from the core cache.
        """
        if self._closed:
            raise CacheClosed("this VirtualCache was closed; make a new one")
        attn_kwargs = kwargs.get("kwargs")
        if isinstance(attn_kwargs, dict):
            attn_kwargs["vmkv_cache"] = self  # how the "vmkv" attention finds this cache (5.24)
        while len(self.layers) <= layer_idx:
            self.layers.append(VirtualLayer(self, len(self.layers)))
        batch, _, q_len, _ = key_states.shape
        if layer_idx <= self._last_layer or self._last_layer < 0:
            self._start_forward(batch)
        self._last_layer = layer_idx
        if self.attention_style != "model":
            _HANDOFF.give(self, key_states, layer_idx)  # how it finds it otherwise (5.19, GPT-NeoX)
        if self.attention_style == "vmkv":
            return key_states, value_states
        if self.attention_style is None:  # first forward: no past to add, and the style is unknown
            if self._shared is not None and not self._pending:  # reset: the core is open already
                self._check_geometry(key_states, None)
            self._pending.append((key_states, value_states))
            return key_states, value_states
        if not self._rows:
            self._open_rows(key_states, self._num_layers)
        if self._step is None:
            self._step = self._begin_dense_step(q_len)
        return self._write_and_view(layer_idx, key_states, value_states)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(keys, values)`` of ``layer`` in ``DynamicCache``'s layout ``[B, kv_heads, columns, head_dim]``.

        Zero-copy views of the stored K/V (VMM mode); ``(None, None)`` before the first forward.

        Raises:
            Unsupported: the stored K/V have no such layout: paged mode (blocks), padding columns
                not stored (``"vmkv"`` attention with a padded batch), or rows out of slot order
                (after a beam reorder). Read each row with ``core.kv(seq_id, layer)`` instead.
        """
        if self._pending:
            k, v = self._pending[layer] if layer < len(self._pending) else (None, None)
            return k, v
        if not self._rows:
            return None, None
        if self.mode != "vmm":
            raise Unsupported("paged mode stores K/V in blocks, not [B, H, columns, D] tensors; "
                              "read rows with cache.core.kv(seq_id, layer) for seq_id in cache.rows")
        if any(self._dropped):
            raise Unsupported("padding columns are not stored (attn_implementation='vmkv'), so rows differ in length; "
                              "read rows with cache.core.kv(seq_id, layer) for seq_id in cache.rows")
        rows = self._slot_slice([self.core.slot(seq_id) for seq_id in self._rows])
        if rows is None:
            raise Unsupported("after this beam reorder the rows are not in consecutive slots, so no view holds them; "
                              "read rows with cache.core.kv(seq_id, layer) for seq_id in cache.rows")
        k_all, v_all = self.core.kv_cache(layer)  # [max_batch, max_seq, H, D]
        length = self._columns
        return k_all[rows, :length].transpose(1, 2), v_all[rows, :length].transpose(1, 2)

    # ---- batch rows (beam search, parallel sampling) -------------------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` continues old row ``beam_idx[i]``: free unused rows, fork repeated ones (no copy)."""
        self._remap_rows(self._as_index_list(beam_idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` consecutive rows sharing its pages (``fork``)."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise InvalidInput(f"repeats must be a positive int, got {repeats!r}")
        self._remap_rows([row for row in range(self._num_rows()) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices`` (in that order); the others are freed."""
        self._remap_rows(self._as_index_list(indices))

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` columns of every row (``truncate``; 0 is a no-op).

        Raises:
            InvalidInput: a positive value (transformers' legacy absolute form is not supported)
                or more columns than stored.
        """
        if tokens_to_remove > 0:
            raise InvalidInput("crop takes a negative number of tokens to remove")
        keep = self.get_seq_length() + tokens_to_remove
        if keep < 0:
            raise InvalidInput(f"cannot crop {-tokens_to_remove} of {self.get_seq_length()} tokens")
        if tokens_to_remove == 0:
            return
        self._flush_pending()
        for row, seq_id in enumerate(self._rows):
            self._dropped[row] = [c for c in self._dropped[row] if c < keep]
            self.core.truncate(seq_id, keep - len(self._dropped[row]))
        self._columns = keep
        self._step = None

    def reset(self) -> None:
        """Free every row (the pages go back to the pool); the next forward starts new rows.

        The core cache stays open with its geometry, so the next use must have the same KV
        heads, head size, dtype and device (any batch size up to ``max_batch_size``).
        """
        if self._shared is not None:
            self._shared.reap()
            for seq_id in self._rows:
                self.core.free(seq_id)
        self._rows, self._dropped, self._pending = [], [], []
        self._columns, self._step, self._last_layer = 0, None, -1
        self.attention_style = self._config_style

    def close(self) -> None:
        """Free this cache's rows and release the memory once no deep copy uses it; unusable afterwards."""
        shared, rows = self._shared, self._rows
        self._shared, self._closed = None, True
        self._rows, self._dropped, self._pending, self._step = [], [], [], None
        if shared is None:
            return
        try:
            shared.reap()
            for seq_id in rows:
                shared.core.free(seq_id)
        finally:
            shared.users -= 1
            if shared.users == 0:
                shared.core.close()

    def __del__(self) -> None:
        shared = getattr(self, "_shared", None)
        if shared is not None:
            self._shared = None
            try:
                shared.retire(self._rows)
            except Exception:  # noqa: BLE001 - interpreter shutdown: modules may be gone already
                pass

    def __deepcopy__(self, memo: dict[int, Any]) -> "VirtualCache":
        """A cache with the same rows, columns and style whose rows are forks of this cache's rows.

        Both share the core cache (and its page pool): no K/V is copied, and the first write of
        either into a shared page copies that page only (copy-on-write). transformers' prompt
        reuse (prefill once, ``copy.deepcopy`` per question) costs one fork per row.

        Raises:
            NoFreeSlot: the copy's rows do not fit the free slots (raise ``max_batch_size``).
        """
        self._flush_pending()
        clone = VirtualCache.__new__(VirtualCache)
        memo[id(self)] = clone
        own = {"layers", "_shared", "_rows", "_step", "_pending"}
        for name, value in self.__dict__.items():
            if name not in own:
                setattr(clone, name, copy.deepcopy(value, memo))
        clone._step, clone._pending, clone._last_layer = None, [], -1
        clone.layers = [VirtualLayer(clone, i) for i in range(len(self.layers))]
        clone._shared, clone._rows = None, []
        if self._shared is None:
            return clone
        self._shared.reap()
        core = self._shared.core
        if len(core) + len(self._rows) > core.config.max_batch_size:
            raise NoFreeSlot(f"a copy of {len(self._rows)} rows needs as many free slots; "
                             f"{core.config.max_batch_size - len(core)} of max_batch_size="
                             f"{core.config.max_batch_size} are free")
        self._shared.users += 1
        clone._shared = self._shared
        for seq_id in self._rows:
            new_id = self._shared.new_id()
            core.fork(seq_id, new_id)
            clone._rows.append(new_id)
        return clone

    # ---- what a VirtualCache does not do -------------------------------------------------------
    def offload(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        raise Unsupported("a VirtualCache does not offload: its pages live in the vmkv pool on the model's device")

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        raise Unsupported("a VirtualCache does not offload, so there is nothing to prefetch")

    def early_initialization(self, *args: Any, **kwargs: Any) -> None:
        raise Unsupported("a VirtualCache sizes itself at the first forward; it cannot be exported")

    def update_conv_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise Unsupported(_NO_LINEAR_ATTENTION)

    def update_recurrent_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise Unsupported(_NO_LINEAR_ATTENTION)

    def update_indexer(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise Unsupported("a VirtualCache holds attention K/V only; indexer key caches are not supported")

    # ---- reporting -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The core cache's ``stats()`` plus this adapter's counters.

        Extra keys: ``rows``, ``columns``, ``attention_style``, ``peak_bytes`` (most pool bytes in
        use after any step), ``gathered_views`` (model-style steps whose rows were not in
        consecutive slots, so the views had to be gathered: a copy), ``row_forks``/``row_frees``
        and ``row_retargets`` (rows reorder_cache rewrote in place, see ``_remap_rows``).
        """
        stats = self.core.stats() if self.core is not None else {"mode": self.mode}
        stats.update(
            rows=len(self._rows), columns=self.get_seq_length(), attention_style=self.attention_style,
            peak_bytes=self.peak_bytes, gathered_views=self.counters["gathered_views"],
            row_forks=self.counters["row_forks"], row_frees=self.counters["row_frees"],
            row_retargets=self.counters["row_retargets"],
        )
        return stats

    def __repr__(self) -> str:
        return f"VirtualCache(mode={self.mode!r}, rows={len(self._rows)}, columns={self.get_seq_length()})"

    # ---- internals: sizing ---------------------------------------------------------------------
    def _require_style_fits_mode(self) -> None:
        if self.mode == "paged" and self.attention_style == "model":
            raise InvalidConfig(
                "paged mode needs the model loaded with attn_implementation='vmkv' (import vmkv.hf first): "
                "stock kernels read contiguous K/V, which paged mode does not have"
            )

    def _open_rows(self, like: torch.Tensor, num_layers: int | None) -> None:
        """Start a row per batch row of ``like`` (``[B, kv_heads, S, head_dim]``), opening the core if needed.

        Raises:
            InvalidShape: the core (kept by ``reset``) holds K/V of another shape.
            NoFreeSlot: more rows than free slots.
        """
        if self._shared is None:
            self._shared = _SharedCore(self._open_core(like, num_layers))
        self._shared.reap()
        core = self.core
        batch = like.shape[0]
        self._check_geometry(like, num_layers)
        free = core.config.max_batch_size - len(core)
        if batch > free:
            raise NoFreeSlot(f"a batch of {batch} rows does not fit the {free} free slots "
                             f"(max_batch_size={core.config.max_batch_size}); raise it")
        self._rows = []
        for _ in range(batch):
            seq_id = self._shared.new_id()
            core.add(seq_id)
            self._rows.append(seq_id)
        self._dropped = [[] for _ in range(batch)]

    def _check_geometry(self, like: torch.Tensor, num_layers: int | None) -> None:
        """Raise ``InvalidShape`` unless the open core stores K/V shaped like ``like`` (``[B, H, S, D]``)."""
        core = self.core
        _, heads, _, head_dim = like.shape
        want = dict(num_layers=num_layers or core.config.num_layers, num_kv_heads=heads, head_dim=head_dim,
                    dtype=like.dtype, device=like.device)
        have = {name: getattr(core.config, name) for name in want}
        if want != have:
            raise InvalidShape(f"this cache holds K/V with {have} but the model gives {want}; "
                               "a reset cache keeps its geometry: use a new VirtualCache for another model")

    def _open_core(self, like: torch.Tensor, num_layers: int) -> KVCacheBase:
        """The core cache for tensors shaped like ``like`` (``[B, kv_heads, S, head_dim]``)."""
        from . import open_cache
        from .vm import granularity

        batch, heads, _, head_dim = like.shape
        opts = self._options
        max_batch = opts["max_batch_size"] or max(8, 4 * batch)
        max_seq = opts["max_seq_len"] or DEFAULT_MAX_SEQ_LEN
        config = KVCacheConfig(
            num_layers=num_layers, num_kv_heads=heads, head_dim=head_dim, dtype=like.dtype, device=like.device,
            max_batch_size=max_batch, max_seq_len=max_seq, memory_budget=1, page_size=1,
            layout=opts["layout"], block_size=opts["block_size"], prefix_caching=False,
            deferred_reclaim=opts["deferred_reclaim"], map_ahead=opts["map_ahead"],
        )
        token_bytes = config.tensor_token_bytes()  # of one VMM piece: a layer, all layers, or one head
        page = opts["page_size"] or default_page_size(token_bytes, granularity(config.device))
        config = config.replace(page_size=page)
        if self.mode == "vmm":
            tokens_per_page, page_bytes = config.page_size // token_bytes, vmm_pieces(config) * config.page_size
        else:
            tokens_per_page = config.block_size
            page_bytes = 2 * num_layers * config.block_size * config.layer_token_bytes
        budget = opts["memory_budget"]
        if budget is None:  # every slot full, plus one page per slot for copy-on-write
            budget = (max_batch * -(-max_seq // tokens_per_page) + max_batch) * page_bytes
            if config.device.type == "cuda":  # CUDA pages are allocated up front: at most half the free memory
                budget = min(budget, torch.cuda.mem_get_info(config.device)[0] // 2)
            elif self.mode == "vmm":  # each mapped page costs host mappings: stay within half of those left
                budget = min(budget, self._mappable_pages(config) * page_bytes)
        core = open_cache(config.replace(memory_budget=budget), mode=self.mode)
        log.info("vmkv.hf: %s cache, %d layers, %d B budget, kernel %s", self.mode, num_layers, budget, core.kernel)
        return core

    @staticmethod
    def _mappable_pages(config: KVCacheConfig) -> int:
        """Pool pages whose mappings (two per page and range when fragmented) fit in half of what
        Linux's ``vm.max_map_count`` still allows this process (unbounded when unknown)."""
        from .vm import mapping_room

        room = mapping_room()
        if room is None:
            return 1 << 62
        pieces = vmm_pieces(config)
        return max(1, (room // 2 // pieces - 1) // 2)

    def _flush_pending(self) -> None:
        """Write the first forward's K/V (kept by reference while the style was unknown)."""
        if not self._pending:
            return
        self.attention_style = "model"
        self._require_style_fits_mode()
        pending, self._pending = self._pending, []
        self._open_rows(pending[0][0], len(pending))
        q_len = pending[0][0].shape[2]
        step = self._begin_dense_step(q_len)
        for layer, (k, v) in enumerate(pending):
            self.core.write(layer, self._pack(k), self._pack(v), step.plan)

    # ---- internals: steps ----------------------------------------------------------------------
    def _start_forward(self, batch: int) -> None:
        """The first layer of a forward; its plan is built lazily (the columns count once it exists)."""
        if self._shared is not None:
            self._shared.reap()
        if self._pending and self.attention_style != "vmkv":
            self._flush_pending()
        if self._rows and batch != len(self._rows):
            raise InvalidShape(
                f"batch of {batch} rows, but the cache holds {len(self._rows)}; use reorder_cache, "
                "batch_select_indices or batch_repeat_interleave to change rows"
            )
        self._step = None

    def _begin_dense_step(self, q_len: int) -> _Step:
        """"model" style: every row stores all ``q_len`` new columns."""
        plan = self.core.begin_step({seq_id: q_len for seq_id in self._rows})
        self._columns += q_len
        self._note_peak()
        return _Step(plan, None)

    def _begin_ragged_step(self, mask: torch.Tensor | None, batch: int, q_len: int) -> _Step:
        """"vmkv" style: each row stores only its real (unpadded) new columns."""
        real = None
        if mask is not None:
            if mask.dim() != 2:
                raise InvalidInput("the vmkv attention takes a 2D padding mask; 4D masks are not supported")
            real = mask[:, -q_len:].to(torch.bool)
            if bool(real.all()):
                real = None
        counts = [q_len] * batch if real is None else real.sum(1).tolist()
        batch_plan = {seq_id: n for seq_id, n in zip(self._rows, counts) if n > 0}
        if not batch_plan:
            raise InvalidInput("every row of this step is padding")
        plan = self.core.begin_step(batch_plan)
        if real is not None:
            for row, flags in enumerate(real.tolist()):
                self._dropped[row].extend(self._columns + j for j, ok in enumerate(flags) if not ok)
        self._columns += q_len
        self._note_peak()
        keep = None if real is None else real.reshape(-1).nonzero().squeeze(1).to(mask.device)
        return _Step(plan, keep)

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.core.pool.num_in_use * self.core.geometry.page_bytes)

    @staticmethod
    def _pack(states: torch.Tensor) -> torch.Tensor:
        """``[B, H, S, D]`` -> contiguous ``[B * S, H, D]`` (row after row: the plan's packing order)."""
        batch, heads, q_len, dim = states.shape
        return states.transpose(1, 2).reshape(batch * q_len, heads, dim).contiguous()

    @staticmethod
    def _slot_slice(slots: list[int]) -> slice | None:
        """A slice selecting ``slots`` in order (an arithmetic progression), else ``None``."""
        stride = slots[1] - slots[0] if len(slots) > 1 else 1
        if stride > 0 and all(b - a == stride for a, b in zip(slots, slots[1:])):
            return slice(slots[0], slots[-1] + 1, stride)
        return None

    def _write_and_view(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """"model" style: write, then return ``[B, H, columns, D]`` views of the virtual tensors."""
        plan = self._step.plan
        self.core.write(layer, self._pack(k), self._pack(v), plan)
        k_all, v_all = self.core.kv_cache(layer)  # [max_batch, max_seq, H, D], mapped up to each length
        length = self._columns
        rows = self._slot_slice(plan.slots)
        if rows is not None:
            return k_all[rows, :length].transpose(1, 2), v_all[rows, :length].transpose(1, 2)
        self.counters["gathered_views"] += 1  # rows not in arithmetic slot order: one copy
        if self.counters["gathered_views"] == 1:
            log.info("vmkv.hf: rows are not in consecutive slots (beam reorder); views are gathered (a copy). "
                     "attn_implementation='vmkv' avoids this")
        index = plan.slots_t.to(torch.long)
        k_view = k_all[:, :length].index_select(0, index).transpose(1, 2)
        return k_view, v_all[:, :length].index_select(0, index).transpose(1, 2)

    def _attend(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        mask: torch.Tensor | None, scaling: float | None,
    ) -> torch.Tensor:
        """"vmkv" style, one layer: write the real new tokens and run the cache's kernel.

        Shapes: ``query: [B, Hq, S, D]``, ``key, value: [B, Hkv, S, D]``; returns ``[B, S, Hq, D]``.
        """
        if self.attention_style is None:  # first forward without a config: the attention tells us
            self.attention_style = "vmkv"
            self._pending = []
        layer = module.layer_idx
        if not self._rows:
            self._open_rows(key, self._num_layers or module.config.num_hidden_layers)
        batch, q_heads, q_len, dim = query.shape
        if self._step is None:
            self._step = self._begin_ragged_step(mask, batch, q_len)
        step = self._step
        q, k, v = self._pack(query), self._pack(key), self._pack(value)
        if step.keep is not None:
            q, k, v = q.index_select(0, step.keep), k.index_select(0, step.keep), v.index_select(0, step.keep)
        self.core.write(layer, k, v, step.plan)
        out = self.core.attention(layer, q, step.plan, scale=scaling)  # [T, Hq, D]
        if step.keep is not None:
            full = out.new_zeros(batch * q_len, q_heads, dim)
            full[step.keep] = out
            out = full
        return out.view(batch, q_len, q_heads, dim)

    # ---- internals: rows -----------------------------------------------------------------------
    def _num_rows(self) -> int:
        if self._pending:
            return self._pending[0][0].shape[0]
        return len(self._rows)

    def _as_index_list(self, index: torch.Tensor | list[int]) -> list[int]:
        values = index.reshape(-1).tolist() if isinstance(index, torch.Tensor) else list(index)
        rows = self._num_rows()
        if not all(isinstance(i, int) and 0 <= i < rows for i in values):
            raise InvalidInput(f"row indexes must be ints in 0..{rows - 1}, got {values}")
        return values

    def _remap_rows(self, sources: list[int]) -> None:
        """New row ``i`` continues old row ``sources[i]``.

        Each old row is taken over by one new row that continues it (preferring the same index:
        no change). Every other new row needs a copy of its source; it gets one of two ways:

        * *retarget* (VMM mode): an old row no new row continues, whose pages equal all the
          source's full pages (the beams diverged within the last, partly filled page), is
          truncated to them and gets the source's last tokens written: under a page of copy, no
          page mapping, and the same memory as a fork (whose first write copies that page);
        * *fork* otherwise: the old row is freed and the source forked, sharing all its pages
          (mapping each of them into the new slot); the first write into a shared page copies it.

        The new rows must fit the slots left by the rows of deep copies sharing the core; that
        is checked before anything changes. Forks made before a failing core call (out of pages
        or mappings) are freed again; should the failure come after an unused row was already
        freed or retargeted (its old tokens are gone), every row is freed and the error says so.

        Raises:
            NoFreeSlot: the new rows do not fit the slots the other users of the core leave
                (nothing changed).
        """
        self._flush_pending()
        self._step = None
        if not self._rows:
            return
        self._shared.reap()
        core = self.core
        limit = core.config.max_batch_size
        free = limit - (len(core) - len(self._rows))  # slots this cache may fill: others keep theirs
        if len(sources) > free:
            raise NoFreeSlot(f"{len(sources)} rows need as many slots; {free} of max_batch_size={limit} are "
                             f"not held by deep copies of this cache; raise it or close the copies")
        taker: dict[int, int] = {}
        for new, old in enumerate(sources):
            if old not in taker or new == old:
                taker[old] = new
        unused = [old for old in range(len(self._rows)) if old not in taker]
        rows, dropped, forks, spare = [], [], [], len(unused)
        try:
            for new, old in enumerate(sources):
                if taker[old] == new:
                    rows.append(self._rows[old])
                else:
                    rows.append(self._copy_row(old, unused, forks))
                dropped.append(list(self._dropped[old]))
        except BaseException as exc:
            self._undo_copies(forks, len(unused) < spare, exc)
            raise
        for old in unused:
            core.free(self._rows[old])
            self.counters["row_frees"] += 1
        self._rows, self._dropped = rows, dropped

    def _undo_copies(self, forks: list[int], lost_rows: bool, exc: BaseException) -> None:
        """A row operation failed: free its ``forks``; if unused rows were already freed or
        retargeted (``lost_rows``), the old rows cannot come back: free them all too."""
        for seq_id in forks:
            self.core.free(seq_id)
        if lost_rows:
            self._rows = [seq_id for seq_id in self._rows if seq_id in self.core]
            self.reset()
            exc.add_note("vmkv.hf: rows freed or rewritten before this failure cannot be restored, "
                         "so every row of this cache was freed: prefill again")

    def _copy_row(self, source: int, unused: list[int], forks: list[int]) -> int:
        """A sequence holding row ``source``'s tokens: a retargeted unused row, else a fork
        (whose id is appended to ``forks``). Used rows are removed from ``unused``."""
        src_id = self._rows[source]
        if self.mode == "vmm":
            src_pages = self.core.pages(src_id)
            best, shared = None, -1
            for old in unused:
                pages = self.core.pages(self._rows[old])
                same = next((n for n, (a, b) in enumerate(zip(pages, src_pages)) if a != b), min(len(pages), len(src_pages)))
                if same > shared:
                    best, shared = old, same
            if best is not None and self._can_retarget(self._rows[best], src_id, shared):
                unused.remove(best)  # before the row changes: a failure must know it is gone
                self._retarget(self._rows[best], src_id, shared)
                return self._rows[best]
        seq_id = self._shared.new_id()
        if len(self.core) >= self.core.config.max_batch_size and unused:  # make a slot first
            self.core.free(self._rows[unused.pop()])
            self.counters["row_frees"] += 1
        self.core.fork(src_id, seq_id)
        forks.append(seq_id)
        self.counters["row_forks"] += 1
        return seq_id

    def _retarget_keep(self, seq_id: int, src_id: int, shared_pages: int) -> int:
        """Tokens ``seq_id`` keeps when it becomes a copy of ``src_id`` (they share ``shared_pages``)."""
        return min(shared_pages * self.core.tokens_per_page, self.core.seq_len(src_id), self.core.seq_len(seq_id))

    def _can_retarget(self, seq_id: int, src_id: int, shared_pages: int) -> bool:
        """Whether ``seq_id`` shares every full page of ``src_id`` (else copying a page would take
        memory a fork shares)."""
        tpp = self.core.tokens_per_page
        return self._retarget_keep(seq_id, src_id, shared_pages) >= self.core.seq_len(src_id) // tpp * tpp

    def _retarget(self, seq_id: int, src_id: int, shared_pages: int) -> None:
        """Make ``seq_id`` (for which ``_can_retarget`` holds) a copy of ``src_id`` whose first
        ``shared_pages`` pages it already shares: truncate it and write the source's last tokens."""
        length = self.core.seq_len(src_id)
        keep = self._retarget_keep(seq_id, src_id, shared_pages)
        self.core.truncate(seq_id, keep)
        if length > keep:
            plan = self.core.begin_step({seq_id: length - keep})
            for layer in range(self.core.config.num_layers):
                k, v = self.core.kv(src_id, layer)  # [length, H, D], views of the same storage:
                self.core.write(layer, k[keep:].clone(), v[keep:].clone(), plan)  # torch refuses aliasing
        self.counters["row_retargets"] += 1


__all__ = [
    "ATTN_IMPLEMENTATION",
    "Unsupported",
    "VirtualCache",
    "cache_argument",
    "causal_padding_mask",
    "VirtualLayer",
    "default_page_size",
    "register",
    "vmkv_attention_forward",
    "vmkv_attention_mask",
]
