"""VMM layouts (per_layer, all_layers, head_major) through the whole lifecycle against a dense
mirror, and the per-device default layout and page size."""

from __future__ import annotations

import pytest
import torch
from helpers import KVMirror, small_config

import vmkv
from vmkv.sizing import DEFAULT_TOKENS_PER_PAGE, DeviceFacts, default_pages, resolve
from vmkv.vm import mapping_room

PAGES = {"per_layer": "4KiB", "all_layers": "8KiB", "head_major": "4KiB"}  # 32, 32 and 64 tokens a page


@pytest.mark.parametrize("layout", list(PAGES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lifecycle_in_every_layout(layout, dtype):
    """Prefill, decode across page boundaries, fork + copy-on-write, a prefix hit, free and trim:
    every output against the float64 reference, every stored K/V read back exactly."""
    cache = vmkv.VirtualKVCache(small_config(layout=layout, page_size=PAGES[layout], dtype=dtype))
    try:
        tpp = cache.tokens_per_page
        mirror = KVMirror(cache, q_heads=4)
        prompt = list(range(2 * tpp + 5))
        cache.add("a", token_ids=prompt)
        plan = cache.begin_step({"a": prompt})  # ids given: full pages enter the prefix cache
        gen = torch.Generator().manual_seed(1)
        ks = [torch.randn(len(prompt), 2, 16, generator=gen).to(cache.config.dtype) for _ in range(2)]
        for layer in range(2):
            cache.write(layer, ks[layer], -ks[layer], plan)
        mirror.k["a"] = [k.clone() for k in ks]
        mirror.v["a"] = [-k for k in ks]
        for _ in range(3):
            mirror.step({"a": 1})
        mirror.fork("a", "b")  # shares every page; the partly filled last page is copied on write
        mirror.step({"a": 1, "b": 1})
        mirror.step({"b": tpp})  # b grows a page of its own
        cache.add("c", token_ids=prompt)  # two full pages of the prompt come from the prefix cache
        assert cache.seq_len("c") == 2 * tpp and cache.stats()["prefix_hits"] >= 1
        mirror.k["c"] = [k[: 2 * tpp] for k in mirror.k["a"]]
        mirror.v["c"] = [v[: 2 * tpp] for v in mirror.v["a"]]
        mirror.step({"c": 5, "a": 1})
        for seq_id in "abc":
            mirror.assert_stored(seq_id)
        assert cache.stats()["cow_copies"] >= 1
        mirror.free("b")
        cache.trim()
        cache.check()
        mirror.assert_stored("a"), mirror.assert_stored("c")
    finally:
        cache.close()


@pytest.mark.parametrize("layout", list(PAGES))
def test_write_batch_stores_what_write_stores_and_returns_the_batch(layout):
    """write_batch (a dense step given as [B, kv_heads, S, head_dim]) stores exactly what write
    stores, across a page boundary and after a fork (copy-on-write), returns every token of the
    batch (zero-copy views for evenly spaced slots, a gathered copy otherwise) and refuses a
    ragged step, a stale plan and a misshapen tensor without storing anything."""
    cache = vmkv.VirtualKVCache(small_config(layout=layout, page_size=PAGES[layout], max_batch_size=4))
    try:
        tpp = cache.tokens_per_page
        gen = torch.Generator().manual_seed(3)
        stored: dict[str, list[list[torch.Tensor]]] = {}  # seq -> layer -> [K, V] chunks [S, H, D]

        def step(seq_ids: list[str], count: int) -> tuple[torch.Tensor, ...]:
            plan = cache.begin_step(dict.fromkeys(seq_ids, count))
            for layer in range(2):
                k, v = (torch.randn(len(seq_ids), 2, count, 16, generator=gen) for _ in range(2))
                keys, values = cache.write_batch(layer, k, v, plan)
                for row, seq_id in enumerate(seq_ids):
                    chunks = stored.setdefault(seq_id, [[[], []], [[], []]])[layer]
                    chunks[0].append(k[row].transpose(0, 1)), chunks[1].append(v[row].transpose(0, 1))
                    want_k, want_v = (torch.cat(c) for c in chunks)
                    assert torch.equal(keys[row].transpose(0, 1), want_k) and torch.equal(values[row].transpose(0, 1), want_v)
                    got_k, got_v = cache.kv(seq_id, layer)
                    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
            return keys, plan

        cache.add("a"), cache.add("b")
        keys, _ = step(["a", "b"], tpp - 1)
        assert keys.shape == (2, 2, tpp - 1, 16) and not keys.is_contiguous()  # a view of the slots
        for _ in range(3):  # decode across the page boundary: the fast path, then the full path
            step(["a", "b"], 1)
        cache.fork("a", "c")  # shares a's pages; the next write copies the partly filled one
        stored["c"] = [[list(part) for part in layer] for layer in stored["a"]]
        keys, plan = step(["c", "a"], 1)  # slots 2, 0: not evenly spaced, so gathered
        assert keys.is_contiguous() and cache.stats()["cow_copies"] >= 1
        before = [cache.kv(seq_id, 0)[0].clone() for seq_id in "ac"]
        bad = torch.zeros(2, 2, 1, 16)
        with pytest.raises(vmkv.errors.InvalidShape):
            cache.write_batch(0, bad[:1], bad[:1], plan)
        with pytest.raises(vmkv.errors.InvalidShape):
            cache.write_batch(0, bad, bad[..., :8], plan)
        ragged = cache.begin_step({"a": 1, "b": 2})
        with pytest.raises(vmkv.errors.InvalidInput, match="same number"):
            cache.write_batch(0, bad, bad, ragged)
        with pytest.raises(vmkv.errors.StalePlan):
            cache.write_batch(0, bad, bad, plan)
        assert all(torch.equal(cache.kv(s, 0)[0][: len(b)], b) for s, b in zip("ac", before))
        cache.check()
    finally:
        cache.close()


def test_head_major_pages_cover_one_head_and_map_only_what_is_stored():
    cache = vmkv.VirtualKVCache(small_config(layout="head_major", page_size="4KiB"))
    try:
        assert cache.tokens_per_page == 4096 // (16 * 4)  # one head's tokens: head_dim 16 floats
        # layers x K/V x heads
        assert cache.geometry.num_tensors == 2 * 2 * 2 == cache.config.kv_shape.pieces(cache.config.layout)
        cache.add("a")
        n = cache.tokens_per_page + 1
        plan = cache.begin_step({"a": n})
        for layer in range(2):
            cache.write(layer, torch.ones(n, 2, 16), torch.ones(n, 2, 16), plan)
        assert cache.stats()["resident_bytes"] == 2 * cache.geometry.page_bytes  # 2 pool pages, nothing more
        k_view, _ = cache.kv_cache(0)
        assert k_view.stride()[1:] == (16, cache.seq_capacity * 16, 1)  # [B, S, H, D] over [B, H, S, D]
        rows, _ = cache.layer_storage(0)
        assert rows.shape == (6 * 2 * cache.seq_capacity, 16)
    finally:
        cache.close()


def test_the_default_is_the_fastest_layout_that_fits_else_all_layers_with_16_tokens_a_page():
    llama = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float32")  # Llama-3-8B, fp32: 4 KiB a token and layer
    small = resolve(vmkv.KVCacheConfig(**llama, memory_budget="64MiB"))
    assert small.layout == "per_layer" and small.page_size == 16 * 4096  # 16 pool pages x 64 pieces fit the room
    llama["dtype"] = "float16"  # half precision: head-major first (CPU SDPA reads it 1.4-2x faster) when it fits
    half = resolve(vmkv.KVCacheConfig(**llama, memory_budget="64MiB"))
    assert half.layout == "head_major" and half.page_size == 4096  # 16 tokens of one 256 B head
    config = resolve(vmkv.KVCacheConfig(**llama, memory_budget="1GiB"))  # per-layer 16-token pages: ~65,600 mappings
    assert config.layout == "all_layers"
    tpp = config.page_size // config.tensor_token_bytes()
    assert config.page_size % 4096 == 0 and tpp == DEFAULT_TOKENS_PER_PAGE
    cache = vmkv.VirtualKVCache(config.replace(max_batch_size=2, max_seq_len=64))
    try:
        assert cache.tokens_per_page == DEFAULT_TOKENS_PER_PAGE
    finally:
        cache.close()


def test_the_default_page_grows_to_fit_the_mapping_room():
    room = mapping_room()
    if room is None:
        pytest.skip("this system does not report vm.max_map_count")
    small = dict(num_layers=2, num_kv_heads=1, head_dim=16, dtype="float32")  # 128 B a token, all layers
    config = resolve(vmkv.KVCacheConfig(**small, memory_budget="4GiB"))
    pieces = config.kv_shape.pieces(config.layout)
    pages = config.memory_budget // (pieces * config.page_size)
    assert pieces * (2 * pages + 1) <= room  # even a fragmented pool fits
    assert config.page_size // config.tensor_token_bytes() > DEFAULT_TOKENS_PER_PAGE  # had to grow
    tiny = resolve(vmkv.KVCacheConfig(**small, memory_budget="1MiB"))
    assert (tiny.layout, tiny.page_size) == ("per_layer", 4096)  # 64 tokens: the host granularity is the floor


def test_an_explicit_page_size_keeps_the_per_layer_layout():
    config = resolve(vmkv.KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, page_size="4KiB"))
    assert config.layout == "per_layer" and config.page_size == 4096
    assert default_pages(config.kv_shape, config.dtype, config.memory_budget, DeviceFacts("cpu", 4096),
                         "head_major")[0] == "head_major"
    with pytest.raises(vmkv.InvalidConfig, match="layout must be one of"):
        vmkv.KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, layout="heads")


def test_the_config_reads_no_device_and_the_cache_decides_its_pages(monkeypatch):
    """A config only validates (a None layout and page size stay None); the cache decides them
    from the device's facts, read once when it opens, and ``cache.config`` holds the result."""
    import vmkv.vm

    reads = []
    real_granularity, real_room = vmkv.vm.granularity, vmkv.vm.mapping_room
    monkeypatch.setattr(vmkv.vm, "granularity", lambda device: reads.append("granularity") or real_granularity(device))
    monkeypatch.setattr(vmkv.vm, "mapping_room", lambda: reads.append("mapping_room") or real_room())
    config = vmkv.KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", memory_budget="8MiB",
                                max_batch_size=2, max_seq_len=64)
    cuda = vmkv.KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, device="cuda:0")
    assert (config.layout, config.page_size, cuda.layout, cuda.page_size) == (None, None, None, None) and reads == []
    with vmkv.VirtualKVCache(config) as cache:
        assert (cache.config.layout, cache.config.page_size) == ("per_layer", 4096)  # 32 tokens of 128 B: the granule
    assert reads.count("granularity") == 1 and reads.count("mapping_room") == 1  # once each, at open
    assert resolve(cuda, DeviceFacts("cuda", 2 << 20)).layout == "all_layers"
