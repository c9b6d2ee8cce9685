"""Which pool pages of a VMM cache hold memory (the backend's physical pages behind them).

A pool page ``p`` is backed by ``num_tensors`` physical pages of the backend, one per piece
(range, and head in the head-major layout): physical page ``t * num_pages + p`` is what piece
``t`` maps for it, so pool pages ``p`` and ``p + 1`` are neighbours in the page store and, mapped
side by side, merge into one mapping.

A page holds memory from its first mapping (the host touches it; CUDA creates it, or a shared
budget's grant provisions it) until :meth:`MappedPages.release` gives it back. A shared budget
counts exactly these pages (:class:`~vmkv.core.budget.PageMemory`).
"""

from __future__ import annotations

from ..config import PageGeometry
from ..vm import VirtualMemory


class MappedPages:
    """The pool pages whose physical pages hold memory, and the numbering of those physical pages.

    Args:
        vm: the backend holding the page store.
        geometry: the cache's page geometry (``num_pages`` pool pages of ``num_tensors`` pieces).
    """

    def __init__(self, vm: VirtualMemory, geometry: PageGeometry) -> None:
        self._vm = vm
        self._geometry = geometry
        self._backed: set[int] = set()  # pool pages mapped since their memory was last released
        self.on_demand = vm.on_demand

    def piece(self, page: int, tensor: int) -> int:
        """The backend page that piece ``tensor`` maps for pool page ``page``."""
        return tensor * self._geometry.num_pages + page

    def pieces(self, page: int) -> list[int]:
        """Every backend page of pool page ``page``, piece by piece."""
        return [self.piece(page, tensor) for tensor in range(self._geometry.num_tensors)]

    def mapped(self, page: int) -> None:
        """``page`` was mapped: it holds memory until released."""
        self._backed.add(page)

    def backed(self) -> int:
        return len(self._backed)

    def fresh(self, pages: list[int]) -> int:
        return sum(page not in self._backed for page in pages)

    def provision(self, pages: list[int]) -> None:
        self._vm.provision([piece for page in pages for piece in self.pieces(page)])
        self._backed.update(pages)

    def release(self, pages: list[int]) -> None:
        """Give the memory of free ``pages`` back (only those mapped since their last release)."""
        for page in sorted(self._backed.intersection(pages)):
            for piece in self.pieces(page):
                self._vm.release_page(piece)
            self._backed.discard(page)
