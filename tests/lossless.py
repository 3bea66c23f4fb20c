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


def exact_joint(hf_model, prompt: list[int], params, n_tokens: int, vocab_size: int) -> np.ndarray:
    """Exact target probabilities [V ** n_tokens] of the first ``n_tokens`` outputs after ``prompt``,
    with the request's logit processing (outcome (t1, t2, ..) at index t1 * V ** (n-1) + t2 * ..)."""
    from specdec.sampling import SamplingBatch, probs_from_logits

    sb = SamplingBatch.from_params([params])
    joint, prefixes = torch.ones(1), [[]]
    for _ in range(n_tokens):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + p for p in prefixes])).logits[:, -1, :vocab_size]
        probs = torch.stack([probs_from_logits(row[None], sb)[0] for row in logits])  # [n_prefix, V]
        joint = (joint[:, None] * probs).reshape(-1)
        prefixes = [p + [t] for p in prefixes for t in range(vocab_size)]
    return joint.double().numpy()


def assert_first_tokens_follow_target(hf_model, prompt: list[int], tokens: np.ndarray, params, vocab_size: int) -> None:
    """Sampled outputs ``tokens`` [N, 3]: the joint of the first two and the marginal of the third
    must pass a chi-square test against the target's exact probabilities."""
    V = vocab_size
    joint2 = exact_joint(hf_model, prompt, params, 2, V)  # (t1, t2)
    assert chi_square_p(tokens[:, 0] * V + tokens[:, 1], joint2) > FALSE_ALARM
    third = exact_joint(hf_model, prompt, params, 3, V).reshape(V * V, V).sum(0)  # marginal of t3
    assert chi_square_p(tokens[:, 2], third) > FALSE_ALARM
