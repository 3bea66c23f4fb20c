"""The model pair shipped inside the package: loads offline by name, and speculation is lossless on it."""

import pytest

from specdec import LLM, SamplingParams
from specdec.models.resolve import SHIPPED
from specdec.near_tie import first_divergence

pytestmark = pytest.mark.skipif(not (SHIPPED["specdec/demo-draft"] / "config.json").exists(),
                                reason="the shipped pair is not installed")
PROMPTS = ['def fibonacci(n):\n    """', "class Stack:\n    def __init__(self):\n        self.", "import os\n\ndef main():\n   "]


def test_shipped_pair_greedy_speculation_equals_plain_decoding():
    """Equal, or parting where the target's top-2 logits are within its dtype's rounding (bf16 here
    on CPUs with native bf16: two logits within 2^-6 of their size)."""
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain_llm = LLM("specdec/demo-target")
    plain = plain_llm.generate(PROMPTS, sp)
    spec_llm = LLM("specdec/demo-target", speculative_config={"method": "draft_model", "model": "specdec/demo-draft",
                                                               "num_speculative_tokens": 3, "adaptive": False})
    spec = spec_llm.generate(PROMPTS, sp)
    for a, b in zip(plain, spec):
        d = first_divergence(plain_llm.engine.target, a.prompt_token_ids, a.outputs[0].token_ids, b.outputs[0].token_ids)
        assert d is None or d["near_tie"], d
    assert spec_llm.get_metrics()["acceptance_rate"] > 0.2  # the distilled draft does agree with its target
    assert all(o.outputs[0].text.strip() for o in plain)
