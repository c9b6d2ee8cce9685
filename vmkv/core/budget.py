"""A cache's side of a host-wide KV budget (the ``shared_budget`` setting, :mod:`vmkv.ledger`).

Invariant: ``member.held >= memory.backed()``. The cache takes grants before it backs pages
(:meth:`CacheBudget.cover`) and returns them only once that memory went back to the OS, so the
members' resident KV memory never exceeds the budget. Requests from others are served at a step
boundary or by the watcher thread while idle; giving back touches only pages no live sequence
holds, so it never invalidates a plan.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Protocol

from ..errors import OutOfPages
from ..ledger import SharedBudget
from ..share import CacheShare
from .calls import CallGuard
from .pages import PagePool
from .slots import Drop, SlotTable


class PageMemory(Protocol):
    """Which pool pages hold memory: the mode's side of a shared budget (VMM mode implements it)."""

    on_demand: bool
    """Pages are created when provisioned and destroyed when released (CUDA); else memory comes with a
    page's first write (the host).
    """

    def backed(self) -> int:
        """Pages whose memory the cache holds now."""

    def fresh(self, pages: list[int]) -> int:
        """How many of ``pages`` hold no memory yet (mapping them backs new memory)."""

    def provision(self, pages: list[int]) -> None:
        """Give ``pages`` memory now (on-demand backends)."""

    def release(self, pages: list[int]) -> None:
        """Give the memory of free ``pages`` back to the OS or driver."""


class CacheBudget:
    """How one cache takes, holds and gives back grants of a shared budget.

    Args:
        spec: the parsed ``shared_budget`` setting.
        page_bytes: bytes of one pool page (all its pieces).
        num_pages: pages of the cache's pool (its own ceiling).
        pool, slots, memory, guard: the cache's page pool, slot table, page memory and call guard.
        drop: stops addressing a page and releases its reference.
        before_serving: called by the watcher before it gives pages back (joins map-ahead).
        counters: the cache's counters (``ledger_reclaims``).

    None of them may hold the cache strongly (a cycle would keep a dropped cache open): pass its
    methods through :func:`~vmkv.core.calls.weak_method`.

    Raises:
        InvalidConfig, LedgerMismatch, LedgerCorrupt: joining the ledger failed.
    """

    def __init__(self, spec: SharedBudget, page_bytes: int, num_pages: int, *, pool: PagePool, slots: SlotTable,
                 memory: PageMemory, guard: CallGuard, drop: Drop,
                 before_serving: Callable[[], None], counters: Counter[str]) -> None:
        self.pool, self.slots, self.memory, self.guard = pool, slots, memory, guard
        self._drop, self._before_serving, self._counters = drop, before_serving, counters
        self.share = CacheShare(self, spec, page_bytes, num_pages * page_bytes)
        self.member = self.share.member

    # ---- taking grants ---------------------------------------------------------------------
    def backed_after(self, count: int) -> int:
        """``memory.backed()`` once ``pool.allocate(count)`` took its pages (cached ones hold memory already)."""
        return self.memory.backed() + self.memory.fresh(self.pool.peek_free(count))

    def cover(self, count: int) -> None:
        """Hold grants for ``allocate(count)``: from the free budget, then this cache's idle memory, then
        by asking the others.

        Raises:
            OutOfPages: the others did not give back enough within the seat's wait.
        """
        member = self.member
        held = member.held
        short = member.take(self.backed_after(count), extra=self.share.batch)
        if short:
            self.recycle(short)
            short = member.take(self.backed_after(count), extra=self.share.batch, wait_s=self.share.wait_s)
        if short:  # wait=0: no waiting, and nothing came back
            raise OutOfPages(f"ledger {self.share.ledger.name!r} is full: {short} more pages needed and no "
                             "wait allowed (wait=0); free sequences or raise the shared budget")
        if member.held > held:
            self._provision(count)

    def _provision(self, count: int) -> None:
        """On-demand backends (CUDA): create, in one batch, the free pages the grants cover from the next
        ``count`` on.
        """
        if not self.memory.on_demand:
            return
        room = self.member.held - self.memory.backed()
        unbacked = self.memory.fresh
        pages = [page for page in self.pool.peek_free(count + room) if unbacked([page])][:room]
        self.memory.provision(pages)

    def covered(self, count: int) -> int:
        """How many of the next ``count`` free pages the grants held cover (map ahead takes no more)."""
        count = min(count, self.pool.num_free)
        while count and self.backed_after(count) > self.member.held:
            count -= 1
        return count

    def check_granted(self) -> None:
        """Refuse to back one more page unless a grant covers it: the one place a page gets memory.

        Raises:
            OutOfPages: every page granted is backed already.
        """
        if self.memory.backed() >= self.member.held:
            raise OutOfPages(f"ledger {self.share.ledger.name!r} granted {self.member.held} pages, "
                             "all backed; the page was not mapped")

    # ---- giving back ---------------------------------------------------------------------
    def recycle(self, count: int) -> int:
        """Put up to ``count`` idle pages holding memory on top of the free stack (journaled); returns how many."""
        done = self.slots.drain(count, self._drop)
        return done + len(self.pool.evict_oldest(count - done))

    def live_pages(self) -> int:
        """Pages live sequences hold (in use, less the spare pages of freed slots)."""
        return self.pool.num_in_use - self.slots.idle_spare()

    def boundary(self) -> None:
        """At a step boundary: serve others' requests, and say what this cache could give back."""
        member = self.member
        if member.asked():
            self.give_back(member.asked())
        member.offer(member.held - max(self.live_pages(), member.min_pages))

    def give_back(self, asked: int) -> None:
        """Release idle memory until ``asked`` grants are unused (never below what live sequences or
        ``min`` need), then return them. Touches only pages no live sequence holds.
        """
        member = self.member
        target = max(member.held - asked, self.live_pages(), member.min_pages)
        excess = self.memory.backed() - target
        if excess > 0:
            with self.guard.atomic():
                dirty_free = self.memory.backed() - self.pool.num_in_use - self.pool.num_cached
                self.recycle(excess - dirty_free)
            self.memory.release(self.pool.free_pages())
        member.give(member.held - max(target, self.memory.backed()), reclaim=True)
        self._counters["ledger_reclaims"] += 1

    def after_trim(self) -> None:
        """``trim`` released memory: return the grants it no longer needs, then serve requests."""
        self.member.give(self.member.held - self.memory.backed())
        self.boundary()

    def serve(self) -> None:
        """The watcher's entry: serve a request if no call is running (a begun step is no obstacle)."""
        guard = self.guard
        guard.serving = True
        try:
            if not guard.lock.acquire(blocking=False):
                return  # a call is running: its next begin_step serves the request
            try:
                if not (guard.closed or guard.broken):
                    self._before_serving()
                    self.boundary()
            finally:
                guard.lock.release()
        finally:
            guard.serving = False

    def stats(self) -> dict[str, object]:
        """The ledger's name and the grants held."""
        return {"ledger": self.share.ledger.name, "ledger_pages_held": self.member.held,
                "ledger_reclaims": self._counters["ledger_reclaims"]}

    def close(self) -> None:
        """Stop the watcher and leave the ledger (after the cache's memory is released)."""
        self.share.close()
