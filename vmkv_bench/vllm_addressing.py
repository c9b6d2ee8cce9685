"""Block tables vs virtual memory inside one vLLM (``vmkv bench vllm --parts addressing``, the GPU
check's ``vllm_addressing``): stock, vmkv's paged backing and contiguous mode, interleaved (docs/vllm.md)."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from . import common

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--addr-layers", type=int, default=4, help="decoder layers of the model (default 4)")
    parser.add_argument("--addr-head-dim", type=int, default=64, help="head width (default 64; 8 query, 4 KV heads)")
    parser.add_argument("--addr-requests", type=int, default=None, help="requests per round (default 8; smoke 2)")
    parser.add_argument("--addr-prompt", default=None, help="prompt tokens, MIN-MAX (default 1024-1536; smoke 256-384)")
    parser.add_argument("--addr-output", type=int, default=None, help="output tokens per request (default 64; smoke 8)")
    parser.add_argument("--addr-rounds", type=int, default=None, help="interleaved rounds (default 3; smoke 1)")
    parser.add_argument("--addr-page-size", default="512KiB", help="vmkv page size of both vmkv engines (default 512KiB)")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    smoke = args.smoke
    low, high = (int(x) for x in (args.addr_prompt or ("256-384" if smoke else "1024-1536")).split("-"))
    return {"layers": args.addr_layers, "head_dim": args.addr_head_dim, "requests": args.addr_requests or (2 if smoke else 8),
            "prompt": (low, high), "output": args.addr_output or (8 if smoke else 64),
            "rounds": args.addr_rounds or (1 if smoke else 3), "page_size": args.addr_page_size, "block_size": 128}


GPU_SETTINGS = {"layers": 16, "head_dim": 128, "requests": 16, "prompt": (1024, 1536), "output": 64, "rounds": 3,
                "page_size": "2MiB", "block_size": 128}
"""The GPU check's run: 16 layers x 4 KV heads of 128 in bfloat16 make a 128-token block one 2 MiB
all-layers page; vLLM's GPU defaults otherwise."""
GPU_ENGINE = {"dtype": "bfloat16", "enforce_eager": False}


def measure(args: argparse.Namespace, model_root: Path) -> dict[str, Any]:
    """Run the three engines on CPU settings; returns ``{"rows", "summary", "config", "schema"}``."""
    return run(settings(args), model_root, args.seed)


def run(s: dict[str, Any], model_root: Path, seed: int, engine_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The three engines on the work of ``s``, interleaved: ``{"rows", "summary", "config", "schema"}``."""
    from vllm import SamplingParams

    from vmkv.vllm import stats
    from vmkv_bench.vllm_harness import drive, tiny

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
        order = ENGINES[round_ % 3:] + ENGINES[: round_ % 3]
        for name in order:
            llm, vmkv = engines[name], name != "stock"
            llm.reset_prefix_cache()  # every run prefills in full: no engine reuses an earlier round's prompts
            time.sleep(1.5)  # vLLM's workers busy-poll for 1 s after a step: let the idle engines go quiet
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
        row["tokens_identical"] = tokens[(row["round"], row["engine"])] == tokens[(row["round"], "stock")]
        row["first_divergence"] = first_divergence(tokens[(row["round"], row["engine"])], tokens[(row["round"], "stock")])
    kernels = sorted(stats(engines["contiguous"])[0].get("kernel_calls", {}))
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    return {"rows": rows, "summary": {**summary(rows, kv_bytes), "contiguous_kernels": kernels}, "schema": SCHEMA,
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


def summary(rows: list[dict[str, Any]], kv_bytes: int) -> dict[str, Any]:
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


def verdicts(result: dict[str, Any]) -> list[common.Verdict]:
    """Which addressing wins inside vLLM: contiguous over stock (target >= 1.0) and over paged."""
    s = result["summary"]
    identical = s["tokens_identical"]["contiguous"]
    over_stock = common.Spread.of(s["contiguous_over_stock"])
    over_paged = common.Spread.of(s["contiguous_over_paged"])
    return [
        common.ratio_verdict("vllm.addressing.stock", "vLLM output tokens/s, contiguous (slots, SDPA) over stock (block "
                             "tables, CPU_ATTN)", over_stock, "contiguous", "stock", target=1.0,
                             note="tokens identical" if identical else "TOKENS DIFFER"),
        common.ratio_verdict("vllm.addressing.paged", "vLLM output tokens/s, contiguous over vmkv's paged backing",
                             over_paged, "contiguous", "paged"),
    ]
