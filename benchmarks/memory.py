"""KV-cache memory utilization under a request trace (issue 5; vLLM paper Fig. 2 / Sec. 6).

A seeded ShareGPT-like or Alpaca-like trace is replayed, in arrival order, through one scheduler
and several allocators, each a real cache doing ``add`` / ``reserve`` / ``begin_step`` / ``free``
under the same memory budget (kernels are skipped: no K/V is written, so the host backend's
pages are mapped but never touched)::

    static-max   reserve max_seq_len tokens per request up front (FasterTransformer/Orca "Max")
    pow2         reserve the next power of two of prompt+output (Orca "Pow2": <= 2x over)
    paged-b16    paged mode, 16-token blocks, pages on demand (vLLM)
    vmm-*        VMM mode, per-layer or all-layers layout, 64 KiB or 2 MiB pages, on demand

The two reservation baselines run on the VMM cache with the all-layers layout and 2 MiB pages
(32 tokens a page for Llama-3-8B), so a reservation is rounded up to whole 32-token pages.

Scheduler (the same for all): every iteration admits waiting requests first-come first-served
while the allocator accepts their prompt (or reservation) and leaves 1 % of the pages free (vLLM's
watermark; the first request is always tried), then runs one decode step for every
running request; a request that reached its output length is freed. If a decode step runs out of
pages, the newest running request is preempted (freed, re-queued at the front, recomputed later:
vLLM's recompute preemption).

Utilization = bytes of stored tokens / bytes of pages held by sequences. *Steady state* is every
iteration after the first completion while requests are still waiting (memory is the limit).
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import vmkv

from . import common

NAME = "memory"
DESCRIPTION = "KV utilization and sequences per budget: static/pow2 reservation vs paged vs VMM on a request trace"

SCHEMA = {
    "trace": "request trace (sharegpt-like or alpaca-like)",
    "allocator": "allocation policy and cache (see module docstring)",
    "tokens_per_page": "tokens one page (or block) holds",
    "steady_util": "mean KV utilization (stored token bytes / allocated bytes) at steady state, 0..1",
    "peak_alloc_util": "utilization at the iteration with the most bytes allocated, 0..1",
    "mean_running": "mean sequences running at steady state (how many fit the budget)",
    "steady_iterations": "iterations counted as steady state (0: memory never held requests back; the means then cover every iteration)",
    "max_running": "most sequences running at once",
    "preemptions": "decode steps that ran out of pages and preempted a request",
    "iterations": "scheduler iterations to finish the trace",
    "wall_s": "seconds the replay took (allocator calls only)",
}


@dataclass(frozen=True)
class Allocator:
    """One allocator of the comparison: a cache configuration plus a reservation policy."""

    label: str
    mode: str  # "vmm" or "paged"
    fields: dict[str, Any]
    policy: str  # "on_demand", "max" or "pow2"


ALLOCATORS = [
    Allocator("static-max", "vmm", {"layout": "all_layers", "page_size": "2MiB"}, "max"),
    Allocator("pow2", "vmm", {"layout": "all_layers", "page_size": "2MiB"}, "pow2"),
    Allocator("paged-b16", "paged", {"block_size": 16}, "on_demand"),
    Allocator("vmm-layer-64KiB", "vmm", {"layout": "per_layer", "page_size": "64KiB"}, "on_demand"),
    Allocator("vmm-layer-2MiB", "vmm", {"layout": "per_layer", "page_size": "2MiB"}, "on_demand"),
    Allocator("vmm-all-64KiB", "vmm", {"layout": "all_layers", "page_size": "64KiB"}, "on_demand"),
    Allocator("vmm-all-2MiB", "vmm", {"layout": "all_layers", "page_size": "2MiB"}, "on_demand"),
]
DEFAULT_BUDGETS = {"sharegpt": "2GiB", "alpaca": "512MiB"}  # both hold ~30 average requests
DEFAULT_VMM = "vmm-layer-2MiB"  # the library's defaults: per_layer layout, 2 MiB pages


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This benchmark's options (the CLI adds --device, --smoke, --seed, --out)."""
    parser.add_argument("--traces", nargs="+", default=["sharegpt", "alpaca"], choices=sorted(common.TRACES))
    parser.add_argument("--requests", type=int, default=None, help="requests per trace (default: 120 ShareGPT-like, 300 Alpaca-like; smoke: 12)")
    parser.add_argument("--budget", default=None, help="KV memory budget (Llama-3-8B geometry: 128 KiB a token; default 2GiB "
                        "for ShareGPT-like, 512MiB for Alpaca-like, whose requests are ~6x shorter; smoke 512MiB)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="longest request; the static baseline reserves this much (default 2048; smoke 256)")
    parser.add_argument("--allocators", nargs="+", default=[a.label for a in ALLOCATORS], choices=[a.label for a in ALLOCATORS])


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class _Replay:
    """Replays one trace through one allocator and records utilization every iteration."""

    def __init__(self, cache: vmkv.KVCacheBase, allocator: Allocator, max_seq_len: int) -> None:
        self.cache = cache
        self.policy = allocator.policy
        self.max_seq_len = max_seq_len
        self.token_bytes = cache.config.bytes_per_token
        self.page_bytes = cache.geometry.page_bytes
        self.running: dict[int, list[int]] = {}  # rid -> [length, target length], in admission order
        self.watermark = -(-cache.pool.num_pages // 100)  # vLLM's admission watermark: 1 % of the pages
        self.preemptions = 0
        # A refused request stays refused until some sequence frees memory (pages only shrink
        # otherwise), so admission is not retried before then: same result, fewer calls.
        self.blocked = False

    def _admit(self, req: common.Request) -> bool:
        """Try to start ``req``; on any refusal leave the cache as it was and return False."""
        cache = self.cache
        try:
            cache.add(req.rid)
        except vmkv.NoFreeSlot:
            self.blocked = True
            return False
        try:
            if self.policy == "max":
                cache.reserve(req.rid, self.max_seq_len)
            elif self.policy == "pow2":
                cache.reserve(req.rid, min(self.max_seq_len, _next_pow2(req.total)))
            cache.begin_step({req.rid: req.prompt})
        except vmkv.OutOfPages:
            cache.free(req.rid)
            self.blocked = True
            return False
        if self.running and cache.pool.num_free < self.watermark:  # keep room for decode steps
            cache.free(req.rid)
            self.blocked = True
            return False
        self.running[req.rid] = [req.prompt, req.total]
        return True

    def _decode(self, waiting: deque[common.Request], trace: list[common.Request]) -> None:
        """One decode step for every running request, preempting the newest on OutOfPages."""
        while self.running:
            try:
                self.cache.begin_step({rid: 1 for rid in self.running})
                break
            except vmkv.OutOfPages:
                victim = next(reversed(self.running))
                self.cache.free(victim)
                self.blocked = False
                del self.running[victim]
                waiting.appendleft(trace[victim])
                self.preemptions += 1
        for rid in list(self.running):
            state = self.running[rid]
            state[0] += 1
            if state[0] >= state[1]:
                self.cache.free(rid)
                self.blocked = False
                del self.running[rid]

    def run(self, trace: list[common.Request], show: bool, desc: str) -> dict[str, list[float]]:
        waiting = deque(trace)
        series: dict[str, list[float]] = {"util": [], "running": [], "alloc_bytes": [], "steady": []}
        done_any = False
        bar = common.progress(iter(int, 1), desc, enabled=show)  # an endless counter for tqdm
        for _ in bar:
            while waiting and not self.blocked and self._admit(waiting[0]):
                waiting.popleft()
            if not self.running:
                if waiting:
                    raise vmkv.OutOfPages(f"request {waiting[0].rid} does not fit the budget even alone")
                break
            before = len(self.running)
            self._decode(waiting, trace)
            done_any = done_any or len(self.running) < before
            held = self.cache.pool.num_in_use * self.page_bytes
            stored = sum(length for length, _ in self.running.values()) * self.token_bytes
            series["util"].append(stored / held if held else 0.0)
            series["running"].append(len(self.running))
            series["alloc_bytes"].append(held)
            series["steady"].append(bool(done_any and waiting))
        if show:
            bar.close()
        return series


def _open(allocator: Allocator, args: argparse.Namespace, budget: str) -> vmkv.KVCacheBase:
    config = common.cache_config(
        common.LLAMA3_8B, args.device,
        max_batch_size=512, max_seq_len=args.max_seq_len, memory_budget=budget,
        prefix_caching=False, deferred_reclaim=False, **allocator.fields,
    )
    return vmkv.open_cache(config, mode=allocator.mode)


def _summarise_series(series: dict[str, list[float]]) -> dict[str, float]:
    marked = [i for i, s in enumerate(series["steady"]) if s]
    steady = marked or list(range(len(series["util"])))
    peak = max(range(len(series["alloc_bytes"])), key=series["alloc_bytes"].__getitem__)
    return {
        "steady_iterations": len(marked),
        "steady_util": sum(series["util"][i] for i in steady) / len(steady),
        "peak_alloc_util": series["util"][peak],
        "mean_running": sum(series["running"][i] for i in steady) / len(steady),
        "max_running": max(series["running"]),
    }


def _downsample(values: list[float], points: int = 300) -> list[float]:
    step = max(1, len(values) // points)
    return [round(float(v), 4) for v in values[::step]]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Replay each trace through each allocator; rows per (trace, allocator)."""
    common.check_device(args.device)
    show = getattr(args, "progress", False)
    has_paged, why_not = common.paged_available()
    args = argparse.Namespace(**{**vars(args), "max_seq_len": args.max_seq_len or (256 if args.smoke else 2048),
                                  })
    rows, series_out, traces, skipped, budgets = [], {}, {}, {}, {}
    for kind in args.traces:
        count = args.requests or (12 if args.smoke else {"sharegpt": 120, "alpaca": 300}[kind])
        budgets[kind] = args.budget or ("512MiB" if args.smoke else DEFAULT_BUDGETS[kind])
        trace = common.make_trace(kind, count, args.seed, args.max_seq_len)
        traces[kind] = common.trace_stats(trace)
        for allocator in [a for a in ALLOCATORS if a.label in args.allocators]:
            if allocator.mode == "paged" and not has_paged:
                skipped[allocator.label] = why_not
                continue
            try:
                cache = _open(allocator, args, budgets[kind])
            except vmkv.InvalidConfig as exc:  # e.g. 64 KiB pages under CUDA's 2 MiB granularity
                skipped[allocator.label] = str(exc)
                continue
            try:
                start = time.perf_counter()
                replay = _Replay(cache, allocator, args.max_seq_len)
                series = replay.run(trace, show, f"memory {kind} {allocator.label}")
                wall = time.perf_counter() - start
                rows.append({
                    "trace": kind, "allocator": allocator.label, "tokens_per_page": cache.tokens_per_page,
                    **_summarise_series(series), "preemptions": replay.preemptions,
                    "iterations": len(series["util"]), "wall_s": wall,
                })
            finally:
                cache.close()
            series_out[f"{kind}/{allocator.label}"] = {k: _downsample(v) for k, v in series.items() if k != "steady"}
    return common.make_result(NAME, SCHEMA, rows, _summary(rows, skipped), traces=traces, series=series_out,
                              config={"budget": budgets, "max_seq_len": args.max_seq_len, "shape": common.LLAMA3_8B})


def _summary(rows: list[dict[str, Any]], skipped: dict[str, str]) -> dict[str, Any]:
    """Goals of issue 5, judged on the ShareGPT-like trace's steady-state utilization."""
    summary: dict[str, Any] = {"skipped": skipped}
    share = {r["allocator"]: r["steady_util"] for r in rows if r["trace"] == "sharegpt"}
    if not share:
        return summary
    summary["sharegpt_steady_util"] = share
    vmm = {label: util for label, util in share.items() if label.startswith("vmm-")}
    if vmm:
        best = max(vmm, key=vmm.__getitem__)
        summary["best_vmm"] = {"allocator": best, "steady_util": vmm[best], "goal_ge_96pct": vmm[best] >= 0.96}
    goals = (
        ("goal_vmm_default_ge_96pct", DEFAULT_VMM, lambda u: u >= 0.96),
        ("goal_paged_ge_96pct", "paged-b16", lambda u: u >= 0.96),
        ("goal_static_20_to_40pct", "static-max", lambda u: 0.20 <= u <= 0.40),
    )
    for key, label, met in goals:
        if label in share:
            summary[key] = met(share[label])
    return summary


def plot(result: dict[str, Any], out_dir) -> list[str]:
    """``memory_utilization.png``: utilization over time, one panel per trace, one line per allocator
    (allocators with the same tokens per page draw the same line)."""
    plt = common.pyplot()
    kinds = list(result["traces"])
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for key, series in result["series"].items():
            trace, label = key.split("/", 1)
            if trace == kind:
                util = list(series["util"])
                while util and util[-1] == 0.0:  # the last iteration frees everything
                    util.pop()
                ax.plot([i / max(1, len(util) - 1) for i in range(len(util))], util, label=label, linewidth=1.2)
        ax.set_title(f"{kind}-like trace, budget {result['config']['budget'][kind]}")
        ax.set_xlabel("progress through the replay (fraction of its iterations)")
        ax.set_ylabel("KV utilization (stored / allocated)")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return [common.save_figure(fig, out_dir, "memory_utilization.png")]
