"""Host backend: Linux virtual memory through libc (mmap + memfd), no GPU needed.

* reserve: ``mmap(PROT_READ, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``: reads hit the kernel's
  zero page, writes are a SIGSEGV.
* physical pages: one ``memfd``; page ``i`` is its range ``[i * page_size, (i + 1) * page_size)``.
* map: ``mmap(MAP_SHARED|MAP_FIXED, memfd, offset)``; unmap: read-only anonymous memory over it.
* release: ``fallocate(PUNCH_HOLE|KEEP_SIZE)`` gives the page's memory back to the OS.

    | page 7 (rw) | page 2 (rw) | zero (ro) | zero (ro) | ... zero (ro) ... |
      memfd offsets              reads: 0.0, writes: SIGSEGV, memory: none

Linux allows ``vm.max_map_count`` mappings per process (65,530 by default); neighbouring pages
merge into one mapping, every other mapped run costs up to two (:func:`free_map_count`).
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
import weakref

import torch

from ..errors import BackendError, BackendUnavailable, InvalidConfig, OutOfMappings
from ..validate import is_int, positive_int
from .base import VirtualMemory

_PROT_READ, _PROT_RW = mmap.PROT_READ, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_NORESERVE, _MAP_FIXED = 0x4000, 0x10
_ZERO_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE  # read-only: the zero page
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
MAP_HEADROOM = 2048  # mappings left to the rest of the process (libraries, the allocator, threads)
# Live backends and the mappings each may need: the limit is per process, so every open backend's
# promise counts against the next one (see mapping_room).
_PROMISES: "weakref.WeakKeyDictionary[HostVirtualMemory, int]" = weakref.WeakKeyDictionary()


def _load_libc() -> ctypes.CDLL:
    if not sys.platform.startswith("linux"):
        raise BackendUnavailable("the host backend needs Linux (mmap + memfd_create)")
    try:  # glibc's soname first: find_library runs ldconfig in a subprocess (milliseconds a cache)
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # another C library (musl)
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.fallocate.restype = ctypes.c_int
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


def free_map_count() -> int | None:
    """Mappings this process may still create before ``vm.max_map_count`` refuses more (``None``: unknown)."""
    try:
        with open(_MAX_MAP_COUNT) as limit_file:
            limit = int(limit_file.read())
        with open("/proc/self/maps", "rb") as maps:
            used = sum(1 for _ in maps)
    except (OSError, ValueError):
        return None
    return limit - used


def mapping_room() -> int | None:
    """Mappings a new backend may promise itself: what the process may still create, less what
    open backends promised (``max_mappings``) and ``MAP_HEADROOM``. ``None`` if unknown."""
    free = free_map_count()
    if free is None:
        return None
    return free - sum(_PROMISES.values()) - MAP_HEADROOM


class _Reservation:
    """One reserved address range; ``munmap`` once the backend and every tensor over it let go."""

    def __init__(self, libc: ctypes.CDLL, addr: int, nbytes: int) -> None:
        self.libc, self.addr, self.nbytes = libc, addr, nbytes

    def __del__(self) -> None:
        self.libc.munmap(self.addr, self.nbytes)


class HostVirtualMemory(VirtualMemory):
    """Linux virtual memory over a memfd page store (see the module docstring).

    Args:
        page_size: bytes of one page: a multiple of the OS page size (4 KiB).
        num_pages: pages in the store (memory only for pages written and not released).
        populate: pre-fault a page when it is mapped (``MAP_POPULATE``): the cost moves into ``map``.
        max_mappings: the most mappings this backend will ever need; refused with
            ``InvalidConfig`` above :func:`mapping_room`, and counted until ``close()``.
    """

    name = "host"

    def __init__(self, page_size: int, num_pages: int, *, populate: bool = False, max_mappings: int = 0) -> None:
        self.granularity = mmap.PAGESIZE
        if not is_int(page_size, 1) or page_size % self.granularity:
            raise InvalidConfig(f"host page_size must be a positive multiple of {self.granularity} B, got {page_size!r}")
        positive_int("num_pages", num_pages)
        room = mapping_room() if max_mappings else None
        if room is not None and max_mappings > room:
            raise InvalidConfig(
                f"this store may need {max_mappings} mappings but the process can create only {room} more "
                f"(Linux vm.max_map_count, {_MAX_MAP_COUNT}); use larger pages or raise the limit with "
                "sysctl -w vm.max_map_count=N"
            )
        self._libc = _load_libc()
        self.device = torch.device("cpu")
        self.page_size = page_size
        self.num_pages = num_pages
        self._map_flags = mmap.MAP_SHARED | _MAP_FIXED | (mmap.MAP_POPULATE if populate else 0)
        self._reservations: dict[int, _Reservation] = {}
        self._starts: list[int] = []  # sorted reservation addresses, to find the one holding an address
        self._fd = os.memfd_create("vmkv-pages", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, page_size * num_pages)
        except OSError as exc:
            os.close(self._fd)
            self._fd = -1
            raise BackendError(f"sizing the page store to {page_size * num_pages} B failed: {exc}") from None
        _PROMISES[self] = max_mappings

    def _fail(self, what: str) -> BackendError:
        err = ctypes.get_errno()
        message = f"{what} failed: {os.strerror(err)} (errno {err})"
        if err == errno.ENOMEM:
            return OutOfMappings(
                f"{message}; the process is out of memory mappings (Linux vm.max_map_count, {_MAX_MAP_COUNT}) "
                "or memory: free sequences, use larger pages, or raise the limit (sysctl -w vm.max_map_count=N)"
            )
        return BackendError(message)

    def _mmap(self, addr: int | None, nbytes: int, prot: int, flags: int, fd: int, offset: int, what: str) -> int:
        got = self._libc.mmap(addr, nbytes, prot, flags, fd, offset)
        if got is None or got == _MAP_FAILED:
            raise self._fail(what)
        return got

    def _open(self) -> None:
        if self._fd < 0:
            raise BackendError("the host backend is closed")

    def reserve(self, nbytes: int) -> int:
        """Reserve ``nbytes`` of address space reading as zeros.

        Raises:
            InvalidConfig: ``nbytes`` is not a positive multiple of the page size, or the process
                has no such span of address space left.
        """
        self._open()
        if not is_int(nbytes, 1) or nbytes % self.page_size:
            raise InvalidConfig(f"reserve: {nbytes!r} is not a positive multiple of the page size {self.page_size}")
        got = self._libc.mmap(None, nbytes, _PROT_READ, _ZERO_FLAGS, -1, 0)
        if got is None or got == _MAP_FAILED:
            err = ctypes.get_errno()
            raise InvalidConfig(
                f"reserving {nbytes} B of address space failed: {os.strerror(err)} (errno {err}); lower "
                "max_batch_size or max_seq_len (a VMM range reserves both in full)"
            )
        self._reservations[got] = _Reservation(self._libc, got, nbytes)
        bisect.insort(self._starts, got)
        return got

    def free_reservation(self, addr: int, nbytes: int) -> None:
        """Give a range back; it is unmapped now, and returned to the OS once no tensor uses it."""
        reservation = self._reservations.get(addr)
        if reservation is None or reservation.nbytes != nbytes:
            raise BackendError(f"free_reservation: ({addr:#x}, {nbytes}) is not a reservation of this backend")
        self._zero(reservation)
        del self._reservations[addr]
        self._starts.remove(addr)

    def _zero(self, reservation: _Reservation) -> None:
        """Back the whole range with the zero page again (drops every page mapped in it)."""
        self._mmap(reservation.addr, reservation.nbytes, _PROT_READ, _ZERO_FLAGS | _MAP_FIXED, -1, 0,
                   f"unmapping the reservation at {reservation.addr:#x}")

    def map(self, addr: int, page: int) -> None:
        """Map store page ``page`` read-write at ``addr`` (a page of a reservation).

        Raises:
            BackendError: ``addr`` is not a page of a reservation, ``page`` not in the store, or
                the OS refused (``OutOfMappings`` when out of mappings or memory).
        """
        self._open()
        self._check_page(page)
        self._reservation_of(addr, self.page_size, "map")
        self._mmap(addr, self.page_size, _PROT_RW, self._map_flags, self._fd, page * self.page_size,
                   f"mapping page {page} at {addr:#x}")

    def map_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Map each ``(addr, page)`` read-write, all or none; every pair is checked first.

        Raises:
            BackendError: a pair is not a page of a reservation and a page of the store, or the OS
                refused (``OutOfMappings`` when out of mappings or memory); nothing stays mapped.
        """
        self._open()
        for addr, page in pairs:
            self._check_page(page)
            self._reservation_of(addr, self.page_size, "map")
        call, size, flags, fd = self._libc.mmap, self.page_size, self._map_flags, self._fd
        for done, (addr, page) in enumerate(pairs):
            got = call(addr, size, _PROT_RW, flags, fd, page * size)
            if got is None or got == _MAP_FAILED:
                error = self._fail(f"mapping page {page} at {addr:#x}")  # errno first, before unmapping
                for back, _ in pairs[:done]:
                    self.unmap(back)
                raise error

    def unmap(self, addr: int) -> None:
        """Put the zero page back at ``addr`` (a page of a reservation).

        Raises:
            BackendError: ``addr`` is not a page of a reservation, or the OS refused.
        """
        self._open()
        self._reservation_of(addr, self.page_size, "unmap")
        self._mmap(addr, self.page_size, _PROT_READ, _ZERO_FLAGS | _MAP_FIXED, -1, 0, f"unmapping {addr:#x}")

    @property
    def map_granule(self) -> int:
        """Parts of pages map in OS pages (``mmap`` of any file range)."""
        return self.granularity

    def map_range(self, addr: int, page: int, offset: int, nbytes: int) -> None:
        """Map bytes ``[offset, offset + nbytes)`` of store page ``page`` read-write at ``addr``, all
        multiples of the OS page (4 KiB).

        Raises:
            InvalidConfig: a value is not a multiple of the OS page, or the range leaves the page.
            BackendError: ``addr`` is not inside a reservation, ``page`` not in the store, or the OS
                refused (``OutOfMappings`` when out of mappings or memory).
        """
        self._open()
        self._check_page(page)
        self._check_part(addr, offset, nbytes)
        self._reservation_of(addr, nbytes, "map_range")
        self._mmap(addr, nbytes, _PROT_RW, self._map_flags, self._fd, page * self.page_size + offset,
                   f"mapping {nbytes} B of page {page} at {addr:#x}")

    def unmap_range(self, addr: int, nbytes: int) -> None:
        """Put the zero page back over ``[addr, addr + nbytes)`` (multiples of the OS page).

        Raises:
            InvalidConfig: not multiples of the OS page.
            BackendError: the range is not inside a reservation, or the OS refused.
        """
        self._open()
        self._check_part(addr, 0, nbytes, within_page=False)
        self._reservation_of(addr, nbytes, "unmap_range")
        self._mmap(addr, nbytes, _PROT_READ, _ZERO_FLAGS | _MAP_FIXED, -1, 0, f"unmapping {nbytes} B at {addr:#x}")

    def _check_part(self, addr: int, offset: int, nbytes: int, within_page: bool = True) -> None:
        grain = self.granularity
        if (nbytes <= 0 or addr % grain or offset % grain or nbytes % grain
                or (within_page and offset + nbytes > self.page_size)):
            raise InvalidConfig(f"parts of pages are mapped and unmapped in multiples of {grain} B (a mapped part within "
                                f"one {self.page_size} B page): got {nbytes} B at offset {offset} to {addr:#x}")

    def release_page(self, page: int) -> None:
        """Give the memory behind store page ``page`` back to the OS (its contents become zeros).

        Raises:
            BackendError: ``page`` is not in the store, or the OS refused.
        """
        self._open()
        self._check_page(page)
        mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        if self._libc.fallocate(self._fd, mode, page * self.page_size, self.page_size) != 0:
            raise self._fail(f"releasing page {page}")

    def _check_page(self, page: int) -> None:
        if not is_int(page, 0) or page >= self.num_pages:
            raise BackendError(f"page {page!r} is not a page of the store (0..{self.num_pages - 1})")

    def _reservation_of(self, addr: int, nbytes: int, what: str) -> _Reservation:
        """The reservation holding ``[addr, addr + nbytes)``, else ``BackendError``: nothing outside this
        backend's reservations is ever mapped over.
        """
        index = bisect.bisect_right(self._starts, addr) - 1 if isinstance(addr, int) else -1
        reservation = self._reservations[self._starts[index]] if index >= 0 else None
        if (reservation is None or addr + nbytes > reservation.addr + reservation.nbytes
                or (what in ("map", "unmap") and (addr - reservation.addr) % self.page_size)):
            raise BackendError(f"{what}: [{addr!r}, +{nbytes}) is not inside a reservation of this backend")
        return reservation

    def tensor(self, addr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-copy tensor over ``addr`` that keeps its reservation alive (reads zeros, never faults, after
        an unmap or ``close``).
        """
        nbytes = torch.empty((), dtype=dtype).element_size()
        for dim in shape:
            nbytes *= dim
        reservation = self._reservation_of(addr, nbytes, "tensor")
        buffer = (ctypes.c_uint8 * nbytes).from_address(addr)
        buffer.reservation = reservation  # the tensor holds the buffer, the buffer the range
        return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)

    def synchronize(self) -> None:
        """CPU kernels run synchronously: nothing to wait for."""

    def resident_bytes(self) -> int:
        fd = self._fd  # read once: close() may run on another thread (stats() is thread-free)
        try:
            return os.fstat(fd).st_blocks * 512 if fd >= 0 else 0
        except OSError:  # closed in between
            return 0

    def close(self) -> None:
        """Unmap every page (views read zeros from now on) and free the page store. Idempotent."""
        errors = []
        for reservation in self._reservations.values():
            try:
                self._zero(reservation)
            except Exception as exc:  # noqa: BLE001 - keep going: the store is freed once its mappings go
                errors.append(exc)
        self._reservations.clear()
        self._starts.clear()
        _PROMISES.pop(self, None)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if errors:
            raise errors[0]

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: libc or os may be gone already
            pass
