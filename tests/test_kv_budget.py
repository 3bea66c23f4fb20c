"""The scheduler's KV budget counts every cache a drafter keeps (``Drafter.kv_use``): per drafter, requests
run under a budget that holds two of them, and after every step the real tensors (the target's KV and
kept states, each drafter cache) hold no more than the budget reserves, which never exceeds the budget."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.models.kv_cache import KVCache
from specdec.tree import TreeShape
from test_eagle3 import make_head
from tiny_models import make_byte_tokenizer, make_model, perturbed_copy, random_prompts, remapped_copy

pytestmark = pytest.mark.usefixtures("one_thread")

K = 3
LENGTHS = [5, 209, 40, 12]  # prompt tokens; 209 + MAX_TOKENS + a verify pass nearly fill 256 target positions
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A word-level target with room for long rows; a close draft of its vocabulary; a draft with its
    words under other ids; a byte-level draft (several draft tokens per target token); an EAGLE-3 head."""
    root = tmp_path_factory.mktemp("kv_budget")
    target = make_model(root / "target", "llama", max_pos=1024, layers=4)
    make_byte_tokenizer(root / "byte_tok")
    return {"target": str(target), "draft": str(perturbed_copy(target, root / "draft", 0.01)),
            "remapped": str(remapped_copy(target, root / "remapped", [f"w{i}" for i in reversed(range(120))])),
            "byte": str(make_model(root / "byte", "llama", layers=1, seed=5, max_pos=2048,
                                   tokenizer_from=root / "byte_tok")),
            "head": make_head(str(target), root / "head")}


def cache_bytes(cache: KVCache | None) -> int:
    if cache is None:
        return 0
    return cache.k.nbytes + cache.v.nbytes + (cache.states.nbytes if cache.states is not None else 0)


def drafter_caches(drafter) -> list[KVCache]:
    """The KV caches a drafter holds now: its runner's (a draft model's, an EAGLE-3 head's), its members'."""
    if drafter is None:
        return []
    if hasattr(drafter, "parts"):  # ChoosingDrafter
        return [c for part in drafter.parts.values() for c in drafter_caches(part.drafter)]
    if hasattr(drafter, "suffix") and hasattr(drafter, "model"):  # HybridDrafter
        return drafter_caches(drafter.model)
    runner = getattr(drafter, "runner", None)
    return [runner.cache] if runner is not None and runner.cache is not None else []


def run_under_budget(llm: LLM, rows: int = 2) -> dict:
    """Every request of LENGTHS under a budget of ``rows`` rows of the longest, stepped one round at a
    time; after each round the bytes the caches hold are checked against the budget."""
    engine = llm.engine
    sched = engine.scheduler
    assert sched.drafter is engine.drafter  # the budget asks the drafter what its caches hold
    drafter_bytes = sum(u.bytes_per_position for u in engine.drafter.kv_use(K)) if engine.drafter else 0
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    kv = sched.limit(kv_cache_memory=0)
    need = kv.bytes_for(rows, max(kv.positions(n, MAX_TOKENS) for n in LENGTHS))
    kv = sched.limit(kv_cache_memory=need)
    for p in random_prompts(len(LENGTHS), LENGTHS, seed=3):
        engine.add_request(p, sp)
    most_rows = most_held = drafter_held = steps = 0
    old_style = 0.0  # held / what a budget of bytes per target position (the drafter's per position too) reserves
    while engine.has_unfinished():
        engine.step()
        steps += 1
        held = cache_bytes(engine.target.cache) + sum(cache_bytes(c) for c in drafter_caches(engine.drafter))
        assert kv.reserved <= kv.budget, "admitted past the budget"
        assert held <= kv.reserved, f"step {steps}: caches hold {held} bytes, the budget reserves {kv.reserved}"
        most_rows = max(most_rows, len(engine.running))
        most_held = max(most_held, held)
        drafter_held = max(drafter_held, sum(cache_bytes(c) for c in drafter_caches(engine.drafter)))
        per_position = kv.peak_rows * kv.peak_len * (engine.target.kv_bytes_per_token() + drafter_bytes)
        old_style = max(old_style, held / per_position) if per_position else old_style
        assert steps < 2000
    assert most_rows == rows  # the budget bound admission
    return {"held": most_held, "drafter_held": drafter_held, "old_style": old_style,
            "drafted": llm.get_metrics()["num_draft_tokens"]}


def spec(**kw) -> dict:
    return {"num_speculative_tokens": K, "adaptive": False, "draft_tree": "chain", **kw}


@pytest.mark.parametrize("config, past_old_budget", [
    (spec(method="draft_model", model="draft"), False),
    (spec(method="draft_model", model="draft", draft_tree="tree", draft_tree_max_nodes=6, draft_tree_top_k=3), False),
    (spec(method="draft_model", model="remapped", draft_tokenizer_mapping="intersection"), False),
    (spec(method="draft_model", model="byte", draft_tokenizer_mapping="string"), True),  # several tokens per token
    (spec(method="eagle3", model="head"), False),
    (spec(method="eagle3", model="head", draft_tree="tree", draft_tree_max_nodes=6, draft_tree_top_k=3), True),
    (spec(method="layer_skip", num_draft_layers=1), False),
    (spec(method="ngram", prompt_lookup_min=1), False),
    (spec(method="suffix"), False),
    (spec(method="draft_model", model="draft", enable_suffix_decoding=True), False),
    (spec(method=["ngram", "draft_model"], model="draft"), False),
], ids=lambda c: "-".join(str(v) for v in (c["method"], c.get("model"), c["draft_tree"],
                                             c.get("enable_suffix_decoding") and "suffix") if v)
    if isinstance(c, dict) else "")
def test_the_budget_covers_what_the_caches_hold(models, config, past_old_budget):
    """``past_old_budget``: the caches held more than a budget of bytes per target position (the
    drafter's per position beside the target's) reserved: the head's tree slots (a candidate pool
    past the history) and the byte-level draft's spelling."""
    config = dict(config)
    if "model" in config:
        config["model"] = models[config["model"]]
    llm = LLM(models["target"], max_num_seqs=4, speculative_config=config)
    out = run_under_budget(llm)
    assert out["drafted"] > 0  # the drafter ran: its caches and extra positions were exercised
    keeps_kv = config["method"] == "eagle3" or "draft_model" in config["method"]
    assert (out["drafter_held"] > 0) == keeps_kv
    assert (out["old_style"] > 1) == past_old_budget, out


def test_what_the_drafters_say_they_hold(models):
    """The byte-level draft spells a target token " w12" in several tokens and counts that many per
    token, plus its 2k + 2 string steps, its BOS and a padding position; the EAGLE-3 head reserves a
    tree's candidate pool past the history; a draft model a tree pass's block."""
    llm = LLM(models["target"], speculative_config=spec(method="draft_model", model=models["byte"],
                                                        draft_tokenizer_mapping="string"))
    (use,) = llm.engine.drafter.kv_use(K)
    assert use.per_token == llm.engine.drafter.draft_tokens_per_token() > 2 and use.extra == 2 * K + 2 + 2
    tree = TreeShape(6, K, 3)
    head, states = LLM(models["target"], speculative_config=spec(method="eagle3", model=models["head"])
                       ).engine.drafter.kv_use(K, tree)
    assert head.extra == 3 + (K - 1) * 9 + 1 and states.extra == 6 + 1  # pool, and the target's verify pass
    (draft,) = LLM(models["target"], speculative_config=spec(method="draft_model", model=models["draft"])
                   ).engine.drafter.kv_use(K, tree)
    assert draft.extra == max(6, 3 * (K - 1)) + 1 and draft.per_token == 1


def test_a_view_past_its_share_drafts_nothing(models):
    """A row whose history the draft spells in more tokens than the budget counts for it drafts nothing
    (its cache never outgrows the budget); the others still draft."""
    from specdec.drafters.other_vocab import OtherVocabDrafter

    llm = LLM(models["target"], max_num_seqs=4, speculative_config=spec(method="draft_model", model=models["byte"],
                                                                        draft_tokenizer_mapping="string"))
    drafter = llm.engine.drafter
    assert isinstance(drafter, OtherVocabDrafter)
    drafter._per_token = 1.0  # as if the budget counted one draft token per target token
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in random_prompts(2, [30, 30], seed=4)], sp)
    assert llm.get_metrics()["num_draft_tokens"] == 0
    assert drafter.runner.cache is None  # never fed: nothing cached
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


@pytest.fixture(scope="module")
def ggufs(models, tmp_path_factory):
    from specdec.models.gguf import convert

    root = tmp_path_factory.mktemp("kv_budget_gguf")
    return {name: convert(models[name], str(root / f"{name}.gguf"), "f32") for name in ("target", "draft")}


def llamacpp_held(llm: LLM) -> int:
    """Bytes the caches of a llama.cpp target hold now: its KV cells, its kept layer inputs (EAGLE-3),
    and the drafter's (a llama.cpp draft's cells, a head's torch KV)."""
    target, drafter = llm.engine.target, llm.engine.drafter
    held = target.cells * target.kv_bytes_per_token() + (target.states.nbytes if target.states is not None else 0)
    runner = drafter.runner
    if hasattr(runner, "cells"):
        return held + runner.cells * runner.kv_bytes_per_token()
    return held + cache_bytes(runner.cache)


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_llamacpp_caches_stay_within_their_budget(models, ggufs, method):
    """llama.cpp's one pool of KV cells doubles as rows grow, and the kept layer inputs an EAGLE-3 head
    reads double in length for every sequence id; under a budget each stops at the budget's share
    (Engine sets ``max_cache_positions``): after every step the caches hold no more than the budget
    (plus one cache step of every cache), and the outputs equal plain decoding's."""
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    prompts = random_prompts(6, [380, 370, 375, 385, 372, 378], seed=2)  # 512 positions a row (budget steps)
    expected = [o.outputs[0].token_ids for o in LLM(ggufs["target"], backend="llama.cpp").generate(
        [{"prompt_token_ids": p} for p in prompts], sp)]
    model = ggufs["draft"] if method == "draft_model" else models["head"]
    llm = LLM(ggufs["target"], backend="llama.cpp", max_num_seqs=6, speculative_config={
        "method": method, "model": model, "num_speculative_tokens": K, "adaptive": False})
    kv = llm.engine.limit_admission(0, None)
    budget = 5 * kv.bytes_for(1, 512)  # five rows of 512 positions: past 2048 cells, short of six rows
    kv = llm.engine.limit_admission(budget, None)
    assert llm.engine.target.max_cache_positions == budget // kv.bytes_per_token
    slack = llm.engine.target.cache_step * kv.bytes_per_token
    seqs = [s for p in prompts for s in llm.engine.add_group([(p, sp, None)])]
    most = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        most = max(most, llamacpp_held(llm))
    assert most <= budget + slack, (most, budget)
    assert most > 0.8 * budget  # the rows did fill it
    assert [s.token_ids[s.num_prompt_tokens:] for s in seqs] == expected
