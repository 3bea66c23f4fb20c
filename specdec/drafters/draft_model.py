"""``method: "draft_model"``: a small model with the target's vocabulary, run by the same runner.

The draft keeps its own KV cache. Before drafting it compares the tokens it has
cached for a sequence with the sequence's committed history, keeps the longest
common prefix (rolling back is a length change) and feeds the rest: usually
one token (the target's recovered or bonus token), two after a full acceptance.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import DraftProposal, Drafter
from specdec.models.base import ModelRunner
from specdec.sampling import SamplingBatch, probs_from_logits, sample
from specdec.sequence import Sequence


class DraftModelDrafter(Drafter):
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.cached: dict[int, list[int]] = {}  # seq_id -> tokens whose KV sits in the draft cache
        self.committed: dict[int, int] = {}  # seq_id -> history length at the last proposal (surely still valid)

    def propose(self, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        B, k = len(seqs), max(num_draft)
        device = self.runner.device
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
        T = max(len(c) for c in chunks)
        tokens = torch.zeros(B, T, dtype=torch.long)  # [B, T], right-padded; padding KV is overwritten later
        for b, c in enumerate(chunks):
            tokens[b, : len(c)] = torch.tensor(c)
        last = torch.tensor([len(c) - 1 for c in chunks], device=device)
        logits = self.runner.forward(tokens.to(device), starts, logits_index=last)  # [B, V]

        # 2. Draft k tokens autoregressively: greedy rows take the argmax, sampled rows draw from q.
        pos = [s + len(c) for s, c in zip(starts, chunks)]
        draft_ids, draft_probs = [], []
        for i in range(k):
            if sb.all_greedy:
                x = logits.argmax(dim=-1)  # [B]
            else:
                q = probs_from_logits(logits, sb)  # [B, V]
                x = torch.where(sb.greedy, logits.argmax(dim=-1), sample(q, [s.generator for s in seqs]))
                draft_probs.append(q)
            draft_ids.append(x)
            if i + 1 < k:  # the last draft need not be fed: its distribution is never used
                logits = self.runner.forward(x[:, None], pos, logits_index=torch.zeros_like(x))
                pos = [p + 1 for p in pos]
        draft = torch.stack(draft_ids, dim=1) if k else torch.zeros(B, 0, dtype=torch.long, device=device)

        # 3. Remember what the cache now holds: the history plus drafts 1..k-1 (rows asking for fewer
        #    drafts still fed k-1 of them; the longest-common-prefix check above sorts that out).
        fed = draft[:, : max(k - 1, 0)].tolist()
        for b, s in enumerate(seqs):
            self.cached[s.seq_id] = s.token_ids + fed[b]
            self.committed[s.seq_id] = len(s.token_ids)
        probs = torch.stack(draft_probs, dim=1) if draft_probs else None  # [B, k, V]
        return DraftProposal(draft, probs, list(num_draft))

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.cached.pop(i, None)
            self.committed.pop(i, None)
