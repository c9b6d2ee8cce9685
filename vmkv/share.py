"""A cache's seat in a host-wide ledger (the ``shared_budget`` setting): joining it, and the
watcher thread that serves other members' requests while the cache sits idle.

What the cache does with its grants is :mod:`vmkv.core.budget`; the watcher polls the member's
``request`` field (a lock-free read) and, when asked, calls the budget's ``serve()``, which gives
pages back whenever no call is running (after a ``begin_step`` too: an idle member's last call is
often one). Giving back touches only pages no live sequence holds, so it never invalidates a plan.

A cache with a seat closes at interpreter exit if it is still open then (:func:`close_at_exit`),
so a process that ends cleanly never leaves a dead member behind.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from contextlib import suppress
from typing import Protocol

from .errors import LedgerError
from .ledger import Ledger, Member, SharedBudget, member_max

log = logging.getLogger("vmkv")

POLL_S = 0.01
"""How often an idle member's watcher looks for requests (a member busy with steps answers at
its next ``begin_step``)."""

FAILED_WAIT_S = 1.0
"""After a failure the watcher waits this long before it looks for requests again."""

BATCH_DIVISOR = 64
"""A member takes grants in batches of ``1/BATCH_DIVISOR`` of the budget (1 to 64 pages), so
the ledger's lock is taken about once a batch, not once a page."""


class Closable(Protocol):
    """What :func:`close_at_exit` closes (a cache)."""

    def close(self) -> None:
        """Release the memory, then leave the ledger."""


_OPEN_AT_EXIT: "weakref.WeakSet[Closable]" = weakref.WeakSet()


def close_at_exit(cache: Closable) -> None:
    """Close ``cache`` when the interpreter exits, if it is still open then. A dropped cache
    leaves the ledger in its finalizer, but one referenced to the end (by a daemon thread, say
    an engine loop's) is never finalized: its member would stay, dead, holding its bytes until a
    reap, and the ledger's file would outlive its last member. Held weakly: a dropped cache goes."""
    _OPEN_AT_EXIT.add(cache)


@atexit.register  # at import: exit handlers run last registered first, so this one follows those of its users
def _close_open() -> None:
    """The exit handler of :func:`close_at_exit`: close every cache still open."""
    for cache in list(_OPEN_AT_EXIT):
        try:
            cache.close()
        except Exception as exc:  # noqa: BLE001 -- one cache that cannot close (a thread inside it) spares the others
            log.warning("vmkv: a cache could not close at exit (%s: %s); its ledger seat stays until a reap",
                        type(exc).__name__, exc)


def join(spec: SharedBudget, label: str, page_bytes: int, ceiling: int) -> tuple[Ledger, Member]:
    """Open ``spec``'s ledger and join it as ``label``, closing the ledger again if the join fails.

    Args:
        spec: the parsed ``shared_budget`` setting.
        label: the member's name in the ledger.
        page_bytes: bytes of one of the member's pages.
        ceiling: bytes the member can map at most on its own; its ``max`` is capped there.

    Returns:
        The open ledger and the member's seat in it.

    Raises:
        InvalidConfig, LedgerMismatch, LedgerCorrupt, LedgerError: as :class:`vmkv.ledger.Ledger`
            and its ``join``; a join refused for the member's sizes creates no file, and one
            refused later leaves no file a member did not need before.
    """
    max_bytes = ceiling if spec.max_bytes is None else min(spec.max_bytes, ceiling)
    member_max(spec.budget, page_bytes, spec.min_bytes, max_bytes, label)  # refused before any file exists
    ledger = Ledger(spec.name, spec.budget)
    try:
        member = ledger.join(label, page_bytes, min_bytes=spec.min_bytes, max_bytes=max_bytes)
    except BaseException:
        with suppress(LedgerError):  # the join's own error is the one to see
            ledger.close(unlink_if_empty=True)
        ledger.close()
        raise
    return ledger, member


def grant_batch(spec: SharedBudget, page_bytes: int) -> int:
    """Pages a member takes per grant: ``1/BATCH_DIVISOR`` of the budget, 1 to 64 pages."""
    return max(1, min(64, spec.budget // page_bytes // BATCH_DIVISOR))


class Server(Protocol):
    """What the watcher serves requests through (:class:`vmkv.core.budget.CacheBudget`)."""

    def serve(self) -> None:
        """Give pages back if the cache is idle."""


class CacheShare:
    """One cache's seat in a ledger: its member handle, batch size and watcher thread.

    Args:
        owner: serves requests (held weakly by the watcher, so a dropped cache still closes).
        spec: the parsed setting.
        page_bytes: bytes of one of the cache's pages.
        ceiling: bytes the cache can map at most on its own.

    Attributes:
        member: the ledger handle (``member.held``: pages granted).
        batch: pages taken beyond need per grant, when the budget has them.
        wait_s: how long a member short of budget waits for others.
    """

    def __init__(self, owner: Server, spec: SharedBudget, page_bytes: int, ceiling: int) -> None:
        label = spec.member or f"{os.path.basename(sys.argv[0]) or 'python'}:{os.getpid()}"
        self.ledger, self.member = join(spec, label, page_bytes, ceiling)
        self.batch = grant_batch(spec, page_bytes)
        self.wait_s = spec.wait_s
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=_watch, args=(weakref.ref(owner), self.member, self._stop),
                                         name="vmkv-ledger", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        """Stop the watcher and leave the ledger, whose file goes with its last member (call
        after the cache's memory is released)."""
        self._stop.set()
        if self._watcher is not threading.current_thread():
            self._watcher.join()
        self.member.leave()
        self.ledger.close(unlink_if_empty=True)


def _watch(ref: "weakref.ref[Server]", member: Member, stop: threading.Event) -> None:
    """The watcher: serve requests while the cache sits idle; stop with the cache. A failure
    (reading a request takes the ledger's lock, which refuses a damaged file) is logged, and the
    watcher waits ``FAILED_WAIT_S`` before it looks again: the cache's own calls raise it."""
    pause = POLL_S
    while not stop.wait(pause):
        pause = POLL_S
        owner = None
        try:
            if not member.asked():
                continue
            owner = ref()
            if owner is None:
                return
            owner.serve()
        except Exception as exc:  # noqa: BLE001 -- the next begin_step serves the request itself
            log.warning("vmkv: giving pages back to ledger %r failed (%s: %s)", member.ledger.name,
                        type(exc).__name__, exc)
            pause = FAILED_WAIT_S
        del owner
