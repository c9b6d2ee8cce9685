"""Host backend: Linux virtual memory through libc (mmap + memfd), no GPU needed.

* reserve: ``mmap(NULL, n, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)`` — address
  space only.
* physical pages: one ``memfd`` sized to the page store; page ``i`` is the file range
  ``[i * page_size, (i + 1) * page_size)``. The kernel gives it memory on first touch.
* map: ``mmap(addr, page_size, PROT_READ|PROT_WRITE, MAP_SHARED|MAP_FIXED, memfd, offset)``;
  mapping one offset at several addresses shares it.
* unmap: map ``PROT_NONE`` anonymous memory over the page with ``MAP_FIXED`` (keeps the range
  reserved; touching it again is a SIGSEGV).
* release: ``fallocate(PUNCH_HOLE|KEEP_SIZE)`` gives the page's memory back to the OS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys

import torch

from ..errors import BackendError, BackendUnavailable, InvalidConfig
from .base import VirtualMemory

_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_NORESERVE, _MAP_FIXED = 0x4000, 0x10
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value


def _load_libc() -> ctypes.CDLL:
    if not sys.platform.startswith("linux"):
        raise BackendUnavailable("the host backend needs Linux (mmap + memfd_create)")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.fallocate.restype = ctypes.c_int
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


class HostVirtualMemory(VirtualMemory):
    """Linux virtual memory over a memfd page store (see the module docstring).

    Args:
        page_size: bytes of one page: a multiple of the OS page size (4 KiB).
        num_pages: pages in the store (the memfd is ``page_size * num_pages`` bytes, but holds
            memory only for pages that were written and not released).
        populate: pre-fault a page's memory when it is mapped (``MAP_POPULATE``), so the first
            write does not take page faults; costs time in ``map`` instead.
    """

    name = "host"

    def __init__(self, page_size: int, num_pages: int, *, populate: bool = False) -> None:
        self.granularity = mmap.PAGESIZE
        if page_size <= 0 or page_size % self.granularity:
            raise InvalidConfig(f"host page_size must be a positive multiple of {self.granularity} B, got {page_size}")
        if num_pages <= 0:
            raise InvalidConfig(f"num_pages must be positive, got {num_pages}")
        self._libc = _load_libc()
        self.device = torch.device("cpu")
        self.page_size = page_size
        self.num_pages = num_pages
        self._map_flags = mmap.MAP_SHARED | _MAP_FIXED | (mmap.MAP_POPULATE if populate else 0)
        self._fd = os.memfd_create("vmkv-pages", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, page_size * num_pages)
        self._reservations: dict[int, int] = {}

    def _check(self, result: int | None, what: str) -> int:
        if result is None or result == _MAP_FAILED:
            err = ctypes.get_errno()
            raise BackendError(f"{what} failed: {os.strerror(err)} (errno {err})")
        return result

    def reserve(self, nbytes: int) -> int:
        if nbytes <= 0 or nbytes % self.page_size:
            raise InvalidConfig(f"reserve: {nbytes} is not a positive multiple of the page size {self.page_size}")
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        addr = self._check(self._libc.mmap(None, nbytes, _PROT_NONE, flags, -1, 0), f"reserving {nbytes} B")
        self._reservations[addr] = nbytes
        return addr

    def free_reservation(self, addr: int, nbytes: int) -> None:
        if self._reservations.pop(addr, None) is None:
            raise BackendError(f"free_reservation: {addr:#x} is not a reservation of this backend")
        if self._libc.munmap(addr, nbytes) != 0:
            self._check(None, "munmap")

    def map(self, addr: int, page: int) -> None:
        offset = page * self.page_size
        got = self._libc.mmap(addr, self.page_size, _PROT_RW, self._map_flags, self._fd, offset)
        self._check(got, f"mapping page {page} at {addr:#x}")

    def unmap(self, addr: int) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
        self._check(self._libc.mmap(addr, self.page_size, _PROT_NONE, flags, -1, 0), f"unmapping {addr:#x}")

    def release_page(self, page: int) -> None:
        mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        if self._libc.fallocate(self._fd, mode, page * self.page_size, self.page_size) != 0:
            self._check(None, f"releasing page {page}")

    def tensor(self, addr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize
        for dim in shape:
            nbytes *= dim
        buffer = (ctypes.c_uint8 * nbytes).from_address(addr)
        return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)

    def synchronize(self) -> None:
        """CPU kernels run synchronously: nothing to wait for."""

    def resident_bytes(self) -> int:
        return os.fstat(self._fd).st_blocks * 512

    def close(self) -> None:
        for addr, nbytes in list(self._reservations.items()):
            self.free_reservation(addr, nbytes)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: libc or os may be gone already
            pass
