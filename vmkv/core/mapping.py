"""When pages are mapped: at the eager point of each step, and ahead of need on a background thread
(``config.map_ahead``, VMM mode).

The eager point is ``begin_step``: it maps every page the step writes before any kernel runs;
nothing is ever mapped inside a compiled or captured region. Mapping ahead (as vAttention does)
maps the next page of each sequence about to cross a page boundary on a worker thread; every
cache call but ``write`` and ``attention`` joins the worker first. Two rules keep the worker safe
beside kernels (:func:`background_safe`): on CUDA a new page is an unmap then a map, so it runs
only where kernels read no further than each length; and a mapping synchronizes the device, so
CUDA graph captures wait for it first (``cache.wait_for_mapping()``).
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

from .sequence import LiveSequence

log = logging.getLogger("vmkv")


def background_safe(device_type: str, reads_past_length: bool) -> bool:
    """Whether pages may be mapped on the worker while kernels run: always on the host, on CUDA only if
    no kernel reads past a sequence's length.
    """
    return device_type != "cuda" or not reads_past_length


class MapAhead:
    """The map-ahead worker of one cache.

    Args:
        grow: maps one more page for a sequence, all or nothing.
        covered: how many of the next ``n`` free pages may be mapped now.
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
        """After a step: map in the background the next page of each sequence whose next step of the same
        length would not fit.
        """
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
        """Wait for the background mapping; a failure there is logged and counted, never re-raised (the next
        step maps the page itself).
        """
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
