"""``method: "draft_model"``: a small model with the target's vocabulary, run by the same runner.

The draft keeps its own KV cache. Before drafting it compares the tokens it has
cached for a sequence with the sequence's committed history, keeps the longest
common prefix (rolling back is a length change) and feeds the rest: usually
one token (the target's recovered or bonus token), two after a full acceptance.
"""

from __future__ import annotations

import torch

from specdec.drafters.autoregressive import draft_autoregressive
from specdec.drafters.base import DraftProposal, Drafter
from specdec.models.base import ForwardBatch, ModelRunner
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence

CATCH_UP_TOGETHER = 4  # newcomers' chunks up to this long ride along in the running rows' forward


class DraftModelDrafter(Drafter):
    def __init__(self, runner: ModelRunner, draft_p_min: float = 0.0):
        self.runner = runner
        self.draft_p_min = draft_p_min
        self.cached: dict[int, list[int]] = {}  # seq_id -> tokens whose KV sits in the draft cache
        self.committed: dict[int, int] = {}  # seq_id -> history length at the last proposal (surely still valid)

    def propose(self, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        B = len(seqs)
        is_new = self.runner.sync_rows([s.seq_id for s in seqs])

        # 1. Catch up: feed each sequence's tokens that the draft cache lacks (at least the newest one).
        starts, chunks = [], []
        for s, new in zip(seqs, is_new):
            cached = [] if new else self.cached[s.seq_id]
            m = 0 if new else self.committed[s.seq_id]
            limit = min(len(cached), len(s.token_ids) - 1)
            while m < limit and cached[m] == s.token_ids[m]:
                m += 1
            starts.append(m)
            chunks.append(s.token_ids[m:])
        # Newcomers join at the end of the batch with their whole prompt: they catch up in a forward
        # of their own, so the running rows' one- or two-token feeds are not padded to a prompt's length.
        split = B
        while split > 0 and is_new[split - 1]:
            split -= 1
        if split in (0, B) or max(len(c) for c in chunks[split:]) <= CATCH_UP_TOGETHER:
            split = B
        logits = torch.cat([self._catch_up(chunks[lo:hi], starts[lo:hi], lo)
                            for lo, hi in ((0, split), (split, B)) if hi > lo])  # [B, V]

        # 2. Draft up to k tokens autoregressively.
        pos = [s + len(c) for s, c in zip(starts, chunks)]

        def feed(x: torch.Tensor, i: int) -> torch.Tensor:  # x [B] -> logits [B, V]
            return self.runner.forward(ForwardBatch.dense(x[:, None], [p + i for p in pos], logits="last"))

        def greedy(x: list[int], n: int) -> list[list[int]]:  # x [B] fed at pos -> the next n argmaxes [B, n]
            return self.runner.greedy_steps(x, pos, n)

        proposal = draft_autoregressive(logits, feed, seqs, num_draft, sb, self.draft_p_min, greedy)

        # 3. Remember what the cache now holds: the history plus the drafts that were fed.
        fed = proposal.draft_token_ids[:, : max(proposal.draft_token_ids.shape[1] - 1, 0)].tolist()
        for b, s in enumerate(seqs):
            self.cached[s.seq_id] = s.token_ids + fed[b]
            self.committed[s.seq_id] = len(s.token_ids)
        return proposal

    def _catch_up(self, chunks: list[list[int]], starts: list[int], row_offset: int) -> torch.Tensor:
        """Feed each row's chunk at its start; returns the logits after each chunk's last token [B, V]."""
        return self.runner.forward(ForwardBatch.from_rows(chunks, starts, logits="last", row_offset=row_offset,
                                                          device=self.runner.device))

    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token()

    def release_memory(self) -> None:
        self.runner.release()  # every row starts empty again; propose() notices new rows

    def release(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.cached.pop(s.seq_id, None)
            self.committed.pop(s.seq_id, None)
