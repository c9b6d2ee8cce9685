"""OpenAI-compatible server over both KV modes, driven by the official ``openai`` client and httpx
against servers on 127.0.0.1 with ephemeral ports (CPU, bounded traffic)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from helpers import MODES

from vmkv.engine import Engine, EngineConfig, EngineLoop
from vmkv.models import ByteTokenizer, default_hf_model
from vmkv.server import metrics
from vmkv.server.app import BackgroundServer, create_app

ROOT = Path(__file__).resolve().parents[1]
MODEL = "vmkv-default"
PAGE = 8 * 4096  # one pool page of the default model with 4 KiB pages: 8 tokens x 4 layers x K/V


class Running:
    """An engine loop served over HTTP on an ephemeral port."""

    def __init__(self, mode: str, budget: int = 256 * PAGE, api_key: str | None = None,
                 protect_metrics: bool = False) -> None:
        engine = Engine.from_config(EngineConfig(kv_mode=mode, memory_budget=budget, page_size="4KiB", block_size=8,
                                                 max_num_seqs=8, max_seq_len=256))
        self.loop = EngineLoop(engine)
        self.http = BackgroundServer(create_app(self.loop, MODEL, api_key=api_key, protect_metrics=protect_metrics))
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


def hold_steps_until_queued(loop: EngineLoop, count: int, timeout: float = 20.0) -> None:
    """Make ``loop``'s engine take its first step only once ``count`` requests wait, so that they
    compete for pages together however the client's requests happen to be spread in time.
    The wait is on the loop's own condition: it releases the loop's lock, so submissions go on."""
    engine, deadline = loop.engine, time.monotonic() + timeout
    step = engine.step

    def first_step():
        while len(engine.scheduler.waiting) < count and time.monotonic() < deadline:
            loop._wake.wait(0.01)
        engine.step = step
        return step()

    engine.step = first_step


@pytest.mark.parametrize("mode", MODES)
def test_preemption_under_pressure_keeps_every_text(mode, reference):
    """A budget of 8 pages for 6 requests of 4 pages each: preemptions, identical texts. (All six
    wait before the first step: on a quiet machine the first one could finish before the others
    arrived, and nothing would be preempted.)"""
    tight = Running(mode, budget=8 * PAGE)
    hold_steps_until_queued(tight.loop, 6)
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


BAD = [  # (path, body, status, error code, error param); raw bytes are sent as they are
    ("/v1/completions", b"{not json", 400, None, None),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", b"[" * 100_000, 400, None, None),  # nested too deeply for the parser
    ("/v1/completions", {"model": "gpt-unknown", "prompt": "x"}, 404, "model_not_found", "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 300, "max_tokens": 1}, 400, "context_length_exceeded",
     "prompt"),  # the prompt alone is too long: no max_tokens would fit (issue 30 item 15)
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, None, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10_000}, 400, "context_length_exceeded",
     "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, None, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, None, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 10**30}, 400, None, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 9}, 400, None, "n"),  # above the 8 sequence slots
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 3}, 400, None, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, None, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 2}, 400, None, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 10**30]}, 400, None, "prompt"),
    ("/v1/completions", {"model": MODEL}, 400, None, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, None, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, None,
     "messages.0.role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300}]}, 400,
     "context_length_exceeded", "messages"),  # no max_tokens sent: the prompt alone is too long
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 10_000}, 400, "context_length_exceeded", "max_completion_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300}],
                              "max_completion_tokens": 5}, 400, "context_length_exceeded", "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, None, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     400, None, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": [1]}, 400, None,
     "stop"),
    # issue 10 item 17: lone surrogates (valid JSON escapes, not Unicode) and numbers no float holds
    ("/v1/completions", b'{"model": "vmkv-default", "prompt": "a\\ud800b"}', 400, None, "prompt"),
    ("/v1/completions", b'{"model": "vmkv-default", "prompt": ["ok", "\\udfff"]}', 400, None, "prompt.1"),
    ("/v1/chat/completions", b'{"model": "vmkv-default", "messages": [{"role": "user", "content": "\\ud83d"}]}', 400,
     None, "messages.0.content"),
    ("/v1/completions", b'{"model": "vmkv-default", "prompt": "x", "stop": ["\\udc00"]}', 400, None, "stop.0"),
    ("/v1/completions", b'{"model": "vmkv-default", "prompt": "x", "temperature": 1' + b"0" * 400 + b"}", 400, None,
     "temperature"),
    ("/v1/completions", b'{"model": "vmkv-default", "prompt": "x", "presence_penalty": -1' + b"0" * 400 + b"}", 400,
     None, "presence_penalty"),
    ("/v1/completions", b'{"model": "vmkv-default", "prompt": "x", "frequency_penalty": 1' + b"0" * 309 + b"}", 400,
     None, "frequency_penalty"),
    ("/v1/completions", b'{"model": "vmkv-default", "prompt": "x", "top_p": 1e999}', 400, None, "top_p"),
    ("/v1/completions", b'{"model": "vmkv-default", "prompt": "x", "temperature": NaN}', 400, None, "temperature"),
    ("/v1/completions", b'{"model": "vmkv-default", "prompt": "x", "top_p": -Infinity}', 400, None, "top_p"),
]


def test_bad_requests_get_4xx_and_change_nothing(server):
    """Every client error is a 4xx in OpenAI's shape, naming the field in ``param``."""
    before = server.metrics()
    for path, body, status, code, param in BAD:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
        assert response.status_code == status, (body[:200], response.text[:300])
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error", error
        assert error["code"] == code and error["param"] == param, (body[:200], error)
        assert len(error["message"]) < 300  # a 400-digit number is not echoed back
    after = server.metrics()
    assert after["vmkv_requests_added_total"] == before["vmkv_requests_added_total"]
    assert after["vmkv_kv_pages_in_use"] == before["vmkv_kv_pages_in_use"]
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="nope", prompt="x")
    assert server.client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).choices[0].text is not None


def test_the_bound_of_n_is_the_servers_whatever_side_it_misses(server):
    """n=0 and n=1000 name the same bound: [1, min(128, sequence slots)] (8 slots here)."""
    for n in (0, 9, 1000):
        response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "n": n})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == f"n must be in [1, 8], got {n}"


def test_framework_errors_have_the_openai_shape(server):
    """FastAPI's own 404 (unknown route) and 405 (wrong method) answers, in OpenAI's shape."""
    for method, path, status in (("POST", "/v1/nowhere", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/models", 405), ("GET", "/", 404)):
        response = httpx.request(method, server.url + path)
        assert response.status_code == status
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert path in error["message"]
    assert "allow" in httpx.get(server.url + "/v1/completions").headers  # 405 still says which methods


def test_api_key_is_required_when_set():
    """``/v1/*`` needs ``Bearer KEY`` (the scheme in any case, RFC 7235); ``/metrics`` is open
    unless ``protect_metrics`` (issue 10 item 18); ``/health`` is always open."""
    guarded = Running("vmm", api_key="s3cret")
    protected = BackgroundServer(create_app(guarded.loop, MODEL, api_key="s3cret", protect_metrics=True))
    try:
        assert guarded.client.completions.create(model=MODEL, prompt="ok", max_tokens=1).choices
        wrong = openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=MODEL, prompt="no", max_tokens=1)
        assert httpx.get(guarded.url + "/v1/models").status_code == 401
        for header, status in (("bearer s3cret", 200), ("BEARER  s3cret", 200),
                               ("Basic s3cret", 401), ("Bearer s3cre", 401), ("s3cret", 401), ("Bearer", 401)):
            response = httpx.get(guarded.url + "/v1/models", headers={"authorization": header})
            assert response.status_code == status, header
            if status == 401:
                assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(guarded.url + "/metrics").status_code == 200  # open by default
        assert httpx.get(protected.url + "/metrics").status_code == 401
        assert httpx.get(protected.url + "/metrics", headers={"authorization": "bearer s3cret"}).status_code == 200
        assert httpx.get(protected.url + "/health").status_code == 200
    finally:
        protected.stop()
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


def test_a_disconnect_during_a_long_step_does_not_hold_up_other_requests(server):
    """The abort of a gone client waits for no engine step: other handlers answer meanwhile."""
    before = server.metrics()
    body = json.dumps({"model": MODEL, "prompt": "a long step", "max_tokens": 200, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((server.http.host, server.http.port), timeout=10) as client:
        client.sendall(head + body)
        deadline = time.monotonic() + 20
        while server.metrics()["vmkv_sequences_running"] < 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
        server.loop._lock.acquire()  # from now on the engine is inside a step that takes long
    try:
        time.sleep(0.5)  # the server sees the disconnect and aborts the request
        assert httpx.get(server.url + "/health", timeout=3).json() == {"status": "ok"}
    finally:
        server.loop._lock.release()
    after = server.wait_idle()
    assert after["vmkv_requests_aborted_total"] == before["vmkv_requests_aborted_total"] + 1
    assert after["vmkv_generation_tokens_total"] - before["vmkv_generation_tokens_total"] < 200
    assert after["vmkv_kv_pages_in_use"] == after["vmkv_kv_pages_spare"]


def test_chat_without_max_tokens_generates_what_a_small_kv_budget_holds():
    """No max_tokens: the default is capped by the KV budget (not only the context), and a
    prompt that alone does not fit is refused naming messages, the field the client sent."""
    small = Running("vmm", budget=8 * PAGE)  # 8 pages of 8 tokens: 64 tokens, a 256-token context
    try:
        messages = [{"role": "user", "content": "hi"}]
        prompt_len = len(ByteTokenizer().apply_chat_template(messages))
        reply = small.client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                     extra_body={"ignore_eos": True})
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 64 - prompt_len + 1  # the last token needs no KV
        response = httpx.post(small.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "x" * 80}]})
        error = response.json()["error"]
        assert response.status_code == 400 and (error["param"], error["code"]) == ("messages", "kv_budget_exceeded")
        assert "shorten the prompt" in error["message"]
    finally:
        small.close()


def test_cli_options_and_configuration_errors(capsys):
    import argparse

    from vmkv.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.host, args.kv_mode, args.model, args.port) == ("127.0.0.1", "vmm", None, 8000)  # loopback by default
    bad = parser.parse_args(["--memory-budget", "1KiB", "--log-level", "error"])
    assert cli.run(bad) == 2
    assert "memory_budget" in capsys.readouterr().err
    no_key = parser.parse_args(["--protect-metrics", "--log-level", "error"])
    no_key.api_key = None
    assert cli.run(no_key) == 2 and "--api-key" in capsys.readouterr().err
    for option in (["--port", "99999"], ["--port", "-1"], ["--port", "http"], ["--max-num-seqs", "0"],
                   ["--device", "gpu"], ["--device", "cuda:x"]):
        with pytest.raises(SystemExit) as exit_info:  # argparse refuses it: nothing was loaded or bound
            parser.parse_args(option)
        assert exit_info.value.code == 2 and option[0] in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one line naming what a device is, not torch's traceback
        parser.parse_args(["--device", "gpu"])
    assert "'gpu' is not a device; use 'cpu' or 'cuda[:N]'" in capsys.readouterr().err
    help_text = " ".join(parser.format_help().split())  # argparse wraps lines
    for default in ("(default: 256MiB)", "(default: 8000)", "(default: 127.0.0.1", "(default: vmm)", "(default: 32)",
                    "(default: 512)", "(default: 16)", "(default: auto)", "(default: cpu)", "(default: 0)"):
        assert default in help_text, default


def test_client_disconnect_while_waiting_aborts_at_once(server):
    """Issue 10 item 16: a non-streamed request is aborted as soon as its client disconnects
    (the engine produces output every step, so waiting for a quiet moment never came)."""
    before = server.metrics()
    body = json.dumps({"model": MODEL, "prompt": "wait for me", "max_tokens": 200, "n": 2, "ignore_eos": True,
                       "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((server.http.host, server.http.port), timeout=10) as client:
        client.sendall(head + body)
        deadline = time.monotonic() + 20
        while server.metrics()["vmkv_sequences_running"] < 2:  # prefilled and forked: generating
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    left = time.monotonic()
    after = server.wait_idle(timeout=20)
    assert after["vmkv_requests_aborted_total"] == before["vmkv_requests_aborted_total"] + 1
    assert after["vmkv_generation_tokens_total"] - before["vmkv_generation_tokens_total"] < 2 * 200
    assert after["vmkv_kv_pages_in_use"] == after["vmkv_kv_pages_spare"]  # every page returned
    assert time.monotonic() - left < 10


def test_tiny_temperature_is_greedy_over_http(server):
    """``temperature=1e-40`` passed validation and then crashed the batch with a 500 (issue 10 item 15)."""
    greedy = server.client.completions.create(model=MODEL, prompt="tiny temperature", **GREEDY).choices[0].text
    tiny = server.client.completions.create(model=MODEL, prompt="tiny temperature", temperature=1e-40, max_tokens=10,
                                            extra_body={"ignore_eos": True}).choices[0].text
    assert tiny == greedy


def test_a_request_failing_in_the_engine_fails_alone(server, reference, monkeypatch):
    """One request's sampling raises (forced): it gets a 500 in OpenAI's shape (non-streamed) or
    an error event (streamed); the requests served beside it get their greedy text."""
    from vmkv.engine import engine as engine_module

    real = engine_module.next_token

    def next_token(logits, state, argmax):
        if state.params.seed == 666 and len(state.output) >= 2:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real(logits, state, argmax)

    monkeypatch.setattr(engine_module, "next_token", next_token)
    before = server.metrics()
    tok = ByteTokenizer()
    prompts = [f"neighbour {i} keeps going" for i in range(3)]
    bad = {"model": MODEL, "prompt": "I fail", "max_tokens": 30, "seed": 666, "ignore_eos": True}

    def good(prompt: str) -> str:
        return server.client.completions.create(model=MODEL, prompt=prompt, **GREEDY).choices[0].text

    def failing() -> httpx.Response:
        return httpx.post(server.url + "/v1/completions", json=bad, timeout=60)

    def failing_stream() -> list[str]:
        with httpx.stream("POST", server.url + "/v1/completions", json={**bad, "stream": True}, timeout=60) as r:
            return [line for line in r.iter_lines() if line.startswith("data: ")]

    with ThreadPoolExecutor(5) as pool:
        goods = [pool.submit(good, p) for p in prompts]
        failed, streamed = pool.submit(failing), pool.submit(failing_stream)
        texts = [f.result() for f in goods]
    assert texts == [reference(tok.encode(p), 10) for p in prompts]
    response = failed.result()
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "probability tensor" in error["message"]
    events = streamed.result()
    assert json.loads(events[-1][6:])["error"]["type"] == "server_error" and "[DONE]" not in events[-1]
    after = server.wait_idle()
    assert after["vmkv_kv_pages_in_use"] == after["vmkv_kv_pages_spare"]
    assert after["vmkv_requests_failed_total"] - before["vmkv_requests_failed_total"] == 2


def test_metrics_print_rounded_values(server):
    """Gauges as a person reads them (``0.238462``, not ``0.23846153846153847``); counters whole."""
    server.client.completions.create(model=MODEL, prompt="make the gauges move", max_tokens=3, temperature=0)
    samples = [line.rsplit(" ", 1)[1] for line in httpx.get(server.url + "/metrics").text.splitlines()
               if line and not line.startswith("#")]
    assert samples and all(re.fullmatch(r"-?\d+(\.\d{1,6})?(e[+-]\d+)?|NaN|[+-]Inf", v) for v in samples), samples
    assert all(len(v.replace("-", "").replace(".", "").split("e")[0]) <= 7 for v in samples)
    assert metrics.format_value(0.23846153846153847) == "0.238462" and metrics.format_value(1024.0) == "1024"


class OverlapGuard:
    """Wraps every public method of a cache; records when two threads are inside it at once."""

    def __init__(self, cache, monkeypatch) -> None:
        self.lock = threading.Lock()
        self.inside: dict[int, str] = {}
        self.overlaps: list[tuple[str, str]] = []
        self.calls = 0
        for name in dir(type(cache)):
            attr = getattr(type(cache), name, None)
            if not name.startswith("_") and callable(attr) and not isinstance(attr, type):
                monkeypatch.setattr(cache, name, self.wrap(name, getattr(cache, name)))

    def wrap(self, name, method):
        def guarded(*args, **kwargs):
            me = threading.get_ident()
            with self.lock:
                self.calls += 1
                self.overlaps += [(name, other) for tid, other in self.inside.items() if tid != me]
                self.inside[me] = name
            try:
                return method(*args, **kwargs)
            finally:
                with self.lock:
                    self.inside.pop(me, None)

        return guarded


def test_the_cache_is_never_used_by_two_threads_at_once(server, monkeypatch):
    """The thread contract (issue 10 item 8): requests, streams, aborts, tokenization and
    /metrics from many threads; the engine only ever calls its cache from one thread at a time."""
    guard = OverlapGuard(server.loop.engine.cache, monkeypatch)

    def client(i: int) -> None:
        if i % 3 == 0:
            httpx.get(server.url + "/metrics")
        elif i % 3 == 1:
            server.client.completions.create(model=MODEL, prompt=f"thread {i}", max_tokens=4, temperature=0.5, seed=i)
        else:
            body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 30, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
                next(response.iter_lines())  # then hang up: the request is aborted

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(client, range(24)))
    server.wait_idle()
    assert guard.calls > 100
    assert [pair for pair in guard.overlaps if "stats" not in pair] == []  # stats() may overlap by contract


def test_serve_on_port_0_prints_the_url_it_listens_on_at_any_log_level():
    """``vmkv serve --port 0``: the OS picks the port, and a line names that one, not :0, even with
    ``--log-level warning`` (which hides the info log)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "vmkv.server.cli", "--port", "0", "--memory-budget", "8MiB", "--max-num-seqs", "2",
               "--log-level", "warning"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = threading.Timer(120, process.kill)  # no line by then: the server is killed, stderr ends, the test fails
    deadline.start()
    try:
        url, port = None, 0
        for line in process.stderr:  # the line goes to stderr, with the log; wait for it
            found = re.search(r"serving \S+ on (http://127\.0\.0\.1:(\d+)) ", line)
            if found:
                url, port = found.group(1), int(found.group(2))
                break
        assert url is not None and port != 0
        assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
    finally:
        deadline.cancel()
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda signum: signum.name)
def test_a_stopped_server_leaves_its_ledger_and_says_so_in_one_line(signum):
    """Issue 37 items 1-2: ``vmkv serve --shared-budget`` stopped by SIGTERM or Ctrl-C closes its
    cache (uvicorn raises the signal again once it has stopped: it used to kill the process
    before the cache closed, leaving a dead member holding its bytes), and says so in one line,
    never a traceback. The server was the ledger's only member, so its file goes too."""
    import subprocess
    import sys

    from vmkv.ledger import Ledger, ledger_path

    name = f"test-serve-{os.getpid()}-{signum.name}"
    command = [sys.executable, "-m", "vmkv.server.cli", "--port", "0", "--memory-budget", "8MiB", "--max-num-seqs",
               "2", "--log-level", "warning", "--shared-budget", f"{name}:64MiB,member=serve"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = threading.Timer(120, process.kill)  # no line by then: the server is killed, stderr ends, the test fails
    deadline.start()
    try:
        url = next((found.group(1) for line in process.stderr
                    if (found := re.search(r"serving \S+ on (http://\S+) ", line))), None)
        assert url is not None
        reply = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200
        with Ledger(name, None) as ledger:
            [member] = ledger.members()
        assert member.name == "serve" and member.alive and member.held > 0  # its pages stay cached: held
        process.send_signal(signum)
        assert process.wait(timeout=60) == 0
        lines = process.stderr.read().splitlines()
        assert lines == [f"vmkv serve: stopped by {signum.name}"]  # one line, no traceback
        assert not os.path.exists(ledger_path(name))  # the last member left: nothing held, no dead member
    finally:
        deadline.cancel()
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        if os.path.exists(ledger_path(name)):
            os.unlink(ledger_path(name))


@pytest.mark.parametrize("mode, option, value, message", [
    ("paged", "--page-size", "3KiB", "page_size 3072 must be a multiple"),
    ("vmm", "--memory-budget", "-5MiB", "memory_budget must be >= 0"),
    ("vmm", "--page-size", "6KiB", "try page_size="),
    ("vmm", "--cuda-graphs", "on", "--cuda-graphs on needs a CUDA device"),  # issue 37 item 3: no silent stand-in
])
def test_serve_refuses_a_bad_cache_option_before_it_loads_the_weights(monkeypatch, capsys, mode, option, value, message):
    from vmkv.engine import engine as engine_module
    from vmkv.server import cli as serve_cli

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the cache options were checked")

    monkeypatch.setattr(engine_module, "load_model", no_weights)
    assert serve_cli.main(["--kv-mode", mode, f"{option}={value}"]) == 2
    assert message in capsys.readouterr().err


def test_an_idle_connection_outlives_the_client_pool_s_expiry(server):
    """The server keeps an idle keep-alive connection open longer than the openai client's pool
    (httpx) keeps it: a server that closed first would race the request of a client that just
    took that connection from its pool ("Server disconnected without sending a response")."""
    expiry = httpx.Limits().keepalive_expiry  # the openai client's pool: httpx's default, 5 s
    host, port = server.url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()

    def answer(sock: socket.socket) -> bytes:
        data = b""
        while b'{"status":"ok"}' not in data:
            chunk = sock.recv(4096)
            if not chunk:
                return data  # the server closed the connection
            data += chunk
        return data

    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        assert answer(sock).startswith(b"HTTP/1.1 200")
        time.sleep(expiry + 0.5)  # idle past the pool's expiry: the client would have dropped it by now
        sock.sendall(request)
        assert answer(sock).startswith(b"HTTP/1.1 200"), "the server closed an idle connection a pool may still use"
