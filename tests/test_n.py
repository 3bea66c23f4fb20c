"""n > 1: several choices per prompt, each its own sequence, sharing the prompt's prefill (the target
prefills it once and copies the cache rows), seeded as vLLM seeds them (choice i: seed + i)."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.models.base import ForwardBatch
from test_drafters_lookup import make_repetitive_model, repetitive_prompts
from tiny_models import perturbed_copy

K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, n=3)
SEEDED = SamplingParams(temperature=0.3, seed=21, max_tokens=14, ignore_eos=True, n=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("n")
    target = make_repetitive_model(root / "target", seed=0)
    return {"target": target, "draft": str(perturbed_copy(target, root / "draft", 0.01))}


def spec_llm(models, method: str, **kwargs) -> LLM:
    cfg = {"method": method, "num_speculative_tokens": K, "adaptive": False}
    cfg |= {"model": models["draft"]} if method == "draft_model" else {"prompt_lookup_min": 1}
    return LLM(models["target"], speculative_config=cfg, **kwargs)


class PrefillSpy:
    """Records the real tokens of every target forward that the engine's prefill runs (each call
    forwarded unchanged)."""

    def __init__(self, llm: LLM):
        engine, runner = llm.engine, llm.target
        self.prefilled, self.active = [], False
        prefill, forward = engine._prefill, runner.forward

        def spy_prefill(*args):
            self.active = True
            try:
                return prefill(*args)
            finally:
                self.active = False

        def spy_forward(batch: ForwardBatch):
            if self.active:
                self.prefilled.append(sum(batch.lengths))
            return forward(batch)

        engine._prefill, runner.forward = spy_prefill, spy_forward


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_greedy_choices_all_equal_plain_decoding(models, method):
    prompts = repetitive_prompts(2, seed=4)
    llm = spec_llm(models, method)
    spy = PrefillSpy(llm)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    assert spy.prefilled == [sum(len(p) - 1 for p in prompts)]  # each prompt once, not three times
    want = LLM(models["target"]).generate([{"prompt_token_ids": p} for p in prompts],
                                          SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    for g, w in zip(got, want):
        assert [o.index for o in g.outputs] == [0, 1, 2]
        assert [o.token_ids for o in g.outputs] == [w.outputs[0].token_ids] * 3
        assert g.finished


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_seeded_choices_are_reproducible_and_each_equals_its_own_seed(models, method):
    prompt = {"prompt_token_ids": repetitive_prompts(1, seed=6)[0]}
    llm = spec_llm(models, method)
    first = [o.token_ids for o in llm.generate(prompt, SEEDED)[0].outputs]
    again = [o.token_ids for o in llm.generate(prompt, SEEDED)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) > 1  # the choices differ
    alone = [llm.generate(prompt, SamplingParams(temperature=0.3, seed=21 + i, max_tokens=14,
                                                 ignore_eos=True))[0].outputs[0].token_ids for i in range(3)]
    assert first == alone


def test_choices_with_logprobs_and_prompt_logprobs(models):
    llm = spec_llm(models, "draft_model")
    prompt = repetitive_prompts(1, seed=7)[0]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.3, seed=3, max_tokens=8, ignore_eos=True, n=2, logprobs=1,
                                      prompt_logprobs=1))[0]
    alone = llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(temperature=0.3, seed=4, max_tokens=8, ignore_eos=True, logprobs=1,
                                        prompt_logprobs=1))[0]
    assert len(out.prompt_logprobs) == len(prompt)
    assert [{t: round(v.logprob, 4) for t, v in d.items()} for d in out.prompt_logprobs[1:]] == \
        [{t: round(v.logprob, 4) for t, v in d.items()} for d in alone.prompt_logprobs[1:]]
    assert out.outputs[1].token_ids == alone.outputs[0].token_ids
    assert out.outputs[1].cumulative_logprob == pytest.approx(alone.outputs[0].cumulative_logprob, abs=1e-4)


def test_a_choice_admitted_later_copies_a_running_sibling(models):
    """With room for three sequences, a request of n = 3 behind another runs two choices first; the
    third joins when the other request ends and copies the prompt from a sibling still running."""
    llm = LLM(models["target"], speculative_config={"model": models["draft"], "num_speculative_tokens": K,
                                                      "adaptive": False}, max_num_seqs=3)
    engine = llm.engine
    prompt = repetitive_prompts(1, seed=8)[0]
    other = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3, prompt_logprobs=1)
    choices = engine.add_choices(prompt, params)
    spy = PrefillSpy(llm)
    engine.step()
    assert choices[2] in engine.waiting
    while engine.has_unfinished():
        engine.step()
    assert other.finished
    assert spy.prefilled == [2, len(prompt) - 1]  # the other prompt, then choice 0 alone (prompt logits); no more
    assert choices[2].prompt_logprobs is choices[0].prompt_logprobs
    want = LLM(models["target"]).generate({"prompt_token_ids": prompt},
                                          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [s.output_token_ids for s in choices] == [want[0].outputs[0].token_ids] * 3


def test_stream_yields_every_choice(models):
    llm = spec_llm(models, "ngram")
    prompt = {"prompt_token_ids": repetitive_prompts(1, seed=6)[0]}
    deltas = list(llm.stream(prompt, SEEDED))
    whole = llm.generate(prompt, SEEDED)[0].outputs
    for i in range(3):
        assert [t for d in deltas if d.index == i for t in d.token_ids] == whole[i].token_ids
        assert [d.finish_reason for d in deltas if d.index == i][-1] == "length"


def test_llamacpp_choices_share_the_prefill(models, tmp_path):
    from specdec.models.gguf import convert

    gguf = convert(models["target"], str(tmp_path / "t.gguf"), "f32")
    prompts = repetitive_prompts(2, seed=4)
    llm = LLM(gguf, backend="llama.cpp", tokenizer=models["target"],
              speculative_config={"method": "ngram", "num_speculative_tokens": K, "adaptive": False,
                                  "prompt_lookup_min": 1})
    spy = PrefillSpy(llm)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert spy.prefilled == [sum(len(p) - 1 for p in prompts)]
    want = LLM(models["target"]).generate([{"prompt_token_ids": p} for p in prompts],
                                          SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    for g, w in zip(got, want):
        assert [o.token_ids for o in g.outputs] == [w.outputs[0].token_ids] * 3


def test_greedy_choices_with_penalties_equal_plain_decoding(models):
    """Each choice keeps its own processor (penalty counts), so all equal plain decoding's output."""
    prompts = repetitive_prompts(2, seed=4)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, presence_penalty=0.1, logit_bias={9: 1.5})
    got = spec_llm(models, "draft_model").generate([{"prompt_token_ids": p} for p in prompts],
                                                   SamplingParams(**{**vars(params), "n": 3}))
    want = LLM(models["target"]).generate([{"prompt_token_ids": p} for p in prompts], params)
    for g, w in zip(got, want):
        assert [o.token_ids for o in g.outputs] == [w.outputs[0].token_ids] * 3
