"""Which pool page each logical page of each slot addresses: the changes of ownership.

Every change runs inside the caller's ``guard.atomic()`` and journals its inverse. The mode says
how a page is addressed (:class:`Addressing`); this module decides which page, with what references.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Protocol

import torch

from ..errors import OutOfPages
from .calls import CallGuard
from .pages import PagePool
from .sequence import RELEASED, LiveSequence
from .slots import SlotTable

if TYPE_CHECKING:
    from .budget import CacheBudget


class Addressing(Protocol):
    """How a mode addresses pool pages from slots; ``attach`` and ``detach`` journal their inverses."""

    def attach(self, slot: int, index: int, page: int, old: int | None, keep: int) -> None:
        """Make logical page ``index`` of ``slot`` address ``page`` (replacing ``old``, or ``None``).
        Copy-on-write: the first ``keep`` tokens of ``old`` (every layer, K and V) are copied first."""

    def detach(self, slot: int, index: int, page: int) -> None:
        """Make logical page ``index`` of ``slot`` (which addresses ``page``) address nothing."""

    def release(self, pages: list[int]) -> None:
        """Return the memory behind free pool pages to the OS, where the mode can."""

    def token_rows(self, slot: int, pages: list[int], start: int, count: int) -> torch.Tensor:
        """int64 rows, in a layer's flattened storage, of tokens ``start .. start + count - 1``."""

    def block_table(self, seqs: list[LiveSequence], kv_lens: list[int]) -> torch.Tensor | None:
        """The block table a kernel reads for ``seqs`` holding ``kv_lens`` tokens, or ``None``."""

    def check(self, seqs: list[LiveSequence]) -> None:
        """Raise ``AssertionError`` if the storage disagrees with the sequences' pages."""


class PageOwnership:
    """Grows, copies, adopts and drops the pages of slots (``budget``: new pages need its grants)."""

    def __init__(self, pool: PagePool, slots: SlotTable, guard: CallGuard, addressing: Addressing,
                 tokens_per_page: int) -> None:
        self.pool, self.slots, self.guard, self.addressing = pool, slots, guard, addressing
        self.tokens_per_page = tokens_per_page
        self.budget: CacheBudget | None = None

    def drop(self, slot: int, index: int, page: int) -> None:
        """Stop addressing ``page`` from ``slot``/``index`` and release that reference."""
        self.addressing.detach(slot, index, page)
        self.pool.decref(page)

    def is_private(self, page: int) -> bool:
        """One owner and no prefix hash: nothing else can read the page."""
        return self.pool.refcount(page) == 1 and self.pool.page_hash(page) is None

    def adopt_slot(self, slot: int, head: list[int]) -> list[int]:
        """Map ``head`` (referenced) as the first pages of ``slot``; return the new sequence's pages:
        ``head`` then the slot's spare pages past it.
        """
        spare = self.slots.spare[slot]
        for index, page in enumerate(head):
            old = spare[index] if index < len(spare) else None
            if page == RELEASED:  # behind a sliding window (a fork's): nothing there
                if old is not None:
                    self.drop(slot, index, old)
                continue
            self.addressing.attach(slot, index, page, old, 0)
            if old is not None:
                self.pool.decref(old)
        return head + spare[len(head) :]

    def check_room(self, count: int, keep_cached: bool = False, freed: int = 0) -> None:
        """Raise ``OutOfPages`` (changing nothing) unless :meth:`make_room` can find ``count`` pages once
        ``freed`` more are free.
        """
        spare = self.slots.idle_spare() if count > self.pool.num_free + freed else 0
        if count > self.pool.num_free + freed + (0 if keep_cached else self.pool.num_cached) + spare:
            raise OutOfPages(
                f"need {count} pages; {self.pool.num_free + freed} free, {self.pool.num_cached} cached, {spare} "
                f"spare ({self.pool.num_pages} in all); free sequences or raise memory_budget"
            )

    def make_room(self, count: int, keep_cached: bool = False) -> None:
        """Ensure ``pool.allocate(count)`` will succeed (taking spare pages back, counting on evicting cached
        ones unless ``keep_cached``) and that a shared budget granted the memory.

        Raises:
            OutOfPages: not enough even so, or the shared budget did not free up in time.
        """
        self.check_room(count, keep_cached)
        short = count - self.pool.num_free
        if short > 0:
            self.slots.drain(short, self.drop)
        if self.budget is not None:
            self.budget.cover(count)

    def grow(self, seq: LiveSequence, count: int, fresh: Iterator[int] | None = None) -> None:
        """Append ``count`` new pages to ``seq``, taken from ``fresh`` if given."""
        for page in self.pool.allocate(count) if fresh is None else [next(fresh) for _ in range(count)]:
            self.addressing.attach(seq.slot, len(seq.pages), page, None, 0)
            seq.pages.append(page)
            self.guard.log(seq.pages.pop)

    def copy_on_write(self, seq: LiveSequence, indexes: list[int], fresh: Iterator[int] | None = None) -> None:
        """Give ``seq`` private copies of the shared pages at ``indexes``, taken from ``fresh`` if given."""
        for index in indexes:
            old = seq.pages[index]
            page = self.pool.allocate(1)[0] if fresh is None else next(fresh)
            keep = min(self.tokens_per_page, max(0, seq.length - index * self.tokens_per_page))
            self.addressing.attach(seq.slot, index, page, old, keep)
            self.pool.decref(old)
            seq.pages[index] = page
            self.guard.log(lambda index=index, old=old: seq.pages.__setitem__(index, old))

    def covered(self, count: int) -> int:
        """How many of the next ``count`` free pages may be mapped now without taking pages back."""
        return min(count, self.pool.num_free) if self.budget is None else self.budget.covered(count)

    def grow_one(self, seq: LiveSequence) -> None:
        """One more page for ``seq``, all or nothing (the map-ahead worker's step: free pages only)."""
        with self.guard.atomic():
            self.grow(seq, 1)

    def drop_from(self, seq: LiveSequence, keep: int) -> None:
        """Drop the pages of ``seq`` past its first ``keep``, last first (the caller shortens ``seq.pages``)."""
        for index in range(len(seq.pages) - 1, max(keep, seq.released) - 1, -1):
            self.drop(seq.slot, index, seq.pages[index])
