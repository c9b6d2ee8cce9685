"""Serving throughput, latency and capacity, VMM vs paged, with the engine in-process on the embedded
model: closed loop, open loop and a fixed budget (docs/serving.md)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import time
from collections import deque
from itertools import accumulate
from pathlib import Path
from typing import Any, Callable

from vmkv.config import MODES
from vmkv.engine import Engine, EngineConfig, RequestOutput, SamplingParams
from vmkv.server.cli import GRAPHS

from . import common

NAME = "serve"
DESCRIPTION = ("serving engine (in-process): tokens/s, TTFT/TPOT p50/p99 vs concurrency and request rate, "
               "capacity per budget; VMM vs paged")

SCHEMA = {
    "experiment": "concurrency (closed loop), rate (open loop, Poisson) or capacity (all at once, fixed budget)",
    "mode": "KV mode: vmm or paged",
    "tokens_per_page": "tokens one VMM page / paged block holds",
    "concurrency": "requests in flight (closed loop); 0 elsewhere",
    "rate": "arrival rate in requests/s (open loop; inf = all at once); 0 elsewhere",
    "requests": "requests completed",
    "output_tokens": "tokens generated in all",
    "wall_s": "seconds from the first arrival to the last completion",
    "throughput_tok_s": "output tokens per second (wall clock)",
    "tok_per_cpu_s": "output tokens per CPU-second of this process (all its threads)",
    "ttft_p50_ms": "time to first token, median (ms)",
    "ttft_p99_ms": "time to first token, 99th percentile (ms)",
    "tpot_p50_ms": "time per output token after the first, median over requests (ms)",
    "tpot_p99_ms": "time per output token after the first, 99th percentile (ms)",
    "latency_p50_ms": "arrival to last token, median (ms)",
    "latency_p99_ms": "arrival to last token, 99th percentile (ms)",
    "peak_running": "most sequences in the cache at once",
    "mean_running": "sequences in the cache, mean over steps (what the budget sustains)",
    "preemptions": "sequences preempted for lack of pages during the run",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="closed-loop levels (default 1 4 16; smoke 1 4)")
    parser.add_argument("--rates", type=float, nargs="+", default=None, help="open-loop req/s, inf allowed "
                        "(default 4 16 inf; smoke 32 inf)")
    parser.add_argument("--requests", type=int, default=None, help="requests per run (default 32; smoke 8)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 64; smoke 24)")
    parser.add_argument("--output-len", type=int, default=None, help="output tokens (default 32; smoke 8)")
    parser.add_argument("--memory-budget", default=None, help="KV budget of the throughput/latency runs "
                        "(default 64MiB on CPU, 1GiB on CUDA where a VMM page is 2 MiB per tensor)")
    parser.add_argument("--capacity-budget", default=None, help="KV budget of the capacity experiment "
                        "(default 8MiB on CPU, 64MiB on CUDA)")
    parser.add_argument("--capacity-requests", type=int, default=None, help="distinct prompts sent at once in the "
                        "capacity experiment (default 64; smoke 16)")
    parser.add_argument("--capacity-output-len", type=int, default=None, help="output tokens of each capacity request "
                        "(default 32; smoke 8; not --output-len: the quick preset measures what the full run does)")
    parser.add_argument("--vmm-page-size", default=None, help="VMM page bytes per K/V tensor (default: the engine's, "
                        "64 KiB on CPU, 2 MiB on CUDA)")
    parser.add_argument("--block-size", type=int, default=16, help="paged tokens per block")
    parser.add_argument("--repeats", type=int, default=None, help="runs per mode and setting, modes alternating; the "
                        "row kept is the median-throughput run (default 3; smoke 1)")
    parser.add_argument("--rate-repeats", type=int, default=None, help="runs per mode and rate of the open-loop "
                        "experiment (default: --repeats; no verdict rests on them)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads during the run (tiny model: 1 is fastest)")
    parser.add_argument("--cuda-graphs", default="auto", choices=list(GRAPHS),
                        help="capture the engines' decode steps as CUDA graphs (auto: on a CUDA device; off: compare)")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    smoke = args.smoke
    return {
        "concurrency": args.concurrency or ([1, 4] if smoke else [1, 4, 16]),
        "rates": args.rates or ([32.0, math.inf] if smoke else [4.0, 16.0, math.inf]),
        "requests": args.requests or (8 if smoke else 32),
        "prompt_len": args.prompt_len or (24 if smoke else 64),
        "output_len": args.output_len or (8 if smoke else 32),
        "repeats": args.repeats or (1 if smoke else 3),
        "rate_repeats": args.rate_repeats or args.repeats or (1 if smoke else 3),
        "memory_budget": args.memory_budget or ("64MiB" if args.device == "cpu" else "1GiB"),
        "capacity_budget": args.capacity_budget or ("8MiB" if args.device == "cpu" else "64MiB"),
        "capacity_requests": args.capacity_requests or (16 if smoke else 64),
        "capacity_output_len": args.capacity_output_len or (8 if smoke else 32),
    }


def _engine_config(mode: str, args: argparse.Namespace, budget: str, max_num_seqs: int, page_size: str | None) -> EngineConfig:
    return EngineConfig(kv_mode=mode, memory_budget=budget, page_size=page_size, block_size=args.block_size,
                        max_num_seqs=max_num_seqs, max_seq_len=1024, device=args.device, seed=args.seed,
                        cuda_graphs=GRAPHS[args.cuda_graphs])


def _throughput_configs(args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, EngineConfig]:
    """Per mode, the engine of the closed- and open-loop runs."""
    slots = max(max(settings["concurrency"]), 16)
    return {mode: _engine_config(mode, args, settings["memory_budget"], slots, args.vmm_page_size) for mode in args.modes}


def _capacity_configs(args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, EngineConfig]:
    """Label -> engine of the capacity experiment: every mode at its page size, and on the CPU VMM with 4 KiB pages
    too (CUDA maps 2 MiB at the least)."""
    variants: list[tuple[str, str | None]] = [(mode, args.vmm_page_size) for mode in args.modes]
    if "vmm" in args.modes and args.device == "cpu":
        variants.append(("vmm", "4KiB"))
    budget = settings["capacity_budget"]
    return {f"capacity {mode}{f' {page} pages' if page else ''} ({budget})": _engine_config(mode, args, budget, 256, page)
            for mode, page in variants}


def refusals(args: argparse.Namespace, granularity: int) -> dict[str, str]:
    settings = _settings(args)
    configs = {f"{mode} ({settings['memory_budget']})": config for mode, config in _throughput_configs(args, settings).items()}
    configs.update(_capacity_configs(args, settings))
    return common.cache_refusals([(label, c.kv_mode, c.cache_config()) for label, c in configs.items()], granularity)


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """Seeded random byte prompts after BOS: no two share a prefix page."""
    rng = random.Random(seed)
    return [[256] + [rng.randrange(256) for _ in range(length - 1)] for _ in range(count)]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


class _Recorder:
    """Collects finished requests' times, relative to their intended arrival."""

    def __init__(self) -> None:
        self.arrival: dict[str, float] = {}
        self.done: list[tuple[float, float, float, int]] = []  # (ttft, tpot, latency, tokens)
        self.peak_running = self.running_sum = self.steps = 0

    def observe(self, engine: Engine, outputs: list[RequestOutput]) -> int:
        running = len(engine.scheduler.running)
        self.peak_running = max(self.peak_running, running)
        self.running_sum += running
        self.steps += 1
        finished = [out for out in outputs if out.finished]
        for out in finished:
            arrival = self.arrival.pop(out.request_id)
            tokens = len(out.outputs[0].token_ids)
            ttft = out.metrics.first_token_time - arrival
            tpot = (out.metrics.finish_time - out.metrics.first_token_time) / max(1, tokens - 1)
            self.done.append((ttft, tpot, out.metrics.finish_time - arrival, tokens))
        return len(finished)

    def row(self, wall: float, cpu: float) -> dict[str, Any]:
        ttft, tpot, latency, tokens = (list(col) for col in zip(*self.done))
        times = {"ttft": ttft, "tpot": tpot, "latency": latency}
        return {"requests": len(self.done), "output_tokens": sum(tokens), "wall_s": wall,
                "throughput_tok_s": sum(tokens) / wall, "tok_per_cpu_s": sum(tokens) / cpu,
                **{f"{name}_p{q}_ms": _percentile(values, q) * 1000.0 for name, values in times.items() for q in (50, 99)},
                "peak_running": self.peak_running, "mean_running": self.running_sum / max(1, self.steps)}


def run_closed_loop(engine: Engine, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> dict[str, Any]:
    """Keep ``concurrency`` requests in flight until every prompt is done."""
    recorder, pending, inflight = _Recorder(), deque(prompts), 0
    start, cpu = time.monotonic(), time.process_time()
    while pending or engine.has_unfinished():
        while pending and inflight < concurrency:
            rid = engine.add_request(pending.popleft(), params)
            recorder.arrival[rid] = time.monotonic()
            inflight += 1
        inflight -= recorder.observe(engine, engine.step())
    return recorder.row(time.monotonic() - start, time.process_time() - cpu)


def run_open_loop(engine: Engine, prompts: list[list[int]], params: SamplingParams, rate: float, seed: int) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` requests/s (all at once when infinite); TTFT counts from the intended arrival."""
    rng = random.Random(seed)
    gaps = [0.0 if math.isinf(rate) else rng.expovariate(rate) for _ in prompts[1:]]
    recorder, pending = _Recorder(), deque(zip(accumulate(gaps, initial=0.0), prompts))
    start, cpu = time.monotonic(), time.process_time()
    while pending or engine.has_unfinished():
        now = time.monotonic() - start
        while pending and pending[0][0] <= now:
            offset, prompt = pending.popleft()
            recorder.arrival[engine.add_request(prompt, params)] = start + offset
        if engine.has_unfinished():
            recorder.observe(engine, engine.step())
        elif pending:
            time.sleep(max(0.0, pending[0][0] - (time.monotonic() - start)))
    return recorder.row(time.monotonic() - start, time.process_time() - cpu)


def _row(experiment: str, mode: str, engine: Engine, measured: dict[str, Any], concurrency: int = 0,
         rate: float = 0.0) -> dict[str, Any]:
    stats = engine.stats()
    return {"experiment": experiment, "mode": mode, "tokens_per_page": stats["cache"]["tokens_per_page"],
            "concurrency": concurrency, "rate": rate, **measured, "preemptions": stats["engine"]["preemptions"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    common.check_device(args.device)
    settings = _settings(args)
    with common.torch_threads(args.threads):
        rows, samples = _measure(args, settings)
    config = {**settings, "rates": [str(r) for r in settings["rates"]], "vmm_page_size": args.vmm_page_size,
              "block_size": args.block_size, "threads": args.threads, "driver": "in-process Engine (no HTTP)",
              "cuda_graphs": args.cuda_graphs}
    return common.make_result(NAME, SCHEMA, rows, _summary(rows), config=config, samples=samples)


def _measure(args: argparse.Namespace, settings: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows of every experiment, and per closed-loop setting each mode's tokens per CPU-second per repeat."""
    prompts = _prompts(settings["requests"], settings["prompt_len"], args.seed)
    params = SamplingParams(max_tokens=settings["output_len"], temperature=0.0, ignore_eos=True)
    engines = {mode: Engine.from_config(config) for mode, config in _throughput_configs(args, settings).items()}
    rows: list[dict[str, Any]] = []
    samples: dict[str, Any] = {}
    try:
        for engine in engines.values():  # warm-up: first calls allocate and load kernels
            engine.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        for concurrency in settings["concurrency"]:
            found, runs = _alternate(engines, settings["repeats"], "concurrency", lambda e, c=concurrency: (
                run_closed_loop(e, prompts, params, c)), concurrency=concurrency)
            rows += found
            samples[f"concurrency/{concurrency}"] = {mode: [r["tok_per_cpu_s"] for r in mine] for mode, mine in runs.items()}
        for rate in settings["rates"]:
            rows += _alternate(engines, settings["rate_repeats"], "rate", lambda e, r=rate: (
                run_open_loop(e, prompts, params, r, args.seed)), rate=rate)[0]
    finally:
        for engine in engines.values():
            engine.close()
    return rows + _capacity(args, settings), samples


def _alternate(engines: dict[str, Engine], repeats: int, experiment: str, measure: Callable[[Engine], dict[str, Any]],
               **labels: Any) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """``repeats`` runs of ``measure(engine)`` per mode, modes taking turns in a rotating order
    (machine drift hits both alike); per mode, the run of median throughput, and every run."""
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in engines}
    for repeat in range(repeats):
        for mode in common.rotated(list(engines), repeat):
            engine = engines[mode]
            engine.cache.trim()
            before = engine.stats()["engine"]["preemptions"]
            row = _row(experiment, mode, engine, measure(engine), **labels)
            row["preemptions"] -= before
            runs[mode].append(row)
    kept = [sorted(mine, key=lambda r: r["throughput_tok_s"])[len(mine) // 2] for mine in runs.values()]
    return kept, runs


CAPACITY_PROMPT_LEN = 64  # fixed, like the request count and output length: one capacity experiment everywhere


def _capacity(args: argparse.Namespace, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Every prompt at once into ``--capacity-budget``: how many run together, per mode and page size."""
    prompts = _prompts(settings["capacity_requests"], CAPACITY_PROMPT_LEN, args.seed + 1)
    params = SamplingParams(max_tokens=settings["capacity_output_len"], temperature=0.0, ignore_eos=True)
    rows = []
    for config in _capacity_configs(args, settings).values():
        engine = Engine.from_config(config)
        try:
            rows.append(_row("capacity", config.kv_mode, engine, run_closed_loop(engine, prompts, params, len(prompts)),
                             concurrency=len(prompts)))
        finally:
            engine.close()
    return rows


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Headline numbers: throughput and TPOT at the top concurrency, capacity per variant."""
    summary: dict[str, Any] = {}
    top = max((r["concurrency"] for r in rows if r["experiment"] == "concurrency"), default=None)
    for r in rows:  # concurrency rows come first
        if r["experiment"] == "concurrency" and r["concurrency"] == top:
            summary[f"{r['mode']}_at_c{top}"] = {"throughput_tok_s": round(r["throughput_tok_s"], 1),
                                                 "tok_per_cpu_s": round(r["tok_per_cpu_s"], 1),
                                                 "tpot_p50_ms": round(r["tpot_p50_ms"], 2)}
        elif r["experiment"] == "capacity":
            summary[f"capacity_{r['mode']}_{r['tokens_per_page']}tok"] = {
                "mean_running": round(r["mean_running"], 1), "peak_running": r["peak_running"], "preemptions": r["preemptions"]}
    return summary


VATTENTION = 1.23  # vAttention (Prabhu et al., 2025): up to 1.23x serving throughput over PagedAttention kernels


def verdicts(result: dict[str, Any]) -> list[common.Verdict]:
    """Closed-loop throughput VMM vs paged at the top concurrency (tokens per CPU-second, paired repeats), and
    the capacity of the budget (mean sequences running, VMM at the engine's page size vs paged)."""
    out = []
    key = max((k for k in result["samples"] if k.startswith("concurrency/")), key=lambda k: int(k.split("/")[1]), default=None)
    data = result["samples"].get(key, {})
    if {"vmm", "paged"} <= set(data):
        ratio = common.Spread.of([v / p for v, p in zip(data["vmm"], data["paged"])])
        agrees = ratio.high >= 1.0 and ratio.low <= VATTENTION  # our range meets [1.0, 1.23]
        relation = "above" if ratio.low > VATTENTION else "below" if ratio.high < 1.0 else ""
        verdict = common.ratio_verdict(
            "serve.throughput", f"serving output tokens per CPU-second, {key.split('/')[1]} requests in flight: VMM vs paged",
            ratio, "VMM", "paged", reference=f"vAttention: up to {VATTENTION}x over PagedAttention kernels", agrees=agrees,
            note="embedded model, in-process engine")
        out.append(dataclasses.replace(verdict, relation=relation))
    cap = [r for r in result["rows"] if r["experiment"] == "capacity"]
    vmm = next((r for r in cap if r["mode"] == "vmm"), None)
    paged = next((r for r in cap if r["mode"] == "paged"), None)
    if vmm and paged:
        small = next((r for r in cap if r["mode"] == "vmm" and r is not vmm), None)
        note = f"paged {paged['preemptions']} preemptions, VMM {vmm['preemptions']}"
        if small:
            note += f"; VMM {small['tokens_per_page']}-tok pages: {small['mean_running']:.1f} running"
        out.append(common.ratio_verdict(
            "serve.capacity", f"capacity of {result['config']['capacity_budget']}: sequences running (mean), "
            f"VMM {vmm['tokens_per_page']}-tok pages vs paged {paged['tokens_per_page']}-tok blocks",
            common.Spread.exact(vmm["mean_running"] / paged["mean_running"]), "VMM", "paged", note=note))
    return out


def table(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for r in result["rows"]:
        load = {"concurrency": f"C={r['concurrency']}", "capacity": f"{r['concurrency']} at once",
                "rate": "all at once" if math.isinf(r["rate"]) else f"{r['rate']:g} req/s"}[r["experiment"]]
        out.append({"experiment": r["experiment"], "load": load, "mode": r["mode"], "tok/page": r["tokens_per_page"],
                    "tok/s": round(r["throughput_tok_s"], 1), "tok/CPU-s": round(r["tok_per_cpu_s"], 1),
                    "TTFT p50 ms": round(r["ttft_p50_ms"], 1), "TTFT p99 ms": round(r["ttft_p99_ms"], 1),
                    "TPOT p50 ms": round(r["tpot_p50_ms"], 2), "running mean": round(r["mean_running"], 1),
                    "peak": r["peak_running"], "preempted": r["preemptions"]})
    return out


def plot(result: dict[str, Any], out_dir: Path) -> list[str]:
    """``serve.png``: throughput vs concurrency, TTFT p50/p99 vs offered load, capacity per variant."""
    plt = common.pyplot()
    rows = result["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    rates = sorted({r["rate"] for r in rows if r["experiment"] == "rate"})
    colors = {"vmm": "tab:blue", "paged": "tab:orange"}
    levels = sorted({r["concurrency"] for r in rows if r["experiment"] == "concurrency"})
    for mode in sorted({r["mode"] for r in rows}):
        color = colors.get(mode)
        conc = sorted((r for r in rows if r["experiment"] == "concurrency" and r["mode"] == mode), key=lambda r: r["concurrency"])
        # on an idle machine the two measures coincide: open circles under crosses keep both visible
        axes[0].plot([r["concurrency"] for r in conc], [r["throughput_tok_s"] for r in conc], marker="o", markersize=9,
                     markerfacecolor="none", color=color, label=f"{mode}, per wall second")
        axes[0].plot([r["concurrency"] for r in conc], [r["tok_per_cpu_s"] for r in conc], marker="x", linestyle="--",
                     color=color, label=f"{mode}, per CPU-second")
        rate = {r["rate"]: r for r in rows if r["experiment"] == "rate" and r["mode"] == mode}
        x = list(range(len(rates)))
        axes[1].plot(x, [rate[r]["ttft_p50_ms"] for r in rates], marker="o", color=color, label=f"{mode} p50")
        axes[1].plot(x, [rate[r]["ttft_p99_ms"] for r in rates], marker="^", linestyle="--", color=color, label=f"{mode} p99")
    axes[0].set(xlabel="requests in flight (closed loop)", ylabel="output tokens / s", title="throughput")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xticks(levels, [str(level) for level in levels])
    axes[1].set_xticks(range(len(rates)), ["all at once" if math.isinf(rate) else f"{rate:g}/s" for rate in rates])
    axes[1].set(xlabel="arrival rate (open loop, Poisson)", ylabel="time to first token (ms)", title="latency vs offered load")
    cap = [r for r in rows if r["experiment"] == "capacity"]
    names = [f"{r['mode']}\n{r['tokens_per_page']} tok/page" for r in cap]
    bars = axes[2].bar(names, [r["mean_running"] for r in cap], color=[colors.get(r["mode"], "grey") for r in cap], alpha=0.75,
                       label="mean running")
    axes[2].plot(names, [r["peak_running"] for r in cap], "k_", markersize=22, markeredgewidth=2, linestyle="none",
                 label="peak running")
    for bar, r in zip(bars, cap):
        axes[2].annotate(f"{r['preemptions']} preempted", (bar.get_x() + bar.get_width() / 2, bar.get_height() / 2),
                         ha="center", fontsize=8, color="white")
    axes[2].set(ylabel="sequences running at once",
                title=f"capacity of {result['config']['capacity_budget']}, {result['config']['capacity_requests']} requests")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.16), ncol=2, frameon=False)
    fig.tight_layout()
    return [common.save_figure(fig, out_dir, "serve.png", tight=False)]
