"""Page size of vLLM's contiguous mode (:mod:`vmkv.vllm.contiguous.pages`).

* The plan, for any model shape, granularity and layout: pages are whole granules and whole
  tokens, the block size is the smallest valid one (or the one asked for), the waste bound and
  sharing granularity follow, and bad input raises a typed error naming a size that works.
* Pipeline stages with different layer counts get one block size valid in each; a real
  ``VllmConfig`` (tensor and pipeline parallel) gives each rank's geometry.
* The documented numbers for known models (docs/vllm.md, "Contiguous mode: page size on CUDA").
* The plan's slot geometry is :class:`vmkv.VirtualKVCache`'s (same pages, slots and offsets).
* On the fake CUDA driver (tests/fake_cuda), through the real CUDA backend: the granularity is
  the driver's, and one physical page per piece is mapped into two requests' slots at
  page-aligned offsets (a shared prefix block), read back by both, private blocks apart, empty
  pages zeros, one ``cuMemMap`` per piece per block.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from fake_cuda import FakeRuntime
from fake_cuda.fixtures import fake, fake_lib, runtime  # noqa: F401  (fixtures)
from hypothesis import given, settings
from hypothesis import strategies as st

import vmkv
import vmkv.vm.cuda
from vmkv.config import LAYOUTS, KVShape
from vmkv.errors import BackendError, InvalidConfig, InvalidInput
from vmkv.sizing import DEFAULT_TOKENS_PER_PAGE
from vmkv.vllm.contiguous.pages import min_block_size, plan_contiguous_pages, plan_for_vllm, vllm_stage_shapes
from vmkv.vm import granularity as device_granularity
from vmkv.vm.cuda import CudaVirtualMemory, cuda_granularity

KiB, MiB = 1 << 10, 1 << 20
GPU = 2 * MiB  # cuMemGetAllocationGranularity on NVIDIA GPUs
HOST = 4 * KiB

LLAMA3_8B = KVShape(num_layers=32, num_kv_heads=8, head_dim=128, element_size=2)
LLAMA3_70B = KVShape(num_layers=80, num_kv_heads=8, head_dim=128, element_size=2)
LLAMA3_70B_TP8 = KVShape(num_layers=80, num_kv_heads=1, head_dim=128, element_size=2)  # one KV head a rank
QWEN2_7B = KVShape(num_layers=28, num_kv_heads=4, head_dim=128, element_size=2)
HD64 = KVShape(num_layers=4, num_kv_heads=2, head_dim=64, element_size=2)  # the issue's >= 4 layers, GQA, head_dim 64
HD64_FP32 = KVShape(num_layers=4, num_kv_heads=2, head_dim=64, element_size=4)
LLAMA3_8B_FP32 = KVShape(num_layers=32, num_kv_heads=8, head_dim=128, element_size=4)


def plan(shape: KVShape, granularity: int, **kw):
    kw.setdefault("max_model_len", 8192)
    kw.setdefault("max_num_seqs", 256)
    return plan_contiguous_pages(shape, granularity, **kw)


# ---- the plan's invariants -----------------------------------------------------------------
shapes = st.builds(KVShape, num_layers=st.integers(1, 96), num_kv_heads=st.integers(1, 16),
                   head_dim=st.sampled_from([32, 64, 80, 96, 112, 128, 192, 256]), element_size=st.sampled_from([1, 2, 4]))


@settings(max_examples=200, deadline=None)
@given(shape=shapes, granularity=st.sampled_from([HOST, 64 * KiB, GPU]), layout=st.sampled_from(LAYOUTS),
       max_model_len=st.integers(1, 40_000), max_num_seqs=st.integers(1, 512))
def test_pages_are_whole_granules_and_the_block_the_smallest_that_holds_16_tokens(shape, granularity, layout,
                                                                                 max_model_len, max_num_seqs):
    p = plan(shape, granularity, layout=layout, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    assert p.page_bytes % granularity == 0 and p.page_bytes == p.block_size * p.token_bytes
    assert p.token_bytes == shape.token_bytes(p.layout) and p.pieces * p.token_bytes == shape.bytes_per_token
    step = p.min_block_size  # the smallest block of whole granules: no smaller one is
    assert (step * p.token_bytes) % granularity == 0
    assert all((b * p.token_bytes) % granularity for b in range(1, min(step, 5000)))
    assert p.block_size % step == 0 and p.block_size >= DEFAULT_TOKENS_PER_PAGE > p.block_size - step
    assert p.slot_tokens % p.block_size == 0 and p.slot_tokens >= max_model_len > p.slot_tokens - p.block_size
    assert p.reservation_bytes % granularity == 0 and p.ranges * p.heads_per_range == p.pieces
    last = p.page_offset(max_num_seqs - 1, p.pages_per_slot - 1, p.heads_per_range - 1)
    assert last % granularity == 0 and last + p.page_bytes == p.reservation_bytes  # the last page ends the range
    assert p.waste_bytes == p.waste_tokens * shape.bytes_per_token == (p.block_size - 1) * shape.bytes_per_token
    assert p.sharing_tokens == p.block_size and p.mappings_per_request == p.pages_per_slot * p.pieces


@settings(max_examples=100, deadline=None)
@given(shape=shapes, granularity=st.sampled_from([HOST, GPU]), layout=st.sampled_from(LAYOUTS), asked=st.integers(1, 20_000))
def test_a_requested_block_size_is_kept_when_whole_granules_else_refused_naming_one_that_is(shape, granularity, layout, asked):
    step = min_block_size(shape, granularity, layout)
    if asked % step == 0:
        p = plan(shape, granularity, layout=layout, block_size=asked)
        assert p.block_size == asked and p.page_bytes % granularity == 0
        return
    with pytest.raises(InvalidConfig, match=f"multiple of {step} tokens") as err:
        plan(shape, granularity, layout=layout, block_size=asked)
    suggested = -(-asked // step) * step
    assert f"block_size={suggested}" in str(err.value)
    assert plan(shape, granularity, layout=layout, block_size=suggested).block_size == suggested


# ---- documented numbers --------------------------------------------------------------------
# (shape, granularity, layout) -> (block_size, page_bytes, pieces, waste_bytes, mappings at 8K tokens)
KNOWN = [
    (LLAMA3_8B, GPU, "per_layer", (1024, 2 * MiB, 64, 1023 * 2 * KiB * 64, 512)),
    (LLAMA3_8B, GPU, "all_layers", (32, 2 * MiB, 2, 31 * 64 * KiB * 2, 512)),
    (LLAMA3_70B, GPU, "per_layer", (1024, 2 * MiB, 160, 1023 * 2 * KiB * 160, 1280)),
    (LLAMA3_70B, GPU, "all_layers", (64, 10 * MiB, 2, 63 * 160 * KiB * 2, 256)),
    (LLAMA3_70B_TP8, GPU, "all_layers", (512, 10 * MiB, 2, 511 * 20 * KiB * 2, 32)),
    (QWEN2_7B, GPU, "per_layer", (2048, 2 * MiB, 56, 2047 * KiB * 56, 224)),
    (QWEN2_7B, GPU, "all_layers", (512, 14 * MiB, 2, 511 * 28 * KiB * 2, 32)),
    (HD64, GPU, "per_layer", (8192, 2 * MiB, 8, 8191 * 256 * 8, 8)),
    (HD64, GPU, "all_layers", (2048, 2 * MiB, 2, 2047 * KiB * 2, 8)),
    (HD64_FP32, HOST, "per_layer", (16, 8 * KiB, 8, 15 * 512 * 8, 4096)),
    (HD64_FP32, HOST, "head_major", (16, 4 * KiB, 16, 15 * 256 * 16, 8192)),
    (LLAMA3_8B_FP32, HOST, "per_layer", (16, 64 * KiB, 64, 15 * 4 * KiB * 64, 32768)),
    (LLAMA3_8B_FP32, HOST, "all_layers", (16, 2 * MiB, 2, 15 * 128 * KiB * 2, 1024)),
]


@pytest.mark.parametrize("shape, granularity, layout, expected", KNOWN)
def test_known_models_give_the_documented_numbers(shape, granularity, layout, expected):
    p = plan(shape, granularity, layout=layout)
    assert (p.layout, p.block_size, p.page_bytes, p.pieces, p.waste_bytes, p.mappings_per_request) == (layout, *expected)
    assert p.granules_per_page == p.page_bytes // granularity


def test_all_layers_pages_map_as_often_as_per_layer_ones_in_fewer_pieces_and_the_reason_says_why():
    p = plan(LLAMA3_8B, GPU, layout="all_layers")
    per_layer = plan(LLAMA3_8B, GPU, layout="per_layer")
    assert 256 * p.maps_per_decode_token == 256 * per_layer.maps_per_decode_token == 16  # maps a step, 256 decoding
    assert (p.block_bytes, per_layer.block_bytes) == (4 * MiB, 128 * MiB)  # the memory one block maps
    assert (p.waste_bytes_per_piece, per_layer.waste_bytes_per_piece) == (31 * 64 * KiB, 1023 * 2 * KiB)
    assert "the smallest page of whole 2.0 MiB granules holding >= 16 tokens of 65536 B" in p.reason
    assert "block_size 32 tokens = one 2.0 MiB page" in p.describe() and "all_layers" in p.describe()
    assert "block_size 2048 as asked" in plan(LLAMA3_8B, GPU, layout="per_layer", block_size=2048).reason


# ---- pipeline stages and vLLM's config ------------------------------------------------------
def stage(shape: KVShape, layers: int) -> KVShape:
    return KVShape(layers, shape.num_kv_heads, shape.head_dim, shape.element_size)


def test_pipeline_stages_get_one_block_size_valid_in_every_stage():
    """Llama-3-70B over 3 stages (vLLM splits 80 layers 27, 27, 26): alone, the 26-layer stage's
    all-layers token (52 KiB = 13 x 4 KiB) makes 512-token blocks, the 27-layer ones (27 x 2 KiB)
    1,024; vLLM has one block_size, so every stage plans 1,024 (per-layer pages too)."""
    stages = [stage(LLAMA3_70B, n) for n in (27, 27, 26)]
    assert plan(stages[2], GPU, layout="all_layers").block_size == 512
    plans = [plan(shape, GPU, stages=stages, layout="per_layer") for shape in stages]
    assert [p.block_size for p in plans] == [1024] * 3 and "valid in every pipeline stage" in plans[0].reason
    for p, shape in zip(plans, stages):
        assert p.page_bytes % GPU == 0 and p.pieces == 2 * shape.num_layers
    together = [plan(shape, GPU, stages=stages, layout="all_layers") for shape in stages]
    assert [p.block_size for p in together] == [1024] * 3 and [p.page_bytes for p in together] == [54 * MiB] * 2 + [52 * MiB]
    with pytest.raises(InvalidConfig,
                       match="on this pipeline stage, and the block must suit the other stages too.*multiple of 1024"):
        plan(stages[2], GPU, stages=stages, layout="all_layers", block_size=512)


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM 0.32 not installed")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from vmkv_bench.vllm_harness.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", num_layers=4)  # 4 KV heads of 32, 4 layers


def engine_config(model_dir, **args):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model_dir), max_model_len=300, max_num_seqs=5, **args).create_engine_config()


@needs_vllm
def test_a_vllm_config_gives_each_ranks_geometry_and_keeps_a_block_size_the_user_set(tiny_model_dir, monkeypatch):
    """TP=2 halves the KV heads a rank holds; PP=3 splits 4 layers 1, 2, 1 (vLLM's own split), so
    the stages differ; vLLM's CPU default block size (128, not set by the user) is replaced by the
    plan's, one the user set is kept, and an fp8 KV cache is refused."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = engine_config(tiny_model_dir, tensor_parallel_size=2, dtype="float32")
    assert vllm_stage_shapes(config) == [KVShape(4, 2, 32, 4)]
    p = plan_for_vllm(config, layout="per_layer", granularity=HOST)
    assert (p.layout, p.block_size, p.slot_tokens, p.max_num_seqs, p.granularity) == ("per_layer", 16, 304, 5, HOST)
    assert p == plan_contiguous_pages(KVShape(4, 2, 32, 4), HOST, max_model_len=300, max_num_seqs=5, layout="per_layer")
    assert plan_for_vllm(config, layout="all_layers", granularity=HOST).layout == "all_layers"

    config = engine_config(tiny_model_dir, pipeline_parallel_size=3, block_size=64)
    assert config.cache_config.user_specified_block_size and config.model_config.dtype == torch.bfloat16
    shapes = vllm_stage_shapes(config)
    assert shapes == [KVShape(1, 4, 32, 2), KVShape(2, 4, 32, 2), KVShape(1, 4, 32, 2)]
    p = plan_for_vllm(config, layout="per_layer", granularity=HOST)
    assert (p.block_size, p.pieces) == (64, 2) and p == plan(shapes[0], HOST, max_model_len=300, max_num_seqs=5,
                                                               layout="per_layer", block_size=64, stages=shapes)
    config = engine_config(tiny_model_dir, kv_cache_dtype="fp8")
    with pytest.raises(InvalidConfig, match="cache_dtype='fp8'"):
        vllm_stage_shapes(config)


# ---- typed errors --------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(granularity=0), "granularity must be a positive int"),
    (dict(granularity=True), "granularity must be a positive int"),
    (dict(granularity=2.0 * MiB), "granularity must be a positive int"),
    (dict(max_model_len=0), "max_model_len must be a positive int"),
    (dict(max_num_seqs=-1), "max_num_seqs must be a positive int"),
    (dict(block_size=0), "block_size must be a positive int"),
    (dict(block_size=16, layout="per_layer"), r"multiple of 1024 tokens.*block_size=1024 or leave it unset"),
    (dict(block_size=48), r"all_layers layout .* multiple of 32 tokens.*block_size=64"),
    (dict(layout="rows"), "layout must be one of"),
])
def test_bad_input_raises_invalid_config_naming_the_field(kw, match):
    args = dict(granularity=GPU, max_model_len=8192, max_num_seqs=8, layout="all_layers") | kw
    with pytest.raises(InvalidConfig, match=match):
        plan_contiguous_pages(LLAMA3_8B, args.pop("granularity"), **args)


def test_bad_shapes_and_offsets_raise_typed_errors():
    with pytest.raises(InvalidConfig, match="num_kv_heads must be a positive int"):
        KVShape(32, 0, 128, 2)
    with pytest.raises(InvalidConfig, match="element_size must be a positive int"):
        KVShape(32, 8, 128, True)
    with pytest.raises(InvalidConfig, match="must be KVShape, got list"):
        plan_contiguous_pages(LLAMA3_8B, GPU, max_model_len=64, max_num_seqs=1, layout="all_layers", stages=[[32, 8, 128, 2]])
    with pytest.raises(InvalidConfig, match="must be KVShape, got dict"):
        plan_contiguous_pages({"num_layers": 32}, GPU, max_model_len=64, max_num_seqs=1, layout="all_layers")
    p = plan(LLAMA3_8B, GPU, max_num_seqs=4, layout="all_layers")
    for args in [(4, 0), (0, p.pages_per_slot), (-1, 0), (0, 0, 1), (0, True)]:
        with pytest.raises(InvalidInput, match="page_offset"):
            p.page_offset(*args)


# ---- the plan is VirtualKVCache's slot geometry --------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_plan_is_the_slot_geometry_of_a_virtual_kv_cache(layout):
    """A ``VirtualKVCache`` sized from the plan has its pages, slots and page offsets: logical
    page j of slot s starts ``page_offset(s, j)`` bytes into each piece's range (checked on the
    cache's own views, by address; nothing is mapped)."""
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=64, element_size=4)
    p = plan_contiguous_pages(shape, device_granularity(torch.device("cpu")), max_model_len=100, max_num_seqs=3,
                              layout=layout)
    config = vmkv.KVCacheConfig(num_layers=3, num_kv_heads=2, head_dim=64, dtype="float32", device="cpu",
                                max_batch_size=3, max_seq_len=100, memory_budget="1MiB",
                                page_size=p.page_bytes, layout=layout)
    cache = vmkv.VirtualKVCache(config)
    try:
        assert (cache.tokens_per_page, cache.seq_capacity, cache.slot_bytes) == (p.block_size, p.slot_tokens, p.slot_bytes)
        assert (cache.geometry.num_tensors, cache.geometry.piece_bytes) == (p.pieces, p.page_bytes)
        for layer in range(shape.num_layers):
            for view in cache.kv_cache(layer):
                origin = view[0, 0, 0].data_ptr()
                for slot, token, head in [(0, 0, 0), (1, 17, 1), (2, 99, 0), (2, p.block_size, 1)]:
                    within = (token % p.block_size) * p.token_bytes
                    offset = p.page_offset(slot, token // p.block_size, head if layout == "head_major" else 0)
                    head_bytes = 0 if layout == "head_major" else head * shape.head_dim * 4
                    assert view[slot, token, head].data_ptr() - origin == offset + within + head_bytes
    finally:
        cache.close()


@needs_vllm
def test_on_cuda_vllm_takes_the_contiguous_plans_block_size_when_none_is_set(tiny_model_dir, monkeypatch):
    """vLLM asks the selected backend for its preferred block size (with its config current):
    in contiguous mode on CUDA it is the all-layers plan's at 2 MiB granules (here 4 layers x 4
    KV heads x 32 in bf16: 1 KiB a token, 2,048-token blocks); on CPU vLLM's own."""
    from vllm.config import KVTransferConfig, set_current_vllm_config

    from vmkv import vllm as plugin
    from vmkv.vllm.contiguous.backend import VmkvContiguousBackend

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transfer = KVTransferConfig(**plugin.engine_args(kv_mode="contiguous")["kv_transfer_config"])
    config = engine_config(tiny_model_dir, kv_transfer_config=transfer)
    with set_current_vllm_config(config):
        assert VmkvContiguousBackend.get_preferred_block_size(16) == 16
    config.device_config.device = torch.device("cuda")
    expected = plan_contiguous_pages(KVShape(4, 4, 32, 2), GPU, max_model_len=300, max_num_seqs=5, layout="all_layers")
    with set_current_vllm_config(config):
        assert VmkvContiguousBackend.get_preferred_block_size(16) == expected.block_size == 2048
    config.kv_transfer_config = None  # paged mode or no vmkv: vLLM's own
    with set_current_vllm_config(config):
        assert VmkvContiguousBackend.get_preferred_block_size(16) == 16


# ---- on the fake CUDA driver ---------------------------------------------------------------
TOY = KVShape(num_layers=5, num_kv_heads=2, head_dim=128, element_size=4)  # 70B's proportions at 64 KiB granules


def layer_views(vm: CudaVirtualMemory, bases: list[int], p, shape: KVShape, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every layer's K and V over all slots, ``[slots, tokens, kv_heads, head_dim]`` (K0, V0, K1, ...)."""
    rows = (p.max_num_seqs, p.slot_tokens)
    heads = (shape.num_kv_heads, shape.head_dim)
    if p.layout == "per_layer":
        return [vm.tensor(base, (*rows, *heads), dtype) for base in bases]
    k_all, v_all = (vm.tensor(base, (*rows, shape.num_layers, *heads), dtype) for base in bases)
    return [view for layer in range(shape.num_layers) for view in (k_all[:, :, layer], v_all[:, :, layer])]


@pytest.mark.parametrize("shape, granularity, layout, granules", [
    (TOY, 64 * KiB, "per_layer", 1),
    (TOY, 64 * KiB, "all_layers", 5),
    (LLAMA3_8B, GPU, "all_layers", 1),
], ids=["toy-per_layer", "toy-all_layers-5-granule-pages", "llama3-8b-all_layers-2MiB"])
def test_one_physical_page_is_mapped_into_two_slots_through_the_cuda_backend(fake, runtime, shape, granularity, layout, granules):  # noqa: F811
    """Two requests share their first (full) block: block_table 0 = [1, 2], 1 = [1, 3]. Each
    block is one page in every piece; mapping page ``block_table[j]`` at ``page_offset(slot,
    j)`` makes both slots read the shared tokens from one physical page, their own tokens from
    their own pages and zeros from pages they do not hold; freeing one slot leaves the other."""
    fake.reset(granularity=granularity)
    b = plan_contiguous_pages(shape, granularity, layout=layout, max_model_len=1, max_num_seqs=1).block_size
    p = plan_contiguous_pages(shape, cuda_granularity("cuda:0", runtime=runtime), layout=layout,
                              max_model_len=2 * b + 2, max_num_seqs=2)
    assert p.granularity == granularity and p.granules_per_page == granules and p.pages_per_slot == 3
    tables = {0: [1, 2], 1: [1, 3]}
    blocks = 3

    def page_of(block: int, piece: int) -> int:
        return piece * blocks + block - 1

    vm = CudaVirtualMemory(p.page_bytes, blocks * p.pieces, device="cuda:0", runtime=runtime)
    try:
        bases = [vm.reserve(p.reservation_bytes) for _ in range(p.ranges)]
        fake.calls(clear=True)
        for slot, table in tables.items():
            for j, block in enumerate(table):
                for piece, base in enumerate(bases):
                    vm.map(base + p.page_offset(slot, j), page_of(block, piece))
        maps = [c for c in fake.calls() if c.name == "cuMemMap"]
        assert len(maps) == 4 * p.maps_per_block and all(c.ok for c in maps)
        live = {m["addr"]: m["handle"] for m in fake.state()["mappings"]}
        for piece, base in enumerate(bases):  # the shared block's page: one handle at both slots' page 0
            shared = vm._handles[page_of(1, piece)]
            assert [addr for addr, handle in live.items() if handle == shared] == sorted(
                [base + p.page_offset(0, 0), base + p.page_offset(1, 0)])

        dtype = torch.float32 if shape.element_size == 4 else torch.float16
        views = layer_views(vm, bases, p, shape, dtype)
        gen = torch.Generator().manual_seed(0)
        n0, own1 = b + b // 2 + 1, range(b, b + b // 3 + 1)
        heads = (shape.num_kv_heads, shape.head_dim)
        data0 = [torch.randn(n0, *heads, generator=gen).to(dtype) for _ in views]
        data1 = [torch.randn(len(own1), *heads, generator=gen).to(dtype) for _ in views]
        for view, d0, d1 in zip(views, data0, data1):
            view[0, :n0] = d0  # request 0: its prompt, the shared block first
            view[1, own1.start:own1.stop] = d1  # request 1: only past the shared block (vLLM never writes a shared block)
        for view, d0, d1 in zip(views, data0, data1):
            assert torch.equal(view[1, :b], d0[:b])  # the shared block, read through the other slot
            assert torch.equal(view[0, :n0], d0) and torch.equal(view[1, own1.start:own1.stop], d1)
            assert not view[0, n0:].any() and not view[1, own1.stop:].any()  # rest of its block, empty pages: zeros
        assert vm.resident_bytes() == (blocks * p.pieces + 1) * p.page_bytes  # 4 block mappings, 3 blocks of memory

        vm.synchronize()
        for j in range(len(tables[1])):  # request 1 finishes: its slot's pages go, the shared page stays for request 0
            for base in bases:
                vm.unmap(base + p.page_offset(1, j))
        for view, d0 in zip(views, data0):
            assert not view[1].any() and torch.equal(view[0, :n0], d0)
        del views
    finally:
        vm.close()


# ---- vLLM's slot space on the fake CUDA driver -----------------------------------------------
# Two layers of 2 KV heads x 32 floats: an all-layers token takes 512 B of a piece, so 64 KiB
# granules make 128-token blocks, one 64 KiB page per K (V) piece; a block is 128 KiB, every
# layer's K then V (vLLM's block-outermost BLHNC, read as [K|V, tokens, layers, heads, D]).
SLOT_LAYERS, SLOT_HEADS, SLOT_DIM, SLOT_BLOCKS = 2, 2, 32, 6


def cuda_slot_space(runtime, block: int = 128, page_size: int = 64 * KiB, views_layout: str = "BLHNC"):  # noqa: F811
    """A KV buffer of ``SLOT_BLOCKS`` blocks on the fake CUDA backend, vLLM's per-layer views of it
    in ``views_layout`` (every page mapped, block b's bytes filled by layer, K|V and head) and a
    :class:`~vmkv.vllm.contiguous.slots.SlotSpace` of 3 slots x 3 blocks over it."""
    from vmkv.vllm.contiguous.slots import SlotSpace
    from vmkv.vllm.worker.kvbuffer import KVBuffer

    layer_block = SLOT_HEADS * block * 2 * SLOT_DIM  # floats of one layer's block [H, N, 2D]
    nbytes = SLOT_BLOCKS * SLOT_LAYERS * layer_block * 4
    buffer = KVBuffer(CudaVirtualMemory(page_size, nbytes // page_size, device="cuda:0", runtime=runtime), nbytes)
    buffer.apply([], list(range(buffer.num_pages)))
    raw = buffer.tensor().view(torch.float32)
    shape = (SLOT_BLOCKS, SLOT_HEADS, block, 2 * SLOT_DIM)
    inner = (block * 2 * SLOT_DIM, 2 * SLOT_DIM, 1)
    if views_layout == "BLHNC":
        views = {f"l{layer}": raw.as_strided(shape, (SLOT_LAYERS * layer_block, *inner), layer * layer_block)
                 for layer in range(SLOT_LAYERS)}
    else:  # LBHNC: every layer's blocks in its own region
        views = {f"l{layer}": raw.as_strided(shape, (layer_block, *inner), layer * SLOT_BLOCKS * layer_block)
                 for layer in range(SLOT_LAYERS)}
    try:
        space = SlotSpace(buffer, views, SLOT_BLOCKS, block, max_slots=3, max_blocks=3)
    except BaseException:
        buffer.close()
        raise
    space.views = views  # kept for tests that build a second space over the same buffer
    for layer, rows in enumerate(space.write_views):  # [blocks, tokens, K|V, heads, D]
        for half in range(2):
            for head in range(SLOT_HEADS):
                rows[:, :, half, head] = (torch.arange(SLOT_BLOCKS, dtype=torch.float32)[:, None, None] * 1000
                                          + 100 * layer + 10 * half + head)
    return buffer, space


MAPS = [(0, 0, 1), (0, 1, 2), (2, 0, 1), (2, 1, 3)]  # slots 0 and 2 share their first block, 1


def mapped_at(fake) -> dict[int, int]:  # noqa: F811
    return {m["addr"]: m["handle"] for m in fake.state()["mappings"]}


@pytest.mark.parametrize("block", [128, 256], ids=["one-page-pieces", "two-page-pieces"])
def test_the_slot_space_maps_each_blocks_pages_at_the_plans_offsets_on_the_cuda_driver(fake, runtime, block):  # noqa: F811
    """Reserve: one K and one V range of the plan's size. Map: for every (slot, j, block) and
    K|V, the buffer's handles behind that piece, at ``base + page_offset(slot, j)`` (one
    ``cuMemMap`` per page, nothing allocated); both slots read the shared block from the same
    handle, every layer's slice reads its own K/V, empty pages read zeros. Free: synchronize,
    then the slot's pages go back to the zero page; the other slot keeps the shared block."""
    fake.calls(clear=True)
    buffer, space = cuda_slot_space(runtime, block)
    calls = fake.calls(clear=True)
    p = space.plan
    assert (p.layout, p.block_size, p.pieces, p.page_bytes) == ("all_layers", block, 2, block * 512)
    reserves = [c for c in calls if c.name == "cuMemAddressReserve" and c.args.startswith(f"size={p.reservation_bytes},")]
    assert len(reserves) == 2 and p.reservation_bytes == 3 * 3 * block * 512  # K and V: 3 slots of 3 blocks
    k_base, v_base = space._bases[0]
    resident = buffer.backend.resident_bytes()

    space.map(MAPS)
    calls = fake.calls(clear=True)
    assert "cuMemCreate" not in [c.name for c in calls] and buffer.backend.resident_bytes() == resident
    pages = p.page_bytes // buffer.page_size
    maps = [c for c in calls if c.name == "cuMemMap"]
    assert len(maps) == len(MAPS) * 2 * pages and all(c.ok for c in maps)
    live = mapped_at(fake)
    handles = buffer.backend._handles
    for slot, j, blk in MAPS:
        for half, base in enumerate((k_base, v_base)):
            for i in range(pages):  # the piece's buffer pages, in order
                source = (blk * 2 * p.page_bytes + half * p.page_bytes) // buffer.page_size + i
                addr = base + p.page_offset(slot, j) + i * buffer.page_size
                assert live[addr] == handles[buffer.physical_page(source)], (slot, j, half, i)
    for layer in range(SLOT_LAYERS):
        k, v = space.k[layer], space.v[layer]
        assert k.shape == (3, 3 * block, SLOT_HEADS, SLOT_DIM) and space.owns(k) and space.owns(v)
        for slot, blocks in ((0, (1, 2)), (2, (1, 3))):
            for j, blk in enumerate(blocks):
                for head in range(SLOT_HEADS):
                    rows = slice(j * block, (j + 1) * block)
                    assert bool((k[slot, rows, head] == blk * 1000 + 100 * layer + head).all())
                    assert bool((v[slot, rows, head] == blk * 1000 + 100 * layer + 10 + head).all())
        assert k[:, 2 * block:].abs().sum() == 0 and k[1].abs().sum() == 0  # empty pages: the zero page
    space.write_views[1][1, 5, 0, 1, 3] = -1.0  # block 1 (shared), token 5, K, head 1: seen through both slots
    assert space.k[1][0, 5, 1, 3] == -1.0 and space.k[1][2, 5, 1, 3] == -1.0
    assert space.rows_to_slots(torch.tensor([[1, 3, 0]]), [block + 1]) == [2]

    space.free([0])
    calls = fake.calls(clear=True)
    names = [c.name for c in calls]
    assert names.index("cuCtxSynchronize") < names.index("cuMemUnmap") and not fake.hazards()
    assert space.k[0][0].abs().sum() == 0 and space.k[0][2, :block, 0, 0].eq(1000).all()
    live = mapped_at(fake)
    assert all(live[k_base + p.page_offset(0, j) + i * buffer.page_size] == buffer.backend._zero
               for j in range(2) for i in range(pages))
    assert space.stats()["slots_in_use"] == 1
    space.close()
    buffer.close()


@pytest.mark.parametrize("op", ["map", "free", "reserve"])
def test_every_failing_driver_call_of_the_slot_space_is_undone(fake, runtime, op):  # noqa: F811
    """Fail the k-th driver call of ``space.map`` / ``space.free`` / the slot reservation, for
    every k: ``BackendError``, the driver's mappings and the slot tables are as before (nothing
    half-mapped), and the same call works once the driver does."""
    from vmkv.vllm.contiguous.slots import SlotSpace

    def prepared():  # a fresh torch runtime after every reset of the driver, as the backend tests do
        buffer, space = cuda_slot_space(FakeRuntime())
        if op == "free":
            space.map(MAPS)
        return buffer, space

    def action(buffer, space):
        if op == "map":
            return space.map(MAPS)
        if op == "free":
            return space.free([0, 2])
        return SlotSpace(buffer, space.views, SLOT_BLOCKS, 128, max_slots=3, max_blocks=3)

    def close(buffer, space, made=None):
        for each in (made, space, buffer):
            if each is not None:
                each.close()

    fake.reset()
    buffer, space = prepared()
    fake.calls(clear=True)
    made = action(buffer, space)
    total = len(fake.calls())
    assert total >= 8
    close(buffer, space, made)
    del buffer, space, made  # before the next reset: their reservations go back to this driver state
    for k in range(1, total + 1):
        fake.reset()
        buffer, space = prepared()
        before = (mapped_at(fake), space._tables.copy(), list(space._lengths))
        fake.fail("", nth=k)
        with pytest.raises(BackendError):
            action(buffer, space)
        fake.clear_failures()
        assert mapped_at(fake) == before[0], f"call {k} of {total} of {op} changed the driver's mappings"
        assert (space._tables == before[1]).all() and space._lengths == before[2]
        made = action(buffer, space)  # the same call works once the driver does
        close(buffer, space, made)
        del buffer, space, made


@pytest.mark.parametrize("kw, match", [
    ({"block": 64}, r"vLLM's block_size 64 does not make whole pages; start vLLM with block_size=128 \(--block-size 128\)"),
    ({"page_size": 128 * KiB}, r"pieces of 65536 B from the KV buffer in whole pages \(page_size\) of 131072 B.*set page_size"),
    ({"views_layout": "LBHNC"}, r"every layer of a block in one run \(layout BLHNC\)"),
], ids=["block-size", "page-size", "vllm-layout"])
def test_the_slot_space_on_cuda_refuses_what_cannot_map_naming_what_works(fake, runtime, kw, match):  # noqa: F811
    """On CUDA a piece (all layers' K of a block) must be whole 64 KiB granules (so vLLM's block
    a multiple of 128 tokens here), whole pages of the buffer (cuMemMap maps handles whole), and
    vLLM's blocks block-outermost; each is refused at start, nothing left reserved."""
    with pytest.raises(InvalidConfig, match=match):
        cuda_slot_space(runtime, **kw)
