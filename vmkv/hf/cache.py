"""The ``transformers.Cache`` backed by vmkv (:class:`VirtualCache`) and its per-layer face (:class:`VirtualLayer`).

How a forward runs, per attention style (``VirtualCache.attention_style``): see the package
docstring (``vmkv.hf``). Per forward one ``begin_step`` (on the first layer), then every layer
writes and attends with that plan. Row operations (beams, forks, deep copies) are in
``vmkv.hf.rows``, the ``"vmkv"`` attention in ``vmkv.hf.attention``, sizing in ``vmkv.hf.sizing``.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ..config import LAYOUTS
from ..core.base import KVCacheBase
from ..core.step import StepPlan, slot_slice
from ..errors import CacheClosed, InvalidConfig, InvalidInput, InvalidShape, NoFreeSlot, Unsupported
from ..sizes import parse_size
from ..validate import as_int, as_layer
from .attention import ATTN_IMPLEMENTATION, COMPILED_STEP, HANDOFF
from .compat import Cache, CacheLayerMixin, attention_kwargs
from .compiled import CompiledSteps, check_compile, check_map_ahead, compiled_steps, eager_update
from .rows import RowPolicy, SharedCore
from .sizing import CacheOptions, open_core

log = logging.getLogger("vmkv")

MODES = ("vmm", "paged")
_NO_LINEAR_ATTENTION = "a VirtualCache holds attention K/V only; linear-attention (Mamba-style) states are not supported"


@dataclass(slots=True)
class _Step:
    """One forward's metadata: the core plan and, when padding is dropped, the kept token indexes."""

    plan: StepPlan
    keep: torch.Tensor | None  # int64 [T]: rows of the flattened [B * S] new tokens that are stored
    dense: bool = False  # "model" style: every row stores every column (core.write_batch)
    gathered: bool = False  # dense, rows not in evenly spaced slots: write_batch returns copies



class VirtualLayer(CacheLayerMixin):
    """One layer's face of a :class:`VirtualCache` (transformers' per-layer API).

    Pages hold every layer of a token, so batch operations (reorder, crop, fork) act on the
    whole cache: call them on the ``VirtualCache``, not on a layer. ``keys`` / ``values`` are
    ``[B, kv_heads, columns, head_dim]`` as in ``DynamicCache``: zero-copy views where the stored
    K/V have that layout, else materialised copies (see :meth:`VirtualCache.layer_states`).
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


class VirtualCache(RowPolicy, Cache):
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
        page_size: VMM page per K/V piece (int or "16KiB"). Default: the smallest multiple of
            the backend granularity and of one token's bytes holding 64 tokens (head-major: grown
            until the mappings fit, see ``vmkv.hf.sizing.choose_layout``).
        layout: VMM ``"per_layer"``, ``"all_layers"`` or ``"head_major"``. Default: the one
            measured fastest for the attention path on this device (``choose_layout``; host:
            ``head_major``, CUDA: ``all_layers``); ``stats()["layout"]`` and
            ``stats()["layout_reason"]`` say which and why.
        block_size: paged mode tokens per block.
        deferred_reclaim: VMM: freed rows keep their pages mapped for the next sequence. Off by
            default: beam search frees rows every step and that memory should return to the pool.
        map_ahead: VMM: map the next page on a background thread.
        compile: run under transformers' compiled generation (``is_compileable``; see
            ``vmkv.hf.compiled`` and docs/hf.md): StaticCache's contract over pages. Each step's
            pages are mapped at an eager point before the compiled forward. With the model's
            attention each layer returns ``[B, kv_heads, max_seq_len, head_dim]`` views (the
            model's mask hides what is past each row's length, which reads zeros and holds no
            memory); with the ``"vmkv"`` attention rows hold no padding and a compiled decode
            step reads each row's own length (paged mode: through the block table). Needs
            ``config`` and ``max_seq_len`` (the most columns a row reaches; the model's attention
            reads that many, as StaticCache reads ``max_cache_len``).

    Raises:
        InvalidConfig: unknown mode or layout, a page size that is no size, paged mode with a
            config whose attention is not "vmkv", or ``compile=True`` without what it needs.

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
        layout: str | None = None,
        block_size: int = 16,
        deferred_reclaim: bool = False,
        map_ahead: bool = False,
        compile: bool = False,
    ) -> None:
        if mode not in MODES:
            raise InvalidConfig(f"mode must be 'vmm' or 'paged', got {mode!r}")
        if layout is not None and layout not in LAYOUTS:
            raise InvalidConfig(f"layout must be one of {', '.join(LAYOUTS)} or None (chosen), got {layout!r}")
        super().__init__(layers=[])
        self.mode = mode
        self._options = CacheOptions(
            max_batch_size=max_batch_size, max_seq_len=max_seq_len, memory_budget=memory_budget,
            page_size=None if page_size is None else parse_size(page_size, name="page_size"),
            layout=layout, block_size=block_size,
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
        self._compile = check_compile(compile, config, max_seq_len)
        self._compiled: CompiledSteps | None = None  # compile=True: made with the rows' core
        self._shared: SharedCore | None = None
        self._closed = False
        self._rows: list[int] = []  # sequence id of each batch row; empty before the first forward
        self._dropped: list[list[int]] = []  # "vmkv" style: per row, columns not stored (padding)
        self._columns = 0  # tokens per row as transformers counts them (padding included)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # first forward, style unknown
        self._step: _Step | None = None
        self._last_slots: tuple[tuple[int, ...], bool] | None = None  # (slots, gathered) of the last dense step
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

    def _make_layers(self, count: int) -> list["VirtualLayer"]:
        """This cache's first ``count`` layer faces (the ones it has, then new ones)."""
        return self.layers[:count] + [VirtualLayer(self, i) for i in range(len(self.layers), count)]

    # ---- what transformers asks ----------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        """Columns seen before the coming forward (padding included), as ``DynamicCache`` counts
        them. Inside a compiled forward of a prepared step: a 0-d device tensor (as StaticCache's),
        so that the graph does not depend on the count."""
        compiled = self._compiled
        if compiled is not None and compiled.armed:
            if torch.compiler.is_compiling():
                return compiled.starts
            return self._columns - self._step.plan.q_lens[0]
        return self._columns + (self._pending[0][0].shape[2] if self._pending else 0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the returned K/V hold exactly ``columns + query_length`` tokens,
        or with ``compile=True`` always ``max_seq_len`` (and, called eagerly, this is the step's
        eager point: :meth:`prepare_step`)."""
        if not torch.compiler.is_compiling():
            self._eager_point(query_length)
        if self._compile:
            return self._options.max_seq_len, 0
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1: no fixed length is attended over (the cache grows page by page); with
        ``compile=True`` the columns every layer returns (``max_seq_len``)."""
        return self._options.max_seq_len if self._compile else -1

    @property
    def is_compileable(self) -> bool:
        """Whether transformers may compile a forward over this cache (``compile=True``)."""
        return self._compile

    def prepare_step(self, q_len: int = 1) -> None:
        """The eager point of a compiled step (``compile=True``): commit the next forward's
        ``q_len`` new columns of every row, mapping (and copying on write) the pages they land in,
        and point the compiled forward's device positions at them. transformers' ``generate()``
        does it through :meth:`get_mask_sizes`; call it yourself before each compiled forward of a
        hand-written loop. A no-op while a step is already prepared, or before the first forward
        (which opens the rows eagerly). With the ``"vmkv"`` attention a compiled step decodes one
        token per row (``q_len=1``); run longer forwards eagerly.

        Raises:
            InvalidConfig: the cache was not made with ``compile=True``.
            InvalidInput: ``q_len`` is not a positive int, or not 1 with the ``"vmkv"`` attention.
            CacheClosed, SequenceTooLong, OutOfPages: from the core cache (nothing changed).
        """
        if not self._compile:
            raise InvalidConfig("prepare_step is the eager point of VirtualCache(compile=True); this cache "
                                "runs eagerly and needs none")
        if isinstance(q_len, bool) or not isinstance(q_len, int) or q_len < 1:
            raise InvalidInput(f"q_len must be a positive int, got {q_len!r}")
        if q_len != 1 and self.attention_style == ATTN_IMPLEMENTATION:
            raise InvalidInput(f"a compiled step of the 'vmkv' attention decodes one token per row, got q_len={q_len}; "
                               "run a forward of several tokens eagerly (it drops its padding)")
        self._eager_point(q_len)

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
        zero-copy views of the VMM tensors (``compile=True``: ``[B, kv_heads, max_seq_len,
        head_dim]``). ``"vmkv"`` style (or before the style is known): the new states unchanged;
        the ``"vmkv"`` attention writes them. Inside a compiled forward a prepared step writes
        through device positions (``vmkv.hf.compiled``); anything else runs this eagerly at a
        graph break, with one warning.

        Raises:
            InvalidShape: the batch changed without ``reorder_cache``/``batch_*``, or a reset
                cache is used with K/V of another shape.
            InvalidConfig: paged mode with the model's own attention.
            CacheClosed: the cache was closed.
            SequenceTooLong, OutOfPages, NoFreeSlot: from the core cache.
        """
        if torch.compiler.is_compiling():
            return self._compiled_update(key_states, value_states, layer_idx, args, kwargs)
        return self._eager_update(key_states, value_states, layer_idx, *args, **kwargs)

    def _compiled_update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                         args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``update`` as dynamo traces it: a prepared step writes through device positions
        (``CompiledSteps.update``); anything else runs eagerly at a graph break, with one warning."""
        compiled = self._compiled
        if compiled is None:
            return eager_update(self, key_states, value_states, layer_idx, args, kwargs)
        live = compiled.begin_forward() if layer_idx == 0 else compiled.live
        if not live:
            return eager_update(self, key_states, value_states, layer_idx, args, kwargs)
        return compiled.update(layer_idx, key_states, value_states)

    def _eager_update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``update`` outside a compiled region (see :meth:`update`)."""
        step, compiled = self._step, self._compiled
        if (step is not None and step.dense and self._last_layer < layer_idx < len(self.layers)
                and (compiled is None or not compiled.armed)):
            # "model" style, a later layer of this forward: the step's plan is known (the lean path
            # of a decode step; core.write_batch still checks the tensors, plan and layer)
            self._last_layer = layer_idx
            if not step.gathered and compiled is None:
                return self._shared.core.write_batch(layer_idx, key_states, value_states, step.plan)
            return self._write_and_view(layer_idx, key_states, value_states)
        if self._closed:
            raise CacheClosed("this VirtualCache was closed; make a new one")
        attn_kwargs = attention_kwargs(kwargs)
        if attn_kwargs is not None:
            attn_kwargs["vmkv_cache"] = self  # how the "vmkv" attention finds this cache (5.24)
        if len(self.layers) <= layer_idx:
            self.layers = self._make_layers(layer_idx + 1)
        batch, _, q_len, _ = key_states.shape
        if layer_idx <= self._last_layer or self._last_layer < 0:
            self._start_forward(batch)
        self._last_layer = layer_idx
        if self.attention_style != "model":
            HANDOFF.give(self, key_states, layer_idx)  # how it finds it otherwise (5.19, GPT-NeoX)
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

        ``(None, None)`` before the first forward. See :meth:`layer_states` for when they are
        views and when copies.
        """
        return self.layer_states(layer, 0), self.layer_states(layer, 1)

    def layer_states(self, layer: int, part: int) -> torch.Tensor | None:
        """``layer``'s keys (``part=0``) or values (``part=1``) as ``[B, kv_heads, columns, head_dim]``.

        A zero-copy view of the stored K/V wherever they have that layout: VMM mode, every column
        stored, rows in slots of arithmetic order. Elsewhere a **copy** (counted in
        ``stats()["materialised_kv"]``, logged once): paged mode (K/V live in blocks), the
        ``"vmkv"`` attention on a padded batch (padding columns are not stored: they read zeros),
        rows out of slot order after a beam reorder. Rows are in batch order either way; a copy
        does not follow later steps (read it again). ``None`` before the first forward.

        Raises:
            InvalidInput: no such layer.
        """
        if self._pending:
            return self._pending[layer][part] if layer < len(self._pending) else None
        if not self._rows:
            return None
        if self.mode == "vmm" and not any(self._dropped):
            rows = slot_slice([self.core.slot(seq_id) for seq_id in self._rows])
            if rows is not None:
                return self._shared.dense_views(as_layer(layer, self.core.config.num_layers))[part][rows, :, : self._columns]
        return self._materialise(layer, part)

    def _materialise(self, layer: int, part: int) -> torch.Tensor:
        """A new ``[B, kv_heads, columns, head_dim]`` tensor of ``layer``'s K or V, row by row
        (``core.kv``), the columns no row stores (padding, "vmkv" attention) left zero."""
        self.counters["materialised_kv"] += 1
        if self.counters["materialised_kv"] == 1:
            log.info("vmkv.hf: cache.layers[i].keys/.values have no zero-copy view here (%s mode, %s); "
                     "they are materialised copies", self.mode, "padding not stored" if any(self._dropped) else
                     "rows out of slot order" if self.mode == "vmm" else "K/V in blocks")
        rows = [self.core.kv(seq_id, layer)[part] for seq_id in self._rows]  # each [stored, H, D]
        _, heads, dim = rows[0].shape
        out = rows[0].new_zeros(len(rows), heads, self._columns, dim)
        for row, states in enumerate(rows):
            dropped = self._dropped[row]
            if not dropped:
                out[row, :, : states.shape[0]] = states.transpose(0, 1)
                continue
            gone = set(dropped)
            columns = torch.tensor([c for c in range(self._columns) if c not in gone], device=out.device)
            out[row, :, columns] = states.transpose(0, 1)
        return out

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` columns of every row (``truncate``; 0 is a no-op).

        Raises:
            InvalidInput: not an int, a positive value (transformers' legacy absolute form is not
                supported) or more columns than stored.
        """
        tokens_to_remove = as_int(tokens_to_remove, "crop's tokens_to_remove (a negative number)", minimum=None)
        if tokens_to_remove > 0:
            raise InvalidInput("crop takes a negative number of tokens to remove")
        keep = self.get_seq_length() + tokens_to_remove
        if keep < 0:
            raise InvalidInput(f"cannot crop {-tokens_to_remove} of {self.get_seq_length()} tokens")
        if tokens_to_remove == 0:
            return
        self._disarm()
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
        if self._compiled is not None:
            self._compiled.disarm()
            COMPILED_STEP.release(self._compiled)
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
        COMPILED_STEP.release(self._compiled)
        self._rows, self._dropped, self._pending, self._step = [], [], [], None
        if shared is None:
            return
        if shared.users == 1:  # the last user: closing the core drops every row at once
            shared.users = 0
            shared.core.close()
            return
        try:
            shared.reap()
            for seq_id in rows:
                shared.core.free(seq_id)
        finally:
            shared.users -= 1

    def __del__(self) -> None:
        shared = getattr(self, "_shared", None)
        if shared is not None:
            self._shared = None
            try:
                shared.retire(self._rows)
            except Exception:  # noqa: BLE001 - interpreter shutdown: modules may be gone already
                pass



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
        consecutive slots, so the views had to be gathered: a copy), ``materialised_kv`` (reads of
        ``layers[i].keys``/``.values`` that had no view and returned a copy), ``row_forks``/``row_frees``
        and ``row_retargets`` (rows reorder_cache rewrote in place, see ``_remap_rows``), ``layout``
        (VMM layout, ``"blocks"`` in paged mode; ``None`` before the first forward),
        ``layout_reason`` (``"given"``, or why the default chose it: ``sizing.choose_layout``),
        ``compiled_steps`` (``compile=True``: steps prepared at the eager point) and
        ``compile_fallbacks`` (``update`` calls a compiled forward ran eagerly at a graph break).
        """
        stats = self.core.stats() if self.core is not None else {"mode": self.mode}
        choice = self._shared.choice if self._shared is not None else None
        stats.update(
            layout=choice.layout if choice else None, layout_reason=choice.reason if choice else None,
            rows=len(self._rows), columns=self.get_seq_length(), attention_style=self.attention_style,
            peak_bytes=self.peak_bytes, gathered_views=self.counters["gathered_views"],
            materialised_kv=self.counters["materialised_kv"],
            row_forks=self.counters["row_forks"], row_frees=self.counters["row_frees"],
            row_retargets=self.counters["row_retargets"],
            compiled_steps=self.counters["compiled_steps"],
            compile_fallbacks=self.counters["compile_fallbacks"],
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
            InvalidConfig: ``compile=True`` with ``map_ahead`` on CUDA (``compiled.check_map_ahead``).
        """
        check_map_ahead(self._compile, self._options.map_ahead, like.device)
        if self._shared is None:
            self._shared = SharedCore(*open_core(self.mode, self._options, like, num_layers, self.attention_style))
        if self._compile and self._compiled is None:
            self._compiled = compiled_steps(self._shared.core, self._options.max_seq_len,
                                            ragged=self.attention_style == ATTN_IMPLEMENTATION, paged=self.mode == "paged")
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
        """The first layer of a forward; its plan is built lazily (the columns count once it exists),
        unless a step was prepared at the eager point (``compile=True``): the forward writes that one."""
        if self._compiled is not None and self._compiled.disarm():  # eager: writes the prepared step
            return
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

    def _eager_point(self, q_len: int) -> None:
        """Eager, before a forward of ``q_len`` tokens over this cache (and before the model makes
        its mask): a compiled step is committed (:meth:`_arm`), and ``COMPILED_STEP`` says whether
        the forward is a prepared ragged step (the ``"vmkv"`` mask and attention read it)."""
        if self._compile:
            self._arm(q_len)
        compiled = self._compiled
        COMPILED_STEP.steps = compiled if compiled is not None and compiled.ragged and compiled.armed else None

    def _arm(self, q_len: int) -> None:
        """The eager point of a compiled step (see :meth:`prepare_step`). A ragged cache (the
        ``"vmkv"`` attention) compiles decode steps only: a forward of several new tokens over kept
        rows (generate() continuing a conversation) runs eagerly, dropping its padding."""
        if self._closed:
            raise CacheClosed("this VirtualCache was closed; make a new one")
        compiled = self._compiled
        if compiled is None or compiled.armed or not self._rows or (compiled.ragged and q_len != 1):
            return
        self._shared.reap()
        columns = self._columns
        if compiled.ragged:
            self._step = self._begin_ragged_step(None, len(self._rows), q_len)
            compiled.follow(self._step.plan)
        else:
            self._step = self._begin_dense_step(q_len)
        compiled.arm(self._step.plan, columns)
        self.counters["compiled_steps"] += 1

    def _disarm(self) -> None:
        """Roll back a step prepared at the eager point that no forward wrote (before a row
        operation, ``crop`` or ``reset``): its columns were never written."""
        if self._compiled is None or not self._compiled.disarm():
            return
        q_len = self._step.plan.q_lens[0]
        for seq_id in self._rows:
            self.core.truncate(seq_id, self.core.seq_len(seq_id) - q_len)
        self._columns -= q_len
        self._step = None

    def _begin_dense_step(self, q_len: int) -> _Step:
        """"model" style: every row stores all ``q_len`` new columns."""
        plan = self.core.begin_step(dict.fromkeys(self._rows, q_len))
        self._columns += q_len
        self._note_peak()
        last = self._last_slots
        if last is None or last[0] is not plan.slots:  # a decode fast-path plan shares its slots tuple
            self._last_slots = last = (plan.slots, slot_slice(plan.slots) is None)
            if self._compiled is not None:
                self._compiled.follow(plan)
        return _Step(plan, None, dense=True, gathered=last[1])

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
        if q_len == 1:  # decode: no transpose needed (one reshape, a view of a contiguous tensor)
            return states.reshape(batch, heads, dim).contiguous()
        return states.transpose(1, 2).reshape(batch * q_len, heads, dim).contiguous()

    def _write_and_view(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """"model" style: write, then return ``[B, H, columns, D]`` views of the virtual tensors."""
        step = self._step
        keys, values = self.core.write_batch(layer, k, v, step.plan)
        if self._compiled is not None:
            return self._compiled.views(layer)  # [B, H, max_seq_len, D], as the compiled forward's
        if not step.gathered:
            return keys, values  # views of the virtual tensors
        self.counters["gathered_views"] += 1  # rows not in arithmetic slot order: one copy
        if self.counters["gathered_views"] == 1:
            log.info("vmkv.hf: rows are not in consecutive slots (beam reorder); views are gathered (a copy). "
                     "attn_implementation='vmkv' avoids this")
        return keys, values

    def attend(
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
