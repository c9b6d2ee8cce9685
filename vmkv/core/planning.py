"""Planning a step's pages (:func:`plan_pages`), and the decode fast path that skips it
(:class:`DecodeFastPath`).

The fast path: a decode step for the same sequences as the last, with no call in between, needs
no page mapped, copied or unregistered while every new token lands in the page holding the token
before it (written by the last step, so private and not full). Its plan is the last one token
further (:meth:`~vmkv.core.step.StepPlan.next_decode`).
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
    """Per step: the page indexes to copy before writing, and how many pages to add. Two sequences
    writing one shared page cost one copy; ``undoable`` copies every page another owner can see.
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
    ``window``: a step that must release a page takes the full path.
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

    def next_plan(self, batch: Any, version: int,
                  parse: Callable[[Any], list[Step]]) -> tuple[StepPlan | None, list[Step] | None]:
        """``(plan, steps)``: the last plan one token further, or ``(None, steps)`` for the full path.
        ``steps`` is ``parse(batch)`` where this had to validate the batch, else ``None``. Applies when
        ``batch`` names the last decode plan's sequences in order, one token each, the version is
        unchanged and each token fits the page holding its previous one.
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
        """Decode steps that still fit, for every sequence, in the page holding its last token (0 at a boundary)."""
        tpp, limit = self.tokens_per_page, self.max_seq_len
        room = min(min((tpp - seq.length % tpp) % tpp, limit - seq.length) for seq in seqs)
        if self.window is not None:
            room = min(room, min(self.window.steps_before_release(seq) for seq in seqs))
        return room
