"""Hugging Face ``transformers`` integration: a ``Cache`` backed by vmkv, and the ``"vmkv"`` attention.

    import vmkv.hf                                            # registers attn_implementation="vmkv"
    cache = vmkv.hf.VirtualCache(mode="vmm")                  # or mode="paged"
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)

Two attention styles (``VirtualCache.attention_style``): ``"model"`` (the model's own attention
reads zero-copy views; VMM only) and ``"vmkv"`` (the registered attention writes the real tokens
and runs the cache's kernel; both modes). Modules: :mod:`.cache` (the ``Cache``), :mod:`.attention`,
:mod:`.compiled` (``compile=True``), :mod:`.rows` (beams, forks, deep copies), :mod:`.options`,
:mod:`.compat` (transformers 5.x differences). Guide: docs/hf.md.
"""

from ..errors import Unsupported
from .attention import ATTN_IMPLEMENTATION, causal_padding_mask, register, vmkv_attention_forward, vmkv_attention_mask
from .cache import VirtualCache, VirtualLayer
from .compat import cache_argument
from .options import default_page_size

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
