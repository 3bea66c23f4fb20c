"""Speculating with an EAGLE-3 head on the torch backend, through ``LLM``: the target's kept hidden
states against transformers' ``output_hidden_states``, the drafter's logits against a head run from
scratch over the whole history, greedy equality with plain decoding, exact sampled distributions,
batch-independent seeds, and heads that do not fit the target."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch

from lossless import assert_first_tokens_follow_target, assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.models import linear8
from specdec.models.base import ForwardBatch, ModelRunner
from specdec.models.eagle3 import Eagle3Config, Eagle3Head, save_head
from specdec.models.llama import LlamaRunner
from specdec.models.load import load_model
from test_drafters_lookup import make_repetitive_model
from tiny_models import make_model, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL_WORDS = [f"w{i}" for i in range(20)]  # V = 23: small enough for exact distribution tests
LAYERS = 4  # default layer ids [2, 2, 1]: repeated and out of order


def hf_config(target: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(target)


def make_head(target: str, out: Path, seed: int = 0, draft_vocab: int | None = None, **overrides) -> str:
    """A random head for ``target`` saved in the SpecForge layout (float32); ``draft_vocab``: a reduced
    draft vocabulary of that many random target ids."""
    c = Eagle3Config.for_target(hf_config(target), draft_vocab_size=draft_vocab)
    for name, value in overrides.items():
        setattr(c, name, value)
    torch.manual_seed(seed)
    head = Eagle3Head(c)
    if c.norm_before_fc:  # a weight that is not all ones: a runner that skipped it would show
        with torch.no_grad():
            head.input_norm.weight.uniform_(0.5, 1.5)
    if draft_vocab:
        ids = torch.randperm(c.vocab_size)[:draft_vocab].sort().values
        head.d2t = ids - torch.arange(draft_vocab)
        head.t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        head.t2d[ids] = True
    save_head(head, out, dtype=torch.float32)
    return str(out)


def make_copying_head(target: str, out: Path) -> str:
    """A head that drafts what a target whose next token follows its last one would: it ignores the
    target's states (hidden_norm = 0, norm before the residual), attends (almost) only to its own
    position, passes that token's normed embedding through, and reads it with the target's final norm
    and LM head. On a target whose next token follows its last one (``last_token_target``) most of its
    drafts are right."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target)
    cfg = hf.config
    D, H = cfg.hidden_size, cfg.num_attention_heads
    c = Eagle3Config.for_target(cfg)
    c.num_key_value_heads, c.norm_before_residual = H, True
    head = Eagle3Head(c)
    eye = torch.eye(D)
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        L = head.midlayer
        L.input_layernorm.weight.fill_(1.0)
        L.post_attention_layernorm.weight.fill_(1.0)
        L.self_attn.q_proj.weight[:, :D] = 3.0 * eye  # q = k = 3 * normed embedding: each query peaks on itself
        L.self_attn.k_proj.weight[:, :D] = 3.0 * eye
        L.self_attn.v_proj.weight[:, :D] = eye
        L.self_attn.o_proj.weight.copy_(eye)
        head.norm.weight.copy_(hf.model.norm.weight)
        head.lm_head.weight.copy_(hf.lm_head.weight)
    save_head(head, out, dtype=torch.float32)
    return str(out)


def last_token_target(folder: Path) -> str:
    """make_repetitive_model with its layers' outputs scaled to 0.005: the next token all but follows
    the last one (the head above agrees with its argmax at about 96% of positions)."""
    return make_repetitive_model(folder, scale=0.005, seed=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = str(make_model(root / "target", "llama", layers=LAYERS, seed=0, max_pos=512))
    return {"target": target, "hf": load_model(target).hf_model, "head": make_head(target, root / "head"),
            "head_small_vocab": make_head(target, root / "head_vd", seed=1, draft_vocab=40),
            "head_norm_before_fc": make_head(target, root / "head_nf", seed=2, draft_vocab=40, norm_before_fc=True)}


def spec(head: str, k: int = 4, **kw) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, **kw}


def reference_states(hf, tokens: list[int], layer_ids: list[int]) -> torch.Tensor:
    """transformers' inputs of layers ``layer_ids`` (hidden_states[i]) at every position, concatenated  [T, n * D]."""
    with torch.no_grad():
        hs = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in layer_ids], dim=-1)


def rewrite_move_copy_and_grow(r, check, hist: dict[str, list[int]]) -> None:
    """After rows a, b, c of runner ``r`` were fed ``hist``: a padded ragged pass, greedy_steps, a
    rollback that rewrites positions, rows that move, a copied prefix and a cache grown past its first
    256 positions, calling ``check(row, tokens)`` on the kept states after each (rows end as c, a, d)."""
    more = random_prompts(3, [3, 2, 3], seed=2)  # padded ragged: 8 of 9 real
    r.forward(ForwardBatch.from_rows(more, [len(h) for h in hist.values()]))
    for b, (n, m) in enumerate(zip("abc", more)):
        hist[n] = hist[n] + m
        check(b, hist[n])
    steps = r.greedy_steps([hist[n][-1] for n in "abc"], [len(hist[n]) - 1 for n in "abc"], 3)
    for b, (n, s) in enumerate(zip("abc", steps)):
        hist[n] = hist[n] + s[:-1]  # the last argmax is not fed
        check(b, hist[n])
    hist["b"] = hist["b"][:4] + [9, 10, 11]  # rollback: row b rewrites positions 4.. with other tokens
    r.forward(ForwardBatch.from_rows([[9, 10, 11]], [4], row_offset=1))
    check(1, hist["b"])
    r.sync_rows(["c", "a", "d"])  # c moves to row 0; b leaves; d is new
    check(0, hist["c"])
    check(1, hist["a"])
    r.copy_prefix(0, [2], 5)  # d takes c's first 5 positions
    check(2, hist["c"][:5])
    long = random_prompts(1, [300], seed=3)[0]  # past the first 256 positions: the cache grows, states too
    r.forward(ForwardBatch.from_rows([long[5:]], [5], row_offset=2))
    hist["d"] = hist["c"][:5] + long[5:]
    check(2, hist["d"])
    check(0, hist["c"])


# -- the target's kept hidden states ----------------------------------------------------------------


def test_kept_states_match_transformers_hidden_states(models):
    """Packed and padded ragged batches, greedy_steps, a rollback that rewrites positions, rows that
    move, a copied prefix, and a cache that grows past its first allocation."""
    hf, ids = models["hf"], [2, 3, 0]
    r = LlamaRunner(load_model(models["target"]))
    r.sync_rows(["plain"])
    r.forward(ForwardBatch.from_rows([[5, 6, 7]], [0]))
    assert r.cache.states is None  # nothing is kept unless asked
    r.keep_hidden_states(ids)
    assert r.can_keep_hidden_states and r.token_embedding().shape == hf.model.embed_tokens.weight.shape

    def check(row: int, tokens: list[int]):
        got = r.hidden_states(row, 0, len(tokens))
        assert torch.allclose(got, reference_states(hf, tokens, ids), atol=1e-4), (row, len(tokens))

    hist = {n: p for n, p in zip("abc", random_prompts(3, [7, 2, 12], seed=1))}
    r.sync_rows(list("abc"))
    r.forward(ForwardBatch.from_rows(list(hist.values()), [0, 0, 0]))  # packed (21 of 36 tokens real)
    for b, n in enumerate("abc"):
        check(b, hist[n])
    rewrite_move_copy_and_grow(r, check, hist)
    r.release()
    assert r.cache is None


def test_a_backend_that_cannot_keep_states_says_which_can(models):
    from specdec.drafters.eagle3 import Eagle3Drafter
    from specdec.models.eagle3 import load_head

    stub = types.SimpleNamespace(backend="llama.cpp", can_keep_hidden_states=False, device=torch.device("cpu"))
    stub.keep_hidden_states = lambda ids: ModelRunner.keep_hidden_states(stub, ids)
    hf = models["hf"]
    head = load_head(models["head"], hf.model.embed_tokens.weight.detach(), LAYERS)
    with pytest.raises(ValueError, match="backend='torch'"):
        Eagle3Drafter(head, stub)


# -- the drafter against a head run from scratch ------------------------------------------------------


@pytest.mark.parametrize("path,head_name", [("loop", "head_small_vocab"), ("greedy-fast-path", "head_small_vocab"),
                                            ("loop", "head_norm_before_fc")])
def test_draft_logits_equal_the_head_run_from_scratch(models, monkeypatch, path, head_name):
    """Every round (rejected drafts roll the head's KV back; ragged rows catch up together or alone;
    n=2 choices copy their prompt's target states), the drafter's logits for each draft equal
    ``Eagle3Head.step`` run over the whole history with transformers' hidden states, then chained over
    its own drafts; its drafts are their argmaxes. "loop": every draft through draft_autoregressive's
    loop (the logits are compared); "greedy-fast-path": the drafter's own argmax path, which builds no
    target-vocabulary logits (the drafts are compared).
    A norm_before_fc head: the drafter's runner normalizes the features before fc as the head does."""
    import specdec.drafters.eagle3 as eagle3

    calls = []
    real = eagle3.draft_autoregressive

    def recorded(logits, feed, seqs, num_draft, sb, draft_p_min=0.0, greedy_steps=None):
        rec = {"tokens": [list(s.token_ids) for s in seqs], "want": list(num_draft), "logits": [logits.clone()]}

        def fed(x, i):
            out = feed(x, i)
            rec["logits"].append(out.clone())
            return out

        rec["proposal"] = real(logits, fed, seqs, num_draft, sb, draft_p_min,
                               greedy_steps if path == "greedy-fast-path" else None)
        calls.append(rec)
        return rec["proposal"]

    if path == "loop":
        monkeypatch.setattr(eagle3, "argmax_drafts", lambda *args: False)
        monkeypatch.setattr(eagle3, "draft_autoregressive", recorded)
    # the head's products in the target's dtype: quantized ones are near these, not equal (test_compiled_head.py)
    llm = LLM(models["target"], backend="torch",
              speculative_config=spec(models[head_name], 3, adaptive=False, quantization="none"))
    drafter = llm.engine.drafter
    if path == "greedy-fast-path":
        propose = drafter.propose

        def proposed(seqs, num_draft, sb):
            rec = {"tokens": [list(s.token_ids) for s in seqs], "logits": [], "proposal": propose(seqs, num_draft, sb)}
            rec["want"] = list(rec["proposal"].num_draft_tokens)
            calls.append(rec)
            return rec["proposal"]

        monkeypatch.setattr(drafter, "propose", proposed)
    head = drafter.head
    assert head.config.norm_before_fc == (head_name == "head_norm_before_fc")
    ids = head.config.layer_ids
    copied = []  # a choice takes its prompt's head entries from its sibling
    share = drafter._copy_from_sibling
    monkeypatch.setattr(drafter, "_copy_from_sibling", lambda seqs, b: copied.append(share(seqs, b)) or copied[-1])
    prompts = random_prompts(3, [2, 9, 30], seed=5)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12, n=2,
                                                                            ignore_eos=True))
    rows_checked = 0
    for rec in calls:
        drafts = rec["proposal"].draft_token_ids
        for b, (tokens, want) in enumerate(zip(rec["tokens"], rec["want"])):
            if want == 0:
                continue
            L = len(tokens)
            feats = reference_states(models["hf"], tokens[: L - 1], ids)  # f_0..f_{L-2}
            x = torch.tensor([tokens[1:]])  # t_{p+1} at position p
            logits, g, k, v = head.step(x, head.fuse(feats[None]), torch.arange(L - 1)[None])
            want_logits = [logits[0, -1]]
            g = g[:, -1:]
            for j in range(1, rec["proposal"].num_draft_tokens[b]):
                logits, g, k2, v2 = head.step(drafts[b, j - 1].view(1, 1), g, torch.tensor([[L - 2 + j]]), k, v)
                k, v = torch.cat([k, k2], dim=2), torch.cat([v, v2], dim=2)
                want_logits.append(logits[0, -1])
            for j, w in enumerate(want_logits):
                expected = torch.full((llm.target.vocab_size,), float("-inf"))  # draft id i is target id i + d2t[i]
                expected[head.draft_to_target] = w
                assert int(drafts[b, j]) == int(expected.argmax()), (L, j)
                if j < len(rec["logits"]):
                    got = rec["logits"][j][b]
                    inside = torch.isfinite(expected)
                    assert torch.allclose(got[inside], expected[inside], atol=2e-3), (L, j)
                    assert (got[~inside] <= -1e29).all()  # outside the draft vocabulary: q = 0
            rows_checked += 1
    assert rows_checked >= 10
    c = head.config  # the scheduler's KV budget counts the head's KV and the target's kept states
    assert drafter.kv_bytes_per_token() == 2 * c.num_key_value_heads * c.head_dim * 4 + 3 * c.target_hidden_size * 4
    assert sorted(copied)[-2:] == [8, 29]  # the second choice of the 9- and 30-token prompts: P - 1 entries


# -- through LLM: greedy equality -----------------------------------------------------------------------


def plain_greedy(target: str, prompts, max_tokens: int, n: int = 1, dtype: str = "auto"):
    llm = LLM(target, backend="torch", dtype=dtype)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
    return [[c.token_ids for c in o.outputs] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


@pytest.mark.parametrize("config", [
    dict(k=1, adaptive=False), dict(k=2, adaptive=False), dict(k=3, adaptive=False), dict(k=5, adaptive=False),
    dict(k=4, adaptive=True), dict(k=4, enable_suffix_decoding=True, suffix_decoding_min_score=0.0),
    dict(k=4, method=["suffix", "eagle3"]), dict(k=4, adaptive=False, draft_p_min=0.02),
], ids=["k1", "k2", "k3", "k5", "adaptive", "suffix-in-front", "choice", "p-min"])
def test_greedy_output_equals_plain_decoding(models, config):
    config = dict(config)
    k = config.pop("k")
    prompts = random_prompts(4, [1, 5, 11, 23], seed=k)
    expected = plain_greedy(models["target"], prompts, 24, n=2)
    llm = LLM(models["target"], backend="torch", speculative_config=spec(models["head_small_vocab"], k, **config))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2))
    for p, e, o in zip(prompts, expected, outs):
        for ec, c in zip(e, o.outputs):
            assert_greedy_equal(models["hf"], p, ec, c.token_ids)
    if "method" not in config:  # the choice may rule the random head out
        assert llm.get_metrics()["num_draft_tokens"] > 0


def test_penalties_and_tokens_outside_the_draft_vocabulary(models):
    """Greedy with penalties equals plain decoding; a request allowed only tokens the head cannot draft
    still gets a distribution (q spreads over them, the OFF_VOCAB floor) and stays within them."""
    from safetensors import safe_open

    with safe_open(str(Path(models["head_small_vocab"]) / "model.safetensors"), framework="pt") as f:
        d2t = f.get_tensor("d2t")
    inside = (torch.arange(len(d2t)) + d2t).tolist()
    outside = [t for t in range(3, 123) if t not in inside][:6]
    prompts = random_prompts(3, [3, 8, 13], seed=7)
    penalties = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    cases = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **penalties),
             SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, allowed_token_ids=outside),
             SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, allowed_token_ids=outside)]
    plain = LLM(models["target"], backend="torch")
    llm = LLM(models["target"], backend="torch", speculative_config=spec(models["head_small_vocab"], 3, adaptive=False))
    for sp in cases:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        if sp.temperature == 0:
            expected = plain.generate([{"prompt_token_ids": p} for p in prompts], sp)
            for p, e, o in zip(prompts, expected, outs):
                assert_greedy_equal(models["hf"], p, e.outputs[0].token_ids, o.outputs[0].token_ids)
        if sp.allowed_token_ids:
            assert all(t in outside for o in outs for t in o.outputs[0].token_ids)
    assert llm.get_metrics()["num_draft_tokens"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
def test_a_head_that_agrees_with_the_target_is_accepted(tmp_path, dtype):
    """bfloat16: the head's products run in bf16 beside a bf16 target; int8, int4: quantized beside it (int4:
    the default where specdec's VNNI kernel runs)."""
    quantization = dtype if dtype in ("int8", "int4") else "none"
    if quantization != "none":
        can = linear8.available(int(quantization[3:]))
        if not can.ok:
            pytest.skip(f"the {quantization} kernel cannot run here: {can.reason}")
        dtype = "bfloat16"
    target = last_token_target(tmp_path / "target")
    head = make_copying_head(target, tmp_path / "head")
    hf = load_model(target).hf_model
    if dtype == "bfloat16":
        hf = hf.to(torch.bfloat16)
    prompts = random_prompts(3, [4, 9, 17], seed=2)
    expected = plain_greedy(target, prompts, 30, dtype=dtype)
    llm = LLM(target, backend="torch", dtype=dtype,
              speculative_config=spec(head, 4, adaptive=False, quantization=quantization))
    w = llm.engine.drafter.runner.w
    if quantization != "none":
        assert w.qkv.kind == w.lm_head.kind == {"int8": "w8", "int4": "w4"}[quantization]
        assert w.fc.dtype == torch.bfloat16
    else:
        assert w.qkv.dtype == getattr(torch, dtype)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_equal(hf, p, e[0], o.outputs[0].token_ids)
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0 and m["acceptance_rate"] > 0.5, m


# -- sampled outputs -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_small")
    target = str(make_model(root / "t", "llama", words=SMALL_WORDS, seed=3, init_std=0.5))  # as test_engine.py's
    head = make_head(target, root / "head", seed=2, draft_vocab=18)  # 5 of 23 tokens it never drafts
    return target, head, load_model(target).hf_model


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=4),
    dict(temperature=1.0, top_p=0.7),
], ids=["t1", "topk", "topp"])
def test_sampled_outputs_follow_the_target_distribution(small_vocab, params):
    target, head, hf = small_vocab
    check_sampled_outputs(target, head, hf, "torch", params)


def check_sampled_outputs(target: str, head: str, hf, backend: str, params: dict) -> None:
    """3,000 seeded requests on ``backend`` with the head drafting 2 tokens: the first tokens follow
    the target's distribution (chi-square), and drafts were proposed and accepted."""
    prompt = [5, 9, 3]
    N = 3000
    llm = LLM(target, backend=backend, speculative_config=spec(head, 2, adaptive=False))
    sps = [SamplingParams(max_tokens=3, seed=1000 + i, ignore_eos=True, **params) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, sps)
    tokens = np.array([o.outputs[0].token_ids for o in outs])  # [N, 3]
    assert_first_tokens_follow_target(hf, prompt, tokens, sps[0], len(SMALL_WORDS) + 3)
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] > 0  # the drafts did get used


def test_a_seeded_request_gives_the_same_output_alone_and_in_a_batch(tmp_path, monkeypatch):
    from test_seeds import assert_same_or_near_tie, prompts, run_alone, run_in_batch

    target = last_token_target(tmp_path / "target")
    cfg = spec(make_copying_head(target, tmp_path / "head"), 3, adaptive=False)
    prompt, others = prompts()
    alone, metrics, margins = run_alone(target, cfg, prompt, monkeypatch)
    assert metrics["num_draft_tokens"] > 0 and metrics["num_accepted_tokens"] > 0
    batched = run_in_batch(target, cfg, prompt, others)
    assert_same_or_near_tie(alone, batched, margins, "eagle3")


# -- heads that do not fit ----------------------------------------------------------------------------


def test_a_head_for_another_target_is_a_value_error(models, tmp_path):
    target = models["target"]
    narrow = str(make_model(tmp_path / "narrow", "llama", layers=LAYERS, hidden=32))
    other_words = str(make_model(tmp_path / "words", "llama", layers=LAYERS, words=SMALL_WORDS))
    deeper = str(make_model(tmp_path / "deeper", "llama", layers=8))
    cases = [(make_head(narrow, tmp_path / "h_narrow"), "hidden states of size 32"),
             (make_head(other_words, tmp_path / "h_words"), "vocabulary of 23 tokens"),
             (make_head(deeper, tmp_path / "h_deeper"), r"reads target layers \[2, 4, 5\]")]
    for head, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(target, backend="torch", speculative_config=spec(head))


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_a_head_folder_without_its_files_says_which_is_missing(models, tmp_path, missing):
    import shutil

    head = tmp_path / "head"
    shutil.copytree(models["head"], head)
    (head / missing).unlink()
    with pytest.raises(ValueError, match=missing):
        LLM(models["target"], backend="torch", speculative_config=spec(str(head)))


def test_norm_before_fc_is_read_where_the_formats_write_it_and_old_heads_load_as_before(models, tmp_path):
    """A config without ``norm_before_fc`` (every head before it) makes the same head as before: no
    input_norm tensor, fuse = fc. The key is read at the top level and in ``eagle_config`` (vLLM reads both);
    a head that has it but lacks ``input_norm.weight`` is refused by name."""
    import json

    from specdec.models.eagle3 import Eagle3Head, load_head, read_config

    hf = models["hf"]
    emb, n = hf.get_input_embeddings().weight.detach(), hf.config.num_hidden_layers
    old = load_head(models["head"], emb, n)
    assert "norm_before_fc" in json.loads((Path(models["head"]) / "config.json").read_text())  # written False
    cfg = json.loads((Path(models["head"]) / "config.json").read_text())
    del cfg["norm_before_fc"]
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(cfg))
    (plain / "model.safetensors").symlink_to(Path(models["head"]) / "model.safetensors")
    head = load_head(plain, emb, n)
    assert not head.config.norm_before_fc and not hasattr(head, "input_norm")
    assert set(head.state_dict()) == set(old.state_dict())
    x = torch.randn(3, 3 * head.config.target_hidden_size)
    torch.testing.assert_close(head.fuse(x), head.fc(x))

    for where in ("top", "eagle_config"):
        c2 = dict(cfg, **({"norm_before_fc": True} if where == "top" else
                          {"eagle_config": {**cfg["eagle_config"], "norm_before_fc": True}}))
        d = tmp_path / where
        d.mkdir()
        (d / "config.json").write_text(json.dumps(c2))
        assert read_config(d).norm_before_fc
        assert "input_norm.weight" in Eagle3Head(read_config(d)).state_dict()
        (d / "model.safetensors").symlink_to(Path(models["head"]) / "model.safetensors")
        with pytest.raises(ValueError, match="input_norm.weight"):
            load_head(d, emb, n)
