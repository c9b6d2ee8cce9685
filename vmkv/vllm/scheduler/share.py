"""The vLLM plugin in a host-wide ledger (``shared_budget``): the scheduler side holds the grants.

Who is the member: vLLM's engine-core process, the one running the scheduler. It decides which
pages every worker maps (:class:`~vmkv.vllm.scheduler.free_blocks.PageAwareFreeBlocks`, lists sent with
each step), so it is the one that can keep a promise about them; a member page is one buffer
page on every rank (``page_size x ranks`` bytes: each rank maps the same pages from its own
store). The workers only follow the lists (on CUDA their store creates a page's memory when a
step maps it and gives it back to the driver when a step unmaps it).

Invariant, kept here: ``member.held >= need``, where ``need`` is the most pages the workers may
map now: the pages mapped in the scheduler (the next step sends them all), the pages the
workers map after each step built but not yet finished (steps finish in order:
``Scheduler.update_from_output`` runs once the workers executed the step), and after the last
finished one. So grants are taken *before* a step maps (the free count allows only
``limit = held - owed`` mapped pages), and given back only once the step that carries the
unmaps *finished*: the resident KV memory of all members together stays within the budget.

Pressure, the step-boundary rule: another member short of budget posts a request on this
member (:meth:`vmkv.ledger.Member.take`). It is served only at the start of a
``schedule()`` (:meth:`EngineShare.boundary`), by the scheduler's own thread: spare grants
(held beyond ``need``) first, at once if they suffice; else whole idle units (pages that only prefix-cached blocks keep mapped, never a
running request's or a retained block's) are evicted, least recently idle first: their
prefix-cache entries are removed *before* their unmaps are sent, so no later prefix hit can
read a page that was unmapped. Their grants (with the spare ones) go back when the step
carrying those unmaps finished (:meth:`EngineShare.finished`); until then they are ``owed`` (not counted in ``limit``, so this
engine does not map them again meanwhile).

An idle vLLM engine takes no steps, so the watcher thread here only *wakes* the engine-core
loop: it polls the member's ``request`` field (a lock-free read), and while it is set puts
vLLM's own ``WAKEUP`` message into the engine core's input queue; the connector reports
pending work (``has_pending_push_work``) while a request or a give-back is pending, so the woken
loop runs an (empty) step: schedule (the boundary serves the request), execute (the workers
unmap), update (the grants go back). The watcher never touches the scheduler's state. Reading a
standing request takes the ledger's lock, which refuses a damaged ledger: the watcher logs that
and looks again after :data:`vmkv.share.FAILED_WAIT_S` (the scheduler's own calls raise it), as
the cache's watcher does.
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
    """One vLLM engine's seat in a ledger (see the module docstring).

    Args:
        spec: the parsed ``shared_budget`` setting.
        page_bytes: bytes one buffer page takes over all ranks.
        cap_pages: pages the engine may map at most (its own budget).
        wake: wakes the engine-core loop (``None``: no loop to wake; requests are then served
            at the next step the client drives).

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
        """Cover ``pages`` (a :class:`PageAwareFreeBlocks`) and start the watcher: the grants for
        what is mapped already (vLLM's null block's unit) are taken, waiting for others if need be.

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
        """Hold grants for ``pages`` mapped pages (plus a batch ahead when the budget has it);
        with ``wait``, ask the others and wait up to the setting's ``wait`` (once a boundary: a
        wait that timed out is not repeated before the next one). Short grants are not an
        error: the free count stays lower and vLLM queues or preempts, as it does when full."""
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
        """Every worker executed step ``step`` (and every one before it): give back what its
        unmaps freed, keeping a batch ahead unless it was asked for."""
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
        """Whether the engine must step although no request runs: a request to serve, or grants
        to give back once a step finished."""
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
    """The watcher: while others ask this member for pages, wake the engine loop (module docstring).

    A failure (reading a standing request takes the ledger's lock, which refuses a damaged
    ledger; the wake call) is logged, and the watcher waits ``FAILED_WAIT_S`` before it looks
    again instead of dying: the scheduler's own ledger calls raise the error where it matters.
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
    """How to wake the vLLM 0.32 engine-core loop that is building the calling scheduler, or
    ``None`` when none is (an in-process engine, or a test).

    ``EngineCoreProc`` creates its ``input_queue`` before ``EngineCore.__init__`` builds the
    scheduler; its busy loop blocks on that queue while idle, and vLLM itself wakes it with a
    ``WAKEUP`` message (``EngineCoreRequestType.WAKEUP``, used at shutdown). The engine core is
    found as ``self`` of a calling frame (vLLM keeps no other handle on it in that process).
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
