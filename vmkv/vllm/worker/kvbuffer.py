"""One vLLM worker's KV buffer: a vmkv reservation whose pages are mapped on request (no vLLM).

Pages are virtual page numbers, the same on every rank; physical pages come from each rank's
own store of ``budget_pages``::

    virtual pages  | M | M | 0 | 0 | M | 0 | ... |      reads anywhere: data or zeros
    physical store   [p3, p0, ..free..]              writes to a 0 page: fault

Block 0 (vLLM's null block and padding target) stays mapped for the whole run.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from ...errors import BackendError, InvalidConfig, InvalidInput
from ...vm import VirtualMemory


def process_rss_bytes() -> int:
    """Resident set size of this process in bytes (``/proc/self/statm``), 0 where unknown."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class KVBuffer:
    """A reserved KV buffer of ``nbytes`` backed by at most ``backend.num_pages`` mapped pages (it owns
    and closes ``backend``).

    Raises:
        InvalidConfig: ``nbytes`` is not positive.
    """

    def __init__(self, backend: VirtualMemory, nbytes: int) -> None:
        if nbytes <= 0:
            raise InvalidConfig(f"KV buffer of {nbytes} B: must be positive")
        self.backend = backend
        self.page_size = backend.page_size
        self.nbytes = nbytes
        self.num_pages = -(-nbytes // self.page_size)
        self.addr = backend.reserve(self.num_pages * self.page_size)
        self._physical: dict[int, int] = {}  # virtual page -> physical page
        self._free = list(range(backend.num_pages - 1, -1, -1))  # a stack: low pages first
        self.maps = 0
        self.unmaps = 0

    @property
    def budget_pages(self) -> int:
        """Physical pages this buffer may map at once."""
        return self.backend.num_pages

    @property
    def mapped_pages(self) -> int:
        return len(self._physical)

    def is_mapped(self, page: int) -> bool:
        return page in self._physical

    def physical_page(self, page: int) -> int:
        """The store page behind mapped virtual page ``page`` (private to this rank).

        Raises:
            InvalidInput: ``page`` is not mapped.
        """
        physical = self._physical.get(page)
        if physical is None:
            raise InvalidInput(f"KV buffer: page {page} is not mapped")
        return physical

    def tensor(self) -> torch.Tensor:
        """The buffer as a flat ``int8`` tensor of ``nbytes`` (what ``torch.zeros`` gave vLLM)."""
        return self.backend.tensor(self.addr, (self.nbytes,), torch.int8)

    def apply(self, unmap: Sequence[int], to_map: Sequence[int]) -> None:
        """Unmap then map virtual pages (a step's list), after waiting for the device; validates everything
        first, and returns unmapped pages' memory to the OS where the backend can.

        Raises:
            InvalidInput: a page is out of range, unmapped twice, mapped twice, or listed twice.
            BackendError: the physical store cannot hold the maps, or the OS/driver refused a call
                (the maps of this call are undone first).
        """
        unmap, to_map = list(unmap), list(to_map)
        self._validate(unmap, to_map)
        if unmap:
            self.backend.synchronize()
            for page in unmap:
                physical = self._physical.pop(page)
                self.backend.unmap(self.addr + page * self.page_size)
                self._free.append(physical)
                self.unmaps += 1
                self.backend.release_page(physical)
        if to_map and self.backend.on_demand:  # CUDA in a shared budget: create the step's pages in one batch
            self.backend.provision(self._free[len(self._free) - len(to_map):])
        done: list[int] = []
        try:
            for page in to_map:
                physical = self._free.pop()
                try:
                    self.backend.map(self.addr + page * self.page_size, physical)
                except BackendError:
                    self._free.append(physical)
                    raise
                self._physical[page] = physical
                done.append(page)
        except BackendError:
            for page in reversed(done):
                self.backend.unmap(self.addr + page * self.page_size)
                self._free.append(self._physical.pop(page))
            raise
        self.maps += len(done)

    def _validate(self, unmap: list[int], to_map: list[int]) -> None:
        for name, pages in (("unmap", unmap), ("map", to_map)):
            if len(set(pages)) != len(pages):
                raise InvalidInput(f"KV buffer: a page is listed twice in the {name} list")
            bad = [p for p in pages if not (isinstance(p, int) and 0 <= p < self.num_pages)]
            if bad:
                raise InvalidInput(f"KV buffer: {name} pages {bad[:5]} are outside 0..{self.num_pages - 1}")
        not_mapped = [p for p in unmap if p not in self._physical]
        if not_mapped:
            raise InvalidInput(f"KV buffer: pages {not_mapped[:5]} are not mapped and cannot be unmapped")
        leaving = set(unmap)
        twice = [p for p in to_map if p in self._physical and p not in leaving]
        if twice:
            raise InvalidInput(f"KV buffer: pages {twice[:5]} are mapped already")
        if len(to_map) > len(self._free) + len(unmap):
            raise BackendError(f"KV buffer: {len(to_map)} pages to map but only {len(self._free) + len(unmap)} of "
                               f"{self.budget_pages} physical pages free: the scheduler's budget and this worker's disagree")

    def stats(self) -> dict[str, Any]:
        """Memory counters of this buffer (see :func:`vmkv.vllm.stats`)."""
        return {
            "resident_bytes": self.backend.resident_bytes(),
            "mapped_pages": self.mapped_pages,
            "mapped_bytes": self.mapped_pages * self.page_size,
            "maps": self.maps,
            "unmaps": self.unmaps,
            "page_size": self.page_size,
            "budget_pages": self.budget_pages,
            "buffer_bytes": self.nbytes,
            "backend": self.backend.name,
        }

    def close(self) -> None:
        """Unmap everything and free the store; views of the buffer then read zeros. Idempotent."""
        self._physical.clear()
        self.backend.close()
