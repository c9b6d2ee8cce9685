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

Where things live (one concept per module):

``vmkv.hf.cache``
    :class:`VirtualCache` (the ``Cache``) and :class:`VirtualLayer` (its per-layer face), the
    steps of a forward and what ``cache.layers[i].keys`` / ``.values`` return (zero-copy views,
    or copies counted in ``stats()["materialised_kv"]`` where no view exists).
``vmkv.hf.attention``
    the ``"vmkv"`` attention, its mask, and how it finds its cache (the 5.24 attention kwargs, or
    a per-thread note ``update`` leaves); the stock SDPA fallback for other caches.
``vmkv.hf.compiled``
    ``VirtualCache(compile=True)`` under transformers' compiled generation: the step committed at
    an eager point (``get_mask_sizes`` / ``prepare_step``), the compiled forward's writes through
    device positions; full-length views of the fixed virtual tensors for the model's attention,
    each row's own length through the capturable decode kernel for the ``"vmkv"`` attention
    (slots in VMM mode, a block table in paged mode).
``vmkv.hf.rows``
    the row policy: batch rows as sequence ids; beams (``reorder_cache``), ``batch_*``, deep
    copies as ``free`` + ``fork`` (copy-on-write, no K/V copied).
``vmkv.hf.sizing``
    the core cache's size, page size, layout and budget from the first K/V (lazy: the layer
    count comes from ``config``, the ``"vmkv"`` attention's module, or the first forward), and
    the default layout rule (``choose_layout``: head-major on the host).
``vmkv.hf.compat``
    what differs between transformers versions.

Supported: transformers 5.x (the per-layer ``CacheLayerMixin`` API; tested with 5.19 and 5.24;
5.19 names the cache argument ``past_key_values=``, 5.24 ``cache=``: see :func:`cache_argument`).
Importing this module needs transformers; ``import vmkv`` does not.
"""

from ..errors import Unsupported
from .attention import ATTN_IMPLEMENTATION, causal_padding_mask, register, vmkv_attention_forward, vmkv_attention_mask
from .cache import VirtualCache, VirtualLayer
from .compat import cache_argument
from .sizing import default_page_size

register()

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
