"""backend="auto" on a CPU: an HF checkpoint runs on the backend measured faster here, for plain decoding
and for the draft length asked for; the verdict is cached; SPECDEC_AUTO_BACKEND fixes it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.bench import compute_paths  # noqa: E402
from specdec.models import backend_choice  # noqa: E402
from specdec.models.backend_choice import ENV, auto_backend  # noqa: E402
from specdec.models.resolve import resolve  # noqa: E402
from tiny_models import make_model  # noqa: E402


@pytest.fixture()
def measured(tmp_path, monkeypatch):
    """A tiny checkpoint, with auto free to measure and every cache in tmp_path."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return str(make_model(tmp_path / "m", "llama"))


def test_auto_times_both_backends_once_and_keeps_the_verdict(measured, monkeypatch, capfd):
    verdict = auto_backend(resolve(measured), "float32", 4)
    assert "timing m on llama.cpp and torch for backend=auto (k=4), once" in capfd.readouterr().err
    assert verdict.backend in ("torch", "llama.cpp") and verdict.reason.startswith("faster here: t(1) + t(5)")
    assert set(verdict.ms) == {"torch", "llama.cpp"} and all(len(t) == 2 and min(t) > 0 for t in verdict.ms.values())
    cost = {b: sum(t) for b, t in verdict.ms.items()}
    assert cost[verdict.backend] <= min(cost.values())
    cached = json.loads(backend_choice.cache_path().read_text())
    assert list(cached.values()) == [verdict.ms]

    def no_timing(*args):
        raise AssertionError("timed again: the verdict should come from the cache")

    monkeypatch.setattr(backend_choice, "time_backends", no_timing)
    assert auto_backend(resolve(measured), "float32", 4) == verdict
    llm = LLM(measured, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert (llm.backend, llm.backend_reason) == (verdict.backend, f"auto: {verdict.reason}")
    key = next(iter(cached))
    backend_choice.cache_path().write_text(json.dumps({key: {"torch": "fast"}}))  # a damaged entry is timed anew
    monkeypatch.setattr(backend_choice, "time_backends", fake_timings)
    assert auto_backend(resolve(measured), "float32", 4).ms == fake_timings(measured, "float32", 4)


def fake_timings(path, dtype, k):
    """llama.cpp's one-token step is the cheaper, torch's verify pass of k+1 tokens much flatter."""
    return {"llama.cpp": [1.0, 1.0 + 0.5 * k], "torch": [1.5, 1.5 + 0.05 * k]}


def test_auto_picks_per_draft_length_and_runs_losslessly_on_its_pick(measured, monkeypatch):
    monkeypatch.setattr(backend_choice, "time_backends", fake_timings)
    plain = LLM(measured, dtype="float32")
    assert plain.backend == "llama.cpp" and "t(1) llama.cpp 1.00 ms, torch 1.50 ms" in plain.backend_reason
    spec = LLM(measured, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    assert spec.backend == "torch" and "t(1) + t(9) llama.cpp 6.00 ms, torch 3.40 ms" in spec.backend_reason
    short = LLM(measured, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 1})
    assert short.backend == "llama.cpp"
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    torch_plain = LLM(measured, dtype="float32", backend="torch").generate("w1 w2 w1 w2", sp)[0].outputs[0].token_ids
    assert spec.generate("w1 w2 w1 w2", sp)[0].outputs[0].token_ids == torch_plain
    paths = compute_paths(plain)  # describes a llama.cpp target too
    assert paths["backend"].startswith("llama.cpp (auto: faster here") and "llama.cpp" in paths["target"]


def test_a_large_checkpoint_goes_to_llamacpp_untimed(measured, monkeypatch):
    monkeypatch.setattr(backend_choice, "MAX_TIMED_BYTES", 0)
    monkeypatch.setattr(backend_choice, "time_backends", lambda *a: pytest.fail("timed a large checkpoint"))
    verdict = auto_backend(resolve(measured), "auto", 0)
    assert verdict.backend == "llama.cpp" and "bound by memory" in verdict.reason and verdict.ms == {}


def test_the_environment_fixes_the_choice_and_a_bad_value_says_what_is_allowed(measured, monkeypatch):
    monkeypatch.setattr(backend_choice, "time_backends", lambda *a: pytest.fail("timed a fixed choice"))
    for fixed in ("torch", "llama.cpp"):
        monkeypatch.setenv(ENV, fixed)
        assert LLM(measured).backend == fixed
    monkeypatch.setenv(ENV, "cuda")
    with pytest.raises(ValueError, match="must be 'torch' or 'llama.cpp', got 'cuda'"):
        LLM(measured)
    assert LLM(measured, backend="torch").backend_reason == "asked for"  # asking overrides the environment
