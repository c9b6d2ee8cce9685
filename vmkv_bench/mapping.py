"""What mapping pages costs in VMM mode: map/unmap per page, reserving 64 GiB, and its share of a decode
step on demand and with map-ahead against no mapping at all (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import vmkv
from vmkv.sizes import format_size
from vmkv.vm import open_backend

from . import common

NAME = "mapping"
DESCRIPTION = ("VMM mapping overhead: map/unmap us per page, reserving 64 GiB, share of decode time spent mapping "
               "(map_ahead on/off)")

SCHEMA = {
    "measure": "map_us, unmap_us (median per page), reserve_64GiB_ms, or decode_share (mapping share of step time)",
    "page_size": "bytes of one mapped page",
    "map_ahead": "decode_share only: pages of the next step mapped on a background thread",
    "value": "the measured value, in the unit of the measure (us, ms, or a fraction)",
    "low": "decode_share: lowest share of a single round (from 5 rounds on, the lowest is left out); "
           "map/unmap: 10th percentile call; reserve: fastest",
    "high": "decode_share: highest share of a single round (same rule); map/unmap: 90th percentile call; reserve: slowest",
    "step_ms": "decode_share only: ms per decode step (all layers), median over rounds",
    "baseline_step_ms": "decode_share only: the same with every page mapped before the loop",
    "runs": "decode_share: rounds; map/unmap: calls timed; reserve: reservations timed",
    "reliable": "false when the measurement failed its sanity check "
                "(a negative share, or a step faster than the baseline beyond its spread)",
    "why": "why the measurement is unreliable ('' when it is reliable)",
    "saving": "decode_share with map_ahead only: on demand's share minus map-ahead's, paired per round (median)",
    "saving_low": "its lowest round (same trimming rule as low)",
    "saving_high": "its highest round",
}
RESERVE_BYTES = 64 * 2**30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable on a shared CPU; "
                        "0 keeps torch's default)")
    parser.add_argument("--page-sizes", nargs="+", default=None, help="backend page sizes for map/unmap "
                        "(default 64KiB 2MiB; CUDA 2MiB)")
    parser.add_argument("--pages", type=int, default=None, help="pages mapped per latency measurement (default 256; smoke 32)")
    parser.add_argument("--decode-page-sizes", nargs="+", default=None, help="VMM page sizes of the decode-share runs "
                        "(default 4KiB 64KiB, smoke 4KiB, CUDA 2MiB; small pages map often: the worst case)")
    parser.add_argument("--shape", choices=list(SHAPES), default=None, help="K/V geometry of the decode-share runs (default "
                        "small on CPU, llama3-8b on CUDA, where the small model's 2 MiB page would hardly ever be mapped)")
    parser.add_argument("--layout", choices=list(vmkv.config.LAYOUTS), default=None,
                        help="VMM layout of the decode-share runs (default per_layer on CPU, all_layers on CUDA)")
    parser.add_argument("--batch", type=int, default=None, help="sequences decoding together (default 16; smoke 4)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps (default 256; smoke 16)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the three decode variants (default 9; smoke 2)")


def map_latency(vm: Any, page_size: int, pages: int, rounds: int = 1) -> tuple[list[int], list[int]]:
    """Nanoseconds to map, then to unmap, each of ``pages`` pages one by one into a reservation of
    ``vm``, ``rounds`` times: each call timed alone (a median ignores the calls a busy machine preempts)."""
    base = vm.reserve(page_size * pages)
    addrs = [base + i * page_size for i in range(pages)]
    map_ns, unmap_ns = [], []
    for _ in range(rounds):
        for page, addr in enumerate(addrs):
            start = time.perf_counter_ns()
            vm.map(addr, page)
            map_ns.append(time.perf_counter_ns() - start)
        vm.synchronize()
        for addr in addrs:
            start = time.perf_counter_ns()
            vm.unmap(addr)
            unmap_ns.append(time.perf_counter_ns() - start)
    vm.free_reservation(base, page_size * pages)
    return map_ns, unmap_ns


def _percentiles(samples: list[float]) -> common.Spread:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return common.Spread(statistics.median(ordered), pick(0.1), pick(0.9), len(ordered))


def _reserve_time(device: str, page_size: int) -> common.Spread:
    with open_backend(torch.device(device), page_size, 1) as vm:
        def once() -> None:
            vm.free_reservation(vm.reserve(RESERVE_BYTES), RESERVE_BYTES)

        return common.time_interleaved({"reserve": once}, device, repeat=5).spread("reserve")


SHAPES = {"small": {"num_layers": 4, "num_kv_heads": 4, "head_dim": 32, "dtype": "float32"}, "llama3-8b": common.LLAMA3_8B}
PROMPT = 16  # tokens each sequence holds before the timed steps


def _decode_config(args: argparse.Namespace, page_size: str, map_ahead: bool = False) -> vmkv.KVCacheConfig:
    """The decode-share runs' cache: a budget of exactly the pages the run needs (+1 a sequence), since
    mappings are finite."""
    shape = SHAPES[args.shape]
    probe = common.cache_config(shape, args.device, page_size=page_size, layout=args.layout)
    page = probe.page_size
    pages_per_seq = -(-(PROMPT + args.steps + 1) * probe.tensor_token_bytes() // page) + 1
    return common.cache_config(shape, args.device, max_batch_size=args.batch, max_seq_len=PROMPT + args.steps + 1,
                               page_size=page_size,
                               memory_budget=probe.kv_shape.pieces(args.layout) * page * args.batch * pages_per_seq,
                               layout=args.layout, prefix_caching=False, map_ahead=map_ahead)


def _decode_loop(args: argparse.Namespace, page_size: str, map_ahead: bool, premap: bool) -> tuple[list[float], list[float]]:
    """Decode ``steps`` tokens for ``batch`` sequences: per-step seconds in ``begin_step``, and in all."""
    config = _decode_config(args, page_size, map_ahead)
    layers, heads, dim = config.num_layers, config.num_kv_heads, config.head_dim
    gen = torch.Generator().manual_seed(args.seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype=config.dtype, device=config.device)

    with vmkv.open_cache(config, "vmm") as cache:
        for seq in range(args.batch):
            cache.add(seq)
            if premap:
                cache.reserve(seq, PROMPT + args.steps)
        plan = cache.begin_step({seq: PROMPT for seq in range(args.batch)})
        kv = randn(args.batch * PROMPT, heads, dim)
        for layer in range(layers):
            cache.write(layer, kv, kv, plan)
        k = randn(args.batch, heads, dim)  # k: [B, Hkv, D]
        q = randn(args.batch, 2 * heads, dim)  # q: [B, Hq, D]
        step = {seq: 1 for seq in range(args.batch)}
        begins, totals = [], []
        common.synchronize(args.device)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            plan = cache.begin_step(step)
            t1 = time.perf_counter()
            for layer in range(layers):
                cache.write(layer, k, k, plan)
                cache.attention(layer, q, plan)
            common.synchronize(args.device)
            begins.append(t1 - t0)
            totals.append(time.perf_counter() - t0)
        return begins, totals


VARIANTS = {"on_demand": (False, False), "ahead": (True, False), "premapped": (False, True)}


def _share(begins: dict[str, list[list[float]]], totals: list[list[float]], variant: str) -> common.Spread:
    per_round = zip(begins[variant], begins["premapped"], totals)
    return common.Spread.of([(sum(mine) - sum(base)) / sum(total) for mine, base, total in per_round])


def _saving(begins: dict[str, list[list[float]]], totals: list[list[float]]) -> common.Spread:
    """What map-ahead saves over on demand, paired per round (it cancels what moves a whole round): the verdict."""
    per_round = zip(begins["on_demand"], begins["ahead"], totals)
    return common.Spread.of([(sum(demand) - sum(ahead)) / sum(total) for demand, ahead, total in per_round])


def _measure_shares(args: argparse.Namespace, page_size: str,
                    rounds: int) -> tuple[dict[str, common.Spread], common.Spread, dict[str, common.Spread]]:
    """Both variants' shares, map-ahead's paired saving, and each variant's ms per step, over ``rounds``."""
    begins: dict[str, list[list[float]]] = {name: [] for name in VARIANTS}
    totals: dict[str, list[list[float]]] = {name: [] for name in VARIANTS}
    for r in range(rounds):  # interleaved, in a rotating order
        for name in common.rotated(list(VARIANTS), r):
            begin, total = _decode_loop(args, page_size, *VARIANTS[name])
            begins[name].append(begin)
            totals[name].append(total)
    shares = {name: _share(begins, totals["premapped"], name) for name in ("on_demand", "ahead")}
    step_ms = {name: common.Spread.of([sum(t) / args.steps * 1e3 for t in totals[name]]) for name in VARIANTS}
    return shares, _saving(begins, totals["premapped"]), step_ms


def _errors(shares: dict[str, common.Spread], step_ms: dict[str, common.Spread]) -> dict[str, str]:
    """Variant -> why its measurement is an error: mapping cannot cost less than no mapping, so a negative
    share or a step below the baseline's beyond its spread means the machine moved."""
    base = step_ms["premapped"]
    errors = {}
    for name, share in shares.items():
        why = []
        if share.value < 0:
            why.append(f"negative share {common.number_text(share.value, '%')} (begin_step without mapping took longer)")
        if base.value - step_ms[name].value > base.high - base.low:
            why.append(f"step {step_ms[name].value:.3g} ms, below the no-mapping baseline's {base.value:.3g} ms by more "
                       f"than its spread ({base.low:.3g}-{base.high:.3g} ms)")
        if why:
            errors[name] = "; ".join(why) + ": a negative cost is a measurement error"
    return errors


def _decode_rows(args: argparse.Namespace, page_size: str) -> list[dict[str, Any]]:
    """Mapping's share of decode time for ``page_size``, measured again with twice the rounds if it came out negative."""
    shares, saving, step_ms = _measure_shares(args, page_size, args.rounds)
    if _errors(shares, step_ms):
        shares, saving, step_ms = _measure_shares(args, page_size, 2 * args.rounds)
    errors = _errors(shares, step_ms)
    return [{"measure": "decode_share", "page_size": vmkv.parse_size(page_size), "map_ahead": ahead,
             "value": shares[name].value, "low": shares[name].low, "high": shares[name].high, "step_ms": step_ms[name].value,
             "baseline_step_ms": step_ms["premapped"].value, "runs": shares[name].runs, "reliable": name not in errors,
             "why": errors.get(name, ""), "saving": saving.value if ahead else None,
             "saving_low": saving.low if ahead else None, "saving_high": saving.high if ahead else None}
            for name, ahead in (("on_demand", False), ("ahead", True))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    with common.torch_threads(getattr(args, "threads", None)):
        result = _run(args)
    result["config"]["threads"] = getattr(args, "threads", None) or "torch default"
    return result


def _default_sizes(device: str, host: list[str]) -> list[str]:
    return host if device == "cpu" else ["2MiB"]


def _settings(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the defaults that depend on ``--smoke`` and ``--device`` filled in."""
    cpu = args.device == "cpu"
    return argparse.Namespace(**{
        **vars(args),
        "pages": args.pages or (32 if args.smoke else 256),
        "steps": args.steps or (16 if args.smoke else 256),
        "batch": args.batch or (4 if args.smoke else 16),
        "rounds": args.rounds or (2 if args.smoke else 9),
        "decode_page_sizes": args.decode_page_sizes or _default_sizes(args.device, ["4KiB"] if args.smoke else ["4KiB", "64KiB"]),
        "page_sizes": args.page_sizes or _default_sizes(args.device, ["64KiB", "2MiB"]),
        "shape": args.shape or ("small" if cpu else "llama3-8b"),
        "layout": args.layout or ("per_layer" if cpu else "all_layers"),
    })


def refusals(args: argparse.Namespace, granularity: int) -> dict[str, str]:
    args = _settings(args)
    refused = {f"map/unmap {size} pages": f"{vmkv.parse_size(size)} B is not a multiple of the backend granularity "
                                          f"({granularity} B)"
               for size in args.page_sizes if vmkv.parse_size(size) % granularity}
    planned = [(f"decode-share {size} pages ({args.layout}, {args.shape})", "vmm", _decode_config(args, size))
               for size in args.decode_page_sizes]
    return {**refused, **common.cache_refusals(planned, granularity)}


def _run(args: argparse.Namespace) -> dict[str, Any]:
    common.check_device(args.device)
    args = _settings(args)
    rows: list[dict[str, Any]] = []
    empty = {"map_ahead": None, "step_ms": None, "baseline_step_ms": None, "reliable": True, "why": "", "saving": None,
             "saving_low": None, "saving_high": None}
    work = [("latency", size) for size in args.page_sizes] + [("decode", size) for size in args.decode_page_sizes]
    for what, size in common.progress(work, "mapping", enabled=getattr(args, "progress", False)):
        nbytes = vmkv.parse_size(size)
        if what == "decode":
            rows += _decode_rows(args, size)
            continue
        with open_backend(torch.device(args.device), nbytes, args.pages) as vm:
            map_ns, unmap_ns = map_latency(vm, nbytes, args.pages)
        for measure, ns in (("map_us", map_ns), ("unmap_us", unmap_ns)):
            us = _percentiles(ns).scaled(1e-3)
            rows.append({"measure": measure, "page_size": nbytes, **empty, "value": us.value, "low": us.low, "high": us.high,
                         "runs": us.runs})
    reserve_page = vmkv.parse_size(args.page_sizes[-1])
    reserve = _reserve_time(args.device, reserve_page).scaled(1e3)
    rows.append({"measure": "reserve_64GiB_ms", "page_size": reserve_page, **empty, "value": reserve.value,
                 "low": reserve.low, "high": reserve.high, "runs": reserve.runs})
    variant = lambda r: f"{r['page_size']}B{' ahead' if r['map_ahead'] else ''}"  # noqa: E731
    summary = {
        "backend": "host (Linux mmap + memfd)" if args.device == "cpu" else "cuda (driver VMM)",
        **{m: {r["page_size"]: round(r["value"], 2) for r in rows if r["measure"] == m} for m in ("map_us", "unmap_us")},
        "reserve_64GiB_ms": round(reserve.value, 3),
        "decode_share": {variant(r): round(r["value"], 4) for r in rows if r["measure"] == "decode_share"},
        "unreliable": {variant(r): r["why"] for r in rows if not r["reliable"]},
    }
    decode = {str(vmkv.parse_size(size)): _decode_config(args, size) for size in args.decode_page_sizes}
    config = {"pages": args.pages, "batch": args.batch, "steps": args.steps, "rounds": args.rounds, "clock": "wall",
              "shape": args.shape, "layout": args.layout,
              "tokens_per_page": {size: c.page_size // c.tensor_token_bytes() for size, c in decode.items()}}
    return common.make_result(NAME, SCHEMA, rows, summary, config=config)


def verdicts(result: dict[str, Any]) -> list[common.Verdict]:
    """Mapping's share of a decode step at the smallest page (the most maps), with map-ahead and on demand."""
    shares = [r for r in result["rows"] if r["measure"] == "decode_share"]
    if not shares:
        return []
    page = min(r["page_size"] for r in shares)
    rows = {r["map_ahead"]: r for r in shares if r["page_size"] == page}
    ahead, demand = rows.get(True), rows.get(False)
    config = result.get("config", {})
    tokens = config.get("tokens_per_page", {}).get(str(page))
    geometry = f" = {tokens} tokens, {config['layout']}, {config['shape']}" if tokens else ""
    question = f"mapping cost, share of a decode step ({format_size(page).replace('.0 ', ' ')} pages{geometry}; the most maps)"
    spread = {k: common.Spread(r["value"], r["low"], r["high"], r["runs"],
                               kept=r["runs"] - 2 if r["runs"] >= common.TRIM_FROM else None)
              for k, r in rows.items()}
    bad = [r for r in rows.values() if not r["reliable"]]
    if bad or ahead is None or demand is None:
        why = "; ".join(f"{'ahead' if r['map_ahead'] else 'on demand'}: {r.get('why') or 'negative share'}" for r in bad)
        why = f"{why} (after a rerun with twice the rounds)" if bad else "a variant was not measured"
        return [common.unreliable("mapping.share", question, why, spread.get(True), "%")]
    saving = common.Spread(ahead["saving"], ahead["saving_low"], ahead["saving_high"], ahead["runs"])
    if saving.low > 0:  # map-ahead cheaper in every (kept) round
        winner, side = "map-ahead hides most of it", "map-ahead"
    elif saving.high < 0:
        winner, side = "on demand (map-ahead costs more)", "on demand"
    else:
        winner, side = "tie (map-ahead's saving changes sign between rounds)", "tie"
    return [common.Verdict(
        key="mapping.share", question=question,
        result=f"ahead {common.number_text(ahead['value'], '%')}, on demand {common.number_text(demand['value'], '%')}",
        spread=f"ahead {common.spread_text(spread[True], '%')}", winner=winner, side=side, value=ahead["value"],
        low=ahead["low"], high=ahead["high"],
        note=(f"saves {common.number_text(saving.value, '%')} of a step, rounds "
              f"{common.number_text(saving.low, '%')} to {common.number_text(saving.high, '%')}; "
              f"step {ahead['baseline_step_ms']:.2f} ms without mapping"),
    )]
