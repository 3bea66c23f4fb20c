"""Penalties, biases and masks under speculation: each verify position is processed as if the row's
earlier drafts were emitted, so greedy output equals plain decoding's and sampled output follows the
target's processed distribution exactly, for every drafter. The reference is transformers' own logits
processors (tests/lossless.py: reference_processing), not specdec's code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lossless import assert_first_tokens_follow_target, reference_processing
from specdec import LLM, SamplingParams
from specdec.models.load import load_model
from test_drafters_lookup import make_repetitive_model
from tiny_models import perturbed_copy

SMALL_WORDS = [f"w{i}" for i in range(20)]
V = len(SMALL_WORDS) + 3  # <unk>, <s>, </s>
EOS = 2

PROCESSING = {
    "repetition": dict(repetition_penalty=1.8),
    "presence_frequency": dict(presence_penalty=1.5, frequency_penalty=1.0),
    "logit_bias": dict(logit_bias={4: 3.0, 7: -100.0, 12: 1.5}),
    "min_tokens_bad_words": dict(min_tokens=2, bad_words=["w3", "w5 w6"]),
    "allowed_token_ids": dict(allowed_token_ids=[2, 4, 5, 6, 8, 9, 10, 11, 13]),
}
SPEC = {
    "draft_model": lambda draft: {"model": draft, "num_speculative_tokens": 3, "adaptive": False},
    "ngram": lambda draft: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False},
    "suffix": lambda draft: {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False},
}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A target with a small vocabulary whose next token depends mostly on the last (lookup drafters
    get accepted), and a perturbed copy as its draft model."""
    root = tmp_path_factory.mktemp("processing")
    target = make_repetitive_model(root / "t", words=SMALL_WORDS, seed=3, init_std=0.5, scale=0.05)
    draft = perturbed_copy(target, root / "d", 0.01)
    return target, str(draft), load_model(target).hf_model


def small_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in lengths]


def _bad_words_ids(llm: LLM, params: SamplingParams) -> list[list[int]]:
    from specdec.processing import bad_words_token_ids
    return bad_words_token_ids(llm.tokenizer, params.bad_words) if params.bad_words else []


def _reference_greedy(hf, prompt: list[int], params: SamplingParams, bad_words_ids, n: int) -> list[int]:
    process = reference_processing(params, len(prompt), [EOS], bad_words_ids)
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1, :V]
        ids.append(int(process(ids, logits).argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("processing", list(PROCESSING))
def test_plain_decoding_processes_logits_as_transformers_does(small, processing):
    target, _, hf = small
    llm = LLM(target)
    prompts = small_prompts([5, 7, 4], seed=4)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=processing != "min_tokens_bad_words",
                        **PROCESSING[processing])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, o in zip(prompts, outs):
        got = o.outputs[0].token_ids
        assert got == _reference_greedy(hf, p, sp, _bad_words_ids(llm, sp), len(got))
        assert len(got) == 12 or got[-1] == EOS


@pytest.mark.parametrize("processing", list(PROCESSING))
@pytest.mark.parametrize("method", list(SPEC))
def test_greedy_speculation_equals_plain_decoding_under_processing(small, method, processing):
    target, draft, _ = small
    prompts = [p * 3 for p in small_prompts([3, 4, 2, 5], seed=5)]  # repeats: lookup drafts get accepted
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **PROCESSING[processing])
    requests = [{"prompt_token_ids": p} for p in prompts]
    expected = [o.outputs[0].token_ids for o in LLM(target).generate(requests, sp)]
    llm = LLM(target, speculative_config=SPEC[method](draft))
    got = [o.outputs[0].token_ids for o in llm.generate(requests, sp)]
    assert got == expected  # float32 on both sides: no near-tie allowance needed
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0  # speculation ran
    if method == "draft_model" or processing not in ("repetition", "presence_frequency"):
        assert m["num_accepted_tokens"] > 0  # and was used (penalties on repeats defeat lookup drafts)


@pytest.mark.parametrize("processing", ["repetition", "presence_frequency", "logit_bias", "min_tokens_bad_words"])
@pytest.mark.parametrize("method", list(SPEC))
def test_sampled_outputs_follow_the_processed_target_distribution(small, method, processing):
    target, draft, hf = small
    prompt = [9, 3, 3, 3, 20, 9, 3, 3]
    N = 2000
    llm = LLM(target, speculative_config=SPEC[method](draft))
    sps = [SamplingParams(max_tokens=3, seed=3000 + i, ignore_eos=processing != "min_tokens_bad_words",
                          **PROCESSING[processing]) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, sps)
    tokens = np.array([o.outputs[0].token_ids + [EOS] * (3 - len(o.outputs[0].token_ids)) for o in outs])
    if processing == "min_tokens_bad_words":
        assert (tokens[:, :2] != EOS).all()  # min_tokens=2: no EOS among the first two
    process = reference_processing(sps[0], len(prompt), [EOS], _bad_words_ids(llm, sps[0]))
    if processing == "min_tokens_bad_words":  # an output that ended with EOS is padded with EOS: check t1, t2 only
        from lossless import FALSE_ALARM, chi_square_p, exact_joint
        joint2 = exact_joint(hf, prompt, sps[0], 2, V, process)
        assert chi_square_p(tokens[:, 0] * V + tokens[:, 1], joint2) > FALSE_ALARM
    else:
        assert_first_tokens_follow_target(hf, prompt, tokens, sps[0], V, process)
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0  # drafts were verified
    if method != "ngram":  # the prompt's lookups mostly miss under biases that favour unseen tokens
        assert m["num_accepted_tokens"] > 0


def test_processing_values_are_checked_against_the_vocabulary(small):
    target, _, _ = small
    llm = LLM(target)
    with pytest.raises(ValueError, match="allowed_token_ids has token ids \\[99\\]"):
        llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(allowed_token_ids=[4, 99]))
    with pytest.raises(ValueError, match="logit_bias has token ids"):
        llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(logit_bias={1000: 1.0}))
    for bad in (dict(presence_penalty=3.0), dict(repetition_penalty=0.0), dict(min_tokens=20, max_tokens=5),
                dict(logit_bias={"x": 1.0}), dict(bad_words=[""]), dict(allowed_token_ids=[])):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
