"""What differs between the transformers 5.x versions ``vmkv.hf`` supports (CI tests 5.19 and the newest, 5.25):
the cache argument's name (:func:`cache_argument`) and whether ``Cache.update`` gets the
attention kwargs (:func:`attention_kwargs`).
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
    """The keyword the installed transformers takes a cache as: ``"cache"`` (5.24) or
    ``"past_key_values"`` (5.19); ``**{cache_argument(): cache}`` runs on both without a warning.
    """
    from transformers.generation.utils import GenerationMixin

    parameters = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@functools.cache
def update_gets_attention_kwargs() -> bool:
    """Whether the models pass the attention's kwargs to ``Cache.update`` (5.24+; not GPT-NeoX), which
    the compiled ``"vmkv"`` attention needs.
    """
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return (major, minor) >= (5, 24)


def attention_kwargs(update_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The attention's kwargs as transformers 5.24 passes them to ``Cache.update``; ``None`` where not."""
    found = update_kwargs.get("kwargs")
    return found if isinstance(found, dict) else None
