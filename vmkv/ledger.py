"""A host-wide KV budget that several processes share, the way an OS shares RAM between them.

A *ledger* is a small file in shared memory (``/dev/shm/vmkv-ledger.NAME``, or any path) that
every member maps. It records one byte budget and, per member, what it holds::

    header   magic "VMKVLDG1" | version | slots | budget bytes | crc32 of the fields before it
    journal  slot index | a slot's new image | seal (crc32 of the two, or 0: empty)
    slot i   pid | process start time | pid namespace | flags | member name | page bytes | held |
             min | max | grants | returns | reclaims | request | want    (the image)
             reclaimable                                           (written without the lock)

Members count bytes (each in its own page size): a member that is about to back ``n`` more pages
with memory first takes ``n * page_bytes`` from the ledger (:meth:`Member.take`, in batches, so
the hot path does not lock per page), and gives bytes back when their memory went back to the OS
(:meth:`Member.give`).

Invariants (checked on every locked read; a file that breaks one is refused, never trusted):
    * ``sum(held) <= budget``: no member ever holds memory past the ledger's budget;
    * ``min <= max`` and ``held <= max`` for every member;
    * an empty slot (``pid == 0``) holds nothing;
    * a request stands only while a live member waits (``want``) for the bytes it asks.

Atomic changes: a process may be killed at any instruction. A file appears under its name only
complete (written unnamed, then linked), so no reader sees one half made. A slot changes by its
whole image: written to the journal, sealed, copied into the slot, the seal cleared. Whoever
takes the lock next copies a sealed record again (a writer killed after sealing) or drops an
unsealed one (killed before: the slot is untouched), so every slot is always either its old or
its new image.

Pressure: when the budget is spent, :meth:`Member.take` posts a ``request`` (bytes to give back)
on the members that said they have reclaimable bytes, and waits a bounded time for them to give;
members read their own ``request`` without the lock (:meth:`Member.asked`) at their next step
boundary, or on their watcher thread while idle. Requests go when their asker stops waiting (it
got its pages, timed out, left or died).

Faults, who is dead: a member joining for its own process takes an OFD lock on its slot's first
byte (``fcntl`` ``F_OFD_SETLK``), which the kernel drops when the process dies, in whatever PID
namespace it runs. A member whose lock is gone is dead. A member whose lock is held is alive,
unless it runs in this process's PID namespace (recorded at join) and its pid is gone, a zombie
or reused (a forked child may keep the lock of a dead parent). A member joined on behalf of
another pid (no lock) is judged by its pid in this namespace only, and never counted dead from
another. :meth:`Ledger.reap` frees dead members' slots and bytes. The lock that guards the record
is ``fcntl.flock`` on the file, which the kernel also drops when its holder dies, and within a
process a thread lock (flock does not exclude threads that share an open file: a member's
watcher thread reads its requests while its owner takes grants).

Every read or change of the record takes the lock; the only lock-free accesses are a member's
reads of its own ``request`` and writes of its own ``reclaimable`` (aligned 8-byte fields that
only hint; ``request`` is read again under the lock before it is served). A handle belongs to
the process that opened it: used in a forked child it raises ``LedgerError``.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import mmap
import os
import re
import stat
import struct
import threading
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from .errors import InvalidConfig, LedgerCorrupt, LedgerError, LedgerMismatch, OutOfPages
from .sizes import format_size, parse_size

MAGIC = b"VMKVLDG1"
VERSION = 2
NUM_SLOTS = 32
MAX_BUDGET = (1 << 63) - 1
"""The largest budget a ledger records (its fields are 64-bit)."""
LEDGER_DIR = "/dev/shm"
_HEADER = struct.Struct("<8sIIQ")  # magic, version, slots, budget; then a crc32 of these bytes
_CRC = struct.Struct("<I")
_SLOT = struct.Struct("<qQQQ32sQQQQQQQQQ")  # a slot's image: every field written under the lock
_FIELDS = ("pid", "start", "ns", "flags", "name", "page_bytes", "held", "min", "max", "grants", "returns",
           "reclaims", "request", "want")
_OFFSETS = dict(zip(_FIELDS, itertools.accumulate((32 if name == "name" else 8 for name in _FIELDS), initial=0)))
_OFFSETS["reclaimable"] = _SLOT.size  # the one field written without the lock, after the image
_SLOT_BYTES = 160
_INDEX = struct.Struct("<Q")
_JOURNAL = 64  # the journal record: the slot's index, then its new image; then the seal
_SEAL = _JOURNAL + _INDEX.size + _SLOT.size
_SLOTS = 256
FILE_BYTES = _SLOTS + NUM_SLOTS * _SLOT_BYTES
HOLDS_LOCK = 1
"""``flags`` bit: the member holds the OFD lock on its slot's first byte (module docstring)."""
_FLOCK = struct.Struct("@hhqqi4x")  # struct flock: type, whence, start, len, pid
_U64 = struct.Struct("<Q")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}
WAIT_STEP_S = 0.005


def ledger_path(name: str) -> str:
    """The file of ledger ``name``: ``/dev/shm/vmkv-ledger.NAME``, or ``name`` itself if it is a path.

    Raises:
        InvalidConfig: the name is empty or has characters other than letters, digits, ``_.-``.
    """
    if "/" in name:
        return name
    if not _NAME.match(name):
        raise InvalidConfig(f"ledger name {name!r}: use 1-64 letters, digits, '_', '.' or '-' (or a path)")
    return os.path.join(LEDGER_DIR, f"vmkv-ledger.{name}")


def check_budget(budget: int) -> int:
    """Return ``budget`` if a ledger can record it.

    Raises:
        InvalidConfig: it is not 1 B to ``MAX_BUDGET`` (8 EiB).
    """
    if not 0 < budget <= MAX_BUDGET:
        raise InvalidConfig(f"a shared budget must be 1 B to {MAX_BUDGET} B (8 EiB), got {budget} B")
    return budget


def member_max(budget: int, page_bytes: int, min_bytes: int, max_bytes: int | None, label: str) -> int:
    """The most bytes a member may hold: ``max_bytes`` (``None``: the budget), at most the budget,
    rounded down to whole pages.

    Raises:
        InvalidConfig: no page fits, or ``min_bytes`` is above it.
    """
    high = budget if max_bytes is None else min(max_bytes, budget)
    high -= high % page_bytes if page_bytes > 0 else 0
    if page_bytes <= 0 or high <= 0 or min_bytes > high:
        raise InvalidConfig(f"ledger member {label!r}: page_bytes {page_bytes}, min {min_bytes} and max "
                            f"{max_bytes} leave no page within the budget {format_size(budget)}")
    return high


@dataclass(frozen=True)
class SharedBudget:
    """A parsed ``shared_budget`` setting: ``"NAME:SIZE[,min=SIZE][,max=SIZE][,member=LABEL][,wait=SECONDS]"``.

    Attributes:
        name: the ledger's name (or path).
        budget: bytes the ledger holds for all members together.
        min_bytes: bytes this member is never asked to give back.
        max_bytes: bytes this member never holds more than (``None``: the whole budget).
        member: the label ``vmkv ledger`` shows (``None``: the program name and pid).
        wait_s: how long a member short of budget waits for others to give back before
            ``OutOfPages`` (default 2 s).
    """

    name: str
    budget: int
    min_bytes: int = 0
    max_bytes: int | None = None
    member: str | None = None
    wait_s: float = 2.0

    @classmethod
    def parse(cls, text: str) -> "SharedBudget":
        """Read a ``shared_budget`` string.

        Raises:
            InvalidConfig: it is not ``NAME:SIZE`` with optional ``,min=``, ``,max=``, ``,member=``,
                ``,wait=``; the size is 0 or past ``MAX_BUDGET``; ``max`` is 0; ``min`` is above
                ``max`` or the budget.
        """
        if not isinstance(text, str) or ":" not in text:
            raise InvalidConfig(f"shared_budget must be 'NAME:SIZE[,min=SIZE][,max=SIZE][,member=LABEL][,wait=SECONDS]', "
                                f"got {text!r}")
        name, _, rest = text.partition(":")
        size, *options = rest.split(",")
        fields: dict[str, str] = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key.strip() not in ("min", "max", "member", "wait") or key.strip() in fields:
                raise InvalidConfig(f"shared_budget: {option!r} is not min=SIZE, max=SIZE, member=LABEL or "
                                    "wait=SECONDS (each once)")
            fields[key.strip()] = value.strip()
        ledger_path(name)  # validates the name
        budget = check_budget(parse_size(size.strip(), name="shared_budget size"))
        low = parse_size(fields.get("min", "0"), name="shared_budget min")
        high = parse_size(fields["max"], name="shared_budget max") if "max" in fields else None
        if high == 0:
            raise InvalidConfig(f"shared_budget {text!r}: max must be > 0 (leave it out for no limit of its own)")
        if low > (budget if high is None else min(high, budget)):
            raise InvalidConfig(f"shared_budget {text!r}: the budget must be > 0 and min <= max <= budget")
        member = fields.get("member")
        if member is not None and not 0 < len(member.encode()) <= 32:
            raise InvalidConfig(f"shared_budget member label must be 1-32 bytes, got {member!r}")
        try:
            wait_s = float(fields.get("wait", "2"))
        except ValueError:
            wait_s = -1.0
        if not 0 <= wait_s <= 3600:
            raise InvalidConfig(f"shared_budget wait must be 0-3600 seconds, got {fields['wait']!r}")
        return cls(name, budget, low, high, member, wait_s)


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


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), or ``None`` if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            fields = stat_file.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return None if fields[0] == b"Z" else int(fields[19])


def process_alive(pid: int, start: int) -> bool:
    """Whether ``pid`` is the live process that started at ``start`` (not a zombie, not a reused pid;
    ``start`` 0: unknown, then any live ``pid`` counts)."""
    if start:
        return process_start(pid) == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_namespace() -> int:
    """This process's PID namespace (the inode of ``/proc/self/ns/pid``), or 0 if this ``/proc``
    does not show it: then no pid read from ``/proc`` means what this process's pids mean."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):  # /proc of another namespace
            return 0
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _seal(record: bytes) -> int:
    """The seal of a journal record: never 0 (0 marks an empty journal)."""
    return 1 << 32 | zlib.crc32(record)


class Ledger:
    """One host-wide budget, opened (created if need be) by every member process.

    Args:
        name: the ledger's name (``/dev/shm/vmkv-ledger.NAME``) or path.
        budget: its bytes; ``None`` to open an existing ledger whatever its budget (``vmkv ledger``).
        alive: ``alive(pid, start)`` says whether a member's process lives, where its pid can be
            judged (module docstring; tests pass their own).

    Raises:
        InvalidConfig: ``budget`` is 0 or past ``MAX_BUDGET``.
        LedgerCorrupt: the file is not a vmkv ledger, or breaks an invariant.
        LedgerMismatch: the ledger exists with another budget or version.
        LedgerError: the path is not a regular file, or cannot be opened or created (permissions,
            a read-only filesystem, no space left: the message says which; no file is left).
        FileNotFoundError: ``budget`` is ``None`` and no such ledger exists.
    """

    def __init__(self, name: str, budget: int | None, *, alive: Callable[[int, int], bool] = process_alive) -> None:
        self.path = ledger_path(name)
        self.name = name
        self._alive = alive
        self._fd = -1
        self._map: mmap.mmap | None = None
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
        """Write a complete, empty ledger as an unnamed file, then give it the path (unless
        another process did first): no process ever sees a ledger half made, and a failure
        leaves nothing behind.

        Raises:
            LedgerError: the directory is missing, read-only or full, or refuses unnamed files.
        """
        directory = os.path.dirname(self.path) or "."
        header = _HEADER.pack(MAGIC, VERSION, NUM_SLOTS, budget)
        image = bytearray(FILE_BYTES)
        image[: _HEADER.size] = header
        _CRC.pack_into(image, _HEADER.size, zlib.crc32(header))
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
        """Check the header of ``fd`` (holding its lock), map it, recover and check its record;
        return its budget."""
        size = os.fstat(fd).st_size
        head = os.pread(fd, _HEADER.size + _CRC.size, 0)
        if len(head) < _HEADER.size + _CRC.size or head[:8] != MAGIC:
            advice = "remove it if nothing uses it" if "/" not in self.name else "name the ledger by another path"
            raise LedgerCorrupt(f"{self.path} is not a vmkv ledger ({size} bytes, no ledger header); {advice}")
        _, version, slots, found = _HEADER.unpack_from(head)
        if version != VERSION:
            raise LedgerMismatch(f"{self.path} is a version {version} ledger; this vmkv reads version {VERSION}")
        if _CRC.unpack_from(head, _HEADER.size)[0] != zlib.crc32(head[: _HEADER.size]) or slots != NUM_SLOTS \
                or size != FILE_BYTES:
            raise LedgerCorrupt(f"{self.path} is a damaged vmkv ledger ({size} bytes, {slots} slots, or a bad "
                                "checksum); remove it when nothing uses it")
        if budget is not None and found != budget:
            raise LedgerMismatch(f"ledger {self.name!r} exists with a budget of {format_size(found)}, not "
                                 f"{format_size(budget)}: use the same budget, or another name")
        self._map = mmap.mmap(fd, FILE_BYTES)
        self.budget = found
        try:
            self._recover()
            self._check()
        except BaseException:
            self._map.close()
            self._map = None
            raise
        return found

    def _reopen(self) -> None:
        """Open the file the path names now (this handle's was removed by its last member)."""
        self._map.close()
        self._map = None
        os.close(self._fd)
        self._fd = -1
        self.budget = self._open(self.budget)

    # ---- the record --------------------------------------------------------------------------
    def _slot(self, index: int) -> dict:
        values = _SLOT.unpack_from(self._map, _SLOTS + index * _SLOT_BYTES)
        return dict(zip(_FIELDS, values))

    def _write(self, index: int, **fields: int | bytes) -> None:
        """Change fields of slot ``index`` (holding the lock), atomically (module docstring)."""
        slot = self._slot(index)
        slot.update(fields)
        record = _INDEX.pack(index) + _SLOT.pack(*(slot[name] for name in _FIELDS))
        self._map[_JOURNAL:_SEAL] = record
        _U64.pack_into(self._map, _SEAL, _seal(record))
        self._apply(record)
        _U64.pack_into(self._map, _SEAL, 0)

    def _apply(self, record: bytes) -> None:
        base = _SLOTS + _INDEX.unpack_from(record)[0] * _SLOT_BYTES
        self._map[base : base + _SLOT.size] = record[_INDEX.size :]

    def _recover(self) -> None:
        """Finish what a writer killed inside :meth:`_write` left (holding the lock): copy a sealed
        journal record into its slot again, drop an unsealed one."""
        (seal,) = _U64.unpack_from(self._map, _SEAL)
        if not seal:
            return
        record = bytes(self._map[_JOURNAL:_SEAL])
        if seal == _seal(record):
            if _INDEX.unpack_from(record)[0] >= NUM_SLOTS:
                raise LedgerCorrupt(f"{self.path}: its journal names no slot; the file is damaged: remove it when "
                                    "nothing uses it")
            self._apply(record)
        _U64.pack_into(self._map, _SEAL, 0)

    def _check(self) -> list[dict]:
        """All slots, after checking the invariants of the module docstring (holding the lock)."""
        slots = [self._slot(i) for i in range(NUM_SLOTS)]
        total = 0
        for index, slot in enumerate(slots):
            if slot["pid"] < 0 or (slot["pid"] == 0 and (slot["held"] or slot["page_bytes"])):
                raise LedgerCorrupt(f"{self.path}: slot {index} is inconsistent (pid {slot['pid']}, "
                                    f"holding {slot['held']} B); the file is damaged: remove it when nothing uses it")
            if slot["pid"] and not (slot["min"] <= slot["max"] and slot["held"] <= slot["max"] and slot["page_bytes"]):
                raise LedgerCorrupt(f"{self.path}: member in slot {index} breaks min <= max, held <= max")
            total += slot["held"]
        if total > self.budget:
            raise LedgerCorrupt(f"{self.path}: members hold {total} B, more than the budget {self.budget} B")
        return slots

    @contextmanager
    def locked(self) -> Iterator[list[dict]]:
        """Hold the ledger's lock; yield its slots, recovered and checked (module docstring).

        Raises:
            LedgerCorrupt: the record breaks an invariant (nothing is changed), or the ledger is closed.
            LedgerError: this process did not open the handle (a forked child).
        """
        if self._map is None:
            raise LedgerCorrupt(f"ledger {self.name!r} is closed")
        if os.getpid() != self._opener:
            raise LedgerError(f"ledger {self.name!r} was opened by process {self._opener}, not this one "
                              f"({os.getpid()}, a fork): open the ledger (or the cache) again in this process")
        with self._threads:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._recover()
                yield self._check()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    # ---- liveness ----------------------------------------------------------------------------
    def _range_lock(self, command: int, kind: int, index: int) -> int:
        arg = _FLOCK.pack(kind, os.SEEK_SET, _SLOTS + index * _SLOT_BYTES, 1, 0)
        return _FLOCK.unpack(fcntl.fcntl(self._fd, command, arg))[0]

    def _take_lock(self, index: int) -> bool:
        """Take slot ``index``'s liveness lock for this process; ``False`` if another open file
        holds it (a forked child of its dead member)."""
        try:
            self._range_lock(fcntl.F_OFD_SETLK, fcntl.F_WRLCK, index)
        except (BlockingIOError, PermissionError):
            return False
        self._locks.add(index)
        return True

    def _drop_lock(self, index: int) -> None:
        if index in self._locks:
            self._range_lock(fcntl.F_OFD_SETLK, fcntl.F_UNLCK, index)
            self._locks.discard(index)

    def _is_alive(self, index: int, slot: dict) -> bool:
        """Whether the member in slot ``index`` lives (the rule of the module docstring)."""
        if slot["flags"] & HOLDS_LOCK and index not in self._locks \
                and self._range_lock(fcntl.F_OFD_GETLK, fcntl.F_WRLCK, index) == fcntl.F_UNLCK:
            return False  # its lock went with its process
        here = pid_namespace()
        if here and slot["ns"] == here and index not in self._locks:
            return self._alive(slot["pid"], slot["start"])
        return True

    # ---- members -----------------------------------------------------------------------------
    def join(self, label: str, page_bytes: int, *, min_bytes: int = 0, max_bytes: int | None = None,
             pid: int | None = None) -> "Member":
        """Add a member holding nothing yet.

        Args:
            label: what ``vmkv ledger`` shows (1-32 bytes of UTF-8).
            page_bytes: bytes of one of its pages (it takes and gives whole pages).
            min_bytes: it is never asked to give back below this.
            max_bytes: it never holds more (``None``: the budget), rounded down to whole pages.
            pid: the member's process (default: this one, which then holds the slot's liveness
                lock; another pid is judged by its pid alone, see the module docstring).

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
                        self._reap(slots)
                        index = self._free_slot(self._check(), own)
                    if index is None:
                        raise LedgerMismatch(f"ledger {self.name!r} has {NUM_SLOTS} live members already")
                    _U64.pack_into(self._map, _SLOTS + index * _SLOT_BYTES + _OFFSETS["reclaimable"], 0)  # its hint
                    self._write(index, **fields)
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
                           reclaimable=self._reclaimable(i), want=s["want"], alive=self._is_alive(i, s))
                for i, s in enumerate(slots) if s["pid"]
            ]

    def _reclaimable(self, index: int) -> int:
        return _U64.unpack_from(self._map, _SLOTS + index * _SLOT_BYTES + _OFFSETS["reclaimable"])[0]

    def reap(self) -> int:
        """Free the slots and bytes of members whose processes are gone; return the bytes freed."""
        with self.locked() as slots:
            return self._reap(slots)

    def _reap(self, slots: list[dict]) -> int:
        freed = 0
        for index, slot in enumerate(slots):
            if slot["pid"] and not self._is_alive(index, slot):
                freed += slot["held"]
                self._clear(index)
        return freed

    def _clear(self, index: int) -> None:
        """Empty slot ``index`` (holding the lock); its requests go if no one else waits."""
        self._write(index, **{name: b"" if name == "name" else 0 for name in _FIELDS})
        self._drop_lock(index)
        self._drop_requests()

    def _drop_requests(self, *, of_the_dead: bool = False) -> None:
        """Clear every request if no member waits for them (``of_the_dead``: no live member)."""
        slots = [self._slot(i) for i in range(NUM_SLOTS)]
        if any(s["pid"] and s["want"] and (not of_the_dead or self._is_alive(i, s)) for i, s in enumerate(slots)):
            return
        for index, slot in enumerate(slots):
            if slot["request"]:
                self._write(index, request=0)

    def close(self, *, unlink_if_empty: bool = False) -> None:
        """Unmap the ledger (and remove its file if ``unlink_if_empty`` and no member is left; not
        from a forked child). Idempotent."""
        if self._map is None:
            return
        try:
            if unlink_if_empty and os.getpid() == self._opener:
                with self.locked() as slots:
                    if not any(slot["pid"] for slot in slots) and self._names(self._fd):
                        os.unlink(self.path)
        finally:
            self._map.close()
            self._map = None
            os.close(self._fd)
            self._fd = -1
            self._locks.clear()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Member:
    """One member's handle on a ledger: it takes and gives whole pages of ``page_bytes``.

    ``held`` (pages) is this process's copy of its slot's ``held``; only this handle changes it
    (other processes only clear a dead member's slot), so it is read without the lock.
    """

    def __init__(self, ledger: Ledger, slot: int, pid: int, page_bytes: int) -> None:
        self.ledger = ledger
        self.slot = slot
        self.pid = pid
        self.page_bytes = page_bytes
        self.held = 0
        self._base = _SLOTS + slot * _SLOT_BYTES

    def take(self, pages: int, *, extra: int = 0, wait_s: float = 0.0) -> int:
        """Hold at least ``pages`` pages in all, plus up to ``extra`` more if the budget has them
        (only when it takes any: a member that holds ``pages`` already returns at once, unlocked).

        Without enough free budget it reaps dead members; then, if ``wait_s > 0``, asks members
        with reclaimable bytes to give back and waits up to ``wait_s`` seconds for them (not at
        all when no member offers any: the caller preempts or fails at once).

        Returns:
            The pages it could not get (0: it holds ``pages``); with ``wait_s > 0`` always 0.

        Raises:
            OutOfPages: ``wait_s > 0`` and the budget did not free up in time (it then holds
                whatever it had before, plus what it got meanwhile), or ``pages`` is past its max.
        """
        if pages <= self.held:
            return 0
        deadline = time.monotonic() + wait_s
        reason = f"the others gave back too little within {wait_s:.1f} s"
        while True:
            with self.ledger.locked() as slots:
                short = self._grant(slots, pages, extra)
                if short and self.ledger._reap(slots):
                    slots = self.ledger._check()
                    short = self._grant(slots, pages, extra)
                if not short or wait_s <= 0:
                    self._stop_waiting()
                    return short
                if not any(s["request"] for i, s in enumerate(slots) if i != self.slot) \
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
        if self.ledger._slot(self.slot)["want"]:
            self.ledger._write(self.slot, want=0)
            self.ledger._drop_requests()

    def _grant(self, slots: list[dict], pages: int, extra: int) -> int:
        """Grant what the free budget allows towards ``pages`` (+ ``extra``); return the pages still short."""
        me = self._mine(slots)
        if pages * self.page_bytes > me["max"]:
            raise OutOfPages(f"ledger {self.ledger.name!r}: {pages} pages of {format_size(self.page_bytes)} exceed "
                             f"this member's max of {format_size(me['max'])}")
        free = self.ledger.budget - sum(slot["held"] for slot in slots)
        room = min(free, me["max"] - me["held"]) // self.page_bytes
        need = max(0, pages - self.held)
        got = min(room, need + extra)
        if got > 0:
            self.held += got
            me["held"] = self.held * self.page_bytes
            self.ledger._write(self.slot, held=me["held"], grants=me["grants"] + got)
        return max(0, need - got)

    def _mine(self, slots: list[dict]) -> dict:
        me = slots[self.slot]
        if me["pid"] != self.pid or me["held"] != self.held * self.page_bytes:
            raise LedgerCorrupt(f"ledger {self.ledger.name!r}: this member's slot was changed by another process "
                                "(was it counted dead? is /proc readable?)")
        return me

    def _ask(self, slots: list[dict], nbytes: int) -> int:
        """Post requests for ``nbytes`` on the others, largest reclaimable first; return the bytes asked."""
        self.ledger._write(self.slot, want=nbytes)
        others = sorted((i for i, s in enumerate(slots) if s["pid"] and i != self.slot),
                        key=lambda i: -self.ledger._reclaimable(i))
        asked = 0
        for index in others:
            slot = slots[index]
            offer = min(self.ledger._reclaimable(index), max(0, slot["held"] - slot["min"]), nbytes - asked)
            if offer > 0:
                self.ledger._write(index, request=slot["request"] + offer)
                asked += offer
        return asked

    def give(self, pages: int, *, reclaim: bool = False) -> None:
        """Give back ``pages`` pages (whose memory went back to the OS); ``reclaim``: on request."""
        pages = min(pages, self.held)
        if pages <= 0 and not reclaim:
            return
        with self.ledger.locked() as slots:
            me = self._mine(slots)
            self.held -= pages
            fields = {"held": self.held * self.page_bytes, "returns": me["returns"] + pages}
            if reclaim:
                fields.update(reclaims=me["reclaims"] + pages, request=0)
            self.ledger._write(self.slot, **fields)

    def asked(self) -> int:
        """Pages others asked this member to give back: read without the lock, and when there
        are any, read again under it, once requests no live member waits for are gone."""
        (nbytes,) = _U64.unpack_from(self.ledger._map, self._base + _OFFSETS["request"])
        if nbytes:
            with self.ledger.locked():
                self.ledger._drop_requests(of_the_dead=True)
                nbytes = self.ledger._slot(self.slot)["request"]
        return -(-nbytes // self.page_bytes)

    def offer(self, pages: int) -> None:
        """Say how many pages this member could give back if asked (written without the lock)."""
        _U64.pack_into(self.ledger._map, self._base + _OFFSETS["reclaimable"], max(0, pages) * self.page_bytes)

    @property
    def min_pages(self) -> int:
        """Pages this member keeps whatever it is asked."""
        (nbytes,) = _U64.unpack_from(self.ledger._map, self._base + _OFFSETS["min"])
        return -(-nbytes // self.page_bytes)

    def leave(self) -> None:
        """Give everything back and free the slot (not from a forked child: the member is its
        parent's). Idempotent."""
        if self.ledger._map is None or self.slot < 0:
            return
        if os.getpid() == self.ledger._opener:
            with self.ledger.locked() as slots:
                if slots[self.slot]["pid"] == self.pid:
                    self.ledger._clear(self.slot)
        self.held, self.slot = 0, -1


def report(name: str, *, reap: bool = False) -> list[str]:
    """What ``vmkv ledger NAME`` prints: the budget, one row per member, and a verdict line.

    Args:
        name: the ledger's name or path.
        reap: first free the slots of members whose processes are gone.

    Raises:
        FileNotFoundError: no such ledger; LedgerCorrupt, LedgerMismatch: it cannot be read.
    """
    ledger = Ledger(name, None)
    try:
        freed = ledger.reap() if reap else 0
        members = ledger.members()
        budget = ledger.budget
    finally:
        ledger.close(unlink_if_empty=reap)  # a reaped ledger with no member left goes
    used = sum(m.held for m in members)
    lines = [f"ledger {name} ({ledger.path}): budget {format_size(budget)}, held {format_size(used)}, "
             f"free {format_size(budget - used)}"]
    header = ("member", "pid", "state", "page", "held", "pages", "min", "max", "grants", "returns", "reclaims",
              "asked", "idle")
    rows = [(m.name, str(m.pid), "alive" if m.alive else "dead", format_size(m.page_bytes), format_size(m.held),
             str(m.held // m.page_bytes), format_size(m.min), format_size(m.max), str(m.grants), str(m.returns),
             str(m.reclaims), format_size(m.request), format_size(m.reclaimable)) for m in members]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows]]
    return lines + [verdict(budget, members, freed)]


def verdict(budget: int, members: list[MemberInfo], reaped: int = 0) -> str:
    """One line that says what the ledger's state means."""
    used = sum(m.held for m in members)
    dead = [m for m in members if not m.alive]
    waiting = [m for m in members if m.want]
    if not members:
        state = "no members: the whole budget is free"
    elif dead:
        state = (f"{len(dead)} dead member(s) hold {format_size(sum(m.held for m in dead))}: the next member short "
                 "of budget takes it back (or run with --reap)")
    elif waiting:
        state = (f"{', '.join(m.name for m in waiting)} wait(s) for {format_size(sum(m.want for m in waiting))}; "
                 f"the others offer {format_size(sum(m.reclaimable for m in members if not m.want))} idle")
    else:
        state = (f"{len(members)} member(s) hold {used / budget:.0%} of the budget; "
                 f"{format_size(sum(m.reclaimable for m in members))} of it idle (given back on demand)")
    return f"verdict: {state}" + (f"; reaped {format_size(reaped)} of dead members" if reaped else "")


def prometheus_lines(name: str) -> list[str]:
    """Prometheus gauges of ledger ``name``: its budget, and each member's bytes held and idle."""
    with Ledger(name, None) as ledger:
        members, budget = ledger.members(), ledger.budget
    lines = ["# HELP vmkv_ledger_budget_bytes Bytes of the host-wide KV budget this cache shares",
             "# TYPE vmkv_ledger_budget_bytes gauge", f'vmkv_ledger_budget_bytes{{ledger="{_label(name)}"}} {budget}']
    for metric, field, text in (("held_bytes", "held", "Bytes of the shared KV budget a member holds"),
                                ("idle_bytes", "reclaimable", "Bytes a member could give back when asked"),
                                ("reclaims_total", "reclaims", "Pages a member gave back on request")):
        kind = "counter" if metric.endswith("_total") else "gauge"
        lines += [f"# HELP vmkv_ledger_member_{metric} {text}", f"# TYPE vmkv_ledger_member_{metric} {kind}"]
        lines += [f'vmkv_ledger_member_{metric}{{ledger="{_label(name)}",member="{_label(m.name)}",pid="{m.pid}"}} '
                  f"{getattr(m, field)}" for m in members]
    return lines


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
