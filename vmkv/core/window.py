"""Sliding windows: a cache whose layers all see only the last ``size`` tokens lets go of the
pages wholly behind them.

A query at position ``p`` sees keys ``p - size + 1 .. p``. When a step begins at length ``L`` its
earliest query is at ``L``, so no key before ``L - size + 1`` is read again; ``slack`` more tokens
are kept for rollback (``crop``, rejected speculative tokens). Every page wholly before that is
released at the step's start (:meth:`SlidingWindow.release`): VMM unmaps it (the zero page reads
there, the slot's addresses unchanged), paged mode returns the block; the sequence's entry becomes
:data:`~vmkv.core.sequence.RELEASED`. Tokens keep their absolute positions, so a row holds at
most ``size + slack`` tokens and a partly filled page at each end::

    positions   0 ........... R*tpp ....... L-size+1-slack ... L-size+1 ........ L
    pages       [ released ... ][ kept: slack, then the window ................ ][ new ]
"""

from __future__ import annotations

from ..errors import InvalidInput
from .ownership import PageOwnership
from .sequence import RELEASED, LiveSequence


class SlidingWindow:
    """What a window of ``size`` tokens (``slack`` more kept) lets a cache of ``tokens_per_page``
    tokens a page release, and what it forbids."""

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
        """Decode steps ``seq`` may begin before one must release a page (the decode fast path's
        room, :class:`~vmkv.core.planning.DecodeFastPath`)."""
        reach = self.size - 1 + self.slack
        return max(0, (seq.released + 1) * self.tokens_per_page + reach - seq.length)

    def check_truncate(self, seq: LiveSequence, length: int) -> None:
        """Raise ``InvalidInput`` if truncating ``seq`` to ``length`` would leave the next step's
        window reaching into released pages (a rollback beyond the slack)."""
        floor = seq.released * self.tokens_per_page + self.size - 1 if seq.released else 0
        if length < floor:
            raise InvalidInput(
                f"cannot truncate {seq.seq_id!r} to {length} tokens: its {self.size}-token sliding window let go of "
                f"the tokens before position {seq.released * self.tokens_per_page} (the slack kept {self.slack} tokens "
                f"behind the window); the shortest length it can return to is {floor}")
