"""Suffix decoding's global trie with running outputs in it, and its two probability estimates: a request
drafts from another's in-flight text, the global trie always holds exactly the substrings of the outputs
it keeps (running and released, within max_cached_requests), drafts equal the definition computed by a
full scan for both estimates, and outputs stay lossless end to end."""

from __future__ import annotations

import random

import pytest

from lossless import assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.drafters import suffix_native
from specdec.drafters.suffix_native import suffix_drafter
from specdec.drafters.suffix import END_MASK, SLOT_SHIFT, SuffixDrafter, SuffixTrie
from test_drafters_lookup import target  # noqa: F401 (the fixture: a tiny model whose greedy output loops)
from test_drafters_lookup import METHODS, make_seq, propose, repetitive_prompts, substring_counts, trie_counts


def test_a_request_drafts_from_another_requests_output_as_it_grows():
    d = SuffixDrafter(max_cached_requests=4, max_spec_factor=4.0)
    a = make_seq([50, 51, 10, 11, 12, 13, 14, 15], num_prompt=2)  # running: its output so far
    b = make_seq([60, 61, 62, 10, 11, 12], num_prompt=3)
    assert propose(d, [a, b], 3) == [[], [13, 14, 15]]  # b's output repeats a's in-flight text
    a.token_ids += [16, 17]  # a grows; b catches up with it
    b.token_ids += [13, 14, 15]
    assert propose(d, [a, b], 3) == [[], [16, 17]]
    assert sorted(map(tuple, d.cache.seqs.values())) == [(10, 11, 12, 13, 14, 15), (10, 11, 12, 13, 14, 15, 16, 17)]
    # the prompt is not in the global trie: another request can't draft a's prompt from it
    c = make_seq([99, 50], num_prompt=2)
    assert propose(d, [c], 3) == [[]]


def test_release_completes_the_output_and_keeps_it():
    d = SuffixDrafter(max_cached_requests=4, max_spec_factor=4.0)
    a, e = make_seq([50, 51, 10, 11], num_prompt=2), make_seq([7, 8], num_prompt=2)
    propose(d, [a, e], 3)
    a.token_ids += [12, 13, 14, 15]  # the last round's tokens, which the drafter has not been shown
    d.release([a, e])
    assert list(d.cache.seqs.values()) == [[10, 11, 12, 13, 14, 15]]  # e had no output: it takes no place
    assert d.requests == {} and d.running == {}
    assert trie_counts(d.cache) == substring_counts([[10, 11, 12, 13, 14, 15]], d.depth)
    f = make_seq([1, 2, 3], num_prompt=1)  # never drafted for (finished in its first round): it joins at release
    d.release([f])
    assert list(d.cache.seqs.values()) == [[10, 11, 12, 13, 14, 15], [2, 3]]


class KeptOutputs:
    """What the global trie should hold, kept by hand: (seq_id, output) oldest first. A request joins when
    first shown (or shown a history that did not grow from the one before: it joins afresh); the
    oldest leave beyond ``bound``, a running one included (it stops joining); a release completes the
    output (an empty one leaves)."""

    def __init__(self, bound: int):
        self.bound, self.kept, self.seen = bound, [], {}  # seen: seq_id -> history last shown

    def show(self, s) -> None:
        old = self.seen.get(s.seq_id)
        if old is None or s.token_ids[:len(old)] != old:
            self.kept = [(i, o) for i, o in self.kept if i != s.seq_id]
            if self.bound:
                self.kept = (self.kept + [(s.seq_id, None)])[-self.bound:]
        self.seen[s.seq_id] = list(s.token_ids)

    def release(self, s) -> None:
        self.seen.pop(s.seq_id)
        self.kept = [(i, list(s.output_token_ids) if i == s.seq_id else o) for i, o in self.kept]
        self.kept = [(i, o) for i, o in self.kept if i != s.seq_id or o]

    def outputs(self, running) -> list[list[int]]:
        now = {s.seq_id: list(s.output_token_ids) for s in running}
        return [now[i] if o is None else o for i, o in self.kept]


IMPLEMENTATIONS = [False, pytest.param(True, marks=pytest.mark.skipif(
    suffix_native.unavailable_reason(check_env=False) is not None, reason="no native suffix tries"))]


@pytest.mark.parametrize("native", IMPLEMENTATIONS, ids=["python", "native"])
@pytest.mark.parametrize("bound", [0, 1, 3, 10])
def test_global_trie_holds_exactly_the_kept_outputs(bound, native):
    """Random rounds of running requests (growing, sometimes replaced by a shorter history, released, new
    ones joining): the global trie always equals one built afresh from the outputs it should keep."""
    rng = random.Random(bound)
    depth = 5
    d = suffix_drafter(max_tree_depth=depth, max_cached_requests=bound, max_spec_factor=2.0, min_token_prob=0.2,
                      native=native)
    new = lambda: make_seq([rng.randrange(3) for _ in range(rng.randint(1, 6))])  # noqa: E731 (all prompt)
    running, model = [new() for _ in range(3)], KeptOutputs(bound)
    for _ in range(80):
        for s in running:
            if rng.random() < 0.1 and s.num_output_tokens > 1:  # a replaced history: the output shrinks
                del s.token_ids[len(s.token_ids) - rng.randint(1, 2):]
            s.token_ids += [rng.randrange(3) for _ in range(rng.randint(1, 4))]
        propose(d, running, [rng.randint(0, 4) for _ in running])
        for s in running:
            model.show(s)
        assert set(d.requests) == {s.seq_id for s in running}
        if rng.random() < 0.3:
            done = running.pop(rng.randrange(len(running)))
            done.token_ids += [rng.randrange(3) for _ in range(rng.randint(0, 3))]
            d.release([done])
            model.release(done)
            running.append(new())
        expected = model.outputs(running)
        assert len(d.cache.seqs) <= bound
        assert list(d.cache.seqs.values()) == expected
        assert trie_counts(d.cache) == substring_counts(expected, depth)
        growing = [slot for slot in d.cache.seqs if is_growing(d.cache, slot)]
        assert all(len(open_suffixes(d.cache, slot)) < depth for slot in growing)  # one step each per token
        for s in running:  # drafting reads a running output's open suffixes instead of walking the trie
            req = d.requests.get(s.seq_id)
            if req is not None and req.slot is not None:
                assert_open_suffixes_are_the_matches(d.cache, req.slot)


def is_growing(trie, slot) -> bool:
    return slot in trie.growing if isinstance(trie, SuffixTrie) else trie.is_growing(slot)


def open_suffixes(trie, slot) -> list[tuple[int, int]]:
    """(node, depth) of a growing sequence's open suffixes, a node named by id() in the Python trie."""
    if isinstance(trie, SuffixTrie):
        return [(id(node), m) for node, m in trie.growing[slot]]
    return trie.open(slot)


def walk(trie, tokens, start, stop):
    """The position of tokens[start:stop]: a node's name (as open_suffixes), or the Python leaf code."""
    at = trie.walk(tokens, start, stop)
    if isinstance(trie, SuffixTrie):
        return at if type(at) is int else ("node", id(at))
    return suffix_native.python_leaf(at) if at < 0 else ("node", at)


def assert_open_suffixes_are_the_matches(trie, slot):
    """The open suffixes of a growing sequence are the nodes of its suffixes shorter than the depth; those
    held as leaves are its own occurrence, with no continuation to draft."""
    seq = trie.seqs[slot]
    nodes = []
    for m in range(min(trie.depth - 1, len(seq)), 0, -1):
        at = walk(trie, seq, len(seq) - m, len(seq))
        if type(at) is int:
            assert at >> SLOT_SHIFT == slot and (at & END_MASK) == len(seq) - 1
        else:
            nodes.append((at[1], m))
    assert open_suffixes(trie, slot) == nodes


def test_the_bound_pushes_out_the_oldest_running_output_which_stops_joining():
    d = SuffixDrafter(max_tree_depth=6, max_cached_requests=2)
    a, b = make_seq([1, 10, 11], num_prompt=1), make_seq([2, 20, 21], num_prompt=1)
    propose(d, [a, b], 2)
    c = make_seq([3, 30, 31], num_prompt=1)
    propose(d, [a, b, c], 2)  # c joins: a, the oldest, leaves although it runs
    assert d.requests[a.seq_id].slot is None and list(d.cache.seqs.values()) == [[20, 21], [30, 31]]
    a.token_ids += [12, 13]
    propose(d, [a, b, c], 2)
    d.release([a])
    assert list(d.cache.seqs.values()) == [[20, 21], [30, 31]]
    assert trie_counts(d.cache) == substring_counts([[20, 21], [30, 31]], 6)


# -- the two probability estimates ------------------------------------------------------------------


def reference_draft(h: list[int], k: int, depth: int, factor: float, min_prob: float, count_ends: bool):
    """The definition by a full scan of one history: every suffix of at most depth - 1 tokens is a match;
    from it, follow the most frequent next token (ties: the one first seen last) while the path probability
    (count(s + t) over count(s) with count_ends, else over the occurrences of s that continue) stays >=
    min_prob, for at most min(k, floor(factor * m), depth - m) tokens; the largest summed probability wins
    (ties: the longer match)."""
    ends = lambda s: [e for e in range(len(s) - 1, len(h)) if h[e - len(s) + 1:e + 1] == s]  # noqa: E731
    best, best_score = [], 0.0
    for m in range(min(depth - 1, len(h)), 0, -1):
        cur, draft, prob, score = h[-m:], [], 1.0, 0.0
        while len(draft) < min(k, int(factor * m + 1e-9), depth - m):
            nxt = [h[e + 1] for e in ends(cur) if e + 1 < len(h)]  # in order of their occurrence
            if not nxt:
                break
            t = max(nxt, key=lambda x: (nxt.count(x), nxt.index(x)))
            prob *= nxt.count(t) / (len(ends(cur)) if count_ends else len(nxt))
            if prob < min_prob:
                break
            cur, draft, score = cur + [t], draft + [t], score + prob
        if score > best_score:
            best, best_score = draft, score
    return best, best_score


@pytest.mark.parametrize("native", IMPLEMENTATIONS, ids=["python", "native"])
@pytest.mark.parametrize("probability", ["continuations", "occurrences"])
def test_drafts_equal_the_definition_for_each_estimate(probability, native):
    rng = random.Random(5)
    for _ in range(300):
        depth, V = rng.randint(2, 7), rng.randint(1, 4)
        factor, min_prob, k = rng.choice([0.5, 1.0, 2.0, 4.0]), rng.choice([0.0, 0.1, 0.3, 0.6]), rng.randint(1, 6)
        h = [rng.randrange(V) for _ in range(rng.randint(1, 30))]
        d = suffix_drafter(max_tree_depth=depth, max_cached_requests=0, max_spec_factor=factor,
                          min_token_prob=min_prob, probability=probability, native=native)
        draft, score = d.draft(make_seq(h), k)
        ref, ref_score = reference_draft(h, k, depth, factor, min_prob, probability == "occurrences")
        assert draft == ref and score == pytest.approx(ref_score), (h, depth, factor, min_prob, k)


def test_the_estimates_on_a_loop():
    """"1 2" occurred 3 times and ends the history: it continued with 3 twice and ends once.
    Arctic's SuffixDecodingCache (arctic-inference 0.3.0) drafts the same for this history (prompt
    [1, 2, 3], response [4, 1, 2, 3, 4, 1, 2]) with probabilities 2/3 x4 then 1/3 x4."""
    h = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    cont = SuffixDrafter(max_cached_requests=0, max_spec_factor=4.0, probability="continuations")
    occ = SuffixDrafter(max_cached_requests=0, max_spec_factor=4.0, probability="occurrences")
    assert cont.draft(make_seq(h), 8) == ([3, 4, 1, 2, 3, 4, 1, 2], pytest.approx(8.0))
    assert occ.draft(make_seq(h), 8) == ([3, 4, 1, 2, 3, 4, 1, 2], pytest.approx(4 * 2 / 3 + 4 * 1 / 3))
    # min_token_prob between them: the shrunk estimate stops where the other drafts on
    assert SuffixDrafter(max_cached_requests=0, max_spec_factor=4.0, min_token_prob=0.5,
                         probability="occurrences").draft(make_seq(h), 8)[0] == [3, 4, 1, 2]


def test_an_unknown_estimate_is_refused():
    with pytest.raises(ValueError, match="probability must be one of"):
        SuffixDrafter(probability="counts")


# -- end to end -------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch, probability", [(1, "continuations"), (4, "continuations"), (4, "occurrences")])
def test_greedy_output_equals_plain_decoding_with_running_outputs_shared(target, batch, probability, caplog):
    """Requests that repeat each other's text, several in flight: drafts come from the others' running
    outputs, and the outputs stay those of plain decoding, with either estimate."""
    path, hf = target
    prompts = repetitive_prompts(4, seed=4)
    prompts = prompts + [p[:-1] for p in prompts]  # each prompt twice, the second a token shorter
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    expected = [o.outputs[0].token_ids for o in LLM(path).generate(requests, sp)]
    llm = LLM(path, speculative_config=METHODS["suffix"], max_num_seqs=batch)
    # the engine's drafter, with the estimate under test (the same as build_drafter makes for the config)
    llm.engine.drafter = SuffixDrafter(max_spec_factor=2.0, probability=probability)
    llm.engine.drafter.method = "suffix"
    for p, e, o in zip(prompts, expected, llm.generate(requests, sp)):
        assert_greedy_equal(hf, p, e, o.outputs[0].token_ids)
    m = llm.get_metrics()
    assert "drafter failed" not in caplog.text and 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
    assert len(llm.engine.drafter.cache.seqs) == len(prompts)
