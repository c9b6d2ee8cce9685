"""The CUDA backend and the CUDA kernel paths.

* The backend contract (map, unmap, share a page at two addresses, views, big reservations)
  runs on every backend that can run here: ``host`` always, ``cuda`` with a GPU, the driver
  and cuda-bindings (else skipped, with the reason).
* A ``VirtualKVCache`` on ``device="cuda"`` is checked against a dense float64 reference,
  through its own kernel and through every contiguous kernel this machine can run.
* On a machine without CUDA: asking for it raises ``BackendUnavailable`` (never an
  ImportError or AttributeError), and ``benchmarks/gpu_check.py --device cpu --smoke`` runs.
"""

from __future__ import annotations

import enum
import json
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import vmkv
from conftest import dense_attention
from vmkv.attention import CONTIGUOUS_KERNELS, _slot_rows, contiguous_kernel_unavailable, select_contiguous_kernel
from vmkv.errors import BackendError, BackendUnavailable, InvalidConfig
from vmkv.vm.cuda import CudaVirtualMemory, cuda_granularity
from vmkv.vm.host import HostVirtualMemory

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def cuda_status() -> tuple[bool, str]:
    """Whether the CUDA backend can run here, and if not, why (the skip reason)."""
    try:
        cuda_granularity("cuda")
    except BackendUnavailable as exc:
        return False, str(exc)
    return True, "CUDA backend available"


CUDA_OK, CUDA_REASON = cuda_status()
needs_cuda = pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)
needs_no_cuda = pytest.mark.skipif(CUDA_OK, reason="a GPU is present: the no-GPU error path cannot be shown")
BACKENDS = ["host", pytest.param("cuda", marks=[needs_cuda, pytest.mark.gpu])]


def open_vm(kind: str, num_pages: int = 8):
    if kind == "host":
        return HostVirtualMemory(2 * MiB, num_pages)
    return CudaVirtualMemory(cuda_granularity("cuda"), num_pages, device="cuda")


@pytest.fixture(params=BACKENDS)
def vm(request):
    backend = open_vm(request.param)
    yield backend
    backend.close()


# ---- the backend contract, on every backend ------------------------------------------------
def test_mapped_page_reads_back_what_was_written(vm):
    page = vm.page_size
    addr = vm.reserve(4 * page)
    vm.map(addr + page, 5)
    view = vm.tensor(addr + page, (page // 4,), torch.float32)
    view.copy_(torch.arange(page // 4, dtype=torch.float32, device=vm.device))
    again = vm.tensor(addr + page, (page // 4,), torch.float32)  # a second, independent view
    assert torch.equal(again.cpu(), torch.arange(page // 4, dtype=torch.float32))
    vm.synchronize()
    vm.unmap(addr + page)
    vm.free_reservation(addr, 4 * page)


def test_one_page_at_two_addresses_is_shared(vm):
    page = vm.page_size
    first, second = vm.reserve(2 * page), vm.reserve(2 * page)
    vm.map(first + page, 3)
    vm.map(second, 3)
    a = vm.tensor(first + page, (page,), torch.uint8)
    b = vm.tensor(second, (page,), torch.uint8)
    a[123] = 42
    b[page - 1] = 7
    assert b[123].item() == 42 and a[page - 1].item() == 7
    vm.synchronize()
    vm.unmap(second)
    assert a[123].item() == 42  # unmapping one address keeps the page at the other
    vm.synchronize()
    vm.unmap(first + page)
    vm.free_reservation(first, 2 * page)
    vm.free_reservation(second, 2 * page)


def test_typed_views_of_one_range_see_the_same_bytes(vm):
    page = vm.page_size
    addr = vm.reserve(2 * page)
    vm.map(addr, 0)
    vm.map(addr + page, 1)
    halves = vm.tensor(addr, (2, page // 2), torch.float16)  # spans both pages
    halves.fill_(1.5)
    for dtype in (torch.bfloat16, torch.float32):
        view = vm.tensor(addr, (2 * page // torch.empty((), dtype=dtype).element_size(),), dtype)
        assert view.data_ptr() == addr and view.device == vm.device
    raw = vm.tensor(addr + page, (4,), torch.uint8)  # 1.5 in float16 is 0x3E00, little-endian
    assert raw.cpu().tolist() == [0x00, 0x3E, 0x00, 0x3E]
    vm.synchronize()
    vm.unmap(addr)
    vm.unmap(addr + page)
    vm.free_reservation(addr, 2 * page)


def test_a_view_of_a_mostly_unmapped_range_is_usable_where_mapped(vm):
    page = vm.page_size
    addr = vm.reserve(64 * page)
    whole = vm.tensor(addr, (64, page), torch.uint8)  # created before anything is mapped
    vm.map(addr + 10 * page, 2)
    whole[10].fill_(9)
    assert int(vm.tensor(addr + 10 * page, (page,), torch.uint8).sum().item()) == 9 * page
    vm.synchronize()
    vm.unmap(addr + 10 * page)
    vm.free_reservation(addr, 64 * page)


def test_reserving_64_gib_takes_no_memory(vm):
    before = vm.resident_bytes()
    free_before = torch.cuda.mem_get_info(vm.device)[0] if vm.device.type == "cuda" else 0
    addr = vm.reserve((64 << 30) // vm.page_size * vm.page_size)
    assert vm.resident_bytes() == before
    if vm.device.type == "cuda":
        assert free_before - torch.cuda.mem_get_info(vm.device)[0] < 64 * MiB  # page tables at most
    vm.free_reservation(addr, (64 << 30) // vm.page_size * vm.page_size)


def test_bad_reservations_are_refused(vm):
    with pytest.raises(InvalidConfig):
        vm.reserve(vm.page_size + 1)
    with pytest.raises(BackendError):
        vm.free_reservation(12345 * vm.page_size, vm.page_size)


def test_close_is_idempotent_and_frees_everything():
    for kind in ["host"] + (["cuda"] if CUDA_OK else []):
        backend = open_vm(kind, num_pages=2)
        addr = backend.reserve(4 * backend.page_size)
        backend.map(addr, 1)
        backend.close()
        backend.close()


# ---- CUDA only -------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.gpu
def test_cuda_store_is_preallocated_and_errors_are_typed():
    vm = open_vm("cuda", num_pages=4)
    page = vm.page_size
    assert page % vm.granularity == 0 and vm.granularity >= 4096
    assert vm.resident_bytes() == 4 * page  # pages created x page size, before any map
    addr = vm.reserve(4 * page)
    vm.map(addr, 0)
    with pytest.raises(BackendError, match="already holds page 0"):
        vm.map(addr, 1)
    with pytest.raises(BackendError, match="nothing is mapped"):
        vm.unmap(addr + page)
    with pytest.raises(BackendError, match="page boundary"):
        vm.map(addr + vm.granularity // 2, 1)
    with pytest.raises(BackendError, match="not inside a reservation"):
        vm.map(addr + 8 * page, 1)
    with pytest.raises(BackendError, match="outside the store"):
        vm.map(addr + page, 4)
    with pytest.raises(BackendError, match="still mapped"):
        vm.free_reservation(addr, 4 * page)
    vm.release_page(0)  # a no-op: the store stays allocated
    assert vm.resident_bytes() >= 4 * page
    vm.close()
    with pytest.raises(InvalidConfig, match="multiple of"):
        CudaVirtualMemory(vm.granularity + 1, 1, device="cuda")


@needs_cuda
@pytest.mark.gpu
def test_cuda_map_from_another_thread_uses_torchs_context():
    import threading

    vm = open_vm("cuda", num_pages=2)
    addr = vm.reserve(2 * vm.page_size)
    errors = []

    def work() -> None:
        try:
            vm.map(addr + vm.page_size, 1)
        except Exception as exc:  # reported below, in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors
    view = vm.tensor(addr + vm.page_size, (16,), torch.int32)
    view.fill_(3)
    assert int(view.sum()) == 48
    vm.close()


def _cuda_config(dtype: str = "float16", **overrides) -> vmkv.KVCacheConfig:
    # 8 KV heads x 128 x fp16 = 2 KiB a token: a 2 MiB page holds 1024 tokens.
    values = dict(
        num_layers=2, num_kv_heads=8, head_dim=128, dtype=dtype, device="cuda", max_batch_size=4,
        max_seq_len=2048, memory_budget=48 * 4 * 2 * MiB, page_size=cuda_granularity("cuda") if CUDA_OK else 2 * MiB,
    )
    values.update(overrides)
    return vmkv.KVCacheConfig(**values)


class CudaMirror:
    """Drives a CUDA cache with random K/V and keeps dense CPU copies for the reference."""

    def __init__(self, cache: vmkv.KVCacheBase, q_heads: int) -> None:
        self.cache, self.q_heads = cache, q_heads
        self.gen = torch.Generator().manual_seed(0)
        self.k: dict = {}
        self.v: dict = {}

    def rand(self, *shape: int) -> torch.Tensor:  # CPU, in the cache dtype
        return torch.randn(*shape, generator=self.gen).to(self.cache.config.dtype)

    def step(self, batch: dict) -> None:
        cfg, dev = self.cache.config, self.cache.config.device
        plan = self.cache.begin_step(batch)
        counts = {seq_id: new if isinstance(new, int) else len(new) for seq_id, new in batch.items()}
        total = sum(counts.values())
        for layer in range(cfg.num_layers):
            k, v = self.rand(total, cfg.num_kv_heads, cfg.head_dim), self.rand(total, cfg.num_kv_heads, cfg.head_dim)
            q = self.rand(total, self.q_heads, cfg.head_dim)
            self.cache.write(layer, k.to(dev), v.to(dev), plan)
            outs = {"cache": self.cache.attention(layer, q.to(dev), plan).cpu()}
            k_view, v_view = self.cache.kv_cache(layer)
            for name in CONTIGUOUS_KERNELS:
                if contiguous_kernel_unavailable(name, dev, cfg.dtype, cfg.head_dim) is None:
                    outs[name] = CONTIGUOUS_KERNELS[name](q.to(dev), k_view, v_view, plan, None).cpu()
            offset = 0
            for seq_id, n in counts.items():
                ks = self.k.setdefault(seq_id, [k[:0]] * cfg.num_layers)
                vs = self.v.setdefault(seq_id, [v[:0]] * cfg.num_layers)
                start = ks[layer].shape[0]
                ks[layer] = torch.cat([ks[layer], k[offset : offset + n]])
                vs[layer] = torch.cat([vs[layer], v[offset : offset + n]])
                want = dense_attention(q[offset : offset + n].float(), ks[layer].float(), vs[layer].float(), start)
                for name, out in outs.items():
                    got = out[offset : offset + n].float()
                    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")
                offset += n
        self.cache.check()

    def fork(self, src, dst) -> None:
        self.cache.fork(src, dst)
        self.k[dst], self.v[dst] = list(self.k[src]), list(self.v[src])


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_cuda_cache_attention_matches_dense_reference(dtype, layout):
    # all_layers also maps ahead: pages mapped from a background thread, in torch's context.
    cache = vmkv.open_cache(_cuda_config(dtype, layout=layout, map_ahead=layout == "all_layers"))
    assert cache.stats()["backend"] == "cuda"
    if dtype == "float32":
        assert cache.kernel == "sdpa_per_sequence"  # FlashAttention kernels need fp16/bf16
    run_scenario(cache)
    stats = cache.stats()
    store = stats["pages_total"] * stats["page_bytes"]  # preallocated; plus at most the probe granule
    assert store <= stats["resident_bytes"] <= store + cuda_granularity("cuda")
    cache.close()


def test_the_cuda_scenario_itself_on_the_host_backend():
    """The scenario above, run here on the host backend, so the test's own logic is checked
    on machines without a GPU too."""
    # 2 layers x 2 heads x 32 x 4 B = 512 B a token in the all-layers tensor: 8 tokens a 4 KiB page.
    config = _cuda_config("float32", device="cpu", layout="all_layers", map_ahead=True, num_kv_heads=2, head_dim=32,
                          page_size="4KiB", max_seq_len=256, memory_budget=64 * 2 * 4096)
    cache = vmkv.open_cache(config)
    run_scenario(cache, whole=64, q_heads=4)
    cache.close()


def run_scenario(cache: vmkv.KVCacheBase, whole: int = 1024, q_heads: int = 16) -> None:
    """Prefill chunks, decode, fork + copy-on-write, free, prefix-cache hit; every step's
    attention (the cache's kernel and every kernel that can run) against the dense reference.

    ``whole`` tokens must be a whole number of pages (1024 is, for every GPU config above).
    """
    mirror = CudaMirror(cache, q_heads)
    for seq in ("a", "b", "c"):
        cache.add(seq)
    mirror.step({"a": whole * 11 // 16, "b": 5, "c": 1})  # prefill chunks of different lengths
    mirror.step({"a": whole * 6 // 16, "b": 1, "c": 1})  # "a" grows past ``whole`` tokens
    for _ in range(3):
        mirror.step({"a": 1, "b": 1, "c": 1})  # decode
    mirror.fork("a", "d")  # shares a's pages; the next write into the shared page copies it
    mirror.step({"a": 1, "d": 2})
    assert cache.stats()["cow_copies"] >= 1
    cache.free("b")
    mirror.step({"c": 3, "d": 1})
    prompt = list(range(whole + whole // 8 - 1))  # a part page past ``whole``: p caches ``whole``
    cache.add("p", prompt)
    mirror.step({"p": prompt})
    cache.free("c")
    cache.add("q", prompt + [5, 6])  # finds p's full pages: mapped into q's slot, not copied
    assert cache.seq_len("q") == whole and cache.stats()["prefix_hits"] == 1
    mirror.k["q"] = [k[:whole] for k in mirror.k["p"]]
    mirror.v["q"] = [v[:whole] for v in mirror.v["p"]]
    mirror.step({"q": prompt[whole:] + [5, 6], "p": 1})
    for seq in ("a", "d", "p", "q"):
        for layer in range(cache.config.num_layers):
            k, v = cache.kv(seq, layer)
            assert torch.equal(k.cpu(), mirror.k[seq][layer]) and torch.equal(v.cpu(), mirror.v[seq][layer])


# ---- kernels: pieces that run on any machine -----------------------------------------------
@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_slot_rows_address_each_slot_without_copying(layout):
    layers, batch, cap, heads, dim = 3, 4, 8, 2, 4
    if layout == "per_layer":
        full = torch.randn(batch, cap, heads, dim)
        layer_view = full
    else:
        full = torch.randn(batch, cap, layers, heads, dim)
        layer_view = full[:, :, 1]
    for view in (layer_view, layer_view[:, :5]):  # the whole capacity and a [:, :n] slice
        rows, per_slot = _slot_rows(view)
        assert per_slot == cap and rows.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
        for slot in range(batch):
            assert torch.equal(rows[slot * per_slot : slot * per_slot + view.shape[1]], view[slot])


def test_kernel_selection_names_why_faster_kernels_are_skipped():
    assert select_contiguous_kernel(torch.device("cpu"))[0] == "sdpa_adaptive"
    assert contiguous_kernel_unavailable("sdpa_per_sequence", torch.device("cpu")) is None
    assert "unknown kernel" in contiguous_kernel_unavailable("nope", torch.device("cpu"))
    if not torch.cuda.is_available():
        assert "needs a CUDA device" in contiguous_kernel_unavailable("varlen_attn_seqused", torch.device("cuda", 0))
    elif CUDA_OK:
        reason = contiguous_kernel_unavailable("varlen_attn_seqused", torch.device("cuda", 0), torch.float32, 128)
        assert "float16 or bfloat16" in reason


# ---- no GPU here: one clear error ------------------------------------------------------------
@needs_no_cuda
def test_asking_for_cuda_without_a_gpu_raises_backend_unavailable():
    for attempt in (
        lambda: cuda_granularity("cuda"),
        lambda: CudaVirtualMemory(2 * MiB, 1, device="cuda"),
        lambda: vmkv.open_cache(_cuda_config()),
    ):
        with pytest.raises(BackendUnavailable, match="^CUDA driver not available: ") as info:
            attempt()
        assert not isinstance(info.value, (ImportError, AttributeError))


def test_missing_cuda_bindings_is_backend_unavailable(monkeypatch):
    """Even where torch sees a GPU, a missing cuda-bindings package is the same clear error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # makes the import fail
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    with pytest.raises(BackendUnavailable, match="^CUDA driver not available: cannot import cuda.bindings"):
        cuda_granularity(torch.device("cuda", 0))


# ---- the backend's own logic, against a recording fake of cuda.bindings.driver ----------------
class FakeDriver:
    """Just enough of ``cuda.bindings.driver`` to run ``CudaVirtualMemory`` without a GPU.

    Calls return ``(CUresult, *values)`` like the real bindings; it records every call, keeps
    the current context per thread, refuses maps of mapped ranges and unmaps of unmapped ones,
    and fails the calls named in ``fail`` with ``CUDA_ERROR_OUT_OF_MEMORY``.
    """

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_OUT_OF_MEMORY = 2

    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
    CUdevice_attribute = SimpleNamespace(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=102)
    GRANULARITY = 2 * MiB
    CONTEXT = 0xC0
    CUmemAllocationProp = CUmemAccessDesc = staticmethod(lambda: SimpleNamespace(location=SimpleNamespace()))

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.mapped: dict[int, int] = {}
        self.fail: set[str] = set()
        self.local = threading.local()
        self.next_addr, self.next_handle = 1 << 40, 1

    def _result(self, name: str, *args, values=()) -> tuple:
        self.calls.append((name, *args))
        if name in self.fail:
            return (self.CUresult.CUDA_ERROR_OUT_OF_MEMORY,)
        return (self.CUresult.CUDA_SUCCESS, *values)

    def cuInit(self, flags): return self._result("cuInit")
    def cuDeviceGetAttribute(self, attribute, device): return self._result("attr", values=(1,))
    def cuMemGetAllocationGranularity(self, prop, flag): return self._result("granularity", values=(self.GRANULARITY,))
    def cuDevicePrimaryCtxRetain(self, device): return self._result("retain", device, values=(self.CONTEXT,))
    def cuDevicePrimaryCtxRelease(self, device): return self._result("release_ctx", device)
    def cuCtxGetCurrent(self): return (self.CUresult.CUDA_SUCCESS, getattr(self.local, "stack", [0])[-1])
    def cuCtxPushCurrent(self, ctx):
        self.local.stack = getattr(self.local, "stack", [0]) + [int(ctx)]
        return self._result("push")
    def cuCtxPopCurrent(self):
        return self._result("pop", values=(self.local.stack.pop(),))
    def cuMemCreate(self, size, prop, flags):
        self.next_handle += 1
        return self._result("create", size, values=(self.next_handle,))
    def cuMemAddressReserve(self, size, alignment, addr, flags):
        self.next_addr += size + (1 << 30)
        return self._result("reserve", size, alignment, values=(self.next_addr - size - (1 << 30),))
    def cuMemMap(self, addr, size, offset, handle, flags):
        if addr in self.mapped:
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)
        result = self._result("map", addr, size, handle)
        if result[0] == 0:
            self.mapped[addr] = handle
        return result
    def cuMemSetAccess(self, addr, size, descs, count): return self._result("access", addr, size, count)
    def cuMemUnmap(self, addr, size):
        if self.mapped.pop(addr, None) is None:
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)
        return self._result("unmap", addr, size)
    def cuMemRelease(self, handle): return self._result("release", handle)
    def cuMemAddressFree(self, addr, size): return self._result("free", addr, size)


@pytest.fixture
def fake_driver(monkeypatch):
    driver = FakeDriver()
    bindings = SimpleNamespace(driver=driver)
    monkeypatch.setitem(sys.modules, "cuda", SimpleNamespace(bindings=bindings))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: driver.calls.append(("synchronize",)))
    driver.local.stack = [0, FakeDriver.CONTEXT]  # torch made its primary context current here
    return driver


def test_backend_drives_the_driver_as_documented(fake_driver):
    page = 2 * FakeDriver.GRANULARITY
    assert cuda_granularity("cuda:0") == FakeDriver.GRANULARITY
    vm = CudaVirtualMemory(page, 3, device="cuda:0")
    assert [c[1] for c in fake_driver.calls if c[0] == "create"] == [page] * 3  # the whole store, up front
    assert vm.resident_bytes() == 3 * page
    addr = vm.reserve(4 * page)
    assert ("reserve", 4 * page, FakeDriver.GRANULARITY) in fake_driver.calls
    vm.map(addr + page, 2)
    assert fake_driver.calls[-2:] == [("map", addr + page, page, 4), ("access", addr + page, page, 1)]
    fake_driver.fail = {"access"}  # a refused cuMemSetAccess leaves nothing mapped
    with pytest.raises(BackendError, match="cuMemSetAccess at .* failed: CUDA_ERROR_OUT_OF_MEMORY"):
        vm.map(addr, 0)
    assert addr not in fake_driver.mapped
    fake_driver.fail = set()
    with pytest.raises(BackendError, match="already holds page 2"):
        vm.map(addr + page, 1)

    with vm._probe_at(addr + 3 * page + 64):  # nothing mapped there: a granule is, for the call
        assert fake_driver.mapped[addr + 3 * page] == 5
    assert addr + 3 * page not in fake_driver.mapped and vm.resident_bytes() == 3 * page + FakeDriver.GRANULARITY
    before = len(fake_driver.calls)
    with vm._probe_at(addr + page + 64):  # mapped already: nothing to do
        pass
    assert len(fake_driver.calls) == before

    def map_elsewhere() -> None:  # a thread where torch's context is not current
        vm.map(addr + 2 * page, 0)

    thread = threading.Thread(target=map_elsewhere)
    thread.start()
    thread.join()
    assert [c[0] for c in fake_driver.calls[before:]] == ["push", "map", "access", "pop"]

    vm.close()
    vm.close()
    assert fake_driver.mapped == {}
    assert [c[0] for c in fake_driver.calls if c[0] in ("release", "release_ctx", "free")] == (
        ["free"] + ["release"] * 4 + ["release_ctx"]  # 3 pages + the probe granule, then the context
    )
    assert fake_driver.calls.index(("synchronize",), before) < fake_driver.calls.index(("unmap", addr + page, page))


def test_backend_gives_everything_back_when_the_store_does_not_fit(fake_driver):
    fake_driver.fail = {"create"}
    with pytest.raises(BackendError, match="does not fit in free GPU memory; lower memory_budget"):
        CudaVirtualMemory(FakeDriver.GRANULARITY, 4, device="cuda:0")
    assert [c[0] for c in fake_driver.calls[-2:]] == ["synchronize", "release_ctx"]


# ---- the GPU check script --------------------------------------------------------------------
def test_gpu_check_help_and_cpu_smoke_run(tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import gpu_check
    finally:
        sys.path.remove(str(ROOT))
    with pytest.raises(SystemExit) as done:
        gpu_check.parse_args(["--help"])
    assert done.value.code == 0 and "--smoke" in capsys.readouterr().out
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    run = subprocess.run(
        [sys.executable, script, "--device", "cpu", "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    for section in ("environment", "decode", "map_unmap", "paged_vs_vmm"):
        assert section in report["sections"], report["sections"].keys()
    decode = report["sections"]["decode"]
    assert decode["ok"], decode
    row = decode["result"]["kernels"]["sdpa_per_sequence"]
    assert row["max_abs_diff"] == 0.0 and row["vmm_over_dense"] > 0  # same kernel, same bytes
    assert report["sections"]["map_unmap"]["ok"], report["sections"]["map_unmap"]
    assert "decode" in run.stdout  # the table is printed
