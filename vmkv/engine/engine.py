"""The serving engine: continuous batching over a vmkv cache, one packed forward per step.

The cycle (vAttention's alloc/step/free)::

    add_request(prompt, params)      queue it (validated first; nothing changes on error)
    step():
        schedule                     decodes + prefill chunks + admissions (cache.add with ids)
        cache.begin_step(batch)      on OutOfPages preempt the newest sequence and retry
        model forward                per layer: cache.write(k, v) + cache.attention(q)
        sample, fork (n > 1), detect stops
        cache.free(finished)         full pages stay in the prefix cache
    abort(request_id)                cache.free of its sequences, at once

A request whose sampling raises ends alone (``finish_reason="error"``); a failed forward truncates
the step's sequences back to what the cache held before it, then raises. Not thread-safe: one
thread drives it (:class:`~vmkv.engine.loop.EngineLoop` for the server).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from .. import open_cache
from ..config import KVCacheConfig
from ..core.base import KVCacheBase
from ..core.step import StepPlan
from ..errors import DuplicateSequence, InvalidConfig, OutOfPages, SequenceTooLong
from ..sizing import check_cache_options
from ..validate import as_device, is_int
from .graphs import SLOTS_TAKEN, DecodeGraphs, unsupported
from .request import CompletionOutput, Request, RequestMetrics, RequestOutput, Sequence
from .runner import LoadedModel, ModelRunner, cache_config_for, load_model, read_model_spec
from .sampling import InvalidParameter, SamplerState, SamplingParams, new_generator, next_token
from .scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("vmkv.engine")

THROUGHPUT_WINDOW_S = 10.0


@dataclass(frozen=True)
class EngineConfig:
    """Everything :meth:`Engine.from_config` needs.

    Args:
        model: a local Hugging Face directory, or ``None`` for the embedded default model.
        kv_mode: ``"vmm"`` (virtually contiguous) or ``"paged"`` (block tables).
        memory_budget: bytes for KV pages (int or "256MiB").
        page_size: VMM page bytes per K/V tensor; ``None``: :func:`vmkv.sizing.default_pages`.
        block_size: paged mode: tokens per block.
        max_num_seqs: cache slots: sequences running at once (each completion of n is one).
        max_seq_len: longest prompt + completion; ``None``: min(model's positions, 4096).
        max_num_batched_tokens: tokens one step feeds at most.
        max_prefill_chunk: prompt tokens of one sequence one step feeds at most.
        prefix_caching: reuse cached pages of earlier prompts.
        dtype: model and cache dtype (``auto``: float32 on CPU).
        device: ``cpu`` or ``cuda[:N]``.
        seed: seeds the generators of requests that bring no seed.
        shared_budget: VMM: join a host-wide KV budget (:mod:`vmkv.ledger`), e.g.
            ``"kv-host:16GiB"``; ``memory_budget`` is then this engine's ceiling.
        cuda_graphs: capture decode steps as CUDA graphs; ``None``: on CUDA, off elsewhere (on a
            CPU ``True`` replays the step eagerly, the reference). Takes one more slot and page.
        map_ahead: VMM: map the next step's pages on a background thread while the step runs.
    """

    model: str | None = None
    kv_mode: str = "vmm"
    memory_budget: int | str = "256MiB"
    page_size: int | str | None = None
    block_size: int = 16
    max_num_seqs: int = 32
    max_seq_len: int | None = None
    max_num_batched_tokens: int = 512
    max_prefill_chunk: int = 512
    prefix_caching: bool = True
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    shared_budget: str | None = None
    cuda_graphs: bool | None = None
    map_ahead: bool = False

    @property
    def graphs(self) -> bool:
        """Whether decode steps are captured (``cuda_graphs``, ``None`` resolved by the device)."""
        return as_device(self.device).type == "cuda" if self.cuda_graphs is None else self.cuda_graphs

    def cache_config(self) -> KVCacheConfig:
        """The KV cache configuration this engine opens, from the model's ``config.json`` (no weight read).

        Raises:
            InvalidConfig: no ``config.json``, an unsupported model, or a bad cache option.
        """
        spec = read_model_spec(self.model, dtype=self.dtype, device=self.device)
        return spec.cache_config(
            max_batch_size=self.max_num_seqs + SLOTS_TAKEN * self.graphs,
            max_seq_len=self.max_seq_len or min(spec.max_seq_len(), 4096),
            memory_budget=self.memory_budget, page_size=self.page_size, block_size=self.block_size,
            prefix_caching=self.prefix_caching, shared_budget=self.shared_budget, map_ahead=self.map_ahead,
            max_step_tokens=self.max_prefill_chunk,
        )


def _check_cache_fits(loaded: LoadedModel, cache: KVCacheBase) -> None:
    """Raise ``InvalidConfig`` unless ``cache`` fits the model's KV shape, windows, dtype, device and positions."""
    if cache.config.max_seq_len > loaded.max_position_embeddings:
        raise InvalidConfig(
            f"max_seq_len {cache.config.max_seq_len} exceeds the model's {loaded.max_position_embeddings} positions"
        )
    want = cache_config_for(loaded.model)
    for name in ("num_layers", "num_kv_heads", "head_dim", "dtype", "device", "layer_windows"):
        if getattr(want, name) != getattr(cache.config, name):
            raise InvalidConfig(
                f"the cache's {name} is {getattr(cache.config, name)} but the model needs {getattr(want, name)}; "
                "build the cache config with runner.cache_config_for(model, ...)"
            )


def _decode_graphs(loaded: LoadedModel, cache: KVCacheBase, wanted: bool | None) -> DecodeGraphs | None:
    """The engine's captured decode steps: ``wanted`` ``True`` (raise where they cannot run), ``False``,
    or ``None`` (where they can run on CUDA).
    """
    if wanted is False:
        return None
    if wanted is None:
        if torch.device(cache.config.device).type != "cuda":
            return None
        why = unsupported(cache)
        if why is not None:
            log.warning("vmkv engine: decode steps run without CUDA graphs: %s", why)
            return None
    return DecodeGraphs(loaded.model, cache)


class Engine:
    """Continuous-batching generation over one model and one KV cache.

    Args:
        loaded: the model and tokenizer (``runner.load_model``).
        cache: an open cache shaped for the model (``runner.cache_config_for``), either mode.
        scheduler: step limits.
        seed: seeds requests that bring no seed of their own.
        cuda_graphs: capture decode steps, taking one of the cache's slots; ``None``: on a CUDA
            device where they can run, off elsewhere.

    Raises:
        InvalidConfig: the cache does not fit the model.
        Unsupported: ``cuda_graphs=True`` where decode steps cannot be captured (the reason).

    Example::

        engine = Engine.from_config(EngineConfig(kv_mode="vmm", memory_budget="64MiB"))
        rid = engine.add_request("Hello", SamplingParams(max_tokens=8, temperature=0))
        while engine.has_unfinished():
            for out in engine.step():
                print(out.outputs[0].delta_text, end="")
    """

    def __init__(
        self, loaded: LoadedModel, cache: KVCacheBase, scheduler: SchedulerConfig | None = None, seed: int = 0,
        cuda_graphs: bool | None = None,
    ) -> None:
        _check_cache_fits(loaded, cache)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.model.shape.vocab_size
        self.cache = cache
        self.graphs = _decode_graphs(loaded, cache, cuda_graphs)
        self.max_slots = cache.config.max_batch_size - (SLOTS_TAKEN if self.graphs is not None else 0)  # for requests
        self.runner = ModelRunner(loaded.model, self.graphs)
        self.scheduler = Scheduler(cache, scheduler or SchedulerConfig())
        self.max_seq_len = cache.config.max_seq_len
        self._rng = random.Random(seed)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated) of recent steps
        self.counters: dict[str, int] = dict.fromkeys(
            ("requests_added", "requests_finished", "requests_aborted", "requests_failed", "steps", "tokens_fed",
             "prompt_tokens", "generation_tokens", "forks", "shared_pages_peak"), 0
        )
        self.ttft_sum = 0.0

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        """Check the cache options against the model's config.json (before any weight is read), load the
        model, open the cache, build the engine.

        Raises:
            InvalidConfig: a bad option, an unsupported model, or a mode that cannot open.
        """
        cache_config = config.cache_config()
        scheduler = SchedulerConfig(config.max_num_batched_tokens, config.max_prefill_chunk)
        check_cache_options(cache_config, config.kv_mode)  # before the weights, allocating nothing: fails fast
        loaded = load_model(config.model, dtype=config.dtype, device=config.device)
        cache = open_cache(cache_config, mode=config.kv_mode)  # after the weights: a GPU store takes what they leave
        try:
            return cls(loaded, cache, scheduler, config.seed, cuda_graphs=config.cuda_graphs)
        except BaseException:  # Ctrl-C included: the cache leaves a shared budget's ledger
            cache.close()
            raise

    # ---- requests --------------------------------------------------------------------------
    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; it starts at the next :meth:`step` that has room.

        Args:
            prompt: text (tokenized here) or token ids.
            params: sampling parameters (default: ``SamplingParams()``).
            request_id: unique id; generated when ``None``.

        Returns:
            The request id.

        Raises:
            InvalidParameter: empty prompt, token ids outside the vocabulary (``param`` is
                ``"prompt"``), ``n`` above the slots (``"n"``).
            SequenceTooLong: prompt + ``max_tokens`` exceeds ``max_seq_len``.
            OutOfPages: one completion alone would need more pages than the whole budget.
            DuplicateSequence: ``request_id`` is in use.
        """
        params = params or SamplingParams()
        if request_id is not None and request_id in self._requests:
            raise DuplicateSequence(f"request id {request_id!r} is in use")
        ids = self.check_request(prompt, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        request = Request(request_id, ids, params, seed=seed)
        parent = Sequence(request, 0, list(ids), SamplerState(params, new_generator(seed)))
        request.sequences.append(parent)
        self._requests[request_id] = request
        self.scheduler.add(parent)
        self.counters["requests_added"] += 1
        return request_id

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize and validate a request without queueing it; returns the prompt's token ids.

        Raises:
            InvalidParameter, SequenceTooLong, OutOfPages: as :meth:`add_request`.
        """
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        if not all(is_int(t, 0) and t < self.vocab_size for t in ids):
            raise InvalidParameter("prompt", f"prompt token ids must be ints in [0, {self.vocab_size})")
        if len(ids) + params.max_tokens > self.max_seq_len:
            asked = f"max_tokens is {params.max_tokens}" if params.max_tokens <= self.max_seq_len else \
                f"max_tokens is above {self.max_seq_len}"
            raise SequenceTooLong(
                f"this model's maximum context length is {self.max_seq_len} tokens; the prompt has {len(ids)} "
                f"and {asked}, so at most {max(0, self.max_seq_len - len(ids))} tokens can be generated"
            )
        if params.n > self.max_slots:
            raise InvalidParameter("n", f"n={params.n} exceeds the {self.max_slots} sequence slots")
        pages = self.cache.pages_for(len(ids) + params.max_tokens - 1)
        if pages > self.cache.pool.num_pages:
            raise OutOfPages(
                f"one completion of {len(ids) + params.max_tokens} tokens needs {pages} KV pages; the memory "
                f"budget holds {self.cache.pool.num_pages}"
            )
        return ids

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most tokens one completion of a ``prompt_len``-token prompt may generate (context and KV
        budget); reads only fixed sizes, so any thread may call it.

        Raises:
            SequenceTooLong: the prompt alone fills the context.
            OutOfPages: the prompt alone fills the KV budget.
        """
        budget_tokens = self.cache.pool.num_pages * self.cache.tokens_per_page
        if prompt_len >= self.max_seq_len:
            raise SequenceTooLong(f"the prompt has {prompt_len} tokens and this model's maximum context length is "
                                  f"{self.max_seq_len}: no token can be generated; shorten the prompt")
        if prompt_len > budget_tokens:
            raise OutOfPages(f"the prompt has {prompt_len} tokens and the KV memory budget holds {budget_tokens} "
                             f"({self.cache.pool.num_pages} pages): no token can be generated; shorten the prompt")
        return min(self.max_seq_len - prompt_len, budget_tokens - prompt_len + 1)  # the last token is not stored

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its sequences' pages; returns whether it was still unfinished."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.sequences:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        self.counters["requests_aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._requests)

    # ---- a step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batched forward over the scheduled sequences and sample their next tokens.

        Returns:
            One output per request that produced tokens or finished in this step (a request whose
            sampling failed finishes with ``error`` set).

        Raises:
            Exception: whatever the forward raised; the step's sequences are truncated back first, so
                the engine stays consistent (``abort`` the requests, or ``step`` again to retry).
        """
        batch = self.scheduler.schedule()
        plan, batch = self._begin(batch)
        if plan is None:
            return []
        chunks = [seq.tokens[seq.num_computed : seq.num_computed + n] for seq, n in batch]
        wants = [seq.num_computed + n == len(seq.tokens) for seq, n in batch]
        try:
            logits = self.runner.execute(self.cache, plan, chunks, wants)  # [sum(wants), vocab]
        except Exception:
            for seq, _ in batch:  # the step's K/V were not (all) written: forget its tokens
                self.cache.truncate(seq.seq_id, seq.num_computed)
            raise
        for seq, n in batch:
            seq.num_computed += n
            self.counters["prompt_tokens"] += max(0, min(n, len(seq.request.prompt_ids) - (seq.num_computed - n)))
        self.counters["steps"] += 1
        self.counters["tokens_fed"] += plan.num_tokens
        sampled = [seq for (seq, _), want in zip(batch, wants) if want]
        touched = self._sample(sampled, logits)
        self.counters["shared_pages_peak"] = max(self.counters["shared_pages_peak"], self.cache.pool.num_shared)
        return [self._report(request) for request in touched]

    def _begin(self, batch: list[tuple[Sequence, int]]) -> tuple[StepPlan | None, list[tuple[Sequence, int]]]:
        """``cache.begin_step`` for the batch, preempting the newest sequences until it fits."""
        while batch:
            try:
                plan = self.cache.begin_step(
                    {seq.seq_id: seq.tokens[seq.num_computed : seq.num_computed + n] for seq, n in batch}
                )
                return plan, batch
            except OutOfPages:
                victim = self.scheduler.preempt_newest()
                if victim is None:  # cannot happen: check_request makes every sequence fit alone
                    raise
                batch = [(seq, n) for seq, n in batch if seq is not victim]
        return None, batch

    def _sample(self, sampled: list[Sequence], logits: torch.Tensor) -> list[Request]:
        """Sample next tokens (forking n > 1 requests first), apply stops, free finished sequences; a
        request that raises fails alone.
        """
        logits = logits.float().cpu()  # [len(sampled), vocab]
        argmax = logits.argmax(-1).tolist()
        now = time.monotonic()
        touched: dict[str, Request] = {}
        generated = 0
        for row, seq in enumerate(sampled):
            request = seq.request
            touched[request.request_id] = request
            if request.error is not None:
                continue
            try:
                group = [seq] + (self._fork(seq) if seq.index == 0 and not request.forked else [])
                for member in group:
                    self._advance(member, next_token(logits[row], member.sampler, argmax[row]), now)
                    generated += 1
            except Exception as exc:  # noqa: BLE001 - isolated: this request fails, the batch goes on
                self._fail(request, exc)
        self.counters["generation_tokens"] += generated
        self._recent.append((now, generated))
        return list(touched.values())

    def _advance(self, seq: Sequence, token: int, now: float) -> None:
        """Append ``token`` to ``seq`` and finish it if a stop condition holds."""
        request = seq.request
        if request.first_token_time is None:
            request.first_token_time = now
            self.ttft_sum += now - request.arrival
        seq.tokens.append(token)
        seq.sampler.output.append(token)
        reason = self._check_stop(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _fail(self, request: Request, exc: Exception) -> None:
        """End every sequence of ``request`` with ``finish_reason="error"`` (their pages are freed)."""
        log.error("vmkv engine: request %s failed and was stopped (the batch goes on): %s: %s",
                  request.request_id, type(exc).__name__, exc, exc_info=exc)
        request.error = f"{type(exc).__name__}: {exc}"
        request.forked = True  # no completion is forked after this
        for seq in request.sequences:
            if not seq.finished:
                self.scheduler.finish(seq, "error")
        self.counters["requests_failed"] += 1

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Fork the other ``n - 1`` completions of ``parent``'s request: they share its prompt pages."""
        request = parent.request
        children = []
        for index in range(1, request.params.n):
            child = Sequence(request, index, list(parent.tokens),
                             SamplerState(request.params, new_generator(request.seed + index)))
            self.cache.fork(parent.seq_id, child.seq_id)
            child.num_computed = parent.num_computed
            self.scheduler.adopt(child)
            request.sequences.append(child)
            children.append(child)
        request.forked = True
        self.counters["forks"] += len(children)
        return children

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        """Update ``seq.text``; return why ``seq`` ends (stop token or string, ``max_tokens``) or ``None``."""
        params = seq.request.params
        stop_token = token in params.stop_token_ids or (not params.ignore_eos and token in self.tokenizer.eos_token_ids)
        output = seq.output_ids
        text = self.tokenizer.decode(output[:-1] if stop_token else output)
        cut = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
        seq.text = text
        if stop_token or cut >= 0:
            return "stop"
        return "length" if len(output) >= params.max_tokens else None

    def _report(self, request: Request) -> RequestOutput:
        """The request's output of this step (deltas since the last report); retires it when done."""
        outputs = []
        hold = max((len(s) for s in request.params.stop), default=1) - 1
        for seq in request.sequences:
            end = len(seq.text)
            if not seq.finished:
                end -= hold + len(seq.text) - len(seq.text.rstrip("\ufffd"))  # maybe a stop string / partial char
            end = max(end, seq.sent_text)
            ids = seq.output_ids
            outputs.append(CompletionOutput(
                seq.index, seq.text[:end], list(ids), seq.text[seq.sent_text : end], ids[seq.sent_tokens :],
                seq.finish_reason,
            ))
            seq.sent_text, seq.sent_tokens = end, len(ids)
        finished = request.finished
        if finished:
            request.finish_time = time.monotonic()
            self._requests.pop(request.request_id, None)
            self.counters["requests_finished"] += 1
        metrics = RequestMetrics(request.arrival, request.first_token_time, request.finish_time, request.preemptions)
        return RequestOutput(request.request_id, request.prompt_ids, outputs, finished, metrics, request.error)

    # ---- convenience and introspection ---------------------------------------------------
    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to completion and return their final outputs, in order (other requests' outputs
        are not returned).
        """
        ids = [self.add_request(prompt, params) for prompt in prompts]
        final: dict[str, RequestOutput] = {}
        while any(rid not in final for rid in ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last ``THROUGHPUT_WINDOW_S`` seconds."""
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S

    def stats(self) -> dict[str, Any]:
        """Engine counters and gauges (``engine``) and the cache's ``stats()`` (``cache``)."""
        running = {s.request.request_id for s in self.scheduler.running}
        waiting = {s.request.request_id for s in self.scheduler.waiting} - running
        cache = self.cache.stats()
        queries = cache["prefix_queries"]
        engine = dict(self.counters)
        engine.update(
            model=self.model_name,
            kv_mode=self.cache.mode,
            requests_running=len(running),
            requests_waiting=len(waiting),
            sequences_running=len(self.scheduler.running),
            sequences_waiting=len(self.scheduler.waiting),
            sequences_preempted=self.scheduler.num_preempted_waiting,
            preemptions=self.scheduler.preemptions,
            prefix_hit_rate=cache["prefix_hits"] / queries if queries else 0.0,
            tokens_per_second=self.tokens_per_second(),
            ttft_seconds_sum=self.ttft_sum,
            cuda_graphs=self.graphs.stats.as_dict() if self.graphs is not None else None,
        )
        return {"engine": engine, "cache": cache}

    def close(self) -> None:
        """Abort everything and release the cache."""
        for request_id in list(self._requests):
            self.abort(request_id)
        self.cache.close()
