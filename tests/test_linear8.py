"""The 8- and 4-bit weight kernels (models/linear8.py) and their Linear kinds "w8" and "w4": each computes what
its torch reference computes (int8: bit for bit; int4: up to the float32 sums over groups) for any row count and
odd shapes, on each ISA path this CPU has (AVX512-VNNI here, AVX-VNNI under ATen held to AVX2, int4 on AVX2
alone under SPECDEC_NO_VNNI); each is near the float product; the EAGLE-3 head takes int4 by default where it
runs, and ``quantization`` chooses or refuses them with a clear message."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.config import SpeculativeConfig
from specdec.models import linear8
from specdec.models.linear import Linear

ROOT = Path(__file__).resolve().parents[1]
RUNS = linear8.available(8).ok  # both kernels (VNNI)
needs_kernel = pytest.mark.skipif(not RUNS, reason=f"the int8 kernel cannot run here: {linear8.available(8).reason}")


def _cpu_has(flag: str) -> bool:
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


@needs_kernel
@pytest.mark.parametrize("out_features,in_features", [(1, 3), (5, 4), (17, 37), (64, 512), (1027, 515)])
def test_products_equal_the_reference_bit_for_bit_for_1_to_13_rows(out_features, in_features):
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g)
    packed = linear8.pack(w)
    blocks = -(-out_features // 16)
    assert packed.weight.shape == (blocks, -(-in_features // 4), 16, 4) and packed.weight.dtype == torch.int8
    assert packed.scale.shape == packed.comp.shape == (blocks * 16,)
    for rows in range(1, 14):
        x = torch.randn(rows, in_features, generator=g) * 3
        y = linear8.linear8(x, packed, out_features)
        assert y.shape == (rows, out_features) and y.dtype == torch.float32
        assert torch.equal(y, linear8.reference(x, packed, out_features)), f"rows={rows}"


@needs_kernel
def test_zero_rows_of_weights_and_inputs_give_zeros():
    w = torch.randn(20, 40)
    w[3] = 0
    packed = linear8.pack(w)
    x = torch.randn(3, 40)
    x[1] = 0
    y = linear8.linear8(x, packed, 20)
    assert torch.equal(y[1], torch.zeros(20)) and torch.equal(y[:, 3], torch.zeros(3))
    assert torch.equal(y, linear8.reference(x, packed, 20))


@needs_kernel
def test_products_are_near_the_float_product():
    """Two roundings of 1/254 of a row's range: about 1% of the product's norm on Gaussian rows."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(2048, 512, generator=g), torch.randn(4, 512, generator=g)
    exact = x @ w.T
    rel = ((linear8.linear8(x, linear8.pack(w), 2048) - exact).norm() / exact.norm()).item()
    assert rel < 0.02, rel


@needs_kernel
@pytest.mark.parametrize("out_features,in_features,group", [(1, 3, 64), (5, 64, 64), (17, 37, 8), (64, 512, 64),
                                                           (1027, 515, 64), (40, 1408, 32)])
def test_int4_products_equal_the_reference_for_1_to_13_rows(out_features, in_features, group):
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g)
    packed = linear8.pack4(w, group)
    blocks, kp = -(-out_features // 16), -(-in_features // group) * group
    assert packed.weight.shape == (blocks, kp // 8, 16, 4) and packed.weight.dtype == torch.uint8
    assert packed.scale.shape == (blocks, kp // group, 16) and packed.scale.dtype == torch.float16
    q = linear8.unpack4(packed, out_features, in_features)  # what pack4 stored: the rounded groups
    s = packed.scale.transpose(1, 2).reshape(blocks * 16, -1)[:out_features].float().repeat_interleave(group, 1)
    assert q.min() >= -8 and q.max() <= 7
    assert ((q * s[:, :in_features] - w).abs() <= s[:, :in_features] * 0.5 + 1e-3 * w.abs()).all()
    for rows in range(1, 14):
        x = torch.randn(rows, in_features, generator=g) * 3
        y = linear8.linear4(x, packed, out_features)
        assert y.shape == (rows, out_features) and y.dtype == torch.float32
        torch.testing.assert_close(y, linear8.reference4(x, packed, out_features), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_int4_products_are_near_the_float_product():
    """Groups of 64 in 16 levels: about 11% of the product's norm on Gaussian rows (a trained head's drafts
    barely move: docs/benchmarks.md)."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(2048, 512, generator=g), torch.randn(4, 512, generator=g)
    exact = x @ w.T
    rel = ((linear8.linear4(x, linear8.pack4(w), 2048) - exact).norm() / exact.norm()).item()
    assert rel < 0.13, rel
    with pytest.raises(ValueError, match="multiple of 8"):
        linear8.pack4(w, 12)


@pytest.mark.skipif(not (RUNS and _cpu_has("avx_vnni") and linear8.isa() == 2),
                    reason="needs a CPU with both AVX512-VNNI and AVX-VNNI to compare the two paths")
def test_the_8_lane_path_computes_the_same_bits():
    """ATen held to AVX2 (as the restricted suite runs) leaves the kernels their AVX-VNNI path."""
    code = ("import torch; from specdec.models import linear8 as l\n"
            "assert l.available().ok and l.isa() == 1, l.isa()\n"
            "g = torch.Generator().manual_seed(5)\n"
            "for n, k in ((1027, 515), (16, 4), (9, 33)):\n"
            "    w = torch.randn(n, k, generator=g)\n"
            "    p, p4 = l.pack(w), l.pack4(w)\n"
            "    for rows in range(1, 10):\n"
            "        x = torch.randn(rows, k, generator=g)\n"
            "        assert torch.equal(l.linear8(x, p, n), l.reference(x, p, n)), (n, k, rows)\n"
            "        torch.testing.assert_close(l.linear4(x, p4, n), l.reference4(x, p4, n), rtol=1e-5, atol=1e-4)\n"
            "print('ok')")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.skipif(not RUNS, reason="needs specdec's kernels")
def test_without_vnni_int4_runs_on_avx2_and_int8_says_why_not():
    """SPECDEC_NO_VNNI: what a CPU with AVX2 alone runs (EPYC before Zen 4): int4 on vpmaddubsw, the same sums as
    the reference; int8 unavailable with its reason, and the head's default falls back to int4."""
    code = ("import torch; from specdec.models import linear8 as l\n"
            "assert l.available(4).ok and l.isa() == 0, l.isa()\n"
            "assert not l.available(8).ok and 'int4 runs on AVX2' in l.available(8).reason\n"
            "g = torch.Generator().manual_seed(6)\n"
            "for n, k, G in ((1027, 515, 64), (16, 64, 64), (9, 33, 8), (40, 1408, 32)):\n"
            "    p = l.pack4(torch.randn(n, k, generator=g), G)\n"
            "    for rows in range(1, 10):\n"
            "        x = torch.randn(rows, k, generator=g) * 3\n"
            "        torch.testing.assert_close(l.linear4(x, p, n), l.reference4(x, p, n), rtol=1e-5, atol=1e-4)\n"
            "from specdec.models.linear import Linear\n"
            "w = torch.randn(32, 64)\n"
            "assert Linear(w, quantize='int4').kind == 'w4' and Linear(w, quantize='int8').kind != 'w8'\n"
            "from specdec.drafters import eagle3\n"
            "class T: device = torch.device('cpu')\n"
            "assert eagle3.head_quantization(T()) == 'int4'\n"
            "try:\n"
            "    eagle3.head_quantization(T(), 'int8')\n"
            "except ValueError as e:\n"
            "    assert 'int4 runs on AVX2' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('int8 without VNNI')\n"
            "print('ok')")
    env = {**os.environ, linear8.NO_VNNI_ENV: "1", "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("quantize,kind", [("int8", "w8"), ("int4", "w4")])
def test_linear_quantizes_only_where_asked_and_the_kernel_runs(quantize, kind):
    w = torch.randn(48, 64)
    assert Linear(w).kind not in ("w8", "w4")
    lin = Linear(w, quantize=quantize)
    assert lin.kind == (kind if linear8.available(int(quantize[3:])).ok else Linear(w).kind)
    y = lin(torch.randn(2, 3, 64))
    assert y.shape == (2, 3, 48) and y.dtype == torch.float32
    with pytest.raises(ValueError, match="quantize must be"):
        Linear(w, quantize="int2")


def test_quantization_is_checked():
    for q in ("int8", "int4", "none"):
        assert SpeculativeConfig(method="eagle3", model="h", quantization=q).quantization == q
    with pytest.raises(ValueError, match="quantization must be one of"):
        SpeculativeConfig(method="eagle3", model="h", quantization="fp8")
    with pytest.raises(ValueError, match="needs method 'eagle3'"):
        SpeculativeConfig(method="draft_model", model="d", quantization="none")


def test_the_head_takes_int4_by_default_where_it_runs_and_says_why_not_elsewhere(monkeypatch):
    from specdec.drafters import eagle3

    class Target:
        device = torch.device("cpu")

    assert eagle3.head_quantization(Target()) == ("int4" if linear8.available(4).ok else None)
    assert eagle3.head_quantization(Target(), "none") is None
    if RUNS:
        assert eagle3.head_quantization(Target(), "int8") == "int8"
    monkeypatch.setattr(linear8, "available", lambda bits=8: linear8.native.Availability(False, "no kernels on this CPU"))
    assert eagle3.head_quantization(Target()) is None
    with pytest.raises(ValueError, match="no kernels on this CPU.*set it to 'none'"):
        eagle3.head_quantization(Target(), "int4")
