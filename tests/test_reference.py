"""The reference loop (specdec/reference.py) as the batched engine's oracle."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from lossless import FALSE_ALARM, assert_greedy_equal, chi_square_p, exact_joint
from specdec import LLM, SamplingParams
from specdec.models.llama import LlamaRunner
from specdec.models.load import load_model
from specdec.reference import speculative_generate, speculative_generate_tree
from tiny_models import make_model, perturbed_copy, random_prompts

SMALL_WORDS = [f"w{i}" for i in range(20)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    target = make_model(root / "t", "llama", seed=1)
    draft = perturbed_copy(target, root / "d", 0.03)  # agrees often, not always
    return str(target), str(draft)


def test_engine_greedy_equals_the_reference_loop(pair):
    target, draft = pair
    hf = load_model(target).hf_model
    t_runner, d_runner = LlamaRunner(load_model(target)), LlamaRunner(load_model(draft))
    prompts = random_prompts(5, [3, 9, 17, 5, 12], seed=4)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(target, speculative_config={"model": draft, "num_speculative_tokens": 3})
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    for p, got in zip(prompts, batched):
        expected = speculative_generate(t_runner, d_runner, p, sp, k=3)
        assert len(expected) == 24
        assert_greedy_equal(hf, p, expected, got)
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0 and 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference_small")
    target = make_model(root / "t", "llama", words=SMALL_WORDS, seed=3, init_std=0.5)
    draft = perturbed_copy(target, root / "d", 0.3)  # disagrees often: rejections and recovered tokens
    return str(target), str(draft)


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_k=4, top_p=0.9)],
                         ids=["t1", "topk-topp"])
def test_engine_samples_follow_the_reference_distribution(small_vocab, params):
    """The first two sampled tokens: the reference loop matches the exact target distribution, and the
    batched engine's samples are homogeneous with the reference's (a chi-square contingency test).
    The engine's first token comes from a plain pass, so its second is the one drafted (max_tokens 3)."""
    target, draft = small_vocab
    hf = load_model(target).hf_model
    V, N, prompt = len(SMALL_WORDS) + 3, 1000, [5, 9, 3]
    t_runner, d_runner = LlamaRunner(load_model(target)), LlamaRunner(load_model(draft))
    sps = [SamplingParams(max_tokens=2, seed=7000 + i, ignore_eos=True, **params) for i in range(N)]
    ref = np.array([speculative_generate(t_runner, d_runner, prompt, sp, k=2) for sp in sps])  # [N, 2]
    llm = LLM(target, speculative_config={"model": draft, "num_speculative_tokens": 2})
    sps3 = [SamplingParams(max_tokens=3, seed=8000 + i, ignore_eos=True, **params) for i in range(N)]
    eng = np.array([o.outputs[0].token_ids[:2] for o in llm.generate([{"prompt_token_ids": prompt}] * N, sps3)])
    assert llm.get_metrics()["num_draft_tokens"] > 0
    ref_joint, eng_joint = ref[:, 0] * V + ref[:, 1], eng[:, 0] * V + eng[:, 1]
    assert chi_square_p(ref_joint, exact_joint(hf, prompt, sps[0], 2, V)) > FALSE_ALARM
    outcomes = np.union1d(ref_joint, eng_joint)
    table = np.array([[np.sum(ref_joint == o) for o in outcomes], [np.sum(eng_joint == o) for o in outcomes]])
    table = table[:, table.sum(0) >= 10]  # outcomes too rare to test are left out
    assert stats.chi2_contingency(table).pvalue > FALSE_ALARM


def test_reference_loop_refuses_k_below_one(pair):
    target, draft = pair
    runner = LlamaRunner(load_model(target))
    with pytest.raises(ValueError, match="k must be >= 1"):
        speculative_generate(runner, runner, [5, 6], SamplingParams(max_tokens=2), k=0)


def test_tree_reference_loop_greedy_equals_plain_decoding(pair):
    target, draft = pair
    hf = load_model(target).hf_model
    t_runner, d_runner = LlamaRunner(load_model(target)), LlamaRunner(load_model(draft))
    prompts = random_prompts(3, [3, 9, 17], seed=6)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(target).generate([{"prompt_token_ids": p} for p in prompts], sp)]
    for p, expected in zip(prompts, plain):
        assert_greedy_equal(hf, p, expected, speculative_generate_tree(t_runner, d_runner, p, sp, depth=3, width=2))


def test_tree_reference_loop_samples_follow_the_target(small_vocab):
    """Two siblings drawn without replacement, each with a child: the first two tokens are exact (top-k
    and top-p: p and q have zeros)."""
    params = dict(temperature=0.8, top_k=4, top_p=0.9)
    target, draft = small_vocab
    hf = load_model(target).hf_model
    V, N, prompt = len(SMALL_WORDS) + 3, 700, [5, 9, 3]
    t_runner, d_runner = LlamaRunner(load_model(target)), LlamaRunner(load_model(draft))
    sps = [SamplingParams(max_tokens=2, seed=9000 + i, ignore_eos=True, **params) for i in range(N)]
    ref = np.array([speculative_generate_tree(t_runner, d_runner, prompt, sp, depth=2, width=2) for sp in sps])
    assert chi_square_p(ref[:, 0] * V + ref[:, 1], exact_joint(hf, prompt, sps[0], 2, V)) > FALSE_ALARM
