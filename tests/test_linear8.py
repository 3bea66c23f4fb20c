"""The 8-bit weight kernel (models/linear8.py) and its Linear kind "w8": the kernel computes what its torch
reference computes, bit for bit, for any row count and odd shapes, on each ISA path this CPU has (AVX512-VNNI
here, AVX-VNNI under ATen held to AVX2); it is near the float product; the EAGLE-3 head takes it by default
where it runs, and ``quantization`` chooses or refuses it with a clear message."""

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
RUNS = linear8.available().ok
needs_kernel = pytest.mark.skipif(not RUNS, reason=f"the int8 kernel cannot run here: {linear8.available().reason}")


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


@pytest.mark.skipif(not (RUNS and _cpu_has("avx_vnni") and linear8.isa() == 2),
                    reason="needs a CPU with both AVX512-VNNI and AVX-VNNI to compare the two paths")
def test_the_8_lane_path_computes_the_same_bits():
    """ATen held to AVX2 (as the restricted suite runs) leaves the kernel its AVX-VNNI path."""
    code = ("import torch; from specdec.models import linear8 as l\n"
            "assert l.available().ok and l.isa() == 1, l.isa()\n"
            "g = torch.Generator().manual_seed(5)\n"
            "for n, k in ((1027, 515), (16, 4), (9, 33)):\n"
            "    p = l.pack(torch.randn(n, k, generator=g))\n"
            "    for rows in range(1, 10):\n"
            "        x = torch.randn(rows, k, generator=g)\n"
            "        assert torch.equal(l.linear8(x, p, n), l.reference(x, p, n)), (n, k, rows)\n"
            "print('ok')")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_linear_takes_int8_only_where_asked_and_the_kernel_runs():
    w = torch.randn(48, 64)
    assert Linear(w).kind != "w8"
    lin = Linear(w, int8=True)
    assert lin.kind == ("w8" if RUNS else Linear(w).kind)
    y = lin(torch.randn(2, 3, 64))
    assert y.shape == (2, 3, 48) and y.dtype == torch.float32


def test_quantization_is_checked():
    ok = SpeculativeConfig(method="eagle3", model="h", quantization="int8")
    assert ok.quantization == "int8"
    with pytest.raises(ValueError, match="quantization must be one of"):
        SpeculativeConfig(method="eagle3", model="h", quantization="fp8")
    with pytest.raises(ValueError, match="needs method 'eagle3'"):
        SpeculativeConfig(method="draft_model", model="d", quantization="none")


def test_the_head_takes_int8_by_default_where_it_runs_and_says_why_not_elsewhere(monkeypatch):
    from specdec.drafters import eagle3

    class Target:
        device = torch.device("cpu")

    assert eagle3.head_int8(Target()) is RUNS
    assert eagle3.head_int8(Target(), "none") is False
    monkeypatch.setattr(linear8, "available", lambda: linear8.native.Availability(False, "no VNNI on this CPU"))
    assert eagle3.head_int8(Target()) is False
    with pytest.raises(ValueError, match="no VNNI on this CPU.*set it to 'none'"):
        eagle3.head_int8(Target(), "int8")
