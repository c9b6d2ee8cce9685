"""The one registry: every benchmark of ``vmkv bench`` and every section of the GPU check
(``python benchmarks/gpu_check.py``), in the order they run. :mod:`vmkv_bench.runner` runs both."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Entry:
    """One thing to run: ``target`` is a benchmark module (``vmkv bench``; the contract: docs/benchmarks.md)
    or a GPU-check section's ``module:function``, which takes a :class:`~vmkv_bench.runner.Context`."""

    name: str
    target: str
    about: str = ""
    presets: dict[str, list[str]] = field(default_factory=dict)  # bench: the quick suite's options per device
    in_suite: bool = True  # bench: in the quick suite (else only with --full or by name)
    estimate_s: float = 0.0  # check: seconds on an H200, its process's start included
    headline: str | Callable[[dict], str] = ""  # check: module:function, the summary's line of a passed result
    skip: str | Callable[..., str | None] = ""  # check: module:function, (device, smoke) -> why it cannot run here or None
    timeout_s: float | None = None  # check: its process's limit (None: --section-timeout)
    alone: bool = False  # check: runs only when named in --sections

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    def load(self, what: str | Callable | None = None) -> Any:
        """The object ``what`` (default: ``target``) names: a module or ``module:function``."""
        if callable(what):
            return what
        module, _, attr = (what or self.target).partition(":")
        loaded = importlib.import_module(module)
        return getattr(loaded, attr) if attr else loaded


def _bench(name: str, presets: dict[str, list[str]] | None = None, in_suite: bool = True) -> Entry:
    return Entry(name, f"vmkv_bench.{name}", presets=presets or {}, in_suite=in_suite)


def _check(name: str, estimate_s: float, function: str, about: str, **fields: Any) -> Entry:
    group, _, attr = function.partition(".")  # "core.tests": vmkv_bench.gpu.core's tests_section and tests_headline
    target = f"vmkv_bench.gpu.{group}:{attr}"
    return Entry(name, f"{target}_section", about, estimate_s=estimate_s, headline=f"{target}_headline", **fields)


# The GPU presets keep the quick suite within about 3 minutes on an H200 (docs/benchmarks.md).
BENCHMARKS: dict[str, Entry] = {entry.name: entry for entry in (
    _bench("memory", {
        "cpu": ["--requests", "sharegpt=120", "alpaca=300", "--budget", "sharegpt=1GiB", "alpaca=256MiB", "--page-sizes", "2MiB"],
        # half the requests on CUDA: every 2 MiB page maps and unmaps through the driver
        "cuda": ["--requests", "sharegpt=60", "alpaca=150", "--budget", "sharegpt=1GiB", "alpaca=256MiB", "--page-sizes", "2MiB"],
    }),
    _bench("decode", {
        "cpu": ["--batches", "1", "8", "32", "--contexts", "512", "2048", "--repeat", "7", "--paged-kernels", "selected"],
        "cuda": ["--batches", "8", "32", "--contexts", "2048", "8192", "--repeat", "7", "--paged-kernels", "selected",
                 "--threads", "0"],
    }),
    _bench("mapping", {
        "cpu": ["--steps", "128", "--rounds", "11", "--pages", "128", "--decode-page-sizes", "4KiB"],
        "cuda": ["--steps", "128", "--rounds", "7", "--pages", "128", "--page-sizes", "2MiB", "--decode-page-sizes", "2MiB",
                 "--shape", "llama3-8b", "--layout", "all_layers"],
    }),
    _bench("sharing", {
        "cpu": ["--traces", "alpaca", "--requests", "3", "--widths", "2", "6"],
        # the same replays in a 4x smaller budget: CUDA creates its pages at open
        "cuda": ["--traces", "alpaca", "--requests", "3", "--widths", "2", "6", "--max-seq-len", "512"],
    }),
    _bench("generate", {
        "cpu": ["--models", "small", "--prompt-len", "64", "--new-tokens", "256", "--batch-sizes", "8",
                "--beam-new-tokens", "32", "--caches", "dynamic", "static", "vmm", "vmm+vmkv", "bound", "--repeats", "7"],
        # no StaticCache on CUDA: generate() compiles the model for it there (tens of seconds a shape)
        # and the sliding-window part on GPT-OSS's shape at issue 36's point (4,096 + 256 tokens, 2 MiB pages)
        "cuda": ["--models", "1b", "--prompt-len", "64", "--new-tokens", "64", "--batch-sizes", "8",
                 "--beam-new-tokens", "16", "--caches", "dynamic", "vmm", "vmm+vmkv", "bound", "--repeats", "3",
                 "--window-models", "gpt-oss", "--window-caches", "dynamic", "vmm"],
    }),
    _bench("serve", {
        "cpu": ["--concurrency", "1", "8", "--rates", "16", "inf", "--requests", "16", "--output-len", "16", "--repeats", "7",
                "--rate-repeats", "1"],
        "cuda": ["--concurrency", "1", "8", "--rates", "16", "inf", "--requests", "16", "--output-len", "16", "--repeats", "5",
                 "--rate-repeats", "1"],
    }),
    _bench("vllm", in_suite=False),  # vLLM stock vs the vmkv plugin: needs vLLM, minutes
    _bench("two_engines", in_suite=False),  # two engine processes, alternating bursts
)}

# The quick checks come before `bench`: a run short of time skips what no longer fits, last first.
# Without vLLM the default run must fit the 8-minute budget (docs/gpu.md, "Time budget").
SECTIONS: dict[str, Entry] = {entry.name: entry for entry in (
    _check("environment", 15, "core.environment",
           "versions, the GPU, VMM granularity, read-only zero page, the kernels a cache can use"),
    _check("tests", 60, "core.tests", "pytest tests/test_cuda.py: the CUDA backend contract and caches against a dense reference",
           skip="vmkv_bench.gpu.core:tests_skip"),
    _check("zero_page", 15, "core.zero_page", "empty pages read zeros, views after close too; a write into one faults"),
    _check("decode", 15, "core.decode", "one decode step per contiguous kernel on VMM views vs a dense copy"),
    _check("map_unmap", 15, "core.map_unmap", "map/unmap latency per page, store creation, a 64 GiB reservation"),
    _check("paged_vs_vmm", 35, "kernels.paged_vs_vmm",
           "Triton decode over slots vs block tables (16, 256), every paged kernel vs VMM's, bandwidth, splits"),
    _check("shared_budget", 20, "memory.shared_budget", "two caches in one ledger: where the device memory goes, stage by stage"),
    _check("vllm_slots", 15, "slots.vllm_slots",
           "vLLM contiguous mode's slot space over a vLLM-shaped KV buffer, rollback at every driver call"),
    _check("engine_graphs", 40, "graphs.engine_graphs",
           "the engine's decode steps as CUDA graphs: logits against eager across page boundaries, speed-up at 32 sequences"),
    Entry("bench", "vmkv_bench.runner:bench_section", "the main job: python -m vmkv.cli bench --device cuda (its GPU preset)",
          estimate_s=215, headline="vmkv_bench.runner:bench_headline", timeout_s=260),
    _check("hf_compiled", 240, "compiled.hf_compiled",
           "generate() compiled over VirtualCache(compile=True) vs StaticCache: dense, ragged, teacher-forced logits",
           timeout_s=420, alone=True),
    _check("vllm", 150, "vllm_engine.vllm", "the vLLM smoke test (vllm_smoke.gpu_smoke): vLLM + vmkv gives stock vLLM's tokens",
           skip="vmkv_bench.gpu.vllm_engine:vllm_unavailable"),
    _check("vllm_addressing", 420, "vllm_engine.vllm_addressing",
           "block tables vs virtual memory inside one vLLM (three engines)",
           skip="vmkv_bench.gpu.vllm_engine:vllm_unavailable", timeout_s=1080),
)}
