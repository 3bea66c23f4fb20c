"""The shipped draft with its own tokenizer (specdec/assets/demo-draft-vocab4k) against the shipped
target: it loads offline, runs through the other-vocabulary mappings, and greedy speculation is
lossless with it."""

from pathlib import Path

import pytest

from specdec import LLM, SamplingParams
from specdec.near_tie import first_divergence

DRAFT = Path(__file__).resolve().parents[1] / "specdec" / "assets" / "demo-draft-vocab4k"
pytestmark = pytest.mark.skipif(not (DRAFT / "config.json").exists(), reason="the vocab4k draft is not installed")
PROMPTS = ['def fibonacci(n):\n    """', "class Stack:\n    def __init__(self):\n        self.", "import os\n\ndef main():\n   "]


@pytest.fixture(scope="module")
def plain():
    llm = LLM("specdec/demo-target")
    return llm, llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))


@pytest.mark.parametrize("mapping", ["string", "intersection"])
def test_vocab4k_draft_greedy_speculation_equals_plain_decoding(plain, mapping):
    """Equal, or parting where the target's top-2 logits are within its dtype's rounding."""
    plain_llm, expected = plain
    spec_llm = LLM("specdec/demo-target", speculative_config={
        "method": "draft_model", "model": str(DRAFT), "num_speculative_tokens": 3, "adaptive": False,
        "draft_tokenizer_mapping": mapping})
    drafter = spec_llm.engine.drafter
    assert drafter.mapping == mapping  # the other-vocabulary drafter runs, with the mapping asked for
    assert len(drafter.draft_tok) == 4096 and len(spec_llm.tokenizer) == 8192
    spec = spec_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for a, b in zip(expected, spec):
        d = first_divergence(plain_llm.engine.target, a.prompt_token_ids, a.outputs[0].token_ids, b.outputs[0].token_ids)
        assert d is None or d["near_tie"], d
    assert spec_llm.get_metrics()["acceptance_rate"] > 0.3  # taught on the target's outputs, it agrees with them
