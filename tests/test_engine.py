"""Serving engine and Llama-family runner: outputs against transformers, batching, preemption,
forks, prefix caching, stops, aborts and request validation, in both KV modes (CPU)."""

from __future__ import annotations

import pytest
import torch

import vmkv
from vmkv.engine import GREEDY_TEMPERATURE, Engine, EngineConfig, InvalidParameter, SamplingParams
from vmkv.engine.llama import LlamaForCausalLM, LlamaShape
from vmkv.engine.runner import load_model
from vmkv.models import ByteTokenizer, default_hf_model, save_byte_tokenizer

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 3, "a", "Once upon a time, there"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model():
    return default_hf_model()


def hf_greedy(hf_model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Reference: transformers ``generate`` greedy on the same weights, not stopping at EOS."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=258)
    assert out.shape[1] == len(prompt_ids) + max_tokens
    return out[0, len(prompt_ids):].tolist()


def make_engine(mode: str, **overrides) -> Engine:
    options = dict(kv_mode=mode, memory_budget="8MiB", page_size="4KiB", block_size=8, max_num_seqs=8, max_seq_len=256)
    return Engine.from_config(EngineConfig(**{**options, **overrides}))


@pytest.fixture
def engines():
    made = []

    def make(mode: str, **overrides) -> Engine:
        engine = make_engine(mode, **overrides)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def assert_all_pages_back(engine: Engine) -> None:
    """No sequence holds a page; after ``trim`` every page is free."""
    engine.cache.check()
    assert len(engine.cache) == 0
    engine.cache.trim()
    stats = engine.cache.stats()
    assert stats["pages_free"] == stats["pages_total"]


# ---- the runner ------------------------------------------------------------------------------
def test_dense_path_matches_transformers(hf_model):
    loaded = load_model(None)
    ids = torch.tensor(ByteTokenizer().encode("Compare me with transformers"))
    with torch.no_grad():
        want = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(loaded.model.forward_dense(ids), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_families_match_transformers(family, tmp_path):
    """Qwen2 (q/k/v bias) and Mistral shapes load from a local safetensors directory and match."""
    import transformers

    cls, config_cls = {
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig),
    }[family]
    config = config_cls(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        sliding_window=None, tie_word_embeddings=family == "qwen2")
    torch.manual_seed(1)
    reference = cls(config).eval()
    if family == "qwen2":
        assert reference.model.layers[0].self_attn.q_proj.bias is not None
        with torch.no_grad():
            for layer in reference.model.layers:
                layer.self_attn.q_proj.bias.normal_()  # make the bias matter
    reference.save_pretrained(tmp_path)
    ours = LlamaForCausalLM.from_hf_config(config)
    from vmkv.engine.runner import _read_safetensors

    ours.load_weights(_read_safetensors(tmp_path))
    ids = torch.randint(0, 300, (17,))
    with torch.no_grad():
        want = reference(ids[None]).logits[0]
    torch.testing.assert_close(ours.forward_dense(ids), want, atol=1e-4, rtol=1e-4)
    assert LlamaShape.from_hf_config(config).qkv_bias == (family == "qwen2")


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config

    with pytest.raises(vmkv.InvalidConfig, match="gpt2"):
        LlamaShape.from_hf_config(GPT2Config())


def test_local_hf_directory_serves_like_transformers(tmp_path, hf_model, engines):
    hf_model.save_pretrained(tmp_path)
    save_byte_tokenizer(tmp_path)
    engine = engines("vmm", model=str(tmp_path))
    assert engine.model_name == tmp_path.name
    ids = engine.tokenizer.encode("from a directory")
    out = engine.generate([ids], GREEDY)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, GREEDY.max_tokens)
    assert engine.tokenizer.chat([{"role": "user", "content": "hi"}]) == engine.tokenizer.encode("user: hi\nassistant:")


@pytest.mark.parametrize("text", ["A!\u00e9\n", "plain ASCII, spaces  and\ttabs", "line one\nline two\r\n",
                                  "multibyte: \u00e9\u00e8 \u6f22\u5b57 \U0001f600", "\x00\x7f control"])
def test_saved_byte_tokenizer_encodes_like_byte_tokenizer(tmp_path, text):
    """Token ids are byte values (then BOS, EOS, PAD = 256, 257, 258), BOS first, like ByteTokenizer."""
    from transformers import AutoTokenizer

    save_byte_tokenizer(tmp_path)
    saved, ours = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True), ByteTokenizer()
    assert saved.encode(text) == ours.encode(text)
    assert saved.encode(text, add_special_tokens=False) == ours.encode(text, add_bos=False)
    assert saved.decode(ours.encode(text), skip_special_tokens=True) == ours.decode(ours.encode(text)) == text
    assert (saved.bos_token_id, saved.eos_token_id, saved.pad_token_id, len(saved)) == (256, 257, 258, 259)
    chat = [{"role": "user", "content": text}]
    prompt = saved.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert saved.encode(prompt, add_special_tokens=False) == ours.apply_chat_template(chat)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(vmkv.InvalidConfig, match="config.json"):
        load_model(tmp_path)


# ---- the engine ------------------------------------------------------------------------------
def test_greedy_matches_transformers_with_chunked_prefill(mode, engines, hf_model):
    """Mixed prompt lengths, prefills chunked to 16 tokens a step next to running decodes."""
    engine = engines(mode, max_num_batched_tokens=16, max_prefill_chunk=16)
    tok = ByteTokenizer()
    outs = engine.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        want = hf_greedy(hf_model, tok.encode(prompt), GREEDY.max_tokens)
        assert out.outputs[0].token_ids == want, prompt
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == tok.decode(want)
    assert engine.stats()["engine"]["steps"] > GREEDY.max_tokens  # the long prompt took several chunks
    assert_all_pages_back(engine)


def test_parallel_sampling_forks_prompt_pages(mode, engines):
    engine = engines(mode)
    prompt = "shared prompt " * 6  # 85 tokens: 10 full pages of 8, shared by the 4 completions
    params = SamplingParams(max_tokens=6, temperature=1.0, n=4, seed=7, ignore_eos=True)
    engine.add_request(prompt, params, request_id="r")
    engine.step()  # prefill, then fork: all four completions share the prompt's pages
    stats = engine.cache.stats()
    assert stats["forks"] == 3 and stats["sequences"] == 4
    assert stats["shared_pages"] >= len(ByteTokenizer().encode(prompt)) // 8
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2, 3]
    texts = [c.token_ids for c in final.outputs]
    assert len(set(map(tuple, texts))) > 1  # independent draws
    again = engines(mode).generate([prompt], params)[0]  # same seed: same completions
    assert [c.token_ids for c in again.outputs] == texts
    assert_all_pages_back(engine)


def test_prefix_cache_skips_cached_prompt_pages(mode, engines):
    engine = engines(mode)
    prompt = "a long shared system prompt, " * 4
    first = engine.generate([prompt], GREEDY)[0]
    fed = engine.stats()["engine"]["prompt_tokens"]
    second = engine.generate([prompt], GREEDY)[0]
    stats = engine.stats()
    assert stats["cache"]["prefix_hits"] == 1
    assert stats["engine"]["prompt_tokens"] - fed < 8  # only the last partial page is recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_stop_strings_and_stop_tokens(engines):
    engine = engines("vmm")
    base = engine.generate(["stop test"], GREEDY)[0].outputs[0]
    cut_at = base.text[4:6]  # a stop string from the middle of the greedy text
    out = engine.generate(["stop test"], SamplingParams(max_tokens=12, temperature=0, stop=cut_at, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == base.text[: base.text.find(cut_at)]
    token = base.token_ids[3]
    out = engine.generate(["stop test"], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[token], ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == base.token_ids[: base.token_ids.index(token) + 1]


def test_streamed_deltas_add_up_to_the_text(engines):
    engine = engines("vmm")
    engine.add_request("stream me", GREEDY, request_id="s")
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    assert "".join(deltas) == final.outputs[0].text


def test_sampling_controls():
    from vmkv.engine.sampling import SamplerState, new_generator, next_token

    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    states = [SamplerState(SamplingParams(top_k=1), new_generator(0)),
              SamplerState(SamplingParams(top_p=0.01), new_generator(0)),
              SamplerState(SamplingParams(temperature=0, presence_penalty=2.0), new_generator(0), output=[1])]
    assert [next_token(logits, state, 1) for state in states] == [1, 1, 3]
    draws = {next_token(logits, SamplerState(SamplingParams(top_k=2), new_generator(i)), 1) for i in range(200)}
    assert draws == {1, 3}  # the two most likely tokens, both drawn


def test_abort_frees_pages(mode, engines):
    engine = engines(mode)
    engine.add_request("abort me " * 5, SamplingParams(max_tokens=50, ignore_eos=True), request_id="x")
    engine.step()
    engine.step()
    assert engine.cache.stats()["pages_in_use"] > 0
    assert engine.abort("x") and not engine.abort("x")
    assert not engine.has_unfinished()
    assert_all_pages_back(engine)


@pytest.mark.parametrize(
    "prompt, params, error, param",
    [
        ("x" * 300, SamplingParams(max_tokens=1), vmkv.SequenceTooLong, None),
        ("hi", SamplingParams(max_tokens=254), vmkv.SequenceTooLong, None),
        ([], SamplingParams(), InvalidParameter, "prompt"),
        ([5, 999], SamplingParams(), InvalidParameter, "prompt"),
        ("hi", SamplingParams(n=9), InvalidParameter, "n"),
    ],
)
def test_bad_requests_change_nothing(engines, prompt, params, error, param):
    engine = engines("vmm")
    before = engine.stats()
    with pytest.raises(error) as info:
        engine.add_request(prompt, params)
    assert getattr(info.value, "param", None) == param
    assert engine.stats() == before and not engine.has_unfinished()


def test_request_larger_than_the_budget_is_refused(engines):
    engine = engines("vmm", memory_budget=4 * 8 * 4096)  # 4 pages of 8 tokens
    with pytest.raises(vmkv.OutOfPages, match="needs 5 KV pages"):
        engine.add_request("abc", SamplingParams(max_tokens=36))


@pytest.mark.parametrize("budget_pages, prompt_len, room", [(4, 4, 29), (4, 32, 1), (64, 200, 56), (64, 255, 1)])
def test_max_new_tokens_is_the_largest_max_tokens_accepted(engines, budget_pages, prompt_len, room):
    """4 pages of 8 tokens hold 32 tokens (the last generated token is never stored); the context is 256."""
    engine = engines("vmm", memory_budget=budget_pages * 8 * 4096)
    assert engine.max_new_tokens(prompt_len) == room
    prompt = [65] * prompt_len
    engine.check_request(prompt, SamplingParams(max_tokens=room))
    with pytest.raises((vmkv.OutOfPages, vmkv.SequenceTooLong)):
        engine.check_request(prompt, SamplingParams(max_tokens=room + 1))


def test_max_new_tokens_refuses_a_prompt_that_alone_does_not_fit(engines):
    engine = engines("vmm", memory_budget=4 * 8 * 4096)
    with pytest.raises(vmkv.OutOfPages, match="the prompt has 33 tokens"):
        engine.max_new_tokens(33)
    with pytest.raises(vmkv.SequenceTooLong, match="the prompt has 256 tokens"):
        engines("vmm").max_new_tokens(256)


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("n", 0),
                                          ("stop", [""]), ("top_k", -2), ("seed", 1.5), ("temperature", float("nan")),
                                          ("temperature", 10**400), ("frequency_penalty", float("inf")),
                                          ("stop_token_ids", [-1])])
def test_sampling_params_are_validated(field, value):
    with pytest.raises(InvalidParameter, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and isinstance(info.value, vmkv.InvalidInput)
    assert len(str(info.value)) < 200  # a 400-digit integer is not echoed in full


@pytest.mark.parametrize("temperature", [1e-40, 1e-8, GREEDY_TEMPERATURE / 2])
def test_tiny_temperatures_are_greedy(engines, temperature):
    """Dividing logits by 1e-40 overflowed float32 and engine.step() raised (issue 10 item 10)."""
    engine = engines("vmm")
    greedy = engine.generate(PROMPTS[:2], GREEDY)
    params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=temperature, seed=1, ignore_eos=True)
    assert params.greedy
    tiny = engine.generate(PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in tiny] == [o.outputs[0].token_ids for o in greedy]
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


def sampler_failing_for(monkeypatch, seed: int, after: int) -> None:
    """Make the engine's sampler raise for completions of requests seeded ``seed`` once they hold
    ``after`` tokens (as a row of non-finite logits would make torch.multinomial raise)."""
    from vmkv.engine import engine as engine_module

    real = engine_module.next_token

    def next_token(logits, state, argmax):
        if state.params.seed == seed and len(state.output) >= after:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real(logits, state, argmax)

    monkeypatch.setattr(engine_module, "next_token", next_token)


@pytest.mark.parametrize("after", [0, 3], ids=["first-token", "mid-decode"])
def test_one_request_failing_to_sample_does_not_stop_the_others(mode, engines, monkeypatch, after):
    """Issue 10 items 10/15: the failing request (n=2, forked) ends alone with finish_reason
    "error" and its pages return; the requests batched with it get the tokens they get alone."""
    others = [("Hello world", GREEDY), ("Once upon a time", SamplingParams(max_tokens=10, seed=5, ignore_eos=True))]
    alone = {p: engines(mode).generate([p], s)[0].outputs[0].token_ids for p, s in others}
    sampler_failing_for(monkeypatch, seed=666, after=after)
    engine = engines(mode)
    ids = {engine.add_request(p, s): p for p, s in others}
    bad = engine.add_request("this one fails", SamplingParams(max_tokens=10, n=2, seed=666, ignore_eos=True))
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    failed = final[bad]
    assert failed.error.startswith("RuntimeError: probability tensor")
    assert [c.finish_reason for c in failed.outputs] == ["error", "error"]
    assert all(len(c.token_ids) == after for c in failed.outputs)
    for rid, prompt in ids.items():
        assert final[rid].error is None and final[rid].outputs[0].token_ids == alone[prompt]
    assert engine.stats()["engine"]["requests_failed"] == 1
    assert_all_pages_back(engine)


def forward_failing_once(monkeypatch, engine: Engine, at_step: int) -> None:
    """Make ``engine``'s runner raise (as a transient out-of-memory would) in step ``at_step`` only."""
    real, calls = engine.runner.execute, []

    def execute(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_step:
            raise RuntimeError("CUDA out of memory (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", execute)


@pytest.mark.parametrize("at_step", [1, 3], ids=["prefill", "decode"])
def test_failed_forward_leaves_the_engine_consistent(mode, engines, monkeypatch, at_step):
    """A forward that raises: step() raises, every sequence holds in the cache exactly the tokens
    the engine counts, and the next steps finish every request as if nothing had happened."""
    prompts = [PROMPTS[1], PROMPTS[3]]
    want = [o.outputs[0].token_ids for o in engines(mode).generate(prompts, GREEDY)]
    engine = engines(mode, max_num_batched_tokens=32, max_prefill_chunk=32)
    forward_failing_once(monkeypatch, engine, at_step)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    final, raised = {}, 0
    while engine.has_unfinished():
        try:
            outputs = engine.step()
        except RuntimeError as exc:
            assert "injected" in str(exc)
            raised += 1
            engine.cache.check()
            for seq in engine.scheduler.running:
                assert engine.cache.seq_len(seq.seq_id) == seq.num_computed
            continue
        final.update((o.request_id, o) for o in outputs if o.finished)
    assert raised == 1
    assert [final[rid].outputs[0].token_ids for rid in ids] == want


def test_failed_forward_then_the_same_prompt_matches_a_fresh_engine(mode, engines, monkeypatch):
    """Issue 10 item 7 through the engine: a failed prefill (the loop aborts its request), then
    a request with the same prompt must not be answered from K/V that were never written."""
    prompt = PROMPTS[1]  # 136 tokens: 17 full pages of 8
    want = engines(mode).generate([prompt], GREEDY)[0].outputs[0].token_ids
    engine = engines(mode)
    forward_failing_once(monkeypatch, engine, at_step=1)
    rid = engine.add_request(prompt, GREEDY)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert engine.abort(rid)  # what EngineLoop does with the requests of a failed step
    assert engine.generate([prompt], GREEDY)[0].outputs[0].token_ids == want


def test_engine_refuses_a_cache_of_another_shape():
    loaded = load_model(None)
    cache = vmkv.open_cache(vmkv.KVCacheConfig(num_layers=2, num_kv_heads=4, head_dim=32, dtype="float32",
                                               memory_budget="1MiB", page_size="4KiB"))
    try:
        with pytest.raises(vmkv.InvalidConfig, match="num_layers"):
            Engine(loaded, cache)
    finally:
        cache.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with the CUDA driver")
@pytest.mark.parametrize("mode", ["vmm", "paged"])
def test_engine_on_cuda_matches_cpu(mode, hf_model):
    """The same greedy tokens on the GPU (float32 model and cache, 2 MiB VMM pages) as transformers."""
    engine = Engine.from_config(EngineConfig(kv_mode=mode, device="cuda", dtype="float32", memory_budget="256MiB",
                                             max_num_seqs=4, max_seq_len=256))
    try:
        tok = ByteTokenizer()
        outs = engine.generate(PROMPTS, GREEDY)
        for prompt, out in zip(PROMPTS, outs):
            assert out.outputs[0].token_ids == hf_greedy(hf_model, tok.encode(prompt), GREEDY.max_tokens)
    finally:
        engine.close()


@pytest.mark.parametrize("mode,graphs", [("vmm", False), ("paged", False), ("vmm", True), ("paged", True)])
def test_a_sliding_window_model_serves_like_transformers_with_memory_that_follows_the_window(mode, graphs):
    """Issue 36: the embedded Mistral-shaped model (a 64-token window on every layer) generates
    transformers' tokens past its window, eagerly and through the captured decode steps; each
    sequence holds its window, the slack and two pages, not every token."""
    from vmkv.models import EMBEDDED_WINDOW

    hf = default_hf_model(name="mistral")
    engine = make_engine(mode, model="embedded:mistral", cuda_graphs=graphs, max_prefill_chunk=32)
    try:
        tok = engine.tokenizer
        prompts = ["The KV cache of a sliding window holds the last tokens only. " * 2, "a short one"]
        params = SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        done, held = {}, []
        while len(done) < len(ids):
            done.update({out.request_id: out.outputs[0].token_ids for out in engine.step() if out.finished})
            cache = engine.cache
            held += [len(cache.pages(seq)) - cache.pages(seq).count(-1) for seq in cache.seq_ids]
        for prompt, request in zip(prompts, ids):
            prompt_ids = tok.encode(prompt)
            assert len(prompt_ids) + 90 > EMBEDDED_WINDOW + 16
            assert done[request] == hf_greedy(hf, prompt_ids, 90)
        tpp = engine.cache.tokens_per_page
        assert max(held) <= -(-(EMBEDDED_WINDOW - 1 + engine.cache.window.slack + 32) // tpp) + 2
        assert engine.stats()["cache"]["window_releases"] > 0
        assert not graphs or engine.stats()["engine"]["cuda_graphs"]["replays"] > 0
    finally:
        engine.close()


def test_an_unknown_embedded_model_is_refused():
    with pytest.raises(vmkv.InvalidConfig, match="no embedded model 'gpt'"):
        make_engine("vmm", model="embedded:gpt")


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cpu:1"])
def test_a_device_that_is_not_one_is_refused_with_a_typed_error(device):
    with pytest.raises(vmkv.InvalidConfig, match="device"):
        make_engine("vmm", device=device)


def random_traffic(seed: int, count: int) -> list[tuple[int, list[int], SamplingParams]]:
    """``(arrival step, prompt ids, params)``: shared prefixes, n up to 3, greedy and seeded sampling."""
    import random

    rng = random.Random(seed)
    traffic, step = [], 0
    for i in range(count):
        step += rng.choice([0, 0, 1, 3])
        prompt = ([256] + [7] * rng.choice([0, 16, 24]) + [rng.randrange(256) for _ in range(rng.randint(1, 30))])
        params = SamplingParams(max_tokens=rng.randint(1, 20), n=rng.choice([1, 1, 2, 3]), temperature=rng.choice([0.0, 1.0]),
                                seed=i, stop_token_ids=[rng.randrange(256)])
        traffic.append((step, prompt, params))
    return traffic


def replay(engine: Engine, traffic, check: bool) -> dict[str, list[list[int]]]:
    """Run ``traffic`` to the end; the final token ids of every completion, by request id."""
    pending, results, step = list(enumerate(traffic)), {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(prompt, params, request_id=f"r{i}")
        for out in engine.step():
            if out.finished:
                assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
                results[out.request_id] = [c.token_ids for c in out.outputs]
        if check:
            engine.cache.check()
        step += 1
    return results


def test_random_traffic_under_pressure_matches_a_roomy_run(mode, engines):
    """Preemption, forks, COW and prefix hits all at once: nothing crashes, drops or changes."""
    traffic = random_traffic(seed=3, count=10)
    roomy = replay(engines(mode), traffic, check=False)
    tight = engines(mode, memory_budget=8 * 8 * 4096, max_num_seqs=4, max_num_batched_tokens=24, max_prefill_chunk=16)
    assert replay(tight, traffic, check=True) == roomy
    stats = tight.stats()
    assert stats["engine"]["preemptions"] > 0 and stats["engine"]["forks"] > 0 and stats["cache"]["prefix_hits"] > 0
    assert_all_pages_back(tight)
