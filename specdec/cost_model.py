"""The speculative cost model (docs/algorithm.md, "Cost model"): tokens a round emits, what the round
costs, and the speedup over plain decoding that follows. Small pure functions, the one copy that the
adaptive controller (specdec/adaptive.py), the workbench's profile and the tests use.

    E(k) = 1 + Σ_{i≤k} Π_{j≤i} α_j        tokens per round, k drafts
    cost(k) = k·c + v(k)                   k draft steps of cost c, one verify pass of k+1 tokens per row
    S(k) = E(k) · t_1 / cost(k)            over plain decoding: one token per plain step of cost t_1

Conventions:
- k counts drafted tokens; the verify pass runs k + 1 tokens per row.
- acceptance is per draft position and conditional: ``alphas[i-1]`` is
  α_i = P(x_i accepted | x_1..x_{i-1} accepted). An i.i.d. α is ``[α] * k``, and E(k) is then
  (1 - α^(k+1)) / (1 - α). A sequence given fewer than k alphas drafts no further.
- E(k) counts the recovered or bonus token, as τ (mean acceptance length, specdec/metrics.py) does:
  E(k) ∈ [1, k+1], and E(0) = 1 is plain decoding.
- costs share one unit: the workbench measures them in 1-token target steps (t_1 = 1, v(0) = 1), the
  controller in seconds. S(0) = 1.
"""

from __future__ import annotations

from collections.abc import Sequence


def mean_expected_tokens(alphas_per_seq: Sequence[Sequence[float]], k_max: int) -> list[float]:
    """E(k) for k = 0..k_max, averaged over the sequences  [k_max + 1]. One pass per sequence: the
    controller calls it every round it weighs k."""
    out = [0.0] * (k_max + 1)
    for alphas in alphas_per_seq:
        run = total = 1.0
        out[0] += 1.0
        k = 0
        for k, a in zip(range(1, k_max + 1), alphas):
            run *= a  # Π_{j≤k} α_j: the chance that position k is accepted
            total += run
            out[k] += total
        for k in range(k + 1, k_max + 1):  # no alphas left: no more drafts, no more tokens
            out[k] += total
    n = len(alphas_per_seq)
    for k in range(k_max + 1):
        out[k] /= n
    return out


def expected_tokens(alphas: Sequence[float], k: int) -> float:
    """E(k) for one sequence whose conditional acceptance is ``alphas``."""
    return mean_expected_tokens([alphas], k)[k]


def round_cost(k: int, draft_cost: float, verify_cost: float) -> float:
    """k·c + v(k): k draft steps of ``draft_cost`` and one verify pass (k + 1 tokens per row) of
    ``verify_cost``."""
    return k * draft_cost + verify_cost


def mean_round_cost(k: int, draft_cost: float, verify_costs: Sequence[float],
                    draft_lengths: Sequence[int] | None = None) -> float:
    """``round_cost`` at k with ``verify_costs[n]`` = v(n), averaged over the proposal lengths when a
    drafter proposes fewer than asked: ``draft_lengths[n]`` counts the rounds that proposed n tokens
    when asked for the most, and asked for k, such a round drafts min(n, k). Without lengths (or with
    none counted) every round drafts k."""
    if not draft_lengths or sum(draft_lengths) == 0:
        return round_cost(k, draft_cost, verify_costs[k])
    total = sum(draft_lengths)
    return sum(count * round_cost(min(n, k), draft_cost, verify_costs[min(n, k)])
               for n, count in enumerate(draft_lengths)) / total


def speedup(tokens: float, cost: float, plain_step: float = 1.0) -> float:
    """S = E · t_1 / cost: a round's tokens per unit of time over plain decoding's one per ``plain_step``."""
    return tokens * plain_step / cost


def predicted_speedups(alphas: Sequence[float], draft_cost: float, verify_costs: Sequence[float],
                       draft_lengths: Sequence[int] | None = None) -> list[float]:
    """S(k) for k = 0..len(verify_costs)-1, costs in 1-token target steps (``verify_costs[0]`` = 1)."""
    k_max = len(verify_costs) - 1
    tokens = mean_expected_tokens([alphas], k_max)
    return [speedup(tokens[k], mean_round_cost(k, draft_cost, verify_costs, draft_lengths))
            for k in range(k_max + 1)]


def best_k(speedups: Sequence[float], min_gain: float = 0.0) -> int:
    """The break-even rule: the k with the highest S(k) (the smallest of equals), or 0, plain decoding,
    unless that S(k) reaches 1 + ``min_gain`` (a predicted gain inside the estimates' noise is none).
    ``speedups[0]`` is S(0) = 1."""
    best = max(range(len(speedups)), key=speedups.__getitem__)
    return best if speedups[best] >= 1.0 + min_gain else 0
