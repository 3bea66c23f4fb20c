"""Speculative decoding for one sequence with a draft model, written to be read (docs/algorithm.md).

The batched engine (engine.py) does the same for many sequences at once, with any drafter,
adaptive k and requests that come and go. This loop is its oracle in the tests: the engine's
greedy output must equal it, and its sampled output must follow the same distribution.
It shares only the runners and the logit processing with the engine, not the verifier.
"""

from __future__ import annotations

import torch

from specdec.config import SamplingParams
from specdec.models.base import ForwardBatch, ModelRunner
from specdec.sampling import SamplingBatch, make_generator, probs_from_logits


def speculative_generate(target: ModelRunner, draft: ModelRunner, prompt: list[int], params: SamplingParams,
                         k: int = 4) -> list[int]:
    """Up to ``params.max_tokens`` tokens after ``prompt``; no stop conditions but the length."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    sb = SamplingBatch.from_params([params])
    g = make_generator(params.seed)
    tokens = list(prompt)
    target.sync_rows(["reference"])
    draft.sync_rows(["reference"])
    t_len = d_len = 0  # positions each model's cache holds for this sequence

    def run(model: ModelRunner, feed: list[int], start: int, logits: str | int) -> torch.Tensor:
        return model.forward(ForwardBatch.from_rows([feed], [start], logits, device=model.device))[0].float()

    def pick(p: torch.Tensor) -> int:  # p [V]
        return int(p.argmax()) if params.greedy else int(torch.multinomial(p, 1, generator=g))

    while len(tokens) - len(prompt) < params.max_tokens:
        # 1. draft: x_1..x_k from q, feeding the draft what its cache lacks first
        q_logits = run(draft, tokens[d_len:], d_len, "last")  # [V]
        d_len = len(tokens)
        drafts, qs = [], []
        for i in range(k):
            q = probs_from_logits(q_logits[None], sb)[0]  # [V]
            drafts.append(pick(q))
            qs.append(q)
            if i + 1 < k:
                q_logits = run(draft, [drafts[-1]], d_len + i, "last")

        # 2. verify: one target pass over [newest token, x_1..x_k] gives p_1..p_{k+1}
        ps = probs_from_logits(run(target, tokens[t_len:] + drafts, t_len, k + 1)[None], sb)[0]  # [k+1, V]

        # 3. accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); greedy: iff x_i is p_i's argmax
        n = 0
        while n < k:
            x, p, q = drafts[n], ps[n], qs[n]
            ok = x == int(p.argmax()) if params.greedy else float(torch.rand(1, generator=g)) * q[x] < p[x]
            if not ok:
                break
            n += 1
        if n < k:  # recovered: from the residual max(0, p - q), normalized (greedy: p's argmax)
            residual = (ps[n] - qs[n]).clamp(min=0)
            extra = pick(ps[n] if params.greedy or residual.sum() <= 0 else residual / residual.sum())
        else:  # bonus: from p_{k+1}, which the same pass computed
            extra = pick(ps[k])

        # 4. commit; rollback is a length change: each cache keeps only what it fed and was accepted
        t_len = len(tokens) + n  # the target fed [.., newest token, x_1..x_n] validly
        d_len += min(n, k - 1)  # the draft fed x_1..x_{k-1}
        tokens += drafts[:n] + [extra]
    return tokens[len(prompt):][: params.max_tokens]
