"""Result objects, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """vLLM's ``Logprob``: one token's log probability under the target at one position."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]  # token id -> Logprob: the chosen token plus the top N


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None  # one dict per output token, when SamplingParams.logprobs is set


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # "spec_decoding": the speculative counters of the request's choices summed, and
    # "spec_decoding_per_choice": one per choice (RequestSpecStats.as_dict(), metrics.py)
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # per prompt token; the first is None


@dataclass
class StreamDelta:
    """What one engine round added to a streamed request."""

    text: str  # new text, held back while it could still be the start of a stop string
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[PositionLogprobs] | None = None  # one dict per token in token_ids, when asked
    index: int = 0  # which of the request's n choices
    metrics: dict | None = None  # on a choice's last delta: its speculative counters (RequestSpecStats.as_dict())
