"""Stock vLLM vs vLLM + vmkv on a bursty ShareGPT-like trace, both engines in-process and up for the
whole run, taking turns: output tokens/s and the KV memory each holds (docs/vllm.md)."""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from . import common

NAME = "vllm"
DESCRIPTION = "vLLM with and without vmkv: one bursty ShareGPT-like trace (tokens/s ratio, KV memory over time)"

SCHEMA = {
    "round": "interleaving round (engines take turns within a round)",
    "engine": "stock (vLLM's KV buffer) or vmkv (pages mapped on demand)",
    "requests": "requests in the trace",
    "output_tokens": "tokens generated",
    "wall_s": "seconds from the first arrival to the last token",
    "output_tok_per_s": "output tokens per second",
    "kv_mean_mib": "KV memory held, mean over the samples (MiB; stock: its whole buffer)",
    "kv_peak_mib": "KV memory held, peak (MiB)",
    "rss_peak_mib": "peak resident set of the worker processes (MiB)",
    "tokens_identical": "greedy tokens equal to the other engine's, every request",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=None, help="requests in the trace (default 16; smoke 4)")
    parser.add_argument("--bursts", type=int, default=None, help="groups of requests arriving together (default 4; smoke 2)")
    parser.add_argument("--gap", type=float, default=None, help="seconds between bursts (default 1, shorter than a burst "
                        "takes to serve: the engine stays busy and tokens/s measures the engine; smoke 0.5)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per engine (default 3; smoke 1)")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest request in tokens (default 1024; smoke 384)")
    parser.add_argument("--kv-bytes", default="256MiB", help="vLLM's KV buffer for both engines (default 256MiB)")
    parser.add_argument("--page-size", default="512KiB", help="vmkv page size (default 512KiB: 4 blocks a page)")
    parser.add_argument("--max-cached", default="0", help="KV the prefix cache alone may keep mapped (default 0)")
    parser.add_argument("--sample-every", type=int, default=4, help="engine steps between memory samples (default 4)")
    parser.add_argument("--model-dir", type=Path, default=None, help="where to write the tiny model (default: a temp dir)")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    smoke = args.smoke
    return {
        "requests": args.requests or (4 if smoke else 16),
        "bursts": args.bursts or (2 if smoke else 4),
        "gap": args.gap if args.gap is not None else (0.5 if smoke else 1.0),
        "rounds": args.rounds or (1 if smoke else 3),
        "max_model_len": args.max_model_len or (384 if smoke else 1024),
    }


def bursty_arrivals(count: int, bursts: int, gap: float) -> list[float]:
    """Arrival times: ``count`` requests in ``bursts`` equal groups, ``gap`` seconds apart."""
    per = -(-count // max(1, bursts))
    return [gap * (i // per) for i in range(count)]


def trace_prompts(trace: list[common.Request], seed: int) -> list[list[int]]:
    """Seeded token ids of each request's prompt length (bytes of the tiny model's vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(req.prompt)] for req in trace]


def _compact(samples: list[dict[str, Any]], points: int = 100) -> list[dict[str, Any]]:
    step = max(1, len(samples) // points)
    return [{**s, "t": round(s["t"], 3)} for s in samples[::step]]


def _kv_memory(samples: list[dict[str, Any]], vmkv: bool, buffer_bytes: int) -> list[float]:
    return [s["resident_bytes"] if vmkv else buffer_bytes for s in samples]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Rows per (round, engine) of the trace."""
    from vmkv.sizes import parse_size
    from vmkv.vllm import check_vllm
    from vmkv_bench.vllm_harness import tiny

    check_vllm()
    if args.device != "cpu":
        common.check_device(args.device)
    kv_bytes = parse_size(args.kv_bytes, name="--kv-bytes")
    model = tiny.save_tiny_model(args.model_dir or Path(tempfile.gettempdir()) / "vmkv-vllm-tiny")
    rows, series, config = _run_trace(args, model, kv_bytes)
    config = {"kv_bytes": kv_bytes, "token_bytes": tiny.token_bytes(), **config}
    return common.make_result(NAME, SCHEMA, rows, _summary(rows, kv_bytes), series=series, config=config)


def _run_trace(args: argparse.Namespace, model: Path,
               kv_bytes: int) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """The trace through both in-process engines, interleaved: ``(rows, series, config)``."""
    from vllm import SamplingParams

    from vmkv_bench.vllm_harness import drive

    s = _settings(args)
    trace = common.make_trace("sharegpt", s["requests"], args.seed, s["max_model_len"])
    prompts = trace_prompts(trace, args.seed)
    params = [SamplingParams(max_tokens=r.output, temperature=0.0, ignore_eos=True) for r in trace]
    arrivals = bursty_arrivals(len(trace), s["bursts"], s["gap"])
    options = {"page_size": args.page_size, "max_cached": args.max_cached}
    engines = {
        "stock": drive.engine(model, vmkv=False, kv_cache_bytes=kv_bytes, max_model_len=s["max_model_len"]),
        "vmkv": drive.engine(model, vmkv=True, kv_cache_bytes=kv_bytes, max_model_len=s["max_model_len"], options=options),
    }
    rows, series, tokens = [], {}, {}
    for round_ in range(s["rounds"]):
        for name in common.rotated(["stock", "vmkv"], round_):
            vmkv = name == "vmkv"
            time.sleep(drive.SETTLE_S)
            result = drive.run(engines[name], prompts, params, vmkv=vmkv, arrivals=arrivals, sample_every=args.sample_every)
            samples = result.as_dict()["samples"] or [drive.memory_sample(engines[name], vmkv, result.wall_s, 0, 0).__dict__]
            kv = _kv_memory(samples, vmkv, kv_bytes)
            tokens[(round_, name)] = result.tokens
            rows.append({"round": round_, "engine": name, "requests": len(trace), "output_tokens": result.output_tokens,
                         "wall_s": result.wall_s, "output_tok_per_s": result.output_tokens / result.wall_s,
                         "kv_mean_mib": statistics.fmean(kv) / 2**20, "kv_peak_mib": max(kv) / 2**20,
                         "rss_peak_mib": max(x["rss_bytes"] for x in samples) / 2**20, "tokens_identical": False})
            series[name] = _compact(samples)
    for row in rows:  # each engine's tokens against the other's
        row["tokens_identical"] = tokens[(row["round"], "stock")] == tokens[(row["round"], "vmkv")]
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    return rows, series, {**s, **options, "trace": common.trace_stats(trace)}


def _summary(rows: list[dict[str, Any]], kv_bytes: int) -> dict[str, Any]:
    """Headline ratios and the verdict line."""
    rounds = sorted({r["round"] for r in rows})
    by = {(r["round"], r["engine"]): r for r in rows}
    ratios = [by[(i, "vmkv")]["output_tok_per_s"] / by[(i, "stock")]["output_tok_per_s"] for i in rounds]
    ratio = statistics.median(ratios)
    vmkv_mean = statistics.fmean(by[(i, "vmkv")]["kv_mean_mib"] for i in rounds) * 2**20
    vmkv_peak = max(by[(i, "vmkv")]["kv_peak_mib"] for i in rounds) * 2**20
    rss_saved = statistics.fmean(by[(i, "stock")]["rss_peak_mib"] - by[(i, "vmkv")]["rss_peak_mib"] for i in rounds) * 2**20
    identical = all(r["tokens_identical"] for r in rows)
    verdict = (f"vmkv runs vLLM at {ratio:.2f}x stock output tokens/s (median of {len(ratios)} interleaved rounds, "
               f"range {min(ratios):.2f}-{max(ratios):.2f}; target >= 0.97) "
               f"while holding {vmkv_mean / kv_bytes:.1%} of stock's KV memory on average "
               f"({vmkv_peak / kv_bytes:.1%} at peak); tokens {'identical' if identical else 'DIFFER'}")
    return {"throughput_ratio_vmkv_over_stock": ratio, "throughput_ratios_per_round": ratios,
            "kv_mean_ratio_vmkv_over_stock": vmkv_mean / kv_bytes, "kv_peak_ratio_vmkv_over_stock": vmkv_peak / kv_bytes,
            "rss_saved_bytes": rss_saved, "tokens_identical": identical, "verdict": verdict}


def plot(result: dict[str, Any], out_dir: Path) -> list[str]:
    """``vllm_kv_memory.png``: KV memory over the last round, both engines, and what the live tokens need."""
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    token_bytes, kv_bytes = result["config"]["token_bytes"], result["config"]["kv_bytes"]
    for name, samples in result["series"].items():
        t = [s["t"] for s in samples]
        kv = _kv_memory(samples, name == "vmkv", kv_bytes)
        ax.plot(t, [v / 2**20 for v in kv], label=f"{name}: KV memory held", linewidth=1.4)
        if name == "vmkv":
            ax.plot(t, [s["live_tokens"] * token_bytes / 2**20 for s in samples], label="live tokens x bytes per token",
                    linestyle="--", linewidth=1.0)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set(xlabel="seconds into the trace", ylabel="MiB",
           title=f"tiny Llama on vLLM, {result['config']['requests']} bursty ShareGPT-like requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return [common.save_figure(fig, out_dir, "vllm_kv_memory.png")]


def table(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for engine in ("stock", "vmkv"):
        mine = [r for r in result["rows"] if r["engine"] == engine]
        out.append({"workload": f"bursty trace, {mine[0]['requests']} requests", "engine": engine, "rounds": len(mine),
                    "output tok/s": statistics.median(r["output_tok_per_s"] for r in mine),
                    "same text": all(r["tokens_identical"] for r in mine)})
    return out


def verdicts(result: dict[str, Any]) -> list[common.Verdict]:
    """What the plugin costs in output tokens/s, and how much KV memory it holds."""
    summary = result["summary"]
    ratio = common.Spread.of(summary["throughput_ratios_per_round"])
    cost = common.ratio_verdict(
        "vllm.throughput", "vLLM output tokens/s, vmkv over stock (same trace, interleaved)", ratio, "vmkv", "stock", target=0.97,
        note="tokens identical" if summary["tokens_identical"] else "TOKENS DIFFER")
    mean, peak = summary["kv_mean_ratio_vmkv_over_stock"], summary["kv_peak_ratio_vmkv_over_stock"]
    side, winner = kv_memory_side(mean)
    memory = common.Verdict(
        key="vllm.kv_memory", question="KV memory held by vmkv, share of stock vLLM's buffer (mean over the trace)",
        result=common.number_text(mean, "%"), spread=f"peak {common.number_text(peak, '%')}",
        winner=winner, side=side, value=mean, high=peak,
        note=f"worker RSS {abs(summary['rss_saved_bytes']) / 2**20:.0f} MiB "
             f"{'below' if summary['rss_saved_bytes'] >= 0 else 'above'} stock")
    return [cost, memory]


def kv_memory_side(mean: float, tie_margin: float = common.TIE_MARGIN) -> tuple[str, str]:
    """Who holds less KV memory, on ``mean`` (vmkv's mean / stock's buffer; the peak does not decide):
    ``(side, winner text)``."""
    if mean < 1.0 / (1.0 + tie_margin):
        return "vmkv", f"vmkv, {common.number_text(mean, '%')} of stock's buffer on average"
    if mean > 1.0 + tie_margin:
        return "stock", f"stock, vmkv holds {common.number_text(mean)} its buffer on average"
    return "tie", f"tie (mean within {100 * tie_margin:.0f} % of stock's buffer)"
