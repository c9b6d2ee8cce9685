"""When pages are mapped: at the eager point of each step, and ahead of need on a background
thread (``config.map_ahead``, VMM mode).

**The eager point** is ``begin_step``: it maps (and copies on write) every page the step will
write, before any kernel of the step runs. Compiled and captured steps rely on it: a compiled
transformers forward (``vmkv.hf.compiled``) or a replayed CUDA graph (``vmkv.engine.graphs``)
cannot map a page, so their eager point (``VirtualCache.get_mask_sizes`` / ``prepare_step``, the
engine's step before a replay) calls ``begin_step`` first and the graph only writes rows that are
mapped and owned by the step. Nothing is ever mapped inside a compiled or captured region.

**Mapping ahead** overlaps the system calls of the *next* step's new pages with this step's
compute (vAttention maps the next step's pages this way): after each ``begin_step``, every
sequence of the step whose room runs out if its next step is as long as this one (a decode
crossing a page boundary) gets one more page on the worker thread. Every cache call first waits
for the worker (:meth:`MapAhead.join`), so the worker never runs beside a call that changes
pages; ``write`` and ``attention`` do not wait (they touch no page the worker maps: it maps past
every sequence's length). Two rules keep the worker safe beside kernels (:func:`background_safe`):

* a new page replaces the zero page at its address. On the host that is one atomic ``mmap``;
  on CUDA it is an unmap then a map, and a kernel reading that address in between faults. So on
  CUDA the worker may run only while every kernel reads no further than each sequence's length
  (the varlen and Triton kernels, which read lengths from the device), never beside the model's
  own attention over full-length views (``VirtualCache(compile=True)``: that reads the zero pages
  past each row, and is refused with ``map_ahead``).
* a mapping synchronizes the device first, which no thread may do while another captures a CUDA
  graph: the graphs wait for the worker before a capture (``cache.wait_for_mapping()``).
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

from .sequence import LiveSequence

log = logging.getLogger("vmkv")


def background_safe(device_type: str, reads_past_length: bool) -> bool:
    """Whether pages may be mapped on the worker thread while kernels run (module docstring):
    always on the host, on CUDA only if no kernel reads past a sequence's length."""
    return device_type != "cuda" or not reads_past_length


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
