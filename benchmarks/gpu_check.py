#!/usr/bin/env python
"""One-shot GPU check of vmkv: CUDA tests, decode kernels on VMM views vs dense tensors,
map/unmap latency, and paged vs VMM on the same work. Writes ``DIR/gpu_check.json``.

    python benchmarks/gpu_check.py --out DIR                   # on an NVIDIA GPU, < 5 minutes
    python benchmarks/gpu_check.py --device cpu --smoke --out DIR   # dry run of the same code, seconds

Sections (each runs in its own try/except; a failure is recorded in the JSON with its
traceback and the next section still runs):

    environment   torch/CUDA/driver versions, GPU, granularity, which kernels can run and why not
    tests         pytest on tests/test_cuda.py (CUDA backend contract + cache vs dense reference)
    decode        one decode step, 32 sequences x 2048 tokens, 32 q / 8 kv heads, head_dim 128,
                  fp16: each contiguous kernel on the VMM views and on a dense torch tensor of
                  the same shape and contents; CUDA-event timing, interleaved; ratio vmm/dense
    map_unmap     latency of cuMemMap+cuMemSetAccess and cuMemUnmap per page (2 MiB), of
                  cuMemCreate per page, and of reserving 64 GiB of address space
    paged_vs_vmm  if ``paged`` imports: each paged kernel vs the VMM cache's kernel through
                  ``cache.attention`` on the same K/V (paged block_size 256, as FlashAttention's
                  paged kernels require)

Nothing is installed or downloaded; optional packages (flash-attn, cuda-bindings, ...) are used
when present and reported as missing otherwise. See docs/gpu.md for what each number means.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import vmkv  # noqa: E402
from vmkv.attention import (  # noqa: E402
    CONTIGUOUS_KERNELS,
    contiguous_kernel_unavailable,
    flash_varlen_has_seqused_k,
    has_flash_attn,
    select_contiguous_kernel,
    torch_varlen_features,
)
from vmkv.step import StepPlan  # noqa: E402

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


# ---- timing ----------------------------------------------------------------------------------
def sample_ms(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Mean milliseconds per call of ``fn`` over ``iters`` back-to-back calls (CUDA events on GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    began = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - began) * 1e3 / iters


def compare_ms(fns: dict[str, Callable[[], Any]], device: torch.device, shape: Shape) -> dict[str, float]:
    """Median ms per call of each variant; samples of the variants are interleaved (A B A B ...)
    so that clock and thermal drift hit every variant alike."""
    for fn in fns.values():  # warm up: kernel selection, caches, lazy init
        fn()
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(shape.repeats):
        for name, fn in fns.items():
            samples[name].append(sample_ms(fn, device, shape.iters))
    return {name: statistics.median(values) for name, values in samples.items()}


def percentiles_us(values_ns: list[int]) -> dict[str, float]:
    ordered = sorted(values_ns)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3  # noqa: E731
    return {"median": pick(0.5), "p90": pick(0.9), "mean": statistics.fmean(ordered) / 1e3, "max": ordered[-1] / 1e3}


# ---- workload helpers ------------------------------------------------------------------------
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


# ---- sections --------------------------------------------------------------------------------
def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device, shape: Shape) -> dict[str, Any]:
    dtype = getattr(torch, shape.dtype)
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "vmkv": vmkv.__version__,
        "packages": {name: package_version(name) for name in ("cuda-bindings", "flash-attn", "flashinfer-python", "triton", "cupy-cuda12x", "cupy-cuda13x", "numpy")},
        "flash_attn_installed": has_flash_attn(),
        "aten_flash_varlen_has_seqused_k": flash_varlen_has_seqused_k(),
        "varlen_attn_arguments": sorted(torch_varlen_features()),
        "contiguous_kernels": {
            name: contiguous_kernel_unavailable(name, device, dtype, shape.head_dim) or "available" for name in CONTIGUOUS_KERNELS
        },
        "selected_contiguous_kernel": select_contiguous_kernel(device, dtype, shape.head_dim)[0],
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}", "memory_GiB": round(props.total_memory / 2**30, 1),
                      "multiprocessors": props.multi_processor_count}
        from vmkv.vm.cuda import cuda_granularity

        env["vmm_granularity_bytes"] = cuda_granularity(device)
        try:
            from cuda.bindings import driver

            env["cuda_driver_version"] = driver.cuDriverGetVersion()[1]
        except Exception as exc:  # reported, not fatal: the backend section shows the real error
            env["cuda_driver_version"] = f"unknown ({exc})"
    return env


def run_tests(paths: list[str], timeout: int) -> dict[str, Any]:
    """pytest on ``paths``; its own smoke test is deselected (it would run this script again)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *paths, "-k", "not gpu_check"]
    began = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary[-1] if summary else "")}
    return {
        "ok": proc.returncode == 0,
        "command": " ".join(cmd),
        "returncode": proc.returncode,
        "counts": counts,
        "seconds": round(time.perf_counter() - began, 1),
        "output_tail": output[-4000:],
    }


def decode_section(device: torch.device, shape: Shape, kernels: list[str]) -> dict[str, Any]:
    """Each of ``kernels`` (contiguous-mode names) on the VMM views vs on a dense tensor with the same bytes."""
    cache = vmkv.open_cache(decode_config(device, shape))
    try:
        data = make_data(device, shape)
        plan = fill(cache, data, shape)
        k_vmm, v_vmm = cache.kv_cache(0)  # [batch, seq_len, kv_heads, head_dim] views of the VMM ranges
        k_dense, v_dense = k_vmm.clone(), v_vmm.clone()  # every position is mapped: all slots are full
        reference = reference_decode(data.q, k_dense, v_dense, plan.slots_t.long())
        kv_bytes = 2 * shape.batch * shape.seq_len * shape.kv_heads * shape.head_dim * k_vmm.element_size()
        rows: dict[str, Any] = {}
        for name in kernels:
            kernel = CONTIGUOUS_KERNELS[name]
            reason = contiguous_kernel_unavailable(name, device, k_vmm.dtype, shape.head_dim)
            if reason is not None:
                rows[name] = {"skipped": reason}
                continue
            on_vmm = lambda: kernel(data.q, k_vmm, v_vmm, plan, None)  # noqa: E731
            on_dense = lambda: kernel(data.q, k_dense, v_dense, plan, None)  # noqa: E731
            out_vmm, out_dense = on_vmm(), on_dense()
            times = compare_ms({"vmm": on_vmm, "dense": on_dense}, device, shape)
            rows[name] = {
                "vmm_ms": times["vmm"],
                "dense_ms": times["dense"],
                "vmm_over_dense": times["vmm"] / times["dense"],
                "vmm_GBps": kv_bytes / times["vmm"] / 1e6,
                "max_abs_diff": (out_vmm.float() - out_dense.float()).abs().max().item(),
                "max_abs_err_vs_fp32_reference": (out_vmm.float() - reference).abs().max().item(),
            }
        return {"shape": asdict(shape), "cache_kernel": cache.kernel, "kv_bytes_read": kv_bytes,
                "page_bytes": cache.stats()["page_bytes"], "kernels": rows}
    finally:
        cache.close()


def map_unmap_section(device: torch.device, shape: Shape) -> dict[str, Any]:
    """Per-page latency of map (cuMemMap + cuMemSetAccess) and unmap, host clock, 3 rounds."""
    began = time.perf_counter()
    if device.type == "cuda":
        from vmkv.vm.cuda import CudaVirtualMemory, cuda_granularity

        page = cuda_granularity(device)
        vm = CudaVirtualMemory(page, shape.map_pages, device=device)
    else:
        from vmkv.vm.host import HostVirtualMemory

        page = 2 * MiB
        vm = HostVirtualMemory(page, shape.map_pages)
    create_s = time.perf_counter() - began
    try:
        addr = vm.reserve(shape.map_pages * page)
        map_ns, unmap_ns = [], []
        for _ in range(3):
            for i in range(shape.map_pages):
                t = time.perf_counter_ns()
                vm.map(addr + i * page, i)
                map_ns.append(time.perf_counter_ns() - t)
            vm.synchronize()
            for i in range(shape.map_pages):
                t = time.perf_counter_ns()
                vm.unmap(addr + i * page)
                unmap_ns.append(time.perf_counter_ns() - t)
        vm.free_reservation(addr, shape.map_pages * page)
        big = (64 << 30) // page * page
        t = time.perf_counter_ns()
        big_addr = vm.reserve(big)
        reserve_us = (time.perf_counter_ns() - t) / 1e3
        vm.free_reservation(big_addr, big)
        return {
            "backend": vm.name,
            "page_bytes": page,
            "pages": shape.map_pages,
            "create_store_us_per_page": create_s * 1e6 / shape.map_pages,
            "map_us": percentiles_us(map_ns),
            "unmap_us": percentiles_us(unmap_ns),
            "reserve_64GiB_us": reserve_us,
        }
    finally:
        vm.close()


def paged_section(device: torch.device, shape: Shape) -> dict[str, Any]:
    """Every paged kernel vs the VMM cache's own kernel, through ``cache.attention``, same K/V."""
    from paged import KERNELS as PAGED_KERNELS
    from paged import PagedKVCache

    data = make_data(device, shape)
    quick = replace(shape, iters=max(1, shape.iters // 5), repeats=max(1, shape.repeats - 2))  # some kernels are slow
    vmm = vmkv.open_cache(decode_config(device, shape))
    try:
        vmm_plan = fill(vmm, data, shape)
        vmm_out = vmm.attention(0, data.q, vmm_plan)
        rows: dict[str, Any] = {}
        blocks = 2 * shape.batch * -(-shape.seq_len // shape.paged_block)
        itemsize = torch.empty((), dtype=getattr(torch, shape.dtype)).element_size()
        block_bytes = shape.paged_block * shape.kv_heads * shape.head_dim * itemsize
        config = decode_config(device, shape, block_size=shape.paged_block, memory_budget=blocks * block_bytes)
        for name in PAGED_KERNELS:
            try:
                paged = PagedKVCache(config, kernel=name)
            except (vmkv.BackendUnavailable, vmkv.InvalidConfig) as exc:
                rows[name] = {"skipped": str(exc)}
                continue
            try:
                plan = fill(paged, data, shape)
                out = paged.attention(0, data.q, plan)
                times = compare_ms(
                    {"paged": lambda: paged.attention(0, data.q, plan), "vmm": lambda: vmm.attention(0, data.q, vmm_plan)},
                    device, quick,
                )
                rows[name] = {
                    "paged_ms": times["paged"],
                    "vmm_ms": times["vmm"],
                    "paged_over_vmm": times["paged"] / times["vmm"],
                    "max_abs_diff_vs_vmm": (out.float() - vmm_out.float()).abs().max().item(),
                }
            finally:
                paged.close()
        return {"vmm_kernel": vmm.kernel, "paged_block_size": shape.paged_block, "kernels": rows}
    finally:
        vmm.close()


# ---- driver ------------------------------------------------------------------------------------
def run_section(report: dict[str, Any], name: str, fn: Callable[..., dict[str, Any]], *args: Any) -> None:
    """Run one section; record its result, or its error and traceback, and its duration."""
    print(f"[gpu_check] {name} ...", flush=True)
    began = time.perf_counter()
    try:
        result = fn(*args)
        entry = {"ok": bool(result.pop("ok", True)), "result": result}
    except Exception as exc:  # recorded: one failing section must not lose the others
        entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    entry["seconds"] = round(time.perf_counter() - began, 2)
    report["sections"][name] = entry
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[fmt(row.get(col, "")) for col in columns] for row in rows]
    widths = [max(len(col), *(len(c[i]) for c in cells)) for i, col in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(col.ljust(w) for col, w in zip(columns, widths)))
    for line in cells:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))


def print_report(report: dict[str, Any]) -> None:
    sections = report["sections"]
    print_table("sections", [
        {"section": name, "ok": entry["ok"], "seconds": entry["seconds"], "error": entry.get("error", "")[:100]}
        for name, entry in sections.items()
    ])
    for name, key in (("decode", "kernels"), ("paged_vs_vmm", "kernels")):
        result = sections.get(name, {}).get("result")
        if result:
            rows = [{"kernel": kernel, **{k: v for k, v in row.items() if k != "skipped"}, "skipped": row.get("skipped", "")[:70]}
                    for kernel, row in result[key].items()]
            print_table(f"{name} ({result.get('cache_kernel') or result.get('vmm_kernel')} is the VMM cache's kernel)", rows)
    mapping = sections.get("map_unmap", {}).get("result")
    if mapping:
        print_table("map_unmap (microseconds per page)", [
            {"op": op, "page_bytes": mapping["page_bytes"], **mapping[f"{op}_us"]} for op in ("map", "unmap")
        ])
        print(f"  store creation {mapping['create_store_us_per_page']:.1f} us/page; reserve 64 GiB {mapping['reserve_64GiB_us']:.1f} us")
    tests = sections.get("tests", {}).get("result")
    if tests:
        print(f"\ntests: {tests['counts']} (returncode {tests['returncode']}): {tests['command']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Sections: environment, tests, decode, map_unmap, paged_vs_vmm. See docs/gpu.md.")
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few iterations (a dry run of the code paths)")
    parser.add_argument("--sections", nargs="+", default=["environment", "tests", "decode", "map_unmap", "paged_vs_vmm"],
                        help="which sections to run (default: all; tests are skipped with --smoke)")
    parser.add_argument("--kernels", nargs="+", default=list(CONTIGUOUS_KERNELS), choices=list(CONTIGUOUS_KERNELS),
                        help="contiguous kernels for the decode section (default: all; those that cannot run are skipped with the reason)")
    parser.add_argument("--tests", nargs="+", default=["tests/test_cuda.py"], help="pytest paths for the tests section")
    parser.add_argument("--test-timeout", type=int, default=150, help="seconds allowed for the tests section")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    shape = SMOKE if args.smoke else FULL
    if args.smoke and device.type == "cpu":
        torch.set_num_threads(1)  # a dry run on a shared CPU: idle OpenMP threads spinning only slow it down
    report: dict[str, Any] = {"device": str(device), "smoke": args.smoke, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sections": {}}
    runs: dict[str, tuple[Callable[..., dict[str, Any]], tuple]] = {
        "environment": (environment, (device, shape)),
        "tests": (run_tests, (args.tests, args.test_timeout)),
        "decode": (decode_section, (device, shape, args.kernels)),
        "map_unmap": (map_unmap_section, (device, shape)),
        "paged_vs_vmm": (paged_section, (device, shape)),
    }
    for name in args.sections:
        if name not in runs:
            print(f"[gpu_check] unknown section {name!r}; known: {', '.join(runs)}", file=sys.stderr)
            return 2
        if name == "tests" and args.smoke:
            continue  # the smoke run is itself called from the tests
        fn, fn_args = runs[name]
        run_section(report, name, fn, *fn_args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_check.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print_report(report)
    print(f"\n[gpu_check] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
