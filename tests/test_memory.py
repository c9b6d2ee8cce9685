"""VMM mode on the host: the memory mapped is exactly what the tokens need, seen by the process."""

import torch
from helpers import rss_bytes

import vmkv

MiB = 1 << 20


def big_cache(**overrides) -> vmkv.VirtualKVCache:
    """2 layers x 4 KV heads x 64 floats = 1 KiB a token a tensor; 2 MiB pages = 2048 tokens.

    64 slots x 128K tokens x 4 tensors reserves 32 GiB of address space.
    """
    config = dict(
        num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32", max_batch_size=64,
        max_seq_len=128 * 1024, memory_budget="256MiB", page_size="2MiB",
    )
    return vmkv.VirtualKVCache(vmkv.KVCacheConfig(**{**config, **overrides}))


ONES = torch.ones(4 * 2048, 4, 64)
"""The K/V written, allocated once at import: an 8 MiB tensor made and freed inside a test would
land in the RSS it measures whenever glibc serves it from the heap (after an earlier free of a
large block raised its mmap threshold) and keeps it after the free: 8 MiB over the bound when
test_vm_host ran first."""


def fill(cache: vmkv.VirtualKVCache, batch: dict) -> None:
    """Write ones as the K/V of ``batch`` {seq_id: new tokens} in every layer."""
    plan = cache.begin_step(batch)
    kv = ONES[: plan.num_tokens]
    for layer in range(cache.config.num_layers):
        cache.write(layer, kv, kv, plan)


def test_reserving_the_whole_cache_costs_no_resident_memory():
    before = rss_bytes()
    cache = big_cache()
    assert cache.stats()["reserved_bytes"] == 32 << 30
    assert rss_bytes() - before < 8 * MiB
    assert cache.stats()["resident_bytes"] == 0 and cache.stats()["bytes_in_use"] == 0
    cache.close()


def test_mapped_bytes_are_exactly_the_pages_the_tokens_need():
    cache = big_cache()
    tpp = cache.tokens_per_page
    assert tpp == 2048
    for seq_id in range(3):
        cache.add(seq_id)
    base = rss_bytes()
    fill(cache, {0: tpp, 1: 2 * tpp, 2: tpp})  # 4 pool pages of 4 x 2 MiB
    page_bytes = cache.geometry.page_bytes
    stats = cache.stats()
    assert page_bytes == 8 * MiB
    assert stats["pages_in_use"] == 4 and stats["bytes_in_use"] == 4 * page_bytes
    assert stats["resident_bytes"] == 4 * page_bytes  # the memfd holds exactly those pages
    assert stats["utilization"] == 1.0
    grown = rss_bytes() - base
    assert 4 * page_bytes - 2 * MiB <= grown <= 4 * page_bytes + 6 * MiB, grown

    fill(cache, {0: 1})  # one more token maps one more page (4 x 2 MiB) but touches 4 KiB of each
    assert cache.stats()["bytes_in_use"] == 5 * page_bytes

    mapped = rss_bytes()
    cache.free(1)
    cache.free(2)
    assert cache.stats()["pages_spare"] == 3  # deferred reclamation: still mapped
    released = cache.trim()
    assert released == 3
    stats = cache.stats()
    assert stats["pages_in_use"] == 2 and stats["resident_bytes"] <= 2 * page_bytes
    assert mapped - rss_bytes() >= 3 * page_bytes - 2 * MiB  # trim gave the memory back
    cache.close()


def test_all_layers_layout_maps_fewer_tokens_per_page():
    cache = big_cache(layout="all_layers")
    assert cache.tokens_per_page == 1024 and cache.geometry.num_tensors == 2
    cache.add("a")
    fill(cache, {"a": 1500})
    stats = cache.stats()
    assert stats["pages_in_use"] == 2 and stats["bytes_in_use"] == 2 * 2 * 2 * MiB
    k, v = cache.kv("a", 1)
    assert k.shape == (1500, 4, 64) and bool((k == 1).all()) and bool((v == 1).all())
    cache.close()


def test_views_are_zero_copy():
    cache = big_cache()
    cache.add("a")
    fill(cache, {"a": 10})
    k_all, _ = cache.kv_cache(0)
    k, _ = cache.kv("a", 0)
    assert k_all.shape == (64, 128 * 1024, 4, 64)
    assert k.data_ptr() == k_all[cache.slot("a")].data_ptr()
    plan = cache.begin_step({"a": 1})
    cache.write(0, torch.full((1, 4, 64), 5.0, dtype=k.dtype), torch.zeros(1, 4, 64, dtype=k.dtype), plan)
    assert k_all[cache.slot("a"), 10, 0, 0].item() == 5.0  # the view taken before the write sees it
    cache.close()
