"""The Triton attention kernels (vmkv.kernels.triton_attention) against a float64 reference in
plain torch, run on CPU tensors by Triton's interpreter.

Triton decides when a ``@triton.jit`` function is defined whether it runs in the interpreter,
and its own library (``tl.max``, ``tl.sum``) is defined when triton is first imported: so
``TRITON_INTERPRET=1`` must be set before triton's first import in the process, and must not
leak into other tests (a compiled kernel elsewhere would find triton's library interpreted).
Hence: in a process that already runs the interpreter (``TRITON_INTERPRET=1 python -m pytest
tests/test_triton_kernels.py``: per-test results) the kernel tests run in place; otherwise
(a plain run, the whole suite) they are skipped here and ``test_kernels_in_interpreter`` runs
this module in a child process with the variable set, failing with the child's report.

Every run writes into an output poisoned with NaN (and, with splits, a NaN-poisoned workspace),
so an element left unwritten fails; every storage element no sequence addresses (the rest of a
last block or slot, unused blocks and slots, the other layers of an all-layers tensor) is NaN,
so a read past a sequence's length that reached the result fails too. Under a variant (window,
soft-cap, sinks) the storage is :func:`helpers.variant_step`'s: the memory before each window
released (block-table entries -1, those blocks NaN, the pool's last block NaN for a -1 used as
an index), checked against the float64 reference that applies the variant as transformers does.

The interpreter runs each program in Python, one at a time, so shapes are small and the
parameter sets cover each dimension a few times, not their full product. A GPU compiles the
same kernels: ``test_kernels_compile_for_sm90`` compiles them for an H100/H200 ahead of time
(no GPU needed), which checks what the interpreter does not (types of loop-carried values,
``tl.dot`` shape minimums).

On a machine with a CUDA GPU (and no interpreter set) the same kernel tests run in place on the
GPU, compiled: the storage is built on the CPU, as here, and moved to the device; the reference
stays float64 on the CPU (gpu_check's ``tests`` section runs this module so).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import variant_step

pytest.importorskip("triton", reason="triton is not installed (it is in the test extra on Linux x86_64): "
                                     "the Triton kernels' tests need it")

from vmkv.errors import BackendUnavailable, InvalidDevice, InvalidDtype, InvalidInput, InvalidShape, Unsupported  # noqa: E402
from vmkv.kernels import triton_attention as ta  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED, NOT_INTERPRETED_WHY = ta.triton_available("cpu")  # whether this process runs Triton's interpreter
CHILD = os.environ.get("VMKV_TRITON_CHILD") == "1"  # the child process of test_kernels_in_interpreter
ON_GPU = not INTERPRETED and torch.cuda.is_available() and ta.triton_available("cuda")[0]  # compiled, in place
DEVICE = "cuda" if ON_GPU else "cpu"  # where the kernels' inputs live
parent_only = pytest.mark.skipif(CHILD, reason="ran in the parent process")

TOLERANCE = {
    # (atol, rtol) of an output against the float64 reference on the same (rounded) inputs.
    # Outputs are convex combinations of V rows drawn from N(0, 1), so |out| < ~4. Accumulation is
    # float32 throughout; what differs by dtype is two roundings to it: the probabilities cast
    # to the dtype for the P @ V dot (relative error 2^-11 for float16, 2^-8 for bfloat16,
    # summed over keys with random signs) and the output's own rounding (the same relative
    # error times |out|). float32 dots are IEEE (not TF32), so float32 differs from float64
    # only by float32 summation order (its bound leaves room for a GPU's). Measured here: the
    # worst float16/bfloat16 errors are 3-6x below these bounds, float32's far below.
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@pytest.fixture
def kernels_run_here():
    """Requested by every test that runs a kernel: skipped unless this process runs Triton's
    interpreter or has a CUDA GPU (otherwise test_kernels_in_interpreter runs it in a child process)."""
    if not (INTERPRETED or ON_GPU):
        pytest.skip("runs in test_kernels_in_interpreter's child process (no Triton interpreter or GPU in this one)")


@pytest.mark.skipif(INTERPRETED or ON_GPU, reason="this process runs the kernel tests in place (Triton's interpreter, or a GPU)")
def test_kernels_in_interpreter():
    """This module's kernel tests, in a child process that sets TRITON_INTERPRET=1 before triton's
    first import (rerun them with per-test results: TRITON_INTERPRET=1 python -m pytest
    tests/test_triton_kernels.py)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "VMKV_TRITON_CHILD": "1"}
    command = [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider",
               "--tb=short", "-rfE"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (f"the kernel tests failed in the interpreter:\n{result.stdout[-6000:]}\n"
                                    f"{result.stderr[-2000:]}")


# ---- storage builders ---------------------------------------------------------------------------
@dataclass
class Storage:
    """K/V storage of some sequences, and the truth: each sequence's K/V in float64."""

    k: torch.Tensor
    v: torch.Tensor
    address: dict  # block_table=... or slots=...
    keys: list  # per sequence, float64 [L, Hkv, D]
    values: list


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def paged_storage(lens, block_size, kv_heads, head_dim, dtype, *, seed=0, fork=True, fill=float("nan")) -> Storage:
    """Block pools with each sequence's blocks scattered (shuffled pool ids), and copy-on-write
    forks: with ``fork``, sequence 1 shares sequence 0's blocks as far as both lengths reach
    (the last shared one may be full for one and partial for the other), as a fork does.

    Rows no sequence reaches, blocks no table names and everything else hold ``fill``; table
    entries past each sequence's blocks are -1."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    shared = min(need[0], need[1]) if fork and len(lens) > 1 else 0
    num_blocks = sum(need) - shared + 3  # spare blocks no one addresses
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, taken = [], 0
    for i, n in enumerate(need):
        if i == 1 and shared:
            own = tables[0][:shared] + ids[taken : taken + n - shared]
            taken += n - shared
        else:
            own = ids[taken : taken + n]
            taken += n
        tables.append(own)
    rows_used = {}  # pool block -> rows some sequence reaches
    for own, n in zip(tables, lens):
        for j, block in enumerate(own):
            rows_used[block] = max(rows_used.get(block, 0), min(block_size, n - j * block_size))
    k = torch.full((num_blocks, block_size, kv_heads, head_dim), fill, dtype=dtype)
    v = torch.full_like(k, fill)
    if not math.isnan(fill):  # junk from another generator: the sequences' data stay the same
        junk = torch.Generator().manual_seed(seed + 1)
        k.copy_(_randn(junk, *k.shape, dtype=dtype))
        v.copy_(_randn(junk, *v.shape, dtype=dtype))
    for block, rows in sorted(rows_used.items()):
        k[block, :rows] = _randn(gen, rows, kv_heads, head_dim, dtype=dtype)
        v[block, :rows] = _randn(gen, rows, kv_heads, head_dim, dtype=dtype)
    width = max(need) + 1  # one more column, all -1
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    for i, own in enumerate(tables):
        table[i, : len(own)] = torch.tensor(own, dtype=torch.int32)
    keys = [k[own].flatten(0, 1)[:n].double() for own, n in zip(tables, lens)]
    values = [v[own].flatten(0, 1)[:n].double() for own, n in zip(tables, lens)]
    return Storage(k.to(DEVICE), v.to(DEVICE), {"block_table": table.to(DEVICE)}, keys, values)


def contiguous_storage(lens, capacity, kv_heads, head_dim, dtype, *, layout="plain", seed=0, fill=float("nan")) -> Storage:
    """``[max_batch, capacity, Hkv, D]`` views, as VMM mode hands them out:

    * ``plain``: a contiguous tensor;
    * ``all_layers``: layer 1 of an all-layers ``[B, S, 3, H, D]`` tensor (the other layers hold
      ``fill``);
    * ``head_major``: a ``[B, H, S, D]`` range seen as ``.transpose(1, 2)``.

    Slots are a shuffled subset of ``B + 2`` rows; past each length, and unused slots, ``fill``."""
    gen = torch.Generator().manual_seed(seed)
    max_batch = len(lens) + 2
    slots = torch.randperm(max_batch, generator=gen)[: len(lens)].to(torch.int32)
    junk = torch.Generator().manual_seed(seed + 1)  # another generator: the sequences' data stay the same

    def make() -> torch.Tensor:
        shape = {
            "plain": (max_batch, capacity, kv_heads, head_dim),
            "all_layers": (max_batch, capacity, 3, kv_heads, head_dim),
            "head_major": (max_batch, kv_heads, capacity, head_dim),
        }[layout]
        full = torch.full(shape, fill, dtype=dtype)
        if not math.isnan(fill):
            full.copy_(_randn(junk, *shape, dtype=dtype))
        view = {"plain": lambda t: t, "all_layers": lambda t: t[:, :, 1], "head_major": lambda t: t.transpose(1, 2)}[layout](full)
        for slot, n in zip(slots.tolist(), lens):
            view[slot, :n] = _randn(gen, n, kv_heads, head_dim, dtype=dtype)
        return view

    k, v = make(), make()
    keys = [k[s, :n].double() for s, n in zip(slots.tolist(), lens)]
    values = [v[s, :n].double() for s, n in zip(slots.tolist(), lens)]
    return Storage(_moved(k), _moved(v), {"slots": slots.to(DEVICE)}, keys, values)


def _moved(view: torch.Tensor) -> torch.Tensor:
    """``view`` on :data:`DEVICE` with its strides: its whole storage moved, then viewed alike."""
    if DEVICE == "cpu":
        return view
    base = torch.empty(0, dtype=view.dtype).set_(view.untyped_storage()).to(DEVICE)
    return base.as_strided(view.shape, view.stride(), view.storage_offset())


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of ``q: [n, Hq, D]``, the last ``n`` positions of ``keys,
    values: [L, Hkv, D]`` (query j at position L - n + j); zeros where there is no key."""
    n, q_heads, _ = q.shape
    length = keys.shape[0]
    if length == 0:
        return torch.zeros(q.shape, dtype=torch.float64)
    group = q_heads // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    position = length - n + torch.arange(n)
    scores = scores.masked_fill(torch.arange(length)[None, :] > position[:, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out).all(), "an output element was not written (NaN poison left) or is not finite"
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double().cpu(), expected, atol=atol, rtol=rtol)


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def nan_workspace(batch, q_heads, head_dim, splits) -> ta.DecodeWorkspace:
    ws = ta.DecodeWorkspace.allocate(batch, q_heads, head_dim, splits, DEVICE)
    ws.partial_out.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    return ws


def run_decode(store: Storage, lens, q_heads, dtype, *, num_splits=None, seed=1, check=True) -> torch.Tensor:
    head_dim = store.k.shape[3]
    q = _randn(torch.Generator().manual_seed(seed), len(lens), q_heads, head_dim, dtype=dtype)
    splits = num_splits or ta.MAX_AUTO_SPLITS
    out = ta.decode_attention(
        q.to(DEVICE), store.k, store.v, torch.tensor(lens, dtype=torch.int32, device=DEVICE), **store.address,
        num_splits=num_splits, out=poisoned(q.shape, dtype), workspace=nan_workspace(len(lens), q_heads, head_dim, splits),
    )
    if check:
        scale = head_dim ** -0.5
        expected = torch.stack([reference(q[i : i + 1], store.keys[i], store.values[i], scale)[0] for i in range(len(lens))])
        assert_close(out, expected, dtype)
    return out


def run_prefill(store: Storage, q_lens, kv_lens, q_heads, dtype, *, seed=2) -> torch.Tensor:
    head_dim = store.k.shape[3]
    q = _randn(torch.Generator().manual_seed(seed), sum(q_lens), q_heads, head_dim, dtype=dtype)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = ta.prefill_attention(
        *on_device(q, store.k, store.v, cu_q, torch.tensor(kv_lens, dtype=torch.int32)), **store.address,
        out=poisoned(q.shape, dtype),
    )
    scale = head_dim ** -0.5
    for i in range(len(q_lens)):
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        assert_close(out[rows], reference(q[rows], store.keys[i], store.values[i], scale), dtype)
    return out


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


# ---- decode -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "block_size, group, head_dim, dtype",
    [
        (16, 1, 64, F32),
        (16, 4, 128, BF16),
        (32, 8, 32, F16),
        (32, 4, 64, F32),
        (256, 4, 64, F16),
        (256, 8, 128, BF16),
    ],
)
def test_decode_paged(kernels_run_here, block_size, group, head_dim, dtype):
    """Lengths 0, 1, a block, a block + 1, and more; sequence 1 a fork sharing sequence 0's
    blocks; the default split count."""
    lens = [block_size + 1, block_size, 0, 1, 2 * block_size + 5]
    store = paged_storage(lens, block_size, 2, head_dim, dtype)
    shared = set(store.address["block_table"][0].tolist()) & set(store.address["block_table"][1].tolist()) - {-1}
    assert shared, "the fork shares no block"
    out = run_decode(store, lens, 2 * group, dtype)
    assert (out[2] == 0).all(), "a sequence without keys must get zeros"


@pytest.mark.parametrize(
    "layout, group, head_dim, dtype",
    [("plain", 4, 64, F32), ("all_layers", 8, 128, BF16), ("head_major", 1, 32, F16), ("head_major", 4, 64, F32)],
)
def test_decode_contiguous(kernels_run_here, layout, group, head_dim, dtype):
    """Slots of strided views (one layer of an all-layers tensor, a head-major range
    transposed), lengths 0 .. capacity, forced splits."""
    lens, capacity = [0, 1, 64, 65, 150], 150
    store = contiguous_storage(lens, capacity, 2, head_dim, dtype, layout=layout)
    out = run_decode(store, lens, 2 * group, dtype, num_splits=3)
    assert (out[0] == 0).all()


@pytest.mark.parametrize("addressing", ["paged", "contiguous"])
def test_split_counts_agree(kernels_run_here, addressing):
    """1..5 splits, and far more splits than blocks (empty splits), give the same output."""
    lens = [1, 16, 17, 100]
    if addressing == "paged":
        store = paged_storage(lens, 16, 1, 32, F32)
    else:
        store = contiguous_storage(lens, 128, 1, 32, F32, layout="head_major")
    outs = [run_decode(store, lens, 4, F32, num_splits=n) for n in (1, 2, 3, 4, 5, 40)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=2e-6, rtol=2e-6)


def test_steps_reuse_buffers_as_a_graph_replay_would(kernels_run_here):
    """The same q, out, workspace, lengths tensor and split count every step (what a captured
    graph replays), lengths grown in place on the device: each step is right, crossing blocks."""
    final = [2, 17, 33]
    store = paged_storage(final, 16, 1, 32, F32)
    lens, q = on_device(torch.tensor([n - 2 for n in final], dtype=torch.int32), torch.randn(3, 4, 32))  # lens 0, 15, 31
    out = poisoned(q.shape, F32)
    ws = nan_workspace(3, 4, 32, 3)
    for step in range(3):
        ta.decode_attention(q, store.k, store.v, lens, **store.address, num_splits=3, out=out, workspace=ws)
        n = lens.tolist()
        expected = torch.stack([reference(q[i : i + 1].cpu(), store.keys[i][: n[i]], store.values[i][: n[i]], 32**-0.5)[0]
                                for i in range(3)])
        assert_close(out, expected, F32)
        lens += 1


def test_decode_all_empty_with_splits(kernels_run_here):
    """Every sequence without keys, several splits: the merge sees only empty splits -> zeros."""
    lens = [0, 0]
    store = paged_storage(lens, 16, 1, 16, F32, fork=False)
    out = run_decode(store, lens, 2, F32, num_splits=4)
    assert (out == 0).all()


@pytest.mark.parametrize("addressing", ["paged", "contiguous"])
def test_reads_past_length_do_not_matter(kernels_run_here, addressing):
    """The same sequences over storage whose unaddressed elements are NaN or random numbers:
    bit-identical outputs (nothing past a length is read into the result)."""
    lens = [3, 20, 33]
    outs = []
    for fill in (float("nan"), 1.0):
        if addressing == "paged":
            store = paged_storage(lens, 16, 1, 32, F16, fill=fill)
        else:
            store = contiguous_storage(lens, 48, 1, 32, F16, layout="all_layers", fill=fill)
        outs.append(run_decode(store, lens, 4, F16, num_splits=2, check=False))
        outs.append(run_prefill(store, [3, 5, 33], lens, 4, F16))
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


def test_odd_block_size_and_group(kernels_run_here):
    """A block size that does not hold whole key tiles and is no power of two (each key looks its
    block up), and a group of 3 query heads per KV head (padded rows)."""
    lens = [0, 24, 49, 100]
    store = paged_storage(lens, 24, 2, 32, F32)
    run_decode(store, lens, 6, F32, num_splits=2)
    run_prefill(store, [1, 24, 10, 37], lens, 6, F32)


def test_large_scores(kernels_run_here):
    """Scores in the hundreds (softmax all but one-hot): the running max keeps every exp2 finite,
    across tiles and across splits."""
    lens = [5, 70, 130]
    store = paged_storage(lens, 16, 1, 32, F32)
    store.k.mul_(8)  # with q ~ N(0, 1) * 8 below: scores ~ N(0, 64^2 * 32 / 32)
    store.keys = [k * 8 for k in store.keys]
    q = torch.randn(3, 2, 32) * 8
    expected = torch.stack([reference(q[i : i + 1], store.keys[i], store.values[i], 32**-0.5)[0] for i in range(3)])
    q, lengths, cu_q = on_device(q, torch.tensor(lens, dtype=torch.int32), torch.tensor([0, 1, 2, 3], dtype=torch.int32))
    out = ta.decode_attention(q, store.k, store.v, lengths, **store.address, num_splits=3, out=poisoned(q.shape, F32))
    assert_close(out, expected, F32)
    out = ta.prefill_attention(q, store.k, store.v, cu_q, lengths, **store.address, out=poisoned(q.shape, F32))
    assert_close(out, expected, F32)


# ---- prefill ------------------------------------------------------------------------------------
SCENARIOS = {
    # name: (q_lens, kv_lens)
    "no_prefix": ([5, 17, 33], [5, 17, 33]),  # plain causal prefill, ragged
    "chunked": ([8, 20, 1, 0], [40, 20, 70, 9]),  # a cached prefix, no prefix, a decode row, no new token
    "long_chunk": ([40, 1], [75, 16]),  # a chunk of several query tiles after a prefix
}


@pytest.mark.parametrize(
    "block_size, group, head_dim, dtype, scenario",
    [
        (16, 4, 64, F16, "chunked"),
        (256, 1, 128, BF16, "no_prefix"),
        (32, 8, 32, F32, "long_chunk"),
        (16, 1, 32, F32, "chunked"),
    ],
)
def test_prefill_paged(kernels_run_here, block_size, group, head_dim, dtype, scenario):
    q_lens, kv_lens = SCENARIOS[scenario]
    store = paged_storage(kv_lens, block_size, 2, head_dim, dtype)
    run_prefill(store, q_lens, kv_lens, 2 * group, dtype)


@pytest.mark.parametrize(
    "layout, group, head_dim, dtype, scenario",
    [("plain", 4, 32, F32, "no_prefix"), ("all_layers", 8, 64, BF16, "chunked"), ("head_major", 1, 128, F16, "long_chunk")],
)
def test_prefill_contiguous(kernels_run_here, layout, group, head_dim, dtype, scenario):
    q_lens, kv_lens = SCENARIOS[scenario]
    store = contiguous_storage(kv_lens, max(kv_lens) + 7, 2, head_dim, dtype, layout=layout)
    run_prefill(store, q_lens, kv_lens, 2 * group, dtype)


def test_prefill_head_dim_256(kernels_run_here):
    lens = [3, 40]
    store = paged_storage(lens, 32, 1, 256, F16)
    run_prefill(store, [3, 9], lens, 2, F16)
    run_decode(store, lens, 2, F16, num_splits=2)


# ---- variants: window, soft-cap, sinks ---------------------------------------------------------
def run_variant(step, q_heads, dtype, *, window=0, softcap=0.0, sinks=None, num_splits=None, seed=3):
    """The Triton kernel of the step's phase (decode if every sequence adds one token, else
    prefill) over both addressings of ``step`` (:func:`helpers.variant_step`: the window's memory
    released, block-table entries -1 and the blocks NaN), checked against the float64 reference
    of the variant. Returns the two outputs (slots, blocks)."""
    plan = step.plan
    q = _randn(torch.Generator().manual_seed(seed), plan.num_tokens, q_heads, step.k_pool.shape[3], dtype=dtype)
    variant = dict(window=window, softcap=softcap, sinks=None if sinks is None else sinks.to(DEVICE))
    lens = plan.kv_lens_t.to(DEVICE)
    outs = []
    for k, v, where in ((step.k_slots, step.v_slots, {"slots": plan.slots_t.to(DEVICE)}),
                        (step.k_pool, step.v_pool, {"block_table": plan.block_table.to(DEVICE)})):
        k, v = _moved(k), _moved(v)
        if plan.is_decode:
            ws = nan_workspace(plan.batch_size, q_heads, q.shape[2], num_splits or ta.MAX_AUTO_SPLITS)
            out = ta.decode_attention(q.to(DEVICE), k, v, lens, num_splits=num_splits, out=poisoned(q.shape, dtype),
                                      workspace=ws, **variant, **where)
        else:
            out = ta.prefill_attention(q.to(DEVICE), k, v, plan.cu_q.to(DEVICE), lens, out=poisoned(q.shape, dtype),
                                       **variant, **where)
        for i in range(plan.batch_size):
            rows = slice(plan.offsets[i], plan.offsets[i + 1])
            want = step.reference(q, i, window=window, softcap=softcap, sinks=sinks)
            assert_close(out[rows], want, dtype)
        outs.append(out)
    return outs


VARIANT_DECODE = [  # (starts, block_size, head_dim, group, dtype, window, softcap, sinks, splits)
    ([40, 3, 70, 17], 16, 32, 4, F32, 5, 0.0, False, 1),  # windows inside a block; per-key block lookups
    ([40, 3, 70, 17], 16, 32, 4, F32, 17, 0.0, True, 3),  # a block and one key; sinks merged across splits
    ([40, 3, 70, 17], 16, 16, 1, F16, 1, 2.0, True, 1),  # window 1: a query sees only itself
    ([200, 64, 150], 64, 16, 2, F32, 70, 3.0, True, 2),  # one table entry per tile: whole blocks released
    ([200, 64, 150], 64, 64, 4, BF16, 130, 0.0, False, None),  # the default split count for the window
    ([20, 5, 9], 16, 32, 2, F32, 1000, 5.0, True, 4),  # a window longer than every sequence
    ([20, 5, 9], 16, 32, 8, F32, 0, 5.0, True, 2),  # no window: soft-cap and sinks alone
]


@pytest.mark.parametrize("starts, block_size, head_dim, group, dtype, window, softcap, sinks, splits", VARIANT_DECODE)
def test_decode_variants(kernels_run_here, starts, block_size, head_dim, group, dtype, window, softcap, sinks, splits):
    """Split-KV decode under a variant, slots and block tables: the window's blocks released
    (entries -1, blocks NaN), one and several splits, GQA."""
    step = variant_step(starts, [1] * len(starts), window=window, block_size=block_size, head_dim=head_dim, dtype=dtype)
    sink_logits = torch.randn(2 * group, generator=torch.Generator().manual_seed(5)) * 2 if sinks else None
    run_variant(step, 2 * group, dtype, window=window, softcap=softcap, sinks=sink_logits, num_splits=splits)


VARIANT_PREFILL = [  # (starts, q_lens, block_size, head_dim, group, dtype, window, softcap, sinks)
    ([40, 0, 70, 17], [1, 30, 1, 5], 16, 32, 4, F32, 5, 0.0, True),  # mixed: decode rows, a prompt, a chunk
    ([40, 0, 33], [1, 70, 2], 24, 32, 2, F16, 17, 3.0, False),  # odd block size, a prompt longer than the window
    ([200, 64, 150], [1, 70, 9], 64, 16, 1, F32, 70, 0.0, True),  # whole blocks released before a chunk
    ([8, 0], [20, 9], 16, 16, 8, BF16, 1, 2.0, True),  # window 1
    ([8, 0], [20, 9], 16, 16, 2, F32, 1000, 0.0, False),  # a window longer than every sequence
]


@pytest.mark.parametrize("starts, q_lens, block_size, head_dim, group, dtype, window, softcap, sinks", VARIANT_PREFILL)
def test_prefill_variants(kernels_run_here, starts, q_lens, block_size, head_dim, group, dtype, window, softcap, sinks):
    """Chunked prefill under a variant, slots and block tables, a cached prefix partly released."""
    step = variant_step(starts, q_lens, window=window, block_size=block_size, head_dim=head_dim, dtype=dtype)
    sink_logits = torch.randn(2 * group, generator=torch.Generator().manual_seed(5)) * 2 if sinks else None
    run_variant(step, 2 * group, dtype, window=window, softcap=softcap, sinks=sink_logits)


def test_memory_before_a_window_is_never_read(kernels_run_here):
    """The same step over storage whose released memory holds NaN or zeros (what an unmapped VMM
    page reads): bit-identical outputs, decode and prefill (nothing before the window reaches
    the result, and no -1 entry is followed)."""
    outs = []
    for fill in (float("nan"), 0.0):
        decode = variant_step([40, 3, 70], [1, 1, 1], window=9, block_size=16, before_window=fill)
        prefill = variant_step([40, 3, 70], [1, 20, 6], window=9, block_size=16, before_window=fill)
        outs += run_variant(decode, 4, F32, window=9, num_splits=2) + run_variant(prefill, 4, F32, window=9)
    assert all(torch.equal(a, b) for a, b in zip(outs[:4], outs[4:]))


def test_split_counts_agree_under_a_window(kernels_run_here):
    """1..5 splits and far more splits than the window's tiles give the same output."""
    step = variant_step([100, 30, 7], [1, 1, 1], window=20, block_size=16, head_dim=16)
    sinks = torch.randn(4)
    outs = [run_variant(step, 4, F32, window=20, softcap=4.0, sinks=sinks, num_splits=n)[1] for n in (1, 2, 5, 40)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=2e-6, rtol=2e-6)


# ---- host side: splits, graph friendliness, probe ----------------------------------------------
def test_choose_num_splits():
    assert ta.choose_num_splits(32, 8, 8192, 132) == 1  # 256 programs for 132 SMs: enough already
    assert ta.choose_num_splits(8, 8, 8192, 132) == 3  # 64 programs -> 192 for 132 wanted
    assert ta.choose_num_splits(1, 8, 8192, 132) == 4  # 17 wanted, no split under MIN_KEYS_PER_SPLIT keys
    assert ta.choose_num_splits(8, 8, 2048, 132) == 1  # too few keys to split
    assert ta.choose_num_splits(1, 1, 1 << 20, 132) == ta.MAX_AUTO_SPLITS  # 132 wanted, capped
    assert ta.choose_num_splits(1, 1, 5000, 132) == 3
    assert ta.choose_num_splits(4, 2, 0, 132) == 1
    assert ta.choose_num_splits(0, 8, 4096, 132) >= 1


class _Recorder:
    """Stands in for the kernel module: records each launch's grid and arguments."""

    def __init__(self):
        self.launches = []

    def __getattr__(self, name):
        recorder = self

        class _Kernel:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: recorder.launches.append((name, grid, args, kwargs))

        return _Kernel()


def test_host_side_reads_no_device_value(monkeypatch):
    """Every host decision comes from shapes and host ints: on ``meta`` tensors (no data, so any
    ``.item()``/``.tolist()``/sync raises) decode and prefill plan their launches, and the grids
    are the same whatever the lengths."""
    recorder = _Recorder()
    monkeypatch.setattr(ta, "_require", lambda device: recorder)
    meta = dict(device="meta")
    q = torch.empty(6, 8, 64, dtype=F16, **meta)
    pool = torch.empty(40, 16, 1, 64, dtype=F16, **meta)  # one KV head: 6 programs, fewer than the SMs, so splits
    lens = torch.empty(6, dtype=torch.int32, **meta)
    table = torch.empty(6, 400, dtype=torch.int32, **meta)  # up to 6,400 keys
    ta.decode_attention(q, pool, pool, lens, block_table=table, max_kv_len=5000)
    ta.decode_attention(q, pool, pool, lens, block_table=table, num_splits=1)
    ta.prefill_attention(q, pool, pool, torch.empty(3, dtype=torch.int32, **meta), lens[:2], block_table=table[:2])
    names = [(name, grid) for name, grid, _, _ in recorder.launches]
    splits = ta.choose_num_splits(6, 1, 5000, ta.CPU_STAND_IN_SMS)
    assert splits > 1
    assert names == [
        ("_decode_split_kernel", (6, 1, splits)), ("_decode_merge_kernel", (6, 1)),
        ("_decode_split_kernel", (6, 1, 1)),
        ("_prefill_kernel", (6 // 16 + 2, 1)),
    ]


def test_workspace_caps_default_splits(kernels_run_here):
    lens = [2200, 6300]  # long enough for the rule to split (it would take 4)
    store = paged_storage(lens, 256, 1, 16, F32)
    q = torch.randn(2, 2, 16)
    ws = ta.DecodeWorkspace.allocate(2, 2, 16, 2, DEVICE)
    ws.partial_lse.fill_(float("nan"))
    out = ta.decode_attention(*on_device(q, store.k, store.v, torch.tensor(lens, dtype=torch.int32)), **store.address,
                              workspace=ws)
    assert not torch.isnan(ws.partial_lse).any(), "the default split count must be capped at the workspace's 2"
    expected = torch.stack([reference(q[i : i + 1], store.keys[i], store.values[i], 0.25)[0] for i in range(2)])
    assert_close(out, expected, F32)


def test_probe():
    assert ta.triton_available("cpu") == (INTERPRETED, NOT_INTERPRETED_WHY)
    ok, why = ta.triton_available("meta")
    assert not ok and "meta" in why
    if not torch.cuda.is_available():
        ok, why = ta.triton_available("cuda")
        assert not ok and "CUDA" in why


def test_probe_failure_raises_backend_unavailable(monkeypatch):
    monkeypatch.setattr(ta, "triton_available", lambda device=None: (False, "triton is not importable (test)"))
    q = torch.randn(1, 2, 16)
    pool = torch.randn(2, 16, 1, 16)
    with pytest.raises(BackendUnavailable, match="not importable"):
        ta.decode_attention(q, pool, pool, torch.ones(1, dtype=torch.int32), slots=torch.zeros(1, dtype=torch.int32))


@parent_only
def test_without_triton_import_works_and_kernels_say_why():
    """In a process where triton cannot be imported, importing vmkv's kernels works, the probe says
    why, and a call raises BackendUnavailable (after validating its inputs)."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # import triton -> ImportError
        import torch
        from vmkv.errors import BackendUnavailable, InvalidShape
        from vmkv.kernels import triton_attention as ta
        ok, why = ta.triton_available("cpu")
        assert not ok and "triton is not importable" in why, why
        q, pool = torch.randn(1, 2, 16), torch.randn(2, 16, 1, 16)
        lens, slots = torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        try:
            ta.decode_attention(q, pool, pool, lens, slots=slots)
        except BackendUnavailable as exc:
            assert "triton is not importable" in str(exc), exc
        else:
            raise AssertionError("no BackendUnavailable")
        try:
            ta.decode_attention(q[:, :, :8], pool, pool, lens, slots=slots)
        except InvalidShape:
            pass
        print("OK")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr


# ---- errors -------------------------------------------------------------------------------------
def _valid(dtype=F32):
    q = torch.randn(2, 4, 32, dtype=dtype)
    pool = torch.randn(6, 16, 2, 32, dtype=dtype)
    return dict(
        q=q, k=pool, v=pool.clone(), kv_lens=torch.tensor([3, 20], dtype=torch.int32),
        block_table=torch.tensor([[0, -1], [1, 2]], dtype=torch.int32),
    )


def _bad(**changes):
    args = _valid()
    args.update(changes)
    return args


I32 = torch.int32
DECODE_ERRORS = [
    (InvalidDtype, _bad(q=torch.randn(2, 4, 32, dtype=torch.float64))),
    (InvalidDtype, _bad(k=torch.randn(6, 16, 2, 32, dtype=F16))),
    (InvalidShape, _bad(q=torch.randn(2, 4, 32, 1))),
    (InvalidShape, _bad(v=torch.randn(6, 16, 2, 16))),
    (InvalidShape, _bad(q=torch.randn(2, 4, 16))),  # head_dim differs from k's
    (InvalidShape, _bad(q=torch.randn(2, 3, 32))),  # 3 q heads over 2 KV heads
    (Unsupported, _bad(q=torch.randn(2, 4, 48), k=torch.randn(6, 16, 2, 48), v=torch.randn(6, 16, 2, 48))),
    (InvalidInput, _bad(k=torch.randn(6, 16, 2, 64)[..., ::2])),  # non-unit last stride
    (InvalidInput, _bad(q=torch.randn(2, 4, 64)[..., ::2])),
    (InvalidDtype, _bad(kv_lens=torch.tensor([3, 20]))),  # int64
    (InvalidShape, _bad(kv_lens=torch.tensor([3], dtype=I32))),
    (InvalidDtype, _bad(block_table=torch.tensor([[0, -1], [1, 2]]))),
    (InvalidShape, _bad(block_table=torch.tensor([0, 1], dtype=I32))),
    (InvalidInput, _bad(slots=torch.tensor([0, 1], dtype=I32))),  # both addressings
    (InvalidInput, _bad(block_table=None)),  # neither
    (InvalidDevice, _bad(kv_lens=torch.tensor([3, 20], dtype=I32, device="meta"))),
    (InvalidDevice, _bad(k=torch.randn(6, 16, 2, 32, device="meta"))),
    (InvalidShape, _bad(out=torch.empty(2, 4, 16))),
    (InvalidDtype, _bad(out=torch.empty(2, 4, 32, dtype=F16))),
    (InvalidInput, _bad(out=torch.empty(2, 4, 64)[..., ::2])),
    (InvalidInput, _bad(num_splits=0)),
    (InvalidInput, _bad(num_splits=ta.MAX_NUM_SPLITS + 1)),
    (InvalidInput, _bad(num_splits=2.0)),
    (InvalidInput, _bad(max_kv_len=-1)),
    (InvalidInput, _bad(scale=float("nan"))),
    (InvalidInput, _bad(workspace=object())),
    (InvalidShape, _bad(num_splits=4, workspace=ta.DecodeWorkspace.allocate(2, 4, 32, 2, "cpu"))),  # too few splits
    (InvalidShape, _bad(num_splits=2, workspace=ta.DecodeWorkspace.allocate(1, 4, 32, 2, "cpu"))),  # too few rows
    (InvalidInput, _bad(q=[[1.0]])),
    (InvalidInput, _bad(window=-1)),
    (InvalidInput, _bad(window=2.0)),
    (InvalidInput, _bad(softcap=-1.0)),
    (InvalidInput, _bad(softcap=float("inf"))),
    (InvalidInput, _bad(sinks=[0.0] * 4)),
    (InvalidDtype, _bad(sinks=torch.zeros(4, dtype=F16))),
    (InvalidShape, _bad(sinks=torch.zeros(3))),  # one logit per query head: 4
    (InvalidDevice, _bad(sinks=torch.zeros(4, device="meta"))),
    (InvalidInput, _bad(sinks=torch.zeros(8)[::2])),  # not unit-strided
]


@pytest.fixture
def no_launch(monkeypatch):
    """Errors are raised before anything launches: reaching the kernels fails the test."""

    def launch(device):
        raise AssertionError("validation let bad input through to the kernels")

    monkeypatch.setattr(ta, "_require", launch)


@pytest.mark.parametrize("error, args", DECODE_ERRORS, ids=[f"{e.__name__}-{i}" for i, (e, _) in enumerate(DECODE_ERRORS)])
def test_decode_errors(no_launch, error, args):
    with pytest.raises(error):
        ta.decode_attention(**args)


def test_decode_contiguous_errors(no_launch):
    q, cache = torch.randn(2, 4, 32), torch.randn(3, 8, 2, 32)
    lens = torch.tensor([1, 2], dtype=I32)
    with pytest.raises(InvalidDtype):
        ta.decode_attention(q, cache, cache, lens, slots=torch.tensor([0, 1]))
    with pytest.raises(InvalidShape):
        ta.decode_attention(q, cache, cache, lens, slots=torch.tensor([0, 1, 2], dtype=I32))
    with pytest.raises(InvalidShape):  # a pool with blocks of 0 tokens
        ta.decode_attention(q, cache[:, :0], cache[:, :0], lens, block_table=torch.zeros(2, 1, dtype=I32))


def test_prefill_errors(no_launch):
    args = _valid()
    args["cu_q"] = torch.tensor([0, 1, 2], dtype=I32)
    with pytest.raises(InvalidDtype):
        ta.prefill_attention(**{**args, "cu_q": torch.tensor([0, 1, 2])})
    with pytest.raises(InvalidShape):
        ta.prefill_attention(**{**args, "cu_q": torch.tensor([[0, 1, 2]], dtype=I32)})
    with pytest.raises(InvalidShape):  # 3 sequences by cu_q, 2 by kv_lens
        ta.prefill_attention(**{**args, "cu_q": torch.tensor([0, 1, 1, 2], dtype=I32)})
    with pytest.raises(InvalidDevice):
        ta.prefill_attention(**{**args, "cu_q": torch.tensor([0, 1, 2], dtype=I32, device="meta")})
    with pytest.raises(Unsupported):
        ta.prefill_attention(**{**args, "q": torch.randn(2, 4, 8), "k": torch.randn(6, 16, 2, 8), "v": torch.randn(6, 16, 2, 8)})
    with pytest.raises(InvalidInput):
        ta.prefill_attention(**{**args, "window": -2})
    with pytest.raises(InvalidShape):
        ta.prefill_attention(**{**args, "sinks": torch.zeros(2)})


# ---- the GPU build ------------------------------------------------------------------------------
@parent_only
def test_kernels_compile_for_sm90():
    """Compile each kernel variant for sm90 (H100/H200) ahead of time with the installed triton:
    no GPU needed. The interpreter runs kernels as Python and does not check what compilation
    does (types of loop-carried values, ``tl.dot`` shape minimums, constexpr branches)."""
    code = textwrap.dedent(
        """
        import importlib.util, sys
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        spec = importlib.util.spec_from_file_location("triton_kernels", sys.argv[1])
        K = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(K)  # the kernels' module alone (it imports only triton)

        def compile_(fn, dtype, **constexprs):
            types = {"Q": dtype, "K": dtype, "V": dtype, "OUT": dtype, "PART_OUT": "*fp32", "PART_LSE": "*fp32", "SINKS": "*fp32",
                     "qk_scale": "fp32", "softcap_in": "fp32", "softcap_out": "fp32"}
            if constexprs.pop("one_split", False):
                constexprs["num_splits"] = 1  # how triton compiles an int argument equal to 1
            for name in ("KV_LENS", "BLOCK_TABLE", "SLOTS", "CU_Q"):
                types[name] = "*i32"
            sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
            src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
            triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})

        variants = [  # (kernel, dtype, dot precision, paged, block size, head_dim, group, splits, soft-cap, sinks)
            ("decode", "*fp16", "tf32", True, 16, 128, 4, 3, False, False),  # a tile spans blocks: per-key lookups
            ("decode", "*fp32", "ieee", False, 1, 256, 8, 1, False, False),  # contiguous, one split: writes out itself
            ("decode", "*bf16", "tf32", True, 64, 64, 8, 1, True, True),  # soft-cap, sinks in pass 1
            ("decode", "*fp16", "tf32", False, 1, 128, 4, 4, True, True),  # sinks left to the merge
            ("prefill", "*bf16", "tf32", True, 256, 64, 1, 0, False, False),  # one block-table entry per tile
            ("prefill", "*fp16", "tf32", True, 24, 32, 32, 0, False, False),  # odd block size, a group of 32
            ("prefill", "*bf16", "tf32", True, 16, 128, 4, 0, True, True),
            ("merge", "*bf16", "", False, 0, 128, 4, 3, False, False),
            ("merge", "*fp16", "", False, 0, 64, 8, 3, False, True),
        ]
        for kernel, dtype, prec, paged, page, dim, group, splits, softcap, sinks in variants:
            block_n = max(16, min(64, 16384 // (dim * (4 if dtype == "*fp32" else 2))))  # as triton_attention._block_n
            common = dict(GROUP=group, HEAD_DIM=dim, BLOCK_N=block_n, PAGED=paged, PAGE_SIZE=page, DOT_PRECISION=prec,
                          EMULATE_BF16=False, SOFTCAP=softcap, HAS_SINKS=sinks)
            if kernel == "decode":
                compile_(K._decode_split_kernel, dtype, BLOCK_G=max(16, group), one_split=splits == 1, **common)
            elif kernel == "prefill":
                compile_(K._prefill_kernel, dtype, BLOCK_M=max(64, group), BLOCK_Q=max(64, group) // group, **common)
            else:
                compile_(K._decode_merge_kernel, dtype, GROUP=group, BLOCK_G=group, HEAD_DIM=dim, HAS_SINKS=sinks)
        # a window of 1 is an int equal to 1, which triton compiles as a constant
        common = dict(GROUP=4, HEAD_DIM=64, BLOCK_N=64, PAGED=True, PAGE_SIZE=64, DOT_PRECISION="tf32", EMULATE_BF16=False,
                      SOFTCAP=True, HAS_SINKS=True, window=1)
        compile_(K._decode_split_kernel, "*fp16", BLOCK_G=16, one_split=True, **common)
        compile_(K._prefill_kernel, "*fp16", BLOCK_M=64, BLOCK_Q=16, **common)
        print("OK")
        """
    )
    probe = "import triton.backends.nvidia.compiler, triton.compiler; from triton.backends.compiler import GPUTarget"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode != 0:
        pytest.skip("this triton build has no NVIDIA backend to compile for")
    path = ROOT / "vmkv" / "kernels" / "triton_kernels.py"
    result = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
