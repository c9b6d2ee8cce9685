"""The one kernel registry of both modes: its measured orders, the rule, forcing a kernel, the
variant features each kernel supports and the rule around those it lacks, and the Triton kernel
read through each cache's own addressing, plain and under variants (interpreter mode, in a child
process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import small_config, variant_step

import vmkv
from vmkv.errors import InvalidDevice, InvalidDtype, InvalidInput, InvalidShape, Unsupported
from vmkv.kernels import measured, registry
from vmkv.kernels.base import ADDRESSINGS, ALL_FEATURES, PLAIN, PhaseSplit, Variant, first_key
from vmkv.kernels.facts import MachineFacts
from vmkv.kernels.paged import FlashInferDecode

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.device("cuda", 0)


def test_every_measured_order_names_registered_kernels_with_its_provenance():
    data = json.loads(measured.PATH.read_text())
    for key, entry in data["order"].items():
        device_type, addressing = key.split("/")
        assert device_type in ("cpu", "cuda") and addressing in ADDRESSINGS
        assert entry["kernels"] and set(entry["kernels"]) <= set(registry.names(addressing)), key
        assert set(entry.get("decode", entry["kernels"])) == set(entry["kernels"]), key  # a reordering, no new names
        assert set(entry.get("provisional", ())) <= set(entry["kernels"]), key
        assert all(entry[field] for field in ("machine", "command", "date", "result")), key
    rule = data["batch_rule"]["cpu"]
    assert all(rule[field] for field in ("machine", "command", "date"))
    assert measured.batch_rule_constants("cpu")["call_us"] == rule["call_us"]


def test_every_addressing_on_every_device_has_a_kernel_that_runs_anywhere():
    """The last kernel of each order needs nothing but torch: a cache always gets one."""
    nothing = MachineFacts((9, 0), {"flash_attn": "absent", "flashinfer": "absent"}, False, frozenset(), "absent")
    for device in (torch.device("cpu"), CUDA):
        for addressing in ADDRESSINGS:
            spec = registry.KernelSpec(addressing, device, torch.float32, 2, 16, 16 if addressing == "blocks" else None)
            choice = registry.choose(spec, nothing)
            assert registry.unavailable(choice.name, spec, nothing) is None


def test_captured_steps_choose_by_the_same_needs_as_eager_ones():
    """The rule for compiled and captured decode steps (issue 35): Triton where it runs for this
    head dim, dtype and device, else the masked SDPA kernel, with the reason; never a kernel that
    would refuse the step mid-generation."""
    gpu = MachineFacts((9, 0), {"flash_attn": "absent", "flashinfer": "absent"}, True, frozenset(), None)
    for addressing in ADDRESSINGS:
        spec = registry.KernelSpec(addressing, CUDA, torch.bfloat16, 8, 128)
        assert registry.choose_capturable(spec, gpu).decode == "triton"
        for head_dim in (80, 96):  # Phi-3's 96: not a Triton head dim
            choice = registry.choose_capturable(registry.KernelSpec(addressing, CUDA, torch.bfloat16, 8, head_dim), gpu)
            assert choice.decode == "sdpa_masked" and f"got {head_dim}" in choice.reason
        no_triton = MachineFacts(triton_missing="triton is not importable")
        spec = registry.KernelSpec(addressing, torch.device("cpu"), torch.float32, 2, 64)
        assert registry.choose_capturable(spec, no_triton).decode == "sdpa_masked"
    assert [name for name, entry in registry.KERNELS.items() if entry.capturable] == ["triton", "sdpa_masked"]


def test_the_masked_decode_kernel_matches_the_cache_kernel_on_decode_steps():
    """``sdpa_masked`` is a registry kernel like any other: forced on an eager cache (paired with
    the rule's kernel for prefill), it gives the same outputs on decode steps, in both modes."""
    for mode in ("vmm", "paged"):
        outs = []
        for kernel in (None, "sdpa_masked"):
            cache = vmkv.open_cache(small_config(), mode=mode, kernel=kernel)
            gen = torch.Generator().manual_seed(1)
            cache.add("a"), cache.add("b")
            out = None
            for batch in ({"a": 9, "b": 3}, {"a": 1, "b": 1}, {"a": 1, "b": 1}):
                plan = cache.begin_step(batch)
                for layer in range(cache.config.num_layers):
                    kv = torch.randn(plan.num_tokens, cache.config.num_kv_heads, cache.config.head_dim, generator=gen)
                    cache.write(layer, kv, kv, plan)
                    q = torch.randn(plan.num_tokens, 2 * cache.config.num_kv_heads, cache.config.head_dim, generator=gen)
                    out = cache.attention(layer, q, plan)
            outs.append(out)
            assert kernel is None or cache.kernel.startswith("sdpa_masked+")
            cache.close()
        torch.testing.assert_close(outs[0], outs[1])


def test_a_decode_only_kernel_is_paired_with_the_next_one_for_other_steps():
    flashinfer = MachineFacts((9, 0), {"flash_attn": "absent"}, True, frozenset(), "absent")
    choice = registry.choose(registry.KernelSpec("blocks", CUDA, torch.float16, 2, 128, 16), flashinfer)
    assert (choice.decode, choice.other, choice.name) == ("flashinfer_decode", "gather_sdpa", "flashinfer_decode+gather_sdpa")
    assert "flashinfer_decode placed by reasoning, not yet measured" in choice.reason


def test_an_order_may_rank_decode_steps_apart():
    """cuda/slots ranks Triton's split-KV decode first for decode steps (measured on an H200) and
    keeps FlashAttention's varlen kernel for prefill; without Triton both phases take the varlen one."""
    h200 = MachineFacts((9, 0), {"flash_attn": "absent", "flashinfer": "absent"}, True, frozenset(), None)
    spec = registry.KernelSpec("slots", CUDA, torch.float16, 8, 128)
    choice = registry.choose(spec, h200)
    assert (choice.decode, choice.other, choice.name) == ("triton", "varlen_attn_seqused", "triton+varlen_attn_seqused")
    assert measured.order("cuda", "slots").decode[0] == "triton" and "triton" not in choice.provisional
    no_triton = MachineFacts((9, 0), {"flash_attn": "absent", "flashinfer": "absent"}, True, frozenset(), "absent (test)")
    assert registry.choose(spec, no_triton).name == "varlen_attn_seqused"
    assert measured.order("cpu", "slots").decode == measured.order("cpu", "slots").kernels  # no "decode": the same order


def test_forcing_a_kernel_by_name_in_either_mode():
    for mode, name in (("vmm", "sdpa_per_sequence"), ("paged", "gather_sdpa")):
        cls = vmkv.VirtualKVCache if mode == "vmm" else vmkv.PagedKVCache
        with cls(small_config(), kernel=name) as cache:
            assert cache.kernel == name == cache.stats()["kernel"]
        with pytest.raises(vmkv.InvalidConfig, match="kernel must be one of"):
            cls(small_config(), kernel="sdpa_chunked" if mode == "vmm" else "sdpa_adaptive")  # the other mode's
        with pytest.raises(vmkv.BackendUnavailable, match="cannot run here"):
            cls(small_config(), kernel="flash_attn_with_kvcache")  # needs CUDA


def test_phase_split_runs_each_step_with_its_kernel():
    from vmkv.kernels.contiguous import Stateless

    calls = []

    def tagged(tag):
        return Stateless(tag, lambda q, k, v, plan, scale: calls.append(tag) or torch.zeros_like(q))

    kernel = PhaseSplit(tagged("decode"), tagged("other"))
    assert kernel.name == "decode+other"
    with vmkv.VirtualKVCache(small_config()) as cache:
        cache.add("a")
        q = torch.zeros(3, 4, 16)
        plan = cache.begin_step({"a": 3})
        k, v = cache.kv_cache(0)
        kernel(q, k, v, plan, None)
        for layer in range(cache.config.num_layers):
            cache.write(layer, torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), plan)
        plan = cache.begin_step({"a": 1})
        kernel(q[:1], k, v, plan, None)
    assert calls == ["other", "decode"]


TRITON_THROUGH_CACHES = textwrap.dedent('''
    import torch, vmkv
    from helpers import KVMirror, dense_attention, small_config

    for mode, cls in (("vmm", vmkv.VirtualKVCache), ("paged", vmkv.PagedKVCache)):
        with cls(small_config(block_size=16), kernel="triton") as cache, cls(small_config(block_size=16)) as ref:
            assert cache.kernel == "triton"
            gen = torch.Generator().manual_seed(0)
            for seq in ("a", "b", "c"):
                cache.add(seq); ref.add(seq)
            cache.fork("a", "a2"); ref.fork("a", "a2")  # shared pages, copied on write
            for batch in ({"a": 19, "b": 5, "c": 33, "a2": 1}, {"a": 1, "b": 1, "c": 1, "a2": 1},
                          {"a": 1, "b": 16, "c": 1, "a2": 2}, {"a": 1, "b": 1, "c": 1, "a2": 1}):
                total = sum(batch.values())
                plan, ref_plan = cache.begin_step(batch), ref.begin_step(batch)
                for layer in range(cache.config.num_layers):
                    k, v = (torch.randn(total, 2, 16, generator=gen) for _ in range(2))
                    q = torch.randn(total, 4, 16, generator=gen)
                    cache.write(layer, k, v, plan); ref.write(layer, k, v, ref_plan)
                    got, want = cache.attention(layer, q, plan), ref.attention(layer, q, ref_plan)
                    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
            cache.check()
    print("ok")
''')


@pytest.mark.skipif(not registry.KERNELS.get("triton") or __import__("importlib").util.find_spec("triton") is None,
                    reason="triton is not installed (it is in the test extra on Linux x86_64)")
def test_the_triton_kernel_reads_both_addressings_through_the_caches():
    """``kernel="triton"`` in VMM mode (slots) and paged mode (block tables): the same outputs as
    each mode's own CPU kernel, over prefill, decode, chunked prefill and copy-on-write forks
    (Triton's interpreter: a child process, ``TRITON_INTERPRET=1`` before triton's first import)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    result = subprocess.run([sys.executable, "-c", TRITON_THROUGH_CACHES], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout[-3000:] + result.stderr[-3000:]


# ---- variants: what each kernel supports, and the rule around what it lacks ----------------------
CPU = torch.device("cpu")
VARLEN = frozenset({"block_table", "seqused_k", "window_size", "enable_gqa"})


def test_a_variant_is_validated_and_names_its_features():
    sinks = torch.zeros(4)
    variant = Variant(window=8, softcap=30, sinks=sinks)
    assert variant.features == ALL_FEATURES and PLAIN.features == frozenset() and Variant(window=3).features == {"window"}
    assert (variant.window, variant.softcap) == (8, 30.0) and isinstance(variant.softcap, float)
    assert variant == Variant(8, 30.0, sinks) and hash(variant) == hash(Variant(8, 30.0, sinks))
    assert variant != Variant(8, 30.0, torch.zeros(4)) and Variant() == PLAIN  # sinks compare by identity
    for bad, error in [({"window": -1}, InvalidInput), ({"window": True}, InvalidInput), ({"window": 2.5}, InvalidInput),
                       ({"softcap": -1.0}, InvalidInput), ({"softcap": float("inf")}, InvalidInput),
                       ({"sinks": [0.0]}, InvalidInput), ({"sinks": torch.zeros(4, dtype=torch.bfloat16)}, InvalidDtype),
                       ({"sinks": torch.zeros(2, 2)}, InvalidShape)]:
        with pytest.raises(error):
            Variant(**bad)
    with pytest.raises(InvalidShape, match="one logit per query head"):
        variant.check(8, CPU)
    with pytest.raises(InvalidDevice):
        variant.check(4, torch.device("meta"))
    assert [first_key(p, 4) for p in (0, 2, 3, 10)] == [0, 0, 0, 7] and first_key(10, 0) == 0
    assert first_key(torch.tensor([10, 2]), 4).tolist() == [7, 0] and first_key(torch.tensor([10]), 0).tolist() == [0]


def test_every_kernel_declares_the_features_its_code_implements():
    """The registry's features are the kernel objects' own (which refuse the others), and every
    kernel has a window: even the GPU-only ones, from their APIs (FlashAttention's window_size,
    FlashInfer's window_left)."""
    for name, entry in registry.KERNELS.items():
        assert entry.features <= ALL_FEATURES and "window" in entry.features, name
        for addressing in entry.addressings:
            spec = registry.KernelSpec(addressing, CPU, torch.float32, 2, 16, 16 if addressing == "blocks" else None)
            built = FlashInferDecode if name == "flashinfer_decode" else registry.build(name, spec)  # (needs flashinfer)
            assert built.features == entry.features, (name, addressing)
    assert not {name for name, e in registry.KERNELS.items() if "sinks" in e.features} & {
        "flash_attn_with_kvcache", "varlen_attn_seqused", "varlen_attn_block_table", "flashinfer_decode"}


def test_the_last_kernel_of_every_order_and_the_capturable_fallback_have_every_feature():
    """A cache whose layers use a window, soft-capping and sinks always gets a kernel, eager and
    captured, on any machine."""
    nothing = MachineFacts((9, 0), {"flash_attn": "absent", "flashinfer": "absent"}, False, frozenset(), "absent")
    for device in (CPU, CUDA):
        for addressing in ADDRESSINGS:
            spec = registry.KernelSpec(addressing, device, torch.float32, 2, 16, 16 if addressing == "blocks" else None,
                                       features=ALL_FEATURES)
            assert registry.KERNELS[measured.order(device.type, addressing).kernels[-1]].features == ALL_FEATURES
            assert registry.unavailable(registry.choose(spec, nothing).name, spec, nothing) is None
            assert registry.choose_capturable(spec, nothing).decode == "sdpa_masked"


def test_the_rule_passes_over_kernels_that_lack_a_feature():
    """On a GPU with every package: a window keeps FlashInfer and flash-attn (both have one),
    sinks send decode and prefill to Triton, each skipped kernel saying which feature it lacks;
    torch's varlen kernel over slots needs its op's window argument for a window."""
    gpu = MachineFacts((9, 0), {}, True, VARLEN, None, varlen_window=True)
    blocks = dict(addressing="blocks", device=CUDA, dtype=torch.bfloat16, kv_heads=8, head_dim=128, block_size=256)
    for features, want in [((), "flashinfer_decode+flash_attn_with_kvcache"),
                           ({"window", "softcap"}, "flashinfer_decode+flash_attn_with_kvcache"),
                           ({"window", "sinks"}, "triton")]:
        choice = registry.choose(registry.KernelSpec(**blocks, features=frozenset(features)), gpu)
        assert choice.name == want, features
    assert "flashinfer_decode needs attention sinks, which it lacks" in choice.reason
    assert "varlen_attn_block_table needs attention sinks, which it lacks" in choice.reason
    slots = dict(addressing="slots", device=CUDA, dtype=torch.float16, kv_heads=8, head_dim=128)
    no_flash_attn = MachineFacts((9, 0), {"flash_attn": "absent", "flashinfer": "absent"}, True, VARLEN, None, varlen_window=True)
    choice = registry.choose(registry.KernelSpec(**slots, features=frozenset({"softcap"})), no_flash_attn)
    assert (choice.decode, choice.other) == ("triton", "triton") and "varlen_attn_seqused needs soft-capping" in choice.reason
    old_torch = MachineFacts((9, 0), {"flash_attn": "absent", "flashinfer": "absent"}, True, VARLEN, "absent (test)")
    choice = registry.choose(registry.KernelSpec(**slots, features=frozenset({"window"})), old_torch)
    assert choice.name == "sdpa_per_sequence" and "window_size_left" in choice.reason
    assert registry.choose(registry.KernelSpec(**slots), old_torch).name == "varlen_attn_seqused"  # plain layers: as before
    with pytest.raises(vmkv.InvalidConfig, match="unknown attention features"):
        registry.KernelSpec(**slots, features=frozenset({"alibi"}))


def test_a_kernel_refuses_a_variant_it_lacks(monkeypatch):
    """Called with a feature it lacks, a kernel raises before running; forced by name for a cache
    whose layers use one, the registry says which."""
    from helpers import register_kernel

    from vmkv.kernels.contiguous import Stateless, slot_kernel

    plain = Stateless("plain", lambda q, k, v, plan, scale: torch.zeros_like(q))
    assert plain.features == frozenset()
    step = variant_step([5, 3], [1, 1], window=2, before_window=0.0)
    q = torch.randn(2, 4, 16)
    assert plain(q, step.k_slots, step.v_slots, step.plan, None).shape == q.shape  # plain: as before
    with pytest.raises(Unsupported, match="plain does not support a sliding window and attention sinks"):
        plain(q, step.k_slots, step.v_slots, step.plan, None, Variant(2, 0.0, torch.zeros(4)))
    split = PhaseSplit(slot_kernel("sdpa_batched"), slot_kernel("varlen_attn_seqused"))
    assert split.features == {"window"}
    with pytest.raises(InvalidShape):  # sinks that do not fit q: refused before running
        slot_kernel("sdpa_batched")(q, step.k_slots, step.v_slots, step.plan, None, Variant(sinks=torch.zeros(3)))
    register_kernel(monkeypatch, "test_plain", lambda q, k, v, plan, scale: torch.zeros_like(q))
    spec = registry.KernelSpec("slots", CPU, torch.float32, 2, 16, features=frozenset({"softcap"}))
    assert "test_plain needs soft-capping, which it lacks" == registry.unavailable("test_plain", spec)
    with pytest.raises(vmkv.BackendUnavailable, match="needs soft-capping, which it lacks"):
        registry.make_kernel(spec, forced="test_plain")


TRITON_VARIANTS_THROUGH_CACHES = textwrap.dedent('''
    import torch, vmkv
    from helpers import small_config
    from vmkv.kernels import registry
    from vmkv.kernels.base import Variant

    sinks = torch.randn(4)
    variants = [Variant(window=7, sinks=sinks), Variant(window=20, softcap=3.0)]  # one per layer
    for mode, cls in (("vmm", vmkv.VirtualKVCache), ("paged", vmkv.PagedKVCache)):
        with cls(small_config(block_size=16)) as cache:
            spec = registry.KernelSpec("blocks" if mode == "paged" else "slots", cache.config.device, cache.config.dtype,
                                       2, 16, 16 if mode == "paged" else None, features=frozenset({"window", "softcap", "sinks"}))
            triton, cpu = registry.build("triton", spec), registry.build(registry.choose(spec).other, spec)
            gen = torch.Generator().manual_seed(0)
            for seq in ("a", "b", "c"):
                cache.add(seq)
            cache.fork("a", "a2")
            for batch in ({"a": 19, "b": 5, "c": 33, "a2": 1}, {"a": 1, "b": 1, "c": 1, "a2": 1},
                          {"a": 1, "b": 16, "c": 1, "a2": 2}, {"a": 1, "b": 1, "c": 1, "a2": 1}):
                total = sum(batch.values())
                plan = cache.begin_step(batch)
                for layer, variant in enumerate(variants):
                    k, v = (torch.randn(total, 2, 16, generator=gen) for _ in range(2))
                    q = torch.randn(total, 4, 16, generator=gen)
                    cache.write(layer, k, v, plan)
                    storage = cache.block_pool(layer) if mode == "paged" else cache.kv_cache(layer)
                    got, want = (kernel(q, *storage, plan, None, variant) for kernel in (triton, cpu))
                    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    print("ok")
''')


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None,
                    reason="triton is not installed (it is in the test extra on Linux x86_64)")
def test_the_triton_kernel_applies_variants_over_both_caches_storage():
    """The registry's Triton kernel over a VMM cache's slots and a paged cache's pools, one
    variant per layer (a window with sinks, a window with a soft-cap): the same outputs as each
    mode's CPU kernel, over prefill, decode, chunked prefill and forks (Triton's interpreter: a
    child process)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    result = subprocess.run([sys.executable, "-c", TRITON_VARIANTS_THROUGH_CACHES], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout[-3000:] + result.stderr[-3000:]


def test_a_cpu_cache_does_not_import_triton():
    """Issue 37: asking whether Triton's kernels could run on the CPU needs no import of triton
    (about 80 MiB and most of a second) where its interpreter was not asked for."""
    code = ("import sys, vmkv\n"
            "cache = vmkv.open_cache(vmkv.KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, dtype='float32', "
            "max_batch_size=2, max_seq_len=64, memory_budget='1MiB'))\n"
            "print(cache.kernel, 'triton' in sys.modules)\n")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False", done.stdout
