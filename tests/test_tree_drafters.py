"""Draft trees from the drafters that branch: the draft model's dynamic (EAGLE-2) trees and suffix
decoding's trie branches. Each tree keeps its shape and its node order; the draft model's tree-pass
logits equal its chain-run logits on every path; after a tree round the drafter drafts what a fresh one
would on the same history; suffix trees' branches are the trie's counts."""

import copy

import pytest
import torch

from specdec.config import SamplingParams
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.models.base import ForwardBatch
from specdec.models.llama import LlamaRunner
from specdec.models.load import load_model
from specdec.sampling import SamplingBatch, make_generator, probs_from_logits
from specdec.sequence import Sequence
from specdec.tree import DraftTree, TreeShape
from tiny_models import make_model

SHAPES = [TreeShape(10, 4, 3), TreeShape(6, 6, 2), TreeShape(3, 1, 4), TreeShape(1, 1, 1)]
HISTORIES = [[3, 4, 5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, one_thread):
    return make_model(tmp_path_factory.mktemp("draft"), "llama", init_std=0.5)


def runner_of(folder) -> LlamaRunner:
    return LlamaRunner(load_model(str(folder)))


def seq(tokens: list[int], **params) -> Sequence:
    p = SamplingParams(**params)
    return Sequence(list(tokens), p, make_generator(p.seed), max_len=200)


def batch_of(seqs: list[Sequence]) -> SamplingBatch:
    return SamplingBatch.from_params([s.params for s in seqs])


def chain_logits(runner, history: list[int]) -> torch.Tensor:
    """The draft's logits after ``history``, run as a plain chain in a fresh row  [V]."""
    runner.sync_rows([("chain", len(history), tuple(history))])
    return runner.forward(ForwardBatch.from_rows([history], [0], logits="last"))[0]


def check_shape(tree: DraftTree, shape: TreeShape) -> None:
    assert 1 <= tree.num_nodes <= shape.num_nodes
    assert max(tree.depths()) <= shape.max_depth
    for node in range(-1, tree.num_nodes):
        assert len(tree.children(node)) <= shape.max_children
    assert all(p < i for i, p in enumerate(tree.parents))  # topological (DraftTree checks it too)


def check_against_chains(tree: DraftTree, history: list[int], ref_runner, sb: SamplingBatch, top_k: bool,
                         logits_after=None) -> None:
    """Every node's score is the product of q along its path, q from the draft run as a chain
    (``logits_after(path)``, default: ref_runner after history + path); with top-k siblings each node's
    children are the best tokens of q after its path, in order."""
    logits_after = logits_after or (lambda path: chain_logits(ref_runner, history + path))
    for node in [-1] + list(range(tree.num_nodes)):
        path = [tree.token_ids[j] for j in tree.path_to(node)] if node >= 0 else []
        q = probs_from_logits(logits_after(path)[None], sb)[0]  # [V]
        kids = tree.children(node)
        if top_k and kids:
            want = q.topk(len(kids)).indices.tolist()
            assert [tree.token_ids[c] for c in kids] == want
        for c in kids:
            base = 1.0 if node < 0 else tree.scores[node]
            assert tree.scores[c] == pytest.approx(base * float(q[tree.token_ids[c]]), rel=1e-3, abs=1e-6)
            if tree.draft_probs is not None:
                torch.testing.assert_close(tree.draft_probs[c], q, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_draft_model_tree_shape_and_paths(folder, shape):
    drafter, ref = DraftModelDrafter(runner_of(folder)), runner_of(folder)
    assert drafter.can_draft_trees
    seqs = [seq(HISTORIES[0], temperature=0)]
    sb = batch_of(seqs)
    (tree,) = drafter.propose_tree(seqs, [shape], sb)
    check_shape(tree, shape)
    assert tree.draft_probs is None
    assert tree.num_nodes == shape.num_nodes  # a random model's q has mass everywhere: the budget fills
    check_against_chains(tree, HISTORIES[0], ref, sb, top_k=True)
    root_q = probs_from_logits(chain_logits(ref, HISTORIES[0])[None], sb)[0]
    assert tree.token_ids[0] == int(root_q.argmax())  # the chain's first draft leads


def test_sampled_siblings_are_drawn_without_replacement(folder):
    drafter, ref = DraftModelDrafter(runner_of(folder), siblings="sampled"), runner_of(folder)
    shape = TreeShape(8, 3, 3)
    seqs = [seq(HISTORIES[0], temperature=1.0, seed=5)]
    sb = batch_of(seqs)
    (tree,) = drafter.propose_tree(seqs, [shape], sb)
    check_shape(tree, shape)
    assert tree.draft_probs is not None and tree.draft_probs.shape[0] == tree.num_nodes
    for node in range(-1, tree.num_nodes):
        kids = [tree.token_ids[c] for c in tree.children(node)]
        assert len(set(kids)) == len(kids)
    check_against_chains(tree, HISTORIES[0], ref, sb, top_k=False)
    again = DraftModelDrafter(runner_of(folder), siblings="sampled").propose_tree(
        [seq(HISTORIES[0], temperature=1.0, seed=5)], [shape], sb)[0]
    assert (again.token_ids, again.parents) == (tree.token_ids, tree.parents)  # seeded: reproducible
    # greedy rows keep top-k candidates beside sampled ones
    mixed = [seq(HISTORIES[1], temperature=0), seq(HISTORIES[0], temperature=1.0, seed=5)]
    g, s = drafter.propose_tree(mixed, [shape, shape], batch_of(mixed))
    assert g.draft_probs is None and s.draft_probs is not None
    assert (s.token_ids, s.parents) == (tree.token_ids, tree.parents)  # the batch does not change a seeded row


def test_sampled_tree_shape_does_not_depend_on_its_draws(folder):
    """The multi-candidate rule is exact only if no sampled node's own token decides whether it exists:
    the shape comes from the root's q (rank_tree) before any draw, whatever the seed draws."""
    from specdec.drafters.tree_expand import RankAcceptance, rank_tree

    shape = TreeShape(12, 4, 3)
    ref = runner_of(folder)
    seqs = [seq(HISTORIES[0], temperature=1.0, seed=seed) for seed in range(4)]
    trees = [DraftModelDrafter(runner_of(folder), siblings="sampled").propose_tree([s], [shape], batch_of([s]))[0]
             for s in seqs]
    assert len({tuple(t.parents) for t in trees}) == 1
    assert len({tuple(t.token_ids) for t in trees}) > 1  # the tokens are drawn
    plan = rank_tree(shape, RankAcceptance().probs(seqs[:1], shape.max_children)[0])  # a fresh drafter's rates
    assert sum(plan.values()) == trees[0].num_nodes == shape.num_nodes
    for node in range(-1, trees[0].num_nodes):
        ranks = tuple(trees[0].children(trees[0].parents[j]).index(j) for j in trees[0].path_to(node))
        assert len(trees[0].children(node)) == plan.get(ranks, 0)


def test_rank_acceptance_counts_the_accepted_siblings():
    """Rates per sibling rank from verified sampled trees: every child tried in order until one is accepted."""
    from specdec.drafters.tree_expand import PRIOR_RANK_ACCEPTANCE, RankAcceptance

    ranks = RankAcceptance(decay=1.0, prior_weight=0.0)
    q = torch.full((4, 5), 0.2)
    # root: children 0 (token 7) and 1 (token 8); node 1 has children 2 (token 9) and 3 (token 6)
    tree = DraftTree([7, 8, 9, 6], [-1, -1, 1, 1], q)
    rows = [seq([1, 2], temperature=1.0), seq([1, 2], temperature=1.0, seed=3)]
    ranks.propose(rows, [tree, tree])
    rows[0].token_ids += [8, 6, 4]  # rank 1 at the root, then rank 1 below it, then the bonus token
    rows[1].token_ids += [5]  # every root child rejected: 5 recovered
    ranks.observe(rows, [2, 0])
    assert ranks.all.tried == [3.0, 3.0] and ranks.all.hits == [0.0, 2.0]
    assert ranks.own[rows[1].seq_id].tried == [1.0, 1.0] and ranks.own[rows[1].seq_id].hits == []
    assert ranks.probs(rows, 2) == [[0.0, 2 / 3], [0.0, 0.0]]  # the seeded row reads only its own rounds
    assert RankAcceptance().probs(rows[:1], 2) == [list(PRIOR_RANK_ACCEPTANCE[:2])]


def test_batch_rows_equal_alone(folder):
    drafter = DraftModelDrafter(runner_of(folder))
    seqs = [seq(HISTORIES[0], temperature=0), seq(HISTORIES[1], temperature=0), seq([12, 13], temperature=0)]
    shapes = [SHAPES[0], SHAPES[1], None]
    together = drafter.propose_tree(seqs, shapes, batch_of(seqs))
    assert together[2] is None
    for s, shape, got in zip(seqs[:2], shapes, together):
        alone = DraftModelDrafter(runner_of(folder)).propose_tree([seq(s.token_ids, temperature=0)], [shape],
                                                                  batch_of([s]))[0]
        assert (got.token_ids, got.parents) == (alone.token_ids, alone.parents)
        assert got.scores == pytest.approx(alone.scores, rel=1e-3, abs=1e-6)


@pytest.mark.parametrize("accept", ["deep", "root_child", "none"])
def test_state_after_a_tree_round_equals_a_fresh_drafter(folder, accept):
    """Commit a path of the tree (kept in the draft cache by compaction, not fed again) plus a bonus
    token; the next proposals, tree and chain, equal a fresh drafter's on the same history."""
    runner = runner_of(folder)
    drafter = DraftModelDrafter(runner)
    s = seq(HISTORIES[0], temperature=0)
    shape = TreeShape(10, 4, 2)
    (tree,) = drafter.propose_tree([s], [shape], batch_of([s]))
    deepest = max(range(tree.num_nodes), key=lambda i: (tree.depths()[i], -i))
    node = {"deep": deepest, "root_child": tree.children(-1)[-1], "none": -1}[accept]
    path = [tree.token_ids[j] for j in tree.path_to(node)] if node >= 0 else []
    s.token_ids += path + [17]  # the accepted drafts and the target's bonus (or recovered) token
    drafter.observe([s], [len(path)])
    n = len(HISTORIES[0])
    got_tree = drafter.propose_tree([s], [shape], batch_of([s]))[0]
    if accept == "deep":  # the path sat in the last tree pass: kept by compaction, only the bonus fed
        assert len(drafter.cached[s.seq_id]) == len(s.token_ids)
    fresh = DraftModelDrafter(runner_of(folder))
    fresh.q_calibration = copy.deepcopy(drafter.q_calibration)  # what it learned of acceptance stays
    want_tree = fresh.propose_tree([seq(s.token_ids, temperature=0)], [shape], batch_of([s]))[0]
    assert (got_tree.token_ids, got_tree.parents) == (want_tree.token_ids, want_tree.parents)
    assert got_tree.scores == pytest.approx(want_tree.scores, rel=1e-3, abs=1e-6)
    # a second round from the same history (a rejection of every draft and a new token), then chains
    s.token_ids = s.token_ids[: n + len(path) + 1] + [tree.token_ids[0], 18]
    got = drafter.propose([s], [4], batch_of([s])).draft_token_ids[0].tolist()
    want = DraftModelDrafter(runner_of(folder)).propose([seq(s.token_ids, temperature=0)], [4], batch_of([s]))
    assert got == want.draft_token_ids[0].tolist()


def test_draft_model_without_tree_passes_drafts_chains(folder):
    runner = runner_of(folder)
    runner.can_verify_trees = False  # as the llama.cpp runner: no tree passes
    drafter = DraftModelDrafter(runner)
    assert not drafter.can_draft_trees
    s = seq(HISTORIES[0], temperature=0)
    (tree,) = drafter.propose_tree([s], [TreeShape(10, 3, 3)], batch_of([s]))
    assert tree.parents == [-1, 0, 1]
    want = DraftModelDrafter(runner_of(folder)).propose([seq(HISTORIES[0], temperature=0)], [3], batch_of([s]))
    assert tree.token_ids == want.draft_token_ids[0].tolist()


def test_q_calibration_values_candidates_by_their_measured_acceptance():
    from specdec.drafters.tree_expand import QCalibration

    cal = QCalibration(decay=1.0, prior_weight=1.0)
    assert cal.value(0.42) == pytest.approx(0.42)  # nothing measured: q itself
    tree = DraftTree([7, 8, 9], [-1, -1, 0])  # root children 7 (q 0.45) and 8 (q 0.05); 9 (q 0.9) below 7
    s = seq([1, 2], temperature=0)
    for _ in range(3):
        cal.propose([s], [(tree, [0.45, 0.05, 0.9])])
        s.token_ids += [7, 9, 3]  # both top candidates accepted, then the bonus token
        cal.observe([s], [2])
    assert cal.value(0.45) == pytest.approx((3 + 0.45) / (3 + 1))  # accepted every time it was tried
    assert cal.value(0.05) == pytest.approx(0.05 / (3 + 1))  # never
    assert cal.value(0.95) == pytest.approx((3 + 0.95) / (3 + 1))


# -- suffix decoding -------------------------------------------------------------------------------

def count(history: list[int], string: list[int], continued: bool = False) -> int:
    """Occurrences of ``string`` in ``history`` (with ``continued``: those followed by another token)."""
    m, end = len(string), len(history) - (1 if continued else 0)
    return sum(1 for i in range(end - m + 1) if history[i : i + m] == string)


REPETITIVE = [5, 6, 7, 8, 5, 6, 9, 5, 6, 7, 10, 5, 6, 7, 8, 11, 5, 6, 7, 8, 12, 5, 6]


@pytest.mark.parametrize("shape", [TreeShape(8, 4, 3), TreeShape(4, 3, 1), TreeShape(16, 6, 4)], ids=str)
def test_suffix_tree_branches_are_the_tries(shape):
    drafter = SuffixDrafter(max_tree_depth=8, max_cached_requests=0, min_token_prob=0.0)
    assert drafter.can_draft_trees
    s = seq(REPETITIVE, temperature=0)
    (tree,) = drafter.propose_tree([s], [shape], batch_of([s]))
    check_shape(tree, shape)
    assert tree.draft_probs is None
    h = REPETITIVE

    def probs_ok(m: int) -> bool:  # the tree continues the history's last m tokens, as the trie counts them
        for i in range(tree.num_nodes):
            path = [tree.token_ids[j] for j in tree.path_to(i)]
            context = h[len(h) - m:] + path[:-1]
            p = count(h, context + path[-1:]) / count(h, context, continued=True)
            parent = tree.parents[i]
            if tree.scores[i] != pytest.approx((1.0 if parent < 0 else tree.scores[parent]) * p):
                return False
        return True

    matches = [m for m in range(1, 8) if count(h, h[len(h) - m:], continued=True) and probs_ok(m)]
    assert matches
    m = matches[0]
    for node in [-1] + list(range(tree.num_nodes)):  # children: the most frequent continuations, in order
        path = [tree.token_ids[j] for j in tree.path_to(node)] if node >= 0 else []
        context = h[len(h) - m:] + path
        kids = [tree.token_ids[c] for c in tree.children(node)]
        counts = [count(h, context + [t]) for t in kids]
        assert counts == sorted(counts, reverse=True)
        others = [count(h, context + [t]) for t in set(h) - set(kids)]
        if len(kids) == shape.max_children and kids:
            assert max(others, default=0) <= min(counts)
    # the chain the suffix drafter proposes is the tree's best path
    chain = drafter.propose([s], [shape.max_depth], batch_of([s])).draft_token_ids[0].tolist()
    assert [tree.token_ids[j] for j in tree.path_to(0)] == chain[:1]


def test_hybrid_passes_each_members_trees(folder):
    model = DraftModelDrafter(runner_of(folder))
    hybrid = HybridDrafter(SuffixDrafter(max_tree_depth=8, max_cached_requests=0, min_token_prob=0.0), model, 1.0)
    assert hybrid.can_draft_trees
    seqs = [seq(REPETITIVE, temperature=0), seq(HISTORIES[1], temperature=0)]
    shapes = [TreeShape(8, 4, 3), TreeShape(8, 4, 3)]
    suffix_tree, model_tree = hybrid.propose_tree(seqs, shapes, batch_of(seqs))
    want_suffix = SuffixDrafter(max_tree_depth=8, max_cached_requests=0, min_token_prob=0.0).propose_tree(
        [seq(REPETITIVE, temperature=0)], shapes[:1], batch_of(seqs[:1]))[0]
    assert (suffix_tree.token_ids, suffix_tree.parents) == (want_suffix.token_ids, want_suffix.parents)
    want_model = DraftModelDrafter(runner_of(folder)).propose_tree([seq(HISTORIES[1], temperature=0)], shapes[1:],
                                                                   batch_of(seqs[1:]))[0]
    assert (model_tree.token_ids, model_tree.parents) == (want_model.token_ids, want_model.parents)
    assert hybrid.tree_sources == ["suffix", model.method]


# -- eagle3 ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("siblings", ["top_k", "sampled"])
@pytest.mark.parametrize("shape", [TreeShape(10, 4, 3), TreeShape(5, 5, 1)], ids=str)
def test_eagle3_tree_paths_equal_the_head_run_as_chains(folder, shape, siblings):
    """The head's tree levels (its k, v at node slots, each node seeing its ancestors) give every node
    the logits ``Eagle3Head.step`` gives its path run as a chain after the history (sampled siblings:
    each node's q is compared whole)."""
    from transformers import AutoConfig

    from specdec.drafters.eagle3 import Eagle3Drafter
    from specdec.models.eagle3 import Eagle3Config, Eagle3Head

    target = runner_of(folder)
    c = Eagle3Config.for_target(AutoConfig.from_pretrained(folder))
    torch.manual_seed(3)
    head = Eagle3Head(c, target.token_embedding()[: c.vocab_size].float())
    for name, p in head.named_parameters():  # sharp attention: what a node sees shows in its q
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=1.0 if "q_proj" in name or "k_proj" in name else 0.3)
    drafter = Eagle3Drafter(head, target, siblings=siblings, quantization="none")  # chains computed in float
    assert drafter.can_draft_trees
    history = HISTORIES[0] * 2
    s = seq(history, **({"temperature": 0} if siblings == "top_k" else {"temperature": 1.0, "seed": 1}))
    target.sync_rows([s.seq_id])
    target.forward(ForwardBatch.from_rows([history[:-1]], [0], logits="none"))
    s.num_computed = len(history) - 1
    feats = target.hidden_states(0, 0, len(history) - 1)  # f_0..f_{L-2}
    L = len(history)

    def logits_after(path: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits, g, k, v = head.step(torch.tensor([history[1:]]), head.fuse(feats[None]), torch.arange(L - 1)[None])
            g = g[:, -1:]
            for j, t in enumerate(path, start=1):
                logits, g, k2, v2 = head.step(torch.tensor([[t]]), g, torch.tensor([[L - 2 + j]]), k, v)
                k, v = torch.cat([k, k2], dim=2), torch.cat([v, v2], dim=2)
            out = torch.full((target.vocab_size,), float("-inf"))  # draft ids -> target ids, -inf elsewhere
            out[head.draft_to_target] = logits[0, -1]
            return out

    for _ in range(2):  # a second round from the same history: the slots past it are overwritten
        (tree,) = drafter.propose_tree([s], [shape], batch_of([s]))
        check_shape(tree, shape)
        assert tree.num_nodes == shape.num_nodes
        assert (tree.draft_probs is None) == (siblings == "top_k")
        check_against_chains(tree, history, None, batch_of([s]), top_k=siblings == "top_k", logits_after=logits_after)


@pytest.mark.parametrize("methods", [("suffix", "draft_model", "ngram"), ("ngram", "suffix")], ids=str)
def test_choice_passes_the_chosen_members_trees(folder, methods):
    """A method list drafts each row with the method it chooses: its tree where that method branches."""
    from specdec.drafters.choice import ChoosingDrafter
    from specdec.drafters.ngram import NgramDrafter

    def suffix():
        return SuffixDrafter(max_tree_depth=8, max_cached_requests=0, min_token_prob=0.0)

    make = {"suffix": suffix, "draft_model": lambda: DraftModelDrafter(runner_of(folder)),
            "ngram": lambda: NgramDrafter(3, 3)}  # REPETITIVE's last 3 tokens never came before: no ngram draft
    choosing = ChoosingDrafter({m: make[m]() for m in methods})
    assert choosing.can_draft_trees
    seqs = [seq(REPETITIVE, temperature=0), seq(HISTORIES[1], temperature=0), seq(HISTORIES[0], temperature=0)]
    shapes = [TreeShape(8, 4, 3), TreeShape(8, 4, 3), None]
    trees = choosing.propose_tree(seqs, shapes, batch_of(seqs))
    assert trees[2] is None
    methods = {s.seq_id: m for s, (m, _) in zip(seqs, [choosing._last.get(s.seq_id, (None, 0)) for s in seqs])}
    # only a branching member can draft REPETITIVE (suffix matches its last 2 tokens, ngram needs 3):
    # its tree is checked against that member's own
    assert methods[seqs[0].seq_id] in ("suffix", "draft_model")
    for s, shape, tree in zip(seqs[:2], shapes, trees):
        m = methods[s.seq_id]
        if m is None or m == "ngram":  # nothing, or a lookup that drafts chains
            assert tree is None or tree.parents == list(range(-1, tree.num_nodes - 1))
            continue
        fresh = make[m]
        want = fresh().propose_tree([seq(s.token_ids, temperature=0)], [shape], batch_of([s]))[0]
        assert (tree.token_ids, tree.parents) == (want.token_ids, want.parents), m
        assert choosing._last[s.seq_id] == (m, max(tree.depths()))
        assert choosing.tree_sources[seqs.index(s)] == m
    choosing.observe(seqs, [1, 0, 0])  # acceptance per method recorded as for chains
