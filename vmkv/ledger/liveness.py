"""Who is alive: a member's process, judged across PID namespaces.

A member holds an OFD lock on its slot's first byte, dropped by the kernel when its process dies
(any namespace): no lock, dead. A held lock is alive unless, in this PID namespace, its pid is
gone, a zombie or reused. A member joined for another pid (no lock) is judged by pid only here.
"""

from __future__ import annotations

import fcntl
import os
import struct
from typing import Callable

from .format import HOLDS_LOCK, slot_offset

_FLOCK = struct.Struct("@hhqqi4x")  # struct flock: type, whence, start, len, pid


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), or ``None`` if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            fields = stat_file.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return None if fields[0] == b"Z" else int(fields[19])


def process_alive(pid: int, start: int) -> bool:
    """Whether ``pid`` is the live process that started at ``start`` (``start`` 0: any live ``pid``)."""
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
    """This process's PID namespace (the inode of ``/proc/self/ns/pid``), or 0 if unknown."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):  # /proc of another namespace
            return 0
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _range_lock(fd: int, command: int, kind: int, index: int) -> int:
    arg = _FLOCK.pack(kind, os.SEEK_SET, slot_offset(index), 1, 0)
    return _FLOCK.unpack(fcntl.fcntl(fd, command, arg))[0]


def take_lock(fd: int, index: int) -> bool:
    """Take slot ``index``'s liveness lock through open file ``fd``; ``False`` if another open
    file holds it (a forked child of its dead member)."""
    try:
        _range_lock(fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, index)
    except (BlockingIOError, PermissionError):
        return False
    return True


def drop_lock(fd: int, index: int) -> None:
    """Release slot ``index``'s liveness lock held through ``fd``."""
    _range_lock(fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, index)


def member_alive(fd: int, index: int, slot: dict, *, mine: bool, alive: Callable[[int, int], bool]) -> bool:
    """Whether the member in slot ``index`` lives (the module docstring's rule); ``mine``: this handle
    holds its lock; ``alive`` judges a pid of this namespace.
    """
    if slot["flags"] & HOLDS_LOCK and not mine \
            and _range_lock(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, index) == fcntl.F_UNLCK:
        return False  # its lock went with its process
    here = pid_namespace()
    if here and slot["ns"] == here and not mine:
        return alive(slot["pid"], slot["start"])
    return True
