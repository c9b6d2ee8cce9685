"""No input, fault or thread may crash the process or silently corrupt K/V (issue 10, A and B).

* Empty pages read as zeros: views outlive free/trim/close/GC, reads past a length never fault,
  writes to an empty page still fail (SIGSEGV, checked in a child process).
* A plan is bound to the cache that built it.
* Fault injection: the k-th backend (or pool) call of an operation fails, for every k; the cache
  must be exactly as before (bookkeeping and every sequence's K/V) and keep working.
* The mapping limit (vm.max_map_count) is known at open; map-ahead failures do not poison.
* The prefix cache never serves K/V that were not written; threads that overlap raise.
* Bad input raises typed errors and changes nothing; stats() is O(1).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
from helpers import KVMirror, instrument, small_config

import vmkv
from vmkv.core.pages import PagePool
from vmkv.errors import (
    BackendError,
    CacheClosed,
    ConcurrentUse,
    InvalidConfig,
    InvalidInput,
    OutOfMappings,
    StalePlan,
    UnknownSequence,
)
from vmkv.vm import free_map_count

TPP = 32  # tokens a page in the small config (4 KiB pages / blocks of 32, 128 B a token)


def fill(cache: vmkv.KVCacheBase, batch: dict, value: float | None = None, gen: torch.Generator | None = None) -> None:
    """One step of ``batch`` writing every layer (random K/V, or a constant)."""
    cfg = cache.config
    plan = cache.begin_step(batch)
    total = sum(len(n) if isinstance(n, list) else n for n in batch.values())
    for layer in range(cfg.num_layers):
        if value is None:
            kv = torch.randn(total, cfg.num_kv_heads, cfg.head_dim, generator=gen)
        else:
            kv = torch.full((total, cfg.num_kv_heads, cfg.head_dim), value)
        cache.write(layer, kv.to(cfg.dtype), kv.to(cfg.dtype), plan)


# ---- A1/A2: empty pages read as zeros -------------------------------------------------------------
def test_reads_past_a_length_see_zeros_and_never_fault():
    cache = vmkv.VirtualKVCache(small_config())
    cache.add("a")
    fill(cache, {"a": 5}, value=1.0)
    k, v = cache.kv_cache(0)
    assert k.abs().sum().item() == 5 * 2 * 16  # the 5 tokens; every other byte of the range reads 0
    assert k[0, 5:].abs().sum().item() == 0 and k[1:].abs().sum().item() == 0
    cache.close()


def test_views_outlive_free_trim_close_and_garbage_collection():
    cache = vmkv.VirtualKVCache(small_config())
    cache.add("a")
    fill(cache, {"a": 40}, value=2.0)
    seq_k, _ = cache.kv("a", 1)
    layer_k, _ = cache.kv_cache(1)
    rows_k, _ = cache.layer_storage(1)
    assert seq_k.sum().item() == 40 * 32 * 2.0
    cache.free("a")
    cache.trim()
    assert seq_k.sum().item() == 0 and layer_k.sum().item() == 0 and rows_k.sum().item() == 0
    cache.add("b")
    fill(cache, {"b": 3}, value=3.0)
    view_b, _ = cache.kv("b", 0)
    cache.close()
    assert view_b.sum().item() == 0 and layer_k.sum().item() == 0  # after close: zeros, no fault
    with pytest.raises(CacheClosed):
        cache.kv("b", 0)
    del cache
    gc.collect()
    assert view_b.sum().item() == 0 and rows_k.sum().item() == 0  # after the cache is collected


def test_a_view_keeps_only_address_space_not_memory():
    cache = vmkv.VirtualKVCache(small_config(memory_budget=64 * 4 * 65536, page_size="64KiB"))
    cache.add("a")
    fill(cache, {"a": 512}, value=1.0)
    view, _ = cache.kv("a", 0)
    resident = cache.stats()["resident_bytes"]
    assert resident >= 512 * 128 * 4  # every tensor's pages hold memory
    fd_count_before = len(list(__import__("pathlib").Path("/proc/self/fd").iterdir()))
    cache.close()
    assert len(list(__import__("pathlib").Path("/proc/self/fd").iterdir())) == fd_count_before - 1  # memfd gone
    assert view.sum().item() == 0


WRITE_TO_EMPTY_PAGE = textwrap.dedent("""
    import torch
    from vmkv.vm.host import HostVirtualMemory
    vm = HostVirtualMemory(4096, 4)
    addr = vm.reserve(4 * 4096)
    t = vm.tensor(addr, (4 * 4096,), torch.uint8)
    assert int(t.sum()) == 0          # reads of empty pages: zeros
    vm.map(addr, 0)
    t[:4096] = 1                      # a mapped page takes writes
    print("mapped write ok", flush=True)
    t[4096] = 1                       # an empty page does not: SIGSEGV
    print("unreachable", flush=True)
""")


def test_writes_to_an_empty_page_fail_loudly():
    proc = subprocess.run([sys.executable, "-c", WRITE_TO_EMPTY_PAGE], capture_output=True, text=True, timeout=60)
    assert "mapped write ok" in proc.stdout and "unreachable" not in proc.stdout
    assert proc.returncode == -11, (proc.returncode, proc.stderr[-500:])  # killed by SIGSEGV


def test_every_map_and_unmap_waits_for_running_kernels():
    """On CUDA a map takes the zero page away for a moment and an unmap the data page: a kernel
    still reading the address (padded kernels read past a sequence's length) would fault. The
    cache synchronizes the backend before each page it maps or unmaps."""
    cache = vmkv.open_cache(small_config(), mode="vmm")
    calls = []
    for name in ("map", "unmap", "synchronize"):
        real = getattr(cache.ranges.vm, name)
        setattr(cache.ranges.vm, name, lambda *args, _real=real, _name=name: (calls.append(_name), _real(*args))[1])
    ids = _tokens(TPP + 1, 1)
    cache.add("a")
    plan = cache.begin_step({"a": ids})  # maps two pages
    for layer in range(cache.config.num_layers):
        cache.write(layer, torch.ones(len(ids), 2, 16), torch.ones(len(ids), 2, 16), plan)
    calls.append("|")  # kernels may run between cache calls
    cache.fork("a", "b")
    cache.begin_step({"b": 1})  # copy-on-write of b's shared last page: unmap + map
    calls.append("|")
    cache.free("a"), cache.free("b"), cache.trim()  # trim unmaps the spare pages
    segments = [segment.split() for segment in " ".join(calls).split("|")]
    assert [segment[0] for segment in segments] == ["synchronize"] * 3, calls
    assert "map" in calls and "unmap" in calls
    cache.close()


# ---- A3: a plan is bound to its cache --------------------------------------------------------------
def test_a_plan_from_another_cache_is_refused(mode):
    one, two = (vmkv.open_cache(small_config(), mode=mode) for _ in range(2))
    for cache in (one, two):
        cache.add("a")
        cache.add("b")
    plan_one = one.begin_step({"a": 3})
    two.begin_step({"b": 3})
    assert plan_one.version == two._version  # both at the same version: the check must not rely on it
    k = torch.ones(3, 2, 16)
    before = two.state()
    with pytest.raises(StalePlan, match="another cache"):
        two.write(0, k, k, plan_one)
    with pytest.raises(StalePlan, match="another cache"):
        two.attention(0, torch.ones(3, 4, 16), plan_one)
    assert two.state() == before
    one.close(), two.close()


# ---- A4: fault injection ---------------------------------------------------------------------------
def _tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7 + i * 3) % 50 for i in range(n)]


def _setup_decode(cache, mirror):
    cache.add("a"), cache.add("b")
    mirror.step({"a": TPP - 1, "b": 2 * TPP}, check=False)


def _setup_fork(cache, mirror):
    cache.add("a")
    mirror.step({"a": TPP + 5}, check=False)
    mirror.fork("a", "b")


def _setup_prefix(cache, mirror):
    ids = _tokens(3 * TPP, 1)
    cache.add("p", token_ids=ids)
    plan = cache.begin_step({"p": ids})
    for layer in range(cache.config.num_layers):
        kv = torch.randn(len(ids), 2, 16)
        cache.write(layer, kv, kv, plan)
    cache.free("p")
    cache.add("a")
    mirror.step({"a": 10}, check=False)
    cache.add("q"), cache.free("q")  # a freed slot keeps spare pages (VMM) for the next add


def _setup_spares(cache, mirror):
    cache.add("a"), cache.add("b"), cache.add("c")
    mirror.step({"a": 3 * TPP, "b": 2 * TPP + 3, "c": 5}, check=False)
    mirror.free("b")


def _setup_pressure(cache, mirror):
    """A nearly full pool whose free slots hold spare pages: a step must take them back."""
    cache.add("a"), cache.add("b"), cache.add("c")
    mirror.step({"a": 4 * TPP, "b": 6 * TPP, "c": 4 * TPP}, check=False)
    mirror.free("b")


def _setup_trim(cache, mirror):
    """Spare pages (VMM), pages past a truncated length and cached prefix pages, all for trim()."""
    _setup_prefix(cache, mirror)
    _setup_spares_of(cache, mirror, "x", "y")
    cache.truncate("x", TPP)
    mirror.k["x"] = [k[:TPP] for k in mirror.k["x"]]
    mirror.v["x"] = [v[:TPP] for v in mirror.v["x"]]


def _setup_spares_of(cache, mirror, keep, drop):
    cache.add(keep), cache.add(drop)
    mirror.step({keep: 3 * TPP, drop: 2 * TPP + 3}, check=False)
    mirror.free(drop)


SCENARIOS = {
    "prefill": (lambda c, m: c.add("a"), lambda c, m: c.begin_step({"a": 3 * TPP + 4})),
    "decode across a page boundary": (_setup_decode, lambda c, m: c.begin_step({"a": 1, "b": 1})),
    "fork + copy-on-write": (_setup_fork, lambda c, m: c.begin_step({"a": 2, "b": 3})),
    "prefix hit over spare pages": (_setup_prefix, lambda c, m: c.add("h", token_ids=_tokens(3 * TPP, 1) + [7])),
    "fork over spare pages": (_setup_spares, lambda c, m: c.fork("a", "f")),
    "reserve": (_setup_decode, lambda c, m: c.reserve("a", 5 * TPP)),
    "free of a fork": (_setup_fork, lambda c, m: c.free("b")),
    "spare pages taken under pressure": (_setup_pressure, lambda c, m: c.begin_step({"a": 3 * TPP, "c": 3 * TPP})),
    "trim": (_setup_trim, lambda c, m: c.trim()),
}


def _snapshot(cache: vmkv.KVCacheBase) -> tuple:
    kv = {
        (seq_id, layer): tuple(t.clone() for t in cache.kv(seq_id, layer))
        for seq_id in cache.seq_ids
        for layer in range(cache.config.num_layers)
    }
    return cache.state(), kv


def _assert_same(before: tuple, after: tuple, what: str) -> None:
    assert before[0] == after[0], f"{what}: bookkeeping changed"
    assert before[1].keys() == after[1].keys()
    for key, (k, v) in before[1].items():
        assert torch.equal(k, after[1][key][0]) and torch.equal(v, after[1][key][1]), f"{what}: K/V of {key} changed"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_failure_at_every_call_leaves_the_cache_as_it_was(mode, scenario):
    setup, op = SCENARIOS[scenario]
    config = small_config(memory_budget=20 * 4 * 4096, max_batch_size=4)

    def fresh():
        cache = vmkv.open_cache(config, mode=mode)
        mirror = KVMirror(cache, q_heads=4, seed=3)
        setup(cache, mirror)
        return cache, mirror, instrument(cache)

    cache, mirror, faults = fresh()
    start = faults.calls
    op(cache, mirror)
    total = faults.calls - start
    cache.close()
    assert total > 0, f"{scenario}: the operation made no call that can fail"
    for k in range(1, total + 1):
        for error in (BackendError, OutOfMappings):
            cache, mirror, faults = fresh()
            before = _snapshot(cache)
            faults.error = error
            faults.arm(k)
            with pytest.raises(error, match="injected"):
                op(cache, mirror)
            faults.fail_at = None
            cache.check()
            if faults.failed == "release_page":  # trim gives memory back after the pages are free
                _assert_same(({},) + before[1:], ({},) + _snapshot(cache)[1:], f"{scenario}, call {k}")
            else:
                _assert_same(before, _snapshot(cache), f"{scenario}, call {k} of {total}")
            for seq_id in list(mirror.k):  # every sequence still reads back exactly what was written
                if seq_id in cache:
                    mirror.assert_stored(seq_id)
            op(cache, mirror)  # the same call works once the fault is gone
            cache.check()
            cache.close()


def test_a_failed_rollback_marks_the_cache_broken():
    cache = vmkv.VirtualKVCache(small_config())
    cache.add("a")
    fill(cache, {"a": 2 * TPP + 5})
    cache.fork("a", "b")
    real_map, real_unmap = cache.ranges.vm.map, cache.ranges.vm.unmap
    calls = {"unmap": 0}

    def unmap_fails_from_the_fifth_call(addr):
        calls["unmap"] += 1
        if calls["unmap"] >= 5:
            raise BackendError("injected: unmap refused")
        real_unmap(addr)

    def map_always_fails(addr, page):
        raise BackendError("injected: map refused")

    cache.ranges.vm.map, cache.ranges.vm.unmap = map_always_fails, unmap_fails_from_the_fifth_call
    with pytest.raises(BackendError, match="could not undo"):
        cache.free("b")  # unmaps b's last page (4 tensors), fails on the next; mapping back fails too
    cache.ranges.vm.map, cache.ranges.vm.unmap = real_map, real_unmap
    with pytest.raises(BackendError, match="close\\(\\) it"):
        cache.add("c")
    assert cache.stats()["sequences"] == 2  # stats() still answers
    cache.close()  # and close() still releases


def test_a_rollback_that_fails_inside_one_page_marks_the_cache_broken_and_nothing_faults():
    """Copy-on-write maps a page into each of 4 ranges; the OS refuses maps from the 2nd on, so
    undoing the first range's unmap fails too: the cache must say it is broken, not carry on
    over a range that now reads the zero page (a later write there would be a SIGSEGV)."""
    cache = vmkv.VirtualKVCache(small_config())
    cache.add("a")
    fill(cache, {"a": 40})
    cache.fork("a", "b")
    real_map = cache.ranges.vm.map
    calls = {"map": 0}

    def map_refused_from_the_second_call(addr, page):
        calls["map"] += 1
        if calls["map"] >= 2:
            raise BackendError("injected: map refused")
        real_map(addr, page)

    cache.ranges.vm.map = map_refused_from_the_second_call
    with pytest.raises(BackendError, match="could not undo"):
        cache.begin_step({"b": 1})
    cache.ranges.vm.map = real_map
    for call in (lambda: cache.begin_step({"b": 1}), lambda: cache.free("a"), lambda: cache.kv("b", 0)):
        with pytest.raises(BackendError, match="close\\(\\) it"):
            call()
    cache.close()


# ---- finishing a step: only calls that end it, only once their checks pass ---------------------------
def _half_written_step(cache, ids):
    cache.add("a", token_ids=ids)
    plan = cache.begin_step({"a": ids})
    kv = torch.ones(len(ids), 2, 16)
    cache.write(0, kv, kv, plan)
    return plan, kv


def test_queries_and_failed_calls_between_layers_do_not_end_the_step(mode):
    cache = vmkv.open_cache(small_config(), mode=mode)
    ids = _tokens(2 * TPP + 6, 9)
    plan, kv = _half_written_step(cache, ids)
    before = cache.state()
    cache.pages("a"), cache.check(), cache.stats()  # queries between layers
    with pytest.raises(InvalidInput):
        cache.reserve("a", 3.0)  # a failed call between layers
    with pytest.raises(vmkv.DuplicateSequence):
        cache.add("a")
    assert cache.state() == before
    cache.reserve("a", len(ids))  # a call that keeps the plan valid: it only records the reservation
    assert cache.state()[0][0][4] == len(ids) and cache.state()[0][0][6] == ()  # no pages registered yet
    cache.write(1, kv, kv, plan)  # the plan still works: the step completes
    cache.add("b", token_ids=ids)
    assert cache.seq_len("b") == 2 * TPP  # and its full pages were cached
    cache.close()


def test_token_ids_as_tensors_or_arrays(mode):
    cache = vmkv.open_cache(small_config(), mode=mode)
    cache.add("a"), cache.add("b"), cache.add("c")
    plan = cache.begin_step({"a": torch.tensor([1, 2, 3]), "b": np.array([4, 5]), "c": np.array([7])})
    assert plan.q_lens == (3, 2, 1)
    with pytest.raises(InvalidInput):
        cache.begin_step({"a": np.array(4)})  # 0-d: neither a count we accept silently nor ids
    cache.close()


# ---- A5: the mapping limit ------------------------------------------------------------------------
@pytest.mark.skipif(free_map_count() is None, reason="/proc does not tell the mapping limit here")
def test_a_budget_the_mapping_limit_cannot_hold_is_refused_with_a_page_size_that_fits():
    config = vmkv.KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32",
                                memory_budget="1GiB", page_size="4KiB", max_batch_size=64)
    with pytest.raises(InvalidConfig, match="vm.max_map_count") as error:
        vmkv.VirtualKVCache(config)
    suggested = str(error.value).split("page_size=")[1].split(" or larger")[0]
    cache = vmkv.VirtualKVCache(config.replace(page_size=suggested.replace(" ", "").replace(".0", "")))
    cache.close()


@pytest.mark.skipif(free_map_count() is None, reason="/proc does not tell the mapping limit here")
def test_neighbouring_pages_merge_into_one_mapping():
    cache = vmkv.VirtualKVCache(small_config(memory_budget=256 * 4 * 4096, max_seq_len=8192))
    before = free_map_count()
    cache.add("a")
    fill(cache, {"a": 200 * TPP}, value=1.0)  # 200 pages in each of 4 ranges, consecutive in the store
    used = before - free_map_count()
    assert used <= 4 * 2 + 2, f"200 consecutive pages cost {used} mappings"
    cache.close()


# ---- A6: map-ahead failures --------------------------------------------------------------------------
def test_a_map_ahead_failure_is_reported_once_and_the_cache_keeps_working():
    cache = vmkv.VirtualKVCache(small_config(map_ahead=True))
    real_map_pages = cache.ranges.vm.map_pages

    def map_fails_on_the_worker(pairs):
        if threading.current_thread().name.startswith("vmkv-map-ahead"):
            raise BackendError("injected map-ahead failure")
        real_map_pages(pairs)

    cache.ranges.vm.map_pages = map_fails_on_the_worker  # how a new page is mapped
    cache.add("a")
    fill(cache, {"a": TPP - 1})  # the worker tries to map the next page ... and fails
    assert cache.pages("a") == [0]  # joined: the failed page is rolled back, nothing leaked
    assert cache.stats()["map_ahead_errors"] == 1
    fill(cache, {"a": 2})  # the step maps the page itself; the error is not raised again
    assert cache.seq_len("a") == TPP + 1 and len(cache.pages("a")) == 2
    cache.check()
    cache.free("a"), cache.trim()
    assert cache.stats()["pages_free"] == cache.stats()["pages_total"]
    cache.close()


# ---- A11: a half-built cache --------------------------------------------------------------------------
def test_a_cache_that_fails_half_way_through_opening_releases_everything(monkeypatch):
    from vmkv.vm import host

    opened = []
    real_tensor = host.HostVirtualMemory.tensor

    def failing_tensor(self, *args, **kwargs):
        opened.append(self)
        raise BackendError("injected: no views today")

    monkeypatch.setattr(host.HostVirtualMemory, "tensor", failing_tensor)
    with pytest.raises(BackendError, match="no views"):
        vmkv.VirtualKVCache(small_config())
    monkeypatch.setattr(host.HostVirtualMemory, "tensor", real_tensor)
    assert opened and opened[0]._fd == -1 and not opened[0]._reservations  # the store is released


def test_close_is_total_and_idempotent(mode):
    cache = vmkv.open_cache(small_config(), mode=mode)
    cache.close()
    cache.close()
    with pytest.raises(CacheClosed):
        cache.add("a")


# ---- B7: the prefix cache serves only written K/V -------------------------------------------------------
@pytest.mark.parametrize("layers_written", [0, 1])
def test_pages_of_a_step_that_did_not_write_every_layer_are_never_cached(mode, layers_written):
    cache = vmkv.open_cache(small_config(), mode=mode)
    ids = _tokens(2 * TPP + 3, 5)
    cache.add("a", token_ids=ids)
    plan = cache.begin_step({"a": ids})
    for layer in range(layers_written):  # a forward pass that failed half-way
        cache.write(layer, torch.ones(len(ids), 2, 16), torch.ones(len(ids), 2, 16), plan)
    cache.add("b", token_ids=ids)  # same prompt: must not be served K/V that were never written
    assert cache.seq_len("b") == 0 and cache.stats()["prefix_hits"] == 0
    fill(cache, {"a": 1})  # later complete steps of "a" do not register the unwritten pages either
    cache.free("a")
    cache.add("c", token_ids=ids)
    assert cache.seq_len("c") == 0
    cache.close()


def test_pages_of_a_complete_step_are_cached(mode):
    cache = vmkv.open_cache(small_config(), mode=mode)
    ids = _tokens(2 * TPP + 3, 5)
    cache.add("a", token_ids=ids)
    fill(cache, {"a": ids})
    cache.add("b", token_ids=ids)
    assert cache.seq_len("b") == 2 * TPP
    cache.close()


# ---- B8: threads ---------------------------------------------------------------------------------------
def test_overlapping_calls_from_two_threads_raise_instead_of_corrupting(mode):
    cache = vmkv.open_cache(small_config(), mode=mode)
    cache.add("a"), cache.add("b")
    fill(cache, {"a": 5})
    inside, release = threading.Event(), threading.Event()
    real_allocate = cache.pool.allocate

    def slow_allocate(count):
        inside.set()
        release.wait(10)
        return real_allocate(count)

    cache.pool.allocate = slow_allocate
    worker = threading.Thread(target=lambda: cache.begin_step({"b": 3}))
    worker.start()
    assert inside.wait(10)
    errors = []
    for call in (lambda: cache.add("c"), lambda: cache.free("a"), lambda: cache.trim(), lambda: cache.kv("a", 0),
                 lambda: cache.begin_step({"a": 1}), lambda: cache.close()):
        try:
            call()
        except ConcurrentUse as exc:
            errors.append(exc)
    stats = cache.stats()  # stats() may be read from any thread
    release.set()
    worker.join(10)
    assert len(errors) == 6 and all("another thread" in str(e) for e in errors)
    assert stats["sequences"] == 2
    cache.pool.allocate = real_allocate
    cache.check()
    assert cache.seq_len("b") == 3
    cache.close()


def test_calls_from_threads_that_take_turns_are_fine(mode):
    cache = vmkv.open_cache(small_config(), mode=mode)
    lock = threading.Lock()

    def work(name):
        for i in range(20):
            with lock:
                cache.add((name, i))
                fill(cache, {(name, i): 5})
                cache.free((name, i))

    threads = [threading.Thread(target=work, args=(n,)) for n in "xyz"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cache.check()
    assert len(cache) == 0
    cache.close()


# ---- A13: bad input is typed and changes nothing ----------------------------------------------------------
def test_bad_input_raises_typed_errors_and_changes_nothing(mode):
    cache = vmkv.open_cache(small_config(), mode=mode)
    cache.add("a")
    plan = cache.begin_step({"a": 2})
    q, kv = torch.ones(2, 4, 16), torch.ones(2, 2, 16)
    cache.write(0, kv, kv, plan)  # layer 0 written: attention's scale is what gets checked
    bad = [
        (InvalidInput, lambda: cache.add(["unhashable"])),
        (InvalidInput, lambda: cache.add(("a", ["b"]))),
        (InvalidInput, lambda: cache.add("x", token_ids=5)),
        (InvalidInput, lambda: cache.add("x", token_ids="abc")),
        (InvalidInput, lambda: cache.add("x", token_ids=[1.5])),
        (InvalidInput, lambda: cache.fork("a", {"unhashable": 1})),
        (InvalidInput, lambda: cache.begin_step({"a": 1.0})),
        (InvalidInput, lambda: cache.begin_step({"a": True})),
        (InvalidInput, lambda: cache.begin_step({"a": torch.tensor(5)})),
        (InvalidInput, lambda: cache.begin_step([("a", 1)])),
        (InvalidInput, lambda: cache.write(0, kv, kv, None)),
        (InvalidInput, lambda: cache.write(0.0, kv, kv, plan)),
        (InvalidInput, lambda: cache.write(-1, kv, kv, plan)),
        (InvalidInput, lambda: cache.write("0", kv, kv, plan)),
        (InvalidInput, lambda: cache.attention(0, q, plan, scale="x")),
        (InvalidInput, lambda: cache.attention(0, q, plan, scale=-1.0)),
        (InvalidInput, lambda: cache.kv("a", 99)),
        (InvalidInput, lambda: cache.kv("a", -1)),
        (InvalidInput, lambda: cache.pages_for(-5)),
        (InvalidInput, lambda: cache.reserve("a", 3.0)),
        (InvalidInput, lambda: cache.truncate("a", -1)),
        (InvalidInput, lambda: cache.truncate("a", True)),
        (UnknownSequence, lambda: cache.free(["unhashable"])),
        (UnknownSequence, lambda: cache.kv(["unhashable"], 0)),
    ]
    before = cache.state()
    for error, call in bad:
        with pytest.raises(error):
            call()
        assert cache.state() == before, f"{error.__name__} changed the cache"
    cache.begin_step({"a": np.int64(2)})  # NumPy integers are integers
    cache.close()


@pytest.mark.parametrize("field,value", [("prefix_caching", "no"), ("map_ahead", 1), ("deferred_reclaim", None)])
def test_flags_must_be_booleans(field, value):
    with pytest.raises(InvalidConfig, match=field):
        small_config(**{field: value})


def test_a_budget_above_the_machines_memory_is_refused(mode):
    with pytest.raises(InvalidConfig, match="exceeds the memory"):
        vmkv.open_cache(small_config(memory_budget="64TiB"), mode=mode)


# ---- A14: stats() is O(1) -------------------------------------------------------------------------------
def test_stats_does_not_scale_with_the_pool():
    def stats_time(num_pages: int) -> float:
        config = vmkv.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=1,
                                    memory_budget=num_pages * 2 * 32, max_batch_size=4, max_seq_len=64)
        cache = vmkv.open_cache(config, mode="paged")
        cache.add("a")
        fill(cache, {"a": 50})
        best = min(_timed(cache.stats) for _ in range(20))
        cache.close()
        return best

    small, large = stats_time(1_000), stats_time(1_000_000)
    assert large < 20 * small + 1e-4, f"stats() took {small * 1e6:.0f} us at 1K pages, {large * 1e6:.0f} us at 1M"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_the_pool_keeps_its_shared_counter_and_undoes_exactly():
    pool = PagePool(8)
    pool.journal = []
    a, b = pool.allocate(2)
    pool.incref(a)
    pool.register(b, b"h")
    pool.decref(b)  # cached
    assert pool.num_shared == 1 and pool.num_cached == 1
    journal, pool.journal = pool.journal, None
    while journal:
        journal.pop()()
    assert pool.state() == PagePool(8).state() and pool.num_shared == 0
    pool.check()
