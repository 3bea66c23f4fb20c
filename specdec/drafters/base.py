"""The one small interface every drafter implements.

A drafter sees the committed history of each sequence (``seq.token_ids``) and
proposes up to k tokens for it. It reconciles its own state (a KV cache, an
index over text) with that history itself: the engine never tells it about
rollbacks, joins or departures beyond calling ``propose`` with the current batch
and ``observe`` with what was accepted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence


@dataclass
class DraftProposal:
    draft_token_ids: torch.Tensor  # [B, k_max] long; row b's drafts are its first num_draft_tokens[b]
    draft_probs: torch.Tensor | None  # [B, k_max, V]: q_i each draft was sampled from; None when drafts
    #                                    are deterministic (q = one-hot), as for greedy or lookup drafters
    num_draft_tokens: list[int]  # [B] drafts per row, 0..k_max; a row may propose fewer than asked

    @classmethod
    def from_rows(cls, rows: list[list[int]], device: torch.device | str) -> DraftProposal:
        """Pack per-row deterministic drafts (possibly empty) into a right-padded [B, longest row] proposal."""
        width = max((len(r) for r in rows), default=0)
        ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, k]; padding past a row's drafts is never read
        for b, r in enumerate(rows):
            if r:
                ids[b, : len(r)] = torch.tensor(r)
        return cls(ids.to(device), None, [len(r) for r in rows])


class Drafter(ABC):
    @abstractmethod
    def propose(self, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        """Propose up to ``num_draft[b]`` tokens continuing ``seqs[b].token_ids``."""

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Learn how many drafts of the last proposal each sequence accepted (its history already includes them)."""

    def release(self, seqs: list[Sequence]) -> None:
        """Forget finished sequences (their histories are final)."""

    def release_memory(self) -> None:
        """No sequence is running: free buffers that the next proposal can rebuild (a KV cache)."""
