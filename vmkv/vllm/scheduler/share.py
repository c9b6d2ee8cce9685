"""The vLLM plugin in a host-wide ledger (``shared_budget``): the scheduler side holds the grants.

The member is the engine-core process, which decides every page the workers map; a member page
is one buffer page on every rank. Invariant: ``member.held >= need`` (pages mapped in the
scheduler, plus those of steps built and not finished), so grants are taken before a step maps
and given back only once the step carrying the unmaps finished. Requests from others are served
at the start of ``schedule()``: spare grants first, then whole idle units (hashes removed before
the unmaps). A watcher thread only wakes an idle engine loop with vLLM's ``WAKEUP`` message.
Details: docs/shared-budget.md.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from typing import Any, Callable

from ...errors import OutOfPages
from ...ledger import Member, SharedBudget
from ...share import FAILED_WAIT_S, POLL_S, grant_batch, join

log = logging.getLogger("vmkv")

WAKE_EVERY_S = 0.05
"""While a request is pending, the watcher wakes the engine loop at most this often."""


class EngineShare:
    """One vLLM engine's seat in a ledger.

    Args:
        spec: the parsed ``shared_budget`` setting.
        page_bytes: bytes one buffer page takes over all ranks.
        cap_pages: pages the engine may map at most (its own budget).
        wake: wakes the engine-core loop (``None``: served at the next step the client drives).

    Raises:
        InvalidConfig: no page fits the member's limits; LedgerMismatch/LedgerCorrupt: as
            :class:`vmkv.ledger.Ledger`.
    """

    def __init__(self, spec: SharedBudget, page_bytes: int, cap_pages: int,
                 wake: Callable[[], None] | None) -> None:
        ceiling = cap_pages * page_bytes
        self.ledger, self.member = join(spec, spec.member or f"vllm:{os.getpid()}", page_bytes, ceiling)
        self.max_pages = min(ceiling if spec.max_bytes is None else spec.max_bytes, ceiling, spec.budget) // page_bytes
        self.batch = grant_batch(spec, page_bytes)
        self.wait_s = spec.wait_s
        self.owed = 0  # pages evicted for a request, given back when reclaim_step finished
        self.reclaim_step = 0  # the step carrying those unmaps (0: none pending)
        self._built: deque[tuple[int, int]] = deque()  # (step, pages mapped after it), not finished
        self._finished_pages = 0  # pages the workers map after the last finished step
        self._waited = False  # a wait for others timed out since the last boundary: do not block again
        self.offered = 0  # pages last offered to others (idle: given back when asked)
        self.reclaimed = 0  # pages given back on request, in all
        self._pages: Any = None  # the PageAwareFreeBlocks whose pages these grants cover
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=_watch, args=(self.member, wake, self._stop),
                                         name="vmkv-ledger-vllm", daemon=True)

    # ---- what the free set reads -----------------------------------------------------------------
    @property
    def limit(self) -> int:
        """Pages the scheduler may have mapped now."""
        return self.member.held - self.owed

    def attach(self, pages: Any) -> None:
        """Cover ``pages`` and start the watcher, taking the grants for what is mapped already.

        Raises:
            OutOfPages: the ledger cannot grant even that.
        """
        if self.member.take(pages.mapped_pages, wait_s=self.wait_s):  # short: only with wait=0
            raise OutOfPages(f"ledger {self.ledger.name!r} cannot grant the {pages.mapped_pages} pages vLLM's "
                             "null block keeps mapped, and the setting allows no wait (wait=0)")
        self._pages = pages
        pages.grants = self
        pages.limit_changed()
        self._watcher.start()

    def cover(self, pages: int, *, wait: bool) -> None:
        """Hold grants for ``pages`` mapped pages (plus a batch ahead); with ``wait``, ask the others and
        wait once per boundary. Short grants are not an error: the free count stays lower.
        """
        pages = min(pages, self.max_pages - self.owed)
        if pages <= self.limit or (wait and self._waited):
            return
        try:
            self.member.take(pages + self.owed, extra=self.batch, wait_s=self.wait_s if wait else 0.0)
        except OutOfPages as exc:
            self._waited = True
            log.debug("vmkv: %s", exc)

    # ---- the step cycle --------------------------------------------------------------------------
    def need(self) -> int:
        """The most pages the workers may map now (module docstring)."""
        return max(self._pages.mapped_pages, self._finished_pages, *(pages for _, pages in self._built))

    def boundary(self, step: int) -> None:
        """Start of ``schedule()`` for step ``step``: serve a request from others (module docstring)."""
        self._waited = False
        asked = self.member.asked()
        if asked and not self.reclaim_step:
            spare = min(asked, max(0, self.member.held - self.need()))
            freed = self._pages.evict_idle(asked - spare) if asked > spare else 0
            if freed:  # given back, spare grants too, once the step carrying the unmaps finished
                self.owed, self.reclaim_step = freed + spare, step
            else:  # answered at once (with what is spare, maybe nothing)
                self._give_back(spare)
            self._pages.limit_changed()
        self._offer()

    def built(self, step: int) -> None:
        """Step ``step`` was built: the workers map ``sent_pages`` once they applied it."""
        self._built.append((step, self._pages.sent_pages))

    def finished(self, step: int) -> None:
        """Every worker executed step ``step``: give back what its unmaps freed, keeping a batch ahead unless asked."""
        while self._built and self._built[0][0] <= step:
            self._finished_pages = self._built.popleft()[1]
        need = self.need()
        if self.reclaim_step and step >= self.reclaim_step:
            self.owed = self.reclaim_step = 0
            self._give_back(max(0, self.member.held - max(need, self.member.min_pages)))
        elif self.member.held - self.owed > need + self.batch:
            self.member.give(self.member.held - self.owed - need - self.batch)
        self._pages.limit_changed()
        self._offer()

    def _give_back(self, pages: int) -> None:
        """Answer the request: give ``pages`` back (and clear it, even with none)."""
        self.member.give(pages, reclaim=True)
        self.reclaimed += pages

    def pending(self) -> bool:
        """Whether the engine must step with no request running: a request to serve, or grants to give back."""
        return bool(self.reclaim_step or self.member.asked())

    def _offer(self) -> None:
        keep = max(self.need() - self._pages.idle_pages(), self.member.min_pages)
        self.offered = max(0, self.member.held - self.owed - keep)
        self.member.offer(self.offered)

    def gauges(self) -> dict[str, int]:
        """``{"held_bytes", "idle_bytes", "reclaims"}`` of this seat (Prometheus, vLLM's stats log)."""
        page = self.member.page_bytes
        return {"held_bytes": self.member.held * page, "idle_bytes": self.offered * page, "reclaims": self.reclaimed}

    def close(self) -> None:
        """Stop the watcher and leave the ledger (its file goes with its last member). Idempotent."""
        self._stop.set()
        if self._watcher.is_alive() and self._watcher is not threading.current_thread():
            self._watcher.join()
        self.member.leave()
        self.ledger.close(unlink_if_empty=True)


def _watch(member: Member, wake: Callable[[], None] | None, stop: threading.Event) -> None:
    """The watcher: while others ask for pages, wake the engine loop; a failure is logged and retried
    after ``FAILED_WAIT_S``.
    """
    woken = 0.0
    pause = POLL_S
    while not stop.wait(pause):
        pause = POLL_S
        if wake is None:
            continue
        try:
            if not member.asked():
                continue
            now = time.monotonic()
            if now - woken >= WAKE_EVERY_S:
                wake()
                woken = now
        except Exception as exc:  # noqa: BLE001 -- the next step boundary serves the request itself
            log.warning("vmkv: watching ledger %r for requests failed (%s: %s)", member.ledger.name,
                        type(exc).__name__, exc)
            pause = FAILED_WAIT_S


def engine_wake() -> Callable[[], None] | None:
    """How to wake the vLLM 0.32 engine-core loop building the calling scheduler (its ``input_queue``,
    found as ``self`` of a calling frame), or ``None`` when there is none.
    """
    # vLLM's engine core, imported when called: the seat itself runs (and is tested) without vLLM
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCore

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, EngineCore) and isinstance(getattr(owner, "input_queue", None), queue.Queue):
            inbox = owner.input_queue
            return lambda: inbox.put_nowait((EngineCoreRequestType.WAKEUP, None))
        frame = frame.f_back
    return None
