"""Batched vs per-sequence decode attention on the VMM cache: the measurements behind the rule
that ``sdpa_adaptive`` (vmkv.kernels.contiguous) uses to choose between them at every step.

Run: ``python -m vmkv_bench.contiguous_decode [--dtype float32 bfloat16] [--threads 1] [--repeat 7]``

For each workload (batch size, per-sequence lengths, which slots they occupy) one one-layer VMM
cache holds the K/V; one decode step is timed with both kernels, taking turns (median of
``--repeat``, spread = min..max), and the outputs are compared. Then the cost model of
:class:`vmkv.kernels.contiguous.BatchRule` is fitted by least squares::

    per-sequence  t = call * B + key * sum(L)
    batched       t = run_key * span * max_kv + real_key * sum(L)  (+ ~one call)

(``span``: slots from the lowest to the highest slot of the step, dummy rows included;
``max_kv``: the longest sequence). The verdict says how often the fitted rule picks the faster
kernel and what the wrong picks cost, against the constants built into vmkv. Machine noise:
rerun on a quiet machine; the ratios are what matters.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

import vmkv
from vmkv.kernels.contiguous import DEFAULT_BATCH_RULE, BatchRule, plan_decode_batch, sdpa_decode_batched, sdpa_per_sequence

from . import common

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def workloads(quick: bool) -> list[tuple[str, list[int], int]]:
    """``(name, lengths, slot_every)``: sequences of ``lengths`` in slots 0, k, 2k, ... (k = slot_every)."""
    out = []
    batches, contexts = ((4, 32), (128, 2048)) if quick else ((4, 8, 32), (128, 512, 2048))
    for b in batches:
        for n in contexts:
            out.append((f"B={b} equal {n}", [n] * b, 1))
            out.append((f"B={b} spread 2..{n}", [max(2, n * (i + 1) // b) for i in range(b)], 1))
            out.append((f"B={b} one {n}, rest 32", [n] + [32] * (b - 1), 1))
            out.append((f"B={b} equal {n}, every 2nd slot", [n] * b, 2))
            out.append((f"B={b} 90% of {n}, every 2nd slot", [n - n // 10 * (i % 2) for i in range(b)], 2))
    return out


def _cache(lengths: list[int], every: int, dtype: str) -> tuple[vmkv.VirtualKVCache, vmkv.StepPlan]:
    """A one-layer cache holding ``lengths`` tokens in slots 0, every, 2*every, ...; and a decode plan."""
    slots = len(lengths) * every
    token_bytes = KV_HEADS * HEAD_DIM * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    budget = 2 * (sum(lengths) + len(lengths) * 256) * token_bytes + (8 << 20)
    cache = vmkv.VirtualKVCache(vmkv.KVCacheConfig(
        num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype, max_batch_size=slots,
        max_seq_len=max(lengths) + 1, memory_budget=budget, page_size="64KiB", prefix_caching=False,
    ))
    gen = torch.Generator().manual_seed(0)
    for slot in range(slots):
        cache.add(slot)
    used = list(range(0, slots, every))
    for slot, n in zip(used, lengths):
        plan = cache.begin_step({slot: n - 1})
        k = torch.randn(n - 1, KV_HEADS, HEAD_DIM, generator=gen).to(cache.config.dtype)
        cache.write(0, k, torch.randn(k.shape, generator=gen).to(k.dtype), plan)
    plan = cache.begin_step({slot: 1 for slot in used})
    k = torch.randn(len(used), KV_HEADS, HEAD_DIM, generator=gen).to(cache.config.dtype)
    cache.write(0, k, k, plan)
    return cache, plan


def measure(lengths: list[int], every: int, dtype: str, repeat: int) -> dict:
    """Median (and spread) of both kernels on one decode step, interleaved."""
    cache, plan = _cache(lengths, every, dtype)
    try:
        q = torch.randn(len(lengths), Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(cache.config.dtype)
        k, v = cache._k[0], cache._v[0]
        decode = list(range(len(lengths)))
        candidates = {
            "per_sequence": lambda: sdpa_per_sequence(q, k, v, plan, None),
            "batched": lambda: sdpa_decode_batched(q, k, v, plan_decode_batch(plan, decode, None), None),
        }
        outs = {name: fn() for name, fn in candidates.items()}  # warm-up, and the check
        diff = (outs["per_sequence"].float() - outs["batched"].float()).abs().max().item()
        times = common.time_interleaved(candidates, "cpu", repeat=repeat, warmup=0).samples  # warmed up above
        batch = plan_decode_batch(plan, decode, None)
        return {
            "B": len(lengths), "sum_kv": sum(lengths), "span_keys": batch.span * batch.max_kv, "max_abs_diff": diff,
            **{f"{name}_ms": statistics.median(t) * 1e3 for name, t in times.items()},
            **{f"{name}_best_ms": min(t) * 1e3 for name, t in times.items()},
            **{f"{name}_spread": (min(t) * 1e3, max(t) * 1e3) for name, t in times.items()},
        }
    finally:
        cache.close()


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a handful of unknowns: try every active set)."""
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.sum(b**2))
    for mask in range(1, 2**n):
        cols = [j for j in range(n) if mask >> j & 1]
        x = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if (x < 0).any():
            continue
        full = np.zeros(n)
        full[cols] = x
        err = float(np.sum((a @ full - b) ** 2))
        if err < best_err:
            best, best_err = full, err
    return best


def fit(rows: list[dict]) -> BatchRule:
    """Constants of both cost models (microseconds, all >= 0), least squares on relative error
    (each workload weighs the same, whatever its size) of the *best* time of each kernel: on a
    shared machine the minimum is the least disturbed estimate of what a kernel costs."""
    per = np.array([r["per_sequence_best_ms"] * 1e3 for r in rows])
    a = np.array([[r["B"], r["sum_kv"]] for r in rows], dtype=float) / per[:, None]
    call, key = _nonnegative_lstsq(a, np.ones(len(rows)))
    bat = np.array([r["batched_best_ms"] * 1e3 for r in rows])
    b = np.array([[r["span_keys"], r["sum_kv"], 1.0] for r in rows], dtype=float) / bat[:, None]
    run_key, real_key, fixed = _nonnegative_lstsq(b, np.ones(len(rows)))
    return BatchRule(call_us=round(float(call), 3), key_us=round(float(key), 4), run_key_us=round(float(run_key), 4),
                     real_key_us=round(float(real_key), 4), fixed_us=round(float(fixed), 3))


def judge(rule: BatchRule, rows: list[dict]) -> tuple[int, float]:
    """How many workloads ``rule`` gets right, and the worst slowdown of its picks vs the faster kernel."""
    right, worst = 0, 1.0
    for r in rows:
        per_sequence, batched = rule.predict(r["B"], r["span_keys"], r["sum_kv"])
        picked = r["batched_ms"] if batched < per_sequence else r["per_sequence_ms"]
        best = min(r["batched_ms"], r["per_sequence_ms"])
        right += picked == best
        worst = max(worst, picked / best)
    return right, worst


def run(dtype: str, repeat: int, quick: bool) -> None:
    print(f"dtype={dtype} q_heads={Q_HEADS} kv_heads={KV_HEADS} head_dim={HEAD_DIM} threads={torch.get_num_threads()} "
          f"(ms per layer, median of {repeat}, candidates interleaved)")
    print(f"{'workload':36s}{'per_seq':>9s}{'batched':>9s}{'per/bat':>8s}{'sum L':>8s}{'span*max':>9s}  spread per_seq | batched")
    rows = []
    for name, lengths, every in workloads(quick):
        r = measure(lengths, every, dtype, repeat)
        rows.append(r)
        (p0, p1), (b0, b1) = r["per_sequence_spread"], r["batched_spread"]
        print(f"{name:36s}{r['per_sequence_ms']:9.3f}{r['batched_ms']:9.3f}{r['per_sequence_ms'] / r['batched_ms']:8.2f}"
              f"{r['sum_kv']:8d}{r['span_keys']:9d}  {p0:.2f}-{p1:.2f} | {b0:.2f}-{b1:.2f}   diff {r['max_abs_diff']:.1e}", flush=True)
    fitted = fit(rows)
    print(f"fitted here: {fitted}")
    for label, rule in (("fitted here", fitted), ("built into vmkv", DEFAULT_BATCH_RULE)):
        right, worst = judge(rule, rows)
        print(f"rule {label}: picks the faster kernel in {right}/{len(rows)} workloads; worst pick is {worst:.2f}x the faster one")
    best = max(rows, key=lambda r: r["per_sequence_ms"] / r["batched_ms"])
    print(f"verdict: batching gains at most {best['per_sequence_ms'] / best['batched_ms']:.2f}x here (equal lengths, "
          f"dense slots); with unequal lengths or sparse slots per-sequence wins, so the rule decides per step.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="fewer workloads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in args.dtype:
        run(dtype, args.repeat, args.quick)


if __name__ == "__main__":
    main()
