"""``specdec demo`` tells the truth: its final ratio is checked against what τ and the measured costs
explain, figures that do not add up are measured again and flagged if they stay so, a run that drafted
nothing says so (not "0% acceptance"), and a CPU out of arithmetic is named as the reason speculation
cannot pay. The decisions are pure functions of figures, tested on injected ones; the final comparison
runs once on tiny models to check what it returns.
"""

from __future__ import annotations

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

import specdec.demo as demo  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.bench import BenchResult, PromptRun  # noqa: E402
from specdec.demo import (FinalFigures, acceptance_text, cannot_pay, choose, doubts, expected_ratio,  # noqa: E402
                          explain)
from test_demo_choice import m  # noqa: E402  -- Measured records from injected figures
from tiny_models import make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# -- what τ and the costs explain ----------------------------------------------------------------


def test_expected_ratio_from_tau_and_costs():
    # every round drafted: τ 3 tokens for a verify pass of 1.5 steps and 0.5 steps of drafting
    assert expected_ratio(3.0, 10, 0, 1.5, 0.5) == pytest.approx(1.5)
    # rounds that drafted nothing are plain steps: 10 rounds of 3 tokens in 20 steps, 20 plain steps
    assert expected_ratio(3.0, 10, 20, 1.5, 0.5) == pytest.approx(50 / 40)
    assert expected_ratio(1.0, 0, 64, 1.8, 0.3) == 1.0  # drafted nothing: plain decoding
    assert expected_ratio(1.0, 0, 0, 1.0, 0.0) == 1.0
    # the engine's own work per round (0.5 steps): a drafted round pays it once for τ tokens, plain
    # decoding once per token; so 3 tokens for 1.5 + 0.5 + 0.5 steps against 1.5 steps a token
    assert expected_ratio(3.0, 10, 0, 1.5, 0.5, host_steps=0.5) == pytest.approx(3.0 / 2.5 * 1.5)
    assert expected_ratio(1.0, 0, 64, 1.8, 0.3, host_steps=0.2) == pytest.approx(1.0)


def test_drafts_per_round_from_the_per_position_counts():
    """Rounds of 6, 1, 1 and 3 drafts: positions 0..5 were drafted 4, 2, 2, 1, 1, 1 times."""
    m = {"num_draft_tokens_per_pos": [4, 2, 2, 1, 1, 1], "num_tree_drafts": 0}
    assert demo.drafts_per_round(m) == {1: 2, 3: 1, 6: 1}
    assert demo.drafts_per_round({"num_draft_tokens_per_pos": [], "num_tree_drafts": 0}) is None
    assert demo.drafts_per_round({**m, "num_tree_drafts": 3}) is None  # a tree's positions are depths


def test_the_verify_cost_is_averaged_over_the_rounds_drafts():
    """Rounds of 1, 1 and 7 drafts on a step-shaped verify cost (the 16-bit kernel's: 1-3 tokens one
    step, 4-6 two, 7-9 three) cost (1 + 1 + 3) / 3 steps a round, not the cost at the mean (3 drafts: 2)."""
    from types import SimpleNamespace

    line = lambda T: 1.0 if T <= 3 else (2.0 if T <= 6 else 3.0)  # noqa: E731
    controller = SimpleNamespace(verify_time={(1, 1): None}, verify_line=lambda B: line)
    spec = SimpleNamespace(engine=SimpleNamespace(controller=controller), backend="torch")
    metrics = {"num_drafts": 3, "num_verify_passes": 3, "num_draft_tokens": 9, "num_tree_drafts": 0,
               "num_draft_tokens_per_pos": [3, 1, 1, 1, 1, 1, 1], "mean_acceptance_length": 2.0, "draft_time_s": 0.0}
    figures = demo.final_figures(SimpleNamespace(spec_metrics=metrics, decode_speedup=1.2), spec)
    assert figures.verify_steps == pytest.approx(5 / 3)


def test_a_ratio_the_figures_cannot_explain_is_doubted():
    # the fresh-clone run of issue 37: "speedup 2.13x" from a run that drafted nothing (τ 1)
    nothing = FinalFigures(ratio=2.13, tau=1.0, drafted_rounds=0, plain_steps=190, verify_steps=1.8, draft_steps=0.0)
    assert doubts(nothing) == ["2.13x over plain on the same backend is more than τ 1.00 allows"]
    # within the band of what τ 2.5, a 1.8-step verify pass and 0.3 steps of drafting predict (1.19x)
    fine = FinalFigures(ratio=1.1, tau=2.5, drafted_rounds=40, plain_steps=0, verify_steps=1.8, draft_steps=0.3)
    assert fine.expected == pytest.approx(2.5 / 2.1) and doubts(fine) == []
    slow = FinalFigures(ratio=0.8, tau=2.5, drafted_rounds=40, plain_steps=0, verify_steps=1.2, draft_steps=0.3)
    assert doubts(slow) == ["0.80x over plain on the same backend where τ 2.50 and the measured costs predict 1.67x"]
    # no costs measured: only τ bounds the ratio
    assert doubts(FinalFigures(1.9, 2.5, 40, 0, None, None)) == []
    # the fastest plain backend measured 3.6x the other's now, 1.2x in the probe: the plain run was slowed
    moved = FinalFigures(1.1, 2.5, 40, 0, 1.8, 0.3, plain_ratio=3.6, probe_plain_ratio=1.2)
    assert doubts(moved) == ["the plain backends measured 3.60x apart now and 1.20x in the probe"]
    assert doubts(FinalFigures(1.1, 2.5, 40, 0, 1.8, 0.3, plain_ratio=1.3, probe_plain_ratio=1.2)) == []


def test_drafted_nothing_is_said_as_such():
    text = acceptance_text({"num_draft_tokens": 0, "acceptance_rate": 0.0, "mean_acceptance_length": 1.0})
    assert text.startswith("drafted nothing") and "%" not in text
    text = acceptance_text({"num_draft_tokens": 120, "acceptance_rate": 0.733, "mean_acceptance_length": 2.47})
    assert text == "τ 2.47 tokens per verify pass; 73.3% of 120 drafted tokens accepted"
    gated = choose([m("llama.cpp", tps=400), m("llama.cpp", "draft_model", 6, tps=390, tau=1.0, mean_k=0.0)])
    why = explain(gated, {"llama.cpp": (2.0, 4.6)})
    assert "draft_model drafted nothing (the controller found no k that pays here): it ran as plain decoding" in why
    assert "gets 1.00 tokens per verify pass" not in why


def test_final_lines_are_short_and_honest():
    r = {"speedup": 1.0, "runs": 5, "remeasured": 2, "expected_speedup": 1.0, "greedy_match": {"matched": 3, "near_ties": 0,
                                                                                   "total": 3},
         "doubts": ["2.13x over plain on the same backend is more than τ 1.00 allows"],
         "spec": {"metrics": {"num_draft_tokens": 0, "acceptance_rate": 0.0, "mean_acceptance_length": 1.0}}}
    lines = demo.final_lines(r, "llama.cpp", "torch", 2.13, peer="plain llama.cpp")
    assert lines[0].startswith("speedup: 2.13x over plain llama.cpp") and "fastest of 5 runs" in lines[0]
    assert lines[2].startswith("not to be trusted: 2.13x over plain on the same backend is more than τ 1.00 allows")
    assert lines[3].startswith("drafted nothing") and not any("0.0%" in line for line in lines)
    assert len(lines) <= 5
    r.update(doubts=[], runs=1, remeasured=0, expected_speedup=1.42)
    lines = demo.final_lines(r, "torch", "torch", 1.40, peer=None)
    assert lines[:2] == ["speedup: 1.40x over plain torch, the fastest plain backend here (alternating prompt by "
                         "prompt after a warm-up)", "as τ and the measured costs predict (1.42x on torch, decoding "
                         "alone)"]
    r.update(decode_speedup=1.37)  # the measured ratio of the decoding alone stands beside the prediction
    assert demo.final_lines(r, "torch", "torch", 1.40, peer=None)[1] == (
        "as τ and the measured costs predict (1.42x on torch, decoding alone, measured 1.37x)")


def test_a_cpu_out_of_arithmetic_is_named():
    # the 1B stand-in on 2 AVX2 cores (issue 37): q4_k_m verifies 5 tokens in 3.62 steps; the shipped pair: 1.8
    out = cannot_pay({"llama.cpp": (5, 111.6 / 30.8), "torch": (5, 12.25 / 11.24)})
    assert list(out) == ["llama.cpp"]
    assert out["llama.cpp"].startswith("On this CPU llama.cpp is out of arithmetic: a verify pass of 5 tokens costs "
                                       "3.62 one-token steps, so even a round with every draft accepted is at most "
                                       "1.38x plain")
    assert cannot_pay({"llama.cpp": (5, 1.8)}) == {}
    choice = choose([m("llama.cpp", tps=32), m("llama.cpp", "draft_model", 6, tps=30, tau=2.4, mean_k=3.0)])
    assert "speculation cannot pay on it here" in explain(choice, {"llama.cpp": (30.8, 111.6)})  # forward costs
    assert "cannot pay" not in explain(choice, {"llama.cpp": (4.0, 7.2)})
    # without them, the controller's verify line at the drafts per round: 4 tokens in 3.1 steps
    steep = choose([m("llama.cpp", tps=32, step_ms=31.0),
                    m("llama.cpp", "draft_model", 6, tps=30, tau=2.4, mean_k=3.0, verify_steps=3.1)])
    assert "a verify pass of 4 tokens costs 3.10 one-token steps" in explain(steep)
    flat = choose([m("torch", tps=80, step_ms=12.0), m("torch", "eagle3", 6, tps=140, tau=3.4, mean_k=4.0,
                                                       verify_steps=1.1)])
    assert "cannot pay" not in explain(flat)


def _run(ar_s: float, spec_s: float, peer_s: float) -> PromptRun:
    return PromptRun(None, ar_tokens=10, ar_time_s=ar_s, spec_tokens=10, spec_time_s=spec_s, num_drafts=4,
                     peer_tokens={"plain llama.cpp": 10}, peer_time_s={"plain llama.cpp": peer_s})


def test_remeasured_figures_keep_each_sides_fastest_run():
    metrics = {"num_drafts": 8}
    a = BenchResult([_run(1.0, 0.5, 0.4), _run(2.0, 1.0, 0.8)], metrics, True, 1, 10, 4)
    b = BenchResult([_run(0.5, 0.6, 0.9), _run(2.5, 0.7, 0.3)], metrics, True, 1, 10, 4)
    best = demo._fastest(a, b)
    assert [(r.ar_time_s, r.spec_time_s, r.peer_time_s["plain llama.cpp"]) for r in best.runs] == [
        (0.5, 0.5, 0.4), (2.0, 0.7, 0.3)]
    assert a.runs[0].peer_time_s["plain llama.cpp"] == 0.4  # the inputs are left as they were


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("honest")
    return str(make_model(root / "t", seed=0)), str(make_model(root / "d", seed=0))  # a draft that always agrees


def test_final_comparison_returns_checked_figures(pair):
    target, draft = pair
    plain = LLM(model=target, backend="torch")
    spec = LLM(model=target, backend="torch", speculative_config={"method": "draft_model", "model": draft,
                                                                  "num_speculative_tokens": 3, "adaptive": False})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    costs = demo.forward_costs({demo.Candidate("torch"): plain})  # the step and a verify pass of 5, timed now
    r = demo.final_comparison(plain, spec, ["w1 w2 w3", "w5 w6", "w9 w8 w7 w6"], params, costs=costs)
    assert r["greedy_match"]["matched"] == 3
    assert 0 <= r["remeasured"] <= demo.FINAL_EXTRA_ROUNDS and r["runs"] == demo.FINAL_ROUNDS + r["remeasured"]
    assert not r["doubts"] or r["remeasured"] == demo.FINAL_EXTRA_ROUNDS  # flagged only after measuring again
    assert r["spec"]["metrics"]["num_draft_tokens"] > 0 and r["spec"]["mean_acceptance_length"] > 1.5
    assert r["expected_speedup"] is not None and r["expected_speedup"] > 0
    figures = demo.final_figures(_as_result(plain, spec, params), spec)
    assert figures.tau > 1.5 and figures.drafted_rounds > 0
    assert figures.verify_steps is None  # no adaptive controller and no forward costs: only τ bounds the ratio


def _as_result(plain, spec, params):
    from specdec.bench import run_bench

    return run_bench(plain, spec, ["w1 w2 w3"], params)
