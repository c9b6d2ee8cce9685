"""Which slot layout contiguous mode should give vmkv's CPU kernel (issue 20): a kernel microbenchmark.

Run: ``python -m vmkv_bench.vllm_slot_layouts [--repeat 9] [--threads 1] [--clock auto]``

One layer of the addressing benchmark's model (8 query / 4 KV heads, head_dim 64, fp32, vLLM
blocks of 128 tokens), 8 requests of 1,024-1,536 tokens. The same K/V, timed interleaved with
the kernel :func:`vmkv.kernels.registry.make_kernel` picks, over three slot layouts:

* ``kv_interleaved``: ``[slots, tokens, heads, K|V]`` (one range; each token's K and V side by
  side, what vLLM's token-major block holds): K and V are strided views of it;
* ``separate``: one K and one V range ``[slots, tokens, heads, D]`` (token-major, the
  ``per_layer`` layout of :class:`~vmkv.vmm.cache.VirtualKVCache` and of
  :func:`vmkv.vllm.contiguous.pages.plan_contiguous_pages`);
* ``head_major``: K and V ``[slots, heads, tokens, D]`` (each head's tokens contiguous; a piece of
  a block is ``block_size * D * 4`` = 32 KiB, whole OS pages);

the selected kernel's GEMM variant ``gemm_adaptive`` (decode rows as two GEMMs, grouped query
heads, no repeat of K/V) on head-major slots; and vLLM's own ``CPU_ATTN`` kernel
(``cpu_attention_with_kv_cache``) over a block table on vLLM's head-major blocks, the kernel
stock vLLM runs. Two steps: a decode step (one new token per request) and a prefill chunk (256
new tokens of one request after 1,024 cached). Ratios are per round (interleaved, random order
each round), median with spread; ``--clock auto`` times the thread's CPU time with one thread.
The verdicts say which layout the kernel reads fastest, whether GEMMs beat SDPA, and how it
stands against ``CPU_ATTN``.

Measured (docs/vllm.md has the table; 2-core shared machine, 1 thread, 9 rounds): head-major
slots beat token-major ones by 1.6x in decode, the layouts tie in the prefill chunk;
``gemm_adaptive`` ties with ``sdpa_adaptive`` (decode reads each KV head once in both); vLLM's
``CPU_ATTN`` is 1.2-1.5x faster in decode and 1.6-1.7x in the prefill chunk (2.2x / 2.4x in an
earlier run at lower load). Contiguous mode's slots are head-major
(:class:`vmkv.vllm.contiguous.slots.SlotSpace`); what is left of the gap to stock vLLM is the kernel, not
the addressing.
"""

from __future__ import annotations

import argparse
import random
from typing import Any, Callable

import torch

from vmkv.core.step import make_plan
from vmkv.kernels.contiguous import slot_kernel
from vmkv.kernels.registry import KernelSpec, make_kernel

from . import common

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 128
LAYOUTS = ("kv_interleaved", "separate", "head_major")
GEMM_CANDIDATE = "head_major_gemm"  # gemm_adaptive (decode rows as GEMMs) on head-major slots


def slot_views(layout: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k, v`` ``[slots, tokens, heads, D]`` copied into ``layout``'s memory order, returned as
    ``[slots, tokens, heads, D]`` views (what the kernel takes)."""
    if layout == "kv_interleaved":
        kv = torch.cat([k, v], dim=-1).contiguous()
        return kv[..., :HEAD_DIM], kv[..., HEAD_DIM:]
    if layout == "separate":
        return k.contiguous(), v.contiguous()
    return k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)


def vllm_cpu_attn(k: torch.Tensor, v: torch.Tensor, lens: list[int], q_lens: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """vLLM's CPU_ATTN over blocks holding the same K/V (slot ``s``'s block ``j`` is block ``1 + s * nb + j``)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    slots, cap = k.shape[0], k.shape[1]
    nb = cap // BLOCK
    isa = _get_attn_isa(torch.float32, BLOCK, HEAD_DIM)
    cache = torch.zeros(1 + slots * nb, KV_HEADS, 2 * BLOCK, HEAD_DIM)  # [blocks, heads, K rows | V rows, D]
    key_cache, value_cache = cache.chunk(2, dim=2)
    rows = BLOCK + torch.arange(slots * cap)  # token t of slot s: block 1 + s * nb + t // BLOCK
    ops.cpu_attn_reshape_and_cache(k.reshape(-1, KV_HEADS, HEAD_DIM), v.reshape(-1, KV_HEADS, HEAD_DIM), key_cache,
                                   value_cache, rows, isa)  # vLLM's own packing of its blocks
    table = (1 + torch.arange(slots * nb, dtype=torch.int32)).reshape(slots, nb)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=slots, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seq_lens=seq_lens,
        dtype=torch.float32, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)

    def run(q: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl, seq_lens=seq_lens,
            scale=HEAD_DIM ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
            scheduler_metadata=meta, s_aux=None)
        return out

    return run


def workloads(rng: random.Random) -> dict[str, tuple[list[int], list[int]]]:
    """``name -> (kv lengths, new tokens)`` per request."""
    decode = [rng.randint(1024, 1536) for _ in range(8)]
    return {"decode 8 x 1024-1536": (decode, [1] * 8), "prefill 256 after 1024": ([1280], [256])}


def measure(repeat: int, seed: int, clock: str = "wall") -> tuple[list[dict[str, Any]], list[Any]]:
    """Rows (per workload and candidate: median ms, ratio over ``kv_interleaved``) and verdicts."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rows, verdicts = [], []
    for name, (lens, q_lens) in workloads(rng).items():
        slots, cap = len(lens), -(-max(lens) // BLOCK) * BLOCK
        k = torch.randn(slots, cap, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(slots, cap, KV_HEADS, HEAD_DIM, generator=gen)
        q = torch.randn(sum(q_lens), Q_HEADS, HEAD_DIM, generator=gen)
        plan = make_plan(tuple(range(slots)), list(range(slots)), [n - m for n, m in zip(lens, q_lens)], q_lens,
                         device=torch.device("cpu"), write_rows=torch.empty(0, dtype=torch.long))
        kernel = make_kernel(KernelSpec("slots", torch.device("cpu"), torch.float32, KV_HEADS, HEAD_DIM))
        kernel_name = kernel.name
        fns: dict[str, Callable[[], Any]] = {}
        outs = {}
        for layout in LAYOUTS:
            kl, vl = slot_views(layout, k, v)
            fns[layout] = (lambda kl=kl, vl=vl: kernel(q, kl, vl, plan, HEAD_DIM ** -0.5))
            outs[layout] = fns[layout]()
        hk, hv = slot_views("head_major", k, v)
        gemm = slot_kernel("gemm_adaptive")
        fns[GEMM_CANDIDATE] = (lambda: gemm(q, hk, hv, plan, HEAD_DIM ** -0.5))
        outs[GEMM_CANDIDATE] = fns[GEMM_CANDIDATE]()
        fns["vllm_cpu_attn"] = (lambda run=vllm_cpu_attn(k, v, lens, q_lens): run(q))
        outs["vllm_cpu_attn"] = fns["vllm_cpu_attn"]()
        timings = common.time_interleaved(fns, "cpu", repeat=repeat, warmup=2, min_sample_s=0.02, clock=clock)
        for cand in fns:
            error = float((outs[cand] - outs["kv_interleaved"]).abs().max())
            kernel_of = {"vllm_cpu_attn": "CPU_ATTN", GEMM_CANDIDATE: "gemm_adaptive"}.get(cand, kernel_name)
            rows.append({"workload": name, "candidate": cand, "kernel": kernel_of,
                         "ms": 1e3 * timings.median(cand), "vs_interleaved": timings.ratio("kv_interleaved", cand).value,
                         "max_abs_diff": error})
        verdicts.append(common.ratio_verdict(f"slot_layouts.separate.{name}", f"{name}: {kernel_name}, separate K and V "
                                             "ranges over K|V interleaved", timings.ratio("kv_interleaved", "separate"),
                                             "separate", "kv_interleaved"))
        verdicts.append(common.ratio_verdict(f"slot_layouts.head_major.{name}", f"{name}: {kernel_name}, head-major over "
                                             "separate token-major", timings.ratio("separate", "head_major"),
                                             "head_major", "separate"))
        verdicts.append(common.ratio_verdict(f"slot_layouts.gemm.{name}", f"{name}: gemm_adaptive (GEMMs) over "
                                             f"{kernel_name} on head-major slots", timings.ratio("head_major", GEMM_CANDIDATE),
                                             "gemm_adaptive", kernel_name))
        best = min(LAYOUTS, key=timings.median)
        verdicts.append(common.ratio_verdict(f"slot_layouts.cpu_attn.{name}", f"{name}: {kernel_name} on {best} slots over "
                                             "vLLM's CPU_ATTN on blocks", timings.ratio("vllm_cpu_attn", best),
                                             best, "vllm_cpu_attn"))
    return rows, verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", default="auto", help="wall, cpu or auto (cpu time with one thread: what other "
                        "processes of a shared machine cannot inflate)")
    args = parser.parse_args()
    with common.torch_threads(args.threads):
        rows, verdicts = measure(args.repeat, args.seed, common.pick_clock(args.clock, "cpu", args.threads))
    print(common.format_table(rows, list(rows[0])))
    print(common.format_verdicts([v.as_dict() for v in verdicts]))


if __name__ == "__main__":
    main()
