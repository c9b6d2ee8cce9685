"""The ``paged_vs_vmm`` section: VMM mode's and paged mode's kernels on the same decode step,
side by side in one process (issue 29's measurements).

* **Translation alone**: vmkv's Triton decode kernel reading VMM mode's slots and the same kernel
  reading paged mode's block tables (blocks of 16 and 256 tokens), on the same K/V: nothing but
  the addressing differs. Every candidate is the kernel object called on its cache's storage and
  plan (the same host path for all; ``cache.attention``'s input checks are left out alike).
* **The bandwidth limit**: each decode kernel's K/V bytes read per second, as a share of the
  device's read bandwidth measured in the same run (``torch.sum`` over a buffer larger than the
  caches).
* **The best paged kernel against VMM mode's**: every paged kernel that runs here against the
  kernel a VMM cache selects.
* **The split count**: the Triton slots kernel at several split counts, and the one
  :func:`vmkv.kernels.triton_attention.choose_num_splits` picks.

Every output is checked against the fp32 reference (a wrong kernel fails the section); missed
speed targets are verdicts, not failures. The section also writes ``proposed_orders``: the
kernels of ``vmkv/kernels/measured.json``'s CUDA orders sorted by what this run measured, with
the GPU and the date, to be reviewed and committed (docs/gpu.md, "Updating the measured orders").
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, replace
from typing import Any, Callable

import torch

import vmkv
from vmkv.kernels import measured, triton_attention
from vmkv.kernels import registry as kernel_registry
from vmkv.vmm.views import unguarded
from vmkv_bench import common

from .workload import TOLERANCE, Shape, compare_ms, decode_config, fill, make_data, reference_decode

BLOCK_SIZES = (16, 256)
SPLIT_COUNTS = (1, 2, 4, 8, 16, 32)
TARGETS = {"slots_share_of_bandwidth": 0.80, "blocks16_over_slots": 1.15, "blocks256_over_slots": 1.05,
           "best_paged_over_vmm": 1 / 0.9}
"""Issue 29's targets: the Triton slots kernel reads at >= 80 % of the read bandwidth; through a
block table it takes <= 1.15x its slots time at block 16 and <= 1.05x at block 256; the best
paged kernel takes <= 1/0.9 of the VMM cache's selected kernel's time (>= 0.9x its speed)."""


def read_bandwidth_gbps(device: torch.device, nbytes: int, repeats: int) -> float:
    """GB/s ``torch.sum`` reads a float32 buffer of ``nbytes`` at (the median of ``repeats``)."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    timings = common.time_interleaved({"sum": lambda: buffer.sum()}, device.type, repeat=repeats, warmup=2)
    return nbytes / timings.median("sum") / 1e9


def _paged_cache(device: torch.device, shape: Shape, block: int) -> vmkv.PagedKVCache:
    itemsize = torch.empty((), dtype=getattr(torch, shape.dtype)).element_size()
    blocks = shape.batch * -(-shape.seq_len // block) + shape.batch
    config = decode_config(device, shape, block_size=block, memory_budget=2 * blocks * block * shape.kv_heads * shape.head_dim * itemsize)
    return vmkv.PagedKVCache(config)


def _kernel_call(name: str, spec: kernel_registry.KernelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 plan: vmkv.StepPlan) -> Callable[[], torch.Tensor] | str:
    """A decode call of kernel ``name`` on ``k``, ``v`` with ``plan``, or why it cannot run here."""
    why = kernel_registry.unavailable(name, spec)
    if why is not None:
        return f"kernel {name} cannot run here: {why}"
    kernel, scale = kernel_registry.build(name, spec), spec.head_dim ** -0.5
    return lambda: kernel(q, k, v, plan, scale)


def decode_kernel(cache: vmkv.KVCacheBase) -> str:
    """The kernel ``cache`` runs decode steps with (its kernel's name is ``decode+other`` when the
    phases differ)."""
    return cache.kernel.partition("+")[0]


def _candidates(device: torch.device, shape: Shape, data, opened: list
                ) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, str], vmkv.StepPlan]:
    """The decode calls to time: ``vmm:<the decode kernel a VMM cache selects>``, ``slots:triton``
    and ``blocks<B>:<each paged kernel>``; what could not run, with why; the VMM cache's plan (the
    VMM cache is ``opened[0]``). Every candidate is a kernel object called on its cache's own
    storage and plan, so every one has the same host path (the caches' input checks, which
    ``cache.attention`` adds, are left out alike)."""
    vmm = vmkv.open_cache(decode_config(device, shape))
    opened.append(vmm)
    plan = fill(vmm, data, shape)
    k, v = map(unguarded, vmm.kv_cache(0))
    spec = kernel_registry.KernelSpec("slots", device, vmm.config.dtype, shape.kv_heads, shape.head_dim)
    calls = {label: _kernel_call(label.partition(":")[2], spec, data.q, k, v, plan)
             for label in (f"vmm:{decode_kernel(vmm)}", "slots:triton")}
    for block in BLOCK_SIZES:
        if block > shape.seq_len:
            continue
        cache = _paged_cache(device, shape, block)
        opened.append(cache)
        paged_plan, pools = fill(cache, data, shape), cache.block_pool(0)
        block_spec = replace(spec, addressing="blocks", block_size=block)
        for name in kernel_registry.names("blocks"):
            calls[f"blocks{block}:{name}"] = _kernel_call(name, block_spec, data.q, *pools, paged_plan)
    fns = {label: call for label, call in calls.items() if callable(call)}
    skipped = {label: why for label, why in calls.items() if isinstance(why, str)}
    return fns, skipped, plan


def _split_sweep(device: torch.device, shape: Shape, data, vmm: vmkv.VirtualKVCache, plan: vmkv.StepPlan) -> dict[str, Any]:
    """The Triton slots kernel at each of :data:`SPLIT_COUNTS` (ms), and the count the rule picks."""
    ok, why = triton_attention.triton_available(device)
    if not ok:
        return {"skipped": why}
    k, v = map(unguarded, vmm.kv_cache(0))
    counts = [n for n in SPLIT_COUNTS if n <= max(2, shape.seq_len // 64)]
    fns = {str(n): (lambda n=n: triton_attention.decode_attention(data.q, k, v, plan.kv_lens_t, slots=plan.slots_t,
                                                                    num_splits=n)) for n in counts}
    times = compare_ms(fns, device, shape)
    chosen = triton_attention.choose_num_splits(shape.batch, shape.kv_heads, shape.seq_len,
                                                triton_attention.multiprocessor_count(device))
    return {"ms_by_splits": times, "chosen": chosen, "fastest": int(min(times, key=times.get))}


def paged_vs_vmm_section(device: torch.device, shape: Shape) -> dict[str, Any]:
    """Every decode candidate timed side by side, checked against the fp32 reference; the
    bandwidth shares, the translation ratios, the split sweep and the verdicts on the targets.
    Samples are a fifth of ``shape.iters`` calls (the slowest paged kernels take milliseconds)."""
    shape = replace(shape, iters=max(1, shape.iters // 5))
    data = make_data(device, shape)
    opened: list = []
    try:
        fns, skipped, plan = _candidates(device, shape, data, opened)
        vmm = opened[0]
        k, v = map(unguarded, vmm.kv_cache(0))
        reference = reference_decode(data.q, k.clone(), v.clone(), plan.slots_t.long())
        tolerance = TOLERANCE[shape.dtype]
        errors = {name: (fn().float() - reference).abs().max().item() for name, fn in fns.items()}
        failures = [f"{name}: max |output - fp32 reference| {err:.3g} > {tolerance:g} ({shape.dtype})"
                    for name, err in errors.items() if not err <= tolerance]
        times = compare_ms(fns, device, shape)
        kv_bytes = 2 * shape.batch * shape.seq_len * shape.kv_heads * shape.head_dim * k.element_size()
        bandwidth = read_bandwidth_gbps(device, max(4 * kv_bytes, 64 << 20), shape.repeats)
        rows = {name: {"ms": ms, "GBps": kv_bytes / ms / 1e6, "share_of_read_bandwidth": kv_bytes / ms / 1e6 / bandwidth,
                       "max_abs_err_vs_fp32_reference": errors[name]} for name, ms in times.items()}
        splits = _split_sweep(device, shape, data, vmm, plan)
        result = {"shape": asdict(shape), "read_bandwidth_GBps": bandwidth, "kv_bytes_read": kv_bytes,
                  "vmm_kernel": decode_kernel(vmm), "candidates": rows, "skipped": skipped, "splits": splits,
                  "tolerance": tolerance, "failures": failures}
        result["ratios"] = ratios(result)
        result["verdicts"] = verdicts(result)
        result["proposed_orders"] = proposed_orders(result, device)
        return result
    finally:
        for cache in opened:
            cache.close()


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
            met = value >= target
            lines.append(f"Triton decode over slots reads at {value:.0%} of the measured read bandwidth "
                         f"({result['read_bandwidth_GBps']:.0f} GB/s): {'meets' if met else 'misses'} the {target:.0%} target")
        else:
            met = value <= target
            lines.append(f"{key.replace('_', ' ')}: {value:.2f}x ({'meets' if met else 'misses'} <= {target:.2f}x)")
    return lines


def proposed_orders(result: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The CUDA decode orders of ``measured.json`` (each entry's ``"decode"``), each kernel placed
    by this run's time (kernels not measured here keep their place after the measured ones), to
    review and commit. Paged kernels are ranked at the largest block size measured, where every
    paged kernel can run (FlashAttention's need 256-token blocks)."""
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


