"""Result objects, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None
    logprobs: None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)


@dataclass
class StreamDelta:
    """What one engine round added to a streamed request."""

    text: str  # new text, held back while it could still be the start of a stop string
    token_ids: list[int]
    finish_reason: str | None = None
