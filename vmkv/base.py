"""The lifecycle both modes share: sequences, slots, page ownership, copy-on-write, prefix cache.

``KVCacheBase`` owns every decision about *which* pool page holds *which* tokens of *which*
sequence. A mode only says how a page is addressed (VMM: mapped into a slot's virtual range;
paged: written into a block-table row) through these hooks; each journals the inverse of every
change it makes (``self._log``), so a failure half-way is rolled back:

    _attach(slot, index, page, old, keep)   logical page ``index`` of ``slot`` now addresses ``page``
    _detach(slot, index, page)              ... addresses nothing (reads as zeros in VMM mode)
    _release(pages)                         give free pages' memory back to the OS (if possible)
    _token_rows(slot, pages, start, n)      storage rows of tokens ``start .. start+n-1``

Ownership, per slot::

    logical page   0      1      2      3                       (tokens_per_page tokens each)
    live seq    [ p7 ][ p2 ][ p9 ][ p4 ]    seq.pages = [7, 2, 9, 4], seq.length <= 4 * tpp
    freed slot  [ p5 ][ p6 ]                spare pages: still mapped, kept for the next sequence

Every page in ``seq.pages`` or in a slot's spare list holds one reference in the pool; a page
shared by a fork or a prefix hit holds one per owner. A write into a page with two or more
owners first copies it (copy-on-write). A step's full pages whose token ids are known enter the
prefix index at the next call into the cache, and only if that step wrote every layer (pages
whose K/V were never written are never served to another prompt).

Every public method validates everything first and raises before changing anything; what can
fail half-way (the OS or driver refusing a mapping) runs inside :func:`vmkv.calls.atomic` and
is rolled back. Calls must not overlap in time (:func:`vmkv.calls.exclusive`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch

from .calls import atomic, enter, exclusive
from .config import KVCacheConfig, PageGeometry
from .errors import (
    ConcurrentUse,
    DuplicateSequence,
    InvalidDevice,
    InvalidDtype,
    InvalidInput,
    InvalidShape,
    NoFreeSlot,
    OutOfPages,
    SequenceTooLong,
    StalePlan,
    UnknownSequence,
)
from .pages import PagePool
from .share import BudgetShare
from .step import StepPlan, make_plan
from .validate import as_int, as_layer, as_token_ids, check_seq_id

SeqId = Hashable
log = logging.getLogger("vmkv")


@dataclass
class _Sequence:
    """One live sequence. ``pages[i]`` holds its tokens ``i*tpp .. (i+1)*tpp - 1``."""

    seq_id: SeqId
    slot: int
    pages: list[int]
    length: int = 0  # tokens stored (including those the current step is writing)
    reserved: int = 0  # tokens reserve() guaranteed room for
    tokens: list[int] = field(default_factory=list)  # known token ids of positions 0..len-1
    hashes: list[bytes] = field(default_factory=list)  # chained hash of each full page, in order


class KVCacheBase(ABC):
    """Lifecycle API shared by :class:`vmkv.VirtualKVCache` and :class:`paged.PagedKVCache`.

    Subclasses set ``mode`` and ``kernel``, call ``super().__init__`` before anything that can
    fail (so ``close()`` always finds the attributes it needs), then allocate their storage.
    """

    mode: str
    kernel: str

    def __init__(self, config: KVCacheConfig, geometry: PageGeometry) -> None:
        self.config = config
        self.geometry = geometry
        self.tokens_per_page = geometry.tokens_per_page
        self.max_pages_per_seq = self.pages_for(config.max_seq_len)
        self.pool = PagePool(geometry.num_pages)
        self._seqs: dict[SeqId, _Sequence] = {}
        self._free_slots: set[int] = set(range(config.max_batch_size))
        self._spare: dict[int, list[int]] = {slot: [] for slot in range(config.max_batch_size)}
        self._keep_spare = config.deferred_reclaim and self.mode == "vmm"
        self._tokens = 0  # sum of the live sequences' lengths (stats() is O(1))
        self._version = 0
        self._owner = object()  # plans carry it: a plan of another cache is refused
        # the last step, until the next call registers its full pages: (seq_id, start) and layers written
        self._last_step: list[tuple[SeqId, int]] = []
        self._layers_written: set[int] = set()
        self._last_plan: StepPlan | None = None  # the last committed plan (the decode fast path extends it)
        self._last_seqs: list[_Sequence] = []  # its sequences, in its order
        self._decode_room = 0  # decode steps the fast path may still take (see _next_decode_plan)
        # call discipline (vmkv.calls): one thread at a time, journaled changes, broken after a failed undo
        self._lock = threading.RLock()
        self._journal: list[Callable[[], None]] | None = None
        self._closed = False
        self._broken: str | None = None
        # map ahead (VMM mode): one long-lived worker; _ahead is its pending job, joined by _join_ahead
        self._ahead: Future | None = None
        self._ahead_worker = (
            ThreadPoolExecutor(1, thread_name_prefix="vmkv-map-ahead") if config.map_ahead and self.mode == "vmm" else None
        )
        self.counters: Counter[str] = Counter()
        self._share: BudgetShare | None = None  # the host ledger this cache joined (shared_budget), if any

    # ---- hooks a mode implements ---------------------------------------------------------
    @abstractmethod
    def _attach(self, slot: int, index: int, page: int, old: int | None, keep: int) -> None:
        """Make logical page ``index`` of ``slot`` address ``page``, journaling each change.

        ``old`` is the page addressed there before (``None`` if none). Copy-on-write: the first
        ``keep`` tokens of ``old`` (every layer, K and V) are copied into ``page`` first.
        """

    @abstractmethod
    def _detach(self, slot: int, index: int, page: int) -> None:
        """Make logical page ``index`` of ``slot`` (which addresses ``page``) address nothing,
        journaling each change."""

    @abstractmethod
    def _release(self, pages: list[int]) -> None:
        """Return the memory behind free pool pages to the OS, where the mode can."""

    @abstractmethod
    def _token_rows(self, slot: int, pages: list[int], start: int, count: int) -> torch.Tensor:
        """int64 rows, in a layer's flattened ``[rows, heads, dim]`` storage, of ``count`` tokens."""

    @abstractmethod
    def _block_table(self, seqs: list[_Sequence], kv_lens: list[int]) -> torch.Tensor | None:
        """The block table a kernel needs for ``seqs`` holding ``kv_lens`` tokens (paged mode),
        or ``None``."""

    @abstractmethod
    def layer_storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V storage flattened to rows (zero-copy): ``[rows, kv_heads, head_dim]``,
        or ``[rows, head_dim]`` in the VMM head-major layout (see the modes' docstrings)."""

    @abstractmethod
    def attention(self, layer: int, q: torch.Tensor, plan: StepPlan, *, scale: float | None = None) -> torch.Tensor:
        """Attention of the step's queries ``q: [T, q_heads, head_dim]`` over each sequence's cache.

        Returns ``[T, q_heads, head_dim]``: causal within the new tokens, full over the cached
        prefix, grouped-query when ``q_heads`` is a multiple of ``num_kv_heads``.
        """

    @abstractmethod
    def kv(self, seq_id: SeqId, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K and V of one sequence in one layer, each ``[length, kv_heads, head_dim]``."""

    @abstractmethod
    def _close_storage(self) -> None:
        """Release the mode's memory (must work on a half-built cache)."""

    # ---- lifecycle -------------------------------------------------------------------------
    @exclusive
    def add(self, seq_id: SeqId, token_ids: Sequence[int] | None = None) -> int:
        """Start a sequence in a free slot, reusing cached pages of its prompt.

        Args:
            seq_id: any hashable id not in use.
            token_ids: the prompt, if known. With prefix caching on, the longest prefix of
                whole pages already cached is linked in (no copy, no new page) and counts as
                stored: ``seq_len(seq_id)`` then says how many tokens the caller may skip. At
                least one token is always left to compute.

        Returns:
            The slot (batch row) the sequence occupies.

        Raises:
            DuplicateSequence, SequenceTooLong, NoFreeSlot, InvalidInput; BackendError (or
            OutOfMappings) if the OS refused a mapping: the call was rolled back.
        """
        self._join_ahead()
        check_seq_id(seq_id)
        if seq_id in self._seqs:
            raise DuplicateSequence(f"sequence {seq_id!r} already exists; free it first or pick another id")
        tokens = [] if token_ids is None else as_token_ids(token_ids)
        if len(tokens) > self.config.max_seq_len:
            raise SequenceTooLong(
                f"prompt of {len(tokens)} tokens exceeds max_seq_len={self.config.max_seq_len}"
            )
        self._require_free_slot(seq_id)
        with atomic(self):
            self._finish_last_step()
            hits = self._match_prefix(tokens)
            slot = self._pick_slot(self.pages_for(len(tokens)) if tokens else None)
            for page, _ in hits:
                self.pool.incref(page)
            pages = self._adopt_slot(slot, [page for page, _ in hits])
        seq = self._start_sequence(seq_id, slot, pages, len(hits) * self.tokens_per_page, tokens)
        seq.hashes = [page_hash for _, page_hash in hits]
        if tokens and self.config.prefix_caching:
            self.counters["prefix_queries"] += 1
            self.counters["prefix_hits"] += bool(hits)
            self.counters["prefix_hit_tokens"] += seq.length
        return slot

    @exclusive
    def fork(self, src_id: SeqId, dst_id: SeqId) -> int:
        """Start ``dst_id`` as a copy of ``src_id`` that shares all of its pages (no copy).

        The first write of either sequence into a shared page copies that page (copy-on-write),
        so neither ever sees the other's new tokens. Forking allocates no page.

        Returns:
            The slot of ``dst_id``.

        Raises:
            UnknownSequence, DuplicateSequence, NoFreeSlot, InvalidInput; BackendError (or
            OutOfMappings) if the OS refused a mapping: the call was rolled back.
        """
        self._join_ahead()
        src = self._get(src_id)
        check_seq_id(dst_id)
        if dst_id in self._seqs:
            raise DuplicateSequence(f"cannot fork into {dst_id!r}: it already exists")
        self._require_free_slot(dst_id)
        slot = self._pick_slot(0)
        with atomic(self):
            self._finish_last_step()
            for page in src.pages:
                self.pool.incref(page)
            pages = self._adopt_slot(slot, list(src.pages))
        seq = self._start_sequence(dst_id, slot, pages, src.length, list(src.tokens))
        seq.reserved, seq.hashes = src.reserved, list(src.hashes)
        self.counters["forks"] += 1
        return slot

    @exclusive
    def reserve(self, seq_id: SeqId, num_tokens: int) -> None:
        """Guarantee room for ``num_tokens`` tokens in total, mapping pages now if needed. A plan
        from ``begin_step`` stays valid.

        Raises:
            UnknownSequence, SequenceTooLong, OutOfPages, InvalidInput; BackendError (or
            OutOfMappings) if the OS refused a mapping: the call was rolled back.
        """
        self._join_ahead()
        seq = self._get(seq_id)
        num_tokens = as_int(num_tokens, "num_tokens")
        self._check_length(seq, num_tokens)
        grow = max(0, self.pages_for(num_tokens) - len(seq.pages))
        with atomic(self):
            self._make_room(grow)
            self._grow(seq, grow)
        seq.reserved = max(seq.reserved, num_tokens)

    @exclusive
    def free(self, seq_id: SeqId) -> None:
        """End a sequence. Its full pages stay in the prefix cache; with deferred reclamation
        (VMM mode) its private pages stay mapped in the slot for the next sequence.

        Raises:
            UnknownSequence; BackendError if the OS refused to unmap a page: the call was rolled
            back.
        """
        self._join_ahead()
        seq = self._get(seq_id)
        with atomic(self):
            self._finish_last_step()  # first: its full pages stay in the prefix cache
            keep = 0
            if self._keep_spare:
                while keep < len(seq.pages) and self._is_private(seq.pages[keep]):
                    keep += 1
            for index in range(len(seq.pages) - 1, keep - 1, -1):
                self._drop(seq.slot, index, seq.pages[index])
        self._spare[seq.slot] = seq.pages[:keep]
        del self._seqs[seq_id]
        self._free_slots.add(seq.slot)
        self._tokens -= seq.length
        self._version += 1
        if self._share is not None:
            self._ledger_boundary()

    @exclusive
    def truncate(self, seq_id: SeqId, length: int) -> None:
        """Forget the tokens of ``seq_id`` from position ``length`` on (pages stay until ``trim``).

        Raises:
            UnknownSequence, InvalidInput (length negative or beyond the sequence).
        """
        self._join_ahead()
        seq = self._get(seq_id)
        length = as_int(length, "truncate length")
        if length > seq.length:
            raise InvalidInput(f"truncate length must be in 0..{seq.length}, got {length}")
        with atomic(self):
            self._finish_last_step()
        self._tokens -= seq.length - length
        seq.length = length
        del seq.tokens[length:]
        del seq.hashes[length // self.tokens_per_page :]
        self._version += 1

    @exclusive
    def trim(self, keep_cached: bool = False) -> int:
        """Return every page no live sequence needs to the pool, and free memory to the OS.

        Unmaps the spare pages of freed slots and pages of live sequences beyond
        ``max(length, reserved)``; unless ``keep_cached``, also drops the prefix cache.

        Returns:
            The number of pages that became free.

        Raises:
            BackendError: the OS refused to unmap a page (the call was rolled back), or to take
                some free page's memory back (the pages are free in the pool all the same: call
                ``trim()`` again to retry).
        """
        self._join_ahead()
        before = self.pool.num_free
        needs = {seq.seq_id: self.pages_for(max(seq.length, seq.reserved)) for seq in self._seqs.values()}
        with atomic(self):
            self._finish_last_step()
            for slot in sorted(self._free_slots):
                spare = self._spare[slot]
                for index in range(len(spare) - 1, -1, -1):
                    self._drop(slot, index, spare[index])
            for seq in self._seqs.values():
                for index in range(len(seq.pages) - 1, needs[seq.seq_id] - 1, -1):
                    self._drop(seq.slot, index, seq.pages[index])
            if not keep_cached:
                self.pool.evict_all()
        for slot in self._free_slots:
            self._spare[slot] = []
        for seq in self._seqs.values():
            del seq.pages[needs[seq.seq_id] :]
        self._version += 1
        self._release(self.pool.free_pages())
        if self._share is not None:
            self._share.member.give(self._share.member.held - self._backed())
            self._ledger_boundary()
        return self.pool.num_free - before

    # ---- a step ----------------------------------------------------------------------------
    @exclusive
    def begin_step(self, batch: Mapping[SeqId, int | Sequence[int]]) -> StepPlan:
        """Make room for a step's new tokens and build the metadata every layer will use.

        Args:
            batch: for each sequence of the step, the number of new tokens, or their token ids
                (ids let full pages enter the prefix cache). Prefill chunks and single decode
                tokens mix freely.

        Returns:
            The :class:`StepPlan` to pass to ``write`` and ``attention`` for every layer. Any
            later call that changes the cache makes it stale.

        Raises:
            UnknownSequence, SequenceTooLong, OutOfPages, InvalidInput; BackendError (or
            OutOfMappings) if the OS refused a mapping: the call was rolled back.
        """
        self._join_ahead()
        plan, steps = self._next_decode_plan(batch)
        copies = 0
        if plan is not None:  # the decode fast path: nothing to map, copy or unregister
            self._finish_last_step()  # outside ``atomic``: nothing after it can fail
            seqs = self._last_seqs
            for seq, _, ids in steps or ():  # token ids given: record them where the ids so far are known
                if ids is not None and len(seq.tokens) >= seq.length:  # (else, as for a count, nothing to do)
                    seq.tokens[seq.length : seq.length + 1] = ids
            self._last_step = [(seq.seq_id, seq.length) for seq in seqs]
            for seq in seqs:
                seq.length += 1
            self._tokens += len(seqs)
            self._decode_room -= 1
        else:
            steps = steps or self._check_batch(batch)
            with atomic(self):
                self._finish_last_step()
                plan, copies = self._map_step(steps)
            for seq, count, ids in steps:
                self._unregister_written(seq, count)
                if ids is not None and len(seq.tokens) >= seq.length:
                    seq.tokens[seq.length : seq.length + count] = ids
                elif len(seq.tokens) < seq.length + count:
                    del seq.tokens[seq.length :]  # ids unknown from here on: stop hashing
                self._last_step.append((seq.seq_id, seq.length))
                seq.length += count
                self._tokens += count
            seqs = [seq for seq, _, _ in steps]
            self._decode_room = self._room_in_pages(seqs) if plan.is_decode else 0
        self.counters["cow_copies"] += copies
        self._layers_written = set()
        self._version += 1
        self._last_plan, self._last_seqs = plan, seqs
        if self._share is not None:  # after the commit: a step that fails changes nothing
            self._ledger_boundary()
        if self._ahead_worker is not None:
            self._start_map_ahead(plan)
        return plan

    def _map_step(self, steps: list[tuple[_Sequence, int, Any]]) -> tuple[StepPlan, int]:
        """Copy shared pages written into, map the pages the step needs, and build its plan
        (journaled, inside the caller's ``atomic``; nothing is committed). Returns the plan and
        the number of pages copied."""
        copies, grows = self._plan_pages(steps)
        self._make_room(sum(len(c) for c in copies) + sum(grows))
        for (seq, _, _), copy_at, grow in zip(steps, copies, grows):
            self._copy_on_write(seq, copy_at)
            self._grow(seq, grow)
        plan = self._build_plan([s for s, _, _ in steps], [c for _, c, _ in steps])  # may fail: before the commit
        return plan, sum(len(c) for c in copies)

    def _next_decode_plan(self, batch: Any) -> tuple[StepPlan | None, list[tuple[_Sequence, int, Any]] | None]:
        """The decode fast path: ``(plan, steps)`` with the last plan one token further
        (:meth:`StepPlan.next_decode`), or ``(None, steps)`` where it does not apply and the step
        takes the full path (``_map_step``). ``steps`` is ``_check_batch(batch)`` where this had to
        validate the batch (token ids were given), else ``None`` (the full path validates it, and
        raises whatever error it deserves).

        It applies when ``batch`` names the last plan's sequences in the same order, one token
        each (the int ``1``, or one token id), the last plan was a decode step, nothing changed
        the cache since (same version: no free, fork, truncate, add, trim) and ``_decode_room``
        says each sequence's new token lands within ``max_seq_len`` in the page holding its
        previous token. That page was written by the last step, so it is private (the full path
        copied it if it was shared, and only a version change can share it again) and not full,
        so it has no prefix hash to drop (only full pages are registered). So no page is mapped,
        copied, allocated or unregistered, and every row is the last one + 1. With counts the
        checks are a few C-level calls over the batch (``tuple``, ``map``), no Python loop.
        """
        last = self._last_plan
        if (last is None or last.version != self._version or self._decode_room <= 0 or not isinstance(batch, dict)
                or len(batch) != len(last.seq_ids)):
            return None, None
        counts = tuple(batch.values())
        if counts == last.q_lens and set(map(type, counts)) == {int}:  # (a decode plan's q_lens are all 1)
            return (last.next_decode(self._version + 1) if tuple(batch) == last.seq_ids else None), None
        steps = self._check_batch(batch)  # token ids (or counts of other types): validate them first
        same = all(seq is old and count == 1 for (seq, count, _), old in zip(steps, self._last_seqs))
        return (last.next_decode(self._version + 1) if same else None), steps

    def _room_in_pages(self, seqs: list[_Sequence]) -> int:
        """Decode steps (one token per sequence) that still fit, for every one of ``seqs``, in the
        page holding its last token and within ``max_seq_len`` (0 when one is at a page boundary)."""
        tpp, limit = self.tokens_per_page, self.config.max_seq_len
        return min(min((tpp - seq.length % tpp) % tpp, limit - seq.length) for seq in seqs)

    @exclusive
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> None:
        """Store the step's new keys and values of one layer.

        Args:
            layer: layer index.
            k, v: ``[T, kv_heads, head_dim]`` packed in the plan's order, cache dtype and device.
            plan: this step's plan from ``begin_step``.

        Raises:
            StalePlan, InvalidShape, InvalidDtype, InvalidDevice, InvalidInput.
        """
        layer = self._check_plan(plan, layer)
        shape = (plan.num_tokens, self.config.num_kv_heads, self.config.head_dim)
        for name, tensor in (("k", k), ("v", v)):
            self._check_tensor(name, tensor, shape)
        self._store(layer, k, v, plan)
        self._layers_written.add(layer)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> None:
        """Copy validated ``k``, ``v`` ``[T, kv_heads, head_dim]`` to their rows of ``layer``
        (a mode whose storage is not token rows overrides this)."""
        k_rows, v_rows = self.layer_storage(layer)
        k_rows.index_copy_(0, plan.write_rows, k)
        v_rows.index_copy_(0, plan.write_rows, v)

    # ---- queries ---------------------------------------------------------------------------
    def __contains__(self, seq_id: SeqId) -> bool:
        try:
            return seq_id in self._seqs
        except TypeError:  # unhashable: certainly not a sequence of ours
            return False

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def seq_ids(self) -> list[SeqId]:
        """Ids of the live sequences."""
        return list(self._seqs)

    def pages_for(self, num_tokens: int) -> int:
        """Pool pages that hold ``num_tokens`` tokens of one sequence.

        Raises:
            InvalidInput: ``num_tokens`` is not an int >= 0.
        """
        return -(-as_int(num_tokens, "num_tokens") // self.tokens_per_page)

    def seq_len(self, seq_id: SeqId) -> int:
        """Tokens stored for ``seq_id`` (after ``add``: the tokens found in the prefix cache)."""
        return self._get(seq_id).length

    def slot(self, seq_id: SeqId) -> int:
        """The slot (batch row) of ``seq_id``."""
        return self._get(seq_id).slot

    @exclusive
    def pages(self, seq_id: SeqId) -> list[int]:
        """Pool page ids holding ``seq_id``'s tokens, in order (a copy).

        Raises:
            UnknownSequence.
        """
        self._join_ahead()
        return list(self._get(seq_id).pages)

    def stats(self) -> dict[str, Any]:
        """Memory and sharing counters, in O(1); callable from any thread (a snapshot that a
        concurrent call may be changing). ``utilization`` = ``token_bytes / bytes_in_use``: above
        1.0 when sharing stores one page for several sequences."""
        page_bytes = self.geometry.page_bytes
        token_bytes = self._tokens * self.config.bytes_per_token
        bytes_in_use = self.pool.num_in_use * page_bytes
        return {
            "mode": self.mode,
            "kernel": self.kernel,
            "sequences": len(self._seqs),
            "pages_total": self.pool.num_pages,
            "pages_free": self.pool.num_free,
            "pages_in_use": self.pool.num_in_use,
            "pages_spare": sum(len(spare) for spare in list(self._spare.values())),
            "shared_pages": self.pool.num_shared,
            "cached_pages": self.pool.num_cached,
            "page_bytes": page_bytes,
            "tokens_per_page": self.tokens_per_page,
            "bytes_in_use": bytes_in_use,
            "tokens": self._tokens,
            "token_bytes": token_bytes,
            "utilization": token_bytes / bytes_in_use if bytes_in_use else 0.0,
            "prefix_hits": self.counters["prefix_hits"],
            "prefix_queries": self.counters["prefix_queries"],
            "prefix_hit_tokens": self.counters["prefix_hit_tokens"],
            "cow_copies": self.counters["cow_copies"],
            "forks": self.counters["forks"],
            "evictions": self.pool.evictions,
            "map_ahead_errors": self.counters["map_ahead_errors"],
        }

    @exclusive
    def check(self) -> None:
        """Raise ``AssertionError`` if page ownership (or the mode's storage, e.g. the paged block
        table) is inconsistent (used by the tests)."""
        self._join_ahead()
        self.pool.check()
        owners: Counter[int] = Counter()
        for seq in self._seqs.values():
            owners.update(seq.pages)
            assert seq.length <= len(seq.pages) * self.tokens_per_page, f"{seq.seq_id!r} outgrew its pages"
            assert seq.slot not in self._free_slots and not self._spare[seq.slot]
        for spare in self._spare.values():
            owners.update(spare)
        for page in range(self.pool.num_pages):
            assert self.pool.refcount(page) == owners[page], f"page {page}: ref != owners"
        assert self._tokens == sum(seq.length for seq in self._seqs.values()), "token counter is off"
        self._check_storage()

    def _check_storage(self) -> None:
        """The mode's own consistency checks (called by :meth:`check`, holding the lock)."""

    def state(self) -> tuple:
        """Everything that defines the cache's bookkeeping, as comparable values: a failed call
        leaves it equal (tests compare it before and after)."""
        seqs = tuple(
            (s.seq_id, s.slot, tuple(s.pages), s.length, s.reserved, tuple(s.tokens), tuple(s.hashes))
            for s in self._seqs.values()
        )
        spare = tuple(tuple(self._spare[slot]) for slot in sorted(self._spare))
        return (seqs, spare, tuple(sorted(self._free_slots)), self.pool.state(), self._version, self._tokens,
                dict(self.counters))

    # ---- closing ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release all memory; views handed out earlier stay readable (VMM: they read zeros).
        The cache is unusable afterwards. Idempotent, and works on a half-built cache.

        Raises:
            ConcurrentUse: another thread is inside the cache.
        """
        lock = getattr(self, "_lock", None)
        if lock is not None and not enter(self):
            raise ConcurrentUse("close() while another thread is inside this cache")
        try:
            if getattr(self, "_closed", False):
                return
            self._closed = True
            self._stop_map_ahead()
            self._close_storage()
            share, self._share = getattr(self, "_share", None), None
            if share is not None:
                share.close()
        finally:
            if lock is not None:
                lock.release()

    def __enter__(self) -> "KVCacheBase":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown, or a half-built object: nothing left to do
            pass

    # ---- validation ------------------------------------------------------------------------
    def _get(self, seq_id: SeqId) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequence(f"unknown sequence {seq_id!r}; add() it first") from None

    def _require_free_slot(self, seq_id: SeqId) -> None:
        if not self._free_slots:
            raise NoFreeSlot(
                f"all {self.config.max_batch_size} slots are in use; free a sequence before adding "
                f"{seq_id!r} or raise max_batch_size"
            )

    def _check_length(self, seq: _Sequence, total: int) -> None:
        if total > self.config.max_seq_len:
            raise SequenceTooLong(
                f"sequence {seq.seq_id!r} would hold {total} tokens, past max_seq_len={self.config.max_seq_len}"
            )

    def _check_batch(self, batch: Any) -> list[tuple[_Sequence, int, list[int] | None]]:
        """``(sequence, new tokens, their ids or None)`` per entry of a ``begin_step`` batch."""
        if not isinstance(batch, Mapping):
            raise InvalidInput(f"begin_step takes a mapping {{seq_id: count or token ids}}, got {type(batch).__name__}")
        if not batch:
            raise InvalidInput("begin_step needs at least one sequence")
        steps: list[tuple[_Sequence, int, list[int] | None]] = []
        for seq_id, new in batch.items():
            seq = self._get(seq_id)
            if type(new) is int and new >= 1:  # the common case (a count), checked cheaply
                ids, count = None, new
            elif isinstance(new, torch.Tensor) and new.dim() == 0:
                raise InvalidInput(
                    f"sequence {seq_id!r}: a 0-d tensor is ambiguous; pass an int count or a list of token ids"
                )
            elif isinstance(new, (bool, float)) or (hasattr(new, "__index__") and not hasattr(new, "__len__")):
                ids, count = None, as_int(new, f"new tokens of {seq_id!r}", minimum=1)  # a count (NumPy ints too)
            else:  # token ids: a list, tuple, range, 1-D tensor or array
                ids = as_token_ids(new, 1)
                count = len(ids)
            self._check_length(seq, seq.length + count)
            steps.append((seq, count, ids))
        return steps

    def _check_plan(self, plan: StepPlan, layer: int) -> int:
        """Validate a plan and layer index for this cache; return the layer as an int."""
        if not isinstance(plan, StepPlan):
            raise InvalidInput(f"plan must be the StepPlan returned by begin_step, got {type(plan).__name__}")
        if plan.owner is not self._owner:
            raise StalePlan("this plan was built by another cache; call begin_step on this one")
        if plan.version != self._version:
            raise StalePlan("the cache changed since this plan was built; call begin_step again")
        return as_layer(layer, self.config.num_layers)

    def _check_tensor(
        self, name: str, tensor: torch.Tensor, shape: tuple[int, ...], dims: str = "[tokens, kv_heads, head_dim]"
    ) -> None:
        """Refuse ``tensor`` unless it is a tensor of ``shape`` (named ``dims`` in the message), dtype and device."""
        if not isinstance(tensor, torch.Tensor):
            raise InvalidInput(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.shape != shape:  # torch.Size is a tuple: no copy
            raise InvalidShape(f"{name} must have shape {list(shape)} ({dims}), got {list(tensor.shape)}")
        if tensor.dtype != self.config.dtype:
            raise InvalidDtype(f"{name} has dtype {tensor.dtype}; the cache holds {self.config.dtype}")
        if tensor.device != self.config.device:
            raise InvalidDevice(f"{name} is on {tensor.device}; the cache lives on {self.config.device}")

    def _check_query(self, q: torch.Tensor, plan: StepPlan) -> None:
        heads = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 3 else 0
        if heads == 0 or heads % self.config.num_kv_heads:
            raise InvalidShape(
                f"q must have shape [{plan.num_tokens}, n * {self.config.num_kv_heads}, {self.config.head_dim}] "
                f"([tokens, q_heads, head_dim]), got {list(getattr(q, 'shape', []))}"
            )
        self._check_tensor("q", q, (plan.num_tokens, heads, self.config.head_dim), "[tokens, q_heads, head_dim]")

    # ---- page ownership (inside atomic(): every change is journaled) -----------------------
    def _log(self, undo: Callable[[], None]) -> None:
        if self._journal is not None:
            self._journal.append(undo)

    def _drop(self, slot: int, index: int, page: int) -> None:
        """Stop addressing ``page`` from ``slot``/``index`` and release that reference."""
        self._detach(slot, index, page)
        self.pool.decref(page)

    def _is_private(self, page: int) -> bool:
        return self.pool.refcount(page) == 1 and self.pool.page_hash(page) is None

    def _pick_slot(self, want_pages: int | None) -> int:
        """A free slot for a new sequence, reusing the spare pages it keeps mapped.

        With ``want_pages`` known: best fit, the fewest spare pages that still cover it, else the
        most. With ``None`` (size unknown): the most spare pages.
        """

        def fit(slot: int) -> tuple[int, int, int]:
            spare = len(self._spare[slot])
            if want_pages is not None and spare >= want_pages:
                return (0, spare, slot)
            return (1, -spare, slot)

        return min(self._free_slots, key=fit)

    def _adopt_slot(self, slot: int, head: list[int]) -> list[int]:
        """Map ``head`` (already referenced) as the first pages of ``slot``; return the pages of
        the new sequence: ``head`` then the slot's spare pages past it. Spare pages under ``head``
        are released. The caller commits (``_start_sequence``)."""
        spare = self._spare[slot]
        for index, page in enumerate(head):
            old = spare[index] if index < len(spare) else None
            self._attach(slot, index, page, old, 0)
            if old is not None:
                self.pool.decref(old)
        return head + spare[len(head) :]

    def _start_sequence(self, seq_id: SeqId, slot: int, pages: list[int], length: int, tokens: list[int]) -> _Sequence:
        """Commit a new sequence in ``slot`` (after ``_adopt_slot`` succeeded)."""
        self._spare[slot] = []
        self._free_slots.discard(slot)
        seq = _Sequence(seq_id, slot, pages, length, tokens=tokens)
        self._seqs[seq_id] = seq
        self._tokens += length
        self._version += 1
        return seq

    def _make_room(self, count: int) -> None:
        """Ensure ``pool.allocate(count)`` will succeed, taking spare pages back from freed slots,
        and, in a shared budget, that the ledger granted the memory it will back.

        Raises:
            OutOfPages: even with every spare page and cached page there is not enough, or the
                shared budget did not free up in time.
        """
        self._room_in_pool(count)
        if self._share is not None:
            self._cover(count)

    def _room_in_pool(self, count: int) -> None:
        short = count - self.pool.num_free
        if short <= 0:
            return
        spare_total = sum(len(s) for slot, s in self._spare.items() if slot in self._free_slots)
        if count > self.pool.num_free + self.pool.num_cached + spare_total:
            raise OutOfPages(
                f"need {count} pages; {self.pool.num_free} free, {self.pool.num_cached} cached, {spare_total} "
                f"spare ({self.pool.num_pages} in all); free sequences or raise memory_budget"
            )
        for slot in sorted(self._free_slots):
            spare = self._spare[slot]
            while spare and short > 0:
                page = spare.pop()
                self._log(lambda spare=spare, page=page: spare.append(page))
                self._drop(slot, len(spare), page)
                short -= 1

    def _grow(self, seq: _Sequence, count: int) -> None:
        for page in self.pool.allocate(count):
            self._attach(seq.slot, len(seq.pages), page, None, 0)
            seq.pages.append(page)
            self._log(seq.pages.pop)

    # ---- shared budget (vmkv.share: member.held >= _backed() at all times) -------------------
    def _backed(self) -> int:
        """Pages whose memory the cache may hold (a mode that can give memory back overrides it)."""
        return self.pool.num_pages

    def _fresh(self, pages: list[int]) -> int:
        """How many of ``pages`` hold no memory yet (mapping them backs new memory)."""
        return 0

    def _backed_after(self, count: int) -> int:
        """``_backed()`` once ``pool.allocate(count)`` took its pages (cached ones hold memory already)."""
        return self._backed() + self._fresh(self.pool.peek_free(count))

    def _cover(self, count: int) -> None:
        """Hold grants for ``allocate(count)``: from the ledger's free budget first, then by reusing
        this cache's own idle memory (spare, then cached pages), then by asking the others.

        Raises:
            OutOfPages: the others did not give back enough within the share's wait.
        """
        member = self._share.member
        held = member.held
        short = member.take(self._backed_after(count), extra=self._share.batch)
        if short:
            self._recycle(short)
            short = member.take(self._backed_after(count), extra=self._share.batch, wait_s=self._share.wait_s)
        if short:  # wait=0: no waiting, and nothing came back
            raise OutOfPages(f"ledger {self._share.ledger.name!r} is full: {short} more pages needed and no "
                             "wait allowed (wait=0); free sequences or raise the shared budget")
        if member.held > held:
            self._provision(count)

    def _provision(self, count: int) -> None:
        """Give the pages a new grant covers memory now, where the backend needs that (see VMM)."""

    def _recycle(self, count: int) -> int:
        """Put up to ``count`` idle pages that hold memory on top of the free stack (journaled):
        spare pages of freed slots first, then the oldest cached pages. Returns how many."""
        done = 0
        for slot in sorted(self._free_slots):
            spare = self._spare[slot]
            while spare and done < count:
                page = spare.pop()
                self._log(lambda spare=spare, page=page: spare.append(page))
                self._drop(slot, len(spare), page)
                done += 1
        return done + len(self.pool.evict_oldest(count - done))

    def _covered(self, count: int) -> int:
        """How many of the next ``count`` free pages the grants held cover (map ahead takes no more)."""
        count = min(count, self.pool.num_free)
        if self._share is None:
            return count
        while count and self._backed_after(count) > self._share.member.held:
            count -= 1
        return count

    def _live_pages(self) -> int:
        """Pages live sequences hold (in use, less the spare pages of freed slots)."""
        spare = sum(len(self._spare[slot]) for slot in self._free_slots)
        return self.pool.num_in_use - spare

    def _ledger_boundary(self) -> None:
        """At a step boundary: serve others' requests, and say what this cache could give back."""
        member = self._share.member
        if member.asked():
            self._give_back(member.asked())
        member.offer(member.held - max(self._live_pages(), member.min_pages))

    def _give_back(self, asked: int) -> None:
        """Release idle memory until ``asked`` grants are unused (never below what live
        sequences or the member's ``min`` need), then return the unused grants. Touches only
        pages no live sequence holds (spare pages of freed slots, cached and free pages), so a
        plan in flight stays valid."""
        member = self._share.member
        target = max(member.held - asked, self._live_pages(), member.min_pages)
        excess = self._backed() - target
        if excess > 0:
            with atomic(self):
                dirty_free = self._backed() - self.pool.num_in_use - self.pool.num_cached
                self._recycle(excess - dirty_free)
            self._release(self.pool.free_pages())
        member.give(member.held - max(target, self._backed()), reclaim=True)
        self.counters["ledger_reclaims"] += 1

    def _serve_ledger(self) -> None:
        """The watcher's entry: serve a request if no call is running. A step begun and not yet
        followed by another call may be in flight or long finished; either way giving back
        touches no page a live sequence holds, so it is served too."""
        self._share.serving = True
        try:
            if not self._lock.acquire(blocking=False):
                return  # a call is running: its next begin_step serves the request
            try:
                if not (self._closed or self._broken):
                    self._join_ahead()
                    self._ledger_boundary()
            finally:
                self._lock.release()
        finally:
            self._share.serving = False

    def _copy_on_write(self, seq: _Sequence, indexes: list[int]) -> None:
        """Give ``seq`` private copies of the shared pages at ``indexes`` (only stored tokens are copied)."""
        for index in indexes:
            old = seq.pages[index]
            (page,) = self.pool.allocate(1)
            keep = min(self.tokens_per_page, max(0, seq.length - index * self.tokens_per_page))
            self._attach(seq.slot, index, page, old, keep)
            self.pool.decref(old)
            seq.pages[index] = page
            self._log(lambda index=index, old=old: seq.pages.__setitem__(index, old))

    # ---- prefix cache ----------------------------------------------------------------------
    def _match_prefix(self, tokens: list[int]) -> list[tuple[int, bytes]]:
        """Cached pages of the longest prefix of whole pages of ``tokens`` (leaving >= 1 token)."""
        if not self.config.prefix_caching:
            return []
        hits: list[tuple[int, bytes]] = []
        parent = b""
        tpp = self.tokens_per_page
        for index in range((len(tokens) - 1) // tpp if tokens else 0):
            parent = self._page_hash(parent, tokens[index * tpp : (index + 1) * tpp])
            page = self.pool.lookup(parent)
            if page is None:
                break
            hits.append((page, parent))
        return hits

    @staticmethod
    def _page_hash(parent: bytes, tokens: list[int]) -> bytes:
        return hashlib.blake2b(parent + repr(tokens).encode(), digest_size=16).digest()

    def _register_full_pages(self, seq: _Sequence) -> None:
        """Index the full pages of ``seq`` whose token ids are known (their K/V are written)."""
        tpp = self.tokens_per_page
        full = min(seq.length, len(seq.tokens)) // tpp
        for index in range(len(seq.hashes), full):
            parent = seq.hashes[-1] if seq.hashes else b""
            page_hash = self._page_hash(parent, seq.tokens[index * tpp : (index + 1) * tpp])
            self.pool.register(seq.pages[index], page_hash)
            seq.hashes.append(page_hash)
            self._log(seq.hashes.pop)

    def _finish_last_step(self) -> None:
        """Index the full pages the last step filled, if it wrote every layer. If it did not
        (a forward pass failed half-way), its tokens' K/V are unknown: forget their ids, so
        those pages never enter the prefix cache.

        Runs (journaled) inside the calls that make the step's plan stale, after their checks:
        a call that fails finishes nothing, and queries between a step's layers change nothing.
        """
        if not self._last_step:
            return
        complete = len(self._layers_written) == self.config.num_layers
        if complete and not self.config.prefix_caching:  # nothing to index, nothing to forget
            seqs = ()
        else:
            seqs = [(self._seqs.get(seq_id), start) for seq_id, start in self._last_step]
        for seq, start in seqs:
            if seq is None:
                continue
            if not complete:
                forgotten = seq.tokens[start:]
                del seq.tokens[start:]
                self._log(lambda seq=seq, forgotten=forgotten: seq.tokens.extend(forgotten))
            else:
                self._register_full_pages(seq)
        last, self._last_step = self._last_step, []
        self._log(lambda: setattr(self, "_last_step", last))

    def _unregister_written(self, seq: _Sequence, count: int) -> None:
        """Pages this step writes into change: drop their prefix hashes (they are private now)."""
        tpp = self.tokens_per_page
        for index in range(seq.length // tpp, -(-(seq.length + count) // tpp)):
            self.pool.unregister(seq.pages[index])
        del seq.hashes[seq.length // tpp :]

    # ---- steps -----------------------------------------------------------------------------
    def _join_ahead(self) -> None:
        """Wait for background mapping. A failure there is logged and counted in ``stats()``,
        never re-raised: the worker rolled its page back, and the next step maps it itself."""
        if self._ahead is None:
            return
        ahead, self._ahead = self._ahead, None
        try:
            ahead.result()
        except Exception as exc:  # noqa: BLE001 - reported in stats() and the log
            self.counters["map_ahead_errors"] += 1
            log.warning("vmkv: mapping ahead failed (%s: %s); the next step maps the page itself",
                        type(exc).__name__, exc)

    def _plan_pages(self, steps: list[tuple[_Sequence, int, Any]]) -> tuple[list[list[int]], list[int]]:
        """For each step: the page indexes to copy before writing, and the pages to add.

        Simulates the reference drops of earlier copies, so two sequences writing into the same
        shared page cost one copy, not two.
        """
        dropped: Counter[int] = Counter()
        copies, grows = [], []
        for seq, count, _ in steps:
            first = seq.length // self.tokens_per_page
            end = self.pages_for(seq.length + count)
            copy_at = []
            for index in range(first, min(end, len(seq.pages))):
                page = seq.pages[index]
                if self.pool.refcount(page) - dropped[page] > 1:
                    dropped[page] += 1
                    copy_at.append(index)
            copies.append(copy_at)
            grows.append(max(0, end - len(seq.pages)))
        return copies, grows

    def _build_plan(self, seqs: list[_Sequence], counts: list[int]) -> StepPlan:
        """The plan of a step adding ``counts[i]`` tokens to ``seqs[i]``, built before the step is
        committed (lengths are still the old ones; the plan carries the version it commits)."""
        starts = [seq.length for seq in seqs]
        rows = [self._token_rows(seq.slot, seq.pages, s, n) for seq, s, n in zip(seqs, starts, counts)]
        kv_lens = [s + n for s, n in zip(starts, counts)]
        return make_plan(tuple(seq.seq_id for seq in seqs), [seq.slot for seq in seqs], starts, counts,
                         device=self.config.device, write_rows=torch.cat(rows).to(self.config.device),
                         block_table=self._block_table(seqs, kv_lens), version=self._version + 1, owner=self._owner)

    # ---- map ahead -------------------------------------------------------------------------
    def _start_map_ahead(self, plan: StepPlan) -> None:
        """Map the next page, on the worker thread, of each sequence whose room runs out if its
        next step is as long as this one (a decode crossing a page boundary).

        Only free pages are used; spare and cached pages are left to the next ``begin_step``,
        which also raises ``OutOfPages`` if need be.
        """
        due = []
        for seq_id, n in zip(plan.seq_ids, plan.q_lens):
            seq = self._seqs[seq_id]
            room = len(seq.pages) * self.tokens_per_page - seq.length
            if room < n and len(seq.pages) < self.max_pages_per_seq:
                due.append(seq)
        if due:
            self._ahead = self._ahead_worker.submit(self._map_ahead, due)

    def _map_ahead(self, due: list[_Sequence]) -> None:
        """On the worker: one page for each due sequence, each all or nothing."""
        for seq in due[: self._covered(len(due))]:
            with atomic(self):
                self._grow(seq, 1)
            self.counters["pages_mapped_ahead"] += 1

    def _stop_map_ahead(self) -> None:
        """Finish pending background mapping and stop the worker (at close)."""
        if getattr(self, "_ahead", None) is not None:
            self._join_ahead()
        worker = getattr(self, "_ahead_worker", None)
        if worker is not None:
            worker.shutdown()
            self._ahead_worker = None
