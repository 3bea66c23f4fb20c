"""The model pair shipped inside the package: loads offline by name, and speculation is lossless on it."""

import pytest

from lossless import assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.models.loader import SHIPPED

pytestmark = pytest.mark.skipif(not (SHIPPED["specdec/demo-draft"] / "config.json").exists(),
                                reason="the shipped pair is not installed")
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\ndef main():\n"]


def test_shipped_pair_greedy_speculation_equals_plain_decoding():
    from transformers import AutoModelForCausalLM

    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM("specdec/demo-target").generate(PROMPTS, sp)
    spec_llm = LLM("specdec/demo-target", speculative_config={"method": "draft_model", "model": "specdec/demo-draft",
                                                               "num_speculative_tokens": 3, "adaptive": False})
    spec = spec_llm.generate(PROMPTS, sp)
    hf = AutoModelForCausalLM.from_pretrained(str(SHIPPED["specdec/demo-target"]))
    for a, b in zip(plain, spec):
        assert_greedy_equal(hf, a.prompt_token_ids, a.outputs[0].token_ids, b.outputs[0].token_ids)
    assert spec_llm.get_metrics()["acceptance_rate"] > 0.2  # the distilled draft does agree with its target
    assert "def" in plain[0].outputs[0].text or "return" in plain[0].outputs[0].text
