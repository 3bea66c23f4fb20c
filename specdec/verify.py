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
Sampled rows draw from their own generator only what they use (vLLM does the same), so a seeded
request's output does not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec import sampling_kernel
from specdec.models.base import long_tensor
from specdec.sampling import SamplingBatch, argmax, draw, probs_from_logits, sample


ROW_BY_ROW = 4  # sampled rows with drafts from q: on the CPU, batches of up to this many go row by row


@dataclass
class VerifyResult:
    num_accepted: list[int]  # [B] accepted drafts per row, 0..k
    next_token_ids: list[int]  # [B] the recovered token (num_accepted < k) or the bonus token (== k)


class ProbRows:
    """One row's target distributions p_1..p_{k+1} [V] (``rows[i]``), each processed from its logits
    (``probs_from_logits``) when first read: the verifier reads a row's positions up to its first
    rejection. ``rejection_sample`` takes a list of them (one per row) in place of target_probs."""

    def __init__(self, logits: torch.Tensor, sb: SamplingBatch):
        self.logits, self.sb = logits, sb  # [k+1, V], one row
        self.made: dict[int, torch.Tensor] = {}

    def __getitem__(self, i: int) -> torch.Tensor:
        p = self.made.get(i)
        if p is None:
            p = self.made[i] = probs_from_logits(self.logits[i][None], self.sb)[0]  # [V]
        return p


def verify(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
           sb: SamplingBatch, generators: Sequence[torch.Generator],
           num_draft: torch.Tensor | Sequence[int] | None = None) -> VerifyResult:
    """draft_token_ids [B, k]; draft_probs [B, k, V] or None for a deterministic drafter (q = one-hot);
    target_logits [B, k+1, V] from one target pass over [last committed token, x_1..x_k];
    num_draft [B] (a tensor or ints): row b drafted only its first num_draft[b] positions (None: all k). A row
    that accepts all its drafts gets its bonus token from p at position num_draft[b] + 1."""
    B, k = draft_token_ids.shape
    if num_draft is None:
        num_draft = [k] * B
    limits = num_draft.tolist() if isinstance(num_draft, torch.Tensor) else list(num_draft)  # [B]
    if sb.all_greedy:
        return verify_greedy(draft_token_ids, argmax(target_logits), limits)
    num_accepted = [0] * B
    next_ids = [0] * B
    greedy = [False] * B if sb.all_sampled else sb.greedy.tolist()  # [B], read once
    greedy_rows = [b for b in range(B) if greedy[b]]
    sampled_rows = [b for b in range(B) if not greedy[b]]
    if greedy_rows:
        g = verify_greedy(draft_token_ids[greedy_rows], argmax(target_logits[greedy_rows]),
                          [limits[b] for b in greedy_rows])
        for i, b in enumerate(greedy_rows):
            num_accepted[b], next_ids[b] = g.num_accepted[i], g.next_token_ids[i]
    if sampled_rows and native_rows(target_logits, sb, len(sampled_rows)):
        for b in sampled_rows:
            num_accepted[b], next_ids[b] = verify_row(target_logits, draft_token_ids, draft_probs, limits[b], sb, b,
                                                      generators[b])
    elif sampled_rows:
        take = _take(sampled_rows, B, target_logits.device)
        sub = sb.select(sampled_rows)
        if sub.cut_rows and target_logits.device.type == "cpu" and len(sampled_rows) <= ROW_BY_ROW:
            # a top-k / top-p cut costs ~0.08 ms a position on the CPU, and a row reads p up to its first rejection
            target_probs = [ProbRows(target_logits[b], sub.select([i])) for i, b in enumerate(sampled_rows)]
        else:
            target_probs = probs_from_logits(take(target_logits), sub)  # [Bs, k+1, V]
        s = rejection_sample(take(draft_token_ids), None if draft_probs is None else take(draft_probs),
                             target_probs, [generators[b] for b in sampled_rows],
                             long_tensor([limits[b] for b in sampled_rows], target_logits.device))
        for i, b in enumerate(sampled_rows):
            num_accepted[b], next_ids[b] = s.num_accepted[i], s.next_token_ids[i]
    return VerifyResult(num_accepted, next_ids)


def native_rows(target_logits: torch.Tensor, sb: SamplingBatch, rows: int) -> bool:
    """Whether ``verify`` takes its sampled rows one native call each (``verify_row``): a few rows on the CPU
    where the sampling kernel runs."""
    return rows <= ROW_BY_ROW and target_logits.device.type == "cpu" and sampling_kernel.available().ok


def verify_row(target_logits: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
               num_draft: int, sb: SamplingBatch, b: int, generator: torch.Generator) -> tuple[int, int]:
    """``rejection_sample`` for row b alone (num_draft: its drafts), in one call of the sampling kernel
    (sampling_kernel.py): each p_i made from the target's logits [B, k+1, V] when read, the same draws in the
    same order, the same decisions.
    Right after a forward a round's dozen small torch calls cost more than the rule's arithmetic."""
    return sampling_kernel.module().verify_row(target_logits, draft_token_ids, draft_probs, num_draft,
                                               sb.temperature, sb.top_k, sb.top_p, sb.min_p, b, generator)


def verify_greedy(draft_token_ids: torch.Tensor | list[list[int]], target_argmax: torch.Tensor | list[list[int]],
                  num_draft: torch.Tensor | Sequence[int] | None = None) -> VerifyResult:
    """Greedy rows: accept the drafts while each equals the target's argmax there, then emit the
    argmax after the accepted prefix (recovered, or the bonus token after all num_draft[b]).
    draft_token_ids [B, k] (a tensor or lists); target_argmax [B, k+1] (argmax p_1..p_{k+1}, a tensor or
    lists). The argmaxes come to the host once and the prefix is found in Python: a round's k is small, and
    a dozen small tensor ops cost more than the loop at batch 1."""
    drafts = draft_token_ids.tolist() if isinstance(draft_token_ids, torch.Tensor) else draft_token_ids  # [B, k]
    target_ids = target_argmax.tolist() if isinstance(target_argmax, torch.Tensor) else target_argmax  # [B, k+1]
    limits = [len(d) for d in drafts] if num_draft is None else (
        num_draft.tolist() if isinstance(num_draft, torch.Tensor) else list(num_draft))  # [B]
    num_accepted, next_ids = [], []
    for d, t, limit in zip(drafts, target_ids, limits):
        n = 0
        while n < limit and d[n] == t[n]:
            n += 1
        num_accepted.append(n)
        next_ids.append(t[n])  # recovered or bonus
    return VerifyResult(num_accepted, next_ids)


def rejection_sample(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generators: Sequence[torch.Generator], num_draft: torch.Tensor | None = None) -> VerifyResult:
    """Leviathan et al. 2023, Alg. 1. draft_token_ids [B, k]; draft_probs [B, k, V] | None;
    target_probs [B, k+1, V], or (up to ROW_BY_ROW rows on the CPU) a ProbRows per row;
    num_draft [B] drafts per row (None: all k).

    Each row draws only what it uses from its own generator, so a seeded row's draws do not depend
    on the rest of the batch: a row whose drafts are deterministic (q one-hot) one draw per token it
    emits (``_exact_match``); any other row one uniform per draft it proposed, then one draw for
    its recovered or bonus token."""
    B, k = draft_token_ids.shape
    device = draft_token_ids.device
    if num_draft is None:
        num_draft = torch.full((B,), k, dtype=torch.long, device=device)
    n_rows = num_draft.tolist()
    one_hot = [True] * B
    if draft_probs is not None and k:
        q_draft = draft_probs.gather(-1, draft_token_ids[..., None]).squeeze(-1)  # [B, k]: q_i(x_i)
        drafted = torch.arange(k, device=device) < num_draft[:, None]
        spread = q_draft != 1.0  # [B, k]: q_i is not one-hot(x_i) ...
        if bool((~spread & drafted).any()):  # ... or, where q_i(x_i) is 1, mass elsewhere (a scan of q: rare)
            spread = spread | ((draft_probs > 0).sum(dim=-1) != 1)
        one_hot = (~(spread & drafted).any(dim=1)).tolist()
    exact = [b for b in range(B) if one_hot[b]]
    sampled = [b for b in range(B) if not one_hot[b]]
    num_accepted, next_ids = [0] * B, [0] * B
    if exact:
        take = _take(exact, B, device)
        acc, nxt = _exact_match(take(draft_token_ids), take(target_probs), [generators[b] for b in exact],
                                [n_rows[b] for b in exact])
        for i, b in enumerate(exact):
            num_accepted[b], next_ids[b] = acc[i], nxt[i]
    if sampled:
        take = _take(sampled, B, device)
        s = _accept_or_recover(take(draft_token_ids), take(draft_probs), take(target_probs),
                               [generators[b] for b in sampled], take(num_draft))
        for i, b in enumerate(sampled):
            num_accepted[b], next_ids[b] = s.num_accepted[i], s.next_token_ids[i]
    return VerifyResult(num_accepted, next_ids)


def _take(rows: list[int], B: int, device: torch.device):
    """The function t -> t[rows] for one subset of a batch's B rows; t itself (no copy) when the subset
    is every row, in order, as at batch 1."""
    if rows == list(range(B)):
        return lambda t: t
    index = torch.tensor(rows, device=device)
    return lambda t: [t[r] for r in rows] if isinstance(t, list) else t[index]


def _exact_match(draft_token_ids: torch.Tensor, target_probs: torch.Tensor, generators: Sequence[torch.Generator],
                 num_draft: list[int]) -> tuple[list[int], list[int]]:
    """Rows with q_i = one-hot(x_i): at each position draw y_i ~ p_i; accept x_i iff y_i == x_i,
    else emit y_i. That is Alg. 1 for a one-hot q: x_i is accepted with probability p_i(x_i) =
    min(1, p_i(x_i) / q_i(x_i)), and a rejected row's y_i follows p_i without x_i, which is the
    residual max(0, p_i - q_i) / Z. The draws are plain decoding's own draws in plain decoding's
    order, so a seeded row emits what it would emit with no drafter at all. Returns (accepted,
    next token) per row; draft_token_ids [B, k], target_probs [B, k+1, V] or a ProbRows per row."""
    B = len(generators)
    num_accepted, next_ids = [0] * B, [0] * B
    drafts = draft_token_ids.tolist()
    alive = list(range(B))
    for i in range(draft_token_ids.shape[1] + 1):
        p_i = (torch.stack([target_probs[b][i] for b in alive]) if isinstance(target_probs, list)
               else target_probs[alive, i])  # [alive, V]
        y = sample(p_i, [generators[b] for b in alive]).tolist()  # one read of the device per position
        still = []
        for b, t in zip(alive, y):
            if i < num_draft[b] and t == drafts[b][i]:
                still.append(b)
            else:
                num_accepted[b], next_ids[b] = i, t
        alive = still
        if not alive:
            break
    return num_accepted, next_ids


def _accept_or_recover(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                       generators: Sequence[torch.Generator], num_draft: torch.Tensor) -> VerifyResult:
    """Rows whose drafts were sampled from q: accept x_i while u_i * q_i(x_i) < p_i(x_i), then one
    token from the residual at the first rejection or the bonus distribution p_{n+1}. A few rows on
    the CPU go row by row (``_accept_or_recover_row``: the same draws and decisions in a third of the
    tensor ops, which cost 5-20 µs each right after a forward), others batched."""
    if isinstance(target_probs, list) or (target_probs.device.type == "cpu" and len(generators) <= ROW_BY_ROW):
        rows = [_accept_or_recover_row(draft_token_ids[b], draft_probs[b], target_probs[b], g, n)
                for b, (g, n) in enumerate(zip(generators, num_draft.tolist()))]
        return VerifyResult([n for n, _ in rows], [t for _, t in rows])
    return _accept_or_recover_batched(draft_token_ids, draft_probs, target_probs, generators, num_draft)


def _accept_or_recover_batched(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                               generators: Sequence[torch.Generator], num_draft: torch.Tensor) -> VerifyResult:
    """``_accept_or_recover`` over the batch's tensors: draft_token_ids [B, k], draft_probs [B, k, V],
    target_probs [B, k+1, V], num_draft [B]."""
    B, k = draft_token_ids.shape
    device = target_probs.device
    p_draft = target_probs[:, :k].gather(-1, draft_token_ids[..., None]).squeeze(-1)  # [B, k]: p_i(x_i)
    q_draft = draft_probs.gather(-1, draft_token_ids[..., None]).squeeze(-1)  # [B, k]: q_i(x_i)
    u = torch.ones(B, k, device=device)  # [B, k]; past a row's drafts never read
    for b, (g, n) in enumerate(zip(generators, num_draft.tolist())):
        u[b, :n] = torch.rand(n, generator=g, device=device)  # only the uniforms this row uses
    drafted = torch.arange(k, device=device) < num_draft[:, None]  # [B, k]
    accepted = ((u * q_draft < p_draft) & drafted).int()  # u < p/q without dividing; q(x) > 0 as x ~ q
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)  # [B]

    # The distribution of the one extra token: residual at the first rejection, p_{n+1} after full acceptance.
    rows = torch.arange(B, device=device)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    rejected = num_accepted < num_draft  # otherwise every draft was accepted: p_next is the bonus distribution
    if bool(rejected.any()):
        q_at = draft_probs[rows, num_accepted.clamp(max=k - 1)]  # [B, V]
        residual = (p_next - q_at).clamp(min=0)
        mass = residual.sum(dim=-1, keepdim=True)
        # mass is > 0 whenever a rejection can happen (p != q); fall back to p only against rounding
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
        p_next = torch.where(rejected[:, None], residual, p_next)
    next_ids = sample(p_next, generators)
    return VerifyResult(num_accepted.tolist(), next_ids.tolist())


def _accept_or_recover_row(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                           generator: torch.Generator, n: int) -> tuple[int, int]:
    """``_accept_or_recover`` for one row: draft_token_ids [k], draft_probs [k, V], target_probs [k+1, V]
    (or its ProbRows, read up to the first rejection), its first n drafts proposed. Draws what the batched
    rule draws for the row, in the same order (n uniforms, then one draw), and decides alike: (accepted,
    the recovered or bonus token)."""
    k = draft_token_ids.shape[0]
    ids, at = draft_token_ids[:n], torch.arange(n)
    u = torch.rand(n, generator=generator)  # [n]
    bars = (u * draft_probs[at, ids]).tolist()  # u_i q_i(x_i), float32 products as the batched rule makes them
    accepted = next((i for i, (bar, x) in enumerate(zip(bars, ids.tolist())) if not bar < float(target_probs[i][x])), n)
    p_next = target_probs[accepted]  # [V]
    if accepted < n:  # the residual at the first rejection, drawn from as it is (its scale does not change a draw)
        residual = (p_next - draft_probs[min(accepted, k - 1)]).clamp_(min=0)
        if residual.sum() > 0:  # whenever a rejection can happen (p != q); p itself only against rounding, as batched
            p_next = residual
    return accepted, draw(p_next, generator)
