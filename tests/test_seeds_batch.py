"""The seeds rule (policy.py, docs/algorithm.md "Seeds"): a seeded sampled request's output is its
output alone on a fresh engine, whatever runs beside it and whatever ran before, for every drafter,
tree mode and vocabulary mapping. Each case of issue 38 is reproduced first (a tree round turned
into a chain round by a companion's penalty or logprobs; suffix decoding's member read from the
global trie; draft_tokenizer_mapping "auto" chosen per round), then random companions are mixed
around a seeded request. Also: a drafter's bad output degrades (strict: raises), and a tree shape
that cannot hold k levels is refused at configuration time."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.drafters.base import DraftProposal, Drafter
from specdec.tree import DraftTree
from test_eagle3 import make_head
from tiny_models import WORDS, make_model, perturbed_copy, random_prompts, remapped_copy

SEEDED = SamplingParams(temperature=1.0, seed=42, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("seeds_batch")
    target = make_model(root / "target", seed=0)
    words = list(WORDS)
    random.Random(0).shuffle(words)
    return {"target": str(target), "draft": str(perturbed_copy(target, root / "draft", 0.05)),
            "other": str(remapped_copy(target, root / "other", words, scale=0.002)),
            "head": make_head(str(target), root / "head")}


def prompts(n: int = 5) -> list[list[int]]:
    return random_prompts(n, [6, 7, 8, 9, 5, 6, 7, 8][:n], seed=3)


def first_output(target: str, cfg: dict | None, reqs: list[tuple[list[int], SamplingParams]],
                 drafted: list[int] | None = None) -> list[int]:
    """The first request's tokens, run with the others on a fresh engine. It must have speculated, or
    with ``drafted`` (the adaptive controller may keep a short run plain) its drafts are appended there."""
    llm = LLM(target, dtype="float32", backend="torch", speculative_config=cfg)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [sp for _, sp in reqs])
    n = llm.get_metrics()["num_draft_tokens"]
    if drafted is None:
        assert n > 0  # it did speculate
    else:
        drafted.append(n)
    return outs[0].outputs[0].token_ids


# -- the reproductions of issue 38 -------------------------------------------------------------------


@pytest.mark.parametrize("companion", [dict(presence_penalty=0.5), dict(logprobs=1)])
def test_a_tree_round_does_not_turn_into_a_chain_round_beside_a_penalty_or_logprobs(models, companion):
    cfg = {"method": "draft_model", "model": models["draft"], "num_speculative_tokens": 3, "draft_tree": "tree",
           "adaptive": False}
    p = prompts()
    alone = first_output(models["target"], cfg, [(p[0], SEEDED)])
    other = SamplingParams(temperature=1.0, max_tokens=24, **companion)
    assert first_output(models["target"], cfg, [(p[0], SEEDED), (p[1], other)]) == alone


def test_a_companion_with_logprobs_gets_them_from_the_tree_pass(models):
    """The companion drafts a chain inside the tree round: its logprobs are those of its own tokens,
    the same as a plain run's (raw logprobs do not depend on drafts)."""
    cfg = {"method": "draft_model", "model": models["draft"], "num_speculative_tokens": 3, "draft_tree": "tree",
           "adaptive": False}
    p = prompts()
    lp = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    spec = LLM(models["target"], dtype="float32", backend="torch", speculative_config=cfg)
    got = spec.generate([{"prompt_token_ids": p[0]}, {"prompt_token_ids": p[1]}], [SEEDED, lp])[1].outputs[0]
    plain = LLM(models["target"], dtype="float32", backend="torch").generate([{"prompt_token_ids": p[1]}], lp)[0]
    want = plain.outputs[0]
    assert got.token_ids == want.token_ids and len(got.logprobs) == len(want.logprobs)
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


def test_suffix_decoding_in_front_of_a_model_does_not_read_earlier_outputs_for_a_seeded_row(models):
    cfg = {"method": "draft_model", "model": models["draft"], "num_speculative_tokens": 3, "adaptive": False,
           "enable_suffix_decoding": True, "suffix_decoding_min_score": 0.5, "draft_tree": "chain"}
    prompt = prompts()[0] * 3
    llm = LLM(models["target"], dtype="float32", backend="torch", speculative_config=cfg)
    first = llm.generate([{"prompt_token_ids": prompt}], SEEDED)[0].outputs[0].token_ids
    second = llm.generate([{"prompt_token_ids": prompt}], SEEDED)[0].outputs[0].token_ids  # the trie holds the first
    plain = LLM(models["target"], dtype="float32", backend="torch").generate([{"prompt_token_ids": prompt}], SEEDED)
    assert first == second == plain[0].outputs[0].token_ids  # the suffix tries' one-hot drafts: the plain output


def test_an_auto_vocabulary_mapping_is_fixed_for_a_seeded_row(models):
    cfg = {"method": "draft_model", "model": models["other"], "num_speculative_tokens": 3, "adaptive": False,
           "draft_tokenizer_mapping": "auto"}
    p = prompts()
    alone = first_output(models["target"], cfg, [(p[0], SEEDED)])
    others = [SamplingParams(temperature=t, max_tokens=30, ignore_eos=True) for t in (0.0, 0.8, 1.2)]
    assert first_output(models["target"], cfg, [(p[0], SEEDED)] + list(zip(p[1:4], others))) == alone


# -- random companions -------------------------------------------------------------------------------


def companions(rng: random.Random, n: int) -> list[SamplingParams]:
    out = []
    for _ in range(n):
        kw = dict(temperature=rng.choice([0.0, 0.7, 1.0, 1.3]), max_tokens=rng.randint(3, 30), ignore_eos=True,
                  n=rng.choice([1, 1, 2]))
        if rng.random() < 0.4:
            kw[rng.choice(["presence_penalty", "frequency_penalty"])] = rng.choice([-0.5, 0.5, 1.0])
        if rng.random() < 0.3:
            kw["repetition_penalty"] = 1.2
        if rng.random() < 0.4:
            kw["logprobs"] = rng.choice([0, 1, 3])
        if rng.random() < 0.5:
            kw["seed"] = rng.randrange(1000)
        out.append(SamplingParams(**kw))
    return out


CASES = [("draft_model", "chain"), ("draft_model", "tree"), ("ngram", "chain"), ("suffix", "tree"),
         ("hybrid", "tree"), ("eagle3", "tree"), ("other", "chain"), (["suffix", "draft_model"], "tree")]


def spec(models, method, tree: str) -> dict:
    cfg = {"num_speculative_tokens": 3, "adaptive": True, "draft_tree": tree}
    if method == "hybrid":
        return cfg | {"method": "draft_model", "model": models["draft"], "enable_suffix_decoding": True,
                      "suffix_decoding_min_score": 0.5}
    if method == "other":
        return cfg | {"method": "draft_model", "model": models["other"]}
    if method == "eagle3":
        return cfg | {"method": "eagle3", "model": models["head"]}
    if method == "ngram":
        return cfg | {"method": "ngram", "prompt_lookup_min": 1}
    return cfg | {"method": method} | ({"model": models["draft"]} if "draft_model" in method or method == "draft_model"
                                       else {})


@pytest.mark.parametrize("method, tree", CASES, ids=[f"{m}-{t}" for m, t in CASES])
def test_a_seeded_request_among_random_companions_gives_its_output_alone(models, method, tree):
    rng = random.Random(zlib.crc32(f"{method}-{tree}".encode()))  # str hashes vary per process
    cfg = spec(models, method, tree)
    p = prompts(8)
    seeded = SamplingParams(temperature=rng.choice([0.6, 1.0]), seed=rng.randrange(1000), max_tokens=20,
                            ignore_eos=True, presence_penalty=rng.choice([0.0, 0.5]))
    drafted: list[int] = []
    alone = first_output(models["target"], cfg, [(p[0] * 2, seeded)], drafted)
    for trial in range(2):
        others = companions(rng, rng.randint(2, 5))
        got = first_output(models["target"], cfg, [(p[0] * 2, seeded)] + list(zip(p[1:], others)), drafted)
        assert got == alone, f"trial {trial}: companions {others}"
    assert sum(drafted) > 0  # the rounds did speculate


# -- a drafter's bad output degrades; a tree that cannot hold k levels is refused ---------------------


class OutOfVocabulary(Drafter):
    method = "broken"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def propose(self, seqs, num_draft, sb):
        return DraftProposal.from_rows([[self.vocab_size + 5] * n for n in num_draft], sb.device)


class ZeroQTree(Drafter):
    """Sampled siblings whose q gives the second one probability 0: verify_tree cannot verify it."""
    method = "broken"
    can_draft_trees = True

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def propose(self, seqs, num_draft, sb):
        raise AssertionError("a tree round asks for trees")

    def propose_tree(self, seqs, shapes, sb):
        q = torch.zeros(2, self.vocab_size)
        q[:, 4] = 1.0  # token 5 has probability 0
        return [DraftTree([4, 5], [-1, -1], q) if sh is not None else None for sh in shapes]


@pytest.mark.parametrize("broken", ["chain", "tree"])
def test_a_drafter_bug_degrades_to_plain_decoding_and_raises_when_strict(models, broken):
    from specdec.engine import Engine

    p = prompts()[0]
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    plain = LLM(models["target"], dtype="float32", backend="torch").generate([{"prompt_token_ids": p}], sp)
    for strict in (False, True):
        llm = LLM(models["target"], dtype="float32", backend="torch")
        drafter = (OutOfVocabulary if broken == "chain" else ZeroQTree)(llm.target.vocab_size)
        llm.engine = Engine(llm.target, drafter, 2, tokenizer=llm.tokenizer, strict_drafter=strict,
                            draft_tree="chain" if broken == "chain" else "tree")
        if strict:
            with pytest.raises(ValueError, match="vocabulary" if broken == "chain" else "probability 0"):
                llm.generate([{"prompt_token_ids": p}], sp)
        else:
            out = llm.generate([{"prompt_token_ids": p}], sp)
            assert llm.engine.drafter_failures == 1
            assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids  # plain decoding's draws


def test_a_tree_that_cannot_hold_k_levels_is_refused_up_front():
    with pytest.raises(ValueError, match="draft_tree_max_nodes=7 nodes.*num_speculative_tokens=8"):
        SpeculativeConfig(method=["ngram", "draft_model"], model="m", num_speculative_tokens=8, draft_tree="tree",
                          draft_tree_max_nodes=7)
    SpeculativeConfig(method="ngram", num_speculative_tokens=8, draft_tree="auto", draft_tree_max_nodes=7)  # capped
    SpeculativeConfig(method="ngram", num_speculative_tokens=7, draft_tree="tree", draft_tree_max_nodes=7)
