"""The speculative cost model (docs/algorithm.md, "Cost model"): tokens a round emits, what the round
costs, and the speedup over plain decoding that follows. Small pure functions, the one copy that the
adaptive controller (specdec/adaptive/), the workbench's profile and the tests use.

    E(k) = 1 + Σ_{i≤k} Π_{j≤i} α_j        tokens per round, k drafts
    cost(k) = k·c + v(k)                   k draft steps of cost c, one verify pass of k+1 tokens per row
    cost(k) = c(k) + v(k)                  a parallel draft (PARD): one forward drafts all k, c(k) its cost
    S(k) = E(k) · t_1 / cost(k)            over plain decoding: one token per plain step of cost t_1

Conventions:
- k counts drafted tokens; the verify pass runs k + 1 tokens per row.
- acceptance is per draft position and conditional: ``alphas[i-1]`` is
  α_i = P(x_i accepted | x_1..x_{i-1} accepted). An i.i.d. α is ``[α] * k``, and E(k) is then
  (1 - α^(k+1)) / (1 - α). A sequence given fewer than k alphas drafts no further.
- E(k) counts the recovered or bonus token, as τ (mean acceptance length, specdec/metrics.py) does:
  E(k) ∈ [1, k+1], and E(0) = 1 is plain decoding.
- a draft's cost has one of two shapes (``draft_passes``): an autoregressive draft (a draft model,
  an EAGLE-3 head, the target's early layers) runs one step per drafted token, so c is per token; a
  parallel draft (drafters/pard.py) runs one forward over the history and k - 1 masks whatever k, so
  c is per round, and c(k) only grows with the masks that forward carries (measured, not assumed flat).
- costs share one unit: the workbench measures them in 1-token target steps (t_1 = 1, v(0) = 1), the
  controller in seconds. S(0) = 1.
"""

from __future__ import annotations

import heapq
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


def draft_passes(k: int, parallel: bool = False) -> int:
    """Draft passes a round of k drafts runs: k for an autoregressive draft, one for a parallel draft
    (none at k = 0: plain decoding drafts nothing)."""
    return min(k, 1) if parallel else k


def round_cost(k: int, draft_cost: float, verify_cost: float, parallel: bool = False) -> float:
    """k·c + v(k): k draft steps of ``draft_cost`` and one verify pass (k + 1 tokens per row) of
    ``verify_cost``; ``parallel``: c + v(k), one draft forward of ``draft_cost`` (c(k), its cost at k)."""
    return draft_passes(k, parallel) * draft_cost + verify_cost


def draft_cost_at(draft_cost: float | Sequence[float], k: int) -> float:
    """c, or c(k) when ``draft_cost`` gives one per k (a parallel draft's forward grows with its masks)."""
    return draft_cost if isinstance(draft_cost, (int, float)) else draft_cost[k]


def mean_round_cost(k: int, draft_cost: float | Sequence[float], verify_costs: Sequence[float],
                    draft_lengths: Sequence[int] | None = None, parallel: bool = False) -> float:
    """``round_cost`` at k with ``verify_costs[n]`` = v(n), averaged over the proposal lengths when a
    drafter proposes fewer than asked: ``draft_lengths[n]`` counts the rounds that proposed n tokens
    when asked for the most, and asked for k, such a round drafts min(n, k). Without lengths (or with
    none counted) every round drafts k. ``draft_cost``: c, or c(n) for n = 0..k_max."""
    if not draft_lengths or sum(draft_lengths) == 0:
        return round_cost(k, draft_cost_at(draft_cost, k), verify_costs[k], parallel)
    total = sum(draft_lengths)
    return sum(count * round_cost(min(n, k), draft_cost_at(draft_cost, min(n, k)), verify_costs[min(n, k)], parallel)
               for n, count in enumerate(draft_lengths)) / total


def speedup(tokens: float, cost: float, plain_step: float = 1.0) -> float:
    """S = E · t_1 / cost: a round's tokens per unit of time over plain decoding's one per ``plain_step``."""
    return tokens * plain_step / cost


def predicted_speedups(alphas: Sequence[float], draft_cost: float | Sequence[float], verify_costs: Sequence[float],
                       draft_lengths: Sequence[int] | None = None, parallel: bool = False) -> list[float]:
    """S(k) for k = 0..len(verify_costs)-1, costs in 1-token target steps (``verify_costs[0]`` = 1);
    ``draft_cost``: c, or c(k) per k; ``parallel``: one draft forward per round (``round_cost``)."""
    k_max = len(verify_costs) - 1
    tokens = mean_expected_tokens([alphas], k_max)
    return [speedup(tokens[k], mean_round_cost(k, draft_cost, verify_costs, draft_lengths, parallel))
            for k in range(k_max + 1)]


def best_k(speedups: Sequence[float], min_gain: float = 0.0) -> int:
    """The break-even rule: the k with the highest S(k) (the smallest of equals), or 0, plain decoding,
    unless that S(k) reaches 1 + ``min_gain`` (a predicted gain inside the estimates' noise is none).
    ``speedups[0]`` is S(0) = 1."""
    best = max(range(len(speedups)), key=speedups.__getitem__)
    return best if speedups[best] >= 1.0 + min_gain else 0


# -- draft trees (tree.py) -----------------------------------------------------------------------------
#
# A tree round drafts N nodes and verifies 1 + N tokens per row in one pass (the root and the nodes).
# Its tokens are 1 + the expected length of the accepted root path. The model (Sequoia's "positional
# acceptance", kept simple): at depth d the child of rank j of an accepted node (j = 1 the drafter's
# most likely) is the one accepted with probability p[d][j], whatever the path above; the ranks
# exclude each other, so Σ_j p[d][j] <= 1. A node's value is the chance its whole path is accepted,
# the product of p along it, and a tree's expected tokens are 1 + the sum of its nodes' values:
#
#     E_tree = 1 + Σ_{nodes n} Π_{(d, j) on the path to n} p[d][j]
#
# A chain of k drafts is the tree with one child per node, and E_tree is then E(k) above. The best
# tree of N nodes takes the N most valuable nodes of the infinite tree, best first (EAGLE-2's
# expansion by cumulative draft probability; Sequoia's optimal tree when p falls with rank and a
# child is worth at most its parent, as it is here).


def rank_acceptance(alpha: float, max_children: int, sibling: float) -> list[float]:
    """p[j] for ranks j = 1..max_children at one depth, from the chain's conditional acceptance
    ``alpha`` there (the top-ranked child is the chain's draft) and ``sibling``: the share of the
    remaining miss that each further sibling catches (the target's token was the draft's second
    choice, third, ...):  p[1] = α,  p[j] = (1 - α) · s · (1 - s)^(j-2)."""
    out = [alpha]
    miss = 1.0 - alpha
    for _ in range(1, max_children):
        out.append(miss * sibling)
        miss *= 1.0 - sibling
    return out


def tree_node_values(rank_probs: Sequence[Sequence[float]], num_nodes: int,
                     max_children: int | None = None) -> list[tuple[float, int, int]]:
    """The ``num_nodes`` most valuable nodes of a tree whose depth d (1-based) has rank acceptance
    ``rank_probs[d-1]`` (so the depth is at most len(rank_probs)), picked best first: a node may join
    once its parent and its next-better sibling have. Returns (value, depth, rank) per node, in
    the order picked (values non-increasing when p falls with rank)  [<= num_nodes]."""
    D = len(rank_probs)
    if D == 0 or num_nodes <= 0:
        return []
    probs = [sorted(p, reverse=True)[:max_children] if max_children else sorted(p, reverse=True)
             for p in rank_probs]
    # heap of candidates: (-value, tiebreak, depth, rank, parent value)
    heap = [(-probs[0][0], 0, 1, 0, 1.0)] if probs[0] else []
    out: list[tuple[float, int, int]] = []
    n = 1
    while heap and len(out) < num_nodes:
        neg, _, d, j, parent_value = heapq.heappop(heap)
        value = -neg
        out.append((value, d, j + 1))
        if j + 1 < len(probs[d - 1]):  # the next sibling
            heapq.heappush(heap, (-(parent_value * probs[d - 1][j + 1]), n, d, j + 1, parent_value))
            n += 1
        if d < D and probs[d]:  # its first child
            heapq.heappush(heap, (-(value * probs[d][0]), n, d + 1, 0, value))
            n += 1
    return out


def tree_expected_tokens(rank_probs: Sequence[Sequence[float]], max_nodes: int,
                         max_children: int | None = None) -> list[float]:
    """E_tree(N) for N = 0..max_nodes: the expected tokens of a round that drafts the best tree of N
    nodes (``tree_node_values``) and verifies it, bonus or recovered token included  [max_nodes + 1].
    E_tree(0) = 1 (plain decoding); a tree that cannot grow further keeps its last value."""
    values = tree_node_values(rank_probs, max_nodes, max_children)
    out = [1.0]
    for v, _, _ in values:
        out.append(out[-1] + v)
    out += [out[-1]] * (max_nodes + 1 - len(out))
    return out

