"""What differs between the transformers versions ``vmkv.hf`` supports (5.x: tested with 5.19 and 5.24).

* The import itself: ``vmkv.hf`` needs transformers, ``import vmkv`` does not; a missing
  transformers says which extra brings it.
* The cache argument: 5.19 names it ``past_key_values=``, 5.24 ``cache=`` (:func:`cache_argument`).
* The attention kwargs: 5.24 passes them to ``Cache.update(k, v, layer, kwargs=...)``, 5.19 and
  models such as GPT-NeoX do not (:func:`attention_kwargs`; ``vmkv.hf.attention`` has the
  per-thread note that covers the others).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from ..extras import install_hint

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface
except ModuleNotFoundError as exc:  # say which extra brings the missing package
    if exc.name != "transformers":
        raise
    raise ModuleNotFoundError(f"vmkv.hf needs transformers: {install_hint('hf')} ({exc})", name=exc.name) from exc

__all__ = ["AttentionInterface", "AttentionMaskInterface", "Cache", "CacheLayerMixin", "attention_kwargs", "cache_argument"]


@functools.cache
def cache_argument() -> str:
    """The keyword the installed transformers takes a cache as: ``"cache"`` (5.24) or ``"past_key_values"`` (5.19).

    Both spellings work on 5.24 (the old one until 6.0, with a deprecation warning); code that
    must run on both without a warning passes ``**{vmkv.hf.cache_argument(): cache}``.
    """
    from transformers.generation.utils import GenerationMixin

    parameters = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@functools.cache
def update_gets_attention_kwargs() -> bool:
    """Whether the installed transformers' models pass the attention's kwargs to ``Cache.update``
    (5.24 and later; not GPT-NeoX): what the compiled ``"vmkv"`` attention receives its step
    through (elsewhere it runs eagerly at graph breaks)."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return (major, minor) >= (5, 24)


def attention_kwargs(update_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The attention's own keyword arguments, as transformers 5.24 passes them to ``Cache.update``
    (``update(k, v, layer, kwargs=...)``); ``None`` where the caller does not (5.19, GPT-NeoX)."""
    found = update_kwargs.get("kwargs")
    return found if isinstance(found, dict) else None
