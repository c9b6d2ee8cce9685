"""vmkv's CUDA backend against the fake driver: call order, the zero page, rollback of every
failing driver call, a total close.

Each test drives ``CudaVirtualMemory`` through the real cuda-bindings into the fake
``libcuda.so.1``; the fake's log shows the calls and arguments the driver received, its state
shows what is mapped where with which access, and host memory behind the fake's device
addresses shows the bytes. After every test nothing may be left (the ``fake`` fixture checks).
"""

from __future__ import annotations

import logging
from typing import Callable

import pytest
import torch

import vmkv
from fake_cuda import FakeRuntime
from fake_cuda.fixtures import leftovers
from vmkv.errors import BackendError, BackendUnavailable
from vmkv.vm.cuda import CudaVirtualMemory

PAGE = 128 << 10  # two 64 KiB granules
READ, READ_WRITE = 1, 3


def open_vm(runtime, num_pages: int = 3) -> CudaVirtualMemory:
    return CudaVirtualMemory(PAGE, num_pages, device="cuda:0", runtime=runtime)


def names(calls) -> list[str]:
    return [c.name for c in calls]


def mappings(fake) -> dict[int, tuple[int, int]]:
    """Address -> (handle, access) of every live mapping in the fake driver."""
    return {m["addr"]: (m["handle"], m["access"]) for m in fake.state()["mappings"]}


def assert_matches_driver(vm: CudaVirtualMemory, fake) -> None:
    """What the backend believes is mapped is what the driver has mapped, with the right access,
    and the bytes are right: data pages hold ``page + 1`` (see ``fill``), the others zeros."""
    live = mappings(fake)
    for res in vm._reservations.values():
        for addr in res.pages():
            if addr in res.holes:
                assert addr not in live, f"{addr:#x} is a hole to the backend but mapped in the driver"
            elif addr in res.data:
                page = res.data[addr]
                assert live[addr] == (vm._handles[page], READ_WRITE)
                assert set(vm.tensor(addr, (PAGE,), torch.uint8).tolist()) == {page + 1}
            else:
                assert live[addr] == (vm._zero, READ)
                assert int(torch.count_nonzero(vm.tensor(addr, (PAGE,), torch.uint8))) == 0


def assert_in_step(vm: CudaVirtualMemory, fake) -> None:
    """The backend's picture of every page equals the driver's (no bytes checked)."""
    live = mappings(fake)
    for res in vm._reservations.values():
        for addr in res.pages():
            if addr in res.holes:
                expected = None
            elif addr in res.data:
                expected = (vm._handles[res.data[addr]], READ_WRITE)
            else:
                expected = (vm._zero, READ)
            assert live.get(addr) == expected, f"{addr:#x}: backend {expected}, driver {live.get(addr)}"


def fill(vm: CudaVirtualMemory, addr: int, page: int) -> None:
    vm.map(addr, page)
    vm.tensor(addr, (PAGE,), torch.uint8).fill_(page + 1)


# ---- call order ------------------------------------------------------------------------------
def test_open_creates_and_zeroes_the_whole_store_up_front(fake, runtime):
    vm = open_vm(runtime, num_pages=3)
    calls = fake.calls(clear=True)
    creates = [c for c in calls if c.name == "cuMemCreate"]
    assert len(creates) == 4 and all(f"size={PAGE}" in c.args for c in creates)  # 3 pages + the zero page
    after = names(calls[calls.index(creates[-1]) + 1 :])
    assert after[:5] == ["cuDevicePrimaryCtxRetain", "cuMemAddressReserve", "cuMemMap", "cuMemMap", "cuMemMap"]
    assert after[6:10] == ["cuMemSetAccess", "cuMemsetD8", "cuCtxSynchronize", "cuMemSetAccess"]  # rw, zero, wait, r/o probe
    memset = next(c for c in calls if c.name == "cuMemsetD8")
    assert f"value=0, n={4 * PAGE}" in memset.args  # every page at once
    assert names(calls).count("cuMemUnmap") == 4 and "cuMemAddressFree" in names(calls)
    assert vm.resident_bytes() == 4 * PAGE and vm.zero_page_read_only
    addr = vm.reserve(3 * PAGE)
    for page in range(3):
        vm.map(addr + page * PAGE, page)
    assert "cuMemCreate" not in names(fake.calls())  # nothing is allocated on the hot path
    vm.close()


def test_reserve_maps_the_zero_page_read_only_at_every_page(fake, runtime):
    vm = open_vm(runtime)
    fake.calls(clear=True)
    addr = vm.reserve(3 * PAGE)
    calls = fake.calls()
    assert names(calls) == (["cuCtxGetCurrent", "cuDevicePrimaryCtxRetain", "cuMemAddressReserve"]
                            + ["cuMemMap"] * 3 + ["cuMemSetAccess"])
    assert all(f"handle={vm._zero:#x}" in c.args for c in calls if c.name == "cuMemMap")
    assert f"ptr={addr:#x}, size={3 * PAGE}, flags={READ}" in calls[-1].args  # one call for the whole range
    assert mappings(fake) == {addr + i * PAGE: (vm._zero, READ) for i in range(3)}
    vm.close()


def test_map_and_unmap_swap_the_zero_page_and_a_data_page(fake, runtime):
    vm = open_vm(runtime)
    addr = vm.reserve(3 * PAGE)
    fake.calls(clear=True)
    vm.map(addr + PAGE, 2)
    calls = fake.calls(clear=True)
    assert names(calls) == ["cuCtxGetCurrent", "cuMemUnmap", "cuMemMap", "cuMemSetAccess"]
    assert f"handle={vm._handles[2]:#x}" in calls[2].args and f"flags={READ_WRITE}" in calls[3].args
    vm.synchronize()
    vm.unmap(addr + PAGE)
    calls = fake.calls()
    assert names(calls) == ["cuCtxGetCurrent", "cuCtxSynchronize", "cuCtxGetCurrent", "cuMemUnmap", "cuMemMap", "cuMemSetAccess"]
    assert f"handle={vm._zero:#x}" in calls[4].args and f"flags={READ}" in calls[5].args
    assert mappings(fake)[addr + PAGE] == (vm._zero, READ)
    vm.close()


def test_a_thread_without_the_context_pushes_and_pops_it(fake, runtime):
    import threading

    vm = open_vm(runtime)
    addr = vm.reserve(PAGE)
    fake.calls(clear=True)
    thread = threading.Thread(target=vm.map, args=(addr, 0))
    thread.start()
    thread.join()
    assert names(fake.calls()) == ["cuCtxGetCurrent", "cuCtxPushCurrent", "cuMemUnmap", "cuMemMap", "cuMemSetAccess",
                                   "cuCtxPopCurrent"]
    vm.close()


def test_a_device_without_read_only_mappings_gets_read_write_empty_pages(fake, caplog):
    fake.reset(read_only=False)
    with caplog.at_level(logging.WARNING, logger="vmkv"):
        vm = open_vm(FakeRuntime())
    assert not vm.zero_page_read_only and "refuses read-only mappings" in caplog.text
    addr = vm.reserve(2 * PAGE)
    assert set(mappings(fake).values()) == {(vm._zero, READ_WRITE)}
    view = vm.tensor(addr, (2 * PAGE,), torch.uint8)
    assert int(torch.count_nonzero(view)) == 0
    del view
    vm.close()


# ---- failures: every driver call of an operation, one at a time ---------------------------------
def prepared(runtime, op: str) -> tuple[CudaVirtualMemory, Callable[[], None]]:
    """A backend in a known state and the operation to break."""
    vm = open_vm(runtime)
    if op == "reserve":
        return vm, lambda: vm.reserve(3 * PAGE)
    addr = vm.reserve(3 * PAGE)
    if op == "map":
        fill(vm, addr, 0)
        return vm, lambda: fill(vm, addr + PAGE, 1)
    fill(vm, addr + PAGE, 1)
    if op == "unmap":
        return vm, lambda: vm.unmap(addr + PAGE)
    fill(vm, addr + 2 * PAGE, 2)
    return vm, lambda: vm.free_reservation(addr, 3 * PAGE)  # op == "free_reservation"


def count_calls(fake, op: str) -> tuple[int, int]:
    """Driver calls of ``op``: (of the operation itself, in all). free_reservation also frees the
    range right away when no tensor holds it: those calls are best effort (logged, not raised)."""
    fake.reset()
    vm, action = prepared(FakeRuntime(), op)
    fake.calls(clear=True)
    action()
    calls = names(fake.calls())
    vm.close()
    own = calls.index("cuCtxSynchronize") - 1 if "cuCtxSynchronize" in calls else len(calls)  # - its cuCtxGetCurrent
    return own, len(calls)


@pytest.mark.parametrize("op", ["reserve", "map", "unmap", "free_reservation"])
def test_every_failing_driver_call_is_undone(fake, op, caplog):
    """Fail the k-th driver call of ``op`` for every k: ``BackendError``, the backend and the
    driver agree on every page with the same bytes as before, the retry succeeds, close frees
    everything."""
    own, total = count_calls(fake, op)
    assert own >= 4
    for k in range(1, total + 1):
        fake.reset()
        vm, action = prepared(FakeRuntime(), op)
        before = {a: dict(r.data) for a, r in vm._reservations.items()}
        fake.fail("", nth=k)
        if k > own:  # releasing the freed range: best effort, never raised; what leaks is logged
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="vmkv"):
                action()
                vm.close()
            assert not leftovers(fake) or "freeing the reservation" in caplog.text, (k, leftovers(fake))
            fake.reset()
            continue
        with pytest.raises(BackendError):
            action()
        fake.clear_failures()
        assert not any(r.holes for r in vm._reservations.values()), f"call {k}: a page was left with nothing mapped"
        assert {a: dict(r.data) for a, r in vm._reservations.items()} == before, f"call {k} of {op} changed the state"
        assert_matches_driver(vm, fake)
        action()  # the same call works once the driver does
        assert_matches_driver(vm, fake)
        vm.close()
        assert not leftovers(fake), (k, leftovers(fake))


def test_a_failing_undo_leaves_a_reported_hole_that_heals(fake, runtime):
    vm = open_vm(runtime)
    addr = vm.reserve(2 * PAGE)
    fake.fail("cuMemSetAccess", nth=1)  # the data page's access ...
    fake.fail("cuMemMap", nth=2)  # ... and then mapping the zero page back
    with pytest.raises(BackendError, match="reads at .* fault"):
        vm.map(addr, 1)
    fake.clear_failures()
    assert addr in vm._reservations[addr].holes and addr not in mappings(fake)
    assert_matches_driver(vm, fake)
    fill(vm, addr, 1)  # a hole takes a data page directly
    vm.unmap(addr)  # and gets the zero page back
    assert_matches_driver(vm, fake)
    vm.close()


GIVE_BACK = {"cuMemUnmap", "cuMemAddressFree", "cuMemRelease", "cuDevicePrimaryCtxRelease"}


def test_a_failing_open_gives_back_everything(fake, caplog):
    """Fail each driver call of opening (create, zero, probe) and closing a backend in turn:
    the error is typed, and everything is given back -- except what the driver itself refused
    to take back, which the error or the log names."""
    fake.reset()
    runtime = FakeRuntime()
    runtime.activate(0)
    fake.calls(clear=True)
    open_vm(runtime).close()
    total = len(fake.calls())
    failed = 0
    for k in range(1, total + 1):
        fake.reset()
        runtime = FakeRuntime()
        runtime.activate(0)  # torch is up before the cache opens
        fake.fail("", nth=k)
        caplog.clear()
        message = ""
        with caplog.at_level(logging.WARNING, logger="vmkv"):
            try:
                open_vm(runtime).close()
            except (BackendError, BackendUnavailable) as exc:
                failed += 1
                message = str(exc)
        (injected,) = [c.name for c in fake.calls() if c.note == "injected"]
        fake.clear_failures()
        left = leftovers(fake)
        if injected in GIVE_BACK and left:
            assert injected in message + caplog.text, (k, injected, message, caplog.text)
        else:
            assert not left, (k, injected, left)
        fake.reset()
    assert failed >= total // 2


def test_close_is_total_whatever_fails(fake, caplog):
    """Fail each driver call of close() and of freeing the range after it, in turn: nothing
    raises, the views still read (data where the driver kept a page, else zeros) without a
    fault, and everything is given back except what the driver refused, which the log names."""
    fake.reset()
    vm, _ = prepared(FakeRuntime(), "free_reservation")
    fake.calls(clear=True)
    vm.close()
    total = len(fake.calls())
    for k in range(1, total + 1):
        fake.reset()
        vm, _ = prepared(FakeRuntime(), "free_reservation")
        (addr,) = vm._reservations
        view = vm.tensor(addr, (3, PAGE), torch.uint8)
        fake.fail("", nth=k)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vmkv"):
            vm.close()
            assert vm.resident_bytes() == 0
            rows = view.sum(1).tolist()
            del view
        (injected,) = [c.name for c in fake.calls() if c.note == "injected"]
        fake.clear_failures()
        assert rows[0] == 0 and rows[1] in (0, 2 * PAGE) and rows[2] in (0, 3 * PAGE), (k, rows)
        left = leftovers(fake)
        if injected in GIVE_BACK and left:
            assert injected in caplog.text, (k, injected, caplog.text)
        else:
            assert not left, (k, injected, left)
        fake.reset()


def test_a_store_that_does_not_fit_is_given_back(fake, runtime):
    with pytest.raises(BackendError, match="does not fit in free GPU memory; lower memory_budget"):
        open_vm(runtime, num_pages=1000)  # 125 MiB on a 64 MiB device
    assert fake.state()["memory_used"] == 0


# ---- what the stores hold ------------------------------------------------------------------
def test_an_on_demand_store_holds_what_was_created_minus_released_zero_page_included(fake, runtime):
    """A store in a shared budget creates pages when provisioned (or mapped) and gives them back
    when released: at every step ``resident_bytes`` is the handles the driver created minus those
    it released (the zero page among them) and the device memory the driver counts; a provision
    that fails half-way gives back what it created; close gives back everything."""
    stores = [CudaVirtualMemory(PAGE, 6, device="cuda:0", runtime=runtime, on_demand=True) for _ in range(2)]

    def in_step() -> int:
        resident = sum(vm.resident_bytes() for vm in stores)
        assert resident == fake.created_minus_released() == fake.state()["memory_used"]
        return resident

    assert in_step() == 2 * PAGE  # the zero pages, one a store
    first, second = stores
    assert first.provision([0, 1, 2]) == 3 and first.provision([1, 2]) == 0  # created once
    addr = first.reserve(2 * PAGE)
    first.map(addr, 3)  # a page not provisioned yet is created by its map
    assert in_step() == 6 * PAGE
    first.synchronize()
    first.unmap(addr)
    for page in (0, 3):
        first.release_page(page)
    first.release_page(0)  # released already: nothing to do
    assert in_step() == 4 * PAGE
    fake.fail("cuMemCreate", nth=3)  # the third page of the batch does not fit
    with pytest.raises(BackendError, match="cuMemCreate"):
        second.provision([0, 1, 2, 3])
    assert in_step() == 4 * PAGE  # the two it created went back
    assert second.provision([0, 1, 2, 3]) == 4
    assert in_step() == 8 * PAGE
    first.free_reservation(addr, 2 * PAGE)
    for vm in stores:
        vm.close()
    assert in_step() == 0 and fake.created_minus_released() == 0


# ---- the cache on top: a failing driver call never desynchronises the backend ----------------
def test_a_failing_driver_call_during_cache_work_keeps_backend_and_driver_in_step(fake_cuda_backends, fake):
    """Fail the k-th driver call of a step that grows, forks (copy-on-write) and frees, for
    every k: the backend's picture equals the driver's, the cache's bookkeeping is whole
    (``check()``), and close gives everything back."""
    config = vmkv.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float32", device="cpu",
                                max_batch_size=3, max_seq_len=64, page_size="4KiB", memory_budget=16 * 2 * 4096)

    def work(cache) -> None:
        plan = cache.begin_step({"a": 20})
        cache.write(0, torch.ones(20, 1, 64), torch.ones(20, 1, 64), plan)
        cache.fork("a", "b")
        plan = cache.begin_step({"b": 1})
        cache.write(0, torch.zeros(1, 1, 64), torch.zeros(1, 1, 64), plan)
        cache.free("a")

    def fresh():
        fake.reset(granularity=4096)
        fake_cuda_backends.clear()
        cache = vmkv.open_cache(config)
        cache.add("a")
        fake.calls(clear=True)
        return cache

    cache = fresh()
    work(cache)
    total = len(fake.calls())
    cache.close()
    for k in range(1, total + 1):
        cache = fresh()
        fake.fail("", nth=k)
        try:
            work(cache)
        except BackendError:
            pass
        fake.clear_failures()
        assert_in_step(fake_cuda_backends[0], fake)
        cache.check()  # the cache's own rollback (vmkv/core/base.py) left its bookkeeping whole
        cache.close()
        del cache
        assert not leftovers(fake), (k, leftovers(fake))
