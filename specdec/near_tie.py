"""Where greedy speculative output may part from plain greedy output: a measured near-tie.

A verify pass computes the same logits as one-token steps up to floating-point rounding. Where
the target's top-2 logits are closer than that rounding, the two paths may pick different
tokens; anywhere else they must not. The rounding depends on the weights' dtype: float32 sums
differ by ~1e-5, while bfloat16 matrix products round their results to 8 significant bits, so
two logits within a couple of bf16 steps of each other (2^-6 of their size) are a tie. 16-bit
weights multiplied in float32 (the ``w16`` kernel, models/linear16.py) round like float32.
"""

from __future__ import annotations

import torch

from specdec.models.base import next_token_logits

FLOAT32_NEAR_TIE = 1e-3  # logits; 100x the float32 differences measured between the two paths
BF16_RELATIVE_STEP = 2.0**-6  # two bf16 rounding steps (8 significant bits), relative to the logit


def near_tie_threshold(runner, top_logit: float) -> float:
    """The top-2 gap below which ``runner``'s rounding can reorder two logits of this size."""
    head = getattr(runner, "lm_head", None)  # every Linear of a runner takes the same kind
    if runner.dtype in (torch.bfloat16, torch.float16) and getattr(head, "kind", None) != "w16":
        return max(FLOAT32_NEAR_TIE, abs(top_logit) * BF16_RELATIVE_STEP)
    return FLOAT32_NEAR_TIE


def top2(runner, token_ids: list[int]) -> tuple[float, float]:
    """(top logit, top-2 gap) of the next token after ``token_ids``, from a fresh cache row."""
    logits = next_token_logits(runner, [list(token_ids)], row_tag="__specdec_near_tie__")[0]  # [V]
    top = logits.topk(2).values
    return float(top[0]), float(top[0] - top[1])


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (the shorter one's length when one is a
    prefix of the other); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def first_divergence(runner, prompt_ids: list[int], expected: list[int], got: list[int]) -> dict | None:
    """None where ``got`` equals ``expected``; else where they part, the target's top-2 gap there,
    the dtype's threshold and whether it is a near-tie (lossless) or not (a bug)."""
    j = first_mismatch(expected, got)
    if j is None:
        return None
    if j >= min(len(expected), len(got)):  # one stopped earlier: no token to compare, not a near-tie
        return {"position": j, "gap": None, "threshold": None, "near_tie": False}
    top, gap = top2(runner, list(prompt_ids) + list(expected[:j]))
    threshold = near_tie_threshold(runner, top)
    return {"position": j, "gap": gap, "threshold": threshold, "near_tie": gap < threshold}
