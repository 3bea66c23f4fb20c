"""The same checks on every device: the runner against transformers, greedy speculation equal to
plain decoding, and sampled speculation following the target's distribution. ``cuda`` runs where a
GPU exists (benchmarks/gpu_check.sh) and is skipped, saying so, where none does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lossless import FALSE_ALARM, chi_square_p
from specdec import LLM, SamplingParams
from specdec.models.base import ForwardBatch, next_token_logits
from specdec.models.load import load_model
from specdec.near_tie import first_divergence
from tiny_models import make_model, perturbed_copy, random_prompts

SMALL_WORDS = [f"w{i}" for i in range(20)]  # V = 23: small enough for an exact joint distribution
V = len(SMALL_WORDS) + 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("devices")
    target = make_model(root / "t", "llama", seed=5)
    return str(target), str(perturbed_copy(target, root / "d", 0.01))


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("devices-small")
    target = make_model(root / "t", "llama", words=SMALL_WORDS, seed=3, init_std=0.5)
    return str(target), str(perturbed_copy(target, root / "d", 0.05))


def test_runner_logits_match_transformers(pair, device):
    runner = LLM(pair[0], device=device).target
    assert runner.device.type == device and runner.dtype == torch.float32
    hf = load_model(pair[0], dtype="float32").hf_model  # on the CPU: the reference
    prompts = random_prompts(3, [9], seed=4)
    with torch.no_grad():
        ref = hf(torch.tensor(prompts)).logits[:, -1, : runner.vocab_size]  # [3, V]
    out = next_token_logits(runner, prompts).cpu()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)  # float32 sums in another order


def test_greedy_speculative_equals_plain(pair, device):
    target, draft = pair
    prompts = random_prompts(3, [3, 11, 6], seed=1)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(target, device=device)
    expected = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    llm = LLM(target, device=device, speculative_config={"model": draft, "num_speculative_tokens": 4,
                                                         "adaptive": False})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, e, o in zip(prompts, expected, outs):
        d = first_divergence(plain.engine.target, p, e, o.outputs[0].token_ids)
        assert d is None or d["near_tie"], d
    assert llm.get_metrics()["num_drafts"] > 0 and llm.get_metrics()["num_accepted_tokens"] > 0


def test_sampled_speculation_follows_the_target(small_vocab, device):
    """Pearson chi-square of the first two sampled tokens (temperature 1) against the target's
    exact joint distribution, computed by transformers on the CPU."""
    target, draft = small_vocab
    prompt = [5, 9, 3]
    n = 1200
    torch.manual_seed(0)  # the CPU's and every GPU's generator
    llm = LLM(target, device=device, speculative_config={"model": draft, "num_speculative_tokens": 2,
                                                         "adaptive": False})
    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True))
    tokens = np.array([o.outputs[0].token_ids for o in outs])  # [n, 3]; the 2nd and 3rd come from a verify pass
    hf = load_model(target, dtype="float32").hf_model
    with torch.no_grad():
        first = hf(torch.tensor([prompt])).logits[0, -1, :V].softmax(-1)  # [V]
        second = hf(torch.tensor([prompt + [t] for t in range(V)])).logits[:, -1, :V].softmax(-1)  # [V, V]
    joint = (first[:, None] * second).reshape(-1).double().numpy()  # p(t1) p(t2 | t1)
    assert chi_square_p(tokens[:, 0] * V + tokens[:, 1], joint) > FALSE_ALARM
    assert llm.get_metrics()["num_accepted_tokens"] > 0  # the drafts did get used


def test_verify_rows_equal_one_token_steps_in_bf16(pair, device):
    """With bf16 weights, a verify pass of 5 tokens scores each token as a one-token step does, up
    to the order of float32 sums: products give float32 results into a float32 stream (linear.py),
    so no kernel choice by batch shape rounds a row to another bf16 value."""
    llm = LLM(pair[0], device=device, dtype="bfloat16", backend="torch")
    runner = llm.engine.target
    if runner.lm_head.kind not in ("w16", "w16dot", "mm32"):
        pytest.skip(f"products here ({runner.lm_head.kind}) give bf16 results; this CPU has another bf16 path")
    assert runner.compute_dtype == torch.float32
    prefix, cont = random_prompts(1, [11], seed=8)[0], [7, 3, 12, 5, 9]
    runner.sync_rows([("steps", 0)])
    runner.forward(ForwardBatch.from_rows([prefix], [0], logits="none", device=runner.device))
    steps = torch.cat([runner.forward(ForwardBatch.from_rows([[t]], [len(prefix) + j], device=runner.device))
                       for j, t in enumerate(cont)])  # [5, V]
    runner.sync_rows([("verify", 0)])
    runner.forward(ForwardBatch.from_rows([prefix], [0], logits="none", device=runner.device))
    verify = runner.forward(ForwardBatch.from_rows([cont], [len(prefix)], logits="all", device=runner.device))[0]
    assert steps.dtype == verify.dtype == torch.float32
    # a bf16 result rounded another way would move a logit by ~4e-3 of its size (here ~1e-2)
    torch.testing.assert_close(verify.cpu(), steps.cpu(), atol=2e-3, rtol=0)


def test_compiled_step_equals_eager_as_the_cache_grows(tmp_path, device):
    """The compiled step (the default on CPU and CUDA) gives plain decoding's greedy output over 300
    tokens, past ATTEND_STEP several times and past one CACHE_STEP (the cache grows and moves), with
    and without a draft. On CUDA it replays CUDA graphs: inductor skips none (the KV cache it writes
    is a static input), and the grown cache's graphs are recorded again."""
    if device != "cuda":  # it passes on CPU too (half a minute, most of it compiling): kept out of CI's time
        pytest.skip("run on CUDA; the compiled CPU step against eager is tests/test_compiled.py")
    from torch._dynamo.utils import counters

    target = str(make_model(tmp_path / "t", "llama", seed=6, max_pos=640))
    draft = str(perturbed_copy(Path(target), tmp_path / "d", 0.01))
    prompts = random_prompts(2, [5, 9], seed=2)
    sp = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    eager = LLM(target, device=device, enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    skips = counters["inductor"]["cudagraph_skips"]
    for spec in (None, {"model": draft, "num_speculative_tokens": 4, "adaptive": False}):
        llm = LLM(target, device=device, enforce_eager=False, speculative_config=spec)
        outs = [llm.generate([{"prompt_token_ids": p}], sp)[0] for p in prompts]  # one row: the compiled path
        assert llm.engine.target.last_path == "compiled"
        assert llm.engine.target.cache.max_len > 256  # it grew
        for p, e, o in zip(prompts, expected, outs):
            d = first_divergence(eager.engine.target, p, e, o.outputs[0].token_ids)
            assert d is None or d["near_tie"], (spec, d)
    assert counters["inductor"]["cudagraph_skips"] == skips, "inductor skipped CUDA graphs (see its log)"
