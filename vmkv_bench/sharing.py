"""Memory that copy-on-write sharing saves in parallel sampling and beam search: each request replayed
shared (fork) and unshared (copies), paged and VMM page sizes (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import functools
import itertools
import random
import statistics
from dataclasses import dataclass
from typing import Any, Callable

import vmkv
from vmkv.sizing import DEFAULT_TOKENS_PER_PAGE

from . import common

NAME = "sharing"
DESCRIPTION = "memory saved by COW sharing for parallel sampling (n=2,4,6) and beam search (w=2,4,6), paged vs VMM page sizes"

SCHEMA = {
    "trace": "request trace (sharegpt-like or alpaca-like)",
    "scenario": "parallel (n samples) or beam (width w)",
    "n": "samples or beam width",
    "allocator": "cache and page geometry",
    "geometry": "VMM layout and page bytes per K/V tensor, or paged block size",
    "tokens_per_page": "tokens one page holds",
    "saved": "1 - pages in use with sharing / without, summed over steps (0..1)",
    "peak_saved": "1 - peak pages with sharing / peak pages without",
    "cow_copies": "pages copied on write in the shared run",
    "requests": "requests replayed",
}


@dataclass(frozen=True)
class Allocator:
    label: str
    mode: str
    fields: dict[str, Any]


# Llama-3-8B KV heads and dims; per-layer pages count the same tokens whatever the layer count,
# so the per-layer runs use one layer (copies on write move 2 x 2 MiB instead of 64 x 2 MiB).
_ONE_LAYER = {**common.LLAMA3_8B, "num_layers": 1}
ALLOCATORS = [
    Allocator("paged-b16", "paged", {**_ONE_LAYER, "block_size": 16}),
    Allocator("vmm-per_layer-64KiB", "vmm", {**_ONE_LAYER, "layout": "per_layer", "page_size": "64KiB"}),
    Allocator("vmm-per_layer-2MiB", "vmm", {**_ONE_LAYER, "layout": "per_layer", "page_size": "2MiB"}),
    Allocator("vmm-all_layers-2MiB", "vmm", {**common.LLAMA3_8B, "layout": "all_layers", "page_size": "2MiB"}),
    Allocator("vmm-default", "vmm", dict(common.LLAMA3_8B)),  # layout and page size: the library's choice
]
DEFAULT_VMM = "vmm-default"
DEFAULT_ALLOCATORS = {  # per device: CUDA maps 2 MiB at the least
    "cpu": ["paged-b16", DEFAULT_VMM, "vmm-per_layer-64KiB", "vmm-per_layer-2MiB"],
    "cuda": ["paged-b16", DEFAULT_VMM, "vmm-per_layer-2MiB"],
}
# Requests per (trace, scenario): beam search copies a page on write almost every step (2 MiB
# pieces with the 2 MiB allocator), so it gets fewer requests than parallel sampling.
DEFAULT_REQUESTS = {("sharegpt", "parallel"): 12, ("alpaca", "parallel"): 30, ("sharegpt", "beam"): 2, ("alpaca", "beam"): 6}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", nargs="+", default=None, choices=sorted(common.TRACES), help="default: both; smoke: alpaca")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per (trace, scenario) (default: parallel 12 ShareGPT-like / 30 Alpaca-like, "
                             "beam 2 / 6; smoke 1)")
    parser.add_argument("--widths", type=int, nargs="+", default=None, help="n and beam widths (default 2 4 6; smoke 2)")
    parser.add_argument("--allocators", nargs="+", default=None, choices=[a.label for a in ALLOCATORS],
                        help=f"default {' '.join(DEFAULT_ALLOCATORS['cpu'])} on CPU, {' '.join(DEFAULT_ALLOCATORS['cuda'])} "
                             "on CUDA (vmm-default: the library's own layout and page size on the device)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="longest sequence (default 2048; smoke 128)")


class _Run:
    """One request in one cache, shared or unshared; sums the pages in use after every step."""

    def __init__(self, cache: vmkv.KVCacheBase, shared: bool) -> None:
        self.cache, self.shared = cache, shared
        self.lengths: dict[int, int] = {}
        self.ids = itertools.count(1)
        self.page_steps = self.peak = 0

    def start(self, prompt: int) -> int:
        seq = next(self.ids)
        self.cache.add(seq)
        self.cache.begin_step({seq: prompt})
        self.lengths[seq] = prompt
        return seq

    def fork(self, src: int) -> int:
        dst = next(self.ids)
        if self.shared:
            self.cache.fork(src, dst)
        else:
            self.cache.add(dst)
            self.cache.begin_step({dst: self.lengths[src]})
        self.lengths[dst] = self.lengths[src]
        return dst

    def free(self, seq: int) -> None:
        self.cache.free(seq)
        del self.lengths[seq]

    def step(self, seqs: list[int]) -> None:
        self.cache.begin_step({seq: 1 for seq in seqs})
        for seq in seqs:
            self.lengths[seq] += 1
        self.record()

    def record(self) -> None:
        used = self.cache.pool.num_in_use
        self.page_steps += used
        self.peak = max(self.peak, used)

    def close(self) -> None:
        for seq in list(self.lengths):
            self.free(seq)


def _parallel(run: _Run, rng: random.Random, *, prompt: int, outputs: list[int]) -> None:
    parent = run.start(prompt)
    left = {parent: outputs[0]}  # tokens each sample has yet to generate
    for out in outputs[1:]:
        left[run.fork(parent)] = out
    run.record()
    while left:
        run.step(list(left))
        for seq in list(left):
            left[seq] -= 1
            if left[seq] <= 0:
                run.free(seq)
                del left[seq]


def _beam(run: _Run, rng: random.Random, *, prompt: int, steps: int, width: int) -> None:
    beams = [run.start(prompt)]
    beams += [run.fork(beams[0]) for _ in range(width - 1)]
    run.record()
    for _ in range(steps):
        drawn = [rng.choice(beams) for _ in range(width)]
        counts = {beam: drawn.count(beam) for beam in beams}
        for beam in beams:
            if counts[beam] == 0:
                run.free(beam)
        survivors = [beam for beam in beams if counts[beam]]
        beams = survivors + [run.fork(beam) for beam in survivors for _ in range(counts[beam] - 1)]
        run.step(beams)


def _measure(allocator: Allocator, args: argparse.Namespace, scenario: Callable[[_Run, random.Random], None], width: int,
             seed: int) -> dict[str, Any]:
    """Run ``scenario`` shared and unshared with the same seed; return page sums and copies."""
    result = {}
    config = _config(allocator, args, width)
    for shared in (True, False):
        with vmkv.open_cache(config, allocator.mode) as cache:
            run = _Run(cache, shared)
            scenario(run, random.Random(seed))
            run.close()
            result[shared] = (run.page_steps, run.peak, cache.stats()["cow_copies"], cache.tokens_per_page,
                              common.geometry(cache))
    return result


def _config(allocator: Allocator, args: argparse.Namespace, width: int) -> vmkv.KVCacheConfig:
    """The cache ``allocator`` replays ``width`` samples or beams in: 2 x width slots and their pages."""
    fields = dict(allocator.fields)
    shape = _shape(fields)
    if allocator.label == DEFAULT_VMM:
        probe = common.cache_config(fields, args.device, max_seq_len=args.max_seq_len,
                                    memory_budget=_budget(shape, width, args.max_seq_len, DEFAULT_TOKENS_PER_PAGE))
        fields.update(layout=probe.layout, page_size=probe.page_size)
    page_tokens = (fields["block_size"] if allocator.mode == "paged"
                   else vmkv.parse_size(fields["page_size"]) // shape.tensor_token_bytes(fields["layout"]))
    return common.cache_config({}, args.device, **fields, max_batch_size=2 * width, max_seq_len=args.max_seq_len,
                               memory_budget=_budget(shape, width, args.max_seq_len, page_tokens), prefix_caching=False,
                               deferred_reclaim=False)


def _shape(fields: dict[str, Any]) -> vmkv.KVCacheConfig:
    return common.cache_config({k: fields[k] for k in ("num_layers", "num_kv_heads", "head_dim", "dtype")}, "cpu",
                               page_size="64KiB")  # any page: a default would be sized for nothing


def _budget(shape: vmkv.KVCacheConfig, width: int, max_seq_len: int, page_tokens: int) -> int:
    pages = 2 * width * (-(-max_seq_len // page_tokens) + 1)
    return pages * page_tokens * shape.bytes_per_token


def _settings(args: argparse.Namespace) -> tuple[argparse.Namespace, list[int]]:
    widths = args.widths or ([2] if args.smoke else [2, 4, 6])
    args = argparse.Namespace(**{**vars(args), "max_seq_len": args.max_seq_len or (128 if args.smoke else 2048),
                                  "traces": args.traces or (["alpaca"] if args.smoke else ["sharegpt", "alpaca"]),
                                  "allocators": args.allocators or DEFAULT_ALLOCATORS[args.device]})
    return args, widths


def refusals(args: argparse.Namespace, granularity: int) -> dict[str, str]:
    args, widths = _settings(args)
    planned = [(f"{a.label} (width {width})", a.mode, _config(a, args, width))
               for a in ALLOCATORS if a.label in args.allocators for width in widths]
    return common.cache_refusals(planned, granularity)


def run(args: argparse.Namespace) -> dict[str, Any]:
    common.check_device(args.device)
    args, widths = _settings(args)
    allocators = [a for a in ALLOCATORS if a.label in args.allocators]
    work = [(kind, scen, n, a) for kind in args.traces for scen in ("parallel", "beam") for n in widths for a in allocators]
    rows, skipped = [], {}
    for kind, scen, width, allocator in common.progress(work, "sharing", enabled=getattr(args, "progress", False)):
        if allocator.label in skipped:
            continue
        try:
            measured = _replay(args, allocator, kind, scen, width, max(widths))
        except vmkv.InvalidConfig as exc:  # e.g. 64 KiB pages under CUDA's 2 MiB granularity
            skipped[allocator.label] = str(exc)
            continue
        rows.append({"trace": kind, "scenario": scen, "n": width, "allocator": allocator.label, **measured})
    return common.make_result(NAME, SCHEMA, rows, _summary(rows, skipped))


def _replay(args: argparse.Namespace, allocator: Allocator, kind: str, scen: str, width: int, most: int) -> dict[str, Any]:
    """Every request of a ``kind`` trace through ``scen`` at ``width``, shared and unshared: the row's measurements."""
    count = args.requests or (1 if args.smoke else DEFAULT_REQUESTS[(kind, scen)])
    trace = common.make_trace(kind, count, args.seed, args.max_seq_len)
    # per-sample output lengths: the same draws for every n (n=2 takes the first 2 of ``most``)
    extra = common.make_trace(kind, count * most, args.seed + 1, args.max_seq_len)
    sums: dict[bool, list[Any]] = {True: [0, 0, 0], False: [0, 0, 0]}  # page-steps, peak pages, copies on write
    for req in trace:
        if scen == "parallel":
            outs = [min(e.output, args.max_seq_len - req.prompt) for e in extra[req.rid * most : req.rid * most + width]]
            scenario = functools.partial(_parallel, prompt=req.prompt, outputs=outs)
        else:
            scenario = functools.partial(_beam, prompt=req.prompt, steps=req.output, width=width)
        measured = _measure(allocator, args, scenario, width, args.seed * 1000 + req.rid)
        for shared, (page_steps, peak, cows, tpp, geometry) in measured.items():
            sums[shared][0] += page_steps
            sums[shared][1] = max(sums[shared][1], peak)
            sums[shared][2] += cows
    return {"geometry": geometry, "tokens_per_page": tpp, "saved": 1 - sums[True][0] / sums[False][0],
            "peak_saved": 1 - sums[True][1] / sums[False][1], "cow_copies": sums[True][2], "requests": count}


PAPER = {  # vLLM paper, Fig. 15 (ranges over n / width 2..6)
    ("alpaca", "parallel"): (0.061, 0.098), ("sharegpt", "parallel"): (0.162, 0.305),
    ("alpaca", "beam"): (0.376, 0.552), ("sharegpt", "beam"): (0.443, 0.663),
}


def _summary(rows: list[dict[str, Any]], skipped: dict[str, str]) -> dict[str, Any]:
    summary: dict[str, Any] = {"skipped": skipped, "paper_ranges": {f"{k[0]}/{k[1]}": v for k, v in PAPER.items()}}
    for row in rows:
        key = f"{row['trace']}/{row['scenario']}/{row['allocator']}"
        summary.setdefault(key, {})[f"n={row['n']}"] = round(row["saved"], 3)
    return summary


HEADLINE = (DEFAULT_VMM, "paged-b16")
"""What a verdict compares: VMM with the library's default pages on the device, and paged mode;
the other allocators measured are shown as alternatives."""
TIE_POINTS = 0.01
"""Mean savings closer than one percentage point are a tie (a deterministic replay has no spread)."""


def verdicts(result: dict[str, Any]) -> list[common.Verdict]:
    """Per trace and scenario: memory saved by VMM's default pages and by paged mode (the others as
    alternatives), against the vLLM paper's range."""
    out = []
    rows = result["rows"]
    for trace, scen in dict.fromkeys((r["trace"], r["scenario"]) for r in rows):
        mine = [r for r in rows if (r["trace"], r["scenario"]) == (trace, scen)]
        by = {label: [r for r in mine if r["allocator"] == label] for label in dict.fromkeys(r["allocator"] for r in mine)}
        headline = [label for label in HEADLINE if label in by] or list(by)
        mean = {label: statistics.fmean(r["saved"] for r in by[label]) for label in by}
        best = max(headline, key=mean.__getitem__)
        tied = [label for label in headline if mean[best] - mean[label] < TIE_POINTS]
        winner = best if len(tied) == 1 else f"tie ({' = '.join(tied)}, within 1 point)"
        low, high = PAPER[(trace, scen)]
        paged = [r["saved"] for r in by.get("paged-b16", [])]
        agrees = min(paged) <= high and max(paged) >= low if paged else None  # the measured range meets the paper's
        alternatives = [label for label in by if label not in headline]
        widths = sorted({r["n"] for r in mine})
        span = str(widths[0]) if len(widths) == 1 else f"{widths[0]}-{widths[-1]}"
        what = "parallel sampling, n" if scen == "parallel" else "beam search, width"
        out.append(common.Verdict(
            key=f"sharing.{trace}.{scen}", question=f"memory saved by sharing, {what} {span}, {trace}-like",
            result=", ".join(_saved_text(label, by[label]) for label in headline), spread="exact (seeded)",
            winner=winner, side=best if len(tied) == 1 else "tie",
            reference=f"vLLM paper Fig. 15: {100 * low:.1f}-{100 * high:.1f} %", agrees=agrees, value=mean[best],
            note="alternatives: " + ", ".join(_saved_text(label, by[label]) for label in alternatives) if alternatives else "",
        ))
    return out


def _saved_text(label: str, rows: list[dict[str, Any]]) -> str:
    """The allocator's name and the memory it saved over the widths, e.g. ``"VMM 8-tok pages 12-30 %"``."""
    pages = f"{rows[0]['tokens_per_page']}-tok pages"
    if label.startswith("paged"):
        name = "paged"
    elif label == DEFAULT_VMM:
        name = f"VMM default ({pages}, {rows[0]['geometry'].split(',')[0]})"
    else:
        name = f"VMM {pages}"
    lo, hi = min(r["saved"] for r in rows), max(r["saved"] for r in rows)
    low, high = common.number_text(lo, "%"), common.number_text(hi, "%")
    span = low if lo == hi else f"{low.removesuffix(' %')}-{high}"
    return f"{name} {span}"


def plot(result: dict[str, Any], out_dir) -> list[str]:
    """``sharing_saved.png``: memory saved vs n / width, a panel per trace and scenario, the paper's range shaded."""
    plt = common.pyplot()
    rows = result["rows"]
    panels = list(dict.fromkeys((r["trace"], r["scenario"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.0), squeeze=False)
    markers = ["o", "s", "^", "D"]
    for ax, (trace, scen) in zip(axes[0], panels):
        mine = [r for r in rows if r["trace"] == trace and r["scenario"] == scen]
        low, high = PAPER[(trace, scen)]
        ax.axhspan(100 * low, 100 * high, color="grey", alpha=0.2, label="vLLM paper (Fig. 15) range")
        for i, label in enumerate(dict.fromkeys(r["allocator"] for r in mine)):
            pts = [r for r in mine if r["allocator"] == label]
            ax.plot([r["n"] for r in pts], [100 * r["saved"] for r in pts], marker=markers[i % len(markers)],
                    label=f"{label} ({pts[0]['tokens_per_page']} tok/page)")
        ax.set(title=f"{trace}-like: {'parallel sampling' if scen == 'parallel' else 'beam search'}", ylabel="memory saved (%)",
               xlabel="n (samples)" if scen == "parallel" else "beam width", xticks=sorted({r["n"] for r in mine}),
               ylim=(0, None))
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    columns = 2 if len(panels) <= 2 else 4
    fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 * -(-len(labels) // columns) + 0.02, 1, 1))
    return [common.save_figure(fig, out_dir, "sharing_saved.png", tight=False)]
