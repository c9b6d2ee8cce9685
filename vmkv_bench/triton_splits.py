"""How many splits the Triton decode kernel should cut a sequence's keys into: a sweep, and the
rule against it.

    python -m vmkv_bench.triton_splits                      # on a CUDA GPU: the sweep behind the rule
    python -m vmkv_bench.triton_splits --contexts 8192 --batches 1 8 32
    TRITON_INTERPRET=1 python -m vmkv_bench.triton_splits --device cpu --smoke   # the code path, no GPU

For every (keys, sequences) point, vmkv's Triton decode (``decode_attention`` over contiguous
slots, float16, 8 KV heads of 128, 32 query heads) at each split count, each call timed alone as
an eager decode step issues it (the merge launch included), medians of interleaved rounds; then
the count :func:`vmkv.kernels.triton_attention.choose_num_splits` picks and its time against the
point's fastest. It ends with the verdict: at how many points the rule is within 10 % of the
fastest count. docs/gpu.md ("The split rule") has an H200's numbers.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from vmkv.kernels import triton_attention as ta
from vmkv_bench import common

NEAR = 1.10  # the rule's time within this factor of the fastest count's counts as near
KV_HEADS, Q_HEADS, HEAD_DIM = 8, 32, 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m vmkv_bench.triton_splits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: Triton's interpreter (set TRITON_INTERPRET=1)")
    parser.add_argument("--contexts", nargs="+", type=int, default=[2048, 8192], help="keys per sequence")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8, 16, 32, 64], help="sequences per step")
    parser.add_argument("--splits", nargs="+", type=int, default=[1, 2, 3, 4, 8, 16, 32], help="split counts to time")
    parser.add_argument("--repeat", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--smoke", action="store_true", help="tiny points, two rounds (the code path)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.contexts, args.batches, args.splits, args.repeat = [64], [1, 2], [1, 2], 2
    return args


def sweep_point(device: torch.device, keys: int, batch: int, splits: list[int], repeat: int) -> dict[str, Any]:
    """Milliseconds per decode call at each split count for ``batch`` sequences of ``keys`` keys."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    k = torch.randn(batch, keys, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)  # [B, S, Hkv, D]: the slots
    v = torch.randn_like(k)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=dtype, device=device)  # [B, Hq, D]
    lens = torch.full((batch,), keys, dtype=torch.int32, device=device)
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    fns = {n: (lambda n=n: ta.decode_attention(q, k, v, lens, slots=slots, num_splits=n)) for n in splits}
    timings = common.time_interleaved(fns, device.type, repeat=repeat, warmup=2, min_sample_s=0.005)
    ms = {n: timings.median(n) * 1e3 for n in splits}
    rule = ta.choose_num_splits(batch, KV_HEADS, keys, ta.multiprocessor_count(device))
    if rule not in ms:  # the rule's count was not in the sweep: time it too
        ms[rule] = common.time_interleaved({rule: lambda: ta.decode_attention(q, k, v, lens, slots=slots, num_splits=rule)},
                                           device.type, repeat=repeat, warmup=2, min_sample_s=0.005).median(rule) * 1e3
    best = min(ms, key=ms.get)
    return {"keys": keys, "batch": batch, "ms": ms, "best": best, "rule": rule, "rule_over_best": ms[rule] / ms[best]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.check_device(args.device)
    device = torch.device(args.device)
    ok, why = ta.triton_available(device)
    if not ok:
        print(f"triton_splits: the Triton kernels cannot run here: {why}")
        return 2
    points = [sweep_point(device, keys, batch, args.splits, args.repeat) for keys in args.contexts for batch in args.batches]
    for p in points:
        times = " ".join(f"{n}:{p['ms'][n]:.4f}" for n in sorted(p["ms"]))
        print(f"keys {p['keys']:>6} x {p['batch']:>3} sequences: fastest {p['best']} splits ({p['ms'][p['best']]:.4f} ms), "
              f"the rule {p['rule']} ({p['rule_over_best']:.2f}x the fastest)   ms by splits: {times}")
    near = sum(p["rule_over_best"] <= NEAR for p in points)
    worst = max(points, key=lambda p: p["rule_over_best"])
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "Triton's CPU interpreter: not a GPU measurement"
    print(f"verdict: the split rule is within {NEAR - 1:.0%} of the fastest count at {near} of {len(points)} points; "
          f"worst {worst['rule_over_best']:.2f}x at {worst['keys']} keys x {worst['batch']} sequences ({where})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
