"""Several methods in speculative_config (drafters/choice.py): lossless like any drafter (greedy
equality, exact sampled distribution), the choice goes to the method that pays on a workload built
for it, seeded requests do not depend on their batch, and bad lists are refused. The CLI's
--method takes the list."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import test_drafters_lookup as lookup_tests  # the repetitive tiny target; a module, so its tests are not collected here
from lossless import assert_first_tokens_follow_target, assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.cli_common import CliError, build_speculative_config
from specdec.drafters.base import DraftProposal
from specdec.drafters.merge import merge_proposals
from specdec.models.load import load_model
from tiny_models import SMALL_WORDS, make_model, perturbed_copy, random_prompts, small_vocab_pair

ALL = ["suffix", "draft_model", "ngram"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("choice")
    target = make_model(root / "target", "llama", layers=2, seed=0)
    near = perturbed_copy(target, root / "near", 0.01)  # a partly agreeing draft
    unrelated = make_model(root / "unrelated", "llama", layers=1, seed=1)
    repetitive = lookup_tests.make_repetitive_model(root / "repetitive", seed=0)
    return {"target": str(target), "near": str(near), "unrelated": str(unrelated), "repetitive": repetitive,
            "hf": load_model(str(target)).hf_model}


def plain(target: str, prompts: list[list[int]], sp: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM(target).generate([{"prompt_token_ids": p} for p in prompts], sp)]


# -- lossless -------------------------------------------------------------------------------------


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed_k", "adaptive"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_equals_plain_decoding(models, batch, adaptive, caplog):
    """Prompts that repeat a phrase (lookups find drafts) and random ones (only the model drafts)."""
    prompts = (lookup_tests.repetitive_prompts(2, seed=4) + random_prompts(2, [5, 9], seed=5))[:batch]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = plain(models["target"], prompts, sp)
    llm = LLM(models["target"], speculative_config={"method": ALL, "model": models["near"],
                                                    "num_speculative_tokens": 3, "adaptive": adaptive})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    served = llm.engine.drafter.rounds_per_method
    assert "drafter failed" not in caplog.text and served["draft_model"] > 0
    if not adaptive:  # (the controller may rightly stop drafting on this CPU: the target is tiny)
        assert served["suffix"] + served["ngram"] > 0 and llm.get_metrics()["num_accepted_tokens"] > 0


def test_greedy_with_layer_skip_in_the_list_equals_plain_decoding(models, caplog):
    prompts = lookup_tests.repetitive_prompts(3, seed=6)
    sp = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    expected = plain(models["target"], prompts, sp)
    llm = LLM(models["target"], speculative_config={"method": ["layer_skip", "ngram"], "num_draft_layers": 1,
                                                    "num_speculative_tokens": 3, "adaptive": False})
    for p, e, o in zip(prompts, expected, llm.generate([{"prompt_token_ids": p} for p in prompts], sp)):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    assert "drafter failed" not in caplog.text and min(llm.engine.drafter.rounds_per_method.values()) > 0


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    return small_vocab_pair(tmp_path_factory.mktemp("choice_small"))


def test_sampled_outputs_follow_the_target_distribution(small_vocab, caplog):
    """Temperature 1, unseeded (a seeded request drafts only with the lookups, below). Half the requests
    repeat a phrase (the lookups find drafts), half do not (only the model has one), so rounds mix
    one-hot lookup rows with rows sampled from the draft model's q; the first three tokens of each
    prompt still follow the target's exact distribution (chi-square)."""
    target, draft, hf = small_vocab
    prompts = [[9, 3, 3, 3, 20, 9, 3, 3], [5, 9, 3]]  # the lookups find "3 20" or "3 3" in the first
    N, V = 2500, len(SMALL_WORDS) + 3
    llm = LLM(target, speculative_config={"method": ALL, "model": draft, "num_speculative_tokens": 2,
                                          "adaptive": False})
    mixed = []
    propose = llm.engine.drafter.propose

    def recorded(seqs, want, sb):
        proposal = propose(seqs, want, sb)
        mixed.append(len({m for m, n in zip(proposal.sources, proposal.num_draft_tokens) if n}) > 1)
        return proposal

    llm.engine.drafter.propose = recorded
    sp = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompts[i % 2]} for i in range(2 * N)], sp)
    for i, prompt in enumerate(prompts):
        tokens = np.array([o.outputs[0].token_ids for o in outs[i::2]])  # [N, 3]
        assert_first_tokens_follow_target(hf, prompt, tokens, sp, V)
    assert "drafter failed" not in caplog.text and llm.get_metrics()["num_accepted_tokens"] > 0
    assert any(mixed)  # some round drafted rows with a lookup and rows with the model


def test_merge_gives_deterministic_rows_a_one_hot_q_beside_sampled_ones():
    q = torch.softmax(torch.randn(3, 2, 5), dim=-1)  # [B, k, V]
    model = DraftProposal(torch.tensor([[1, 2], [0, 0], [3, 4]]), q, [2, 0, 1])
    lookup = DraftProposal(torch.tensor([[0, 0, 0], [4, 1, 2], [0, 0, 0]]), None, [0, 3, 0])
    merged = merge_proposals({"draft_model": model, "ngram": lookup}, ["draft_model", "ngram", "draft_model"], "cpu")
    assert merged.num_draft_tokens == [2, 3, 1] and merged.sources == ["draft_model", "ngram", "draft_model"]
    assert merged.draft_token_ids.tolist() == [[1, 2, 0], [4, 1, 2], [3, 0, 0]]
    assert torch.equal(merged.draft_probs[0, :2], q[0]) and torch.equal(merged.draft_probs[2, :1], q[2, :1])
    assert torch.equal(merged.draft_probs[1], torch.eye(5)[[4, 1, 2]])  # one-hot of the lookup's drafts
    only_lookup = merge_proposals({"draft_model": model, "ngram": lookup}, ["ngram"] * 3, "cpu")
    assert only_lookup.draft_probs is None and only_lookup.num_draft_tokens == [0, 3, 0]


# -- the choice -----------------------------------------------------------------------------------


def test_repetitive_text_goes_to_the_lookups_and_an_unrelated_draft_is_left(models, caplog):
    """A target that loops, a draft that knows nothing of it: after one try per request, the lookups
    draft nearly every round."""
    prompts = lookup_tests.repetitive_prompts(4, seed=7)
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = plain(models["repetitive"], prompts, sp)
    llm = LLM(models["repetitive"], speculative_config={"method": ALL, "model": models["unrelated"],
                                                        "num_speculative_tokens": 4, "adaptive": False})
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)] == expected
    served = llm.engine.drafter.rounds_per_method
    lookups = served["suffix"] + served["ngram"]
    assert "drafter failed" not in caplog.text and lookups > 5 * served["draft_model"] and served["draft_model"] > 0


def test_a_draft_that_is_the_target_takes_the_rounds(models, caplog):
    """The draft is a copy of the target (every draft accepted), the prompts are random: the draft model
    drafts nearly every round, the lookups only when they are tried or probed."""
    prompts = random_prompts(4, [6, 11, 4, 8], seed=8)
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = plain(models["target"], prompts, sp)
    llm = LLM(models["target"], speculative_config={"method": ALL, "model": models["target"],
                                                    "num_speculative_tokens": 4, "adaptive": False})
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)] == expected
    served = llm.engine.drafter.rounds_per_method
    assert "drafter failed" not in caplog.text and served["draft_model"] > 3 * (served["suffix"] + served["ngram"])
    m = llm.get_metrics()
    assert m["num_rounds_per_method"]["draft_model"] == served["draft_model"]  # the engine's counters agree


# -- seeds ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("methods", [ALL, ["draft_model", "ngram"]], ids=["with_suffix", "ngram_only"])
def test_seeded_requests_do_not_depend_on_their_batch(models, methods):
    """A seeded sampled request drafts only with the lookups, whose one-hot drafts race plain
    decoding's own draws: alone, in a batch of others, and with plain decoding it emits the same."""
    prompt = lookup_tests.repetitive_prompts(1, seed=11)[0]
    others = random_prompts(3, [4, 9, 6], seed=12)
    # a target whose next token follows mostly from the last, sampled cool: its text loops, so the lookups
    # find matches whatever the seed draws
    sp = SamplingParams(temperature=0.05, seed=77, max_tokens=30, ignore_eos=True)
    cfg = {"method": methods, "model": models["unrelated"], "num_speculative_tokens": 3}
    llm = LLM(models["repetitive"], speculative_config=cfg)
    alone = llm.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0].token_ids
    served = dict(llm.engine.drafter.rounds_per_method)  # the seeded request's alone
    assert served["ngram"] + served.get("suffix", 0) > 0 and served["draft_model"] == 0  # it drafted, with lookups
    free = SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True)  # unseeded: any method
    batch = llm.generate([{"prompt_token_ids": p} for p in [others[0], prompt, *others[1:]]], [free, sp, free, free])
    assert batch[1].outputs[0].token_ids == alone
    assert alone == plain(models["repetitive"], [prompt], sp)[0]


def test_seeded_requests_without_a_lookup_keep_the_first_method(models):
    prompt = random_prompts(1, [6], seed=13)[0]
    sp = SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True)
    cfg = {"method": ["draft_model", "layer_skip"], "model": models["near"], "num_draft_layers": 1,
           "num_speculative_tokens": 3}
    llm = LLM(models["target"], speculative_config=cfg)
    alone = llm.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0].token_ids
    free = SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": p} for p in [prompt, *random_prompts(2, [5, 3], seed=14)]],
                         [sp, free, free])
    assert batch[0].outputs[0].token_ids == alone
    single = LLM(models["target"], speculative_config={**cfg, "method": "draft_model"})
    assert single.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0].token_ids == alone


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg, message", [
    ({"method": ["suffix", "medusa"]}, "method 'medusa' is not supported"),
    ({"method": ["ngram", "suffix", "ngram"]}, "name each method once"),
    ({"method": ["suffix", "draft_model"], "model": "x", "enable_suffix_decoding": True},
     "list 'suffix' among the methods"),
    ({"method": []}, "non-empty list"),
    ({"method": ["ngram", "draft_model"]}, "needs 'model'"),
    ({"method": ["ngram", "draft_model"], "model": "/no/such/draft"}, "does not exist"),
])
def test_bad_lists_of_methods(models, cfg, message):
    with pytest.raises(ValueError, match=message):
        LLM(models["target"], speculative_config={"num_speculative_tokens": 2, **cfg})


def test_cli_method_option():
    assert build_speculative_config(None, None, None, method="suffix, ngram") == {
        "method": ["suffix", "ngram"], "num_speculative_tokens": 4}
    with pytest.raises(CliError, match="needs the draft model: pass --draft"):
        build_speculative_config(None, None, None, method="suffix,draft_model")
    assert build_speculative_config("D", 3, None, method="suffix,draft_model") == {
        "method": ["suffix", "draft_model"], "model": "D", "num_speculative_tokens": 3}
    assert build_speculative_config(None, None, '{"model": "D"}', method="ngram,draft_model")["method"] == [
        "ngram", "draft_model"]
    assert build_speculative_config(None, 2, None, method="ngram") == {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(CliError, match="empty name"):
        build_speculative_config(None, None, None, method="suffix,,ngram")
    with pytest.raises(CliError, match="disagrees"):
        build_speculative_config(None, None, '{"method": "ngram"}', method="suffix,ngram")


def test_cli_generate_with_several_methods(models):
    """``specdec generate --method suffix,draft_model,ngram --draft D``: the list reaches the engine, which
    drafts with it, and the greedy output is plain decoding's; a bad list exits 2 naming the problem."""
    from typer.testing import CliRunner

    from specdec.cli import app

    prompt = lookup_tests.repetitive_prompts(1, seed=15)[0]
    ids = ",".join(map(str, prompt))
    common = ["generate", "--model", models["target"], "--prompt-token-ids", ids, "--temperature", "0",
              "--max-tokens", "20", "--ignore-eos"]
    result = CliRunner().invoke(app, [*common, "--method", "suffix,draft_model,ngram", "--draft", models["near"],
                                      "--no-adaptive", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["token_ids"] == plain(models["target"], [prompt], SamplingParams(temperature=0, max_tokens=20,
                                                                                 ignore_eos=True))[0]
    assert out["metrics"]["num_draft_tokens"] > 0
    bad = CliRunner().invoke(app, [*common, "--method", "suffix,medusa"])
    assert bad.exit_code == 2 and "method 'medusa' is not supported" in bad.stderr
