"""Speculative decoding for one sequence with a draft model, written to be read (docs/algorithm.md).

The batched engine (engine.py) does the same for many sequences at once, with any drafter,
adaptive k and requests that come and go. This loop is its oracle in the tests: the engine's
greedy output must equal it, and its sampled output must follow the same distribution.
It shares only the runners and the logit processing with the engine, not the verifier.
``speculative_generate_tree`` is the same loop with a draft tree per round (verify_tree.py's rule).
"""

from __future__ import annotations

import torch

from specdec.config import SamplingParams
from specdec.models.base import ForwardBatch, ModelRunner
from specdec.sampling import SamplingBatch, make_generator, probs_from_logits
from specdec.tree import DraftTree, block_parents


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


def speculative_generate_tree(target: ModelRunner, draft: ModelRunner, prompt: list[int], params: SamplingParams,
                              depth: int = 3, width: int = 2) -> list[int]:
    """The loop above with a tree per round: ``width`` siblings drawn from q without replacement after
    the newest token (greedy: the top ``width``), each continued by a chain to ``depth`` tokens. The
    target needs ``can_verify_trees``; the draft runs each path from the start (slow, short)."""
    sb = SamplingBatch.from_params([params])
    g = make_generator(params.seed)
    tokens = list(prompt)
    target.sync_rows(["reference"])
    t_len = 0  # positions the target's cache holds

    def q_after(path: list[int]) -> torch.Tensor:  # the draft's q after tokens + path  [V]
        draft.sync_rows(["reference-tree"])
        return probs_from_logits(draft.forward(ForwardBatch.from_rows([tokens + path], [0]))[0][None], sb)[0]

    def pick(p: torch.Tensor) -> int:  # p [V]
        return int(p.argmax()) if params.greedy else int(torch.multinomial(p, 1, generator=g))

    while len(tokens) - len(prompt) < params.max_tokens:
        # 1. draft: siblings from q without replacement, then a chain below each; node i was drawn from qs[i]
        ids, parents, qs = [], [], []
        q0 = q_after([])
        rest = q0.clone()
        for _ in range(width):
            if rest.sum() <= 0:
                break  # q has fewer tokens than width
            ids.append(pick(rest / rest.sum()))
            parents.append(-1)
            qs.append(q0)
            rest[ids[-1]] = 0.0
            for d in range(1, depth):
                qs.append(q_after([ids[-1 - j] for j in range(d)][::-1]))
                ids.append(pick(qs[-1]))
                parents.append(len(ids) - 2)
        tree = DraftTree(ids, parents, torch.stack(qs))

        # 2. verify: one pass over [what the cache lacks, nodes], each node seeing only its ancestors
        feed = tokens[t_len:]
        batch = ForwardBatch.from_rows([feed + ids], [t_len], 1 + len(ids), device=target.device)
        batch.parents = [block_parents(len(feed), tree)]
        ps = probs_from_logits(target.forward(batch)[0].float()[None], sb)[0]  # [1 + N, V]: after the root, node i

        # 3. accept: at each node try its children in turn (greedy: the one that is p's argmax; sampled:
        #    with probability r(x) / q(x), q without the siblings tried before, r the residual so far)
        path, node = [], -1
        while True:
            p, r, tried, extra = ps[node + 1], ps[node + 1], [], None
            for c in tree.children(node):
                q = qs[c].clone()
                q[tried] = 0.0
                q /= q.sum()
                x = ids[c]
                ok = x == int(p.argmax()) if params.greedy else float(torch.rand(1, generator=g)) * q[x] < r[x]
                if ok:
                    extra = c
                    break
                residual = (r - q).clamp(min=0)
                r = residual / residual.sum() if residual.sum() > 0 else r
                tried.append(x)
            if extra is None:  # recovered from the last residual (a leaf: bonus from p); greedy: p's argmax
                nxt = pick(p if params.greedy else r)
                break
            path.append(extra)
            node = extra

        # 4. commit: the target keeps [feed, accepted path] in consecutive slots; the rest is dropped by length
        target.compact([0], [t_len], [list(range(len(feed))) + [len(feed) + j for j in path]])
        t_len += len(feed) + len(path)
        tokens += [ids[j] for j in path] + [nxt]
    return tokens[len(prompt):][: params.max_tokens]
