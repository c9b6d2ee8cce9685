"""Planning a step's pages: which shared pages it must copy and how many pages it adds
(:func:`plan_pages`), and the decode fast path that skips all of it (:class:`DecodeFastPath`).

The decode fast path: a decode step (one new token per sequence) for the same sequences as the
last one, when no call changed the cache since, needs no page mapped, copied, allocated or
unregistered as long as every new token lands in the page that holds the token before it. That
page was written by the last step, so it is private (the full path copied it if it was shared,
and only a version change can share it again) and not full, so it has no prefix hash to drop
(only full pages are registered). Every storage row is then the last one + 1, and the plan is
the last plan one token further (:meth:`~vmkv.core.step.StepPlan.next_decode`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from .checks import Step
from .pages import PagePool
from .sequence import LiveSequence
from .step import StepPlan
from .window import SlidingWindow


def plan_pages(steps: list[Step], pool: PagePool, tokens_per_page: int,
               undoable: bool = False) -> tuple[list[list[int]], list[int]]:
    """For each step: the page indexes to copy before writing, and how many pages to add.

    Simulates the reference drops of earlier copies, so two sequences writing into the same
    shared page cost one copy, not two. ``undoable``: every page another owner or the prefix
    index can see is copied rather than written, so that cancelling the step
    (``KVCacheBase.cancel_step``) gives them back unchanged.
    """
    dropped: Counter[int] = Counter()
    copies, grows = [], []
    for seq, count, _ in steps:
        first = seq.length // tokens_per_page
        end = -(-(seq.length + count) // tokens_per_page)
        copy_at = []
        for index in range(first, min(end, len(seq.pages))):
            page = seq.pages[index]
            shared = pool.refcount(page) > 1 if undoable else pool.refcount(page) - dropped[page] > 1
            if shared or (undoable and pool.page_hash(page) is not None):
                dropped[page] += 1
                copy_at.append(index)
        copies.append(copy_at)
        grows.append(max(0, end - len(seq.pages)))
    return copies, grows


class DecodeFastPath:
    """The last committed plan and how many more decode steps may extend it (module docstring).

    Args:
        tokens_per_page: tokens of one page.
        max_seq_len: the longest a sequence may grow.
        window: the cache's sliding window, if any: a step that must release a page takes the
            full path.
    """

    def __init__(self, tokens_per_page: int, max_seq_len: int, window: SlidingWindow | None = None) -> None:
        self.tokens_per_page = tokens_per_page
        self.max_seq_len = max_seq_len
        self.window = window
        self.plan: StepPlan | None = None  # the last committed plan
        self.seqs: list[LiveSequence] = []  # its sequences, in its order
        self._room = 0  # decode steps the fast path may still take

    def commit(self, plan: StepPlan, seqs: list[LiveSequence], fast: bool) -> None:
        """``plan`` was committed for ``seqs`` (lengths already advanced); ``fast``: by this path."""
        self.plan, self.seqs = plan, seqs
        if fast:
            self._room -= 1
        else:
            self._room = self._room_in_pages(seqs) if plan.is_decode else 0

    def state(self) -> tuple:
        """What :meth:`restore` takes back (a cancelled step: ``KVCacheBase.cancel_step``)."""
        return self.plan, self.seqs, self._room

    def restore(self, state: tuple) -> None:
        self.plan, self.seqs, self._room = state

    def next_plan(self, batch: Any, version: int, parse: Callable[[Any], list[Step]]) -> tuple[StepPlan | None, list[Step] | None]:
        """``(plan, steps)``: the last plan one token further, or ``(None, steps)`` where the fast
        path does not apply and the step takes the full path. ``steps`` is ``parse(batch)`` where
        this had to validate the batch (token ids were given), else ``None`` (the full path
        validates it, and raises whatever error it deserves).

        It applies when ``batch`` names the last plan's sequences in the same order, one token
        each (the int ``1``, or one token id), the last plan was a decode step, nothing changed
        the cache since (``version`` is the plan's) and each sequence's new token lands within
        ``max_seq_len`` in the page holding its previous token. With counts the checks are a few
        C-level calls over the batch (``tuple``, ``map``), no Python loop.
        """
        last = self.plan
        if (last is None or last.version != version or self._room <= 0 or not isinstance(batch, dict)
                or len(batch) != len(last.seq_ids)):
            return None, None
        counts = tuple(batch.values())
        if counts == last.q_lens and set(map(type, counts)) == {int}:  # (a decode plan's q_lens are all 1)
            return (last.next_decode(version + 1) if tuple(batch) == last.seq_ids else None), None
        steps = parse(batch)  # token ids (or counts of other types): validate them first
        same = all(seq is old and count == 1 for (seq, count, _), old in zip(steps, self.seqs))
        return (last.next_decode(version + 1) if same else None), steps

    def _room_in_pages(self, seqs: list[LiveSequence]) -> int:
        """Decode steps (one token per sequence) that still fit, for every one of ``seqs``, in the
        page holding its last token and within ``max_seq_len`` (0 when one is at a page boundary)."""
        tpp, limit = self.tokens_per_page, self.max_seq_len
        room = min(min((tpp - seq.length % tpp) % tpp, limit - seq.length) for seq in seqs)
        if self.window is not None:
            room = min(room, min(self.window.steps_before_release(seq) for seq in seqs))
        return room
