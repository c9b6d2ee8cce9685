"""One layer's face of a ``VirtualCache``: transformers' per-layer cache API (``cache.layers[i]``)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from ..errors import Unsupported
from .compat import CacheLayerMixin

if TYPE_CHECKING:
    from .cache import VirtualCache


class VirtualLayer(CacheLayerMixin):
    """One layer's face of a :class:`VirtualCache`; batch operations act on the whole cache (pages hold
    every layer). ``keys``/``values``: ``[B, kv_heads, columns, head_dim]``, views or copies.
    """

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
    def is_sliding(self) -> bool:  # type: ignore[override]
        """Whether this layer attends over a sliding window (its mask and sizes are the window's)."""
        return self._cache._model.window(self.layer_idx) > 0

    @is_sliding.setter
    def is_sliding(self, value: bool) -> None:
        """A transformers layer class may assign it; the window lives in the cache."""

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self._cache.is_initialized

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        """CacheLayerMixin.__init__ assigns it; the state lives in the cache."""

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        """This layer's K, ``[B, kv_heads, columns, head_dim]``: a view or a copy (``VirtualCache.layer_states``)."""
        return self._cache.layer_states(self.layer_idx, 0)

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        _refuse_assignment(value)

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        """This layer's V, ``[B, kv_heads, columns, head_dim]``: a view or a copy (``VirtualCache.layer_states``)."""
        return self._cache.layer_states(self.layer_idx, 1)

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
        return self._cache.get_max_length()

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
        raise Unsupported("a VirtualCache layer's keys/values are read from the cache; write through update()")
