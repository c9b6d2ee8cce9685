"""A cache's seat in a host-wide ledger (``shared_budget``): joining it, and the watcher thread that
serves other members' requests while the cache sits idle (through :mod:`vmkv.core.budget`). A
cache with a seat closes at interpreter exit, so a clean exit leaves no dead member.
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
"""How often an idle member's watcher looks for requests."""

FAILED_WAIT_S = 1.0
"""After a failure the watcher waits this long before it looks for requests again."""

BATCH_DIVISOR = 64
"""A member takes grants in batches of ``1/BATCH_DIVISOR`` of the budget (1 to 64 pages): one lock a batch, not a page."""


class Closable(Protocol):
    """What :func:`close_at_exit` closes (a cache)."""

    def close(self) -> None:
        """Release the memory, then leave the ledger."""


_OPEN_AT_EXIT: "weakref.WeakSet[Closable]" = weakref.WeakSet()


def close_at_exit(cache: Closable) -> None:
    """Close ``cache`` at interpreter exit if still open: one referenced to the end (by a daemon thread)
    is never finalized and would leave a dead member. Held weakly.
    """
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
    """Open ``spec``'s ledger and join it as ``label`` (``ceiling``: the member's own maximum bytes).

    Returns:
        The open ledger and the member's seat in it.

    Raises:
        InvalidConfig, LedgerMismatch, LedgerCorrupt, LedgerError: as :class:`vmkv.ledger.Ledger`
            and its ``join``; a refused join leaves no file a member did not need before.
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
        """Stop the watcher and leave the ledger (after the cache's memory is released)."""
        self._stop.set()
        if self._watcher is not threading.current_thread():
            self._watcher.join()
        self.member.leave()
        self.ledger.close(unlink_if_empty=True)


def _watch(ref: "weakref.ref[Server]", member: Member, stop: threading.Event) -> None:
    """The watcher: serve requests while the cache sits idle; a failure is logged and retried after ``FAILED_WAIT_S``."""
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
