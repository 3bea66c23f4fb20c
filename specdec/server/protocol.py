"""The OpenAI wire format: request models, response and chunk builders, and error bodies.

Every sampling field OpenAI defines maps onto ``SamplingParams``: ``n`` (choices per prompt),
``presence_penalty``, ``frequency_penalty``, ``logit_bias`` (token id strings -> bias, clipped to
OpenAI's -100..100 as vLLM does), ``logprobs`` (completions: an int; chat: a bool plus
``top_logprobs``), ``response_format`` (``json_object``, ``json_schema``), and completions' ``echo``
and ``best_of`` (run best_of, answer the n likeliest). vLLM's extra fields come
in the body too (the openai client sends them with ``extra_body``): ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``bad_words``, ``allowed_token_ids``, ``prompt_logprobs``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``return_token_ids``,
``return_tokens_as_token_ids``, ``return_spec_metrics`` (specdec's: ``usage["spec_decoding"]``, the
request's speculative counters, ``spec_usage``), ``structured_outputs`` ({json | json_object | regex | choice |
grammar}) and its older names ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``. What cannot work is refused with a 400 that names the field and says why
(``suffix``, ``tools``, a streamed ``best_of``), never silently ignored. Unknown fields are ignored,
as OpenAI and vLLM do.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.config import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams, short_repr
from specdec.metrics import RequestSpecStats
from specdec.outputs import PositionLogprobs


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


# vLLM's structured_outputs keys we honour; disable_fallback is accepted because there is no fallback
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
_STRUCTURED_FLAGS = ("disable_any_whitespace", "disable_fallback")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


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
    response_format: dict[str, Any] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # add "token_ids" to each choice (and chunk), as vLLM does
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>", as vLLM does
    return_spec_metrics: bool = False  # specdec's: usage gains "spec_decoding", the request's speculative counters
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        """Cross-field rules and fields that cannot work; the values themselves are checked by
        ``SamplingParams`` (``sampling_params``)."""
        if self.n is not None and self.n < 1:
            raise ApiError(400, f"n must be an integer >= 1, got {self.n}", "n")
        if self.return_spec_metrics and self.stream and not self.include_usage:
            raise ApiError(400, "return_spec_metrics adds to usage, which a stream sends only when asked: send "
                           'stream_options {"include_usage": true} too', "return_spec_metrics")

    @property
    def num_choices(self) -> int:
        """Choices per prompt the answer carries (``n``)."""
        return 1 if self.n is None else self.n

    @property
    def num_generated(self) -> int:
        """Sequences per prompt the engine runs (completions' ``best_of`` may ask for more than ``n``)."""
        return self.num_choices

    @property
    def output_logprobs(self) -> int | None:
        """Top tokens per output position the response reports (None: no logprobs)."""
        return None

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
            n=self.num_generated,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._logit_bias(),
            min_tokens=self.min_tokens,
            bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids,
            structured_outputs=self.structured(),
            logprobs=self.output_logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.strip().isdigit():
                raise ApiError(400, f"logit_bias keys must be token ids (strings of digits), got {short_repr(key)}",
                               "logit_bias")
            bias[int(key)] = value
        return bias

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint from whichever field the client used (at most one of them)."""
        found: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None:
            spec = _response_format(rf)
            if spec is not None:
                found.append(("response_format", spec))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", _structured_outputs(self.structured_outputs)))
        for name, key in _GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                found.append((name, {key: _schema(value, name) if key == "json" else value}))
        if not found:
            return None
        if len(found) > 1:
            raise ApiError(400, f"{' and '.join(n for n, _ in found)} both constrain the output; send one of them",
                           found[1][0])
        name, spec = found[0]
        try:
            return StructuredOutputsParams(**spec)
        except ValueError as e:
            raise ApiError(400, f"{name}: {e}", name) from None

    @property
    def constraint_field(self) -> str | None:
        """The field the output constraint came from (errors name it)."""
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            return "response_format"
        return next((name for name in ("structured_outputs", *_GUIDED) if getattr(self, name) is not None), None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _response_format(rf: dict[str, Any]) -> dict | None:
    """OpenAI's response_format as structured_outputs fields (None: plain text)."""
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ApiError(400, "response_format of type json_schema needs a json_schema object "
                           '({"name": ..., "schema": {...}, "strict": true})', "response_format")
        if js.get("schema") is None:  # OpenAI's schema is optional: then any JSON object
            return {"json_object": True}
        return {"json": _schema(js["schema"], "response_format")}
    raise ApiError(400, f"response_format type {short_repr(kind)} is not supported; use text, json_object or "
                   "json_schema", "response_format")


def _structured_outputs(so: dict[str, Any]) -> dict:
    unknown = sorted(set(so) - set(_STRUCTURED_KEYS) - set(_STRUCTURED_FLAGS))
    if unknown:
        raise ApiError(400, f"structured_outputs does not support {short_repr(unknown)}; it takes one of "
                       f"{', '.join(_STRUCTURED_KEYS)} (plus disable_any_whitespace)", "structured_outputs")
    spec = {k: v for k, v in so.items() if k != "disable_fallback" and v is not None}
    if "json" in spec:
        spec["json"] = _schema(spec["json"], "structured_outputs")
    return spec


def _schema(value: Any, field: str) -> dict:
    """A JSON schema sent as an object or as its text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ApiError(400, f"{field}: the JSON schema is not valid JSON", field) from None
    if not isinstance(value, dict):
        raise ApiError(400, f"{field}: a JSON schema must be an object, got {type(value).__name__}", field)
    return value


Prompt = str | list[int]


class CompletionRequest(_SamplingFields):
    # str | list[str] | list[int] | list[list[int]]: the items are checked by prompts(), after the
    # server's bound on their count (validating 10,000 token lists against each form here holds the
    # GIL for tens of ms, for a request refused anyway)
    prompt: str | list
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of < self.num_choices:
            raise ApiError(400, f"best_of ({self.best_of}) must be at least n ({self.num_choices})", "best_of")
        if self.num_generated > self.num_choices and self.stream:
            raise ApiError(400, "best_of cannot be streamed: which n of the best_of choices are best is known only "
                           "when all have finished; send stream: false, or best_of equal to n", "best_of")
        if self.suffix:
            raise ApiError(400, "suffix is not supported: insertion needs a model trained for fill-in-the-middle "
                           "and its template; put the text before the insertion point in the prompt", "suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got {self.logprobs}", "logprobs")

    @property
    def num_generated(self) -> int:
        return max(self.num_choices, self.best_of or 1)

    @property
    def output_logprobs(self) -> int | None:
        return self.logprobs

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        params = super().sampling_params(max_tokens)
        if self.num_generated > self.num_choices and params.logprobs is None:
            params.logprobs = 0  # best_of ranks choices by their tokens' summed logprobs
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = self.logprobs  # echoed prompt tokens get logprobs too (vLLM)
        return params

    def prompts(self, max_prompts: int) -> list[Prompt]:
        """The request's prompts (strings, or lists of token ids), at most ``max_prompts`` of them; the
        count is checked before the items, so a huge list is refused without walking it."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ApiError(400, "prompt is empty; pass a string, a list of strings or a list of token ids", "prompt")
        if _is_token_ids(p):
            return [p]
        if len(p) > max_prompts:
            raise ApiError(400, f"the request has {len(p)} prompts; this server takes at most {max_prompts} per "
                           "request", "prompt", "too_many_prompts")
        if not (all(type(x) is str for x in p) or all(type(x) is list and _is_token_ids(x) for x in p)):
            raise ApiError(400, "prompt has the wrong type: pass a string, a list of strings, a list of token ids "
                           "(integers) or a list of such lists", "prompt", "invalid_type")
        return p


def _is_token_ids(items: list) -> bool:
    return all(type(t) is int for t in items)  # JSON true/false are bools, not token ids


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

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be an integer in 0..{MAX_LOGPROBS}, got {self.top_logprobs}",
                           "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        if self.tools and self.tool_choice != "none":
            raise ApiError(400, "tools are not supported: calling them needs a tool-call parser for the model's "
                           "format, which this server does not have; describe the tools in the messages and use "
                           'response_format json_schema for the call, or send tool_choice "none"', "tools")

    @property
    def output_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses --------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, spec: RequestSpecStats | None = None) -> dict:
    """OpenAI's usage; with ``spec`` (``return_spec_metrics``), plus ``spec_decoding``: ``spec_usage(spec)``."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if spec is not None:
        out["spec_decoding"] = spec_usage(spec)
    return out


def spec_usage(spec: RequestSpecStats) -> dict:
    """A request's speculative counters, summed over its choices (every sequence it generated, as
    ``completion_tokens`` counts them), with the fields and names of ``LLM``'s
    ``RequestOutput.metrics["spec_decoding"]`` (metrics.py): drafts, draft and accepted tokens (per
    position too), verify passes, tau (``mean_acceptance_length``), rounds per drafting method, and
    the wall time of its rounds."""
    return spec.as_dict()


def finish_reason(reason: str | None) -> str | None:
    """The engine says "stop", "length" or "abort"; OpenAI knows only the first two."""
    return None if reason is None else ("length" if reason == "length" else "stop")


Kind = Literal["completion", "chat"]
OBJECT = {"completion": ("text_completion", "text_completion"), "chat": ("chat.completion", "chat.completion.chunk")}


def choice(kind: Kind, index: int, text: str, reason: str | None, token_ids: list[int] | None,
           logprobs: dict | None = None, prompt_logprobs: list | None = None) -> dict:
    body = {"text": text} if kind == "completion" else {"message": {"role": "assistant", "content": text}}
    return _choice(index, body, reason, token_ids, logprobs, prompt_logprobs)


def chunk_choice(kind: Kind, index: int, text: str | None, reason: str | None, token_ids: list[int] | None,
                 role: bool = False, logprobs: dict | None = None, prompt_logprobs: list | None = None) -> dict:
    if kind == "completion":
        body: dict[str, Any] = {"text": text or ""}
    else:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        body = {"delta": delta}
    return _choice(index, body, reason, token_ids, logprobs, prompt_logprobs)


def _choice(index: int, body: dict, reason: str | None, token_ids: list[int] | None, logprobs: dict | None,
            prompt_logprobs: list | None) -> dict:
    """A choice whole or streamed: its text (``body``) among the fields both carry, in OpenAI's order."""
    c: dict[str, Any] = {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
    if token_ids is not None:
        c["token_ids"] = token_ids
    if prompt_logprobs is not None:
        c["prompt_logprobs"] = prompt_logprobs
    return c


# -- logprobs -----------------------------------------------------------------------------------------

MIN_LOGPROB = -9999.0  # what OpenAI sends for a token of probability 0 (JSON has no -inf)
TokenText = Callable[[int], str]  # a token id's text as the logprobs name it


def _clip(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _top(position: PositionLogprobs, n: int) -> list[tuple[int, float]]:
    """The n most likely (token id, logprob) of a position, most likely first."""
    ranked = sorted(position.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 62,
                                                      -kv[1].logprob))
    return [(t, lp.logprob) for t, lp in ranked[:n]]


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], top: int,
                        token_text: TokenText, offset: int) -> dict:
    """OpenAI's completions shape: tokens, token_logprobs, top_logprobs (the chosen token and the
    ``top`` most likely, by their text) and text_offset (each token's start in the choice's text,
    counted from ``offset``). A position without logprobs (an echoed prompt's first token) is null."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, pos in zip(token_ids, positions):
        text = token_text(t)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if pos is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_clip(pos[t].logprob))
        best = {token_text(t): _clip(pos[t].logprob)}
        for tt, lp in _top(pos, top):
            best.setdefault(token_text(tt), _clip(lp))
        out["top_logprobs"].append(best)
    return out


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], top: int, token_text: TokenText) -> dict:
    """OpenAI's chat shape: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}]}]}`` with the ``top`` most likely tokens of each position, most likely first."""

    def entry(t: int, logprob: float) -> dict:
        text = token_text(t)
        return {"token": text, "logprob": _clip(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}

    return {"content": [{**entry(t, pos[t].logprob), "top_logprobs": [entry(tt, lp) for tt, lp in _top(pos, top)]}
                        for t, pos in zip(token_ids, positions)]}


def prompt_logprobs_json(positions: list[PositionLogprobs | None]) -> list:
    """vLLM's prompt_logprobs: per prompt token null (the first) or {token id: {logprob, rank, decoded_token}}."""
    return [None if pos is None else {str(t): {"logprob": _clip(lp.logprob), "rank": lp.rank,
                                               "decoded_token": lp.decoded_token} for t, lp in pos.items()}
            for pos in positions]


def response(kind: Kind, rid: str, created: int, model: str, choices: list[dict], use: dict | None,
             chunk: bool = False) -> dict:
    body = {"id": rid, "object": OBJECT[kind][int(chunk)], "created": created, "model": model, "choices": choices}
    if use is not None or not chunk:
        body["usage"] = use
    return body
