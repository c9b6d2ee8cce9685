"""Per-request sampling parameters and the sampler that turns logits into next tokens.

Greedy rows take the argmax; others apply penalties, temperature, top-k, top-p, then draw with the
sequence's own seeded generator, so a seeded request's tokens do not depend on its batch. Each
row is sampled alone, so a row that cannot be sampled fails only its request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameter
from ..validate import is_int

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (as in vLLM): dividing by a tinier one overflows float32."""


@dataclass(frozen=True)
class SamplingParams:
    """How to generate the completions of one request (OpenAI's meaning for each field).

    Args:
        max_tokens: tokens to generate at most per completion (>= 1).
        temperature: logits are divided by it (0..2); below ``GREEDY_TEMPERATURE`` (0 included)
            the argmax is taken instead.
        top_p: nucleus sampling mass, in (0, 1].
        top_k: keep the k most likely tokens; -1 or 0 keeps all.
        n: completions to generate; the prompt is computed once and forked (``cache.fork``).
        stop: strings that end a completion (not included in the text).
        stop_token_ids: token ids that end a completion (besides EOS unless ``ignore_eos``).
        ignore_eos: keep generating past the end-of-sequence token.
        seed: seed of the request's random generators (completion ``i`` uses ``seed + i``).
        presence_penalty: subtracted once from each token already generated (-2..2).
        frequency_penalty: subtracted per occurrence of each generated token (-2..2).

    Raises:
        InvalidParameter: a value out of range (``param`` and the message name the field).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _int_in("max_tokens", self.max_tokens, 1, None)
        _int_in("n", self.n, 1, None)
        _int_in("top_k", self.top_k, -1, None)
        _num_in("temperature", self.temperature, 0.0, 2.0)
        _num_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _num_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _num_in("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0:
            raise InvalidParameter("top_p", "top_p must be in (0, 1], got 0")
        if not all(isinstance(s, str) and s for s in stop):
            raise InvalidParameter("stop", "stop must be a non-empty string or a list of non-empty strings")
        for token in self.stop_token_ids:
            _int_in("stop_token_ids", token, 0, None)
        if self.seed is not None:
            _int_in("seed", self.seed, None, None)
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))  # in range: an int converts exactly enough

    @property
    def greedy(self) -> bool:
        """Whether the argmax is taken (``temperature < GREEDY_TEMPERATURE``)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _int_in(name: str, value: object, low: int | None, high: int | None) -> None:
    if not is_int(value):
        raise InvalidParameter(name, f"{name} must be an integer, got {_short(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low}, {high if high is not None else 'inf'}]"
        raise InvalidParameter(name, f"{name} must be in {bounds}, got {_short(value)}")


def _num_in(name: str, value: object, low: float, high: float) -> None:
    """``value`` is an int or float within ``[low, high]`` (NaN, infinities and huge ints are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise InvalidParameter(name, f"{name} must be a number in [{low}, {high}], got {_short(value)}")


def _short(value: object) -> str:
    """``repr(value)``, cut to 40 characters (a 400-digit integer in an error message helps no one)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class SamplerState:
    """What the sampler keeps per completion: its generator and what it generated so far."""

    params: SamplingParams
    generator: torch.Generator
    output: list[int] = field(default_factory=list)


def new_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (reduced to 63 bits)."""
    return torch.Generator().manual_seed(seed % (1 << 63))


def next_token(logits: torch.Tensor, state: SamplerState, argmax: int) -> int:
    """Next token of one completion (sampled alone, so a failing row fails only its request).

    Args:
        logits: float32 CPU ``[vocab]``.
        state: the completion's parameters, generator and output so far.
        argmax: ``logits.argmax()`` (computed for the whole batch by the caller).

    Raises:
        RuntimeError: the probabilities to draw from are not finite (``torch.multinomial``).
    """
    p = state.params
    if p.greedy and not p.penalised:
        return argmax
    row_logits = logits.clone()
    if p.penalised and state.output:
        counts = torch.bincount(torch.tensor(state.output), minlength=row_logits.shape[0])[: row_logits.shape[0]]
        row_logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    if p.greedy:
        return int(row_logits.argmax())
    return _draw(row_logits / p.temperature, p.top_k, p.top_p, state.generator)


def _draw(logits: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator) -> int:
    """Draw from ``softmax(logits)`` restricted to the top-k tokens and the top-p mass. ``logits: [V]``."""
    if 0 < top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of strictly more likely tokens
        sorted_probs[before >= top_p] = 0.0  # keeps the smallest set reaching top_p (at least one)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
