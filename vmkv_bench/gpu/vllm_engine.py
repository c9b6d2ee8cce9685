"""The sections that need vLLM on the GPU: ``vllm`` (the plugin's smoke test) and ``vllm_addressing`` (block tables vs
virtual memory inside one vLLM: stock, paged backing, contiguous mode); both skip, with the reason, off CUDA or without vLLM."""

from __future__ import annotations

import importlib.util
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import vmkv

from ..common import rotated
from ..runner import Context, SectionSkipped
from .vllm_smoke import gpu_smoke

MiB = 1 << 20
ENGINES = ("stock", "paged", "contiguous")
SCHEMA = {
    "round": "interleaving round (engines take turns within a round)",
    "engine": "stock (CPU_ATTN over block tables), paged (vmkv backs the paged buffer) or contiguous (slots, SDPA)",
    "output_tokens": "tokens generated",
    "wall_s": "seconds from the first request to the last token",
    "output_tok_per_s": "output tokens per second",
    "kv_mean_mib": "KV memory held, mean over the samples (MiB; stock: its whole buffer)",
    "kv_peak_mib": "KV memory held, peak (MiB)",
    "attention_share": "contiguous: time in the attention kernel / wall time (others: not measured, -1)",
    "mode_share": "contiguous: time in the mode's step metadata (slot lookup, plan) and K/V writes / wall time (others: -1)",
    "tokens_identical": "greedy tokens equal to stock's of the same round, every request",
    "first_divergence": "earliest output position where a request's tokens differ from stock's (-1: none)",
}
GPU_SETTINGS = {"layers": 16, "head_dim": 128, "requests": 16, "prompt": (1024, 1536), "output": 64, "rounds": 3,
                "page_size": "2MiB", "block_size": 128}
"""The GPU check's run: 16 layers x 4 KV heads of 128 in bfloat16 make a 128-token block one 2 MiB
all-layers page; vLLM's GPU defaults otherwise."""
GPU_ENGINE = {"dtype": "bfloat16", "enforce_eager": False}


def vllm_unavailable(device: torch.device, smoke: bool, what: str = "vLLM on the GPU") -> str | None:
    """Why a section that starts vLLM (``what``) cannot run here: checked before its process starts, and in it."""
    if device.type != "cuda":
        return f"{what} needs a CUDA device"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    return None


def vllm_section(ctx: Context) -> dict[str, Any]:
    """:func:`~vmkv_bench.gpu.vllm_smoke.gpu_smoke` ``(DIR/vllm)``: stock vLLM and vLLM + vmkv on the tiny model."""
    device, out_dir = ctx.device, ctx.out
    why = vllm_unavailable(device, ctx.smoke, "the vLLM smoke test")
    if why:
        raise SectionSkipped(why)
    (out_dir / "vllm").mkdir(parents=True, exist_ok=True)
    try:
        result = gpu_smoke(out_dir / "vllm")
    except vmkv.BackendUnavailable as exc:  # e.g. a vLLM other than the one the plugin supports
        raise SectionSkipped(f"the vLLM smoke test: {exc}") from None
    result = dict(result) if isinstance(result, dict) else {"returned": result}
    result["failures"] = vllm_failures(result)
    return result


def vllm_failures(result: dict[str, Any]) -> list[str]:
    """Why ``gpu_smoke``'s result fails (``[]`` when it reports ``"passed": True``)."""
    if result.get("passed") is True:
        return []
    if "passed" not in result:
        return [f"gpu_smoke reported no 'passed' (keys: {', '.join(sorted(result))})"]
    why = []
    if result.get("tokens_identical") is not True:
        why.append("vLLM + vmkv generated other tokens than stock vLLM")
    peak, buffer = result.get("kv_peak_mapped_bytes"), result.get("kv_buffer_bytes")
    if isinstance(peak, int) and isinstance(buffer, int) and peak >= buffer:
        why.append(f"vmkv mapped {peak / MiB:.0f} MiB at peak, not less than the {buffer / MiB:.0f} MiB KV buffer")
    return why or ["gpu_smoke reported passed=False"]


def vllm_addressing_section(ctx: Context) -> dict[str, Any]:
    """Stock vLLM, vmkv's paged backing and contiguous mode interleaved on :data:`GPU_SETTINGS`' work."""
    device, out_dir, smoke = ctx.device, ctx.out, ctx.smoke
    why = vllm_unavailable(device, smoke, "the addressing comparison inside vLLM on CUDA")
    if why:
        raise SectionSkipped(why)
    from vmkv.vllm import check_vllm

    try:
        check_vllm()
    except vmkv.BackendUnavailable as exc:  # missing, or another release than the plugin's (UnsupportedVllm)
        raise SectionSkipped(str(exc)) from None
    settings = dict(GPU_SETTINGS)
    if smoke:
        settings.update(requests=2, prompt=(256, 384), output=8, rounds=1)
    (out_dir / "vllm_addressing").mkdir(parents=True, exist_ok=True)
    result = run_addressing(settings, out_dir / "vllm_addressing", 0, GPU_ENGINE)
    result["failures"] = addressing_failures(result["rows"])
    return result


def run_addressing(s: dict[str, Any], model_root: Path, seed: int, engine_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The three engines on the work of ``s``, interleaved: ``{"rows", "summary", "config", "schema"}``."""
    from vllm import SamplingParams

    from vmkv.vllm import stats

    from ..vllm_harness import drive, tiny

    model = tiny.save_tiny_model(model_root / f"vmkv-vllm-tiny-{s['layers']}x{s['head_dim']}", s["layers"], s["head_dim"])
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(*s["prompt"]))] for _ in range(s["requests"])]
    params = [SamplingParams(max_tokens=s["output"], temperature=0.0, ignore_eos=True) for _ in prompts]
    max_len = -(-(s["prompt"][1] + s["output"]) // s["block_size"]) * s["block_size"]
    kv_bytes = tiny.token_bytes(s["layers"], s["head_dim"]) * max_len * (s["requests"] + 1)
    common_kwargs = {"kv_cache_bytes": kv_bytes, "max_model_len": max_len, "block_size": s["block_size"],
                     "max_num_seqs": s["requests"], **(engine_kwargs or {})}
    options = {"paged": {"page_size": s["page_size"], "max_cached": 0},
               "contiguous": {"page_size": s["page_size"], "max_cached": 0, "kv_mode": "contiguous"}}
    engines = {name: drive.engine(model, vmkv=name != "stock", options=options.get(name), **common_kwargs) for name in ENGINES}
    rows, tokens = [], {}
    for round_ in range(s["rounds"]):
        for name in rotated(ENGINES, round_):
            llm, vmkv = engines[name], name != "stock"
            llm.reset_prefix_cache()  # every run prefills in full: no engine reuses an earlier round's prompts
            time.sleep(drive.SETTLE_S)
            before = stats(llm)[0] if name == "contiguous" else {}
            result = drive.run(llm, prompts, params, vmkv=vmkv, sample_every=4)
            after = stats(llm)[0] if name == "contiguous" else {}
            kernel, mode = ((after[key] - before[key] if after else -1.0) for key in ("kernel_seconds", "mode_seconds"))
            kv = [x.resident_bytes if vmkv else kv_bytes for x in result.samples] or [kv_bytes]
            tokens[(round_, name)] = result.tokens
            rows.append({"round": round_, "engine": name, "output_tokens": result.output_tokens, "wall_s": result.wall_s,
                         "output_tok_per_s": result.output_tokens / result.wall_s,
                         "kv_mean_mib": statistics.fmean(kv) / 2**20, "kv_peak_mib": max(kv) / 2**20,
                         "attention_share": kernel / result.wall_s if kernel >= 0 else -1.0,
                         "mode_share": mode / result.wall_s if mode >= 0 else -1.0, "tokens_identical": False})
    for row in rows:
        ours, stock = tokens[(row["round"], row["engine"])], tokens[(row["round"], "stock")]
        row["tokens_identical"], row["first_divergence"] = ours == stock, first_divergence(ours, stock)
    kernels = sorted(stats(engines["contiguous"])[0].get("kernel_calls", {}))
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    return {"rows": rows, "summary": {**addressing_summary(rows, kv_bytes), "contiguous_kernels": kernels}, "schema": SCHEMA,
            "config": {**s, "kv_bytes": kv_bytes, "max_model_len": max_len, **(engine_kwargs or {})}}


def first_divergence(ours: dict[str, list[int]], stock: dict[str, list[int]]) -> int:
    """The earliest output position where any request's tokens differ from stock's (-1: none)."""
    positions = [next((i for i, (a, b) in enumerate(zip(ours[r], stock[r])) if a != b),
                      -1 if len(ours[r]) == len(stock[r]) else min(len(ours[r]), len(stock[r]))) for r in stock]
    differing = [p for p in positions if p >= 0]
    return min(differing) if differing else -1


def _ratios(rows: list[dict[str, Any]], top: str, bottom: str) -> list[float]:
    by = {(r["round"], r["engine"]): r["output_tok_per_s"] for r in rows}
    return [by[(i, top)] / by[(i, bottom)] for i in sorted({r["round"] for r in rows})]


def addressing_summary(rows: list[dict[str, Any]], kv_bytes: int) -> dict[str, Any]:
    """Ratios per round, memory shares, identity and the verdict line."""
    over_stock, over_paged = _ratios(rows, "contiguous", "stock"), _ratios(rows, "contiguous", "paged")
    paged_over_stock = _ratios(rows, "paged", "stock")
    mean = {e: statistics.fmean(r["kv_mean_mib"] for r in rows if r["engine"] == e) * 2**20 / kv_bytes for e in ENGINES}
    share = [r["attention_share"] for r in rows if r["engine"] == "contiguous"]
    mode_share = [r["mode_share"] for r in rows if r["engine"] == "contiguous"]
    identical = {e: all(r["tokens_identical"] for r in rows if r["engine"] == e) for e in ENGINES}
    ratio = statistics.median(over_stock)
    verdict = (f"contiguous runs vLLM at {ratio:.2f}x stock output tokens/s (median of {len(over_stock)} interleaved rounds, "
               f"range {min(over_stock):.2f}-{max(over_stock):.2f}; target >= 1.0) and {statistics.median(over_paged):.2f}x "
               f"the paged backing; attention kernel {statistics.median(share):.0%} of the run, the mode's step metadata "
               f"and K/V writes {statistics.median(mode_share):.0%}; KV memory held "
               f"{mean['contiguous']:.1%} (contiguous) / {mean['paged']:.1%} (paged) of stock's buffer; tokens "
               f"{'identical' if identical['contiguous'] else 'DIFFER'} (contiguous), "
               f"{'identical' if identical['paged'] else 'DIFFER'} (paged)")
    return {"contiguous_over_stock": over_stock, "contiguous_over_paged": over_paged, "paged_over_stock": paged_over_stock,
            "kv_mean_share": mean, "attention_share": share, "mode_share": mode_share, "tokens_identical": identical,
            "verdict": verdict}


def addressing_failures(rows: list[dict[str, Any]]) -> list[str]:
    """Why the addressing run fails: the paged backing must give stock's tokens exactly, contiguous mode
    every first token (later bfloat16 differences are summation order, reported)."""
    why = []
    for row in rows:
        if row["engine"] == "paged" and not row["tokens_identical"]:
            why.append(f"round {row['round']}: the paged backing's tokens differ from stock's "
                       f"at position {row['first_divergence']}")
        if row["engine"] == "contiguous" and row["first_divergence"] == 0:
            why.append(f"round {row['round']}: contiguous mode's first token differs from stock's")
    return why


def vllm_headline(result: dict[str, Any]) -> str:
    """Whether vLLM + vmkv gave stock vLLM's tokens, and its peak KV mapping."""
    peak, buffer = result.get("kv_peak_mapped_bytes"), result.get("kv_buffer_bytes")
    mapped = (f", KV mapped at peak {peak / MiB:.0f} of {buffer / MiB:.0f} MiB"
              if isinstance(peak, int) and isinstance(buffer, int) else "")
    return f"tokens identical to stock: {result.get('tokens_identical')}{mapped}"


def vllm_addressing_headline(result: dict[str, Any]) -> str:
    """Contiguous mode's output tokens/s over stock vLLM's, median and range of the rounds."""
    over = result["summary"]["contiguous_over_stock"]
    return f"contiguous {statistics.median(over):.2f}x stock tokens/s (rounds {min(over):.2f}-{max(over):.2f})"
