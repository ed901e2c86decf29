"""The HTTP API's requests: OpenAI's completions and chat schemas, Megatron's `PUT /api`, their errors.

Requests are checked here, before anything reaches the engine: wrong JSON, a field of the
wrong type or out of range is an `APIError` (HTTP 4xx with OpenAI's error body, naming the
field). Unknown fields are ignored, as OpenAI-compatible servers do, so clients that send
more than tessera uses still work. Sampling fields left out (or null) take OpenAI's
defaults; tessera's extras (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, ...) follow vLLM.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_CHOICES = 128          # prompts x n in one request
MAX_LOGPROBS = 20          # top log-probs per token (vLLM's bound; OpenAI allows 5 / 20)
LOGPROB_FLOOR = -9999.0    # -inf and NaN are not JSON: reported as this (vLLM's convention)


class APIError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code
        self.headers = headers or {}   # Retry-After, WWW-Authenticate

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # strict: "1" is not a number and true is not an integer; unknown fields are ignored
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """The fields every generation request shares; None = the default."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)          # vLLM: -1 or 0 = off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None            # vLLM's: prompt and generated token ids in each choice
    user: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_kwargs(self, choice: int = 0) -> dict[str, Any]:
        """SamplingParams keyword arguments of the fields given (max_tokens and logprobs aside).

        The n choices of a prompt get seeds seed, seed + 1, ...: the same seed, different samples.
        """
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                                                        "presence_penalty", "frequency_penalty", "seed",
                                                        "ignore_eos", "min_tokens")}
        kwargs = {name: value for name, value in given.items() if value is not None}
        if self.seed is not None:
            kwargs["seed"] = self.seed + choice
        if self.top_k is not None:
            kwargs["top_k"] = max(self.top_k, 0)
        if self.stop_token_ids:
            kwargs["stop_token_ids"] = tuple(self.stop_token_ids)
        return kwargs


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)      # OpenAI's default: 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")   # image parts etc. are refused below
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")   # name, tool_calls, ... reach the template
    role: str
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(part.type != "text" for part in self.content):
                raise APIError("messages: only text content parts are supported", param="messages")
            message["content"] = "".join(part.text or "" for part in self.content)
        return message


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)      # OpenAI's older name of max_completion_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None


class MegatronRequest(_Strict):
    """Megatron-LM's `PUT /api` (tools/run_text_generation_server.py), with its bounds and defaults."""

    prompts: list[str] = Field(min_length=1, max_length=MAX_CHOICES)
    tokens_to_generate: int = Field(64, ge=1)
    logprobs: bool = False
    temperature: float = Field(1.0, gt=0, le=100)
    top_k: int = Field(0, ge=0, le=1000)
    top_p: float = Field(0.0, ge=0, le=1)           # 0 = off, as in Megatron
    random_seed: int | None = Field(None, ge=0)
    add_BOS: bool = False
    stop_token: int | None = None
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False


# Megatron options that tessera does not implement: refused rather than silently ignored.
MEGATRON_UNSUPPORTED = ("top_p_decay", "top_p_bound", "prevent_newline_after_colon", "length_penalty", "beam_width",
                        "max_len", "sentences")


def parse_request(model: type[BaseModel], body: bytes, refuse: tuple[str, ...] = ()) -> Any:
    """The request of `body` (JSON) as `model`; an APIError naming the field otherwise.

    Fields named in `refuse` are options tessera lacks: present, they are an error.
    """
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise APIError(f"the request body must be a JSON object, got {type(data).__name__}")
    for name in refuse:
        if name in data:
            raise APIError(f"'{name}' is not supported by this server", param=name)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _field_error(model, exc) from None


def _field_error(model: type[BaseModel], exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    name = str(first["loc"][0]) if first["loc"] else None
    if first["type"] == "missing":
        return APIError(f"'{name}' is required", param=name)
    union_branches = [e for e in exc.errors() if e["loc"] and e["loc"][0] == name]
    field = model.model_fields.get(name)
    if len(union_branches) > 1 and field is not None and len(first["loc"]) == 2:
        expected = str(field.annotation).replace("typing.", "")
        return APIError(f"'{name}': has the wrong type (expected {expected})", param=name)
    where = ".".join(str(part) for part in first["loc"])
    return APIError(f"'{where}': {first['msg']}", param=name)


def clean_logprob(value: float) -> float:
    return value if value == value and value > LOGPROB_FLOOR else LOGPROB_FLOOR
