"""The llama.cpp backend: `specdec convert`, LlamaCppRunner against transformers' logits, the engine on
top of it (greedy equality, exact sampled distributions) and its bad-input errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

# a required dependency (built by `make install`): a missing or broken build fails here, not as skips
import llama_cpp  # noqa: E402, F401

from lossless import assert_first_tokens_follow_target, assert_greedy_equal  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.models.base import ForwardBatch  # noqa: E402
from specdec.models.gguf import convert, read_info  # noqa: E402
from specdec.models.load import load_model, load_runner  # noqa: E402
from tiny_models import make_model, perturbed_copy, random_prompts  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"
ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
SMALL_WORDS = [f"w{i}" for i in range(20)]  # V = 23: small enough for exact distribution tests
LOGIT_TOL = 1e-3


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Per architecture: the HF folder, its f32 GGUF and the transformers model (the reference)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch in ARCHS:
        hf = make_model(root / arch, arch)
        gguf_path = convert(str(hf), str(root / f"{arch}.gguf"), "f32")
        out[arch] = (str(hf), gguf_path, load_model(str(hf)).hf_model)
    return out


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V]


# -- conversion and the runner ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_f32_logits_match_transformers(converted, arch):
    _, path, hf = converted[arch]
    runner, _ = load_runner(path, "llama.cpp")
    prompts = random_prompts(3, [9], seed=1)
    runner.sync_rows(["a", "b", "c"])
    got = runner.forward(ForwardBatch.from_rows(prompts, [0, 0, 0], logits="all"))  # [3, 9, V]
    ref = torch.stack([hf_logits(hf, p) for p in prompts])[..., : runner.vocab_size]
    assert (got - ref).abs().max() < LOGIT_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_a_gguf_on_the_torch_backend_computes_the_checkpoints_model(converted, arch, tmp_path):
    """backend='torch' reads a GGUF through transformers (names mapped back, q/k rows un-permuted,
    blocks dequantized): its logits are the checkpoint's; a bf16 file decodes as the bf16 checkpoint."""
    hf_dir, path, hf = converted[arch]
    if arch == "mistral":  # a llama-architecture file named Mistral: transformers 5 has no GGUF mapping for it
        with pytest.raises(ValueError, match="does not map model type 'mistral'; use backend='llama.cpp'"):
            load_runner(path, "torch", dtype="float32")
        return
    runner, _ = load_runner(path, "torch", dtype="float32")
    assert runner.backend == "torch" and runner.dtype == torch.float32
    prompts = random_prompts(3, [9], seed=1)
    runner.sync_rows(["a", "b", "c"])
    got = runner.forward(ForwardBatch.from_rows(prompts, [0, 0, 0], logits="all"))  # [3, 9, V]
    ref = torch.stack([hf_logits(hf, p) for p in prompts])[..., : runner.vocab_size]
    assert (got - ref).abs().max() < 1e-4
    bf16 = convert(hf_dir, str(tmp_path / "bf16.gguf"), "bf16")
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = [[o.outputs[0].token_ids for o in LLM(m, backend="torch", dtype="bfloat16").generate(
        [{"prompt_token_ids": p} for p in prompts], sp)] for m in (bf16, hf_dir)]
    assert outs[0] == outs[1]


def test_flash_attention_on_request_computes_the_same_model(converted):
    """flash_attn=True (what llama.cpp's tools default to; benchmarks/verify_cost.py compares both)
    gives the same logits within its f16 rounding of the attention inputs, at full ubatch."""
    from specdec.models.llamacpp import BATCH_TOKENS, LlamaCppRunner

    _, path, hf = converted["llama"]
    runner = LlamaCppRunner(path, flash_attn=True)
    assert runner.ubatch == BATCH_TOKENS
    prompt = random_prompts(1, [9], seed=8)[0]
    runner.sync_rows(["a"])
    got = runner.forward(ForwardBatch.from_rows([prompt], [0], logits="all"))[0]  # [9, V]
    assert (got - hf_logits(hf, prompt)[:, : runner.vocab_size]).abs().max() < 0.05


def test_ragged_rows_rollback_and_continuation_match_transformers(converted):
    """Rows of different lengths in one llama batch, a row rolled back to an earlier start, and rows
    synced in a new order: each row's logits equal a fresh pass over its whole sequence."""
    _, path, hf = converted["llama"]
    runner, _ = load_runner(path, "llama.cpp")
    seqs = random_prompts(3, [12, 7, 10], seed=2)
    runner.sync_rows(["x", "y", "z"])
    runner.forward(ForwardBatch.from_rows([s[:5] for s in seqs], [0, 0, 0], logits="none"))
    # ragged continuation: 3, 1 and 4 tokens, logits of each row's last 1
    feeds = [seqs[0][5:8], seqs[1][5:6], seqs[2][5:9]]
    got = runner.forward(ForwardBatch.from_rows(feeds, [5, 5, 5], logits="last"))  # [3, V]
    for b, (s, f) in enumerate(zip(seqs, feeds)):
        assert (got[b] - hf_logits(hf, s[: 5 + len(f)])[-1, : runner.vocab_size]).abs().max() < LOGIT_TOL
    # rows move: z first, x second (y forgotten); x rolls back from 8 to 6 with other tokens
    assert runner.sync_rows(["z", "x"]) == [False, False]
    other = [3, 4, 5]
    got = runner.forward(ForwardBatch.from_rows([seqs[2][9:10], other], [9, 6], logits=1))  # [2, 1, V]
    assert (got[0, 0] - hf_logits(hf, seqs[2][:10])[-1, : runner.vocab_size]).abs().max() < LOGIT_TOL
    assert (got[1, 0] - hf_logits(hf, seqs[0][:6] + other)[-1, : runner.vocab_size]).abs().max() < LOGIT_TOL
    assert runner.sync_rows(["z", "new"]) == [False, True]


@pytest.mark.parametrize("backend", ["llama.cpp", "torch"])
def test_greedy_steps_equal_greedy_forwards_and_stop_when_every_row_has_stopped(converted, backend):
    """ModelRunner.greedy_steps on both backends: each row's argmax chain equals one greedy forward at
    a time, from rows of different cached lengths (one rolled back); with stop ids it returns once
    every row has emitted one, leaving each row's cache at start + the steps taken."""
    hf_dir, path, _ = converted["llama"]
    runner, _ = load_runner(path if backend == "llama.cpp" else hf_dir, backend)
    seqs = random_prompts(3, [9, 5, 7], seed=4)

    def reference(steps):
        runner.sync_rows(["ref"])
        out = []
        for s in seqs:
            ids = list(s)
            for _ in range(steps):
                logits = runner.forward(ForwardBatch.from_rows([ids], [0], logits="last"))  # [1, V]
                ids.append(int(logits[0].argmax()))
            out.append(ids[len(s):])
        return out

    expected = reference(7)
    runner.sync_rows(["a", "b", "c"])
    runner.forward(ForwardBatch.from_rows([s[:-1] + [1, 2] for s in seqs], [0, 0, 0], logits="none"))
    # each row rolls back past the two tokens that do not belong and feeds its last prompt token
    got = runner.greedy_steps([s[-1] for s in seqs], [len(s) - 1 for s in seqs], 6)
    assert got == [e[:6] for e in expected]
    # continuing from the cache it left: the last argmax is fed next
    more = runner.greedy_steps([g[-1] for g in got], [len(s) + 5 for s in seqs], 1)
    assert more == [e[6:] for e in expected]
    stop = {expected[0][1], expected[1][3], expected[2][0]}  # each row emits one by step 4 (maybe sooner)
    first_stop = max(min(i for i, t in enumerate(e) if t in stop) for e in expected)
    got = runner.greedy_steps([s[-1] for s in seqs], [len(s) - 1 for s in seqs], 6, stop_token_ids=sorted(stop))
    assert got == [e[: first_stop + 1] for e in expected]
    if backend == "llama.cpp":
        assert [runner.cached[runner.seq_of[i]] for i in "abc"] == [len(s) + first_stop for s in seqs]


@pytest.mark.parametrize("backend", ["llama.cpp", "torch"])
def test_sampled_steps_hand_each_steps_logits_to_pick_and_feed_its_tokens(converted, backend):
    """ModelRunner.sampled_steps on both backends (a sampling drafter's chain): ``pick`` is handed each step's
    logits [B, V], as one forward at a time gives them, and its tokens are fed next; from rows of different
    cached lengths, rolled back first, the cache then holding start + steps positions."""
    hf_dir, path, _ = converted["llama"]
    runner, _ = load_runner(path if backend == "llama.cpp" else hf_dir, backend)
    seqs = random_prompts(3, [9, 5, 7], seed=5)

    def second_best(logits: torch.Tensor) -> list[int]:  # not the argmax: a chain greedy_steps would not take
        return logits.topk(2, dim=-1).indices[:, 1].tolist()

    runner.sync_rows(["ref"])
    expected, expected_logits = [], []
    for s in seqs:
        ids, seen = list(s), []
        for _ in range(5):
            logits = runner.forward(ForwardBatch.from_rows([ids], [0], logits="last"))  # [1, V]
            seen.append(logits[0].clone())
            ids.append(second_best(logits)[0])
        expected.append(ids[len(s):])
        expected_logits.append(torch.stack(seen))
    runner.sync_rows(["a", "b", "c"])
    runner.forward(ForwardBatch.from_rows([s[:-1] + [1, 2] for s in seqs], [0, 0, 0], logits="none"))
    handed = []

    def pick(logits: torch.Tensor) -> list[int]:
        handed.append(logits.clone())  # [B, V]
        return second_best(logits)

    got = runner.sampled_steps([s[-1] for s in seqs], [len(s) - 1 for s in seqs], 5, pick)
    assert got == expected
    for b in range(3):
        assert (torch.stack([h[b] for h in handed]) - expected_logits[b]).abs().max() < LOGIT_TOL
    if backend == "llama.cpp":
        assert [runner.cached[runner.seq_of[i]] for i in "abc"] == [len(s) + 4 for s in seqs]


@pytest.mark.parametrize("backend", ["llama.cpp", "torch"])
def test_plain_rounds_of_several_steps_equal_rounds_of_one(converted, backend):
    """num_scheduler_steps: greedy plain rounds of up to 4 steps give what rounds of one give, with a
    stop token met inside a round, max_tokens that is no multiple of 4, and a stop string; the
    several-step call is what ran."""
    hf_dir, path, _ = converted["llama"]
    model = path if backend == "llama.cpp" else hf_dir
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, [5, 9, 4], seed=3)]
    one, many = LLM(model, backend=backend, num_scheduler_steps=1), LLM(model, backend=backend)
    steps = []
    greedy_steps = many.target.greedy_steps
    many.target.greedy_steps = lambda *a, **kw: (steps.append(a[2]), greedy_steps(*a, **kw))[1]
    sp = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)
    free = [o.outputs[0] for o in one.generate(prompts, sp)]
    params = [SamplingParams(temperature=0, max_tokens=11, stop_token_ids=[free[0].token_ids[6]]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, stop=[free[2].text[-6:-3]])]
    want = [(c.token_ids, c.text, c.finish_reason) for c in (o.outputs[0] for o in one.generate(prompts, params))]
    got = [(c.token_ids, c.text, c.finish_reason) for c in (o.outputs[0] for o in many.generate(prompts, params))]
    assert got == want
    assert want[0][2] == "stop" and len(want[0][0]) <= 7 and want[2][2] == "stop"
    assert max(steps) == 4


def test_logits_come_back_at_the_asked_positions_in_the_asked_order(converted):
    """A ragged batch asking for positions past a row's tokens gets zeros there, and an index out of
    order (or repeated) gets the logits in its own order."""
    _, path, hf = converted["llama"]
    runner, _ = load_runner(path, "llama.cpp")
    seqs = random_prompts(2, [6, 4], seed=7)
    runner.sync_rows(["a", "b"])
    index = torch.tensor([[5, 0, 3, 3], [1, 2, 3, 4]])  # [B, L]; row b has 4 tokens: position 4 is past them
    got = runner.forward(ForwardBatch(torch.tensor([seqs[0], seqs[1] + [0, 0]]), [0, 0], [6, 4], index))  # [2, 4, V]
    ref = [hf_logits(hf, s)[:, : runner.vocab_size] for s in seqs]  # [T, V] each
    assert (got[0] - ref[0][[5, 0, 3, 3]]).abs().max() < LOGIT_TOL
    assert (got[1, :3] - ref[1][[1, 2, 3]]).abs().max() < LOGIT_TOL
    assert not got[1, 3].any()


def test_the_cache_grows_and_keeps_every_sequence(converted):
    """More positions than a context holds: it is rebuilt larger with every sequence's KV copied over."""
    _, path, hf = converted["llama"]
    runner, _ = load_runner(path, "llama.cpp")
    runner.reserve(2, 8)
    first = runner.cells
    seqs = [random_prompts(1, [200], seed=s)[0] for s in (3, 4)]
    runner.sync_rows(["p", "q"])
    for lo in range(0, 200, 50):  # 400 positions in all, then more rows
        runner.forward(ForwardBatch.from_rows([s[lo : lo + 50] for s in seqs], [lo, lo], logits="none"))
    runner.sync_rows(["p", "q"] + [f"r{i}" for i in range(8)])
    runner.forward(ForwardBatch.from_rows([[5] * 100] * 8, [0] * 8, logits="none", row_offset=2))
    assert runner.cells > first and runner.n_seq >= 10  # sequence ids grew past the first context's 4 as well
    got = runner.forward(ForwardBatch.from_rows([[7], [8]], [200, 200], logits="last"))
    for b, (s, t) in enumerate(zip(seqs, [7, 8])):
        assert (got[b] - hf_logits(hf, s + [t])[-1, : runner.vocab_size]).abs().max() < LOGIT_TOL


def test_attention_scratch_stays_within_the_kv_cache():
    """Without flash attention a compute pass holds cells x ubatch x heads float32 scores: the ubatch
    keeps them within the KV cache's own size, a power of two from 64 to 512 tokens."""
    from specdec.models.llamacpp import _ubatch

    for kv_bytes, heads, want in [(8192, 8, 256), (16384, 8, 512), (524288, 32, 512), (131072, 32, 512),
                                  (2048, 16, 64), (24576, 8, 512), (12288, 8, 256)]:
        got = _ubatch(kv_bytes, heads)
        assert got == want, (kv_bytes, heads, got)
        assert got == 64 or got * heads * 4 <= kv_bytes


def test_release_clears_a_small_cache_and_frees_a_large_one(converted, monkeypatch):
    """release() forgets every sequence either way; a small context is kept (cleared, no 10-20 ms
    rebuild at the next request), a large one is freed. The kept one computes as a fresh one."""
    import specdec.models.llamacpp as llamacpp

    _, path, hf = converted["llama"]
    runner, _ = load_runner(path, "llama.cpp")
    ids = random_prompts(2, [9, 6], seed=6)
    for keep in (True, False):
        monkeypatch.setattr(llamacpp, "KEEP_BYTES", 2**40 if keep else 0)
        runner.sync_rows(["a", "b"])
        runner.forward(ForwardBatch.from_rows(ids, [0, 0], logits="none"))
        ctx = runner.ctx
        runner.release()
        assert (runner.ctx is ctx) == keep and (runner.ctx is None) != keep
        assert runner.sync_rows(["b", "a"]) == [True, True]  # every row starts empty
        got = runner.forward(ForwardBatch.from_rows([ids[1][:3], ids[0][:4]], [0, 0], logits="last"))  # [2, V]
        assert (got[0] - hf_logits(hf, ids[1][:3])[-1, : runner.vocab_size]).abs().max() < LOGIT_TOL
        assert (got[1] - hf_logits(hf, ids[0][:4])[-1, : runner.vocab_size]).abs().max() < LOGIT_TOL
        runner.release()


# largest logit error relative to the largest logit (5.5 here), measured: bf16 0.024, f16 0.005, q8_0 0.055,
# q4_k_m 0.26 (a tiny model's rows are too short for k-quants: llama.cpp falls back to q5_0)
@pytest.mark.parametrize("outtype,tol", [("bf16", 0.05), ("f16", 0.01), ("q8_0", 0.1), ("q4_k_m", 0.4)])
def test_other_outtypes_load_and_stay_close(converted, tmp_path, outtype, tol):
    hf_dir, _, hf = converted["llama"]
    path = convert(hf_dir, str(tmp_path / f"m-{outtype}.gguf"), outtype)
    assert read_info(path).weight_type != "F32"
    runner, _ = load_runner(path, "llama.cpp")
    ids = random_prompts(1, [8], seed=5)[0]
    runner.sync_rows(["a"])
    got = runner.forward(ForwardBatch.from_rows([ids], [0], logits="all"))[0]  # [8, V]
    ref = hf_logits(hf, ids)[:, : runner.vocab_size]
    assert (got - ref).abs().max() < tol * ref.abs().max()


def test_the_tokenizer_travels_in_the_gguf(converted):
    hf_dir, path, _ = converted["qwen2"]
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(hf_dir)
    runner, eos = load_runner(path, "llama.cpp")
    text = "w1 w2 w17 w99"
    assert runner.tokenizer.encode(text) == ref.encode(text)
    assert runner.tokenizer.get_vocab() == ref.get_vocab()
    assert eos == {2}


# -- the engine on llama.cpp --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory, converted):
    root = tmp_path_factory.mktemp("pair")
    hf_dir, target, hf = converted["llama"]
    near = convert(str(perturbed_copy(hf_dir, root / "near", 0.01)), str(root / "near.gguf"), "f32")
    return target, near, hf


def plain(target, prompts, n):
    llm = LLM(target)
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


@pytest.mark.parametrize("method", ["draft_model", "ngram", "suffix", "suffix+draft_model"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_equals_plain_on_llamacpp(pair, method, batch):
    target, near, hf = pair
    # repeated text, so ngram and suffix find drafts
    prompts = [(p * 3)[:20] for p in random_prompts(batch, [5, 7, 4, 6], seed=7)]
    expected = plain(target, prompts, 24)
    cfg = {"num_speculative_tokens": 4, "adaptive": False}  # k = 4 drafts in every round (where a lookup finds them)
    if "draft_model" in method:
        cfg |= {"method": "draft_model", "model": near}
        if method.startswith("suffix"):
            cfg |= {"enable_suffix_decoding": True}
    else:
        cfg |= {"method": method}
    llm = LLM(target, speculative_config=cfg)
    assert llm.backend == "llama.cpp"
    draft_steps = []
    if "draft_model" in method:  # greedy drafts of more than one token take one greedy_steps call
        runner = getattr(llm.engine.drafter, "model", llm.engine.drafter).runner
        greedy_steps = runner.greedy_steps
        runner.greedy_steps = lambda *a, **kw: (draft_steps.append(a[2]), greedy_steps(*a, **kw))[1]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    for p, e, g in zip(prompts, expected, got):
        assert_greedy_equal(hf, p, e, g)  # f32 GGUF: the backend's rounding is float32's (lossless.NEAR_TIE)
    assert llm.get_metrics()["num_draft_tokens"] > 0
    if method == "draft_model":  # a round's catch-up token and its k drafts: one greedy_steps call
        assert draft_steps and max(draft_steps) == cfg["num_speculative_tokens"]


@pytest.mark.parametrize("backend", ["llama.cpp", "torch"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_sampled_draft_chain_in_one_call_draws_what_the_loop_draws(pair, backend, batch, monkeypatch):
    """Sampled draft_model drafts (every row draws all k): one ``sampled_steps`` call (autoregressive.sampled_chain,
    the catch-up token its first step) against draft_autoregressive's loop of forwards: the same seeded outputs
    and the same accepted drafts."""
    import specdec.drafters.autoregressive as autoregressive
    import specdec.drafters.draft_model as draft_model

    target, near, _ = pair
    prompts = random_prompts(batch, [5, 7, 4], seed=8)
    sps = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=40 + i, ignore_eos=True) for i in range(batch)]

    def run():
        llm = LLM(target, backend=backend, speculative_config={"method": "draft_model", "model": near,
                                                              "num_speculative_tokens": 3, "adaptive": False})
        runner = llm.engine.drafter.runner
        calls = []
        steps = runner.sampled_steps
        monkeypatch.setattr(runner, "sampled_steps", lambda *a, **kw: (calls.append(a[2]), steps(*a, **kw))[1])
        outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sps)]
        return outs, llm.get_metrics()["num_accepted_tokens"], calls

    chained, accepted, calls = run()
    assert calls and max(calls) == 3  # x_1..x_3 of a round from one call (the catch-up token its first step)
    with monkeypatch.context() as m:
        for module in (autoregressive, draft_model):
            m.setattr(module, "every_row_draws", lambda *a: False)
        looped, accepted_loop, calls = run()
    assert not calls and (chained, accepted) == (looped, accepted_loop)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    target = make_model(root / "t", "llama", words=SMALL_WORDS, seed=3, init_std=0.5)
    draft = perturbed_copy(target, root / "d", 0.05)
    return (convert(str(target), str(root / "t.gguf"), "f32"), convert(str(draft), str(root / "d.gguf"), "f32"),
            load_model(str(target)).hf_model)


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=4),
    dict(temperature=1.0, top_p=0.7),
], ids=["t1", "topk", "topp"])
@pytest.mark.parametrize("method", ["draft_model", "ngram", "suffix"])
def test_sampled_outputs_follow_the_target_distribution_on_llamacpp(small_vocab, params, method):
    target, draft, hf = small_vocab
    # suffix: a spread-out first token (entropy 2.1 nats), a prompt token half the time; ngram (matching
    # one token) needs a first token that is a prompt token under top-k and top-p too (99.9%)
    prompt = [13, 3, 22, 13, 20] if method == "ngram" else [14, 11, 18, 11, 10]
    N = 2000
    cfg = {"method": method, "num_speculative_tokens": 2}
    if method == "draft_model":
        cfg["model"] = draft
    if method == "ngram":
        cfg |= {"prompt_lookup_min": 1}
    if method == "suffix":
        cfg |= {"suffix_decoding_min_token_prob": 0.0}
    llm = LLM(target, speculative_config=cfg)
    sps = [SamplingParams(max_tokens=3, seed=1000 + i, ignore_eos=True, **params) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, sps)
    tokens = np.array([o.outputs[0].token_ids for o in outs])  # [N, 3]
    V = 23
    assert_first_tokens_follow_target(hf, prompt, tokens, sps[0], V)
    metrics = llm.get_metrics()
    assert metrics["num_draft_tokens"] > 0  # drafts were verified (ngram's one-token matches are rarely right)
    assert method == "ngram" or metrics["num_accepted_tokens"] > 0


@pytest.mark.parametrize("method", ["draft_model", "suffix"])
def test_penalties_and_biases_under_speculation_on_llamacpp(pair, method):
    """Processing acts on logits, so it is the same on every backend: greedy output with penalties,
    a bias and min_tokens equals plain decoding's with them."""
    target, near, hf = pair
    prompts = [(p * 3)[:20] for p in random_prompts(3, [5, 7, 4], seed=8)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                        presence_penalty=0.5, frequency_penalty=0.3, logit_bias={7: 2.0}, min_tokens=4)
    requests = [{"prompt_token_ids": p} for p in prompts]
    expected = [o.outputs[0].token_ids for o in LLM(target).generate(requests, sp)]
    cfg = {"method": method, "num_speculative_tokens": 4} | ({"model": near} if method == "draft_model" else {})
    llm = LLM(target, speculative_config=cfg)
    got = [o.outputs[0].token_ids for o in llm.generate(requests, sp)]
    assert got == expected
    assert llm.get_metrics()["num_draft_tokens"] > 0


# -- bad input -------------------------------------------------------------------------------------------


def test_missing_and_corrupt_gguf_files_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist.*specdec convert"):
        LLM(str(tmp_path / "nope.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        LLM(str(bad))
    folder = tmp_path / "two"
    folder.mkdir()
    (folder / "a.gguf").write_bytes(b"x")
    (folder / "b.gguf").write_bytes(b"x")
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        LLM(str(folder))


def test_a_draft_gguf_with_another_vocabulary_is_refused(pair, tmp_path):
    target, _, _ = pair
    other = make_model(tmp_path / "o", "llama", words=[f"v{i}" for i in range(120)])
    other_gguf = convert(str(other), str(tmp_path / "o.gguf"), "f32")
    with pytest.raises(ValueError, match="different vocabularies"):
        LLM(target, speculative_config={"method": "draft_model", "model": other_gguf})


def test_layer_skip_on_llamacpp_names_the_backend(pair, converted):
    target, _, _ = pair
    with pytest.raises(ValueError, match="llama.cpp backend cannot do"):
        LLM(target, speculative_config={"method": "layer_skip", "num_speculative_tokens": 2})
    hf_dir = converted["llama"][0]
    with pytest.raises(ValueError, match="llama.cpp backend cannot do"):
        LLM(hf_dir, backend="llama.cpp", speculative_config={"method": "layer_skip", "num_speculative_tokens": 2})
    assert LLM(hf_dir, speculative_config={"method": "layer_skip", "num_speculative_tokens": 2}).backend == "torch"
    # a GGUF on the torch backend can (its model is transformers' own), and stays lossless
    llm = LLM(target, backend="torch", speculative_config={"method": "layer_skip", "num_speculative_tokens": 2,
                                                            "num_draft_layers": 1})
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, [6], seed=3)]
    expected = [o.outputs[0].token_ids for o in LLM(target, backend="torch").generate(prompts, sp)]
    assert llm.backend == "torch" and [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == expected
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_converting_an_unsupported_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "g")
    with pytest.raises(ValueError, match="cannot convert architecture 'GPT2LMHeadModel'"):
        convert(str(tmp_path / "g"), str(tmp_path / "g.gguf"))


def test_an_hf_checkpoint_on_llamacpp_is_converted_once_into_the_cache(converted, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    hf_dir, _, hf = converted["qwen3"]
    a = LLM(hf_dir, backend="llama.cpp")
    assert "converting" in capfd.readouterr().err
    b = LLM(hf_dir, backend="llama.cpp")
    assert "converting" not in capfd.readouterr().err
    assert len(list((tmp_path / "cache" / "gguf").glob("*.gguf"))) == 1
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert a.generate("w1 w2", sp)[0].outputs[0].token_ids == b.generate("w1 w2", sp)[0].outputs[0].token_ids


def test_cli_converts_runs_a_gguf_and_exits_2_on_bad_input(converted, tmp_path):
    from typer.testing import CliRunner

    from specdec.cli import app

    cli = CliRunner()
    hf_dir = converted["llama"][0]
    out = tmp_path / "x.gguf"
    ok = cli.invoke(app, ["convert", hf_dir, "--out", str(out), "--outtype", "f32"])
    assert ok.exit_code == 0 and out.exists(), ok.output
    gen = cli.invoke(app, ["generate", "--model", str(out), "--prompt", "w1 w2", "--temperature", "0",
                           "--max-tokens", "4", "--ignore-eos", "--json"])
    assert gen.exit_code == 0, gen.output
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"junk")
    res = cli.invoke(app, ["generate", "--model", str(bad), "--prompt", "w1"])
    assert res.exit_code == 2 and "not a readable GGUF file" in res.stderr and "Traceback" not in res.output
    res = cli.invoke(app, ["convert", str(tmp_path), "--out", str(tmp_path / "y.gguf")])
    assert res.exit_code == 2 and "has no config.json" in res.stderr
    res = cli.invoke(app, ["generate", "--model", str(out), "--prompt", "w1 w2", "--temperature", "0",
                           "--max-tokens", "4", "--ignore-eos", "--json", "--backend", "torch"])
    assert res.exit_code == 0, res.output
    lib = LLM(str(out), backend="torch").generate(["w1 w2"], SamplingParams(temperature=0, max_tokens=4,
                                                                             ignore_eos=True))[0].outputs[0]
    assert json.loads(res.stdout)["token_ids"] == lib.token_ids and len(lib.token_ids) == 4


def test_a_budgets_bound_stops_the_caches_doubling(converted):
    """A context grows by doubling, but under a KV budget (``max_cache_positions``) only to what is
    needed past the bound: the cells never exceed max(need, bound) rounded to the cache step."""
    _, path, hf = converted["llama"]
    sizes = {}
    ids = [f"s{i}" for i in range(5)]
    for bound in (None, 1200):
        runner, _ = load_runner(path, "llama.cpp")
        runner.max_cache_positions = bound
        runner.reserve(5, 8)
        seqs = [random_prompts(1, [220], seed=s)[0] for s in range(5)]
        runner.sync_rows(ids)
        for lo in (0, 110):  # 1100 positions in all: past the first context's 1024 cells
            runner.forward(ForwardBatch.from_rows([s[lo : lo + 110] for s in seqs], [lo] * 5, logits="none"))
        sizes[bound] = runner.cells
        got = runner.forward(ForwardBatch.from_rows([[7]] * 5, [220] * 5, logits="last"))
        for b, s in enumerate(seqs):
            assert (got[b] - hf_logits(hf, s + [7])[-1, : runner.vocab_size]).abs().max() < LOGIT_TOL
    assert sizes[None] >= 2048  # doubled
    assert 1105 <= sizes[1200] <= runner.round_cache_len(1200), sizes
