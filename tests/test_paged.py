"""Paged mode specifics: the block pool, the block table, the slot mapping, COW of blocks,
agreement with VMM mode, and errors. (Mode-generic lifecycle tests live in test_cache.py.)"""

from __future__ import annotations

import pytest
import torch
from helpers import KVMirror, small_config

import vmkv
from vmkv.paged import PagedKVCache

BLOCK = 32  # small_config's block_size


@pytest.fixture
def cache():
    cache = PagedKVCache(small_config(prefix_caching=False))
    yield cache
    cache.close()


def row(cache: PagedKVCache, seq_id, width: int = 6) -> list[int]:
    return cache.block_table[cache.slot(seq_id), :width].tolist()


def test_pools_are_sized_from_the_budget():
    config = small_config()
    cache = vmkv.open_cache(config, mode="paged")
    try:
        block_bytes = BLOCK * config.layer_token_bytes  # one block of one layer's K
        assert cache.num_blocks == config.memory_budget // (2 * config.num_layers * block_bytes) == 64
        k_pool, v_pool = cache.block_pool(1)
        assert k_pool.shape == v_pool.shape == (64, BLOCK, config.num_kv_heads, config.head_dim)
        stats = cache.stats()
        assert stats["mode"] == "paged" and stats["tokens_per_page"] == BLOCK
        assert stats["pool_bytes"] == config.memory_budget
        assert stats["kernel"] == "sdpa_chunked"
        assert cache.block_table.dtype == torch.int32
        assert cache.block_table.shape == (config.max_batch_size, config.max_seq_len // BLOCK)
        assert (cache.block_table == -1).all()
    finally:
        cache.close()


def test_block_table_holds_exact_page_ids_through_add_grow_free(cache):
    cache.add("a")
    cache.add("b")
    cache.begin_step({"a": 70, "b": 5})  # a: 3 blocks, b: 1 block; a fresh pool hands out 0, 1, 2...
    assert cache.pages("a") == [0, 1, 2] and row(cache, "a") == [0, 1, 2, -1, -1, -1]
    assert cache.pages("b") == [3] and row(cache, "b") == [3, -1, -1, -1, -1, -1]
    cache.begin_step({"a": 26, "b": 1})  # a reaches 96 = 3 full blocks; b stays in its block
    assert row(cache, "a") == [0, 1, 2, -1, -1, -1] and row(cache, "b") == [3, -1, -1, -1, -1, -1]
    cache.begin_step({"a": 1})  # token 96 opens a's 4th block
    assert row(cache, "a") == [0, 1, 2, 4, -1, -1]
    slot_a = cache.slot("a")
    cache.free("a")
    assert (cache.block_table[slot_a] == -1).all()
    cache.add("c")
    cache.begin_step({"c": 40})  # freed blocks come back, lowest id first
    assert cache.pages("c") == [0, 1] and row(cache, "c") == [0, 1, -1, -1, -1, -1]
    cache.reserve("c", 200)  # reserve grows the table too
    assert row(cache, "c", 8) == [0, 1, 2, 4, 5, 6, 7, -1]
    cache.check()


def test_step_block_table_and_slot_mapping(cache):
    cache.add("a")
    cache.add("b")
    cache.begin_step({"a": 40})
    plan = cache.begin_step({"b": 3, "a": 30})  # b: block 2; a: 40..69 in blocks 0, 1, 3
    assert plan.block_table.dtype == torch.int32
    assert plan.block_table.tolist() == [[2, -1, -1], [0, 1, 3]]  # width = a's 3 blocks
    rows = plan.write_rows.tolist()
    assert rows[:3] == [2 * BLOCK + 0, 2 * BLOCK + 1, 2 * BLOCK + 2]
    want_a = [(p // BLOCK) for p in range(40, 70)]
    assert rows[3:] == [[0, 1, 3][b] * BLOCK + p % BLOCK for b, p in zip(want_a, range(40, 70))]


def test_write_lands_in_the_mapped_rows_and_kv_gathers_it_back(cache):
    mirror = KVMirror(cache, q_heads=4)
    cache.add("a")
    cache.add("b")
    mirror.step({"a": 45, "b": 33})
    mirror.step({"a": 1, "b": 31})
    for seq_id in ("a", "b"):
        mirror.assert_stored(seq_id)
    k_pool, _ = cache.block_pool(1)
    k_a = mirror.k["a"][1]
    pages = cache.pages("a")
    assert torch.equal(k_pool[pages[1], 13], k_a[BLOCK + 13])  # token 45 sits in block 1, row 13
    assert torch.equal(k_pool[pages[0]], k_a[:BLOCK])


def test_fork_copy_on_write_rewrites_the_table_entry_and_keeps_the_parent_intact(cache):
    mirror = KVMirror(cache, q_heads=4)
    cache.add("a")
    mirror.step({"a": 40})  # blocks [0, 1]; block 1 holds 8 tokens
    mirror.fork("a", "b")
    assert row(cache, "b") == row(cache, "a") == [0, 1, -1, -1, -1, -1]
    assert cache.stats()["shared_pages"] == 2
    parent = [tuple(t.clone() for t in cache.kv("a", layer)) for layer in range(2)]
    pools = [tuple(t.clone() for t in cache.block_pool(layer)) for layer in range(2)]
    mirror.step({"b": 3})  # writes into shared block 1 -> b gets a copy (block 2)
    assert row(cache, "a") == [0, 1, -1, -1, -1, -1]
    assert row(cache, "b") == [0, 2, -1, -1, -1, -1]
    assert cache.stats()["cow_copies"] == 1
    for layer in range(2):
        k, v = cache.kv("a", layer)
        assert torch.equal(k, parent[layer][0]) and torch.equal(v, parent[layer][1])  # bit-identical
        for now, before in zip(cache.block_pool(layer), pools[layer]):
            assert torch.equal(now[1], before[1])  # the parent's block was never written
            assert torch.equal(now[2, :8], before[1, :8])  # the copy holds the stored tokens
    mirror.assert_stored("a")
    mirror.assert_stored("b")
    mirror.step({"a": 2, "b": 1})  # block 1 is a's alone now: no further copy
    assert cache.stats()["cow_copies"] == 1
    cache.check()


def test_a_prefix_hit_puts_the_cached_block_ids_in_the_table():
    cache = PagedKVCache(small_config())
    try:
        prompt = list(range(80))  # 2 full blocks + 16 tokens
        mirror = KVMirror(cache, q_heads=2)
        cache.add("a", prompt)
        plan = cache.begin_step({"a": prompt})
        for layer in range(2):
            k = mirror.randn(80, 2, 16)
            cache.write(layer, k, k, plan)
        cache.add("b", prompt)
        assert cache.seq_len("b") == 2 * BLOCK
        assert row(cache, "b") == row(cache, "a")[:2] + [-1, -1, -1, -1]
        assert cache.stats()["prefix_hits"] == 1
    finally:
        cache.close()


def test_trim_frees_blocks_and_release_is_a_no_op(cache):
    cache.add("a")
    cache.begin_step({"a": 70})  # blocks 0, 1, 2
    cache.truncate("a", 10)
    before = cache.stats()["pool_bytes"]
    assert cache.trim() == 2
    assert row(cache, "a") == [0, -1, -1, -1, -1, -1]
    assert cache.stats()["pool_bytes"] == before  # the pools stay allocated until close()


def _run(cache, gen: torch.Generator, batch: dict) -> list[torch.Tensor]:
    """One step of ``batch`` ({seq_id: count or token ids}) with seeded K/V/Q; returns each layer's output."""
    cfg = cache.config
    plan = cache.begin_step(batch)
    outs = []
    for layer in range(cfg.num_layers):
        k, v = (torch.randn(plan.num_tokens, 2, 16, generator=gen) for _ in range(2))
        q = torch.randn(plan.num_tokens, 4, 16, generator=gen)
        cache.write(layer, k, v, plan)
        outs.append(cache.attention(layer, q, plan))
    return outs


def test_vmm_and_paged_give_the_same_outputs_for_the_same_work():
    prompt = list(range(70))
    results = []
    for mode in ("vmm", "paged"):
        cache = vmkv.open_cache(small_config(), mode=mode)
        try:
            gen = torch.Generator().manual_seed(7)
            cache.add("a", prompt)
            cache.add("b")
            outs = _run(cache, gen, {"a": prompt, "b": 5})  # prefill, mixed lengths
            outs += _run(cache, gen, {"a": [5], "b": 1})  # decode
            cache.fork("a", "c")
            outs += _run(cache, gen, {"c": 2, "a": 1, "b": 40})  # copy-on-write + mixed
            cache.free("a")
            cache.add("d", prompt)  # prefix hit: 2 cached pages
            assert cache.seq_len("d") == 2 * BLOCK
            outs += _run(cache, gen, {"d": prompt[2 * BLOCK :], "b": 1})  # prefill over a cached prefix
            kv = {s: tuple(t.clone() for t in cache.kv(s, 1)) for s in ("b", "c", "d")}  # VMM views die at close()
            results.append((outs, kv, cache.stats()))
        finally:
            cache.close()
    (vmm_outs, vmm_kv, vmm_stats), (paged_outs, paged_kv, paged_stats) = results
    for a, b in zip(vmm_outs, paged_outs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for seq_id in vmm_kv:
        assert all(torch.equal(x, y) for x, y in zip(vmm_kv[seq_id], paged_kv[seq_id]))
    for key in ("tokens", "pages_in_use", "cow_copies", "prefix_hits", "shared_pages"):
        assert vmm_stats[key] == paged_stats[key], key


def test_errors_are_typed_and_raised_before_any_change(cache):
    cache.add("a")
    plan = cache.begin_step({"a": 4})
    k = torch.zeros(4, 2, 16)
    with pytest.raises(vmkv.InvalidShape):
        cache.write(0, torch.zeros(3, 2, 16), k, plan)
    with pytest.raises(vmkv.InvalidDtype):
        cache.write(0, k.double(), k, plan)
    with pytest.raises(vmkv.InvalidInput, match="not written"):
        cache.attention(0, torch.zeros(4, 2, 16), plan)  # the failed writes wrote nothing
    cache.write(0, k, k, plan)
    with pytest.raises(vmkv.InvalidShape):
        cache.attention(0, torch.zeros(4, 3, 16), plan)  # 3 query heads over 2 KV heads
    with pytest.raises(vmkv.InvalidDtype):
        cache.attention(0, torch.zeros(4, 2, 16, dtype=torch.bfloat16), plan)
    with pytest.raises(vmkv.InvalidInput):
        cache.attention(2, torch.zeros(4, 2, 16), plan)  # no layer 2
    table = cache.block_table.clone()
    pool = cache.block_pool(0)[0].clone()
    cache.add("b")  # any change makes the plan stale
    with pytest.raises(vmkv.StalePlan):
        cache.write(0, k, k, plan)
    with pytest.raises(vmkv.StalePlan):
        cache.attention(0, torch.zeros(4, 2, 16), plan)
    assert torch.equal(cache.block_pool(0)[0], pool)
    assert torch.equal(cache.block_table[cache.slot("a")], table[cache.slot("a")])


def test_kernel_and_device_errors():
    with pytest.raises(vmkv.InvalidConfig, match="kernel must be one of"):
        PagedKVCache(small_config(), kernel="no_such_kernel")
    with pytest.raises(vmkv.BackendUnavailable, match="multiple of 256"):
        PagedKVCache(small_config(), kernel="varlen_attn_block_table")
    with pytest.raises(vmkv.BackendUnavailable, match="needs CUDA"):
        PagedKVCache(small_config(), kernel="flashinfer_decode")
    with pytest.raises(vmkv.InvalidConfig, match="holds no block"):
        PagedKVCache(small_config(memory_budget=1024))
    if not torch.cuda.is_available():
        with pytest.raises(vmkv.BackendUnavailable, match="CUDA"):
            PagedKVCache(small_config(device="cuda"))


def test_close_is_idempotent():
    cache = PagedKVCache(small_config())
    cache.close()
    cache.close()
    assert cache.stats()["pool_bytes"] == 0
