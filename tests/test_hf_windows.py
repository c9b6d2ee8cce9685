"""Today's models in transformers (issue 36): sliding-window layers, soft-capping and attention
sinks, with memory that follows the window.

Tiny random configs of GPT-OSS (alternating windowed and full layers, attention sinks), Gemma 2
(soft-capping), Gemma 3 (five local layers to one global, here three to one), Mistral (every
layer windowed), Qwen2 (``use_sliding_window``: the upper layers windowed) and Cohere2; prompts
longer than the window, 60 new tokens. ``VirtualCache(config=model.config)`` gives each kind of layer its own
cache (``vmkv.core.groups``): VMM mode with the model's own attention, VMM and paged mode with
the ``"vmkv"`` attention, eagerly and compiled; every run gives ``DynamicCache``'s tokens.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import transformers as T  # noqa: E402
from transformers import CompileConfig, DynamicCache  # noqa: E402

import vmkv.hf as vhf  # noqa: E402
from vmkv.errors import InvalidInput  # noqa: E402
from vmkv.hf.compat import update_gets_attention_kwargs  # noqa: E402

CACHE = vhf.cache_argument()
W = 16  # every model's window: the 40-token prompts and 60 new tokens run well past it
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0)
ARCHS = {  # name: (config, model, what it adds, its own attention)
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM, dict(sliding_window=W, num_local_experts=4, num_experts_per_tok=2,
                layer_types=["sliding_attention", "full_attention"] * 2), "eager"),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(sliding_window=W, query_pre_attn_scalar=16), "eager"),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(sliding_window=W, query_pre_attn_scalar=16,
               layer_types=["sliding_attention"] * 3 + ["full_attention"]), "sdpa"),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=W), "sdpa"),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(sliding_window=W, use_sliding_window=True, max_window_layers=2),
              "sdpa"),
    "cohere2": (T.Cohere2Config, T.Cohere2ForCausalLM, dict(sliding_window=W,
                layer_types=["sliding_attention"] * 3 + ["full_attention"]), "sdpa"),
}
SETUPS = [("vmm", "own"), ("vmm", "vmkv"), ("paged", "vmkv")]
NEW = 60


def tiny(name: str, attention: str = "own") -> torch.nn.Module:
    config_cls, model_cls, extra, own = ARCHS[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    model.set_attn_implementation(own if attention == "own" else attention)
    return model


def prompts(padded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :7], mask[1, :7] = 0, 0
    return ids, mask


def generate(model, cache, ids, mask, compiled: bool = False, **options) -> torch.Tensor:
    if compiled:
        config = CompileConfig(mode="default")
        config._compile_all_devices = True
        options["compile_config"] = config
    torch.manual_seed(7)
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0,
                          **{CACHE: cache}, **options)


def cache_for(model, mode: str, **options) -> vhf.VirtualCache:
    """32-token VMM pages (4 KiB of one layer's K), 4-token blocks, 8 tokens of slack: pages go."""
    vmm = dict(page_size="4KiB", layout="per_layer") if mode == "vmm" else {}
    return vhf.VirtualCache(mode, config=model.config, block_size=4, window_slack=8, **vmm, **options)


@pytest.fixture(scope="module")
def dynamic_tokens() -> dict:
    """Each model's tokens over transformers' DynamicCache (its sliding layers), greedy and sampled."""
    out = {}
    for name in ARCHS:
        model = tiny(name)
        for how, options in (("greedy", dict(do_sample=False)), ("sampling", dict(do_sample=True, top_k=20))):
            out[name, how] = generate(model, DynamicCache(config=model.config), *prompts(), **options)
    return out


@pytest.mark.parametrize("how", ["greedy", "sampling"])
@pytest.mark.parametrize("mode,attention", SETUPS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_eager_generation_gives_dynamic_caches_tokens(dynamic_tokens, arch, mode, attention, how):
    model = tiny(arch, attention)
    cache = cache_for(model, mode)
    options = dict(do_sample=False) if how == "greedy" else dict(do_sample=True, top_k=20)
    assert torch.equal(generate(model, cache, *prompts(), **options), dynamic_tokens[arch, how])
    assert_memory_follows_the_window(cache)


@pytest.mark.parametrize("mode,attention", SETUPS)
@pytest.mark.parametrize("arch", ["gpt_oss", "gemma2", "gemma3", "qwen2"])
def test_compiled_generation_gives_dynamic_caches_tokens(dynamic_tokens, arch, mode, attention):
    """compile=True: the model's attention reads full-length views (the model's sliding mask hides
    what the window released: zeros); the "vmkv" attention decodes each row over its window, with
    sinks and soft-capping, through the compiled step."""
    torch._dynamo.reset()
    model = tiny(arch, attention)
    cache = cache_for(model, mode, max_seq_len=40 + NEW, compile=True)
    assert torch.equal(generate(model, cache, *prompts(), compiled=True, do_sample=False), dynamic_tokens[arch, "greedy"])
    stats = cache.stats()
    if attention == "vmkv" and not update_gets_attention_kwargs():  # transformers < 5.24: eagerly at graph breaks
        assert stats["eager_steps"] == NEW - 1 and stats["compile_fallbacks"] > 0
    else:
        assert stats["compiled_steps"] == NEW - 1 and stats["compile_fallbacks"] == 0
    assert_memory_follows_the_window(cache)


def assert_memory_follows_the_window(cache: vhf.VirtualCache) -> None:
    """Each row of a windowed group holds at most its window, the slack and a partly filled page
    at each end; and the windowed groups let pages go."""
    core = cache.core
    for group in getattr(core, "groups", [core]):
        window = group.config.window
        if not window:
            continue
        tpp = group.tokens_per_page
        limit = -(-(window - 1 + group.window.slack) // tpp) + 2
        for seq_id in cache.rows:
            held = [page for page in group.pages(seq_id)[: group.pages_for(group.seq_len(seq_id))] if page != -1]
            assert len(held) <= limit, f"a row of the {window}-token group holds {len(held)} pages of {tpp} tokens"
        assert group.stats()["window_releases"] > 0


@pytest.mark.parametrize("mode,attention", SETUPS)
def test_beam_search_gives_dynamic_caches_tokens(mode, attention):
    model = tiny("gemma3", attention)
    ids, mask = prompts(padded=False)
    options = dict(do_sample=False, num_beams=3)
    want = generate(tiny("gemma3"), DynamicCache(config=model.config), ids, mask, **options)
    assert torch.equal(generate(model, cache_for(model, mode, max_batch_size=12), ids, mask, **options), want)


@pytest.mark.parametrize("mode,attention", SETUPS)
@torch.no_grad()
def test_a_crop_within_the_slack_continues_as_dynamic_cache_does(mode, attention):
    """Rolling back a few tokens (a rejected speculation) and going on: the logits of a
    DynamicCache that keeps every token (transformers' sliding layers, a ring, refuse a crop once
    the window filled); past the slack the crop is refused, changing nothing."""
    model = tiny("gpt_oss", attention)
    reference = tiny("gpt_oss")
    ids = prompts(padded=False)[0]
    ours, theirs = cache_for(model, mode), DynamicCache()
    for run, cache in ((model, ours), (reference, theirs)):
        run(ids, use_cache=True, **{CACHE: cache})
        for token in range(60):
            run(torch.full((2, 1), token + 3), use_cache=True, **{CACHE: cache})
    slack = ours.core.groups[0].window.slack
    before = ours.core.state()
    with pytest.raises(InvalidInput, match="sliding window let go"):
        ours.crop(-(slack + 20))
    assert ours.core.state() == before
    ours.crop(-4)
    theirs.crop(-4)
    for token in range(6):
        step = torch.full((2, 1), 50 + token)
        got = model(step, use_cache=True, **{CACHE: ours}).logits
        want = reference(step, use_cache=True, **{CACHE: theirs}).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_assisted_decoding_gives_the_tokens_of_plain_decoding():
    """A draft model proposes tokens; the main model (windowed, over a VirtualCache) checks them
    and rolls its cache back over the rejected ones: the same tokens as without the draft."""
    model = tiny("mistral")
    draft_config = T.MistralConfig(**{**COMMON, "num_hidden_layers": 1}, sliding_window=W)
    torch.manual_seed(3)
    draft = T.MistralForCausalLM(draft_config).eval()
    ids, mask = prompts(padded=False)
    ids, mask = ids[:1], mask[:1]
    plain = generate(model, cache_for(model, "vmm"), ids, mask, do_sample=False)
    assisted = generate(model, cache_for(model, "vmm"), ids, mask, do_sample=False, assistant_model=draft)
    assert torch.equal(assisted, plain)


def test_the_vmkv_attention_refuses_padding_inside_a_windowed_row():
    """A window counts the columns padding takes, which the "vmkv" attention does not store: a
    padded follow-up prompt over kept rows is refused, naming the way out, before anything changes."""
    model = tiny("mistral", "vmkv")
    cache = cache_for(model, "vmm")
    ids, mask = prompts(padded=False)
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True, **{CACHE: cache})
        more = torch.randint(1, 128, (2, 5))
        more_mask = torch.ones(2, 45, dtype=torch.long)
        more_mask[1, 40:42] = 0
        before = cache.core.state()
        with pytest.raises(InvalidInput, match="padding only on the left of a first prompt"):
            model(more, attention_mask=more_mask, use_cache=True, **{CACHE: cache})
    assert cache.core.state() == before
