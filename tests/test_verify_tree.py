"""The tree verifier on hand-built distributions: greedy paths, recovered and bonus tokens, seeds, and
exactness (chi-square) for random trees of sampled siblings and of deterministic candidates."""

import numpy as np
import pytest
import torch

from lossless import FALSE_ALARM, chi_square_p

from specdec.config import SamplingParams
from specdec.sampling import SamplingBatch, make_generator, probs_from_logits, sample
from specdec.tree import DraftTree
from specdec.verify_tree import verify_tree

V = 6
GREEDY = SamplingBatch.from_params([SamplingParams(temperature=0)])


def one_hot_logits(*best):
    """[1, len(best), V] logits whose argmax at each position is given."""
    t = torch.zeros(1, len(best), V)
    for i, tok in enumerate(best):
        t[0, i, tok] = 5.0
    return t


# node:                0  1  2  3  4
TREE = DraftTree([1, 2, 3, 4, 5], [-1, -1, 1, 1, 3])  # root -> {1, 2}; 2 -> {3, 4}; 4 -> {5}


def test_greedy_follows_the_argmax_down_the_second_branch_and_takes_the_bonus_at_a_leaf():
    # after root: 2 (node 1); after node 1: 4 (node 3); after node 3: 5 (node 4, a leaf); after node 4: 0
    logits = one_hot_logits(2, 0, 4, 0, 5, 0)
    r = verify_tree([TREE], logits, GREEDY, [make_generator(0)])
    assert r.accepted_nodes == [[1, 3, 4]] and r.next_token_ids == [0] and r.num_accepted == [3]


def test_greedy_recovers_the_argmax_where_no_child_matches():
    logits = one_hot_logits(2, 0, 0, 0, 0, 0)  # after node 1 the argmax 0 is neither child (3, 4)
    r = verify_tree([TREE], logits, GREEDY, [make_generator(0)])
    assert r.accepted_nodes == [[1]] and r.next_token_ids == [0]


def test_no_tree_is_plain_decoding():
    r = verify_tree([None, DraftTree([], [])], one_hot_logits(3).expand(2, 1, V), SamplingBatch.from_params(
        [SamplingParams(temperature=0)] * 2), [make_generator(0)] * 2)
    assert r.accepted_nodes == [[], []] and r.next_token_ids == [3, 3]


def test_a_sibling_drawn_twice_from_a_one_hot_q_is_an_error():
    q = torch.zeros(2, V)
    q[:, 1] = 1.0
    tree = DraftTree([1, 2], [-1, -1], q)
    with pytest.raises(ValueError, match="without replacement"):
        for seed in range(20):  # the first child is accepted with p(1) only
            verify_tree([tree], torch.zeros(1, 3, V), SamplingBatch.from_params([SamplingParams()]),
                        [make_generator(seed)])


def test_deterministic_candidates_emit_what_seeded_plain_decoding_emits():
    """One draw from p per level: the emitted tokens are plain decoding's own draws with the same seed."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 1 + TREE.num_nodes, V, generator=g)
    sb = SamplingBatch.from_params([SamplingParams(temperature=1.0)])
    p = probs_from_logits(logits, sb)[0]  # [1 + N, V]
    for seed in range(40):
        r = verify_tree([TREE], logits, sb, [make_generator(seed)])
        plain, node, gen = [], -1, make_generator(seed)
        while True:
            y = int(sample(p[node + 1][None], [gen])[0])
            plain.append(y)
            child = next((c for c in TREE.children(node) if TREE.token_ids[c] == y), None)
            if child is None:
                break
            node = child
        assert [TREE.token_ids[c] for c in r.accepted_nodes[0]] + r.next_token_ids == plain


def test_a_seeded_row_does_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    q = torch.softmax(torch.randn(TREE.num_nodes, V, generator=g), -1)
    sampled = DraftTree([1, 2, 3, 4, 5], TREE.parents, q)
    logits = torch.randn(3, 1 + TREE.num_nodes, V, generator=g)
    sb = SamplingBatch.from_params([SamplingParams(temperature=1.0), SamplingParams(temperature=0),
                                    SamplingParams(temperature=0.7, top_k=3)])
    for seed in range(20):
        alone = verify_tree([sampled], logits[:1], sb.select([0]), [make_generator(seed)])
        mixed = verify_tree([sampled, TREE, None], logits, sb,
                            [make_generator(seed), make_generator(7), make_generator(8)])
        assert (mixed.accepted_nodes[0], mixed.next_token_ids[0]) == (alone.accepted_nodes[0], alone.next_token_ids[0])


# -- exactness ---------------------------------------------------------------------------------------

def random_tree(rng: np.random.Generator, q_of, stochastic: bool):
    """A random tree of depth <= 3: 2-4 children at the root, 0-2 below. Stochastic: each node's children
    are drawn from q(its path) without replacement (the count decided before the draws); else distinct
    tokens picked at random (deterministic candidates as far as the verifier is concerned)."""
    tokens, parents, qs, paths = [], [], [], {-1: ()}
    frontier = [-1]
    for depth in range(3):
        nxt = []
        for node in frontier:
            m = int(rng.integers(2, 5)) if depth == 0 else int(rng.integers(0, 3))
            q = q_of(paths[node])  # [V]
            rest = q.numpy().astype(np.float64)
            for _ in range(m):
                if stochastic:
                    x = int(rng.choice(V, p=rest / rest.sum()))
                    rest[x] = 0.0
                else:
                    x = int(rng.choice([t for t in range(V) if t not in [tokens[c] for c in range(len(tokens))
                                                                         if parents[c] == node]]))
                tokens.append(x)
                parents.append(node)
                qs.append(q)
                paths[len(tokens) - 1] = paths[node] + (x,)
                nxt.append(len(tokens) - 1)
        frontier = nxt
    return DraftTree(tokens, parents, torch.stack(qs) if stochastic else None), paths


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_k=3),
                                    dict(temperature=1.0, top_p=0.7)], ids=["t1", "topk", "topp"])
@pytest.mark.parametrize("stochastic", [True, False], ids=["sampled-siblings", "deterministic"])
def test_first_two_tokens_follow_the_target(params, stochastic):
    """Random p and q over V = 6 for every context up to depth 3, a random tree per round: the first
    emitted token and the first two (the second from p after the first when the round emitted one)
    pass a chi-square test against p."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(123)
    target = {(): torch.randn(V)}  # context -> target logits after it [V]
    draft = {}

    def logits_after(path):
        if path not in target:
            target[path] = torch.randn(V)
        return target[path]

    def q_of(path):
        if path not in draft:
            draft[path] = torch.softmax(torch.randn(V) * 2, -1)  # unrelated to p: rejections happen
        return draft[path]

    N = 8_000
    sp = SamplingParams(**params)
    trees, rows = [], []
    for _ in range(N):
        tree, paths = random_tree(rng, q_of, stochastic)
        trees.append(tree)
        rows.append([logits_after(())] + [logits_after(paths[i]) for i in range(tree.num_nodes)])
    width = max(len(r) for r in rows)
    logits = torch.stack([torch.stack(r + [torch.zeros(V)] * (width - len(r))) for r in rows])  # [N, 1 + N_max, V]
    sb = SamplingBatch.from_params([sp] * N)
    r = verify_tree(trees, logits, sb, [make_generator(10_000 + i) for i in range(N)])

    one = SamplingBatch.from_params([sp])
    p1 = probs_from_logits(logits_after(())[None], one)[0]
    p2 = torch.stack([probs_from_logits(logits_after((t,))[None], one)[0] for t in range(V)])  # [V, V] p(t2 | t1)
    first_two = np.zeros(N, dtype=np.int64)
    deep = 0
    for b, (tree, path, nxt) in enumerate(zip(trees, r.accepted_nodes, r.next_token_ids)):
        emitted = [tree.token_ids[c] for c in path] + [nxt]
        if len(emitted) < 2:  # the next round starts after t1: draw t2 from p(. | t1)
            emitted.append(int(sample(p2[emitted[0]][None], [g])[0]))
        deep += len(path) >= 2
        first_two[b] = emitted[0] * V + emitted[1]
    assert deep > N // 50, "too few rounds accepted two drafts to test paths below the root's children"
    assert chi_square_p(first_two // V, p1.double().numpy()) > FALSE_ALARM
    joint = (p1[:, None] * p2).reshape(-1).double().numpy()
    assert chi_square_p(first_two, joint) > FALSE_ALARM
