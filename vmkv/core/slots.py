"""The slots of a cache: which batch rows are free, and the spare pages a freed slot keeps mapped
for its next sequence (VMM's deferred reclamation)::

    slot   0        1              2        3
    held   seq "a"  -              seq "b"  -
    spare  []       [p5, p6]       []       []      a spare page holds one pool reference

Invariants (``KVCacheBase.check``): a slot is free xor held by one live sequence; a held slot has
no spare pages; spare page ``i`` of a slot is mapped at its logical page ``i``.
"""

from __future__ import annotations

from typing import Callable

from ..errors import NoFreeSlot

Drop = Callable[[int, int, int], None]
"""``drop(slot, index, page)``: stop addressing ``page`` at logical page ``index`` of ``slot``
and release its reference (journaled by the caller's ``atomic`` block)."""


class SlotTable:
    """Free slots and the spare pages of freed ones (``count``: ``max_batch_size``)."""

    def __init__(self, count: int, log: Callable[[Callable[[], None]], None]) -> None:
        self.count = count
        self.free: set[int] = set(range(count))
        self.spare: dict[int, list[int]] = {slot: [] for slot in range(count)}
        self._log = log

    def require_free(self, seq_id: object, slot: int | None = None) -> None:
        """Raise ``NoFreeSlot`` unless a slot (``slot`` itself, if given) is free for a new sequence ``seq_id``."""
        if slot is not None and slot not in self.free:
            raise NoFreeSlot(f"slot {slot} is not free for {seq_id!r}")
        if not self.free:
            raise NoFreeSlot(
                f"all {self.count} slots are in use; free a sequence before adding {seq_id!r} or raise max_batch_size"
            )

    def pick(self, want_pages: int | None, slot: int | None = None) -> int:
        """A free slot for a new sequence: ``slot`` if given, else the fewest spare pages that still cover
        ``want_pages``, else the most.
        """
        if slot is not None:
            return slot

        def fit(slot: int) -> tuple[int, int, int]:
            spare = len(self.spare[slot])
            if want_pages is not None and spare >= want_pages:
                return (0, spare, slot)
            return (1, -spare, slot)

        return min(self.free, key=fit)

    def occupy(self, slot: int) -> None:
        """A new sequence took ``slot`` (its spare pages became the sequence's or were dropped)."""
        self.spare[slot] = []
        self.free.discard(slot)

    def vacate(self, slot: int, spare: list[int]) -> None:
        """The sequence in ``slot`` ended, leaving ``spare`` pages mapped there."""
        self.spare[slot] = spare
        self.free.add(slot)

    def idle_spare(self) -> int:
        """Spare pages of free slots (pages no live sequence holds)."""
        return sum(len(self.spare[slot]) for slot in self.free)

    def drain(self, count: int, drop: Drop) -> int:
        """Drop up to ``count`` spare pages of free slots (journaled); returns how many."""
        done = 0
        for slot in sorted(self.free):
            spare = self.spare[slot]
            while spare and done < count:
                page = spare.pop()
                self._log(lambda spare=spare, page=page: spare.append(page))
                drop(slot, len(spare), page)
                done += 1
        return done

    def state(self) -> tuple:
        """The table as comparable values (tests compare before/after a failed call)."""
        return tuple(tuple(self.spare[slot]) for slot in sorted(self.spare)), tuple(sorted(self.free))
