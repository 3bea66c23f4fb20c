"""An EAGLE-3 head's draft temperature scale s (sampled rows draw from q = softmax(z / (T s))):
the fit (specdec/training/draft_calibration.py) undoes a head made too sharp on purpose, the drafter
(drafters/eagle3.py) then gets more drafts accepted at temperature 1, greedy output and drafts do not
move, sampled outputs still follow the target's distribution, training writes the scale, and bad values
are refused. Run with SPECDEC_STRICT_DRAFTER=1 (a drafter failure fails the test)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lossless import assert_first_tokens_follow_target, assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.models.load import load_model
from test_eagle3 import SMALL_WORDS, last_token_target, make_copying_head, make_head, spec
from test_eagle3_training import run, tiny  # noqa: F401  (tiny: the training tests' fixture)
from tiny_models import make_model, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

SHARPER = 2.0  # the sharp head's logits are the copying head's times this


def sharpen(head: str, out: Path, factor: float) -> str:
    """A copy of ``head`` whose logits are ``factor`` times its own (its LM head scaled): the same argmaxes,
    a sharper q."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text((Path(head) / "config.json").read_text())
    state = load_file(str(Path(head) / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"] * factor
    save_file(state, str(out / "model.safetensors"))
    return str(out)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """A target whose next token all but follows its last one, a head close to it (make_copying_head) and
    that head made SHARPER times sharper."""
    root = tmp_path_factory.mktemp("calibration")
    target = last_token_target(root / "target")
    head = make_copying_head(target, root / "head")
    return {"target": target, "hf": load_model(target).hf_model, "head": head,
            "sharp": sharpen(head, root / "sharp", SHARPER)}


def fit(heads, name: str) -> dict:
    from specdec.models.eagle3 import load_head
    from specdec.training.draft_calibration import fit_scale
    from specdec.training.eagle3 import TTTModel

    hf = heads["hf"]
    head = load_head(heads[name], hf.get_input_embeddings().weight.detach(), hf.config.num_hidden_layers,
                     hf.config.vocab_size)
    windows = torch.randint(3, hf.config.vocab_size, (6, 32), generator=torch.Generator().manual_seed(0))
    return fit_scale(TTTModel(head, 2, 1.0), hf, windows, torch.full((6,), 32))


def test_the_fitted_scale_undoes_a_head_made_too_sharp(heads):
    close, sharp = fit(heads, "head"), fit(heads, "sharp")
    assert close["scale"] == 1.0  # the copying head's q is already the best of the grid
    assert 0.93 * SHARPER < sharp["scale"] < 1.07 * SHARPER  # the grid's point nearest SHARPER
    assert sharp["chain_at_1"] < 0.6 * close["chain"]  # too sharp: much less accepted
    assert sharp["chain"] == pytest.approx(close["chain"], rel=0.01)  # calibrated: as the close head
    assert all(a > b + 0.2 for a, b in zip(sharp["acceptance"], sharp["acceptance_at_1"]))


def sampled_acceptance(heads, q_scale: float) -> float:
    llm = LLM(heads["target"], backend="torch", speculative_config=spec(heads["sharp"], 3, adaptive=False))
    llm.engine.drafter.q_scale = q_scale
    prompts = random_prompts(6, [4, 9, 17], seed=2)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True) for i in range(6)])
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0
    return m["acceptance_rate"]


def test_the_calibrated_head_gets_more_accepted_at_temperature_1(heads):
    scale = fit(heads, "sharp")["scale"]
    before, after = sampled_acceptance(heads, 1.0), sampled_acceptance(heads, scale)
    assert after > before + 0.25, (before, after)  # measured 0.33 -> 0.82


@pytest.mark.parametrize("q_scale", [0.5, SHARPER])
def test_greedy_output_and_drafts_do_not_move(heads, q_scale):
    prompts = random_prompts(4, [3, 8, 13], seed=5)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(heads["target"], backend="torch").generate([{"prompt_token_ids": p} for p in prompts], sp)
    runs = []
    for s in (1.0, q_scale):
        llm = LLM(heads["target"], backend="torch", speculative_config=spec(heads["sharp"], 3, adaptive=False))
        llm.engine.drafter.q_scale = s
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        for p, e, o in zip(prompts, plain, outs):
            assert_greedy_equal(heads["hf"], p, e.outputs[0].token_ids, o.outputs[0].token_ids)
        m = llm.get_metrics()
        runs.append((m["num_draft_tokens"], m["num_accepted_tokens"], m["acceptance_rate_per_pos"]))
    assert runs[0] == runs[1] and runs[0][0] > 0  # the same drafts, accepted alike


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibration_small")
    target = str(make_model(root / "t", "llama", words=SMALL_WORDS, seed=3, init_std=0.5))
    head = make_head(target, root / "head", seed=2, draft_vocab=18)  # 5 of 23 tokens it never drafts
    return target, head, load_model(target).hf_model


@pytest.mark.parametrize("params,q_scale", [
    (dict(temperature=1.0), 2.5),
    (dict(temperature=1.0), 0.4),
    (dict(temperature=0.8, top_k=4), 2.5),
    (dict(temperature=1.0, top_p=0.7), 2.5),
], ids=["t1-flatter", "t1-sharper", "topk", "topp"])
def test_sampled_outputs_follow_the_target_distribution_with_a_scale(small_vocab, params, q_scale):
    """3,000 seeded requests, the head drafting 2 tokens from its rescaled q: the first tokens pass the
    chi-square tests of test_eagle3.py against the target's exact distribution."""
    target, head, hf = small_vocab
    prompt, N = [5, 9, 3], 3000
    llm = LLM(target, backend="torch", speculative_config=spec(head, 2, adaptive=False))
    llm.engine.drafter.q_scale = q_scale
    sps = [SamplingParams(max_tokens=3, seed=1000 + i, ignore_eos=True, **params) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, sps)
    tokens = np.array([o.outputs[0].token_ids for o in outs])  # [N, 3]
    assert_first_tokens_follow_target(hf, prompt, tokens, sps[0], len(SMALL_WORDS) + 3)
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] > 0


def test_training_fits_the_scale_and_writes_it(tiny, tmp_path):  # noqa: F811
    s = run(tiny, tmp_path / "h", "--max-steps", "3", "--draft-vocab", "50")
    r = s["q_scale"]
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert 0.4 <= r["scale"] <= 2.5 and r["positions"] > 0 and r["chain"] >= r["chain_at_1"]
    assert config.get("specdec_draft_temperature_scale", 1.0) == r["scale"]
    assert "draft temperature scale" in (tmp_path / "h" / "README.md").read_text()


BAD = [0, -1.0, math.nan, math.inf, True, "2", None]


@pytest.mark.parametrize("bad", BAD, ids=[repr(b) for b in BAD])
def test_bad_scales_are_refused_with_how_to_fix(heads, tmp_path, bad):
    from specdec.drafters.eagle3 import Eagle3Drafter
    from specdec.training.draft_calibration import write_scale

    llm = LLM(heads["target"], backend="torch", speculative_config=spec(heads["head"], 2, adaptive=False))
    drafter = llm.engine.drafter
    with pytest.raises(ValueError, match="positive finite number.*specdec_draft_temperature_scale"):
        drafter.q_scale = bad
    assert drafter.q_scale == 1.0
    drafter.head.config.draft_temperature_scale = bad  # as a config that carried it would give it
    with pytest.raises(ValueError, match="config.json"):
        Eagle3Drafter(drafter.head, drafter.target)
    with pytest.raises(ValueError, match="positive finite number"):
        write_scale(heads["head"], bad)


def test_write_scale_sets_and_removes_the_key(heads, tmp_path):
    from specdec.training.draft_calibration import SCALE_KEY, write_scale

    folder = Path(sharpen(heads["head"], tmp_path / "h", 1.0))
    before = json.loads((folder / "config.json").read_text())
    write_scale(folder, 1.25)
    assert json.loads((folder / "config.json").read_text()) == {**before, SCALE_KEY: 1.25}
    write_scale(folder, 1.0)  # 1: q as the head gives it, no key
    assert json.loads((folder / "config.json").read_text()) == before
    with pytest.raises(ValueError, match="no config.json"):
        write_scale(tmp_path, 1.5)


def test_a_written_scale_is_what_the_loaded_drafter_uses_and_save_keeps_it(heads, tmp_path):
    """The key write_scale sets is read back by the real loading path (Eagle3Config.from_json), reaches the
    drafter, and survives save_head; a bad value in config.json is refused at load with the key's name."""
    from specdec.models.eagle3 import SCALE_KEY, save_head
    from specdec.training.draft_calibration import write_scale

    folder = Path(sharpen(heads["head"], tmp_path / "h", 1.0))
    write_scale(folder, 1.25)
    drafter = LLM(heads["target"], backend="torch", speculative_config=spec(str(folder), 2, adaptive=False)).engine.drafter
    assert drafter.q_scale == 1.25 and drafter.head.config.draft_temperature_scale == 1.25
    saved = save_head(drafter.head, tmp_path / "saved")
    assert json.loads((saved / "config.json").read_text())[SCALE_KEY] == 1.25
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, SCALE_KEY: -2}))
    with pytest.raises(ValueError, match=f"positive finite number.*{SCALE_KEY}"):
        LLM(heads["target"], backend="torch", speculative_config=spec(str(folder), 2, adaptive=False))
