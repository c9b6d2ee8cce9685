"""The physical page pool shared by both modes: reference counts, free list, prefix index, LRU.

Pure bookkeeping over page ids ``0 .. num_pages-1`` (VMM: physical pages; paged: block indexes).
Every page is in exactly one of three states::

    free      ref == 0, no hash     on the free stack         allocate() takes these first
    cached    ref == 0, has hash    in the LRU (oldest first) allocate() evicts these next
    in use    ref >= 1              owned by sequences/slots  shared when ref >= 2

Invariants (``check()``):
    * ref[p] == 0 and hash[p] is None  <=>  p is on the free stack
    * ref[p] == 0 and hash[p] set      <=>  p is in the LRU
    * the prefix index maps hash[p] -> p for every hashed page, and nothing else
    * num_shared == number of pages with ref >= 2 (a counter: stats() is O(1))

While ``journal`` is a list, every change appends its undo; run in reverse they restore the pool
exactly, LRU order included.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count
from typing import Callable

from ..errors import OutOfPages

Undo = Callable[[], None]


class PagePool:
    """Reference-counted pages with a prefix-cache index (see the module docstring).

    Attributes:
        journal: ``None``, or a list that collects one undo function per change.
        evictions: cached pages evicted so far.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._ref = [0] * num_pages
        self._hash: list[bytes | None] = [None] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 is handed out first
        self._lru: OrderedDict[int, int] = OrderedDict()  # cached page -> stamp, oldest first
        self._stamps = count()  # increasing, so LRU order == stamp order (used by undo)
        self._index: dict[bytes, int] = {}  # prefix hash -> page
        self._shared = 0  # pages with ref >= 2
        self.evictions = 0
        self.journal: list[Undo] | None = None

    # ---- queries -----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages on the free stack (no data worth keeping)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced pages kept for their prefix hash (evictable)."""
        return len(self._lru)

    @property
    def num_in_use(self) -> int:
        """Pages with at least one owner."""
        return self.num_pages - len(self._free) - len(self._lru)

    @property
    def num_shared(self) -> int:
        """Pages with two or more owners."""
        return self._shared

    def refcount(self, page: int) -> int:
        """Owners of ``page``."""
        return self._ref[page]

    def page_hash(self, page: int) -> bytes | None:
        """The prefix hash ``page`` is cached under, if any."""
        return self._hash[page]

    def lookup(self, page_hash: bytes) -> int | None:
        """The page cached under ``page_hash`` (in use or evictable), or ``None``."""
        return self._index.get(page_hash)

    def can_allocate(self, count: int) -> bool:
        """Whether ``allocate(count)`` would succeed (free pages plus evictable cached pages)."""
        return count <= len(self._free) + len(self._lru)

    # ---- changes -----------------------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        """Take ``count`` pages, each with reference count 1: free pages first, then cached ones evicted
        least recently used first. Returns their ids in allocation order.

        Raises:
            OutOfPages: fewer than ``count`` pages are free or evictable (nothing is taken).
        """
        if not self.can_allocate(count):
            raise OutOfPages(
                f"need {count} pages but only {len(self._free)} are free and {len(self._lru)} evictable "
                f"(pool of {self.num_pages}); free sequences, call trim(), or raise memory_budget"
            )
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
                self._log(lambda page=page: self._undo_take_free(page))
            else:
                page, stamp = self._lru.popitem(last=False)
                page_hash = self._hash[page]
                del self._index[page_hash]
                self._hash[page] = None
                self.evictions += 1
                self._log(lambda page=page, stamp=stamp, page_hash=page_hash: self._undo_evict(page, stamp, page_hash))
            self._ref[page] = 1
            pages.append(page)
        return pages

    def incref(self, page: int) -> None:
        """Add an owner to ``page`` (a cached page leaves the LRU)."""
        ref = self._ref[page]
        if ref == 0:
            stamp = self._lru.pop(page)  # a page with ref 0 that someone can name is a cached one
            self._log(lambda: self._reinsert_lru(page, stamp))
        self._ref[page] = ref + 1
        self._shared += ref == 1
        self._log(lambda: self._set_ref(page, ref))

    def decref(self, page: int) -> None:
        """Drop an owner of ``page``; at zero it becomes cached (if hashed) or free."""
        ref = self._ref[page] - 1
        if ref < 0:
            raise AssertionError(f"page {page} released more often than it was taken")
        self._set_ref(page, ref)
        self._log(lambda: self._set_ref(page, ref + 1))
        if ref == 0:
            if self._hash[page] is None:
                self._free.append(page)
                self._log(self._free.pop)
            else:
                self._lru[page] = next(self._stamps)
                self._log(lambda: self._lru.pop(page))

    def register(self, page: int, page_hash: bytes) -> bool:
        """Index an in-use ``page`` under ``page_hash``; ``False`` (nothing changed) when the page is already
        hashed or another page holds that hash.
        """
        if self._hash[page] is not None or page_hash in self._index:
            return False
        self._hash[page] = page_hash
        self._index[page_hash] = page
        self._log(lambda: self.unregister(page))
        return True

    def unregister(self, page: int) -> None:
        """Drop ``page``'s prefix hash (before its contents change). The page must be in use."""
        page_hash = self._hash[page]
        if page_hash is not None:
            del self._index[page_hash]
            self._hash[page] = None
            self._log(lambda: self.register(page, page_hash))

    def evict_all(self) -> list[int]:
        """Move every cached, unreferenced page to the free stack; return their ids."""
        return self.evict_oldest(len(self._lru))

    def evict_oldest(self, count: int) -> list[int]:
        """Move up to ``count`` cached pages, oldest first, to the top of the free stack; return their ids."""
        evicted = [self._lru.popitem(last=False) for _ in range(min(count, len(self._lru)))]
        hashes = [self._hash[page] for page, _ in evicted]
        for (page, _), page_hash in zip(evicted, hashes):
            del self._index[page_hash]
            self._hash[page] = None
            self._free.append(page)
        self.evictions += len(evicted)
        self._log(lambda: self._undo_evict_oldest(evicted, hashes))
        return [page for page, _ in evicted]

    def peek_free(self, count: int) -> list[int]:
        """The free pages the next ``allocate(count)`` takes first (at most ``count``), in that order."""
        return self._free[: -count - 1 : -1] if count > 0 else []

    def free_pages(self) -> list[int]:
        """Ids on the free stack (a copy)."""
        return list(self._free)

    def state(self) -> tuple:
        """Everything that defines the pool, as comparable values (tests compare before/after)."""
        return (list(self._ref), list(self._hash), list(self._free), list(self._lru), dict(self._index), self.evictions)

    def check(self) -> None:
        """Raise ``AssertionError`` if an invariant of the module docstring is broken."""
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "a page is on the free stack twice"
        assert not free & lru, "a page is both free and cached"
        stamps = list(self._lru.values())
        assert stamps == sorted(stamps), "LRU order disagrees with its stamps"
        for page in range(self.num_pages):
            ref, page_hash = self._ref[page], self._hash[page]
            assert ref >= 0
            assert (page in free) == (ref == 0 and page_hash is None), f"free-stack invariant broken at {page}"
            assert (page in lru) == (ref == 0 and page_hash is not None), f"LRU invariant broken at {page}"
            if page_hash is not None:
                assert self._index.get(page_hash) == page, f"index does not point at page {page}"
        assert len(self._index) == sum(h is not None for h in self._hash)
        assert self._shared == sum(ref > 1 for ref in self._ref), "shared-page counter is off"

    # ---- undo helpers --------------------------------------------------------------------
    def _log(self, undo: Undo) -> None:
        if self.journal is not None:
            self.journal.append(undo)

    def _set_ref(self, page: int, ref: int) -> None:
        self._shared += (ref > 1) - (self._ref[page] > 1)
        self._ref[page] = ref

    def _undo_take_free(self, page: int) -> None:
        self._ref[page] = 0
        self._free.append(page)

    def _undo_evict(self, page: int, stamp: int, page_hash: bytes) -> None:
        self._ref[page] = 0
        self._hash[page] = page_hash
        self._index[page_hash] = page
        self.evictions -= 1
        self._reinsert_lru(page, stamp)

    def _undo_evict_oldest(self, evicted: list[tuple[int, int]], hashes: list[bytes]) -> None:
        del self._free[len(self._free) - len(evicted) :]
        for (page, _), page_hash in zip(evicted, hashes):
            self._hash[page] = page_hash
            self._index[page_hash] = page
        newer = list(self._lru.items())  # later changes were undone first: what is left is newer
        self._lru.clear()
        self._lru.update(evicted)
        self._lru.update(newer)
        self.evictions -= len(evicted)

    def _reinsert_lru(self, page: int, stamp: int) -> None:
        """Put ``page`` back at its place in the LRU (O(cached pages): only ever used by undo)."""
        later = []
        if self._lru and next(reversed(self._lru.values())) > stamp:
            later = [p for p, s in self._lru.items() if s > stamp]
        self._lru[page] = stamp
        for other in later:
            self._lru.move_to_end(other)
