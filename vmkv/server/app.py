"""OpenAI-compatible HTTP server over an :class:`~vmkv.engine.EngineLoop` (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE with ``"stream": true``),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. Every request is validated in full before
it reaches the engine (a 4xx in OpenAI's error shape, ``param`` naming the field, nothing
changed); a client that leaves has its requests aborted before the next step. The engine is only
touched through the loop's lock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineLoop, InvalidParameter, RequestOutput, SamplingParams
from ..errors import InvalidConfig, InvalidInput, OutOfPages, SequenceTooLong, VMKVError
from . import metrics
from .protocol import MAX_N, ChatBody, CompletionBody

log = logging.getLogger("vmkv.server")

KEEP_ALIVE_S = 75.0
"""Seconds an idle keep-alive connection stays open: longer than clients' pool expiry (httpx 5 s,
aiohttp 15 s), so the server never closes a connection a client just picked up.
"""

# pydantic names a union's member in an error's location ("temperature", "int"): not a field
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*|[a-z-]+\[.*\])$")


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


def _engine_error(exc: VMKVError, prompt_param: str = "prompt", limit_param: str = "max_tokens") -> APIError:
    """The 4xx answer to an engine validation error (``prompt_param``: where the prompt came from;
    ``limit_param``: the field that set the completion's length, named when it does not fit)."""
    if isinstance(exc, SequenceTooLong):
        return APIError(400, str(exc), param=limit_param, code="context_length_exceeded")
    if isinstance(exc, OutOfPages):
        return APIError(400, str(exc), param=limit_param, code="kv_budget_exceeded")
    if isinstance(exc, InvalidParameter):
        return APIError(400, str(exc), param=prompt_param if exc.param == "prompt" else exc.param)
    if isinstance(exc, (InvalidInput, InvalidConfig)):
        return APIError(400, str(exc))
    return APIError(500, str(exc), type_="server_error")


def _param_path(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as OpenAI's ``param`` (``messages.0.content``), union tags dropped."""
    return ".".join(str(part) for part in loc if not (isinstance(part, str) and _UNION_TAG.match(part)))


def _lone_surrogate(data: Any) -> str | None:
    """The path of the first string in ``data`` that UTF-8 cannot encode (a lone surrogate), or ``None``."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((f"{path}.{key}" if path else str(key), key))
                stack.append((f"{path}.{key}" if path else str(key), item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value))
    return None


async def _client_gone(request: Request) -> None:
    """Return when the client disconnects (the server's ``http.disconnect`` message)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class _Job:
    """One HTTP request in flight: its engine requests and the queue their outputs land in."""

    queue: "asyncio.Queue[RequestOutput | BaseException]"
    request_ids: list[str]
    prompt_tokens: int


class Server:
    """The HTTP layer: parses and validates, submits to the engine loop, shapes the answers.

    Args:
        loop: the engine loop (owned by the caller, who closes it).
        model_name: the only model id the server accepts and lists.
        api_key: if set, ``/v1/*`` requires ``Authorization: Bearer <api_key>`` (scheme in any case).
        protect_metrics: ``/metrics`` requires the key too (off: scrapers read it without one).
    """

    def __init__(self, loop: EngineLoop, model_name: str, api_key: str | None = None,
                 protect_metrics: bool = False) -> None:
        self.loop = loop
        self.model_name = model_name
        self.api_key = api_key
        self.protect_metrics = protect_metrics
        self.created = int(time.time())

    # ---- request handling ------------------------------------------------------------------
    async def parse(self, request: Request, schema: type[BaseModel]) -> Any:
        """Authenticate, read and validate a JSON body; raises :class:`APIError`."""
        self.authenticate(request)
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the body is not valid JSON: {exc}") from None
        except RecursionError:
            raise APIError(400, "the body is nested too deeply") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object")
        bad_text = _lone_surrogate(data)
        if bad_text is not None:
            raise APIError(400, f"{bad_text}: the text holds a lone surrogate (an unpaired \\ud800-\\udfff escape), "
                           "which is not valid Unicode", param=bad_text)
        try:
            body = schema.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = _param_path(first["loc"])
            raise APIError(400, f"{param}: {first['msg']}", param=param) from None
        except RecursionError:
            raise APIError(400, "the body is nested too deeply") from None
        if body.model != self.model_name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        return body

    def authenticate(self, request: Request) -> None:
        """Require ``Authorization: Bearer <api_key>`` when a key is set (the scheme is case-insensitive, RFC 7235)."""
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        valid = scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())
        if not valid:
            raise APIError(401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key")

    async def submit(self, prompts: list[str | list[int]], make_params: Callable[[int], SamplingParams],
                     prompt_param: str = "prompt", limit_param: str = "max_tokens") -> _Job:
        """Validate every prompt, then queue them all (all or nothing), on a worker thread so the event loop
        keeps serving.

        Args:
            prompts: text or token ids, one engine request each.
            make_params: sampling parameters given the prompt's token count (may raise :class:`APIError`).
            prompt_param: the body field the prompts came from (named in errors about them).
            limit_param: the body field that set ``max_tokens`` (named when it does not fit).
        """
        aio = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(output: RequestOutput | BaseException) -> None:
            aio.call_soon_threadsafe(queue.put_nowait, output)

        return await asyncio.to_thread(self._submit, prompts, make_params, sink, queue, prompt_param, limit_param)

    def _submit(self, prompts: list[str | list[int]], make_params: Callable[[int], SamplingParams],
                sink: Callable[[Any], None], queue: asyncio.Queue, prompt_param: str, limit_param: str) -> _Job:
        try:
            checked = []
            for prompt in prompts:
                ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
                try:
                    self.loop.engine.max_new_tokens(len(ids))  # reads fixed sizes only: no lock needed
                except (SequenceTooLong, OutOfPages) as exc:  # the prompt alone fills the context or budget
                    raise _engine_error(exc, prompt_param, limit_param=prompt_param) from None
                params = make_params(len(ids))
                checked.append((self.loop.validate(ids, params), params))
        except VMKVError as exc:
            raise _engine_error(exc, prompt_param, limit_param) from None
        request_ids = [self.loop.submit(ids, params, sink) for ids, params in checked]
        return _Job(queue, request_ids, sum(len(ids) for ids, _ in checked))

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of ``prompt``, encoded between engine steps (HF tokenizers are not thread-safe)."""
        return self.loop.call(lambda engine: engine.tokenizer.encode(prompt))

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat through the tokenizer's chat template, between engine steps."""
        return self.loop.call(lambda engine: engine.tokenizer.chat(messages))

    async def collect(self, request: Request, job: _Job) -> list[RequestOutput]:
        """Wait for every request of ``job`` to finish; abort them as soon as the client leaves.

        Raises:
            APIError: 500 when the engine failed one of the requests (the others are aborted).
        """
        final: dict[str, RequestOutput] = {}
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            while len(final) < len(job.request_ids):
                getter = asyncio.ensure_future(job.queue.get())
                await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the client disconnected: abort (finally) and answer no one
                    getter.cancel()
                    break
                output = getter.result()
                if isinstance(output, BaseException):
                    raise APIError(500, f"the engine failed: {output}", type_="server_error")
                if output.error is not None:
                    raise APIError(500, f"generating this request failed: {output.error}", type_="server_error")
                if output.finished:
                    final[output.request_id] = output
        finally:
            gone.cancel()
            self.abort_unfinished(job, final)
        return [final[rid] for rid in job.request_ids if rid in final]

    def abort_unfinished(self, job: _Job, finished: dict[str, Any]) -> None:
        """Abort ``job``'s unfinished requests before the engine's next step, without blocking the event loop."""
        for rid in job.request_ids:
            if rid not in finished:
                self.loop.abort_soon(rid)

    async def stream(self, job: _Job, chunk: Callable[[int, str | None, str | None], dict],
                     usage_chunk: Callable[[dict], dict] | None, n: int, first: Callable[[int], dict] | None = None
                     ) -> AsyncIterator[str]:
        """Server-sent events of ``job``: one chunk per new text or finish, then ``[DONE]``.

        Args:
            chunk: ``(choice index, delta text, finish reason) -> chunk dict``.
            usage_chunk: given the usage dict, the final usage chunk (``include_usage``), or ``None``.
            n: completions per prompt (choice index = prompt index * n + completion index).
            first: per choice, a chunk sent before any text (the chat role), or ``None``.
        """
        finished: dict[str, RequestOutput] = {}
        ended: set[int] = set()  # choices whose finish_reason was sent (later outputs repeat it)
        try:
            if first is not None:
                for index in range(len(job.request_ids) * n):
                    yield _sse(first(index))
            while len(finished) < len(job.request_ids):
                output = await job.queue.get()
                if isinstance(output, BaseException) or output.error is not None:
                    reason = f"the engine failed: {output}" if isinstance(output, BaseException) else \
                        f"generating this request failed: {output.error}"
                    yield _sse({"error": {"message": reason, "type": "server_error", "param": None, "code": None}})
                    return
                base = job.request_ids.index(output.request_id) * n
                for completion in output.outputs:
                    index = base + completion.index
                    if index in ended:
                        continue
                    if completion.delta_text or completion.finish_reason:
                        yield _sse(chunk(index, completion.delta_text, completion.finish_reason))
                    if completion.finish_reason:
                        ended.add(index)
                if output.finished:
                    finished[output.request_id] = output
            if usage_chunk is not None:
                yield _sse(usage_chunk(_usage(job, finished.values())))
            yield "data: [DONE]\n\n"
        finally:  # normal end, or the client went away (the generator is cancelled / closed)
            self.abort_unfinished(job, finished)


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _usage(job: _Job, outputs: Any) -> dict[str, int]:
    completion = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion,
            "total_tokens": job.prompt_tokens + completion}


def _choices(outputs: list[RequestOutput], n: int, make: Callable[[int, Any], dict]) -> list[dict]:
    return [make(i * n + c.index, c) for i, out in enumerate(outputs) for c in out.outputs]


def create_app(loop: EngineLoop, model_name: str, api_key: str | None = None, protect_metrics: bool = False) -> FastAPI:
    """The FastAPI application serving ``loop``'s engine under ``model_name``.

    Args:
        loop: a running engine loop (closed by the caller after the server stops).
        model_name: the model id clients must name.
        api_key: if set, required as a bearer token on ``/v1/*``.
        protect_metrics: with ``api_key``, require it on ``/metrics`` too (off: scrapers have no key,
            and ``/metrics`` shows no prompt or output).
    """
    server = Server(loop, model_name, api_key, protect_metrics)
    max_n = min(MAX_N, loop.engine.cache.config.max_batch_size)  # n completions run in n sequence slots
    app = FastAPI(title="vmkv", version="0.1.0")
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """FastAPI's own answers (unknown route 404, wrong method 405) in the OpenAI shape."""
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, message, type_=kind).response(headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        """A bug: logged with its traceback, answered 500 in the OpenAI shape."""
        log.error("vmkv server: unexpected error", exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}", type_="server_error").response()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        if server.protect_metrics:
            server.authenticate(request)
        stats = await asyncio.to_thread(loop.stats)  # read only, between steps
        return PlainTextResponse(metrics.render(stats), media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        server.authenticate(request)
        card = {"id": model_name, "object": "model", "created": server.created, "owned_by": "vmkv"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionBody = await server.parse(request, CompletionBody)
        try:
            prompts = body.prompts()
        except InvalidInput as exc:
            raise _engine_error(exc) from None
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        job = await server.submit(prompts, lambda _: body.sampling(max_tokens, max_n=max_n), "prompt")
        rid, created = f"cmpl-{job.request_ids[0]}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        if body.stream:
            def chunk(index: int, text: str | None, reason: str | None) -> dict:
                return {**head, "choices": [{"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}]}

            usage = (lambda u: {**head, "choices": [], "usage": u}) if body.include_usage else None
            return StreamingResponse(server.stream(job, chunk, usage, body.n), media_type="text/event-stream")
        outputs = await server.collect(request, job)
        choices = _choices(outputs, body.n, lambda i, c: {"index": i, "text": c.text, "logprobs": None,
                                                           "finish_reason": c.finish_reason})
        return JSONResponse({**head, "choices": choices, "usage": _usage(job, outputs)})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatBody = await server.parse(request, ChatBody)
        try:
            ids = await asyncio.to_thread(server.tokenize_chat, body.chat())
        except (InvalidInput, InvalidConfig) as exc:
            raise _engine_error(exc, "messages") from None
        except Exception as exc:
            if type(exc).__module__.startswith("jinja2"):  # the chat template refused these messages
                raise APIError(400, f"the model's chat template refused the messages: {exc}", param="messages") from None
            raise
        limit_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens

        def params(prompt_len: int) -> SamplingParams:
            """The client's limit, else as many tokens as the context and the KV budget leave
            (``submit`` refused a prompt that alone leaves none)."""
            if limit is not None:
                return body.sampling(limit, limit_param=limit_param, max_n=max_n)
            return body.sampling(loop.engine.max_new_tokens(prompt_len), max_n=max_n)

        job = await server.submit([ids], params, "messages", limit_param)
        rid, created = f"chatcmpl-{job.request_ids[0]}", int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if body.stream else "chat.completion",
                "created": created, "model": model_name}
        if body.stream:
            def chunk(index: int, text: str | None, reason: str | None) -> dict:
                delta = {"content": text} if text else {}
                return {**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}]}

            def first(index: int) -> dict:
                return {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]}

            usage = (lambda u: {**head, "choices": [], "usage": u}) if body.include_usage else None
            return StreamingResponse(server.stream(job, chunk, usage, body.n, first), media_type="text/event-stream")
        outputs = await server.collect(request, job)
        choices = _choices(outputs, body.n, lambda i, c: {
            "index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
            "finish_reason": c.finish_reason})
        return JSONResponse({**head, "choices": choices, "usage": _usage(job, outputs)})

    return app


class BackgroundServer:
    """Uvicorn serving an app on a daemon thread (tests, benchmarks, notebooks).

    Args:
        app: the ASGI app.
        host: address to bind (loopback by default).
        port: 0 picks a free port; read it from ``port`` after construction.

    Raises:
        RuntimeError: the server did not start within 30 s.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                timeout_keep_alive=KEEP_ALIVE_S)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="vmkv-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
            time.sleep(0.02)
        self.host = host
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        """Stop serving and wait for the thread."""
        self._server.should_exit = True
        self._thread.join(timeout=30)
