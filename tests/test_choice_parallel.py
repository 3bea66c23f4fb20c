"""A parallel draft (PARD) and an EAGLE-3 head as members of a method list (drafters/choice.py):
lossless (greedy equality with plain decoding, the exact sampled distribution), and the choice goes
to the member when it is the one that pays."""

from __future__ import annotations

import numpy as np
import pytest

from lossless import assert_first_tokens_follow_target, assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.drafters.choice import member_config
from specdec.drafters.pard import ParallelDraftDrafter
from specdec.models.load import load_model
from test_eagle3 import last_token_target, make_copying_head, make_head
from test_pard import pard_copy
from tiny_models import SMALL_WORDS, make_model, random_prompts, small_vocab_pair

pytestmark = pytest.mark.usefixtures("one_thread")

LOOKUPS = ["suffix", "ngram"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("choice_parallel")
    target = make_model(root / "target", "llama", layers=4, seed=0)
    return {"target": str(target), "hf": load_model(str(target)).hf_model,
            "pard": pard_copy(target, root / "pard", 0.01, max_k=4),
            "pard_same": pard_copy(target, root / "pard_same", 0.0, max_k=4),  # drafts 1 are the target's own
            "head": make_head(str(target), root / "head")}


def plain(target: str, prompts: list[list[int]], sp: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM(target).generate([{"prompt_token_ids": p} for p in prompts], sp)]


def test_member_config_keeps_parallel_drafting_on_the_draft_model_only():
    from specdec.config import SpeculativeConfig

    spec = SpeculativeConfig(method=["ngram", "draft_model"], model="d", parallel_drafting=True)
    assert member_config(spec, "draft_model").parallel_drafting
    assert member_config(spec, "ngram").method == "ngram" and not member_config(spec, "ngram").parallel_drafting


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed_k", "adaptive"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_with_a_parallel_draft_in_the_list_equals_plain_decoding(models, batch, adaptive, caplog):
    import test_drafters_lookup as lookup_tests

    prompts = (lookup_tests.repetitive_prompts(2, seed=4) + random_prompts(2, [5, 9], seed=5))[:batch]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = plain(models["target"], prompts, sp)
    llm = LLM(models["target"], speculative_config={
        "method": ["suffix", "draft_model", "ngram"], "model": models["pard"], "parallel_drafting": True,
        "num_speculative_tokens": 3, "adaptive": adaptive})
    drafter = llm.engine.drafter
    member = drafter.parts["draft_model"]
    assert isinstance(member.drafter, ParallelDraftDrafter) and member.parallel
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    assert "drafter failed" not in caplog.text and drafter.rounds_per_method["draft_model"] > 0
    if adaptive:  # the list's rounds mix members: the controller charges its draft time per token, as before
        assert not llm.engine.controller.costs.parallel


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_with_an_eagle3_head_in_the_list_equals_plain_decoding(models, batch, caplog):
    import test_drafters_lookup as lookup_tests

    prompts = (lookup_tests.repetitive_prompts(2, seed=6) + random_prompts(1, [7], seed=7))[:batch]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = plain(models["target"], prompts, sp)
    llm = LLM(models["target"], backend="torch", speculative_config={
        "method": ["ngram", "eagle3"], "model": models["head"], "num_speculative_tokens": 3, "adaptive": False})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    assert "drafter failed" not in caplog.text and llm.engine.drafter.rounds_per_method["eagle3"] > 0


def test_a_parallel_draft_that_agrees_takes_the_rounds(models, caplog):
    """Its first draft is the target's own (the same weights), the prompts random: it drafts nearly every
    round, the lookups only when tried."""
    prompts = random_prompts(4, [6, 11, 4, 8], seed=8)
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = plain(models["target"], prompts, sp)
    llm = LLM(models["target"], speculative_config={
        "method": ["suffix", "draft_model", "ngram"], "model": models["pard_same"], "parallel_drafting": True,
        "num_speculative_tokens": 3, "adaptive": False})
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)] == expected
    served = llm.engine.drafter.rounds_per_method
    assert "drafter failed" not in caplog.text and served["draft_model"] > 3 * (served["suffix"] + served["ngram"])
    assert llm.get_metrics()["num_rounds_per_method"]["draft_model"] == served["draft_model"]


def test_an_eagle3_head_is_chosen_as_far_as_it_agrees(tmp_path, caplog):
    """The same target and prompts (a target whose text loops, so the lookup finds drafts too), two
    heads: one that drafts what this target does (about 90% accepted per position) and a random one.
    The first drafts more rounds than the lookup; the random one is tried, then left to the lookup.
    Without a controller the chooser weighs the cost priors, so the counts do not depend on timings."""
    target = last_token_target(tmp_path / "target")
    prompts = random_prompts(3, [4, 9, 17], seed=2)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = plain(target, prompts, sp)
    served = {}
    for name, head in (("agrees", make_copying_head(target, tmp_path / "head")),
                       ("random", make_head(target, tmp_path / "random_head"))):
        llm = LLM(target, backend="torch", speculative_config={
            "method": ["ngram", "eagle3"], "model": head, "num_speculative_tokens": 4, "adaptive": False})
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        assert [o.outputs[0].token_ids for o in outs] == expected
        served[name] = llm.engine.drafter.rounds_per_method
    assert "drafter failed" not in caplog.text
    assert served["agrees"]["eagle3"] > served["agrees"]["ngram"], served
    assert served["agrees"]["eagle3"] >= 3 * served["random"]["eagle3"], served
    assert served["random"]["eagle3"] < served["random"]["ngram"], served


def test_sampled_outputs_with_a_parallel_draft_in_the_list_follow_the_target_distribution(tmp_path, caplog):
    """Temperature 1, unseeded: rows drafted by a lookup (one-hot q) beside rows drafted by the parallel
    draft (its q per mask position); the first three tokens follow the target's exact distribution."""
    target, _, hf = small_vocab_pair(tmp_path)
    pard = pard_copy(target, tmp_path / "pard", 0.05, max_k=4)
    prompts = [[9, 3, 3, 3, 20, 9, 3, 3], [5, 9, 3]]  # the lookups find "3 20" or "3 3" in the first
    N, V = 2500, len(SMALL_WORDS) + 3
    llm = LLM(target, speculative_config={"method": ["suffix", "draft_model", "ngram"], "model": pard,
                                          "parallel_drafting": True, "num_speculative_tokens": 2, "adaptive": False})
    sp = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompts[i % 2]} for i in range(2 * N)], sp)
    for i, prompt in enumerate(prompts):
        tokens = np.array([o.outputs[0].token_ids for o in outs[i::2]])  # [N, 3]
        assert_first_tokens_follow_target(hf, prompt, tokens, sp, V)
    served = llm.engine.drafter.rounds_per_method
    assert "drafter failed" not in caplog.text and llm.get_metrics()["num_accepted_tokens"] > 0
    assert served["draft_model"] > 0 and served["suffix"] + served["ngram"] > 0
