"""The 16-bit weight kernel (models/linear16.py) and its Linear kind "w16": float32 products of bf16 / f16
weights equal the float32 product of the same weights up to the order of the sums, for any row count and
odd shapes; chosen only where bf16 is not native; picked by the restricted environment that stands in for
an AVX2-only CPU; and a model loaded through the real path (dtype="auto") decodes the float32 path's
greedy tokens, eager and compiled."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.models import cpu, linear16
from specdec.models.linear import Linear, dot_products

ROOT = Path(__file__).resolve().parents[1]
HAS_AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
pytestmark = pytest.mark.skipif(not HAS_AVX2, reason="the 16-bit weight kernel is for x86 CPUs with AVX2")
RESTRICTED = {cpu.NO_NATIVE_ENV: "1", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ w^T in float64 from the exactly converted weights: [rows, out]."""
    return x.double() @ w.double().t()


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What float32 sums in any order may differ from the exact product by: ~in * 2^-24 * sum |x w|."""
    return (x.abs().double() @ w.abs().double().t()) * x.shape[-1] * 2.0**-23 + 1e-30


def test_the_kernel_builds_here():
    assert linear16.available().ok, linear16.available().reason


def test_the_kernel_runs_16_lanes_wide_where_avx512_runs():
    """The width follows the CPU and ATen's capability: AVX-512 (unless ATEN_CPU_CAPABILITY holds ATen to
    AVX2, as the restricted suite does) runs the 16-lane product; the rest of this file checks its sums."""
    assert linear16.lanes() == (16 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 8)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_features,in_features", [(1, 3), (5, 8), (13, 37), (64, 512), (1027, 515)])
def test_products_equal_the_float32_product_for_1_to_9_rows(wdtype, out_features, in_features):
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g).to(wdtype)  # [out, in]
    packed = linear16.pack(w)
    assert packed.shape == (-(-out_features // 4), -(-in_features // 8), 4, 8) and packed.dtype == wdtype
    for rows in range(1, 10):
        x = torch.randn(rows, in_features, generator=g)  # [rows, in]
        y = linear16.linear16(x, packed, out_features)
        assert y.shape == (rows, out_features) and y.dtype == torch.float32
        err = (y.double() - reference(x, w)).abs()
        assert (err <= bound(x, w)).all(), f"rows={rows}: max error {err.max():.3g}"
        # the float32 path the kind replaces (x @ w^T on the converted weights) agrees as closely
        torch.testing.assert_close(y, x @ w.float().t(), rtol=1e-5, atol=1e-5 * x.abs().max().item())


def test_many_rows_and_two_threads():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=g).bfloat16()
    x = torch.randn(70, 200, generator=g)  # a prefill's worth
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y = linear16.linear16(x, linear16.pack(w), 300)
    finally:
        torch.set_num_threads(n)
    assert ((y.double() - reference(x, w)).abs() <= bound(x, w)).all()


def test_bad_input_is_refused_with_a_message():
    w = linear16.pack(torch.randn(8, 16).bfloat16())
    with pytest.raises(RuntimeError, match="x must be float32"):
        linear16.linear16(torch.randn(2, 16).bfloat16(), w, 8)
    with pytest.raises(RuntimeError, match="does not hold 8 x 24"):
        linear16.linear16(torch.randn(2, 24), w, 8)
    with pytest.raises(RuntimeError, match="packed w"):
        linear16.linear16(torch.randn(2, 16), torch.randn(8, 16).bfloat16(), 8)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        linear16.linear16(torch.randn(2, 16), torch.zeros(2, 2, 4, 8), 8)


def test_the_kind_is_chosen_only_without_native_bf16(monkeypatch):
    w = torch.randn(24, 40)
    native = cpu.native_bf16().native
    assert Linear(w.bfloat16()).kind == (("w16dot" if dot_products() else "onednn") if native else "w16")
    assert Linear(w.half()).kind == "w16"  # no native f16 kernel on any CPU path here
    assert Linear(w).kind == "wxt"  # float32 weights stay on ATen
    monkeypatch.setenv(cpu.NO_NATIVE_ENV, "1")
    lin = Linear(w.bfloat16(), bias=torch.randn(24).bfloat16())
    assert lin.kind == "w16" and lin.dtype == torch.bfloat16
    x = torch.randn(2, 3, 40).bfloat16()  # any dtype and leading dims in; float32 out
    y = lin(x)
    assert y.shape == (2, 3, 24) and y.dtype == torch.float32
    expected = x.float() @ w.bfloat16().float().t() + lin.bias.float()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_the_restricted_environment_picks_it():
    """The stand-in for an AVX2-only CPU: the kind, the dtype "auto" keeps, inductor's vector ISA."""
    code = """
import json, torch
from torch._inductor import cpu_vec_isa
from specdec.models.linear import Linear
from specdec.models import dtype_choice
from specdec.models.resolve import resolve
source = resolve("specdec/demo-target")
verdict = dtype_choice.bf16_verdict(*dtype_choice.largest_product(dtype_choice.config_of(source)))
print(json.dumps({"kind": Linear(torch.ones(8, 16, dtype=torch.bfloat16)).kind, "aten": torch.backends.cpu.get_cpu_capability(),
                  "inductor": str(cpu_vec_isa.pick_vec_isa()), "dtype": dtype_choice.dtype_for(source, "torch"),
                  "use_bf16": verdict.use_bf16, "reason": verdict.reason}))
"""
    env = {**os.environ, **RESTRICTED}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kind"] == "w16" and got["aten"] == "AVX2" and got["inductor"] == "avx2", got
    assert "float32 products of bf16 weights" in got["reason"], got  # timed on the kernel, not refused untimed
    assert got["dtype"] == ("bfloat16" if got["use_bf16"] else "float32"), got


@pytest.fixture(scope="module")
def no_native():
    mp = pytest.MonkeyPatch()
    mp.setenv(cpu.NO_NATIVE_ENV, "1")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
    mp.undo()


def test_demo_target_greedy_equals_the_float32_path(no_native):
    """The shipped target through the real loading path: auto keeps its bf16 weights on the kernel where
    it measured faster; its greedy tokens equal float32 weights' on held-out prompts, or part only where
    the float32 path's top-2 gap is within float32 rounding (a near-tie)."""
    from specdec import LLM, SamplingParams
    from specdec.models import dtype_choice
    from specdec.near_tie import FLOAT32_NEAR_TIE, first_mismatch, top2

    prompts = [json.loads(line)["prompt"][-400:] for line in
               (ROOT / "benchmarks/prompts/code_heldout.jsonl").read_text().splitlines()[:6]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    runs = {}
    for dtype in ("float32", "bfloat16"):  # bfloat16: what auto picks where the kernel measured faster
        llm = LLM(model="specdec/demo-target", backend="torch", dtype=dtype, enforce_eager=True)
        runs[dtype] = (llm, llm.generate(prompts, params))
    w16 = runs["bfloat16"][0].target
    assert w16.dtype == torch.bfloat16 and w16.compute_dtype == torch.float32
    assert w16.lm_head.kind == "w16" and w16.layers[0].gate_up.kind == "w16"
    assert "16-bit weights, float32 products" in w16.describe()
    verdict = dtype_choice.bf16_verdict(*dtype_choice.largest_product(w16.config))
    assert "float32 products of bf16 weights" in verdict.reason
    f32 = runs["float32"][0].target
    equal = 0
    for a, b in zip(runs["float32"][1], runs["bfloat16"][1]):
        x, y = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        assert len(x) == len(y) == 32
        j = first_mismatch(x, y)
        if j is None:
            equal += 1
            continue
        _, gap = top2(f32, list(a.prompt_token_ids) + x[:j])
        assert gap < FLOAT32_NEAR_TIE, f"parted at {j} where the float32 top-2 gap is {gap:.3g}: not a near-tie"
    assert equal >= len(prompts) - 1, f"only {equal} of {len(prompts)} equal"


def test_compiled_step_calls_the_kernel_and_equals_float32(no_native, tmp_path):
    """A small bf16 model's compiled step (the kernel as an extern call in inductor's graph) against the
    float32 forward of the same weights: logits within float32 rounding, the compiled path asserted, at
    each length the kernel's sizes pad to (compiled.sizes_for: 1, 3, 6, 9; 16 lanes wide 1, 4, 6, 8, 12)."""
    from specdec.models.compiled import W16_SIZES, W16_WIDE_SIZES
    from specdec.models.base import ForwardBatch
    from specdec.models.llama import LlamaRunner
    from specdec.models.load import load_model
    from tiny_models import make_model

    folder = str(make_model(tmp_path / "m", "llama", hidden=64, vocab_rows=203))
    compiled = LlamaRunner(load_model(folder, "bfloat16"), enforce_eager=False)
    ref = LlamaRunner(load_model(folder, "bfloat16"), enforce_eager=True)
    with torch.no_grad():  # the float32 path on the same (bf16-rounded) weights
        f32_model = load_model(folder, "bfloat16")
        f32_model.hf_model.float()
    f32 = LlamaRunner(f32_model, enforce_eager=True)
    assert compiled.compiled is not None and compiled.lm_head.kind == "w16" and f32.lm_head.kind == "wxt"
    assert compiled.compiled.sizes == (W16_WIDE_SIZES if linear16.lanes() == 16 else W16_SIZES)
    prompt = list(range(5, 25))
    for r in (compiled, ref, f32):
        r.sync_rows(["a"])
        r.forward(ForwardBatch.from_rows([prompt[:12]], [0], logits="none"))
    for tokens, start in (([prompt[12]], 12), (prompt[13:15], 13), (prompt[13:18], 13), (prompt[13:21], 13),
                          (prompt[13:22], 13)):  # T = 1, 2, 5, 8, 9
        outs = [r.forward(ForwardBatch.from_rows([tokens], [start], logits="all")) for r in (compiled, ref, f32)]
        assert compiled.last_path == "compiled"
        torch.testing.assert_close(outs[0], outs[2], rtol=0, atol=1e-4)
        torch.testing.assert_close(outs[1], outs[2], rtol=0, atol=1e-4)
