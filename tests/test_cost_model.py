"""The cost model (specdec/cost_model.py): hand-computed cases and properties."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specdec.cost_model import (
    best_k,
    expected_tokens,
    mean_expected_tokens,
    mean_round_cost,
    predicted_speedups,
    rank_acceptance,
    round_cost,
    speedup,
    tree_expected_tokens,
    tree_node_values,
)

rates = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


def test_expected_tokens_by_hand():
    for k in range(6):
        assert expected_tokens([1.0] * k, k) == k + 1  # every draft accepted, plus the bonus token
        assert expected_tokens([0.0] * k, k) == 1.0  # the first draft rejected: the recovered token alone
    assert expected_tokens([0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([0.9, 0.5, 0.2], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    # i.i.d. alpha: the closed form (1 - a^(k+1)) / (1 - a)
    assert expected_tokens([0.7] * 4, 4) == pytest.approx((1 - 0.7 ** 5) / 0.3)
    # no alphas beyond the second: no drafts beyond it either
    assert expected_tokens([1.0, 1.0], 4) == 3.0


def test_mean_expected_tokens_averages_the_sequences_for_every_k():
    assert mean_expected_tokens([[1.0, 1.0], [0.0, 0.0]], 2) == [1.0, 1.5, 2.0]
    assert mean_expected_tokens([[0.5]], 3) == [1.0, 1.5, 1.5, 1.5]
    alphas = [[0.9, 0.8, 0.3], [0.4, 0.6, 0.7], [0.2]]
    assert mean_expected_tokens(alphas, 3) == pytest.approx(
        [sum(expected_tokens(a, k) for a in alphas) / 3 for k in range(4)])


def test_round_cost_and_its_mean_over_proposal_lengths():
    v = [1.0, 1.2, 1.4]
    assert round_cost(2, 0.5, 1.4) == pytest.approx(2.4)
    assert round_cost(0, 0.5, 1.0) == 1.0  # plain decoding: one 1-token step
    assert mean_round_cost(2, 0.5, v) == pytest.approx(2.4)
    assert mean_round_cost(2, 0.5, v, [0, 0, 0]) == pytest.approx(2.4)  # nothing counted: every round drafts k
    # proposal lengths n = 0, 1, 1, 2 (asked for 2): at k = 2 the rounds draft 0, 1, 1, 2
    assert mean_round_cost(2, 0.5, v, [1, 2, 1]) == pytest.approx((1.0 + 2 * 1.7 + 2.4) / 4)
    # at k = 1 the round that proposed 2 drafts 1
    assert mean_round_cost(1, 0.5, v, [1, 2, 1]) == pytest.approx((1.0 + 3 * 1.7) / 4)


def test_speedup_is_tokens_per_cost_relative_to_a_plain_step():
    # E = 3 tokens for k = 2 drafts at c = 0.5 and v(2) = 1.4: 3 / 2.4 plain steps' worth
    assert speedup(3.0, round_cost(2, 0.5, 1.4)) == pytest.approx(3 / 2.4)
    # the unit does not matter: the same round in seconds, with a 10 ms plain step
    assert speedup(3.0, round_cost(2, 0.005, 0.014), 0.010) == pytest.approx(3 / 2.4)
    assert predicted_speedups([1.0, 1.0], 0.5, [1.0, 1.2, 1.4]) == pytest.approx([1.0, 2 / 1.7, 3 / 2.4])
    s = predicted_speedups([0.8, 0.6], 0.1, [1.0, 1.1, 1.3], [1, 0, 3])
    assert s[0] == 1.0  # S(0) = 1: plain decoding against itself
    assert s == pytest.approx([expected_tokens([0.8, 0.6], k) / mean_round_cost(k, 0.1, [1.0, 1.1, 1.3], [1, 0, 3])
                               for k in range(3)])


def test_best_k_is_the_argmax_above_break_even():
    assert best_k([1.0, 1.2, 1.5, 1.4]) == 2
    assert best_k([1.0, 0.9, 0.8]) == 0  # nothing beats plain decoding
    assert best_k([1.0, 1.3, 1.3]) == 1  # equals: the fewer drafts
    assert best_k([1.0, 1.05, 1.04], min_gain=0.06) == 0  # a gain inside the noise is no gain
    assert best_k([1.0, 1.06, 1.04], min_gain=0.06) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(rates, min_size=0, max_size=8), st.integers(min_value=0, max_value=8))
def test_expected_tokens_lies_in_1_to_k_plus_1_and_grows_with_k(alphas, k):
    e = expected_tokens(alphas, k)
    assert 1.0 <= e <= k + 1
    assert expected_tokens(alphas, k + 1) >= e  # one more draft never loses a token


@settings(max_examples=200, deadline=None)
@given(st.lists(rates, min_size=1, max_size=8), st.data())
def test_expected_tokens_is_monotone_in_acceptance(alphas, data):
    i = data.draw(st.integers(min_value=0, max_value=len(alphas) - 1))
    higher = alphas.copy()
    higher[i] = data.draw(st.floats(min_value=alphas[i], max_value=1.0))
    for k in range(len(alphas) + 1):
        assert expected_tokens(higher, k) >= expected_tokens(alphas, k)


@settings(max_examples=200, deadline=None)
@given(rates, st.floats(min_value=0.0, max_value=1.0), st.floats(min_value=1.0, max_value=2.0))
def test_one_draft_breaks_even_where_acceptance_exceeds_its_extra_cost(alpha, c, v1):
    """S(1) > 1 exactly when alpha_1 > c + v(1) - 1 (docs/algorithm.md, break-even)."""
    assume(abs(alpha - (c + v1 - 1.0)) > 1e-9)
    s1 = predicted_speedups([alpha], c, [1.0, v1])[1]
    assert (s1 > 1.0) == (alpha > c + v1 - 1.0)


# -- draft trees ---------------------------------------------------------------------------------------

def test_rank_acceptance_by_hand():
    assert rank_acceptance(0.6, 1, 0.5) == [0.6]
    assert rank_acceptance(0.6, 3, 0.5) == pytest.approx([0.6, 0.2, 0.1])
    assert sum(rank_acceptance(0.3, 50, 0.35)) == pytest.approx(1.0)  # the ranks exclude each other


def test_tree_expected_tokens_by_hand():
    # depth 1 ranks 0.5, 0.3; depth 2 the same. Best first: (d1 r1) 0.5, (d1 r2) 0.3, (d2 under r1) 0.25,
    # then (d2 under r2) 0.15 and (d2 r2 under r1) 0.15
    p = [[0.5, 0.3], [0.5, 0.3]]
    assert tree_expected_tokens(p, 5) == pytest.approx([1.0, 1.5, 1.8, 2.05, 2.2, 2.35])
    # (value, depth, rank) best first: a tree of 3 nodes is 2 deep and 2 wide
    assert tree_node_values(p, 3) == [(0.5, 1, 1), (0.3, 1, 2), (0.25, 2, 1)]
    # a tree that cannot grow further (2 depths x 2 children = 6 nodes) keeps its value
    full = tree_expected_tokens(p, 9)
    assert full[6:] == [full[6]] * 4 and full[6] == pytest.approx(1 + 0.8 + 0.8 * 0.8)


@settings(max_examples=60, deadline=None)
@given(st.lists(rates, min_size=1, max_size=6))
def test_a_tree_of_one_child_per_node_is_the_chain(alphas):
    k = len(alphas)
    tree = tree_expected_tokens([[a] for a in alphas], k + 2, max_children=1)
    assert tree[: k + 1] == pytest.approx([expected_tokens(alphas, n) for n in range(k + 1)])


def _parent_closed_best(p, num_nodes):
    """Brute force: the most valuable set of ``num_nodes`` nodes closed under parents."""
    import itertools

    nodes = []  # (path of ranks, value)
    frontier = [((), 1.0)]
    for probs in p:
        frontier = [(path + (j,), v * q) for path, v in frontier for j, q in enumerate(probs)]
        nodes += frontier
    best = 0.0
    for subset in itertools.combinations(range(len(nodes)), num_nodes):
        paths = {nodes[i][0] for i in subset}
        if all(len(q) == 1 or q[:-1] in paths for q in paths):
            best = max(best, sum(nodes[i][1] for i in subset))
    return best


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.floats(0.0, 0.5), min_size=2, max_size=2), min_size=1, max_size=3),
       st.integers(1, 4))
def test_best_first_picks_the_most_valuable_tree(p, n):
    """Picking nodes best first is optimal among all trees of n nodes (Sequoia's optimal tree)."""
    got = tree_expected_tokens(p, n)[n] - 1.0
    assert got == pytest.approx(_parent_closed_best(p, min(n, sum(2 ** (d + 1) for d in range(len(p))))), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(rates, min_size=1, max_size=6), st.integers(1, 4), st.floats(0.0, 1.0))
def test_more_nodes_never_lose_tokens_and_beat_the_chain(alphas, width, sibling):
    p = [rank_acceptance(a, width, sibling) for a in alphas]
    tree = tree_expected_tokens(p, 20, max_children=width)
    assert all(b >= a - 1e-12 for a, b in zip(tree, tree[1:]))
    for n in range(len(alphas) + 1):  # a tree of n nodes expects at least the chain of n drafts
        assert tree[n] >= expected_tokens(alphas, n) - 1e-12
