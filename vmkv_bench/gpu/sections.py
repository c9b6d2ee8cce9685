"""The registry: every section of ``python benchmarks/gpu_check.py``, in the order they run.

To add one, write its function (``Context -> dict``) in a module of this package and add a
:class:`~vmkv_bench.gpu.registry.Section` line below (:mod:`vmkv_bench.gpu.registry` says what
each field means). Keep the quick checks before ``bench``: when a run is short of time, the
sections whose estimate no longer fits are the ones skipped.

The estimates are seconds on an H200, the section's process start (about 5 s: torch's import)
included. They are estimates, not measurements: every run records each section's real
``seconds`` in ``gpu_check.json``; correct an estimate from there. Together the sections that run
without vLLM must fit in :data:`~vmkv_bench.gpu.runner.DEFAULT_BUDGET_S` (8 minutes), with room
for the Triton kernels' section still to come: see docs/gpu.md, "Time budget". A section too long
for that (``alone=True``: ``hf_compiled``) runs only when named in ``--sections``.
"""

from __future__ import annotations

from . import bench, compiled, core, graphs, kernels, memory, slots, vllm_engine
from .registry import Context, Section


def _tests(ctx: Context) -> dict:
    return core.run_tests(ctx.options.tests, min(ctx.options.test_timeout, ctx.seconds_left() - 10))


def _smoke_runs_no_tests(device, smoke: bool) -> str | None:
    return "--smoke: the dry run is itself one of the tests" if smoke else None


SECTIONS: tuple[Section, ...] = (
    Section("environment", 15, lambda ctx: core.environment(ctx.device, ctx.shape), core.environment_headline,
            "versions, the GPU, VMM granularity, read-only zero page, the kernels a cache can use"),
    Section("tests", 60, _tests, core.tests_headline,
            "pytest tests/test_cuda.py: the CUDA backend contract and caches against a dense reference",
            skip_reason=_smoke_runs_no_tests),
    Section("zero_page", 20, lambda ctx: core.zero_page_section(ctx.device, ctx.shape, ctx.out, ctx.smoke),
            core.zero_page_headline, "empty pages read zeros, views after close too; a write into one faults"),
    Section("decode", 25, lambda ctx: core.decode_section(ctx.device, ctx.shape, ctx.options.kernels),
            core.decode_headline, "one decode step per contiguous kernel on VMM views vs a dense copy"),
    Section("map_unmap", 15, lambda ctx: core.map_unmap_section(ctx.device, ctx.shape), core.map_unmap_headline,
            "map/unmap latency per page, store creation, a 64 GiB reservation"),
    Section("paged_vs_vmm", 35, lambda ctx: kernels.paged_vs_vmm_section(ctx.device, ctx.shape), kernels.paged_vs_vmm_headline,
            "Triton decode over slots vs block tables (16, 256), every paged kernel vs VMM's, bandwidth, splits"),
    Section("shared_budget", 20, lambda ctx: memory.shared_budget_section(ctx.device, ctx.shape),
            memory.shared_budget_headline, "two caches in one ledger: where the device memory goes, stage by stage"),
    Section("vllm_slots", 15, lambda ctx: slots.vllm_slots_section(ctx.device, ctx.smoke), slots.vllm_slots_headline,
            "vLLM contiguous mode's slot space over a vLLM-shaped KV buffer, rollback at every driver call"),
    Section("engine_graphs", 40, lambda ctx: graphs.engine_graphs_section(ctx.device, ctx.smoke), graphs.engine_graphs_headline,
            "the engine's decode steps as CUDA graphs: logits against eager across page boundaries, speed-up at 32 sequences"),
    Section("bench", 200, lambda ctx: bench.bench_section(ctx.device, ctx.out, ctx.smoke, ctx.seconds_left() - 10),
            bench.bench_headline, "the main job: python -m vmkv.cli bench --device cuda (its GPU preset)", timeout_s=240),
    Section("hf_compiled", 240, lambda ctx: compiled.hf_compiled_section(ctx.device, ctx.smoke, ctx.out, ctx.seconds_left), compiled.hf_compiled_headline,
            "generate() compiled over VirtualCache(compile=True) vs StaticCache: dense, ragged, teacher-forced logits",
            timeout_s=420, alone=True),
    Section("vllm", 150, lambda ctx: vllm_engine.vllm_section(ctx.device, ctx.out), vllm_engine.vllm_headline,
            "the vLLM smoke test (vllm_smoke.gpu_smoke): vLLM + vmkv gives stock vLLM's tokens",
            skip_reason=vllm_engine.vllm_unavailable),
    Section("vllm_addressing", 420, lambda ctx: vllm_engine.vllm_addressing_section(ctx.device, ctx.out, ctx.smoke),
            vllm_engine.vllm_addressing_headline, "block tables vs virtual memory inside one vLLM (three engines)",
            skip_reason=vllm_engine.vllm_unavailable, timeout_s=1080),
)
"""Every section, in run order."""

BY_NAME: dict[str, Section] = {section.name: section for section in SECTIONS}
