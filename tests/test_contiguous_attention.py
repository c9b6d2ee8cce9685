"""The contiguous (VMM) CPU kernels against a float64 dense reference: batched decode over runs of
slots (dummy rows, out-of-order packing, mixed prefill), stale data past a sequence's length,
variants (windows, soft-caps, sinks) with the memory before a window unmapped, the
batched/per-sequence rule, and kernel selection with a broken optional package."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from helpers import KVMirror, dense_attention, small_config, variant_step

import vmkv
from vmkv.kernels import contiguous as attention
from vmkv.kernels import facts, registry, triton_attention
from vmkv.kernels.base import PLAIN, Variant
from vmkv.kernels.capturable import MaskedDecode
from vmkv.kernels.contiguous import DEFAULT_BATCH_RULE, BatchRule, SdpaDecodeKernel, plan_decode_batch, slot_kernel
from vmkv.kernels.facts import MachineFacts

CPU_KERNELS = ["gemm_adaptive", "gemm_batched", "sdpa_adaptive", "sdpa_batched", "sdpa_per_sequence"]
FLOAT32_ONLY = {"gemm_adaptive", "gemm_batched"}  # selection never gives them other dtypes


class Driver(KVMirror):
    """Writes random K/V into a VMM cache, keeps a dense copy, and checks every CPU kernel's
    output on the cache's own views against :func:`dense_attention` (float64)."""

    def step(self, batch: dict, kernels=CPU_KERNELS) -> vmkv.StepPlan:
        cfg = self.cache.config
        plan = self.cache.begin_step(batch)
        total = sum(batch.values())
        for layer in range(cfg.num_layers):
            k, v = self.randn(total, cfg.num_kv_heads, cfg.head_dim), self.randn(total, cfg.num_kv_heads, cfg.head_dim)
            q = self.randn(total, self.q_heads, cfg.head_dim)
            self.cache.write(layer, k, v, plan)
            k_view, v_view = self.cache.kv_cache(layer)
            outs = {name: slot_kernel(name)(q, k_view, v_view, plan, None) for name in kernels
                    if cfg.dtype == torch.float32 or name not in FLOAT32_ONLY}
            outs["cache.attention"] = self.cache.attention(layer, q, plan)
            offset = 0
            for seq_id, n in batch.items():
                start = self.record(seq_id, layer, k[offset : offset + n], v[offset : offset + n])
                want = dense_attention(q[offset : offset + n], self.k[seq_id][layer], self.v[seq_id][layer], start)
                tol = 1e-5 if cfg.dtype == torch.float32 else 2e-2
                for name, out in outs.items():
                    torch.testing.assert_close(out[offset : offset + n], want, atol=tol, rtol=tol,
                                               msg=lambda m, name=name, s=seq_id: f"{name}, sequence {s!r}: {m}")
                offset += n
        return plan

    def fill(self, seq_id, n: int) -> None:
        """Prefill ``n`` tokens of ``seq_id`` (checked like any step)."""
        self.step({seq_id: n}, kernels=["sdpa_per_sequence"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("q_heads", [2, 8])  # MHA, and GQA with 4 query heads per KV head
@pytest.mark.parametrize("layout", ["per_layer", "all_layers", "head_major"])
def test_every_cpu_kernel_matches_dense_reference(dtype, q_heads, layout):
    page = {"per_layer": "4KiB", "all_layers": "8KiB", "head_major": "4KiB"}[layout]
    cache = vmkv.VirtualKVCache(small_config(dtype=dtype, layout=layout, page_size=page))
    try:
        driver = Driver(cache, q_heads)
        for seq_id in "abcde":
            cache.add(seq_id)
        driver.step({"a": 37, "b": 1, "c": 64, "d": 5, "e": 31})  # mixed prefill lengths, page boundaries
        for _ in range(3):
            driver.step({"a": 1, "b": 1, "c": 1, "d": 1, "e": 1})  # decode, lengths 2..67
        driver.step({"e": 1, "a": 1, "c": 1})  # packing order != slot order; slot of b, d are dummies
        driver.step({"d": 1, "b": 30, "c": 1})  # prefill on a cached prefix mixed with decode rows
        driver.step({"c": 1})  # one row
    finally:
        cache.close()


@pytest.mark.parametrize("layout", ["per_layer", "head_major"])  # head-major: gemm_batched's batched GEMMs
def test_stale_data_past_a_length_contributes_nothing(layout):
    """A freed sequence leaves its K/V in pages its slot keeps (deferred reclaim); a shorter new
    sequence in that slot is read by the batched call up to the step's longest length."""
    cache = vmkv.VirtualKVCache(small_config(deferred_reclaim=True, layout=layout))
    try:
        driver = Driver(cache, q_heads=4)
        cache.add("old")
        plan = cache.begin_step({"old": 60})  # two pages of 32 tokens
        for layer in range(2):
            huge = driver.randn(60, 2, 16, scale=1e4)  # finite, and loud if it leaked into any output
            cache.write(layer, huge, huge, plan)
        slot = cache.slot("old")
        cache.free("old")
        cache.add("long")
        cache.add("new")
        assert cache.slot("new") == slot or cache.slot("long") == slot
        fresh = "new" if cache.slot("new") == slot else "long"
        driver.fill(fresh, 3)  # positions 3..59 of the slot still hold the old sequence's K/V
        driver.fill("long" if fresh == "new" else "new", 70)  # the run's longest row: 71 keys read for both
        for _ in range(2):
            plan = driver.step({"new": 1, "long": 1})
        batch = slot_kernel("sdpa_batched").plan(plan)
        assert batch.batched and batch.mask is not None and batch.max_kv == 72
    finally:
        cache.close()


@pytest.mark.parametrize("layout", ["per_layer", "head_major"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_stale_data_is_never_read_into_an_answer(poison, layout):
    """An earlier sequence wrote inf/NaN K/V into a page a new, shorter sequence now owns: the
    batched call's mask cannot cancel those (``-inf + inf``, ``0 * inf``), so the row is redone
    on its exact slice."""
    cache = vmkv.VirtualKVCache(small_config(deferred_reclaim=True, layout=layout))
    try:
        driver = Driver(cache, q_heads=4)
        cache.add("old")
        plan = cache.begin_step({"old": 60})
        for layer in range(2):
            bad = torch.full((60, 2, 16), poison)
            cache.write(layer, bad, bad, plan)
        cache.free("old")
        cache.add("new"), cache.add("long")
        driver.fill("new", 3)
        driver.fill("long", 70)
        for _ in range(2):
            plan = driver.step({"new": 1, "long": 1})  # every kernel's output checked finite and exact
        assert slot_kernel("sdpa_batched").plan(plan).batched
    finally:
        cache.close()


@pytest.mark.parametrize("layout", ["per_layer", "head_major"])
def test_rows_past_every_mapped_page_read_zeros_and_are_masked(layout):
    cache = vmkv.VirtualKVCache(small_config(layout=layout))
    try:
        driver = Driver(cache, q_heads=4)
        for seq_id in range(4):
            cache.add(seq_id)
        driver.step({0: 200, 1: 1, 2: 33, 3: 2})  # slot 1 maps one page; the batched call reads 201 keys of it
        k_view, _ = cache.kv_cache(0)
        assert attention.heads_merge(k_view) == (layout == "head_major")  # gemm_batched: one batched GEMM
        driver.step({0: 1, 1: 1, 2: 1, 3: 1}, kernels=["sdpa_batched", "gemm_batched"])
    finally:
        cache.close()


VARIANTS = [  # (window, softcap, sinks)
    (1, 0.0, False),  # a query sees only itself
    (3, 0.0, False),
    (8, 2.0, False),
    (5, 0.0, True),
    (1000, 3.0, True),  # longer than every sequence
    (0, 4.0, False),  # soft-cap alone
    (0, 0.0, True),  # sinks alone
]
VARIANT_STEPS = {  # name: (starts, q_lens)
    "decode": ([10, 4, 20, 7, 0], [1, 1, 1, 1, 1]),
    "mixed": ([10, 0, 20, 7, 13], [1, 6, 1, 9, 1]),  # decode rows, a prompt, chunks over a cached prefix
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_major", [False, True])  # head-major slots: the GEMM kernels' batched path
@pytest.mark.parametrize("window, softcap, sinks", VARIANTS)
def test_every_cpu_kernel_applies_a_variant_as_transformers_does(dtype, head_major, window, softcap, sinks):
    """Every CPU slots kernel (and ``sdpa_masked`` on decode steps) under a window, a soft-cap and
    sinks, GQA, decode and mixed steps, against the float64 reference; positions before each
    window read zeros (an unmapped page) or NaN (which must not leak)."""
    sink_logits = torch.randn(4, generator=torch.Generator().manual_seed(7)) * 2 if sinks else None
    variant = Variant(window, softcap, sink_logits)
    for name, (starts, q_lens) in VARIANT_STEPS.items():
        step = variant_step(starts, q_lens, window=window, dtype=dtype, head_major=head_major,
                            before_window=0.0 if head_major else float("nan"), seed=window)
        q = torch.randn(step.plan.num_tokens, 4, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        kernels = {kernel: slot_kernel(kernel) for kernel in CPU_KERNELS if dtype == torch.float32 or kernel not in FLOAT32_ONLY}
        if step.plan.is_decode:
            kernels["sdpa_masked"] = MaskedDecode("slots")
        for kernel_name, kernel in kernels.items():
            out = kernel(q, step.k_slots, step.v_slots, step.plan, None, variant)
            assert torch.isfinite(out).all(), f"{kernel_name}: memory before a window reached the output"
            step.assert_matches(q, out, f"{kernel_name}, {name}", window=window, softcap=softcap, sinks=sink_logits)


def test_a_batched_decode_reads_from_the_earliest_window_start():
    """The run of slots is read from the earliest first key of the rows' windows, each row's mask
    holding its own window and length; without a window, from key 0 as before."""
    step = variant_step([10, 4, 20, 7], [1, 1, 1, 1], window=6, before_window=0.0)
    plan = step.plan
    batch = plan_decode_batch(plan, [0, 1, 2, 3], None, window=6)
    assert (batch.first_key, batch.max_kv) == (0, 21)  # the row of 5 keys reads from key 0
    rows = batch.mask[:, 0, 0] if batch.at is None else batch.mask[batch.at, 0, 0]  # [B, max_kv - first_key]
    for i, n in enumerate(plan.kv_lens):
        assert rows[i].nonzero().flatten().tolist() == list(range(max(0, n - 6), n))
    batch = plan_decode_batch(plan, [0, 2], None, window=6)
    assert batch.first_key == 5 and batch.mask.shape[-1] == 16  # keys 5 .. 20: nothing before both windows
    assert plan_decode_batch(plan, [0, 2], None).first_key == 0


def test_plans_are_made_once_per_step_and_window():
    """Layers alternating a sliding window and full attention (Gemma, GPT-OSS) plan once per
    step for each window, and reuse the plans layer after layer."""
    step = variant_step([10, 4, 20], [1, 1, 1], window=4, before_window=0.0)
    kernel = SdpaDecodeKernel("test", None)
    planned = []
    kernel.plan = lambda plan, q_heads, scale, variant, real=kernel.plan: planned.append(variant.window) or real(
        plan, q_heads, scale, variant)
    sinks = [torch.randn(4) for _ in range(3)]
    q = torch.randn(3, 4, 16)
    for layer in range(6):
        variant = Variant(4, 0.0, sinks[layer // 2]) if layer % 2 else PLAIN  # other sinks: the same plan
        kernel(q, step.k_slots, step.v_slots, step.plan, None, variant)
    assert planned == [0, 4]


def _plan(cache: vmkv.VirtualKVCache, lengths: dict) -> vmkv.StepPlan:
    for seq_id, n in lengths.items():
        cache.add(seq_id)
        plan = cache.begin_step({seq_id: n})
        zeros = torch.zeros(n, 2, 16)
        for layer in range(2):
            cache.write(layer, zeros, zeros, plan)
    return cache.begin_step({seq_id: 1 for seq_id in lengths})


def test_decode_batch_covers_the_run_of_slots_without_copying_when_it_can():
    cache = vmkv.VirtualKVCache(small_config())
    try:
        plan = _plan(cache, {"a": 10, "b": 10, "c": 10})
        batch = plan_decode_batch(plan, [0, 1, 2], None)
        assert (batch.first_slot, batch.span, batch.max_kv) == (min(plan.slots), 3, 11)
        if list(plan.slots) == sorted(plan.slots):
            assert batch.rows is None and batch.at is None  # q is viewed, not gathered
        assert batch.mask is None  # equal lengths: nothing to mask
        cache.free("b")
        plan = cache.begin_step({"c": 1, "a": 1})
        batch = plan_decode_batch(plan, [0, 1], None)
        assert batch.span == 3 and batch.at.tolist() == [s - batch.first_slot for s in plan.slots]
        assert batch.mask is None  # equal real lengths; the dummy row (b's slot) needs no mask
        cache.begin_step({"a": 2})
        plan = cache.begin_step({"c": 1, "a": 1})  # lengths 13 and 15
        batch = plan_decode_batch(plan, [0, 1], None)
        assert batch.mask.shape == (3, 1, 1, 15)
        keys = dict(zip(plan.seq_ids, batch.mask[batch.at, 0, 0].sum(1).tolist()))
        assert keys == {"c": 13, "a": 15}
    finally:
        cache.close()


def test_the_rule_batches_equal_lengths_and_not_one_long_among_short():
    rule = DEFAULT_BATCH_RULE
    assert rule.batched(32, 2048, [2048] * 32)  # equal lengths, every slot of the run used
    assert rule.batched(8, 128, [128] * 8)
    assert not rule.batched(32, 2048, [2048] + [32] * 31)  # one long row makes 31 short ones pay 2048 keys
    assert not rule.batched(64, 512, [512] * 32)  # half the run is dummy rows
    per_sequence, batched = BatchRule(call_us=10, key_us=1, run_key_us=1, real_key_us=0, fixed_us=0).predict(4, 400, 100)
    assert (per_sequence, batched) == (140, 400)


def test_adaptive_kernel_follows_its_rule_and_memoises_per_plan():
    cache = vmkv.VirtualKVCache(small_config())
    try:
        plan = _plan(cache, {"a": 300, "b": 2, "c": 2, "d": 2})
        kernel = SdpaDecodeKernel("test", DEFAULT_BATCH_RULE)
        batch = kernel.plan(plan)
        assert not batch.batched  # 3 of 4 rows would pay 301 keys for 3
        planned = []
        kernel.plan = lambda *args, real=kernel.plan: planned.append(1) or real(*args)
        k_view, v_view = cache.kv_cache(0)
        q = torch.randn(4, 4, cache.config.head_dim)
        for _ in range(3):  # three layers of one step
            kernel(q, k_view, v_view, plan, None)
        assert planned == [1]  # planned once per step, reused by every layer
        always = SdpaDecodeKernel("always", None)
        assert always.plan(plan).batched
    finally:
        cache.close()


def test_a_prefill_only_step_runs_per_sequence():
    cache = vmkv.VirtualKVCache(small_config())
    try:
        cache.add("a"), cache.add("b")
        driver = Driver(cache, q_heads=4)
        plan = driver.step({"a": 7, "b": 40})
        assert slot_kernel("sdpa_batched").plan(plan) is None
    finally:
        cache.close()


def test_non_contiguous_q_is_accepted():
    cache = vmkv.VirtualKVCache(small_config())
    try:
        plan = _plan(cache, {"a": 5, "b": 9})
        k_view, v_view = cache.kv_cache(0)
        wide = torch.randn(2, 4, 32)
        q = wide[:, :, ::2]  # [2, 4, 16], non-contiguous
        want = slot_kernel("sdpa_per_sequence")(q.contiguous(), k_view, v_view, plan, None)
        for name in CPU_KERNELS:
            torch.testing.assert_close(slot_kernel(name)(q, k_view, v_view, plan, None), want)
    finally:
        cache.close()


def test_cpu_selects_the_adaptive_kernel():
    cache = vmkv.VirtualKVCache(small_config())
    try:
        assert cache.kernel == "sdpa_adaptive" and cache.stats()["kernel"] == "sdpa_adaptive"
    finally:
        cache.close()
    cpu = registry.KernelSpec("slots", torch.device("cpu"), torch.float32, 2, 16)
    assert registry.unavailable("gemm_adaptive", cpu) is None
    reason = registry.unavailable("gemm_adaptive", registry.KernelSpec("slots", torch.device("cpu"), torch.bfloat16, 2, 16))
    assert "float32" in reason
    reason = registry.unavailable("sdpa_batched", registry.KernelSpec("slots", torch.device("cuda", 0), torch.float16, 2, 16),
                                  MachineFacts((9, 0)))
    assert "the CPU" in reason


@pytest.fixture
def broken_flash_attn(tmp_path, monkeypatch):
    """An installed flash-attn whose import fails the way an ABI mismatch does."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    facts.optional_import.cache_clear()
    yield
    facts.optional_import.cache_clear()


def test_a_broken_flash_attn_is_reported_not_selected(broken_flash_attn, monkeypatch, caplog):
    function, why = facts.optional_import("flash_attn", "flash_attn_with_kvcache")
    assert function is None and "undefined symbol" in why and "installed but" in why
    # pretend to be an sm90 GPU, so that selection gets as far as importing flash-attn
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(registry, "_LOGGED", set())
    # no GPU to build it
    monkeypatch.setattr(triton_attention, "triton_available", lambda device=None: (False, "no triton (test)"))
    with caplog.at_level(logging.INFO, logger="vmkv"):
        kernel = registry.make_kernel(registry.KernelSpec("slots", torch.device("cuda", 0), torch.bfloat16, 8, 128))
    assert kernel.name != "flash_attn_with_kvcache"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and "undefined symbol" in warnings[0].getMessage()
    with pytest.raises(vmkv.BackendUnavailable, match="undefined symbol"):
        facts.optional_kernel("flash_attn")


def test_flash_attention_requirements_are_stated_once_for_both_modes():
    """One rule (sm80+, fp16/bf16, head_dim % 8 and <= 256) behind both addressings' FlashAttention
    kernels and ``vmkv info``."""
    sm75 = MachineFacts((7, 5), varlen_seqused=True, triton_missing="not here")
    sm90 = MachineFacts((9, 0), varlen_seqused=True, triton_missing="not here")
    cuda = torch.device("cuda", 0)
    for machine, dtype, head_dim, need in [(sm75, torch.float16, 128, "compute capability 8.0"),
                                           (sm90, torch.float32, 128, "float16 or bfloat16"),
                                           (sm90, torch.bfloat16, 264, "head_dim a multiple of 8")]:
        slots = registry.KernelSpec("slots", cuda, dtype, 8, head_dim)
        blocks = registry.KernelSpec("blocks", cuda, dtype, 8, head_dim, 256)
        assert need in registry.unavailable("flash_attn_with_kvcache", slots, machine)
        assert need in registry.unavailable("flash_attn_with_kvcache", blocks, machine)
    choice = registry.choose(registry.KernelSpec("slots", cuda, torch.float16, 8, 128), sm90)
    assert (choice.name, choice.skipped) == ("flash_attn_with_kvcache", ("triton needs triton usable here (not here)",))
    no_flash = MachineFacts((9, 0), {"flash_attn": "flash_attn is not installed"}, varlen_seqused=False,
                            triton_missing="triton is not installed")
    choice = registry.choose(registry.KernelSpec("slots", cuda, torch.float16, 8, 128), no_flash)
    assert choice.name == "sdpa_per_sequence"
    assert len(choice.skipped) == 3  # each kernel preferred to it, once, in the decode order: triton first
    assert "triton is not installed" in choice.skipped[0] and "flash_attn is not installed" in choice.skipped[1]
    assert "seqused_k" in choice.skipped[2]


def test_vmkv_info_reports_the_selector_s_choice(monkeypatch):
    """``vmkv info``'s CUDA lines are the rule's answer for this torch and flash-attn (it once
    re-derived the choice from other tests: flash-attn installed rather than importable, torch's
    varlen_attn signature rather than the op the kernel calls)."""
    from vmkv import cli
    from vmkv.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "_import_triton", lambda: "triton is not installed")
    for seqused, chosen in ((True, "varlen_attn_seqused"), (False, "sdpa_per_sequence")):
        monkeypatch.setattr(facts, "flash_varlen_has_seqused_k", lambda seqused=seqused: seqused)
        monkeypatch.setattr(facts, "optional_import", lambda module, name: (None, f"{module} is not installed"))
        lines = cli._kernel_lines()
        if torch.cuda.is_available():
            continue  # a real GPU answers for itself
        at = lines.index(next(line for line in lines if line.startswith("  VMM mode (slots), cuda")))
        section = lines[at : at + 12]
        assert any(line.strip().startswith(f"chosen: {chosen}") for line in section)
        assert any(line.split() == ["varlen_attn_seqused", "available"] for line in section) == seqused
