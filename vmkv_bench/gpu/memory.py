"""The ``shared_budget`` section: two caches share one ledger; where the device memory goes, counted
by the driver, by torch and by vmkv's stores (docs/gpu.md, "Where the device memory goes")."""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

import vmkv

from ..decode import Shape, decode_config
from ..runner import Context

MiB = 1 << 20

LEDGER_PAGES = 48  # the shared budget, in pool pages of the caches
CACHE_PAGES = 64  # each cache's own memory_budget, in pool pages (more than its share: the ledger decides)
FILLED = 40  # pool pages each cache fills (5 a sequence, 8 sequences)
SEQUENCES = 8
DRIVER_ALLOWANCE_GRANULES = 2
"""Granules a cache may cost the driver beyond its stores (page tables of its K and V ranges): a
stated bound, not a measurement; the section reports the measured ``driver_beyond_stores_bytes``."""
STAGES = ("opened", "first_filled", "first_freed", "second_filled", "closed")


@dataclass(frozen=True)
class MemorySample:
    """Device memory at one moment: in use as the driver counts it, reserved by torch's allocator."""

    driver_used: int
    torch_reserved: int


class DeviceMemory:
    """Device memory of one CUDA device, as the driver counts it and as torch's allocator holds it."""

    def __init__(self, device: torch.device | str, runtime: Any = None) -> None:
        self.device = torch.device(device)
        self.runtime = runtime

    def sample(self) -> MemorySample:
        """The driver's and torch's counts now."""
        from vmkv.vm.cuda import cuda_memory_info

        free, total = cuda_memory_info(self.device, runtime=self.runtime)
        reserved = torch.cuda.memory_reserved(self.device) if torch.cuda.is_available() else 0
        return MemorySample(total - free, reserved)

    def settle(self) -> None:
        """Free what is unused: unreachable objects (views hold reservations) and torch's cached blocks."""
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class Workload:
    """The two caches' configuration and the K/V they write."""

    config: vmkv.KVCacheConfig
    budget: int  # bytes of the shared budget
    pool_page: int  # bytes of one pool page
    tokens: int  # tokens a sequence
    kv: torch.Tensor  # [SEQUENCES * tokens, kv_heads, head_dim]


def make_workload(device: torch.device, shape: Shape) -> Workload:
    """Two caches' config in one new ledger, and their K/V data (made now, before any measurement)."""
    base = decode_config(device, replace(shape, batch=SEQUENCES))
    pool_page = base.page_size * 2 * base.num_layers  # one piece per layer, K and V (one layer here)
    tokens = FILLED // SEQUENCES * (base.page_size // base.layer_token_bytes)
    budget = LEDGER_PAGES * pool_page
    config = decode_config(device, replace(shape, batch=SEQUENCES, seq_len=tokens), memory_budget=CACHE_PAGES * pool_page,
                           shared_budget=f"gpu-check-{os.getpid()}-{time.monotonic_ns()}:{budget}")
    kv = torch.randn(SEQUENCES * tokens, shape.kv_heads, shape.head_dim, device=device).to(config.dtype)
    return Workload(config, budget, pool_page, tokens, kv)


def _fill(cache: vmkv.KVCacheBase, tag: str, work: Workload) -> float:
    began = time.perf_counter()
    for i in range(SEQUENCES):
        cache.add(f"{tag}{i}")
    plan = cache.begin_step({f"{tag}{i}": work.tokens for i in range(SEQUENCES)})
    seconds = time.perf_counter() - began
    for layer in range(work.config.num_layers):
        cache.write(layer, work.kv, work.kv, plan)
    return seconds


def run_round(work: Workload, memory: DeviceMemory | None) -> dict[str, Any]:
    """One pass of the two caches' work, sampled after every stage of :data:`STAGES`."""
    if memory is not None:
        memory.settle()
    start = memory.sample() if memory is not None else None
    stages: list[dict[str, Any]] = []
    caches = [vmkv.open_cache(work.config), vmkv.open_cache(work.config)]

    def sample(stage: str) -> int:
        """Append the stage's row; return vmkv's resident bytes (0 once the caches are closed and dropped)."""
        resident = sum(cache.stats()["resident_bytes"] for cache in caches)
        row: dict[str, Any] = {"stage": stage, "vmkv_resident": resident}
        if memory is not None:
            now = memory.sample()
            row["driver"] = now.driver_used - start.driver_used
            row["torch"] = now.torch_reserved - start.torch_reserved
            row["beyond"] = row["driver"] - row["torch"] - resident
        stages.append(row)
        return resident

    try:
        stats = [cache.stats() for cache in caches]
        cuda = [s for s in stats if s["backend"] == "cuda"]
        zero_bytes = sum(s["page_size"] for s in cuda)
        granule = cuda[0]["page_size"] if cuda else 0
        sample("opened")
        first_s = _fill(caches[0], "a", work)
        after_first = sample("first_filled")
        for i in range(SEQUENCES):
            caches[0].free(f"a{i}")
        sample("first_freed")
        second_s = _fill(caches[1], "b", work)
        after_second = sample("second_filled")
        held = [cache.stats()["ledger_pages_held"] for cache in caches]
    finally:
        for cache in caches:
            cache.close()
    caches.clear()  # the caches' views hold their reservations (and the zero pages mapped there)
    if memory is not None:
        memory.settle()
    sample("closed")
    return {"stages": stages, "resident_after_first": after_first, "resident_after_second": after_second,
            "pages_held": held, "grow_s": [first_s, second_s], "zero_bytes": zero_bytes, "granule": granule,
            "caches": len(stats)}


def shared_budget_section(ctx: Context, memory: DeviceMemory | None = None) -> dict[str, Any]:
    """Two caches in one ledger, run twice (round 1 warms the process up, round 2 is checked);
    ``memory`` reads the device's memory (default: the driver's and torch's counts on CUDA)."""
    device = ctx.device
    if memory is None and device.type == "cuda":
        memory = DeviceMemory(device)
    work = make_workload(device, ctx.shape)
    warmup, measured = run_round(work, memory), run_round(work, memory)
    budget, zero, stages = work.budget, measured["zero_bytes"], measured["stages"]
    checks = {
        "first_cache_got_more_than_half": measured["resident_after_first"] > budget // 2,
        "stores_within_the_budget": max(row["vmkv_resident"] for row in stages) <= budget + zero,
        "first_cache_gave_pages_back": measured["pages_held"][0] * work.pool_page <= budget - FILLED * work.pool_page,
    }
    result: dict[str, Any] = {
        "budget_bytes": budget, "pool_page_bytes": work.pool_page,
        "resident_after_first": measured["resident_after_first"], "resident_after_second": measured["resident_after_second"],
        "pages_held": measured["pages_held"], "grow_40_pages_s": measured["grow_s"],
        "rounds": {"warmup": warmup["stages"], "measured": stages},
    }
    if memory is not None:
        allowance = DRIVER_ALLOWANCE_GRANULES * measured["granule"] * measured["caches"]
        held = [row["driver"] - row["torch"] for row in stages]
        result["device_bytes_used"] = max(held)
        result["overhead"] = {"zero_pages_bytes": zero, "driver_beyond_stores_bytes": max(row["beyond"] for row in stages),
                              "driver_allowance_bytes": allowance,
                              "context_growth_bytes": warmup["stages"][-1]["driver"] - warmup["stages"][-1]["torch"],
                              "torch_reserved_peak_bytes": max(row["torch"] for row in stages)}
        checks["device_memory_within_the_budget"] = max(held) <= budget + zero + allowance
        checks["device_memory_given_back_at_close"] = held[-1] <= allowance
    result["checks"] = checks
    result["failures"] = [name for name, ok in checks.items() if not ok]
    return result


def shared_budget_headline(result: dict[str, Any]) -> str:
    """vmkv's peak against the budget, and on CUDA the parts beyond it."""
    budget = result["budget_bytes"] / MiB
    overhead = result.get("overhead")
    if overhead is None:
        return f"stores peak {result['resident_after_second'] / MiB:.2f} MiB for a {budget:.2f} MiB budget"
    return (f"device +{result['device_bytes_used'] / MiB:.0f} MiB for a {budget:.0f} MiB budget "
            f"(+{overhead['zero_pages_bytes'] / MiB:.0f} zero pages, "
            f"+{overhead['driver_beyond_stores_bytes'] / MiB:.0f} driver); "
            f"context grew {overhead['context_growth_bytes'] / MiB:.0f} MiB in the warm-up")
