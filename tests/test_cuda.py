"""The CUDA backend and the CUDA kernel paths.

* The backend contract (map, unmap, share a page at two addresses, views, empty pages read as
  zeros, views outlive ``close()``, big reservations) runs on every backend that can run here:
  ``host`` always; ``fake_cuda`` -- the real CUDA backend driving the fake driver library of
  ``tests/fake_cuda`` through the real cuda-bindings -- wherever gcc and cuda-bindings are; and
  ``cuda`` with a GPU, the driver and cuda-bindings (else skipped, with the reason).
* A ``VirtualKVCache`` over the CUDA backend is checked against a dense float64 reference: on
  the fake driver here (CPU tensors over the fake's host-backed device memory), and on a GPU
  through its own kernel and through every contiguous kernel that machine can run.
* On a machine without CUDA: asking for it raises ``BackendUnavailable`` (never an
  ImportError or AttributeError). The GPU check script itself: tests/test_gpu_check.py.

The fake driver's own rules, call order, rollback and fault injection: ``tests/fake_cuda/``.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch
from fake_cuda import FakeRuntime
from fake_cuda.fixtures import fake, fake_cuda_backends, fake_lib, runtime  # noqa: F401  (fixtures)
from helpers import KVMirror, dense_attention

import vmkv
import vmkv.vmm.cache
from vmkv.errors import BackendError, BackendUnavailable, InvalidConfig
from vmkv.kernels import registry
from vmkv.kernels.contiguous import _slot_rows
from vmkv.vm.cuda import CudaVirtualMemory, TorchCudaRuntime, cuda_granularity
from vmkv.vm.host import HostVirtualMemory

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]
FAKE_PAGE = 128 << 10  # two granules of the fake's default 64 KiB: pages bigger than the granularity


def cuda_status() -> tuple[bool, str]:
    """Whether the CUDA backend can run here on a real GPU, and if not, why (the skip reason)."""
    try:
        cuda_granularity("cuda")
    except BackendUnavailable as exc:
        return False, str(exc)
    return True, "CUDA backend available"


CUDA_OK, CUDA_REASON = cuda_status()
needs_cuda = pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)
needs_no_cuda = pytest.mark.skipif(CUDA_OK, reason="a GPU is present: the no-GPU error path cannot be shown")
CUDA_KINDS = ["fake_cuda", pytest.param("cuda", marks=[needs_cuda, pytest.mark.gpu])]
BACKENDS = ["host", *CUDA_KINDS]


def open_vm(request: pytest.FixtureRequest, kind: str, num_pages: int = 8):
    """A backend of ``kind`` with ``num_pages`` pages (the fake's fixtures are pulled in on demand)."""
    if kind == "host":
        return HostVirtualMemory(2 * MiB, num_pages)
    if kind == "fake_cuda":
        return CudaVirtualMemory(FAKE_PAGE, num_pages, device="cuda:0", runtime=request.getfixturevalue("runtime"))
    return CudaVirtualMemory(cuda_granularity("cuda"), num_pages, device="cuda")


@pytest.fixture(params=BACKENDS)
def vm(request):
    backend = open_vm(request, request.param)
    yield backend
    backend.close()


@pytest.fixture(params=CUDA_KINDS)
def cuda_vm(request):
    """The CUDA backend, on the fake driver or on a GPU: 4 pages."""
    backend = open_vm(request, request.param, num_pages=4)
    yield backend
    backend.close()


def on_fake(vm) -> bool:
    return isinstance(getattr(vm, "_runtime", None), FakeRuntime)


# ---- the backend contract, on every backend ------------------------------------------------
def test_mapped_page_reads_back_what_was_written(vm):
    page = vm.page_size
    addr = vm.reserve(4 * page)
    vm.map(addr + page, 5)
    view = vm.tensor(addr + page, (page // 4,), torch.float32)
    view.copy_(torch.arange(page // 4, dtype=torch.float32, device=view.device))
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
    assert a[123].item() == 42 and b[123].item() == 0  # the page stays at the other address
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
        assert view.data_ptr() == addr and view.device == halves.device
    raw = vm.tensor(addr + page, (4,), torch.uint8)  # 1.5 in float16 is 0x3E00, little-endian
    assert raw.cpu().tolist() == [0x00, 0x3E, 0x00, 0x3E]
    vm.synchronize()
    vm.unmap(addr)
    vm.unmap(addr + page)
    vm.free_reservation(addr, 2 * page)


def test_empty_pages_and_fresh_pages_read_zeros(vm):
    """Every page of a reservation reads zeros until data is written, a page mapped for the
    first time too (CUDA: cuMemCreate memory is not zeroed, so the backend zeroes it at open;
    the fake fills new memory with 0xFF, a NaN in every float format)."""
    page = vm.page_size
    addr = vm.reserve(vm.num_pages * page)
    whole = vm.tensor(addr, (vm.num_pages, page // 4), torch.float32)  # created before anything is mapped
    assert int(torch.count_nonzero(whole.cpu())) == 0
    for p in range(vm.num_pages):
        vm.map(addr + p * page, p)
    assert int(torch.count_nonzero(whole.cpu())) == 0 and not whole.isnan().any()
    whole[2].fill_(9.0)
    assert whole.sum(1).cpu().tolist() == [0.0, 0.0, 9.0 * page // 4] + [0.0] * (vm.num_pages - 3)
    vm.synchronize()
    vm.unmap(addr + 2 * page)  # back to the zero page: reads zeros, the data stays in page 2
    assert int(torch.count_nonzero(whole.cpu())) == 0
    vm.unmap(addr + 3 * page)
    vm.map(addr + 3 * page, 2)
    assert whole[3].sum().item() == 9.0 * page // 4
    vm.synchronize()
    vm.free_reservation(addr, vm.num_pages * page)  # unmaps what is still mapped


def test_views_outlive_close_and_read_zeros(vm):
    page = vm.page_size
    addr = vm.reserve(3 * page)
    vm.map(addr + page, 1)
    view = vm.tensor(addr, (3 * page,), torch.uint8)
    view[page : 2 * page].fill_(5)
    assert int(view.sum().item()) == 5 * page
    vm.close()
    assert int(torch.count_nonzero(view.cpu())) == 0  # the data page is gone, the range is not
    if vm.name == "cuda":
        assert vm.resident_bytes() == 0
    vm.close()  # idempotent


def test_reserving_a_lot_takes_no_memory(vm):
    """64 GiB of address space (4,096 pages on the fake: each zero-page mapping is a host
    mapping there, and Linux caps a process at 65,530)."""
    real_gpu = vm.name == "cuda" and not on_fake(vm)
    before = vm.resident_bytes()
    free_before = torch.cuda.mem_get_info(vm.device)[0] if real_gpu else 0
    size = 4096 * vm.page_size if on_fake(vm) else (64 << 30) // vm.page_size * vm.page_size
    addr = vm.reserve(size)
    assert vm.resident_bytes() == before
    if real_gpu:
        assert free_before - torch.cuda.mem_get_info(vm.device)[0] < 64 * MiB  # page tables at most
    probe = vm.tensor(addr + size - vm.page_size, (vm.page_size,), torch.uint8)
    assert int(torch.count_nonzero(probe.cpu())) == 0
    del probe
    vm.free_reservation(addr, size)


def test_bad_reservations_are_refused(vm):
    with pytest.raises(InvalidConfig):
        vm.reserve(vm.page_size + 1)
    with pytest.raises(BackendError):
        vm.free_reservation(12345 * vm.page_size, vm.page_size)


# ---- the CUDA backend, on the fake driver and on a GPU ---------------------------------------
def test_cuda_store_is_preallocated_and_errors_are_typed(cuda_vm):
    vm = cuda_vm
    page = vm.page_size
    assert page % vm.granularity == 0 and vm.granularity >= 4096
    assert vm.resident_bytes() == 5 * page  # 4 pages and the zero page, before any map
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
    with pytest.raises(BackendError, match="outside the store"):
        vm.map(addr + page, True)
    with pytest.raises(BackendError, match="not inside a reservation"):
        vm.tensor(addr + 3 * page, (2 * page,), torch.uint8)
    vm.release_page(0)  # a no-op: the store stays allocated
    assert vm.resident_bytes() == 5 * page
    vm.close()
    with pytest.raises(BackendError, match="closed"):
        vm.reserve(page)


def test_cuda_bad_page_sizes_are_refused(cuda_vm):
    for page_size, num_pages in ((cuda_vm.granularity + 4096, 1), (cuda_vm.granularity, 0), (cuda_vm.granularity, 1.5)):
        with pytest.raises(InvalidConfig):
            CudaVirtualMemory(page_size, num_pages, device=cuda_vm.device, runtime=cuda_vm._runtime)


def test_cuda_map_from_another_thread_uses_torchs_context(cuda_vm):
    vm = cuda_vm
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
    del view


# ---- the VMM cache over the CUDA backend ------------------------------------------------------
def _cuda_config(dtype: str = "float16", **overrides) -> vmkv.KVCacheConfig:
    # 8 KV heads x 128 x fp16 = 2 KiB a token: a 2 MiB page holds 1024 tokens.
    values = dict(
        num_layers=2, num_kv_heads=8, head_dim=128, dtype=dtype, device="cuda", max_batch_size=4,
        max_seq_len=2048, memory_budget=48 * 4 * 2 * MiB, page_size=cuda_granularity("cuda") if CUDA_OK else 2 * MiB,
    )
    values.update(overrides)
    return vmkv.KVCacheConfig(**values)


def _small_config(layout: str) -> vmkv.KVCacheConfig:
    """2 layers x 2 heads x 32 x fp32: 256 B a token per tensor; 4 KiB pages hold 16 tokens
    per layer (per_layer) or 8 (all_layers)."""
    tensors = 4 if layout == "per_layer" else 2
    return _cuda_config("float32", device="cpu", layout=layout, map_ahead=layout == "all_layers", num_kv_heads=2, head_dim=32,
                        page_size="4KiB", max_seq_len=256, memory_budget=64 * tensors * 4096)
class CudaMirror(KVMirror):
    """Drives a CUDA cache with random K/V and keeps dense CPU copies for the reference."""

    def step(self, batch: dict) -> None:
        cfg, dev = self.cache.config, self.cache.config.device
        plan = self.cache.begin_step(batch)
        counts = {seq_id: new if isinstance(new, int) else len(new) for seq_id, new in batch.items()}
        total = sum(counts.values())
        for layer in range(cfg.num_layers):
            k, v = self.randn(total, cfg.num_kv_heads, cfg.head_dim), self.randn(total, cfg.num_kv_heads, cfg.head_dim)
            q = self.randn(total, self.q_heads, cfg.head_dim)
            self.cache.write(layer, k.to(dev), v.to(dev), plan)
            outs = {"cache": self.cache.attention(layer, q.to(dev), plan).cpu()}
            k_view, v_view = self.cache.kv_cache(layer)
            spec = registry.KernelSpec("slots", dev, cfg.dtype, cfg.num_kv_heads, cfg.head_dim)
            for name in registry.names("slots"):
                if registry.KERNELS[name].decode_only and not plan.is_decode:
                    continue  # (the cache pairs it with another kernel for these steps)
                if registry.unavailable(name, spec) is None:
                    outs[name] = registry.build(name, spec)(q.to(dev), k_view, v_view, plan, None).cpu()
            offset = 0
            for seq_id, n in counts.items():
                start = self.record(seq_id, layer, k[offset : offset + n], v[offset : offset + n])
                want = dense_attention(q[offset : offset + n].float(), self.k[seq_id][layer].float(),
                                       self.v[seq_id][layer].float(), start)
                for name, out in outs.items():
                    got = out[offset : offset + n].float()
                    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")
                offset += n
        self.cache.check()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_cuda_cache_attention_matches_dense_reference(dtype, layout):
    # all_layers also maps ahead: pages mapped from a background thread, in torch's context.
    cache = vmkv.open_cache(_cuda_config(dtype, layout=layout, map_ahead=layout == "all_layers"))
    assert cache.stats()["backend"] == "cuda"
    if dtype == "float32":  # FlashAttention kernels need fp16/bf16: the rule's next kernel that reads float32
        assert cache.kernel in ("triton", "sdpa_per_sequence") and cache.kernel == registry.choose(
            registry.KernelSpec("slots", torch.device("cuda", 0), torch.float32, cache.config.num_kv_heads,
                                cache.config.head_dim)).name
    run_scenario(cache)
    stats = cache.stats()
    assert stats["resident_bytes"] == stats["pages_total"] * stats["page_bytes"] + stats["page_size"]  # + the zero page
    k_all, _ = cache.kv_cache(0)
    cache.close()
    assert int(torch.count_nonzero(k_all)) == 0  # a view after close reads zeros


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_vmm_cache_on_the_fake_cuda_driver_matches_dense_reference(fake_cuda_backends, fake, layout):  # noqa: F811
    """The whole VMM cache over the real CUDA backend, the real bindings and the fake driver:
    prefill, decode, fork + copy-on-write, free, prefix hit, map-ahead from a worker thread.
    No driver call may fail, nothing may be left behind, views read zeros after close."""
    cache = vmkv.open_cache(_small_config(layout))
    assert cache.stats()["backend"] == "cuda" and len(fake_cuda_backends) == 1
    run_scenario(cache, whole=64, q_heads=4)
    stats = cache.stats()
    assert stats["resident_bytes"] == stats["pages_total"] * stats["page_bytes"] + stats["page_size"]
    calls = fake.calls()
    assert [c for c in calls if not c.ok] == [], "a driver call failed in normal use"
    if stats["pages_mapped_ahead"]:  # the map-ahead worker pushed torch's context on its thread
        assert any(c.name == "cuCtxPushCurrent" for c in calls)
    k_all, v_all = cache.kv_cache(0)
    assert int(torch.count_nonzero(k_all)) > 0
    cache.close()
    assert int(torch.count_nonzero(k_all)) == 0 and int(torch.count_nonzero(v_all)) == 0


def test_the_cuda_scenario_itself_on_the_host_backend():
    """The scenario above, run here on the host backend, so the test's own logic is checked
    on machines without a GPU too."""
    cache = vmkv.open_cache(_small_config("all_layers"))
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
    k_all, v_all = cache.kv_cache(0)  # past every sequence's pages: the zero page, read without a fault
    assert int(torch.count_nonzero(k_all[:, -1])) == 0 and int(torch.count_nonzero(v_all[:, -1])) == 0


# ---- kernels: pieces that run on any machine -----------------------------------------------
@pytest.mark.parametrize("layout", ["per_layer", "head_major", "all_layers"])
def test_slot_rows_address_each_slot_without_copying(layout):
    layers, batch, cap, heads, dim = 3, 4, 8, 2, 4
    if layout == "per_layer":
        full = torch.randn(batch, cap, heads, dim)
        layer_view, rows_per_slot = full, cap
    elif layout == "head_major":
        full = torch.randn(batch, heads, cap, dim)
        layer_view, rows_per_slot = full.permute(0, 2, 1, 3), heads * cap  # [B, S, H, D] over [B, H, S, D]
    else:
        full = torch.randn(batch, cap, layers, heads, dim)
        layer_view, rows_per_slot = full[:, :, 1], cap  # token stride L * H * D
    for view in (layer_view, layer_view[:, :5]):  # the whole capacity and a [:, :n] slice
        rows, per_slot = _slot_rows(view)
        assert per_slot == rows_per_slot and rows.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
        last = rows.storage_offset() + sum((size - 1) * stride for size, stride in zip(rows.shape, rows.stride()))
        assert last < full.numel()  # no element of the row view lies past the tensor
        for slot in range(batch):
            assert torch.equal(rows[slot * per_slot : slot * per_slot + view.shape[1]], view[slot])


def test_kernel_selection_names_why_faster_kernels_are_skipped():
    cpu = registry.KernelSpec("slots", torch.device("cpu"), torch.float32, 8, 128)
    assert registry.choose(cpu).name == "sdpa_adaptive"
    assert registry.unavailable("sdpa_per_sequence", cpu) is None
    assert "unknown kernel" in registry.unavailable("nope", cpu)
    if not torch.cuda.is_available():
        cuda = registry.KernelSpec("slots", torch.device("cuda", 0), torch.float16, 8, 128)
        assert "needs a CUDA device" in registry.unavailable("varlen_attn_seqused", cuda)
    elif CUDA_OK:
        cuda = registry.KernelSpec("slots", torch.device("cuda", 0), torch.float32, 8, 128)
        assert "float16 or bfloat16" in registry.unavailable("varlen_attn_seqused", cuda)


# ---- no GPU here: one clear error ------------------------------------------------------------
@needs_no_cuda
def test_asking_for_cuda_without_a_gpu_raises_backend_unavailable():
    assert "sees no CUDA GPU" in TorchCudaRuntime().unavailable_reason()
    for attempt in (
        lambda: cuda_granularity("cuda"),
        lambda: CudaVirtualMemory(2 * MiB, 1, device="cuda"),
        lambda: vmkv.open_cache(_cuda_config()),
    ):
        with pytest.raises(BackendUnavailable, match="^CUDA driver not available: ") as info:
            attempt()
        assert not isinstance(info.value, (ImportError, AttributeError))


class _SeesAGpu(TorchCudaRuntime):
    """torch's side says a GPU is there (whatever the driver says)."""

    def unavailable_reason(self):
        return None

    def device_count(self):
        return 1

    def current_device(self):
        return 0

    def activate(self, index):
        pass


def test_missing_cuda_bindings_is_backend_unavailable(monkeypatch):
    """Even where torch sees a GPU, a missing cuda-bindings package is the same clear error."""
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # makes the import fail
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    with pytest.raises(BackendUnavailable, match="^CUDA driver not available: cannot import cuda.bindings"):
        cuda_granularity(torch.device("cuda", 0), runtime=_SeesAGpu())
    with pytest.raises(InvalidConfig, match="does not exist"):
        cuda_granularity("cuda:3", runtime=_SeesAGpu())
    with pytest.raises(InvalidConfig, match="needs a cuda device"):
        cuda_granularity("cpu", runtime=_SeesAGpu())


def test_a_driver_that_refuses_is_backend_unavailable(fake):  # noqa: F811
    fake.reset(vmm=False)
    with pytest.raises(BackendUnavailable, match="does not support virtual memory management"):
        cuda_granularity("cuda:0", runtime=FakeRuntime())
    fake.reset()
    fake.fail("cuInit", nth=-1)
    with pytest.raises(BackendUnavailable, match="torch could not initialise cuda:0"):
        CudaVirtualMemory(FAKE_PAGE, 1, device="cuda:0", runtime=FakeRuntime())
    fake.reset()
    torch_up = FakeRuntime()
    torch_up.activate(0)  # torch is up; then the driver refuses cuInit
    fake.fail("cuInit", nth=-1)
    with pytest.raises(BackendUnavailable, match="cuInit returned CUDA_ERROR_OUT_OF_MEMORY"):
        CudaVirtualMemory(FAKE_PAGE, 1, device="cuda:0", runtime=torch_up)
    fake.reset()
    fake.fail("cuMemGetAllocationGranularity")
    with pytest.raises(BackendUnavailable, match="cuMemGetAllocationGranularity failed"):
        cuda_granularity("cuda:0", runtime=FakeRuntime())
    fake.reset()
