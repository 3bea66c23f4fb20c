"""The drafting loop shared by model drafters (a draft model, the target's early layers).

Given the logits after the history, draft one token at a time: greedy rows take the argmax,
sampled rows draw from q (the same logit processing as the target), and every row stops early
once its top probability falls below ``draft_p_min`` (llama.cpp's ``--draft-p-min``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.drafters.base import DraftProposal
from specdec.sampling import SamplingBatch, probs_from_logits, sample
from specdec.sequence import Sequence


def draft_autoregressive(logits: torch.Tensor, feed: Callable[[torch.Tensor, int], torch.Tensor],
                         seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch,
                         draft_p_min: float = 0.0) -> DraftProposal:
    """logits [B, V]: the drafter's distribution for the first draft position.
    feed(x [B], i) runs draft i (0-based) through the drafter and returns the logits [B, V] after it."""
    B, k = len(seqs), max(num_draft)
    device = logits.device
    limit = torch.tensor(num_draft, device=device)  # [B]
    active = limit > 0  # [B] rows still drafting
    lengths = torch.zeros(B, dtype=torch.long, device=device)
    draft_ids, draft_probs = [], []
    for i in range(k):
        if sb.all_greedy and draft_p_min == 0.0:
            x = logits.argmax(dim=-1)  # [B]
        else:
            q = probs_from_logits(logits, sb)  # [B, V]
            greedy_x = q.argmax(dim=-1) if sb.all_greedy else logits.argmax(dim=-1)
            x = greedy_x if sb.all_greedy else torch.where(sb.greedy, greedy_x, sample(q, [s.generator for s in seqs]))
            draft_probs.append(q)
            if draft_p_min > 0.0:
                active &= q.amax(dim=-1) >= draft_p_min
        active &= i < limit
        lengths += active.long()
        draft_ids.append(x)
        if not bool(active.any()):
            break
        if i + 1 < k:  # the last draft need not be fed: its distribution is never used
            logits = feed(x, i)
    n = int(lengths.max()) if B else 0
    draft = torch.stack(draft_ids[:n], dim=1) if n else torch.zeros(B, 0, dtype=torch.long, device=device)
    probs = None if sb.all_greedy or not draft_probs else torch.stack(draft_probs[:n], dim=1)  # [B, n, V]
    return DraftProposal(draft, probs, lengths.tolist())
