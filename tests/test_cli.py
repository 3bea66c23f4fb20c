"""The CLI: generate / bench / demo over tiny random Llama checkpoints, and its bad-input handling.

Greedy equalities (speculative == plain, CLI == library) are exact here: the tiny models have no
near-ties at these prompts, so any difference is a bug, not floating-point noise.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

os.environ["HF_HUB_OFFLINE"] = "1"

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.cli import app  # noqa: E402
from specdec.prompts import load_prompts  # noqa: E402
from tiny_models import make_model  # noqa: E402

runner = CliRunner()
SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
PROMPTS = ["w1 w2 w3", "w10 w20 w30 w40 w50", "w7"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli_models")
    return {
        "target": str(make_model(root / "target", "llama", seed=0)),
        "same": str(make_model(root / "same", "llama", seed=0)),  # the target's weights: always agrees
        "other": str(make_model(root / "other", "llama", seed=1, layers=1)),  # rarely agrees
    }


@pytest.fixture(scope="module")
def plain_llm(models) -> LLM:
    return LLM(models["target"])


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli_prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "category": "c" + str(i % 2)}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    return path


def cli(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def greedy_ids(llm: LLM, prompt, max_tokens: int) -> list[int]:
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0].token_ids


def json_out(result) -> dict:
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, result.stdout  # exactly one JSON object, nothing else on stdout
    return json.loads(lines[0])


# -- generate -------------------------------------------------------------------------------------


def test_generate_json_equals_library_greedy(models, plain_llm):
    out = json_out(cli("generate", "--model", models["target"], "--prompt", PROMPTS[0], "--temperature", "0",
                       "--max-tokens", "12", "--json"))
    assert set(out) == {"text", "token_ids", "finish_reason", "metrics"}
    ref = plain_llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out["token_ids"] == ref.token_ids
    assert out["text"] == ref.text
    assert out["finish_reason"] == ref.finish_reason == "length"
    m = out["metrics"]
    assert {"acceptance_rate", "mean_acceptance_length", "draft_time_s", "verify_time_s"} <= set(m)
    assert m["num_draft_tokens"] == 0 and m["num_emitted_tokens"] == 12


@pytest.mark.parametrize("draft", ["same", "other"])
def test_generate_draft_greedy_equals_plain(models, plain_llm, draft):
    out = json_out(cli("generate", "--model", models["target"], "--draft", models[draft], "-k", "3", "--no-adaptive",
                       "--prompt", PROMPTS[1], "--temperature", "0", "--max-tokens", "16", "--json"))
    assert out["token_ids"] == greedy_ids(plain_llm, PROMPTS[1], 16)
    m = out["metrics"]
    assert m["num_draft_tokens"] > 0 and len(m["num_accepted_tokens_per_pos"]) == 3
    if draft == "same":
        assert m["acceptance_rate"] == 1.0 and m["mean_acceptance_length"] > 3


def test_generate_speculative_config_and_token_ids(models, plain_llm):
    cfg = json.dumps({"method": "draft_model", "model": models["same"], "num_speculative_tokens": 2,
                      "adaptive": False})
    out = json_out(cli("generate", "--model", models["target"], "--speculative-config", cfg,
                       "--prompt-token-ids", "4, 5,6", "--temperature", "0", "--max-tokens", "10", "--json"))
    assert out["token_ids"] == greedy_ids(plain_llm, {"prompt_token_ids": [4, 5, 6]}, 10)
    assert len(out["metrics"]["num_accepted_tokens_per_pos"]) == 2


def test_generate_with_penalties_equals_the_library(models, plain_llm):
    out = json_out(cli("generate", "--model", models["target"], "--draft", models["other"], "-k", "3",
                       "--prompt", PROMPTS[1], "--temperature", "0", "--max-tokens", "16", "--ignore-eos",
                       "--repetition-penalty", "1.5", "--presence-penalty", "0.5", "--frequency-penalty", "0.5",
                       "--min-tokens", "4", "--json"))
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5,
                        presence_penalty=0.5, frequency_penalty=0.5, min_tokens=4)
    assert out["token_ids"] == plain_llm.generate([PROMPTS[1]], sp)[0].outputs[0].token_ids
    assert out["token_ids"] != greedy_ids(plain_llm, PROMPTS[1], 16)  # the penalties did act
    assert out["metrics"]["num_draft_tokens"] > 0
    bad = cli("generate", "--model", models["target"], "--prompt", "x", "--presence-penalty", "5")
    assert bad.exit_code == 2 and "presence_penalty must be in [-2, 2]" in bad.output


def test_generate_constrains_the_output(tmp_path):
    from tiny_models import make_byte_tokenizer, make_model

    make_byte_tokenizer(tmp_path / "tok")
    target = make_model(tmp_path / "t", "llama", tokenizer_from=tmp_path / "tok", seed=3)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                  "additionalProperties": False}))
    common = ("generate", "--model", target, "--draft", target, "-k", "3", "--prompt", "x", "--temperature", "0",
              "--max-tokens", "24", "--json")
    # long enough for the controller's first plain steps (timed before it may speculate) and some drafting
    out = json_out(cli(*common, "--regex", "[ab]{3}-[0-9]{8}"))
    assert re.fullmatch("[ab]{3}-[0-9]{8}", out["text"]) and out["finish_reason"] == "stop"
    assert out["metrics"]["num_draft_tokens"] > 0  # speculation ran under the grammar
    out = json_out(cli(*common, "--choice", "yes", "--choice", "no"))
    assert out["text"] in ("yes", "no")
    # room to finish: the grammar lets whitespace run on, and this greedy output ends after 34 tokens
    out = json_out(cli(*common, "--json-schema", schema, "--max-tokens", "200"))
    assert out["finish_reason"] == "stop", out["text"]
    value = json.loads(out["text"])
    assert set(value) == {"a"} and isinstance(value["a"], int)
    bad = cli(*common, "--regex", "a", "--choice", "b")
    assert bad.exit_code == 2 and "exactly one of" in bad.output


def test_generate_n_choices_and_logprobs(models, plain_llm):
    out = json_out(cli("generate", "--model", models["target"], "--draft", models["other"], "--prompt", PROMPTS[0],
                       "--temperature", "0.9", "--seed", "5", "-n", "3", "--logprobs", "2", "--max-tokens", "8",
                       "--ignore-eos", "--json"))
    assert len(out["choices"]) == 3 and out["token_ids"] == out["choices"][0]["token_ids"]
    from specdec.cli_common import build_speculative_config

    spec_llm = LLM(models["target"], speculative_config=build_speculative_config(models["other"], None, None, None))
    for i, c in enumerate(out["choices"]):  # choice i is the request with seed 5 + i
        ref = spec_llm.generate([PROMPTS[0]], SamplingParams(temperature=0.9, seed=5 + i, max_tokens=8,
                                                                 ignore_eos=True, logprobs=2))[0].outputs[0]
        assert c["token_ids"] == ref.token_ids
        assert len(c["logprobs"]) == 8 and all(2 <= len(d) <= 3 for d in c["logprobs"])
        for d, t, r in zip(c["logprobs"], c["token_ids"], ref.logprobs):
            assert abs(d[str(t)]["logprob"] - r[t].logprob) < 1e-4


def test_generate_seeded_sampling_is_reproducible(models):
    args = ("generate", "--model", models["target"], "--draft", models["other"], "--prompt", PROMPTS[0],
            "--temperature", "0.9", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.01", "--seed", "7",
            "--max-tokens", "10", "--ignore-eos", "--json")
    assert json_out(cli(*args))["token_ids"] == json_out(cli(*args))["token_ids"]


def test_generate_text_and_stats_line(models, plain_llm):
    result = cli("generate", "--model", models["target"], "--draft", models["same"], "--prompt", PROMPTS[0],
                 "--temperature", "0", "--max-tokens", "12")
    assert result.exit_code == 0, result.output
    ref = plain_llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert result.stdout == ref.text + "\n"
    stats = result.stderr
    assert "12 tokens" in stats and "tokens/s" in stats and "acceptance rate 100.0%" in stats
    assert "τ (mean acceptance length: tokens per verify pass, incl. bonus)" in stats
    assert "draft" in stats and "verify" in stats


def test_generate_stop_string(models, plain_llm):
    ref = plain_llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    stop = ref.text.split()[2]  # the third word; its first occurrence ends the text
    out = json_out(cli("generate", "--model", models["target"], "--prompt", PROMPTS[0], "--temperature", "0",
                       "--max-tokens", "12", "--stop", "no-such-word", "--stop", stop, "--json"))
    assert out["finish_reason"] == "stop"
    assert out["text"] == ref.text[: ref.text.index(stop)]


# -- bench ----------------------------------------------------------------------------------------


def test_bench_json(models, prompts_file, plain_llm):
    out = json_out(cli("bench", "--model", models["target"], "--draft", models["same"], "-k", "3", "--no-adaptive",
                       "--prompts", prompts_file, "--max-tokens", "12", "--json"))
    assert {"ar", "spec", "speedup"} <= set(out)
    assert out["num_prompts"] == len(PROMPTS) and out["greedy"] is True
    ar, spec = out["ar"], out["spec"]
    assert ar["tokens"] == spec["tokens"] == 12 * len(PROMPTS)
    assert ar["tokens_per_s"] == pytest.approx(ar["tokens"] / ar["time_s"])
    assert out["speedup"] == pytest.approx(spec["tokens_per_s"] / ar["tokens_per_s"])
    for key in ("acceptance_rate", "mean_acceptance_length", "acceptance_rate_per_pos", "draft_time_s",
                "verify_time_s", "median_tokens_per_s"):
        assert key in spec
    assert spec["acceptance_rate"] == 1.0
    assert 1.0 <= spec["mean_acceptance_length"] <= 4.0
    assert len(spec["acceptance_rate_per_pos"]) == 3
    # the warm-up is excluded: the counters cover exactly the timed runs
    assert spec["metrics"]["num_emitted_tokens"] == spec["tokens"]
    assert out["greedy_match"] == {"matched": len(PROMPTS), "total": len(PROMPTS), "near_ties": 0, "mismatched": []}
    assert 0 < out["decode_speedup"] and out["prefill_time_s"]["ar"] > 0
    assert set(out["by_category"]) == {"c0", "c1"}


def test_bench_text_and_options(models, prompts_file):
    result = cli("bench", "--model", models["target"], "--draft", models["other"], "--prompts", prompts_file,
                 "--max-tokens", "8", "--num-prompts", "2", "--repeats", "2")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "2 prompts × 2" in text and "plain" in text and "speculative" in text
    assert "speedup:" in text and "acceptance rate:" in text and "incl. bonus" in text
    assert "acceptance per draft position:" in text and "draft time:" in text
    assert "greedy outputs equal to plain decoding: 2/2 prompts" in text


def test_bench_sampling_skips_the_match_check(models, prompts_file):
    out = json_out(cli("bench", "--model", models["target"], "--draft", models["other"], "--prompts",
                       prompts_file, "--max-tokens", "6", "--temperature", "0.8", "--seed", "3",
                       "--num-prompts", "1", "--json"))
    assert out["greedy"] is False and out["greedy_match"] is None


# -- prompt files ---------------------------------------------------------------------------------


def test_load_prompts_formats(tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "a b"}\n\n{"prompt": "c", "category": "code"}\n')
    assert load_prompts(plain) == [{"prompt": "a b", "category": None}, {"prompt": "c", "category": "code"}]
    spec_bench = tmp_path / "question.jsonl"
    spec_bench.write_text('{"question_id": 81, "category": "writing", "turns": ["first", "second"]}\n'
                          '{"question_id": 82, "category": "math", "turns": ["x"]}\n'
                          '{"question_id": 83, "category": "math", "turns": ["y"]}\n')
    assert load_prompts(spec_bench) == [{"prompt": "first", "category": "writing"},
                                        {"prompt": "x", "category": "math"}, {"prompt": "y", "category": "math"}]
    assert load_prompts(spec_bench, num=2) == load_prompts(spec_bench)[:2]


def test_load_prompts_real_spec_bench_file():
    path = SPEC_BENCH
    if not path.exists():
        pytest.skip("Spec-Bench question.jsonl is not on this machine")
    prompts = load_prompts(path, num=5)
    assert len(prompts) == 5 and all(p["prompt"] and p["category"] for p in prompts)


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "ok"}\n{"prompt": "ok", \n', ":2: line 2 is not valid JSON"),
    ('{"prompt": "ok"}\n\n{"text": "no prompt"}\n', ":3: line 3 has no 'prompt', 'prompt_token_ids' or Spec-Bench 'turns'"),
    ('{"prompt_token_ids": [1, "x"]}\n', "'prompt_token_ids' that is not a non-empty list"),
    ('{"turns": []}\n', "turns[0] is not a non-empty string"),
    ('{"prompt": 5}\n', "'prompt' that is not a non-empty string"),
    ('["a list"]\n', "must be a JSON object"),
    ("\n\n", "has no prompts"),
])
def test_load_prompts_errors(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match="bad.jsonl") as e:
        load_prompts(path)
    assert message in str(e.value)


def test_load_prompts_missing_file_and_bad_num(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError, match="integer >= 1"):
        load_prompts(tmp_path / "p.jsonl", num=0)


# -- bad input: "error: ..." on stderr, exit status 2, no traceback --------------------------------


BAD_GENERATE = [
    (["--model", "{tmp}/no-such-model"], "does not exist"),
    (["--draft", "{other}", "-k", "65"], "num_speculative_tokens must be an integer in 0..64, got 65"),
    (["--temperature", "-1"], "temperature must be a number >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-k", "-2"], "top_k must be an integer >= 0"),
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
    (["--speculative-config", "{not json"], "--speculative-config is not valid JSON"),
    (["--speculative-config", '["a list"]'], "--speculative-config must be a JSON object"),
    (["--speculative-config", '{"model": "{other}", "bogus": 1}'], "unknown speculative_config keys ['bogus']"),
    (["--draft", "{tmp}/no-such-draft"], "no-such-draft' does not exist"),
    (["--draft", "{other}", "--speculative-config", "{}"], "either --draft or --speculative-config"),
    (["-k", "3"], "needs a drafter"),
    (["--prompt-token-ids", "1,x"], "--prompt-token-ids must be comma-separated integers"),
    (["--prompt-token-ids", "1,100000"], "outside the vocabulary"),
    (["--dtype", "int8"], "dtype must be one of"),
    (["--device", "tpu"], "device must be 'cpu' or 'cuda[:N]'"),
]


@pytest.mark.parametrize("args, message", BAD_GENERATE, ids=[m for _, m in BAD_GENERATE])
def test_generate_bad_input_exits_2(models, tmp_path, args, message):
    args = [a.replace("{tmp}", str(tmp_path)).replace("{other}", models["other"]) for a in args]
    if "--model" not in args:
        args = ["--model", models["target"], *args]
    if not any(a.startswith("--prompt") for a in args):
        args += ["--prompt", "w1"]
    result = cli("generate", *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert "Traceback" not in result.output and result.stdout == ""


def test_generate_needs_exactly_one_prompt(models):
    for extra in ([], ["--prompt", "w1", "--prompt-token-ids", "4"]):
        result = cli("generate", "--model", models["target"], *extra)
        assert result.exit_code == 2 and "exactly one of --prompt" in result.stderr


def test_serve_bad_threads_exits_2(models):
    result = cli("serve", "--model", models["target"], "--threads", "0")
    assert result.exit_code == 2 and "--threads must be >= 1, got 0" in result.stderr, result.output


def test_serve_bad_engine_iteration_timeout_exits_2(models):
    result = cli("serve", "--model", models["target"], "--engine-iteration-timeout", "0")
    assert result.exit_code == 2 and "engine_iteration_timeout must be a number of seconds > 0, got 0" in \
        result.stderr, result.output


@pytest.mark.parametrize("case", ["no drafter", "missing file", "bad line", "repeats 0"])
def test_bench_bad_input_exits_2(models, tmp_path, prompts_file, case):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "w1"}\n{oops}\n')
    args = {"no drafter": ["--prompts", prompts_file],
            "missing file": ["--draft", models["other"], "--prompts", tmp_path / "none.jsonl"],
            "bad line": ["--draft", models["other"], "--prompts", bad],
            "repeats 0": ["--draft", models["other"], "--prompts", prompts_file, "--repeats", "0"]}[case]
    message = {"no drafter": "pass --draft D or --speculative-config", "missing file": "does not exist",
               "bad line": "bad.jsonl:2: line 2 is not valid JSON", "repeats 0": "repeats must be"}[case]
    result = cli("bench", "--model", models["target"], *args, "--max-tokens", "4")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert "Traceback" not in result.output


# -- demo -----------------------------------------------------------------------------------------


def test_demo_without_the_shipped_pair_exits_1(monkeypatch, tmp_path):
    from specdec.models.resolve import SHIPPED

    monkeypatch.setitem(SHIPPED, "specdec/demo-target", tmp_path / "demo-target")
    monkeypatch.setitem(SHIPPED, "specdec/demo-draft", tmp_path / "demo-draft")
    result = cli("demo")
    assert result.exit_code == 1
    assert "shipped demo pair is not installed" in result.stderr and "Traceback" not in result.output


def test_demo_with_a_pair_installed(monkeypatch, models):
    from specdec.models.resolve import SHIPPED

    monkeypatch.setitem(SHIPPED, "specdec/demo-target", Path(models["target"]))
    monkeypatch.setitem(SHIPPED, "specdec/demo-draft", Path(models["same"]))
    # the method forced: the demo otherwise runs whichever candidate it measures fastest (test_demo_choice.py)
    out = json_out(cli("demo", "--max-tokens", "8", "--method", "draft_model", "--json"))
    assert {"ar_tokens_per_s", "spec_tokens_per_s", "speedup", "acceptance_rate", "mean_acceptance_length"} <= set(out)
    assert out["speedup"] == pytest.approx(out["spec_tokens_per_s"] / out["ar_tokens_per_s"])
    # the draft is the target itself: whatever it drafts is accepted, though adaptive speculation
    # may stop drafting altogether since such a draft costs as much as the target
    assert out["acceptance_rate"] in (0.0, 1.0) and len(out["completions"]) == 3
    assert out["greedy_match"]["matched"] == 3
    text = cli("demo", "--max-tokens", "8", "--method", "draft_model")
    assert text.exit_code == 0, text.output
    assert "def fibonacci(n):" in text.stdout and "speedup:" in text.stdout and "incl. bonus" in text.stdout


# -- the installed console script, end to end ------------------------------------------------------


def test_console_script_end_to_end(models, plain_llm):
    exe = shutil.which("specdec", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the specdec console script is not installed in this environment")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([exe, "generate", "--model", models["target"], "--draft", models["same"],
                           "--prompt", PROMPTS[2], "--temperature", "0", "--max-tokens", "10", "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token_ids"] == greedy_ids(plain_llm, PROMPTS[2], 10)
    bad = subprocess.run([exe, "generate", "--model", models["target"], "--prompt", "w1", "--top-p", "0"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: top_p") and "Traceback" not in bad.stderr


# -- EAGLE-3 heads and the flags around them ----------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--method", "eagle3"], "method eagle3 needs the EAGLE-3 head: pass --draft HEAD (or --speculative-model HEAD)"),
    (["--method", "suffix,eagle3"], "method eagle3 needs the EAGLE-3 head"),
    (["--method", "draft_model"], "method draft_model needs the draft model: pass --draft D"),
    (["--speculative-config", '{"method": "eagle3"}'], "method eagle3 needs the EAGLE-3 head"),
    (["--enable-suffix-decoding"], "--enable-suffix-decoding puts suffix decoding in front of a model drafter"),
    (["--draft", "{other}", "--speculative-model", "{other}"], None),  # one option, two names: the last wins
])
def test_eagle3_flags_bad_input(models, args, message):
    args = [a.replace("{other}", models["other"]) for a in args]
    result = cli("generate", "--model", models["target"], "--prompt", "w1", "--max-tokens", "2", *args)
    if message is None:
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert "Traceback" not in result.output


def test_build_speculative_config_eagle3_spellings():
    from specdec.cli_common import build_speculative_config

    cfg = {"method": "eagle3", "model": "H", "num_speculative_tokens": 5}
    assert build_speculative_config("H", 5, None, method="eagle3") == cfg
    assert build_speculative_config(None, None, json.dumps(cfg)) == cfg
    assert build_speculative_config(None, 5, '{"model": "H"}', method="eagle3") == cfg
    assert build_speculative_config("H", None, None, method="suffix,eagle3") == {
        "method": ["suffix", "eagle3"], "model": "H", "num_speculative_tokens": 4}
    assert build_speculative_config("H", 5, None, method="eagle3", suffix_in_front=True) == {
        **cfg, "enable_suffix_decoding": True}
    no_drafts = {"method": "eagle3", "num_speculative_tokens": 0}  # k = 0: no head needed
    assert build_speculative_config(None, 0, json.dumps({"method": "eagle3"})) == no_drafts


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory) -> dict[str, str]:
    """A 4-layer tiny target and an untrained EAGLE-3 head for it (random weights: few drafts accepted),
    plus a head made for another target."""
    import torch
    from transformers import AutoConfig

    from specdec.models.eagle3 import Eagle3Config, Eagle3Head, save_head

    root = tmp_path_factory.mktemp("cli_eagle3")
    target = make_model(root / "target", "llama", seed=0, layers=4)
    torch.manual_seed(0)
    head = save_head(Eagle3Head(Eagle3Config.for_target(AutoConfig.from_pretrained(target))), root / "head")
    other = make_model(root / "other", "llama", seed=1, layers=4, hidden=32)
    wrong = save_head(Eagle3Head(Eagle3Config.for_target(AutoConfig.from_pretrained(other))), root / "wrong")
    return {"target": str(target), "head": str(head), "wrong": str(wrong)}


@pytest.mark.parametrize("flags", [
    ["--method", "eagle3", "--draft", "{head}"],
    ["--method", "eagle3", "--speculative-model", "{head}"],
    ["--speculative-config", '{"method": "eagle3", "model": "{head}"}'],
    ["--method", "suffix,eagle3", "--draft", "{head}"],
    ["--method", "eagle3", "--draft", "{head}", "--enable-suffix-decoding"],
])
def test_generate_eagle3_greedy_equals_plain(eagle3, flags):
    flags = [f.replace("{head}", eagle3["head"]) for f in flags]
    out = json_out(cli("generate", "--model", eagle3["target"], *flags, "-k", "3", "--no-adaptive",
                       "--prompt", PROMPTS[1], "--temperature", "0", "--max-tokens", "12", "--json"))
    assert out["token_ids"] == greedy_ids(LLM(eagle3["target"]), PROMPTS[1], 12)
    m = out["metrics"]
    assert m["num_draft_tokens"] > 0
    if flags[1] == "eagle3" or flags[0] == "--speculative-config":
        assert m["num_draft_tokens_per_method"].get("eagle3", 0) > 0


def test_bench_eagle3(eagle3, prompts_file):
    out = json_out(cli("bench", "--model", eagle3["target"], "--method", "eagle3", "--draft", eagle3["head"],
                       "-k", "2", "--prompts", prompts_file, "--max-tokens", "6", "--json"))
    assert out["greedy_match"]["matched"] == len(PROMPTS) and out["num_speculative_tokens"] == 2


@pytest.mark.parametrize("case, message", [
    ("wrong target", "hidden"),
    ("no weights", "model.safetensors"),
    ("no config", "config.json"),
])
def test_generate_eagle3_bad_head_exits_2(eagle3, tmp_path, case, message):
    head = {"wrong target": eagle3["wrong"], "no weights": tmp_path / "h1", "no config": tmp_path / "h2"}[case]
    if case == "no weights":
        shutil.copytree(eagle3["head"], head)
        (Path(head) / "model.safetensors").unlink()
    elif case == "no config":
        shutil.copytree(eagle3["head"], head)
        (Path(head) / "config.json").unlink()
    result = cli("generate", "--model", eagle3["target"], "--method", "eagle3", "--draft", head,
                 "--prompt", "w1", "--max-tokens", "2")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert "Traceback" not in result.output


def test_server_with_an_eagle3_config(eagle3):
    """What `specdec serve --speculative-config '{"method": "eagle3", ...}'` builds, served on a thread."""
    import httpx

    from specdec.server import ServerThread, build_app

    spec = {"method": "eagle3", "model": eagle3["head"], "num_speculative_tokens": 3, "adaptive": False}
    with ServerThread(build_app(model=eagle3["target"], speculative_config=spec)) as server:
        body = {"model": eagle3["target"], "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
    plain = LLM(eagle3["target"]).generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8))[0]
    assert text == plain.outputs[0].text


@pytest.mark.skipif(not __import__("importlib").util.find_spec("llama_cpp"), reason="llama-cpp-python not installed")
def test_generate_eagle3_on_llamacpp_greedy_equals_plain(eagle3):
    out = json_out(cli("generate", "--model", eagle3["target"], "--backend", "llama.cpp", "--method", "eagle3",
                       "--draft", eagle3["head"], "-k", "3", "--no-adaptive", "--prompt", PROMPTS[1],
                       "--temperature", "0", "--max-tokens", "12", "--json"))
    plain = LLM(eagle3["target"], backend="llama.cpp")
    assert out["token_ids"] == greedy_ids(plain, PROMPTS[1], 12)
    assert out["metrics"]["num_draft_tokens_per_method"].get("eagle3", 0) > 0
