"""Which pool pages of a VMM cache hold memory (the backend's physical pages behind them).

Piece ``t`` of pool page ``p`` is physical page ``t * num_pages + p``, so neighbouring pool pages
merge into one mapping. A page holds memory from its first mapping until
:meth:`MappedPages.release`; a shared budget counts exactly these pages.
"""

from __future__ import annotations

from ..config import PageGeometry
from ..vm import VirtualMemory


class MappedPages:
    """The pool pages whose physical pages hold memory, and the numbering of those physical pages."""

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
