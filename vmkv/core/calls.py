"""How every public cache call runs: one thread at a time, one process, all or nothing.

* One thread: :func:`exclusive` takes the cache's lock without waiting and raises
  :class:`~vmkv.errors.ConcurrentUse` if another thread is inside. Not wrapped: ``stats()``, the
  single-read lookups (``seq_len``, ``slot``, ``seq_ids``, ``in``, ``len``, ``pages_for``) and
  ``close()``. A shared budget's watcher is waited for instead.
* One process: after ``os.fork()`` the child's copy of every cache is closed
  (:func:`_close_in_forked_child`), since its ``MAP_SHARED`` pages are the parent's.
* All or nothing: :meth:`CallGuard.atomic` journals an undo for every change and runs the
  journal backwards if anything raises; a failed undo marks the cache broken (every later
  call raises :class:`~vmkv.errors.BackendError`).

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
    """One cache's call discipline: its lock, the journal of the call in progress, closed or broken.

    Attributes:
        lock: held by the call running inside the cache.
        journal: the undo functions of the running :meth:`atomic` block, else ``None``.
        closed: ``close()`` ran, or this is a forked child's copy (calls raise ``CacheClosed``).
        pid: the process that opened the cache.
        broken: why a rollback failed (calls raise ``BackendError``), else ``None``.
        serving: a shared budget's watcher holds the lock for a moment (callers wait for it).
        generation: counts :meth:`atomic` blocks; a kept journal may be reverted while no other ran.
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
        """Take the lock without waiting for another caller (only a shared budget's watcher is waited for)."""
        if self.lock.acquire(blocking=False):
            return True
        return self.serving and self.lock.acquire(timeout=LEDGER_WAIT_S)

    def check_usable(self, what: str) -> None:
        """Raise ``CacheClosed`` after ``close()`` or in a forked child, ``BackendError`` once a rollback failed."""
        if self.closed:
            raise self.closed_error(what)
        if self.broken is not None:
            raise BackendError(f"{what}: {self.broken}")

    def closed_error(self, what: str) -> CacheClosed:
        """The ``CacheClosed`` for a call ``what``: closed, or opened by another process."""
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
        """Journal every change made inside the block; on an exception revert them all, newest first (a
        nested block joins the outer one). ``keep``: on success, receives the undo functions so the
        caller may :meth:`revert` later.

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
    """``os.fork()``'s child: close every inherited cache, each with a new lock (the parent's may have
    been held at the fork).
    """
    for guard in list(_GUARDS):
        guard.closed = True
        guard.lock = threading.RLock()


os.register_at_fork(after_in_child=_close_in_forked_child)


class Guarded(Protocol):
    """What :func:`exclusive` needs of an object: its :class:`CallGuard`."""

    guard: CallGuard


def exclusive(method: Method) -> Method:
    """Run ``method`` holding the object's guard lock; raise ``ConcurrentUse``, ``CacheClosed`` or
    ``BackendError`` as :meth:`CallGuard.enter` and :meth:`CallGuard.check_usable` say.
    """

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
    """``method`` held weakly, for a collaborator the cache owns (a strong reference would be a cycle
    that delays close until garbage collection).

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
