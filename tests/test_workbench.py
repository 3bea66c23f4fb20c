"""The workbench on tiny random models: profile, report, verify-lossless, export and bench --peer hf.

Goldens for export live in tests/golden/export; regenerate them with SPECDEC_UPDATE_GOLDEN=1 after a
deliberate change, and review the diff.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

os.environ["HF_HUB_OFFLINE"] = "1"

import specdec.verify as verify_module  # noqa: E402
from specdec import LLM  # noqa: E402
from specdec.cli import app  # noqa: E402
from specdec.cost_model import expected_tokens  # noqa: E402
from specdec.sampling import sample  # noqa: E402
from specdec.workbench.categories import ALL, recommend  # noqa: E402
from specdec.workbench.export import ENGINES, export_by_category, export_config  # noqa: E402
from specdec.workbench.lossless import chi_square, verify_lossless  # noqa: E402
from specdec.workbench.profile import acceptance_from_rounds  # noqa: E402
from tiny_models import make_model, perturbed_copy  # noqa: E402

runner = CliRunner()
GOLDEN = Path(__file__).parent / "golden" / "export"
SMALL_WORDS = [f"w{i}" for i in range(20)]  # V = 23: exact joint distributions are cheap
PROMPTS = [("w1 w2 w3 w4", "code"), ("w10 w20 w30 w40 w50", "code"), ("w7 w8", "chat"), ("w3 w3 w9", "chat")]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("workbench")
    target = make_model(root / "target", "llama", seed=0, layers=4)
    small = make_model(root / "small", "llama", words=SMALL_WORDS, seed=3, init_std=0.5)
    return {"target": str(target), "near": str(perturbed_copy(target, root / "near", 0.01)),
            "small": str(small), "small_draft": str(perturbed_copy(small, root / "small_draft", 0.05))}


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("wb_prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in PROMPTS))
    return path


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def json_out(result) -> dict:
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0])


def fails_with(result, text: str) -> None:
    assert result.exit_code == 2, result.output
    assert "error:" in result.stderr and text in result.stderr, result.stderr


# -- acceptance as the profile measures it (the cost model: tests/test_cost_model.py) -------------


def test_acceptance_from_rounds():
    # (drafts, accepted) per round: position 2 reached by the two rounds that accepted position 1
    acc = acceptance_from_rounds([(2, 0), (2, 1), (2, 2), (0, 0)], 2)
    assert acc["num_rounds"] == 3
    assert acc["alpha_conditional"] == pytest.approx([2 / 3, 1 / 2])
    assert acc["acceptance_rate_per_pos"] == pytest.approx([2 / 3, 1 / 3])
    assert acc["tau_histogram"] == [1, 1, 1]
    assert acc["mean_acceptance_length"] == pytest.approx(2.0)
    # (asked, drafted, accepted): a lookup drafter that found only 1 token fails position 2 by proposing nothing
    acc = acceptance_from_rounds([(2, 1, 1), (2, 2, 2), (2, 0, 0), (1, 1, 1)], 2)
    assert acc["alpha_conditional"] == pytest.approx([3 / 4, 1 / 2])  # position 2: asked 3 times, reached by 2
    assert acc["proposal_rate_per_pos"] == pytest.approx([3 / 4, 1 / 3])
    assert acc["draft_length_histogram"] == [1, 2, 1] and acc["num_rounds"] == 3


# -- profile and report ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def profiled(models, prompts_file, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("profile_out")
    result = cli("profile", "--model", models["target"], "--prompts", prompts_file, "--max-tokens", 16,
                 "--k-max", 3, "--out", out, "--json", "--sweep",
                 "--speculative-config", json.dumps({"method": "draft_model", "model": models["near"]}),
                 "--speculative-config", json.dumps({"method": "layer_skip", "num_draft_layers": 1}),
                 "--speculative-config", json.dumps({"method": ["ngram", "suffix"]}))  # a list: each profiled
    summary = json_out(result)
    assert summary["profile"] == str(out / "profile.json")
    return out, json.loads((out / "profile.json").read_text())


def test_profile_writes_measurements_and_predictions(profiled):
    _, p = profiled
    assert p["k_max"] == 3 and p["num_prompts"] == 4 and p["categories"] == ["chat", "code"]
    v = p["verify_cost"]["v"]
    assert p["verify_cost"]["k"] == [0, 1, 2, 3] and v[0] == 1.0 and all(x > 0 for x in v)
    # a method list: each of its methods, then the list itself (per-request choice)
    assert [c["method"] for c in p["configs"]] == ["draft_model", "layer_skip", "ngram", "suffix", ["ngram", "suffix"]]
    assert p["method_lists"] == [{"methods": ["ngram", "suffix"], "config_indices": [2, 3], "choice_config_index": 4,
                                  "speculative_config": p["method_lists"][0]["speculative_config"]}]
    assert p["method_lists"][0]["speculative_config"]["method"] == ["ngram", "suffix"]
    for c in p["configs"]:
        assert c["draft_cost_ratio"] > 0
        assert c["greedy_match"] == {"matched": 4, "total": 4}
        assert set(c["categories"]) == {"chat", "code", "all"}
        for cat, e in c["categories"].items():
            assert len(e["alpha_conditional"]) == 3
            assert all(0.0 <= a <= 1.0 for a in e["alpha_conditional"] + e["acceptance_rate_per_pos"])
            assert 1.0 <= e["mean_acceptance_length"] <= 4.0
            assert sum(e["tau_histogram"]) == e["num_rounds"] == len(e["accepted_per_round"])
            assert e["num_rounds"] > 0 or c["method"] not in ("draft_model", "layer_skip")  # lookups may find none
            assert e["plain_tokens_per_s"] > 0 and e["spec_tokens_per_s"] > 0
            # the prediction is exactly S(k) = E(k) / (k c + v(k)) with the measured alphas, the cost averaged
            # over the measured proposal lengths (the room left at a sequence's end asks for fewer drafts)
            lengths = e["draft_length_histogram"]
            if c["method"] in ("draft_model", "layer_skip"):  # lookups (and the choice) propose what they find
                assert lengths[3] >= sum(lengths[:3])  # mostly full proposals
            expect = [expected_tokens(e["alpha_conditional"], k)
                      / (sum(n * (min(i, k) * c["draft_cost_ratio"] + v[min(i, k)]) for i, n in enumerate(lengths))
                         / sum(lengths)) for k in range(4)]
            assert e["predicted_speedup"] == pytest.approx(expect)
            assert e["predicted_speedup"][0] == pytest.approx(1.0)
            assert e["best_k"] == max(range(4), key=lambda k: e["predicted_speedup"][k])
    near = p["configs"][0]["overall"]
    assert 0 < near["acceptance_rate"] < 1  # the near draft partly agrees: every position is measured
    rec = p["recommendation"]
    best = max(p["configs"][:4], key=lambda c: c["overall"]["best_speedup"])  # one method: not the list
    assert rec["method"] == best["method"] and rec["k"] == best["overall"]["best_k"]
    assert rec["label"] == best["label"] and rec["runner_up"]["config_index"] != rec["config_index"]
    assert rec["speculative_config"]["adaptive"] is False
    val = p["validation"]
    assert 1 <= val["k"] <= 3 and val["measured_speedup"] > 0
    assert val["greedy_match"]["matched"] == 4
    assert val["predicted_speedup"] == pytest.approx(
        p["configs"][rec["config_index"]]["overall"]["predicted_speedup"][val["k"]])
    assert [r["k"] for r in p["sweep"]] == [1, 2, 3] and all(r["measured_speedup"] > 0 for r in p["sweep"])


def test_profile_per_category_rows_picks_and_checks(profiled):
    _, p = profiled
    assert set(p["by_category"]) == {"chat", "code"}
    for cat, entry in p["by_category"].items():
        assert entry["num_prompts"] == 2
        rows = entry["drafters"]
        assert [r["label"] for r in rows] == [c["label"] for c in p["configs"]]
        assert [r["label"] for r in rows] == ["draft_model (near)", "layer_skip", "ngram", "suffix",
                                              "choice"]
        assert [r["choice"] for r in rows] == [False] * 4 + [True]
        for r, c in zip(rows, p["configs"]):  # the rows are the per-config measurements of this category
            e = c["categories"][cat]
            assert r["acceptance_rate"] == e["acceptance_rate"] and r["best_k"] == e["best_k"]
            assert r["mean_acceptance_length"] == e["mean_acceptance_length"]
            assert r["predicted_speedup_at_k_max"] == e["predicted_speedup"][3]
            assert r["choice"] == isinstance(c["method"], list)
            assert r["measured_speedup_at_k_max"] == e["measured_speedup_at_k_max"] > 0
        rec = entry["recommendation"]
        top = max(range(4), key=lambda i: (p["configs"][i]["categories"][cat]["best_speedup"], -i))  # not the list
        e = p["configs"][top]["categories"][cat]
        assert (rec["config_index"], rec["k"], rec["plain"]) == (top, e["best_k"], e["best_k"] == 0)
        assert rec["predicted_speedup"] == e["best_speedup"]
        assert rec["speculative_config"] == {**p["configs"][top]["speculative_config"],
                                             "num_speculative_tokens": e["best_k"], "adaptive": False}
        val = entry["validation"]
        if rec["plain"]:
            assert val is None
            continue
        assert val["k"] == rec["k"] and val["measured_speedup"] > 0 and val["label"] == rec["label"]
        assert val["predicted_speedup"] == pytest.approx(e["predicted_speedup"][rec["k"]])
        assert val["all_prompts_setting_measured_speedup"] == p["validation"]["by_category"][cat]["measured_speedup"]
        if val["run"] == "its own run":
            assert val["greedy_match"]["matched"] == val["greedy_match"]["total"] == 2


def test_report_writes_html_png_and_markdown(profiled):
    out, p = profiled
    summary = json_out(cli("report", out, "--json"))
    files = summary["files"]
    for name in ("acceptance_by_position.png", "speedup_vs_k.png", "tau_histogram.png", "time_split.png",
                 "by_category.png"):
        assert Path(files[name]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = Path(files["report.html"]).read_text()
    assert page.count("data:image/png;base64,") == 5 and "<table>" in page
    md = Path(files["report.md"]).read_text()
    assert "| config |" in md and "speedup_vs_k.png" in md and "τ" in md and "| k | predicted S(k) |" in md
    assert "## Per category: which drafter" in md and "one deployment per category" in md
    for cat in ("chat", "code"):  # a row per drafter and category
        rows = [line for line in md.splitlines() if line.startswith(f"| {cat} | 2 | ") and line[len(cat) + 9].isalpha()]
        assert [r.split(" | ")[2].rstrip(" ★") for r in rows] == [c["label"] for c in p["configs"]]
        assert " | - / " in rows[-1] and " | - / " not in "".join(rows[:-1])  # the choice: measured only
    stars = sum(not e["recommendation"]["plain"] for e in p["by_category"].values())
    assert md.count("★") == stars + 1  # and one in the legend sentence
    assert summary["summary"]["recommendation"]["method"] in ("draft_model", "layer_skip", "ngram", "suffix")
    by_cat = summary["summary"]["by_category"]
    assert set(by_cat) == {"chat", "code"}
    for cat, e in by_cat.items():
        assert e["recommended"] == (None if e["plain"] else p["by_category"][cat]["recommendation"]["label"])
        assert set(e["drafters"]) == {"draft_model (near)", "layer_skip", "ngram", "suffix", "choice"}


def test_profile_and_report_on_spec_bench(models, shared_data, tmp_path):
    lines = (shared_data / "spec_bench" / "question.jsonl").read_text().splitlines()
    picked = [next(line for line in lines if json.loads(line)["category"] == cat) for cat in ("writing", "coding")]
    (tmp_path / "mixed.jsonl").write_text("\n".join(picked) + "\n")
    result = cli("profile", "--model", models["target"], "--prompts", tmp_path / "mixed.jsonl",
                 "--max-tokens", 8, "--k-max", 2, "--no-validate", "--out", tmp_path,
                 "--speculative-config", '{"method": "layer_skip", "num_draft_layers": 1}',
                 "--speculative-config", '{"method": "ngram"}')
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "recommendation:" in out and "α_1..α_2" in out
    # a table per category, then all prompts, each with a row per drafter
    titles = ("category coding (1 prompt)", "category writing", "all prompts (2 prompts)")
    order = [out.index(title) for title in titles]
    assert order == sorted(order)
    assert out.count("layer_skip") >= 3 and "per category (one deployment per category" in out
    p = json.loads((tmp_path / "profile.json").read_text())
    assert p["categories"] == ["coding", "writing"] and "validation" not in p
    assert all(e.get("validation") is None for e in p["by_category"].values())
    summary = json_out(cli("report", tmp_path, "--json"))["summary"]
    assert summary["validation"] is None and set(summary["by_category"]) == {"coding", "writing"}


def test_profile_and_report_bad_input(models, prompts_file, tmp_path):
    fails_with(cli("profile", "--model", models["target"], "--prompts", prompts_file), "needs a drafter")
    fails_with(cli("profile", "--model", models["target"], "--prompts", prompts_file,
                   "--speculative-config", "{nope"), "not valid JSON")
    fails_with(cli("profile", "--model", models["target"], "--prompts", prompts_file, "--k-max", 0,
                   "--speculative-config", '{"method": "layer_skip"}'), "--k-max")
    fails_with(cli("profile", "--model", models["target"], "--prompts", prompts_file, "--threads", 0,
                   "--speculative-config", '{"method": "layer_skip"}'), "--threads")
    fails_with(cli("profile", "--model", models["target"], "--prompts", tmp_path / "missing.jsonl",
                   "--speculative-config", '{"method": "layer_skip"}'), "does not exist")
    fails_with(cli("report", tmp_path), "no profile.json")
    (tmp_path / "profile.json").write_text("{}")
    fails_with(cli("report", tmp_path), "not a specdec profile")


# -- verify-lossless ------------------------------------------------------------------------------


def skip_residual(draft_token_ids, draft_probs, target_probs, generators, num_draft=None):
    """A broken verifier: after a rejection it samples from p instead of the residual max(0, p - q)."""
    return _broken(draft_token_ids, draft_probs, target_probs, generators, num_draft, residual=False)


def logit_residual(draft_token_ids, draft_probs, target_probs, generators, num_draft=None):
    """A broken verifier: the residual softmax(clamp(log p - log q, min=0)), built from logits."""
    return _broken(draft_token_ids, draft_probs, target_probs, generators, num_draft, residual=True)


_correct_rejection_sample = verify_module.rejection_sample


def _broken(draft_ids, q, p, generators, num_draft, residual):
    B, k = draft_ids.shape
    if q is None or k == 0:
        return _correct_rejection_sample(draft_ids, q, p, generators, num_draft)
    num_draft = torch.full((B,), k) if num_draft is None else num_draft
    p_x = p[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)  # [B, k]
    q_x = q.gather(-1, draft_ids[..., None]).squeeze(-1)
    u = torch.stack([torch.rand(k, generator=g) for g in generators])
    accepted = ((u * q_x < p_x) & (torch.arange(k) < num_draft[:, None])).int()
    n = accepted.cumprod(dim=1).sum(dim=1)  # [B]
    rows = torch.arange(B)
    p_next = p[rows, n]  # [B, V]
    if residual:
        q_at = q[rows, n.clamp(max=k - 1)]
        wrong = torch.softmax(torch.nan_to_num((p_next.log() - q_at.log()).clamp(min=0), posinf=30.0), dim=-1)
        p_next = torch.where((n < num_draft)[:, None], wrong, p_next)
    return verify_module.VerifyResult(n.tolist(), sample(p_next, generators).tolist())


@pytest.fixture(scope="module")
def lossless_llm(models) -> LLM:
    return LLM(models["small"], speculative_config={"model": models["small_draft"], "num_speculative_tokens": 2})


def test_verify_lossless_passes_on_the_engine(models):
    result = json_out(cli("verify-lossless", "--model", models["small"], "--samples", 500, "--prompt", "w1 w2 w3",
                          "--speculative-config", json.dumps({"model": models["small_draft"],
                                                              "num_speculative_tokens": 2}), "--json"))
    assert result["passed"] and result["verdict"] == "PASS" and result["num_tests"] == 3
    assert result["threshold_per_test"] == pytest.approx(1e-3 / 3)
    for t in result["tests"]:
        assert t["samples"] == 500 and t["p_value"] > t["threshold"] and t["df"] >= 5
        assert 0 < t["acceptance_rate"] < 1  # drafts were both accepted and rejected: the residual is exercised


def test_verify_lossless_runs_on_the_llamacpp_backend(models, tmp_path):
    from specdec.models.gguf import convert

    target = convert(models["small"], str(tmp_path / "t.gguf"), "f32")
    draft = convert(models["small_draft"], str(tmp_path / "d.gguf"), "f32")
    result = json_out(cli("verify-lossless", "--model", target, "--backend", "llama.cpp", "--samples", 500,
                          "--prompt", "w1 w2 w3", "--speculative-config",
                          json.dumps({"model": draft, "num_speculative_tokens": 2}), "--json"))
    assert result["passed"] and all(0 < t["acceptance_rate"] < 1 for t in result["tests"])


@pytest.mark.parametrize("broken", [skip_residual, logit_residual], ids=["no-residual", "logit-residual"])
def test_verify_lossless_fails_on_a_broken_verifier(lossless_llm, monkeypatch, broken):
    monkeypatch.setattr(verify_module, "rejection_sample", broken)
    result = verify_lossless(lossless_llm, samples=500, prompts=["w1 w2 w3"])
    assert not result["passed"] and result["verdict"] == "FAIL"
    assert min(t["p_value"] for t in result["tests"]) < result["threshold_per_test"]


def test_verify_lossless_cli_exit_status_and_bad_input(models, monkeypatch):
    spec = json.dumps({"model": models["small_draft"], "num_speculative_tokens": 2})
    monkeypatch.setattr(verify_module, "rejection_sample", skip_residual)
    result = cli("verify-lossless", "--model", models["small"], "--speculative-config", spec, "--samples", 300,
                 "--prompt", "w1 w2 w3")
    assert result.exit_code == 1 and "FAIL" in result.stdout and "p = " in result.stdout
    fails_with(cli("verify-lossless", "--model", models["small"]), "needs a drafter")
    fails_with(cli("verify-lossless", "--model", models["small"], "--speculative-config", spec, "--samples", 3),
               "--samples")


def test_chi_square_merges_small_bins_and_rejects_impossible_outcomes():
    probs = torch.tensor([0.5, 0.3, 0.19, 0.01, 0.0], dtype=torch.float64)
    stat, df, p, impossible = chi_square(torch.tensor([50.0, 30, 19, 1, 0]), probs)
    assert stat == pytest.approx(0.0) and p == pytest.approx(1.0) and df == 3 and impossible == 0
    _, _, p, impossible = chi_square(torch.tensor([50.0, 30, 18, 1, 1]), probs)
    assert p == 0.0 and impossible == 1


# -- export ---------------------------------------------------------------------------------------

EXPORT_CONFIGS = {
    "draft_model": {"method": "draft_model", "model": "org/draft-68m", "num_speculative_tokens": 5, "adaptive": False,
                    "draft_p_min": 0.0},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8, "adaptive": False,  # every option explicit:
               "suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 1000,  # goldens must
               "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1},  # not follow defaults
    "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3, "num_draft_layers": 2},
}


@pytest.mark.parametrize("method", list(EXPORT_CONFIGS))
@pytest.mark.parametrize("engine", ENGINES)
def test_export_matches_golden(engine, method):
    exp = export_config(engine, EXPORT_CONFIGS[method], "org/target-1b")
    golden = GOLDEN / f"{engine}_{method}.txt"
    if os.environ.get("SPECDEC_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(exp.text)
    assert exp.text == golden.read_text()
    assert exp.supported == (method in ("draft_model", "ngram") or (engine, method) == ("vllm", "suffix"))
    if not exp.supported:
        assert "no equivalent" in exp.text and exp.command is None


def test_export_option_values():
    vllm = export_config("vllm", EXPORT_CONFIGS["ngram"]).options["speculative_config"]
    assert vllm == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    sglang = export_config("sglang", EXPORT_CONFIGS["draft_model"]).options
    assert sglang["--speculative-algorithm"] == "STANDALONE" and sglang["--speculative-num-steps"] == 5
    assert sglang["--speculative-num-draft-tokens"] == 6 and sglang["--speculative-eagle-topk"] == 1
    trt = export_config("trtllm", EXPORT_CONFIGS["ngram"]).options["speculative_config"]
    assert trt["decoding_type"] == "NGram" and trt["max_draft_len"] == 4 and trt["max_matching_ngram_size"] == 3
    llama = export_config("llamacpp", EXPORT_CONFIGS["draft_model"]).options
    assert llama["--spec-draft-n-max"] == 5 and llama["-md"] == "org/draft-68m.gguf" and llama["--spec-draft-p-min"] == 0.0
    assert llama["--spec-type"] == "draft-simple"
    adaptive = export_config("vllm", {"model": "d", "num_speculative_tokens": 4})
    assert any("adaptive" in n for n in adaptive.notes)


def test_export_cli_from_profile_and_bad_input(profiled, tmp_path):
    out, p = profiled
    rec = p["recommendation"]
    result = cli("export", "--engine", "vllm", "--profile", out / "profile.json", "--json")
    if rec["plain"]:  # random tiny models rarely pay off; then there is nothing to export
        fails_with(result, "recommends plain decoding")
    elif rec["method"] == "layer_skip":  # vLLM has none: the best single drafter it has that pays, if any
        others = [c for c in p["configs"] if c["method"] in ("draft_model", "ngram", "suffix")
                  and c["overall"]["best_k"] > 0]
        if not others:
            fails_with(result, "has an equivalent on vLLM")
        else:
            best = max(others, key=lambda c: c["overall"]["best_speedup"])
            exported = json_out(result)
            assert exported["method"] == best["method"] and "has no equivalent on vLLM" in exported["text"]
            assert exported["options"]["speculative_config"]["num_speculative_tokens"] == best["overall"]["best_k"]
    else:
        assert json_out(result)["options"]["speculative_config"]["num_speculative_tokens"] == rec["k"]
    draft = p["configs"][0]["speculative_config"]  # the draft_model config
    p["recommendation"] = {**rec, "plain": False, "k": 2, "method": "draft_model", "label": "draft_model (near)",
                           "speculative_config": {**draft, "num_speculative_tokens": 2}}
    (tmp_path / "profile.json").write_text(json.dumps(p))
    exported = json_out(cli("export", "--engine", "sglang", "--profile", tmp_path / "profile.json", "--json"))
    assert exported["method"] == "draft_model" and p["model"] in exported["command"]
    assert exported["options"]["--speculative-num-steps"] == 2
    text = cli("export", "--engine", "trtllm", "--speculative-config", json.dumps(EXPORT_CONFIGS["draft_model"]))
    assert text.exit_code == 0 and "decoding_type: DraftTarget" in text.stdout
    fails_with(cli("export", "--engine", "tgi", "--speculative-config", "{}"), "unknown engine")
    fails_with(cli("export", "--engine", "vllm"), "pass --profile profile.json or --speculative-config")
    fails_with(cli("export", "--engine", "vllm", "--profile", tmp_path / "profile.json",
                   "--speculative-config", json.dumps(EXPORT_CONFIGS["ngram"])), "ranks the methods of a list")
    fails_with(cli("export", "--engine", "vllm", "--by-category", "--speculative-config", "{}"), "--by-category")
    fails_with(cli("export", "--engine", "vllm", "--speculative-config", "{}", "--out", tmp_path), "--by-category")
    fails_with(cli("export", "--engine", "vllm", "--profile", tmp_path / "none.json"), "does not exist")
    fails_with(cli("export", "--engine", "vllm", "--speculative-config", '{"method": "medusa"}'), "not supported")


def with_picks(p: dict, speedups: dict[str, list[tuple[int, float]]]) -> dict:
    """``p`` with each drafter's best k and predicted S(best k) per category set to ``speedups[cat]``
    (one (k, S) per config), its per-category section dropped: the picks follow from the rule again."""
    q = copy.deepcopy(p)
    del q["by_category"]
    for cat, per_config in speedups.items():
        for c, (k, speedup) in zip(q["configs"], per_config):
            e = c["categories"][cat]
            e["best_k"], e["best_speedup"] = k, speedup
            e["predicted_speedup"] = [1.0] * len(e["predicted_speedup"])
            e["predicted_speedup"][k] = speedup
    q["recommendation"] = recommend(q["configs"], ALL)
    return q


PICKS = {  # configs: draft_model, layer_skip, ngram, suffix, the list [ngram, suffix] (never the pick)
    "code": [(1, 1.2), (0, 1.0), (3, 1.5), (2, 1.8), (3, 2.5)],  # suffix, which SGLang lacks: then ngram
    "chat": [(0, 1.0), (0, 1.0), (0, 1.0), (0, 1.0), (2, 1.3)],  # no single method pays: plain decoding
    "all": [(2, 1.4), (0, 1.0), (3, 1.3), (1, 1.1), (3, 1.6)],
}


def test_export_by_category_one_deployment_per_category(profiled, tmp_path):
    _, p = profiled
    q = with_picks(p, PICKS)
    (tmp_path / "profile.json").write_text(json.dumps(q))
    assert recommend(q["configs"], "code")["label"] == "suffix"
    vllm = export_by_category("vllm", tmp_path / "profile.json")
    assert "one speculative method per deployment" in vllm.text and "one deployment per category" in vllm.text
    code = vllm.categories["code"]
    assert code["recommended"] == "suffix" and code["k"] == 2 and not code["plain"]
    assert code["export"].options["speculative_config"]["method"] == "suffix"
    assert code["export"].options["speculative_config"]["num_speculative_tokens"] == 2
    chat = vllm.categories["chat"]
    assert chat["plain"] and chat["export"] is None and "serve without speculative decoding" in chat["text"]
    assert vllm.text.index("=== chat ===") < vllm.text.index("=== code ===")
    sglang = export_by_category("sglang", tmp_path / "profile.json").categories["code"]
    assert sglang["exported_method"] == "ngram" and sglang["export"].options["--speculative-num-draft-tokens"] == 4
    assert "has no equivalent on SGLang, so this is the best it has: ngram at k=3" in sglang["text"]
    # the CLI: one file per category (TensorRT-LLM: YAML), the paths in the JSON
    result = json_out(cli("export", "--engine", "trtllm", "--profile", tmp_path / "profile.json", "--by-category",
                          "--out", tmp_path / "trt", "--json"))
    assert result["files"] == {"chat": str(tmp_path / "trt" / "trtllm-chat.yml"),
                               "code": str(tmp_path / "trt" / "trtllm-code.yml")}
    code_yml = Path(result["files"]["code"]).read_text()
    assert "decoding_type: NGram" in code_yml and "max_draft_len: 3" in code_yml
    assert result["categories"]["code"]["export"]["method"] == "ngram"
    text = cli("export", "--engine", "llamacpp", "--profile", tmp_path / "profile.json", "--by-category")
    assert text.exit_code == 0 and "--spec-type ngram-simple" in text.stdout and "=== chat ===" in text.stdout


def test_export_a_method_list_takes_one_method(profiled, tmp_path):
    _, p = profiled
    listed = {"method": ["suffix", "ngram", "draft_model"], "model": "org/draft", "num_speculative_tokens": 4}
    first = export_config("sglang", listed)  # no profile: the first listed that SGLang has
    assert first.method == "ngram" and first.options["--speculative-num-draft-tokens"] == 5
    assert any("per request and round" in n for n in first.notes) and "first listed" in first.text
    q = with_picks(p, PICKS)
    ranked = export_config("sglang", listed, "org/target", q)  # the profile ranks them: draft_model 1.4x at k=2
    assert ranked.method == "draft_model" and ranked.options["--speculative-num-steps"] == 2
    assert "best single method of the list" in ranked.text
    none = export_config("llamacpp", {"method": ["suffix", "layer_skip"]})
    assert not none.supported and "no equivalent" in none.text
    # the profile's own recommendation: draft_model at k=2 on all prompts, and a note on the profiled list
    (tmp_path / "profile.json").write_text(json.dumps(q))
    rec = json_out(cli("export", "--engine", "llamacpp", "--profile", tmp_path / "profile.json", "--json"))
    assert rec["options"]["--spec-draft-n-max"] == 2 and rec["method"] == "draft_model"
    assert any("picks among ngram, suffix" in n for n in rec["notes"])
    cli_list = json_out(cli("export", "--engine", "vllm", "--profile", tmp_path / "profile.json", "--json",
                            "--speculative-config", json.dumps({"method": ["ngram", "suffix"]})))
    assert cli_list["method"] == "ngram" and cli_list["options"]["speculative_config"]["num_speculative_tokens"] == 3


# -- bench --peer hf ------------------------------------------------------------------------------


def test_bench_peer_hf(models, prompts_file):
    spec = json.dumps({"method": "draft_model", "model": models["near"], "num_speculative_tokens": 3,
                       "adaptive": False})
    r = json_out(cli("bench", "--model", models["target"], "--prompts", prompts_file, "--max-tokens", 16,
                     "--num-prompts", 3, "--speculative-config", spec, "--peer", "hf", "--json"))
    for key in ("hf_ar", "hf_spec"):
        assert r[key]["tokens"] > 0 and r[key]["tokens_per_s"] > 0
        assert r[key]["tokens"] == r["ar"]["tokens"]  # same budget, same stop tokens
    assert r["speedup_vs_hf"] == pytest.approx(r["spec"]["tokens_per_s"] / r["hf_spec"]["tokens_per_s"])
    agree = r["hf_agreement"]
    assert agree["all_agree"] and agree["hf_spec"]["agree"] == agree["hf_ar"]["agree"] == 3
    assert r["greedy_match"]["matched"] == 3
    text = cli("bench", "--model", models["target"], "--prompts", prompts_file, "--max-tokens", 8,
               "--num-prompts", 1, "--speculative-config", spec, "--peer", "hf")
    assert text.exit_code == 0 and "transformers" in text.stdout
    fails_with(cli("bench", "--model", models["target"], "--prompts", prompts_file, "--speculative-config", spec,
                   "--peer", "vllm"), "--peer")
    fails_with(cli("bench", "--model", models["target"], "--prompts", prompts_file, "--speculative-config", spec,
                   "--peer", "hf", "--temperature", 0.8), "greedy")


def test_a_recommendation_keeps_suffix_decoding_in_front_of_the_model():
    from specdec.config import SpeculativeConfig
    from specdec.workbench.profile import _config_dict

    cfg = _config_dict(SpeculativeConfig(model="d", enable_suffix_decoding=True, suffix_decoding_min_score=1.5))
    assert cfg["enable_suffix_decoding"] is True and cfg["suffix_decoding_min_score"] == 1.5 and cfg["model"] == "d"
    assert "enable_suffix_decoding" not in _config_dict(SpeculativeConfig(model="d"))
