"""The rows of a ``VirtualCache``: batch rows as core sequence ids (:class:`RowTable`). Beams,
``batch_*`` and deep copies become ``free`` + ``fork`` (or a retarget), sharing pages instead of
copying K/V.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter, deque

import torch

from ..core.base import KVCacheBase
from ..core.step import slot_slice
from ..errors import InvalidInput, InvalidShape, NoFreeSlot
from ..validate import as_layer, is_int
from .options import LayoutChoice

log = logging.getLogger("vmkv")


class SharedCore:
    """A core cache and the ``VirtualCache`` objects over it. Sequence ids come from here, so copies
    never collide; the core closes with its last user. Rows of a copy dropped without ``close()``
    are freed at the next forward (``reap``), never from the garbage collector mid-forward.
    """

    def __init__(self, core: KVCacheBase, choice: LayoutChoice) -> None:
        self.core = core
        self.choice = choice  # the layout it opened with, and why
        self._views: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # see dense_views
        self.users = 1
        self._ids = itertools.count()
        self._orphans: deque[int] = deque()

    def dense_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s whole K and V as ``[max_batch, kv_heads, max_seq_len, head_dim]`` views (made once)."""
        if self._views is None:
            self._views = [tuple(t.transpose(1, 2) for t in self.core.kv_cache(i)) for i in range(self.core.config.num_layers)]
        return self._views[layer]

    def new_id(self) -> int:
        return next(self._ids)

    def check_geometry(self, like: torch.Tensor, num_layers: int | None) -> None:
        """Raise ``InvalidShape`` unless the core stores K/V shaped like ``like`` (``[B, H, S, D]``)."""
        config = self.core.config
        _, heads, _, head_dim = like.shape
        want = dict(num_layers=num_layers or config.num_layers, num_kv_heads=heads, head_dim=head_dim,
                    dtype=like.dtype, device=like.device)
        have = {name: getattr(config, name) for name in want}
        if want != have:
            raise InvalidShape(f"this cache holds K/V with {have} but the model gives {want}; "
                               "a reset cache keeps its geometry: use a new VirtualCache for another model")

    def leave(self, rows: list[int]) -> None:
        """A user closes: free its ``rows``, or close the core if it was the last user."""
        if self.users == 1:  # the last user: closing the core drops every row at once
            self.users = 0
            self.core.close()
            return
        try:
            self.reap()
            for seq_id in rows:
                self.core.free(seq_id)
        finally:
            self.users -= 1

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


class RowTable:
    """The batch rows of one ``VirtualCache`` over a :class:`SharedCore`.

    Attributes:
        seq_ids: the core's sequence id of each batch row (empty before the first forward).
        dropped: per row, the columns not stored (the ``"vmkv"`` attention drops padding).
        columns: tokens per row as transformers counts them (padding included), committed.
        counters: ``row_forks``, ``row_frees``, ``row_retargets``, ``materialised_kv``.
    """

    def __init__(self, counters: Counter[str]) -> None:
        self.seq_ids: list[int] = []
        self.dropped: list[list[int]] = []
        self.columns = 0
        self.counters = counters

    def open(self, shared: SharedCore, batch: int) -> None:
        """Start a row per batch row.

        Raises:
            NoFreeSlot: more rows than free slots (nothing changed).
        """
        core = shared.core
        free = core.config.max_batch_size - len(core)
        if batch > free:
            raise NoFreeSlot(f"a batch of {batch} rows does not fit the {free} free slots "
                             f"(max_batch_size={core.config.max_batch_size}); raise it")
        self.seq_ids = []
        for _ in range(batch):
            seq_id = shared.new_id()
            core.add(seq_id)
            self.seq_ids.append(seq_id)
        self.dropped = [[] for _ in range(batch)]

    def clear(self) -> None:
        self.seq_ids, self.dropped, self.columns = [], [], 0

    def index_list(self, index: torch.Tensor | list[int], rows: int) -> list[int]:
        """``index`` (a tensor or a sequence of row indexes) as a list of ints.

        Raises:
            InvalidInput: neither, or an index that is not an int in ``0 .. rows - 1``.
        """
        if isinstance(index, torch.Tensor):
            values = index.reshape(-1).tolist()
        elif isinstance(index, (str, bytes)) or not hasattr(index, "__iter__"):
            raise InvalidInput(f"row indexes must be a tensor or a sequence of ints, got {type(index).__name__}")
        else:
            values = list(index)
        if not all(is_int(i, 0) and i < rows for i in values):
            raise InvalidInput(f"row indexes must be ints in 0..{rows - 1}, got {values}")
        return values

    def crop(self, core: KVCacheBase, keep: int) -> None:
        """Keep the first ``keep`` columns of every row (``truncate``), once every row would take it.

        Raises:
            InvalidInput: a row's sliding window let go of what the crop needs (nothing changed).
        """
        dropped = [[c for c in columns if c < keep] for columns in self.dropped]
        for seq_id, gone in zip(self.seq_ids, dropped):
            core.check_truncate(seq_id, keep - len(gone))
        for seq_id, gone in zip(self.seq_ids, dropped):
            core.truncate(seq_id, keep - len(gone))
        self.dropped, self.columns = dropped, keep

    # ---- reading back (cache.layers[i].keys / .values) -----------------------------------------
    def states(self, shared: SharedCore, layer: int, part: int) -> torch.Tensor:
        """``layer``'s keys (``part=0``) or values as ``[B, kv_heads, columns, head_dim]``: a view where the
        stored layout allows, else a copy.

        Raises:
            InvalidInput: no such layer.
        """
        core = shared.core
        if core.mode == "vmm" and not any(self.dropped):
            rows = slot_slice([core.slot(seq_id) for seq_id in self.seq_ids])
            if rows is not None:
                return shared.dense_views(as_layer(layer, core.config.num_layers))[part][rows, :, : self.columns]
        return self._materialise(core, layer, part)

    def _materialise(self, core: KVCacheBase, layer: int, part: int) -> torch.Tensor:
        """A new tensor of ``layer``'s K or V, row by row, the columns no row stores left zero."""
        self.counters["materialised_kv"] += 1
        if self.counters["materialised_kv"] == 1:
            log.info("vmkv.hf: cache.layers[i].keys/.values have no zero-copy view here (%s mode, %s); "
                     "they are materialised copies", core.mode, "padding not stored" if any(self.dropped) else
                     "rows out of slot order" if core.mode == "vmm" else "K/V in blocks")
        rows = [core.kv(seq_id, layer)[part] for seq_id in self.seq_ids]  # each [stored, H, D]
        _, heads, dim = rows[0].shape
        out = rows[0].new_zeros(len(rows), heads, self.columns, dim)
        for row, states in enumerate(rows):
            dropped = self.dropped[row]
            if not dropped:
                out[row, :, : states.shape[0]] = states.transpose(0, 1)
                continue
            gone = set(dropped)
            columns = torch.tensor([c for c in range(self.columns) if c not in gone], device=out.device)
            out[row, :, columns] = states.transpose(0, 1)
        return out

    # ---- row operations ------------------------------------------------------------------------
    def fork_all(self, shared: SharedCore, counters: Counter[str]) -> "RowTable":
        """A table whose rows are forks of these (a deep copy; no K/V copied).

        Raises:
            NoFreeSlot: the forks do not fit the free slots (nothing changed).
        """
        core = shared.core
        if len(core) + len(self.seq_ids) > core.config.max_batch_size:
            raise NoFreeSlot(f"a copy of {len(self.seq_ids)} rows needs as many free slots; "
                             f"{core.config.max_batch_size - len(core)} of max_batch_size="
                             f"{core.config.max_batch_size} are free")
        clone = RowTable(counters)
        clone.dropped, clone.columns = [list(d) for d in self.dropped], self.columns
        for seq_id in self.seq_ids:
            new_id = shared.new_id()
            core.fork(seq_id, new_id)
            clone.seq_ids.append(new_id)
        return clone

    def remap(self, shared: SharedCore, sources: list[int]) -> None:
        """New row ``i`` continues old row ``sources[i]``.

        One new row takes each old row over; every other gets a copy by retarget (VMM: an unused old row
        sharing all the source's full pages is truncated and given its last tokens) or by fork. The rows
        must fit the slots left; a failure after an unused row was lost frees every row and says so.

        Raises:
            NoFreeSlot: the new rows do not fit the slots the other users of the core leave
                (nothing changed).
        """
        if not self.seq_ids:
            return
        core = shared.core
        limit = core.config.max_batch_size
        free = limit - (len(core) - len(self.seq_ids))  # slots this cache may fill: others keep theirs
        if len(sources) > free:
            raise NoFreeSlot(f"{len(sources)} rows need as many slots; {free} of max_batch_size={limit} are "
                             f"not held by deep copies of this cache; raise it or close the copies")
        taker: dict[int, int] = {}
        for new, old in enumerate(sources):
            if old not in taker or new == old:
                taker[old] = new
        unused = [old for old in range(len(self.seq_ids)) if old not in taker]
        rows, dropped, forks, spare = [], [], [], len(unused)
        try:
            for new, old in enumerate(sources):
                if taker[old] == new:
                    rows.append(self.seq_ids[old])
                else:
                    rows.append(self._copy_row(shared, old, unused, forks))
                dropped.append(list(self.dropped[old]))
        except BaseException as exc:
            self._undo_copies(core, forks, len(unused) < spare, exc)
            raise
        for old in unused:
            core.free(self.seq_ids[old])
            self.counters["row_frees"] += 1
        self.seq_ids, self.dropped = rows, dropped

    def _undo_copies(self, core: KVCacheBase, forks: list[int], lost_rows: bool, exc: BaseException) -> None:
        """A row operation failed: free its ``forks``, and every row if unused ones were already lost."""
        for seq_id in forks:
            core.free(seq_id)
        if lost_rows:
            for seq_id in self.seq_ids:
                if seq_id in core:
                    core.free(seq_id)
            self.clear()
            exc.add_note("vmkv.hf: rows freed or rewritten before this failure cannot be restored, "
                         "so every row of this cache was freed: prefill again")

    def _copy_row(self, shared: SharedCore, source: int, unused: list[int], forks: list[int]) -> int:
        """A sequence holding row ``source``'s tokens: a retargeted unused row, else a fork."""
        core = shared.core
        src_id = self.seq_ids[source]
        if core.mode == "vmm" and core.config.window == 0:  # (windowed or grouped: no retarget, a fork)
            src_pages = core.pages(src_id)
            best, shared_pages = None, -1
            for old in unused:
                pages = core.pages(self.seq_ids[old])
                same = next((n for n, (a, b) in enumerate(zip(pages, src_pages)) if a != b), min(len(pages), len(src_pages)))
                if same > shared_pages:
                    best, shared_pages = old, same
            if best is not None and self._can_retarget(core, self.seq_ids[best], src_id, shared_pages):
                unused.remove(best)  # before the row changes: a failure must know it is gone
                self._retarget(core, self.seq_ids[best], src_id, shared_pages)
                return self.seq_ids[best]
        seq_id = shared.new_id()
        if len(core) >= core.config.max_batch_size and unused:  # make a slot first
            core.free(self.seq_ids[unused.pop()])
            self.counters["row_frees"] += 1
        core.fork(src_id, seq_id)
        forks.append(seq_id)
        self.counters["row_forks"] += 1
        return seq_id

    @staticmethod
    def _retarget_keep(core: KVCacheBase, seq_id: int, src_id: int, shared_pages: int) -> int:
        """Tokens ``seq_id`` keeps when it becomes a copy of ``src_id`` (they share ``shared_pages``)."""
        return min(shared_pages * core.tokens_per_page, core.seq_len(src_id), core.seq_len(seq_id))

    def _can_retarget(self, core: KVCacheBase, seq_id: int, src_id: int, shared_pages: int) -> bool:
        """Whether ``seq_id`` shares every full page of ``src_id``."""
        tpp = core.tokens_per_page
        return self._retarget_keep(core, seq_id, src_id, shared_pages) >= core.seq_len(src_id) // tpp * tpp

    def _retarget(self, core: KVCacheBase, seq_id: int, src_id: int, shared_pages: int) -> None:
        """Make ``seq_id`` a copy of ``src_id``: truncate it and write the source's last tokens."""
        length = core.seq_len(src_id)
        keep = self._retarget_keep(core, seq_id, src_id, shared_pages)
        core.truncate(seq_id, keep)
        if length > keep:
            plan = core.begin_step({seq_id: length - keep})
            for layer in range(core.config.num_layers):
                k, v = core.kv(src_id, layer)  # [length, H, D], views of the same storage:
                core.write(layer, k[keep:].clone(), v[keep:].clone(), plan)  # torch refuses aliasing
        self.counters["row_retargets"] += 1

