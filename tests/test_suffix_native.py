"""The native suffix tries (suffix_native.py) against the Python ones (suffix.py, the reference): the same
trie, node for node and child order included, the same open suffixes, counts, follows, continuations,
trees, and drafts, scores and trees of the drafter at every step of random workloads; which
implementation SuffixDrafter picks; lossless end to end with the native tries."""

from __future__ import annotations

import logging
import random

import pytest

from lossless import assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.drafters import suffix_native
from specdec.drafters.suffix import Node, SuffixDrafter, SuffixTrie
from specdec.drafters.suffix_native import NativeSuffixDrafter, python_leaf, suffix_drafter
from specdec.sampling import SamplingBatch
from specdec.tree import TreeShape
from test_drafters_lookup import target  # noqa: F401 (the fixture: a tiny model whose greedy output loops)
from test_drafters_lookup import METHODS, make_seq, repetitive_prompts, substring_counts, trie_counts

pytestmark = pytest.mark.skipif(suffix_native.unavailable_reason(check_env=False) is not None,
                                reason=f"no native suffix tries: {suffix_native.unavailable_reason(check_env=False)}")


# -- comparing a Python trie with a native one ------------------------------------------------------


def node_map(py: SuffixTrie, native) -> dict[int, int]:
    """Walk both tries together, asserting they are the same (each node's count, its children in the same
    order, leaves with the same codes); returns id(Python node) -> native node id."""
    ids = {id(py.root): 0}

    def visit(node: Node, pos: int) -> None:
        assert native.count(pos) == node.count
        kids = native.kids(pos)
        assert [t for t, _, _ in kids] == list(node.children), "children or their order differ"
        for (t, child, n), c in zip(kids, node.children.values()):
            if type(c) is int:
                assert child < 0 and python_leaf(child) == c and n == 1
            else:
                assert child >= 0, f"token {t}: a node in Python, a leaf natively"
                ids[id(c)] = child
                visit(c, child)

    visit(py.root, 0)
    return ids


def assert_same_trie(py: SuffixTrie, native) -> dict[int, int]:
    ids = node_map(py, native)
    assert native.live_nodes() == len(ids)  # no node leaked (removed subtrees go back to the free list)
    assert native.slots() == list(py.seqs)
    for slot, tokens in py.seqs.items():
        assert native.seq(slot) == tokens
        assert native.is_growing(slot) == (slot in py.growing)
        if slot in py.growing:
            assert native.open(slot) == [(ids[id(n)], d) for n, d in py.growing[slot]]
    return ids


def positions(py: SuffixTrie, native, ids, rng, n=12):
    """Up to n (Python position, native position) pairs: random substrings of the held sequences, walked."""
    seqs = list(py.seqs.values())
    out = []
    for _ in range(n):
        if not seqs:
            break
        s = rng.choice(seqs)
        if not s:
            continue
        i = rng.randrange(len(s))
        j = rng.randint(i + 1, min(len(s), i + py.depth))
        p, q = py.walk(s, i, j), native.walk(s, i, j)
        assert p is not None and q is not None
        assert q == native_position(p, ids)
        out.append((p, q))
    return out


def native_position(p, ids) -> int:
    return python_leaf(p) if type(p) is int else ids[id(p)]


def assert_same_reads(py: SuffixTrie, native, ids, rng) -> None:
    """follow, continuations, tree, walk and longest_match agree from random positions."""
    for p, q in positions(py, native, ids, rng):
        for count_ends in (False, True):
            limit, min_prob = rng.randint(0, 10), rng.choice([0.0, 0.1, 0.3, 0.6])
            assert native.follow(q, limit, min_prob, count_ends) == tuple(py.follow(p, limit, min_prob, count_ends))
            assert native.continuations(q, count_ends) == [
                (t, native_position(c, ids), prob) for t, c, prob in py.continuations(p, count_ends)]
            shape = TreeShape(rng.randint(1, 20), rng.randint(1, 8), rng.randint(1, 4))
            tree = py.tree(p, shape, min_prob, count_ends)
            tokens, parents, scores = native.tree(q, shape.num_nodes, shape.max_depth, shape.max_children, min_prob,
                                                  count_ends)
            assert (tokens, parents, scores) == ((tree.token_ids, tree.parents, tree.scores) if tree else ([], [], []))
    V = 1 + max((t for s in py.seqs.values() for t in s), default=0)
    probe = [rng.randrange(V + 1) for _ in range(rng.randint(0, 12))]
    assert native.longest_match(probe, py.depth) == py.longest_match(probe, py.depth)
    for i in range(len(probe)):
        p, q = py.walk(probe, i, len(probe)), native.walk(probe, i, len(probe))
        assert (p is None and q is None) or q == native_position(p, ids)


@pytest.mark.parametrize("seed", range(6))
def test_trie_operations_build_the_same_trie(seed):
    """Sequences added and grown token by token, interleaved, inserted whole, finished and removed: after
    every operation the two tries are the same, and hold exactly the substrings of what they hold."""
    rng = random.Random(seed)
    ext = suffix_native.extension()
    for _ in range(12):
        depth = rng.choice([1, 2, 3, 4, 6, 9])
        V = rng.choice([1, 2, 3, 5, 40])  # 40: nodes with more children than fit inline (tables)
        py, native = SuffixTrie(depth), ext.Trie(depth)
        if rng.random() < 0.3:
            native.set_seq_limit(rng.randint(1, 6))  # renumber children's insertion numbers early and often
        for _ in range(rng.randint(5, 40)):
            op = rng.random()
            growing = list(py.growing)
            if op < 0.45 and growing:  # grow one sequence by a few tokens, from a loop or at random
                slot = rng.choice(growing)
                seq = py.seqs[slot]
                for _ in range(rng.randint(1, 6)):
                    t = seq[-rng.randint(1, len(seq))] if seq and rng.random() < 0.6 else rng.randrange(V)
                    seq.append(t)
                    py.append(slot, len(seq) - 1)
                    native.push(slot, t)
            elif op < 0.6:
                assert native.add() == py.add([])
            elif op < 0.75:
                pattern = [rng.randrange(V) for _ in range(rng.randint(1, 5))]
                tokens = (pattern * 8)[:rng.randint(0, 25)]
                assert native.insert(tokens) == py.insert(tokens)
            elif op < 0.85 and growing:
                slot = rng.choice(growing)
                py.finish(slot)
                native.finish(slot)
            elif py.seqs:
                slot = rng.choice(list(py.seqs))
                py.remove(slot)
                native.remove(slot)
            ids = assert_same_trie(py, native)
            assert trie_counts(native) == substring_counts(list(py.seqs.values()), depth)
            assert_same_reads(py, native, ids, rng)
        for slot in list(py.seqs):
            native.remove(slot)
        assert native.live_nodes() == 1 and native.kids(0) == [] and native.num_seqs() == 0


def test_a_child_removed_and_added_again_goes_last_and_a_leaf_made_a_node_keeps_its_place():
    """Ties between equally frequent children go to the one first seen last: the order is insertion's."""
    ext = suffix_native.extension()
    py, native = SuffixTrie(3), ext.Trie(3)
    for tokens in ([1, 2], [1, 3], [1, 4]):
        assert py.insert(tokens) == native.insert(tokens)
    py.remove(0)
    native.remove(0)
    for tokens in ([1, 2], [1, 3]):  # 2 comes back (last); 3 turns from a leaf into a node (keeps its place)
        assert py.insert(tokens) == native.insert(tokens)
    assert [t for t, _, _ in native.kids(native.walk([1], 0, 1))] == [3, 4, 2] == list(py.walk([1], 0, 1).children)
    assert_same_trie(py, native)


# -- the drafter ------------------------------------------------------------------------------------


def assert_same_drafters(py: SuffixDrafter, native: NativeSuffixDrafter) -> None:
    assert_same_trie(py.cache, native.cache)
    assert list(py.requests) == list(native.requests)
    assert {slot: r.slot for slot, r in py.running.items()} == {slot: r.slot for slot, r in native.running.items()}
    for seq_id, req in py.requests.items():
        other = native.requests[seq_id]
        assert other.slot == req.slot and other.tokens == req.tokens and other.num_prompt == req.num_prompt
        assert_same_trie(req, other)


def workload(rng, V: int):
    """A random stream of tokens with heavy repetition: a phrase looped, sometimes varied."""
    phrase = [rng.randrange(V) for _ in range(rng.randint(1, 6))]
    while True:
        yield rng.choice(phrase) if rng.random() < 0.15 else phrase[0]
        phrase = phrase[1:] + phrase[:1]
        if rng.random() < 0.05:
            phrase = [rng.randrange(V) for _ in range(rng.randint(1, 6))]


@pytest.mark.parametrize("probability", ["continuations", "occurrences"])
@pytest.mark.parametrize("seed", range(4))
def test_the_drafters_draft_the_same_at_every_step(seed, probability):
    """Running requests grow by a few tokens a round (one shown a replaced, shorter history now and then),
    finish and are released, new ones join, the global trie evicts: both drafters give the same drafts,
    scores and trees for every row and want, and hold the same tries."""
    rng = random.Random(100 + seed)
    for _ in range(4):
        kw = dict(max_tree_depth=rng.choice([2, 3, 5, 8, 24]), max_cached_requests=rng.choice([0, 1, 2, 5, 100]),
                  max_spec_factor=rng.choice([0.5, 1.0, 2.0, 4.0, 32.0]), min_token_prob=rng.choice([0.0, 0.1, 0.3]),
                  probability=probability)
        py, native = suffix_drafter(**kw, native=False), suffix_drafter(**kw, native=True)
        assert type(py) is SuffixDrafter and type(native) is NativeSuffixDrafter
        V = rng.choice([2, 3, 6, 50])
        streams = {}

        def new():
            s = make_seq([rng.randrange(V) for _ in range(rng.randint(1, 20))], num_prompt=None)
            streams[s.seq_id] = workload(rng, V)
            return s

        running = [new() for _ in range(rng.randint(1, 4))]
        for _ in range(40):
            for s in running:
                if rng.random() < 0.05 and s.num_output_tokens > 1:  # a replaced history
                    del s.token_ids[len(s.token_ids) - rng.randint(1, 2):]
                s.token_ids += [next(streams[s.seq_id]) for _ in range(rng.randint(0, 5))]
            if rng.random() < 0.5:
                wants = [rng.choice([0, 1, 2, 4, 8, 16, 32]) for _ in running]
                sb = SamplingBatch.from_params([SamplingParams(temperature=0)] * len(running))
                a, b = py.propose(running, wants, sb), native.propose(running, wants, sb)
                assert a.draft_token_ids.tolist() == b.draft_token_ids.tolist()
                assert a.num_draft_tokens == b.num_draft_tokens
                for s in running:
                    want = rng.randint(1, 32)
                    assert py.draft(s, want) == native.draft(s, want)  # drafts and scores, exactly
                    shape = TreeShape(rng.randint(1, 24), rng.randint(1, 10), rng.randint(1, 4))
                    tree, score = py.draft_tree(s, shape)
                    other, other_score = native.draft_tree(s, shape)
                    assert score == other_score and (tree is None) == (other is None)
                    if tree is not None:
                        assert (tree.token_ids, tree.parents, tree.scores) == (other.token_ids, other.parents,
                                                                               other.scores)
                        assert other.draft_probs is None
            else:
                py.observe(running, [0] * len(running))
                native.observe(running, [0] * len(running))
            assert_same_drafters(py, native)
            if rng.random() < 0.2:
                done = running.pop(rng.randrange(len(running)))
                done.token_ids += [next(streams[done.seq_id]) for _ in range(rng.randint(0, 3))]
                py.release([done])
                native.release([done])
                assert_same_drafters(py, native)
                running.append(new())
            if rng.random() < 0.05:  # a request that finished in its first round, never shown
                s = new()
                s.token_ids += [next(streams[s.seq_id]) for _ in range(rng.randint(0, 4))]
                py.release([s])
                native.release([s])
        assert trie_counts(native.cache) == substring_counts(list(py.cache.seqs.values()), kw["max_tree_depth"])


def test_drafts_on_a_long_loop_with_a_big_vocabulary():
    """Long histories over many tokens: the root and the first level keep their children in tables."""
    rng = random.Random(7)
    kw = dict(max_tree_depth=24, max_cached_requests=3, max_spec_factor=2.0, min_token_prob=0.1)
    py, native = suffix_drafter(**kw, native=False), suffix_drafter(**kw, native=True)
    for r in range(5):
        text = [rng.randrange(2000) for _ in range(300)]
        s = make_seq(text[:100], num_prompt=100)
        for i in range(100, 300, 3):
            s.token_ids += text[i:i + 3] if rng.random() < 0.5 else text[i - 60:i - 57]
            want = rng.choice([1, 8, 32])
            assert py.draft(s, want) == native.draft(s, want)
        py.release([s])
        native.release([s])
        assert_same_drafters(py, native)


def test_the_fast_calls_take_only_their_types():
    ext = suffix_native.extension()
    req, trie = ext.Request(4, 1), ext.Trie(4)
    assert ext.grow(req, [5, 6, 5, 6], trie) is True and req.tokens == [5, 6, 5, 6]
    assert ext.draft(req, [5, 6, 5, 6, 5], None, 2, 1.0, 0.0, False) == ([6, 5], 2.0)
    assert ext.draft(req, [7, 6, 5, 6, 5], None, 2, 1.0, 0.0, False) is None  # replaced: nothing changes
    assert req.tokens == [5, 6, 5, 6, 5]
    with pytest.raises(TypeError, match="expected a Request"):
        ext.grow(trie, [1], None)
    with pytest.raises(TypeError, match="expected a Trie"):
        ext.draft(req, [1], req, 2, 1.0, 0.0, False)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        ext.grow(req, [1])


# -- which implementation ---------------------------------------------------------------------------


def test_suffix_drafter_is_native_unless_asked_not_to_be(monkeypatch):
    monkeypatch.delenv(suffix_native.ENV, raising=False)
    assert type(suffix_drafter()) is NativeSuffixDrafter
    assert type(suffix_drafter(native=False)) is SuffixDrafter
    monkeypatch.setenv(suffix_native.ENV, "1")
    assert type(suffix_drafter()) is SuffixDrafter
    assert type(suffix_drafter(native=True)) is NativeSuffixDrafter  # asked for explicitly
    monkeypatch.setenv(suffix_native.ENV, "0")
    assert type(suffix_drafter()) is NativeSuffixDrafter


def test_without_the_extension_the_python_tries_run(monkeypatch):
    monkeypatch.setattr(suffix_native, "_load", lambda: (None, "building the native suffix tries failed: (a test)"))
    d = suffix_drafter(max_spec_factor=4.0)
    assert type(d) is SuffixDrafter and d.draft(make_seq([1, 2, 3, 1, 2]), 2) == ([3, 1], 2.0)
    with pytest.raises(RuntimeError, match="unavailable: building the native suffix tries failed"):
        suffix_drafter(native=True)


def test_a_failed_build_is_a_logged_reason_not_a_crash(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        ext, reason = suffix_native._load.__wrapped__("this is not C++;\n")
    assert ext is None and reason.startswith("building the native suffix tries failed")
    assert "suffix decoding uses the Python tries" in caplog.text


# -- end to end -------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_equals_plain_decoding_and_the_python_drafters_rounds(target, batch, caplog, monkeypatch):
    """The engine's suffix drafter is the native one; outputs are those of plain decoding, and every round
    drafts what the Python drafter drafts (the same draft and accepted counts)."""
    monkeypatch.delenv(suffix_native.ENV, raising=False)
    path, hf = target
    prompts = repetitive_prompts(4, seed=4)
    prompts = prompts + [p[:-1] for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    expected = [o.outputs[0].token_ids for o in LLM(path).generate(requests, sp)]
    metrics = {}
    for native in (True, False):
        llm = LLM(path, speculative_config=METHODS["suffix"], max_num_seqs=batch)
        assert type(llm.engine.drafter) is NativeSuffixDrafter
        if not native:
            llm.engine.drafter = suffix_drafter(max_spec_factor=2.0, native=False)
            llm.engine.drafter.method = "suffix"
        for p, e, o in zip(prompts, expected, llm.generate(requests, sp)):
            assert_greedy_equal(hf, p, e, o.outputs[0].token_ids)
        m = llm.get_metrics()
        metrics[native] = (m["num_draft_tokens"], m["num_accepted_tokens"])
    assert "drafter failed" not in caplog.text and 0 < metrics[True][1] < metrics[True][0]
    assert metrics[True] == metrics[False]
