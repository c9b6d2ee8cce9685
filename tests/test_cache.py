"""The lifecycle API, run against both modes: pages, attention vs a dense reference, errors."""

from __future__ import annotations

import pytest
import torch
from helpers import KVMirror, small_config

import vmkv
from vmkv.errors import (
    DuplicateSequence,
    InvalidConfig,
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

TPP = 32  # tokens per page of the SMALL geometry in both modes


# ---- configuration ---------------------------------------------------------------------------
def test_sizes_accept_ints_and_strings():
    assert vmkv.parse_size("64KiB") == 65536
    assert vmkv.parse_size("2GiB") == 2 << 30
    assert vmkv.parse_size("1.5 MB") == 1_500_000
    assert vmkv.parse_size(4096) == 4096
    for bad in ("two GiB", "1.5B", -1, True, 3.0):
        with pytest.raises(InvalidConfig):
            vmkv.parse_size(bad)
    for negative in (-1, "-5MiB", "-1"):  # a negative size says so, whether an int or a string
        with pytest.raises(InvalidConfig, match="must be >= 0"):
            vmkv.parse_size(negative)


def test_a_setting_one_mode_ignores_is_validated_in_both(mode):
    """page_size (VMM) and block_size (paged): each mode refuses what the other would refuse."""
    with pytest.raises(InvalidConfig, match="page_size 3072 must be a multiple.*try page_size=4096"):
        vmkv.open_cache(small_config(page_size="3KiB"), mode=mode)
    with pytest.raises(InvalidConfig, match="block_size must be a positive int"):
        vmkv.open_cache(small_config(block_size=0), mode=mode)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_layers=0), "num_layers must be a positive int"),
        (dict(layout="rows"), "layout must be"),
        (dict(dtype="int8"), "dtype"),
        (dict(device="mps"), "device"),
        (dict(page_size="6KiB"), "try page_size=4096"),
        (dict(memory_budget="1KiB"), "holds no page"),
    ],
)
def test_invalid_configs_say_what_to_change(overrides, message):
    with pytest.raises(InvalidConfig, match=message):
        vmkv.VirtualKVCache(small_config(**overrides))


def test_geometry_follows_the_layout():
    per_layer = vmkv.VirtualKVCache(small_config(page_size="64KiB"))
    all_layers = vmkv.VirtualKVCache(small_config(page_size="64KiB", layout="all_layers"))
    # 2 heads x 16 floats = 128 B a token a tensor; all_layers stacks 2 layers -> 256 B
    assert per_layer.tokens_per_page == 512 and all_layers.tokens_per_page == 256
    assert per_layer.geometry.num_tensors == 4 and all_layers.geometry.num_tensors == 2
    per_layer.close(), all_layers.close()


def test_open_cache_rejects_unknown_modes():
    with pytest.raises(InvalidConfig, match="mode"):
        vmkv.open_cache(small_config(), mode="swap")


# ---- lifecycle and pages ---------------------------------------------------------------------
def test_pages_follow_the_tokens(make_cache):
    cache = make_cache()
    assert cache.add("a") == 0 and cache.add("b") == 1
    cache.reserve("a", 40)  # 2 pages
    assert cache.pages("a") == [0, 1] and cache.pages("b") == []
    cache.begin_step({"a": 40, "b": 1})
    assert cache.pages("b") == [2]
    stats = cache.stats()
    assert stats["pages_in_use"] == 3 and stats["pages_free"] == 61
    assert stats["tokens"] == 41 and stats["tokens_per_page"] == TPP
    assert stats["bytes_in_use"] == 3 * cache.geometry.page_bytes
    assert stats["token_bytes"] == 41 * cache.config.bytes_per_token
    assert stats["utilization"] == pytest.approx(41 / 96)
    cache.check()


def test_freed_pages_are_reused(make_cache):
    cache = make_cache(deferred_reclaim=False)
    cache.add("a")
    cache.begin_step({"a": 70})
    assert cache.pages("a") == [0, 1, 2]
    cache.free("a")
    assert cache.stats()["pages_in_use"] == 0
    cache.add("b")
    cache.begin_step({"b": 10})
    assert cache.pages("b") == [0]  # freed pages are pushed last-to-first, so page 0 is on top
    cache.check()


def test_thousands_of_sequences_leak_no_page(make_cache):
    cache = make_cache()
    for i in range(2000):
        cache.add(i)
        cache.begin_step({i: 1 + (i * 37) % 90})
        if i % 3:
            cache.begin_step({i: 1})
        cache.free(i)
    cache.trim()
    stats = cache.stats()
    assert stats["pages_in_use"] == 0 and stats["pages_free"] == stats["pages_total"]
    assert stats["sequences"] == 0
    cache.check()


def test_trim_drops_pages_beyond_length_and_reservation(make_cache):
    cache = make_cache()
    cache.add("a")
    cache.reserve("a", 5 * TPP)
    cache.begin_step({"a": 10})
    assert len(cache.pages("a")) == 5
    assert cache.trim() == 0  # the reservation still holds them
    cache.truncate("a", 3)
    cache.add("b")
    cache.begin_step({"b": 1})
    cache.free("b")
    cache.trim()
    assert len(cache.pages("a")) == 5  # reserved
    cache.check()


def test_truncate_forgets_tokens(make_cache):
    cache = make_cache()
    mirror = KVMirror(cache, q_heads=4)
    cache.add("a")
    mirror.step({"a": 50})
    cache.truncate("a", 20)
    for layer in range(2):
        mirror.k["a"][layer] = mirror.k["a"][layer][:20]
        mirror.v["a"][layer] = mirror.v["a"][layer][:20]
    mirror.step({"a": 5})
    mirror.assert_stored("a")
    assert cache.seq_len("a") == 25


# ---- attention against the dense reference ---------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("q_heads", [2, 4])  # plain MHA and GQA (2 query heads per KV head)
def test_attention_matches_dense_reference(make_cache, dtype, q_heads):
    cache = make_cache(dtype=dtype)
    mirror = KVMirror(cache, q_heads=q_heads)
    for seq_id in "abc":
        cache.add(seq_id)
    mirror.step({"a": 37, "b": 1, "c": 64})  # mixed prefill lengths, page boundaries
    mirror.step({"a": 1, "b": 1, "c": 1})  # decode
    mirror.step({"a": 30, "b": 1})  # a chunked prefill on a cached prefix, mixed with decode
    for _ in range(3):
        mirror.step({"a": 1, "b": 1, "c": 1})
    for seq_id in "abc":
        mirror.assert_stored(seq_id)


def test_attention_in_the_all_layers_layout():
    cache = vmkv.VirtualKVCache(small_config(layout="all_layers", page_size="8KiB"))
    assert cache.tokens_per_page == 32
    mirror = KVMirror(cache, q_heads=4)
    cache.add("a"), cache.add("b")
    mirror.step({"a": 45, "b": 3})
    mirror.step({"a": 1, "b": 20})
    mirror.assert_stored("a"), mirror.assert_stored("b")
    cache.close()


def test_map_ahead_maps_the_next_page_in_the_background():
    cache = vmkv.VirtualKVCache(small_config(map_ahead=True))
    mirror = KVMirror(cache, q_heads=4)
    cache.add("a")
    mirror.step({"a": TPP})  # fills page 0 exactly: the next decode needs page 1
    assert len(cache.pages("a")) == 2 and cache.stats()["pages_mapped_ahead"] == 1
    for _ in range(3):
        mirror.step({"a": 1})
    mirror.assert_stored("a")
    cache.close()


def test_deferred_reclaim_hands_mapped_pages_to_the_next_sequence():
    cache = vmkv.VirtualKVCache(small_config())
    cache.add("a")
    cache.begin_step({"a": 3 * TPP})
    pages = cache.pages("a")
    cache.free("a")
    stats = cache.stats()
    assert stats["pages_spare"] == 3 and stats["pages_in_use"] == 3 and stats["tokens"] == 0
    cache.add("b")  # takes the slot with the spare pages: nothing new is mapped
    assert cache.pages("b") == pages and cache.stats()["pages_spare"] == 0
    cache.free("b")
    cache.trim()
    assert cache.stats()["pages_in_use"] == 0
    cache.check()


def test_spare_pages_are_taken_back_under_pressure():
    cache = vmkv.VirtualKVCache(small_config(memory_budget=4 * 4096 * 4))  # 4 pool pages
    cache.add("a"), cache.add("c")
    cache.begin_step({"a": 2 * TPP, "c": 1})
    cache.free("a"), cache.free("c")  # slot 0 keeps 2 pages mapped, slot 1 keeps 1
    assert cache.add("b", token_ids=[7]) == 1  # a one-page prompt: slot 1 fits best
    cache.begin_step({"b": 3 * TPP})  # 2 more pages: the free one + one taken back from slot 0
    stats = cache.stats()
    assert stats["pages_spare"] == 1 and stats["pages_free"] == 0 and len(cache.pages("b")) == 3
    with pytest.raises(OutOfPages):
        cache.begin_step({"b": 2 * TPP})  # 2 more pages: only 1 spare remains
    cache.check()


# ---- errors leave the cache unchanged ----------------------------------------------------------
def test_every_invalid_call_raises_its_error_and_changes_nothing(make_cache):
    cache = make_cache(memory_budget=12 * 4096 * 4, max_batch_size=3)
    cfg = cache.config
    cache.add("a"), cache.add("b")
    stale = cache.begin_step({"a": 2})
    plan = cache.begin_step({"a": 1})

    def t(n: int, heads: int = cfg.num_kv_heads) -> torch.Tensor:
        return torch.zeros(n, heads, cfg.head_dim, dtype=cfg.dtype)

    cache.write(0, t(1), t(1), plan)  # layer 0 written: attention's own argument checks are reached
    failing = [
        (UnknownSequence, lambda: cache.free("nope")),
        (UnknownSequence, lambda: cache.reserve("nope", 3)),
        (UnknownSequence, lambda: cache.begin_step({"a": 1, "nope": 1})),
        (UnknownSequence, lambda: cache.fork("nope", "x")),
        (UnknownSequence, lambda: cache.free(["unhashable"])),
        (DuplicateSequence, lambda: cache.add("a")),
        (DuplicateSequence, lambda: cache.fork("a", "b")),
        (SequenceTooLong, lambda: cache.reserve("a", cfg.max_seq_len + 1)),
        (SequenceTooLong, lambda: cache.begin_step({"a": cfg.max_seq_len})),
        (SequenceTooLong, lambda: cache.add("long", token_ids=[1] * (cfg.max_seq_len + 1))),
        (OutOfPages, lambda: cache.begin_step({"a": 1, "b": cfg.max_seq_len - 1})),
        (OutOfPages, lambda: cache.reserve("b", cfg.max_seq_len)),
        (InvalidInput, lambda: cache.begin_step({})),
        (InvalidInput, lambda: cache.begin_step({"a": 0})),
        (InvalidInput, lambda: cache.begin_step({"a": ["x"]})),
        (InvalidInput, lambda: cache.reserve("a", -1)),
        (InvalidInput, lambda: cache.truncate("a", 99)),
        (InvalidInput, lambda: cache.add("x", token_ids=["a"])),
        (StalePlan, lambda: cache.write(0, t(2), t(2), stale)),
        (StalePlan, lambda: cache.attention(0, t(2, 4), stale)),
        (InvalidShape, lambda: cache.write(0, t(1), t(2), plan)),
        (InvalidShape, lambda: cache.write(0, t(1, 3), t(1, 3), plan)),
        (InvalidShape, lambda: cache.attention(0, t(1, 3), plan)),
        (InvalidShape, lambda: cache.attention(0, t(2, 4), plan)),
        (InvalidInput, lambda: cache.attention(1, t(1, 4), plan)),  # layer 1 not written yet (issue 30 item 7)
        (InvalidDtype, lambda: cache.write(0, t(1).double(), t(1), plan)),
        (InvalidDevice, lambda: cache.write(0, t(1).to("meta"), t(1), plan)),
        (InvalidInput, lambda: cache.write(cfg.num_layers, t(1), t(1), plan)),
        (InvalidInput, lambda: cache.write(0, t(1).numpy(), t(1), plan)),
    ]
    before = cache.stats(), cache.pages("a"), cache.pages("b"), cache.seq_len("a")
    for error, call in failing:
        with pytest.raises(error):
            call()
        after = cache.stats(), cache.pages("a"), cache.pages("b"), cache.seq_len("a")
        assert after == before, f"{error.__name__} changed the cache"
    cache.write(0, t(1), t(1), plan)  # the plan still works after all those failures
    cache.check()


def test_the_decode_fast_path_refuses_what_the_full_path_refuses_and_maps_at_page_boundaries(make_cache):
    """begin_step's decode fast path (a repeat of the last decode step's sequences, one token
    each) checks its batch with a few C-level calls: a bool, a float, another order or another
    set of sequences falls to the full path, which raises or plans as before; each token lands
    where the full path would put it, and the page after a boundary is mapped then."""
    cache = make_cache(max_batch_size=3)
    cache.add("a"), cache.add("b")
    cache.begin_step({"a": TPP - 3, "b": TPP - 2})
    plan = cache.begin_step({"a": 1, "b": 1})  # full path (the last step was no decode), room 1
    for bad in ({"a": True, "b": 1}, {"a": 1.0, "b": 1}, {"a": 1, "b": 0}):
        before = cache.stats(), cache.seq_len("a"), cache.seq_len("b")
        with pytest.raises(InvalidInput):
            cache.begin_step(bad)
        assert (cache.stats(), cache.seq_len("a"), cache.seq_len("b")) == before
    fast = cache.begin_step({"a": 1, "b": 1})  # "b" fills its first page
    assert fast.starts == plan.kv_lens and torch.equal(fast.write_rows, plan.write_rows + 1)
    assert (cache.pages("a"), cache.pages("b")) == ([0], [1])
    crossing = cache.begin_step({"a": 1, "b": 1})  # "b" needs its second page: the full path maps it
    assert len(cache.pages("b")) == 2 and crossing.kv_lens == (TPP, TPP + 1)
    swapped = cache.begin_step({"b": 1, "a": 1})  # another order: planned afresh, rows follow it
    assert swapped.seq_ids == ("b", "a") and swapped.starts == (TPP + 1, TPP)
    ids = cache.begin_step({"b": [7], "a": [8]})  # token ids, same order: the fast path takes them too
    assert ids.starts == swapped.kv_lens and torch.equal(ids.write_rows, swapped.write_rows + 1)
    cache.check()


def test_shape_errors_name_each_tensor_s_dimensions(make_cache):
    cache = make_cache()
    cfg = cache.config
    cache.add("a")
    plan = cache.begin_step({"a": 4})
    kv = torch.zeros(3, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype)
    with pytest.raises(InvalidShape, match=r"k must have shape \[4, 2, 16\] \(\[tokens, kv_heads, head_dim\]\)"):
        cache.write(0, kv, kv, plan)
    cache.write(0, kv[:1].expand(4, -1, -1), kv[:1].expand(4, -1, -1), plan)  # layer 0 written: q is checked
    q = torch.zeros(7, 2 * cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype)  # 7 tokens where the plan has 4
    with pytest.raises(InvalidShape, match=r"q must have shape \[4, 4, 16\] \(\[tokens, q_heads, head_dim\]\)"):
        cache.attention(0, q, plan)


def test_no_free_slot(make_cache):
    cache = make_cache(max_batch_size=2)
    cache.add(1), cache.add(2)
    before = cache.stats()
    with pytest.raises(NoFreeSlot, match="slots are in use"):
        cache.add(3)
    with pytest.raises(NoFreeSlot):
        cache.fork(1, 3)
    assert cache.stats() == before


def test_errors_are_catchable_as_builtin_kinds():
    assert issubclass(UnknownSequence, LookupError) and issubclass(OutOfPages, MemoryError)
    assert issubclass(InvalidShape, ValueError) and str(UnknownSequence("x y")) == "x y"


def test_a_mapping_of_the_config_fields_opens_a_cache_and_anything_else_is_refused(mode):
    with vmkv.open_cache(dict(num_layers=2, num_kv_heads=2, head_dim=64, memory_budget="8MiB"), mode=mode) as cache:
        given = vmkv.KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, memory_budget="8MiB")
        assert cache.config == (vmkv.sizing.resolve(given) if mode == "vmm" else given)  # VMM decides its pages
    with pytest.raises(InvalidConfig, match="unknown field.*'heads'"):
        vmkv.open_cache(dict(num_layers=2, heads=2, head_dim=64), mode=mode)
    with pytest.raises(InvalidConfig, match="missing field.*num_kv_heads"):
        vmkv.open_cache(dict(num_layers=2, head_dim=64), mode=mode)
    with pytest.raises(InvalidConfig, match="KVCacheConfig or a mapping"):
        vmkv.open_cache([2, 2, 64], mode=mode)
