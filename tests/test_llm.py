"""The public API's input checks: each bad input names the problem and the fix."""

import pytest
import torch

from specdec import LLM, SamplingParams
from tiny_models import make_model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(make_model(tmp_path_factory.mktemp("t") / "m", "llama", max_pos=64))


@pytest.fixture(scope="module")
def llm(target):
    return LLM(target)


def test_vocabularies_that_differ_are_refused(target, tmp_path):
    other = make_model(tmp_path / "other", "llama", words=[f"v{i}" for i in range(120)])
    with pytest.raises(ValueError, match="different vocabularies.*same model family"):
        LLM(target, speculative_config={"model": str(other), "num_speculative_tokens": 2})


def test_padded_draft_embeddings_with_the_same_tokenizer_are_accepted(target, tmp_path):
    padded = make_model(tmp_path / "padded", "llama", vocab_rows=200, max_pos=64)
    llm = LLM(target, speculative_config={"model": str(padded), "num_speculative_tokens": 2})
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5


@pytest.mark.parametrize("cfg, message", [
    ({"model": "x", "num_speculative_tokens": 65}, "num_speculative_tokens must be an integer in 0..64"),
    ({"model": "x", "num_speculative_tokens": -1}, "num_speculative_tokens must be an integer in 0..64"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method 'medusa' is not supported"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"model": "x", "num_speculative_token": 2}, "unknown speculative_config keys"),
    ({"model": "/no/such/draft", "num_speculative_tokens": 2}, "does not exist"),
    ({"method": "ngram", "enable_suffix_decoding": True}, "in front of a model drafter"),
    ({"model": "x", "enable_suffix_decoding": True, "suffix_decoding_min_score": -1}, "min_score must be a number >= 0"),
])
def test_bad_speculative_config(target, cfg, message):
    with pytest.raises(ValueError, match=message):
        LLM(target, speculative_config=cfg)


def test_bad_model_arguments(target, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(target, dtype="int8")
    with pytest.raises(ValueError, match="max_model_len=100 exceeds"):
        LLM(target, max_model_len=100)
    with pytest.raises(ValueError, match="num_scheduler_steps must be an integer >= 1, got 0"):
        LLM(target, num_scheduler_steps=0)
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1, got -1"):
        LLM(target, max_num_seqs=-1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            LLM(target, device="cuda")


def test_prompt_longer_than_the_context_is_refused(llm):
    with pytest.raises(ValueError, match="prompt has 64 tokens but the model's context is 64"):
        llm.generate({"prompt_token_ids": [5] * 64}, SamplingParams(max_tokens=1))
    # the engine is still usable afterwards
    assert llm.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=2))[0].finished


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"prompt_token_ids": [5, 10_000]}, "outside the vocabulary"),
    ({"prompt_token_ids": "5 6"}, "must be a list of integers"),
    ({"text": "w1"}, "needs 'prompt'"),
    (3.5, "must be a string"),
])
def test_bad_prompts(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=2))


def test_params_list_must_match_prompts(llm):
    with pytest.raises(ValueError, match="got 2 SamplingParams for 1 prompts"):
        llm.generate(["w1 w2"], [SamplingParams(), SamplingParams()])


def test_text_prompts_and_token_prompts_agree(llm):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = llm.get_tokenizer().encode("w1 w2 w3")
    a, b = llm.generate(["w1 w2 w3", {"prompt_token_ids": ids}], sp)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.prompt == "w1 w2 w3" and a.prompt_token_ids == ids
    assert a.outputs[0].text == llm.get_tokenizer().decode(a.outputs[0].token_ids, skip_special_tokens=True)
