"""The lifecycle both modes share: sequences and the pages that hold them.

``KVCacheBase`` decides which pool page holds which tokens of which sequence; a mode says how a
page is addressed (:class:`~vmkv.core.ownership.Addressing`) and how its storage is read (the
abstract methods). Ownership, per slot::

    logical page   0      1      2      3                       (tokens_per_page tokens each)
    live seq    [ p7 ][ p2 ][ p9 ][ p4 ]    seq.pages = [7, 2, 9, 4], seq.length <= 4 * tpp
    freed slot  [ p5 ][ p6 ]                spare pages: still mapped, kept for the next sequence

Invariants (checked by :meth:`KVCacheBase.check`): every page in ``seq.pages`` or in a slot's
spare list holds one pool reference per owner; a write into a page with two or more owners first
copies it (copy-on-write); a step's full pages enter the prefix index only once the step wrote
every layer. Every call validates first and runs what can fail half-way inside
``self.guard.atomic()`` (:mod:`vmkv.core.calls`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch

from ..config import KVCacheConfig, PageGeometry
from ..errors import ConcurrentUse, DuplicateSequence, InvalidConfig, InvalidInput, SequenceTooLong, StalePlan
from ..kernels.base import Variant
from ..ledger import SharedBudget
from ..share import close_at_exit
from ..validate import as_int, as_token_ids, check_seq_id
from .budget import CacheBudget, PageMemory
from .calls import CallGuard, exclusive, weak_method
from .checks import Step, check_length, check_plan, check_query, check_tensor, get_sequence, parse_batch
from .mapping import MapAhead
from .ownership import Addressing, PageOwnership
from .pages import PagePool
from .planning import DecodeFastPath, plan_pages
from .prefix import PrefixIndex
from .sequence import RELEASED, LiveSequence, SeqId
from .slots import SlotTable
from .step import StepPlan, make_plan
from .window import SlidingWindow


class KVCacheBase(ABC):
    """Lifecycle API shared by :class:`vmkv.VirtualKVCache` and :class:`vmkv.PagedKVCache`.

    Subclasses set ``mode`` and ``kernel``, call ``super().__init__`` before anything that can fail
    (so ``close()`` finds its attributes), then hand their storage's addressing to :meth:`_open`.

    Attributes:
        config, geometry: what the cache holds and how its pages map onto tokens and bytes.
        pool: the page pool (reference counts, free list, prefix index).
        guard: the call discipline (lock, undo journal, closed/broken).
        slots: free slots and spare pages.
        budget: the shared budget this cache joined (``shared_budget``), else ``None``.
        counters: event counts reported by ``stats()``.
    """

    mode: str
    kernel: str

    def __init__(self, config: KVCacheConfig, geometry: PageGeometry) -> None:
        self.config = config
        self.geometry = geometry
        self.tokens_per_page = geometry.tokens_per_page
        self.max_pages_per_seq = self.pages_for(config.max_seq_len)
        self.pool = PagePool(geometry.num_pages)
        self.guard = CallGuard(self.pool)
        self.slots = SlotTable(config.max_batch_size, self.guard.log)
        if config.window is None:
            raise InvalidConfig("a core cache's layers share one window; vmkv.open_cache gives layers of different "
                                "windows a cache each (vmkv.core.groups)")
        slack = self.tokens_per_page if config.window_slack is None else config.window_slack
        self.window = SlidingWindow(config.window, slack, self.tokens_per_page) if config.window else None
        # a windowed cache forgets old pages: no prompt could find them again
        self.prefix = PrefixIndex(self.pool, self.tokens_per_page, config.prefix_caching and self.window is None,
                                  self.guard.log)
        self._fast = DecodeFastPath(self.tokens_per_page, config.max_seq_len, self.window)
        self._seqs: dict[SeqId, LiveSequence] = {}
        self._keep_spare = config.deferred_reclaim and self.mode == "vmm"
        self._tokens = 0  # sum of the live sequences' lengths (stats() is O(1))
        self._version = 0
        self._owner = object()  # plans carry it: a plan of another cache is refused
        # the last step, until the next call registers its full pages: (seq_id, start) and layers written
        self._last_step: list[tuple[SeqId, int]] = []
        self._layers_written: set[int] = set()
        self.counters: Counter[str] = Counter()
        self.budget: CacheBudget | None = None
        self.addressing: Addressing | None = None  # set by _open, once the mode's storage exists
        self._own: PageOwnership | None = None
        self._ahead: MapAhead | None = None
        self._undo: tuple[StepPlan, list, int] | None = None  # the last undoable step: (plan, journal, generation)
        self.variant = Variant(window=config.window or 0)  # what the kernel applies, unless a call adds more

    def _variant(self, softcap: float, sinks: torch.Tensor | None) -> Variant:
        """The kernel's variant for a call: the cache's window, with the call's soft-cap and sinks."""
        return self.variant if not softcap and sinks is None else Variant(self.variant.window, softcap, sinks)

    def _open(self, addressing: Addressing) -> None:
        """The mode's storage exists: pages can now be owned (the last step of a mode's ``__init__``)."""
        self.addressing = addressing
        self._own = PageOwnership(self.pool, self.slots, self.guard, addressing, self.tokens_per_page)
        if self.config.map_ahead and self.mode == "vmm":
            self._ahead = MapAhead(self._own.grow_one, self._own.covered, self.counters)

    def _join_budget(self, spec: SharedBudget, memory: PageMemory) -> CacheBudget:
        """Take a seat in the host-wide ledger ``spec`` names, counting ``memory``'s pages."""
        self.budget = self._own.budget = CacheBudget(
            spec, self.geometry.page_bytes, self.geometry.num_pages, pool=self.pool, slots=self.slots, memory=memory,
            guard=self.guard, drop=self._own.drop, before_serving=weak_method(self._join_ahead),
            counters=self.counters)
        close_at_exit(self)
        return self.budget

    # ---- hooks a mode implements ---------------------------------------------------------
    @abstractmethod
    def layer_storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V storage flattened to rows (zero-copy): ``[rows, kv_heads, head_dim]`` (VMM
        head-major: ``[rows, head_dim]``). VMM: read-only views; paged: the pools (write only through ``write``).
        """

    @abstractmethod
    def attention(self, layer: int, q: torch.Tensor, plan: StepPlan, *, scale: float | None = None,
                  softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the step's queries ``q: [T, q_heads, head_dim]`` over each sequence's cache.

        Returns ``[T, q_heads, head_dim]``: causal within the new tokens, over the cached prefix (or
        window), grouped-query when ``q_heads`` is a multiple of ``num_kv_heads``; ``softcap`` and
        ``sinks`` as :class:`~vmkv.kernels.base.Variant`'s.

        Raises:
            StalePlan, InvalidShape, InvalidDtype, InvalidDevice, InvalidInput (also: ``layer`` not
            written in this step yet, checked first after the plan).
        """

    @abstractmethod
    def kv(self, seq_id: SeqId, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K and V of one sequence in one layer, each ``[length, kv_heads, head_dim]``."""

    @abstractmethod
    def _close_storage(self) -> None:
        """Release the mode's memory (must work on a half-built cache)."""

    # ---- starting and ending sequences ---------------------------------------------------
    @exclusive
    def add(self, seq_id: SeqId, token_ids: Sequence[int] | None = None, *, slot: int | None = None) -> int:
        """Start a sequence in a free slot, reusing cached pages of its prompt.

        Args:
            seq_id: any hashable id not in use.
            token_ids: the prompt, if known. With prefix caching on, the longest prefix of whole
                cached pages is linked in (no copy) and counts as stored: ``seq_len(seq_id)`` says how
                many tokens the caller may skip. At least one token is always left to compute.
            slot: take this free slot (layer groups take the same slot in each); default: the best fit.

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
            raise SequenceTooLong(f"prompt of {len(tokens)} tokens exceeds max_seq_len={self.config.max_seq_len}")
        self.slots.require_free(seq_id, slot)
        with self.guard.atomic():
            self._finish_last_step()
            hits = self.prefix.match(tokens)
            slot = self.slots.pick(self.pages_for(len(tokens)) if tokens else None, slot)
            for page, _ in hits:
                self.pool.incref(page)
            pages = self._own.adopt_slot(slot, [page for page, _ in hits])
        seq = self._start_sequence(seq_id, slot, pages, len(hits) * self.tokens_per_page, tokens)
        seq.hashes = [page_hash for _, page_hash in hits]
        if tokens and self.config.prefix_caching:
            self.counters["prefix_queries"] += 1
            self.counters["prefix_hits"] += bool(hits)
            self.counters["prefix_hit_tokens"] += seq.length
        return slot

    @exclusive
    def fork(self, src_id: SeqId, dst_id: SeqId, *, slot: int | None = None) -> int:
        """Start ``dst_id`` as a copy of ``src_id`` sharing all of its pages; the first write of either into
        a shared page copies it (copy-on-write). ``slot``: as :meth:`add`'s.

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
        self.slots.require_free(dst_id, slot)
        slot = self.slots.pick(0, slot)
        with self.guard.atomic():
            self._finish_last_step()
            for page in src.pages[src.released:]:
                self.pool.incref(page)
            pages = self._own.adopt_slot(slot, list(src.pages))
        seq = self._start_sequence(dst_id, slot, pages, src.length, list(src.tokens))
        seq.reserved, seq.hashes, seq.released = src.reserved, list(src.hashes), src.released
        self.counters["forks"] += 1
        return slot

    @exclusive
    def free(self, seq_id: SeqId) -> None:
        """End a sequence. Its full pages stay in the prefix cache; with deferred reclamation (VMM mode)
        its private pages stay mapped in the slot for the next sequence.

        Raises:
            UnknownSequence; BackendError if the OS refused to unmap a page: the call was rolled back.
        """
        self._join_ahead()
        seq = self._get(seq_id)
        with self.guard.atomic():
            self._finish_last_step()  # first: its full pages stay in the prefix cache
            keep = 0
            if self._keep_spare and not seq.released:  # a window let pages go: none kept as spare
                while keep < len(seq.pages) and self._own.is_private(seq.pages[keep]):
                    keep += 1
            self._own.drop_from(seq, keep)
        self.slots.vacate(seq.slot, seq.pages[:keep])
        del self._seqs[seq_id]
        self._tokens -= seq.length
        self._version += 1
        if self.budget is not None:
            self.budget.boundary()

    # ---- growing and shrinking ------------------------------------------------------------
    @exclusive
    def reserve(self, seq_id: SeqId, num_tokens: int) -> None:
        """Guarantee room for ``num_tokens`` tokens in total, mapping pages now if needed. A plan
        from ``begin_step`` stays valid.

        Raises:
            UnknownSequence, SequenceTooLong, OutOfPages, InvalidInput; BackendError (or
            OutOfMappings) if the OS refused a mapping: the call was rolled back.
        """
        self._join_ahead()
        seq, num_tokens, grow = self._reservation(seq_id, num_tokens)
        with self.guard.atomic():
            self._own.make_room(grow)
            self._own.grow(seq, grow)
        seq.reserved = max(seq.reserved, num_tokens)

    def check_reserve(self, seq_id: SeqId, num_tokens: int) -> None:
        """Raise what :meth:`reserve` would raise for lack of pages or a bad argument, changing nothing (a
        caller reserving in several caches checks them all first)."""
        self._own.check_room(self._reservation(seq_id, num_tokens)[2])

    def _reservation(self, seq_id: SeqId, num_tokens: int) -> tuple[LiveSequence, int, int]:
        """``(sequence, num_tokens, pages to add)`` of a valid reservation (room is make_room's to check)."""
        seq = self._get(seq_id)
        num_tokens = as_int(num_tokens, "num_tokens")
        check_length(seq, num_tokens, self.config.max_seq_len)
        return seq, num_tokens, max(0, self.pages_for(num_tokens) - len(seq.pages))

    @exclusive
    def truncate(self, seq_id: SeqId, length: int) -> None:
        """Forget the tokens of ``seq_id`` from position ``length`` on (pages stay until ``trim``).

        Raises:
            UnknownSequence, InvalidInput (length negative or beyond the sequence).
        """
        self._join_ahead()
        seq, length = self._truncation(seq_id, length)
        with self.guard.atomic():
            self._finish_last_step()
        self._tokens -= seq.length - length
        seq.length = length
        del seq.tokens[length:]
        del seq.hashes[length // self.tokens_per_page :]
        self._version += 1

    def check_truncate(self, seq_id: SeqId, length: int) -> None:
        """Raise what :meth:`truncate` would raise for these arguments, changing nothing (a caller
        truncating several sequences checks them all first)."""
        self._truncation(seq_id, length)

    def _truncation(self, seq_id: SeqId, length: int) -> tuple[LiveSequence, int]:
        seq = self._get(seq_id)
        length = as_int(length, "truncate length")
        if length > seq.length:
            raise InvalidInput(f"truncate length must be in 0..{seq.length}, got {length}")
        if self.window is not None:
            self.window.check_truncate(seq, length)
        return seq, length

    @exclusive
    def trim(self, keep_cached: bool = False) -> int:
        """Return every page no live sequence needs to the pool, and free memory to the OS (unless
        ``keep_cached``, the prefix cache too).

        Returns:
            The number of pages that became free.

        Raises:
            BackendError: the OS refused to unmap a page (the call was rolled back), or to take
                some free page's memory back (call ``trim()`` again to retry).
        """
        self._join_ahead()
        before = self.pool.num_free
        needs = {seq.seq_id: self.pages_for(max(seq.length, seq.reserved)) for seq in self._seqs.values()}
        with self.guard.atomic():
            self._finish_last_step()
            self.slots.drain(self.pool.num_pages, self._own.drop)
            for seq in self._seqs.values():
                self._own.drop_from(seq, needs[seq.seq_id])
            if not keep_cached:
                self.pool.evict_all()
        for seq in self._seqs.values():
            del seq.pages[needs[seq.seq_id] :]
        self._version += 1
        self.addressing.release(self.pool.free_pages())
        if self.budget is not None:
            self.budget.after_trim()
        return self.pool.num_free - before

    # ---- a step ----------------------------------------------------------------------------
    @exclusive
    def begin_step(self, batch: Mapping[SeqId, int | Sequence[int]], *, undoable: bool = False) -> StepPlan:
        """Make room for a step's new tokens and build the metadata every layer will use.

        Args:
            batch: for each sequence of the step, the number of new tokens, or their token ids
                (ids let full pages enter the prefix cache). Prefill chunks and decode tokens mix freely.
            undoable: keep what it takes to undo the step exactly (:meth:`cancel_step`).

        Returns:
            The :class:`StepPlan` to pass to ``write`` and ``attention`` for every layer. Any
            later call that changes the cache makes it stale.

        Raises:
            UnknownSequence, SequenceTooLong, OutOfPages, InvalidInput; BackendError (or
            OutOfMappings) if the OS refused a mapping: the call was rolled back.
        """
        self._join_ahead()
        if undoable:
            journal: list = []
            with self.guard.atomic(keep=journal):
                self.guard.log(self._bookkeeping_undo(batch))  # first logged: reverted last
                plan, seqs = self._take_step(batch, undoable)
            self._undo = (plan, journal, self.guard.generation)
        else:
            plan, seqs = self._take_step(batch, undoable)
        if self.budget is not None:  # after the commit: a step that fails changes nothing
            self.budget.boundary()
        if self._ahead is not None:
            self._ahead.start(zip(seqs, plan.q_lens), self.tokens_per_page, self.max_pages_per_seq)
        return plan

    def _take_step(self, batch: Mapping[SeqId, int | Sequence[int]], undoable: bool) -> tuple[StepPlan, list[LiveSequence]]:
        """``begin_step``'s work: the plan (fast path's or a mapped one) and its sequences, committed."""
        plan, steps = self._fast.next_plan(batch, self._version, self._parse_batch)
        fast = plan is not None
        copies = 0
        if fast:  # nothing to map, copy or unregister
            self._finish_last_step()  # outside ``atomic``: nothing after it can fail
            seqs = self._fast.seqs
            for seq, _, ids in steps or ():  # token ids given: record them where the ids so far are known
                if ids is not None and len(seq.tokens) >= seq.length:  # (else, as for a count, nothing to do)
                    seq.tokens[seq.length : seq.length + 1] = ids
            self._last_step = [(seq.seq_id, seq.length) for seq in seqs]
            for seq in seqs:
                seq.length += 1
            self._tokens += len(seqs)
        else:
            steps = steps or self._parse_batch(batch)
            released = sum(self.window.count_behind(seq) for seq, _, _ in steps) if self.window else 0
            with self.guard.atomic():
                self._finish_last_step()
                began = time.perf_counter_ns()
                plan, copies = self._map_step(steps, undoable)
                self.counters["map_step_ns"] += time.perf_counter_ns() - began  # stats(): time in full-path planning
            self.counters["window_releases"] += released
            self._commit_step(steps)
            seqs = [seq for seq, _, _ in steps]
        self.counters["cow_copies"] += copies
        self._layers_written = set()
        self._version += 1
        self._fast.commit(plan, seqs, fast)
        return plan, seqs

    def _bookkeeping_undo(self, batch: Mapping[SeqId, Any]) -> Callable[[], None]:
        """How to restore what ``begin_step`` changes beyond the journaled pages and mappings."""
        seqs = [self._seqs[seq_id] for seq_id in batch if seq_id in self._seqs] if isinstance(batch, Mapping) else []
        kept = [(seq, seq.length, seq.tokens[seq.length:], seq.hashes[seq.length // self.tokens_per_page:]) for seq in seqs]
        totals = (self._tokens, list(self._last_step), set(self._layers_written), self._version, Counter(self.counters),
                  self._fast.state())

        def undo() -> None:
            for seq, length, tokens, hashes in kept:
                seq.length = length
                seq.tokens[length:] = tokens
                seq.hashes[length // self.tokens_per_page:] = hashes
            self._tokens, self._last_step, self._layers_written, self._version, counters, fast = totals
            self.counters.clear()  # in place: collaborators count into the same Counter
            self.counters.update(counters)
            self._fast.restore(fast)

        return undo

    @exclusive
    def cancel_step(self, plan: StepPlan) -> None:
        """Undo the step ``plan`` made (``begin_step(..., undoable=True)``): lengths, token ids, pages,
        copies and mappings as before it. Pages mapped ahead since stay.

        Raises:
            StalePlan: ``plan`` is not the last undoable step, or a call changed the cache since.
            BackendError: the OS refused to restore a mapping (the cache is then broken).
        """
        self._join_ahead()
        undo = self._undo
        if undo is None or undo[0] is not plan or plan.version != self._version or undo[2] != self.guard.generation:
            raise StalePlan("this step cannot be cancelled: it is not the last undoable step, or the cache changed since")
        self._undo = None
        self.guard.revert(undo[1])

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
            check_tensor(name, tensor, shape, self.config)
        self._store(layer, k, v, plan)
        self._layers_written.add(layer)

    @exclusive
    def written(self, plan: StepPlan) -> None:
        """Record that every layer of the step was written outside :meth:`write` (a replayed CUDA graph):
        only then may its full pages enter the prefix index.

        Raises:
            StalePlan: ``plan`` is not this cache's current plan.
        """
        self._check_plan(plan, 0)
        self._layers_written.update(range(self.config.num_layers))

    @exclusive
    def wait_for_mapping(self) -> None:
        """Wait until no page is being mapped ahead: before a CUDA graph capture, during which no other
        thread may synchronize the device.
        """
        self._join_ahead()

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> None:
        """Copy validated ``k``, ``v`` ``[T, kv_heads, head_dim]`` to their rows of ``layer``."""
        k_rows, v_rows = self.layer_storage(layer)
        k_rows.index_copy_(0, plan.write_rows, k)
        v_rows.index_copy_(0, plan.write_rows, v)

    # ---- queries ---------------------------------------------------------------------------
    # A closed cache (or a forked child's copy, see vmkv.core.calls) holds no sequence: ``in``,
    # ``len`` and ``seq_ids`` say so, and ``seq_len``/``slot`` of any id raise ``CacheClosed``.
    def __contains__(self, seq_id: SeqId) -> bool:
        if self.guard.closed:
            return False
        try:
            return seq_id in self._seqs
        except TypeError:  # unhashable: certainly not a sequence of ours
            return False

    def __len__(self) -> int:
        return 0 if self.guard.closed else len(self._seqs)

    @property
    def seq_ids(self) -> list[SeqId]:
        """Ids of the live sequences (none once closed)."""
        return [] if self.guard.closed else list(self._seqs)

    def pages_for(self, num_tokens: int) -> int:
        """Pool pages that hold ``num_tokens`` tokens of one sequence.

        Raises:
            InvalidInput: ``num_tokens`` is not an int >= 0.
        """
        return -(-as_int(num_tokens, "num_tokens") // self.tokens_per_page)

    def seq_len(self, seq_id: SeqId) -> int:
        """Tokens stored for ``seq_id`` (after ``add``: the tokens found in the prefix cache).

        Raises:
            UnknownSequence; CacheClosed after ``close()`` (or in a forked child).
        """
        if self.guard.closed:
            raise self.guard.closed_error("seq_len()")
        return self._get(seq_id).length

    def slot(self, seq_id: SeqId) -> int:
        """The slot (batch row) of ``seq_id``.

        Raises:
            UnknownSequence; CacheClosed after ``close()`` (or in a forked child).
        """
        if self.guard.closed:
            raise self.guard.closed_error("slot()")
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
        """Memory and sharing counters, in O(1), from any thread (a snapshot). ``utilization`` =
        ``token_bytes / bytes_in_use``: above 1.0 when pages are shared.
        """
        page_bytes = self.geometry.page_bytes
        token_bytes = self._tokens * self.config.bytes_per_token
        bytes_in_use = self.bytes_in_use
        return {
            "mode": self.mode,
            "kernel": self.kernel,
            "sequences": len(self._seqs),  # none once closed: close() drops the table
            "pages_total": self.pool.num_pages,
            "pages_free": self.pool.num_free,
            "pages_in_use": self.pool.num_in_use,
            "pages_spare": sum(len(spare) for spare in list(self.slots.spare.values())),
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
            "window": self.config.window,
            "window_releases": self.counters["window_releases"],
            "map_step_ns": self.counters["map_step_ns"],
        }

    @property
    def bytes_in_use(self) -> int:
        """Bytes of the pool pages in use."""
        return self.pool.num_in_use * self.geometry.page_bytes

    @exclusive
    def check(self) -> None:
        """Raise ``AssertionError`` if page ownership (or the mode's storage) is inconsistent."""
        self._join_ahead()
        self.pool.check()
        owners: Counter[int] = Counter()
        for seq in self._seqs.values():
            owners.update(seq.pages[seq.released:])
            assert all(page == RELEASED for page in seq.pages[:seq.released]), f"{seq.seq_id!r}: a released page is held"
            assert seq.length <= len(seq.pages) * self.tokens_per_page, f"{seq.seq_id!r} outgrew its pages"
            assert seq.slot not in self.slots.free and not self.slots.spare[seq.slot]
        assert len(self.slots.free) + len(self._seqs) == self.slots.count, "a slot is both free and held"
        for spare in self.slots.spare.values():
            owners.update(spare)
        for page in range(self.pool.num_pages):
            assert self.pool.refcount(page) == owners[page], f"page {page}: ref != owners"
        assert self._tokens == sum(seq.length for seq in self._seqs.values()), "token counter is off"
        self.addressing.check(list(self._seqs.values()))

    def state(self) -> tuple:
        """The cache's bookkeeping as comparable values (a failed call leaves it equal)."""
        seqs = tuple(
            (s.seq_id, s.slot, tuple(s.pages), s.length, s.reserved, tuple(s.tokens), tuple(s.hashes), s.released)
            for s in self._seqs.values()
        )
        spare, free = self.slots.state()
        return (seqs, spare, free, self.pool.state(), self._version, self._tokens, dict(self.counters))

    # ---- closing ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release all memory; views handed out earlier stay readable (VMM: zeros). Afterwards the cache
        holds no sequence and every call but ``stats()`` and ``close()`` raises ``CacheClosed``.
        Idempotent; works on a half-built cache; does nothing in a forked child.

        Raises:
            ConcurrentUse: another thread is inside the cache.
        """
        guard = getattr(self, "guard", None)
        if guard is None:  # __init__ failed before the guard existed: nothing was allocated
            return
        if not guard.enter():
            raise ConcurrentUse("close() while another thread is inside this cache")
        try:
            if guard.closed:
                return
            guard.closed = True
            if self._ahead is not None:
                self._ahead.close()
            self._close_storage()
            self._seqs, self._tokens = {}, 0
            budget, self.budget = self.budget, None
            if budget is not None:
                budget.close()
        finally:
            guard.lock.release()

    def __enter__(self) -> "KVCacheBase":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown, or a half-built object: nothing left to do
            pass

    # ---- checks ----------------------------------------------------------------------------
    def _get(self, seq_id: SeqId) -> LiveSequence:
        return get_sequence(self._seqs, seq_id)

    def _parse_batch(self, batch: Any) -> list[Step]:
        return parse_batch(batch, self._seqs, self.config.max_seq_len)

    def _check_plan(self, plan: StepPlan, layer: int) -> int:
        """Validate a plan and layer index for this cache; return the layer as an int."""
        return check_plan(plan, self._owner, self._version, layer, self.config.num_layers)

    def _check_query(self, q: torch.Tensor, plan: StepPlan) -> None:
        check_query(q, plan, self.config)

    def _require_written(self, layer: int) -> None:
        """Refuse attention over ``layer`` before this step wrote it: its new tokens' K/V would be
        whatever the pages held.

        Raises:
            InvalidInput: this step has not written ``layer``.
        """
        if layer not in self._layers_written:
            raise InvalidInput(f"attention: layer {layer} is not written in this step yet; call write(layer, k, v, "
                               "plan) first (its K/V would be stale: zeros or an earlier sequence's data)")

    def _start_sequence(self, seq_id: SeqId, slot: int, pages: list[int], length: int, tokens: list[int]) -> LiveSequence:
        """Commit a new sequence in ``slot`` (after ``adopt_slot`` succeeded)."""
        self.slots.occupy(slot)
        seq = LiveSequence(seq_id, slot, pages, length, tokens=tokens)
        self._seqs[seq_id] = seq
        self._tokens += length
        self._version += 1
        return seq

    # ---- steps -----------------------------------------------------------------------------
    def _map_step(self, steps: list[Step], undoable: bool) -> tuple[StepPlan, int]:
        """Copy shared pages written into, release pages behind a window, map the step's pages and build
        its plan (journaled, nothing committed); returns the plan and the pages copied. ``undoable``:
        nothing another owner or the prefix cache can see is written, evicted or reused.
        """
        copies, grows = plan_pages(steps, self.pool, self.tokens_per_page, undoable=undoable)
        count = sum(len(c) for c in copies) + sum(grows)
        behind = Counter(page for seq, _, _ in steps for page in self.window.behind(seq)) if self.window else Counter()
        # the pages behind each window go first and the step may take them, unless it is undoable
        freed = 0 if undoable else sum(self.pool.refcount(page) == n for page, n in behind.items())
        self._own.check_room(count, undoable, freed)
        fresh = None
        if undoable:  # every new page taken before any is let go, so none the step frees is written again
            self._own.make_room(count, keep_cached=True)
            fresh = iter(self.pool.allocate(count))
        for seq, _, _ in steps if behind else ():
            self.window.release(seq, self._own)
        if not undoable:
            self._own.make_room(count)
        for (seq, _, _), copy_at, grow in zip(steps, copies, grows):
            self._own.copy_on_write(seq, copy_at, fresh)
            self._own.grow(seq, grow, fresh)
        plan = self._build_plan([s for s, _, _ in steps], [c for _, c, _ in steps])  # may fail: before the commit
        return plan, sum(len(c) for c in copies)

    def _commit_step(self, steps: list[Step]) -> None:
        """Commit a mapped step: written pages leave the prefix index, token ids are recorded, lengths advance."""
        for seq, count, ids in steps:
            self.prefix.forget_written(seq, count)
            if ids is not None and len(seq.tokens) >= seq.length:
                seq.tokens[seq.length : seq.length + count] = ids
            elif len(seq.tokens) < seq.length + count:
                del seq.tokens[seq.length :]  # ids unknown from here on: stop hashing
            self._last_step.append((seq.seq_id, seq.length))
            seq.length += count
            self._tokens += count

    def _build_plan(self, seqs: list[LiveSequence], counts: list[int]) -> StepPlan:
        """The plan of a step adding ``counts[i]`` tokens to ``seqs[i]``, built before the step is committed."""
        starts = [seq.length for seq in seqs]
        rows = [self.addressing.token_rows(seq.slot, seq.pages, s, n) for seq, s, n in zip(seqs, starts, counts)]
        kv_lens = [s + n for s, n in zip(starts, counts)]
        return make_plan(tuple(seq.seq_id for seq in seqs), [seq.slot for seq in seqs], starts, counts,
                         device=self.config.device, write_rows=torch.cat(rows).to(self.config.device),
                         block_table=self.addressing.block_table(seqs, kv_lens), version=self._version + 1, owner=self._owner)

    def _finish_last_step(self) -> None:
        """Let the prefix index take the full pages the last step filled, if it wrote every layer. Runs
        inside the calls that make the plan stale, after their checks.
        """
        if not self._last_step:
            return
        complete = len(self._layers_written) == self.config.num_layers
        live = [(self._seqs[seq_id], start) for seq_id, start in self._last_step if seq_id in self._seqs]
        self.prefix.finish_step(live, complete)
        last, self._last_step = self._last_step, []
        self.guard.log(lambda: setattr(self, "_last_step", last))

    # ---- mapping ahead ---------------------------------------------------------------------
    def _join_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead.join()
