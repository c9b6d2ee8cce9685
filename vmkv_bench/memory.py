"""KV memory holding tokens under a request trace: reservation baselines, paged mode and VMM mode in
every layout and page size replay the same seeded trace through one scheduler (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import time
import typing
from collections import deque
from dataclasses import dataclass
from typing import Any

import vmkv

from . import common

NAME = "memory"
DESCRIPTION = "KV utilization and sequences per budget: static/pow2 reservation vs paged vs VMM on a request trace"

SCHEMA = {
    "trace": "request trace (sharegpt-like or alpaca-like)",
    "allocator": "allocation policy and cache (docs/benchmarks.md)",
    "geometry": "VMM layout and page bytes per K/V tensor, or paged block size",
    "tokens_per_page": "tokens one page (or block) holds",
    "steady_util": "mean KV utilization (stored token bytes / allocated bytes) at steady state, 0..1",
    "peak_alloc_util": "utilization at the iteration with the most bytes allocated, 0..1",
    "mean_running": "mean sequences running at steady state (how many fit the budget)",
    "steady_iterations": "iterations counted as steady state "
                         "(0: memory never held requests back; the means then cover every iteration)",
    "steady_util_p10": "10th percentile of utilization over the steady-state iterations, 0..1",
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
    sweep: bool = False  # one of every layout x page size: reported as skipped, with the reason, where refused


def allocators(page_sizes: list[str]) -> list[Allocator]:
    """The baselines, one on-demand VMM allocator per layout and page size, then the library's defaults."""
    vmm = [Allocator(f"vmm-{layout}-{page}", "vmm", {"layout": layout, "page_size": page}, "on_demand", sweep=True)
           for layout in typing.get_args(vmkv.config.Layout) for page in page_sizes]
    return [*BASELINES, *vmm, Allocator(DEFAULT_VMM, "vmm", {}, "on_demand")]


DEFAULT_VMM = "vmm-default"
BASELINES = [
    Allocator("static-max", "vmm", {"layout": "all_layers", "page_size": "2MiB"}, "max"),
    Allocator("pow2", "vmm", {"layout": "all_layers", "page_size": "2MiB"}, "pow2"),
    Allocator("paged-b16", "paged", {"block_size": 16}, "on_demand"),
]
PAGE_SIZES = {"cpu": ["64KiB", "2MiB"], "cuda": ["2MiB"]}  # per device: CUDA maps 2 MiB at the least
DEFAULT_BUDGETS = {"sharegpt": "2GiB", "alpaca": "512MiB"}  # both hold ~30 average requests
PAPER_RESERVATION = (0.204, 0.382)  # PagedAttention paper (Kwon et al., 2023), Fig. 2: KV memory
# actually used by token states in reservation-based systems (Orca Max/Pow2/Oracle, FasterTransformer)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", nargs="+", default=["sharegpt", "alpaca"], choices=sorted(common.TRACES))
    parser.add_argument("--requests", nargs="+", default=None, metavar="[TRACE=]N", help="requests per trace, one "
                        "number for all or TRACE=N each (default: 120 ShareGPT-like, 300 Alpaca-like; smoke: 12)")
    parser.add_argument("--budget", nargs="+", default=None, metavar="[TRACE=]SIZE", help="KV memory budget, one size for "
                        "all or TRACE=SIZE each (default 2GiB ShareGPT-like, 512MiB Alpaca-like; smoke 512MiB)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="longest request; the static baseline reserves this much "
                        "(default 2048; smoke 256)")
    parser.add_argument("--page-sizes", nargs="+", default=None, help="VMM page sizes, each run with every layout "
                        f"(default {' '.join(PAGE_SIZES['cpu'])} on CPU, {' '.join(PAGE_SIZES['cuda'])} on CUDA)")
    labels = ", ".join(a.label for a in allocators(PAGE_SIZES["cpu"]))
    parser.add_argument("--allocators", nargs="+", default=None, help=f"only these allocators (default: all of {labels})")


def _per_trace(values: list[str] | None, kind: str, default: str) -> str:
    """The value for trace ``kind`` from ``["1GiB"]`` or ``["sharegpt=1GiB", "alpaca=256MiB"]``."""
    chosen = default
    for value in values or []:
        trace, sep, rest = value.partition("=")
        if not sep:
            chosen = value
        elif trace not in common.TRACES:
            raise vmkv.InvalidConfig(f"{value!r}: unknown trace {trace!r}; choose from {sorted(common.TRACES)}")
        elif trace == kind:
            return rest
    return chosen


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
        self.blocked = False  # a refused request stays refused until a sequence frees memory: no retry before then

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
                cache.reserve(req.rid, min(self.max_seq_len, 1 << (req.total - 1).bit_length()))  # the next power of two
            cache.begin_step({req.rid: req.prompt})
            fits = not self.running or cache.pool.num_free >= self.watermark  # keep room for decode steps
        except vmkv.OutOfPages:
            fits = False
        if not fits:
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
        for rid, state in list(self.running.items()):
            state[0] += 1
            if state[0] >= state[1]:
                self.cache.free(rid)
                self.blocked = False
                del self.running[rid]

    def run(self, trace: list[common.Request], show: bool, desc: str) -> dict[str, list[float]]:
        waiting = deque(trace)
        series: dict[str, list[float]] = {"util": [], "running": [], "alloc_bytes": [], "finished": [], "steady": []}
        finished = 0
        bar = common.progress(iter(int, 1), desc, enabled=show)  # an endless counter for tqdm
        for _ in bar:
            while waiting and not self.blocked and self._admit(waiting[0]):
                waiting.popleft()
            if not self.running:
                if waiting:
                    raise vmkv.OutOfPages(f"request {waiting[0].rid} does not fit the budget even alone")
                break
            before = len(self.running) + len(waiting)
            self._decode(waiting, trace)
            finished += before - len(self.running) - len(waiting)
            held = self.cache.pool.num_in_use * self.page_bytes
            stored = sum(length for length, _ in self.running.values()) * self.token_bytes
            series["util"].append(stored / held if held else 0.0)
            series["running"].append(len(self.running))
            series["alloc_bytes"].append(held)
            series["finished"].append(finished)
            series["steady"].append(bool(finished and waiting))
        if show:
            bar.close()
        return series


def _config(allocator: Allocator, args: argparse.Namespace, budget: str) -> vmkv.KVCacheConfig:
    return common.cache_config(common.LLAMA3_8B, args.device, max_batch_size=512, max_seq_len=args.max_seq_len,
                               memory_budget=budget, prefix_caching=False, deferred_reclaim=False, **allocator.fields)


def _settings(args: argparse.Namespace) -> tuple[argparse.Namespace, list[Allocator]]:
    """``args`` with the defaults of ``--smoke`` and ``--device`` filled in, and the allocators to replay."""
    args = argparse.Namespace(**{**vars(args), "max_seq_len": args.max_seq_len or (256 if args.smoke else 2048),
                                  "page_sizes": args.page_sizes or PAGE_SIZES[args.device]})
    chosen = allocators(args.page_sizes)
    if args.allocators:
        unknown = sorted(set(args.allocators) - {a.label for a in chosen})
        if unknown:
            raise vmkv.InvalidConfig(f"unknown allocators {unknown}; choose from {[a.label for a in chosen]}")
        chosen = [a for a in chosen if a.label in args.allocators]
    return args, chosen


def _budget(args: argparse.Namespace, kind: str) -> str:
    return _per_trace(args.budget, kind, "512MiB" if args.smoke else DEFAULT_BUDGETS[kind])


def refusals(args: argparse.Namespace, granularity: int) -> dict[str, str]:
    args, chosen = _settings(args)
    planned = [(f"{allocator.label} ({kind}, {_budget(args, kind)})", allocator.mode,
                _config(allocator, args, _budget(args, kind)))
               for kind in args.traces for allocator in chosen if not allocator.sweep]
    return common.cache_refusals(planned, granularity)


def _summarise_series(series: dict[str, list[float]]) -> dict[str, float]:
    marked = [i for i, s in enumerate(series["steady"]) if s]
    steady = marked or list(range(len(series["util"])))
    peak = max(range(len(series["alloc_bytes"])), key=series["alloc_bytes"].__getitem__)
    utils = sorted(series["util"][i] for i in steady)
    return {"steady_iterations": len(marked), "steady_util": sum(utils) / len(utils), "steady_util_p10": utils[len(utils) // 10],
            "peak_alloc_util": series["util"][peak], "mean_running": sum(series["running"][i] for i in steady) / len(steady),
            "max_running": max(series["running"])}


def _steady_series(series: dict[str, list[float]], points: int = 150) -> dict[str, list[float]]:
    steady = [i for i, s in enumerate(series["steady"]) if s] or list(range(len(series["util"])))
    size = max(1, -(-len(steady) // points))
    buckets = [steady[i : i + size] for i in range(0, len(steady), size)]
    return {"finished": [int(series["finished"][b[-1]]) for b in buckets],
            "util": [round(sum(series["util"][i] for i in b) / len(b), 4) for b in buckets],
            "running": [round(sum(series["running"][i] for i in b) / len(b), 2) for b in buckets]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    common.check_device(args.device)
    args, chosen = _settings(args)
    rows, series_out, traces, skipped, budgets = [], {}, {}, {}, {}
    done: dict[tuple[str, str, str], dict[str, Any]] = {}  # (trace, policy, geometry) -> its row
    for kind in args.traces:
        count = int(_per_trace(args.requests, kind, "12" if args.smoke else {"sharegpt": "120", "alpaca": "300"}[kind]))
        budgets[kind] = _budget(args, kind)
        trace = common.make_trace(kind, count, args.seed, args.max_seq_len)
        traces[kind] = common.trace_stats(trace)
        for allocator in chosen:
            try:
                cache = vmkv.open_cache(_config(allocator, args, budgets[kind]), mode=allocator.mode)
            except vmkv.InvalidConfig as exc:  # e.g. 64 KiB pages under CUDA's 2 MiB granularity
                skipped[allocator.label] = str(exc)
                continue
            same = done.get((kind, allocator.policy, common.geometry(cache)))
            if same is not None:  # e.g. the defaults are one of the configurations above: same replay
                cache.close()
                rows.append({**same, "allocator": allocator.label})
                series_out[f"{kind}/{allocator.label}"] = series_out[f"{kind}/{same['allocator']}"]
                continue
            with cache:
                start = time.perf_counter()
                replay = _Replay(cache, allocator, args.max_seq_len)
                series = replay.run(trace, getattr(args, "progress", False), f"memory {kind} {allocator.label}")
                wall = time.perf_counter() - start
                rows.append({
                    "trace": kind, "allocator": allocator.label, "geometry": common.geometry(cache),
                    "tokens_per_page": cache.tokens_per_page, **_summarise_series(series),
                    "preemptions": replay.preemptions, "iterations": len(series["util"]), "wall_s": wall,
                })
            series_out[f"{kind}/{allocator.label}"] = _steady_series(series)
            done[(kind, allocator.policy, rows[-1]["geometry"])] = rows[-1]
    return common.make_result(NAME, SCHEMA, rows, _summary(rows, skipped), traces=traces, series=series_out,
                              config={"budget": budgets, "max_seq_len": args.max_seq_len, "shape": common.LLAMA3_8B,
                                      "seed": args.seed})


def _summary(rows: list[dict[str, Any]], skipped: dict[str, str]) -> dict[str, Any]:
    """Steady-state utilization per trace and allocator, and the best VMM configuration."""
    summary: dict[str, Any] = {"skipped": skipped}
    for kind in dict.fromkeys(r["trace"] for r in rows):
        mine = [r for r in rows if r["trace"] == kind]
        summary[f"{kind}_steady_util"] = {r["allocator"]: round(r["steady_util"], 4) for r in mine}
        vmm = [r for r in mine if r["allocator"].startswith("vmm-")]
        if vmm:
            best = max(vmm, key=lambda r: r["steady_util"])
            summary[f"{kind}_best_vmm"] = {"allocator": best["allocator"], "geometry": best["geometry"],
                                           "steady_util": round(best["steady_util"], 4)}
    return summary


def verdicts(result: dict[str, Any]) -> list[common.Verdict]:
    """Per trace: how much of the KV memory each allocator fills with tokens at steady state."""
    out = []
    low, high = PAPER_RESERVATION
    for kind in dict.fromkeys(r["trace"] for r in result["rows"]):
        util = {r["allocator"]: r for r in result["rows"] if r["trace"] == kind}
        shown = [(DEFAULT_VMM, "VMM default"), ("paged-b16", "paged"), ("static-max", "reserve-max")]
        parts = [f"{name} {common.number_text(util[label]['steady_util'], '%')}" for label, name in shown if label in util]
        best_vmm = max((r for label, r in util.items() if label.startswith("vmm-")), key=lambda r: r["steady_util"], default=None)
        top = max(util.values(), key=lambda r: r["steady_util"])
        ties = [r["allocator"] for r in util.values() if r is not top and top["steady_util"] - r["steady_util"] <= 0.02]
        winner = " = ".join([top["allocator"], *ties[:2]]) + (" (within 2 pts)" if ties else "")
        side = "tie" if ties else top["allocator"]
        note = ""
        if best_vmm is not None and best_vmm["allocator"] != DEFAULT_VMM:
            note = (f"best VMM {common.number_text(best_vmm['steady_util'], '%')}: {best_vmm['geometry']}, "
                    f"{best_vmm['tokens_per_page']} tok/page")
        static = util.get("static-max")
        reference, agrees = "", None
        if kind == "sharegpt" and static is not None:  # the paper measured its systems on ShareGPT
            reference = f"PagedAttention paper: reservation uses {100 * low:.1f}-{100 * high:.1f} %"
            agrees = low <= static["steady_util"] <= high
        out.append(common.Verdict(
            key=f"memory.{kind}", question=f"KV memory holding tokens, {kind}-like (steady state)",
            result=", ".join(parts), spread="exact (seeded)", winner=winner, side=side, reference=reference,
            agrees=agrees, value=util[DEFAULT_VMM]["steady_util"] if DEFAULT_VMM in util else None, note=note,
        ))
    return out


def table(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"trace": r["trace"], "allocator": r["allocator"], "tok/page": r["tokens_per_page"],
             "util %": round(100 * r["steady_util"], 1), "util p10 %": round(100 * r["steady_util_p10"], 1),
             "running (mean)": round(r["mean_running"], 1), "steady iters": r["steady_iterations"],
             "preemptions": r["preemptions"]} for r in result["rows"]]


def plot(result: dict[str, Any], out_dir) -> list[str]:
    """``memory_utilization.png``: steady-state utilization vs requests finished, a panel per trace."""
    plt = common.pyplot()
    kinds = list(result["traces"])
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.2 * len(kinds) + 3.2, 4.4), squeeze=False)
    styles = [("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"), ("-", "v"), ("--", "P"), ("-.", "X"), (":", "*")]
    low, high = PAPER_RESERVATION
    for ax, kind in zip(axes[0], kinds):
        tpp = {r["allocator"]: r["tokens_per_page"] for r in result["rows"] if r["trace"] == kind}
        groups: dict[tuple, list[str]] = {}
        for key, series in result["series"].items():
            trace, label = key.split("/", 1)
            if trace == kind:
                groups.setdefault((tuple(series["finished"]), tuple(series["util"])), []).append(label)
        ax.axhspan(100 * low, 100 * high, color="grey", alpha=0.15, label="PagedAttention paper: reservation systems")
        for i, ((finished, util), labels) in enumerate(groups.items()):
            line, marker = styles[i % len(styles)]
            name = " = ".join(labels) + f" ({tpp[labels[0]]} tok/page)"
            ax.plot(finished, [100 * u for u in util], linestyle=line, marker=marker, markevery=max(1, len(util) // 8),
                    markersize=4, linewidth=1.3, label=name)
        ax.set(title=f"{kind}-like trace, budget {result['config']['budget'][kind]}: steady state", ylim=(0, 105),
               xlabel="requests finished (steady state: requests waiting for memory)", ylabel="KV memory holding tokens (%)")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7, frameon=False)
    for ax, kind in zip(axes[0][:-1], kinds):
        if ax.get_legend_handles_labels()[1] != labels:  # a panel with other lines gets its own legend, below it
            ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 3.0 / (6.2 * len(kinds) + 3.2), 1))
    return [common.save_figure(fig, out_dir, "memory_utilization.png", tight=False)]
