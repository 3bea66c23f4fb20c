"""Drafts with another tokenizer (drafters/other_vocab.py, vocab_map.py): lossless under both mappings
(greedy equality with plain decoding, chi-square of sampled outputs), on torch and llama.cpp; the
draft's view of a history; pairs that cannot be mapped."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from lossless import assert_first_tokens_follow_target, assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.drafters.other_vocab import MAPPINGS, TRIAL_ROWS, OtherVocabDrafter, TextView
from specdec.drafters.vocab_map import decode, encode_start
from specdec.models.load import load_model
from tiny_models import WORDS, make_byte_tokenizer, make_model, random_prompts, remapped_copy

ASSETS = Path(__file__).resolve().parents[1] / "specdec" / "assets"
SMALL_WORDS = [f"w{i}" for i in range(20)]  # V = 23: small enough for exact distribution tests
TEXT = ('def fib(n):\n    """The n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
        '    return fib(n - 1) + fib(n - 2)\n\n\nprint([fib(i) for i in range(10)])  # naïve, 0.5 µs each\n'
        '{"name": "Ada", "tags": ["math", "code"], "ok": true}\n') * 3


def shuffled(words: list[str], seed: int = 0) -> list[str]:
    out = list(words)
    random.Random(seed).shuffle(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A word-level target; a draft that knows its words under other ids (plus words of its own) and
    mostly agrees with it; a byte-level BPE draft (random weights: other segmentation, little agreement)."""
    root = tmp_path_factory.mktemp("other_vocab")
    target = make_model(root / "target", "llama", seed=0)
    remapped = remapped_copy(target, root / "remapped", shuffled(WORDS) + [f"x{i}" for i in range(30)], scale=0.002)
    renumbered = remapped_copy(target, root / "renumbered", shuffled(WORDS, 2), scale=0.002)  # renumbered only
    make_byte_tokenizer(root / "byte_tok")
    byte = make_model(root / "byte", "llama", layers=1, seed=5, tokenizer_from=root / "byte_tok")
    return {"target": str(target), "remapped": str(remapped), "renumbered": str(renumbered), "byte": str(byte),
            "hf": load_model(str(target)).hf_model}


def plain(target: str, prompts, sp, **kw) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM(target, **kw).generate(prompts, sp)]


# -- greedy: the output is plain decoding's ----------------------------------------------------------


@pytest.mark.parametrize("mapping", ["string", "intersection", "auto"])
@pytest.mark.parametrize("draft", ["remapped", "renumbered", "byte"])
def test_greedy_output_equals_plain_decoding(models, draft, mapping):
    """Four prompts of different lengths, two seats: sequences join and leave the batch and roll back
    after rejections. renumbered: the target's words renumbered, nothing else, so every draft token has a
target token (greedy intersection drafts take one runner call)."""
    if draft == "byte" and mapping == "intersection":
        with pytest.raises(ValueError, match="share no token of the same text.*use 'string'"):
            LLM(models["target"], speculative_config={"model": models[draft], "draft_tokenizer_mapping": mapping})
        return
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, [1, 5, 11, 23], seed=2)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = plain(models["target"], prompts, sp, max_num_seqs=2)
    llm = LLM(models["target"], max_num_seqs=2,
              speculative_config={"model": models[draft], "num_speculative_tokens": 4, "adaptive": False,
                                  "draft_tokenizer_mapping": mapping})
    drafter = llm.engine.drafter
    assert isinstance(drafter, OtherVocabDrafter) and drafter._all_shared == (draft == "renumbered")
    outs = llm.generate(prompts, sp)
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_equal(models["hf"], p["prompt_token_ids"], e, o.outputs[0].token_ids)
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0
    if draft == "remapped":  # the draft agrees with the target where the words are the same
        assert m["mean_acceptance_length"] > 2.0, m
    if draft == "renumbered":
        assert m["mean_acceptance_length"] > 2.0, m
    if draft == "byte":  # no token text in common: auto has nothing to measure, string runs
        assert drafter.mapping == "string"
    assert not drafter.views and not drafter.cached  # released with their sequences


def test_auto_measures_both_mappings_and_keeps_one(models, caplog):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, [3, 8], seed=4)]
    llm = LLM(models["target"], speculative_config={"model": models["remapped"], "num_speculative_tokens": 3,
                                                    "adaptive": False})
    drafter = llm.engine.drafter
    assert drafter.requested == "auto" and drafter.mapping is None
    with caplog.at_level(logging.INFO, logger="specdec.drafters.other_vocab"):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    assert drafter.mapping in MAPPINGS
    assert all(asked >= TRIAL_ROWS and accepted > 0 and seconds > 0
               for asked, accepted, _, seconds in drafter.measured.values())
    assert f"mapping {drafter.mapping!r} kept" in caplog.text


def test_the_draft_catches_up_through_text_after_rejections(models):
    """After every round the draft's cache holds the committed history as its own tokens spell it."""
    llm = LLM(models["target"], speculative_config={"model": models["remapped"], "num_speculative_tokens": 4,
                                                    "draft_tokenizer_mapping": "intersection", "adaptive": False})
    drafter, engine = llm.engine.drafter, llm.engine
    seq = engine.add_request(random_prompts(1, [6], seed=7)[0],
                             SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    dtok = AutoTokenizer.from_pretrained(models["remapped"])
    rounds = 0
    while engine.has_unfinished():
        engine.step()
        if not seq.finished and seq.seq_id in drafter.cached:
            rounds += 1
            text = decode(llm.tokenizer, seq.token_ids, drafter.map.target_drop)
            view = drafter._view(seq)
            assert view == encode_start(dtok, text)
            cached = drafter.cached[seq.seq_id]  # what it fed: history and drafts, the rejected ones included
            common = next((i for i, (a, b) in enumerate(zip(cached, view)) if a != b), min(len(cached), len(view)))
            assert common >= len(view) - 2  # next round feeds the recovered or bonus token (and the last draft)
    assert rounds > 3


# -- sampled: the output follows the target's distribution --------------------------------------------


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """V = 23 target; a draft over 16 of its words (other ids) and 6 of its own, partly agreeing: drafts
    off the intersection are impossible, so rejections and residuals happen."""
    root = tmp_path_factory.mktemp("small_other")
    target = make_model(root / "t", "llama", words=SMALL_WORDS, seed=3, init_std=0.5)
    draft = remapped_copy(target, root / "d", shuffled(SMALL_WORDS[:16], 1) + [f"x{i}" for i in range(6)], scale=0.05)
    return str(target), str(draft), load_model(str(target)).hf_model


SAMPLED = [("string", dict(temperature=1.0)), ("string", dict(temperature=1.0, top_p=0.7)),
           ("intersection", dict(temperature=1.0)), ("intersection", dict(temperature=0.8, top_k=4))]


@pytest.mark.parametrize("mapping, params", SAMPLED, ids=["string-t1", "string-topp", "intersection-t1",
                                                          "intersection-topk"])
def test_sampled_outputs_follow_the_target_distribution(small_pair, mapping, params):
    target, draft, hf = small_pair
    prompt = [5, 9, 3]
    N = 2000
    llm = LLM(target, speculative_config={"model": draft, "num_speculative_tokens": 2,
                                          "draft_tokenizer_mapping": mapping})
    sps = [SamplingParams(max_tokens=3, seed=1000 + i, ignore_eos=True, **params) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, sps)
    tokens = np.array([o.outputs[0].token_ids for o in outs])  # [N, 3]
    assert_first_tokens_follow_target(hf, prompt, tokens, sps[0], len(SMALL_WORDS) + 3)
    m = llm.get_metrics()
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]  # drafts were used, and some rejected


def test_seeded_string_drafts_draw_what_plain_decoding_draws(small_pair):
    """String drafts are the draft's argmax (q one-hot): a seeded request samples exactly its plain output."""
    target, draft, _ = small_pair
    prompts = [{"prompt_token_ids": p} for p in ([4, 7], [3, 9, 21, 5, 5], [12, 8, 16, 3, 4, 19, 6])]
    sp = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, seed=5, ignore_eos=True)
    llm = LLM(target, speculative_config={"model": draft, "num_speculative_tokens": 3,
                                          "draft_tokenizer_mapping": "string"})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == plain(target, prompts, sp)


# -- the draft's view of a history -------------------------------------------------------------------


def test_the_incremental_view_equals_re_encoding_the_whole_history(tmp_path):
    """A byte-level target tokenizer (the shipped one) and another byte-level BPE: the view built from a
    growing history, re-encoding only a tail, equals encoding the whole text each time; a replaced
    history starts over."""
    target_tok = AutoTokenizer.from_pretrained(ASSETS / "demo-target")
    make_byte_tokenizer(tmp_path)
    draft_tok = AutoTokenizer.from_pretrained(tmp_path)
    history = target_tok(TEXT)["input_ids"]
    view = TextView(target_tok, draft_tok)
    rng = random.Random(0)
    n = 3
    while n <= len(history):
        assert view.update(history[:n]) == encode_start(draft_tok, decode(target_tok, history[:n])), n
        n += rng.choice([1, 1, 2, 5])
    assert view.anchor > 0  # it did freeze a head
    other = target_tok(TEXT[::-1])["input_ids"][:40]
    assert view.update(other) == encode_start(draft_tok, decode(target_tok, other))


# -- pairs that cannot be mapped ---------------------------------------------------------------------


def test_pairs_that_cannot_be_mapped_are_named(models, tmp_path):
    target = models["target"]
    disjoint = make_model(tmp_path / "disjoint", "llama", words=[f"v{i}" for i in range(120)])
    with pytest.raises(ValueError, match=r"draft '.*disjoint' and target have different vocabularies.*share no text"):
        LLM(target, speculative_config={"model": str(disjoint), "num_speculative_tokens": 2})
    no_text = make_model(tmp_path / "no_text", "llama", words=[f"w{i}" for i in range(100)])
    tok = AutoTokenizer.from_pretrained(no_text)  # every word a special token: no token spells text
    tok.add_special_tokens({"additional_special_tokens": [f"w{i}" for i in range(100)]})
    tok.save_pretrained(no_text)
    with pytest.raises(ValueError, match=r"draft '.*no_text' and target have different vocabularies.*cannot be "
                                         r"mapped through text"):
        LLM(target, speculative_config={"model": str(no_text), "num_speculative_tokens": 2})
    bare = tmp_path / "bare"  # a draft of fewer rows without its tokenizer: nothing says how its ids read
    shutil.copytree(make_model(tmp_path / "small", "llama", words=SMALL_WORDS), bare)
    for f in bare.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ValueError, match=r"draft '.*bare' has 23 vocabulary rows.*its own tokenizer files"):
        LLM(target, speculative_config={"model": str(bare), "num_speculative_tokens": 2})


# -- llama.cpp ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf(models, small_pair, tmp_path_factory):
    """The pairs above as f32 GGUF files (each with its own tokenizer inside)."""
    from specdec.models.gguf import convert

    root = tmp_path_factory.mktemp("other_vocab_gguf")
    names = {"target": models["target"], "remapped": models["remapped"], "byte": models["byte"],
             "small_target": small_pair[0], "small_draft": small_pair[1]}
    return {name: convert(path, str(root / f"{name}.gguf"), "f32") for name, path in names.items()}


@pytest.mark.parametrize("draft, mapping", [("remapped", "string"), ("remapped", "intersection"), ("byte", "auto")])
def test_greedy_output_equals_plain_decoding_on_llamacpp(models, gguf, draft, mapping):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, [2, 7, 13], seed=6)]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = plain(gguf["target"], prompts, sp)
    llm = LLM(gguf["target"], speculative_config={"model": gguf[draft], "num_speculative_tokens": 4,
                                                  "adaptive": False, "draft_tokenizer_mapping": mapping})
    assert llm.backend == "llama.cpp" and llm.engine.drafter.runner.backend == "llama.cpp"
    for p, e, o in zip(prompts, expected, llm.generate(prompts, sp)):
        assert_greedy_equal(models["hf"], p["prompt_token_ids"], e, o.outputs[0].token_ids)
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0
    if draft == "remapped":
        assert m["mean_acceptance_length"] > 2.0, m


def test_intersection_samples_follow_the_target_distribution_on_llamacpp(small_pair, gguf):
    _, _, hf = small_pair
    prompt = [5, 9, 3]
    N = 2000
    llm = LLM(gguf["small_target"], speculative_config={"model": gguf["small_draft"], "num_speculative_tokens": 2,
                                                        "draft_tokenizer_mapping": "intersection"})
    assert llm.backend == "llama.cpp"
    sps = [SamplingParams(max_tokens=3, seed=1000 + i, ignore_eos=True, temperature=1.0) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, sps)
    assert_first_tokens_follow_target(hf, prompt, np.array([o.outputs[0].token_ids for o in outs]), sps[0],
                                      len(SMALL_WORDS) + 3)
    assert llm.get_metrics()["num_accepted_tokens"] > 0


def test_the_intersection_pairs_tokens_of_the_same_text(tmp_path):
    """The shipped target's byte-level BPE against a copy with fewer merges and every id renumbered:
    each draft token pairs with the target token of the same string (bytes of a character included)."""
    import json

    from specdec.drafters.vocab_map import VocabMap

    spec = json.loads((ASSETS / "demo-target" / "tokenizer.json").read_text())
    keep = len(spec["model"]["vocab"]) - 3000
    ids = shuffled(list(range(1, keep)), 3)
    spec["model"]["vocab"] = {s: ([0] + ids)[i] for s, i in spec["model"]["vocab"].items() if i < keep}
    spec["model"]["merges"] = spec["model"]["merges"][:-3000]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(ASSETS / "demo-target" / "tokenizer_config.json", tmp_path)
    target_tok = AutoTokenizer.from_pretrained(ASSETS / "demo-target")
    draft_tok = AutoTokenizer.from_pretrained(tmp_path)
    vm = VocabMap.build(target_tok, draft_tok, len(target_tok), len(draft_tok), "pair")
    tv = target_tok.get_vocab()
    assert vm.num_shared == len(draft_tok) and vm.coverage == 1.0
    assert all(int(vm.draft_to_target[d]) == tv[s] for s, d in draft_tok.get_vocab().items())
    assert int((vm.target_to_draft >= 0).sum()) == len(draft_tok)
