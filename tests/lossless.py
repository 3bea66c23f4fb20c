"""Shared checks for losslessness: greedy equality up to measured near-ties, and chi-square tests."""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats

NEAR_TIE = 1e-3  # a divergence is allowed only where the target's top-2 logit gap is below this
FALSE_ALARM = 1e-3  # each chi-square test fails a correct engine with this probability


def top2_gap(hf_model, token_ids: list[int]) -> float:
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_greedy_equal(hf_model, prompt: list[int], expected: list[int], got: list[int],
                        near_tie: float = NEAR_TIE) -> None:
    """``got`` must equal ``expected`` (plain greedy) unless they part at a near-tie of the target
    (a top-2 logit gap below ``near_tie``). ``hf_model`` is anything that maps ids [1, T] to an
    object with ``.logits`` [1, T, V]."""
    for j, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            gap = top2_gap(hf_model, prompt + expected[:j])
            assert gap < near_tie, f"outputs diverge at token {j} ({a} vs {b}) where the top-2 gap is {gap:.2e}"
            return
    assert len(expected) == len(got), f"lengths differ: {len(expected)} vs {len(got)}"


def chi_square_p(samples: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of integer ``samples`` against ``probs``; bins expecting < 5 are merged."""
    n = len(samples)
    observed = np.bincount(samples, minlength=len(probs)).astype(float)
    assert observed[probs == 0].sum() == 0, "sampled an outcome the target gives probability 0"
    expected = probs * n
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    statistic = ((obs - exp) ** 2 / exp).sum()
    return float(stats.chi2.sf(statistic, df=len(obs) - 1))


def reference_processing(params, prompt_len: int, eos_token_ids=(), bad_words_ids=(), grammar_mask=None):
    """An independent reference for ``specdec.processing``: (ids, logits [V]) -> processed logits, built
    from transformers' own logits processors where they exist, in vLLM's order. ``grammar_mask(output
    ids) -> [V] bool`` stands in for a grammar."""
    from transformers import MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor, \
        RepetitionPenaltyLogitsProcessor

    p = params
    stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))

    def process(ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        x, row = torch.tensor([ids]), logits.float().clone()[None]  # [1, L], [1, V]
        if grammar_mask is not None:
            row[0, ~grammar_mask(ids[prompt_len:])] = float("-inf")
        if p.allowed_token_ids is not None:
            keep = torch.zeros(row.shape[-1], dtype=torch.bool)
            keep[p.allowed_token_ids] = True
            row[0, ~keep] = float("-inf")
        if bad_words_ids:
            row = NoBadWordsLogitsProcessor([list(w) for w in bad_words_ids], eos_token_id=None)(x, row)
        if p.min_tokens and stop_ids:
            row = MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, stop_ids)(x, row)
        for t, b in (p.logit_bias or {}).items():
            row[0, t] += b
        if p.repetition_penalty != 1.0:
            row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(x, row)
        counts = torch.bincount(torch.tensor(ids[prompt_len:], dtype=torch.long), minlength=row.shape[-1]).float()
        row[0] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return row[0]

    return process


def exact_joint(hf_model, prompt: list[int], params, n_tokens: int, vocab_size: int, process=None) -> np.ndarray:
    """Exact target probabilities [V ** n_tokens] of the first ``n_tokens`` outputs after ``prompt``,
    with the request's logit processing (outcome (t1, t2, ..) at index t1 * V ** (n-1) + t2 * ..).
    ``process(ids, logits [V])``: penalties and masks before temperature (``reference_processing``)."""
    from specdec.sampling import SamplingBatch, probs_from_logits

    sb = SamplingBatch.from_params([params])
    joint, prefixes = torch.ones(1), [[]]
    for _ in range(n_tokens):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + p for p in prefixes])).logits[:, -1, :vocab_size]
        if process is not None:
            logits = torch.stack([process(prompt + p, row) for p, row in zip(prefixes, logits)])
        probs = torch.stack([probs_from_logits(row[None], sb)[0] for row in logits])  # [n_prefix, V]
        joint = (joint[:, None] * probs).reshape(-1)
        prefixes = [p + [t] for p in prefixes for t in range(vocab_size)]
    return joint.double().numpy()


def assert_first_tokens_follow_target(hf_model, prompt: list[int], tokens: np.ndarray, params, vocab_size: int,
                                      process=None) -> None:
    """Sampled outputs ``tokens`` [N, 3]: the joint of the first two and the marginal of the third
    must pass a chi-square test against the target's exact probabilities."""
    V = vocab_size
    joint2 = exact_joint(hf_model, prompt, params, 2, V, process)  # (t1, t2)
    assert chi_square_p(tokens[:, 0] * V + tokens[:, 1], joint2) > FALSE_ALARM
    third = exact_joint(hf_model, prompt, params, 3, V, process).reshape(V * V, V).sum(0)  # marginal of t3
    assert chi_square_p(tokens[:, 2], third) > FALSE_ALARM
