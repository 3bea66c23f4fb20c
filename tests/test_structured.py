"""Structured output end to end through ``LLM.generate``, for draft_model, ngram and suffix: greedy
output under a JSON schema equals plain constrained decoding (a difference only at a near-tie of the
masked logits) and parses; sampled outputs under a regex that forbids most of the vocabulary follow
the target's masked distribution exactly (chi-square against probabilities computed here from the
target and an independently derived mask)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from lossless import FALSE_ALARM, NEAR_TIE, chi_square_p
from specdec import LLM, SamplingParams
from specdec.config import StructuredOutputsParams as SO
from specdec.models.load import load_model
from tiny_models import byte_level_token_bytes, make_byte_tokenizer, make_model, perturbed_copy

VOCAB_ROWS = 330  # a 320-token byte-level tokenizer plus padding rows that must never be sampled
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tag", "name", "ok"],
    "additionalProperties": False,
}
RECORDS = '{"id":12,"tag":"red","name":"ab","ok":true}\n{"id":7,"tag":"blue","name":"cd","ok":false}\n'
METHODS = {
    "draft_model": lambda draft: {"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
    "ngram": lambda draft: {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False,
                            "prompt_lookup_min": 1},
    "suffix": lambda draft: {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False,
                             "suffix_decoding_max_spec_factor": 2.0},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    make_byte_tokenizer(root / "tokenizer")
    target = make_model(root / "t", "llama", vocab_rows=VOCAB_ROWS, tokenizer_from=root / "tokenizer", seed=3)
    draft = perturbed_copy(target, root / "d", 0.02)
    loaded = load_model(str(target))
    return str(target), str(draft), loaded.hf_model, loaded.tokenizer


def logits_after(hf, ids: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits[:, -1].double()  # [rows, VOCAB_ROWS]


def assert_equal_up_to_masked_near_tie(hf, llm, so, prompt, expected, got):
    """``got`` equals ``expected`` unless they part where the target's top-2 gap under the grammar's
    mask is below NEAR_TIE."""
    for j, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            m = llm.engine.grammar_compiler.matcher(so)
            for t in expected[:j]:
                assert m.accept_token(t)
            top = logits_after(hf, [prompt + expected[:j]])[0].masked_fill(~m.allowed_mask(), -torch.inf).topk(2)
            gap = float(top.values[0] - top.values[1])
            assert gap < NEAR_TIE, f"outputs part at token {j} ({a} vs {b}) where the masked top-2 gap is {gap:.2e}"
            return
    assert expected == got


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_json_equals_plain_constrained_decoding(models, method):
    target, draft, hf, tok = models
    so = SO(json=SCHEMA, disable_any_whitespace=True)
    prompts = [RECORDS, RECORDS + RECORDS.split("\n")[0] + "\n", "records:\n" + RECORDS]
    sp = SamplingParams(temperature=0, max_tokens=80, structured_outputs=so)
    plain = LLM(target, max_model_len=192)
    expected = plain.generate(prompts, sp)
    llm = LLM(target, speculative_config=METHODS[method](draft), max_model_len=192)
    got = llm.generate(prompts, sp)
    for e, g in zip(expected, got):
        assert_equal_up_to_masked_near_tie(hf, llm, so, e.prompt_token_ids, e.outputs[0].token_ids,
                                           g.outputs[0].token_ids)
        out = g.outputs[0]
        assert out.finish_reason == "stop"
        record = json.loads(out.text)
        assert list(record) == SCHEMA["required"] and 0 <= record["id"] <= 999 and len(record["name"]) <= 6
        assert record["tag"] in ("red", "green", "blue") and isinstance(record["ok"], bool)
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] > 0  # speculation ran under the grammar


@pytest.fixture(scope="module")
def masked_joint(models):
    """``[abc]{8,}`` allows 6 of the 330 ids and, within three tokens, never the stop token. Returns the
    prompt, the allowed ids and the exact joint [A * A] of the first two tokens: the target's softmax
    over the allowed ids (the mask derived here from the tokens' bytes, not by the grammar engine)."""
    target, draft, hf, tok = models
    pieces = byte_level_token_bytes(tok)
    allowed = [t for t, b in enumerate(pieces) if b and set(b) <= set(b"abc")]
    assert 4 < len(allowed) < 20 and max(len(pieces[t]) for t in allowed) * 2 < 8  # no EOS by token 3
    prompt = tok.encode("abcab", add_special_tokens=False)
    p1 = torch.softmax(logits_after(hf, [prompt])[:, allowed], dim=-1)[0]  # [A]
    p2 = torch.softmax(logits_after(hf, [prompt + [t] for t in allowed])[:, allowed], dim=-1)  # [A, A]
    return prompt, allowed, (p1[:, None] * p2).reshape(-1).numpy()


@pytest.mark.parametrize("method", list(METHODS))
def test_sampled_tokens_follow_the_masked_target(models, masked_joint, method):
    target, draft, hf, tok = models
    prompt, allowed, joint = masked_joint
    index = {t: i for i, t in enumerate(allowed)}
    N = 1000
    so = SO(regex="[abc]{8,}")
    sps = [SamplingParams(temperature=1.0, max_tokens=3, seed=4000 + i, structured_outputs=so) for i in range(N)]
    llm = LLM(target, speculative_config={**METHODS[method](draft), "num_speculative_tokens": 2}, max_model_len=16)
    tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": prompt}] * N, sps)]
    assert all(len(t) == 3 and all(x in index for x in t) for t in tokens), "a token the regex forbids"
    samples = np.array([index[a] * len(allowed) + index[b] for a, b, _ in tokens])
    assert chi_square_p(samples, joint) > FALSE_ALARM
    assert llm.get_metrics()["num_accepted_tokens"] > 0  # drafts were used


@pytest.mark.parametrize("extra", [dict(allowed_token_ids=[5, 6]), dict(min_tokens=6), dict(ignore_eos=True)],
                         ids=["allowed_token_ids", "min_tokens", "ignore_eos"])
def test_constraints_that_contradict_the_grammar_leave_it_in_charge(models, extra):
    """Where allowed_token_ids or min_tokens leave nothing the grammar allows, the grammar wins: the output
    is still one of the choices, ended by EOS (not a crash, and not an empty distribution)."""
    target, draft, hf, tok = models
    so = SO(choice=["yes", "no"])
    for spec in (None, METHODS["ngram"](draft)):
        llm = LLM(target, speculative_config=spec, max_model_len=32)
        for sp in (SamplingParams(temperature=0, max_tokens=8, structured_outputs=so, **extra),
                   SamplingParams(temperature=1.0, seed=1, max_tokens=8, structured_outputs=so, **extra)):
            out = llm.generate(["yes or no? yes"], sp)[0].outputs[0]
            assert out.text in ("yes", "no") and out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id


def test_n_choices_each_follow_the_grammar(models):
    """n = 3 sampled choices of one request: each has its own matcher (the first gets the precompiled one)."""
    target, draft, hf, tok = models
    so = SO(regex="(yes|no|maybe) [abc]{2,4}")
    llm = LLM(target, speculative_config=METHODS["ngram"](draft), max_model_len=32)
    out = llm.generate(["abc maybe abc"], SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=12,
                                                        structured_outputs=so))[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert re.fullmatch(r"(yes|no|maybe) [abc]{2,4}", c.text) and c.finish_reason == "stop", c.text


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "draft_model"])
def test_a_grammar_its_engine_gives_up_on_ends_the_output(models, spec, caplog):
    """llguidance stops following ``(a{1000}){1000}`` after a token (its lexer's limits): the output ends
    there with a warning, as in vLLM, instead of failing in the engine."""
    target, draft, _, _ = models
    llm = LLM(target, speculative_config={"model": draft, "num_speculative_tokens": 3} if spec else None)
    out = llm.generate("x", SamplingParams(max_tokens=8, temperature=1.0, seed=1,
                                           structured_outputs=SO(regex="(a{1000}){1000}")))[0].outputs[0]
    assert out.finish_reason == "stop" and set(out.text) <= {"a"}
    assert "grammar matcher failed" in caplog.text


def test_stop_tokens_drafted_past_the_grammars_end_are_dropped(models):
    """Under ignore_eos a sampled draft may propose EOS after the EOS that completes the grammar, and the
    verifier accepts it (the finished grammar allows only stop tokens); plain decoding stops at the
    first, so the speculative output must too: one EOS, ended by "stop"."""
    target, _, _, tok = models
    llm = LLM(target, speculative_config={"model": target, "num_speculative_tokens": 4, "adaptive": False},
              max_model_len=48)
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True,
                          structured_outputs=SO(choice=["yes", "no"])) for s in range(8)]
    for out in llm.generate(["yes or no? yes"] * 8, sps):
        c = out.outputs[0]
        assert c.text in ("yes", "no") and c.finish_reason == "stop"
        assert c.token_ids.count(tok.eos_token_id) == 1 and c.token_ids[-1] == tok.eos_token_id


def test_a_stop_token_that_ends_the_grammar_is_the_stop_reason(models):
    """EOS listed in stop_token_ids (with ignore_eos) ends the output through the stop list: the
    stop_reason stays that token even when drafts past it were dropped with the grammar's end."""
    target, _, _, tok = models
    llm = LLM(target, speculative_config={"model": target, "num_speculative_tokens": 4, "adaptive": False},
              max_model_len=48)
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True, stop_token_ids=[tok.eos_token_id],
                          structured_outputs=SO(choice=["yes", "no"])) for s in range(8)]
    for out in llm.generate(["yes or no? yes"] * 8, sps):
        c = out.outputs[0]
        assert c.text in ("yes", "no") and c.finish_reason == "stop" and c.stop_reason == tok.eos_token_id
