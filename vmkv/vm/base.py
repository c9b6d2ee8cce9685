"""The virtual-memory backend protocol: the only layer that knows whether it runs on Linux or CUDA.

A backend owns one store of equally sized physical pages and hands out virtual ranges::

    reserve(nbytes) -> addr          # address space only, no memory behind it
    map(addr, page) / unmap(addr)    # put physical page #page at addr / take it away again
    release_page(page)               # give the page's memory back to the OS (host only)
    tensor(addr, shape, dtype)       # a zero-copy torch view of a (mapped) range
    free_reservation(addr, nbytes) / close()

Pages are created up front (``create_pages``) so the hot path never allocates. The same page
may be mapped at several addresses at once: that is how sharing works.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class VirtualMemory(ABC):
    """A source of reserved virtual ranges backed on demand by physical pages.

    Attributes:
        name: ``"host"`` or ``"cuda"``.
        device: the torch device the tensors live on.
        granularity: the smallest page size this backend can map, in bytes.
        page_size: bytes of one physical page (a multiple of ``granularity``).
        num_pages: physical pages in the store.
    """

    name: str
    device: torch.device
    granularity: int
    page_size: int
    num_pages: int

    @abstractmethod
    def reserve(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (a multiple of ``page_size``) of address space; return its address."""

    @abstractmethod
    def free_reservation(self, addr: int, nbytes: int) -> None:
        """Give back a range returned by :meth:`reserve` (its pages must be unmapped)."""

    @abstractmethod
    def map(self, addr: int, page: int) -> None:
        """Map physical page ``page`` at ``addr`` (page-aligned, inside a reservation), read-write."""

    @abstractmethod
    def unmap(self, addr: int) -> None:
        """Unmap the page at ``addr``; the address stays reserved."""

    @abstractmethod
    def release_page(self, page: int) -> None:
        """Return the memory behind an unmapped page to the operating system, if the backend can."""

    @abstractmethod
    def tensor(self, addr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` over ``addr`` without copying (touch only mapped parts)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until no kernel still uses a page (call before unmapping one that was read)."""

    @abstractmethod
    def resident_bytes(self) -> int:
        """Bytes of physical memory the page store holds right now."""

    @abstractmethod
    def close(self) -> None:
        """Release every page and reservation. Idempotent."""

    def __enter__(self) -> "VirtualMemory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
