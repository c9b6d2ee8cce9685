"""The ``paged_vs_vmm`` section: VMM's and paged mode's decode kernels on the same step (the Triton kernel
over slots and block tables, every paged kernel, bandwidth, splits) and this run's ``proposed_orders``."""

from __future__ import annotations

import datetime
from contextlib import closing
from dataclasses import asdict, replace
from typing import Any, Callable

import torch

import vmkv
from vmkv.kernels import measured, triton_attention
from vmkv.kernels import registry as kernel_registry

from .. import common
from ..decode import TOLERANCE, DecodeStep, Shape, compare_ms, decode_config
from ..runner import Context
from .core import off_reference

BLOCK_SIZES = (16, 256)
SPLIT_COUNTS = (1, 2, 4, 8, 16, 32)
TARGETS = {"slots_share_of_bandwidth": 0.80, "blocks16_over_slots": 1.15, "blocks256_over_slots": 1.05,
           "best_paged_over_vmm": 1 / 0.9}
"""Issue 29's targets: a floor on the Triton slots kernel's share of the read bandwidth, a ceiling on each ratio of times."""


def decode_kernel(cache: vmkv.KVCacheBase) -> str:
    """The kernel ``cache`` decodes with (its name is ``decode+other`` when the phases differ)."""
    return cache.kernel.partition("+")[0]


def _configs(device: torch.device, shape: Shape) -> dict[str, tuple[str, vmkv.KVCacheConfig]]:
    token_bytes = shape.kv_heads * shape.head_dim * torch.empty((), dtype=getattr(torch, shape.dtype)).element_size()
    configs = {"vmm": ("vmm", decode_config(device, shape))}
    for block in (b for b in BLOCK_SIZES if b <= shape.seq_len):
        blocks = shape.batch * -(-shape.seq_len // block) + shape.batch
        configs[f"blocks{block}"] = ("paged", decode_config(device, shape, block_size=block,
                                                            memory_budget=2 * blocks * block * token_bytes))
    return configs


def _candidates(step: DecodeStep) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, str]]:
    vmm = decode_kernel(step.caches["vmm"])
    calls = {f"vmm:{vmm}": step.call("vmm", vmm), "slots:triton": step.call("vmm", "triton")}
    for label in (label for label in step.caches if label.startswith("blocks")):
        calls.update({f"{label}:{name}": step.call(label, name) for name in kernel_registry.names("blocks")})
    return ({label: call for label, call in calls.items() if callable(call)},
            {label: why for label, why in calls.items() if isinstance(why, str)})


def _split_sweep(device: torch.device, shape: Shape, step: DecodeStep) -> dict[str, Any]:
    """The Triton slots kernel at each of :data:`SPLIT_COUNTS` (ms), and the count the rule picks."""
    ok, why = triton_attention.triton_available(device)
    if not ok:
        return {"skipped": why}
    (k, v), plan = step.storage("vmm"), step.plans["vmm"]
    counts = [n for n in SPLIT_COUNTS if n <= max(2, shape.seq_len // 64)]
    fns = {str(n): (lambda n=n: triton_attention.decode_attention(step.q, k, v, plan.kv_lens_t, slots=plan.slots_t,
                                                                    num_splits=n)) for n in counts}
    times = compare_ms(fns, device, shape)
    chosen = triton_attention.choose_num_splits(shape.batch, shape.kv_heads, shape.seq_len,
                                                triton_attention.multiprocessor_count(device))
    return {"ms_by_splits": times, "chosen": chosen, "fastest": int(min(times, key=times.get))}


def paged_vs_vmm_section(ctx: Context) -> dict[str, Any]:
    """Every candidate checked against the fp32 reference, timed side by side, and judged against the targets."""
    device, shape = ctx.device, replace(ctx.shape, iters=max(1, ctx.shape.iters // 5))
    step = DecodeStep(_configs(device, shape), shape.batch, shape.seq_len - 1, shape.q_heads)  # its last token decoded
    with closing(step):
        fns, skipped = _candidates(step)
        errors = {name: step.error(fn()) for name, fn in fns.items()}
        times, kv_bytes = compare_ms(fns, device, shape), step.kv_bytes
        bandwidth = common.measure_read_bandwidth(device.type, max(4 * kv_bytes, 64 << 20), shape.repeats).value / 1e9
        rows = {name: {"ms": ms, "GBps": kv_bytes / ms / 1e6, "share_of_read_bandwidth": kv_bytes / ms / 1e6 / bandwidth,
                       "max_abs_err_vs_fp32_reference": errors[name]} for name, ms in times.items()}
        result = {"shape": asdict(shape), "read_bandwidth_GBps": bandwidth, "kv_bytes_read": kv_bytes,
                  "vmm_kernel": decode_kernel(step.caches["vmm"]), "candidates": rows, "skipped": skipped,
                  "splits": _split_sweep(device, shape, step), "tolerance": TOLERANCE[shape.dtype],
                  "failures": off_reference(errors, shape)}
        result["ratios"] = ratios(result)
        result["verdicts"] = verdicts(result)
        result["proposed_orders"] = proposed_orders(result, device)
        return result


def ratios(result: dict[str, Any]) -> dict[str, float]:
    """The ratios the targets name (those whose candidates ran)."""
    ms = {name: row["ms"] for name, row in result["candidates"].items()}
    out: dict[str, float] = {}
    if "slots:triton" in ms:
        out["slots_share_of_bandwidth"] = result["candidates"]["slots:triton"]["share_of_read_bandwidth"]
        for block in BLOCK_SIZES:
            if f"blocks{block}:triton" in ms:
                out[f"blocks{block}_over_slots"] = ms[f"blocks{block}:triton"] / ms["slots:triton"]
    paged = [value for name, value in ms.items() if name.startswith("blocks")]
    vmm = ms.get(f"vmm:{result['vmm_kernel']}")
    if paged and vmm:
        out["best_paged_over_vmm"] = min(paged) / vmm
    return out


def verdicts(result: dict[str, Any]) -> list[str]:
    """One sentence per target: met or not, by how much."""
    lines = []
    for key, value in result["ratios"].items():
        target = TARGETS[key]
        if key == "slots_share_of_bandwidth":
            lines.append(f"Triton decode over slots reads at {value:.0%} of the measured read bandwidth "
                         f"({result['read_bandwidth_GBps']:.0f} GB/s): {'meets' if value >= target else 'misses'} "
                         f"the {target:.0%} target")
        else:
            lines.append(f"{key.replace('_', ' ')}: {value:.2f}x ({'meets' if value <= target else 'misses'} <= {target:.2f}x)")
    return lines


def proposed_orders(result: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``measured.json``'s CUDA decode orders sorted by this run's times, to review and commit."""
    if device.type != "cuda":
        return {}
    name = torch.cuda.get_device_name(device)
    today = datetime.date.today().isoformat()
    largest = max((b for b in BLOCK_SIZES if any(label.startswith(f"blocks{b}:") for label in result["candidates"])),
                  default=None)
    timed: dict[str, dict[str, float]] = {"slots": {}, "blocks": {}}
    for label, row in result["candidates"].items():
        where, _, kernel = label.partition(":")
        if where in ("vmm", "slots"):
            timed["slots"][kernel] = min(row["ms"], timed["slots"].get(kernel, float("inf")))
        elif where == f"blocks{largest}":
            timed["blocks"][kernel] = row["ms"]
    orders = {}
    for addressing, kernels in timed.items():
        current = measured.order("cuda", addressing).decode
        ranked = sorted(kernels, key=kernels.get)
        orders[f"cuda/{addressing}"] = {
            "decode": ranked + [k for k in current if k not in ranked],
            "machine": f"{name}, torch {torch.__version__}", "command": "python benchmarks/gpu_check.py",
            "date": today, "result": ", ".join(f"{k} {kernels[k]:.4f} ms" for k in ranked),
        }
    return orders


def paged_vs_vmm_headline(result: dict[str, Any]) -> str:
    """The Triton kernel's bandwidth share and block-16 translation cost, or why not measured."""
    r = result["ratios"]
    if "slots_share_of_bandwidth" not in r:
        return f"Triton not measured ({result['skipped'].get('slots:triton', 'not run')})"
    parts = [f"Triton slots {r['slots_share_of_bandwidth']:.0%} of read bandwidth"]
    if "blocks16_over_slots" in r:
        parts.append(f"block 16 {r['blocks16_over_slots']:.2f}x slots")
    if "best_paged_over_vmm" in r:
        parts.append(f"best paged {r['best_paged_over_vmm']:.2f}x VMM's time")
    return "; ".join(parts)
