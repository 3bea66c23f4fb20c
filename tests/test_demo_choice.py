"""``specdec demo``'s choice: the fastest plain backend and the best speculative configuration, picked by
measurement, and the line that says why.

The decision is tested on injected figures (``Measured`` records, or a fake clock that charges each
configuration a set time per token), never on wall time: which configuration is faster on this
machine is what the demo measures, not what a test may assume.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec.config import SpeculativeConfig

os.environ["HF_HUB_OFFLINE"] = "1"

import specdec.demo as demo  # noqa: E402
from specdec.cli import app  # noqa: E402
from specdec.demo import Candidate, Measured, candidates, choose, explain, measure  # noqa: E402
from tiny_models import make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
runner = CliRunner()


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """The demo keeps the acceptance it measures (acceptance.json): in the test's own cache folder."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))


def m(backend, method=None, k=0, tps=100.0, tau=1.0, mean_k=0.0, step_ms=None, verify_steps=None, error=None):
    c = Candidate(backend, method, k, "model" if method in ("draft_model", "eagle3") else None)
    return Measured(c, tokens=int(tps * 10) if error is None else 0, time_s=10.0 if error is None else 0.0,
                    tau=tau, mean_k=mean_k, step_ms=step_ms, verify_steps=verify_steps, error=error)


# -- the decision, on injected figures ------------------------------------------------------------


def test_choose_the_fastest_plain_and_the_best_speculative_across_backends():
    measured = [
        m("llama.cpp", tps=465, step_ms=2.1),
        m("torch", tps=200, step_ms=4.8),
        m("llama.cpp", "draft_model", 6, tps=440, tau=2.6, mean_k=2.0, verify_steps=1.54),
        m("llama.cpp", "suffix", 16, tps=447, tau=1.8, mean_k=3.0, verify_steps=1.9),
        m("torch", "eagle3", 6, tps=650, tau=4.4, mean_k=5.0, verify_steps=1.1),
        m("torch", "suffix", 16, tps=389, tau=2.9, mean_k=8.0, verify_steps=1.2),
        m("llama.cpp", "eagle3", 6, error="the llama.cpp backend cannot give the head its features"),
    ]
    choice = choose(measured)
    assert choice.plain.candidate == Candidate("llama.cpp")
    assert choice.spec.candidate.name == "torch + eagle3 k=6"
    assert choice.speedup == pytest.approx(650 / 465)  # against plain on the FASTEST backend, not on torch
    assert choice.plain_on("torch").tokens_per_s == 200
    # the forward's costs timed per backend (forward_costs) ...
    why = explain(choice, {"llama.cpp": (2.1, 3.99), "torch": (4.8, 5.28)})
    assert why.startswith("llama.cpp: step 2.10 ms, a verify pass of 5 tokens costs 1.90 steps, best suffix at "
                          "447.0 tok/s, held back by acceptance (τ 1.80 of the 4.0 tokens a round could emit); "
                          "torch: step 4.80 ms, a verify pass of 5 tokens costs 1.10 steps, best eagle3 at 650.0 "
                          "tok/s, held back by its step (2.29x llama.cpp's); ")
    assert "eagle3 gets 4.40 tokens per verify pass (drafting 5.0 a round)" in why
    assert why.endswith("torch + eagle3 k=6 is 1.40x plain llama.cpp (the fastest plain backend)")
    # ... or, without them, the adaptive controller's verify line at the k each backend's best drafted
    why = explain(choice)
    assert "llama.cpp: 2.10 ms per token plain, a verify pass of 4 tokens costs 1.90 steps" in why  # suffix, 3/round
    assert "torch: 4.80 ms per token plain, a verify pass of 6 tokens costs 1.10 steps" in why


def test_limits_name_what_holds_each_backend_back():
    """The largest of three losses against an ideal round: the step against the fastest backend's, the
    verify pass in steps, the tokens a round could emit over τ."""
    costs = {"llama.cpp": (2.0, 4.6), "torch": (5.0, 5.5)}
    steep = choose([m("llama.cpp", tps=400), m("torch", tps=180),
                    m("llama.cpp", "suffix", 16, tps=420, tau=3.0, mean_k=3.0),  # 4 tokens cost 2.3 steps (costs)
                    m("torch", "suffix", 16, tps=390, tau=3.0, mean_k=3.0, verify_steps=1.05)])
    held = demo.limits(steep, costs)
    assert held["llama.cpp"] == ("verify", pytest.approx(2.3)) and held["torch"] == ("step", pytest.approx(2.5))
    assert "llama.cpp: step 2.00 ms, a verify pass of 5 tokens costs 2.30 steps, best suffix at 420.0 tok/s, held " \
        "back by its verify curve (5 tokens cost 2.30 steps)" in explain(steep, costs)
    poor = choose([m("torch", tps=180, step_ms=5.0), m("torch", "eagle3", 6, tps=200, tau=1.5, mean_k=5.0,
                                                         verify_steps=1.2)])
    assert demo.limits(poor) == {"torch": ("acceptance", pytest.approx(4.0))}
    assert "held back by acceptance (τ 1.50 of the 6.0 tokens a round could emit)" in explain(poor)
    gated = choose([m("llama.cpp", tps=400), m("llama.cpp", "draft_model", 6, tps=390, tau=1.0, mean_k=0.0)])
    assert demo.limits(gated, {"llama.cpp": (2.0, 4.6)}) == {"llama.cpp": ("verify", pytest.approx(2.3))}
    assert "held back by its verify curve (5 tokens cost 2.30 steps: the controller drafted nothing)" in explain(
        gated, {"llama.cpp": (2.0, 4.6)})
    plain_only = choose([m("llama.cpp", tps=400, step_ms=2.5), m("torch", tps=200, step_ms=5.0)])
    assert demo.limits(plain_only) == {"llama.cpp": ("step", 1.0), "torch": ("step", 2.0)}
    assert "llama.cpp: 2.50 ms per token plain, the fastest step here; torch: 5.00 ms per token plain, held back " \
        "by its step (2.00x llama.cpp's)" in explain(plain_only)


def test_explain_flags_figures_the_noise_made():
    choice = choose([m("torch", tps=100), m("torch", "eagle3", 6, tps=250, tau=1.0, mean_k=1)])
    assert explain(choice).endswith("torch + eagle3 k=6 is 2.50x plain torch (the fastest plain backend) (noisy: "
                                    "torch + eagle3 k=6 measured faster over plain on the same backend than τ allows; "
                                    "another job shared the CPU: run it again when the machine is quiet)")


def test_choose_says_when_nothing_beats_plain():
    choice = choose([m("llama.cpp", tps=465, step_ms=2.1), m("llama.cpp", "suffix", 16, tps=440, tau=1.5, mean_k=1)])
    assert choice.spec.candidate.method == "suffix" and choice.speedup < 1
    assert "no speculative configuration beats plain llama.cpp here" in explain(choice)


def test_choose_keeps_the_first_of_equals_and_needs_a_plain_run():
    a, b = m("torch", "suffix", 16, tps=300), m("torch", "draft_model", 6, tps=300)
    assert choose([m("torch", tps=100), a, b]).spec is a
    assert choose([m("torch", tps=100)]).spec is None
    with pytest.raises(ValueError, match="plain decoding ran on no backend .*llama.cpp plain: not installed"):
        choose([m("llama.cpp", error="not installed"), a])


def test_candidates_default_set_and_forced_ones():
    names = [c.name for c in candidates(["llama.cpp", "torch"], "D", None)]
    assert names == ["llama.cpp plain", "torch plain", "llama.cpp + draft_model k=6", "llama.cpp + suffix k=16",
                     "llama.cpp + suffix,draft_model k=6", "torch + draft_model k=6", "torch + suffix k=16",
                     "torch + suffix,draft_model k=6"]
    with_head = candidates(["torch"], "D", "H")
    assert [c.name for c in with_head] == ["torch plain", "torch + draft_model k=6", "torch + suffix k=16",
                                           "torch + eagle3 k=6", "torch + suffix,eagle3 k=6"]
    assert with_head[3].speculative_config() == {"method": "eagle3", "num_speculative_tokens": 6, "model": "H"}
    # suffix decoding drafts from each request's own text: the demo repeats its prompts
    assert with_head[4].speculative_config() == {"method": ["suffix", "eagle3"], "num_speculative_tokens": 6,
                                                 "model": "H", "suffix_decoding_max_cached_requests": 0}
    forced = candidates(["torch"], "D", "H", ["eagle3", "suffix"], k=3)
    assert [c.name for c in forced] == ["torch plain", "torch + eagle3 k=3", "torch + suffix k=3"]
    with pytest.raises(ValueError, match="method eagle3 needs its model, and none is installed"):
        candidates(["torch"], "D", None, ["eagle3"])
    with pytest.raises(ValueError, match="names draft_model and eagle3; they read one model each"):
        candidates(["torch"], "D", "H", ["draft_model,eagle3"])


def test_candidates_with_the_parallel_draft():
    """The shipped parallel draft ("pard": draft_model with parallel_drafting) is a candidate of its own and,
    where installed, the model drafter beside suffix."""
    cands = candidates(["torch"], "D", "H", pard="P")
    assert [c.name for c in cands] == ["torch plain", "torch + draft_model k=6", "torch + pard k=6",
                                       "torch + suffix k=16", "torch + eagle3 k=6", "torch + suffix,pard k=6"]
    assert cands[2].speculative_config() == {"method": "draft_model", "num_speculative_tokens": 6, "model": "P",
                                             "parallel_drafting": True}
    assert cands[5].speculative_config() == {"method": ["suffix", "draft_model"], "num_speculative_tokens": 6,
                                             "model": "P", "parallel_drafting": True,
                                             "suffix_decoding_max_cached_requests": 0}
    assert cands[1].speculative_config()["model"] == "D" and "parallel_drafting" not in cands[1].speculative_config()
    with pytest.raises(ValueError, match="method pard needs its model, and none is installed"):
        candidates(["torch"], "D", "H", ["pard"])
    with pytest.raises(ValueError, match="names pard and eagle3"):
        candidates(["torch"], "D", "H", ["pard,eagle3"], pard="P")


# -- measurement on tiny models, timed by a fake clock ---------------------------------------------


class FakeClock:
    """Time that moves only when a wrapped LLM generates: ``ms_per_token[candidate]`` per token."""

    def __init__(self):
        self.now = 0.0
        self.calls: dict = {}  # candidate -> generate calls

    def __call__(self) -> float:
        return self.now

    def charge(self, llms: dict, ms_per_token: dict[str, float]) -> None:
        for c, llm in llms.items():
            if isinstance(llm, str):
                continue
            real = llm.generate

            def generate(prompts, params=None, real=real, cost=ms_per_token[c.name], c=c):
                self.calls[c] = self.calls.get(c, 0) + 1
                outs = real(prompts, params)
                self.now += cost / 1e3 * sum(len(o.outputs[0].token_ids) for o in outs)
                return outs

            llm.generate = generate


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("demo_models")
    return {"target": make_model(root / "target", "llama", seed=0),
            "draft": make_model(root / "draft", "llama", seed=0)}  # the target's weights: drafts all accepted


def test_measure_picks_what_the_clock_says(pair):
    cands = candidates(["torch"], str(pair["draft"]), None, ["draft_model", "suffix"], k=3)
    llms = demo.build(cands, str(pair["target"]))
    clock = FakeClock()
    clock.charge(llms, {"torch plain": 5.0, "torch + draft_model k=3": 2.0, "torch + suffix k=3": 3.0})
    measured = measure(llms, prompts=["w1 w2 w3", "w7 w8"], max_tokens=6, rounds=2, clock=clock)
    assert [x.error for x in measured] == [None, None, None]
    assert all(x.tokens == 2 * 6 for x in measured)  # per prompt its fastest round; ignore_eos: max_tokens each
    assert [round(x.tokens_per_s) for x in measured] == [200, 500, 333]
    draft = measured[1]
    # from the metrics and the controller; a tree round (draft_tree "auto") drafts up to draft_tree_max_nodes
    assert draft.tau > 1 and 0 < draft.mean_k <= max(3, SpeculativeConfig(method="ngram").draft_tree_max_nodes) and draft.step_ms > 0
    choice = choose(measured)
    assert choice.spec is draft and choice.speedup == pytest.approx(2.5)


def test_implausible_figures_are_measured_again(pair):
    """A configuration faster over plain on its backend than its τ allows is noise: more rounds follow."""
    too_fast = [m("torch", tps=100), m("torch", "suffix", 16, tps=300, tau=2.0)]
    assert demo.implausible(too_fast) == ["torch + suffix k=16"]
    assert demo.implausible([m("torch", tps=100), m("torch", "suffix", 16, tps=220, tau=2.0),
                             m("llama.cpp", "suffix", 16, tps=900, tau=1.0)]) == []  # no plain llama.cpp to compare
    cands = candidates(["torch"], str(pair["draft"]), None, ["suffix"], k=2)
    # 1.11x plain is plausible whatever τ (>= 1); 100x is not: warm-up + 2 prompts x (1 + the extra rounds)
    for costs, runs in (({"torch plain": 5.0, "torch + suffix k=2": 4.5}, 1 + 2 * 1),
                        ({"torch plain": 50.0, "torch + suffix k=2": 0.5}, 1 + 2 * (1 + demo.EXTRA_ROUNDS))):
        llms = demo.build(cands, str(pair["target"]))
        clock = FakeClock()
        clock.charge(llms, costs)
        measure(llms, prompts=["w1 w2", "w5"], max_tokens=4, rounds=1, clock=clock)
        assert {c.name: n for c, n in clock.calls.items()} == {"torch plain": runs, "torch + suffix k=2": runs}


def test_measure_reports_a_candidate_that_fails(pair):
    class Broken:
        def generate(self, prompts, params):
            raise RuntimeError("drafter exploded")

    cands = candidates(["torch"], str(pair["draft"]), None, ["suffix"], k=2)
    llms = demo.build(cands, str(pair["target"]))
    llms[Candidate("torch", "draft_model", 2, "x")] = Broken()
    llms[Candidate("llama.cpp", "layer_skip", 2)] = "layer_skip runs the target's first layers"
    measured = {x.candidate.name: x for x in measure(llms, prompts=["w1 w2"], max_tokens=4, rounds=1)}
    assert measured["torch + draft_model k=2"].error == "RuntimeError: drafter exploded"
    assert measured["llama.cpp + layer_skip k=2"].error.startswith("layer_skip runs")
    assert measured["torch + suffix k=2"].ok and measured["torch plain"].ok


# -- the demo command, its choice injected ----------------------------------------------------------


def _install(monkeypatch, pair, head: Path | None = None) -> None:
    from specdec.models.resolve import SHIPPED

    monkeypatch.setitem(SHIPPED, "specdec/demo-target", Path(pair["target"]))
    monkeypatch.setitem(SHIPPED, "specdec/demo-draft", Path(pair["draft"]))
    monkeypatch.setitem(SHIPPED, "specdec/demo-eagle3", head or Path(pair["target"]).parent / "no-head")
    monkeypatch.setitem(SHIPPED, "specdec/demo-draft-pard", Path(pair["target"]).parent / "no-pard")


def _inject(monkeypatch, ms_per_token: dict[str, float]) -> None:
    """The demo's measurement runs for real, on the fake clock."""
    clock = FakeClock()
    real_build = demo.build

    def build(cands, target, device="cpu", progress=None):
        llms = real_build(cands, target, device, progress)
        clock.charge(llms, {c.name: ms_per_token.get(c.name, 50.0) for c in cands})
        return llms

    monkeypatch.setattr(demo, "build", build)
    monkeypatch.setattr(demo, "measure", functools.partial(demo.measure, clock=clock))


def test_demo_runs_the_measured_best(monkeypatch, pair):
    _install(monkeypatch, pair)
    _inject(monkeypatch, {"torch plain": 5.0, "torch + suffix k=16": 2.0, "torch + draft_model k=6": 4.0})
    result = runner.invoke(app, ["demo", "--max-tokens", "6", "--probe-rounds", "1", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["configuration"] == "torch + suffix k=16" and out["plain_backend"] == "torch"
    assert out["speculative_config"]["method"] == "suffix"
    assert {x["name"] for x in out["measured"]} == {"torch plain", "torch + draft_model k=6", "torch + suffix k=16",
                                                     "torch + suffix,draft_model k=6"}
    assert "torch + suffix k=16 is 2.50x plain torch" in out["why"]
    assert out["greedy_match"]["matched"] == 3  # the full run: the same backend, lossless
    assert out["speedup"] == pytest.approx(out["spec_tokens_per_s"] / out["ar_tokens_per_s"])


def test_demo_text_names_the_baseline(monkeypatch, pair):
    _install(monkeypatch, pair)
    _inject(monkeypatch, {"torch plain": 5.0, "torch + draft_model k=6": 1.0})
    result = runner.invoke(app, ["demo", "--max-tokens", "6", "--probe-rounds", "1", "--method", "draft_model"])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "measured here" in text and "torch + draft_model k=6 *" in text and "torch plain *" in text
    assert "why: torch: " in text and "is 5.00x plain torch" in text
    assert "over plain decoding on torch, the fastest plain backend here" in text
    assert "def fibonacci(n):" in text


@pytest.mark.skipif(not __import__("importlib").util.find_spec("llama_cpp"), reason="llama-cpp-python not installed")
def test_demo_across_backends_compares_with_the_fastest_plain(monkeypatch, pair):
    monkeypatch.delenv("SPECDEC_AUTO_BACKEND", raising=False)
    _install(monkeypatch, pair)
    _inject(monkeypatch, {"llama.cpp plain": 2.0, "torch plain": 5.0, "torch + draft_model k=6": 1.0,
                          "llama.cpp + draft_model k=6": 2.5})
    monkeypatch.setattr(demo, "forward_costs", lambda target: {"llama.cpp": (2.0, 4.0), "torch": (5.0, 5.5)})
    result = runner.invoke(app, ["demo", "--max-tokens", "6", "--probe-rounds", "1", "--method", "draft_model",
                                 "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["plain_backend"] == "llama.cpp" and out["configuration"] == "torch + draft_model k=6"
    assert out["why"].startswith("llama.cpp: step 2.00 ms, a verify pass of 5 tokens costs 2.00 steps, best "
                                 "draft_model at ")
    assert "; torch: step 5.00 ms, a verify pass of 5 tokens costs 1.10 steps, best draft_model at " in out["why"]
    assert out["why"].count("held back by ") >= 1  # which limit: the controller's own wall-clock line decides
    assert out["why"].endswith("torch + draft_model k=6 is 2.00x plain llama.cpp (the fastest plain backend)")
    assert out["forward_ms"] == {"llama.cpp": {"1": 2.0, "5": 4.0}, "torch": {"1": 5.0, "5": 5.5}}
    # the full run's baseline is plain llama.cpp; greedy equality is checked on the same backend (torch)
    assert out["greedy_match"]["matched"] == 3
    assert out["speedup"] == pytest.approx(out["spec_tokens_per_s"] / out["ar_tokens_per_s"])
    assert out["same_backend_speedup"] == pytest.approx(out["spec_tokens_per_s"] / out["same_backend_ar_tokens_per_s"])


@pytest.mark.parametrize("args, message", [
    (["--backend", "tpu"], "--backend must be auto, torch or llama.cpp"),
    (["--method", "eagle3"], "the shipped EAGLE-3 head specdec/demo-eagle3 is not installed"),
    (["--method", "suffix,,ngram"], "has an empty name"),
    (["--method", "draft_model,eagle3"], "the shipped EAGLE-3 head"),
    (["--method", "pard"], "the shipped parallel draft specdec/demo-draft-pard is not installed"),
    (["--method", "suffix,pardd"], "unknown method 'pardd'; the demo takes draft_model, ngram, suffix"),
])
def test_demo_bad_input_exits_2(monkeypatch, pair, args, message):
    _install(monkeypatch, pair)
    result = runner.invoke(app, ["demo", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert "Traceback" not in result.output


def test_demo_with_an_eagle3_head_installed(monkeypatch, pair, tmp_path):
    """With the head installed the demo measures eagle3 (alone and listed with suffix) on each backend;
    one the backend cannot run is reported, not fatal."""
    import torch
    from transformers import AutoConfig

    from specdec.models.eagle3 import Eagle3Config, Eagle3Head, save_head

    torch.manual_seed(0)
    head = save_head(Eagle3Head(Eagle3Config.for_target(AutoConfig.from_pretrained(pair["target"]))), tmp_path / "h")
    _install(monkeypatch, pair, head)
    _inject(monkeypatch, {"torch plain": 5.0, "torch + eagle3 k=6": 2.0, "torch + suffix,eagle3 k=6": 3.0})
    result = runner.invoke(app, ["demo", "--max-tokens", "6", "--probe-rounds", "1", "--json",
                                 "--method", "eagle3", "--method", "suffix,eagle3"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert [x["name"] for x in out["measured"]] == ["torch plain", "torch + eagle3 k=6", "torch + suffix,eagle3 k=6"]
    assert all(x["error"] is None for x in out["measured"])
    assert out["configuration"] == "torch + eagle3 k=6" and out["speculative_config"]["model"] == "specdec/demo-eagle3"
    assert out["greedy_match"]["matched"] == 3


@pytest.mark.skipif(not __import__("importlib").util.find_spec("llama_cpp"), reason="llama-cpp-python not installed")
def test_forward_costs_are_timed_in_the_same_run_on_the_loaded_runners(monkeypatch, pair, tmp_path):
    """The demo explains itself with forwards timed now, on the plain candidates' own runners, not with
    backend=auto's cache; the runners decode as before afterwards."""
    from specdec.models import backend_choice

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(backend_choice, "REPEATS", 2)
    cands = candidates(["llama.cpp", "torch"], str(pair["draft"]), None, [], k=2)
    llms = demo.build(cands, str(pair["target"]))
    params = demo.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = {c: llm.generate(["w1 w2 w3"], params)[0].outputs[0].token_ids for c, llm in llms.items()}
    costs = demo.forward_costs(llms)
    assert set(costs) == {"llama.cpp", "torch"} and all(t1 > 0 and tk > 0 for t1, tk in costs.values())
    assert not (tmp_path / "cache" / "backend.json").exists()  # nothing cached, nothing read
    assert {c: llm.generate(["w1 w2 w3"], params)[0].outputs[0].token_ids for c, llm in llms.items()} == before
    by_name = demo.forward_costs(str(pair["target"]))  # a name: both backends loaded for the timing
    assert set(by_name) == {"llama.cpp", "torch"} and all(t1 > 0 for t1, _ in by_name.values())
    with pytest.raises(ValueError, match="no plain candidate loaded"):
        demo.forward_costs({Candidate("torch", "suffix", 2): "not available"})


def test_the_demo_keeps_the_acceptance_it_measured_for_backend_auto(monkeypatch, pair, tmp_path):
    from specdec.models import backend_choice
    from specdec.models.resolve import resolve

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    from specdec import LLM

    (cand,) = candidates(["torch"], str(pair["draft"]), None, ["draft_model"], k=3)[1:]
    # k fixed (adaptive off): the controller would gate off a draft as dear as the target, drafting nothing
    llm = LLM(str(pair["target"]), backend="torch", speculative_config=cand.speculative_config() | {"adaptive": False})
    measure({cand: llm}, prompts=["w1 w2 w3", "w7 w8"], max_tokens=24, rounds=1)
    target, draft = resolve(str(pair["target"])), resolve(str(pair["draft"]))
    alphas, how = backend_choice.acceptance_for(target, "draft_model", draft, 3)
    got = llm.get_metrics()
    alpha = backend_choice.alpha_from_tau(got["mean_acceptance_length"], got["num_draft_tokens"] / got["num_drafts"])
    assert alphas == pytest.approx([alpha] * 3, abs=1e-4) and alpha > 0.9  # the draft is the target
    shown = " / ".join([f"{alpha:.2f}"] * 3)
    assert how.startswith(f"α {shown} (measured: specdec demo, {got['num_drafts']} rounds)")
    assert "prior" in backend_choice.acceptance_for(target, "suffix", None, 3)[1]  # not measured: the prior
