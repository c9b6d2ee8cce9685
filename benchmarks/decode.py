"""Decode attention: VMM (contiguous) vs paged vs the same kernel on ordinary dense tensors.

For each batch size B and context length C, B sequences of C tokens are written into a
one-layer VMM cache and a one-layer paged cache with identical K/V, then one decode step
(one new token per sequence) is timed, the candidates taking turns::

    vmm            cache.attention on the VMM cache (its contiguous kernel, e.g. sdpa_per_sequence)
    dense          the same contiguous kernel on plain torch tensors of the same layout
                   [B, capacity, kv_heads, head_dim] (issue 2: the cost of virtual memory)
    paged:<name>   each paged kernel over the paged cache's block pools and block table

Achieved bandwidth counts the K and V bytes a step must read (sum of lengths x kv_heads x
head_dim x bytes x 2) and is compared with the machine's read bandwidth measured in the same
run (``torch.sum`` over 512 MiB). Every candidate's output is checked against the VMM one.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import vmkv
from vmkv.attention import select_contiguous_kernel

from . import common

NAME = "decode"
DESCRIPTION = "decode-step attention: VMM contiguous vs paged kernels vs dense tensors, bytes/s vs measured bandwidth"

SCHEMA = {
    "batch": "sequences in the decode step",
    "context": "tokens cached per sequence before the step",
    "paged_kernel": "paged-mode kernel compared in this row",
    "vmm_ms": "VMM decode attention, ms per step (median)",
    "dense_ms": "same contiguous kernel on ordinary dense tensors, ms",
    "paged_ms": "paged kernel, ms",
    "vmm_speedup": "paged_ms / vmm_ms (> 1: VMM faster)",
    "vmm_vs_dense": "dense_ms / vmm_ms (1.0: virtual memory costs nothing)",
    "vmm_gbps": "K/V bytes the step reads / VMM time, GB/s",
    "bw_fraction": "vmm_gbps / measured memory read bandwidth",
    "max_abs_diff": "largest |paged - vmm| and |dense - vmm| output difference",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This benchmark's options (the CLI adds --device, --smoke, --seed, --out)."""
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable on a shared CPU; 0 keeps torch's default)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 8 32; smoke 1 2)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="context lengths (default 512 2048 4096; smoke 64 128)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default=None, help="default float32 on CPU, float16 on CUDA")
    parser.add_argument("--page-size", default="2MiB", help="VMM page size")
    parser.add_argument("--block-size", type=int, default=None, help="paged block size (default 16 on CPU, 256 on CUDA: FlashAttention's paged kernels need multiples of 256)")
    parser.add_argument("--paged-kernels", nargs="+", default=None, help="paged kernels to time; 'selected' is the one paged mode picks here (default: selected gather_sdpa)")
    parser.add_argument("--repeat", type=int, default=None, help="timed runs per candidate (default 5; smoke 2)")


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options whose defaults depend on ``--smoke`` and ``--device``."""
    smoke, cuda = args.smoke, args.device == "cuda"
    return argparse.Namespace(**{
        **vars(args),
        "batches": args.batches or ([1, 2] if smoke else [1, 8, 32]),
        "contexts": args.contexts or ([64, 128] if smoke else [512, 2048, 4096]),
        "dtype": args.dtype or ("float16" if cuda else "float32"),
        "block_size": args.block_size or (256 if cuda else 16),
        "repeat": args.repeat or (2 if smoke else 5),
    })


class _Case:
    """B sequences of C tokens in a VMM cache, a paged cache and dense tensors, ready to decode."""

    def __init__(self, args: argparse.Namespace, batch: int, context: int) -> None:
        shape = {"num_layers": 1, "num_kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype}
        probe = common.cache_config(shape, args.device)
        tokens = batch * (context + 1)
        fields = {"max_batch_size": batch, "max_seq_len": context + 1, "prefix_caching": False}
        page_tokens = vmkv.parse_size(args.page_size) // probe.layer_token_bytes
        vmm_budget = batch * -(-(context + 1) // page_tokens) * page_tokens * probe.bytes_per_token
        paged_budget = (tokens + batch * args.block_size) * probe.bytes_per_token
        self.vmm = vmkv.open_cache(common.cache_config(shape, args.device, page_size=args.page_size, memory_budget=vmm_budget, **fields), "vmm")
        self.paged = vmkv.open_cache(common.cache_config(shape, args.device, block_size=args.block_size, memory_budget=paged_budget, **fields), "paged")
        gen = torch.Generator().manual_seed(args.seed)
        dtype, device = self.vmm.config.dtype, self.vmm.config.device

        def randn(*size: int) -> torch.Tensor:
            return torch.randn(*size, generator=gen).to(dtype=dtype, device=device)

        for seq in range(batch):
            k, v = randn(context, args.kv_heads, args.head_dim), randn(context, args.kv_heads, args.head_dim)
            for cache in (self.vmm, self.paged):
                cache.add(seq)
                cache.write(0, k, v, cache.begin_step({seq: context}))
        k, v = randn(batch, args.kv_heads, args.head_dim), randn(batch, args.kv_heads, args.head_dim)
        self.plans = {}
        for cache in (self.vmm, self.paged):
            plan = cache.begin_step({seq: 1 for seq in range(batch)})
            cache.write(0, k, v, plan)
            self.plans[cache.mode] = plan
        self.q = randn(batch, args.q_heads, args.head_dim)  # q: [B, Hq, D], one new token each
        k_cache, v_cache = self.vmm.kv_cache(0)
        self.dense_k, self.dense_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)  # ordinary allocations
        for seq in range(batch):
            slot, length = self.vmm.slot(seq), self.vmm.seq_len(seq)
            self.dense_k[slot, :length], self.dense_v[slot, :length] = self.vmm.kv(seq, 0)
        self.kv_bytes = batch * (context + 1) * probe.layer_token_bytes * 2

    def candidates(self, paged_kernels: list[str]) -> dict[str, Any]:
        """Name -> zero-argument callable running one decode step's attention."""
        from paged.attention import make_paged_kernel

        cfg = self.paged.config
        scale = cfg.head_dim**-0.5
        _, contiguous = select_contiguous_kernel(cfg.device)
        plan_v, plan_p, q = self.plans["vmm"], self.plans["paged"], self.q
        fns = {
            "vmm": lambda: self.vmm.attention(0, q, plan_v),
            "dense": lambda: contiguous(q, self.dense_k, self.dense_v, plan_v, scale),
        }
        k_pool, v_pool = self.paged.block_pool(0)
        for name in paged_kernels:
            kernel = make_paged_kernel(cfg.device, cfg.dtype, cfg.num_kv_heads, cfg.head_dim, cfg.block_size, forced=name)
            meta = kernel.prepare(plan_p, q.shape[1], scale)
            fns[f"paged:{name}"] = lambda kernel=kernel, meta=meta: kernel(q, k_pool, v_pool, plan_p, meta, scale)
        return fns

    def close(self) -> None:
        self.vmm.close()
        self.paged.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every candidate on every (batch, context) of the grid."""
    with common.torch_threads(getattr(args, "threads", None)):
        result = _run(args)
    result["config"]["threads"] = getattr(args, "threads", None) or "torch default"
    return result


def _run(args: argparse.Namespace) -> dict[str, Any]:
    common.check_device(args.device)
    has_paged, why_not = common.paged_available()
    if not has_paged:
        raise vmkv.BackendUnavailable(f"the decode benchmark compares with paged mode; {why_not}")
    args = _defaults(args)
    bandwidth = common.measure_read_bandwidth(args.device)
    grid = [(b, c) for b in args.batches for c in args.contexts]
    rows, kernels = [], {}
    for batch, context in common.progress(grid, "decode grid", enabled=getattr(args, "progress", False)):
        case = _Case(args, batch, context)
        try:
            selected = case.paged.kernel
            wanted = args.paged_kernels or ["selected", "gather_sdpa"]
            paged_kernels = list(dict.fromkeys(selected if name == "selected" else name for name in wanted))
            fns = case.candidates(paged_kernels)
            outs = {name: fn() for name, fn in fns.items()}
            times = common.time_interleaved(fns, args.device, repeat=args.repeat)
            kernels = {"vmm": case.vmm.kernel, "paged_selected": selected}
            for name in paged_kernels:
                diff = max((outs[k].float() - outs["vmm"].float()).abs().max().item() for k in ("dense", f"paged:{name}"))
                vmm_s, dense_s, paged_s = times["vmm"], times["dense"], times[f"paged:{name}"]
                rows.append({
                    "batch": batch, "context": context, "paged_kernel": name,
                    "vmm_ms": vmm_s * 1e3, "dense_ms": dense_s * 1e3, "paged_ms": paged_s * 1e3,
                    "vmm_speedup": paged_s / vmm_s, "vmm_vs_dense": dense_s / vmm_s,
                    "vmm_gbps": case.kv_bytes / vmm_s / 1e9, "bw_fraction": case.kv_bytes / vmm_s / bandwidth,
                    "max_abs_diff": diff,
                })
        finally:
            case.close()
    config = {k: getattr(args, k) for k in ("kv_heads", "q_heads", "head_dim", "dtype", "page_size", "block_size", "repeat")}
    return common.make_result(NAME, SCHEMA, rows, _summary(rows, bandwidth, kernels), config=config)


def _summary(rows: list[dict[str, Any]], bandwidth: float, kernels: dict[str, str]) -> dict[str, Any]:
    summary: dict[str, Any] = {"kernels": kernels, "read_bandwidth_gbps": bandwidth / 1e9}
    selected = [r for r in rows if r["paged_kernel"] == kernels.get("paged_selected")] or rows
    long = [r for r in selected if r["context"] >= 4096]
    if long:
        worst = min(r["vmm_speedup"] for r in long)
        summary["vmm_speedup_ctx_ge_4k_min"] = worst
        summary["goal_vmm_1.2x_paged_ctx_ge_4k"] = worst >= 1.2
    largest = max(selected, key=lambda r: r["batch"] * r["context"])
    summary["largest_point"] = {k: largest[k] for k in ("batch", "context", "vmm_gbps", "bw_fraction")}
    summary["goal_vmm_50pct_bandwidth"] = largest["bw_fraction"] >= 0.5
    issue2 = [r for r in selected if r["batch"] == 32 and r["context"] == 2048]  # issue 2: 32 x 2K tokens
    if issue2:
        summary["vmm_vs_dense_32x2k"] = issue2[0]["vmm_vs_dense"]
        summary["goal_vmm_ge_0.9_dense_32x2k"] = issue2[0]["vmm_vs_dense"] >= 0.9
    summary["max_abs_diff"] = max(r["max_abs_diff"] for r in rows)
    return summary


def plot(result: dict[str, Any], out_dir) -> list[str]:
    """``decode_time.png``: ms per step vs context, one panel per batch size, one line per candidate."""
    plt = common.pyplot()
    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.8), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        mine = [r for r in rows if r["batch"] == batch]
        contexts = sorted({r["context"] for r in mine})
        first = [next(r for r in mine if r["context"] == c) for c in contexts]
        ax.plot(contexts, [r["vmm_ms"] for r in first], "o-", label=f"vmm ({result['summary']['kernels'].get('vmm')})")
        ax.plot(contexts, [r["dense_ms"] for r in first], "x--", label="dense tensors, same kernel")
        for kernel in dict.fromkeys(r["paged_kernel"] for r in mine):
            ax.plot(contexts, [r["paged_ms"] for r in mine if r["paged_kernel"] == kernel], "s-", label=f"paged ({kernel})")
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per decode step (1 layer)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return [common.save_figure(fig, out_dir, "decode_time.png")]
