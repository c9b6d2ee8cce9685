"""When pages are mapped: on demand inside ``begin_step`` (always), and ahead of need on a
background thread (``config.map_ahead``, VMM mode).

Mapping ahead overlaps the system calls of the *next* step's new pages with this step's
compute (vAttention maps the next step's pages this way): after each ``begin_step``, every
sequence of the step whose room runs out if its next step is as long as this one (a decode
crossing a page boundary) gets one more page on the worker thread. Every cache call first waits
for the worker (:meth:`MapAhead.join`), so the worker never runs beside a call that changes
pages; ``write`` and ``attention`` do not wait (they touch no page the worker maps: it maps past
every sequence's length).
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

from .sequence import LiveSequence

log = logging.getLogger("vmkv")


class MapAhead:
    """The map-ahead worker of one cache.

    Args:
        grow: maps one more page for a sequence, all or nothing (rolled back on failure).
        covered: how many of the next ``n`` free pages may be mapped now (a shared budget's grants
            may cover fewer; spare and cached pages are left to the next ``begin_step``).
        counters: the cache's counters (``pages_mapped_ahead``, ``map_ahead_errors``).
    """

    def __init__(self, grow: Callable[[LiveSequence], None], covered: Callable[[int], int],
                 counters: Counter[str]) -> None:
        self._grow = grow
        self._covered = covered
        self._counters = counters
        self._pending: Future | None = None
        self._worker: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="vmkv-map-ahead")

    def start(self, steps: Iterable[tuple[LiveSequence, int]], tokens_per_page: int, max_pages: int) -> None:
        """After a step of ``(sequence, new tokens)``: map, in the background, the next page of each
        sequence whose next step of the same length would not fit its pages."""
        due = [seq for seq, count in steps
               if len(seq.pages) * tokens_per_page - seq.length < count and len(seq.pages) < max_pages]
        if due and self._worker is not None:
            self._pending = self._worker.submit(self._map, due)

    def _map(self, due: list[LiveSequence]) -> None:
        """On the worker: one page for each due sequence, each all or nothing."""
        for seq in due[: self._covered(len(due))]:
            self._grow(seq)
            self._counters["pages_mapped_ahead"] += 1

    def join(self) -> None:
        """Wait for the background mapping. A failure there is logged and counted, never
        re-raised: the worker rolled its page back, and the next step maps it itself."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        try:
            pending.result()
        except Exception as exc:  # noqa: BLE001 - reported in stats() and the log
            self._counters["map_ahead_errors"] += 1
            log.warning("vmkv: mapping ahead failed (%s: %s); the next step maps the page itself",
                        type(exc).__name__, exc)

    def close(self) -> None:
        """Finish pending mapping and stop the worker (at the cache's close)."""
        self.join()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
