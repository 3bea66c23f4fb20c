"""EAGLE-3 on the llama.cpp backend: the layer inputs llama.cpp copies out of each decode (kept per
sequence and position by LlamaCppRunner) against transformers' ``output_hidden_states``, the token
embedding, what the drafter reads in a real run, greedy equality with plain decoding on llama.cpp,
exact sampled distributions, and the errors where llama.cpp cannot give the states."""

from __future__ import annotations

import pytest
import torch

# a required dependency (built by `make install`): a missing or broken build fails here, not as skips
import llama_cpp  # noqa: E402, F401

from lossless import assert_greedy_equal  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.models import llamacpp_ext  # noqa: E402
from specdec.models.base import ForwardBatch  # noqa: E402
from specdec.models.gguf import convert  # noqa: E402
from specdec.models.load import load_model, load_runner  # noqa: E402
from test_eagle3 import check_sampled_outputs, make_head, reference_states, rewrite_move_copy_and_grow  # noqa: E402
from tiny_models import make_model, random_prompts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL_WORDS = [f"w{i}" for i in range(20)]  # V = 23: small enough for exact distribution tests
LAYERS = 4  # default layer ids [2, 2, 1]: repeated and out of order
STATE_TOL = 1e-4  # float32 file: llama.cpp's layer inputs against transformers' float32 ones (atol and rtol)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_llamacpp")
    target = str(make_model(root / "target", "llama", layers=LAYERS, seed=0, max_pos=512))
    return {"target": target, "gguf": convert(target, str(root / "target.gguf"), "f32"),
            "hf": load_model(target).hf_model, "head": make_head(target, root / "head", seed=1, draft_vocab=40),
            "root": root}


def spec(head: str, k: int = 4, **kw) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, **kw}


# -- the runner's kept states --------------------------------------------------------------------------


def test_kept_states_match_transformers_hidden_states(models):
    """Packed ragged prompts, a ragged continuation, greedy_steps, a rollback that rewrites positions,
    rows that move, a copied prefix, states that grow past their first allocation, release; the
    logits stay those of a runner that keeps nothing."""
    hf, ids = models["hf"], [2, 3, 0]
    r, _ = load_runner(models["gguf"], "llama.cpp")
    plain, _ = load_runner(models["gguf"], "llama.cpp")
    r.sync_rows(["plain"])
    r.forward(ForwardBatch.from_rows([[5, 6, 7]], [0]))
    assert r.states is None  # nothing is kept unless asked
    assert r.can_keep_hidden_states
    r.keep_hidden_states(ids)
    assert torch.equal(r.token_embedding(), hf.model.embed_tokens.weight.detach())  # float32 file: exact

    def check(row: int, tokens: list[int]):
        got = r.hidden_states(row, 0, len(tokens))  # [T, 3 * D]
        ref = reference_states(hf, tokens, ids)
        assert torch.allclose(got, ref, rtol=STATE_TOL, atol=STATE_TOL), (row, len(tokens))

    hist = dict(zip("abc", random_prompts(3, [7, 2, 12], seed=1)))
    r.sync_rows(list("abc"))
    plain.sync_rows(list("abc"))
    batch = ForwardBatch.from_rows(list(hist.values()), [0, 0, 0], logits="last")
    assert torch.equal(r.forward(batch), plain.forward(batch))
    for b, n in enumerate("abc"):
        check(b, hist[n])
    rewrite_move_copy_and_grow(r, check, hist)
    cells = r.cells
    r.reserve(3, 2 * cells)  # a new, larger llama context: it is told again which layer inputs to copy
    assert r.cells > cells
    r.forward(ForwardBatch.from_rows([[4, 5]], [len(hist["a"])], row_offset=1))
    hist["a"] = hist["a"] + [4, 5]
    check(1, hist["a"])
    check(0, hist["c"])
    with pytest.raises(ValueError, match="not cached"):
        r.hidden_states(1, 0, len(hist["a"]) + 1)
    r.release()
    assert r.states is None


def test_kept_states_of_a_bf16_file_are_as_close_as_the_torch_runners_bf16_ones(models, tmp_path):
    hf, ids = models["hf"], [1, 2]
    tokens = random_prompts(1, [20], seed=4)[0]
    ref = reference_states(hf, tokens, ids)  # [T, 2 * D] float32

    def rel_error(runner) -> float:
        runner.keep_hidden_states(ids)
        runner.sync_rows(["a"])
        runner.forward(ForwardBatch.from_rows([tokens], [0]))
        got = runner.hidden_states(0, 0, len(tokens))
        return float(((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max())

    cpp, _ = load_runner(convert(models["target"], str(tmp_path / "bf16.gguf"), "bf16"), "llama.cpp")
    torch_bf16, _ = load_runner(models["target"], "torch", dtype="bfloat16")
    assert cpp.dtype == torch.bfloat16
    assert rel_error(cpp) < max(0.05, 2 * rel_error(torch_bf16))


# -- what the drafter reads, through LLM ------------------------------------------------------------------


def test_the_drafter_reads_the_states_of_each_sequences_history(models, monkeypatch):
    """In a real run (verify passes, rejected drafts rolled back, n=2 choices sharing their prompt's
    prefill, ragged rows), every read of the target's states equals transformers' hidden states of the
    row's history at those positions."""
    llm = LLM(models["gguf"], backend="llama.cpp", speculative_config=spec(models["head"], 3, adaptive=False))
    assert llm.backend == "llama.cpp"
    drafter, target = llm.engine.drafter, llm.target
    ids = drafter.head.config.layer_ids
    reads, history = [], {}
    real_propose, real_states = drafter.propose, target.hidden_states

    def propose(seqs, num_draft, sb):
        history.update({b: list(s.token_ids) for b, s in enumerate(seqs)})
        return real_propose(seqs, num_draft, sb)

    def hidden_states(row, start, end):
        out = real_states(row, start, end)
        reads.append((list(history[row]), start, end, out.clone()))
        return out

    monkeypatch.setattr(drafter, "propose", propose)
    monkeypatch.setattr(target, "hidden_states", hidden_states)
    prompts = random_prompts(3, [2, 9, 30], seed=5)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True))
    assert len(reads) >= 10
    for tokens, start, end, got in reads:
        assert end <= len(tokens) - 1  # only positions the target computed
        ref = reference_states(models["hf"], tokens[:end], ids)[start:end]
        assert torch.allclose(got, ref, rtol=STATE_TOL, atol=STATE_TOL), (len(tokens), start, end)


@pytest.mark.parametrize("rows", [[0], [2, 0]], ids=["one-row", "two-rows"])
def test_the_heads_chain_step_computes_its_general_step(models, rows):
    """HeadRunner.chain_step (a chain's draft step, one token per row, rows at different positions, cache
    rows out of order) returns the logits and g that ``step`` returns at T = 1, and writes the same k, v."""
    from specdec.drafters.eagle3 import HeadRunner
    from specdec.models import cache_attention
    from specdec.models.eagle3 import load_head

    hf = models["hf"]
    head = load_head(models["head"], hf.model.embed_tokens.weight.detach(), LAYERS)
    D = head.config.hidden_size
    runners = [HeadRunner(head, torch.bfloat16, torch.device("cpu")) for _ in range(2)]
    # one row's chain step attends with specdec's cache attention kernel where it runs
    assert runners[1].in_cache == cache_attention.available().ok
    torch.manual_seed(7)
    history = torch.randint(0, head.config.vocab_size, (3, 9))  # three cache rows of 9 positions
    hidden = torch.randn(3, 9, D)
    for r in runners:
        r.reserve(3, 16)
        r.step(history, hidden, [0, 1, 2], torch.arange(9)[None].expand(3, 9).contiguous())
    pos = [8, 5][: len(rows)]  # row 2 continues at 8, row 0 at 5 (its positions past 5 are rewritten)
    ids, g = torch.randint(0, head.config.vocab_size, (len(rows),)), torch.randn(len(rows), D)
    want_logits, want_g = runners[0].step(ids[:, None], g[:, None], rows, torch.tensor(pos)[:, None])
    got_logits, got_g = runners[1].chain_step(ids, g, rows, pos)
    assert got_logits.shape == (len(rows), head.config.draft_vocab_size) and got_g.shape == (len(rows), D)
    torch.testing.assert_close(got_logits, want_logits[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_g, want_g[:, 0], rtol=1e-5, atol=1e-5)
    for b, (row, p) in enumerate(zip(rows, pos)):
        torch.testing.assert_close(runners[1].cache.k[0, row, :, : p + 1], runners[0].cache.k[0, row, :, : p + 1])
        torch.testing.assert_close(runners[1].cache.v[0, row, :, : p + 1], runners[0].cache.v[0, row, :, : p + 1])


def test_the_heads_one_row_catch_up_computes_its_general_step(models):
    """HeadRunner.catch_up_row (one row's T tokens, only the last query going on) returns what ``step``
    with ``query_at`` returns and writes the same k, v; positions past the catch-up stay as they were."""
    from specdec.drafters.eagle3 import HeadRunner
    from specdec.models.eagle3 import load_head

    hf = models["hf"]
    head = load_head(models["head"], hf.model.embed_tokens.weight.detach(), LAYERS)
    D = head.config.hidden_size
    runners = [HeadRunner(head, torch.bfloat16, torch.device("cpu")) for _ in range(2)]
    if not runners[1].in_cache:
        pytest.skip("the cache attention kernel does not run here (cache_attention.available())")
    torch.manual_seed(5)
    ids, hidden = torch.randint(0, head.config.vocab_size, (2, 12)), torch.randn(2, 12, D)
    with torch.inference_mode():
        for r in runners:
            r.reserve(2, 32)
            r.step(ids, hidden, [0, 1], torch.arange(12)[None].expand(2, 12).contiguous())  # rows 0, 1: 12 positions
        start, T = 7, 4  # row 1 catches up at positions 7..10 (11 keeps its old entry)
        new_ids, new_hidden = torch.randint(0, head.config.vocab_size, (T,)), torch.randn(T, D)
        pos = torch.arange(start, start + T)[None]
        want_logits, want_g = runners[0].step(new_ids[None], new_hidden[None], [1], pos, query_at=torch.tensor([T - 1]))
        got_logits, got_g = runners[1].catch_up_row(new_ids, new_hidden, 1, start)
    torch.testing.assert_close(got_logits, want_logits[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_g, want_g[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runners[1].cache.k, runners[0].cache.k)
    torch.testing.assert_close(runners[1].cache.v, runners[0].cache.v)


def test_the_head_runner_fuses_as_the_head_with_and_without_norm_before_fc(models):
    """HeadRunner.fuse is Eagle3Head.fuse: fc over the target's states, after input_norm when the head
    has norm_before_fc (a head without it must not be normed)."""
    from specdec.drafters.eagle3 import HeadRunner
    from specdec.models.eagle3 import Eagle3Head, read_config

    torch.manual_seed(3)
    for norm in (False, True):
        c = read_config(models["head"])
        c.norm_before_fc = norm
        head = Eagle3Head(c)
        if norm:
            head.input_norm.weight.data = torch.rand(head.fc.in_features) + 0.5
        x = 10 * torch.randn(2, 5, head.fc.in_features)  # [B, T, 3 Dt]
        got = HeadRunner(head, torch.float32, torch.device("cpu")).fuse(x)
        torch.testing.assert_close(got, head.fuse(x), rtol=1e-5, atol=1e-5)
        if norm:
            assert not torch.allclose(got, head.fc(x), rtol=1e-2, atol=1e-2)


def test_beside_llamacpp_a_small_round_drafts_on_one_torch_thread(models, monkeypatch):
    """Beside a llama.cpp target the torch head's passes of a round of at most ONE_THREAD_ROWS rows run on
    one torch thread, and torch's setting comes back after; beside a torch target they keep torch's threads.
    (The torch head is forced: where the build runs llama.cpp's eagle3 graphs, the head runs there instead.)"""
    from specdec.drafters.eagle3 import ONE_THREAD_ROWS

    monkeypatch.setattr("specdec.drafters.eagle3.native_head", lambda head, target: None)

    seen = []
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for path, backend, rows in ((models["gguf"], "llama.cpp", 1), (models["gguf"], "llama.cpp", ONE_THREAD_ROWS + 1),
                                    (models["target"], "torch", 1)):
            llm = LLM(path, backend=backend, speculative_config=spec(models["head"], 3, adaptive=False))
            runner = llm.engine.drafter.runner
            step = runner.chain_step

            def chain_step(*args, **kwargs):
                seen.append((backend, rows, torch.get_num_threads()))
                return step(*args, **kwargs)

            runner.chain_step = chain_step
            llm.generate([{"prompt_token_ids": p} for p in random_prompts(rows, [6] * rows, seed=2)], sp)
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)
    threads = {(b, r): {t for b2, r2, t in seen if (b2, r2) == (b, r)} for b, r, _ in seen}
    assert threads == {("llama.cpp", 1): {1}, ("llama.cpp", ONE_THREAD_ROWS + 1): {2}, ("torch", 1): {2}}


@pytest.mark.parametrize("config", [
    dict(k=1, adaptive=False), dict(k=3, adaptive=False), dict(k=4, adaptive=True),
    dict(k=4, enable_suffix_decoding=True, suffix_decoding_min_score=0.0),
], ids=["k1", "k3", "adaptive", "suffix-in-front"])
def test_greedy_output_equals_plain_decoding_on_llamacpp(models, config):
    config = dict(config)
    k = config.pop("k")
    prompts = random_prompts(4, [1, 5, 11, 23], seed=k)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    expected = LLM(models["gguf"], backend="llama.cpp").generate(reqs, sp)
    llm = LLM(models["gguf"], backend="llama.cpp", speculative_config=spec(models["head"], k, **config))
    outs = llm.generate(reqs, sp)
    for p, e, o in zip(prompts, expected, outs):
        for ec, c in zip(e.outputs, o.outputs):
            assert_greedy_equal(models["hf"], p, ec.token_ids, c.token_ids)
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_bench_describes_the_head_in_llamacpp(models):
    """``specdec bench`` ends by naming each compute path; the head's runner in llama.cpp is no ModelRunner
    (it failed there: `specdec bench --method eagle3` on a CPU where auto picks llama.cpp)."""
    from specdec.bench import compute_paths

    llm = LLM(models["gguf"], backend="llama.cpp", speculative_config=spec(models["head"]))
    paths = compute_paths(llm)
    assert paths["draft"] == llm.engine.drafter.runner.describe() and "llama.cpp" in paths["target"]


# -- sampled outputs -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_llamacpp_small")
    target = str(make_model(root / "t", "llama", words=SMALL_WORDS, seed=3, init_std=0.5))
    head = make_head(target, root / "head", seed=2, draft_vocab=18)  # 5 of 23 tokens it never drafts
    return convert(target, str(root / "t.gguf"), "f32"), head, load_model(target).hf_model


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=4),
    dict(temperature=1.0, top_p=0.7),
], ids=["t1", "topk", "topp"])
def test_sampled_outputs_follow_the_target_distribution_on_llamacpp(small_vocab, params):
    target, head, hf = small_vocab
    check_sampled_outputs(target, head, hf, "llama.cpp", params)


# -- where llama.cpp cannot give the states -----------------------------------------------------------------


def test_a_model_whose_graph_keeps_no_layer_inputs_names_the_torch_backend(tmp_path):
    """llama.cpp's qwen2 graph records no layer inputs (asking would abort the process): the runner says
    so before, and LLM refuses an eagle3 head on it with the backend that can."""
    target = str(make_model(tmp_path / "qwen2", "qwen2", layers=LAYERS))
    path = convert(target, str(tmp_path / "qwen2.gguf"), "f32")
    r, _ = load_runner(path, "llama.cpp")
    assert not r.can_keep_hidden_states
    with pytest.raises(ValueError, match="backend='torch'"):
        r.keep_hidden_states([1, 2, 3])
    with pytest.raises(ValueError, match="backend='torch'"):
        LLM(path, backend="llama.cpp", speculative_config=spec(make_head(target, tmp_path / "head")))


def test_a_llama_cpp_build_without_the_symbols_names_the_torch_backend(models, monkeypatch):
    symbols = dict(llamacpp_ext._SYMBOLS)
    name, _, restype, argtypes = symbols["get_layer_inp"]
    symbols["get_layer_inp"] = (name, "_Z_not_in_this_build", restype, argtypes)
    monkeypatch.setattr(llamacpp_ext, "_SYMBOLS", symbols)
    monkeypatch.setattr(llamacpp_ext, "_bound", {})
    r, _ = load_runner(models["gguf"], "llama.cpp")
    assert not r.can_keep_hidden_states
    with pytest.raises(ValueError, match=r"does not export llama_get_embeddings_layer_inp.*backend='torch'"):
        r.keep_hidden_states([1])
