"""logprobs and prompt_logprobs: with speculation they equal plain decoding's for the same tokens,
and every value, rank and top-N set is the target's own (transformers' forward in float32)."""

from __future__ import annotations

import math

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.models.load import load_model
from specdec.sampling import SamplingBatch, probs_from_logits
from test_drafters_lookup import make_repetitive_model, repetitive_prompts
from tiny_models import perturbed_copy

K = 3
TOL = 1e-4
N_TOP = 5
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=N_TOP)
SEEDED = SamplingParams(temperature=0.3, seed=11, max_tokens=16, ignore_eos=True, logprobs=N_TOP)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    target = make_repetitive_model(root / "target", seed=0)
    return {"target": target, "draft": str(perturbed_copy(target, root / "draft", 0.01)),
            "hf": load_model(target).hf_model}


@pytest.fixture(scope="module")
def plain(models):
    return LLM(models["target"])


def spec_llm(models, method: str, **kwargs) -> LLM:
    cfg = {"method": method, "num_speculative_tokens": K, "adaptive": False}
    cfg |= {"model": models["draft"]} if method == "draft_model" else {"prompt_lookup_min": 1}
    return LLM(models["target"], speculative_config=cfg, **kwargs)


def hf_logits(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The target's float32 logits [len(output), V] at each output position (teacher forcing)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output[:-1]])).logits[0].float()
    return logits[len(prompt) - 1 :]


def assert_position_logprobs(got: dict, chosen: int, ref: torch.Tensor, n_top: int) -> None:
    """got: one position's {token: Logprob}; ref [V] the reference log probabilities there."""
    assert math.isclose(got[chosen].logprob, float(ref[chosen]), abs_tol=TOL)
    assert got[chosen].rank == int((ref >= ref[chosen]).sum())
    top = ref.topk(n_top)
    for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
        assert t in got, f"top-{r} token {t} missing"
        assert math.isclose(got[t].logprob, v, abs_tol=TOL)
        assert got[t].rank == r
    assert set(got) == {chosen, *top.indices.tolist()}


def assert_logprobs_match_target(hf, prompt: list[int], out, n_top: int) -> None:
    ref = torch.log_softmax(hf_logits(hf, prompt, out.token_ids), dim=-1)  # [n, V]
    assert len(out.logprobs) == len(out.token_ids)
    for j, (t, d) in enumerate(zip(out.token_ids, out.logprobs)):
        assert_position_logprobs(d, t, ref[j], n_top)
    assert math.isclose(out.cumulative_logprob, sum(d[t].logprob for t, d in zip(out.token_ids, out.logprobs)),
                        abs_tol=1e-6)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_logprobs_with_speculation_equal_plain_decoding(models, plain, method, params):
    """Sampled model drafts lead a seeded request elsewhere than plain decoding (same distribution,
    other draws), so there the logprobs are checked against the target's forward alone."""
    prompts = repetitive_prompts(3, seed=4)
    llm = spec_llm(models, method)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    metrics = llm.get_metrics()
    assert metrics["num_draft_tokens"] > 0 and metrics["num_accepted_tokens"] > 0  # speculation ran
    want = plain.generate([{"prompt_token_ids": p} for p in prompts], params)
    compared = 0
    for p, g, w in zip(prompts, got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert_logprobs_match_target(models["hf"], p, g, N_TOP)
        for j, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
            if a != b:  # a sampled draft model's drafts lead elsewhere; greedy never parts on these models
                assert method == "draft_model" and params is SEEDED, f"outputs part at token {j}"
                break
            assert g.logprobs[j].keys() == w.logprobs[j].keys()
            for t, lp in g.logprobs[j].items():
                assert math.isclose(lp.logprob, w.logprobs[j][t].logprob, abs_tol=TOL)
                assert lp.rank == w.logprobs[j][t].rank and lp.decoded_token == w.logprobs[j][t].decoded_token
            compared += 1
    if not (method == "draft_model" and params is SEEDED):  # there the check against the target stands alone
        assert compared == 3 * params.max_tokens


def test_logprobs_zero_gives_the_chosen_token_only(models):
    llm = spec_llm(models, "ngram")
    out = llm.generate({"prompt_token_ids": repetitive_prompts(1, seed=1)[0]},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0))[0].outputs[0]
    assert [list(d) for d in out.logprobs] == [[t] for t in out.token_ids]
    assert all(d[t].decoded_token == llm.tokenizer.decode([t]) for t, d in zip(out.token_ids, out.logprobs))


def test_without_logprobs_nothing_is_reported(plain):
    out = plain.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))[0]
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert out.prompt_logprobs is None


def test_processed_logprobs_are_the_sampled_distribution(models):
    """processed_logprobs: the log of the distribution after temperature and top-k; tokens it removed are -inf."""
    llm = spec_llm(models, "draft_model", logprobs_mode="processed_logprobs")
    params = SamplingParams(temperature=0.7, top_k=4, seed=5, max_tokens=12, ignore_eos=True, logprobs=6)
    prompt = repetitive_prompts(1, seed=2)[0]
    out = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    assert llm.get_metrics()["num_draft_tokens"] > 0
    logits = hf_logits(models["hf"], prompt, out.token_ids)
    ref = probs_from_logits(logits, SamplingBatch.from_params([params] * len(logits))).log()  # [n, V]
    for j, (t, d) in enumerate(zip(out.token_ids, out.logprobs)):
        assert math.isclose(d[t].logprob, float(ref[j, t]), abs_tol=TOL)
        finite = sorted((lp.rank, tok) for tok, lp in d.items() if lp.logprob > -math.inf)
        assert [tok for _, tok in finite] == ref[j].topk(4).indices.tolist()
        assert sum(1 for lp in d.values() if lp.logprob == -math.inf) == 2  # ranks 5 and 6 fall outside top-k


def test_bad_logprobs_mode(models):
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        LLM(models["target"], logprobs_mode="raw_logits")


def test_stream_carries_the_logprobs_of_each_delta(models):
    llm = spec_llm(models, "draft_model")
    prompt = {"prompt_token_ids": repetitive_prompts(1, seed=4)[0]}
    whole = llm.generate(prompt, GREEDY)[0].outputs[0]
    deltas = list(llm.stream(prompt, GREEDY))
    assert any(len(d.token_ids) > 1 for d in deltas)  # some round emitted accepted drafts
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    streamed = [lp for d in deltas for lp in d.logprobs]
    assert [{t: v.logprob for t, v in d.items()} for d in streamed] == \
        [{t: v.logprob for t, v in d.items()} for d in whole.logprobs]


# -- prompt_logprobs --------------------------------------------------------------------------------


def assert_prompt_logprobs_match_target(hf, prompt: list[int], got: list, n_top: int) -> None:
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)  # [P-1, V]
    assert len(got) == len(prompt) and got[0] is None
    for j, t in enumerate(prompt[1:]):
        assert_position_logprobs(got[j + 1], t, ref[j], n_top)


def test_prompt_logprobs_equal_the_target(models):
    llm = spec_llm(models, "draft_model")
    prompts = repetitive_prompts(3, seed=6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": [9]}], params)
    for p, o in zip(prompts, outs):
        assert_prompt_logprobs_match_target(models["hf"], p, o.prompt_logprobs, 3)
        assert o.outputs[0].logprobs is None
    assert outs[-1].prompt_logprobs == [None]
    plain = LLM(models["target"]).generate([{"prompt_token_ids": p} for p in prompts],
                                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs[:3]] == [o.outputs[0].token_ids for o in plain]


def test_prompt_logprobs_of_a_request_that_joins_a_running_batch(models):
    """A small prompt that would ride in a verify pass gets a prefill pass of its own when it asks for
    prompt logprobs; the sequences already decoding are unaffected."""
    llm = spec_llm(models, "draft_model")
    engine = llm.engine
    first, second = repetitive_prompts(2, seed=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = engine.add_request(first, params)
    engine.step()
    engine.step()
    b = engine.add_request(second, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2,
                                                  logprobs=2))
    while engine.has_unfinished():
        engine.step()
    assert_prompt_logprobs_match_target(models["hf"], second, b.prompt_logprobs, 2)
    want = LLM(models["target"]).generate([{"prompt_token_ids": first}, {"prompt_token_ids": second}], params)
    assert [a.output_token_ids, b.output_token_ids] == [w.outputs[0].token_ids for w in want]


# -- with penalties and biases (processing.py) --------------------------------------------------------


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_processed_logprobs_with_penalties_equal_plain_decoding(models, method):
    """Penalties at each verify position count the row's earlier drafts; the processed logprobs of
    the emitted tokens are plain decoding's, and the raw ones stay the model's own."""
    prompts = repetitive_prompts(3, seed=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=N_TOP, presence_penalty=0.1,
                            repetition_penalty=1.05, logit_bias={7: 2.0})
    batch = [{"prompt_token_ids": p} for p in prompts]
    got = spec_llm(models, method, logprobs_mode="processed_logprobs")
    spec = got.generate(batch, params)
    assert got.get_metrics()["num_accepted_tokens"] > 0
    plain = LLM(models["target"], logprobs_mode="processed_logprobs").generate(batch, params)
    raw = spec_llm(models, method).generate(batch, params)
    for p, s, w, r in zip(prompts, spec, plain, raw):
        s, w, r = s.outputs[0], w.outputs[0], r.outputs[0]
        assert s.token_ids == w.token_ids == r.token_ids
        for ds, dw in zip(s.logprobs, w.logprobs):
            assert ds.keys() == dw.keys()
            assert all(math.isclose(ds[t].logprob, dw[t].logprob, abs_tol=TOL) and ds[t].rank == dw[t].rank
                       for t in ds)
        assert_logprobs_match_target(models["hf"], p, r, N_TOP)
        assert any(abs(ds[t].logprob - dr[t].logprob) > 0.1 for t, ds, dr in zip(s.token_ids, s.logprobs, r.logprobs))


def test_llamacpp_logprobs_and_prompt_logprobs_match_the_target(models, tmp_path):
    """The same on the llama.cpp backend (an f32 GGUF: logits within 1e-3 of transformers')."""
    from specdec.models.gguf import convert

    gguf = convert(models["target"], str(tmp_path / "t.gguf"), "f32")
    llm = LLM(gguf, backend="llama.cpp", tokenizer=models["target"],
              speculative_config={"method": "ngram", "num_speculative_tokens": K, "adaptive": False,
                                  "prompt_lookup_min": 1})
    prompt = repetitive_prompts(1, seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    c = out.outputs[0]
    ref = torch.log_softmax(hf_logits(models["hf"], prompt, c.token_ids), dim=-1)
    for j, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
        assert abs(d[t].logprob - float(ref[j, t])) < 1e-3
        assert [tok for tok, lp in sorted(d.items(), key=lambda x: x[1].rank)][:3] == ref[j].topk(3).indices.tolist()
    with torch.no_grad():
        ref = torch.log_softmax(models["hf"](torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    assert all(abs(d[t].logprob - float(ref[j, t])) < 1e-3 for j, (t, d) in enumerate(zip(prompt[1:],
                                                                                        out.prompt_logprobs[1:])))
