"""How every public cache call runs: one thread at a time, and all or nothing.

**One thread at a time.** A cache is not thread-safe and does not pretend to be: each public
method that reads or changes sequences, pages or storage (``add``, ``begin_step``, ``write``,
``attention``, ``kv``, ``pages``, ``check``, ...) is wrapped by :func:`exclusive`, which takes
the cache's lock *without waiting*. If another thread is inside the cache, the call raises
:class:`~vmkv.errors.ConcurrentUse` instead of corrupting state. Serialise calls with your own
lock, or keep a cache on one thread. Not wrapped: ``stats()`` (it only reads counters and may be
called from any thread), the one-field lookups ``seq_len``, ``slot``, ``seq_ids``, ``in`` and
``len`` and the arithmetic ``pages_for`` (each a single dictionary read), and ``close()``
(it takes the lock itself and raises ``ConcurrentUse`` if it cannot). The one other thread a
cache may run is a shared budget's watcher (:mod:`vmkv.share`): a call that finds it inside
waits for it (a moment) instead of raising.

**All or nothing.** A call that changes memory (mapping, unmapping, copying pages) runs inside
:func:`atomic`: every change appends a function that reverts it to the cache's journal (the page
pool journals its own changes); if anything raises, the journal runs backwards and the cache is
exactly as before the call. Should a revert itself fail (the OS refusing to map a page back), the
cache is marked broken: every later call raises :class:`~vmkv.errors.BackendError` and only
``close()`` and ``stats()`` work.

Timeline of one call::

    check input ──► atomic: map/unmap/allocate (journaled) ──► commit: pure bookkeeping
         │                         │ raises
         ▼                         ▼
    typed error, nothing done   journal runs backwards, error re-raised, nothing done
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

from ..errors import BackendError, CacheClosed, ConcurrentUse

if TYPE_CHECKING:
    from .base import KVCacheBase

Method = TypeVar("Method", bound=Callable)


def exclusive(method: Method) -> Method:
    """Run ``method`` holding the cache's lock; raise ``ConcurrentUse`` if another thread holds it,
    ``CacheClosed`` after ``close()``, ``BackendError`` once a rollback failed."""

    @functools.wraps(method)
    def call(cache: "KVCacheBase", *args, **kwargs):
        if not enter(cache):
            raise ConcurrentUse(
                f"{method.__name__}() from thread {threading.current_thread().name!r} while another thread is "
                "inside this cache; a cache serves one thread at a time (stats() excepted): serialise calls "
                "with a lock of your own"
            )
        try:
            if cache._closed:
                raise CacheClosed(f"{method.__name__}(): the cache is closed")
            if cache._broken is not None:
                raise BackendError(f"{method.__name__}(): {cache._broken}")
            return method(cache, *args, **kwargs)
        finally:
            cache._lock.release()

    return call  # type: ignore[return-value]


LEDGER_WAIT_S = 10.0
"""How long a call waits for a shared-budget watcher that is giving pages back (``vmkv.share``)."""


def enter(cache: "KVCacheBase") -> bool:
    """Take the cache's lock without waiting for another caller; only a shared budget's watcher
    thread, which holds it briefly while giving idle pages back, is waited for."""
    if cache._lock.acquire(blocking=False):
        return True
    share = getattr(cache, "_share", None)
    return share is not None and share.serving and cache._lock.acquire(timeout=LEDGER_WAIT_S)


@contextmanager
def atomic(cache: "KVCacheBase") -> Iterator[None]:
    """Journal every change made inside the block; on an exception revert them all, newest first.

    Raises:
        BackendError: reverting failed too (the cache is then marked broken).
    """
    journal: list[Callable[[], None]] = []
    cache._journal = cache.pool.journal = journal
    try:
        yield
    except BaseException as exc:
        cache._journal = cache.pool.journal = None
        try:
            while journal:
                journal.pop()()
        except Exception as undo_exc:
            cache._broken = (
                f"the cache could not undo a failed call ({exc}) because reverting failed too ({undo_exc}); "
                "its state is unknown: close() it and open a new one"
            )
            raise BackendError(cache._broken) from undo_exc
        raise
    finally:
        cache._journal = cache.pool.journal = None
