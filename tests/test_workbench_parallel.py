"""The workbench profiles a parallel draft (PARD) and an EAGLE-3 head beside an autoregressive draft:
acceptance per position, draft cost per round (one forward for PARD whatever k, measured in shape),
and the recommended k from the cost model; a method list may hold the parallel draft."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

os.environ["HF_HUB_OFFLINE"] = "1"

from specdec.cli import app  # noqa: E402
from specdec.cost_model import expected_tokens  # noqa: E402
from test_eagle3 import make_head  # noqa: E402
from test_pard import pard_copy  # noqa: E402
from tiny_models import make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

PROMPTS = [("w1 w2 w3 w4", "code"), ("w10 w20 w30 w40 w50", "code"), ("w7 w8", "chat"), ("w3 w3 w9", "chat")]
K = 3


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("wb_parallel")
    target = make_model(root / "target", "llama", seed=0, layers=4)
    pard = pard_copy(target, root / "pard", 0.01, max_k=4)
    head = make_head(str(target), root / "head")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in PROMPTS))
    out = root / "out"
    result = CliRunner().invoke(app, [str(a) for a in (
        "profile", "--model", target, "--prompts", prompts, "--max-tokens", 16, "--k-max", K, "--out", out,
        "--json", "--backend", "torch",
        # the same weights drafting one step a draft, then in parallel
        "--speculative-config", json.dumps({"method": "draft_model", "model": pard}),
        "--speculative-config", json.dumps({"method": "draft_model", "model": pard, "parallel_drafting": True}),
        "--speculative-config", json.dumps({"method": "eagle3", "model": head}))])
    assert result.exit_code == 0, result.output
    return {**json.loads((out / "profile.json").read_text()), "out": str(out)}


def test_profile_measures_a_parallel_draft_per_round_and_a_head_per_token(profiled):
    p = profiled
    v = p["verify_cost"]["v"]
    ar, pard, head = p["configs"]
    assert [c["method"] for c in p["configs"]] == ["draft_model", "draft_model", "eagle3"]
    assert "parallel_drafting" not in ar["speculative_config"] and pard["speculative_config"]["parallel_drafting"]
    assert [c["draft_cost_shape"] for c in p["configs"]] == ["per_token", "per_round", "per_token"]
    for c in p["configs"]:
        assert c["greedy_match"] == {"matched": 4, "total": 4}
        o = c["overall"]
        assert len(o["alpha_conditional"]) == K and len(o["acceptance_rate_per_pos"]) == K
        assert c["draft_time_per_round_s"] > 0 and len(c["draft_cost_per_round"]) == K + 1
        assert o["best_k"] == max(range(K + 1), key=lambda k: o["predicted_speedup"][k])
    # an autoregressive drafter (the draft model, the head): k steps of c per round
    for c in (ar, head):
        assert c["draft_cost_per_round"] == pytest.approx([k * c["draft_cost_ratio"] for k in range(K + 1)])
        assert c["parallel_draft_forward"] is None
    # the parallel draft: its measured round at K, shaped by its own forward timed at every k
    shape = pard["parallel_draft_forward"]
    assert shape["k"] == [1, 2, 3] and shape["f"][0] == pytest.approx(1.0)
    assert shape["f"] == sorted(shape["f"]) and shape["f"][2] - shape["f"][1] == pytest.approx(shape["f"][1] - 1.0)
    c = pard["draft_cost_per_round"]
    t_round = pard["draft_time_per_round_s"] / pard["target_step_s"]
    assert c[0] == 0.0 and c[K] == pytest.approx(t_round) and pard["draft_cost_ratio"] == pytest.approx(t_round)
    assert c[1:] == pytest.approx([t_round * f / shape["f"][-1] for f in shape["f"]])
    # one forward per round: its round at K costs about one draft step of the same weights, not K
    assert pard["draft_time_per_round_s"] < 0.75 * ar["draft_time_per_round_s"]
    for e in pard["categories"].values():  # S(k) = E(k) / (c(k) + v(k)), averaged over the proposal lengths
        lengths = e["draft_length_histogram"]
        expect = [expected_tokens(e["alpha_conditional"], k)
                  / (sum(n * ((c[min(i, k)] if min(i, k) else 0.0) + v[min(i, k)]) for i, n in enumerate(lengths))
                     / sum(lengths)) for k in range(K + 1)]
        assert e["predicted_speedup"] == pytest.approx(expect)


def test_the_draft_forward_shape_is_a_line_that_does_not_fall():
    from specdec.workbench.profile import _rising_line

    assert _rising_line([1, 2, 3], [1.0, 2.0, 3.0]) == pytest.approx([1.0, 2.0, 3.0])
    assert _rising_line([1, 2, 3], [1.0, 0.9, 0.8]) == pytest.approx([0.9, 0.9, 0.9])  # noise: flat at the mean
    assert _rising_line([1, 2, 3, 4], [1.0, 1.3, 1.1, 1.4]) == pytest.approx([1.05, 1.15, 1.25, 1.35])


def test_report_shows_the_draft_cost_per_round(profiled):
    result = CliRunner().invoke(app, ["report", profiled["out"], "--json"])
    assert result.exit_code == 0, result.output
    md = open(json.loads(result.stdout)["files"]["report.md"]).read()
    rows = [line for line in md.splitlines() if line.startswith("| draft_model (pard)") or line.startswith("| eagle3")]
    assert len(rows) == 3 and [" /round |" in r for r in rows] == [False, True, False], rows
    assert md.count("one forward whatever k") == 1 and md.count("k draft steps") == 2
    summary = json.loads(result.stdout)["summary"]["configs"]
    assert [c["draft_cost_shape"] for c in summary] == ["per_token", "per_round", "per_token"]


def test_profile_a_parallel_draft_on_llamacpp(tmp_path):
    target = make_model(tmp_path / "target", "llama", seed=0, layers=4)
    pard = pard_copy(target, tmp_path / "pard", 0.01, max_k=4)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in PROMPTS[:2]))
    result = CliRunner().invoke(app, [str(a) for a in (
        "profile", "--model", target, "--prompts", prompts, "--max-tokens", 12, "--k-max", K, "--out",
        tmp_path / "out", "--json", "--backend", "llama.cpp", "--no-validate",
        "--speculative-config", json.dumps({"method": "draft_model", "model": pard, "parallel_drafting": True}))])
    assert result.exit_code == 0, result.output
    p = json.loads((tmp_path / "out" / "profile.json").read_text())
    (c,) = p["configs"]
    assert p["backend"] == "llama.cpp" and c["draft_cost_shape"] == "per_round"
    assert c["greedy_match"] == {"matched": 2, "total": 2} and c["parallel_draft_forward"]["f"][0] == pytest.approx(1.0)
    assert c["draft_cost_per_round"][K] == pytest.approx(c["draft_time_per_round_s"] / c["target_step_s"])
