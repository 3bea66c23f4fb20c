"""One proposal from several drafters' proposals, row by row: for a drafter that picks, per sequence,
which of its parts drafts (suffix decoding in front of a model, hybrid.py; a choice among methods,
choice.py).

Each part was asked for drafts only for its own rows (num_draft 0 for the others), so row b of the
merged proposal is row b of the part that owns it. When some owned row was sampled from a q, the
merged proposal carries draft_probs for every row: a deterministic row's q is the one-hot of its
drafts, so the verifier's rule stays exact row by row (verify.rejection_sample tells one-hot rows
apart and races them as plain decoding would).
"""

from __future__ import annotations

import torch

from specdec.drafters.base import DraftProposal


def merge_proposals(parts: dict[str, DraftProposal], owner: list[str], device: torch.device | str) -> DraftProposal:
    """Row b from ``parts[owner[b]]``  (each part [B, k_part], draft_probs [B, k_part, V] or None).
    ``sources`` says which part drafted each row (``owner``)."""
    B = len(owner)
    num = [parts[m].num_draft_tokens[b] for b, m in enumerate(owner)]  # [B]
    width = max(num, default=0)
    ids = torch.zeros(B, width, dtype=torch.long, device=device)  # [B, k]
    sampled = [b for b, m in enumerate(owner) if num[b] and parts[m].draft_probs is not None]
    probs = None
    if sampled:
        q = parts[owner[sampled[0]]].draft_probs
        probs = q.new_zeros(B, width, q.shape[-1])  # [B, k, V]
    for b, m in enumerate(owner):
        n = num[b]
        if n == 0:
            continue
        part = parts[m]
        ids[b, :n] = part.draft_token_ids[b, :n]
        if probs is None:
            continue
        if part.draft_probs is not None:
            probs[b, :n] = part.draft_probs[b, :n]
        else:  # q = one-hot(x_i) for a deterministic row
            probs[b, torch.arange(n, device=device), ids[b, :n]] = 1.0
    return DraftProposal(ids, probs, num, list(owner))
