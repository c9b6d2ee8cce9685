"""The ``vllm`` section's run: stock vLLM and vLLM + vmkv on the tiny model on a GPU, compared (CUDA VMM
under vLLM's buffer, CUDA graphs, async scheduling); it raises BackendUnavailable where it cannot run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from vmkv.errors import BackendUnavailable
from vmkv.sizing import CUDA_GRANULARITY
from vmkv.vllm import check_vllm, trim
from vmkv_bench.vllm_harness import drive, tiny

PAGE_SIZE = CUDA_GRANULARITY  # one granule a page
KV_BYTES = 512 * 2**20
VMKV_OPTIONS: dict[str, Any] = {"page_size": PAGE_SIZE}
"""The plugin's settings in the smoke: the default ``max_cached`` (budget / 8 = 64 MiB) keeps every
prefix-cached block of the workload mapped, so the second pass hits what stock vLLM hits."""


def gpu_smoke(out_dir: str | Path) -> dict[str, Any]:
    """Run the tiny model through stock vLLM and vLLM + vmkv on the GPU; write and return results."""
    import torch

    version = check_vllm()
    if not torch.cuda.is_available():
        raise BackendUnavailable("the vLLM GPU smoke test needs a CUDA GPU; torch sees none")
    from vllm import SamplingParams

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = tiny.save_tiny_model(out / "vllm-tiny-model")
    prefix = [(7 * i + 3) % 250 for i in range(300)]
    prompts = [prefix + [11, 12], prefix + [21], [(5 * i + 1) % 250 for i in range(180)], [(3 * i) % 250 for i in range(40)]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (160, 200, 120, 250)]
    start = time.perf_counter()
    results: dict[str, Any] = {}
    for name in ("stock", "vmkv"):
        vmkv = name == "vmkv"
        llm = drive.engine(model, vmkv=vmkv, kv_cache_bytes=KV_BYTES, max_model_len=1024, dtype="bfloat16",
                           enforce_eager=False, options=VMKV_OPTIONS if vmkv else None)
        config = llm.llm_engine.vllm_config
        run = drive.run(llm, prompts, params, vmkv=vmkv, sample_every=4 if vmkv else 0)
        again = drive.run(llm, prompts, params, vmkv=vmkv)  # the same prompts: prefix-cache hits
        entry: dict[str, Any] = {"tokens": run.tokens, "again": again.tokens, "cached": again.cached_tokens,
                                 "tok_per_s": run.output_tokens / run.wall_s, "v2": bool(config.use_v2_model_runner),
                                 "async": bool(config.scheduler_config.async_scheduling)}
        if vmkv:
            entry["peak_mapped"] = max((s.mapped_bytes for s in run.samples), default=0)
            entry["trimmed"] = trim(llm)
        results[name] = entry
        llm.llm_engine.engine_core.shutdown()
    stock, ours = results["stock"], results["vmkv"]
    summary = {**verdict(stock, ours, KV_BYTES), "throughput_ratio_vmkv_over_stock": ours["tok_per_s"] / stock["tok_per_s"],
               "kv_after_trim_bytes": sum(s["mapped_bytes"] for s in ours["trimmed"]), "model_runner_v2": ours["v2"],
               "async_scheduling": ours["async"], "vllm": version, "gpu": torch.cuda.get_device_name(),
               "seconds": time.perf_counter() - start}
    (out / "vllm_gpu_smoke.json").write_text(json.dumps({"summary": summary, "runs": results}, indent=1, default=str))
    return summary


def verdict(stock: dict[str, Any], ours: dict[str, Any], kv_bytes: int) -> dict[str, Any]:
    """Whether vLLM + vmkv did what stock vLLM did, from both engines' two passes."""
    identical = ours["tokens"] == stock["tokens"] and ours["again"] == stock["again"] == stock["tokens"]
    hits = ours["cached"] == stock["cached"] and sum(stock["cached"].values()) > 0  # no hits: nothing compared
    peak = ours["peak_mapped"]
    return {"tokens_identical": identical, "prefix_hits_identical": hits, "kv_peak_mapped_bytes": peak,
            "kv_buffer_bytes": kv_bytes, "passed": bool(identical and hits and peak < kv_bytes)}
