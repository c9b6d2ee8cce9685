"""The fake CUDA driver enforces the driver's documented VMM rules, through the real bindings.

These tests call ``cuda.bindings.driver`` directly (not vmkv), break one rule each and check the
CUresult and the reason the fake logs, so a backend bug that breaks a rule cannot pass unseen.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
import threading

import pytest

G = 64 << 10  # the fake's default granularity in these tests


@pytest.fixture
def cu(fake):
    """The bindings' driver module with cuInit done and the primary context current here."""
    from cuda.bindings import driver

    ok(driver.cuInit(0))
    ctx = ok(driver.cuDevicePrimaryCtxRetain(0))
    ok(driver.cuCtxPushCurrent(ctx))
    yield driver
    driver.cuCtxPopCurrent()
    driver.cuDevicePrimaryCtxRelease(0)  # the ``fake`` fixture then checks nothing is left


def ok(returned):
    """The values of a successful call (asserting it succeeded)."""
    result, *values = returned
    assert result.name == "CUDA_SUCCESS", result
    return values[0] if len(values) == 1 else tuple(values) if values else None


def error(returned) -> str:
    result = returned[0]
    assert result.name != "CUDA_SUCCESS", "the fake accepted a call that breaks a driver rule"
    return result.name


def prop(driver, device: int = 0):
    p = driver.CUmemAllocationProp()
    p.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = device
    return p


def access(driver, flag: str = "PROT_READWRITE"):
    a = driver.CUmemAccessDesc()
    a.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    a.location.id = 0
    a.flags = getattr(driver.CUmemAccess_flags, f"CU_MEM_ACCESS_FLAGS_{flag}")
    return [a]


def last_note(fake) -> str:
    return fake.calls()[-1].note or ""


def host_bytes(addr: int, n: int) -> bytes:
    return bytes((ctypes.c_uint8 * n).from_address(addr))


def test_the_bindings_call_the_fake_and_calls_need_cuinit(fake):
    from cuda.bindings import driver

    assert error(driver.cuDeviceGet(0)) == "CUDA_ERROR_NOT_INITIALIZED"
    ok(driver.cuInit(0))
    assert int(ok(driver.cuDeviceGet(0))) == 0
    assert error(driver.cuDeviceGet(1)) == "CUDA_ERROR_INVALID_DEVICE"
    assert [c.name for c in fake.calls()] == ["cuDeviceGet", "cuInit", "cuDeviceGet", "cuDeviceGet"]


def test_memory_calls_need_a_current_context_on_the_calling_thread(fake):
    from cuda.bindings import driver

    ok(driver.cuInit(0))
    assert error(driver.cuMemAddressReserve(G, G, 0, 0)) == "CUDA_ERROR_INVALID_CONTEXT"
    assert "no current context" in last_note(fake)
    ctx = ok(driver.cuDevicePrimaryCtxRetain(0))
    ok(driver.cuCtxPushCurrent(ctx))
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(other=driver.cuMemCreate(G, prop(driver), 0)[0].name))
    thread.start()
    thread.join()
    assert seen["other"] == "CUDA_ERROR_INVALID_CONTEXT"  # the stack is per thread
    ptr = ok(driver.cuMemAddressReserve(G, G, 0, 0))
    ok(driver.cuMemAddressFree(ptr, G))
    ok(driver.cuCtxPopCurrent())
    assert error(driver.cuCtxPopCurrent()) == "CUDA_ERROR_INVALID_CONTEXT"
    ok(driver.cuDevicePrimaryCtxRelease(0))
    assert error(driver.cuDevicePrimaryCtxRelease(0)) == "CUDA_ERROR_INVALID_CONTEXT"  # never retained
    assert error(driver.cuCtxPushCurrent(ctx)) == "CUDA_ERROR_INVALID_CONTEXT"  # released: inactive


def test_sizes_and_addresses_follow_the_granularity(cu, fake):
    assert ok(cu.cuMemGetAllocationGranularity(prop(cu),
                                               cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)) == G
    assert error(cu.cuMemCreate(G + 4096, prop(cu), 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert error(cu.cuMemCreate(G, prop(cu, device=3), 0)) == "CUDA_ERROR_INVALID_VALUE"
    handle = ok(cu.cuMemCreate(2 * G, prop(cu), 0))
    ptr = ok(cu.cuMemAddressReserve(4 * G, G, 0, 0))
    assert int(ptr) % G == 0
    assert error(cu.cuMemAddressReserve(4 * G, 3 * G, 0, 0)) == "CUDA_ERROR_INVALID_VALUE"  # not a power of two
    assert error(cu.cuMemMap(int(ptr) + 4096, G, 0, handle, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert error(cu.cuMemMap(ptr, G + 4096, 0, handle, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert "multiples of the granularity" in last_note(fake)
    ok(cu.cuMemRelease(handle))
    ok(cu.cuMemAddressFree(ptr, 4 * G))


def test_map_rules_offset_size_range_and_no_overlap(cu, fake):
    handle = ok(cu.cuMemCreate(2 * G, prop(cu), 0))
    ptr = int(ok(cu.cuMemAddressReserve(4 * G, G, 0, 0)))
    cases = [
        ((ptr, G, G, handle, 0), "offset must be 0"),
        ((ptr, 4 * G, 0, handle, 0), "> handle size"),
        ((ptr + 3 * G, 2 * G, 0, handle, 0), "not inside one reservation"),
        ((ptr, G, 0, 0x1234, 0), "not a handle"),
        ((ptr, G, 0, handle, 1), "flags must be 0"),
    ]
    for call, reason in cases:
        assert error(cu.cuMemMap(*call)) == "CUDA_ERROR_INVALID_VALUE" and reason in last_note(fake), call
    ok(cu.cuMemMap(ptr + G, 2 * G, 0, handle, 0))
    assert error(cu.cuMemMap(ptr, 2 * G, 0, handle, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert "already mapped" in last_note(fake)
    ok(cu.cuMemUnmap(ptr + G, 2 * G))
    ok(cu.cuMemRelease(handle))
    ok(cu.cuMemAddressFree(ptr, 4 * G))


def test_access_needs_a_fully_mapped_range_and_new_mappings_have_none(cu, fake):
    handle = ok(cu.cuMemCreate(G, prop(cu), 0))
    ptr = int(ok(cu.cuMemAddressReserve(2 * G, G, 0, 0)))
    ok(cu.cuMemMap(ptr, G, 0, handle, 0))
    assert fake.state()["mappings"][0]["access"] == 0  # mapped, not accessible yet
    assert error(cu.cuMemSetAccess(ptr, 2 * G, access(cu), 1)) == "CUDA_ERROR_INVALID_VALUE"
    assert "not mapped" in last_note(fake)
    ok(cu.cuMemSetAccess(ptr, G, access(cu, "PROT_READ"), 1))
    location = access(cu)[0].location
    assert ok(cu.cuMemGetAccess(location, ptr)) == 1
    ok(cu.cuMemUnmap(ptr, G))
    ok(cu.cuMemRelease(handle))
    ok(cu.cuMemAddressFree(ptr, 2 * G))


def test_unmap_takes_whole_mappings_and_free_needs_an_empty_exact_range(cu, fake):
    a, b = ok(cu.cuMemCreate(2 * G, prop(cu), 0)), ok(cu.cuMemCreate(G, prop(cu), 0))
    ptr = int(ok(cu.cuMemAddressReserve(4 * G, G, 0, 0)))
    ok(cu.cuMemMap(ptr, 2 * G, 0, a, 0))
    ok(cu.cuMemMap(ptr + 2 * G, G, 0, b, 0))
    assert error(cu.cuMemUnmap(ptr, G)) == "CUDA_ERROR_INVALID_VALUE"  # half of a's mapping
    assert error(cu.cuMemUnmap(ptr + G, 2 * G)) == "CUDA_ERROR_INVALID_VALUE"  # starts inside a mapping
    assert error(cu.cuMemUnmap(ptr, 4 * G)) == "CUDA_ERROR_INVALID_VALUE"  # runs past the last mapping
    assert error(cu.cuMemAddressFree(ptr, 4 * G)) == "CUDA_ERROR_INVALID_VALUE"
    assert "still mapped" in last_note(fake)
    ok(cu.cuMemUnmap(ptr, 3 * G))  # two whole adjacent mappings at once
    assert error(cu.cuMemAddressFree(ptr, 2 * G)) == "CUDA_ERROR_INVALID_VALUE"  # not the reserved size
    ok(cu.cuMemAddressFree(ptr, 4 * G))
    ok(cu.cuMemRelease(a))
    ok(cu.cuMemRelease(b))


def test_release_while_mapped_keeps_the_memory_until_the_last_unmap(cu, fake):
    handle = ok(cu.cuMemCreate(G, prop(cu), 0))
    ptr = int(ok(cu.cuMemAddressReserve(2 * G, G, 0, 0)))
    ok(cu.cuMemMap(ptr, G, 0, handle, 0))
    ok(cu.cuMemMap(ptr + G, G, 0, handle, 0))  # one handle at two addresses: shared memory
    ok(cu.cuMemSetAccess(ptr, 2 * G, access(cu), 1))
    ctypes.memset(ptr + 10, 0x5A, 3)
    assert host_bytes(ptr + G + 10, 3) == b"\x5a" * 3
    assert host_bytes(ptr, 4) == b"\xff" * 4  # new device memory is not zeroed
    ok(cu.cuMemRelease(handle))
    assert error(cu.cuMemRelease(handle)) == "CUDA_ERROR_INVALID_VALUE"  # twice
    assert fake.state()["handles"][0]["released"] == 1 and fake.state()["memory_used"] == G
    ok(cu.cuMemUnmap(ptr, G))
    assert host_bytes(ptr + G + 10, 3) == b"\x5a" * 3  # still backed through the other mapping
    ok(cu.cuMemUnmap(ptr + G, G))
    assert fake.state()["handles"] == [] and fake.state()["memory_used"] == 0
    assert error(cu.cuMemMap(ptr, G, 0, handle, 0)) == "CUDA_ERROR_INVALID_VALUE"  # gone
    ok(cu.cuMemAddressFree(ptr, 2 * G))


def test_memset_needs_writable_memory_and_unmap_before_sync_is_a_hazard(cu, fake):
    handle = ok(cu.cuMemCreate(G, prop(cu), 0))
    ptr = int(ok(cu.cuMemAddressReserve(G, G, 0, 0)))
    ok(cu.cuMemMap(ptr, G, 0, handle, 0))
    ok(cu.cuMemSetAccess(ptr, G, access(cu, "PROT_READ"), 1))
    assert error(cu.cuMemsetD8(ptr, 0, G)) == "CUDA_ERROR_INVALID_VALUE"
    ok(cu.cuMemSetAccess(ptr, G, access(cu), 1))
    ok(cu.cuMemsetD8(ptr, 0, G))
    assert host_bytes(ptr, 8) == bytes(8)
    ok(cu.cuMemUnmap(ptr, G))  # the memset may still be running on a real GPU
    assert fake.hazards() == 1 and "HAZARD" in last_note(fake)
    ok(cu.cuMemRelease(handle))
    ok(cu.cuMemAddressFree(ptr, G))
    fake.reset()  # the hazard was the point of this test


def test_injected_failures_hit_the_nth_matching_call(cu, fake):
    fake.fail("cuMemCreate", nth=2)
    first = ok(cu.cuMemCreate(G, prop(cu), 0))
    assert error(cu.cuMemCreate(G, prop(cu), 0)) == "CUDA_ERROR_OUT_OF_MEMORY"
    assert last_note(fake) == "injected" and len(fake.state()["handles"]) == 1
    third = ok(cu.cuMemCreate(G, prop(cu), 0))
    assert error(cu.cuMemCreate(65 << 20, prop(cu), 0)) == "CUDA_ERROR_OUT_OF_MEMORY"  # the device is 64 MiB
    ok(cu.cuMemRelease(first))
    ok(cu.cuMemRelease(third))


def test_a_write_to_read_only_device_memory_faults(fake_lib):
    """The fake's illegal-address fault is the host's: a write to a read-only mapping is SIGSEGV."""
    script = textwrap.dedent(f"""
        import ctypes, os
        lib = ctypes.CDLL({str(fake_lib.path)!r}, mode=os.RTLD_GLOBAL)
        lib.fake_cuda_reset(ctypes.c_size_t({G}), ctypes.c_size_t(1 << 24), 1, 1, 1)
        from cuda.bindings import driver as cu
        cu.cuInit(0)
        cu.cuCtxPushCurrent(cu.cuDevicePrimaryCtxRetain(0)[1])
        p = cu.CUmemAllocationProp(); p.type = 1; p.location.type = 1; p.location.id = 0
        a = cu.CUmemAccessDesc(); a.location.type = 1; a.location.id = 0; a.flags = 1
        h = cu.cuMemCreate({G}, p, 0)[1]
        ptr = int(cu.cuMemAddressReserve({G}, {G}, 0, 0)[1])
        cu.cuMemMap(ptr, {G}, 0, h, 0)
        assert cu.cuMemSetAccess(ptr, {G}, [a], 1)[0] == 0
        print(ctypes.c_uint8.from_address(ptr).value, flush=True)  # reading is fine
        ctypes.c_uint8.from_address(ptr).value = 1
        print("wrote", flush=True)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == -11 and run.stdout.split() == ["255"], (run.returncode, run.stdout, run.stderr[-2000:])
