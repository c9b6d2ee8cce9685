"""``VirtualCache(compile=True)`` under transformers' compiled generation (issue 28), on the CPU.

Inductor compiles here as on a GPU (without CUDA graphs), so what is checked is the contract:
tokens identical to ``StaticCache`` under the same compile (float32), no graph break inside the
cache, no recompilation once decoding runs, pages mapped only at the eager point, memory that
follows the tokens, and never a crash (the SIGSEGV of a compiled forward over a cache made
without ``compile=True`` runs in a child process: a crash fails that test, not the suite).
Models are the embedded Llama cut to two layers (and smaller for the 512-step test).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from torch._dynamo.utils import counters  # noqa: E402
from transformers import CompileConfig, StaticCache  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402

import vmkv.hf as vhf  # noqa: E402
from vmkv.core.mapping import background_safe  # noqa: E402
from vmkv.errors import InvalidConfig, InvalidInput, SequenceTooLong  # noqa: E402
from vmkv.hf.compat import update_gets_attention_kwargs  # noqa: E402
from vmkv.hf.compiled import check_map_ahead  # noqa: E402
from vmkv.models import PAD, default_hf_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CACHE = vhf.cache_argument()
PROMPT, NEW = 12, 40
MAX_LEN = PROMPT + NEW
PAGE = "4KiB"  # head-major pages of 32 tokens at this geometry: every generation crosses a page


KWARGS = update_gets_attention_kwargs()
needs_kwargs = pytest.mark.skipif(not KWARGS, reason="transformers < 5.24 passes no attention kwargs to Cache.update: the "
                                  "compiled 'vmkv' attention runs eagerly at graph breaks there (assert_compiled checks it)")


def assert_compiled(stats: dict, steps: int, vmkv_attention: bool) -> None:
    """Every prepared step ran in the compiled forward; with the "vmkv" attention on transformers
    < 5.24, eagerly at graph breaks instead (it cannot receive its step there), said once."""
    if vmkv_attention and not KWARGS:
        assert stats["eager_steps"] == steps and stats["compiled_steps"] == 0 and stats["compile_fallbacks"] > 0
    else:
        assert stats["compiled_steps"] == steps and stats["compile_fallbacks"] == 0


def compile_config() -> CompileConfig:
    """What makes generate() compile on a CPU (transformers compiles by itself only on GPUs)."""
    config = CompileConfig(mode="default")
    config._compile_all_devices = True
    return config


@pytest.fixture(autouse=True)
def fresh_dynamo(request):
    """Each test starts with no compiled code (counts of compiled steps and graphs depend on it:
    dynamo stops compiling a function it recompiled too often, and transformers' deprecation
    wrapper is one function for every forward). Tests marked ``dynamo_state`` run on whatever
    earlier tests left: that is what they check."""
    if request.node.get_closest_marker("dynamo_state") is None:
        torch._dynamo.reset()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return default_hf_model(num_hidden_layers=2).eval()


@pytest.fixture(scope="module")
def vmkv_model() -> torch.nn.Module:
    """The ``model`` fixture's weights with ``attn_implementation="vmkv"``."""
    torch.manual_seed(0)
    model = default_hf_model(num_hidden_layers=2).eval()
    model.set_attn_implementation("vmkv")
    return model


def compiled_cache(model: torch.nn.Module, mode: str = "vmm", **options) -> vhf.VirtualCache:
    return vhf.VirtualCache(mode, config=model.config, max_seq_len=MAX_LEN, page_size=PAGE, compile=True, **options)


def batch(padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of PROMPT tokens; ``padded``: the second left-padded to 5 real tokens."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, PROMPT), generator=generator)
    mask = torch.ones_like(ids)
    if padded:
        ids[1, : PROMPT - 5], mask[1, : PROMPT - 5] = PAD, 0
    return ids, mask


def generate(model, cache, ids, mask, seed: int | None = None, **options) -> torch.Tensor:
    if seed is not None:
        torch.manual_seed(seed)
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=PAD, compile_config=compile_config(),
                          **{CACHE: cache}, **options)


@pytest.mark.parametrize("how", ["greedy", "sampling", "left-padded"])
def test_compiled_generate_gives_static_caches_tokens(model, how):
    ids, mask = batch(padded=how == "left-padded")
    options = dict(do_sample=True, top_k=20, seed=7) if how == "sampling" else dict(do_sample=False)
    static = generate(model, StaticCache(config=model.config, max_cache_len=MAX_LEN), ids, mask, **options)
    cache = compiled_cache(model)
    ours = generate(model, cache, ids, mask, **options)
    assert torch.equal(ours, static)
    stats = cache.stats()
    assert stats["compiled_steps"] == NEW - 1 and stats["compile_fallbacks"] == 0  # every decode step compiled
    # memory follows the tokens: at most one partly filled page per row (a page holds every layer)
    assert stats["tokens"] == 2 * (MAX_LEN - 1)
    assert stats["bytes_in_use"] <= stats["token_bytes"] + 2 * stats["page_bytes"]
    # past each row's length the views read zeros (the zero page), which the mask hid
    for layer in range(model.config.num_hidden_layers):
        for part in cache.core.kv_cache(layer):
            for seq_id in cache.rows:
                assert not part[cache.core.slot(seq_id), cache.core.seq_len(seq_id):].any()
    if how == "greedy":  # a reset cache generates the same again
        cache.reset()
        assert torch.equal(generate(model, cache, ids, mask, **options), static)
    cache.close()


@pytest.mark.parametrize("layout", ["all_layers", "per_layer"])
def test_compiled_generate_over_each_layout_gives_static_caches_tokens(model, layout):
    """all_layers (CUDA's default) keeps every layer in one range: the compiled region takes the
    range's storage once, not one aliasing view per layer (which CUDA graphs would refuse)."""
    ids, mask = batch(padded=True)
    static = generate(model, StaticCache(config=model.config, max_cache_len=MAX_LEN), ids, mask, do_sample=False)
    cache = compiled_cache(model, layout=layout)
    assert torch.equal(generate(model, cache, ids, mask, do_sample=False), static)
    assert cache.stats()["compile_fallbacks"] == 0
    bases = {id(store.base) for part in cache._compiled.static.parts for pair in part.stores for store in pair}
    assert len(bases) == (2 if layout == "all_layers" else 2 * model.config.num_hidden_layers)
    cache.close()


@pytest.mark.parametrize("mode,attention", [("vmm", "sdpa"), ("vmm", "vmkv"), ("paged", "vmkv")])
def test_beam_search_and_deep_copies_over_a_compileable_cache(request, model, mode, attention):
    """Beam search is not compiled by transformers 5.19, but the cache still runs StaticCache's
    contract (steps prepared at the eager point; full-length views, or ragged rows with the
    "vmkv" attention) across reorders and forks."""
    ids, mask = batch(padded=attention == "vmkv")
    options = dict(do_sample=False, num_beams=3, max_new_tokens=10, pad_token_id=PAD)
    static = model.generate(ids, attention_mask=mask, **{CACHE: StaticCache(config=model.config, max_cache_len=MAX_LEN)},
                            **options)
    ours = request.getfixturevalue("vmkv_model") if attention == "vmkv" else model
    cache = vhf.VirtualCache(mode, config=ours.config, max_seq_len=MAX_LEN, page_size=PAGE, compile=True,
                             max_batch_size=16)
    assert torch.equal(ours.generate(ids, attention_mask=mask, **{CACHE: cache}, **options), static)
    stats = cache.stats()  # prepared at the eager point, written by the eager forwards of beam search
    assert stats["eager_steps"] == 9 and stats["compiled_steps"] == 0 and stats["compile_fallbacks"] == 0
    cache.close()


def decode_inputs(model, cache, tokens: torch.Tensor, position: int, prepare: bool = True) -> dict:
    """One decode step's forward arguments as generate() builds them (the step prepared first,
    the 4D mask made eagerly); ``prepare=False``: as a hand-written loop might, with the 2D mask
    (the model makes the 4D mask inside the compiled forward: no eager point at all)."""
    batch_size = tokens.shape[0]
    mask = torch.ones(batch_size, position + 1, dtype=torch.long)
    if prepare:
        cache.prepare_step(1)
        mask = create_causal_mask(model.config, torch.empty(batch_size, 1, 0), mask, cache,
                                  torch.full((batch_size, 1), position))
    return dict(input_ids=tokens, position_ids=torch.full((batch_size, 1), position), attention_mask=mask,
                use_cache=True, **{CACHE: cache})


def prefill(model, cache, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids, use_cache=True, **{CACHE: cache})
    return out.logits[:, -1:].argmax(-1)


def test_no_graph_break_inside_the_cache(model):
    cache = compiled_cache(model)
    tokens = prefill(model, cache, batch(padded=False)[0])
    with torch.no_grad():
        explained = torch._dynamo.explain(model.forward)(**decode_inputs(model, cache, tokens, PROMPT))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    cache.close()


@pytest.mark.parametrize("attention", ["sdpa", "vmkv"])
def test_no_recompilation_over_512_decode_steps(attention):
    torch.manual_seed(0)
    small = default_hf_model(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                             num_key_value_heads=1).eval()
    small.set_attn_implementation(attention)
    cache = vhf.VirtualCache("vmm", config=small.config, max_seq_len=600, page_size=PAGE, compile=True)
    tokens = prefill(small, cache, torch.randint(0, 256, (2, 8)))
    forward = torch.compile(small.forward, mode="default")
    torch._dynamo.reset()
    graphs = []
    with torch.no_grad():
        for step in range(512):
            tokens = forward(**decode_inputs(small, cache, tokens, 8 + step)).logits[:, -1:].argmax(-1)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and graphs[-1] == graphs[1], f"recompiled after the second step: {graphs[1]} -> {graphs[-1]} graphs"
    assert_compiled(cache.stats(), 512, attention == "vmkv")
    assert cache.stats()["tokens"] == 2 * (8 + 512)
    cache.close()


@pytest.mark.parametrize("attention", ["sdpa", "vmkv"])
def test_a_compiled_forward_with_no_prepared_step_falls_back_once(request, attention, caplog):
    """A hand-written loop that forgets ``prepare_step``: the cache runs eagerly at a graph
    break (the "vmkv" attention too), warns once, and the tokens are those of the eager cache."""
    model = request.getfixturevalue("vmkv_model" if attention == "vmkv" else "model")
    ids = batch(padded=False)[0]
    reference, cache = compiled_cache(model), compiled_cache(model)
    forward = torch.compile(model.forward, mode="default")
    tokens = ref_tokens = prefill(model, cache, ids)
    prefill(model, reference, ids)
    with torch.no_grad():
        for step in range(3):
            position = PROMPT + step
            tokens = forward(**decode_inputs(model, cache, tokens, position, prepare=False)).logits[:, -1:].argmax(-1)
            ref_tokens = model(**decode_inputs(model, reference, ref_tokens, position)).logits[:, -1:].argmax(-1)
            assert torch.equal(tokens, ref_tokens)
    assert cache.stats()["compile_fallbacks"] > 0 and cache.stats()["compiled_steps"] == 0
    assert sum("no step prepared" in record.getMessage() for record in caplog.records) == 1
    cache.close()
    reference.close()


def test_compile_needs_what_it_runs_on(model):
    vmkv_config = default_hf_model(num_hidden_layers=1).config
    vmkv_config._attn_implementation = "vmkv"
    with pytest.raises(InvalidConfig, match="paged mode needs the model loaded with attn_implementation='vmkv'"):
        vhf.VirtualCache("paged", config=model.config, max_seq_len=64, compile=True)
    assert vhf.VirtualCache("paged", config=vmkv_config, max_seq_len=64, compile=True).is_compileable
    with pytest.raises(InvalidConfig, match="config=model.config"):
        vhf.VirtualCache("vmm", max_seq_len=64, compile=True)
    with pytest.raises(InvalidConfig, match="max_seq_len"):
        vhf.VirtualCache("vmm", config=model.config, compile=True)
    with pytest.raises(InvalidConfig, match="True or False"):
        vhf.VirtualCache("vmm", config=model.config, max_seq_len=64, compile="yes")
    assert vhf.VirtualCache("vmm", config=vmkv_config, max_seq_len=64, compile=True).is_compileable
    eager = vhf.VirtualCache("vmm", config=model.config)
    assert not eager.is_compileable
    with pytest.raises(InvalidConfig, match="prepare_step"):
        eager.prepare_step()
    cache = compiled_cache(model)
    assert cache.is_compileable and cache.get_max_length() == MAX_LEN
    with pytest.raises(InvalidInput):
        cache.prepare_step(0)


def test_map_ahead_beside_a_compiled_attention_that_reads_zero_pages_is_refused_on_cuda(model):
    """A page mapped on the worker replaces the zero page under the compiled attention's reads: on
    the host that is one atomic mmap (allowed), on CUDA an unmap then a map (refused)."""
    assert background_safe("cpu", reads_past_length=True) and background_safe("cuda", reads_past_length=False)
    assert not background_safe("cuda", reads_past_length=True)
    with pytest.raises(InvalidConfig, match="map_ahead"):
        check_map_ahead(True, True, torch.device("cuda"))
    cache = compiled_cache(model, map_ahead=True)  # the host: allowed, and the same tokens
    ids, mask = batch(padded=False)
    static = generate(model, StaticCache(config=model.config, max_cache_len=MAX_LEN), ids, mask, do_sample=False)
    assert torch.equal(generate(model, cache, ids, mask, do_sample=False), static)
    assert cache.stats()["pages_mapped_ahead"] > 0
    cache.close()


def test_the_eager_point_refuses_a_step_past_max_seq_len_and_changes_nothing(model):
    cache = vhf.VirtualCache("vmm", config=model.config, max_seq_len=PROMPT + 1, page_size=PAGE, compile=True)
    prefill(model, cache, batch(padded=False)[0])
    cache.prepare_step(1)  # the last column that fits
    with torch.no_grad():
        model(**decode_inputs(model, cache, torch.zeros(2, 1, dtype=torch.long), PROMPT, prepare=False))
    before = cache.core.state()
    with pytest.raises(SequenceTooLong):
        cache.prepare_step(1)
    assert cache.core.state() == before and cache.get_seq_length() == PROMPT + 1
    cache.close()


def test_a_step_prepared_but_not_run_is_rolled_back_by_row_operations(model):
    cache = compiled_cache(model)
    prefill(model, cache, batch(padded=False)[0])
    cache.prepare_step(1)
    assert cache.get_seq_length() == PROMPT  # the columns before the prepared forward
    cache.reorder_cache(torch.tensor([1, 0]))  # rolls the unwritten column back first
    assert cache.get_seq_length() == PROMPT and [cache.core.seq_len(s) for s in cache.rows] == [PROMPT, PROMPT]
    cache.prepare_step(1)
    cache.crop(-2)
    assert [cache.core.seq_len(s) for s in cache.rows] == [PROMPT - 2] * 2
    cache.close()


# ---- the "vmkv" attention under compile: rows of their own lengths --------------------------------
@pytest.mark.parametrize("mode,how", [("vmm", "greedy"), ("vmm", "sampling"), ("paged", "greedy")])
def test_compiled_vmkv_attention_decodes_ragged_rows_as_the_eager_cache(model, vmkv_model, mode, how):
    """Left-padded prompts: the eager prefill drops the padding, then every compiled decode step
    writes each row at its own position (paged: its row of the block pool) and reads each row's
    own length (paged: through the block table). The tokens are StaticCache's (which stores and
    reads the padding), the bytes only the real tokens'."""
    ids, mask = batch(padded=True)
    options = dict(do_sample=True, top_k=20, seed=7) if how == "sampling" else dict(do_sample=False)
    static = generate(model, StaticCache(config=model.config, max_cache_len=MAX_LEN), ids, mask, **options)
    eager = generate(vmkv_model, vhf.VirtualCache(mode, config=vmkv_model.config, page_size=PAGE), ids, mask, **options)
    cache = compiled_cache(vmkv_model, mode)
    assert torch.equal(generate(vmkv_model, cache, ids, mask, **options), eager)
    assert torch.equal(eager, static)
    stats = cache.stats()
    assert stats["attention_style"] == "vmkv"
    assert_compiled(stats, NEW - 1, vmkv_attention=True)
    real = int(mask.sum()) + 2 * (NEW - 1)  # the padding is not stored
    assert stats["tokens"] == real and [cache.core.seq_len(s) for s in cache.rows] == [PROMPT + NEW - 1, 5 + NEW - 1]
    assert stats["bytes_in_use"] <= stats["token_bytes"] + 2 * stats["page_bytes"]
    cache.close()


@needs_kwargs
@pytest.mark.parametrize("mode", ["vmm", "paged"])
def test_no_graph_break_inside_the_cache_or_the_vmkv_attention(vmkv_model, mode):
    cache = compiled_cache(vmkv_model, mode)
    ids, mask = batch(padded=True)
    with torch.no_grad():
        tokens = vmkv_model(ids, attention_mask=mask, use_cache=True, **{CACHE: cache}).logits[:, -1:].argmax(-1)
        explained = torch._dynamo.explain(vmkv_model.forward)(**decode_inputs(vmkv_model, cache, tokens, PROMPT))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    assert cache.stats()["compile_fallbacks"] == 0 and [cache.core.seq_len(s) for s in cache.rows] == [PROMPT + 1, 6]
    cache.close()


def test_a_prepared_step_left_unrun_does_not_hide_another_caches_padding(vmkv_model):
    """The "vmkv" mask function returns no mask for a prepared compiled step; the mask of a
    forward over another cache is that cache's, even while the first one's step waits."""
    ids, mask = batch(padded=True)
    waiting = compiled_cache(vmkv_model)
    prefill(vmkv_model, waiting, ids)
    waiting.prepare_step(1)
    with torch.no_grad():
        eager = vhf.VirtualCache("vmm", config=vmkv_model.config, page_size=PAGE)
        logits = vmkv_model(ids, attention_mask=mask, use_cache=True, **{CACHE: eager}).logits
        reference = vmkv_model(ids, attention_mask=mask, use_cache=True, **{CACHE: vhf.VirtualCache("vmm")}).logits
    assert torch.equal(logits, reference)
    assert [eager.core.seq_len(s) for s in eager.rows] == [PROMPT, 5]  # the padding was seen, and dropped
    waiting.close()


def test_a_compiled_vmkv_step_decodes_one_token_per_row(vmkv_model):
    cache = compiled_cache(vmkv_model)
    prefill(vmkv_model, cache, batch(padded=False)[0])
    before = cache.core.state()
    with pytest.raises(InvalidInput, match="one token per row"):
        cache.prepare_step(2)
    assert cache.core.state() == before and cache.stats()["compiled_steps"] == 0
    cache.get_mask_sizes(2)  # generate() continuing with a prompt: no step prepared, the forward runs eagerly
    assert cache.core.state() == before
    cache.close()


# ---- the step travels with its call: no state shared between caches, threads or compiled graphs ----
def eager_tokens(model, mode: str, ids, mask, page_size: str | None = PAGE) -> torch.Tensor:
    return generate(model, vhf.VirtualCache(mode, config=model.config, page_size=page_size), ids, mask, do_sample=False)


@pytest.mark.dynamo_state
def test_compiled_generate_after_other_compiled_code_gives_the_eager_caches_tokens(model, vmkv_model):
    """Issue 35: a compiled hand-written loop without prepare_step (graph breaks), then compiled
    generate() of another model over compiled caches of both modes, then of another cache of the
    same model: every run gives the eager cache's tokens, with torch._dynamo never reset (dynamo
    may stop compiling functions it recompiled too often: those forwards then run eagerly, which
    stats() says)."""
    ids, mask = batch(padded=True)
    loop = compiled_cache(model)
    forward = torch.compile(model.forward, mode="default")
    tokens = prefill(model, loop, batch(padded=False)[0])
    with torch.no_grad():
        for step in range(3):
            tokens = forward(**decode_inputs(model, loop, tokens, PROMPT + step, prepare=False)).logits[:, -1:].argmax(-1)
    loop.close()
    for mode in ("vmm", "paged", "vmm", "paged"):  # the second round: another cache, the same compiled code
        cache = compiled_cache(vmkv_model, mode)
        assert torch.equal(generate(vmkv_model, cache, ids, mask, do_sample=False), eager_tokens(vmkv_model, mode, ids, mask))
        stats = cache.stats()
        assert stats["compiled_steps"] + stats["eager_steps"] == NEW - 1
        cache.close()
    cache = compiled_cache(model)  # and the first model again, after the other's compiled steps
    assert torch.equal(generate(model, cache, ids, mask, do_sample=False), eager_tokens(model, "vmm", ids, mask))


def test_a_step_prepared_for_another_cache_changes_nothing_here(vmkv_model):
    """prepare_step(A); prepare_step(B); forward(A): A's forward runs A's step, B's waits (and
    runs next), each over its own rows; left-padded rows keep their padding out."""
    ids, mask = batch(padded=True)
    caches = [compiled_cache(vmkv_model), compiled_cache(vmkv_model, "paged")]
    reference = vhf.VirtualCache("vmm", config=vmkv_model.config, page_size=PAGE)
    forward = torch.compile(vmkv_model.forward, mode="default")
    with torch.no_grad():
        firsts = [vmkv_model(ids, attention_mask=mask, use_cache=True, **{CACHE: c}).logits[:, -1:].argmax(-1)
                  for c in (*caches, reference)]
        tokens = firsts
        for step in range(4):
            position = torch.tensor([[PROMPT + step], [5 + step]])
            for cache in caches:
                cache.prepare_step(1)
            full = torch.cat([mask, torch.ones(2, step + 1, dtype=mask.dtype)], 1)
            outs = []
            for cache, token in zip((*caches, reference), tokens):
                run = forward if cache is not reference else vmkv_model
                outs.append(run(input_ids=token, attention_mask=full, position_ids=position, use_cache=True,
                                **{CACHE: cache}).logits[:, -1])
            torch.testing.assert_close(outs[0], outs[2], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(outs[1], outs[2], atol=1e-4, rtol=1e-4)
            tokens = [out.argmax(-1, keepdim=True) for out in outs]
    for cache in caches:
        assert_compiled(cache.stats(), 4, vmkv_attention=True)
        assert [cache.core.seq_len(s) for s in cache.rows] == [PROMPT + 4, 5 + 4]  # the padding is not stored


def test_threads_with_their_own_models_and_caches_give_their_solo_tokens(model, vmkv_model):
    """Issue 35: thread A generates a left-padded batch with the "vmkv" attention over a
    DynamicCache (the assistant model's path: the stock kernel with the padding mask) and eagerly
    over a VirtualCache; thread B generates compiled over VirtualCache(compile=True), both
    attentions. Each gives what it gives alone, every time."""
    from transformers import DynamicCache

    ids, mask = batch(padded=True)
    jobs = {
        "dynamic": lambda: generate(vmkv_model, DynamicCache(config=vmkv_model.config), ids, mask, do_sample=False),
        "eager": lambda: eager_tokens(vmkv_model, "vmm", ids, mask),
        "compiled": lambda: generate(vmkv_model, compiled_cache(vmkv_model), ids, mask, do_sample=False),
        "compiled_sdpa": lambda: generate(model, compiled_cache(model), ids, mask, do_sample=False),
    }
    solo = {name: job() for name, job in jobs.items()}
    assert torch.equal(solo["dynamic"], solo["eager"]) and torch.equal(solo["compiled"], solo["eager"])
    results: dict[str, list] = {name: [] for name in jobs}
    errors: list[BaseException] = []

    def run(names: list[str], rounds: int) -> None:
        try:
            for _ in range(rounds):
                for name in names:
                    results[name].append(jobs[name]())
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(["dynamic", "eager"], 6)),
               threading.Thread(target=run, args=(["compiled", "compiled_sdpa"], 3))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for name, outs in results.items():
        assert outs and all(torch.equal(out, solo[name]) for out in outs), name


@pytest.mark.parametrize("attention", ["sdpa", "vmkv"])
@pytest.mark.parametrize("compiled", [False, True])
def test_a_refused_forward_changes_nothing(request, attention, compiled):
    """Issue 35: a cache holding one row, given a batch of two: InvalidShape, as the eager cache
    says, and length, pages and the next forward's logits are as if it never happened (the step
    the eager point prepared is cancelled, not committed)."""
    from transformers import DynamicCache

    from vmkv.errors import InvalidShape

    model = request.getfixturevalue("vmkv_model" if attention == "vmkv" else "model")
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(5))
    cache, reference = compiled_cache(model), DynamicCache(config=model.config)
    with torch.no_grad():
        for c in (cache, reference):
            model(ids, use_cache=True, **{CACHE: c})
        before = (cache.core.state(), cache.get_seq_length())
        run = torch.compile(model.forward, mode="default") if compiled else model
        if compiled:
            cache.prepare_step(1)
        with pytest.raises(InvalidShape):
            run(input_ids=torch.zeros(2, 1 if compiled else 8, dtype=torch.long), use_cache=True, **{CACHE: cache})
        assert (cache.core.state(), cache.get_seq_length()) == before
        nxt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(6))
        ours = model(nxt, use_cache=True, **{CACHE: cache}).logits
        want = model(nxt, use_cache=True, **{CACHE: reference}).logits
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 24


@pytest.mark.parametrize("head_dim", [80, 96])
@pytest.mark.parametrize("mode,attention", [("vmm", "sdpa"), ("vmm", "vmkv"), ("paged", "vmkv")])
def test_head_dims_the_triton_kernel_lacks_generate_compiled(head_dim, mode, attention):
    """Issue 35: Phi-3's 96 (and 80): the compiled step's kernel is chosen when the cache's storage
    is made, by the registry's rule (head dim, dtype, device), never met mid-generation."""
    torch.manual_seed(0)
    model = default_hf_model(num_hidden_layers=2, hidden_size=2 * head_dim, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=head_dim).eval()
    model.set_attn_implementation(attention)
    ids, mask = batch(padded=True)
    cache = vhf.VirtualCache(mode, config=model.config, max_seq_len=MAX_LEN, compile=True)
    assert torch.equal(generate(model, cache, ids, mask, do_sample=False), eager_tokens(model, mode, ids, mask, None))
    assert cache._compiled.static.kernel == "sdpa_masked"  # (Triton's interpreter is off here; on a GPU it would refuse too)
    assert_compiled(cache.stats(), NEW - 1, attention == "vmkv")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with the CUDA driver: there generate() "
                    "compiles a compileable cache by itself, with CUDA graphs (mode reduce-overhead)")
@pytest.mark.parametrize("mode,attention", [("vmm", "sdpa"), ("vmm", "vmkv"), ("paged", "vmkv")])
def test_cuda_graphs_over_a_compiled_cache_give_the_eager_caches_tokens_across_pages(mode, attention):
    """On a GPU: generate() compiles the decode step itself (inductor + CUDA graphs); float32, the
    embedded model (1,024 tokens a 2 MiB all-layers page), prompts of 1,010 and 1,000 tokens
    decoding 24 more: the VMM rows cross a page while graphs replay (mapped at the eager point,
    between replays). Tokens and logits are the eager cache's, and no graph ran without CUDA graphs."""
    torch.manual_seed(0)
    model = default_hf_model(device="cuda").eval()
    model.set_attn_implementation(attention)
    ids = torch.randint(1, 256, (2, 1010), device="cuda")
    mask = torch.ones_like(ids)
    ids[1, :10], mask[1, :10] = PAD, 0
    options = dict(attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=PAD,
                   output_logits=True, return_dict_in_generate=True)
    eager = model.generate(ids, **{CACHE: vhf.VirtualCache(mode, config=model.config)}, **options)
    cache = vhf.VirtualCache(mode, config=model.config, max_seq_len=1034, compile=True)
    skips = counters["inductor"]["cudagraph_skips"]
    graphed = model.generate(ids, **{CACHE: cache}, **options)
    assert counters["inductor"]["cudagraph_skips"] == skips, "a compiled graph ran without CUDA graphs"
    stats = cache.stats()
    assert stats["compiled_steps"] == 23 and stats["compile_fallbacks"] == 0
    assert mode == "paged" or stats["layout"] == "all_layers"
    logits, reference = torch.stack(graphed.logits), torch.stack(eager.logits)
    assert float((logits - reference).abs().max()) <= 1e-3 * float(reference.abs().max())
    assert torch.equal(graphed.sequences, eager.sequences)
    cache.close()


TRITON_DECODE = textwrap.dedent("""
    import torch
    from transformers import CompileConfig
    import vmkv.hf
    from vmkv.hf.compat import update_gets_attention_kwargs
    from vmkv.models import PAD, default_hf_model
    torch.manual_seed(0)
    model = default_hf_model(num_hidden_layers=2).eval()
    model.set_attn_implementation("vmkv")
    ids = torch.randint(0, 256, (3, 9))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = PAD, 0
    ids[2, :7], mask[2, :7] = PAD, 0
    config = CompileConfig(mode="default")
    config._compile_all_devices = True
    def generate(cache):
        return model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD,
                              compile_config=config, past_key_values=cache)
    for mode in ("vmm", "paged"):
        eager = generate(vmkv.hf.VirtualCache(mode, config=model.config, max_seq_len=21))
        cache = vmkv.hf.VirtualCache(mode, config=model.config, max_seq_len=21, compile=True, block_size=4)
        compiled = generate(cache)
        assert cache._compiled.static.kernel == "triton", "the interpreter does not run here"
        stats = cache.stats()
        assert stats["compiled_steps"] + stats["eager_steps"] == 11 and (
            stats["compile_fallbacks"] == 0) == update_gets_attention_kwargs(), stats
        print(mode, "SAME" if torch.equal(eager, compiled) else f"DIFFERENT {eager.tolist()} {compiled.tolist()}")
    # a head dim the Triton kernels lack (Phi-3's 96): the rule picks another capturable kernel up front
    torch.manual_seed(0)
    model = default_hf_model(num_hidden_layers=2, hidden_size=192, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=96).eval()
    model.set_attn_implementation("vmkv")
    eager = generate(vmkv.hf.VirtualCache("vmm", config=model.config, max_seq_len=21))
    cache = vmkv.hf.VirtualCache("vmm", config=model.config, max_seq_len=21, compile=True)
    compiled = generate(cache)
    assert cache._compiled.static.kernel == "sdpa_masked", cache._compiled.static.parts[0].choice
    assert cache.stats()["compiled_steps"] + cache.stats()["eager_steps"] == 11, cache.stats()
    print("head_dim 96", "SAME" if torch.equal(eager, compiled) else "DIFFERENT")
""")


def test_compiled_vmkv_attention_runs_the_triton_decode_kernel_in_the_interpreter(tmp_path):
    """The GPU's path on the host: the compiled decode step calls the Triton kernel (Triton's
    interpreter, a child process: ``TRITON_INTERPRET=1`` before triton's first import) through
    ``torch.ops.vmkv.decode_store``, over slots and over block tables (blocks of 4 tokens: rows
    cross blocks while decoding), and gives the eager cache's tokens; a head dim Triton lacks
    (96) gets the masked SDPA kernel when the cache is made, not an error mid-generation."""
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", TRITON_DECODE], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.strip().splitlines()[-3:] == ["vmm SAME", "paged SAME", "head_dim 96 SAME"]


SEGFAULT_REPRO = textwrap.dedent("""
    import logging, sys, torch
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
    import vmkv.hf
    from vmkv.models import default_hf_model
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = default_hf_model(num_hidden_layers=2).eval()
    ids = torch.randint(0, 256, (2, 10))
    def decode(forward, cache, steps=3):
        with torch.no_grad():
            tokens = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            out = []
            for step in range(steps):
                position = torch.full((2, 1), 10 + step)
                tokens = forward(input_ids=tokens, past_key_values=cache, use_cache=True,
                                 position_ids=position).logits[:, -1:].argmax(-1)
                out.append(tokens)
        return torch.cat(out, 1)
    eager = decode(model.forward, vmkv.hf.VirtualCache("vmm", max_seq_len=256))
    compiled = decode(torch.compile(model.forward), vmkv.hf.VirtualCache("vmm", max_seq_len=256))
    print("SAME" if torch.equal(eager, compiled) else f"DIFFERENT {eager.tolist()} {compiled.tolist()}")
""")


def test_compiling_a_forward_over_a_cache_without_compile_does_not_crash(tmp_path):
    """The issue's SIGSEGV (torch.compile(model.forward) over VirtualCache("vmm"): inductor copied
    a whole view back into read-only zero pages) now runs eagerly at graph breaks, warning once."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SEGFAULT_REPRO], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode} (-11 is SIGSEGV)\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.strip().splitlines()[-1] == "SAME"
    assert done.stdout.count("made without compile=True") == 1
