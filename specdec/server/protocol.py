"""The OpenAI wire format: request models, response and chunk builders, and error bodies.

Fields OpenAI defines but specdec cannot honour (``n > 1``, logprobs, penalties, logit bias, tools)
are refused with a 400 that names them, never silently ignored. vLLM's extra sampling fields
(``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``return_token_ids``) are accepted in the body; the openai client sends them with ``extra_body``.
Unknown fields are ignored, as OpenAI and vLLM do.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.config import SamplingParams, short_repr


class ApiError(Exception):
    """An error with an HTTP status, rendered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


MAX_MESSAGE_CHARS = 1000  # an error message never carries a long input back


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "..."
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None means the served model
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # add "token_ids" to each choice (and chunk), as vLLM does

    def check_supported(self) -> None:
        if self.n is not None and self.n != 1:
            raise ApiError(400, f"n={self.n} is not supported: specdec returns one choice per prompt; "
                           "send the request several times (with different seeds) instead", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported; leave it unset or 0", name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported; leave it unset", "logit_bias")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Raises ValueError (mapped to 400) for out-of-range values, with the library's message."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            max_tokens=max_tokens,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = str | list[int]


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != 1:
            raise ApiError(400, f"best_of={self.best_of} is not supported; leave it unset or 1", "best_of")
        if self.echo:
            raise ApiError(400, "echo is not supported; prepend the prompt yourself", "echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if self.logprobs is not None:
            raise ApiError(400, "logprobs is not supported", "logprobs")

    def prompts(self) -> list[Prompt]:
        """One prompt per choice: a string, or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ApiError(400, "prompt is empty; pass a string, a list of strings or a list of token ids", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text; content parts other than text are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"content part of type {short_repr(part.get('type'))} is not supported; "
                               "send text parts", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the end of the context
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise ApiError(400, "logprobs is not supported", "logprobs")
        if self.tools:
            raise ApiError(400, "tools are not supported", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ApiError(400, "response_format other than text is not supported", "response_format")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses --------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str | None) -> str | None:
    """The engine says "stop", "length" or "abort"; OpenAI knows only the first two."""
    return None if reason is None else ("length" if reason == "length" else "stop")


Kind = Literal["completion", "chat"]
OBJECT = {"completion": ("text_completion", "text_completion"), "chat": ("chat.completion", "chat.completion.chunk")}


def choice(kind: Kind, index: int, text: str, reason: str | None, token_ids: list[int] | None) -> dict:
    c: dict[str, Any] = {"index": index}
    if kind == "completion":
        c["text"] = text
    else:
        c["message"] = {"role": "assistant", "content": text}
    c["logprobs"] = None
    c["finish_reason"] = finish_reason(reason)
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c


def chunk_choice(kind: Kind, index: int, text: str | None, reason: str | None, token_ids: list[int] | None,
                 role: bool = False) -> dict:
    c: dict[str, Any] = {"index": index}
    if kind == "completion":
        c["text"] = text or ""
    else:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        c["delta"] = delta
    c["logprobs"] = None
    c["finish_reason"] = finish_reason(reason)
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c


def response(kind: Kind, rid: str, created: int, model: str, choices: list[dict], use: dict | None,
             chunk: bool = False) -> dict:
    body = {"id": rid, "object": OBJECT[kind][int(chunk)], "created": created, "model": model, "choices": choices}
    if use is not None or not chunk:
        body["usage"] = use
    return body
