"""Log probabilities under the target of the tokens a sequence emits and of its prompt (vLLM's
``SamplingParams.logprobs`` / ``prompt_logprobs``).

Every emitted token (accepted draft, recovered or bonus alike) gets the target's distribution at
its own position of the verify pass, so logprobs with speculation equal plain decoding's. Modes,
with vLLM's names (``LLM(logprobs_mode=...)``):
- ``raw_logprobs`` (the default, as in vLLM): log_softmax of the model's logits, before temperature,
  penalties, biases, grammar masks and top-k / top-p / min-p;
- ``processed_logprobs``: the log of the distribution the token was drawn from, after all of those
  (greedy rows: without temperature). Tokens the processing removed get -inf.
Prompt logprobs are always raw (vLLM's too): no sampling processing applies to a prompt.

A position's dict holds the chosen token, ranked by vLLM's count of the tokens at least as likely
(1 = most likely), plus the top N with ranks 1..N.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from specdec.outputs import Logprob, PositionLogprobs
from specdec.sampling import SamplingBatch, probs_from_logits
from specdec.sequence import Sequence

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def check_logprobs_mode(mode: str) -> str:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {mode!r}: raw_logprobs are the "
                         "model's own distribution, processed_logprobs the one each token was sampled from")
    return mode


class TokenText:
    """Each token id's own text (``Logprob.decoded_token``), decoded once per id."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def position_logprobs(logprobs: torch.Tensor, chosen: Seq[int], num_top: Seq[int],
                      token_text: TokenText) -> list[PositionLogprobs]:
    """logprobs [M, V] (one distribution per position), chosen [M] token ids, num_top [M] -> one
    {token id: Logprob} per position: the chosen token plus the top num_top[m]."""
    chosen_ids = torch.tensor(list(chosen), device=logprobs.device)[:, None]  # [M, 1]
    chosen_lp = logprobs.gather(1, chosen_ids)  # [M, 1]
    ranks = (logprobs >= chosen_lp).sum(dim=-1).tolist()  # [M] vLLM's rank: tokens at least as likely
    n = min(max(num_top, default=0), logprobs.shape[-1])
    top_lp, top_ids = logprobs.topk(n, dim=-1) if n else (logprobs[:, :0], chosen_ids[:, :0])  # [M, n]
    out = []
    for m, (t, lp, rank, ids, lps) in enumerate(zip(chosen, chosen_lp[:, 0].tolist(), ranks, top_ids.tolist(),
                                                    top_lp.tolist())):
        d = {t: Logprob(lp, rank, token_text(t))}
        for r, (i, v) in enumerate(zip(ids[: num_top[m]], lps), start=1):
            if i != t:
                d[i] = Logprob(v, r, token_text(i))
        out.append(d)
    return out


def record_emitted(gained: Seq[tuple[Sequence, list[int]]], raw_logits: torch.Tensor | None, target_logits: torch.Tensor | None,
                   sampling: SamplingBatch, mode: str, token_text: TokenText) -> None:
    """After a round's commit: append to each sequence that asks for logprobs one dict per token it
    kept, and add the chosen tokens' logprobs to its cumulative_logprob. ``gained`` [B] in batch
    order; raw_logits [B, k+1, V] the model's, target_logits [B, k+1, V] as the verifier saw them
    (processed); a row's j-th kept token was chosen from position j."""
    rows = [b for b, (s, kept) in enumerate(gained) if kept and s.params.logprobs is not None]
    if not rows:
        return
    b_idx = [b for b in rows for _ in gained[b][1]]
    j_idx = [j for b in rows for j in range(len(gained[b][1]))]
    b_t = torch.tensor(b_idx, device=raw_logits.device)
    j_t = torch.tensor(j_idx, device=raw_logits.device)
    if mode == "raw_logprobs":
        logprobs = torch.log_softmax(raw_logits[b_t, j_t].float(), dim=-1)  # [M, V]
    else:
        logprobs = probs_from_logits(target_logits[b_t, j_t], sampling.select(b_idx)).log()  # [M, V]
    chosen = [t for b in rows for t in gained[b][1]]
    dicts = position_logprobs(logprobs, chosen, [gained[b][0].params.logprobs for b in b_idx], token_text)
    m = 0
    for b in rows:
        s, kept = gained[b]
        new = dicts[m : m + len(kept)]
        m += len(kept)
        s.logprobs.extend(new)
        s.cumulative_logprob += sum(d[t].logprob for d, t in zip(new, kept))


def prompt_logprobs(logits: torch.Tensor | None, prompt_token_ids: list[int], num_top: int,
                    token_text: TokenText) -> list[PositionLogprobs | None]:
    """logits [P-1, V] after prompt tokens 0..P-2 (None when P = 1) -> one dict per prompt token,
    None for the first (nothing predicts it). Raw: log_softmax of the model's logits."""
    if logits is None:
        return [None]
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [P-1, V]
    rest = prompt_token_ids[1:]
    return [None, *position_logprobs(logprobs, rest, [num_top] * len(rest), token_text)]
