"""Per-request speculative counters (``Sequence.stats``, ``RequestOutput.metrics``): each request's
drafts, accepted tokens, verify passes and rounds per method, which add up to the engine's counters."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.metrics import NO_DRAFT, RequestSpecStats, SpecDecodingStats
from test_drafters_lookup import make_repetitive_model, repetitive_prompts
from tiny_models import perturbed_copy

K = 3
SUMMED = ("num_drafts", "num_draft_tokens", "num_asked_draft_tokens", "num_accepted_tokens", "num_emitted_tokens")
PER_POS = ("num_draft_tokens_per_pos", "num_accepted_tokens_per_pos")
PER_METHOD = ("num_rounds_per_method", "num_draft_tokens_per_method", "num_accepted_tokens_per_method")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("request_metrics")
    target = make_repetitive_model(root / "target", seed=0)
    return {"target": target, "draft": str(perturbed_copy(target, root / "draft", 0.01))}


def spec_llm(models, **cfg) -> LLM:
    spec = {"method": "draft_model", "model": models["draft"], "num_speculative_tokens": K, "adaptive": False} | cfg
    return LLM(models["target"], speculative_config=spec, max_num_seqs=2)


def check_consistent(m: dict) -> None:
    """What holds inside any one request's counters."""
    assert m["num_draft_tokens"] == sum(m["num_draft_tokens_per_pos"])
    assert m["num_accepted_tokens"] == sum(m["num_accepted_tokens_per_pos"])
    drafted, accepted = m["num_draft_tokens_per_pos"], m["num_accepted_tokens_per_pos"]
    assert not drafted or drafted[0] == m["num_drafts"]  # every draft has a first position
    assert all(a <= d for a, d in zip(accepted, drafted))
    # drafts are accepted as a prefix, and a draft at position i+1 comes with one at position i
    assert all(x >= y for x, y in zip(drafted, drafted[1:])) and all(x >= y for x, y in zip(accepted, accepted[1:]))
    rounds = m["num_rounds_per_method"]
    assert sum(rounds.values()) == m["num_verify_passes"]  # each round it took part in, once
    assert sum(v for method, v in rounds.items() if method != NO_DRAFT) == m["num_drafts"]
    assert sum(m["num_draft_tokens_per_method"].values()) == m["num_draft_tokens"]
    assert sum(m["num_accepted_tokens_per_method"].values()) == m["num_accepted_tokens"]
    tau = 1 + m["num_accepted_tokens"] / m["num_drafts"] if m["num_drafts"] else 1.0
    assert m["mean_acceptance_length"] == pytest.approx(tau)


def test_record_and_merge_by_hand():
    a = RequestSpecStats()
    a.record(3, 2, 3, "draft_model", 0.5, 1.0)
    a.record(0, 0, 0, "draft_model", 0.25, 1.0)  # nothing drafted: a plain round, under "none"
    a.record_plain(4, 2.0)  # four plain steps in one call
    assert (a.num_verify_passes, a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (6, 1, 3, 2)
    assert a.num_emitted_tokens == 3 + 1 + 4
    assert a.num_rounds_per_method == {"draft_model": 1, NO_DRAFT: 5}
    assert a.num_draft_tokens_per_pos == [1, 1, 1] and a.num_accepted_tokens_per_pos == [1, 1, 0]
    assert (a.draft_time_s, a.verify_time_s) == (0.75, 4.0)
    b = RequestSpecStats()
    b.record(4, 4, 4, "suffix", 0.0, 1.0)
    b.merge(a)
    assert b.num_draft_tokens_per_pos == [2, 2, 2, 1] and b.num_accepted_tokens_per_pos == [2, 2, 1, 1]
    assert b.num_rounds_per_method == {"suffix": 1, "draft_model": 1, NO_DRAFT: 5}
    assert b.num_accepted_tokens_per_method == {"suffix": 4, "draft_model": 2}
    assert (b.num_verify_passes, b.num_drafts, b.verify_time_s) == (7, 2, 5.0)
    assert b.mean_acceptance_length == pytest.approx(1 + 6 / 2)
    check_consistent(b.as_dict())


def test_request_counts_add_up_to_the_engine_counts(models):
    """Six requests through two batch seats (they come and go), greedy and sampled: every request's
    counters are consistent, and summed over the requests they are the engine's."""
    llm = spec_llm(models)
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts(4, seed=3) + repetitive_prompts(2, seed=4)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=8 + 3 * i, ignore_eos=True)
              for i in range(6)]
    outs = llm.generate(prompts, params)
    engine = llm.get_metrics()
    per = [o.metrics["spec_decoding"] for o in outs]
    for o, m in zip(outs, per):
        check_consistent(m)
        assert m["num_drafts"] > 0 and m["num_accepted_tokens"] > 0
        # ignore_eos, no stop: every emitted token is kept (the first from a plain pass)
        assert m["num_emitted_tokens"] == len(o.outputs[0].token_ids)
        assert set(m["num_rounds_per_method"]) <= {"draft_model", NO_DRAFT}
        assert o.metrics["spec_decoding_per_choice"] == [m]
    for name in SUMMED:
        assert sum(m[name] for m in per) == engine[name], name
    for name in PER_POS:
        width = max(len(m[name]) for m in per)
        assert [sum(m[name][i] if i < len(m[name]) else 0 for m in per) for i in range(width)] == engine[name]
    for name in PER_METHOD:
        total = {}
        for m in per:
            for method, v in m[name].items():
                total[method] = total.get(method, 0) + v
        assert total == engine[name], name
    # a round's passes and times are shared by its rows: each request is charged the rounds it was in
    assert max(m["num_verify_passes"] for m in per) <= engine["num_verify_passes"] < sum(
        m["num_verify_passes"] for m in per)
    for name in ("draft_time_s", "verify_time_s"):
        assert 0 < max(m[name] for m in per) <= engine[name] * (1 + 1e-9) <= sum(m[name] for m in per) * (1 + 1e-9)
    assert all(m["prefill_time_s"] <= engine["prefill_time_s"] * (1 + 1e-9) for m in per)


@pytest.mark.parametrize("steps", [1, 8], ids=["one_step_a_round", "multi_step"])
def test_plain_decoding_drafts_nothing_and_verifies_once_per_token(models, steps):
    llm = LLM(models["target"], num_scheduler_steps=steps)
    outs = llm.generate([{"prompt_token_ids": p} for p in repetitive_prompts(3, seed=5)],
                        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True))
    for o in outs:
        m, n = o.metrics["spec_decoding"], len(o.outputs[0].token_ids)
        check_consistent(m)
        assert (m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"]) == (0, 0, 0)
        assert m["draft_time_s"] < m["verify_time_s"]  # no drafter ran: only the rounds' bookkeeping
        assert m["num_verify_passes"] == m["num_emitted_tokens"] == n == 13
        assert m["num_rounds_per_method"] == {NO_DRAFT: n}
        assert m["mean_acceptance_length"] == 1.0 and m["verify_time_s"] > 0
    assert llm.get_metrics()["num_rounds_per_method"] == {NO_DRAFT: 3 * 13}


def test_n_choices_each_count_their_own_rounds_and_the_request_sums_them(models):
    llm = spec_llm(models)
    out = llm.generate({"prompt_token_ids": repetitive_prompts(1, seed=7)[0]},
                       SamplingParams(temperature=0.8, seed=4, max_tokens=12, ignore_eos=True, n=3))[0]
    choices = out.metrics["spec_decoding_per_choice"]
    assert len(choices) == 3
    for c, m in zip(out.outputs, choices):
        check_consistent(m)
        assert m["num_emitted_tokens"] == len(c.token_ids) == 12
    total = out.metrics["spec_decoding"]
    check_consistent(total)
    engine = llm.get_metrics()  # the only request: its choices' sums are the engine's counts
    for name in SUMMED + PER_METHOD:
        assert total[name] == engine[name] == _sum(choices, name), name
    for name in ("num_verify_passes", "draft_time_s", "verify_time_s"):
        assert total[name] == pytest.approx(sum(m[name] for m in choices))


def _sum(dicts: list[dict], name: str):
    if isinstance(dicts[0][name], dict):
        out = {}
        for d in dicts:
            for key, v in d[name].items():
                out[key] = out.get(key, 0) + v
        return out
    return sum(d[name] for d in dicts)


def test_suffix_in_front_of_the_draft_model_says_which_drafted_each_round(models):
    """HybridDrafter: rows the suffix tries drafted count under "suffix", the model's under "draft_model"."""
    llm = spec_llm(models, enable_suffix_decoding=True)
    prompt = {"prompt_token_ids": repetitive_prompts(1, seed=9)[0]}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = llm.generate(prompt, params)[0].metrics["spec_decoding"]
    again = llm.generate(prompt, params)[0].metrics["spec_decoding"]  # the suffix tries hold the first answer
    for m in (first, again):
        check_consistent(m)
        assert set(m["num_rounds_per_method"]) <= {"suffix", "draft_model", NO_DRAFT}
    assert again["num_rounds_per_method"].get("suffix", 0) > first["num_rounds_per_method"].get("suffix", 0)
    engine = llm.get_metrics()
    assert engine["num_rounds_per_method"] == _sum([first, again], "num_rounds_per_method")


def test_stream_gives_each_choice_its_counters_on_its_last_delta(models):
    llm = spec_llm(models)
    prompt = {"prompt_token_ids": repetitive_prompts(1, seed=11)[0]}
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2)
    deltas = list(llm.stream(prompt, params))
    for i in range(2):
        mine = [d for d in deltas if d.index == i]
        assert all(d.metrics is None for d in mine[:-1]) and mine[-1].finish_reason is not None
        m = mine[-1].metrics
        check_consistent(m)
        assert m["num_emitted_tokens"] == sum(len(d.token_ids) for d in mine) == 10
    # the same greedy request through generate drafts and accepts the same (k is fixed)
    ref = spec_llm(models).generate(prompt, params)[0].metrics["spec_decoding_per_choice"]
    for i in range(2):
        got = [d for d in deltas if d.index == i][-1].metrics
        for name in SUMMED + PER_POS + PER_METHOD + ("num_verify_passes",):
            assert got[name] == ref[i][name], name


def test_the_engine_counts_rounds_per_method_beside_vllms_counters():
    stats = SpecDecodingStats()
    stats.record_round([3, 0, 2], [1, 0, 2], [3, 3, 2])
    stats.record_sources([3, 0, 2], [1, 0, 2], ["suffix", "suffix", "draft_model"])
    stats.record_plain_steps(2, 4)
    assert stats.num_rounds_per_method == {"suffix": 1, NO_DRAFT: 1 + 8, "draft_model": 1}
    assert stats.num_draft_tokens_per_method == {"suffix": 3, "draft_model": 2}
    assert stats.num_accepted_tokens_per_method == {"suffix": 1, "draft_model": 2}
    assert stats.as_dict()["num_rounds_per_method"] is not stats.num_rounds_per_method  # a copy
