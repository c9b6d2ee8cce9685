"""Sliding windows: a cache whose layers see only the last ``size`` tokens lets go of the pages
wholly behind them.

A step beginning at length ``L`` reads no key before ``L - size + 1``; ``slack`` more tokens are
kept for rollback. Older pages are released at the step's start (VMM unmaps, paged returns the
block) and become :data:`~vmkv.core.sequence.RELEASED`; positions stay absolute::

    positions   0 ........... R*tpp ....... L-size+1-slack ... L-size+1 ........ L
    pages       [ released ... ][ kept: slack, then the window ................ ][ new ]
"""

from __future__ import annotations

from ..errors import InvalidInput
from .ownership import PageOwnership
from .sequence import RELEASED, LiveSequence


class SlidingWindow:
    """What a window of ``size`` tokens (``slack`` more kept) lets a cache release, and what it forbids."""

    def __init__(self, size: int, slack: int, tokens_per_page: int) -> None:
        self.size, self.slack, self.tokens_per_page = size, slack, tokens_per_page

    def keep_from(self, length: int) -> int:
        """The first page a sequence keeps when a step begins at ``length``."""
        return max(0, length - self.size + 1 - self.slack) // self.tokens_per_page

    def behind(self, seq: LiveSequence) -> list[int]:
        """The pages of ``seq`` a step beginning now releases (wholly behind its window)."""
        return seq.pages[seq.released : min(self.keep_from(seq.length), len(seq.pages))]

    def count_behind(self, seq: LiveSequence) -> int:
        """How many pages of ``seq`` a step beginning now releases."""
        return len(self.behind(seq))

    def release(self, seq: LiveSequence, own: PageOwnership) -> None:
        """Drop the pages of ``seq`` wholly behind its window (journaled: inside the caller's ``atomic``)."""
        first = seq.released
        keep = first + len(self.behind(seq))
        for index in range(first, keep):
            page = seq.pages[index]
            own.drop(seq.slot, index, page)
            seq.pages[index] = RELEASED
            own.guard.log(lambda index=index, page=page: seq.pages.__setitem__(index, page))
        if keep > first:
            seq.released = keep
            own.guard.log(lambda: setattr(seq, "released", first))

    def steps_before_release(self, seq: LiveSequence) -> int:
        """Decode steps ``seq`` may begin before one must release a page (the fast path's room)."""
        reach = self.size - 1 + self.slack
        return max(0, (seq.released + 1) * self.tokens_per_page + reach - seq.length)

    def check_truncate(self, seq: LiveSequence, length: int) -> None:
        """Raise ``InvalidInput`` if truncating ``seq`` to ``length`` reaches into released pages."""
        floor = seq.released * self.tokens_per_page + self.size - 1 if seq.released else 0
        if length < floor:
            raise InvalidInput(
                f"cannot truncate {seq.seq_id!r} to {length} tokens: its {self.size}-token sliding window let go of "
                f"the tokens before position {seq.released * self.tokens_per_page} (the slack kept {self.slack} tokens "
                f"behind the window); the shortest length it can return to is {floor}")
