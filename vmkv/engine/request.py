"""Requests, their sequences, and what the engine reports back.

A :class:`Request` holds ``n`` :class:`Sequence` objects, one per completion, each a cache
sequence ``"{request_id}/{index}"`` while it runs::

    tokens        [ prompt ........................ | generated ....... ]
    num_computed  [ K/V in the cache ........ ]^ next tokens to feed

A preempted sequence is freed (``num_computed = 0``) and fed again later: nothing it generated is lost.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from .sampling import SamplerState, SamplingParams


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer (see ``runner.py`` for the two implementations)."""

    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def chat(self, messages: list[dict[str, str]]) -> list[int]: ...


class Status(enum.Enum):
    WAITING = "waiting"  # not in the cache: new, or preempted
    RUNNING = "running"  # in the cache, fed every step it is scheduled
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: sequences and requests point at each other
class Sequence:
    """One completion of a request (see the module docstring for ``tokens``/``num_computed``)."""

    request: "Request"
    index: int
    tokens: list[int]
    sampler: SamplerState
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    admitted: int = -1  # admission order: the highest is the newest, preempted first
    text: str = ""  # output text so far (cut before a stop string)
    sent_text: int = 0  # characters of ``text`` already reported
    sent_tokens: int = 0  # generated tokens already reported

    @property
    def seq_id(self) -> str:
        """The id of this sequence in the KV cache."""
        return f"{self.request.request_id}/{self.index}"

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.request.prompt_ids) :]

    @property
    def pending(self) -> int:
        """Known tokens the cache does not hold yet."""
        return len(self.tokens) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(eq=False)
class Request:
    """A prompt and its sampling parameters, with ``params.n`` sequences."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int = 0  # completion i draws from a generator seeded with seed + i
    arrival: float = field(default_factory=time.monotonic)
    sequences: list[Sequence] = field(default_factory=list)
    forked: bool = False  # the n - 1 other completions have been forked from sequence 0
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    error: str | None = None  # why the request failed (its completions finish with "error")

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences) and (self.forked or self.params.n == 1)


@dataclass
class CompletionOutput:
    """One completion of a request as reported after a step.

    Attributes:
        index: the completion's index (0 .. n-1).
        text: the whole output text so far (held back: an incomplete character, a possible stop string).
        token_ids: every generated token so far.
        delta_text, delta_token_ids: what is new since the last report.
        finish_reason: ``None`` while running, else ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``.
    """

    index: int
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestMetrics:
    """Times of a request (``time.monotonic`` seconds)."""

    arrival: float
    first_token_time: float | None
    finish_time: float | None
    preemptions: int

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival


@dataclass
class RequestOutput:
    """What a step reports for one request: every completion, with what is new.

    Attributes:
        error: ``None``, or why the engine stopped this request alone (``"RuntimeError: ..."``);
            then ``finished`` is True and its completions end with ``finish_reason="error"``.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
