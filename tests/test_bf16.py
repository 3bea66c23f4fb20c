"""The bfloat16 CPU path: oneDNN linears, ``dtype="auto"``, the runner's bf16 logits against
transformers' float32 forward, and greedy speculative decoding equal to plain decoding."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from specdec import LLM, SamplingParams
from specdec.models import cpu, dtype_choice, linear16, timings
from specdec.models.base import ForwardBatch
from specdec.models.linear import NO_DOT_ENV, Linear, dot_products
from specdec.models.llama import LlamaRunner
from specdec.models.load import load_model
from specdec.near_tie import BF16_RELATIVE_STEP, first_divergence
from tiny_models import make_model, random_prompts

NATIVE = cpu.native_bf16()
needs_native = pytest.mark.skipif(not NATIVE.native, reason=f"bf16 is not native here ({NATIVE.reason}): "
                                                             "bf16 weights take the w16 or w @ x^T path, tested below")


def slow_kind() -> str:
    """The kind of a bf16 Linear without native bf16: the 16-bit weight kernel where it builds and runs
    (x86 with AVX2, tests/test_linear16.py), else ATen's w @ x^T."""
    return "w16" if linear16.available().ok else "wxt"


@pytest.fixture
def no_kernel(monkeypatch):
    """As on a CPU (or install) where the 16-bit weight kernel does not run: w @ x^T for 16-bit weights."""
    monkeypatch.setattr(linear16, "available", lambda: linear16.Availability(False, "switched off by a test"))
# Runner (bf16 weights; float32 residual stream, norms and attention) against transformers in float32 from
# the same bf16 weights: each product rounds its input and its result to bf16 (8 significant bits, relative
# 2^-8 each; the two add in quadrature), and the errors of the products on a token's path (4 per layer and
# the LM head) add at worst linearly. Relative to the largest logit.
LAYERS = 2
LOGIT_TOL = (4 * LAYERS + 1) * 2**0.5 * 2**-8
K = 4


@pytest.fixture
def onednn(monkeypatch):
    """bf16 weights on oneDNN where bf16 is native (as where linear16's dot products do not run)."""
    monkeypatch.setenv(NO_DOT_ENV, "1")


@needs_native
def test_onednn_linear_matches_f_linear(onednn):
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
                    # oneDNN accumulates in float32 and rounds its output to bf16: relative error <= 2^-8;
                    # two bf16 ulps of tolerance.
                    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-4)


@pytest.mark.skipif(not (NATIVE.native and NATIVE.isa.startswith("x86_64")),
                    reason="row invariance is a property of oneDNN's native x86 bf16 kernels (avx512_bf16 / AMX), "
                           f"not of this CPU's path ({NATIVE.isa}: {NATIVE.reason})")
def test_onednn_rows_are_computed_alike_whatever_the_row_count(onednn):
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
def test_wxt_linear_matches_f_linear(monkeypatch, no_kernel, wdtype):
    monkeypatch.setenv(cpu.NO_NATIVE_ENV, "1")  # bf16 goes to wxt too (without the 16-bit weight kernel)
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


def cpu_flags() -> set[str]:
    """The kernel's own list of this CPU's features (Linux x86), read apart from torch's detection."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def test_native_bf16_follows_the_cpu_and_the_restrictions(monkeypatch):
    flags = cpu_flags()
    if NATIVE.isa.startswith("x86_64") and flags:
        has_bf16 = bool({"avx512_bf16", "amx_bf16"} & flags)
        restricted = torch.backends.cpu.get_cpu_capability() != "AVX512" or os.environ.get(
            "ONEDNN_MAX_CPU_ISA", "ALL").upper() not in cpu.ONEDNN_BF16_ISAS
        switched = os.environ.get(cpu.NO_NATIVE_ENV, "0") not in ("0", "")
        assert NATIVE.native == (has_bf16 and not restricted and not switched), NATIVE
        if not has_bf16 and not switched:  # SPECDEC_NO_NATIVE_BF16 gives its own reason first
            assert "no avx512_bf16 or amx_bf16" in NATIVE.reason  # emulated bf16 (any AVX-512 CPU) is not native
    monkeypatch.setenv(cpu.NO_NATIVE_ENV, "1")
    off = cpu.native_bf16()
    assert not off.native and cpu.NO_NATIVE_ENV in off.reason
    assert Linear(torch.ones(8, 4, dtype=torch.bfloat16)).kind == slow_kind()


def config(dt, hidden=64):
    return SimpleNamespace(dtype=dt, hidden_size=hidden, intermediate_size=2 * hidden, vocab_size=4 * hidden,
                           num_attention_heads=4, num_key_value_heads=2)


def test_torch_dtype(monkeypatch, no_kernel):
    monkeypatch.setenv(cpu.NO_NATIVE_ENV, "1")  # as on a CPU without native bf16 or the 16-bit weight kernel
    for bf16 in (torch.bfloat16, "bfloat16"):
        assert dtype_choice.torch_dtype("auto", config(bf16), "cpu") == torch.float32
        assert dtype_choice.torch_dtype("auto", config(bf16), "cuda") == torch.bfloat16
    assert dtype_choice.torch_dtype("auto", config(torch.float16), "cpu") == torch.float32
    assert dtype_choice.torch_dtype("auto", config(torch.float16), "cuda") == torch.float16
    assert dtype_choice.torch_dtype("auto", config(torch.float32), "cpu") == torch.float32
    assert dtype_choice.torch_dtype("auto", config(None), "cpu") == torch.float32
    assert dtype_choice.torch_dtype("bfloat16", config(torch.float32), "cpu") == torch.bfloat16  # explicit stays
    assert dtype_choice.torch_dtype("float32", config(torch.bfloat16), "cpu") == torch.float32
    with pytest.raises(ValueError, match="float32.*bfloat16.*float16.*auto.*'half'"):
        dtype_choice.torch_dtype("half", config(torch.float32), "cpu")


def test_auto_keeps_bf16_only_where_native_and_timed_faster(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    shape = dtype_choice.largest_product(config(torch.bfloat16, hidden=96))
    assert shape == (4 * 96, 96)  # the LM head, the largest of the three
    verdict = dtype_choice.bf16_verdict(*shape)
    if not NATIVE.native and not linear16.available().ok:  # nothing timed, nothing cached
        assert not verdict.use_bf16 and verdict.reason.startswith("no native bf16") and not dtype_choice.cache_path().exists()
        assert dtype_choice.torch_dtype("auto", config(torch.bfloat16, hidden=96), "cpu") == torch.float32
        return
    path = "native bf16" if NATIVE.native else "float32 products of bf16 weights"  # oneDNN, or the w16 kernel
    assert path in verdict.reason, verdict.reason
    cached = json.loads(dtype_choice.cache_path().read_text())
    (key,) = cached
    assert key.endswith("384x96") and cached[key] == verdict.ms and all(t > 0 for t in verdict.ms["bf16"])
    expected = torch.bfloat16 if verdict.use_bf16 else torch.float32
    assert dtype_choice.torch_dtype("auto", config(torch.bfloat16, hidden=96), "cpu") == expected
    # the cached verdict is what decides, timed once per machine: bf16 slower at 5 rows -> float32
    cached[key] = {"bf16": [0.1, 0.3], "float32": [0.2, 0.2]}
    dtype_choice.cache_path().write_text(json.dumps(cached))
    assert "not faster" in dtype_choice.bf16_verdict(*shape).reason
    assert dtype_choice.torch_dtype("auto", config(torch.bfloat16, hidden=96), "cpu") == torch.float32
    cached[key] = {"bf16": [0.1, 0.1], "float32": [0.2, 0.2]}
    dtype_choice.cache_path().write_text(json.dumps(cached))
    assert dtype_choice.torch_dtype("auto", config(torch.bfloat16, hidden=96), "cpu") == torch.bfloat16


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


def test_auto_without_native_bf16_or_the_kernel_is_float32_untimed(monkeypatch, no_kernel, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(cpu.NO_NATIVE_ENV, "1")
    verdict = dtype_choice.bf16_verdict(*dtype_choice.largest_product(config(torch.bfloat16, hidden=96)))
    assert not verdict.use_bf16 and "switched off by a test" in verdict.reason and not verdict.ms
    assert not dtype_choice.cache_path().exists()
    assert dtype_choice.torch_dtype("auto", config(torch.bfloat16, hidden=96), "cpu") == torch.float32


def test_auto_loads_a_bf16_checkpoint_as_float32_without_native_bf16(pair, monkeypatch, no_kernel):
    monkeypatch.setenv(cpu.NO_NATIVE_ENV, "1")
    runner = LLM(pair[0]).target
    assert runner.dtype == torch.float32 and runner.layers[0].qkv.kind == "wxt"
    path = dtype_choice.describe_path(runner, "auto")  # what demo and bench print
    assert "float32 weights, w @ x^T" in path and f"no native bf16: {cpu.NO_NATIVE_ENV}=1 is set" in path, path
    explicit = LLM(pair[0], dtype="bfloat16").target  # asked for: bf16 weights on the w @ x^T path
    assert explicit.dtype == torch.bfloat16 and explicit.layers[0].qkv.kind == "wxt"
    path = dtype_choice.describe_path(explicit, "bfloat16")
    assert "bfloat16 weights, w @ x^T" in path and "--dtype bfloat16, no native bf16" in path, path


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


def kind(native: bool) -> str:
    """bf16 weights' kind: with native bf16, linear16's dot products where they run (avx512_bf16), else oneDNN."""
    return ("w16dot" if dot_products() else "onednn") if native else slow_kind()


@pytest.mark.parametrize("native", [True, False], ids=["native", "switched-off"])
def test_bf16_runner_logits(pair, monkeypatch, native):
    if native and not NATIVE.native:
        pytest.skip(f"bf16 is not native here ({NATIVE.reason})")
    if not native:
        monkeypatch.setenv(cpu.NO_NATIVE_ENV, "1")
    runner = LLM(pair[0], dtype="bfloat16").target
    assert runner.dtype == torch.bfloat16 and runner.compute_dtype == torch.float32
    assert runner.layers[0].qkv.kind == kind(native) and runner.lm_head.kind == kind(native)
    hf32 = load_model(pair[0], dtype="float32").hf_model
    ids = torch.randint(3, 123, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf32(ids).logits[:, -1, : runner.vocab_size]
    runner.release()
    runner.sync_rows(list(range(4)))
    out = runner.forward(ForwardBatch.dense(ids, [0] * 4, "last"))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=LOGIT_TOL * float(ref.abs().max()), rtol=0)
    # a verify pass (T = k+1) against k+1 one-token steps: the same products on other row counts, so at
    # most a bf16 rounding step or two apart (0.0 where oneDNN's rows are row-count invariant)
    assert verify_noise(runner, ids, K + 1) <= BF16_RELATIVE_STEP * float(ref.abs().max())


@pytest.mark.parametrize("native", [True, False], ids=["native", "switched-off"])
@pytest.mark.parametrize("batch", [1, 3])
def test_bf16_greedy_speculative_equals_plain(pair, monkeypatch, batch, native):
    """Equal, or parting only where the target's top-2 logits are within two bf16 rounding steps
    (``specdec.near_tie``: a threshold set by the dtype, not by measured noise)."""
    if native and not NATIVE.native:
        pytest.skip(f"bf16 is not native here ({NATIVE.reason})")
    if not native:
        monkeypatch.setenv(cpu.NO_NATIVE_ENV, "1")
    target, draft = pair
    gap_runner = LlamaRunner(load_model(target, dtype="bfloat16"))
    prompts = random_prompts(batch, [3, 11, 6], seed=batch)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(target, dtype="bfloat16")
    expected = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    llm = LLM(target, dtype="bfloat16",
              speculative_config={"model": draft, "num_speculative_tokens": K, "adaptive": False})
    assert llm.engine.drafter.runner.dtype == torch.bfloat16
    assert llm.engine.drafter.runner.lm_head.kind == kind(native)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, e, o in zip(prompts, expected, outs):
        d = first_divergence(gap_runner, p, e, o.outputs[0].token_ids)
        assert d is None or d["near_tie"], d
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


def test_timings_are_measured_once_and_again_when_the_cache_is_damaged(tmp_path):
    path, names, calls = tmp_path / "t.json", ("bf16", "float32"), []
    measured = {"bf16": [1.0, 2.0], "float32": [3.0, 4.0]}

    def measure():
        calls.append(1)
        return measured

    assert timings.cached(path, "key", measure, names) == measured
    assert timings.cached(path, "key", measure, names) == measured and len(calls) == 1  # from the file
    for damaged in ('{"key": {"bf16": [1.0]}}', '{"key": {"bf16": [1, 2], "float32": ["x", 2]}}', "not json", "[1, 2]"):
        path.write_text(damaged)
        assert timings.cached(path, "key", measure, names) == measured
    assert len(calls) == 5 and json.loads(path.read_text())["key"] == measured
