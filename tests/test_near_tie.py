"""specdec.near_tie: where greedy outputs part, and whether that is a near-tie."""

from types import SimpleNamespace

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.models.base import ForwardBatch
from specdec.near_tie import FLOAT32_NEAR_TIE, first_divergence, near_tie_threshold, top2
from tiny_models import make_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(make_model(tmp_path_factory.mktemp("m"))))


def test_threshold_follows_the_weights_dtype():
    assert near_tie_threshold(SimpleNamespace(dtype=torch.float32), 20.0) == FLOAT32_NEAR_TIE
    bf16 = SimpleNamespace(dtype=torch.bfloat16)
    assert near_tie_threshold(bf16, 8.0) == pytest.approx(8.0 * 2**-6)  # two bf16 steps at |logit| 8
    assert near_tie_threshold(bf16, 0.01) == FLOAT32_NEAR_TIE  # never below the float32 floor
    w16 = SimpleNamespace(dtype=torch.bfloat16, lm_head=SimpleNamespace(kind="w16"))  # float32 products
    assert near_tie_threshold(w16, 8.0) == FLOAT32_NEAR_TIE
    onednn = SimpleNamespace(dtype=torch.bfloat16, lm_head=SimpleNamespace(kind="onednn"))  # bf16 products
    assert near_tie_threshold(onednn, 8.0) == pytest.approx(8.0 * 2**-6)


def test_first_divergence(llm):
    prompt = [5, 6, 7, 8]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    expected = out[0].outputs[0].token_ids
    runner = llm.engine.target
    assert first_divergence(runner, prompt, expected, list(expected)) is None
    assert first_divergence(runner, prompt, expected, expected[:-1])["near_tie"] is False  # a length difference

    # Swap token 2 for the runner's runner-up there: a divergence at a real gap is not a near-tie.
    top, gap = top2(runner, prompt + expected[:2])
    assert top == pytest.approx(float(llm.engine.target.forward(
        ForwardBatch.dense(torch.tensor([prompt + expected[:2]]), [0], "last"))[0].max()))
    other = list(expected)
    other[2] = (other[2] + 1) % 100
    d = first_divergence(runner, prompt, expected, other)
    assert d["position"] == 2 and d["gap"] == pytest.approx(gap)
    assert d["near_tie"] == (gap < FLOAT32_NEAR_TIE) and d["threshold"] == FLOAT32_NEAR_TIE
