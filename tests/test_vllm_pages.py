"""The vLLM plugin's page logic, without vLLM: where blocks live in the KV buffer
(:mod:`vmkv.vllm.layout`), which blocks are handed out and which pages are mapped
(:mod:`vmkv.vllm.scheduler.free_blocks`), and the worker's buffer (:mod:`vmkv.vllm.worker.kvbuffer`)."""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from fake_cuda import FakeRuntime
from fake_cuda.fixtures import fake, fake_lib  # noqa: F401  (fixtures)

import vmkv
from vmkv.vllm.layout import KVLayout, Segment, layout_from_views, view_segments
from vmkv.vllm.scheduler.free_blocks import PageAwareFreeBlocks
from vmkv.vllm.worker.kvbuffer import KVBuffer
from vmkv.vm import HostVirtualMemory

# vLLM 0.32's KVCacheLayout members: logical [L, B, H, N, C] axes in physical (memory) order.
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def kv_views(order: tuple[int, ...], layers: int = 2, blocks: int = 12, heads: int = 2, tokens: int = 8,
             content: int = 16, ratio: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An int32 buffer and its per-layer [B, H, N, C] views laid out like vLLM (``order``); with
    ``ratio`` > 1 each dense block is viewed as ``ratio`` dense kernel blocks of N / ratio tokens,
    as vLLM's create_kv_cache_views does for a kernel that needs smaller blocks."""
    sizes = [layers, blocks, heads, tokens, content]
    strides = [0] * 5
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= sizes[dim]
    raw = torch.zeros(step, dtype=torch.int32)
    five = raw.as_strided(sizes, strides)
    if ratio > 1:
        kernel = tokens // ratio * content
        five = raw.as_strided([layers, blocks * ratio, heads, tokens // ratio, content],
                              [strides[0], strides[1] // ratio, kernel, content, 1])
    return raw, [five[layer] for layer in range(layers)]


def pages_written(raw: torch.Tensor, views: list[torch.Tensor], page_bytes: int, blocks: range) -> set[int]:
    """Pages holding bytes of ``blocks`` (found by writing markers through the views)."""
    raw.zero_()
    for view in views:
        ratio = view.shape[0] // 12
        for block in blocks:
            view[block * ratio:(block + 1) * ratio] = 1
    per_page = page_bytes // raw.element_size()
    return {int(i) // per_page for i in torch.nonzero(raw).flatten()}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("page_bytes", [1024, 4096, 8192])
def test_unit_pages_are_exactly_the_pages_its_blocks_write(name, page_bytes):
    raw, views = kv_views(LAYOUTS[name])
    layout = layout_from_views(dict(enumerate(views)), 12, raw.numel() * 4, page_bytes)
    assert layout.num_pages == -(-raw.numel() * 4 // page_bytes)
    for unit in range(layout.num_units):
        blocks = layout.unit_blocks(unit)
        assert set(layout.unit_pages(unit)) == pages_written(raw, views, page_bytes, blocks), (name, unit)
        assert len(layout.unit_pages(unit)) <= layout.max_pages_per_unit
    touched = set().union(*(layout.unit_pages(u) for u in range(layout.num_units)))
    assert touched == set(range(layout.num_pages))  # every byte belongs to some block


def test_units_cover_whole_pages_when_the_layer_regions_are_aligned():
    raw, views = kv_views(LAYOUTS["LBHNC"], blocks=12)  # a block: 2*8*16*4 = 1 KiB a layer
    layout = layout_from_views(dict(enumerate(views)), 12, raw.numel() * 4, 4096)
    assert layout.blocks_per_unit == 4 and layout.num_units == 3
    assert [layout.unit_pages(u) for u in range(3)] == [(0, 3), (1, 4), (2, 5)]  # one page per layer
    assert layout.max_pages_per_unit == 2
    assert layout.segments == (Segment(0, 1024, 1024), Segment(12 * 1024, 1024, 1024))


def test_kernel_block_split_gives_the_same_layout():
    raw, manager = kv_views(LAYOUTS["LBHNC"])
    _, kernel = kv_views(LAYOUTS["LBHNC"], ratio=2)
    nbytes = raw.numel() * 4
    a = layout_from_views(dict(enumerate(manager)), 12, nbytes, 4096)
    b = layout_from_views(dict(enumerate(kernel)), 12, nbytes, 4096)
    assert a.segments == b.segments and a.fingerprint == b.fingerprint


def test_layout_refuses_runs_outside_the_buffer():
    with pytest.raises(vmkv.InvalidConfig, match="does not fit"):
        KVLayout([Segment(0, 1024, 2048)], 8, 8 * 1024, 4096)
    with pytest.raises(vmkv.InvalidConfig, match="walk"):
        view_segments(torch.zeros(10, 3), 4)


# ---- the page-aware free set ----------------------------------------------------------------------
class Block:
    """The two fields of vLLM's KVCacheBlock the free set reads."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.block_hash: object | None = None


def two_layer_layout(blocks: int = 32) -> KVLayout:
    """32 blocks of 1 KiB per layer, 4 KiB pages: units of 4 blocks, 2 pages each (one per layer)."""
    return KVLayout([Segment(0, 1024, 1024), Segment(blocks * 1024, 1024, 1024)], blocks, 2 * blocks * 1024, 4096)


def layer_runs(blocks: int, layers: int) -> KVLayout:
    """vLLM's CPU layout (LBHNC): one run of 1 KiB blocks per layer, 4 KiB pages (4 blocks a unit).
    With ``blocks`` not a multiple of 4, layer runs after the first do not start on a page."""
    return KVLayout([Segment(layer * blocks * 1024, 1024, 1024) for layer in range(layers)], blocks,
                    layers * blocks * 1024, 4096)


def free_set(budget_pages: int = 16, max_idle_units: int = 8, caching: bool = True, layout: KVLayout | None = None):
    layout = layout or two_layer_layout()
    blocks = [Block(i) for i in range(layout.num_blocks)]
    evicted: list[int] = []

    def evict(block: Block) -> None:
        evicted.append(block.block_id)
        block.block_hash = None

    free = PageAwareFreeBlocks(blocks, layout, budget_pages, max_idle_units, caching, evict)
    free.pin(blocks[0])  # vLLM's null block, held for good
    return free, blocks, evicted


def units_of(free, blocks) -> list[int]:
    return [free.layout.unit_of(b.block_id) for b in blocks]


def test_blocks_fill_a_mapped_page_before_the_next():
    free, _, _ = free_set()
    got = free.popleft_n(7)  # one request: block 0's page first (mapped anyway), then a new one
    assert units_of(free, got) == [0, 0, 0, 1, 1, 1, 1]
    assert free.mapped_pages == 4  # 2 units x 2 pages
    assert free.take_delta() == ([0, 1, 8, 9], [])  # pages of units 0 and 1, both layers
    free.check()


def test_each_request_fills_its_own_page_and_leaves_no_holes_behind():
    free, blocks, _ = free_set()
    a = free.popleft_n(2)  # request a: into block 0's page
    b = free.popleft_n(1)  # request b: block 0's page is claimed by a now: b opens unit 1
    with free.affinity(a[-1].block_id):
        a += free.popleft_n(3)  # a grows in its own page, then opens unit 2
    with free.affinity(b[-1].block_id):
        b += free.popleft_n(2)  # b grows in unit 1, not in a's holes
    assert units_of(free, a) == [0, 0, 0, 2, 2] and units_of(free, b) == [1, 1, 1]
    free.append_n(b)  # b finishes: its page goes whole
    assert free.mapped_pages == 4 and free.take_delta()[1] == []  # (unit 1 came and went)
    free.check()


def test_under_budget_pressure_requests_share_pages_fullest_first():
    free, _, _ = free_set(budget_pages=6)  # 3 units: block 0's and two more
    a, b, c = free.popleft_n(3), free.popleft_n(2), free.popleft_n(1)
    assert units_of(free, a + b + c) == [0, 0, 0, 1, 1, 2]  # every unit mapped: the budget is used up
    assert units_of(free, free.popleft_n(3)) == [1, 1, 2]  # a new request takes holes, fullest unit first
    with free.affinity(c[-1].block_id):
        assert units_of(free, free.popleft_n(2)) == [2, 2]  # c still fills its own page
    assert free.num_free_blocks == 0
    free.check()


def test_freeing_a_whole_unit_unmaps_its_pages_and_deltas_are_net():
    free, blocks, _ = free_set(caching=False)
    got = free.popleft_n(7)
    free.take_delta()
    free.append_n(got[3:])  # unit 1 becomes empty
    assert free.mapped_pages == 2
    assert free.take_delta() == ([], [1, 9])
    again = free.popleft_n(4)  # maps unit 1 again ...
    free.append_n(again)  # ... and unmaps it before the next step
    assert free.take_delta() == ([], [])
    assert free.has_delta() is False
    free.check()


def test_the_budget_bounds_the_free_count_and_a_refusal_changes_nothing():
    free, _, _ = free_set(budget_pages=6)  # 3 units: block 0's and two more
    assert free.num_free_blocks == 3 + 2 * 4
    free.popleft_n(11)
    assert free.num_free_blocks == 0 and free.mapped_pages == 6
    before = free.stats()
    with pytest.raises(ValueError, match="Cannot get 1 free blocks"):
        free.popleft_n(1)
    assert free.stats() == before
    free.check()


def test_budget_too_small_for_two_units_is_refused():
    with pytest.raises(vmkv.InvalidConfig, match="cannot hold two units"):
        free_set(budget_pages=3)


@pytest.mark.parametrize("blocks", [1000, 1001, 255])  # page-aligned layer runs, and two unaligned counts
@pytest.mark.parametrize("layers", [1, 2, 3, 8, 32])
def test_with_the_whole_buffer_as_budget_every_free_block_counts_and_one_allocation_gets_them(blocks, layers):
    layout = layer_runs(blocks, layers)
    free, _, _ = free_set(budget_pages=layout.num_pages, layout=layout)
    assert free.num_free_blocks == blocks - 1  # as vLLM's own queue: every block but the null block
    got = free.popleft_n(blocks - 1)
    assert sorted(b.block_id for b in got) == list(range(1, blocks))
    assert free.num_free_blocks == 0 and free.mapped_pages == layout.num_pages
    free.check()


@pytest.mark.parametrize("blocks", [1000, 1001, 255])
@pytest.mark.parametrize("layers", [1, 2, 3, 8, 32])
def test_under_a_smaller_budget_the_free_count_is_what_one_allocation_obtains(blocks, layers):
    layout = layer_runs(blocks, layers)
    free, blocks_, _ = free_set(budget_pages=layout.num_pages // 3, layout=layout)
    free.check()  # before anything: one popleft_n(num_free_blocks) succeeds and leaves no unit that fits
    with free.affinity(None):
        held = free.popleft_n(free.num_free_blocks // 2)
    free.append_n(held[1::3])  # holes: units next to mapped ones need fewer new pages
    free.check()
    count = free.num_free_blocks
    assert len(free.popleft_n(count)) == count and free.num_free_blocks == 0
    assert free.mapped_pages <= free.budget_pages
    with pytest.raises(ValueError, match="Cannot get 1 free blocks"):
        free.popleft_n(1)


@pytest.mark.parametrize("blocks", [100, 61])
def test_the_tiny_engines_buffers_count_every_block_free_as_stock(blocks):
    """The tiny model's KV (128 KiB a block and layer, 2 layers) in 2 MiB pages: 16 blocks a unit.
    A 26,214,400-byte buffer (100 blocks) used to count 63 of 99 free, a 15,990,784-byte one (61)
    31 of 60, so a 6,000-token prompt (47 blocks) was never scheduled."""
    layout = KVLayout([Segment(layer * blocks * 131072, 131072, 131072) for layer in range(2)], blocks,
                      2 * blocks * 131072, 2 * 2**20)
    assert layout.blocks_per_unit == 16
    free, _, _ = free_set(budget_pages=layout.num_pages, layout=layout)
    assert free.num_free_blocks == blocks - 1 and len(free.popleft_n(blocks - 1)) == blocks - 1


def test_a_small_buffer_is_not_refused_when_the_budget_is_all_of_it():
    layout = layer_runs(5, 2)  # 3 pages; a unit may touch 3 (layer 1 straddles pages 1 and 2)
    assert (layout.num_pages, layout.max_pages_per_unit) == (3, 3)
    free, _, _ = free_set(budget_pages=3, layout=layout)
    assert free.num_free_blocks == 4 and len(free.popleft_n(4)) == 4
    with pytest.raises(vmkv.InvalidConfig, match="cannot hold two units"):
        free_set(budget_pages=2, layout=layout)


def hashed(blocks, ids):
    for i in ids:
        blocks[i].block_hash = ("hash", i)
    return [blocks[i] for i in ids]


def test_cached_blocks_keep_their_pages_and_idle_units_are_capped():
    free, blocks, evicted = free_set(max_idle_units=1)
    free.popleft_n(11)  # units 0, 1, 2 (one request)
    free.append_n(hashed(blocks, [4, 5, 6, 7]))  # unit 1: only cached blocks -> idle, stays mapped
    assert free.stats()["idle_units"] == 1 and free.mapped_pages == 6 and evicted == []
    free.append_n(hashed(blocks, [8, 9, 10, 11]))  # unit 2 idle too: the cap evicts unit 1 whole
    assert evicted == [4, 5, 6, 7] and free.stats()["idle_units"] == 1
    assert free.mapped_pages == 4
    assert free.take_delta() == ([0, 2, 8, 10], [])  # unit 1 came and went between two steps
    free.check()


def test_a_prefix_hit_takes_a_cached_block_back():
    free, blocks, _ = free_set()
    free.popleft_n(7)
    free.append_n(hashed(blocks, [4, 5, 6, 7]))
    free.remove(blocks[5])  # vLLM's touch() on a prefix-cache hit
    assert free.stats()["idle_units"] == 0 and free.stats()["cached_blocks"] == 3
    with pytest.raises(ValueError, match="not free"):
        free.remove(blocks[5])
    free.check()


def test_under_budget_pressure_a_whole_idle_unit_goes_before_single_cached_blocks():
    free, blocks, evicted = free_set(budget_pages=6)
    free.popleft_n(11)
    free.append_n(hashed(blocks, [4, 5, 6, 7]))  # unit 1 idle
    free.append_n(hashed(blocks, [9]))  # unit 2 keeps 2 held and 1 cached block
    free.take_delta()
    got = free.popleft_n(2)
    assert units_of(free, got) == [1, 1] and evicted == [4, 5, 6, 7]  # unit 1 reused whole, in place
    assert free.take_delta() == ([], [])  # no page changed
    assert free.num_free_blocks == 2 + 1  # the rest of unit 1, and block 9 (cached, evictable)
    assert blocks[9] in free.popleft_n(3)  # last: one cached block (vLLM's get_new_blocks drops its hash)
    free.check()


def free_like_vllm(free, blocks, ids):
    """A request finishes: its full blocks keep their prefix-cache hash, and vLLM frees them
    last block first (``free_blocks`` gets them in eviction order)."""
    free.append_n(hashed(blocks, ids)[::-1])


def test_when_only_the_block_count_is_short_cached_blocks_go_one_by_one_least_recent_first():
    """13 blocks, 4 a unit, the whole buffer as budget: x holds blocks 1-3, a blocks 4-7, both
    finish; b needs 6. vLLM's queue evicts the least recently freed block (x's last) and keeps a's
    prefix; evicting a's idle unit whole would cost all of a's hits and free no memory."""
    layout = layer_runs(13, 2)
    free, blocks, evicted = free_set(budget_pages=layout.num_pages, layout=layout)
    x, a = free.popleft_n(3), free.popleft_n(4)
    assert [b.block_id for b in x + a] == [1, 2, 3, 4, 5, 6, 7]
    free_like_vllm(free, blocks, [1, 2, 3])
    free_like_vllm(free, blocks, [4, 5, 6, 7])
    b = free.popleft_n(6)
    assert sorted(block.block_id for block in b) == [3, 8, 9, 10, 11, 12] and evicted == []
    assert all(blocks[i].block_hash is not None for i in (4, 5, 6, 7))  # a's prefix is still cached
    assert [blk.block_id for blk in free.get_all_free_blocks()] == [2, 1, 7, 6, 5, 4]  # stock's eviction order
    free.check()


def test_retained_blocks_go_last_and_keep_their_page_mapped_until_handed_out():
    """vLLM's unpin_blocks: released blocks join the tail of the free queue and stay readable
    until reused; here their unit stays mapped, whatever the idle cap or a trim would do."""
    free, blocks, evicted = free_set(max_idle_units=0, caching=True)
    held = free.popleft_n(11)  # units 0, 1, 2
    free.append_n(hashed(blocks, [8]))  # cached before the unpin
    with free.retaining():
        free.append_n([blocks[4], blocks[5], blocks[6], blocks[7]])  # unit 1: retained only
    free.take_delta()
    assert free.mapped_pages == 6 and free.trim() == 0 and evicted == []  # still read: nothing unmapped
    assert free.stats()["retained_blocks"] == 4 and free.num_free_blocks == 31 - 11 + 5
    free.append_n([b for b in held if b.block_id in (9, 10, 11)])  # unit 2 keeps cached block 8 only
    assert evicted == [8]  # the idle cap (0) evicts unit 2, not the retained unit 1
    order = [b.block_id for b in free.popleft_n(free.num_free_blocks)]
    assert sorted(order[:-4]) == [8, 9, 10, 11] + list(range(12, 32)) and order[-4:] == [4, 5, 6, 7]
    free.check()


def test_reset_forgets_retained_blocks_too():
    free, blocks, _ = free_set()
    free.popleft_n(7)
    with free.retaining():
        free.append_n(blocks[4:8])
    free.take_delta()
    free.forget_hashes()  # BlockPool.reset_prefix_cache tells their readers to stop first
    assert free.stats()["retained_blocks"] == 0 and free.take_delta() == ([], [1, 9])
    free.check()


def test_trim_unmaps_every_idle_unit_and_reset_forgets_hashes():
    free, blocks, evicted = free_set()
    free.popleft_n(11)
    free.append_n(hashed(blocks, [4, 5, 6, 7]))
    free.append_n(hashed(blocks, [8]))
    free.take_delta()
    assert free.trim() == 2  # unit 1's pages; unit 2 still holds blocks
    assert free.take_delta() == ([], [1, 9]) and evicted == [4, 5, 6, 7]
    blocks[8].block_hash = None  # what BlockPool.reset_prefix_cache / evict_blocks do
    free.hash_removed(blocks[8])
    assert free.stats()["cached_blocks"] == 0
    free.check()


class Grants:
    """A ledger seat as the free set sees it (:class:`vmkv.vllm.scheduler.share.EngineShare`'s contract):
    ``cover`` grants some of what is asked, at random; the limit never drops below what is mapped."""

    def __init__(self, rng: random.Random, free: PageAwareFreeBlocks) -> None:
        self.rng, self.limit, self.covered = rng, free.mapped_pages, 0

    def cover(self, pages: int, *, wait: bool) -> None:
        self.limit = max(self.limit, min(pages, self.rng.randint(self.limit, 10)))
        self.covered += 1


@pytest.mark.parametrize("shared", [False, True], ids=["own budget", "shared budget"])
@pytest.mark.parametrize("layout", [two_layer_layout(), layer_runs(33, 3)], ids=["aligned", "unaligned"])
def test_random_operations_keep_every_invariant_and_deltas_replay_the_mapping(layout, shared):
    """With ``shared``, the grants also bound the mapped pages (and so the free count), rise on
    ``make_room`` and fall to what is mapped after idle units are evicted on request."""
    rng = random.Random(0)
    free, blocks, _ = free_set(budget_pages=10, max_idle_units=8 if shared else 2, layout=layout)
    grants = free.grants = Grants(rng, free) if shared else None
    held = {0}
    retained: set[int] = set()
    worker: set[int] = set()
    for _ in range(600):
        op = rng.random()
        if shared and op < 0.4:
            free.make_room(rng.randint(1, 6))  # vLLM counts a request's need, then the free blocks
        if op < 0.4 and free.num_free_blocks:
            hint = rng.choice(sorted(held)) if rng.random() < 0.5 else None  # a request's last block
            with free.affinity(hint):
                got = free.popleft_n(rng.randint(1, min(5, free.num_free_blocks)))
            retained.difference_update(b.block_id for b in got)
            for block in got:
                block.block_hash = None  # vLLM evicts a reused block's hash
                held.add(block.block_id)
        elif op < 0.75 and len(held) > 1:
            out = rng.sample(sorted(held - {0}), rng.randint(1, min(4, len(held) - 1)))
            for i in out:
                blocks[i].block_hash = ("h", i) if rng.random() < 0.5 else None
                held.discard(i)
            retain = rng.random() < 0.2  # unpin_blocks: still read until handed out again
            with free.retaining() if retain else contextlib.nullcontext():
                free.append_n([blocks[i] for i in out])
            retained.update(out if retain else ())
        elif op < 0.85:
            cached = [b for b in free.get_all_free_blocks() if b.block_hash is not None]
            if cached:
                block = rng.choice(cached)
                free.remove(block)
                held.add(block.block_id)
                retained.discard(block.block_id)
        elif op < 0.9 and shared:  # another member asks: evict idle units, give back down to what is mapped
            idle = free.idle_pages()
            before = free.mapped_pages
            assert free.evict_idle(rng.randint(1, 4)) == before - free.mapped_pages <= idle
            grants.limit = rng.randint(free.mapped_pages, grants.limit)
            free.limit_changed()
        elif op < 0.9:
            free.trim()
        to_map, to_unmap = free.take_delta()
        assert not set(to_map) & worker and set(to_unmap) <= worker
        worker = (worker - set(to_unmap)) | set(to_map)
        assert len(worker) == free.mapped_pages <= (grants.limit if shared else 10)
        for block_id in held | retained:  # every held or retained block's pages are mapped on the worker
            assert set(free.layout.unit_pages(free.layout.unit_of(block_id))) <= worker
        free.check()
    assert not shared or grants.covered > 10


# ---- the worker's buffer ----------------------------------------------------------------------------
PAGE = 64 * 1024


def test_buffer_maps_pages_on_request_and_gives_memory_back():
    with HostVirtualMemory(PAGE, 4) as backend:
        buffer = KVBuffer(backend, 10 * PAGE - 100)
        raw = buffer.tensor()  # [10 * PAGE - 100] int8
        assert buffer.num_pages == 10 and raw.numel() == 10 * PAGE - 100
        assert int(raw.abs().sum()) == 0 and backend.resident_bytes() == 0  # reads as zeros, no memory
        buffer.apply([], [0, 7])
        raw[:PAGE] = 3
        raw[7 * PAGE:8 * PAGE] = 5
        assert backend.resident_bytes() == 2 * PAGE
        assert int(raw[PAGE:2 * PAGE].abs().sum()) == 0  # an unmapped page between reads zeros
        buffer.apply([0], [3])  # the freed physical page is reused
        assert int(raw[:PAGE].abs().sum()) == 0 and int(raw[7 * PAGE]) == 5
        assert backend.resident_bytes() == PAGE  # page 0's memory went back to the OS
        assert buffer.stats()["mapped_pages"] == 2 and (buffer.maps, buffer.unmaps) == (3, 1)
        buffer.close()


@pytest.mark.parametrize("unmap, map_, error, match", [
    ([], [10], vmkv.InvalidInput, "outside"),
    ([1], [], vmkv.InvalidInput, "not mapped"),
    ([], [2], vmkv.InvalidInput, "mapped already"),
    ([], [4, 4], vmkv.InvalidInput, "listed twice"),
    ([], [3, 4, 5], vmkv.BackendError, "physical pages free"),
])
def test_buffer_refuses_bad_lists_before_changing_anything(unmap, map_, error, match):
    with HostVirtualMemory(PAGE, 3) as backend:
        buffer = KVBuffer(backend, 10 * PAGE)
        buffer.apply([], [2])
        buffer.tensor()[2 * PAGE] = 9
        with pytest.raises(error, match=match):
            buffer.apply(unmap, map_)
        assert buffer.mapped_pages == 1 and int(buffer.tensor()[2 * PAGE]) == 9 and buffer.maps == 1
        buffer.close()


def test_an_on_demand_cuda_buffer_creates_a_steps_pages_in_one_batch_and_gives_unmapped_ones_back(fake):  # noqa: F811
    """In a shared budget the worker's CUDA store holds device memory only for mapped pages: a
    step's new pages are created together (one memset), an unmapped page is released at once."""
    from vmkv.vm.cuda import CudaVirtualMemory

    fake.reset(granularity=4096)
    buffer = KVBuffer(CudaVirtualMemory(4096, 8, device="cuda:0", runtime=FakeRuntime(), on_demand=True), 8 * 4096)
    try:
        zero = fake.state()["memory_used"]  # the zero page only: nothing created up front
        assert zero == 4096
        fake.calls(clear=True)
        buffer.apply([], [0, 1, 2])
        calls = [call.name for call in fake.calls(clear=True)]
        assert (calls.count("cuMemCreate"), calls.count("cuMemsetD8")) == (3, 1)
        assert fake.state()["memory_used"] == zero + 3 * 4096
        buffer.apply([1, 2], [5])  # two unmapped and released, one created for the new page
        calls = [call.name for call in fake.calls()]
        assert (calls.count("cuMemRelease"), calls.count("cuMemCreate")) == (2, 1)
        assert fake.state()["memory_used"] == zero + 2 * 4096 and buffer.mapped_pages == 2
    finally:
        buffer.close()


def test_a_write_to_an_unmapped_page_fails_loudly():
    """A kernel that writes outside the mapped pages must crash (SIGSEGV), never write silently."""
    script = textwrap.dedent(f"""
        import faulthandler; faulthandler.enable()
        from vmkv.vm import HostVirtualMemory
        from vmkv.vllm.worker.kvbuffer import KVBuffer
        buffer = KVBuffer(HostVirtualMemory({PAGE}, 2), 4 * {PAGE})
        buffer.apply([], [0])
        raw = buffer.tensor()
        raw[0] = 1                     # mapped: fine
        assert int(raw[{PAGE}]) == 0   # unmapped: reads zero
        print("before", flush=True)
        raw[{PAGE}] = 1                # unmapped: the process must die here
        print("after", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGSEGV, proc.stderr
    assert "before" in proc.stdout and "after" not in proc.stdout
    assert "Segmentation fault" in proc.stderr
