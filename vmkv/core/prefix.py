"""The prefix cache: full pages found again by a chained hash of their tokens.

A full page is indexed under ``hash(parent hash, its tokens)``, so one hash names a page and
everything before it; a new prompt links in every cached page up to its first miss::

    prompt    [ t0 .. t15 ][ t16 .. t31 ][ t32 .. t40 ]     tokens_per_page = 16
    hashes      h1 = H("", t0..15)   h2 = H(h1, t16..31)      (the last page is not full)
    pool        h1 -> p7, h2 -> p2                          -> the prompt starts at 32 tokens

Invariants: a page is indexed only once every layer wrote its K/V (:meth:`PrefixIndex.finish_step`),
and leaves the index before anything is written into it again (:meth:`PrefixIndex.forget_written`).
"""

from __future__ import annotations

import hashlib
from typing import Callable, Iterable

from .pages import PagePool
from .sequence import LiveSequence


class PrefixIndex:
    """Which full pages enter and leave the pool's prefix index, and how prompts find them
    (``enabled``: ``config.prefix_caching``).
    """

    def __init__(self, pool: PagePool, tokens_per_page: int, enabled: bool,
                 log: Callable[[Callable[[], None]], None]) -> None:
        self.pool = pool
        self.tokens_per_page = tokens_per_page
        self.enabled = enabled
        self._log = log

    @staticmethod
    def page_hash(parent: bytes, tokens: list[int]) -> bytes:
        """The hash of a page holding ``tokens`` after the page hashed ``parent`` (``b""``: the first)."""
        return hashlib.blake2b(parent + repr(tokens).encode(), digest_size=16).digest()

    def match(self, tokens: list[int]) -> list[tuple[int, bytes]]:
        """``(page, hash)`` of the cached pages of the longest prefix of whole pages of ``tokens``,
        leaving at least one token to compute."""
        if not self.enabled:
            return []
        hits: list[tuple[int, bytes]] = []
        parent = b""
        tpp = self.tokens_per_page
        for index in range((len(tokens) - 1) // tpp if tokens else 0):
            parent = self.page_hash(parent, tokens[index * tpp : (index + 1) * tpp])
            page = self.pool.lookup(parent)
            if page is None:
                break
            hits.append((page, parent))
        return hits

    def register_full_pages(self, seq: LiveSequence) -> None:
        """Index the full pages of ``seq`` whose token ids are known (their K/V are written)."""
        tpp = self.tokens_per_page
        full = min(seq.length, len(seq.tokens)) // tpp
        for index in range(len(seq.hashes), full):
            parent = seq.hashes[-1] if seq.hashes else b""
            page_hash = self.page_hash(parent, seq.tokens[index * tpp : (index + 1) * tpp])
            self.pool.register(seq.pages[index], page_hash)
            seq.hashes.append(page_hash)
            self._log(seq.hashes.pop)

    def finish_step(self, written: Iterable[tuple[LiveSequence, int]], complete: bool) -> None:
        """After a step: index the full pages it filled if it wrote every layer (``complete``); else forget
        the token ids from each ``(sequence, start)`` of ``written`` on, so those pages are never served.
        """
        if complete and not self.enabled:  # nothing to index, nothing to forget
            return
        for seq, start in written:
            if not complete:
                forgotten = seq.tokens[start:]
                del seq.tokens[start:]
                self._log(lambda seq=seq, forgotten=forgotten: seq.tokens.extend(forgotten))
            else:
                self.register_full_pages(seq)

    def forget_written(self, seq: LiveSequence, count: int) -> None:
        """The next ``count`` tokens of ``seq`` change the pages they land in: drop those pages'
        hashes (they are private by now: copy-on-write ran first)."""
        tpp = self.tokens_per_page
        for index in range(seq.length // tpp, -(-(seq.length + count) // tpp)):
            self.pool.unregister(seq.pages[index])
        del seq.hashes[seq.length // tpp :]
