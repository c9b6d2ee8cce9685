"""The ledger and its members: one file every member maps, and each member's handle on it.

A member takes ``n * page_bytes`` before backing ``n`` pages (:meth:`Member.take`, in batches) and
gives bytes back once their memory went back to the OS. When the budget is spent, ``take`` posts
requests on members that offer reclaimable bytes and waits a bounded time. The record is guarded
by ``fcntl.flock`` (dropped by the kernel when its holder dies) plus a thread lock; the only
lock-free accesses are a member's own ``request`` reads and ``reclaimable`` writes. A handle used
in a forked child raises ``LedgerError``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from ..errors import LedgerCorrupt, LedgerError, LedgerMismatch, OutOfPages
from ..sizes import format_size
from .format import FILE_BYTES, HEADER_BYTES, HOLDS_LOCK, NUM_SLOTS, Record, empty_file, read_header
from .liveness import drop_lock, member_alive, pid_namespace, process_alive, process_start, take_lock
from .settings import check_budget, ledger_path, member_max

_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}
WAIT_STEP_S = 0.005


@dataclass(frozen=True)
class MemberInfo:
    """One member as the ledger records it (bytes, except the counters of grants and returns)."""

    slot: int
    pid: int
    name: str
    page_bytes: int
    held: int
    min: int
    max: int
    grants: int
    returns: int
    reclaims: int
    request: int
    reclaimable: int
    want: int
    alive: bool


class Ledger:
    """One host-wide budget, opened (created if need be) by every member process.

    Args:
        name: the ledger's name (``/dev/shm/vmkv-ledger.NAME``) or path.
        budget: its bytes; ``None`` to open an existing ledger whatever its budget (``vmkv ledger``).
        alive: ``alive(pid, start)`` judges whether a member's process lives (tests pass their own).

    Raises:
        InvalidConfig: ``budget`` is 0 or past ``MAX_BUDGET``.
        LedgerCorrupt: the file is not a vmkv ledger, or breaks an invariant.
        LedgerMismatch: the ledger exists with another budget or version.
        LedgerError: the path is not a regular file, or cannot be opened or created (the message
            says why; no file is left).
        FileNotFoundError: ``budget`` is ``None`` and no such ledger exists.
    """

    def __init__(self, name: str, budget: int | None, *, alive: Callable[[int, int], bool] = process_alive) -> None:
        self.path = ledger_path(name)
        self.name = name
        self._alive = alive
        self._fd = -1
        self.record: Record | None = None  # the mapped file (None once closed)
        self._locks: set[int] = set()  # slots whose liveness lock this handle holds
        self._opener = os.getpid()
        self._threads = threading.Lock()  # flock excludes other open files, not this one's threads
        self.budget = self._open(None if budget is None else check_budget(budget))

    # ---- the file ----------------------------------------------------------------------------
    def _open(self, budget: int | None) -> int:
        """Open and map the file (creating it if ``budget``); return its budget."""
        while True:
            fd = self._open_file(budget)
            if fd < 0:
                continue  # just created (by us or another process): open what the path names now
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if self._names(fd):  # else the last member removed it meanwhile: open again
                    found = self._map_file(fd, budget)
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    self._fd = fd
                    return found
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def _open_file(self, budget: int | None) -> int:
        """A descriptor of the regular file at the path, or -1 once a missing one was created."""
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            if budget is None:
                raise FileNotFoundError(errno.ENOENT, "no such ledger", self.path) from None
            self._create(budget)
            return -1
        except OSError as exc:
            raise self._os_error("open", exc) from None
        self._refuse_special(info)
        try:  # O_NONBLOCK: should the path turn into a FIFO or a device meanwhile, opening cannot hang
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        except FileNotFoundError:
            return -1
        except OSError as exc:
            raise self._os_error("open", exc) from None
        try:
            self._refuse_special(os.fstat(fd))
        except LedgerError:
            os.close(fd)
            raise
        return fd

    def _refuse_special(self, info: os.stat_result) -> None:
        if not stat.S_ISREG(info.st_mode):
            kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
            raise LedgerError(f"{self.path} is {kind}, not a ledger file: name the ledger by another path")

    def _create(self, budget: int) -> None:
        """Write a complete, empty ledger as an unnamed file, then link it to the path: nobody sees a ledger
        half made, and a failure leaves nothing.

        Raises:
            LedgerError: the directory is missing, read-only or full, or refuses unnamed files.
        """
        directory = os.path.dirname(self.path) or "."
        image = empty_file(budget)
        try:
            folder = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise LedgerError(f"cannot create the ledger file {self.path}: its directory does not exist "
                              "(name the ledger by a path in a directory that does)") from None
        except OSError as exc:
            raise self._os_error("create", exc) from None
        fd = -1
        try:
            fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=folder)
            os.posix_fallocate(fd, 0, FILE_BYTES)  # the file's memory now, or ENOSPC: never SIGBUS later
            os.pwrite(fd, image, 0)
            os.link(f"/proc/self/fd/{fd}", os.path.basename(self.path), dst_dir_fd=folder)  # follows the fd link
        except FileExistsError:
            pass  # another process created it first: we open theirs
        except OSError as exc:
            raise self._os_error("create", exc) from None
        finally:
            if fd >= 0:
                os.close(fd)
            os.close(folder)

    def _os_error(self, action: str, exc: OSError) -> LedgerError:
        """A typed error for an ``OSError`` of opening or creating the file, with what to do."""
        hint = {errno.EACCES: " (ledgers are private to their owner's processes)",
                errno.EPERM: " (ledgers are private to their owner's processes)",
                errno.ENOSPC: f" ({FILE_BYTES} bytes needed; a Docker container's /dev/shm is 64 MiB unless "
                              "--shm-size says more)",
                errno.EROFS: " (name the ledger by a path on a writable filesystem)",
                errno.EOPNOTSUPP: " (vmkv creates a ledger as an unnamed file first, O_TMPFILE: use tmpfs, "
                                  "ext4, xfs or btrfs)"}.get(exc.errno, "")
        reason = (exc.strerror or str(exc)).lower()
        return LedgerError(f"cannot {action} the ledger file {self.path}: {reason}{hint}")

    def _names(self, fd: int) -> bool:
        """Whether the path still names the open file ``fd`` (its last member may remove it)."""
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (info.st_dev, info.st_ino) == (mine.st_dev, mine.st_ino)

    def _map_file(self, fd: int, budget: int | None) -> int:
        """Check ``fd``'s header (under its lock), map it, recover and check its record; return its budget."""
        size = os.fstat(fd).st_size
        advice = "remove it if nothing uses it" if "/" not in self.name else "name the ledger by another path"
        found = read_header(os.pread(fd, HEADER_BYTES, 0), size, self.path, advice)
        if budget is not None and found != budget:
            raise LedgerMismatch(f"ledger {self.name!r} exists with a budget of {format_size(found)}, not "
                                 f"{format_size(budget)}: use the same budget, or another name")
        record = Record(fd, self.path)
        self.budget = found
        try:
            record.recover()
            record.check(found)
        except BaseException:
            record.close()
            raise
        self.record = record
        return found

    def _reopen(self) -> None:
        """Open the file the path names now (this handle's was removed by its last member)."""
        self.record.close()
        self.record = None
        os.close(self._fd)
        self._fd = -1
        self.budget = self._open(self.budget)

    # ---- the record --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the file is no longer mapped)."""
        return self.record is None

    @property
    def opened_here(self) -> bool:
        """Whether this process opened the handle (not a forked child of the one that did)."""
        return os.getpid() == self._opener

    def check(self) -> list[dict]:
        """All slots, after checking the invariants of :mod:`vmkv.ledger` (holding the lock)."""
        return self.record.check(self.budget)

    @contextmanager
    def locked(self) -> Iterator[list[dict]]:
        """Hold the ledger's lock; yield its slots, recovered and checked.

        Raises:
            LedgerCorrupt: the record breaks an invariant (nothing is changed), or the ledger is closed.
            LedgerError: this process did not open the handle (a forked child).
        """
        if self.record is None:
            raise LedgerCorrupt(f"ledger {self.name!r} is closed")
        if not self.opened_here:
            raise LedgerError(f"ledger {self.name!r} was opened by process {self._opener}, not this one "
                              f"({os.getpid()}, a fork): open the ledger (or the cache) again in this process")
        with self._threads:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self.record.recover()
                yield self.check()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    # ---- liveness ----------------------------------------------------------------------------
    def _take_lock(self, index: int) -> bool:
        """Take slot ``index``'s liveness lock for this process; ``False`` if another open file holds it."""
        if not take_lock(self._fd, index):
            return False
        self._locks.add(index)
        return True

    def _drop_lock(self, index: int) -> None:
        if index in self._locks:
            drop_lock(self._fd, index)
            self._locks.discard(index)

    def _is_alive(self, index: int, slot: dict) -> bool:
        """Whether the member in slot ``index`` lives (:mod:`vmkv.ledger.liveness`)."""
        return member_alive(self._fd, index, slot, mine=index in self._locks, alive=self._alive)

    # ---- members -----------------------------------------------------------------------------
    def join(self, label: str, page_bytes: int, *, min_bytes: int = 0, max_bytes: int | None = None,
             pid: int | None = None) -> "Member":
        """Add a member holding nothing yet.

        Args:
            label: what ``vmkv ledger`` shows (1-32 bytes of UTF-8).
            page_bytes: bytes of one of its pages (it takes and gives whole pages).
            min_bytes: it is never asked to give back below this.
            max_bytes: it never holds more (``None``: the budget), rounded down to whole pages.
            pid: the member's process (default: this one, which then holds the slot's liveness lock).

        Raises:
            InvalidConfig: bad sizes, or no page fits in ``max_bytes``.
            LedgerMismatch: every slot is taken by a live member.
        """
        high = member_max(self.budget, page_bytes, min_bytes, max_bytes, label)
        own = pid is None or pid == os.getpid()
        pid = os.getpid() if own else pid
        fields = dict(pid=pid, start=process_start(pid) or 0, ns=pid_namespace(), flags=HOLDS_LOCK if own else 0,
                      name=label.encode()[:32], page_bytes=page_bytes, held=0, min=min_bytes, max=high, grants=0,
                      returns=0, reclaims=0, request=0, want=0)
        while True:
            with self.locked() as slots:
                if self._locks or self._names(self._fd):  # a handle with members keeps its file named
                    index = self._free_slot(slots, own)
                    if index is None:
                        self.reap_dead(slots)
                        index = self._free_slot(self.check(), own)
                    if index is None:
                        raise LedgerMismatch(f"ledger {self.name!r} has {NUM_SLOTS} live members already")
                    self.record.set_reclaimable(index, 0)  # its hint
                    self.record.write(index, **fields)
                    return Member(self, index, pid, page_bytes)
            self._reopen()  # the last member removed the file after we opened it: join the one named now

    def _free_slot(self, slots: list[dict], own: bool) -> int | None:
        """An empty slot (with its liveness lock taken, for a member of this process), or ``None``."""
        for index, slot in enumerate(slots):
            if slot["pid"] == 0 and (not own or self._take_lock(index)):
                return index
        return None

    def members(self) -> list[MemberInfo]:
        """Every member, live or dead (a snapshot taken under the lock)."""
        with self.locked() as slots:
            return [
                MemberInfo(slot=i, pid=s["pid"], name=s["name"].rstrip(b"\0").decode(errors="replace"),
                           page_bytes=s["page_bytes"], held=s["held"], min=s["min"], max=s["max"],
                           grants=s["grants"], returns=s["returns"], reclaims=s["reclaims"], request=s["request"],
                           reclaimable=self.record.peek(i, "reclaimable"), want=s["want"], alive=self._is_alive(i, s))
                for i, s in enumerate(slots) if s["pid"]
            ]

    def reap(self) -> int:
        """Free the slots and bytes of members whose processes are gone; return the bytes freed."""
        with self.locked() as slots:
            return self.reap_dead(slots)

    def reap_dead(self, slots: list[dict]) -> int:
        """:meth:`reap` for a caller holding the lock (``slots``: what :meth:`locked` yielded)."""
        freed = 0
        for index, slot in enumerate(slots):
            if slot["pid"] and not self._is_alive(index, slot):
                freed += slot["held"]
                self.clear(index)
        return freed

    def clear(self, index: int) -> None:
        """Empty slot ``index`` (holding the lock); its requests go if no one else waits."""
        self.record.clear(index)
        self._drop_lock(index)
        self.drop_requests()

    def drop_requests(self, *, of_the_dead: bool = False) -> None:
        """Clear every request if no member waits for them (``of_the_dead``: no live member), under the lock."""
        slots = [self.record.slot(i) for i in range(NUM_SLOTS)]
        if any(s["pid"] and s["want"] and (not of_the_dead or self._is_alive(i, s)) for i, s in enumerate(slots)):
            return
        for index, slot in enumerate(slots):
            if slot["request"]:
                self.record.write(index, request=0)

    def close(self, *, unlink_if_empty: bool = False) -> None:
        """Unmap the ledger (and remove its file if ``unlink_if_empty`` and no member is left). Idempotent."""
        if self.record is None:
            return
        try:
            if unlink_if_empty and self.opened_here:
                with self.locked() as slots:
                    if not any(slot["pid"] for slot in slots) and self._names(self._fd):
                        os.unlink(self.path)
        finally:
            self.record.close()
            self.record = None
            os.close(self._fd)
            self._fd = -1
            self._locks.clear()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Member:
    """One member's handle on a ledger: it takes and gives whole pages of ``page_bytes``, changing the
    record only through the ledger's methods, under its lock.
    """

    def __init__(self, ledger: Ledger, slot: int, pid: int, page_bytes: int) -> None:
        self.ledger = ledger
        self.pid = pid
        self.page_bytes = page_bytes
        self._slot = slot
        self._own = slot  # the slot whose hints it reads and writes without the lock, even after leave()
        self._held = 0

    @property
    def slot(self) -> int:
        """Its slot in the ledger (-1 once it left)."""
        return self._slot

    @property
    def held(self) -> int:
        """Pages granted; only this handle changes it, so it is read without the lock."""
        return self._held

    @property
    def min_pages(self) -> int:
        """Pages this member keeps whatever it is asked."""
        return -(-self.ledger.record.peek(self._own, "min") // self.page_bytes)

    def take(self, pages: int, *, extra: int = 0, wait_s: float = 0.0) -> int:
        """Hold at least ``pages`` pages, plus up to ``extra`` more if free (a member holding ``pages``
        returns at once, unlocked). Short of budget it reaps the dead, then, with ``wait_s > 0``, asks
        members offering reclaimable bytes and waits for them.

        Returns:
            The pages it could not get (0: it holds ``pages``); with ``wait_s > 0`` always 0.

        Raises:
            OutOfPages: ``wait_s > 0`` and the budget did not free up in time (it then holds
                whatever it had before, plus what it got meanwhile), or ``pages`` is past its max.
        """
        if pages <= self._held:
            return 0
        deadline = time.monotonic() + wait_s
        reason = f"the others gave back too little within {wait_s:.1f} s"
        while True:
            with self.ledger.locked() as slots:
                short = self._grant(slots, pages, extra)
                if short and self.ledger.reap_dead(slots):
                    slots = self.ledger.check()
                    short = self._grant(slots, pages, extra)
                if not short or wait_s <= 0:
                    self._stop_waiting()
                    return short
                if not any(s["request"] for i, s in enumerate(slots) if i != self._slot) \
                        and not self._ask(slots, short * self.page_bytes):
                    deadline, reason = 0.0, "no other member has idle memory to give back"  # waiting cannot help
            if time.monotonic() >= deadline:
                with self.ledger.locked():
                    self._stop_waiting()
                raise OutOfPages(
                    f"ledger {self.ledger.name!r} ({format_size(self.ledger.budget)}) is full: this member needs "
                    f"{short} more pages of {format_size(self.page_bytes)} and {reason}; free sequences, lower "
                    "other members' use, or raise the shared budget"
                )
            time.sleep(WAIT_STEP_S)

    def _stop_waiting(self) -> None:
        """Clear this member's ``want`` (holding the lock), and the requests no one waits for now."""
        record = self.ledger.record
        if record.slot(self._slot)["want"]:
            record.write(self._slot, want=0)
            self.ledger.drop_requests()

    def _grant(self, slots: list[dict], pages: int, extra: int) -> int:
        """Grant what the free budget allows towards ``pages`` (+ ``extra``); return the pages still short."""
        me = self._mine(slots)
        if pages * self.page_bytes > me["max"]:
            raise OutOfPages(f"ledger {self.ledger.name!r}: {pages} pages of {format_size(self.page_bytes)} exceed "
                             f"this member's max of {format_size(me['max'])}")
        free = self.ledger.budget - sum(slot["held"] for slot in slots)
        room = min(free, me["max"] - me["held"]) // self.page_bytes
        need = max(0, pages - self._held)
        got = min(room, need + extra)
        if got > 0:
            self._held += got
            me["held"] = self._held * self.page_bytes
            self.ledger.record.write(self._slot, held=me["held"], grants=me["grants"] + got)
        return max(0, need - got)

    def _mine(self, slots: list[dict]) -> dict:
        me = slots[self._slot]
        if me["pid"] != self.pid or me["held"] != self._held * self.page_bytes:
            raise LedgerCorrupt(f"ledger {self.ledger.name!r}: this member's slot was changed by another process "
                                "(was it counted dead? is /proc readable?)")
        return me

    def _ask(self, slots: list[dict], nbytes: int) -> int:
        """Post requests for ``nbytes`` on the others, largest reclaimable first; return the bytes asked."""
        record = self.ledger.record
        record.write(self._slot, want=nbytes)
        others = sorted((i for i, s in enumerate(slots) if s["pid"] and i != self._slot),
                        key=lambda i: -record.peek(i, "reclaimable"))
        asked = 0
        for index in others:
            slot = slots[index]
            offer = min(record.peek(index, "reclaimable"), max(0, slot["held"] - slot["min"]), nbytes - asked)
            if offer > 0:
                record.write(index, request=slot["request"] + offer)
                asked += offer
        return asked

    def give(self, pages: int, *, reclaim: bool = False) -> None:
        """Give back ``pages`` pages (whose memory went back to the OS); ``reclaim``: on request."""
        pages = min(pages, self._held)
        if pages <= 0 and not reclaim:
            return
        with self.ledger.locked() as slots:
            me = self._mine(slots)
            self._held -= pages
            fields = {"held": self._held * self.page_bytes, "returns": me["returns"] + pages}
            if reclaim:
                fields.update(reclaims=me["reclaims"] + pages, request=0)
            self.ledger.record.write(self._slot, **fields)

    def asked(self) -> int:
        """Pages others asked this member to give back (read unlocked, confirmed under the lock)."""
        nbytes = self.ledger.record.peek(self._own, "request")
        if nbytes:
            with self.ledger.locked():
                self.ledger.drop_requests(of_the_dead=True)
                nbytes = self.ledger.record.slot(self._slot)["request"]
        return -(-nbytes // self.page_bytes)

    def offer(self, pages: int) -> None:
        """Say how many pages this member could give back if asked (written without the lock)."""
        self.ledger.record.set_reclaimable(self._own, max(0, pages) * self.page_bytes)

    def leave(self) -> None:
        """Give everything back and free the slot (not from a forked child). Idempotent."""
        if self.ledger.closed or self._slot < 0:
            return
        if self.ledger.opened_here:
            with self.ledger.locked() as slots:
                if slots[self._slot]["pid"] == self.pid:
                    self.ledger.clear(self._slot)
        self._held, self._slot = 0, -1
