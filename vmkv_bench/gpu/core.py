"""The sections that check the CUDA backend and the kernels: ``environment``, ``tests``,
``zero_page``, ``decode`` and ``map_unmap`` (docs/gpu.md says what each asserts)."""

from __future__ import annotations

import platform
import re
import sys
import time
from contextlib import closing
from dataclasses import asdict, replace
from typing import Any

import torch

import vmkv
from vmkv.kernels import registry as kernel_registry
from vmkv.kernels.facts import flash_varlen_has_seqused_k, has_flash_attn, torch_varlen_features

from ..common import percentiles_us
from ..decode import TOLERANCE, DecodeStep, Shape, compare_ms, decode_config, dense_copy
from ..mapping import map_latency
from ..runner import SCRIPT, Context, optional_packages, package_version, run_process

MiB = 1 << 20


def environment_section(ctx: Context) -> dict[str, Any]:
    """Versions, the GPU, VMM granularity, read-only zero page, each kernel's availability and the ones picked."""
    device, shape = ctx.device, ctx.shape
    spec = kernel_registry.KernelSpec("slots", device, getattr(torch, shape.dtype), shape.kv_heads, shape.head_dim)
    packages = ("cuda-bindings", "flash-attn", "flashinfer-python", "triton", "cupy-cuda12x", "cupy-cuda13x", "numpy")
    env: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "vmkv": vmkv.__version__,
        "packages": {name: package_version(name) for name in packages}, "optional_packages": optional_packages(),
        "flash_attn_installed": has_flash_attn(), "aten_flash_varlen_has_seqused_k": flash_varlen_has_seqused_k(),
        "varlen_attn_arguments": sorted(torch_varlen_features()),
        "contiguous_kernels": {name: kernel_registry.unavailable(name, spec) or "available"
                               for name in kernel_registry.names("slots")},
        "selected_contiguous_kernel": kernel_registry.choose(spec).name,
        "selected_paged_kernel": kernel_registry.choose(replace(spec, addressing="blocks", block_size=shape.paged_block)).name,
    }
    if device.type == "cuda":
        from vmkv.vm.cuda import CudaVirtualMemory, cuda_granularity

        props = torch.cuda.get_device_properties(device)
        env["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                      "memory_GiB": round(props.total_memory / 2**30, 1), "multiprocessors": props.multi_processor_count}
        env["vmm_granularity_bytes"] = cuda_granularity(device)
        with CudaVirtualMemory(env["vmm_granularity_bytes"], 1, device=device) as probe:
            env["zero_page_read_only"] = probe.zero_page_read_only  # False: the device refused PROT_READ
        try:
            from cuda.bindings import driver

            env["cuda_driver_version"] = driver.cuDriverGetVersion()[1]
        except Exception as exc:  # reported, not fatal: the backend section shows the real error
            env["cuda_driver_version"] = f"unknown ({exc})"
    return env


def tests_skip(device: torch.device, smoke: bool) -> str | None:
    return "--smoke: the dry run is itself one of the tests" if smoke else None


def tests_section(ctx: Context) -> dict[str, Any]:
    """pytest on ``--tests``; the GPU check's own tests are deselected (they would run it again)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *ctx.options.tests, "-k", "not gpu_check"]
    done = run_process(cmd, min(ctx.options.test_timeout, ctx.seconds_left() - 10))
    summary = [line for line in done.output.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)",
                                                      summary[-1] if summary else "")}
    return {"failures": [] if done.returncode == 0 else [f"pytest {done.ended}: {counts}"], "command": " ".join(cmd),
            "returncode": done.returncode, "counts": counts, "seconds": round(done.seconds, 1),
            "output_tail": done.output[-4000:]}


def decode_section(ctx: Context) -> dict[str, Any]:
    """Each of ``--kernels`` on the VMM views vs on a dense copy with the same bytes."""
    device, shape = ctx.device, ctx.shape
    step = DecodeStep({"vmm": ("vmm", decode_config(device, shape))}, shape.batch, shape.seq_len - 1, shape.q_heads)
    with closing(step):
        cache, kv_bytes = step.caches["vmm"], step.kv_bytes
        dense = tuple(map(dense_copy, step.storage("vmm")))  # every position is mapped: all slots are full
        rows: dict[str, Any] = {}
        errors: dict[str, float] = {}
        for name in ctx.options.kernels:
            on_vmm, on_dense = step.call("vmm", name), step.call("vmm", name, dense)
            if isinstance(on_vmm, str):
                rows[name] = {"skipped": on_vmm.partition(": ")[2]}
                continue
            out_vmm, out_dense = on_vmm(), on_dense()
            times = compare_ms({"vmm": on_vmm, "dense": on_dense}, device, shape)
            errors[name] = step.error(out_vmm)
            rows[name] = {"vmm_ms": times["vmm"], "dense_ms": times["dense"], "vmm_over_dense": times["vmm"] / times["dense"],
                          "vmm_GBps": kv_bytes / times["vmm"] / 1e6,
                          "max_abs_diff": (out_vmm.float() - out_dense.float()).abs().max().item(),
                          "max_abs_err_vs_fp32_reference": errors[name]}
        return {"shape": asdict(shape), "cache_kernel": cache.kernel, "kv_bytes_read": kv_bytes,
                "page_bytes": cache.stats()["page_bytes"], "tolerance": TOLERANCE[shape.dtype], "kernels": rows,
                "failures": off_reference(errors, shape)}


def off_reference(errors: dict[str, float], shape: Shape) -> list[str]:
    """Why each candidate whose max |output - fp32 reference| exceeds its dtype's tolerance fails (NaN fails too)."""
    tolerance = TOLERANCE[shape.dtype]
    return [f"{name}: max |output - fp32 reference| {error:.3g} > {tolerance:g} ({shape.dtype})"
            for name, error in errors.items() if not error <= tolerance]


def map_unmap_section(ctx: Context) -> dict[str, Any]:
    """Per-page latency of map (cuMemMap + cuMemSetAccess) and unmap, 3 rounds; store creation; 64 GiB reserved."""
    from vmkv.vm import granularity, open_backend

    device, pages = ctx.device, ctx.shape.map_pages
    page = granularity(device) if device.type == "cuda" else 2 * MiB
    began = time.perf_counter()
    vm = open_backend(device, page, pages)
    create_s = time.perf_counter() - began
    with vm:
        map_ns, unmap_ns = map_latency(vm, page, pages, rounds=3)
        big = (64 << 30) // page * page
        t = time.perf_counter_ns()
        big_addr = vm.reserve(big)
        reserve_us = (time.perf_counter_ns() - t) / 1e3
        vm.free_reservation(big_addr, big)
        return {"backend": vm.name, "page_bytes": page, "pages": pages, "create_store_us_per_page": create_s * 1e6 / pages,
                "map_us": percentiles_us(map_ns), "unmap_us": percentiles_us(unmap_ns), "reserve_64GiB_us": reserve_us}


def zero_page_section(ctx: Context) -> dict[str, Any]:
    """Empty pages read as zeros (past a sequence, in an empty slot, after close) and a write
    into one faults, checked in a child process: on CUDA the fault kills the context."""
    device, shape = ctx.device, ctx.shape
    config = decode_config(device, replace(shape, batch=2))
    with vmkv.open_cache(config) as cache:
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
    checks["a_view_after_close_reads_zeros"] = int(torch.count_nonzero(k_all)) == 0
    probe = write_probe(ctx)
    checks["a_write_into_an_empty_page_faults"] = probe["faulted"]
    return {"checks": checks, "write_probe": probe, "failures": [name for name, ok in checks.items() if not ok]}


def write_probe(ctx: Context) -> dict[str, Any]:
    """:func:`write_to_an_empty_page` in a child: it must die after reading zeros, never printing ``WROTE``."""
    cmd = [sys.executable, str(SCRIPT), "--worker", "write_probe", "--device", str(ctx.device), "--out", str(ctx.out)]
    done = run_process(cmd + (["--smoke"] if ctx.smoke else []), timeout=300)
    read_zeros = "READ 0" in done.stdout
    return {"returncode": done.returncode, "exit": done.ended, "read_zeros_first": read_zeros,
            "faulted": done.returncode != 0 and read_zeros and "WROTE" not in done.stdout, "output_tail": done.output[-1500:]}


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


# ---- headlines: the one line each section shows in the summary ---------------------------------
def environment_headline(result: dict[str, Any]) -> str:
    gpu = result.get("gpu")
    where = f"{gpu['name']} (sm {gpu['capability']}), driver {result.get('cuda_driver_version')}" if gpu else "no GPU (dry run)"
    read_only = "" if result.get("zero_page_read_only", True) else "; the device REFUSED read-only zero pages"
    return f"{where}, torch {result['torch']}, kernel {result['selected_contiguous_kernel']}{read_only}"


def tests_headline(result: dict[str, Any]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in result["counts"].items()) or f"no summary ({result['returncode']})"


def zero_page_headline(result: dict[str, Any]) -> str:
    checks = result["checks"]
    return f"{sum(checks.values())}/{len(checks)} checks hold; the write into an empty page: {result['write_probe']['exit']}"


def decode_headline(result: dict[str, Any]) -> str:
    """VMM over dense with the cache's own kernel, and the bandwidth it reached."""
    kernel = result["cache_kernel"]
    row = result["kernels"].get(kernel, {})
    if "vmm_over_dense" not in row:
        return f"the cache's kernel {kernel} was not timed ({row.get('skipped', 'not in --kernels')})"
    return f"VMM/dense {row['vmm_over_dense']:.3f}x with {kernel} ({row['vmm_ms']:.4f} ms, {row['vmm_GBps']:.0f} GB/s)"


def map_unmap_headline(result: dict[str, Any]) -> str:
    return (f"map {result['map_us']['median']:.0f} us, unmap {result['unmap_us']['median']:.0f} us a "
            f"{result['page_bytes'] // MiB} MiB page (median); reserve 64 GiB {result['reserve_64GiB_us'] / 1e6:.2f} s")
