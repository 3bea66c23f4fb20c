"""backend="auto" on a CPU: an HF checkpoint runs on the backend whose timed forwards (and draft step)
give the most expected tokens/s through the cost model, for the method, k and acceptance asked for;
the timings are cached per machine, checkpoint, dtype, torch path, method and k; a checkpoint too
large to hold twice is timed on its first layers; SPECDEC_AUTO_BACKEND fixes the choice."""

from __future__ import annotations

import json
import os

import pytest

# a required dependency (built by `make install`): a missing or broken build fails here, not as skips
import llama_cpp  # noqa: E402, F401

import torch  # noqa: E402

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.bench import compute_paths  # noqa: E402
from specdec.cost_model import expected_tokens, predicted_speedups  # noqa: E402
from specdec.models import backend_choice, timings  # noqa: E402
from specdec.models.backend_choice import ENV, auto_backend, decide  # noqa: E402
from specdec.models.base import ForwardBatch  # noqa: E402
from specdec.models.load import load  # noqa: E402
from specdec.models.resolve import resolve  # noqa: E402
from tiny_models import make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture()
def measured(tmp_path, monkeypatch):
    """A tiny checkpoint, with auto free to measure and every cache in tmp_path."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(backend_choice, "REPEATS", 2)  # noisy figures are fine: no test asserts a verdict on them
    return str(make_model(tmp_path / "m", "llama"))


def entry(llama, torch_, draft=None):
    """A cache entry: per backend the target's ms at lengths_for(k), then the draft step if any."""
    return {"llama.cpp": llama + ([draft[0]] if draft else []), "torch": torch_ + ([draft[1]] if draft else []),
            "how": "timed", "torch_path": "test"}


# llama.cpp: a fast step and a steep verify curve; torch: a slow step and a flat one (issue 28's shape)
STEEP, FLAT = [4.0, 6.1, 12.0], [9.0, 9.2, 9.8]  # t(1), t(2), t(9) in ms


def test_plain_decoding_compares_the_one_token_step():
    verdict = decide(entry([4.0], [9.4]), 0, None, [], "none")
    assert verdict.backend == "llama.cpp"
    assert verdict.reason.startswith("faster here: t(1) llama.cpp 4.00 ms (250.0 tok/s), torch 9.40 ms (106.4 tok/s)")


def test_the_choice_weighs_the_whole_round_by_the_cost_model():
    """High acceptance pays torch's flat verify pass; low acceptance does not, and the round drafts less."""
    high = decide(entry(STEEP, FLAT), 8, "suffix", [0.9] * 8, "α 0.90 (test)")
    low = decide(entry(STEEP, FLAT), 8, "suffix", [0.3] * 8, "α 0.30 (test)")
    assert high.backend == "torch" and low.backend == "llama.cpp"
    for verdict, alphas in ((high, [0.9] * 8), (low, [0.3] * 8)):
        for b, ms in (("llama.cpp", STEEP), ("torch", FLAT)):  # each figure is cost_model's S(k) * 1000 / t(1)
            e = verdict.estimates[b]
            t = dict(zip((1, 2, 9), ms))
            verify = [backend_choice.interpolate(t, kk + 1) / ms[0] for kk in range(9)]
            speedups = predicted_speedups(alphas, 0.0, verify)  # a lookup: no draft step
            assert e.tokens_per_s == pytest.approx(max(speedups) * 1e3 / ms[0])
            assert e.tau == pytest.approx(expected_tokens(alphas, e.k))
    assert high.reason.startswith("expected fastest here for suffix k<=8 with acceptance α 0.90 (test): llama.cpp ")
    torch_speed = high.estimates["torch"].tokens_per_s
    assert f"torch {torch_speed:.1f} tok/s (t(1) 9.00, t(2) 9.20, t(9) 9.80 ms; k=" in high.reason
    # the steep curve: at low acceptance llama.cpp decodes plainly while torch's flat pass still drafts
    assert low.estimates["llama.cpp"].k == 0 < low.estimates["torch"].k
    assert "llama.cpp 250.0 tok/s (t(1) 4.00, t(2) 6.10, t(9) 12.00 ms; plain decoding pays best)" in low.reason
    assert backend_choice.interpolate({1: 4.0, 2: 6.0, 9: 13.0}, 5) == pytest.approx(9.0)


def test_a_slow_draft_step_can_turn_the_choice():
    """draft_model: the draft's step is part of the round; timed per backend."""
    alphas = [0.9] * 8
    cheap = decide(entry(STEEP, FLAT, draft=(0.4, 0.4)), 8, "draft_model", alphas, "test")
    dear = decide(entry(STEEP, FLAT, draft=(0.4, 6.0)), 8, "draft_model", alphas, "test")
    assert cheap.backend == "torch" and dear.backend == "llama.cpp"
    assert "draft step 6.00 ms (timed)" in dear.reason
    untimed = decide(entry(STEEP, FLAT), 8, "eagle3", alphas, "test")  # no draft step timed: the prior ratio
    assert untimed.estimates["torch"].draft_how == "prior"
    assert untimed.estimates["torch"].draft_ms == pytest.approx(backend_choice.PRIOR_DRAFT_COST * 9.0)


def test_auto_times_both_backends_once_and_keeps_the_timings(measured, monkeypatch, capfd):
    verdict = auto_backend(resolve(measured), "float32", 4, "ngram")
    assert "timing m on llama.cpp and torch for backend=auto (ngram, k=4), once" in capfd.readouterr().err
    assert verdict.backend == max(verdict.estimates, key=lambda b: verdict.estimates[b].tokens_per_s)
    assert "acceptance α 0.60 per position (prior for ngram; none measured for this model yet)" in verdict.reason
    assert all(set(e.ms) == {1, 2, 5} and min(e.ms.values()) > 0 for e in verdict.estimates.values())
    cached = json.loads(backend_choice.cache_path().read_text())
    (key, value), = cached.items()
    path = backend_choice.torch_path()  # the suite's own: eager or compiled, as the environment says
    assert f" float32 (float32,float32) torch-path {path} k 4 method ngram draft - " in key + " "
    assert value["torch"] == [verdict.estimates["torch"].ms[T] for T in (1, 2, 5)]
    assert "float32 weights" in value["torch_path"] and "torch path: " in verdict.reason

    def no_timing(*args):
        raise AssertionError("timed again: the timings should come from the cache")

    monkeypatch.setattr(backend_choice, "time_backends", no_timing)
    assert auto_backend(resolve(measured), "float32", 4, "ngram") == verdict
    llm = LLM(measured, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert (llm.backend, llm.backend_reason) == (verdict.backend, f"auto: {verdict.reason}")
    # anything that changes the timings is another entry: the torch path, the method, k
    monkeypatch.setattr(backend_choice, "time_backends", lambda s, d, k, draft=None, eager=None: {
        "llama.cpp": [1.0] * len(backend_choice.lengths_for(k)), "torch": [2.0] * len(backend_choice.lengths_for(k)),
        "how": "timed", "torch_path": "fake"})
    other = {"eager": False, "compiled": True}[path]
    assert "torch path: fake" in auto_backend(resolve(measured), "float32", 4, "ngram", enforce_eager=other).reason
    auto_backend(resolve(measured), "float32", 4, "suffix")
    auto_backend(resolve(measured), "float32", 3, "ngram")
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")  # make test-restricted runs with AVX2 already
    other_isa = "SSE41" if isa == "AVX2" else "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", other_isa)  # other kernels: other timings
    auto_backend(resolve(measured), "float32", 4, "ngram")
    if isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    keys = list(json.loads(backend_choice.cache_path().read_text()))
    assert len(keys) == 5 and {"torch-path eager", "torch-path compiled"} <= {" ".join(k.split()[-8:-6]) for k in keys}
    assert any(f"ONEDNN_MAX_CPU_ISA={other_isa}" in key for key in keys)
    backend_choice.cache_path().write_text(json.dumps({key: {"torch": "fast"}}))  # a damaged entry is timed anew
    assert "torch path: fake" in auto_backend(resolve(measured), "float32", 4, "ngram").reason


def test_a_draft_model_is_timed_beside_the_target(measured, tmp_path):
    draft = resolve(str(make_model(tmp_path / "d", "llama", seed=1, layers=1)))
    verdict = auto_backend(resolve(measured), "float32", 2, "draft_model", draft)
    assert all(e.draft_how == "timed" and e.draft_ms > 0 for e in verdict.estimates.values())
    assert "draft step" in verdict.reason and "(timed)" in verdict.reason
    (key,) = json.loads(backend_choice.cache_path().read_text())
    assert "method draft_model" in key and "draft -" not in key


def test_the_torch_target_is_timed_with_the_sizes_it_runs(measured, monkeypatch):
    """k = 15: the target is timed at 16 tokens, which LLM's target compiles (longest_verify); the probe's
    torch target has those sizes too, so its verify pass is not timed on a path the real run never takes."""
    seen = {}
    real = backend_choice.time_runners

    def spy(runners, lengths, context):
        seen.update({key: r.compile_sizes for key, r in runners.items() if hasattr(r, "compile_sizes")})
        return real(runners, lengths, context)

    monkeypatch.setattr(backend_choice, "time_runners", spy)
    auto_backend(resolve(measured), "float32", 15, "suffix", None)
    target = LLM(measured, backend="torch", speculative_config={"method": "suffix", "num_speculative_tokens": 15}).target
    assert seen[("torch", "target")] == target.compile_sizes and target.compile_sizes[-1] >= 16


def test_measured_acceptance_replaces_the_prior(measured, monkeypatch):
    """What `specdec demo` measured for this target and method is the acceptance auto weighs."""
    source = resolve(measured)
    monkeypatch.setattr(backend_choice, "time_backends", lambda s, d, k, draft=None, eager=None: entry(STEEP, FLAT))
    prior = auto_backend(source, "float32", 8, "suffix")
    assert prior.backend == "llama.cpp" and "prior for suffix" in prior.reason  # α 0.6: torch's step too dear
    # τ measured at 6 drafts a round: the α whose E(6) it is
    alpha = backend_choice.alpha_from_tau(expected_tokens([0.95] * 6, 6), 6.2)
    assert alpha == pytest.approx(0.95, abs=1e-6)
    assert backend_choice.alpha_from_tau(1.0, 3) == pytest.approx(0.0, abs=1e-6)
    assert backend_choice.alpha_from_tau(9.0, 3) == pytest.approx(1.0, abs=1e-6)  # clipped to k + 1
    backend_choice.record_acceptance(source, "suffix", None, [alpha], 100, "a test")
    after = auto_backend(source, "float32", 8, "suffix")
    assert after.backend == "torch"
    assert "α 0.95 / 0.95 / 0.95 / 0.95 ... (measured: a test, 100 rounds)" in after.reason
    assert auto_backend(source, "float32", 8, "ngram").backend == "llama.cpp"  # per method


def test_a_large_checkpoint_is_timed_on_its_first_layers(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(backend_choice, "MEMORY_SHARE", 0.0)  # too large to hold twice, whatever its size
    monkeypatch.setattr(backend_choice, "REPEATS", 2)
    source = resolve(str(make_model(tmp_path / "six", "llama", layers=6)))
    verdict = auto_backend(source, "float32", 4, "suffix")
    assert "timed on its first 1 and 3 layers and extrapolated to 6 (the checkpoint, 0.0 GiB, is over 0.00 of the" \
        in verdict.reason
    assert all(min(e.ms.values()) > 0 for e in verdict.estimates.values())
    assert list((timings.cache_dir() / "gguf").glob("specdec-probe-*")) == []  # the copies' conversions are gone


def test_the_first_layers_copy_computes_what_the_first_layers_compute(tmp_path):
    """The copy a large checkpoint is timed on is its first layers, the head kept: its logits are the
    full model's run through those layers only (the runner's num_layers)."""
    source = resolve(str(make_model(tmp_path / "six", "llama", layers=6, tie=True)))
    copy = backend_choice.first_layers(source, 3, tmp_path / "cut")
    assert copy.config["num_hidden_layers"] == 3
    full, _ = load(source, "torch", "float32")
    cut, _ = load(copy, "torch", "float32")
    tokens = [[5, 9, 3, 7]]
    full.sync_rows(["a"])
    cut.sync_rows(["a"])
    want = full.forward(ForwardBatch.from_rows(tokens, [0], logits=4, num_layers=3))
    got = cut.forward(ForwardBatch.from_rows(tokens, [0], logits=4))
    torch.testing.assert_close(got, want)


def test_auto_runs_losslessly_on_its_pick(measured, monkeypatch):
    monkeypatch.setattr(backend_choice, "time_backends",
                        lambda s, d, k, draft=None, eager=None: entry(STEEP if k else [4.0], FLAT if k else [9.4]))
    plain = LLM(measured, dtype="float32")
    assert plain.backend == "llama.cpp" and "t(1) llama.cpp 4.00 ms" in plain.backend_reason
    backend_choice.record_acceptance(resolve(measured), "ngram", None, [0.9], 50, "a test")
    spec = LLM(measured, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    assert spec.backend == "torch" and "expected fastest here for ngram k<=8" in spec.backend_reason
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    torch_plain = LLM(measured, dtype="float32", backend="torch").generate("w1 w2 w1 w2", sp)[0].outputs[0].token_ids
    assert spec.generate("w1 w2 w1 w2", sp)[0].outputs[0].token_ids == torch_plain
    paths = compute_paths(plain)  # describes a llama.cpp target too
    assert paths["backend"].startswith("llama.cpp (auto: faster here") and "llama.cpp" in paths["target"]


def test_the_environment_fixes_the_choice_and_a_bad_value_says_what_is_allowed(measured, monkeypatch):
    monkeypatch.setattr(backend_choice, "time_backends", lambda *a: pytest.fail("timed a fixed choice"))
    for fixed in ("torch", "llama.cpp"):
        monkeypatch.setenv(ENV, fixed)
        assert LLM(measured).backend == fixed
    monkeypatch.setenv(ENV, "cuda")
    with pytest.raises(ValueError, match="must be 'torch' or 'llama.cpp', got 'cuda'"):
        LLM(measured)
    assert LLM(measured, backend="torch").backend_reason == "asked for"  # asking overrides the environment
