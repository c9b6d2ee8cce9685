"""The GPU check's shared workload: the decode shape, its data, a cache sized for it, the fp32
reference and the timing helpers (used by the sections in :mod:`vmkv_bench.gpu.core`)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable

import torch

import vmkv
from vmkv.core.step import StepPlan
from vmkv_bench import common

MiB = 1 << 20


@dataclass(frozen=True)
class Shape:
    """The decode workload: ``batch`` sequences of ``seq_len`` tokens (the last one decoded now)."""

    batch: int
    seq_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    iters: int  # kernel calls per timed sample
    repeats: int  # timed samples per variant (the median is reported)
    map_pages: int  # pages in the map/unmap measurement
    paged_block: int  # block_size of the paged caches


FULL = Shape(32, 2048, 32, 8, 128, "float16", iters=50, repeats=7, map_pages=256, paged_block=256)
SMOKE = Shape(4, 64, 4, 2, 16, "float32", iters=2, repeats=2, map_pages=16, paged_block=16)

# Largest |output - fp32 reference| a correct decode kernel may show, per K/V dtype. The data are
# randn, so every output is a convex combination of V rows (|o| < ~5, typically < 0.3) and a
# correct kernel errs only by rounding: its output, and scores or probabilities it keeps in the
# storage dtype, are each off by about eps relative (fp16 eps 9.8e-4, bf16 7.8e-3), which gives
# errors of a few eps x |o|. The bounds leave about 5 eps (fp16, and bf16 with its 3 fewer
# mantissa bits 8x that); float32 sums 2048 terms in another order than the reference, ~1e-6.
# A kernel that drops or repeats a token, reads another sequence or masks wrongly errs by
# 1e-2 (one token of 2048 dropped) to 1 at these shapes: above every bound.
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2}


def compare_ms(fns: dict[str, Callable[[], Any]], device: torch.device, shape: Shape) -> dict[str, float]:
    """Median ms per call of each variant, timed by :func:`vmkv_bench.common.time_interleaved`
    (rounds of every variant in a fresh order, so that clock and thermal drift hit all alike;
    each sample is ``shape.iters`` back-to-back calls, the GPU synchronized before the clock is read)."""
    batches = {name: (lambda fn=fn: [fn() for _ in range(shape.iters)]) for name, fn in fns.items()}
    timings = common.time_interleaved(batches, device.type, repeat=shape.repeats, warmup=2)
    return {name: timings.median(name) * 1e3 / shape.iters for name in fns}


def percentiles_us(values_ns: list[int]) -> dict[str, float]:
    """``median``, ``p90``, ``mean`` and ``max`` of nanosecond samples, in microseconds."""
    ordered = sorted(values_ns)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3  # noqa: E731
    return {"median": pick(0.5), "p90": pick(0.9), "mean": statistics.fmean(ordered) / 1e3, "max": ordered[-1] / 1e3}


def page_size_for(device: torch.device, token_bytes: int) -> int:
    """The backend granularity on CUDA (2 MiB usually); 4 KiB pages for the CPU dry run."""
    if device.type == "cuda":
        from vmkv.vm.cuda import cuda_granularity

        page = cuda_granularity(device)
    else:
        page = 4096
    return math.lcm(page, token_bytes)


def decode_config(device: torch.device, shape: Shape, **fields: Any) -> vmkv.KVCacheConfig:
    """One layer sized to hold exactly ``batch`` sequences of ``seq_len`` tokens."""
    itemsize = torch.empty((), dtype=getattr(torch, shape.dtype)).element_size()
    token_bytes = shape.kv_heads * shape.head_dim * itemsize
    page = page_size_for(device, token_bytes)
    pages_per_seq = -(-shape.seq_len // (page // token_bytes))
    values = dict(
        num_layers=1, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim, dtype=shape.dtype, device=device,
        max_batch_size=shape.batch, max_seq_len=shape.seq_len, memory_budget=2 * shape.batch * pages_per_seq * page,
        page_size=page, prefix_caching=False,
    )
    values.update(fields)
    return vmkv.KVCacheConfig(**values)


@dataclass
class DecodeData:
    """The K/V of the prompt, of the decoded token, and the decode queries (all on the device)."""

    k_prompt: torch.Tensor  # [batch * (seq_len - 1), kv_heads, head_dim]
    v_prompt: torch.Tensor
    k_new: torch.Tensor  # [batch, kv_heads, head_dim]
    v_new: torch.Tensor
    q: torch.Tensor  # [batch, q_heads, head_dim]


def make_data(device: torch.device, shape: Shape) -> DecodeData:
    """Seeded random K/V and queries of ``shape`` on ``device``."""
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, shape.dtype)

    def rand(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen, device=device, dtype=torch.float32).to(dtype)

    prompt = shape.batch * (shape.seq_len - 1)
    kv = (shape.kv_heads, shape.head_dim)
    return DecodeData(rand(prompt, *kv), rand(prompt, *kv), rand(shape.batch, *kv), rand(shape.batch, *kv),
                      rand(shape.batch, shape.q_heads, shape.head_dim))


def fill(cache: vmkv.KVCacheBase, data: DecodeData, shape: Shape) -> StepPlan:
    """Prefill ``seq_len - 1`` tokens per sequence, then begin the decode step; returns its plan."""
    for seq in range(shape.batch):
        cache.add(seq)
    plan = cache.begin_step({seq: shape.seq_len - 1 for seq in range(shape.batch)})
    cache.write(0, data.k_prompt, data.v_prompt, plan)
    plan = cache.begin_step({seq: 1 for seq in range(shape.batch)})
    cache.write(0, data.k_new, data.v_new, plan)
    return plan


def reference_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """fp32 attention of one query per sequence over its whole slot. q: [B, Hq, D]; k, v: [B_max, S, Hkv, D]."""
    batch, q_heads, dim = q.shape
    kv_heads = k.shape[2]
    k, v = k[slots].float(), v[slots].float()  # [B, S, Hkv, D]
    qg = q.float().view(batch, kv_heads, q_heads // kv_heads, dim)
    scores = torch.einsum("bhgd,bshd->bhgs", qg, k) / math.sqrt(dim)
    return torch.einsum("bhgs,bshd->bhgd", scores.softmax(-1), v).reshape(batch, q_heads, dim)
