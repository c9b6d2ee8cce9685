"""pytest fixtures for the fake CUDA driver (import them into a test module to use them)."""

from __future__ import annotations

import pytest

from . import FakeDriver, FakeRuntime, FakeUnavailable


@pytest.fixture(scope="session")
def fake_lib(tmp_path_factory) -> FakeDriver:
    """The fake ``libcuda.so.1``, compiled once per test session into a temporary directory and
    loaded into this process (skips with the reason where that cannot be done)."""
    try:
        return FakeDriver.load(tmp_path_factory.mktemp("fake-cuda"))
    except FakeUnavailable as exc:
        pytest.skip(str(exc))


def leftovers(fake: FakeDriver) -> dict:
    """What the driver still holds beyond the context torch keeps: should be empty after a test."""
    state = fake.state()
    left = {key: state[key] for key in ("handles", "reservations", "mappings") if state[key]}
    if any(count > 1 for count in state["context_retains"]):
        left["context_retains"] = state["context_retains"]
    if state["hazards"]:
        left["hazards"] = state["hazards"]
    return left


@pytest.fixture
def fake(fake_lib: FakeDriver) -> FakeDriver:
    """A fresh fake device (64 KiB granularity, 64 MiB); after the test, everything the test
    created must have been given back (no handle, reservation, mapping or context reference
    left, no unmap under pending device work)."""
    fake_lib.reset()
    yield fake_lib
    left = leftovers(fake_lib)  # refcounting has freed what the test let go of (no gc.collect: 0.3 s)
    fake_lib.reset()
    assert not left, f"the test left driver objects behind: {left}"


@pytest.fixture
def runtime(fake: FakeDriver) -> FakeRuntime:
    """Torch's side of CUDA, against the fake driver."""
    return FakeRuntime()


class Backends(list):
    """The backends :func:`fake_cuda_backends` opened, and the torch runtime they share."""

    def __init__(self, runtime: FakeRuntime) -> None:
        super().__init__()
        self.runtime = runtime


@pytest.fixture
def fake_cuda_backends(fake: FakeDriver, monkeypatch) -> Backends:
    """Make ``vmkv.open_cache`` on a CPU config build its VMM ranges with the CUDA backend on
    the fake driver (4 KiB granularity): the cache's tensors are CPU tensors over the fake's
    host-backed device memory, so the CPU kernels run on them. Yields the backends opened
    (``.runtime``: torch's side of CUDA they use; pass it to anything else that asks the driver)."""
    import vmkv.vm
    import vmkv.vmm.ranges
    from vmkv.vm.cuda import CudaVirtualMemory, cuda_granularity

    fake.reset(granularity=4096)
    runtime = FakeRuntime()
    backends = Backends(runtime)

    def open_backend(device, page_size: int, num_pages: int, *, on_demand: bool = False,
                     **_host_only) -> CudaVirtualMemory:
        backend = CudaVirtualMemory(page_size, num_pages, device="cuda:0", runtime=runtime, on_demand=on_demand)
        backends.append(backend)
        return backend

    monkeypatch.setattr(vmkv.vmm.ranges, "open_backend", open_backend)
    monkeypatch.setattr(vmkv.vm, "granularity", lambda device: cuda_granularity("cuda:0", runtime=runtime))
    return backends
