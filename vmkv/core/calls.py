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
cache may run is a shared budget's watcher (:mod:`vmkv.core.budget`): a call that finds it
inside waits for it (a moment) instead of raising.

**One process.** A cache belongs to the process that opened it. After ``os.fork()``
(multiprocessing's default start method on Linux) the child's copy of every cache is closed
(:func:`_close_in_forked_child`, run by ``os.register_at_fork``): a call there raises
:class:`~vmkv.errors.CacheClosed` naming both processes, the lookups report no sequence, and
``close()`` does nothing. A VMM cache's pages are shared memory (``MAP_SHARED``): the child would
otherwise hand out the very pages the parent uses next and overwrite its K/V. Costs nothing per
call: the child's caches are marked once, and calls already test ``closed``. (The host-wide ledger
refuses a forked child's use of its handle in the same way: :mod:`vmkv.ledger`.)

**All or nothing.** A call that changes memory (mapping, unmapping, copying pages) runs inside
:meth:`CallGuard.atomic`: every change appends a function that reverts it to the journal (the
page pool journals its own changes); if anything raises, the journal runs backwards and the cache is
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
import os
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Protocol, TypeVar

from ..errors import BackendError, CacheClosed, ConcurrentUse
from .pages import PagePool

Method = TypeVar("Method", bound=Callable)
Undo = Callable[[], None]

LEDGER_WAIT_S = 10.0
"""How long a call waits for a shared-budget watcher that is giving pages back (:mod:`vmkv.core.budget`)."""


class CallGuard:
    """One cache's call discipline: its lock, the journal of the call in progress, and whether
    it is closed or broken.

    Args:
        pool: the page pool, whose journal follows this one inside :meth:`atomic`.

    Attributes:
        lock: held by the call running inside the cache.
        journal: the undo functions of the running :meth:`atomic` block, else ``None``.
        closed: ``close()`` ran, or this is a forked child's copy; every guarded call raises
            ``CacheClosed``.
        pid: the process that opened the cache.
        broken: why a rollback failed (every guarded call raises ``BackendError``), else ``None``.
        serving: a shared budget's watcher holds the lock for a moment; a caller that finds it
            there waits (:data:`LEDGER_WAIT_S`) instead of raising ``ConcurrentUse``.
        generation: counts :meth:`atomic` blocks; a journal kept from one block may be reverted
            while no other has run.
    """

    def __init__(self, pool: PagePool) -> None:
        self.lock = threading.RLock()
        self.journal: list[Undo] | None = None
        self.closed = False
        self.broken: str | None = None
        self.serving = False
        self.generation = 0
        self.pid = os.getpid()
        self._pool = pool
        _GUARDS.add(self)

    def log(self, undo: Undo) -> None:
        """Record how to revert a change just made (inside :meth:`atomic`; a no-op outside)."""
        if self.journal is not None:
            self.journal.append(undo)

    def enter(self) -> bool:
        """Take the lock without waiting for another caller; only a shared budget's watcher,
        which holds it briefly while giving idle pages back, is waited for."""
        if self.lock.acquire(blocking=False):
            return True
        return self.serving and self.lock.acquire(timeout=LEDGER_WAIT_S)

    def check_usable(self, what: str) -> None:
        """Raise ``CacheClosed`` after ``close()`` or in a forked child, ``BackendError`` once a
        rollback failed."""
        if self.closed:
            raise self.closed_error(what)
        if self.broken is not None:
            raise BackendError(f"{what}: {self.broken}")

    def closed_error(self, what: str) -> CacheClosed:
        """The ``CacheClosed`` for a call ``what`` to a closed cache: closed, or opened by another
        process (this one is a fork of it)."""
        if os.getpid() == self.pid:
            return CacheClosed(f"{what}: the cache is closed")
        return CacheClosed(
            f"{what}: this cache was opened by process {self.pid}, not by this one ({os.getpid()}, a fork of it): "
            "a cache belongs to the process that opened it (a VMM cache's pages are shared with that process, so "
            "writing here would overwrite its K/V); open a cache in this process, or start workers with "
            "multiprocessing's 'spawn' or 'forkserver' method"
        )

    @contextmanager
    def atomic(self, keep: list[Undo] | None = None) -> Iterator[None]:
        """Journal every change made inside the block; on an exception revert them all, newest first.
        A block inside another joins it (the outer one reverts both).

        Args:
            keep: on success, the block's undo functions are appended here, so that the caller may
                revert the whole block later (:meth:`revert`) while :attr:`generation` says no
                other block ran since.

        Raises:
            BackendError: reverting failed too (the cache is then marked broken).
        """
        if self.journal is not None:
            yield
            return
        journal: list[Undo] = []
        self.journal = self._pool.journal = journal
        self.generation += 1
        try:
            yield
        except BaseException as exc:
            self.journal = self._pool.journal = None
            self.revert(journal, exc)
            raise
        else:
            if keep is not None:
                keep.extend(journal)
        finally:
            self.journal = self._pool.journal = None

    def revert(self, journal: list[Undo], cause: BaseException | None = None) -> None:
        """Run ``journal``'s undo functions newest first (emptying it).

        Raises:
            BackendError: an undo failed (the cache is then marked broken).
        """
        try:
            while journal:
                journal.pop()()
        except Exception as undo_exc:
            why = f"a failed call ({cause})" if cause is not None else "a cancelled step"
            self.broken = (
                f"the cache could not undo {why} because reverting failed too ({undo_exc}); "
                "its state is unknown: close() it and open a new one"
            )
            raise BackendError(self.broken) from undo_exc


_GUARDS: "weakref.WeakSet[CallGuard]" = weakref.WeakSet()
"""Every live guard of this process (a forked child closes them all)."""


def _close_in_forked_child() -> None:
    """``os.fork()``'s child: close the copy of every cache it inherited (see the module docstring).
    Each gets a new lock too: another thread of the parent may have held the old one at the fork,
    and no thread of the child will ever release it."""
    for guard in list(_GUARDS):
        guard.closed = True
        guard.lock = threading.RLock()


os.register_at_fork(after_in_child=_close_in_forked_child)


class Guarded(Protocol):
    """What :func:`exclusive` needs of an object: its :class:`CallGuard`."""

    guard: CallGuard


def exclusive(method: Method) -> Method:
    """Run ``method`` holding the object's guard lock; raise ``ConcurrentUse`` if another thread
    holds it, ``CacheClosed`` after ``close()``, ``BackendError`` once a rollback failed."""

    @functools.wraps(method)
    def call(self: Guarded, *args: Any, **kwargs: Any) -> Any:
        guard = self.guard
        if not guard.enter():
            raise ConcurrentUse(
                f"{method.__name__}() from thread {threading.current_thread().name!r} while another thread is "
                "inside this cache; a cache serves one thread at a time (stats() excepted): serialise calls "
                "with a lock of your own"
            )
        try:
            guard.check_usable(f"{method.__name__}()")
            return method(self, *args, **kwargs)
        finally:
            guard.lock.release()

    return call  # type: ignore[return-value]


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound to a cache) for a collaborator the cache owns, held weakly: a strong one
    would make a reference cycle, and a dropped cache would close only when the garbage collector
    runs rather than at once.

    Raises (when called):
        CacheClosed: the cache is gone.
    """
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        target = ref()
        if target is None:
            raise CacheClosed("the cache this belonged to is gone")
        return target(*args)

    return call
