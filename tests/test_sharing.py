"""Copy-on-write forks and prefix caching, in both modes."""

from __future__ import annotations

import pytest
import torch
from helpers import KVMirror, dense_attention

import vmkv
from vmkv.errors import DuplicateSequence, OutOfPages, UnknownSequence

TPP = 32


def test_fork_shares_every_page_then_copies_on_write(make_cache):
    cache = make_cache()
    mirror = KVMirror(cache, q_heads=4)
    prompt = 2 * TPP + 5
    cache.add("p")
    mirror.step({"p": prompt})
    parent_pages = cache.pages("p")
    before = [tuple(t.clone() for t in cache.kv("p", layer)) for layer in range(2)]
    for child in ("c1", "c2", "c3"):
        mirror.fork("p", child)
        assert cache.pages(child) == parent_pages
    stats = cache.stats()
    assert stats["pages_in_use"] == 3 and stats["shared_pages"] == 3  # ceil(69 / 32), no copy yet
    mirror.step({"c1": 1, "c2": 1, "c3": 1})  # each child writes into the shared last page
    stats = cache.stats()
    assert stats["pages_in_use"] == 3 + 3 and stats["cow_copies"] == 3
    assert stats["shared_pages"] == 2  # the two full prompt pages, shared by all four
    for child in ("c1", "c2", "c3"):
        assert cache.pages(child)[:2] == parent_pages[:2] and cache.pages(child)[2] != parent_pages[2]
        mirror.assert_stored(child)
    for layer in range(2):  # the parent's K/V are bit-identical to before the children wrote
        k, v = cache.kv("p", layer)
        assert torch.equal(k, before[layer][0]) and torch.equal(v, before[layer][1])
    mirror.step({"p": 1, "c1": 2, "c2": TPP})  # the parent owns its last page alone now: no copy
    assert cache.stats()["cow_copies"] == 3
    for seq_id in ("p", "c1", "c2", "c3"):
        mirror.assert_stored(seq_id)
    cache.check()


def test_parent_and_child_writing_in_one_step_copy_once(make_cache):
    cache = make_cache()
    mirror = KVMirror(cache, q_heads=2)
    cache.add("p")
    mirror.step({"p": 10})
    mirror.fork("p", "c")
    mirror.step({"p": 1, "c": 1})
    assert cache.stats()["cow_copies"] == 1 and cache.stats()["pages_in_use"] == 2
    mirror.assert_stored("p"), mirror.assert_stored("c")
    cache.check()


def test_fork_on_a_page_boundary_needs_no_copy(make_cache):
    cache = make_cache()
    cache.add("p")
    cache.begin_step({"p": 2 * TPP})
    for child in range(4):
        cache.fork("p", child)
    cache.begin_step({child: 1 for child in range(4)})
    stats = cache.stats()
    assert stats["cow_copies"] == 0 and stats["pages_in_use"] == 2 + 4
    cache.check()


def test_fork_saves_resident_memory_on_the_host():
    cache = vmkv.VirtualKVCache(
        vmkv.KVCacheConfig(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32", max_batch_size=8,
                           max_seq_len=8192, memory_budget="128MiB", page_size="64KiB")
    )
    tpp, page_bytes = cache.tokens_per_page, cache.geometry.page_bytes  # 64 tokens, 4 x 64 KiB
    cache.add("p")
    plan = cache.begin_step({"p": 3 * tpp + 7})
    kv = torch.randn(plan.num_tokens, 4, 64)
    for layer in range(2):
        cache.write(layer, kv, kv, plan)
    resident = cache.stats()["resident_bytes"]
    for child in range(4):
        cache.fork("p", child)
    assert cache.stats()["resident_bytes"] == resident  # forking copies nothing
    plan = cache.begin_step({child: 1 for child in range(4)})
    for layer in range(2):
        cache.write(layer, torch.ones(4, 4, 64), torch.ones(4, 4, 64), plan)
    assert cache.stats()["pages_in_use"] == 4 + 4  # one private page per child
    partial = resident - 3 * page_bytes  # what the parent's last, partly filled page holds
    assert 0 < partial < page_bytes
    assert cache.stats()["resident_bytes"] == resident + 4 * partial  # copies hold the stored tokens only
    cache.close()


def test_fork_errors_change_nothing(make_cache):
    cache = make_cache()
    cache.add("a"), cache.add("b")
    cache.begin_step({"a": 3})
    before = cache.stats()
    with pytest.raises(UnknownSequence):
        cache.fork("zz", "c")
    with pytest.raises(DuplicateSequence):
        cache.fork("a", "b")
    assert cache.stats() == before


def test_running_out_of_pages_mid_copy_changes_nothing(make_cache):
    cache = make_cache(memory_budget=3 * 4096 * 4)  # 3 pool pages
    cache.add("p")
    cache.begin_step({"p": 2 * TPP + 1})  # all 3 pages
    cache.fork("p", "c")
    before = cache.stats(), cache.pages("p"), cache.pages("c"), cache.seq_len("c")
    refs = [cache.pool.refcount(page) for page in range(3)]
    with pytest.raises(OutOfPages):
        cache.begin_step({"c": 1})  # needs a copy of the shared last page: no page left
    assert (cache.stats(), cache.pages("p"), cache.pages("c"), cache.seq_len("c")) == before
    assert [cache.pool.refcount(page) for page in range(3)] == refs
    cache.check()


# ---- prefix caching --------------------------------------------------------------------------
def _kv_of(tokens: list[int], layer: int) -> torch.Tensor:
    """Deterministic K/V of a token at a position: the same prompt always gives the same K/V."""
    out = []
    for position, token in enumerate(tokens):
        gen = torch.Generator().manual_seed(token * 100003 + position * 31 + layer)
        out.append(torch.randn(2, 16, generator=gen))
    return torch.stack(out)  # [n, 2, 16]


def _prefill(cache: vmkv.KVCacheBase, seq_id, tokens: list[int], q: torch.Tensor) -> list[torch.Tensor]:
    """Compute the tokens not yet cached; return each layer's attention output for them."""
    start = cache.seq_len(seq_id)
    plan = cache.begin_step({seq_id: tokens[start:]})
    outs = []
    for layer in range(2):
        kv = _kv_of(tokens, layer)[start:]
        cache.write(layer, kv, kv, plan)
        outs.append(cache.attention(layer, q[start:], plan))
    return outs


def test_a_repeated_prompt_reuses_its_full_pages(make_cache):
    cache = make_cache()
    prompt = list(range(100, 100 + 2 * TPP + 9))  # two full pages and a partial one
    q = torch.randn(len(prompt), 4, 16)
    cache.add("a", token_ids=prompt)
    assert cache.seq_len("a") == 0
    _prefill(cache, "a", prompt, q)
    in_use = cache.stats()["pages_in_use"]
    cache.add("b", token_ids=prompt)
    assert cache.seq_len("b") == 2 * TPP  # the caller computes only the last 9 tokens
    assert cache.pages("b") == cache.pages("a")[:2] and cache.stats()["pages_in_use"] == in_use
    outs = _prefill(cache, "b", prompt, q)
    stats = cache.stats()
    assert stats["pages_in_use"] == in_use + 1 and stats["prefix_hits"] == 1
    assert stats["prefix_hit_tokens"] == 2 * TPP
    for layer in range(2):  # equals a fresh computation of the whole prompt
        kv = _kv_of(prompt, layer)
        want = dense_attention(q[2 * TPP :], kv, kv, 2 * TPP)
        torch.testing.assert_close(outs[layer], want, atol=1e-5, rtol=1e-5)
    cache.check()


def test_cached_pages_outlive_their_sequence_and_are_evicted_last(make_cache):
    cache = make_cache(memory_budget=4 * 4096 * 4)  # 4 pool pages
    prompt = list(range(3 * TPP))
    q = torch.randn(len(prompt), 4, 16)
    cache.add("a", token_ids=prompt)
    _prefill(cache, "a", prompt, q)
    cache.free("a")
    assert cache.stats()["cached_pages"] == 3 and cache.stats()["pages_in_use"] == 0
    cache.add("b", token_ids=prompt + [1])
    assert cache.seq_len("b") == 3 * TPP and cache.stats()["cached_pages"] == 0
    cache.free("b")  # pages are released tail first, so the tail is least recently used
    cache.add("c")
    cache.begin_step({"c": 3 * TPP})  # 1 free page, then two evicted: the tail pages
    stats = cache.stats()
    assert stats["cached_pages"] == 1 and stats["evictions"] == 2
    cache.add("d", token_ids=prompt)
    assert cache.seq_len("d") == TPP  # the head page of the prompt survived
    cache.check()


def test_a_different_prefix_misses(make_cache):
    cache = make_cache()
    prompt = list(range(2 * TPP + 1))
    q = torch.randn(len(prompt), 4, 16)
    cache.add("a", token_ids=prompt)
    _prefill(cache, "a", prompt, q)
    cache.add("b", token_ids=[7] + prompt[1:])
    assert cache.seq_len("b") == 0
    cache.add("c", token_ids=prompt[:TPP] + [7] * (TPP + 1))
    assert cache.seq_len("c") == TPP  # only the first page matches
    cache.check()


def test_a_whole_cached_prompt_still_leaves_one_token_to_compute(make_cache):
    cache = make_cache()
    prompt = list(range(2 * TPP))
    cache.add("a", token_ids=prompt)
    _prefill(cache, "a", prompt, torch.randn(len(prompt), 4, 16))
    cache.add("b", token_ids=prompt)
    assert cache.seq_len("b") == TPP  # the last page is recomputed so the caller gets logits
    cache.check()


def test_writing_into_a_cached_page_after_truncate_unregisters_it(make_cache):
    cache = make_cache()
    prompt = list(range(2 * TPP + 1))
    cache.add("a", token_ids=prompt)
    _prefill(cache, "a", prompt, torch.randn(len(prompt), 4, 16))
    cache.begin_step({"a": [5]})  # the next call registers the two full pages
    assert cache.stats()["cached_pages"] == 0
    cache.truncate("a", TPP + 3)
    cache.begin_step({"a": [9, 9]})  # rewrites page 1: its hash must go
    cache.add("b", token_ids=prompt)
    assert cache.seq_len("b") == TPP
    cache.check()
