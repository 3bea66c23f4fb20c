"""The drafting loop shared by model drafters (a draft model, the target's early layers).

Given the logits after the history, draft one token at a time: greedy rows take the argmax,
sampled rows draw from q (the same logit processing as the target), and every row stops early
once its top probability falls below ``draft_p_min`` (llama.cpp's ``--draft-p-min``).

A sampled row draws from its generator only for the drafts it proposes: none for a row that
asked for 0 drafts or has stopped, so a seeded request consumes its generator as it would alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.drafters.base import DraftProposal
from specdec.models.base import long_tensor
from specdec.processing import process_draft_logits
from specdec.sampling import SamplingBatch, argmax, probs_from_logits, row_sampler, sample, sample_from_logits
from specdec.sequence import Sequence


def argmax_drafts(seqs: list[Sequence], sb: SamplingBatch, draft_p_min: float = 0.0) -> bool:
    """Whether every draft of the round is its position's argmax: greedy rows, no logits processor, no
    draft_p_min (then a drafter may take argmaxes alone, never the logits)."""
    return sb.all_greedy and draft_p_min == 0.0 and all(s.processor is None for s in seqs)


def greedy_chain(first: list[int], greedy_steps: Callable[[list[int], int], list[list[int]]], num_draft: list[int],
                 device: torch.device | str) -> DraftProposal:
    """All-argmax drafts (``argmax_drafts``): x_1 = ``first`` [B], then x_2..x_k from one
    ``greedy_steps(x_1, k - 1)`` call (ModelRunner.greedy_steps) instead of k - 1 forwards."""
    k = max(num_draft, default=0)
    rest = greedy_steps(first, k - 1) if k > 1 else [[] for _ in first]  # [B, k-1]
    return DraftProposal.of_rows([[f] + r for f, r in zip(first, rest)], None, num_draft, device)


def sampled_chain(draws: Callable[[Callable[[torch.Tensor], list[int]], int], list[list[int]]], seqs: list[Sequence],
                  k: int, sb: SamplingBatch, device: torch.device | str, vocab_map: torch.Tensor | None = None,
                  vocab_size: int | None = None) -> DraftProposal:
    """Every row draws all k drafts from q with nothing between the draws (``every_row_draws``):
    ``draws(pick, k)`` runs the drafter k steps, ``pick(logits [B, V]) -> x_i [B]`` drawing each draft from
    the q_i of the logits it is handed (a runner's ``sampled_steps``: one call instead of k forwards).
    ``vocab_map`` [Vd], ``vocab_size``: the logits are over a drafter's vocabulary, token c the target's
    vocab_map[c] (``sampling.row_sampler``); q is over the target's vocabulary of ``vocab_size``."""
    draw_rows = row_sampler(sb, [s.generator for s in seqs], device, vocab_map)
    q, step = None, 0  # q_i [B, k, V], written a step at a time at each pick; the next step

    def pick(step_logits: torch.Tensor) -> list[int]:  # [B, V] or [B, 1, V] -> x_i [B]
        nonlocal q, step
        if q is None:
            q = torch.empty(len(seqs), k, vocab_size or step_logits.shape[-1], device=step_logits.device)
        _, x = draw_rows(step_logits, q, step)
        step += 1
        return x

    drafts = draws(pick, k)  # [B, k]
    return DraftProposal.of_rows(drafts, q, [k] * len(seqs), device)  # q [B, k, V]


def every_row_draws(seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch, draft_p_min: float = 0.0) -> bool:
    """Whether every row samples the same number of drafts, each from q as processed for the target
    (no greedy row, no logits processor, no draft_p_min): then ``sampled_chain`` may draft them."""
    k = max(num_draft, default=0)
    return (k > 0 and all(n == k for n in num_draft) and draft_p_min == 0.0 and sb.all_sampled
            and all(s.processor is None for s in seqs))


def draft_autoregressive(logits: torch.Tensor, feed: Callable[[torch.Tensor, int], torch.Tensor],
                         seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch,
                         draft_p_min: float = 0.0,
                         greedy_steps: Callable[[list[int], int], list[list[int]]] | None = None,
                         sampled_steps: Callable | None = None) -> DraftProposal:
    """logits [B, V]: the drafter's distribution for the first draft position.
    feed(x [B], i) runs draft i (0-based) through the drafter and returns the logits [B, V] after it.
    greedy_steps(x_1 [B], n), optional: feeds x_1 and its own argmaxes, returning x_2..x_{n+1} [B, n]
    (ModelRunner.greedy_steps); drafts that are all argmaxes then take one call instead of k.
    sampled_steps(x_1 [B], n, pick), optional: the same with each next token from ``pick(logits)``
    (ModelRunner.sampled_steps); drafts that every row samples alike then take one call (``sampled_chain``)."""
    B, k = len(seqs), max(num_draft, default=0)
    device = logits.device
    if greedy_steps is not None and k > 1 and argmax_drafts(seqs, sb, draft_p_min):
        return greedy_chain(argmax(logits).tolist(), greedy_steps, num_draft, device)
    if sampled_steps is not None and every_row_draws(seqs, num_draft, sb, draft_p_min):
        def draws(pick: Callable[[torch.Tensor], list[int]], n: int) -> list[list[int]]:  # x_1 from logits, then n - 1
            first = pick(logits)
            rest = sampled_steps(first, n - 1, pick) if n > 1 else [[] for _ in first]
            return [[f] + r for f, r in zip(first, rest)]

        return sampled_chain(draws, seqs, k, sb, device)
    # the rows' bookkeeping in Python lists: a handful of tensor ops per step cost more than the lists at batch 1
    active = [n > 0 for n in num_draft]  # rows still drafting
    lengths = [0] * B
    greedy = sb.greedy.tolist() if not sb.all_greedy else None  # [B] bool, read once
    draft_ids, draft_probs = [], []
    for i in range(k):
        active = [a and i < n for a, n in zip(active, num_draft)]
        logits = process_draft_logits(logits, seqs, draft_ids)  # penalties / grammar as the target's at i
        if sb.all_greedy and draft_p_min == 0.0:
            x = argmax(logits)  # [B]
        elif draft_p_min == 0.0 and not any(greedy) and all(active):  # every row draws x_i: q and x in one pass
            q, ids = sample_from_logits(logits, sb, [s.generator for s in seqs])  # [B, V], [B]
            draft_probs.append(q)
            x = long_tensor(ids, device)
        else:
            q = probs_from_logits(logits, sb)  # [B, V]
            if draft_p_min > 0.0:  # too unsure: this row proposes nothing more
                active = [a and sure for a, sure in zip(active, (q.amax(dim=-1) >= draft_p_min).tolist())]
            if sb.all_greedy:
                x = argmax(q)  # [B]
            else:
                draft_probs.append(q)
                rows = [b for b in range(B) if active[b] and not greedy[b]]  # the sampled rows that draft x_i
                if len(rows) == B:  # every row samples: no argmax to keep, no gather of q
                    x = sample(q, [s.generator for s in seqs])
                else:
                    x = argmax(logits)  # greedy rows keep it
                    if rows:
                        x[rows] = sample(q[rows], [seqs[b].generator for b in rows])
        lengths = [n + a for n, a in zip(lengths, active)]
        draft_ids.append(x)
        if not any(active):
            break
        if i + 1 < k:  # the last draft need not be fed: its distribution is never used
            logits = feed(x, i)
    n = max(lengths, default=0)
    draft = torch.stack(draft_ids[:n], dim=1) if n else torch.zeros(B, 0, dtype=torch.long, device=device)
    probs = torch.stack(draft_probs[:n], dim=1) if n and draft_probs else None  # [B, n, V]
    return DraftProposal(draft, probs, lengths)
