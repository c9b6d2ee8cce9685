"""Continuous batching: which sequences a step feeds, how many tokens each, and who is preempted.

Each step builds one mixed batch under a token budget: decodes first, then running prefills'
next chunks (chunked prefill never stalls decodes), then waiting sequences, oldest first, while
slots, budget and pages allow (a request of ``n`` needs ``n`` free slots). Page accounting is an
estimate; ``begin_step`` is the judge, and on ``OutOfPages`` the newest sequence is preempted to
the head of the queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..core.base import KVCacheBase
from ..validate import positive_int
from .request import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step.

    Args:
        max_num_batched_tokens: tokens one step feeds at most (decodes + prefill chunks).
        max_prefill_chunk: tokens of one sequence's prompt one step feeds at most.
    """

    max_num_batched_tokens: int = 512
    max_prefill_chunk: int = 512

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_prefill_chunk"):
            positive_int(name, getattr(self, name))


class Scheduler:
    """Waiting queue, running set and admission over one KV cache.

    Invariants:
        * a sequence is RUNNING  <=>  it is in ``running``  <=>  ``seq.seq_id in cache``
        * a RUNNING sequence's cache length equals ``seq.num_computed`` between steps
        * ``running`` is in admission order (oldest first)
    """

    def __init__(self, cache: KVCacheBase, config: SchedulerConfig) -> None:
        self.cache = cache
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._admissions = 0

    # ---- queues ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back."""
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def adopt(self, seq: Sequence) -> None:
        """Take a sequence the engine already put in the cache (a fork) as running."""
        seq.status = Status.RUNNING
        seq.admitted = self._next_admission()
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire ``seq`` (finished or aborted), freeing it from the cache if it runs there."""
        if seq.status is Status.RUNNING:
            self.cache.free(seq.seq_id)
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def preempt_newest(self) -> Sequence | None:
        """Free the most recently admitted running sequence and requeue it at the front (``None``: none runs)."""
        if not self.running:
            return None
        seq = max(self.running, key=lambda s: s.admitted)
        self.cache.free(seq.seq_id)
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.request.preemptions += 1
        self.waiting.appendleft(seq)
        self.preemptions += 1
        return seq

    @property
    def num_preempted_waiting(self) -> int:
        """Waiting sequences that had run before (preempted, to be resumed)."""
        return sum(1 for seq in self.waiting if seq.admitted >= 0)

    # ---- a step ----------------------------------------------------------------------------
    def schedule(self) -> list[tuple[Sequence, int]]:
        """This step's batch, ``(sequence, tokens to feed)`` pairs, decodes first; admits waiting sequences."""
        budget = self.config.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        for seq in self.running:  # decodes
            if seq.pending == 1 and budget > 0:
                batch.append((seq, 1))
                budget -= 1
        for seq in self.running:  # prefill chunks of sequences admitted earlier
            if seq.pending > 1 and budget > 0:
                take = min(seq.pending, budget, self.config.max_prefill_chunk)
                batch.append((seq, take))
                budget -= take
        if self.waiting and budget > 0:
            budget = self._admit(batch, budget)
        return batch

    def _admit(self, batch: list[tuple[Sequence, int]], budget: int) -> int:
        tpp = self.cache.tokens_per_page
        stats = self.cache.stats()
        available = stats["pages_free"] + stats["cached_pages"] + stats["pages_spare"]
        available -= sum(self._new_pages(seq, n, tpp) for seq, n in batch)
        free_slots = self.cache.config.max_batch_size - len(self.cache) - self._pending_forks()
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            slots = self._slots_needed(seq)
            need = -(-len(seq.tokens) // tpp)
            if slots > free_slots or need > available:
                break
            self.waiting.popleft()
            self.cache.add(seq.seq_id, token_ids=seq.tokens)
            seq.num_computed = self.cache.seq_len(seq.seq_id)
            seq.status = Status.RUNNING
            seq.admitted = self._next_admission()
            self.running.append(seq)
            take = min(seq.pending, budget, self.config.max_prefill_chunk)
            batch.append((seq, take))
            budget -= take
            free_slots -= slots
            available -= need
        return budget

    @staticmethod
    def _new_pages(seq: Sequence, count: int, tpp: int) -> int:
        """Pages feeding ``count`` more tokens to ``seq`` adds (ignoring spare pages and copies)."""
        return -(-(seq.num_computed + count) // tpp) - -(-seq.num_computed // tpp)

    @staticmethod
    def _slots_needed(seq: Sequence) -> int:
        request = seq.request
        return request.params.n if seq.index == 0 and not request.forked else 1

    def _pending_forks(self) -> int:
        """Slots promised to completions not forked yet (their parent runs)."""
        return sum(s.request.params.n - 1 for s in self.running if s.index == 0 and not s.request.forked)

    def _next_admission(self) -> int:
        self._admissions += 1
        return self._admissions
