"""Side-by-side timing of the paged CPU kernels against the VMM cache's kernel on identical work
(decides the paged CPU default; issue 11 item 3: paged decode >= 0.8x VMM at 2K, B=1 and B=8).

Run: ``python -m vmkv_bench.paged_kernels [--dtype float32 bfloat16] [--layers 2] [--repeat 7]
[--threads 1 2] [--fragment] [--sweep]``

For each workload one paged cache per kernel and one VMM cache hold the same K/V; the time is
one step's attention over ``--layers`` layers (per-step metadata included, as a model pays
it), median of ``--repeat`` rounds in which the candidates take turns, per layer; the spread
of the per-round ratio to VMM is shown. Outputs are checked against the VMM one.

``--fragment`` hands blocks out in a shuffled order (a long-running server's pool) instead of
in order; ``--sweep`` times ``sdpa_chunked`` at several chunk sizes and run thresholds; ``--threads 1 2`` runs
everything at each thread count (torch's default on this machine is 2).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import vmkv
from vmkv.kernels.paged import DEFAULT_MIN_RUN_TOKENS, DEFAULT_SDPA_CHUNK_TOKENS, ChunkedSDPA
from vmkv.paged.cache import PagedKVCache

KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 8, 32, 128, 16

# name -> (cached tokens per sequence, new tokens per sequence)
WORKLOADS: dict[str, tuple[list[int], list[int]]] = {
    "decode B=1 ctx 2048": ([2048], [1]),
    "decode B=8 ctx 2048": ([2048] * 8, [1] * 8),
    "decode B=32 ctx 128..1020": ([128 + 29 * i for i in range(32)], [1] * 32),
    "prefill 1x256 (no prefix)": ([0], [256]),
    "prefill 1x128 after 512 cached": ([512], [128]),
    "mixed 1x128 prefill + 31 decode ctx 512": ([0] + [512] * 31, [128] + [1] * 31),
}


def _config(cached: list[int], new: list[int], layers: int, dtype: str, **extra) -> vmkv.KVCacheConfig:
    total = sum(c + n for c, n in zip(cached, new))
    elt = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    return vmkv.KVCacheConfig(
        layers, KV_HEADS, HEAD_DIM, dtype=dtype, max_batch_size=len(cached), max_seq_len=max(cached) + max(new),
        memory_budget=4 * layers * (total + 256 * len(cached)) * KV_HEADS * HEAD_DIM * elt + (16 << 20),
        block_size=BLOCK, prefix_caching=False, **extra,
    )


def _fill(cache: vmkv.KVCacheBase, cached: list[int], layers: int, fragment: bool) -> None:
    """Write the same K/V into any cache; with ``fragment`` the pool's blocks are taken in a
    shuffled order first (sequences then get scattered blocks)."""
    gen = torch.Generator().manual_seed(0)
    dtype = cache.config.dtype
    if fragment and cache.mode == "paged":
        free = cache.pool._free
        free[:] = [free[i] for i in torch.randperm(len(free), generator=torch.Generator().manual_seed(9)).tolist()]
    for i, n in enumerate(cached):
        cache.add(i)
        if n:
            plan = cache.begin_step({i: n})
            for layer in range(layers):
                k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
                cache.write(layer, k, -k, plan)


def _step(cache: vmkv.KVCacheBase, new: list[int], layers: int) -> vmkv.StepPlan:
    plan = cache.begin_step({i: n for i, n in enumerate(new)})
    gen = torch.Generator().manual_seed(2)
    for layer in range(layers):  # the step's own K/V, as a model writes before attending
        k = torch.randn(plan.num_tokens, KV_HEADS, HEAD_DIM, generator=gen).to(cache.config.dtype)
        cache.write(layer, k, -k, plan)
    return plan


def run(dtype: str, layers: int, repeat: int, kernels: dict[str, dict], fragment: bool, only: str = "") -> None:
    print(f"\ndtype={dtype} kv_heads={KV_HEADS} q_heads={Q_HEADS} head_dim={HEAD_DIM} block={BLOCK} threads={torch.get_num_threads()} "
          f"blocks {'shuffled' if fragment else 'in order'}  (ms per layer, median of {repeat}; x = VMM time / this, per-round spread)")
    names = ["vmm", *kernels]
    print(f"{'workload':40s}" + "".join(f"{n:>26s}" for n in names))
    for workload, (cached, new) in WORKLOADS.items():
        if only not in workload:
            continue
        caches = {"vmm": vmkv.VirtualKVCache(_config(cached, new, layers, dtype, page_size="64KiB"))}
        for label, options in kernels.items():
            options = dict(options)
            min_run = options.pop("min_run_tokens", None)
            cache = caches[label] = PagedKVCache(_config(cached, new, layers, dtype), **options)
            if min_run is not None:  # the sweep: a run threshold (not a cache option)
                cache._kernel = ChunkedSDPA(BLOCK, options["chunk_tokens"], "cpu", min_run)
        try:
            plans = {}
            for label, cache in caches.items():
                _fill(cache, cached, layers, fragment)
                plans[label] = _step(cache, new, layers)
            q = torch.randn(sum(new), Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
            outs, times = {}, {label: [] for label in caches}
            for round_ in range(repeat + 1):  # round 0 warms up
                for label, cache in caches.items():
                    if cache.mode == "paged":
                        cache._kernel._memo = None  # pay the per-step plan every round
                    start = time.perf_counter()
                    for layer in range(layers):
                        outs[label] = cache.attention(layer, q, plans[label])
                    if round_:
                        times[label].append((time.perf_counter() - start) / layers)
        finally:
            for cache in caches.values():
                cache.close()
        diff = max((o.float() - outs["vmm"].float()).abs().max().item() for o in outs.values())
        cells = []
        for label in names:
            ratios = sorted(v / t for v, t in zip(times["vmm"], times[label]))
            cell = f"{statistics.median(times[label]) * 1e3:.2f}"
            if label != "vmm":
                cell += f" x{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"
            cells.append(cell)
        print(f"{workload:40s}" + "".join(f"{c:>26s}" for c in cells) + f"   max diff {diff:.1e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="torch CPU threads, each in turn")
    parser.add_argument("--fragment", action="store_true", help="shuffle the pool's free blocks first")
    parser.add_argument("--sweep", action="store_true", help="sdpa_chunked at 128..1024 chunk tokens instead of the kernel set")
    parser.add_argument("--only", default="", help="run the workloads whose name contains this text")
    args = parser.parse_args()
    if args.sweep:
        kernels = {
            f"chunk {c} run {r}": {"kernel": "sdpa_chunked", "chunk_tokens": c, "min_run_tokens": r}
            for c, r in ((128, 64), (256, 64), (512, 64), (1024, 64), (256, 16), (256, 256))
        }
    else:
        kernels = {name: {"kernel": name} for name in ("gather_sdpa", "blockwise_online_softmax", "sdpa_chunked")}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in args.dtype:
            run(dtype, args.layers, args.repeat, kernels, args.fragment, args.only)
    print(f"\nverdict: read the x columns (>= 0.8 is the target for decode at 2K, B=1 and B=8); sdpa_chunked's defaults: "
          f"{DEFAULT_SDPA_CHUNK_TOKENS} keys a gathered chunk, runs of >= {DEFAULT_MIN_RUN_TOKENS} keys read in place. Rerun on a quiet machine before "
          "trusting small differences.")


if __name__ == "__main__":
    main()
