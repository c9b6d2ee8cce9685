"""The ``vllm_slots`` section: vLLM contiguous mode's slot space over a vLLM-shaped KV buffer, without
vLLM: what the slots read, the driver's access flags, and every failing driver call undone (docs/gpu.md)."""

from __future__ import annotations

import time
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Callable, Iterator

import torch

from vmkv.config import KVShape
from vmkv.errors import BackendError
from vmkv.sizes import format_size
from vmkv.vllm.contiguous.pages import plan_contiguous_pages
from vmkv.vllm.contiguous.slots import SlotSpace, slot_layout
from vmkv.vllm.worker.kvbuffer import KVBuffer
from vmkv.vm import VirtualMemory, granularity, open_backend

from ..common import percentiles_us
from ..runner import Context


@dataclass(frozen=True)
class SlotGeometry:
    """The model and engine the section plays vLLM for (one rank)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    num_blocks: int  # vLLM's blocks in the KV buffer (block 0 is its null block)
    max_slots: int  # max_num_seqs
    max_blocks: int  # blocks a slot holds (max_model_len in blocks)


FULL_SLOTS = SlotGeometry(16, 4, 128, "bfloat16", num_blocks=72, max_slots=8, max_blocks=8)
"""The tiny Llama of ``vllm_addressing``'s GPU run: all layers' K of a 128-token block is one 2 MiB page."""
SMOKE_SLOTS = SlotGeometry(2, 2, 32, "float32", num_blocks=8, max_slots=4, max_blocks=3)

MAPS = [(0, 0, 1), (0, 1, 2), (1, 0, 1), (1, 1, 3), (2, 0, 4)]
"""``(slot, j, block)``: slots 0 and 1 share block 1 (a prefix), slot 2 holds one block."""
MORE = [(3, 0, 1), (3, 1, 5)]
"""What the rollback checks map and free: a slot that shares block 1 too."""
PROT_READ, PROT_READWRITE = 1, 3
"""``CU_MEM_ACCESS_FLAGS_PROT_READ`` / ``_PROT_READWRITE``, as ``cuMemGetAccess`` reports them."""


def block_size_for(backend: VirtualMemory, geometry: SlotGeometry) -> int:
    """The block size vLLM is started with: the plan's smallest whole-granule block of >= 16 tokens."""
    layout = slot_layout(backend.device.type).slots
    element = torch.empty((), dtype=getattr(torch, geometry.dtype)).element_size()
    shape = KVShape(1 if layout == "head_major" else geometry.layers, geometry.kv_heads, geometry.head_dim, element)
    return plan_contiguous_pages(shape, backend.granularity, max_model_len=16, max_num_seqs=geometry.max_slots,
                                 layout=layout).block_size


def buffer_bytes(geometry: SlotGeometry, block_size: int) -> int:
    """Bytes of vLLM's KV buffer: every layer's K and V of every block."""
    element = torch.empty((), dtype=getattr(torch, geometry.dtype)).element_size()
    return geometry.num_blocks * geometry.layers * geometry.kv_heads * block_size * 2 * geometry.head_dim * element


def vllm_kv_buffer(backend: VirtualMemory, geometry: SlotGeometry, block_size: int) -> tuple[KVBuffer, dict[str, torch.Tensor]]:
    """vLLM's KV buffer over ``backend``, every page mapped, and its per-layer views."""
    layer_block = geometry.kv_heads * block_size * 2 * geometry.head_dim  # elements of one layer's block [H, N, 2D]
    buffer = KVBuffer(backend, buffer_bytes(geometry, block_size))
    try:
        buffer.apply([], list(range(buffer.num_pages)))
        raw = buffer.tensor().view(getattr(torch, geometry.dtype))
        shape = (geometry.num_blocks, geometry.kv_heads, block_size, 2 * geometry.head_dim)
        inner = (block_size * 2 * geometry.head_dim, 2 * geometry.head_dim, 1)
        if slot_layout(backend.device.type).vllm_layout == "BLHNC":  # a block: every layer's [H, N, 2D] in one run
            block_stride, layer_stride = geometry.layers * layer_block, layer_block
        else:  # every layer's blocks in a region of their own
            block_stride, layer_stride = layer_block, geometry.num_blocks * layer_block
        views = {f"layers.{layer}": raw.as_strided(shape, (block_stride, *inner), layer * layer_stride)
                 for layer in range(geometry.layers)}
    except BaseException:
        buffer.close()
        raise
    return buffer, views


def fill_blocks(space: SlotSpace) -> None:
    """Random K/V in every block of the buffer (through the views vLLM's kernels write)."""
    gen = torch.Generator(device=space.write_views[0].device).manual_seed(0)
    for rows in space.write_views:
        rows.copy_(torch.randn(rows.shape, generator=gen, device=rows.device).to(rows.dtype))


def reads_blocks(space: SlotSpace, maps: list[tuple[int, int, int]]) -> bool:
    """Whether logical block ``j`` of every ``(slot, j, block)`` reads ``block``'s K and V in every layer."""
    size = space.block_size
    return all(torch.equal(kv[slot, j * size : (j + 1) * size], rows[block, :, half])
               for slot, j, block in maps
               for k, v, rows in zip(space.k, space.v, space.write_views)  # rows: [blocks, tokens, K|V, heads, D]
               for half, kv in enumerate((k, v)))


def reads_zeros_past(space: SlotSpace, maps: list[tuple[int, int, int]]) -> bool:
    """Whether every slot reads zeros past the blocks ``maps`` gives it (all of it, for a slot not in ``maps``)."""
    lengths = {slot: 1 + max(j for s, j, _ in maps if s == slot) for slot, _, _ in maps}
    return not any(int(torch.count_nonzero(view[slot, lengths.get(slot, 0) * space.block_size :]))
                   for slot in range(space.max_slots) for view in (*space.k, *space.v))


# ---- what the driver says ------------------------------------------------------------------------
def driver_access(space: SlotSpace) -> list[int | None] | None:
    """CUDA: ``cuMemGetAccess`` of every page of the slot ranges (None: unmapped); None on the host."""
    backend = space.backend
    if backend.name != "cuda":
        return None
    from cuda.bindings import driver

    location = driver.CUmemLocation()
    location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    location.id = backend.device.index
    range_bytes = space.stats()["slot_reserved_bytes"] // 2  # all-layers slots: one K and one V range
    answers = [driver.cuMemGetAccess(location, addr) for base in (space.k[0].data_ptr(), space.v[0].data_ptr())
               for addr in range(base, base + range_bytes, backend.page_size)]
    return [int(value) if result == driver.CUresult.CUDA_SUCCESS else None for result, value in answers]


def expected_access(space: SlotSpace, maps: list[tuple[int, int, int]]) -> list[int]:
    """The access flags the slot ranges should have after ``maps``: read-write where mapped, else the zero page's
    (the K range's pages, then the V range's, alike)."""
    backend, plan = space.backend, space.plan
    empty = PROT_READ if getattr(backend, "zero_page_read_only", True) else PROT_READWRITE
    per_block = plan.page_bytes // backend.page_size
    mapped = {plan.page_offset(slot, j) // backend.page_size + i for slot, j, _ in maps for i in range(per_block)}
    pages = space.stats()["slot_reserved_bytes"] // 2 // backend.page_size
    return [PROT_READWRITE if page in mapped else empty for page in range(pages)] * 2


@dataclass
class _Calls:
    """Calls counted (and the one made to fail) while :func:`failing_calls` is active."""

    unit: str
    fail_at: int | None
    count: int = 0

    def counted(self, call: Callable[..., Any], failed: Callable[[], Any]) -> Callable[..., Any]:
        """``call``, counted: call ``fail_at`` answers ``failed()`` instead."""
        def counted_call(*args: Any) -> Any:
            self.count += 1
            return failed() if self.count == self.fail_at else call(*args)
        return counted_call


class _CountingDriver:
    """The driver module as the backend sees it, counting ``cu*`` calls; call ``fail_at``
    answers ``CUDA_ERROR_OUT_OF_MEMORY`` without reaching the driver."""

    def __init__(self, driver: Any, calls: _Calls) -> None:
        self._driver, self._calls = driver, calls

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._driver, name)
        if not name.startswith("cu") or not callable(attr):
            return attr
        return self._calls.counted(attr, lambda: (self._driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY,))


BACKEND_CALLS = ("map", "unmap", "map_range", "unmap_range", "synchronize")


def _injected(name: str) -> None:
    raise BackendError(f"{name} failed (injected by gpu_check)")


@contextmanager
def failing_calls(backend: VirtualMemory, fail_at: int | None = None) -> Iterator[_Calls]:
    """Count the calls ``backend`` makes while active, and fail call ``fail_at`` (1-based)."""
    if backend.name == "cuda":
        calls = _Calls("driver call", fail_at)
        context = backend._context  # noqa: SLF001 - the one seam every driver call goes through
        driver = context.driver
        context.driver = _CountingDriver(driver, calls)
        try:
            yield calls
        finally:
            context.driver = driver
        return
    calls = _Calls("backend call", fail_at)
    for name in BACKEND_CALLS:
        setattr(backend, name, calls.counted(getattr(backend, name), partial(_injected, name)))
    try:
        yield calls
    finally:
        for name in BACKEND_CALLS:
            delattr(backend, name)


def _state(space: SlotSpace) -> tuple[dict[str, int], list[int | None] | None, list[torch.Tensor]]:
    stats, access = space.stats(), driver_access(space)
    counts = {key: stats[key] for key in ("slots_in_use", "slot_blocks_mapped", "slot_blocks_distinct")}
    if access is not None and None in access:  # nothing mapped somewhere: reading there would fault
        return counts, access, []
    return counts, access, [view.clone() for view in (*space.k, *space.v)]


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] == b[1] and len(a[2]) == len(b[2]) and all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


def every_failure_is_undone(space: SlotSpace, action: Callable[[], None], undo: Callable[[], None]) -> dict[str, Any]:
    """Fail each call ``action`` makes, one at a time: each must raise and leave the slots as they were."""
    with failing_calls(space.backend) as counted:
        action()
    undo()
    before = _state(space)
    not_raised, not_undone = [], []
    for k in range(1, counted.count + 1):
        with failing_calls(space.backend, fail_at=k):
            try:
                action()
            except BackendError:
                if not _same(_state(space), before):
                    not_undone.append(k)
                continue
        not_raised.append(k)  # the failure was absorbed and the change made: put it back for the next k
        undo()
    return {"calls": counted.count, "unit": counted.unit, "not_raised": not_raised, "not_undone": not_undone}


def _time_map_free(space: SlotSpace, rounds: int = 3) -> dict[str, Any]:
    """``SlotSpace.map`` and ``free`` of every slot full, microseconds per block."""
    blocks = space.max_slots * space.max_blocks
    others = space.write_views[0].shape[0] - 1  # every block but vLLM's null block 0
    full = [(slot, j, 1 + (slot * space.max_blocks + j) % others)
            for slot in range(space.max_slots) for j in range(space.max_blocks)]
    map_ns, free_ns = [], []
    for _ in range(rounds):
        began = time.perf_counter_ns()
        space.map(full)
        map_ns.append((time.perf_counter_ns() - began) // blocks)
        began = time.perf_counter_ns()
        space.free(range(space.max_slots))
        free_ns.append((time.perf_counter_ns() - began) // blocks)
    return {"blocks": blocks, "pages_per_block": space.plan.pieces * space.plan.page_bytes // space.backend.page_size,
            "map_us_per_block": percentiles_us(map_ns), "free_us_per_block": percentiles_us(free_ns)}


def vllm_slots_section(ctx: Context) -> dict[str, Any]:
    """The slot space over a vLLM-shaped KV buffer: ``checks``, ``rollback`` (per action: calls failed
    one at a time), ``timing`` and the geometry (docs/gpu.md)."""
    device, geometry = ctx.device, SMOKE_SLOTS if ctx.smoke else FULL_SLOTS
    page = granularity(device)
    with open_backend(device, page, 1) as probe:  # the backend's device type and granularity decide the block size
        block = block_size_for(probe, geometry)
    backend = open_backend(device, page, -(-buffer_bytes(geometry, block) // page))
    buffer, views = vllm_kv_buffer(backend, geometry, block)
    with closing(buffer), closing(SlotSpace(buffer, views, geometry.num_blocks, block, geometry.max_slots,
                                            geometry.max_blocks)) as space:
        checks: dict[str, bool] = {"slots_read_zeros_before_any_map": reads_zeros_past(space, [])}
        fill_blocks(space)
        space.map(MAPS)
        checks["slots_read_their_blocks"] = reads_blocks(space, MAPS)
        checks["empty_pages_under_the_slots_read_zeros"] = reads_zeros_past(space, MAPS)
        checks["a_shared_block_is_one_physical_page"] = _shared_write_seen_twice(space)
        table = torch.tensor([[1, 3], [1, 2], [4, 0]])  # rows of slots 1, 0, 2: the last block of each is its own
        checks["rows_to_slots_finds_each_rows_slot"] = space.rows_to_slots(table, [block + 1, block + 2, 5]) == [1, 0, 2]
        access = driver_access(space)
        if access is not None:
            checks["driver_access_matches_the_slots"] = access == expected_access(space, MAPS)
        rollback = {"map": every_failure_is_undone(space, lambda: space.map(MORE), lambda: space.free([3]))}
        space.map(MORE)
        checks["a_slot_mapped_after_failures_reads_its_blocks"] = reads_blocks(space, MAPS + MORE)
        rollback["free"] = every_failure_is_undone(space, lambda: space.free([3]), lambda: space.map(MORE))
        for name, outcome in rollback.items():
            checks[f"every_failing_{name}_is_undone"] = not outcome["not_raised"] and not outcome["not_undone"]
        space.free([0, 3])
        left = [m for m in MAPS if m[0] not in (0, 3)]  # slot 1 keeps block 1, which slots 0 and 3 shared
        checks["freed_slots_read_zeros_and_the_shared_block_stays"] = reads_zeros_past(space, left) and reads_blocks(space, left)
        space.free([1, 2])
        timing = _time_map_free(space)
        kept = space.k[0]
        space.close()
        checks["views_read_zeros_after_close"] = int(torch.count_nonzero(kept)) == 0
        plan = space.plan
    return {"backend": backend.name, "geometry": asdict(geometry), "block_size": block, "page_bytes": plan.page_bytes,
            "backend_page_bytes": page, "vllm_layout": slot_layout(backend.device.type).vllm_layout, "slot_layout": plan.layout,
            "checks": checks, "rollback": rollback, "timing": timing, "failures": [name for name, ok in checks.items() if not ok]}


def _shared_write_seen_twice(space: SlotSpace) -> bool:
    rows, k = space.write_views[-1], space.k[-1]
    old = rows[1, 5, 0, 1, 3].clone()
    rows[1, 5, 0, 1, 3] = 7.0
    seen = bool(k[0, 5, 1, 3] == 7.0) and bool(k[1, 5, 1, 3] == 7.0)
    rows[1, 5, 0, 1, 3] = old
    return seen


def vllm_slots_headline(result: dict[str, Any]) -> str:
    """Checks that hold, the rollback calls, and what mapping a block into a slot costs."""
    checks, timing = result["checks"], result["timing"]
    calls = sum(outcome["calls"] for outcome in result["rollback"].values())
    unit = next(iter(result["rollback"].values()))["unit"]
    return (f"{sum(checks.values())}/{len(checks)} checks hold; {calls} {unit}s failed one by one, all undone; "
            f"map {timing['map_us_per_block']['median']:.0f} us, free {timing['free_us_per_block']['median']:.0f} us a block "
            f"({timing['pages_per_block']} x {format_size(result['backend_page_bytes'])})")
