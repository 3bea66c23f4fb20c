"""The EAGLE-3 head inside llama.cpp (models/llamacpp_head.py, converted by models/gguf_eagle3.py): the
file llama.cpp's own loader reads, its passes against the torch head's (HeadRunner) on the same
features, greedy output equal to plain decoding, the same drafts as the torch head, and sampled
outputs that follow the target's distribution."""

from __future__ import annotations

import pytest
import torch

import llama_cpp  # noqa: F401  (a required dependency: a missing build fails here, not as skips)

from lossless import assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.drafters.eagle3 import HeadRunner
from specdec.models import llamacpp_ext
from specdec.models.base import ForwardBatch
from specdec.models.eagle3 import load_head
from specdec.models.gguf import convert, read_info
from specdec.models.llamacpp_head import LlamaCppHead, describe_head
from specdec.models.load import load_model, load_runner
from test_eagle3 import check_sampled_outputs, make_head
from test_eagle3_llamacpp import SMALL_WORDS
from tiny_models import make_model, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 4
F32_TOL = 2e-4  # f32 file against the float32 torch head: the same products in another order (atol and rtol)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_ggml")
    target = str(make_model(root / "target", "llama", layers=LAYERS, seed=0, max_pos=1024))
    return {"target": target, "gguf": convert(target, str(root / "target.gguf"), "f32"),
            "bf16": convert(target, str(root / "target-bf16.gguf"), "bf16"),
            "hf": load_model(target).hf_model,
            "head": make_head(target, root / "head", seed=1, draft_vocab=40),
            # the variants' other tensors and graph branches: input_norm before fc, the normed residual
            "head_normed": make_head(target, root / "head_normed", seed=4, draft_vocab=40, norm_before_fc=True,
                                     norm_before_residual=True),
            "root": root}


def spec(head: str, k: int = 4, **kw) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, **kw}


def both_runners(models, head_dir: str, gguf: str = "gguf", dtype=torch.float32):
    """The llama.cpp target, the head loaded for it, the torch head and the head in llama.cpp."""
    target, _ = load_runner(models[gguf], "llama.cpp")
    emb = target.token_embedding()
    head = load_head(head_dir, emb, target.num_layers, emb.shape[0])
    return target, head, HeadRunner(head, dtype, torch.device("cpu")), LlamaCppHead(head, target)


# -- the file ---------------------------------------------------------------------------------------------


def test_specdec_convert_writes_a_head_llama_cpps_loader_reads_as_eagle3(models, tmp_path):
    path = convert(models["head_normed"], str(tmp_path / "head.gguf"), "bf16")  # what `specdec convert` calls
    info = read_info(path)
    assert info.architecture == "eagle3" and info.weight_type == "BF16"
    lib = llama_cpp
    model = lib.llama_model_load_from_file(path.encode(), lib.llama_model_default_params())
    assert model, "llama.cpp's loader refused the converted head"
    try:
        fn = llamacpp_ext.head_functions()
        assert fn["target_layer_ids_n"](model) == 3
        assert lib.llama_model_n_embd(model) == 64 and lib.llama_model_n_layer(model) == 1
        assert lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model)) == read_info(models["gguf"]).vocab_size
    finally:
        lib.llama_model_free(model)
    with pytest.raises(ValueError, match="converts to one of"):
        convert(models["head"], str(tmp_path / "q.gguf"), "q4_k_m")


# -- its passes against the torch head's -------------------------------------------------------------------


@pytest.mark.parametrize("head", ["head", "head_normed"])
def test_the_heads_passes_in_llama_cpp_match_the_torch_heads(models, head):
    """fuse (the encoder), a catch-up step over 150 positions of the target's real states asking one query
    per row (rows ragged, one query in the middle of a llama.cpp ubatch), a step returning every query,
    chain steps of two rows at different positions after a rollback: logits and g as the torch head's."""
    target, h, ref, nat = both_runners(models, models[head])
    assert nat.describe().startswith("EAGLE-3 head in llama.cpp")
    prompts = random_prompts(2, [151, 40], seed=3)
    target.keep_hidden_states(h.config.layer_ids)
    target.sync_rows(["a", "b"])
    target.forward(ForwardBatch.from_rows(prompts, [0, 0]))
    n = [150, 39]
    feats = torch.zeros(2, 150, nat.fc.in_features)  # [B, T, 3 Dt]
    ids = torch.zeros(2, 150, dtype=torch.long)
    for b in range(2):
        feats[b, : n[b]] = target.hidden_states(b, 0, n[b])
        ids[b, : n[b]] = torch.tensor(prompts[b][1 : n[b] + 1])
    real = torch.arange(150)[None] < torch.tensor(n)[:, None]  # [B, T]
    pos = torch.minimum(torch.arange(150)[None], torch.tensor(n)[:, None] - 1)
    fused = ref.fuse(feats)
    torch.testing.assert_close(nat.fuse(feats), fused, rtol=F32_TOL, atol=F32_TOL)
    for r in (ref, nat):
        r.reserve(2, 256)
        assert r.rows.sync(["a", "b"], r.cache) == [True, True]
    got = nat.step(ids, fused, [0, 1], pos, real, query_at=torch.tensor(n) - 1)
    want = ref.step(ids, fused, [0, 1], pos, real, query_at=torch.tensor(n) - 1)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=F32_TOL, atol=F32_TOL)
    # every query of row b, positions 30..38 rewritten (rollback) with other tokens
    other = torch.randint(0, h.config.vocab_size, (1, 9))
    at = torch.arange(30, 39)[None]
    got = nat.step(other, fused[1:, 30:39], [1], at)
    want = ref.step(other, fused[1:, 30:39], [1], at)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=F32_TOL, atol=F32_TOL)
    x, state = torch.tensor([5, 7]), got[1][0, -1:].expand(2, -1).contiguous()  # [B], [B, D]
    for i in range(3):  # rows out of order, at positions 150 + i and 39 + i
        got = nat.chain_step(x, state, [1, 0], [39 + i, 150 + i])
        want = ref.chain_step(x, state, [1, 0], [39 + i, 150 + i])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=F32_TOL, atol=F32_TOL)
        x, state = want[0].argmax(dim=-1), want[1]


def test_a_bf16_head_in_llama_cpp_is_as_close_as_the_bf16_torch_heads(models):
    """Beside a bf16 target the head's file is bf16 (as HeadRunner's products): its logits sit as close to
    the float32 torch head's as the bf16 torch head's do (within 2x, or 2%); a q8_0 file within 5%."""
    target, h, ref32, nat = both_runners(models, models["head"], "bf16")
    ref16 = HeadRunner(h, torch.bfloat16, torch.device("cpu"))
    assert nat.weight_type == "bf16"
    torch.manual_seed(0)
    feats = torch.randn(1, 20, nat.fc.in_features)
    ids = torch.randint(0, h.config.vocab_size, (1, 20))
    pos = torch.arange(20)[None]
    out = {}
    q8 = LlamaCppHead(h, target, weight_type="q8_0")
    for name, r in (("f32", ref32), ("torch-bf16", ref16), ("llama.cpp", nat), ("q8_0", q8)):
        r.reserve(1, 64)
        r.rows.sync(["a"], r.cache)
        out[name] = r.step(ids, r.fuse(feats), [0], pos)[0]  # [1, T, Vd]

    def err(x: torch.Tensor) -> float:
        return float((x - out["f32"]).norm() / out["f32"].norm())

    assert err(out["llama.cpp"]) < max(0.02, 2 * err(out["torch-bf16"]))
    assert 0 < err(out["q8_0"]) < 0.05  # a q8_0 file (an option: half bf16's bytes) rounds more, not much more


def test_trees_are_refused_with_the_backend_that_drafts_them(models):
    _, h, _, nat = both_runners(models, models["head"])
    nat.reserve(1, 16)
    nat.rows.sync(["a"], nat.cache)
    with pytest.raises(ValueError, match="backend='torch'"):
        nat.step(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, h.config.hidden_size), [0],
                 torch.arange(2)[None], visible=torch.ones(1, 2, 2, dtype=torch.bool))


# -- through LLM ----------------------------------------------------------------------------------------------


def test_the_eagle3_drafter_runs_the_head_in_llama_cpp_beside_a_llama_cpp_target_only(models):
    cpp = LLM(models["gguf"], backend="llama.cpp", speculative_config=spec(models["head"]))
    assert isinstance(cpp.engine.drafter.runner, LlamaCppHead)
    assert "llama.cpp" in describe_head(cpp.engine.drafter.runner)
    torch_llm = LLM(models["target"], backend="torch", enforce_eager=True, speculative_config=spec(models["head"]))
    assert isinstance(torch_llm.engine.drafter.runner, HeadRunner)
    assert "torch" in describe_head(torch_llm.engine.drafter.runner)


@pytest.mark.parametrize("config", [dict(k=1, adaptive=False), dict(k=4, adaptive=False), dict(k=4, adaptive=True)],
                         ids=["k1", "k4", "adaptive"])
def test_greedy_output_equals_plain_decoding(models, config):
    """Ragged prompts, n=2 choices (a prompt's head entries copied between them), a history past the
    first KV cells (the head's context grows): outputs equal plain decoding on llama.cpp."""
    config = dict(config)
    k = config.pop("k")
    prompts = random_prompts(4, [1, 5, 11, 600], seed=k)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    expected = LLM(models["gguf"], backend="llama.cpp").generate(reqs, sp)
    llm = LLM(models["gguf"], backend="llama.cpp", speculative_config=spec(models["head"], k, **config))
    assert isinstance(llm.engine.drafter.runner, LlamaCppHead)
    outs = llm.generate(reqs, sp)
    for p, e, o in zip(prompts, expected, outs):
        for ec, c in zip(e.outputs, o.outputs):
            assert_greedy_equal(models["hf"], p, ec.token_ids, c.token_ids)
    assert llm.get_metrics()["num_draft_tokens"] > 0
    assert llm.engine.drafter.runner.cells > 1024  # the 600-token rows grew the head's context


def test_the_head_in_llama_cpp_drafts_what_the_torch_head_drafts(tmp_path):
    """On a target whose next token all but follows its last one, with a head that copies it (most drafts
    accepted): the same drafts proposed and accepted, round by round, as the float32 torch head's."""
    from test_eagle3 import last_token_target, make_copying_head

    target = last_token_target(tmp_path / "target")
    head = make_copying_head(target, tmp_path / "head")
    gguf = convert(target, str(tmp_path / "target.gguf"), "f32")
    prompts = random_prompts(3, [4, 9, 30], seed=2)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    drafts = {}
    for name in ("llama.cpp", "torch"):
        llm = LLM(gguf, backend="llama.cpp", speculative_config=spec(head, 3, adaptive=False))
        d = llm.engine.drafter
        if name == "torch":
            d.runner = HeadRunner(d.head, torch.float32, d.device)
        assert isinstance(d.runner, LlamaCppHead) == (name == "llama.cpp")
        seen = []
        propose = d.propose

        def record(seqs, num_draft, sb, _propose=propose, _seen=seen):
            out = _propose(seqs, num_draft, sb)
            _seen.append(out.draft_token_ids.tolist())
            return out

        d.propose = record
        llm.generate(reqs, sp)
        m = llm.get_metrics()
        drafts[name] = (seen, m["num_draft_tokens"], m["num_accepted_tokens"])
    assert drafts["llama.cpp"][2] > drafts["llama.cpp"][1] / 2  # most drafts accepted
    assert drafts["llama.cpp"] == drafts["torch"]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_ggml_small")
    target = str(make_model(root / "t", "llama", words=SMALL_WORDS, seed=3, init_std=0.5))
    head = make_head(target, root / "head", seed=2, draft_vocab=18)  # 5 of 23 tokens it never drafts
    return convert(target, str(root / "t.gguf"), "f32"), head, load_model(target).hf_model


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_k=4)], ids=["t1", "topk"])
def test_sampled_outputs_follow_the_target_distribution(small_vocab, params, monkeypatch):
    """The head in llama.cpp gives q over the target's vocabulary (zero off the draft vocabulary) as the
    torch head does: 3,000 seeded requests' first tokens follow the target's distribution (chi-square)."""
    target, head, hf = small_vocab
    built = []
    real = LlamaCppHead.__init__

    def init(self, *args, **kwargs):
        built.append(self)
        real(self, *args, **kwargs)

    monkeypatch.setattr(LlamaCppHead, "__init__", init)
    check_sampled_outputs(target, head, hf, "llama.cpp", params)
    assert len(built) == 1  # the head ran in llama.cpp


def test_draft_distributions_equal_the_torch_heads(models):
    """One sampled round's drafts and q (the draft distribution over the target's vocabulary) from the head
    in llama.cpp equal the float32 torch head's, row by row (same seeds)."""
    from specdec.drafters.eagle3 import Eagle3Drafter
    from specdec.sampling import SamplingBatch, make_generator
    from specdec.sequence import Sequence

    target, h, ref, nat = both_runners(models, models["head"])
    prompts = random_prompts(2, [12, 7], seed=9)
    target.keep_hidden_states(h.config.layer_ids)
    target.sync_rows([0, 1])
    target.forward(ForwardBatch.from_rows([p[:-1] for p in prompts], [0, 0]))
    params = [SamplingParams(temperature=1.0, max_tokens=8), SamplingParams(temperature=0.7, top_k=20, max_tokens=8)]
    out = []
    for runner in (ref, nat):
        d = Eagle3Drafter(h, target)
        d.runner = runner
        seqs = []
        for i, p in enumerate(prompts):
            s = Sequence(list(p), params[i], make_generator(100 + i), max_len=512, seq_id=i)
            s.num_computed = len(p) - 1
            seqs.append(s)
        out.append(d.propose(seqs, [3, 3], SamplingBatch.from_params(params)))
    a, b = out
    assert a.num_draft_tokens == b.num_draft_tokens == [3, 3]
    assert a.draft_token_ids.tolist() == b.draft_token_ids.tolist()
    torch.testing.assert_close(b.draft_probs, a.draft_probs, rtol=1e-3, atol=1e-6)


def test_a_grown_context_keeps_the_rows_entries_and_release_forgets_them(models):
    """The head's cells are sized as HeadRunner's cache (rows x the longest row in steps of 256); growing
    them (a new llama.cpp context) carries every row's entries over: the next step reads them as the
    torch head's does. release() forgets the rows."""
    _, h, ref, nat = both_runners(models, models["head"])
    torch.manual_seed(5)
    ids, hidden = torch.randint(0, h.config.vocab_size, (2, 10)), torch.randn(2, 10, h.config.hidden_size)
    for r in (ref, nat):
        r.reserve(2, 16)
        r.rows.sync(["a", "b"], r.cache)
        r.step(ids, hidden, [0, 1], torch.arange(10)[None].expand(2, 10).contiguous())
    assert nat.cells == 2 * 256
    for r in (ref, nat):
        r.reserve(3, 600)
        assert r.rows.sync(["b", "a", "c"], r.cache) == [False, False, True]
    assert nat.cells == 3 * 768
    x, g = torch.tensor([3, 4]), torch.randn(2, h.config.hidden_size)
    for got, want in zip(nat.chain_step(x, g, [0, 1], [10, 10]), ref.chain_step(x, g, [0, 1], [10, 10])):
        torch.testing.assert_close(got, want, rtol=F32_TOL, atol=F32_TOL)
    nat.release()
    assert nat.rows.sync(["a"], nat.cache) == [True]
