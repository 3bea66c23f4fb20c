"""The one interface every model backend offers: run tokens at positions, get logits.

There is no explicit rollback call: the KV cache is written by absolute
position, so a caller rolls back by passing a smaller ``start`` next time.
A second backend (llama.cpp through llama-cpp-python, say) implements this
same class without the drafters or the verifier knowing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence

import torch


class ModelRunner(ABC):
    vocab_size: int  # width of the returned logits: the tokenizer's length, padded rows cut off
    max_model_len: int  # longest sequence (prompt + output) the model accepts
    num_layers: int
    device: torch.device

    @abstractmethod
    def reserve(self, num_rows: int, length: int) -> None:
        """Make room for ``num_rows`` sequences of ``length`` positions, keeping what is cached."""

    @abstractmethod
    def release(self) -> None:
        """Free the KV cache; the next forward allocates what it needs (every row starts empty)."""

    @abstractmethod
    def sync_rows(self, ids: Sequence[Hashable]) -> list[bool]:
        """Put the cache rows of sequences ``ids`` at rows 0..B-1; returns which ids are new (cached length 0)."""

    @abstractmethod
    def forward(self, token_ids: torch.Tensor, start: Sequence[int], logits_index: torch.Tensor | None = None,
                all_logits: bool = False, row_offset: int = 0, num_layers: int | None = None,
                lengths: Sequence[int] | None = None) -> torch.Tensor | None:
        """Run ``token_ids`` [B, T] at positions ``start[b] + t`` in cache rows ``row_offset + b``; write their KV.
        ``num_layers``: run only the first layers, then the final norm and head (self-speculation).
        ``lengths``: row b holds only its first lengths[b] tokens, the rest is padding (its KV may be
        written, its logits are meaningless); a backend may skip the padding's work.

        Returns float32 logits [B, T, V] when ``all_logits``, [B, V] at ``logits_index`` [B]
        (index into T) or [B, L, V] at ``logits_index`` [B, L] when given, otherwise None (a
        prefill that needs no logits).
        """


def next_token_logits(runner: ModelRunner, prompts: list[list[int]], row_tag: str = "__specdec_probe__") -> torch.Tensor:
    """Next-token logits [B, V] after each prompt (equal lengths), computed in fresh cache rows
    tagged ``row_tag``: the rows of the sequences the engine runs are left as they are."""
    B, T = len(prompts), len(prompts[0])
    runner.sync_rows([(row_tag, b) for b in range(B)])
    tokens = torch.tensor(prompts, device=runner.device)  # [B, T]
    return runner.forward(tokens, [0] * B, logits_index=torch.full((B,), T - 1, device=runner.device))
