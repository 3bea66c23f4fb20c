"""The bfloat16 CPU path: oneDNN linears, ``dtype="auto"``, the runner's bf16 logits against
transformers' float32 forward, and greedy speculative decoding equal to plain decoding."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import specdec.models.linear as linear_mod
import specdec.models.loader as loader_mod
from lossless import NEAR_TIE, assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.models.base import ForwardBatch
from specdec.models.linear import Linear, onednn_bf16_supported
from specdec.models.llama import LlamaRunner
from specdec.models.loader import _torch_dtype, load_model
from tiny_models import make_model, random_prompts

needs_onednn = pytest.mark.skipif(not onednn_bf16_supported(),
                                  reason="this CPU has no native oneDNN bf16 (avx512_bf16 / AMX): bf16 stays off")
# Runner (bf16 weights; float32 residual stream, norms and attention; matmul inputs and results in bf16) against transformers in
# float32 from the same bf16 weights, last-token logits (|logit| <= ~6): measured 0.067-0.085 over 5 prompt
# seeds (0.075 for the batch below); earlier positions reach 0.23. transformers' own bf16 forward is
# 0.17-0.21 away from its float32 one.
LOGIT_TOL = 0.15
K = 4


def test_onednn_linear_matches_f_linear():
    if not onednn_bf16_supported():
        pytest.skip("this CPU has no native oneDNN bf16 (avx512_bf16 / AMX): the onednn kind is never chosen")
    g = torch.Generator().manual_seed(0)
    for n_in, n_out in [(64, 96), (100, 37), (512, 1536)]:
        w = (0.05 * torch.randn(n_out, n_in, generator=g)).bfloat16()
        b = torch.randn(n_out, generator=g).bfloat16()
        for bias in (None, b):
            lin = Linear(w, bias)
            assert lin.kind == "onednn"
            for shape in [(7, n_in), (2, 5, n_in), (1, n_in)]:
                for dt in (torch.float32, torch.bfloat16):
                    x = torch.randn(*shape, generator=g).to(dt)
                    y = lin(x)
                    assert y.dtype == torch.bfloat16 and y.shape == (*shape[:-1], n_out)  # the weight's dtype
                    ref = F.linear(x.bfloat16().float(), w.float(), None if bias is None else bias.float())
                    # oneDNN accumulates in float32 and rounds its output to bf16: relative error <= 2^-8
                    # (measured 0.0039); two bf16 ulps of tolerance.
                    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-4)


def test_onednn_rows_are_computed_alike_whatever_the_row_count():
    if not onednn_bf16_supported():
        pytest.skip("this CPU has no native oneDNN bf16 (avx512_bf16 / AMX): the onednn kind is never chosen")
    g = torch.Generator().manual_seed(1)
    for n_in, n_out in [(64, 96), (512, 1536)]:
        lin = Linear((0.05 * torch.randn(n_out, n_in, generator=g)).bfloat16(), torch.randn(n_out).bfloat16())
        x = torch.randn(8, n_in, generator=g)
        alone = [lin(x[i : i + 1])[0] for i in range(8)]
        for n in range(1, 9):
            y = lin(x[:n])
            for i in range(n):
                assert torch.equal(y[i], alone[i]), f"{n_in}->{n_out}: row {i} of {n} differs from the row alone"


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_wxt_linear_matches_f_linear(monkeypatch, wdtype):
    monkeypatch.setattr(linear_mod, "onednn_bf16_supported", lambda: False)  # bf16 goes to wxt too
    g = torch.Generator().manual_seed(2)
    w = (0.05 * torch.randn(96, 64, generator=g)).to(wdtype)
    b = torch.randn(96, generator=g).to(wdtype)
    lin = Linear(w, b)
    assert lin.kind == "wxt"
    for shape in [(1, 64), (6, 64), (2, 5, 64)]:
        x = torch.randn(*shape, generator=g)
        y = lin(x)
        assert y.dtype == wdtype and y.shape == (*shape[:-1], 96)  # the weight's dtype
        ref = F.linear(x.to(wdtype).float(), w.float(), b.float())
        if wdtype == torch.float32:
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        else:  # rounded to 16 bits twice, after the product and after the bias: bound by the terms' size
            bound = 2**-7 * (x.to(wdtype).float().abs() @ w.float().abs().T + b.float().abs())
            assert ((y - ref).abs() <= bound).all(), (y - ref).abs().max()


@pytest.mark.parametrize("supported", [True, False])
def test_torch_dtype(monkeypatch, supported):
    monkeypatch.setattr(loader_mod, "onednn_bf16_supported", lambda: supported)
    cfg = lambda dt: SimpleNamespace(dtype=dt)  # noqa: E731
    for bf16 in (torch.bfloat16, "bfloat16"):
        assert _torch_dtype("auto", cfg(bf16), "cpu") == (torch.bfloat16 if supported else torch.float32)
        assert _torch_dtype("auto", cfg(bf16), "cuda") == torch.bfloat16
    assert _torch_dtype("auto", cfg(torch.float16), "cpu") == torch.float32
    assert _torch_dtype("auto", cfg(torch.float16), "cuda") == torch.float16
    assert _torch_dtype("auto", cfg(torch.float32), "cpu") == torch.float32
    assert _torch_dtype("auto", cfg(None), "cpu") == torch.float32
    assert _torch_dtype("bfloat16", cfg(torch.float32), "cpu") == torch.bfloat16  # explicit stays
    assert _torch_dtype("float32", cfg(torch.bfloat16), "cpu") == torch.float32
    with pytest.raises(ValueError, match="float32.*bfloat16.*float16.*auto.*'half'"):
        _torch_dtype("half", cfg(torch.float32), "cpu")


def bf16_copy(src: Path, dst: Path, noise: float = 0.0, seed: int = 2) -> Path:
    """``src`` (+ Gaussian noise of std ``noise``) saved in bfloat16: config.json then says bfloat16."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    model.to(torch.bfloat16).save_pretrained(dst, safe_serialization=True)
    return Path(dst)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    src = make_model(root / "src", "llama", layers=2, seed=0)
    return str(bf16_copy(src, root / "target")), str(bf16_copy(src, root / "draft", noise=0.01))


def test_auto_loads_a_bf16_checkpoint_as_float32_without_onednn(pair, monkeypatch):
    monkeypatch.setattr(loader_mod, "onednn_bf16_supported", lambda: False)
    runner = LLM(pair[0]).target
    assert runner.dtype == torch.float32 and runner.layers[0].qkv.kind == "wxt"


def verify_noise(runner: LlamaRunner, ids: torch.Tensor, T: int) -> torch.Tensor:
    """|logits of the last T tokens in one forward - the same from T one-token forwards|, max."""
    B, L = ids.shape
    outs = []
    for steps in ([ids[:, L - T :]], [ids[:, j : j + 1] for j in range(L - T, L)]):
        runner.release()
        runner.sync_rows(list(range(B)))
        runner.forward(ForwardBatch.dense(ids[:, : L - T], [0] * B))
        outs.append(torch.cat([runner.forward(ForwardBatch.dense(s, [L - T + i * s.shape[1]] * B, "all"))
                               for i, s in enumerate(steps)], dim=1))  # [B, T, V]
    return (outs[0] - outs[1]).abs().max()


@needs_onednn
def test_bf16_runner_logits(pair):
    llm = LLM(pair[0])  # dtype="auto" is the default
    runner = llm.target
    assert runner.dtype == torch.bfloat16 and runner.compute_dtype == torch.float32
    assert runner.layers[0].qkv.kind == "onednn" and runner.lm_head.kind == "onednn"
    hf32 = load_model(pair[0], dtype="float32").hf_model
    ids = torch.randint(3, 123, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf32(ids).logits[:, -1, : runner.vocab_size]
    runner.release()
    runner.sync_rows(list(range(4)))
    out = runner.forward(ForwardBatch.dense(ids, [0] * 4, "last"))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=LOGIT_TOL, rtol=0)
    # a verify pass (T = k+1) against k+1 one-token steps; measured 0.0 (oneDNN rows are row-count invariant)
    assert verify_noise(runner, ids, K + 1) <= LOGIT_TOL


class RunnerLogits:
    """``hf_model``-like view of a runner for the near-tie check: the gap of the bf16 computation that
    produced the outputs, not of transformers' float32 forward (0.1 away, far above the near-tie)."""

    def __init__(self, runner: LlamaRunner):
        self.runner = runner

    def __call__(self, ids: torch.Tensor):
        self.runner.release()
        self.runner.sync_rows([0])
        return SimpleNamespace(logits=self.runner.forward(ForwardBatch.dense(ids, [0], "all")))


@needs_onednn
@pytest.mark.parametrize("batch", [1, 3])
def test_bf16_greedy_speculative_equals_plain(pair, batch):
    target, draft = pair
    gap_runner = LlamaRunner(load_model(target))
    ids = torch.randint(3, 123, (3, 20), generator=torch.Generator().manual_seed(3))
    noise = float(verify_noise(gap_runner, ids, K + 1))
    # Plain and speculative greedy can only part where the target's top-2 gap is within the noise
    # between a T=k+1 verify forward and one-token forwards (measured 0.0 here); 4x that for safety,
    # floored at the float32 near-tie.
    near_tie = max(4 * noise, NEAR_TIE)
    prompts = random_prompts(batch, [3, 11, 6], seed=batch)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(target).generate([{"prompt_token_ids": p} for p in prompts], sp)]
    llm = LLM(target, speculative_config={"model": draft, "num_speculative_tokens": K, "adaptive": False})
    assert llm.engine.drafter.runner.dtype == torch.bfloat16
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_equal(RunnerLogits(gap_runner), p, e, o.outputs[0].token_ids, near_tie=near_tie)
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and 0.1 < m["acceptance_rate"] <= 1.0


def test_onednn_rows_are_bucketed_and_padding_is_bounded():
    from specdec.models.linear import onednn_rows

    assert [onednn_rows(r, 4) for r in (1, 2, 3, 4, 5, 9)] == [4, 4, 4, 4, 8, 12]
    assert onednn_rows(1, 1) == 1 and onednn_rows(2, 1) == 4
    sizes = {onednn_rows(r, 1) for r in range(1, 4097)}
    assert len(sizes) <= 8 * 12 + 16  # a bounded set of kernel shapes however batches vary
    assert all(r <= onednn_rows(r, 1) <= max(r + 3, r * 1.125) for r in range(1, 4097))


def test_host_memory_calls_are_safe():
    import platform

    from specdec.host_memory import pin_mmap_threshold, trim_heap

    pinned = pin_mmap_threshold()
    assert pinned is (platform.libc_ver()[0] == "glibc")  # mallopt succeeds on glibc; elsewhere a no-op
    trim_heap()
