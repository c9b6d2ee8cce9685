"""OpenAI request bodies (pydantic) and their translation into engine sampling parameters. Fields the
engine does not implement are refused with a 400 naming them, never ignored; vLLM's extensions
``top_k``, ``stop_token_ids``, ``ignore_eos`` are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, StrictBool, StrictInt

from ..engine import InvalidParameter, SamplingParams

MAX_N = 128
"""The most completions one request may ask for (OpenAI's limit); the server's bound is this or
the engine's sequence slots, whichever is smaller."""


def _shown(value: int) -> str:
    """An int for an error message, cut to 40 characters (a 400-digit number helps no one)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(value: Any) -> int | float:
    """A JSON number as is (no bool, no string); ``SamplingParams`` checks the range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("Input should be a number")
    return value


Number = Annotated[float, PlainValidator(_number)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    n: StrictInt = 1
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    seed: StrictInt | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None

    def _refuse(self, **unsupported: bool) -> None:
        for name, present in unsupported.items():
            if present:
                raise InvalidParameter(name, f"'{name}' is not supported by this server")

    def sampling(self, max_tokens: int, *, limit_param: str = "max_tokens", max_n: int = MAX_N) -> SamplingParams:
        """The engine's parameters.

        Args:
            max_tokens: the completion's length limit.
            limit_param: the body field that set ``max_tokens`` (named when it is out of range).
            max_n: the largest ``n`` the server takes (``MAX_N``, or fewer sequence slots).

        Raises:
            InvalidParameter: a value out of range or an unsupported option (``param`` names it).
        """
        self._refuse(logit_bias=bool(self.logit_bias))
        if not 1 <= self.n <= max_n:
            raise InvalidParameter("n", f"n must be in [1, {max_n}], got {_shown(self.n)}")
        if max_tokens < 1:
            raise InvalidParameter(limit_param, f"{limit_param} must be at least 1, got {_shown(max_tokens)}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise InvalidParameter("stop", "stop takes at most 4 strings")
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            n=self.n, stop=tuple(stops), stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            seed=self.seed, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
        )

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionBody(_Body):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: str | None = None
    best_of: StrictInt | None = None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request (a string, or token ids).

        Raises:
            InvalidParameter: an empty list, or an unsupported option.
        """
        self._refuse(echo=self.echo, logprobs=self.logprobs is not None, suffix=bool(self.suffix),
                     best_of=self.best_of is not None and self.best_of != self.n)
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidParameter("prompt", "prompt must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatBody(_Body):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def chat(self) -> list[dict[str, str]]:
        """The messages as ``{"role", "content"}`` dicts (raises ``InvalidParameter`` on unsupported options)."""
        self._refuse(logprobs=self.logprobs or self.top_logprobs is not None, tools=bool(self.tools),
                     response_format=(self.response_format or {}).get("type", "text") != "text")
        return [{"role": m.role, "content": m.text()} for m in self.messages]
