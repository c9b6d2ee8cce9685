"""The Linux host backend: reservations cost no memory, mapped pages do, release gives memory
back (what every backend does, sharing and zeros among it: tests/test_vm_contract.py)."""

import ctypes
import time

import pytest
import torch
from helpers import rss_bytes

from vmkv.errors import BackendError, InvalidConfig
from vmkv.vm.host import HostVirtualMemory

MiB = 1 << 20


@pytest.fixture
def vm():
    backend = HostVirtualMemory(2 * MiB, 16)
    yield backend
    backend.close()


def test_reserving_64_gib_costs_no_resident_memory_and_little_time(vm):
    before = rss_bytes()
    start = time.perf_counter()
    addr = vm.reserve(64 << 30)
    elapsed = time.perf_counter() - start
    assert addr % 4096 == 0
    assert rss_bytes() - before < 4 * MiB
    assert elapsed < 0.1  # the benchmark asserts < 10 ms; here only guard against a regression
    vm.free_reservation(addr, 64 << 30)


def test_mapped_pages_raise_resident_memory_and_release_lowers_it(vm):
    addr = vm.reserve(32 * MiB)
    base = rss_bytes()
    for i in range(8):
        vm.map(addr + i * 2 * MiB, i)
    view = vm.tensor(addr, (8, 2 * MiB), torch.uint8)
    view.fill_(1)  # touch every byte of the 8 mapped pages
    grown = rss_bytes() - base
    assert 15 * MiB <= grown <= 20 * MiB, grown  # 16 MiB of pages, plus a little interpreter noise
    assert vm.resident_bytes() == 16 * MiB
    mapped = rss_bytes()
    for i in range(8):
        vm.unmap(addr + i * 2 * MiB)
    assert mapped - rss_bytes() >= 15 * MiB  # the 16 MiB of pages left the process
    for i in range(8):
        vm.release_page(i)
    assert vm.resident_bytes() == 0
    vm.free_reservation(addr, 32 * MiB)


def test_released_page_reads_back_zero(vm):
    addr = vm.reserve(2 * MiB)
    vm.map(addr, 0)
    view = vm.tensor(addr, (2 * MiB,), torch.uint8)
    view.fill_(7)
    vm.unmap(addr)
    vm.release_page(0)
    vm.map(addr, 0)
    assert int(view.sum()) == 0
    vm.free_reservation(addr, 2 * MiB)


def test_page_size_must_be_a_multiple_of_the_os_page():
    with pytest.raises(InvalidConfig, match="multiple of 4096"):
        HostVirtualMemory(6000, 4)
    small = HostVirtualMemory(4096, 4)  # 4 KiB pages work
    addr = small.reserve(4096 * 4)
    small.map(addr + 4096, 2)
    small.tensor(addr + 4096, (4096,), torch.uint8).fill_(3)
    assert small.resident_bytes() == 4096
    small.close()


def test_bad_reservations_are_refused(vm):
    with pytest.raises(InvalidConfig):
        vm.reserve(MiB)  # not a multiple of the page size
    with pytest.raises(BackendError):
        vm.free_reservation(12345, 2 * MiB)
    with pytest.raises(InvalidConfig, match="reserving .* lower max_batch_size"):
        vm.reserve(1 << 62)  # more address space than the machine has


def test_map_and_unmap_touch_only_this_backends_reservations(vm):
    import mmap

    other = mmap.mmap(-1, 2 * MiB)  # memory that is not ours must never be mapped over or emptied
    other[:5] = b"hello"
    addr = ctypes.addressof(ctypes.c_char.from_buffer(other))
    for call in (lambda: vm.unmap(addr), lambda: vm.map(addr, 0)):
        with pytest.raises(BackendError, match="not inside a reservation"):
            call()
    assert other[:5] == b"hello"
    base = vm.reserve(4 * MiB)
    with pytest.raises(BackendError, match="not inside a reservation"):
        vm.map(base + 4096, 0)  # not page-aligned within the reservation
    for page in (-1, 16, 1.0, True):
        with pytest.raises(BackendError, match="not a page of the store"):
            vm.map(base, page)
        with pytest.raises(BackendError, match="not a page of the store"):
            vm.release_page(page)
    del other
