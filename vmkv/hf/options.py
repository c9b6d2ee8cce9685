"""What a ``VirtualCache`` opens its core cache with: the user's options (:class:`CacheOptions`), the
model's facts (:class:`ModelFacts`), and from the first K/V it sees the slots, length, page size,
layout and memory budget (the defaults are documented in docs/hf.md, "Sizing"). The page rules
and the layout resolver are :mod:`vmkv.sizing`'s; this module passes the transformers adapter's
candidates: the layout its attention reads fastest, and pages that fit the first batch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..config import KVCacheConfig, check_layout
from ..errors import InvalidConfig
from ..sizes import parse_size
from ..sizing import DeviceFacts, choose_layout, default_pages, mappable_pages, model_windows, smallest_page

log = logging.getLogger("vmkv")

DEFAULT_MAX_SEQ_LEN = 8192
MIN_TOKENS_PER_PAGE = 64
MAX_HEAD_MAJOR_TOKENS = 1024  # the largest head-major page the default grows to before it takes per_layer


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""The ``config.layer_types`` a ``VirtualCache`` holds K/V for (transformers' names)."""


def check_model(text_config: Any) -> None:
    """Raise ``InvalidConfig`` naming the feature when a model's cache is not K/V a ``VirtualCache``
    holds: a latent KV cache (multi-head latent attention: DeepSeek-V2/V3, Kimi), or layers
    without per-token K/V (linear attention, Mamba/conv states, indexers, shared-KV layers)."""
    if getattr(text_config, "kv_lora_rank", None):
        raise InvalidConfig(f"{type(text_config).__name__} caches a latent KV (multi-head latent attention, "
                            "kv_lora_rank): keys and values of different shapes, which a VirtualCache does not hold; "
                            "use transformers' DynamicCache")
    other = sorted(set(getattr(text_config, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
    if other:
        raise InvalidConfig(f"{type(text_config).__name__} has layers of type {', '.join(other)}: a VirtualCache holds "
                            f"the K/V of {', '.join(ATTENTION_LAYER_TYPES)} layers only, not linear-attention, Mamba or "
                            "conv states, indexer caches or shared-KV layers; use transformers' own cache")


def default_page_size(token_bytes: int, granularity: int, min_tokens: int = MIN_TOKENS_PER_PAGE) -> int:
    """Smallest page that is a multiple of ``granularity`` and ``token_bytes`` and holds ``min_tokens``
    (:func:`vmkv.sizing.smallest_page` with this module's default of tokens)."""
    return smallest_page(token_bytes, granularity, min_tokens)


@dataclass(frozen=True)
class CacheOptions:
    """What the user gave ``VirtualCache(...)``; ``None``: the default (see :func:`open_core`)."""

    max_batch_size: int | None = None
    max_seq_len: int | None = None
    memory_budget: int | str | None = None
    page_size: int | None = None
    layout: str | None = None
    block_size: int = 16
    deferred_reclaim: bool = False
    map_ahead: bool = False
    window_slack: int | None = None

    def __post_init__(self) -> None:
        """Raise ``InvalidConfig`` for a layout that is none or a page size that is no size."""
        check_layout(self.layout, optional=True)
        if self.page_size is not None:
            object.__setattr__(self, "page_size", parse_size(self.page_size, name="page_size"))


@dataclass(frozen=True)
class ModelFacts:
    """What a ``VirtualCache`` knows of its model up front: nothing without a config."""

    num_layers: int | None = None
    style: str | None = None  # the attention style the config says: "vmkv" or "model"
    windows: tuple[int, ...] | None = None  # each layer's sliding window (0: full attention); None: all full

    def window(self, layer: int) -> int:
        """``layer``'s sliding window (0: none, or not known without a config)."""
        return self.windows[layer] if self.windows is not None else 0

    @classmethod
    def of(cls, config: Any) -> "ModelFacts":
        """The facts of ``config`` (``None``: learnt at the first forward).

        Raises:
            InvalidConfig: a model whose cache is not K/V a ``VirtualCache`` holds (:func:`check_model`).
        """
        if config is None:
            return cls()
        text = config.get_text_config(decoder=True)
        check_model(text)
        return cls(text.num_hidden_layers, "vmkv" if text._attn_implementation == "vmkv" else "model",
                   model_windows(text))


@dataclass(frozen=True)
class LayoutChoice:
    """The layout and page size a cache opened with, and why (``VirtualCache.stats()`` shows both)."""

    layout: str
    page_size: int
    reason: str


def layout_for(config: KVCacheConfig, style: str, options: CacheOptions, facts: DeviceFacts) -> LayoutChoice:
    """The VMM layout and page size for ``config`` (its ``layout`` and ``page_size`` are ignored)
    when the attention reading the K/V is ``style`` (``"model"``: the model's SDPA/eager over
    ``[B, kv_heads, len, head_dim]`` views; ``"vmkv"``: the cache's own kernel).

    The rule (measurements in docs/hf.md, "Defaults" and "Layouts (a retired experiment)"):

    * host: ``head_major`` (each head's keys of a row contiguous: DynamicCache's own layout, what
      CPU SDPA reads fastest) if the mappings it needs fit (``head_major`` maps ``kv_heads``
      pieces per page and layer): the one candidate of :func:`vmkv.sizing.choose_layout`, at
      pages from :data:`MIN_TOKENS_PER_PAGE` tokens (doubling, up to :data:`MAX_HEAD_MAJOR_TOKENS`),
      whose pool holds the first batch at ``max_seq_len`` within half the mappings
      ``vm.max_map_count`` leaves; else ``per_layer``;
    * CUDA: the core's default (:func:`vmkv.sizing.default_pages`: ``all_layers``, the backend's
      granule): FlashAttention/SDPA read token-major ``[B, S, H, D]`` with a unit last stride.

    A layout or page size the user gave is kept (the page then defaults as for that layout).
    """
    shape, gran = config.kv_shape, facts.granularity
    if options.layout is not None:
        layout = options.layout
        page = options.page_size or default_page_size(shape.token_bytes(layout), gran)
        return LayoutChoice(layout, page, "given")
    if facts.device_type != "cpu":
        layout, page = default_pages(shape, config.dtype, max(config.memory_budget, 1), facts)
        return LayoutChoice(layout, options.page_size or page, f"{facts.device_type}: token-major pages of the "
                            "backend granularity, the layout FlashAttention/SDPA read natively")
    token_bytes = shape.token_bytes("head_major")
    pages = [options.page_size or default_page_size(token_bytes, gran)]
    while not options.page_size and pages[-1] // token_bytes < MAX_HEAD_MAJOR_TOKENS:
        pages.append(2 * pages[-1])
    rows, room = config.max_batch_size, facts.mapping_room
    need_tokens = rows * config.max_seq_len  # the pool holds them, and one more page a row
    chosen = choose_layout(shape, [("head_major", pages)], None if room is None else room // 2,
                           lambda layout, page: -(-need_tokens // (page // token_bytes)) + rows)
    if chosen is not None:
        page = chosen[1]
        return LayoutChoice("head_major", page, f"{style} attention on the host: head-major views are what CPU "
                            f"SDPA reads fastest ({page // token_bytes} tokens a page fit the mappings)")
    layout = "per_layer"
    return LayoutChoice(layout, options.page_size or default_page_size(shape.token_bytes(layout), gran),
                        "host: head-major pages would need more mappings than vm.max_map_count leaves; per_layer")


def open_core(mode: str, options: CacheOptions, like: torch.Tensor, num_layers: int, style: str,
              windows: tuple[int, ...] | None = None, features: tuple[str, ...] = ()) -> tuple[Any, LayoutChoice]:
    """The core cache for K/V shaped like ``like`` (``[B, kv_heads, S, head_dim]``) read by
    attention ``style``, and the layout choice it opened with; ``windows``: each layer's sliding
    window (layers of different windows: a :class:`~vmkv.core.groups.LayerGroups`, a core cache
    per window); ``features``: what the attention adds (``"softcap"``, ``"sinks"``).

    Defaults: ``max(8, 4 * B)`` slots, :data:`DEFAULT_MAX_SEQ_LEN` tokens, the layout and page
    of :func:`layout_for`, and a budget with room for every slot full plus one page per slot
    (copy-on-write), capped on CUDA at half the free memory and on the host (VMM) at half the
    mappings ``vm.max_map_count`` still allows.
    """
    from .. import open_cache

    batch, heads, _, head_dim = like.shape
    max_batch = options.max_batch_size or max(8, 4 * batch)
    max_seq = options.max_seq_len or DEFAULT_MAX_SEQ_LEN
    config = KVCacheConfig(
        num_layers=num_layers, num_kv_heads=heads, head_dim=head_dim, dtype=like.dtype, device=like.device,
        max_batch_size=max_batch, max_seq_len=max_seq, memory_budget=1, block_size=options.block_size,
        prefix_caching=False, deferred_reclaim=options.deferred_reclaim, map_ahead=options.map_ahead,
        layer_windows=windows, attention_features=features, window_slack=options.window_slack,
    )
    # the device's facts, read once; the mapping room only where a default needs it (each read lists /proc/self/maps)
    facts = DeviceFacts.probe(config.device, mappings=mode == "vmm" and (options.layout is None or options.memory_budget is None))
    if mode == "vmm":
        choice = layout_for(config.replace(max_batch_size=batch), style, options, facts)
        config = config.replace(layout=choice.layout, page_size=choice.page_size)
        pieces = config.kv_shape.pieces(choice.layout)
        tokens_per_page, page_bytes = choice.page_size // config.tensor_token_bytes(), pieces * choice.page_size
    else:  # paged mode ignores the page size, but validates a given one all the same (sizing.check_page_size)
        if options.page_size is not None:
            config = config.replace(page_size=options.page_size)
        choice = LayoutChoice("blocks", 0, f"paged mode: {config.block_size}-token blocks")
        tokens_per_page = config.block_size
        page_bytes = 2 * num_layers * config.block_size * config.layer_token_bytes
    budget = options.memory_budget
    if budget is None:  # every slot full, plus one page per slot for copy-on-write
        budget = (max_batch * -(-max_seq // tokens_per_page) + max_batch) * page_bytes
        if config.device.type == "cuda":  # CUDA pages are allocated up front: at most half the free memory
            budget = min(budget, torch.cuda.mem_get_info(config.device)[0] // 2)
        elif mode == "vmm":  # each mapped page costs host mappings: stay within half of those left
            budget = min(budget, mappable_pages(pieces, facts.mapping_room) * page_bytes)
    if windows is not None and len(set(windows)) > 1 and config.layout == "all_layers" and options.page_size is None:
        config = config.replace(page_size=None)  # each group's own: its layers make its tokens' bytes
    core = open_cache(config.replace(memory_budget=budget), mode=mode)
    log.info("vmkv.hf: %s cache, %d layers, %d B budget, layout %s (%s), kernel %s",
             mode, num_layers, budget, choice.layout, choice.reason, core.kernel)
    return core, choice
