"""The page-aware set of free KV blocks behind the page-affine block pool (scheduler side, no vLLM).

vLLM's ``FreeKVCacheBlockQueue`` (``vllm/v1/core/kv_cache_utils.py``) spreads a request's blocks
over the whole buffer, so no page ever empties. :class:`PageAwareFreeBlocks` has its interface and
decides by pages (units: :mod:`vmkv.vllm.layout`). A unit is live while any block of it is held,
cached or retained, and its pages are mapped exactly while it is live; unclaimed while no
request holds a block in it. A block is handed out in this order:

1. an empty block of the unit of the requesting request's last block, if only it holds that unit;
2. an empty block of an unclaimed live unit (mapped anyway);
3. the lowest unmapped unit, if the physical budget has room for its pages;
4. an empty block of the live unit with the most live blocks (fullest first);
5. only when the budget is short: the whole least recently idle unit, its cached blocks evicted;
6. the least recently freed cached or retained block, as vLLM's queue evicts.

Invariants: retained blocks stay last in the eviction order and mapped until handed out;
``num_free_blocks`` is exactly what these steps can deliver within the budget (the ledger's
grants too); idle units beyond ``max_idle_units`` are evicted whole, their hashes first, so no
hit reads an unmapped page. :meth:`PageAwareFreeBlocks.take_delta` returns the net page changes
the connector sends. Why this order: docs/vllm.md, "How it works".
"""

from __future__ import annotations

import copy
import heapq
from collections import OrderedDict
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator

from ...errors import InvalidConfig
from ..layout import KVLayout


class PageAwareFreeBlocks:
    """Free KV blocks grouped by unit, with page mapping state (see the module docstring).

    Args:
        blocks: every block, ``blocks[i].block_id == i``; all start free.
        layout: where blocks live (units, pages).
        budget_pages: physical pages that may be mapped at once (at most ``layout.num_pages``).
        max_idle_units: units kept mapped only by cached blocks before whole ones are evicted.
        caching: whether freed blocks with a hash stay cached (vLLM's ``enable_caching``).
        evict: removes a free block's prefix-cache entry (``BlockPool._maybe_evict_cached_block``).

    Raises:
        InvalidConfig: a budget smaller than the buffer cannot hold two units; a budget of the
            whole buffer is never refused.
    """

    def __init__(self, blocks: list[Any], layout: KVLayout, budget_pages: int, max_idle_units: int,
                 caching: bool, evict: Callable[[Any], Any]) -> None:
        self.layout = layout
        self.k = layout.blocks_per_unit
        self.budget_pages = min(budget_pages, layout.num_pages)
        need = min(2, layout.num_units) * layout.max_pages_per_unit
        if self.budget_pages < min(need, layout.num_pages):
            raise InvalidConfig(
                f"vmkv: a physical budget of {budget_pages} pages of {layout.page_size} B cannot hold two units of "
                f"{self.k} blocks ({layout.max_pages_per_unit} pages each); raise the budget or lower page_size")
        self.max_idle_units = max(0, max_idle_units)
        self.caching = caching
        self._evict = evict
        self._blocks = blocks
        units = layout.num_units
        self._held = [0] * units
        self._cached_in = [0] * units  # prefix-cached free blocks (not retained)
        self._retained_in = [0] * units
        self._retained: set[int] = set()  # free blocks still read by unpin_blocks' caller
        self._retaining = False
        self._empty: list[dict[int, Any]] = [{} for _ in range(units)]
        for block in blocks:
            self._empty[layout.unit_of(block.block_id)][block.block_id] = block
        self._cached: OrderedDict[int, Any] = OrderedDict()  # cached and retained, least recently freed first
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently idle first
        self._buckets: list[dict[int, None]] = [{} for _ in range(self.k + 1)]  # live count -> units with an empty block
        self._bucket_of = [0] * units
        self._pinned = [0] * units  # held for good (vLLM's null block)
        self._unclaimed: dict[int, None] = {}  # live units with an empty block and no request's block
        self._affinity: int | None = None
        self._unmapped = list(range(units))  # a heap, entries checked when popped
        self._page_refs = [0] * layout.num_pages
        self.mapped_pages = 0
        self._empty_in_live = 0
        self._empty_in_unmapped = len(blocks)
        self._changed: set[int] = set()
        self._sent: set[int] = set()
        self.maps = 0
        self.unmaps = 0
        self._unbounded = False
        self._new_count: int | None = None  # blocks step 3 can deliver; None: to recount
        self.grants: Any = None  # in a shared budget: the ledger seat (vmkv.vllm.scheduler.share.EngineShare)
        self._changes = 0  # units changed so far (_change)
        self._idle_pages = (-1, 0)  # (_changes when counted, idle_pages())

    # ---- the FreeKVCacheBlockQueue interface ----------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks :meth:`popleft_n` can deliver now within the physical budget."""
        return self._empty_in_live + len(self._cached) + self._new_blocks()

    def popleft(self) -> Any:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Any]:
        """Hand out ``n`` blocks (module docstring, steps 1-6).

        Raises:
            ValueError: fewer than ``n`` blocks are free within the budget (as vLLM's queue).
        """
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot get {n} free blocks from the pool ({self.num_free_blocks} within the budget)")
        blocks: list[Any] = []
        hint = self._affinity
        for _ in range(n):  # one call serves one request: each block follows the previous one
            blocks.append(self._pick(hint))
            hint = blocks[-1].block_id
        return blocks

    def remove(self, block: Any) -> None:
        """Take a free block out of the set (vLLM does this for a prefix-cache hit)."""
        unit = self.layout.unit_of(block.block_id)
        if block.block_id in self._cached:
            self._change(unit, lambda: self._uncache(block, unit, held=True))
        elif block.block_id in self._empty[unit]:
            self._take_empty(unit, block.block_id)
        else:
            raise ValueError(f"block {block.block_id} is not free")

    def append(self, block: Any) -> None:
        self.append_n([block])

    def append_n(self, blocks: Iterable[Any]) -> None:
        """Blocks come back: cached if they carry a hash (first given, first evicted), else empty."""
        for block in blocks:
            self._release(block)
        self._enforce_idle_cap()

    @contextmanager
    def retaining(self) -> Iterator[None]:
        """Within the block, blocks that come back are retained (``unpin_blocks``): last to evict, mapped until reused."""
        self._retaining = True
        try:
            yield
        finally:
            self._retaining = False

    def prepend_n(self, blocks: Iterable[Any]) -> None:
        """Blocks without a hash come back (vLLM's "reuse first"; here their unit decides)."""
        self.append_n(blocks)

    def pin(self, block: Any) -> None:
        """Take a free block out of the set for good (vLLM's null block): it does not claim its unit."""
        self.remove(block)
        unit = self.layout.unit_of(block.block_id)
        self._change(unit, lambda: self._pinned.__setitem__(unit, self._pinned[unit] + 1))

    @contextmanager
    def affinity(self, block_id: int | None) -> Iterator[None]:
        """Within the block, allocations prefer the unit of ``block_id`` (``None``: no preference)."""
        before, self._affinity = self._affinity, block_id
        try:
            yield
        finally:
            self._affinity = before

    def get_all_free_blocks(self) -> list[Any]:
        return [b for empty in self._empty for b in empty.values()] + list(self._cached.values())

    # ---- memory control -------------------------------------------------------------------------
    def trim(self) -> int:
        """Evict every unit that only cached blocks keep mapped; return the pages unmapped."""
        before = self.mapped_pages
        while self._idle:
            self._evict_unit(next(iter(self._idle)))
        return before - self.mapped_pages

    def forget_hashes(self) -> None:
        """Every free block lost its hash (``reset_prefix_cache``): all become empty."""
        for block in list(self._cached.values()):
            unit = self.layout.unit_of(block.block_id)
            self._change(unit, lambda: self._uncache(block, unit, held=False))

    def hash_removed(self, block: Any) -> None:
        """``block`` may have lost its hash while free (``BlockPool.evict_blocks``)."""
        if block.block_id in self._cached and block.block_hash is None and block.block_id not in self._retained:
            unit = self.layout.unit_of(block.block_id)
            self._change(unit, lambda: self._uncache(block, unit, held=False))

    @contextmanager
    def counting_all(self) -> Iterator[None]:
        """Within the block, ``num_free_blocks`` counts every free block, budget or not."""
        self._unbounded = True
        try:
            yield
        finally:
            self._unbounded = False

    # ---- shared budget ----------------------------------------------------------------------------
    @property
    def limit(self) -> int:
        """Pages that may be mapped now: the budget, and in a shared budget the pages granted."""
        return self.budget_pages if self.grants is None else min(self.budget_pages, self.grants.limit)

    def limit_changed(self) -> None:
        """The grants changed: recount what step 3 can deliver."""
        self._new_count = None

    @property
    def sent_pages(self) -> int:
        """Pages the workers have mapped once they applied every list :meth:`take_delta` returned."""
        return len(self._sent)

    def make_room(self, blocks: int) -> None:
        """In a shared budget, take the grants the new pages of ``blocks`` blocks need (a no-op otherwise)."""
        if self.grants is None or blocks <= self._empty_in_live + self._new_blocks():
            return
        want = min(self.budget_pages, self.mapped_pages + self._pages_for(blocks - self._empty_in_live))
        self.grants.cover(want, wait=False)
        self.limit_changed()
        if blocks > self.num_free_blocks:  # even this engine's own idle pages are too few
            self.grants.cover(want, wait=True)
            self.limit_changed()

    def _pages_for(self, blocks: int) -> int:
        """New pages step 3 maps to deliver ``blocks`` blocks of unmapped units, lowest first."""
        first = self._lowest_unmapped()
        pages: set[int] = set()
        got = 0
        for unit in range(self.layout.num_units if first is None else first, self.layout.num_units):
            if got >= blocks:
                break
            if not self._live(unit):
                pages.update(p for p in self.layout.unit_pages(unit) if self._page_refs[p] == 0)
                got += len(self._empty[unit])
        return len(pages)

    def evict_idle(self, pages: int) -> int:
        """Evict whole idle units, least recently idle first, until ``pages`` pages are unmapped; returns them."""
        before = self.mapped_pages
        while self._idle and before - self.mapped_pages < pages:
            self._evict_unit(next(iter(self._idle)))
        return before - self.mapped_pages

    def idle_pages(self) -> int:
        """Pages evicting every idle unit would unmap (recounted only after a unit changed)."""
        if self._idle_pages[0] != self._changes:
            refs: dict[int, int] = {}
            for unit in self._idle:
                for page in self.layout.unit_pages(unit):
                    refs[page] = refs.get(page, 0) + 1
            self._idle_pages = (self._changes, sum(1 for page, n in refs.items() if n == self._page_refs[page]))
        return self._idle_pages[1]

    @property
    def held_blocks(self) -> int:
        return sum(self._held)

    def has_delta(self) -> bool:
        """Whether pages changed state since the last :meth:`take_delta`."""
        return any((self._page_refs[p] > 0) != (p in self._sent) for p in self._changed)

    def take_delta(self) -> tuple[list[int], list[int]]:
        """``(map, unmap)``: pages mapped and unmapped since the last call, net, sorted."""
        to_map, to_unmap = [], []
        for page in sorted(self._changed):
            live, sent = self._page_refs[page] > 0, page in self._sent
            if live and not sent:
                to_map.append(page)
                self._sent.add(page)
            elif sent and not live:
                to_unmap.append(page)
                self._sent.discard(page)
        self._changed.clear()
        self.maps += len(to_map)
        self.unmaps += len(to_unmap)
        return to_map, to_unmap

    def stats(self) -> dict[str, int]:
        return {
            "mapped_pages": self.mapped_pages,
            "budget_pages": self.budget_pages,
            "mapped_units": sum(1 for u in range(self.layout.num_units) if self._live(u)),
            "idle_units": len(self._idle),
            "held_blocks": self.held_blocks,
            "cached_blocks": len(self._cached) - len(self._retained),
            "retained_blocks": len(self._retained),
            "free_blocks": self.num_free_blocks,
            "blocks_per_unit": self.k,
            "page_size": self.layout.page_size,
            "maps": self.maps,
            "unmaps": self.unmaps,
        }

    # ---- policy ---------------------------------------------------------------------------------
    def _pick(self, hint: int | None) -> Any:
        if hint is not None:  # 1: the request's own page
            unit = self.layout.unit_of(hint)
            if self._empty[unit] and self._live(unit):
                return self._take_any(unit)
        if self._unclaimed:  # 2: a mapped page no request holds
            return self._take_any(next(iter(self._unclaimed)))
        new = self._lowest_unmapped()  # 3: a new unit within the budget
        if new is not None and self._new_pages(new) <= self.limit - self.mapped_pages:
            return self._take_any(new)
        for live in range(self.k - 1, 0, -1):  # 4: the fullest live unit with an empty block
            if self._buckets[live]:
                return self._take_any(next(iter(self._buckets[live])))
        if self._idle and new is not None:  # 5: the budget is short (a unit is left unmapped): a whole idle unit
            unit = next(iter(self._idle))
            self._evict_unit(unit)
            return self._take_any(unit)
        if self._cached:  # 6: vLLM's block count is short: the least recently freed cached/retained block
            block = next(iter(self._cached.values()))
            self.remove(block)
            return block
        raise ValueError("no free KV block left")  # popleft_n checked the count: unreachable

    def _lowest_unmapped(self) -> int | None:
        while self._unmapped:
            unit = self._unmapped[0]
            if not self._live(unit) and self._empty[unit]:
                return unit
            heapq.heappop(self._unmapped)
        return None

    def _new_pages(self, unit: int) -> int:
        return sum(1 for p in self.layout.unit_pages(unit) if self._page_refs[p] == 0)

    def _new_blocks(self) -> int:
        """Empty blocks of unmapped units that step 3 can map, one unit after the other."""
        if self._unbounded or (self.grants is None and self.budget_pages >= self.layout.num_pages):
            return self._empty_in_unmapped
        if self._new_count is None:
            self._new_count = self._count_new_blocks()
        return self._new_count

    def _count_new_blocks(self) -> int:
        """Replay step 3: the lowest unmapped units while their new pages fit the room left."""
        first = self._lowest_unmapped()
        if first is None:
            return 0
        room, counted, blocks = self.limit - self.mapped_pages, set(), 0
        for unit in range(first, self.layout.num_units):
            if self._live(unit):
                continue
            pages = {p for p in self.layout.unit_pages(unit) if self._page_refs[p] == 0} - counted
            if len(pages) > room:
                break
            room -= len(pages)
            counted |= pages
            blocks += len(self._empty[unit])
        return blocks

    def _enforce_idle_cap(self) -> None:
        while len(self._idle) > self.max_idle_units:
            self._evict_unit(next(iter(self._idle)))

    def _evict_unit(self, unit: int) -> None:
        """Evict every cached block of ``unit`` (they become empty)."""
        for block_id in self.layout.unit_blocks(unit):
            block = self._cached.get(block_id)
            if block is not None:
                self._evict(block)
                self._change(unit, lambda: self._uncache(block, unit, held=False))

    # ---- state transitions (each through _change) -----------------------------------------------
    def _idle_now(self, unit: int) -> bool:
        """Live only through prefix-cached blocks: evictable whole."""
        return self._held[unit] == 0 and self._cached_in[unit] > 0 and self._retained_in[unit] == 0

    def _live(self, unit: int) -> int:
        return self._held[unit] + self._cached_in[unit] + self._retained_in[unit]

    def _take_any(self, unit: int) -> Any:
        return self._take_empty(unit, next(iter(self._empty[unit])))

    def _take_empty(self, unit: int, block_id: int) -> Any:
        block = self._empty[unit][block_id]

        def take() -> None:
            del self._empty[unit][block_id]
            self._held[unit] += 1

        self._change(unit, take)
        return block

    def _uncache(self, block: Any, unit: int, held: bool) -> None:
        del self._cached[block.block_id]
        if block.block_id in self._retained:
            self._retained.discard(block.block_id)
            self._retained_in[unit] -= 1
        else:
            self._cached_in[unit] -= 1
        if held:
            self._held[unit] += 1
        else:
            self._empty[unit][block.block_id] = block

    def _release(self, block: Any) -> None:
        unit = self.layout.unit_of(block.block_id)
        if self._retaining:
            def free() -> None:
                self._held[unit] -= 1
                self._cached[block.block_id] = block
                self._retained.add(block.block_id)
                self._retained_in[unit] += 1
        elif self.caching and block.block_hash is not None:
            def free() -> None:
                self._held[unit] -= 1
                self._cached[block.block_id] = block
                self._cached_in[unit] += 1
        else:
            def free() -> None:
                self._held[unit] -= 1
                self._empty[unit][block.block_id] = block
        if block.block_id in self._cached or block.block_id in self._empty[unit]:
            raise ValueError(f"block {block.block_id} is free already")
        self._change(unit, free)

    def _change(self, unit: int, update: Callable[[], None]) -> None:
        """Apply ``update`` to ``unit`` and bring every derived structure up to date."""
        self._changes += 1
        live_before, empty_before = self._live(unit), len(self._empty[unit])
        update()
        live, empty = self._live(unit), len(self._empty[unit])
        if live_before:
            self._empty_in_live -= empty_before
        else:
            self._empty_in_unmapped -= empty_before
        if live:
            self._empty_in_live += empty
        else:
            self._empty_in_unmapped += empty
        if not (live_before and live):  # an unmapped unit is involved: step 3's count changes
            self._new_count = None
        if not live_before and live:
            self._map_pages(unit, +1)
        elif live_before and not live:
            self._map_pages(unit, -1)
            heapq.heappush(self._unmapped, unit)
        if self._idle_now(unit):
            self._idle.setdefault(unit, None)
        else:
            self._idle.pop(unit, None)
        if live and empty and self._held[unit] == self._pinned[unit]:
            self._unclaimed[unit] = None
        else:
            self._unclaimed.pop(unit, None)
        bucket = live if live and empty else 0
        if bucket != self._bucket_of[unit]:
            self._buckets[self._bucket_of[unit]].pop(unit, None)
            if bucket:
                self._buckets[bucket][unit] = None
            self._bucket_of[unit] = bucket

    def _map_pages(self, unit: int, delta: int) -> None:
        for page in self.layout.unit_pages(unit):
            before = self._page_refs[page]
            self._page_refs[page] = before + delta
            if before == 0 or before + delta == 0:
                self.mapped_pages += delta
                self._changed.add(page)

    # ---- for tests ------------------------------------------------------------------------------
    def check(self, drain: bool = True) -> None:
        """Recompute every derived number and compare (tests only); ``drain``: also :meth:`check_obtainable`.

        Raises:
            AssertionError: a derived structure disagrees.
        """
        refs = [0] * self.layout.num_pages
        for unit in range(self.layout.num_units):
            live = self._live(unit)
            if live:
                for page in self.layout.unit_pages(unit):
                    refs[page] += 1
            if self._live(unit) + len(self._empty[unit]) != len(self.layout.unit_blocks(unit)):
                raise AssertionError(f"unit {unit}: held+cached+retained+empty != its blocks")
            retained = sum(1 for b in self.layout.unit_blocks(unit) if b in self._retained)
            cached = sum(1 for b in self.layout.unit_blocks(unit) if b in self._cached) - retained
            if (retained, cached) != (self._retained_in[unit], self._cached_in[unit]):
                raise AssertionError(f"unit {unit}: retained/cached counts disagree")
            if (unit in self._idle) != self._idle_now(unit):
                raise AssertionError(f"unit {unit}: idle membership wrong")
            unclaimed = bool(live and self._empty[unit] and self._held[unit] == self._pinned[unit])
            if (unit in self._unclaimed) != unclaimed:
                raise AssertionError(f"unit {unit}: unclaimed membership wrong")
        if not self._retained <= self._cached.keys():
            raise AssertionError("a retained block is not in the eviction order")
        lost = [i for i, b in self._cached.items() if i not in self._retained and b.block_hash is None]
        if lost:
            raise AssertionError(f"cached blocks {lost} lost their prefix-cache hash but stay cached")
        hashed = [i for empty in self._empty for i, b in empty.items() if self.caching and b.block_hash is not None]
        if hashed:
            raise AssertionError(f"free blocks {hashed} carry a prefix-cache hash but would be handed out as empty")
        if refs != self._page_refs:
            raise AssertionError("page reference counts disagree")
        if self.mapped_pages != sum(1 for r in refs if r) or self.mapped_pages > self.limit:
            raise AssertionError(f"mapped pages {self.mapped_pages} wrong or over the budget {self.limit}")
        empty_live = sum(len(e) for u, e in enumerate(self._empty) if self._live(u))
        empty_unmapped = sum(len(e) for u, e in enumerate(self._empty) if not self._live(u))
        if (empty_live, empty_unmapped) != (self._empty_in_live, self._empty_in_unmapped):
            raise AssertionError("empty block counters disagree")
        if drain:
            self.check_obtainable()

    def check_obtainable(self) -> None:
        """On a copy: one ``popleft_n(num_free_blocks)`` succeeds and leaves nothing step 3 could map (tests only).

        Raises:
            AssertionError: the free count promises more or less than one allocation obtains.
        """
        memo: dict[int, Any] = {id(b): b for b in self._blocks}  # blocks are read, never written
        memo[id(self.layout)] = self.layout
        memo[id(self._evict)] = lambda block: None
        if self.grants is not None:  # the copy sees the grants as they are and takes none
            memo[id(self.grants)] = SimpleNamespace(limit=self.grants.limit)
        clone = copy.deepcopy(self, memo)
        count = clone.num_free_blocks
        try:
            got = clone.popleft_n(count)
        except ValueError as error:
            raise AssertionError(f"the free count {count} is more than one allocation obtains: {error}") from None
        if len({b.block_id for b in got}) != count or clone.num_free_blocks:
            raise AssertionError(f"after taking {count} blocks, {clone.num_free_blocks} more are counted free")
        clone.check(drain=False)
        unit = clone._lowest_unmapped()
        if unit is not None and clone._new_pages(unit) <= clone.limit - clone.mapped_pages:
            raise AssertionError(f"the free count {count} misses unit {unit}, which fits the budget")
        if any(clone._live(clone.layout.unit_of(b.block_id)) for b in clone.get_all_free_blocks()):
            raise AssertionError(f"the free count {count} misses free blocks of mapped units")
