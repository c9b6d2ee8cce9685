"""Misuse a new user may try, each a typed error and never a crash or a wrong answer (issue 30).

* Item 2: writes through the views the cache hands out (``kv_cache``, ``kv``, ``layer_storage``)
  are refused with ``Unsupported``: the whole range, one element past a sequence's length, a view
  kept after ``free`` or ``close``; the crashes are tried in a child process, so a SIGSEGV fails
  the test and not the suite.
* Item 4: a cache used in a process that did not open it (``os.fork``, multiprocessing's default
  start method on Linux) raises ``CacheClosed`` and leaves the parent's K/V alone; like a closed
  cache (item 16), it reports no sequence.
* Item 7: ``attention`` on a layer the current step has not written raises ``InvalidInput``.
* Item 16: ``device="cpu:1"``, a ``max_seq_len`` past int32 and a paged block table no memory
  holds are refused when configured; ``VirtualCache.crop``/``reorder_cache`` refuse non-ints.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import small_config

import vmkv
from vmkv.errors import CacheClosed, InvalidConfig, InvalidInput, UnknownSequence, Unsupported

ROOT = Path(__file__).resolve().parents[1]
TPP = 32  # tokens a page in the small config


def fill(cache: vmkv.KVCacheBase, batch: dict[str, int], value: float) -> None:
    """One step of ``batch`` writing ``value`` into every layer's K and V."""
    plan = cache.begin_step(batch)
    kv = torch.full((sum(batch.values()), 2, 16), value)
    for layer in range(cache.config.num_layers):
        cache.write(layer, kv, kv, plan)


def run_child(script: str) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter on this checkout (a crash there is only a return code)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


# ---- item 2: the views a user gets refuse writes ---------------------------------------------------
WRITES_THROUGH_VIEWS = """
    import torch, vmkv
    from helpers import small_config

    def attempt(name, write):
        try:
            write()
        except Exception as exc:
            print(f"{name}: {type(exc).__name__}", flush=True)
        else:
            print(f"{name}: WRITTEN", flush=True)

    for layout in ("per_layer", "head_major", "all_layers"):
        cache = vmkv.VirtualKVCache(small_config(layout=layout))
        cache.add("a")
        plan = cache.begin_step({"a": 5})
        kv = torch.full((5, 2, 16), 2.0)
        for layer in range(2):
            cache.write(layer, kv, kv, plan)
        k_all, v_all = cache.kv_cache(0)
        rows, _ = cache.layer_storage(1)
        k, v = cache.kv("a", 0)
        slot = cache.slot("a")
        attempt(f"{layout} zero_ the whole layer", lambda: k_all.zero_())
        attempt(f"{layout} one past the length", lambda: k_all.__setitem__((slot, 5), 1.0))
        attempt(f"{layout} an empty page", lambda: v_all[slot, 3 * 32].fill_(1.0))
        attempt(f"{layout} rows", lambda: rows.zero_())
        attempt(f"{layout} out=", lambda: torch.add(k_all[slot, 40], 1.0, out=k_all[slot, 40]))
        attempt(f"{layout} in-place operator", lambda: k_all[slot].__iadd__(1.0))
        cache.free("a")
        attempt(f"{layout} kv after free", lambda: k.fill_(1.0))
        cache.close()
        attempt(f"{layout} kv after close", lambda: k.__setitem__(0, 1.0))
        attempt(f"{layout} numpy after close", lambda: v.numpy().__setitem__(0, 1.0))
        print(layout, "reads after close", float(k.sum()), float(k_all.abs().sum()), flush=True)
    print("alive", flush=True)
"""


def test_writes_through_the_views_raise_and_never_kill_the_process():
    proc = run_child(WRITES_THROUGH_VIEWS)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stdout.splitlines()
    assert lines[-1] == "alive"
    attempts = dict(line.rsplit(": ", 1) for line in lines if ": " in line)
    assert len(attempts) == 3 * 9
    for name, error in attempts.items():  # NumPy refuses a write to a read-only array with a ValueError
        assert error == ("ValueError" if "numpy" in name else "Unsupported"), (name, error)
    for layout in ("per_layer", "head_major", "all_layers"):
        assert f"{layout} reads after close 0.0 0.0" in lines


def test_a_refused_write_changes_nothing_and_reads_copies_and_kernels_still_work(mode):
    cache = vmkv.open_cache(small_config(), mode=mode)
    cache.add("a")
    fill(cache, {"a": 5}, 3.0)
    k, v = cache.kv("a", 1)
    before = k.clone(), cache.state()
    if mode == "vmm":  # mapped positions too: a view is for reading, whatever lies under it
        k_all, _ = cache.kv_cache(1)
        for write in (lambda: k.zero_(), lambda: k.__setitem__(0, 1.0), lambda: k_all[cache.slot("a"), :5].add_(1.0),
                      lambda: torch.nn.init.zeros_(k), lambda: torch.ops.aten.fill_.Scalar(k, 1.0),
                      lambda: torch._foreach_add_([k], 1.0), lambda: torch.nn.functional.relu(k, inplace=True)):
            with pytest.raises(Unsupported, match="read-only"):
                write()
        with pytest.raises(ValueError):  # the NumPy array over the same memory is read-only too
            k.numpy()[0] = 1.0
        assert type(k_all[0]) is type(k) and type(k.transpose(0, 1)) is type(k) and type(k.detach()) is type(k)
    assert torch.equal(k, before[0]) and cache.state() == before[1]
    mine = k.clone()  # a copy is an ordinary tensor: the user's to change
    mine.zero_()
    assert type(mine) is torch.Tensor and float(k.sum()) == 5 * 2 * 16 * 3.0
    assert type(k + 1) is torch.Tensor and torch.equal(k * 2, before[0] * 2)
    for copied in (copy.deepcopy(k), pickle.loads(pickle.dumps(k))):
        assert type(copied) is torch.Tensor and torch.equal(copied, before[0])
    plan = cache.begin_step({"a": 1})
    q = torch.ones(1, 4, 16)
    for layer in range(2):  # the cache's own writes and kernels are unaffected
        cache.write(layer, torch.ones(1, 2, 16), torch.ones(1, 2, 16), plan)
        cache.attention(layer, q, plan)
    assert torch.equal(cache.kv("a", 1)[0][5], torch.ones(2, 16))
    cache.close()


# ---- items 4 and 16: a forked child's copy is closed; a closed cache holds no sequence -------------
def _child_uses(cache: vmkv.KVCacheBase, results) -> None:
    """In the forked child: try every kind of call, report what each raised."""
    out = {}
    calls = {
        "add": lambda: cache.add("b"),
        "truncate": lambda: cache.truncate("a", 0),
        "begin_step": lambda: cache.begin_step({"a": 5}),
        "kv": lambda: cache.kv("a", 0),
        "trim": lambda: cache.trim(),
        "seq_len": lambda: cache.seq_len("a"),
    }
    for name, call in calls.items():
        try:
            call()
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            out[name] = f"{type(exc).__name__}: {exc}"
    try:  # what the child did: rewrite "a" from token 0 (the parent's page)
        cache.truncate("a", 0)
        plan = cache.begin_step({"a": 5})
        for layer in range(2):
            cache.write(layer, torch.full((5, 2, 16), 7.0), torch.full((5, 2, 16), 7.0), plan)
        out["overwrite"] = "ok"
    except Exception as exc:  # noqa: BLE001
        out["overwrite"] = type(exc).__name__
    out["len"], out["seq_ids"], out["in"] = len(cache), cache.seq_ids, "a" in cache
    cache.close()  # releases the child's copies only
    results.put(out)


def test_a_forked_child_gets_cache_closed_and_the_parent_keeps_its_kv(mode):
    context = multiprocessing.get_context()  # the default start method: fork on Linux before Python 3.14
    if context.get_start_method() != "fork":  # (later ones default to forkserver: the fork is the case at issue)
        context = multiprocessing.get_context("fork")
    cache = vmkv.open_cache(small_config(), mode=mode)
    cache.add("a")
    fill(cache, {"a": 5}, 3.0)
    before = cache.kv("a", 0)[0].clone(), cache.state()
    results = context.Queue()
    child = context.Process(target=_child_uses, args=(cache, results))
    child.start()
    out = results.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    for name in ("add", "truncate", "begin_step", "kv", "trim", "seq_len"):
        assert out[name].startswith("CacheClosed: "), (name, out[name])
    assert f"opened by process {os.getpid()}" in out["add"] and "fork" in out["add"]
    assert out["overwrite"] == "CacheClosed"
    assert (out["len"], out["seq_ids"], out["in"]) == (0, [], False)
    assert torch.equal(cache.kv("a", 0)[0], before[0]) and cache.state() == before[1]
    fill(cache, {"a": 1}, 4.0)  # the parent carries on
    cache.check()
    cache.close()


def test_a_closed_cache_reports_no_sequence(mode):
    cache = vmkv.open_cache(small_config(), mode=mode)
    cache.add("a")
    fill(cache, {"a": 3}, 1.0)
    cache.close()
    assert (len(cache), cache.seq_ids, "a" in cache, ["x"] in cache) == (0, [], False, False)
    for lookup in (lambda: cache.seq_len("a"), lambda: cache.slot("a"), lambda: cache.seq_len("never")):
        with pytest.raises(CacheClosed):
            lookup()
    assert cache.stats()["sequences"] == 0


def test_an_open_cache_still_tells_unknown_sequences_apart(mode):
    cache = vmkv.open_cache(small_config(), mode=mode)
    with pytest.raises(UnknownSequence):
        cache.seq_len("a")
    cache.close()


# ---- item 7: attention reads only layers the step wrote -------------------------------------------
def test_attention_on_a_layer_the_step_has_not_written_raises(mode):
    cache = vmkv.open_cache(small_config(), mode=mode)
    cache.add("old")
    fill(cache, {"old": 2 * TPP}, 9.0)  # pages that will be reused: stale K/V under the new sequence
    cache.free("old")
    cache.trim(keep_cached=True)
    cache.add("a")
    plan = cache.begin_step({"a": 5})
    q, kv = torch.ones(5, 4, 16), torch.ones(5, 2, 16)
    before = cache.state()
    for layer in (0, 1):
        with pytest.raises(InvalidInput, match=f"layer {layer} .*not written"):
            cache.attention(layer, q, plan)
    cache.write(0, kv, kv, plan)
    cache.attention(0, q, plan)
    with pytest.raises(InvalidInput, match="layer 1 .*not written"):
        cache.attention(1, q, plan)
    assert cache.state() == before
    cache.write(1, kv, kv, plan)
    cache.attention(1, q, plan)
    plan = cache.begin_step({"a": 1})  # a new step: nothing written yet
    with pytest.raises(InvalidInput, match="not written"):
        cache.attention(0, torch.ones(1, 4, 16), plan)
    cache.close()


def test_attention_after_write_batch_reads_the_written_layer():
    cache = vmkv.VirtualKVCache(small_config())
    cache.add("x"), cache.add("y")
    plan = cache.begin_step({"x": 3, "y": 3})
    cache.write_batch(0, torch.ones(2, 2, 3, 16), torch.ones(2, 2, 3, 16), plan)
    cache.attention(0, torch.ones(6, 4, 16), plan)
    with pytest.raises(InvalidInput, match="not written"):
        cache.attention(1, torch.ones(6, 4, 16), plan)
    cache.close()


# ---- item 16: devices, sizes, transformers' row calls ------------------------------------------------
@pytest.mark.parametrize("device", ["cpu:1", "cpu:7", torch.device("cpu", 3)])
def test_a_cpu_device_index_other_than_0_is_refused(device):
    with pytest.raises(InvalidConfig, match="cpu"):
        small_config(device=device)


def test_cpu_0_is_the_cpu(mode):
    config = small_config(device="cpu:0")
    assert config.device == torch.device("cpu")
    cache = vmkv.open_cache(config, mode=mode)
    cache.add("a")
    fill(cache, {"a": 3}, 1.0)  # tensors on "cpu" are on the cache's device
    cache.close()


@pytest.mark.parametrize("max_seq_len", [2**62, 2**40, 2**31])
def test_a_max_seq_len_no_int32_position_or_block_table_holds_is_refused_before_allocating(mode, max_seq_len):
    with pytest.raises(InvalidConfig, match="max_seq_len"):
        vmkv.open_cache(small_config(max_seq_len=max_seq_len), mode=mode)


def test_a_paged_block_table_larger_than_memory_is_refused():
    from vmkv.sizing import device_memory

    row_bytes = 4 * -(-(2**31 - 1) // 32)  # int32 entries for the longest sequence positions allow
    slots = device_memory(torch.device("cpu")) // row_bytes + 1  # one row more than the memory holds
    with pytest.raises(InvalidConfig, match="block table"):
        vmkv.PagedKVCache(small_config(max_seq_len=2**31 - 1, max_batch_size=slots))


@pytest.mark.parametrize("call, arg", [("crop", None), ("crop", "x"), ("crop", 1.5), ("crop", True),
                                       ("reorder_cache", None), ("reorder_cache", 3), ("reorder_cache", [True]),
                                       ("batch_select_indices", None)])
def test_virtual_cache_row_calls_refuse_what_is_not_ints(call, arg):
    vhf = pytest.importorskip("vmkv.hf")
    cache = vhf.VirtualCache("vmm")
    with pytest.raises(InvalidInput):
        getattr(cache, call)(arg)
    assert cache.get_seq_length() == 0


def test_numpy_ints_are_ints_for_crop():
    vhf = pytest.importorskip("vmkv.hf")
    cache = vhf.VirtualCache("vmm")
    cache.crop(np.int64(0))  # a no-op on an empty cache
