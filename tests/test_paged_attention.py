"""Paged attention kernels against a dense reference (plain torch), against each other, under
variants (windows, soft-caps, sinks) with the blocks before a window released, and the kernel
selection rule. CUDA kernels run only on a GPU (skipped here with the reason)."""

from __future__ import annotations

import dataclasses
import logging
import sys

import pytest
import torch
from helpers import KVMirror, dense_attention, small_config, variant_step

import vmkv
from vmkv.kernels import registry
from vmkv.kernels.base import Variant
from vmkv.kernels.capturable import MaskedDecode
from vmkv.kernels.facts import MachineFacts
from vmkv.kernels.paged import BlockwiseOnlineSoftmax, ChunkedSDPA, GatherSDPA
from vmkv.paged import PagedKVCache

CPU_KERNELS = ["gather_sdpa", "blockwise_online_softmax", "sdpa_chunked"]


def paged_cache(kernel: str, **overrides) -> PagedKVCache:
    chunk = overrides.pop("chunk_tokens", 64)  # small chunks: several per sequence
    return PagedKVCache(small_config(block_size=16, **overrides), kernel=kernel, chunk_tokens=chunk)


@pytest.mark.parametrize(
    "kernel, dtype, q_heads",  # q_heads 8 over 2 KV heads: GQA; 2: MHA
    [(k, d, 8) for k in CPU_KERNELS for d in ("float32", "bfloat16")] + [("blockwise_online_softmax", "float32", 2)],
)
def test_prefill_then_decode_matches_dense_reference(kernel, dtype, q_heads):
    cache = paged_cache(kernel, dtype=dtype)
    try:
        mirror = KVMirror(cache, q_heads=q_heads)  # asserts every output against dense_attention
        for seq_id in "abcd":
            cache.add(seq_id)
        mirror.step({"a": 100, "b": 1, "c": 16, "d": 33})  # mixed lengths, block boundaries
        for _ in range(3):
            mirror.step({"a": 1, "b": 1, "c": 1, "d": 1})  # decode
        mirror.step({"b": 70, "a": 1, "c": 2})  # prefill over a cached prefix, mixed with decode
        mirror.step({"d": 130})  # a long chunk after a prefix: many key chunks, rows skipped
    finally:
        cache.close()


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_prefill_over_a_prefix_cache_hit_matches_dense_reference(kernel):
    cache = paged_cache(kernel)
    try:
        prompt = list(range(90))
        gen = torch.Generator().manual_seed(3)
        cache.add("a", prompt)
        plan = cache.begin_step({"a": prompt})
        k_all = [torch.randn(90, 2, 16, generator=gen) for _ in range(2)]
        for layer in range(2):
            cache.write(layer, k_all[layer], k_all[layer], plan)
        cache.add("b", prompt)  # 5 full blocks cached; 10 tokens to compute
        start = cache.seq_len("b")
        assert start == 80
        plan = cache.begin_step({"b": prompt[start:]})
        for layer in range(2):
            k = k_all[layer][start:]
            cache.write(layer, k, k, plan)
            q = torch.randn(10, 4, 16, generator=gen)
            want = dense_attention(q, k_all[layer], k_all[layer], start)
            torch.testing.assert_close(cache.attention(layer, q, plan), want, atol=1e-5, rtol=1e-5)
    finally:
        cache.close()


@pytest.mark.parametrize("chunk_tokens", [16, 48, 1024])
def test_blockwise_equals_gather_sdpa(chunk_tokens):
    """Random mixed batches: the fast kernel and the reference kernel agree on identical pools."""
    cache = paged_cache("gather_sdpa", max_batch_size=6, chunk_tokens=chunk_tokens)
    try:
        fast = BlockwiseOnlineSoftmax(16, 2, chunk_tokens)
        slow = GatherSDPA()
        mirror = KVMirror(cache, q_heads=8, seed=11)
        rng = torch.Generator().manual_seed(5)
        for seq_id in range(6):
            cache.add(seq_id)
        for _ in range(3):
            batch = {s: int(torch.randint(1, 40, (1,), generator=rng)) if s % 2 else 1 for s in range(6)}
            mirror.step(batch, check=False)
            plan = cache.begin_step({s: 1 for s in range(6)})
            for layer in range(2):
                k = mirror.randn(6, 2, 16)
                cache.write(layer, k, k, plan)
                q = mirror.randn(6, 8, 16)
                k_pool, v_pool = cache.block_pool(layer)
                torch.testing.assert_close(
                    fast(q, k_pool, v_pool, plan, 0.25), slow(q, k_pool, v_pool, plan, 0.25),
                    atol=1e-5, rtol=1e-5,
                )
    finally:
        cache.close()


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_stale_pool_contents_past_a_sequence_never_reach_the_output(kernel):
    """Blocks are reused without clearing: inf/NaN left in a block's unused rows must not leak."""
    cache = paged_cache(kernel)
    try:
        for layer in range(2):
            for pool in cache.block_pool(layer):
                pool.fill_(float("nan"))
        mirror = KVMirror(cache, q_heads=4)  # asserts outputs against the dense reference
        cache.add("a")
        cache.add("b")
        mirror.step({"a": 37, "b": 5})
        mirror.step({"a": 1, "b": 1})
    finally:
        cache.close()


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_fragmented_pools_match_dense_reference(kernel):
    """Sequences that decode together take turns at the free list, so their blocks interleave;
    freed sequences leave holes that later prompts fill: prompts in runs, tails scattered."""
    cache = paged_cache(kernel, max_batch_size=6, chunk_tokens=32)
    try:
        mirror = KVMirror(cache, q_heads=8, seed=4)
        for seq_id in "abcd":
            cache.add(seq_id)
        mirror.step({"a": 70, "b": 3, "c": 20, "d": 1})
        for _ in range(40):  # 40 decode steps: every sequence crosses 2-3 block boundaries, interleaved
            mirror.step({"a": 1, "b": 1, "c": 1, "d": 1}, check=False)
        mirror.free("b")
        cache.add("e")
        mirror.step({"e": 50, "a": 1, "c": 1, "d": 1})  # e's prompt fills b's scattered blocks first
        for _ in range(3):
            mirror.step({"a": 1, "c": 1, "d": 1, "e": 1})  # checked against the dense reference
        for seq_id in "acde":
            mirror.assert_stored(seq_id)
    finally:
        cache.close()


VARIANTS = [  # (window, softcap, sinks)
    (1, 0.0, False),  # a query sees only itself
    (3, 0.0, True),
    (4, 2.0, False),  # one block
    (9, 0.0, True),
    (1000, 3.0, True),  # longer than every sequence
    (0, 4.0, False),  # soft-cap alone
    (0, 0.0, True),  # sinks alone
]
VARIANT_STEPS = {  # name: (starts, q_lens)
    "decode": ([10, 4, 20, 7, 0, 33], [1, 1, 1, 1, 1, 1]),
    "mixed": ([10, 0, 20, 7, 13], [1, 6, 1, 9, 1]),  # decode rows, a prompt, chunks over a cached prefix
}


def block_kernels(plan) -> dict:
    """Every CPU blocks kernel, small chunks (several per sequence), and sdpa_masked on decode steps."""
    kernels = {"gather_sdpa": GatherSDPA(), "blockwise_online_softmax": BlockwiseOnlineSoftmax(4, 2, 8),
               "sdpa_chunked": ChunkedSDPA(4, 8, min_run_tokens=8)}  # sequence 0's blocks: a run, read in place
    if plan.is_decode:
        kernels["sdpa_masked"] = MaskedDecode("blocks")
    return kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap, sinks", VARIANTS)
def test_every_cpu_kernel_applies_a_variant_as_transformers_does(dtype, window, softcap, sinks):
    """Every CPU blocks kernel under a window, a soft-cap and sinks, GQA, decode and mixed
    steps, against the float64 reference; the blocks wholly before each sequence's window are
    released (table entry -1, the block NaN), so following one would poison the output."""
    sink_logits = torch.randn(4, generator=torch.Generator().manual_seed(7)) * 2 if sinks else None
    variant = Variant(window, softcap, sink_logits)
    for name, (starts, q_lens) in VARIANT_STEPS.items():
        step = variant_step(starts, q_lens, window=window, dtype=dtype, seed=window)
        q = torch.randn(step.plan.num_tokens, 4, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        for kernel_name, kernel in block_kernels(step.plan).items():
            out = kernel(q, step.k_pool, step.v_pool, step.plan, None, variant)
            assert torch.isfinite(out).all(), f"{kernel_name}: a released block reached the output"
            step.assert_matches(q, out, f"{kernel_name}, {name}", window=window, softcap=softcap, sinks=sink_logits)


@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1, 1, 1], [1, 6, 1, 9, 3, 1]])
def test_released_table_entries_are_never_followed(q_lens):
    """Entries of blocks wholly before a window, set to an id no pool has (indexing with it
    raises) instead of -1: every kernel gives the same outputs, so none reads them."""
    step = variant_step([10, 4, 20, 7, 13, 33], q_lens, window=5)
    variant = Variant(5)
    q = torch.randn(step.plan.num_tokens, 4, 16)
    table = step.plan.block_table
    released = table.clone()
    for i, start in enumerate(step.plan.starts):
        released[i, : max(0, start - 5 + 1) // 4] = 10**6  # the blocks wholly before the first key
    assert (released == 10**6).any()
    plan = dataclasses.replace(step.plan, block_table=released)
    for (name, kernel), again in zip(block_kernels(step.plan).items(), block_kernels(plan).values()):
        want = kernel(q, step.k_pool, step.v_pool, step.plan, None, variant)
        torch.testing.assert_close(again(q, step.k_pool, step.v_pool, plan, None, variant), want, atol=0, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_sdpa_chunked_pieces_start_at_the_window():
    """A decode row's pieces start at the block holding its window's first key, the first piece
    skipping its rows before that key; the entries before that block are never read."""
    kernel = ChunkedSDPA(block_size=4, chunk_tokens=8, min_run_tokens=8)
    row = torch.tensor([-1, -1, 12, 13, 14, 3, 7, 20, -1], dtype=torch.int32)
    pieces = kernel._pieces(row, 31, lo=10)  # keys 10 .. 30: blocks 2 .. 7, key 10 is row 2 of block 12
    got = [(p.first, None if p.blocks is None else p.blocks.tolist(), p.skip, p.tokens) for p in pieces]
    assert got == [(12, None, 2, 12), (-1, [3, 7], 0, 8), (-1, [20], 0, 3)]
    assert sum(p.tokens - p.skip for p in pieces) == 31 - 10


def test_sdpa_chunked_reads_runs_in_place_and_gathers_the_rest():
    kernel = ChunkedSDPA(block_size=4, chunk_tokens=8, min_run_tokens=16)
    row = torch.tensor([10, 11, 12, 13, 3, 7, 8, 20, 21, 22, 23, 24, -1, -1], dtype=torch.int32)
    pieces = kernel._pieces(row, 46)  # 12 blocks; the last (24) holds 2 keys
    got = [(p.first, None if p.blocks is None else p.blocks.tolist(), p.tokens) for p in pieces]
    assert got == [(10, None, 16), (-1, [3, 7], 8), (-1, [8], 4), (20, None, 18)]
    pieces = kernel._pieces(torch.tensor([10, 11, 12, 13, 5]), 18)  # the partial last block is gathered
    assert [(p.first, p.tokens) for p in pieces] == [(10, 16), (-1, 2)]
    assert sum(p.tokens for p in kernel._pieces(torch.tensor([4, 2, 9]), 9)) == 9  # nothing in place


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_a_non_contiguous_query_is_accepted(kernel):
    cache = paged_cache(kernel)
    try:
        mirror = KVMirror(cache, q_heads=4)
        cache.add("a"), cache.add("b")
        mirror.step({"a": 40, "b": 3})
        plan = cache.begin_step({"a": 1, "b": 5})
        for layer in range(2):
            k = mirror.randn(6, 2, 16)
            cache.write(layer, k, k, plan)
        wide = mirror.randn(6, 4, 32)
        heads_first = mirror.randn(4, 6, 16)
        for q in (wide[:, :, ::2], heads_first.transpose(0, 1)):  # [6, 4, 16]: gaps; dense but permuted
            assert not q.is_contiguous()
            torch.testing.assert_close(cache.attention(0, q, plan), cache.attention(0, q.contiguous(), plan))
    finally:
        cache.close()


def test_scale_argument_is_honoured():
    cache = paged_cache("blockwise_online_softmax")
    ref = paged_cache("gather_sdpa")
    try:
        outs = []
        for c in (cache, ref):
            gen = torch.Generator().manual_seed(0)
            c.add("a")
            plan = c.begin_step({"a": 20})
            k = torch.randn(20, 2, 16, generator=gen)
            c.write(0, k, k, plan)
            q = torch.randn(20, 2, 16, generator=gen)
            outs.append((c.attention(0, q, plan, scale=0.1), c.attention(0, q, plan)))
        torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(outs[0][0], outs[0][1])
    finally:
        cache.close()
        ref.close()


def test_cpu_default_kernel_is_named_in_stats():
    cache = vmkv.open_cache(small_config(), mode="paged")
    try:
        assert cache.stats()["kernel"] == "sdpa_chunked"
    finally:
        cache.close()


CUDA = torch.device("cuda", 0)
VARLEN = {"block_table", "seqused_k", "window_size", "enable_gqa"}


def facts(flash_attn: bool = False, flashinfer: bool = False, varlen: set[str] = VARLEN, triton: bool = False,
          capability: tuple[int, int] = (9, 0)) -> MachineFacts:
    """A made-up GPU: which optional packages import, what torch's varlen op takes, whether Triton runs."""
    missing = {name: f"{name} is not installed"
               for name, ok in (("flash_attn", flash_attn), ("flashinfer", flashinfer)) if not ok}
    return MachineFacts(capability, missing, True, frozenset(varlen), None if triton else "triton is not installed")


@pytest.mark.parametrize(
    "dtype, block, machine, want, why",
    [
        (torch.float16, 16, facts(), "gather_sdpa", "multiple of 256"),
        (torch.float16, 16, facts(triton=True), "triton", "multiple of 256"),  # measured on an H200: not provisional
        (torch.float32, 256, facts(flash_attn=True), "gather_sdpa", "float16 or bfloat16"),
        (torch.bfloat16, 256, facts(), "varlen_attn_block_table", "flash_attn is not installed"),
        (torch.bfloat16, 256, facts(varlen={"seqused_k"}), "gather_sdpa", "block_table"),
        (torch.bfloat16, 256, facts(flash_attn=True), "flash_attn_with_kvcache", "flashinfer is not installed"),
        (torch.float16, 16, facts(flashinfer=True), "flashinfer_decode+gather_sdpa", "multiple of 256"),
        (torch.float16, 512, facts(flash_attn=True, flashinfer=True, varlen=set()), "flashinfer_decode+flash_attn_with_kvcache",
         "not yet measured"),
        (torch.float32, 16, facts(flashinfer=True), "gather_sdpa", "float16 or bfloat16"),
    ],
)
def test_cuda_kernel_selection_rule(dtype, block, machine, want, why):
    choice = registry.choose(registry.KernelSpec("blocks", CUDA, dtype, 2, 128, block), machine)
    assert choice.name == want and why in choice.reason


def test_cuda_selection_needs_ampere_for_flash_kernels():
    choice = registry.choose(registry.KernelSpec("blocks", CUDA, torch.float16, 2, 128, 256),
                             facts(flash_attn=True, capability=(7, 5)))
    assert choice.name == "gather_sdpa" and "8.0" in choice.reason


def test_cpu_selection_rule():
    choice = registry.choose(registry.KernelSpec("blocks", torch.device("cpu"), torch.float32, 2, 16, 16),
                             facts(flash_attn=True, flashinfer=True))
    assert choice.name == "sdpa_chunked"


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with the CUDA driver")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_cuda_default_kernel_matches_dense_reference(block_size):
    config = small_config(device="cuda", dtype="bfloat16", head_dim=64, block_size=block_size,
                          memory_budget=64 * 2 * 2 * block_size * 2 * 64 * 2)
    cache = vmkv.open_cache(config, mode="paged")
    try:
        gen = torch.Generator().manual_seed(0)
        keys = {}
        for seq_id in ("a", "b"):
            cache.add(seq_id)
            keys[seq_id] = torch.empty(0, 2, 64, dtype=torch.bfloat16)
        for n_a in (300, 1, 1, 40):  # prefill, decode, decode, prefill over a prefix (b decodes)
            batch = {"a": n_a, "b": 1}
            plan = cache.begin_step(batch)
            k = torch.randn(plan.num_tokens, 2, 64, generator=gen).to(torch.bfloat16)
            q = torch.randn(plan.num_tokens, 8, 64, generator=gen).to(torch.bfloat16)
            cache.write(0, k.cuda(), k.cuda(), plan)
            out = cache.attention(0, q.cuda(), plan).cpu()
            offset = 0
            for seq_id, n in batch.items():
                start = keys[seq_id].shape[0]
                keys[seq_id] = torch.cat([keys[seq_id], k[offset : offset + n]])
                want = dense_attention(q[offset : offset + n], keys[seq_id], keys[seq_id], start)
                torch.testing.assert_close(out[offset : offset + n], want, atol=2e-2, rtol=2e-2)
                offset += n
    finally:
        cache.close()


def test_blockwise_runs_while_autograd_records():
    """A model run without no_grad() writes K/V that require grad: the kernel must still work."""
    cache = paged_cache("blockwise_online_softmax")
    try:
        gen = torch.Generator().manual_seed(0)
        cache.add("a")
        plan = cache.begin_step({"a": 40})
        k = torch.randn(40, 2, 16, generator=gen, requires_grad=True)
        cache.write(0, k, k, plan)
        q = torch.randn(40, 4, 16, generator=gen)
        out = cache.attention(0, q, plan)
        torch.testing.assert_close(out.detach(), dense_attention(q, k.detach(), k.detach(), 0), atol=1e-5, rtol=1e-5)
    finally:
        cache.close()


@pytest.fixture
def broken_optional_kernels(tmp_path, monkeypatch):
    """flash-attn and flashinfer installed, but their imports fail the way an ABI mismatch does."""
    from vmkv.kernels import facts as attention

    for name in ("flash_attn", "flashinfer"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name}_C.so: undefined symbol: _ZN3c10')\n")
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    attention.optional_import.cache_clear()
    yield
    attention.optional_import.cache_clear()


def test_broken_optional_kernels_fall_back_with_the_reason_logged(broken_optional_kernels, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # pretend: an sm90 GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(registry, "_LOGGED", set())
    spec = registry.KernelSpec("blocks", CUDA, torch.bfloat16, 2, 128, 256)
    with caplog.at_level(logging.INFO, logger="vmkv"):
        choice = registry.choose(spec)
        registry.make_kernel(spec)
    assert "flash" not in choice.name  # neither flash-attn nor flashinfer
    assert "flash_attn is installed but" in choice.reason and "flashinfer is installed but" in choice.reason
    warnings = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "is installed but" in warnings
    with pytest.raises(vmkv.BackendUnavailable, match="undefined symbol"):
        registry.make_kernel(spec, forced="flashinfer_decode")
