"""The scheduler: who runs this round. It owns the waiting queue and the running batch.

Admission takes waiting requests up to ``max_num_seqs`` running; retirement drops finished
sequences and fills their places from the end of the batch, so the cache rows (which follow
batch order, ``RowTable``) move as little as possible. ``RoundBatch`` is what one round runs on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from specdec.models.base import ForwardBatch, pad_rows
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence


class Scheduler:
    def __init__(self, max_num_seqs: int = 256):
        if not (isinstance(max_num_seqs, int) and max_num_seqs >= 1):
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()  # aborted ones stay until admission skips them
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Mark a sequence finished; a waiting one is skipped at admission, a running one retires."""
        if seq.finish_reason is None:
            seq.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        while self.waiting and self.waiting[0].finished:
            self.waiting.popleft()
        return bool(self.running or self.waiting)

    def admit(self) -> list[Sequence]:
        """Move waiting requests into the batch while there is room; returns the newcomers (at its end)."""
        new = []
        while self.waiting and len(self.running) + len(new) < self.max_num_seqs:
            seq = self.waiting.popleft()
            if not seq.finished:
                new.append(seq)
        self.running += new
        return new

    def retire(self) -> list[Sequence]:
        """Drop finished sequences from the batch; returns them."""
        done = [s for s in self.running if s.finished]
        if done:
            n = len(self.running) - len(done)
            kept = self.running[:n]
            movers = iter(s for s in self.running[n:] if not s.finished)
            # survivors keep their places; those past the new end move into the holes
            self.running = [s if not s.finished else next(movers) for s in kept]
        return done


@dataclass
class RoundBatch:
    """One round's state, for the B running sequences in cache-row order (ALGORITHM.md's notation:
    the drafter proposes x_1..x_k from q, the target's verify pass gives p_1..p_{k+1})."""

    seqs: list[Sequence]  # [B]
    start: list[int]  # [B] target cache length of each row = the position its feed starts at
    feed: list[list[int]]  # [B] what each target row lacks: its newest token, or a merged prompt
    num_wanted: list[int]  # [B] drafts asked of the drafter (0: this row decodes plainly)
    sampling: SamplingBatch
    # step 1, draft
    draft_token_ids: torch.Tensor | None = None  # [B, k] long; row b's drafts are its first num_draft[b]
    draft_probs: torch.Tensor | None = None  # [B, k, V] q of sampled drafts; None: one-hot (deterministic)
    num_draft: list[int] = field(default_factory=list)  # [B]

    @classmethod
    def build(cls, seqs: list[Sequence], num_wanted: list[int], device: torch.device,
              last: SamplingBatch | None = None) -> RoundBatch:
        """``last``: the previous round's SamplingBatch, reused when the rows' parameters are the same."""
        return cls(seqs, [s.num_computed for s in seqs], [s.token_ids[s.num_computed:] for s in seqs], num_wanted,
                   SamplingBatch.from_params([s.params for s in seqs], device, reuse=last))

    @property
    def carries_prompt(self) -> bool:
        """Whether some row feeds more than its newest token (a prompt merged into this round)."""
        return any(len(f) != 1 for f in self.feed)

    def set_drafts(self, draft_token_ids: torch.Tensor | None, draft_probs: torch.Tensor | None,
                   num_draft: list[int] | None) -> None:
        if draft_token_ids is None:
            draft_token_ids = torch.zeros(len(self.seqs), 0, dtype=torch.long, device=self.sampling.device)
            num_draft = [0] * len(self.seqs)
        self.draft_token_ids, self.draft_probs, self.num_draft = draft_token_ids, draft_probs, list(num_draft)

    def verify_batch(self) -> ForwardBatch:
        """The target's verify pass: each row's feed then its k drafts; logits at the last k+1 positions
        of each row [B, k+1]: p_1 after the newest committed token, p_{i+1} after draft x_i."""
        drafts, k = self.draft_token_ids, self.draft_token_ids.shape[1]  # [B, k]
        lengths = [len(f) + n for f, n in zip(self.feed, self.num_draft)]
        if not self.carries_prompt:
            tokens = torch.cat([torch.tensor(self.feed, device=drafts.device), drafts], dim=1)  # [B, k+1]
            index = torch.arange(k + 1, device=drafts.device).expand(len(self.seqs), k + 1)
        else:
            tokens = pad_rows([f + d for f, d in zip(self.feed, drafts.tolist())], drafts.device)  # [B, T]
            index = torch.tensor([[len(f) - 1 + j for j in range(k + 1)] for f in self.feed], device=drafts.device)
        return ForwardBatch(tokens, self.start, lengths, index)
