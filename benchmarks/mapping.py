"""Mapping overhead of VMM mode (issues 2 and 5).

Three measurements, all on the real backend and cache:

* ``map`` / ``unmap``: latency per page of the virtual-memory backend (host: ``mmap`` of a memfd
  page with ``MAP_FIXED`` / ``PROT_NONE`` over it; CUDA: ``cuMemMap`` + ``cuMemSetAccess`` /
  ``cuMemUnmap``), median over ``--pages`` pages mapped one by one into a reservation, each
  call timed alone. Goal <= 10 us.
* ``reserve``: reserving (and giving back) 64 GiB of address space. Goal < 10 ms.
* ``decode_share``: share of decode-step time spent mapping. A batch of sequences decodes
  ``--steps`` tokens through every layer (``begin_step`` + ``write`` + ``attention``, no model
  around it: the smallest denominator, so the worst share) three times: pages mapped on demand,
  with ``map_ahead=True`` (the next page mapped on a background thread), and with every page
  reserved before the loop (no mapping at all: the baseline). The mapping share is
  ``(begin_step time - baseline begin_step time) / step time``: what mapping adds to the
  critical path. Goal <= 2 % with mapping ahead.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import vmkv
from vmkv.vm import open_backend

from . import common

NAME = "mapping"
DESCRIPTION = "VMM mapping overhead: map/unmap us per page, reserving 64 GiB, share of decode time spent mapping (map_ahead on/off)"

SCHEMA = {
    "measure": "map_us, unmap_us (median per page), reserve_64GiB_ms, or decode_share (mapping share of step time)",
    "page_size": "bytes of one mapped page",
    "map_ahead": "decode_share only: pages of the next step mapped on a background thread",
    "value": "the measured value, in the unit of the measure (us, ms, or a fraction)",
    "step_ms": "decode_share only: mean ms per decode step (all layers)",
    "baseline_step_ms": "decode_share only: the same with every page mapped before the loop",
    "goal": "the goal the value is held to",
    "met": "whether the goal is met",
}
RESERVE_BYTES = 64 * 2**30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This benchmark's options (the CLI adds --device, --smoke, --seed, --out)."""
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable on a shared CPU; 0 keeps torch's default)")
    parser.add_argument("--page-sizes", nargs="+", default=None, help="backend page sizes for map/unmap (default 64KiB 2MiB; CUDA 2MiB)")
    parser.add_argument("--pages", type=int, default=None, help="pages mapped per latency measurement (default 256; smoke 32)")
    parser.add_argument("--decode-page-sizes", nargs="+", default=None, help="VMM page sizes of the decode-share runs (default 4KiB 64KiB, smoke 4KiB, CUDA 2MiB; small pages map often: the worst case)")
    parser.add_argument("--batch", type=int, default=None, help="sequences decoding together (default 16; smoke 4)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps (default 256; smoke 24)")


def _map_latency(device: str, page_size: int, pages: int) -> tuple[float, float]:
    """Median seconds to map, then to unmap, one page, over ``pages`` pages timed one by one
    (the median ignores the calls a busy machine preempts)."""
    vm = open_backend(torch.device(device), page_size, pages)
    try:
        base = vm.reserve(page_size * pages)
        addrs = [base + i * page_size for i in range(pages)]
        map_ns, unmap_ns = [], []
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
    finally:
        vm.close()
    return statistics.median(map_ns) * 1e-9, statistics.median(unmap_ns) * 1e-9


def _reserve_time(device: str, page_size: int) -> float:
    """Seconds to reserve and give back ``RESERVE_BYTES`` of address space (median of 5)."""
    vm = open_backend(torch.device(device), page_size, 1)
    try:
        def once() -> None:
            vm.free_reservation(vm.reserve(RESERVE_BYTES), RESERVE_BYTES)

        return common.time_call(once, device, repeat=5)
    finally:
        vm.close()


def _decode_loop(args: argparse.Namespace, page_size: str, map_ahead: bool, premap: bool) -> tuple[float, float]:
    """Decode ``steps`` tokens for ``batch`` sequences; return (begin_step seconds, total seconds)."""
    shape = {"num_layers": 4, "num_kv_heads": 4, "head_dim": 32, "dtype": "float32"}
    prompt = 16
    page = vmkv.parse_size(page_size)
    pages_per_seq = -(-(prompt + args.steps + 1) * 4 * 32 * 4 // page) + 1  # 512 B a token in each tensor
    config = common.cache_config(  # a budget the run needs (+1 page a sequence), not more: mappings are finite
        shape, args.device, max_batch_size=args.batch, max_seq_len=prompt + args.steps + 1,
        memory_budget=2 * 4 * page * args.batch * pages_per_seq, page_size=page_size, prefix_caching=False,
        map_ahead=map_ahead,
    )
    gen = torch.Generator().manual_seed(args.seed)
    with vmkv.open_cache(config, "vmm") as cache:
        for seq in range(args.batch):
            cache.add(seq)
            if premap:
                cache.reserve(seq, prompt + args.steps)
        plan = cache.begin_step({seq: prompt for seq in range(args.batch)})
        kv = torch.randn(args.batch * prompt, 4, 32, generator=gen).to(config.device)
        for layer in range(4):
            cache.write(layer, kv, kv, plan)
        k = torch.randn(args.batch, 4, 32, generator=gen).to(config.device)  # k: [B, Hkv, D]
        q = torch.randn(args.batch, 8, 32, generator=gen).to(config.device)  # q: [B, Hq, D]
        step = {seq: 1 for seq in range(args.batch)}
        in_begin = 0.0
        common.synchronize(args.device)
        start = time.perf_counter()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            plan = cache.begin_step(step)
            in_begin += time.perf_counter() - t0
            for layer in range(4):
                cache.write(layer, k, k, plan)
                cache.attention(layer, q, plan)
        common.synchronize(args.device)
        return in_begin, time.perf_counter() - start


def _decode_rows(args: argparse.Namespace, page_size: str) -> list[dict[str, Any]]:
    """Mapping share of decode time for ``page_size``, with and without mapping ahead."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in ("on_demand", "ahead", "premapped")}
    for _ in range(1 if args.smoke else 3):  # interleaved repeats; medians below
        runs["on_demand"].append(_decode_loop(args, page_size, False, False))
        runs["ahead"].append(_decode_loop(args, page_size, True, False))
        runs["premapped"].append(_decode_loop(args, page_size, False, True))
    med = {name: sorted(values, key=lambda r: r[1])[len(values) // 2] for name, values in runs.items()}
    base_begin, base_total = med["premapped"]
    rows = []
    for name, ahead in (("on_demand", False), ("ahead", True)):
        begin, total = med[name]
        share = (begin - base_begin) / total
        rows.append({
            "measure": "decode_share", "page_size": vmkv.parse_size(page_size), "map_ahead": ahead,
            "value": share, "step_ms": total / args.steps * 1e3, "baseline_step_ms": base_total / args.steps * 1e3,
            "goal": "<= 0.02 with map_ahead" if ahead else "(reported)", "met": share <= 0.02 if ahead else None,
        })
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Map/unmap latency, 64 GiB reservation time, and the decode-time share of mapping."""
    with common.torch_threads(getattr(args, "threads", None)):
        result = _run(args)
    result["config"]["threads"] = getattr(args, "threads", None) or "torch default"
    return result


def _default_sizes(device: str, host: list[str]) -> list[str]:
    """``host`` on the CPU; on CUDA its smallest mapping, the driver's granularity (2 MiB)."""
    return host if device == "cpu" else ["2MiB"]


def _run(args: argparse.Namespace) -> dict[str, Any]:
    common.check_device(args.device)
    pages = args.pages or (32 if args.smoke else 256)
    args = argparse.Namespace(**{
        **vars(args),
        "steps": args.steps or (16 if args.smoke else 256),
        "batch": args.batch or (4 if args.smoke else 16),
        "decode_page_sizes": args.decode_page_sizes or _default_sizes(args.device, ["4KiB"] if args.smoke else ["4KiB", "64KiB"]),
        "page_sizes": args.page_sizes or _default_sizes(args.device, ["64KiB", "2MiB"]),
    })
    rows: list[dict[str, Any]] = []
    empty = {"map_ahead": None, "step_ms": None, "baseline_step_ms": None}
    work = [("latency", size) for size in args.page_sizes] + [("decode", size) for size in args.decode_page_sizes]
    for what, size in common.progress(work, "mapping", enabled=getattr(args, "progress", False)):
        nbytes = vmkv.parse_size(size)
        if what == "decode":
            rows += _decode_rows(args, size)
            continue
        map_s, unmap_s = _map_latency(args.device, nbytes, pages)
        for measure, seconds in (("map_us", map_s), ("unmap_us", unmap_s)):
            rows.append({"measure": measure, "page_size": nbytes, **empty, "value": seconds * 1e6, "goal": "<= 10 us", "met": seconds <= 10e-6})
    reserve_page = vmkv.parse_size(args.page_sizes[-1])
    reserve_s = _reserve_time(args.device, reserve_page)
    rows.append({"measure": "reserve_64GiB_ms", "page_size": reserve_page, **empty, "value": reserve_s * 1e3, "goal": "< 10 ms", "met": reserve_s < 0.01})
    backend = "host (Linux mmap + memfd)" if args.device == "cpu" else "cuda (driver VMM)"
    summary = {
        "backend": backend,
        "goal_map_unmap_le_10us": all(r["met"] for r in rows if r["measure"] in ("map_us", "unmap_us")),
        "goal_reserve_64GiB_lt_10ms": reserve_s < 0.01,
        "goal_map_ahead_share_le_2pct": all(r["met"] for r in rows if r["measure"] == "decode_share" and r["map_ahead"]),
        "decode_share": {f"{r['page_size']}B{' ahead' if r['map_ahead'] else ''}": r["value"] for r in rows if r["measure"] == "decode_share"},
    }
    return common.make_result(NAME, SCHEMA, rows, summary, config={"pages": pages, "batch": args.batch, "steps": args.steps})
