"""The row policy of a ``VirtualCache``: batch rows as sequence ids, and what beams, forks and deep copies do to them.

Batch row ``i`` of the model is sequence ``cache._rows[i]`` of the core cache. Beam search's
``reorder_cache`` and ``batch_repeat_interleave`` / ``batch_select_indices`` become ``free`` +
``fork`` (or a *retarget*, see :meth:`RowPolicy._remap_rows`) of sequence ids, so a beam that
continues another shares its pages (copy-on-write) instead of copying K/V; ``copy.deepcopy``
forks every row into the same core cache (:class:`SharedCore`).

:class:`RowPolicy` is a mixin of ``VirtualCache``: it reads and writes the cache's ``_rows``,
``_dropped``, ``_shared``, ``_pending``, ``_step``, ``_compiled`` and ``counters``, and calls its
``_disarm``, ``_flush_pending``, ``reset`` and ``_make_layers``.
"""

from __future__ import annotations

import copy
import itertools
from collections import deque
from typing import Any

import torch

from ..core.base import KVCacheBase
from ..errors import InvalidInput, NoFreeSlot
from .sizing import Choice


class SharedCore:
    """A core cache and the ``VirtualCache`` objects over it (``copy.deepcopy`` makes more).

    Sequence ids come from here so that copies never collide; the core closes with its last
    user. A copy dropped without ``close()`` leaves its rows here (``retire``): the garbage
    collector may run it in the middle of another copy's forward, whose plan a ``free`` would
    invalidate, so the rows are freed at the next forward or row operation instead (``reap``).
    """

    def __init__(self, core: KVCacheBase, choice: Choice) -> None:
        self.core = core
        self.choice = choice  # the layout it opened with, and why
        self._views: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # see dense_views
        self.users = 1
        self._ids = itertools.count()
        self._orphans: deque[int] = deque()

    def dense_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s whole K and V as ``[max_batch, kv_heads, max_seq_len, head_dim]`` views
        (VMM mode; made once per layer: the ranges stay where they are for the core's life)."""
        if self._views is None:
            self._views = [tuple(t.transpose(1, 2) for t in self.core.kv_cache(i)) for i in range(self.core.config.num_layers)]
        return self._views[layer]

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


class RowPolicy:
    """Row operations of a ``VirtualCache`` (see the module docstring)."""

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

    def __deepcopy__(self, memo: dict[int, Any]) -> "RowPolicy":
        """A cache with the same rows, columns and style whose rows are forks of this cache's rows.

        Both share the core cache (and its page pool): no K/V is copied, and the first write of
        either into a shared page copies that page only (copy-on-write). transformers' prompt
        reuse (prefill once, ``copy.deepcopy`` per question) costs one fork per row.

        Raises:
            NoFreeSlot: the copy's rows do not fit the free slots (raise ``max_batch_size``).
        """
        self._disarm()
        self._flush_pending()
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        own = {"layers", "_shared", "_rows", "_step", "_pending", "_compiled"}
        for name, value in self.__dict__.items():
            if name not in own:
                setattr(clone, name, copy.deepcopy(value, memo))
        clone._step, clone._pending, clone._last_layer = None, [], -1
        clone.layers = []
        clone.layers = clone._make_layers(len(self.layers))
        clone._shared, clone._rows = None, []
        clone._compiled = self._compiled.copy() if self._compiled is not None else None
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

    # ---- internals: rows -----------------------------------------------------------------------
    def _num_rows(self) -> int:
        if self._pending:
            return self._pending[0][0].shape[0]
        return len(self._rows)

    def _as_index_list(self, index: torch.Tensor | list[int]) -> list[int]:
        """``index`` (a tensor or a sequence of row indexes) as a list of ints.

        Raises:
            InvalidInput: neither, or an index that is not an int (a bool is not) in ``0 .. rows - 1``.
        """
        if isinstance(index, torch.Tensor):
            values = index.reshape(-1).tolist()
        elif isinstance(index, (str, bytes)) or not hasattr(index, "__iter__"):
            raise InvalidInput(f"row indexes must be a tensor or a sequence of ints, got {type(index).__name__}")
        else:
            values = list(index)
        rows = self._num_rows()
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < rows for i in values):
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
        self._disarm()
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
