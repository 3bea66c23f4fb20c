"""One request's state as it moves through the engine."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from specdec.config import SamplingParams
from specdec.metrics import RequestSpecStats
from specdec.outputs import PositionLogprobs

_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator  # per request: drafting and verification draw from it, in a fixed order
    max_len: int  # prompt + output may not exceed this (the model's context)
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(init=False)  # prompt + output so far
    # Target KV positions that hold this sequence's tokens. Between rounds it is len(token_ids) - 1:
    # the newest token is fed in the next round's verify pass. Rolling back is lowering this number.
    num_computed: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    text: str = ""  # detokenized output, cut at a stop string
    processor: object | None = None  # processing.RowProcessor when params.processes_logits
    # choices of one request (SamplingParams.n) share a group: one prefills the prompt, the others copy its cache
    prefill_group: int | None = None
    # logprobs.py, when the params ask: one dict per output token, their sum, one per prompt token
    logprobs: list[PositionLogprobs] | None = field(init=False)
    cumulative_logprob: float | None = field(init=False)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # its speculative counters (metrics.py), recorded by the engine each round: RequestOutput.metrics
    stats: RequestSpecStats = field(init=False, default_factory=RequestSpecStats)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        wants = self.params.logprobs is not None
        self.logprobs = [] if wants else None
        self.cumulative_logprob = 0.0 if wants else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def room(self) -> int:
        """How many more tokens this sequence may still emit."""
        return min(self.params.max_tokens - self.num_output_tokens, self.max_len - len(self.token_ids))
