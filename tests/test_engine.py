"""End to end through ``LLM.generate``: greedy equality with plain decoding, exact sampled
distributions, stop conditions, and the drafter-failure fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lossless import assert_first_tokens_follow_target, assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.drafters.base import DraftProposal, Drafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.models.load import load_model
from specdec.sampling import SamplingBatch
from specdec.scheduler import RoundBatch
from tiny_models import SMALL_WORDS, make_model, perturbed_copy, random_prompts, small_vocab_pair



@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    target = make_model(root / "target", "llama", layers=2, seed=0)
    unrelated = make_model(root / "unrelated", "llama", layers=1, seed=1)
    near = perturbed_copy(target, root / "near", 0.01)  # a partly agreeing draft
    return {"target": str(target), "unrelated": str(unrelated), "near": str(near),
            "hf": load_model(str(target)).hf_model}


class AntiDrafter(Drafter):
    """Proposes the target's argmax + 1: every draft is wrong."""

    def __init__(self, inner: DraftModelDrafter, vocab: int):
        self.inner, self.vocab = inner, vocab

    def propose(self, seqs, k, sb):
        d = self.inner.propose(seqs, k, SamplingBatch.from_params([SamplingParams(temperature=0)] * len(seqs)))
        return DraftProposal((d.draft_token_ids + 1) % self.vocab, None, d.num_draft_tokens)


class GreedyDrafter(Drafter):
    """A deterministic drafter: the draft model's argmax whatever the temperature (q = one-hot)."""

    def __init__(self, inner: DraftModelDrafter):
        self.inner = inner

    def propose(self, seqs, k, sb):
        return self.inner.propose(seqs, k, SamplingBatch.from_params([SamplingParams(temperature=0)] * len(seqs)))


def plain_greedy(target, prompts, max_tokens):
    llm = LLM(target)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
@pytest.mark.parametrize("draft", ["self", "never", "near", "unrelated"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_equals_plain_decoding(models, draft, batch, adaptive):
    prompts = random_prompts(batch, [1, 5, 11, 23], seed=batch)
    expected = plain_greedy(models["target"], prompts, 30)
    model = models["target"] if draft in ("self", "never") else models[draft]
    chain = {"draft_tree": "chain"} if draft == "never" else {}  # the drafter swapped in drafts chains
    llm = LLM(models["target"], speculative_config={"model": model, "num_speculative_tokens": 4,
                                                    "adaptive": adaptive, **chain})
    if draft == "never":
        llm.engine.drafter = AntiDrafter(llm.engine.drafter, llm.target.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    m = llm.get_metrics()
    assert m["num_drafts"] > 0
    if draft == "self":
        assert m["acceptance_rate"] > 0.95
        assert m["mean_acceptance_length"] > 4.5 or adaptive
    if draft == "never":
        assert m["num_accepted_tokens"] == 0 and m["mean_acceptance_length"] == 1.0
    if draft == "near":
        assert 0.1 < m["acceptance_rate"] < 1.0


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_rounds_verify_the_argmax_alone_with_the_same_outcome(models, batch, monkeypatch):
    """A greedy round whose logits nothing else reads verifies the target's argmaxes (forward_argmax); made to
    take the logits instead, the same run emits the same tokens with the same counts. A row that asks for
    logprobs makes its rounds take the logits."""
    prompts = random_prompts(batch, [3, 8, 13], seed=7)
    requests = [{"prompt_token_ids": p} for p in prompts]
    spec = {"model": models["near"], "num_speculative_tokens": 3, "adaptive": False}
    results = []
    for argmax_only in (True, False):
        llm = LLM(models["target"], speculative_config=spec)
        calls = []
        inner = llm.engine.target.forward_argmax
        monkeypatch.setattr(llm.engine.target, "forward_argmax", lambda b: calls.append(b) or inner(b))
        if not argmax_only:
            monkeypatch.setattr(RoundBatch, "argmax_only", property(lambda self: False))
        outs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        m = llm.get_metrics()
        results.append(([o.outputs[0].token_ids for o in outs], m["num_draft_tokens"], m["num_accepted_tokens"]))
        assert bool(calls) == argmax_only
        if argmax_only:
            calls.clear()
            out = llm.generate(requests[:1], SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True))
            assert not calls and len(out[0].outputs[0].logprobs) == 8
    assert results[0] == results[1] and results[0][2] > 0


@pytest.mark.parametrize("k", [1, 2, 7])
def test_greedy_equality_for_other_k(models, k):
    prompts = random_prompts(3, [2, 9, 4], seed=k)
    expected = plain_greedy(models["target"], prompts, 25)
    llm = LLM(models["target"], speculative_config={"model": models["near"], "num_speculative_tokens": k})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True))
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
        assert len(o.outputs[0].token_ids) == 25 and o.outputs[0].finish_reason == "length"
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] > 0


def test_seeded_sampling_is_reproducible(models):
    llm = LLM(models["target"], speculative_config={"model": models["near"], "num_speculative_tokens": 3})
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, [4, 6, 8])]
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=11, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert a == b
    c = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.9, top_p=0.95,
                                                                              max_tokens=20, seed=12,
                                                                              ignore_eos=True))]
    assert a != c


# -- distributions --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    return small_vocab_pair(tmp_path_factory.mktemp("small"))


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=4),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=0.9, min_p=0.2),
], ids=["t1", "topk", "topp", "minp"])
@pytest.mark.parametrize("drafter", ["sampling", "greedy", "suffix-then-sampling", "sampling-without-kernel"])
def test_sampled_outputs_follow_the_target_distribution(small_vocab, params, drafter, monkeypatch):
    """suffix-then-sampling: suffix decoding in front of the draft model. Every request is seeded, so
    the seeds rule (policy.seeded_members) has the suffix tries alone draft them, from the earlier
    requests' outputs: one-hot drafts that race plain decoding's own draws. sampling-without-kernel: as
    where the sampling kernel cannot be built (numpy's cut, torch's min-p, the Python verifier)."""
    if drafter == "sampling-without-kernel":
        from specdec import sampling_kernel
        from specdec.models.native import Availability

        monkeypatch.setattr(sampling_kernel, "available", lambda: Availability(False, "test"))
    target, draft, hf = small_vocab
    prompt = [5, 9, 3]
    N = 3000
    hybrid = {"enable_suffix_decoding": True, "suffix_decoding_min_score": 0.0} if drafter.startswith("suffix") else {}
    chain = {"draft_tree": "chain"} if drafter == "greedy" else {}  # the drafter swapped in drafts chains
    llm = LLM(target, speculative_config={"model": draft, "num_speculative_tokens": 2, **hybrid, **chain})
    if drafter == "greedy":
        llm.engine.drafter = GreedyDrafter(llm.engine.drafter)
    sps = [SamplingParams(max_tokens=3, seed=1000 + i, ignore_eos=True, **params) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, sps)
    tokens = np.array([o.outputs[0].token_ids for o in outs])  # [N, 3]
    V = 23
    assert_first_tokens_follow_target(hf, prompt, tokens, sps[0], V)
    assert llm.get_metrics()["num_accepted_tokens"] > 0  # the drafts did get used
    if hybrid:
        assert llm.engine.drafter.suffix_rows > 0 and llm.engine.drafter.model_rows == 0  # the seeds rule


# -- stop conditions ------------------------------------------------------------------------------


def test_stop_conditions(models):
    llm = LLM(models["target"], speculative_config={"model": models["target"], "num_speculative_tokens": 4})
    prompt = {"prompt_token_ids": random_prompts(1, [6])[0]}
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    ids = full.token_ids
    # a stop token id ends the output at its first occurrence, the token included
    stop_tok = ids[7]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == ids[: ids.index(stop_tok) + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_tok
    # EOS: make the model's eos the same token
    llm.engine.detokenizer.eos_token_ids = {stop_tok}
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    assert out.token_ids == ids[: ids.index(stop_tok) + 1] and out.finish_reason == "stop"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ids
    llm.engine.detokenizer.eos_token_ids = set()
    # a stop string cuts the text before it
    words = full.text.split()
    stop = " " + words[5]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    # max_tokens
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ids[:3] and out.finish_reason == "length"
    assert llm.get_metrics()["num_accepted_tokens"] > 0


def test_context_limit_ends_with_length(models):
    llm = LLM(models["target"], max_model_len=20,
              speculative_config={"model": models["near"], "num_speculative_tokens": 4})
    out = llm.generate({"prompt_token_ids": list(range(3, 18))},
                       SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stream_yields_the_same_tokens_and_text(models):
    llm = LLM(models["target"], speculative_config={"model": models["near"], "num_speculative_tokens": 3})
    prompt = {"prompt_token_ids": random_prompts(1, [5], seed=9)[0]}
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    whole = llm.generate(prompt, sp)[0].outputs[0]
    deltas = list(llm.stream(prompt, sp))
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert "".join(d.text for d in deltas) == whole.text
    assert deltas[-1].finish_reason == "length"
    assert not llm.engine.has_unfinished()
    assert llm.get_metrics()["num_draft_tokens"] > 0


class BrokenDrafter(Drafter):
    def propose(self, seqs, k, sb):
        raise RuntimeError("draft server fell over")


def test_a_failing_drafter_degrades_to_plain_decoding(models, caplog):
    prompts = random_prompts(2, [4, 7], seed=5)
    expected = plain_greedy(models["target"], prompts, 12)
    llm = LLM(models["target"], speculative_config={"model": models["near"], "num_speculative_tokens": 3,
                                                    "draft_tree": "chain", "adaptive": False})
    llm.engine.drafter = BrokenDrafter()
    llm.engine.strict_drafter = False  # as for users: the failure degrades, it does not raise
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert "drafter failed" in caplog.text and llm.engine.drafter_failures > 0


def test_in_strict_mode_a_failing_drafter_raises(models):
    llm = LLM(models["target"], speculative_config={"model": models["near"], "num_speculative_tokens": 3,
                                                    "draft_tree": "chain", "adaptive": False})
    llm.engine.drafter = BrokenDrafter()
    assert llm.engine.strict_drafter  # the test suite sets SPECDEC_STRICT_DRAFTER=1 (conftest.py)
    with pytest.raises(RuntimeError, match="draft server fell over"):
        llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))


def test_metrics_follow_vllm_conventions(models):
    """k = 3 fixed, one request of 40 tokens: the first token comes from a plain pass, every later
    round drafts min(3, room - 1), so only the last rounds draft fewer than 3 or none."""
    llm = LLM(models["target"], speculative_config={"model": models["near"], "num_speculative_tokens": 3,
                                                    "adaptive": False})
    llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    m = llm.get_metrics()
    drafts, per_pos = m["num_drafts"], m["num_draft_tokens_per_pos"]
    assert drafts > 0 and per_pos[0] == drafts and per_pos[2] >= drafts - 2  # room-limited: at most 2 rounds
    assert m["num_draft_tokens"] == sum(per_pos) and 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
    assert m["num_verify_passes"] - drafts in (1, 2)  # the first round, and the last when its room is 1
    assert m["acceptance_rate"] == pytest.approx(m["num_accepted_tokens"] / m["num_draft_tokens"])
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    assert sum(m["num_accepted_tokens_per_pos"]) == m["num_accepted_tokens"]
    assert all(a >= b for a, b in zip(m["num_accepted_tokens_per_pos"], m["num_accepted_tokens_per_pos"][1:]))
    assert m["num_emitted_tokens"] == 40 == m["num_accepted_tokens"] + m["num_verify_passes"]
    assert m["draft_time_s"] > 0 and m["verify_time_s"] > 0
    llm.reset_metrics()
    assert llm.get_metrics()["num_drafts"] == 0


def test_verify_passes_count_rounds_and_emitted_tokens_count_what_verification_emitted(models):
    """Three sequences per round: a verify pass per round, not per sequence. A stop token cuts a round's
    tokens after it: num_emitted_tokens counts them, as vLLM's does, the output does not."""
    llm = LLM(models["target"], speculative_config={"model": models["target"], "num_speculative_tokens": 4,
                                                    "adaptive": False})
    prompts = random_prompts(3, [4, 7, 5], seed=8)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    rounds = 0
    for p in prompts:
        llm.engine.add_request(p, sp)
    while llm.engine.has_unfinished():
        rounds += bool(llm.engine.step())
    m = llm.get_metrics()
    assert m["num_verify_passes"] == rounds < m["num_drafts"]
    assert m["num_emitted_tokens"] == 3 * 16
    full = plain_greedy(models["target"], prompts[:1], 16)[0]  # the self-draft accepts all 4 drafts a round
    llm.reset_metrics()
    out = llm.generate({"prompt_token_ids": prompts[0]},
                       SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[full[2]]))[0].outputs[0]
    m = llm.get_metrics()
    assert out.token_ids == full[: full.index(full[2]) + 1] and out.finish_reason == "stop"
    assert m["num_emitted_tokens"] == m["num_accepted_tokens"] + m["num_verify_passes"] > len(out.token_ids)


def test_per_position_acceptance_counts_only_rounds_that_drafted_that_position(models):
    llm = LLM(models["target"], speculative_config={"model": models["target"], "num_speculative_tokens": 4,
                                                    "adaptive": False})
    llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    m = llm.get_metrics()  # the first token from a plain pass, then k = 4, 4, then 0 (1 token of room left)
    assert m["num_draft_tokens_per_pos"] == [2, 2, 2, 2]
    assert m["acceptance_rate_per_pos"] == [1.0, 1.0, 1.0, 1.0]


class FlakyDrafter(Drafter):
    """Fails on the sequences it was given first; drafts with the wrapped drafter afterwards."""

    def __init__(self, inner):
        self.inner, self.failed_on = inner, None

    def propose(self, seqs, num_draft, sb):
        if self.failed_on is None:
            self.failed_on = {s.seq_id for s in seqs}
            raise RuntimeError("flaky")
        assert not self.failed_on & {s.seq_id for s in seqs}, "a failed sequence was drafted again"
        return self.inner.propose(seqs, num_draft, sb)


def test_a_drafter_failure_only_affects_the_sequences_it_failed_on(models):
    prompts = random_prompts(2, [4, 7], seed=6)
    expected = plain_greedy(models["target"], prompts, 12)
    llm = LLM(models["target"], speculative_config={"model": models["target"], "num_speculative_tokens": 3,
                                                    "adaptive": False, "draft_tree": "chain"})
    llm.engine.drafter = FlakyDrafter(llm.engine.drafter)
    llm.engine.strict_drafter = False  # as for users: the failure degrades, it does not raise
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.get_metrics()["num_drafts"] == 0
    later = llm.generate({"prompt_token_ids": prompts[0]}, sp)  # a new request speculates again
    assert later[0].outputs[0].token_ids == expected[0]
    assert llm.get_metrics()["num_drafts"] > 0


def test_the_rounds_right_after_a_prefill_are_not_timed_for_the_controller(models):
    """Their passes run on caches the prompt's forward filled (llama.cpp on Xeon-AMX-FP16: steps 1-4 after a
    250-token prefill 5.6-3.1 ms against 2.5-2.6): COLD_ROUNDS rounds report no verify time."""
    from specdec.engine import COLD_ROUNDS

    llm = LLM(models["target"], speculative_config={"model": models["near"], "num_speculative_tokens": 3,
                                                    "adaptive": True})
    timed = []
    record = llm.engine.controller.record
    llm.engine.controller.record = lambda *a, **kw: (timed.append(a[4] is not None), record(*a, **kw))[1]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt in random_prompts(2, [9, 17], seed=3):  # two requests, one after the other: each prefill counts
        start = len(timed)
        llm.generate([{"prompt_token_ids": prompt}], sp)
        assert timed[start:start + COLD_ROUNDS] == [False] * COLD_ROUNDS and all(timed[start + COLD_ROUNDS:])


def test_release_memory_frees_the_caches_and_generation_resumes(models):
    llm = LLM(models["target"], speculative_config={"model": models["near"], "num_speculative_tokens": 3})
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": [4, 5, 6]}, sp)[0].outputs[0].token_ids
    llm.engine.release_memory()
    assert llm.engine.target.cache is None and llm.engine.drafter.runner.cache is None
    assert llm.generate({"prompt_token_ids": [4, 5, 6]}, sp)[0].outputs[0].token_ids == first


def test_caches_grown_during_decoding_survive_batch_changes(tmp_path):
    """A cache that grows inside a forward pass must still be reorderable when requests come and go."""
    target = make_model(tmp_path / "long", "llama", max_pos=1024)
    llm = LLM(str(target), speculative_config={"model": str(target), "num_speculative_tokens": 3})
    sp = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)  # past the first 256-position block
    a = llm.generate({"prompt_token_ids": [4] * 40}, sp)[0].outputs[0].token_ids
    assert llm.generate({"prompt_token_ids": [4] * 40}, sp)[0].outputs[0].token_ids == a  # a new row id
    outs = llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [4] * 40}], sp)
    assert outs[1].outputs[0].token_ids == a


@pytest.mark.parametrize("method", ["draft_model", "layer_skip", "ngram", "suffix", "suffix+draft_model"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
def test_requests_that_come_and_go_between_rounds_equal_plain_decoding(models, method, adaptive):
    """Staggered arrivals and departures (a server's traffic): sequences leave at different rounds,
    newcomers with long prompts join a running batch, and each output still equals plain decoding,
    for every drafter (layer_skip shares the target's cache with a newcomer's merged prompt)."""
    prompts = random_prompts(6, [2, 14, 6, 11, 3, 9], seed=11)
    lengths = [5, 17, 9, 12, 20, 7]
    cfg = {"method": method, "num_speculative_tokens": 3, "adaptive": adaptive}
    cfg.update({"draft_model": {"model": models["near"]}, "layer_skip": {"num_draft_layers": 1},
                "ngram": {"prompt_lookup_min": 1},
                "suffix+draft_model": {"method": "draft_model", "model": models["near"], "enable_suffix_decoding": True,
                                       "suffix_decoding_min_score": 0.0}}.get(method, {}))
    spec = LLM(models["target"], speculative_config=cfg)
    engine = spec.engine
    calls = []
    forward = engine.target.forward
    # a full target pass that asks no logits is a prefill (verify passes and plain steps ask some)
    engine.target.forward = lambda batch: (calls.append(batch.num_layers is None and batch.logits_index is None),
                                           forward(batch))[1]
    seqs, pending, passes = {}, list(range(len(prompts))), []
    while pending or engine.has_unfinished():
        if pending and len(engine.running) + len(engine.waiting) < 3:
            i = pending.pop(0)
            sp = SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True)
            seqs[i] = engine.add_request(prompts[i], sp)
        calls.clear()
        engine.step()
        passes.append(calls.count(True))  # prefill passes (layer_skip drafts with num_layers set)
    for i, p in enumerate(prompts):
        assert seqs[i].output_token_ids == plain_greedy(models["target"], [p], lengths[i])[0]
    # only the first prompt, admitted to an empty batch, had a prefill pass of its own; every later
    # one rode in a running batch's verify pass
    assert passes[0] == 1 and set(passes[1:]) == {0}
    assert spec.get_metrics()["num_draft_tokens"] > 0


@pytest.mark.parametrize("method, p_min", [("draft_model", 0.2), ("layer_skip", 0.3)])
def test_draft_p_min_with_greedy_and_sampled_rows(models, method, p_min, caplog):
    """draft_p_min over greedy and sampled rows: in some rounds with sampled rows every row stops
    before its first draft (the drafter proposes nothing), others draft; greedy rows still equal
    plain decoding, drafts are made and accepted, and the drafter never fails."""
    prompts = random_prompts(4, [3, 8, 5, 11], seed=21)
    cfg = {"method": method, "num_speculative_tokens": 3, "adaptive": False, "draft_p_min": p_min,
           **{"draft_model": {"model": models["near"]}, "layer_skip": {"num_draft_layers": 1}}[method]}
    llm = LLM(models["target"], speculative_config=cfg)
    rounds = []  # (most drafts asked of a row, drafts proposed, some row samples) per round
    propose = llm.engine.drafter.propose

    def recorded(seqs, want, sb):
        proposal = propose(seqs, want, sb)
        rounds.append((max(want), proposal.draft_token_ids.shape[1], not sb.all_greedy))
        return proposal

    llm.engine.drafter.propose = recorded
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy, sampled, greedy, sampled])
    expected = plain_greedy(models["target"], prompts[::2], 20)
    for p, e, o in zip(prompts[::2], expected, outs[::2]):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] > 0
    assert any(asked > 0 and got == 0 and mixed for asked, got, mixed in rounds)
    assert any(got > 0 for _, got, _ in rounds)
    assert "drafter failed" not in caplog.text


def test_prompts_admitted_together_are_prefilled_packed_and_match_transformers(models):
    """Prompts of 1 to 23 tokens admitted at once share one packed prefill pass (a 1-token prompt has
    nothing to prefill); plain decoding of each equals transformers' greedy loop on it alone."""
    prompts = random_prompts(4, [1, 23, 5, 9], seed=14)
    out = plain_greedy(models["target"], prompts, 6)
    hf = models["hf"]
    for p, got in zip(prompts, out):
        ids = list(p)
        with torch.no_grad():
            for _ in range(6):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert got == ids[len(p):]


def test_suffix_decoding_in_front_skips_the_draft_model_on_repeated_text(models):
    """A request asked again: its earlier answer is in the suffix cache, so once the match is two
    tokens long every round's suffix draft is confident and the draft model no longer runs; the
    output still equals plain decoding."""
    prompts = random_prompts(2, [5, 8], seed=13)
    llm = LLM(models["target"], speculative_config={"model": models["near"], "num_speculative_tokens": 3,
                                                    "adaptive": False, "enable_suffix_decoding": True})
    drafter = llm.engine.drafter
    model_calls = []
    propose = drafter.model.propose
    drafter.model.propose = lambda *a: (model_calls.append(1), propose(*a))[1]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert first == plain_greedy(models["target"], prompts, 30)
    first_calls, suffix_rows = len(model_calls), drafter.suffix_rows
    again = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert again == first
    # the first drafting round matches one token (a one-token draft, below the score of 2): the model
    assert first_calls > 5 and len(model_calls) - first_calls == 1 and drafter.suffix_rows - suffix_rows > 10


def test_a_queue_longer_than_max_num_seqs_equals_plain_decoding(models):
    """generate() with more prompts than max_num_seqs: the rest wait, then join the running batch
    (their prompts prefilled inside its verify passes), in order, each equal to plain decoding."""
    prompts = random_prompts(5, [3, 9, 5, 12, 2], seed=12)
    llm = LLM(models["target"], max_num_seqs=2,
              speculative_config={"model": models["near"], "num_speculative_tokens": 3, "adaptive": False})
    sp = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 15, 9, 4, 11)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, params, o in zip(prompts, sp, outs):
        assert o.outputs[0].token_ids == plain_greedy(models["target"], [p], params.max_tokens)[0]
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_a_step_isolated_to_part_of_the_batch_leaves_the_others_to_recompute_and_equal_plain_decoding(models):
    """Engine.isolated (a server retrying a failed step over part of its batch): only the group steps
    and joins; the others are held aside, come back after with their history to recompute, and every
    output still equals plain decoding. next_in_line names who the next step may admit."""
    prompts = random_prompts(3, [4, 7, 5], seed=21)
    llm = LLM(models["target"], max_num_seqs=3,
              speculative_config={"model": models["near"], "num_speculative_tokens": 3, "adaptive": False})
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a, b = (engine.add_request(p, sp) for p in prompts[:2])
    assert engine.next_in_line() == [a, b]
    engine.step()
    engine.step()
    c = engine.add_request(prompts[2], sp)
    assert engine.running == [a, b] and engine.next_in_line() == [c]
    before = {s.seq_id: len(s.output_token_ids) for s in (a, b, c)}
    with engine.isolated([b, c]):
        assert engine.running == [b] and engine.next_in_line() == [c]
        engine.step()
        assert engine.running == [b, c]
    assert len(a.output_token_ids) == before[a.seq_id] and a.num_computed == 0  # held aside: recomputes
    assert len(b.output_token_ids) > before[b.seq_id] and len(c.output_token_ids) > 0
    assert engine.running == [b, c, a] and engine.waiting == []
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in (a, b, c)] == plain_greedy(models["target"], prompts, 12)


def _stream_pieces(decode, ids: list[int], cuts: list[int]) -> list[str]:
    """Run a TextStreamer over ``ids`` revealed at the positions ``cuts``; returns each round's text."""
    from types import SimpleNamespace

    from specdec.detokenizer import TextStreamer

    params = SamplingParams(temperature=0, max_tokens=len(ids))
    detokenizer = SimpleNamespace(decode=lambda t, params: decode(t), output_text=lambda s: decode(s.output_token_ids))
    seq = SimpleNamespace(output_token_ids=[], params=params, finished=False, finish_reason=None,
                          logprobs=None)
    streamer, pieces, last = TextStreamer(detokenizer, seq), [], 0
    for cut in sorted(set(cuts)) + [len(ids)]:
        if cut <= last:
            continue
        seq.output_token_ids = ids[:cut]
        seq.finished = cut == len(ids)
        seq.finish_reason = "length" if seq.finished else None
        pieces.append(streamer.delta(ids[last:cut]).text)
        last = cut
    return pieces


def test_streamed_text_with_special_tokens_equals_the_whole_decode(tmp_path):
    """Tokens that decode to nothing (special tokens, skipped) must not eat the space a word-joining
    decoder puts between the words around them, wherever the rounds cut the output."""
    from hypothesis import given, settings, strategies as st
    from transformers import AutoTokenizer

    from tiny_models import make_tokenizer

    make_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)

    def decode(t):
        return tok.decode(t, skip_special_tokens=True)

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.integers(0, 12), min_size=1, max_size=14), st.lists(st.integers(1, 14), max_size=8))
    def check(ids, cuts):
        pieces = _stream_pieces(decode, ids, cuts)
        assert "".join(pieces) == decode(ids)

    check()


@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("text", ["def naïve(x):\n    return '😀' + x  # 日本語 ok\n",
                                  "    self.assertEqual(w[0].lineno, 1)\n\n        with warnings.catch_warnings():"])
def test_incremental_detokenizing_streams_exactly_the_whole_decode(text, chunk):
    """The streamer decodes only the newest window each round; what it emits, round by round and
    in pieces of any size, adds up to the whole output's decode, never half a character."""
    from types import SimpleNamespace

    from specdec.detokenizer import Detokenizer, TextStreamer
    from specdec.models.load import load_tokenizer
    from specdec.models.resolve import resolve_model_path

    tok = load_tokenizer(resolve_model_path("specdec/demo-target"))
    ids = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=len(ids))
    seq = SimpleNamespace(output_token_ids=[], params=params, finished=False, finish_reason=None, stop_reason=None,
                          logprobs=None)
    streamer, pieces = TextStreamer(Detokenizer(tok), seq), []
    for i in range(0, len(ids), chunk):
        seq.output_token_ids = ids[: i + chunk]
        seq.finished = i + chunk >= len(ids)
        seq.finish_reason = "length" if seq.finished else None
        pieces.append(streamer.delta(ids[i : i + chunk]).text)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)
    assert sum(bool(p) for p in pieces[:-1]) >= len(pieces) // 2  # text flows before the end
