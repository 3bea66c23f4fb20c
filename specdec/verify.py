"""The verifier: which draft tokens the target keeps, and the one token it adds.

Vocabulary (vLLM's rejection sampler uses the same words):
- *draft* tokens x_1..x_k, proposed by the drafter from distributions q_1..q_k;
- *accepted* tokens: the longest prefix of the drafts that survives verification;
- *recovered* token: after the first rejection at position i, a sample from the
  residual max(0, p_i - q_i) / Z, built from probabilities, never from logits;
- *bonus* token: after all k drafts are accepted, a sample from p_{k+1}, which
  the same target pass already computed.
Every row emits its accepted drafts plus exactly one recovered or bonus token.

Greedy rows accept x_i iff x_i == argmax p_i and emit argmax p at the first mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.sampling import SamplingBatch, probs_from_logits, sample


@dataclass
class VerifyResult:
    num_accepted: list[int]  # [B] accepted drafts per row, 0..k
    next_token_ids: list[int]  # [B] the recovered token (num_accepted < k) or the bonus token (== k)


def verify(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
           sb: SamplingBatch, generators: Sequence[torch.Generator],
           num_draft: torch.Tensor | None = None) -> VerifyResult:
    """draft_token_ids [B, k]; draft_probs [B, k, V] or None for a deterministic drafter (q = one-hot);
    target_logits [B, k+1, V] from one target pass over [last committed token, x_1..x_k];
    num_draft [B]: row b drafted only its first num_draft[b] positions (None: all k). A row that
    accepts all its drafts gets its bonus token from p at position num_draft[b] + 1."""
    B, k = draft_token_ids.shape
    if num_draft is None:
        num_draft = torch.full((B,), k, dtype=torch.long, device=target_logits.device)
    if sb.all_greedy:
        return verify_greedy(draft_token_ids, target_logits, num_draft)
    num_accepted = [0] * B
    next_ids = [0] * B
    greedy_rows = [b for b in range(B) if sb.greedy[b]]
    sampled_rows = [b for b in range(B) if not sb.greedy[b]]
    if greedy_rows:
        g = verify_greedy(draft_token_ids[greedy_rows], target_logits[greedy_rows], num_draft[greedy_rows])
        for i, b in enumerate(greedy_rows):
            num_accepted[b], next_ids[b] = g.num_accepted[i], g.next_token_ids[i]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=target_logits.device)
        target_probs = probs_from_logits(target_logits[rows], sb.select(sampled_rows))  # [Bs, k+1, V]
        s = rejection_sample(draft_token_ids[rows], None if draft_probs is None else draft_probs[rows],
                             target_probs, [generators[b] for b in sampled_rows], num_draft[rows])
        for i, b in enumerate(sampled_rows):
            num_accepted[b], next_ids[b] = s.num_accepted[i], s.next_token_ids[i]
    return VerifyResult(num_accepted, next_ids)


def verify_greedy(draft_token_ids: torch.Tensor, target_logits: torch.Tensor,
                  num_draft: torch.Tensor | None = None) -> VerifyResult:
    target_argmax = target_logits.argmax(dim=-1)  # [B, k+1]
    k = draft_token_ids.shape[1]
    matches = draft_token_ids == target_argmax[:, :k]  # [B, k]
    if num_draft is not None:
        matches &= torch.arange(k, device=matches.device) < num_draft[:, None]
    matches = matches.int()
    num_accepted = matches.cumprod(dim=1).sum(dim=1)  # [B]: length of the matching prefix
    next_ids = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # recovered or bonus
    return VerifyResult(num_accepted.tolist(), next_ids.tolist())


def rejection_sample(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generators: Sequence[torch.Generator], num_draft: torch.Tensor | None = None) -> VerifyResult:
    """Leviathan et al. 2023, Alg. 1. draft_token_ids [B, k]; draft_probs [B, k, V] | None;
    target_probs [B, k+1, V]; num_draft [B] drafts per row (None: all k)."""
    B, k = draft_token_ids.shape
    device = target_probs.device
    if num_draft is None:
        num_draft = torch.full((B,), k, dtype=torch.long, device=device)
    p_draft = target_probs[:, :k].gather(-1, draft_token_ids[..., None]).squeeze(-1)  # [B, k]: p_i(x_i)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)  # deterministic drafter: q_i = one-hot(x_i)
    else:
        q_draft = draft_probs.gather(-1, draft_token_ids[..., None]).squeeze(-1)  # [B, k]: q_i(x_i)
    u = torch.stack([torch.rand(k, generator=g, device=device) for g in generators]) if k else p_draft
    drafted = torch.arange(k, device=device) < num_draft[:, None]  # [B, k]
    accepted = ((u * q_draft < p_draft) & drafted).int()  # u < p/q without dividing; q(x) > 0 as x ~ q
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)  # [B]

    # The distribution of the one extra token: residual at the first rejection, p_{k+1} after full acceptance.
    rows = torch.arange(B, device=device)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    rejected = num_accepted < num_draft  # otherwise every draft was accepted: p_next is the bonus distribution
    if bool(rejected.any()):
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_at = torch.zeros_like(p_next)
            q_at[rows, draft_token_ids[rows, at]] = 1.0
        else:
            q_at = draft_probs[rows, at]  # [B, V]
        residual = (p_next - q_at).clamp(min=0)
        mass = residual.sum(dim=-1, keepdim=True)
        # mass is > 0 whenever a rejection can happen (p != q); fall back to p only against rounding
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
        p_next = torch.where(rejected[:, None], residual, p_next)
    next_ids = sample(p_next, generators)
    return VerifyResult(num_accepted.tolist(), next_ids.tolist())
