"""The ``transformers.Cache`` backed by vmkv: :class:`VirtualCache`, a face over the core cache
(:class:`~vmkv.hf.rows.SharedCore`), its rows (:class:`~vmkv.hf.rows.RowTable`), the forward
styles (:mod:`vmkv.hf.forward`) and the compiled step (:class:`~vmkv.hf.compiled.CompiledStep`).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch

from ..config import check_mode
from ..core.base import KVCacheBase
from ..errors import CacheClosed, InvalidConfig, InvalidInput, InvalidShape, Unsupported
from ..validate import as_int
from .attention import ATTN_IMPLEMENTATION, HANDOFF, LayerVariant
from .compat import Cache, attention_kwargs
from .compiled import (
    FALLBACK_NOT_COMPILEABLE,
    CompiledStep,
    check_compile,
    check_map_ahead,
    eager_update,
)
from .forward import DenseWrites, Forward, RaggedWrites, note_peak, pack
from .layer import VirtualLayer
from .options import CacheOptions, ModelFacts, open_core
from .rows import RowTable, SharedCore

log = logging.getLogger("vmkv")

STATS = ("peak_bytes", "gathered_views", "materialised_kv", "row_forks", "row_frees", "row_retargets", "compiled_steps",
         "eager_steps", "compile_fallbacks")  # the adapter's counters stats() reports (docs/hf.md)
_NO_LINEAR_ATTENTION = "a VirtualCache holds attention K/V only; linear-attention (Mamba-style) states are not supported"


def _refusal(why: str) -> Any:
    """A method that raises ``Unsupported(why)``: what a ``VirtualCache`` does not do."""

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise Unsupported(why)

    return refuse


def _check_style_fits_mode(mode: str, style: str | None) -> None:
    """Raise ``InvalidConfig`` for paged mode under the model's own attention (it reads contiguous K/V)."""
    if mode == "paged" and style == "model":
        raise InvalidConfig("paged mode needs the model loaded with attn_implementation='vmkv' (import vmkv.hf first): "
                            "stock kernels read contiguous K/V, which paged mode does not have")


class VirtualCache(Cache):
    """A ``transformers.Cache`` whose K/V live in a vmkv cache (VMM or paged mode).

    Args:
        mode: ``"vmm"`` (virtually contiguous tensors, stock kernels) or ``"paged"`` (block
            tables; needs ``attn_implementation="vmkv"``).
        config: the model config (optional): the layer count and attention style up front.
        max_batch_size, max_seq_len, memory_budget, page_size, layout, block_size,
            deferred_reclaim, map_ahead, window_slack: the core cache's (docs/hf.md, "Sizing").
        compile: transformers' compiled generation over pages; needs ``config`` and ``max_seq_len``.

    Raises:
        InvalidConfig: a bad option, paged mode with the model's own attention, a model whose
            cache is not K/V, or ``compile=True`` without what it needs.

    Threads: one thread at a time per cache; caches of other threads are independent.
    """

    def __init__(
        self, mode: str = "vmm", *, config: Any = None, max_batch_size: int | None = None,
        max_seq_len: int | None = None, memory_budget: int | str | None = None, page_size: int | str | None = None,
        layout: str | None = None, block_size: int = 16, deferred_reclaim: bool = False, map_ahead: bool = False,
        window_slack: int | None = None, compile: bool = False,
    ) -> None:
        check_mode(mode)
        super().__init__(layers=[])
        self.mode = mode
        self._options = CacheOptions(max_batch_size, max_seq_len, memory_budget, page_size, layout, block_size,
                                     deferred_reclaim, map_ahead, window_slack)
        self._model = ModelFacts.of(config)
        self.attention_style: str | None = self._model.style  # "model" | "vmkv"; None until known
        _check_style_fits_mode(self.mode, self.attention_style)
        self._compile = check_compile(compile, config, max_seq_len)
        self.counters: Counter[str] = Counter()
        self._use(RowTable(self.counters))
        self._shared: SharedCore | None = None
        self._compiled: CompiledStep | None = None  # compile=True: made with the core
        self._closed = False
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # first forward, style unknown
        self._forward: Forward | None = None  # the eager forward in progress
        self._last_layer = -1
        if self._model.num_layers:  # each layer's face up front: transformers reads is_sliding before a forward
            self.layers = [VirtualLayer(self, i) for i in range(self._model.num_layers)]

    @property
    def core(self) -> KVCacheBase | None:
        """The vmkv cache holding the pages (shared with deep copies), or ``None`` before the first forward."""
        return self._shared.core if self._shared is not None else None

    @property
    def peak_bytes(self) -> int:
        """The most pool bytes in use after any step of this cache."""
        return self.counters["peak_bytes"]

    @property
    def rows(self) -> list[Any]:
        """The core cache's sequence id of each batch row (read ``core.kv(seq_id, layer)``)."""
        return list(self._table.seq_ids)

    # ---- what transformers asks ----------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        """Columns seen before the coming forward (padding included, as ``DynamicCache``); inside a
        compiled forward a 0-d device tensor, so the graph does not depend on it.
        """
        compiled = self._compiled
        if compiled is not None and (compiled.armed or compiled.live) and torch.compiler.is_compiling():
            return compiled.start
        done = compiled.q_len if compiled is not None and compiled.done else 0
        return self._table.columns + done + (self._pending[0][0].shape[2] if self._pending else 0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)``; with ``compile=True`` ``max_seq_len``, and an eager call is the
        step's eager point (:meth:`prepare_step`).
        """
        if self._compile and not torch.compiler.is_compiling():
            self._prepare(query_length, explicit=False)
        if self._compile:
            return self._options.max_seq_len, 0
        past, window = self.get_seq_length(), self._model.window(layer_idx)
        offset = max(past - window + 1, 0) if window and self.attention_style == "model" else 0  # its window's views
        return past + query_length - offset, offset

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1: no fixed length (the cache grows page by page); with ``compile=True`` ``max_seq_len``."""
        return self._options.max_seq_len if self._compile else -1

    @property
    def is_compileable(self) -> bool:
        """Whether transformers may compile a forward over this cache (``compile=True``)."""
        return self._compile

    @property
    def is_initialized(self) -> bool:
        return bool(self._table.seq_ids) or bool(self._pending)

    @property
    def batch_size(self) -> int:
        return self._num_rows() if self.is_initialized else -1

    def prepare_step(self, q_len: int = 1) -> None:
        """The eager point of a compiled step: the next ``q_len`` columns of every row begun undoably and
        loaded into the static step; committed once a forward wrote every layer, else cancelled.

        Raises:
            InvalidConfig: the cache was not made with ``compile=True``.
            InvalidInput: ``q_len`` is not a positive int, or not 1 with the ``"vmkv"`` attention.
            CacheClosed, SequenceTooLong, OutOfPages: from the core cache (nothing changed).
        """
        if not self._compile:
            raise InvalidConfig("prepare_step is the eager point of VirtualCache(compile=True); this cache "
                                "runs eagerly and needs none")
        q_len = as_int(q_len, "q_len", minimum=1)
        if q_len != 1 and self.attention_style == ATTN_IMPLEMENTATION:
            raise InvalidInput(f"a compiled step of the 'vmkv' attention decodes one token per row, got q_len={q_len}; "
                               "run a forward of several tokens eagerly (it drops its padding)")
        self._prepare(q_len, explicit=True)

    def _prepare(self, q_len: int, explicit: bool) -> None:
        """:meth:`prepare_step` after its checks (``explicit``: called by the user, between forwards)."""
        if self._closed:
            raise CacheClosed("this VirtualCache was closed; make a new one")
        compiled = self._compiled
        if compiled is None or not self._table.seq_ids or compiled.waiting(q_len):
            return
        if compiled.live and not explicit:  # inside an eager forward (a model asking its mask sizes)
            return
        self._settle()
        if not compiled.ragged or q_len == 1:  # (a prompt over kept ragged rows runs eagerly, dropping its padding)
            self._shared.reap()
            compiled.begin(self.core, self._table.seq_ids, q_len, self._table.columns)
            note_peak(self.core, self.counters)

    def _settle(self, cancel_unwritten: bool = True) -> None:
        """Commit the compiled step a forward wrote, or cancel one no forward wrote (unless ``cancel_unwritten`` is False)."""
        if self._compiled is not None:
            self._table.columns += self._compiled.resolve(self.core, self.counters, cancel_unwritten)

    # ---- update: what a layer writes and gets back ----------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new K/V ``[B, kv_heads, S, head_dim]``; return views of every stored token
        (``"model"`` style) or the new states (``"vmkv"``: its attention writes them).

        Raises:
            InvalidShape (a changed batch), InvalidConfig, CacheClosed, SequenceTooLong, OutOfPages,
            NoFreeSlot.
        """
        if torch.compiler.is_compiling():
            if self._compiled is None:
                return eager_update(self, key_states, value_states, layer_idx, args, kwargs, FALLBACK_NOT_COMPILEABLE)
            return self._compiled.traced_update(self, key_states, value_states, layer_idx, args, kwargs)
        return self._eager_update(key_states, value_states, layer_idx, *args, **kwargs)

    def _eager_update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``update`` outside a compiled region (see :meth:`update`)."""
        forward = self._forward  # "model" style, a later layer of this forward: the lean path of a decode step
        if forward is not None and not forward.gathered and self._compiled is None and self.attention_style == "model" \
                and self._model.windows is None and self._last_layer < layer_idx < len(self.layers):
            self._last_layer = layer_idx
            return self._shared.core.write_batch(layer_idx, key_states, value_states, forward.plan)
        if self._closed:
            raise CacheClosed("this VirtualCache was closed; make a new one")
        if key_states.shape != value_states.shape:
            raise InvalidConfig(f"keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} differ in shape "
                                "(a latent KV, as multi-head latent attention caches): a VirtualCache holds K and V of one shape")
        attn_kwargs = attention_kwargs(kwargs)
        if attn_kwargs is not None:
            attn_kwargs["vmkv_cache"] = self  # how the "vmkv" attention finds this cache (5.24)
        if len(self.layers) <= layer_idx:
            self.layers = self.layers + [VirtualLayer(self, i) for i in range(len(self.layers), layer_idx + 1)]
        if layer_idx <= self._last_layer or self._last_layer < 0:
            self._start_forward(key_states)
        self._last_layer = layer_idx
        if self.attention_style != "model":
            HANDOFF.give(self, key_states, layer_idx)  # how it finds it otherwise (5.19, GPT-NeoX)
        if self.attention_style == "vmkv":
            return key_states, value_states
        if self.attention_style is None:  # first forward: no past to add, and the style is unknown
            if self._shared is not None and not self._pending:  # reset: the core is open already
                self._shared.check_geometry(key_states, None)
            self._pending.append((key_states, value_states))
            return key_states, value_states
        if not self._table.seq_ids:
            self._open_rows(key_states, self._model.num_layers)
        if self._forward is None:
            self._forward = self._dense.begin(self.core, key_states.shape[2], self._compiled)
        return self._dense.write(self.core, layer_idx, key_states, value_states, self._forward, self._compiled,
                                 self._model.window(layer_idx))

    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        mask: torch.Tensor | None, scaling: float | None, variant: LayerVariant,
    ) -> torch.Tensor:
        """"vmkv" style, one layer eagerly: write the real new tokens and run the cache's kernel.

        Shapes: ``query: [B, Hq, S, D]``, ``key, value: [B, Hkv, S, D]``; returns ``[B, S, Hq, D]``.

        Raises:
            InvalidConfig: the layer's window is not the one the cache holds it with.
        """
        if self.attention_style is None:  # first forward without a config: the attention tells us
            self.attention_style = "vmkv"
            self._pending = []
        layer = module.layer_idx
        if variant.window != self._model.window(layer):
            raise InvalidConfig(f"layer {layer} attends over a sliding window of {variant.window} tokens, but this "
                                f"VirtualCache holds it with a window of {self._model.window(layer)}: make the cache with "
                                "config=model.config, which says each layer's window")
        if not self._table.seq_ids:
            features = ("softcap",) * bool(variant.softcap) + ("sinks",) * (variant.sinks is not None)
            self._open_rows(key, self._model.num_layers or module.config.num_hidden_layers, features)
        if self._forward is None:
            self._forward = self._ragged.begin(self.core, mask, query.shape[0], query.shape[2], self._model.windows)
        return self._ragged.attend(self.core, layer, query, key, value, self._forward, scaling, self._compiled, variant)

    def layer_states(self, layer: int, part: int) -> torch.Tensor | None:
        """``layer``'s keys (``part=0``) or values as ``[B, kv_heads, columns, head_dim]``, ``None`` before the
        first forward; ``InvalidInput``: no such layer.
        """
        if self._pending:
            return self._pending[layer][part] if layer < len(self._pending) else None
        if not self._table.seq_ids:
            return None
        self._settle(cancel_unwritten=False)
        return self._table.states(self._shared, layer, part)

    # ---- changing the rows -------------------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` columns of every row; ``InvalidInput``: not an int,
        positive, or more than stored.
        """
        tokens_to_remove = as_int(tokens_to_remove, "crop's tokens_to_remove (a negative number)", minimum=None)
        if tokens_to_remove > 0:
            raise InvalidInput("crop takes a negative number of tokens to remove")
        keep = self.get_seq_length() + tokens_to_remove
        if keep < 0:
            raise InvalidInput(f"cannot crop {-tokens_to_remove} of {self.get_seq_length()} tokens")
        if tokens_to_remove == 0:
            return
        self._before_row_change()
        self._table.crop(self.core, keep)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` continues old row ``beam_idx[i]``: free unused rows, fork repeated ones (no copy)."""
        self._remap(self._table.index_list(beam_idx, self._num_rows()))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` consecutive rows sharing its pages (``fork``)."""
        repeats = as_int(repeats, "repeats", minimum=1)
        self._remap([row for row in range(self._num_rows()) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices`` (in that order); the others are freed."""
        self._remap(self._table.index_list(indices, self._num_rows()))

    def _remap(self, sources: list[int]) -> None:
        self._before_row_change()
        if self._shared is None:
            return
        try:
            self._table.remap(self._shared, sources)
        except BaseException:
            if not self._table.seq_ids:  # every row was freed by a failure half-way
                self.reset()
            raise

    def __deepcopy__(self, memo: dict[int, Any]) -> "VirtualCache":
        """A cache whose rows are forks of this one's (the core shared, no K/V copied).

        Raises:
            NoFreeSlot: the copy's rows do not fit the free slots (raise ``max_batch_size``).
        """
        self._before_row_change()
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(self.__dict__)
        clone.counters = Counter(self.counters)
        clone.layers = [VirtualLayer(clone, i) for i in range(len(self.layers))]
        clone._shared, clone._compiled, clone._forward, clone._last_layer = None, None, None, -1
        clone._use(RowTable(clone.counters) if self._shared is None else self._table.fork_all(self._shared, clone.counters))
        if self._shared is None:
            return clone
        self._shared.users += 1
        clone._shared = self._shared
        clone._compiled = self._compiled.copy(self.core) if self._compiled is not None else None
        return clone

    def reset(self) -> None:
        """Free every row; the core keeps its geometry for the next forward (any batch up to ``max_batch_size``)."""
        if self._compiled is not None:
            self._settle(cancel_unwritten=False)
            self._compiled.settle()  # a step still waiting: its rows are freed below
        if self._shared is not None:
            self._shared.reap()
            for seq_id in self._table.seq_ids:
                self.core.free(seq_id)
        self._table.clear()
        self._pending, self._forward, self._last_layer = [], None, -1
        self.attention_style = self._model.style

    def close(self) -> None:
        """Free this cache's rows and release the memory once no deep copy uses it; unusable afterwards."""
        shared, rows = self._shared, self._table.seq_ids
        self._shared, self._closed = None, True
        self._table.clear()
        self._pending, self._forward, self._compiled = [], None, None
        if shared is not None:
            shared.leave(rows)

    def __del__(self) -> None:
        shared, self._shared = getattr(self, "_shared", None), None
        try:
            if shared is not None:
                shared.retire(self._table.seq_ids)
        except Exception:  # noqa: BLE001 - interpreter shutdown: modules may be gone already
            pass

    # ---- what a VirtualCache does not do -------------------------------------------------------
    offload = prefetch = _refusal("a VirtualCache does not offload: its pages live in the vmkv pool on the model's device")
    early_initialization = _refusal("a VirtualCache sizes itself at the first forward; it cannot be exported")
    update_conv_state = update_recurrent_state = _refusal(_NO_LINEAR_ATTENTION)
    update_indexer = _refusal("a VirtualCache holds attention K/V only; indexer key caches are not supported")

    # ---- reporting -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The core cache's ``stats()`` plus this adapter's (docs/hf.md, "What stats() says")."""
        self._settle(cancel_unwritten=False)
        stats = self.core.stats() if self.core is not None else {"mode": self.mode}
        choice = self._shared.choice if self._shared is not None else None
        stats.update({name: self.counters[name] for name in STATS})
        return {**stats, "layout": choice.layout if choice else None, "layout_reason": choice.reason if choice else None,
                "rows": len(self._table.seq_ids), "columns": self.get_seq_length(), "attention_style": self.attention_style}

    def __repr__(self) -> str:
        return f"VirtualCache(mode={self.mode!r}, rows={len(self._table.seq_ids)}, columns={self.get_seq_length()})"

    # ---- internals -------------------------------------------------------------------------------
    def _use(self, table: RowTable) -> None:
        self._table, self._dense, self._ragged = table, DenseWrites(table, self.counters), RaggedWrites(table, self.counters)

    def _num_rows(self) -> int:
        return self._pending[0][0].shape[0] if self._pending else len(self._table.seq_ids)

    def _open_rows(self, like: torch.Tensor, num_layers: int | None, features: tuple[str, ...] = ()) -> None:
        """Start a row per batch row of ``like``, opening the core (and compiled step) if needed."""
        check_map_ahead(self._compile, self._options.map_ahead, like.device)
        if self._shared is None:
            self._shared = SharedCore(*open_core(self.mode, self._options, like, num_layers, self.attention_style,
                                                 self._model.windows, features))
        if self._compile and self._compiled is None:
            self._compiled = CompiledStep(self.core, self._options.max_seq_len, ragged=self.attention_style == "vmkv")
        self._shared.reap()
        self._shared.check_geometry(like, num_layers)
        self._table.open(self._shared, like.shape[0])

    def _flush_pending(self) -> None:
        """Write the first forward's K/V (kept by reference while the style was unknown)."""
        if not self._pending:
            return
        self.attention_style = "model"
        _check_style_fits_mode(self.mode, self.attention_style)
        pending, self._pending = self._pending, []
        self._open_rows(pending[0][0], len(pending))
        forward = self._dense.begin(self.core, pending[0][0].shape[2], self._compiled)
        for layer, (k, v) in enumerate(pending):
            self.core.write(layer, pack(k), pack(v), forward.plan)

    def _before_row_change(self) -> None:
        """Before ``crop``, a row operation or a deep copy: settle the compiled step, flush, reap, no plan in flight."""
        self._settle()
        self._flush_pending()
        if self._shared is not None:
            self._shared.reap()
        self._forward = None

    def _start_forward(self, key_states: torch.Tensor) -> None:
        """The first layer of an eager forward: take the prepared compiled step if it fits, else begin a step lazily."""
        compiled = self._compiled
        if compiled is not None and compiled.armed:
            self._forward = Forward.dense(compiled.take_eagerly(self.core, key_states))
            return
        if compiled is not None:
            self._settle()  # a step a failed forward left half-written: cancelled
        if self._shared is not None:
            self._shared.reap()
        if self._pending and self.attention_style != "vmkv":
            self._flush_pending()
        if self._table.seq_ids and key_states.shape[0] != len(self._table.seq_ids):
            raise InvalidShape(
                f"batch of {key_states.shape[0]} rows, but the cache holds {len(self._table.seq_ids)}; use "
                "reorder_cache, batch_select_indices or batch_repeat_interleave to change rows, or cache.reset() "
                "(or a new VirtualCache) to start another batch"
            )
        self._forward = None

