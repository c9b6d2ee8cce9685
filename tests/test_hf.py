"""vmkv.hf against transformers' own caches on tiny random models (CPU, no download).

Setups: ``vmm`` (model's SDPA over zero-copy views), ``vmm+vmkv`` and ``paged+vmkv`` (the
registered ``attn_implementation="vmkv"`` calling the cache's kernel). Generated tokens must be
identical to ``DynamicCache``; logits are bit-identical with the model's SDPA over our views and
agree within ``atol=2e-5, rtol=1e-5`` (float32; measured <= 6e-6) with the cache's own kernels.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402  # noqa: E402

import vmkv.hf as vhf  # noqa: E402
from vmkv.errors import (  # noqa: E402
    CacheClosed,
    InvalidConfig,
    InvalidInput,
    InvalidShape,
    NoFreeSlot,
    OutOfPages,
    SequenceTooLong,
)

# transformers 5.19 takes the cache as past_key_values=, 5.24 as cache= (the old name still works
# there with a deprecation warning): every call here uses the installed version's name.
CACHE = vhf.cache_argument()

TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, pad_token_id=0,
    bos_token_id=2, eos_token_id=1, tie_word_embeddings=False,
)
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
}
# More architectures, one test each way (transformers class prefix -> what sets it apart). GPT-NeoX
# calls cache.update(k, v, layer) without the attention kwargs; Gemma scales embeddings; Qwen3 and
# OLMo2 normalise q/k; Phi rotates part of each head; Mixtral is a mixture of experts; OPT has
# learned positions and no RoPE.
MORE_ARCHS = ["GPTNeoX", "Gemma", "Qwen3", "Phi", "Olmo2", "Mixtral", "OPT"]
# Sliding-window / soft-capped attention: the model's own attention over VMM views only.
SLIDING = {"Mistral": dict(sliding_window=16), "Gemma2": dict(sliding_window=16, head_dim=16, query_pre_attn_scalar=16)}
# (mode, attn_implementation)
SETUPS = [
    pytest.param(("vmm", "sdpa"), id="vmm"),
    pytest.param(("vmm", "vmkv"), id="vmm+vmkv"),
    pytest.param(("paged", "vmkv"), id="paged+vmkv"),
]
# 32 tokens a VMM page of this geometry (128 B a token and layer); VirtualCache()'s own defaults
# (head-major on the host) are tested in test_defaults_*
PAGE = dict(page_size="4KiB", block_size=16, layout="per_layer")


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    built = {}
    for name, (config_cls, model_cls) in ARCHS.items():
        torch.manual_seed(1)
        built[name] = model_cls(config_cls(**TINY)).eval()
    return built


@functools.cache
def tiny_model(prefix: str, **overrides) -> torch.nn.Module:
    """``transformers.<prefix>ForCausalLM`` of the TINY shape with seeded random weights."""
    config_cls, model_cls = getattr(transformers, prefix + "Config"), getattr(transformers, prefix + "ForCausalLM")
    torch.manual_seed(1)
    return model_cls(config_cls(**{**TINY, **overrides})).eval()


def use_attention(model: torch.nn.Module, name: str) -> torch.nn.Module:
    model.set_attn_implementation(name)
    return model


def prompts(padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One prompt of 11 tokens, or a left-padded batch of 3 (11, 6 and 9 tokens)."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, TINY["vocab_size"], (3 if padded else 1, 11), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :5] = 0
        mask[2, :2] = 0
        ids[mask == 0] = TINY["pad_token_id"]
    return ids, mask


def generate(model, cache, ids, mask, **kwargs) -> torch.Tensor:
    kwargs.setdefault("max_new_tokens", 12)
    kwargs.setdefault("do_sample", False)
    return model.generate(ids, attention_mask=mask, pad_token_id=0, **{CACHE: cache}, **kwargs)


def reference(model, ids, mask, **kwargs) -> torch.Tensor:
    return generate(use_attention(model, "sdpa"), DynamicCache(), ids, mask, **kwargs)


def assert_all_pages_return(cache: vhf.VirtualCache) -> None:
    cache.reset()
    cache.core.check()
    stats = cache.stats()
    assert stats["pages_free"] == stats["pages_total"]


# ---- generation equals DynamicCache ---------------------------------------------------------------
@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("padded", [False, True], ids=["single", "left-padded"])
def test_greedy_generate_matches_dynamic_cache(models, arch, setup, padded):
    mode, attn = setup
    ids, mask = prompts(padded)
    expected = reference(models[arch], ids, mask)
    cache = vhf.VirtualCache(mode, **PAGE)
    out = generate(use_attention(models[arch], attn), cache, ids, mask)
    assert torch.equal(out, expected)
    assert cache.get_seq_length() == out.shape[1] - 1  # the last token is never fed back
    assert_all_pages_return(cache)


@pytest.mark.parametrize("setup", SETUPS)
def test_beam_search_matches_dynamic_cache(models, setup):
    mode, attn = setup
    ids, mask = prompts(padded=True)
    beams = dict(num_beams=4, num_return_sequences=2, max_new_tokens=10)
    expected = reference(models["llama"], ids, mask, **beams)
    cache = vhf.VirtualCache(mode, **PAGE)
    out = generate(use_attention(models["llama"], attn), cache, ids, mask, **beams)
    assert torch.equal(out, expected)
    stats = cache.stats()
    # every row no beam continues is either freed (and a source forked) or rewritten in place
    assert stats["row_forks"] + stats["row_retargets"] > 0 and stats["row_forks"] == stats["row_frees"]
    assert_all_pages_return(cache)


@pytest.mark.parametrize("setup", SETUPS)
def test_seeded_sampling_matches_dynamic_cache(models, setup):
    mode, attn = setup
    ids, mask = prompts(padded=True)
    sample = dict(do_sample=True, num_return_sequences=3, top_k=0, max_new_tokens=10)
    torch.manual_seed(123)
    expected = reference(models["qwen2"], ids, mask, **sample)
    cache = vhf.VirtualCache(mode, **PAGE)
    torch.manual_seed(123)
    out = generate(use_attention(models["qwen2"], attn), cache, ids, mask, **sample)
    assert torch.equal(out, expected)
    assert_all_pages_return(cache)


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_forward_logits_match_dynamic_cache(models, arch, setup):
    """Prefill of a left-padded batch, then a 3-token chunk: logits of every real position agree."""
    mode, attn = setup
    model = models[arch]
    ids, mask = prompts(padded=True)
    more = torch.randint(3, TINY["vocab_size"], (3, 3), generator=torch.Generator().manual_seed(3))
    full_mask = torch.cat([mask, torch.ones_like(more)], dim=1)

    def two_forwards(cache):
        first = model(ids, attention_mask=mask, **{CACHE: cache}, use_cache=True).logits
        second = model(more, attention_mask=full_mask, **{CACHE: cache}, use_cache=True).logits
        return first, second

    use_attention(model, "sdpa")
    ref_first, ref_second = two_forwards(DynamicCache())
    use_attention(model, attn)
    cache = vhf.VirtualCache(mode, **PAGE)
    first, second = two_forwards(cache)
    real = mask.bool()
    if attn == "sdpa":  # the same SDPA call on the same values: bit-identical
        assert torch.equal(first[real], ref_first[real]) and torch.equal(second, ref_second)
    # the cache's own kernels sum in another order: measured <= 6e-6 on these models
    torch.testing.assert_close(first[real], ref_first[real], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(second, ref_second, atol=2e-5, rtol=1e-5)
    assert cache.get_seq_length() == ids.shape[1] + 3


# ---- VirtualCache() with no arguments (issue 16: defaults that win) -----------------------------
def assert_same_greedy_tokens_up_to_a_tie(model, ids, mask, out, expected) -> None:
    """bfloat16 with the cache's own kernel: it sums in another order than SDPA, so greedy tokens
    may part at a near-tie (transformers' own eager and SDPA attentions part on AVX2 CPUs too).
    Each row equals DynamicCache's tokens up to its first difference, and there DynamicCache's
    logits of the two tokens are within 2 bfloat16 steps of each other (a tie in bfloat16)."""
    prompt = ids.shape[1]
    for row in range(out.shape[0]):
        differ = (out[row] != expected[row]).nonzero()
        if len(differ) == 0:
            continue
        at = int(differ[0])
        assert at >= prompt
        ours, theirs = int(out[row, at]), int(expected[row, at])
        with torch.no_grad():
            seen = torch.cat([mask[row], mask.new_ones(at - prompt)])[None]
            logits = use_attention(model, "sdpa")(expected[row : row + 1, :at], attention_mask=seen).logits[0, -1]
        step = 2.0 ** (torch.frexp(logits[theirs].float()).exponent.item() - 8)  # one bf16 step there
        assert float(logits[theirs] - logits[ours]) <= 2 * step, (row, at, ours, theirs)


@functools.cache
def model_in(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("workload", ["greedy", "beam", "sampling"])
def test_defaults_generate_dynamic_cache_tokens(dtype, setup, workload):
    """``VirtualCache(mode)`` with every default (the layout it picks: head-major on the host)
    gives DynamicCache's tokens on a left-padded batch, greedy, beams and seeded sampling, in
    float32 and bfloat16; stats() names the layout and why."""
    mode, attn = setup
    model = model_in(dtype)
    ids, mask = prompts(padded=True)
    kwargs = {"greedy": {}, "beam": dict(num_beams=3, num_return_sequences=2),
              "sampling": dict(do_sample=True, num_return_sequences=2, top_k=0)}[workload]
    torch.manual_seed(5)
    expected = reference(model, ids, mask, **kwargs)
    cache = vhf.VirtualCache(mode)
    torch.manual_seed(5)
    out = generate(use_attention(model, attn), cache, ids, mask, **kwargs)
    if dtype == torch.bfloat16 and attn == "vmkv" and workload == "greedy":
        assert_same_greedy_tokens_up_to_a_tie(model, ids, mask, out, expected)
    else:
        assert torch.equal(out, expected)
    stats = cache.stats()
    assert stats["layout"] == ("head_major" if mode == "vmm" else "blocks") and stats["layout_reason"]
    assert_all_pages_return(cache)


# ---- more architectures; reset, deepcopy, assistants (issue 10 items 19-23) ----------------------
@pytest.fixture(scope="module")
def references() -> dict:
    """DynamicCache outputs computed once per test module, by key."""
    return {}


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("arch", list(ARCHS) + MORE_ARCHS)
def test_architecture_generates_again_after_reset(models, references, arch, setup):
    """Left-padded greedy generation equals DynamicCache; after ``reset()`` the same cache serves
    another batch (2 rows, other prompts) equally, and every page returns each time."""
    mode, attn = setup
    model = models[arch] if arch in ARCHS else tiny_model(arch)
    ids, mask = prompts(padded=True)
    cache = vhf.VirtualCache(mode, **PAGE)
    for n, (batch_ids, batch_mask) in enumerate(((ids, mask), (ids[:2, 3:].flip(0), mask[:2, 3:].flip(0)))):
        if (arch, n) not in references:
            references[arch, n] = reference(model, batch_ids, batch_mask)
        expected = references[arch, n]
        assert torch.equal(generate(use_attention(model, attn), cache, batch_ids, batch_mask), expected)
        assert_all_pages_return(cache)  # reset(), then every page is free
        assert cache.get_seq_length() == 0 and not cache.is_initialized


@pytest.mark.parametrize("arch", list(SLIDING))
def test_sliding_window_models_run_over_vmm_views_and_the_vmkv_attention_needs_the_config(arch):
    """Mistral (window 16) and Gemma2 (window 16, soft-capping) with their own attention in VMM
    mode equal transformers' default cache (sliding layers) well past the window, with or without
    the config; the "vmkv" attention needs the config (which says each layer's window)."""
    model = tiny_model(arch, **SLIDING[arch])
    ids, mask = prompts(padded=True)
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, attention_mask=mask, **kwargs)  # no cache given: transformers builds its own
    for cache in (vhf.VirtualCache("vmm", **PAGE), vhf.VirtualCache("vmm", config=model.config, **PAGE)):
        assert torch.equal(model.generate(ids, attention_mask=mask, **{CACHE: cache}, **kwargs), expected)
        assert cache.get_seq_length() == 11 + 23 > SLIDING[arch]["sliding_window"]
    own = model.config._attn_implementation
    try:
        with pytest.raises(InvalidConfig, match="config=model.config"):
            generate(use_attention(model, "vmkv"), vhf.VirtualCache("vmm", **PAGE), ids, mask)
    finally:
        use_attention(model, own)


@pytest.mark.parametrize("setup", SETUPS)
@torch.no_grad()
def test_deepcopy_reuses_a_prefilled_prompt(models, setup):
    """transformers' prompt reuse: prefill a shared prefix once, ``copy.deepcopy`` the cache per
    question. Same tokens as DynamicCache; a copy shares every page (no page allocated) and a
    dropped copy frees its rows."""
    mode, attn = setup
    model = models["llama"]
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, TINY["vocab_size"], (1, 40), generator=gen)  # more than one 32-token page
    questions = [torch.randint(3, TINY["vocab_size"], (1, n), generator=gen) for n in (5, 9, 3)]

    def answer(base, question):
        full = torch.cat([prefix, question], 1)
        return model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=8, do_sample=False,
                              pad_token_id=0, **{CACHE: copy.deepcopy(base)})

    use_attention(model, "sdpa")
    dense = DynamicCache()
    model(prefix, **{CACHE: dense}, use_cache=True)
    expected = [answer(dense, q) for q in questions]
    use_attention(model, attn)
    base = vhf.VirtualCache(mode, **PAGE)
    model(prefix, **{CACHE: base}, use_cache=True)
    if attn == "sdpa":  # the first forward's K/V are written at the next call: make them pages now
        base._flush_pending()
    in_use = base.core.stats()["pages_in_use"]
    clone = copy.deepcopy(base)
    assert base.core.stats()["pages_in_use"] == in_use and clone.core is base.core  # shared, nothing copied
    assert base.core.pages(clone.rows[0]) == base.core.pages(base.rows[0])
    for question, want in zip(questions, expected):
        assert torch.equal(answer(base, question), want)
    dropped = weakref.ref(clone)
    del clone
    assert dropped() is None  # no reference cycle: a cache nobody holds is gone at once, without gc
    survivor = copy.deepcopy(base)  # dropped copies free their rows here (never in the middle of a forward)
    assert len(base.core) == 2 and base.get_seq_length() == 40
    base.close()  # the copy still uses the core: it stays open
    assert base.core is None and len(survivor.core) == 1
    full = torch.cat([prefix, questions[0]], 1)
    out = model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=8, do_sample=False,
                         pad_token_id=0, **{CACHE: survivor})
    assert torch.equal(out, expected[0])
    survivor.close()


@pytest.mark.parametrize("setup", SETUPS)
def test_vmkv_attention_model_can_be_an_assistant(models, setup):
    """generate() gives an assistant model a DynamicCache: its "vmkv" attention runs the stock
    SDPA kernel, and assisted greedy decoding gives the main model's greedy tokens."""
    mode, attn = setup
    main = models["llama"]
    assistant = use_attention(tiny_model("Llama", num_hidden_layers=1), "vmkv")
    ids, mask = prompts(padded=False)
    expected = reference(main, ids, mask)
    out = generate(use_attention(main, attn), vhf.VirtualCache(mode, **PAGE), ids, mask, assistant_model=assistant)
    assert torch.equal(out, expected)


def test_vmkv_attention_with_another_cache_equals_sdpa(models):
    """A left-padded prefill then a 3-token chunk over a DynamicCache: the "vmkv" attention's
    stock fallback gives SDPA's logits at every real position."""
    model = models["qwen2"]
    ids, mask = prompts(padded=True)
    more = torch.randint(3, TINY["vocab_size"], (3, 3), generator=torch.Generator().manual_seed(3))
    full_mask = torch.cat([mask, torch.ones_like(more)], dim=1)

    def two_forwards():
        cache = DynamicCache()
        first = model(ids, attention_mask=mask, **{CACHE: cache}, use_cache=True).logits
        return first, model(more, attention_mask=full_mask, **{CACHE: cache}, use_cache=True).logits

    want_first, want_second = two_forwards() if use_attention(model, "sdpa") else None
    use_attention(model, "vmkv")
    first, second = two_forwards()
    real = mask.bool()
    torch.testing.assert_close(first[real], want_first[real], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(second, want_second, atol=1e-6, rtol=1e-6)


def test_vmkv_attention_says_when_a_model_changes_k_after_update(models):
    """The "vmkv" attention writes the K that ``update`` returned; a model that hands its
    attention another tensor is refused with the reason (never a silent stock fallback)."""
    model = use_attention(models["llama"], "vmkv")
    cache = vhf.VirtualCache("vmm", config=model.config, **PAGE)
    k = torch.randn(1, 2, 3, 16)
    cache.update(k, k.clone(), 0)  # as GPT-NeoX calls it: no attention kwargs
    module = model.model.layers[0].self_attn
    with pytest.raises(InvalidConfig, match="changes the key states"):
        vhf.vmkv_attention_forward(module, torch.randn(1, 4, 3, 16), k * 2, k.clone(), None)


def test_layer_keys_and_values_are_views_where_the_layout_allows(models):
    """``cache.layers[i].keys / .values``: zero-copy views equal to DynamicCache's tensors in VMM
    mode with the model's attention (no copy counted); a clear ``Unsupported`` from every
    inherited feature a VirtualCache lacks."""
    model = use_attention(models["llama"], "sdpa")
    ids, mask = prompts(padded=True)
    more = torch.randint(3, TINY["vocab_size"], (3, 2), generator=torch.Generator().manual_seed(4))
    full_mask = torch.cat([mask, torch.ones_like(more)], dim=1)
    dense, cache = DynamicCache(), vhf.VirtualCache("vmm", **PAGE)
    for c in (dense, cache):
        model(ids, attention_mask=mask, **{CACHE: c}, use_cache=True)
    torch.testing.assert_close(cache.layers[1].values, dense.layers[1].values)  # first forward: kept by reference
    for c in (dense, cache):
        model(more, attention_mask=full_mask, **{CACHE: c}, use_cache=True)
    k_all, _ = cache.core.kv_cache(0)
    for layer in range(2):
        assert cache.layers[layer].keys.shape == dense.layers[layer].keys.shape == (3, 2, 13, 16)
        torch.testing.assert_close(cache.layers[layer].keys, dense.layers[layer].keys)
        torch.testing.assert_close(cache.layers[layer].values, dense.layers[layer].values)
    assert cache.layers[0].keys.data_ptr() == k_all[cache.core.slot(cache.rows[0])].data_ptr()  # a view
    assert cache.stats()["materialised_kv"] == 0
    for call in (lambda: cache.layers[0].offload(), lambda: cache.layers[0].prefetch(), lambda: cache.offload(0),
                 lambda: cache.prefetch(0), lambda: cache.early_initialization(1, 2, 16, torch.float32, "cpu"),
                 lambda: cache.layers[0].reset(), lambda: cache.layers[0].batch_select_indices(torch.tensor([0])),
                 lambda: setattr(cache.layers[0], "keys", torch.zeros(1))):
        with pytest.raises(vhf.Unsupported):
            call()


# the three setups where no [B, H, columns, D] view exists: (mode, attention, workload)
NO_VIEW = [
    pytest.param(("paged", "vmkv", "greedy"), id="paged-greedy"),
    pytest.param(("paged", "vmkv", "beam"), id="paged-beam"),
    pytest.param(("vmm", "vmkv", "greedy"), id="vmm+vmkv-padded-greedy"),
    pytest.param(("vmm", "vmkv", "beam"), id="vmm+vmkv-padded-beam"),
    pytest.param(("vmm", "sdpa", "beam"), id="vmm-beam-rows-out-of-slot-order"),
]


@pytest.mark.parametrize("case", NO_VIEW)
def test_layer_keys_and_values_are_copies_equal_to_dynamic_cache_where_no_view_exists(models, case):
    """transformers' own generation tests read ``out.past_key_values.layers[i].keys``: where no
    view exists they are materialised copies, counted in stats(), equal to DynamicCache's tensors
    (padding columns, not stored by the "vmkv" attention, read zeros), rows in batch order."""
    mode, attn, workload = case
    model = models["llama"]
    ids, mask = prompts(padded=True)
    beams = dict(num_beams=3, max_new_tokens=10) if workload == "beam" else {}
    if attn == "sdpa":  # rows land out of slot order when a reorder forks rows into other slots
        ids, mask = ids[:1], mask[:1]
    kwargs = dict(return_dict_in_generate=True, **beams)
    want = generate(use_attention(model, "sdpa"), DynamicCache(), ids, mask, **kwargs)
    cache = vhf.VirtualCache(mode, **PAGE)
    got = generate(use_attention(model, attn), cache, ids, mask, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    dense = want.past_key_values
    rows = dense.layers[0].keys.shape[0]
    real = mask.repeat_interleave(rows // mask.shape[0], 0).bool()  # [rows, prompt]: beams follow their prompt
    real = torch.cat([real, torch.ones(rows, dense.get_seq_length() - real.shape[1], dtype=torch.bool)], 1)
    if attn == "sdpa":  # the model's attention stores the padding columns too
        real[:] = True
    for layer in range(2):
        for part in ("keys", "values"):
            mine, theirs = getattr(cache.layers[layer], part), getattr(dense.layers[layer], part)
            assert mine.shape == theirs.shape == (rows, 2, dense.get_seq_length(), 16)
            torch.testing.assert_close(mine.transpose(1, 2)[real], theirs.transpose(1, 2)[real], atol=2e-5, rtol=1e-5)
            assert not mine.transpose(1, 2)[~real].any()  # padding columns read zeros
    assert cache.stats()["materialised_kv"] == 4  # one copy per read: 2 layers x K and V
    assert got.past_key_values is cache


# ---- VMM views, rows, crop ----------------------------------------------------------------------
def test_vmm_update_returns_zero_copy_views_of_exact_length(models):
    model = use_attention(models["llama"], "sdpa")
    cache = vhf.VirtualCache("vmm", config=model.config, **PAGE)
    ids, mask = prompts(padded=True)
    model(ids, attention_mask=mask, **{CACHE: cache}, use_cache=True)
    assert cache.get_mask_sizes(1, 0) == (ids.shape[1] + 1, 0)
    k_new = torch.randn(3, 2, 1, 16)
    keys, values = cache.update(k_new, k_new.clone(), 0)  # a new step of one token per row
    k_all, _ = cache.core.kv_cache(0)
    assert keys.shape == (3, 2, ids.shape[1] + 1, 16)
    assert keys.data_ptr() == k_all[cache.core.slot(cache.rows[0])].data_ptr()  # a view, not a copy
    torch.testing.assert_close(keys[:, :, -1:], k_new)
    dense = DynamicCache()
    use_attention(model, "sdpa")
    model(ids, attention_mask=mask, **{CACHE: dense}, use_cache=True)
    torch.testing.assert_close(keys[:, :, :-1], dense.layers[0].keys)
    assert cache.stats()["gathered_views"] == 0


@pytest.mark.parametrize("mode", ["vmm", "paged"])
def test_cache_built_from_config_knows_its_attention(models, mode):
    model = use_attention(models["qwen2"], "vmkv")
    cache = vhf.VirtualCache(mode, config=model.config, **PAGE)
    assert cache.attention_style == "vmkv"
    ids, mask = prompts(padded=True)
    expected = reference(model, ids, mask)
    assert torch.equal(generate(use_attention(model, "vmkv"), cache, ids, mask), expected)


def _kv_rows(cache: vhf.VirtualCache, layer: int) -> list[torch.Tensor]:
    return [cache.core.kv(seq_id, layer)[0] for seq_id in cache.rows]  # each [len, H, D]


@pytest.mark.parametrize("setup", SETUPS)
def test_row_operations_follow_dynamic_cache(models, setup):
    """reorder_cache, batch_repeat_interleave, batch_select_indices and crop vs DynamicCache."""
    mode, attn = setup
    model = models["llama"]
    ids, _ = prompts(padded=False)
    ids = torch.cat([ids, ids.flip(1), ids.roll(3, 1)])  # 3 rows, no padding: every column is stored
    use_attention(model, "sdpa")
    dense = DynamicCache()
    model(ids, **{CACHE: dense}, use_cache=True)
    use_attention(model, attn)
    cache = vhf.VirtualCache(mode, max_batch_size=8, **PAGE)
    model(ids, **{CACHE: cache}, use_cache=True)

    def check():
        for layer in range(2):
            expected = dense.layers[layer].keys.transpose(1, 2)  # [B, S, H, D]
            got = _kv_rows(cache, layer)
            assert len(got) == expected.shape[0]
            for row, k in enumerate(got):
                torch.testing.assert_close(k, expected[row])
        assert cache.get_seq_length() == dense.get_seq_length()
        cache.core.check()

    for op, arg in [
        ("reorder_cache", torch.tensor([0, 0, 2])),
        ("batch_repeat_interleave", 2),
        ("batch_select_indices", torch.tensor([5, 1, 0])),
        ("crop", -4),
    ]:
        getattr(dense, op)(arg)
        getattr(cache, op)(arg)
        check()
    pages = [cache.core.pages(seq_id) for seq_id in cache.rows]
    assert pages[1] == pages[2]  # both continue old row 0: shared pages, nothing copied
    assert cache.stats()["cow_copies"] == 0


def test_crop_of_padded_rows_keeps_their_real_tokens(models):
    model = use_attention(models["llama"], "vmkv")
    ids, mask = prompts(padded=True)
    cache = vhf.VirtualCache("vmm", **PAGE)
    model(ids, attention_mask=mask, **{CACHE: cache}, use_cache=True)
    assert [cache.core.seq_len(s) for s in cache.rows] == [11, 6, 9]  # padding is not stored
    cache.crop(-2)
    assert cache.get_seq_length() == 9
    assert [cache.core.seq_len(s) for s in cache.rows] == [9, 4, 7]


def test_beam_search_shares_pages(models):
    """Beams that continue one another share pages: peak bytes below DynamicCache's final bytes."""
    model = use_attention(models["llama"], "vmkv")
    ids = torch.randint(3, TINY["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(5))
    beams = dict(num_beams=4, max_new_tokens=40, min_new_tokens=40)
    dense = DynamicCache()
    generate(use_attention(model, "sdpa"), dense, ids, torch.ones_like(ids), **beams)
    dense_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dense.layers)
    cache = vhf.VirtualCache("vmm", **PAGE)
    generate(use_attention(model, "vmkv"), cache, ids, torch.ones_like(ids), **beams)
    stats = cache.stats()
    assert stats["shared_pages"] > 0
    assert stats["bytes_in_use"] < 0.6 * dense_bytes
    assert_all_pages_return(cache)


def test_model_attention_gathers_after_a_reorder_and_says_so(models):
    model = use_attention(models["llama"], "sdpa")
    ids, mask = prompts(padded=False)
    cache = vhf.VirtualCache("vmm", **PAGE)
    model(ids.repeat(2, 1), **{CACHE: cache}, use_cache=True)
    cache.reorder_cache(torch.tensor([1, 0]))  # rows swap slots
    model(ids[:, :2].repeat(2, 1), **{CACHE: cache}, use_cache=True)
    assert cache.stats()["gathered_views"] == 2  # once per layer of that step


# ---- errors -----------------------------------------------------------------------------------
def test_models_whose_cache_is_not_kv_are_refused_naming_the_feature():
    """Issue 37 (and 36): DeepSeek-V3's latent KV (multi-head latent attention) and hybrid models'
    linear-attention layers are refused when the cache is made, never with an internal error; a
    latent KV met without a config is refused at the first update, naming it."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3NextConfig

    mla = DeepseekV3Config(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
                           q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                           num_experts_per_tok=2, first_k_dense_replace=1)
    with pytest.raises(InvalidConfig, match="latent KV"):
        vhf.VirtualCache(config=mla)
    cache = vhf.VirtualCache()
    with pytest.raises(InvalidConfig, match="latent KV"):
        DeepseekV3ForCausalLM(mla).eval()(torch.randint(0, 64, (1, 5)), **{CACHE: cache}, use_cache=True)
    assert cache.core is None and cache.get_seq_length() == 0  # refused before anything was stored
    with pytest.raises(InvalidConfig, match="linear_attention"):
        vhf.VirtualCache(config=Qwen3NextConfig(num_hidden_layers=4))


def test_errors_are_typed(models):
    model = use_attention(models["llama"], "sdpa")
    with pytest.raises(InvalidConfig):
        vhf.VirtualCache("nope")
    with pytest.raises(InvalidConfig, match="attn_implementation='vmkv'"):
        vhf.VirtualCache("paged", config=model.config)
    ids, mask = prompts(padded=False)
    cache = vhf.VirtualCache("vmm", max_batch_size=2, **PAGE)
    model(ids, **{CACHE: cache}, use_cache=True)
    with pytest.raises(InvalidShape, match=r"cache\.reset\(\) \(or a new VirtualCache\) to start another batch"):
        model(ids.repeat(2, 1)[:, :1], **{CACHE: cache}, use_cache=True)  # issue 37: the error says what to do
    with pytest.raises(NoFreeSlot):
        cache.batch_repeat_interleave(3)
    with pytest.raises(InvalidInput):
        cache.crop(2)
    with pytest.raises(InvalidInput):
        cache.reorder_cache(torch.tensor([4]))
    assert cache.get_seq_length() == ids.shape[1] and len(cache.rows) == 1  # failed calls changed nothing
    short = vhf.VirtualCache("vmm", max_seq_len=12, **PAGE)
    model(ids, **{CACHE: short}, use_cache=True)
    with pytest.raises(SequenceTooLong):
        model(ids[:, :2], **{CACHE: short}, use_cache=True)
    assert short.get_seq_length() == ids.shape[1]
    full = vhf.VirtualCache("vmm", max_batch_size=1, **PAGE)
    model(ids, **{CACHE: full}, use_cache=True)
    model(ids[:, :1], **{CACHE: full}, use_cache=True)
    with pytest.raises(NoFreeSlot, match="free slots"):
        copy.deepcopy(full)  # a copy forks every row: no slot left
    assert len(full.core) == 1 and full.core.stats()["forks"] == 0
    full.reset()
    with pytest.raises(InvalidShape, match="reset cache keeps its geometry"):  # 4 KV heads of 16, not 2
        tiny_model("GPTNeoX")(ids, **{CACHE: full}, use_cache=True)
    full.close()
    with pytest.raises(CacheClosed):
        model(ids, **{CACHE: full}, use_cache=True)


def test_failed_row_operation_changes_nothing_with_a_deep_copy_in_the_core(models):
    """Rows a deep copy holds count against max_batch_size: the remap is refused before any fork."""
    model = use_attention(models["llama"], "vmkv")
    ids, _ = prompts(padded=False)
    cache = vhf.VirtualCache("vmm", max_batch_size=5, **PAGE)
    model(ids.repeat(2, 1), **{CACHE: cache}, use_cache=True)
    other = copy.deepcopy(cache)  # 4 of 5 slots in use
    before = (cache.rows, cache.core.state())
    with pytest.raises(NoFreeSlot, match="3 of max_batch_size=5"):
        cache.batch_repeat_interleave(2)  # 4 rows: 2 more than the one free slot
    assert (cache.rows, cache.core.state()) == before
    assert sorted(cache.core.seq_ids) == sorted(cache.rows + other.rows)
    cache.close()
    assert sorted(other.core.seq_ids) == sorted(other.rows)  # nothing of the closed copy is left
    other.close()


def test_row_operation_frees_its_forks_when_a_fork_fails(models, monkeypatch):
    model = use_attention(models["llama"], "vmkv")
    ids, _ = prompts(padded=False)
    cache = vhf.VirtualCache("vmm", max_batch_size=8, **PAGE)
    model(ids.repeat(2, 1), **{CACHE: cache}, use_cache=True)
    before = (cache.rows, cache.core.state())
    fork, calls = cache.core.fork, []

    def failing_fork(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OutOfPages("injected")
        return fork(src, dst)

    monkeypatch.setattr(cache.core, "fork", failing_fork)
    with pytest.raises(OutOfPages, match="injected"):
        cache.batch_repeat_interleave(2)
    assert len(calls) == 2  # the first fork was made, then freed
    assert cache.rows == before[0] and cache.core.seq_ids == before[0]
    assert cache.core.state()[2:4] == before[1][2:4]  # the same free slots and pool pages
    cache.close()


def test_row_operation_that_lost_a_row_frees_every_row_and_says_so(models, monkeypatch):
    """A retarget rewrote an unused row, then failed: the old rows cannot come back."""
    model = use_attention(models["llama"], "vmkv")
    ids, _ = prompts(padded=False)
    cache = vhf.VirtualCache("vmm", max_batch_size=2, **PAGE)
    model(torch.cat([ids, ids.flip(1)]), **{CACHE: cache}, use_cache=True)
    monkeypatch.setattr(cache.core, "begin_step", lambda batch: (_ for _ in ()).throw(OutOfPages("injected")))
    with pytest.raises(OutOfPages, match="injected") as failure:
        cache.reorder_cache(torch.tensor([0, 0]))  # row 1 (under a page) is retargeted to row 0
    assert "every row of this cache was freed" in str(failure.value.__notes__)
    assert cache.rows == [] and cache.core.seq_ids == [] and cache.get_seq_length() == 0
    assert_all_pages_return(cache)


def test_default_page_size_fits_granularity_and_token_bytes():
    page = vhf.default_page_size(token_bytes=384, granularity=4096)
    assert page % 4096 == 0 and page % 384 == 0 and page // 384 >= 64


def test_vmkv_imports_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import vmkv\n"
        "try:\n    import vmkv.hf\nexcept ImportError:\n    print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "ok"


# ---- benchmark --------------------------------------------------------------------------------
def test_generate_benchmark_smoke(tmp_path: Path):
    import argparse

    from vmkv_bench import generate as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([])
    args.device, args.smoke, args.seed, args.out = "cpu", True, 0, tmp_path
    result = bench.run(args)
    assert result["name"] == bench.NAME == "generate"
    assert result["rows"] and set(result["rows"][0]) == set(result["schema"])
    assert all(row["same_tokens_as_dynamic"] for row in result["rows"])
    assert set(result["summary"]["small/greedy/b2/4 speed vs dynamic"]) >= {"static", "vmm"}
    assert result["update_overhead"]["small/greedy/b2/4"]["decode_steps"] >= 1
    assert {v.key for v in bench.verdicts(result)} >= {"generate.small.vs_dynamic", "generate.small.vs_static"}
    pngs = bench.plot(result, tmp_path)
    assert pngs and all(Path(p).exists() for p in pngs)
