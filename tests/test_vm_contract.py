"""The VirtualMemory contract (vmkv/vm/base.py), asserted once and run over every backend: the
Linux host backend, and the CUDA backend on the fake driver (tests/fake_cuda). What a backend
does only its own way is tested beside it: tests/test_vm_host.py (resident memory, a released
page reads zero: the host gives its memory back; the CUDA store is allocated for good) and
tests/fake_cuda/test_cuda_backend.py (driver calls, the zero page's access, rollback)."""

from __future__ import annotations

import pytest
import torch
from fake_cuda.fixtures import fake, fake_lib, runtime  # noqa: F401 - fixtures the CUDA backend needs

from vmkv.errors import BackendError, InvalidConfig
from vmkv.vm.base import VirtualMemory

NUM_PAGES = 4


@pytest.fixture(params=["host", "fake_cuda"])
def vm(request) -> VirtualMemory:
    """An open backend of ``NUM_PAGES`` pages of its granularity (host 4 KiB, fake CUDA 64 KiB)."""
    if request.param == "host":
        from vmkv.vm.host import HostVirtualMemory

        backend = HostVirtualMemory(4096, NUM_PAGES)
    else:
        from vmkv.vm.cuda import CudaVirtualMemory, cuda_granularity

        fake_runtime = request.getfixturevalue("runtime")
        backend = CudaVirtualMemory(cuda_granularity("cuda:0", runtime=fake_runtime), NUM_PAGES, device="cuda:0",
                                    runtime=fake_runtime)
    yield backend
    backend.close()


def page_view(vm: VirtualMemory, addr: int) -> torch.Tensor:
    return vm.tensor(addr, (vm.page_size,), torch.uint8)


def test_a_reservation_reads_zero_and_a_mapped_page_holds_what_is_written(vm):
    addr = vm.reserve(3 * vm.page_size)
    whole = vm.tensor(addr, (3, vm.page_size), torch.uint8)
    assert int(torch.count_nonzero(whole)) == 0  # reserved, nothing mapped: zeros everywhere
    vm.map(addr + vm.page_size, 2)
    page_view(vm, addr + vm.page_size).fill_(9)
    assert set(whole[1].tolist()) == {9} and int(torch.count_nonzero(whole[0])) == 0
    vm.synchronize()
    vm.unmap(addr + vm.page_size)
    assert int(torch.count_nonzero(whole)) == 0  # unmapped: zeros again, the address still reserved
    vm.free_reservation(addr, 3 * vm.page_size)


def test_one_page_mapped_at_two_addresses_is_shared(vm):
    addr = vm.reserve(2 * vm.page_size)
    vm.map(addr, 1)
    vm.map(addr + vm.page_size, 1)
    first, second = page_view(vm, addr), page_view(vm, addr + vm.page_size)
    first[123] = 42
    assert second[123].item() == 42
    vm.synchronize()
    vm.unmap(addr + vm.page_size)
    assert first[123].item() == 42  # unmapping one address keeps the other
    vm.free_reservation(addr, 2 * vm.page_size)


def test_bad_calls_are_refused_and_change_nothing(vm):
    with pytest.raises(InvalidConfig):
        vm.reserve(vm.page_size + 1)  # not a multiple of the page size
    addr = vm.reserve(2 * vm.page_size)
    vm.map(addr, 0)
    page_view(vm, addr).fill_(5)
    for call in (lambda: vm.map(addr + vm.page_size // 2, 1),  # not page-aligned
                 lambda: vm.map(addr + 2 * vm.page_size, 1),  # past the reservation
                 lambda: vm.map(addr + vm.page_size, NUM_PAGES),  # not a page of the store
                 lambda: vm.map(addr + vm.page_size, -1),
                 lambda: vm.free_reservation(addr + vm.page_size, vm.page_size)):  # not a reservation's start
        with pytest.raises(BackendError):
            call()
    assert set(page_view(vm, addr).tolist()) == {5}
    assert int(torch.count_nonzero(page_view(vm, addr + vm.page_size))) == 0
    vm.synchronize()
    vm.unmap(addr)
    vm.free_reservation(addr, 2 * vm.page_size)


def test_map_pages_maps_every_pair_or_none(vm):
    """map_pages maps a list of (addr, page) like map, all or none: a bad pair anywhere leaves
    none of the others mapped (page 0, mapped elsewhere and written, would show if it were)."""
    addr, other = vm.reserve(3 * vm.page_size), vm.reserve(vm.page_size)
    vm.map(other, 0)
    page_view(vm, other).fill_(7)
    whole = vm.tensor(addr, (3, vm.page_size), torch.uint8)
    for bad in ((addr + 3 * vm.page_size, 1), (addr + vm.page_size, NUM_PAGES)):
        with pytest.raises(BackendError):
            vm.map_pages([(addr, 0), (addr + 2 * vm.page_size, 1), bad])
        assert int(torch.count_nonzero(whole)) == 0
    vm.map_pages([(addr, 0), (addr + 2 * vm.page_size, 1)])
    page_view(vm, addr + 2 * vm.page_size).fill_(3)
    assert set(whole[0].tolist()) == {7} and set(whole[2].tolist()) == {3} and int(torch.count_nonzero(whole[1])) == 0
    vm.synchronize()
    for at in (addr, addr + 2 * vm.page_size, other):
        vm.unmap(at)
    vm.free_reservation(addr, 3 * vm.page_size), vm.free_reservation(other, vm.page_size)


def test_close_is_idempotent_and_leaves_live_tensors_reading_zero(vm):
    addr = vm.reserve(vm.page_size)
    vm.map(addr, 3)
    view = page_view(vm, addr)
    view.fill_(1)
    vm.close()
    vm.close()
    assert int(torch.count_nonzero(view)) == 0
