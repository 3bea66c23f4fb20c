"""Lookup drafters (``ngram``, ``suffix``): what they propose on hand-made histories, incremental state
equal to a rebuild from scratch, bounded memory, and losslessness end to end through ``LLM``."""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest
import torch

from lossless import assert_first_tokens_follow_target, assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import END_MASK, SLOT_SHIFT, Node, RequestTrie, SuffixDrafter, SuffixTrie
from specdec.models.load import load_model
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from tiny_models import make_model, random_prompts

SMALL_WORDS = [f"w{i}" for i in range(20)]  # V = 23: small enough for exact distribution tests


def make_seq(tokens: list[int], num_prompt: int | None = None) -> Sequence:
    s = Sequence(list(tokens[:num_prompt]), SamplingParams(), torch.Generator(), max_len=10**6)
    s.token_ids = list(tokens)
    return s


def propose(drafter, seqs: list[Sequence], k: int | list[int]) -> list[list[int]]:
    ks = [k] * len(seqs) if isinstance(k, int) else k
    p = drafter.propose(seqs, ks, SamplingBatch.from_params([SamplingParams(temperature=0)] * len(seqs)))
    assert p.draft_probs is None  # deterministic drafts: q = one-hot
    assert p.draft_token_ids.shape == (len(seqs), max(p.num_draft_tokens))
    assert all(0 <= n <= want for n, want in zip(p.num_draft_tokens, ks))
    return [p.draft_token_ids[b, :n].tolist() for b, n in enumerate(p.num_draft_tokens)]


# -- ngram ----------------------------------------------------------------------------------------


def ngram_reference(h: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The definition, by a full scan: the longest n-gram match, its most recent earlier occurrence,
    and k tokens copied after it (the copy running on through itself when the match is near the end)."""
    L = len(h)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for e in range(L - 2, n - 2, -1):
            if h[e - n + 1:e + 1] == h[L - n:]:
                extended = list(h)
                for i in range(k):
                    extended.append(extended[e + 1 + i])
                return extended[L:]
    return []


@pytest.mark.parametrize("history, n_min, n_max, k, expected", [
    ([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 2, 3], 1, 2, 2, [5, 7]),  # most recent of two matches
    ([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 2, 3], 1, 2, 10, [5, 7, 2, 3, 5, 7, 2, 3, 5, 7]),  # the loop runs on
    ([5, 2, 3, 9, 7, 2, 3, 4, 5, 2, 3], 1, 3, 3, [9, 7, 2]),  # the 3-gram beats a more recent 2-gram
    ([5, 2, 3, 9, 7, 2, 3, 4, 5, 2, 3], 1, 2, 3, [4, 5, 2]),
    ([1, 2, 3, 1], 1, 4, 3, [2, 3, 1]),
    ([1, 2, 3, 1], 2, 4, 3, []),  # only a 1-gram matches, below prompt_lookup_min
    ([7, 7], 1, 4, 4, [7, 7, 7, 7]),
    ([1, 2, 3, 4], 1, 4, 4, []),  # no match
    ([6], 1, 4, 4, []),
])
def test_ngram_proposes_what_followed_the_most_recent_match(history, n_min, n_max, k, expected):
    assert ngram_reference(history, k, n_min, n_max) == expected
    assert propose(NgramDrafter(n_min, n_max), [make_seq(history)], k) == [expected]


def test_ngram_rows_propose_their_own_numbers_of_drafts():
    d = NgramDrafter(1, 3)
    seqs = [make_seq([1, 2, 3, 1, 2]), make_seq([4, 5, 4]), make_seq([8, 9])]
    assert propose(d, seqs, [4, 0, 3]) == [[3, 1, 2, 3], [], []]
    assert propose(d, seqs[1:], [2, 2]) == [[5, 4], []]
    assert propose(d, seqs[2:], 4) == [[]]  # nothing to propose: a [1, 0] proposal


def test_ngram_incremental_index_equals_a_full_scan():
    rng = random.Random(0)
    d = NgramDrafter(2, 4)
    seqs = [make_seq([rng.randrange(4) for _ in range(n)]) for n in (1, 6, 30)]
    for _ in range(150):
        for s in seqs:
            if rng.random() < 0.1:  # a rollback / rewrite: the drafter must notice and re-index
                del s.token_ids[max(1, len(s.token_ids) - rng.randint(1, 3)):]
            s.token_ids += [rng.randrange(4) for _ in range(rng.randint(1, 5))]
        ks = [rng.randint(0, 6) for _ in seqs]
        assert propose(d, seqs, ks) == [ngram_reference(s.token_ids, k, 2, 4) for s, k in zip(seqs, ks)]
        d.observe(seqs, [0] * len(seqs))


def test_ngram_release_forgets_the_sequence():
    d = NgramDrafter(1, 2)
    a, b = make_seq([1, 2, 1]), make_seq([3, 4, 3])
    propose(d, [a, b], 2)
    d.release([a])
    assert set(d.index) == {b.seq_id}
    d.release([b, make_seq([9])])
    assert d.index == {}


# -- suffix ---------------------------------------------------------------------------------------


def trie_counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every string the trie holds, with its count (leaves spelled out from their occurrence)."""
    out = {}

    def visit(node, prefix):
        for t, c in node.children.items():
            s = prefix + (t,)
            if type(c) is Node:
                out[s] = c.count
                visit(c, s)
            else:
                seq, e = trie.seqs[c >> SLOT_SHIFT], c & END_MASK
                assert seq[e] == t
                out[s] = 1
                while len(s) < trie.depth and e + 1 < len(seq):
                    e += 1
                    s += (seq[e],)
                    out[s] = 1

    visit(trie.root, ())
    return out


def substring_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    c = collections.Counter()
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                c[tuple(s[i:i + n])] += 1
    return dict(c)


def test_suffix_trie_counts_every_substring_and_removal_undoes_insertion():
    rng = random.Random(1)
    for _ in range(150):
        depth, V = rng.randint(1, 6), rng.randint(1, 4)
        seqs = [[rng.randrange(V) for _ in range(rng.randint(0, 30))] for _ in range(rng.randint(1, 5))]
        trie = SuffixTrie(depth)
        slots = [trie.insert(s) for s in seqs]
        assert trie_counts(trie) == substring_counts(seqs, depth)
        cut = rng.randint(0, len(seqs))
        for slot in slots[:cut]:
            trie.remove(slot)
        assert trie_counts(trie) == substring_counts(seqs[cut:], depth)
    for slot in slots[cut:]:
        trie.remove(slot)
    assert trie.root.children == {} and trie.seqs == {}


# history: "1 2" is followed by 3 twice and by 5 once; the last "8 1 2" occurred nowhere before
HISTORY = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 8, 1, 2]


@pytest.mark.parametrize("depth, factor, min_prob, k, expected", [
    (24, 1.0, 0.1, 4, [3, 4]),  # match "1 2" (2 tokens): at most floor(1.0 * 2) drafts
    (24, 2.0, 0.1, 4, [3, 4, 1, 2]),  # path probability 2/3 all along
    (24, 3.0, 0.1, 6, [3, 4, 1, 2, 5, 6]),  # then "1 2 3 4 1 2" -> 3 or 5, a tie: the newer, 2/3 * 1/2 = 1/3
    (24, 3.0, 0.5, 6, [3, 4, 1, 2]),  # ... which min_token_prob = 0.5 refuses
    (24, 3.0, 0.7, 6, []),  # even the first step (2/3) is too unlikely
    (24, 1.0, 0.1, 1, [3]),
    (4, 1.0, 0.1, 2, [3, 4]),  # depth 4: match 2 + drafts 2
    (3, 1.0, 0.1, 2, [3]),  # depth 3: match "2" (1 token) leaves room, but the factor allows 1 draft
])
def test_suffix_proposes_the_most_frequent_continuation(depth, factor, min_prob, k, expected):
    d = SuffixDrafter(max_tree_depth=depth, max_cached_requests=0, max_spec_factor=factor, min_token_prob=min_prob)
    assert propose(d, [make_seq(HISTORY)], k) == [expected]


def test_suffix_proposes_nothing_without_a_repeat_and_handles_loops():
    d = SuffixDrafter(max_spec_factor=4.0)
    assert propose(d, [make_seq([1, 2, 3, 4, 5]), make_seq([9]), make_seq([7] * 6)], [4, 4, 4]) == [[], [], [7] * 4]


def test_suffix_incremental_trie_equals_a_rebuild():
    rng = random.Random(2)
    d = SuffixDrafter(max_tree_depth=5, max_cached_requests=0, max_spec_factor=2.0, min_token_prob=0.2)
    seqs = [make_seq([rng.randrange(3) for _ in range(n)]) for n in (1, 8, 25)]
    for _ in range(100):
        for s in seqs:
            if rng.random() < 0.1:
                del s.token_ids[max(1, len(s.token_ids) - rng.randint(1, 3)):]
            s.token_ids += [rng.randrange(3) for _ in range(rng.randint(1, 5))]
        ks = [rng.randint(0, 5) for _ in seqs]
        fresh = SuffixDrafter(max_tree_depth=5, max_cached_requests=0, max_spec_factor=2.0, min_token_prob=0.2)
        assert propose(d, seqs, ks) == propose(fresh, [make_seq(s.token_ids) for s in seqs], ks)
        d.observe(seqs, [0] * len(seqs))
        for s in seqs:
            assert trie_counts(d.requests[s.seq_id]) == substring_counts([s.token_ids], 5)


def test_suffix_drafts_from_earlier_requests_outputs():
    d = SuffixDrafter(max_cached_requests=2, max_spec_factor=4.0)
    a = make_seq([50, 51, 10, 11], num_prompt=2)
    propose(d, [a], 3)
    a.token_ids += [12, 13, 14, 15]  # the last round's tokens, which the drafter has not been shown
    d.release([a])
    assert list(d.cache.seqs.values()) == [[10, 11, 12, 13, 14, 15]] and d.requests == {}
    b = make_seq([99, 10, 11, 12])
    assert propose(d, [b], 3) == [[13, 14, 15]]
    no_cache = SuffixDrafter(max_cached_requests=0, max_spec_factor=4.0)
    assert propose(no_cache, [b], 3) == [[]]


def test_suffix_cache_evicts_the_oldest_and_stays_bounded():
    rng = random.Random(3)
    d = SuffixDrafter(max_tree_depth=6, max_cached_requests=2)
    outputs = []
    for i in range(6):
        out = [rng.randrange(5) for _ in range(rng.randint(5, 40))]
        s = make_seq([100 + i] + out, num_prompt=1)
        propose(d, [s], 2)
        d.release([s])
        outputs.append(out)
        assert list(d.cache.seqs.values()) == outputs[-2:]
        assert trie_counts(d.cache) == substring_counts(outputs[-2:], 6)  # exactly what a fresh cache holds


def test_suffix_release_forgets_the_sequence():
    d = SuffixDrafter()
    a, b = make_seq([1, 2, 1, 2]), make_seq([3, 4, 3])
    propose(d, [a, b], 2)
    d.release([a, make_seq([9])])
    assert set(d.requests) == {b.seq_id}


def test_request_trie_open_suffixes_are_the_repeated_ones():
    s = make_seq([1, 2, 3, 1, 2])
    t = RequestTrie(24, s)
    t.extend(s.token_ids)
    assert [d for _, d in t.open] == [2, 1]  # "1 2" and "2" occurred before; "3 1 2" did not


# -- end to end -----------------------------------------------------------------------------------


def make_repetitive_model(folder, scale: float = 0.03, **kwargs) -> str:
    """A tiny random Llama whose attention and MLP outputs are scaled down by ``scale``: its next token
    depends mostly on the last one, so its greedy output falls into loops that lookup drafters predict,
    while the rest of the context still breaks some loops (drafts get both accepted and rejected)."""
    from transformers import AutoModelForCausalLM

    path = make_model(folder, "llama", layers=2, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_repetitive_model(tmp_path_factory.mktemp("lookup") / "target", seed=0)
    return path, load_model(path).hf_model


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Short random phrases repeated: lookup drafters find matches in them from the first round."""
    return [p * r for p, r in zip(random_prompts(n, [3, 5, 7, 4], seed=seed), [4, 3, 2, 5])]


METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False,
               "suffix_decoding_max_spec_factor": 2.0},
}


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed_k", "adaptive"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_output_equals_plain_decoding(target, method, batch, adaptive, caplog):
    path, hf = target
    prompts = repetitive_prompts(batch, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    expected = [o.outputs[0].token_ids for o in LLM(path).generate(requests, sp)]
    llm = LLM(path, speculative_config={**METHODS[method], "adaptive": adaptive})
    for p, e, o in zip(prompts, expected, llm.generate(requests, sp)):
        assert_greedy_equal(hf, p, e, o.outputs[0].token_ids)
    m = llm.get_metrics()
    assert "drafter failed" not in caplog.text  # the engine would have decoded those sequences plainly
    if not adaptive:  # (the controller may rightly stop drafting for these sequences)
        assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]


def test_suffix_cache_of_earlier_outputs_drafts_a_repeated_request(target, caplog):
    path, hf = target
    prompts = repetitive_prompts(4, seed=2)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    expected = [o.outputs[0].token_ids for o in LLM(path).generate(requests, sp)]
    llm = LLM(path, speculative_config=METHODS["suffix"])
    rates = []
    for _ in range(2):  # the second time, the outputs of the first are in the global cache
        for p, e, o in zip(prompts, expected, llm.generate(requests, sp)):
            assert_greedy_equal(hf, p, e, o.outputs[0].token_ids)
        rates.append(llm.get_metrics()["mean_acceptance_length"])
        llm.reset_metrics()
    assert "drafter failed" not in caplog.text and len(llm.engine.drafter.cache.seqs) == 8
    assert rates[1] > rates[0] and rates[1] > 3


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    path = make_repetitive_model(tmp_path_factory.mktemp("lookup_small") / "t", words=SMALL_WORDS, seed=3,
                                 init_std=0.5, scale=0.005)
    return path, load_model(path).hf_model


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_k=4)], ids=["t1", "topk"])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_sampled_outputs_follow_the_target_distribution(small_vocab, method, params, caplog):
    path, hf = small_vocab
    prompt = [9, 3, 3, 3, 20, 9, 3, 3]  # lookup proposes "3 20", which the target finds likely
    N, V = 3000, len(SMALL_WORDS) + 3
    llm = LLM(path, speculative_config={**METHODS[method], "num_speculative_tokens": 2})
    sps = [SamplingParams(max_tokens=3, seed=2000 + i, ignore_eos=True, **params) for i in range(N)]
    tokens = np.array([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": prompt}] * N, sps)])
    assert_first_tokens_follow_target(hf, prompt, tokens, sps[0], V)
    assert "drafter failed" not in caplog.text and llm.get_metrics()["num_accepted_tokens"] > 0  # drafts were used
