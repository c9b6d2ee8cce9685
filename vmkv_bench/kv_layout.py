"""Which per-layer K/V layout does CPU decode attention read fastest, and does virtual memory cost
the kernel anything? The measurements behind the VMM layout choice (issue 11, item 2).

Run: ``python -m vmkv_bench.kv_layout [--dtype float32 bfloat16] [--batches 8 32]
[--contexts 2048 8192] [--threads 1] [--repeat 7] [--max-gib 4]``

One decode step (one query per sequence, every sequence ``context`` tokens long) of one layer,
32 query heads over 8 KV heads of 128, with the vmkv contiguous kernels, on:

    token-major  [B, S, H, D]    the VMM per-layer layout (FlashAttention's), a dense tensor
    head-major   [B, H, S, D]    DynamicCache's layout, a dense tensor
    all-layers   [B, S, L, H, D] one layer's strided slice (L = 8), a dense tensor (B <= 8 only)
    vmm          [B, S, H, D]    the same K/V in a VirtualKVCache (host virtual memory), per_layer
    vmm-hm       [B, H, S, D]    the same in a VirtualKVCache with layout="head_major"

Candidates take turns (median of ``--repeat``, spread min..max); every output is checked
against the token-major batched one. The read bandwidth (``torch.sum`` over 512 MiB) is measured
in the same rounds, so ``KV GB/s / bandwidth`` is a same-moment fraction. The verdict names the
fastest layout per dtype and how sure the measurement is (ratio spread across rounds).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch

import vmkv
from vmkv.core.step import StepPlan
from vmkv.kernels.contiguous import slot_kernel
from vmkv.vmm.views import unguarded

from . import common

Q_HEADS, KV_HEADS, HEAD_DIM, ALL_LAYERS = 32, 8, 128, 8


def decode_plan(batch: int, context: int) -> StepPlan:
    """A decode plan: sequence ``i`` in slot ``i``, ``context`` cached tokens plus the new one."""
    lengths = [context + 1] * batch
    return StepPlan(
        seq_ids=tuple(range(batch)), slots=tuple(range(batch)), starts=(context,) * batch, q_lens=(1,) * batch,
        kv_lens=tuple(lengths), cu_q=torch.arange(batch + 1, dtype=torch.int32), write_rows=torch.zeros(0, dtype=torch.long),
        slots_t=torch.arange(batch, dtype=torch.int32), kv_lens_t=torch.tensor(lengths, dtype=torch.int32),
        block_table=None, causal_masks=(None,) * batch, version=0,
    )


class Setup:
    """The same K/V in every layout of one (batch, context, dtype)."""

    def __init__(self, batch: int, context: int, dtype: torch.dtype, all_layers: bool) -> None:
        gen = torch.Generator().manual_seed(0)
        length = context + 1
        shape = (batch, length, KV_HEADS, HEAD_DIM)
        self.k = torch.randn(shape, generator=gen).to(dtype)  # token-major [B, S, H, D]
        self.v = torch.randn(shape, generator=gen).to(dtype)
        self.k_hm = self.k.transpose(1, 2).contiguous()  # head-major [B, H, S, D]
        self.v_hm = self.v.transpose(1, 2).contiguous()
        self.k_all = self.v_all = None
        if all_layers:
            self.k_all = torch.zeros(batch, length, ALL_LAYERS, KV_HEADS, HEAD_DIM, dtype=dtype)
            self.v_all = torch.zeros_like(self.k_all)
            self.k_all[:, :, 3], self.v_all[:, :, 3] = self.k, self.v
        self.cache = self._vmm(batch, length, dtype, "per_layer")
        self.cache_hm = self._vmm(batch, length, dtype, "head_major")
        self.q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
        self.plan = decode_plan(batch, context)
        self.kv_bytes = 2 * self.k.numel() * self.k.element_size()

    def _vmm(self, batch: int, length: int, dtype: torch.dtype, layout: str) -> vmkv.VirtualKVCache:
        token_bytes = KV_HEADS * HEAD_DIM * self.k.element_size()
        cache = vmkv.VirtualKVCache(vmkv.KVCacheConfig(
            num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype, max_batch_size=batch,
            max_seq_len=length, memory_budget=2 * batch * (length + 1024) * token_bytes, page_size="256KiB",
            layout=layout, prefix_caching=False,
        ))
        for seq in range(batch):
            cache.add(seq)
            plan = cache.begin_step({seq: length})
            cache.write(0, self.k[seq], self.v[seq], plan)
        return cache

    def layouts(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Name -> (K, V) as the kernels take them: logical ``[B, S, H, D]`` views."""
        out = {
            "token-major": (self.k, self.v),
            "head-major": (self.k_hm.transpose(1, 2), self.v_hm.transpose(1, 2)),
            "vmm": tuple(map(unguarded, self.cache.kv_cache(0))),  # plain tensors: time the kernel alone
            "vmm-hm": tuple(map(unguarded, self.cache_hm.kv_cache(0))),
        }
        if self.k_all is not None:
            out["all-layers"] = (self.k_all[:, :, 3], self.v_all[:, :, 3])
        return out

    def close(self) -> None:
        self.cache.close()
        self.cache_hm.close()


def measure(batch: int, context: int, dtype: torch.dtype, repeat: int) -> dict:
    setup = Setup(batch, context, dtype, all_layers=batch <= 8)
    try:
        probe = torch.ones(512 << 20 >> 2, dtype=torch.float32)
        fns: dict[str, Callable[[], object]] = {"bandwidth": lambda: probe.sum()}
        outs = {}
        for layout, (k, v) in setup.layouts().items():
            for kernel in ("sdpa_batched", "sdpa_per_sequence"):
                fn = slot_kernel(kernel)
                call = lambda fn=fn, k=k, v=v: fn(setup.q, k, v, setup.plan, None)  # noqa: E731
                fns[f"{layout} {kernel}"] = call
                outs[f"{layout} {kernel}"] = call().float()
        ref = outs["token-major sdpa_batched"]
        diff = max((o - ref).abs().max().item() for o in outs.values())
        times = common.time_interleaved(fns, "cpu", repeat=repeat).samples  # one warm-up call each
        bandwidth = [probe.numel() * 4 / t / 1e9 for t in times.pop("bandwidth")]
        return {"times": times, "bandwidth": bandwidth, "kv_bytes": setup.kv_bytes, "max_abs_diff": diff}
    finally:
        setup.close()


def ratio_stats(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Median and min..max of the per-round ratio ``a / b`` (rounds paired: same moment)."""
    ratios = [x / y for x, y in zip(a, b)]
    return statistics.median(ratios), min(ratios), max(ratios)


def report(batch: int, context: int, dtype: torch.dtype, r: dict) -> dict[str, float]:
    times, bw = r["times"], statistics.median(r["bandwidth"])
    base = times["token-major sdpa_batched"]
    print(f"\nB={batch} context={context} {str(dtype).removeprefix('torch.')}: read bandwidth {bw:.1f} GB/s "
          f"(spread {min(r['bandwidth']):.1f}-{max(r['bandwidth']):.1f}); max |diff| {r['max_abs_diff']:.1e}")
    print(f"  {'candidate':36s}{'ms':>9s}{'spread':>17s}{'KV GB/s':>9s}{'of bw':>7s}{'vs token-major batched':>26s}")
    for name, ts in times.items():
        median = statistics.median(ts)
        gbps = r["kv_bytes"] / median / 1e9
        ratio, lo, hi = ratio_stats(base, ts)
        print(f"  {name:36s}{median * 1e3:9.2f}{min(ts) * 1e3:8.2f}-{max(ts) * 1e3:<8.2f}{gbps:9.2f}{gbps / bw:7.0%}"
              f"{ratio:11.2f}x ({lo:.2f}-{hi:.2f})")
    return {name: ratio_stats(base, ts)[0] for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--max-gib", type=float, default=4.0, help="skip configurations whose tensors need more memory")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"decode attention, {Q_HEADS} query / {KV_HEADS} KV heads of {HEAD_DIM}, threads={torch.get_num_threads()}, "
          f"median of {args.repeat} interleaved rounds; ratios > 1: faster than token-major batched")
    speedups: dict[str, dict[str, list[float]]] = {}
    for name in args.dtype:
        dtype = getattr(torch, name)
        for batch in args.batches:
            for context in args.contexts:
                need = 2 * batch * (context + 1) * KV_HEADS * HEAD_DIM * dtype.itemsize * (4 + (ALL_LAYERS if batch <= 8 else 0))
                if need > args.max_gib * 2**30:
                    print(f"\nB={batch} context={context} {name}: skipped, needs {need / 2**30:.1f} GiB (> --max-gib)")
                    continue
                ratios = report(batch, context, dtype, measure(batch, context, dtype, args.repeat))
                for candidate, ratio in ratios.items():
                    speedups.setdefault(name, {}).setdefault(candidate, []).append(ratio)
    print("\nverdict (median over configurations of the speed relative to token-major batched SDPA):")
    for name, table in speedups.items():
        best = max(table, key=lambda c: statistics.median(table[c]))
        cells = ", ".join(f"{c} {statistics.median(v):.2f}x" for c, v in sorted(table.items(), key=lambda kv: -statistics.median(kv[1])))
        print(f"  {name}: fastest is {best}; {cells}")


if __name__ == "__main__":
    main()
