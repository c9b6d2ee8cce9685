#!/usr/bin/env python
"""One-shot GPU check of vmkv: CUDA tests, the zero page, decode kernels on VMM views vs dense
tensors, map/unmap latency, paged vs VMM on the same work, and vLLM's smoke test if present.

    python benchmarks/gpu_check.py                        # on an NVIDIA GPU: every section, a few minutes
    python benchmarks/gpu_check.py --out DIR --sections zero_page decode
    python benchmarks/gpu_check.py --device cpu --smoke   # dry run of the same code on the CPU, seconds

Every section runs in its own process, so a CUDA fault (which kills the CUDA context) loses
that section only; ``DIR/gpu_check.json`` (default ``gpu-check-out/``) is rewritten after
every section, so an interrupted run keeps what finished.

    environment   torch/CUDA/driver versions, GPU, granularity, read-only zero page, kernels
    tests         pytest tests/test_cuda.py (CUDA backend contract + cache vs dense reference)
    zero_page     reads past a sequence and views after close() see zeros; a write into an
                  empty page faults (in a child process, as expected)
    decode        one decode step, 32 sequences x 2048 tokens, 32 q / 8 kv heads, head_dim 128,
                  fp16: each contiguous kernel on the VMM views and on a dense tensor of the
                  same contents; CUDA-event timing, interleaved; ratio vmm/dense; fails when an
                  output is further from the fp32 reference than the dtype's ``TOLERANCE``
    map_unmap     latency of map (unmap zero page + cuMemMap + cuMemSetAccess) and unmap per
                  2 MiB page, of creating the store, and of reserving 64 GiB (zero page at
                  every page)
    paged_vs_vmm  each paged kernel vs the VMM cache's kernel through ``cache.attention``;
                  fails when the outputs differ by more than twice ``TOLERANCE``
    shared_budget two caches in one ledger of 48 pages (each could take 64): one fills 40, frees
                  them, the other fills 40; the device memory both stores hold (backend count
                  and, on CUDA, cudaMemGetInfo) stays within the budget and the first one's
                  pages really go back; the time to create a page in a grant's batch
    vllm          ``vmkv.vllm.gpu_smoke(DIR/vllm)`` if vmkv.vllm and vLLM are installed; fails
                  unless it reports ``"passed": True``
    vllm_addressing  block tables vs virtual memory inside one vLLM on the GPU (issue 20; the CUDA
                  run of ``vmkv bench vllm --parts addressing``): stock vLLM, vmkv's paged backing
                  and vmkv's contiguous mode (``--attention-backend CUSTOM``, all-layers slots of
                  2 MiB pages, FlashAttention with cache_batch_idx where flash-attn imports) on
                  identical work, interleaved rounds; output tokens/s ratios, KV memory, tokens
                  against stock's; fails when the paged backing's tokens differ from stock's or
                  a contiguous request's first token does (a wrong cache; later bf16 near-ties
                  are reported, not failed)

Exit status: 0 every section passed (or was skipped, with the reason); 1 a section failed;
2 bad arguments; 3 no CUDA GPU here (one line says why; nothing ran). Nothing is installed or
downloaded. See docs/gpu.md for what each number means.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import math
import platform
import re
import signal
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
from benchmarks import common  # noqa: E402
from vmkv.core.step import StepPlan  # noqa: E402
from vmkv.kernels.contiguous import (  # noqa: E402
    CONTIGUOUS_KERNELS,
    contiguous_kernel_unavailable,
    flash_varlen_has_seqused_k,
    has_flash_attn,
    select_contiguous_kernel,
    torch_varlen_features,
)
from vmkv.vm.cuda import TorchCudaRuntime  # noqa: E402

MiB = 1 << 20
SECTIONS = ["environment", "tests", "zero_page", "decode", "map_unmap", "paged_vs_vmm", "shared_budget", "vllm",
            "vllm_addressing"]
TIMEOUT_FACTOR = {"vllm_addressing": 3}  # three vLLM engines start (and capture CUDA graphs) in that one process
EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU = 1, 2, 3


class SectionSkipped(Exception):
    """A section cannot run here; the message says why (recorded, not a failure)."""


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


# ---- timing ----------------------------------------------------------------------------------
def compare_ms(fns: dict[str, Callable[[], Any]], device: torch.device, shape: Shape) -> dict[str, float]:
    """Median ms per call of each variant, timed by :func:`benchmarks.common.time_interleaved`
    (rounds of every variant in a fresh order, so that clock and thermal drift hit all alike;
    each sample is ``shape.iters`` back-to-back calls, the GPU synchronized before the clock is read)."""
    batches = {name: (lambda fn=fn: [fn() for _ in range(shape.iters)]) for name, fn in fns.items()}
    timings = common.time_interleaved(batches, device.type, repeat=shape.repeats, warmup=2)
    return {name: timings.median(name) * 1e3 / shape.iters for name in fns}


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
        from vmkv.vm.cuda import CudaVirtualMemory

        probe = CudaVirtualMemory(env["vmm_granularity_bytes"], 1, device=device)
        env["zero_page_read_only"] = probe.zero_page_read_only  # False: the device refused PROT_READ
        probe.close()
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
        "failures": [] if proc.returncode == 0 else [f"pytest exited with {proc.returncode}: {counts}"],
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
        tolerance = TOLERANCE[shape.dtype]
        rows: dict[str, Any] = {}
        failures = []
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
            error = rows[name]["max_abs_err_vs_fp32_reference"]
            if not error <= tolerance:  # NaN fails too
                failures.append(f"{name}: max |output - fp32 reference| {error:.3g} > {tolerance:g} ({shape.dtype})")
        return {"shape": asdict(shape), "cache_kernel": cache.kernel, "kv_bytes_read": kv_bytes,
                "page_bytes": cache.stats()["page_bytes"], "tolerance": tolerance, "kernels": rows, "failures": failures}
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
    from vmkv.paged import KERNELS as PAGED_KERNELS
    from vmkv.paged import PagedKVCache

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
        tolerance = 2 * TOLERANCE[shape.dtype]  # each output within TOLERANCE of the fp32 reference
        failures = []
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
            diff = rows[name]["max_abs_diff_vs_vmm"]
            if not diff <= tolerance:  # NaN fails too
                failures.append(f"{name}: max |paged - VMM ({vmm.kernel})| {diff:.3g} > {tolerance:g} ({shape.dtype})")
        return {"vmm_kernel": vmm.kernel, "paged_block_size": shape.paged_block, "tolerance": tolerance, "kernels": rows,
                "failures": failures}
    finally:
        vmm.close()


def shared_budget_section(device: torch.device, shape: Shape) -> dict[str, Any]:
    """Two caches share one ledger: device memory follows the pages between them (docs/shared-budget.md)."""
    import os

    base = decode_config(device, replace(shape, batch=8))
    page = base.page_size * 2 * base.num_layers  # a pool page: one piece per layer, K and V (per-layer layout)
    budget, name = 48 * page, f"gpu-check-{os.getpid()}"
    tokens = 5 * (base.page_size // base.layer_token_bytes)  # 5 pages a sequence, 40 for 8
    config = decode_config(device, replace(shape, batch=8, seq_len=tokens), memory_budget=64 * page,
                           shared_budget=f"{name}:{budget}")

    def device_used() -> int | None:  # what the driver handed out beyond torch's own allocator
        if device.type != "cuda":
            return None
        return torch.cuda.mem_get_info(device)[1] - torch.cuda.mem_get_info(device)[0] - torch.cuda.memory_reserved(device)

    used_before = device_used()
    caches = [vmkv.open_cache(config), vmkv.open_cache(config)]

    def resident() -> int:
        return sum(cache.stats()["resident_bytes"] for cache in caches)

    def fill(cache: vmkv.KVCacheBase, tag: str) -> float:
        began = time.perf_counter()
        for i in range(8):
            cache.add(f"{tag}{i}")
        plan = cache.begin_step({f"{tag}{i}": tokens for i in range(8)})
        seconds = time.perf_counter() - began
        kv = torch.randn(8 * tokens, shape.kv_heads, shape.head_dim, device=device).to(config.dtype)
        for layer in range(config.num_layers):
            cache.write(layer, kv, kv, plan)
        return seconds

    try:
        first_s = fill(caches[0], "a")
        after_first = resident()
        for i in range(8):
            caches[0].free(f"a{i}")
        second_s = fill(caches[1], "b")
        after_second = resident()
        held = [cache.stats()["ledger_pages_held"] for cache in caches]
        used = None if used_before is None else device_used() - used_before
    finally:
        for cache in caches:
            cache.close()
    zero = 2 * config.page_size if device.type == "cuda" else 0  # each backend's zero page
    limit = budget + zero
    checks = {
        "first_cache_got_more_than_half": after_first > budget // 2,
        "stores_within_the_budget": after_first <= limit and after_second <= limit,
        "first_cache_gave_pages_back": held[0] * page <= budget - 40 * page,
        "device_memory_within_the_budget": used is None or used <= limit + 2 * MiB,  # the driver's rounding aside
    }
    return {"budget_bytes": budget, "resident_after_first": after_first, "resident_after_second": after_second,
            "pages_held": held, "device_bytes_used": used, "grow_40_pages_s": [first_s, second_s],
            "checks": checks, "failures": [name for name, ok in checks.items() if not ok]}


def zero_page_section(device: torch.device, shape: Shape, out_dir: Path, smoke: bool) -> dict[str, Any]:
    """Empty pages read as zeros (past a sequence, in an empty slot, after close) and a write
    into one faults -- checked in a child process, since on CUDA the fault kills the context."""
    config = decode_config(device, replace(shape, batch=2))
    cache = vmkv.open_cache(config)
    k_all = None
    try:
        tpp = cache.tokens_per_page
        written = min(5, tpp)
        cache.add("a")
        plan = cache.begin_step({"a": written})
        k = torch.randn(written, shape.kv_heads, shape.head_dim, device=device).to(config.dtype)
        cache.write(0, k, k, plan)
        k_all, _ = cache.kv_cache(0)  # [batch, seq_len, kv_heads, head_dim]
        slot = plan.slots_t[0].item()
        checks = {
            "written_tokens_read_back": bool(torch.equal(k_all[slot, :written], k)),
            "rest_of_the_page_reads_zeros": int(torch.count_nonzero(k_all[slot, written:tpp])) == 0,
            "pages_past_the_sequence_read_zeros": int(torch.count_nonzero(k_all[slot, tpp:])) == 0,
            "an_empty_slot_reads_zeros": int(torch.count_nonzero(k_all[1 - slot])) == 0,
            "no_nan_anywhere": not bool(k_all.isnan().any()),
        }
    finally:
        cache.close()
    checks["a_view_after_close_reads_zeros"] = k_all is not None and int(torch.count_nonzero(k_all)) == 0
    probe = write_probe(device, out_dir, smoke)
    checks["a_write_into_an_empty_page_faults"] = probe["faulted"]
    return {"checks": checks, "write_probe": probe, "failures": [name for name, ok in checks.items() if not ok]}


def write_probe(device: torch.device, out_dir: Path, smoke: bool) -> dict[str, Any]:
    """Run :func:`write_to_an_empty_page` in a child: it must die (SIGSEGV on the host, a CUDA
    illegal-address error on a GPU) after reading zeros, without printing ``WROTE``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "write_probe", "--device", str(device), "--out", str(out_dir)]
    proc = subprocess.run(cmd + (["--smoke"] if smoke else []), cwd=ROOT, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    return {
        "returncode": proc.returncode,
        "exit": describe_exit(proc.returncode),
        "read_zeros_first": "READ 0" in proc.stdout,
        "faulted": proc.returncode != 0 and "READ 0" in proc.stdout and "WROTE" not in proc.stdout,
        "output_tail": output[-1500:],
    }


def write_to_an_empty_page(device: torch.device) -> None:
    """Read an empty page (zeros), then write into it: this process is expected to die here."""
    from vmkv.vm import granularity, open_backend

    page = granularity(device)
    vm = open_backend(device, page, 1)
    addr = vm.reserve(2 * page)
    view = vm.tensor(addr, (2 * page,), torch.uint8)
    print("READ", int(view.sum().item()), flush=True)
    view[page:].fill_(1)  # an empty page: read-only
    vm.synchronize()
    print("WROTE", int(view.sum().item()), flush=True)


def vllm_section(device: torch.device, out_dir: Path) -> dict[str, Any]:
    """``vmkv.vllm.gpu_smoke(out_dir)``, written by the vLLM integration, if it is there."""
    if device.type != "cuda":
        raise SectionSkipped("the vLLM smoke test needs a CUDA device")
    if importlib.util.find_spec("vllm") is None:
        raise SectionSkipped("vLLM is not installed")
    try:
        module = importlib.import_module("vmkv.vllm")
    except ImportError as exc:
        raise SectionSkipped(f"vmkv.vllm cannot be imported: {exc}") from None
    smoke = getattr(module, "gpu_smoke", None)
    if smoke is None:
        raise SectionSkipped("vmkv.vllm has no gpu_smoke(out_dir)")
    (out_dir / "vllm").mkdir(parents=True, exist_ok=True)
    try:
        result = smoke(out_dir / "vllm")
    except vmkv.BackendUnavailable as exc:  # e.g. a vLLM other than the one the plugin supports
        raise SectionSkipped(f"vmkv.vllm.gpu_smoke: {exc}") from None
    result = dict(result) if isinstance(result, dict) else {"returned": result}
    result["failures"] = vllm_failures(result)
    return result


def vllm_failures(result: dict[str, Any]) -> list[str]:
    """Why ``gpu_smoke``'s result fails (``[]`` when it reports ``"passed": True``)."""
    if result.get("passed") is True:
        return []
    if "passed" not in result:
        return [f"gpu_smoke reported no 'passed' (keys: {', '.join(sorted(result))})"]
    why = []
    if result.get("tokens_identical") is not True:
        why.append("vLLM + vmkv generated other tokens than stock vLLM")
    peak, buffer = result.get("kv_peak_mapped_bytes"), result.get("kv_buffer_bytes")
    if isinstance(peak, int) and isinstance(buffer, int) and peak >= buffer:
        why.append(f"vmkv mapped {peak / MiB:.0f} MiB at peak, not less than the {buffer / MiB:.0f} MiB KV buffer")
    return why or ["gpu_smoke reported passed=False"]


def vllm_addressing_section(device: torch.device, out_dir: Path, smoke: bool) -> dict[str, Any]:
    """The addressing comparison of ``vmkv bench vllm --parts addressing`` on the GPU
    (:func:`benchmarks.vllm_addressing.run` with :data:`~benchmarks.vllm_addressing.GPU_SETTINGS`)."""
    if device.type != "cuda":
        raise SectionSkipped("the addressing comparison inside vLLM on CUDA needs a CUDA device "
                             "(the CPU run: vmkv bench vllm --parts addressing)")
    if importlib.util.find_spec("vllm") is None:
        raise SectionSkipped("vLLM is not installed")
    from vmkv.vllm import check_vllm

    try:
        check_vllm()
    except vmkv.BackendUnavailable as exc:  # missing, or another release than the plugin's (UnsupportedVllm)
        raise SectionSkipped(str(exc)) from None
    from benchmarks import vllm_addressing

    settings = dict(vllm_addressing.GPU_SETTINGS)
    if smoke:
        settings.update(requests=2, prompt=(256, 384), output=8, rounds=1)
    (out_dir / "vllm_addressing").mkdir(parents=True, exist_ok=True)
    result = vllm_addressing.run(settings, out_dir / "vllm_addressing", 0, vllm_addressing.GPU_ENGINE)
    result["failures"] = addressing_failures(result["rows"])
    return result


def addressing_failures(rows: list[dict[str, Any]]) -> list[str]:
    """Why the addressing run fails: the paged backing (vLLM's own kernel) must give stock's
    tokens exactly; contiguous mode must give every request's first token (a wrong cache changes
    it at once), later differences in bfloat16 are kernel summation order and are reported."""
    why = []
    for row in rows:
        if row["engine"] == "paged" and not row["tokens_identical"]:
            why.append(f"round {row['round']}: the paged backing's tokens differ from stock's at position {row['first_divergence']}")
        if row["engine"] == "contiguous" and row["first_divergence"] == 0:
            why.append(f"round {row['round']}: contiguous mode's first token differs from stock's")
    return why


# ---- running sections, each in its own process -----------------------------------------------
def section_call(name: str, args: argparse.Namespace, device: torch.device) -> Callable[[], dict[str, Any]]:
    """The work of section ``name`` (run inside the worker process)."""
    shape = SMOKE if args.smoke else FULL
    calls: dict[str, Callable[[], dict[str, Any]]] = {
        "environment": lambda: environment(device, shape),
        "tests": lambda: run_tests(args.tests, args.test_timeout),
        "zero_page": lambda: zero_page_section(device, shape, args.out, args.smoke),
        "decode": lambda: decode_section(device, shape, args.kernels),
        "map_unmap": lambda: map_unmap_section(device, shape),
        "paged_vs_vmm": lambda: paged_section(device, shape),
        "shared_budget": lambda: shared_budget_section(device, shape),
        "vllm": lambda: vllm_section(device, args.out),
        "vllm_addressing": lambda: vllm_addressing_section(device, args.out, args.smoke),
    }
    return calls[name]


def run_worker(args: argparse.Namespace) -> int:
    """Inside a section's process: run it and write ``DIR/sections/NAME.json``."""
    device = resolve_device(args.device)
    if args.smoke and device.type == "cpu":
        torch.set_num_threads(1)  # a dry run on a shared CPU: idle OpenMP threads spinning only slow it down
    if args.worker == "write_probe":
        write_to_an_empty_page(device)
        return 0
    try:
        result = section_call(args.worker, args, device)()
        failures = result.pop("failures", [])
        entry = {"status": "failed" if failures else "passed", "result": result}
        if failures:
            entry["error"] = "; ".join(failures)
    except SectionSkipped as exc:
        entry = {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # recorded: the parent reports it and goes on
        entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    path = section_file(args.out, args.worker)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entry, indent=2, default=str))
    return 0


def section_file(out_dir: Path, name: str) -> Path:
    return out_dir / "sections" / f"{name}.json"


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def collect(cmd: list[str], result: Path, timeout: float) -> dict[str, Any]:
    """Run one section's process and read what it wrote; a crash, a timeout or a missing result
    is a failed section with the process's last output."""
    result.unlink(missing_ok=True)
    began = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        output, ended = proc.stdout + proc.stderr, describe_exit(proc.returncode)
    except subprocess.TimeoutExpired as exc:
        proc, ended = None, f"timed out after {timeout:g} s"
        output = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or "" for part in (exc.stdout, exc.stderr))
    seconds = round(time.perf_counter() - began, 1)
    if proc is not None and proc.returncode == 0 and result.exists():
        return {**json.loads(result.read_text()), "seconds": seconds}
    return {"status": "failed", "error": f"the section's process {ended} before reporting", "seconds": seconds,
            "output_tail": output[-3000:]}


def worker_command(name: str, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--device", args.device, "--out", str(args.out),
           "--kernels", *args.kernels, "--tests", *args.tests, "--test-timeout", str(args.test_timeout)]
    return cmd + (["--smoke"] if args.smoke else [])


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# ---- the report ------------------------------------------------------------------------------
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
        {"section": name, "status": entry["status"], "seconds": entry.get("seconds", ""),
         "why": (entry.get("error") or entry.get("reason") or "")[:100]}
        for name, entry in sections.items()
    ])
    for name in ("decode", "paged_vs_vmm"):
        result = sections.get(name, {}).get("result")
        if result:
            rows = [{"kernel": kernel, **{k: v for k, v in row.items() if k != "skipped"}, "skipped": row.get("skipped", "")[:70]}
                    for kernel, row in result["kernels"].items()]
            print_table(f"{name} ({result.get('cache_kernel') or result.get('vmm_kernel')} is the VMM cache's kernel)", rows)
    zero = sections.get("zero_page", {}).get("result")
    if zero:
        print_table("zero_page", [{"check": name, "holds": ok} for name, ok in zero["checks"].items()])
    mapping = sections.get("map_unmap", {}).get("result")
    if mapping:
        print_table("map_unmap (microseconds per page)", [
            {"op": op, "page_bytes": mapping["page_bytes"], **mapping[f"{op}_us"]} for op in ("map", "unmap")
        ])
        print(f"  store creation {mapping['create_store_us_per_page']:.1f} us/page; reserve 64 GiB {mapping['reserve_64GiB_us']:.0f} us")
    addressing = sections.get("vllm_addressing", {}).get("result")
    if addressing:
        print_table("vllm_addressing (output tokens/s per engine and round)", [
            {k: row[k] for k in ("round", "engine", "output_tok_per_s", "kv_mean_mib", "tokens_identical", "first_divergence")}
            for row in addressing["rows"]])
        print(f"  {addressing['summary']['verdict']}; contiguous kernel {addressing['summary']['contiguous_kernels']}")
    tests = sections.get("tests", {}).get("result")
    if tests:
        print(f"\ntests: {tests['counts']} (returncode {tests['returncode']}): {tests['command']}")


def verdict(report: dict[str, Any]) -> str:
    """One line: what passed, what was skipped, what failed and why; on CUDA, what decode over VMM
    pages costs with the kernel the cache selected (``cache_kernel``)."""
    by_status: dict[str, list[str]] = {"passed": [], "skipped": [], "failed": []}
    for name, entry in report["sections"].items():
        by_status[entry["status"]].append(name)
    line = f"gpu_check on {report['device']}: {len(by_status['passed'])} passed, {len(by_status['skipped'])} skipped"
    if by_status["failed"]:
        firsts = [f"{name} ({(report['sections'][name].get('error') or '')[:80]})" for name in by_status["failed"]]
        return f"{line}, {len(by_status['failed'])} FAILED: " + "; ".join(firsts)
    decode = report["sections"].get("decode", {}).get("result", {})
    kernel = decode.get("cache_kernel")
    if kernel and report["device"].startswith("cuda"):  # the kernel the cache runs, not the best-looking one
        row = decode["kernels"].get(kernel, {})
        if "vmm_over_dense" in row:
            line += f"; decode over VMM pages costs {row['vmm_over_dense']:.2f}x dense with {kernel}, the cache's kernel (1.00 = free)"
        else:
            line += f"; the cache's kernel {kernel} was not timed ({row.get('skipped', 'not in --kernels')})"
    addressing = report["sections"].get("vllm_addressing", {}).get("result")
    if addressing:
        over = addressing["summary"]["contiguous_over_stock"]
        line += (f"; inside vLLM contiguous mode ({', '.join(addressing['summary']['contiguous_kernels'])}) runs at "
                 f"{statistics.median(over):.2f}x stock output tokens/s (rounds {min(over):.2f}-{max(over):.2f})")
    return line + "."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Exit status: 0 passed, 1 a section failed, 2 bad arguments, 3 no CUDA GPU. "
                                            "See docs/gpu.md.")
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"), help="directory for gpu_check.json (default: gpu-check-out)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few iterations (a dry run of the code paths)")
    parser.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS, metavar="SECTION",
                        help=f"which sections to run (default: all: {' '.join(SECTIONS)}; tests are skipped with --smoke)")
    parser.add_argument("--kernels", nargs="+", default=list(CONTIGUOUS_KERNELS), choices=list(CONTIGUOUS_KERNELS),
                        help="contiguous kernels for the decode section (default: all; those that cannot run are skipped with the reason)")
    parser.add_argument("--tests", nargs="+", default=["tests/test_cuda.py"], help="pytest paths for the tests section")
    parser.add_argument("--test-timeout", type=int, default=240, help="seconds allowed for the tests section's pytest (default 240)")
    parser.add_argument("--section-timeout", type=int, default=360, help="seconds allowed for one section's process (default 360)")
    parser.add_argument("--worker", choices=[*SECTIONS, "write_probe"], help=argparse.SUPPRESS)  # one section, inside its process
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    device = torch.device(args.device)
    if device.type == "cuda":
        reason = TorchCudaRuntime().unavailable_reason()
        if reason is not None:
            print(f"gpu_check: no CUDA GPU here ({reason}); nothing was checked (dry run: --device cpu --smoke)")
            return EXIT_NO_GPU
    report: dict[str, Any] = {"device": str(resolve_device(args.device)), "smoke": args.smoke,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sections": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_check.json"
    for name in args.sections:
        if name == "tests" and args.smoke:
            entry = {"status": "skipped", "reason": "--smoke: the dry run is itself one of the tests"}
        else:
            print(f"[gpu_check] {name} ...", flush=True)
            timeout = args.section_timeout * TIMEOUT_FACTOR.get(name, 1)
            entry = collect(worker_command(name, args), section_file(args.out, name), timeout)
        report["sections"][name] = entry
        path.write_text(json.dumps(report, indent=2, default=str))  # after every section
        print(f"[gpu_check] {name}: {entry['status']}", (entry.get("error") or entry.get("reason") or "")[:160], flush=True)
    print_report(report)
    print(f"\n[gpu_check] wrote {path}")
    print(verdict(report))
    return EXIT_FAILED if any(entry["status"] == "failed" for entry in report["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
