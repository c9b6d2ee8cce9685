"""One live sequence as the core tracks it: its slot, its pages, its length, its known tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

SeqId = Hashable
RELEASED = -1
"""A logical page a sliding window left behind: no pool page (VMM: the zero page; paged: no block)."""


@dataclass
class LiveSequence:
    """A sequence between ``add`` (or ``fork``) and ``free``.

    Invariants (``KVCacheBase.check``): ``pages[i]`` holds tokens ``i * tpp .. (i + 1) * tpp - 1``
    with one pool reference, but the first ``released`` entries, :data:`RELEASED` (behind a window);
    ``length <= len(pages) * tpp``; ``hashes[i]`` is full page ``i``'s prefix hash; ``tokens`` are
    the known ids of positions ``0 .. len(tokens) - 1``.
    """

    seq_id: SeqId
    slot: int
    pages: list[int]
    length: int = 0  # tokens stored (including those the current step is writing)
    reserved: int = 0  # tokens reserve() guaranteed room for
    tokens: list[int] = field(default_factory=list)  # known token ids of positions 0..len-1
    hashes: list[bytes] = field(default_factory=list)  # chained hash of each full page, in order
    released: int = 0  # leading logical pages a sliding window released
