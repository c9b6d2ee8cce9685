"""Side-by-side timing of the paged CPU kernels on identical work (decides the CPU default).

Run: ``python -m benchmarks.paged_kernels [--dtype float32|bfloat16] [--chunk-tokens 256] [--layers 2] [--repeat 5] [--threads 1]``

For each workload one cache per kernel holds the same K/V; the time is one step's attention
over ``--layers`` layers (per-step metadata included, as a model pays it), best of
``--repeat``, reported per layer. Also checks that the kernels agree.
"""

from __future__ import annotations

import argparse
import time

import torch

from vmkv.config import KVCacheConfig

from paged.attention import DEFAULT_CHUNK_TOKENS
from paged.cache import PagedKVCache

KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 8, 32, 128, 16

# name -> (cached tokens per sequence, new tokens per sequence)
WORKLOADS: dict[str, tuple[list[int], list[int]]] = {
    "decode B=32 ctx 128..1020": ([128 + 29 * i for i in range(32)], [1] * 32),
    "decode B=4 ctx 2048": ([2048] * 4, [1] * 4),
    "prefill 1x256 (no prefix)": ([0], [256]),
    "prefill 1x128 after 512 cached": ([512], [128]),
    "mixed 1x128 prefill + 31 decode ctx 512": ([0] + [512] * 31, [128] + [1] * 31),
}


def _fill(cache: PagedKVCache, cached: list[int], layers: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = cache.config.dtype
    for i, n in enumerate(cached):
        cache.add(i)
        if n:
            plan = cache.begin_step({i: n})
            for layer in range(layers):
                k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
                cache.write(layer, k, k.clone(), plan)


def run(dtype: str, layers: int, repeat: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
    kernels = ("gather_sdpa", "blockwise_online_softmax")
    print(f"dtype={dtype} kv_heads={KV_HEADS} q_heads={Q_HEADS} head_dim={HEAD_DIM} block={BLOCK} "
          f"chunk_tokens={chunk_tokens} threads={torch.get_num_threads()}  (ms per layer, best of {repeat})")
    print(f"{'workload':44s}" + "".join(f"{k:>26s}" for k in kernels) + f"{'gather/blockwise':>18s}")
    for name, (cached, new) in WORKLOADS.items():
        total = sum(c + n for c, n in zip(cached, new))
        config = KVCacheConfig(
            layers, KV_HEADS, HEAD_DIM, dtype=dtype, max_batch_size=len(cached), max_seq_len=max(cached) + max(new),
            memory_budget=2 * layers * (total + BLOCK * len(cached)) * KV_HEADS * HEAD_DIM * 4, block_size=BLOCK,
            prefix_caching=False,
        )
        caches, plans, best = [], [], []
        for kernel in kernels:  # identical contents in every cache
            cache = PagedKVCache(config, kernel=kernel, chunk_tokens=chunk_tokens)
            _fill(cache, cached, layers, seed=0)
            caches.append(cache)
            plan = cache.begin_step({i: n for i, n in enumerate(new)})
            gen = torch.Generator().manual_seed(2)
            for layer in range(layers):  # the step's own K/V, as a model writes before attending
                k = torch.randn(plan.num_tokens, KV_HEADS, HEAD_DIM, generator=gen).to(config.dtype)
                cache.write(layer, k, -k, plan)
            plans.append(plan)
            best.append(float("inf"))
        q = torch.randn(sum(new), Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(config.dtype)
        outs = [None] * len(kernels)
        for _ in range(repeat):  # kernels alternate, so both see the same machine load
            for i, (cache, plan) in enumerate(zip(caches, plans)):
                cache._step_meta = None  # pay the per-step preparation every repeat
                t0 = time.perf_counter()
                for layer in range(layers):
                    outs[i] = cache.attention(layer, q, plan).float()
                best[i] = min(best[i], time.perf_counter() - t0)
        for cache in caches:
            cache.close()
        times = [b / layers * 1e3 for b in best]
        diff = (outs[0] - outs[1]).abs().max().item()
        print(f"{name:44s}" + "".join(f"{t:26.2f}" for t in times) + f"{times[0] / times[1]:17.2f}x  (max diff {diff:.1e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run(args.dtype, args.layers, args.repeat, args.chunk_tokens)


if __name__ == "__main__":
    main()
