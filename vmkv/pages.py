"""The physical page pool shared by both modes: reference counts, free list, prefix index, LRU.

Pure bookkeeping over page ids ``0 .. num_pages-1``; it never touches memory, so it is tested
alone. A page id means the same thing in both modes: in VMM mode the physical pages mapped
into the virtual K/V ranges, in paged mode a block index into the block pool tensors.

Every page is in exactly one of three states::

    free      ref == 0, no hash     on the free stack         allocate() takes these first
    cached    ref == 0, has hash    in the LRU (oldest first) allocate() evicts these next
    in use    ref >= 1              owned by sequences/slots  shared when ref >= 2

Invariants (checked by ``check()`` in tests):
    * ref[p] == 0 and hash[p] is None  <=>  p is on the free stack
    * ref[p] == 0 and hash[p] set      <=>  p is in the LRU
    * the prefix index maps hash[p] -> p for every hashed page, and nothing else
"""

from __future__ import annotations

from collections import OrderedDict

from .errors import OutOfPages


class PagePool:
    """Reference-counted pages with a prefix-cache index (see the module docstring).

    Args:
        num_pages: pages in the pool; ids are ``0 .. num_pages-1``.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._ref = [0] * num_pages
        self._hash: list[bytes | None] = [None] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 is handed out first
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced pages
        self._index: dict[bytes, int] = {}  # prefix hash -> page
        self.evictions = 0

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
        return sum(1 for ref in self._ref if ref > 1)

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
        """Take ``count`` pages, each with reference count 1.

        Free pages come first (lowest id first on a fresh pool); then cached pages are evicted,
        least recently used first, and their hashes dropped.

        Returns:
            The page ids, in allocation order.

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
            else:
                page, _ = self._lru.popitem(last=False)
                del self._index[self._hash[page]]
                self._hash[page] = None
                self.evictions += 1
            self._ref[page] = 1
            pages.append(page)
        return pages

    def incref(self, page: int) -> None:
        """Add an owner to ``page`` (a cached page leaves the LRU)."""
        if self._ref[page] == 0:
            self._lru.pop(page)  # a page with ref 0 that someone can name is a cached one
        self._ref[page] += 1

    def decref(self, page: int) -> None:
        """Drop an owner of ``page``; at zero it becomes cached (if hashed) or free."""
        ref = self._ref[page] - 1
        if ref < 0:
            raise AssertionError(f"page {page} released more often than it was taken")
        self._ref[page] = ref
        if ref == 0:
            if self._hash[page] is None:
                self._free.append(page)
            else:
                self._lru[page] = None

    def register(self, page: int, page_hash: bytes) -> bool:
        """Index an in-use ``page`` under ``page_hash`` so later prompts can find it.

        Returns:
            ``False`` (and changes nothing) when the page is already hashed or another page
            holds that hash; ``True`` otherwise.
        """
        if self._hash[page] is not None or page_hash in self._index:
            return False
        self._hash[page] = page_hash
        self._index[page_hash] = page
        return True

    def unregister(self, page: int) -> None:
        """Drop ``page``'s prefix hash (before its contents change). The page must be in use."""
        page_hash = self._hash[page]
        if page_hash is not None:
            del self._index[page_hash]
            self._hash[page] = None

    def touch(self, page: int) -> None:
        """Mark a cached page as most recently used."""
        if page in self._lru:
            self._lru.move_to_end(page)

    def evict_all(self) -> list[int]:
        """Move every cached, unreferenced page to the free stack; return their ids."""
        evicted = list(self._lru)
        for page in evicted:
            del self._index[self._hash[page]]
            self._hash[page] = None
            self._free.append(page)
        self._lru.clear()
        self.evictions += len(evicted)
        return evicted

    def free_pages(self) -> list[int]:
        """Ids on the free stack (a copy)."""
        return list(self._free)

    def check(self) -> None:
        """Raise ``AssertionError`` if an invariant of the module docstring is broken."""
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "a page is on the free stack twice"
        assert not free & lru, "a page is both free and cached"
        for page in range(self.num_pages):
            ref, page_hash = self._ref[page], self._hash[page]
            assert ref >= 0
            assert (page in free) == (ref == 0 and page_hash is None), f"free-stack invariant broken at {page}"
            assert (page in lru) == (ref == 0 and page_hash is not None), f"LRU invariant broken at {page}"
            if page_hash is not None:
                assert self._index.get(page_hash) == page, f"index does not point at page {page}"
        assert len(self._index) == sum(h is not None for h in self._hash)
