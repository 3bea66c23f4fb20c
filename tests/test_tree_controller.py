"""The adaptive controller sizes draft trees (AdaptiveK.choose_tree / record_tree): trees where the
verify pass is flat enough for them to beat the best chain, chains on steep backends and large
batches, and what tree rounds accept and cost corrects the prediction."""

import random

import pytest

from specdec.adaptive import DECAY, AdaptiveK, Timing
from specdec.adaptive.trees import TREE_DECIDE_ROUNDS
from specdec.cost_model import rank_acceptance, speedup, tree_expected_tokens, tree_node_values
from specdec.tree import DraftTree


def measured(t1: float, slope: float, batch: int = 1, draft: float = 0.0005, k: int = 4) -> AdaptiveK:
    """A controller that has timed plain steps and chain verify passes of 2..k+1 tokens at ``batch``:
    t_v(T) = t1 * (1 + slope * (T - 1)), ``draft`` seconds per drafted position."""
    ctrl = AdaptiveK(k)
    for T in range(1, k + 2):
        em = ctrl.verify_time.setdefault((batch, T), Timing(skip=0))
        for _ in range(4):
            em.update(t1 * (1 + slope * (T - 1)))
    ctrl.costs.draft_time.setdefault(batch, Timing(skip=0)).update(draft)
    ctrl.costs.plain_measured_at[batch] = 0
    return ctrl


def test_a_flat_verify_pass_gets_a_tree_and_a_steep_one_a_chain():
    # torch on this CPU: t(1, 2, 3, 5, 9) = 9.38, 8.65, 9.07, 10.04, 10.18 ms; llama.cpp: 3.99 .. 8.99 ms
    flat = measured(0.0094, 0.01)
    shape = flat.choose_tree([0], 16, 4, 4, force=False)
    assert shape is not None and shape.max_children >= 2 and 4 < shape.num_nodes <= 16 and shape.max_depth <= 4
    steep = measured(0.0040, 0.16)
    assert steep.choose_tree([0], 16, 4, 4, force=False) is None


def test_large_batches_draft_chains():
    """The verify pass of 8 rows grows with every token (the batch is 8x the tokens): no tree pays."""
    ids = list(range(8))
    ctrl = measured(0.020, 0.12, batch=8)
    assert ctrl.choose_tree(ids, 16, 4, 4, force=False) is None
    assert measured(0.020, 0.005, batch=8).choose_tree(ids, 16, 4, 4, force=False) is not None


def test_the_shape_is_the_cost_models_best_tree():
    """(N, depth) maximise E_tree(N) * t1 / (depth * c_tree + t_v(1 + N)) over every depth limit, with
    the prior's tree (no tree round yet)."""
    t1, slope, draft = 0.010, 0.02, 0.0004
    ctrl = measured(t1, slope, draft=draft)
    shape = ctrl.choose_tree([0], 12, 3, 4, force=False)
    alphas = ctrl.acceptance.mean_alphas([0], 4)
    p = [rank_acceptance(a, 3, ctrl.trees.sibling_rate()) for a in alphas]
    line = ctrl.costs.tree_verify_line(1)
    s = {}
    for limit in range(1, 5):
        E = tree_expected_tokens(p[:limit], 12, 3)
        for n in range(1, 13):
            nodes = tree_node_values(p[:limit], n, 3)  # (value, depth, rank)
            depth, width = max(d for _, d, _ in nodes), max(j for _, _, j in nodes)
            s[(n, depth, width)] = speedup(E[n], depth * 1.25 * draft + line(n + 1), t1)
    best = max(s, key=s.get)
    assert (shape.num_nodes, shape.max_depth, shape.max_children) == best
    assert best[2] >= 2 and s[best] > 1.05 * max(ctrl.speedups(1, [alphas]))


def test_force_always_returns_a_tree_within_the_limits():
    for slope in (0.0, 0.2, 1.0):
        ctrl = measured(0.004, slope)
        shape = ctrl.choose_tree([0], 10, 3, 5, force=True)
        assert shape is not None and 2 <= shape.num_nodes <= 10 and shape.max_depth <= 5
        assert 2 <= shape.max_children <= 3
    fresh = AdaptiveK(4)  # nothing measured, plain steps not timed: still a shape
    assert fresh.choose_tree([0], 16, 4, 4, force=True) is not None
    assert fresh.choose_tree([0], 16, 4, 4, force=False) is None  # plain steps come first
    assert measured(0.004, 0.0).choose_tree([0], 16, 1, 4, force=True).max_children == 1  # top_k 1: a chain


def test_trees_whose_siblings_catch_nothing_fall_back_to_chains():
    """Each depth's top draft is accepted with probability 0.8 and a sibling never is: a tree accepts
    what its best chain would, for a wider pass. The prior predicts more; what tree rounds accept
    corrects it, and the controller returns to chains."""
    rnd = random.Random(0)

    def accepted(depth):  # the top-ranked path, 0.8 per depth
        n = 0
        while n < depth and rnd.random() < 0.8:
            n += 1
        return n

    ctrl = measured(0.0094, 0.015)
    chosen = []
    for _ in range(150):
        shape = ctrl.choose_tree([0], 16, 4, 4, force=False)
        chosen.append(shape)
        if shape is None:
            k = ctrl.choose([0])[0]
            ctrl.record([0], [k], [accepted(k)], 0.0005 * k, 0.0094 * (1 + 0.015 * k))
        else:
            tree = _tree_of(shape)
            a = accepted(shape.max_depth)
            ctrl.record_tree([0], [tree.num_nodes], [a], 0.0005 * shape.max_depth,
                             0.0094 * (1 + 0.015 * tree.num_nodes), trees=[tree], paths=[_first_children(tree)[:a]])
    assert chosen[0] is not None and ctrl.trees.sibling_rate() < 0.25
    assert sum(s is not None for s in chosen[-50:]) <= 5


def _tree_of(shape) -> DraftTree:
    """A tree of the shape: the chain of first children max_depth deep, then further children of its
    nodes (ranks 2, 3, ..) up to num_nodes."""
    parents = [-1] + list(range(shape.max_depth - 1))
    rank = 1
    while len(parents) < shape.num_nodes and rank < shape.max_children:
        for p in [-1] + list(range(shape.max_depth - 1)):
            if len(parents) < shape.num_nodes:
                parents.append(p)
        rank += 1
    return DraftTree(list(range(len(parents))), parents)


def _first_children(tree: DraftTree) -> list[int]:
    path, node = [], -1
    while tree.children(node):
        node = tree.children(node)[0]
        path.append(node)
    return path


def test_tree_passes_timed_steeper_than_the_chain_line_switch_trees_off():
    ctrl = measured(0.0094, 0.01)
    shape = ctrl.choose_tree([0], 16, 4, 4, force=False)
    assert shape is not None
    for _ in range(TREE_DECIDE_ROUNDS):  # the tree pass costs 3 steps: no tree pays
        assert ctrl.choose_tree([0], 16, 4, 4, force=False) == shape  # the decision stands a few rounds
        ctrl.record_tree([0], [shape.num_nodes], [3], 0.002, 3 * 0.0094)
    line = ctrl.costs.tree_verify_line(1)
    assert line(shape.num_nodes + 1) / line(1) > 2
    assert ctrl.choose_tree([0], 16, 4, 4, force=False) is None


def test_trees_accepting_as_predicted_keep_the_calibration_and_record_tokens_per_pass():
    ctrl = measured(0.0094, 0.01, batch=2)
    for _ in range(30):
        shape = ctrl.choose_tree([0, 1], 16, 4, 4, force=False)
        assert shape is not None
        n = shape.num_nodes
        expected = ctrl.trees.prior[n] - 1  # accept, on average, what the model predicts
        lo = int(expected)
        acc = [lo, lo + 1] if expected - lo > 0.5 else [lo, lo]
        ctrl.record_tree([0, 1], [n, n], acc, 0.002, 0.0094 * 1.2)
    assert ctrl.trees.calibration() == pytest.approx(1.0, abs=0.25)
    assert sum(em.value for em in ctrl.trees.tokens.values()) > 0 and all(N <= 16 for N in ctrl.trees.tokens)
    assert 2 in {b for b, _ in ctrl.costs.tree_verify_time} and 2 in ctrl.costs.tree_draft_time


def test_the_decision_is_not_weighed_again_while_nothing_it_reads_changes(monkeypatch):
    """Speculation off, plain rounds: the tree decision is kept, not recomputed every round."""
    ctrl = measured(0.0040, 0.16)
    calls = []
    decide = ctrl.trees.decide
    monkeypatch.setattr(ctrl.trees, "decide", lambda *a: calls.append(a) or decide(*a))
    for _ in range(50):
        assert ctrl.choose_tree([0], 16, 4, 4, force=False) is None
        ctrl.record([0], [0], [0], 0.0, 0.004)
    assert len(calls) == 1
    ctrl.choose_tree([0, 1], 16, 4, 4, force=False)  # another batch size: weighed anew (if it is timed)
    ctrl.choose_tree([0], 16, 4, 4, force=True)  # other arguments: weighed anew
    assert len(calls) == 2


def test_tree_rounds_teach_the_chains_acceptance_and_the_siblings_rate():
    """Root children A, B; A's children C, D; C's child E (siblings in rank order). Path [A, D]: the
    chain of first children (A, C, E) would have accepted A only; at A the first child missed and
    the second caught it. Path [B]: the chain accepted nothing; a sibling caught. Path []: all missed."""
    tree = DraftTree([10, 11, 12, 13, 14], [-1, -1, 0, 0, 2])
    ctrl = AdaptiveK(4)
    ctrl.record_tree([0, 1, 2], [5, 5, 5], [2, 1, 0], 0.001, 0.01, trees=[tree] * 3, paths=[[0, 3], [1], []])
    seqs = ctrl.acceptance.seqs
    assert seqs[0].reached == [1.0, 1.0, 0.0] and seqs[0].accepted == [1.0, 0.0, 0.0]
    assert seqs[1].reached == [1.0, 0.0, 0.0] and seqs[1].accepted == [0.0, 0.0, 0.0]
    d = DECAY ** (1 / 3)  # decayed per row, as the batch-wide acceptance counts are
    assert ctrl.trees.sibling_tried == pytest.approx((d + 1) * d + 1)
    assert ctrl.trees.sibling_caught == pytest.approx((d + 1) * d)


def _full_tree(depth: int, width: int) -> DraftTree:
    tokens, parents, frontier = [], [], [-1]
    for _ in range(depth):
        nxt = []
        for p in frontier:
            for _ in range(width):
                parents.append(p)
                tokens.append(len(tokens))
                nxt.append(len(tokens) - 1)
        frontier = nxt
    return DraftTree(tokens, parents)


def test_the_measured_rates_converge_to_the_true_ones():
    """A world where each first child is accepted with 0.7 and each further sibling catches 0.6 of the
    remaining miss (cost_model.rank_acceptance's model): the controller's estimates get there."""
    rnd = random.Random(1)
    tree = _full_tree(3, 3)
    kids = {}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
    ctrl = AdaptiveK(3)
    for _ in range(400):
        path, node = [], -1
        while node in kids:
            hit = next((c for r, c in enumerate(kids[node]) if rnd.random() < (0.7 if r == 0 else 0.6)), None)
            if hit is None:
                break
            path.append(hit)
            node = hit
        ctrl.record_tree([0], [tree.num_nodes], [len(path)], 0.001, 0.01, trees=[tree], paths=[path])
    assert ctrl.trees.sibling_rate() == pytest.approx(0.6, abs=0.1)
    assert ctrl.acceptance.batch_alphas(3)[0] == pytest.approx(0.7, abs=0.1)


def test_after_tree_rounds_the_chain_is_weighed_anew():
    """Chains switched off after rounds that accepted nothing, then trees ran and measured good
    acceptance: when trees stop paying, choose() weighs chains again instead of keeping the old 'off'
    until a probe."""
    ctrl = measured(0.010, 0.05)
    for _ in range(40):
        k = ctrl.choose([0])[0]
        if k == 0:
            break
        ctrl.record([0], [k], [0], 0.0005 * k, 0.010 * (1 + 0.05 * k))
    assert k == 0 and ctrl.prober.off_rounds > 0  # the chain is off
    tree = _full_tree(4, 2)
    first = [0, 2, 6, 14]  # the first children's path, accepted to the end
    for _ in range(20):
        ctrl.record_tree([0], [tree.num_nodes], [4], 0.002, 0.02, trees=[tree], paths=[first])
    assert ctrl.choose([0])[0] > 0
