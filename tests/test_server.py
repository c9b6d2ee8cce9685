"""OpenAI-compatible server over both KV modes, driven by the official ``openai`` client and httpx
against servers on 127.0.0.1 with ephemeral ports (CPU, bounded traffic)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from vmkv.engine import Engine, EngineConfig, EngineLoop
from vmkv.models import ByteTokenizer, default_hf_model
from vmkv.server import metrics
from vmkv.server.app import BackgroundServer, create_app

from conftest import MODES

MODEL = "vmkv-default"
PAGE = 8 * 4096  # one pool page of the default model with 4 KiB pages: 8 tokens x 4 layers x K/V


class Running:
    """An engine loop served over HTTP on an ephemeral port."""

    def __init__(self, mode: str, budget: int = 256 * PAGE, api_key: str | None = None) -> None:
        engine = Engine.from_config(EngineConfig(kv_mode=mode, memory_budget=budget, page_size="4KiB", block_size=8,
                                                 max_num_seqs=8, max_seq_len=256))
        self.loop = EngineLoop(engine)
        self.http = BackgroundServer(create_app(self.loop, MODEL, api_key=api_key))
        self.url = self.http.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        return metrics.parse(httpx.get(self.url + "/metrics").text)

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics()
            if values["vmkv_sequences_running"] == 0 and values["vmkv_sequences_waiting"] == 0:
                return values
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.05)

    def close(self) -> None:
        self.http.stop()
        self.loop.close()


@pytest.fixture(scope="module", params=MODES)
def server(request):
    running = Running(request.param)
    yield running
    running.close()


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of transformers ``generate`` (no engine) for given prompt ids."""
    model = default_hf_model()

    def greedy(ids: list[int], max_tokens: int) -> str:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=258)
        return ByteTokenizer().decode(out[0, len(ids):].tolist())

    return greedy


GREEDY = dict(temperature=0, max_tokens=10, extra_body={"ignore_eos": True})


def test_completions_and_chat_match_the_model(server, reference):
    """Greedy text equals transformers' in each mode (hence in both), streamed or not."""
    tok = ByteTokenizer()
    prompt = "The capital of France is"
    text = server.client.completions.create(model=MODEL, prompt=prompt, **GREEDY).choices[0].text
    assert text == reference(tok.encode(prompt), 10)
    stream = server.client.completions.create(model=MODEL, prompt=prompt, stream=True, **GREEDY)
    assert "".join(chunk.choices[0].text for chunk in stream) == text

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    reply = server.client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    want = reference(tok.apply_chat_template(messages), 10)
    assert reply.choices[0].message.content == want and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 10
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 10


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list()] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    assert "# TYPE vmkv_kv_utilization gauge" in text and 'kv_mode="' in text


def test_concurrent_clients_then_every_page_back(server):
    """32 requests from 8 concurrent clients (completions and chat, streamed and not) all succeed."""
    before = server.metrics()

    def one(i: int) -> str:
        if i % 2:
            kwargs = dict(model=MODEL, prompt=f"client {i} says", max_tokens=6, temperature=0.7, seed=i)
            if i % 4 == 1:
                return "".join(c.choices[0].text for c in server.client.completions.create(stream=True, **kwargs))
            return server.client.completions.create(**kwargs).choices[0].text
        messages = [{"role": "user", "content": f"question {i}"}]
        return server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(32)))
    assert len(results) == 32 and all(isinstance(r, str) for r in results)
    after = server.wait_idle()
    assert after["vmkv_requests_finished_total"] - before["vmkv_requests_finished_total"] == 32
    assert after["vmkv_kv_pages_in_use"] == after["vmkv_kv_pages_spare"]  # no sequence holds a page
    freed = server.loop.call(lambda engine: (engine.cache.check(), engine.cache.trim())[1])
    final = server.metrics()
    assert final["vmkv_kv_pages_free"] == final["vmkv_kv_pages_total"] and freed >= 0


@pytest.mark.parametrize("mode", MODES)
def test_preemption_under_pressure_keeps_every_text(mode, reference):
    """A budget of 8 pages for 6 requests of 4 pages each: preemptions, identical texts."""
    tight = Running(mode, budget=8 * PAGE)
    try:
        prompts = [f"pressure {i}: go on" for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(lambda p: tight.client.completions.create(
                model=MODEL, prompt=p, temperature=0, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text,
                prompts))
        values = tight.wait_idle()
        assert values["vmkv_preemptions_total"] > 0
        assert values["vmkv_requests_finished_total"] == 6
        tok = ByteTokenizer()
        assert texts == [reference(tok.encode(p), 16) for p in prompts]
    finally:
        tight.close()


def test_parallel_sampling_shares_prompt_pages(server):
    before = server.metrics()
    prompt = "a prompt long enough to fill several pages. " * 2  # 89 tokens: 11 full pages
    reply = server.client.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=5, temperature=1.0, seed=3,
                                             extra_body={"ignore_eos": True})
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    assert reply.usage.completion_tokens == 20
    after = server.wait_idle()
    assert after["vmkv_kv_forks_total"] - before["vmkv_kv_forks_total"] == 3
    assert after["vmkv_kv_pages_shared_peak"] >= 11
    stream = server.client.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=5, temperature=1.0, seed=3,
                                              stream=True, extra_body={"ignore_eos": True})
    texts, finishes = [""] * 4, []
    for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].text
        if chunk.choices[0].finish_reason:
            finishes.append(chunk.choices[0].index)
    assert sorted(finishes) == [0, 1, 2, 3]  # one finish per choice
    assert texts == [c.text for c in sorted(reply.choices, key=lambda c: c.index)]  # same seed, same text


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": "gpt-unknown", "prompt": "x"}, 404, "model_not_found"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 300, "max_tokens": 1}, 400, "context_length_exceeded"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10_000}, 400, "context_length_exceeded"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 3}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 2}, 400, None),
    ("/v1/completions", {"model": MODEL}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
]


def test_bad_requests_get_4xx_and_change_nothing(server):
    before = server.metrics()
    for path, body, status, code in BAD:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
        if code is not None:
            assert error["code"] == code
    after = server.metrics()
    assert after["vmkv_requests_added_total"] == before["vmkv_requests_added_total"]
    assert after["vmkv_kv_pages_in_use"] == before["vmkv_kv_pages_in_use"]
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="nope", prompt="x")
    assert server.client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).choices[0].text is not None


def test_api_key_is_required_when_set():
    guarded = Running("vmm", api_key="s3cret")
    try:
        assert guarded.client.completions.create(model=MODEL, prompt="ok", max_tokens=1).choices
        wrong = openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=MODEL, prompt="no", max_tokens=1)
        assert httpx.get(guarded.url + "/v1/models").status_code == 401
    finally:
        guarded.close()


def test_client_disconnect_mid_stream_frees_its_sequence(server):
    before = server.metrics()
    body = {"model": MODEL, "prompt": "talk for a long time", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    after = server.wait_idle()
    assert after["vmkv_requests_aborted_total"] == before["vmkv_requests_aborted_total"] + 1
    assert after["vmkv_generation_tokens_total"] - before["vmkv_generation_tokens_total"] < 200
    assert after["vmkv_kv_pages_in_use"] == after["vmkv_kv_pages_spare"]


def test_cli_options_and_configuration_errors(capsys):
    import argparse

    from vmkv.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.host, args.kv_mode, args.model) == ("127.0.0.1", "vmm", None)  # loopback unless told otherwise
    bad = parser.parse_args(["--memory-budget", "1KiB", "--log-level", "error"])
    assert cli.run(bad) == 2
    assert "memory_budget" in capsys.readouterr().err
