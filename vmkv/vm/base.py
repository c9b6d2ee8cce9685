"""The virtual-memory backend protocol: the only layer that knows whether it runs on Linux or CUDA.

A backend owns one store of equally sized physical pages, created up front so the hot path never
allocates, and hands out virtual ranges::

    reserve(nbytes) -> addr          # address space only: reads as zeros, no memory behind it
    map(addr, page) / unmap(addr)    # put physical page #page at addr / back to the zero page
    release_page(page)               # give the page's memory back (host; CUDA on demand)
    provision(pages)                 # CUDA on demand: create pages' memory in one batch
    tensor(addr, shape, dtype)       # a zero-copy torch view of a (mapped) range
    free_reservation(addr, nbytes) / close()

One page may be mapped at several addresses (sharing). Invariant: every unmapped page of a
reservation is the shared read-only zero page, so reads never fault and writes there always do;
a tensor keeps its reservation alive, so it reads zeros after ``close()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..errors import InvalidConfig


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
        """Reserve ``nbytes`` (a multiple of ``page_size``) of address space, every page of it
        reading as zeros; return its address."""

    @abstractmethod
    def free_reservation(self, addr: int, nbytes: int) -> None:
        """Give back a range returned by :meth:`reserve`: its pages are unmapped now; the address
        space is freed once no tensor over it is left."""

    @abstractmethod
    def map(self, addr: int, page: int) -> None:
        """Map physical page ``page`` at ``addr`` (page-aligned, in a reservation), read-write. Call
        :meth:`synchronize` first if a kernel may still read ``addr`` (CUDA unmaps the zero page first).
        """

    def map_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Map each ``(addr, page)`` of ``pairs`` as :meth:`map` does, all or none.

        Raises:
            BackendError: as :meth:`map`.
        """
        done: list[int] = []
        try:
            for addr, page in pairs:
                self.map(addr, page)
                done.append(addr)
        except BaseException:
            for addr in reversed(done):
                self.unmap(addr)
            raise

    @abstractmethod
    def unmap(self, addr: int) -> None:
        """Unmap the page at ``addr``: it reads as zeros again; the address stays reserved."""

    @property
    def map_granule(self) -> int:
        """The smallest run :meth:`map_range` can map: a whole page here (``cuMemMap`` maps a handle from offset 0)."""
        return self.page_size

    def map_range(self, addr: int, page: int, offset: int, nbytes: int) -> None:
        """Map bytes ``[offset, offset + nbytes)`` of physical page ``page`` at ``addr`` (a second view of
        part of a page: vLLM's contiguous mode). This default maps whole pages only.

        Raises:
            InvalidConfig: the range is not a whole page (the backend cannot map parts of one).
        """
        if offset != 0 or nbytes != self.page_size:
            raise InvalidConfig(f"the {self.name} backend maps whole pages of {self.page_size} B only, "
                                f"not {nbytes} B at offset {offset}")
        self.map(addr, page)

    def unmap_range(self, addr: int, nbytes: int) -> None:
        """Put the zero page back over ``[addr, addr + nbytes)``; this default unmaps whole pages only.

        Raises:
            InvalidConfig: ``nbytes`` is not a whole number of pages.
        """
        if nbytes <= 0 or nbytes % self.page_size:
            raise InvalidConfig(f"the {self.name} backend unmaps whole pages of {self.page_size} B only, not {nbytes} B")
        for at in range(addr, addr + nbytes, self.page_size):
            self.unmap(at)

    @abstractmethod
    def release_page(self, page: int) -> None:
        """Return the memory behind an unmapped page to the operating system, if the backend can."""

    on_demand = False
    """Whether pages get memory only when provisioned (CUDA in a shared budget), not on first write."""

    def provision(self, pages: list[int]) -> int:
        """Give ``pages`` memory now, in one batch, where pages are created on demand; returns how many."""
        return 0

    @abstractmethod
    def tensor(self, addr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` over ``addr`` without copying; it keeps the reservation alive."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until no kernel still uses a page (call before unmapping one that was read)."""

    @abstractmethod
    def resident_bytes(self) -> int:
        """Bytes of physical memory the page store holds right now."""

    @abstractmethod
    def close(self) -> None:
        """Unmap every page (live tensors read zeros), release the memory; reservations go with their last
        tensor. Idempotent.
        """

    def __enter__(self) -> "VirtualMemory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
