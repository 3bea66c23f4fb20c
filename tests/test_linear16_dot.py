"""linear16's bf16 dot-product kernel (``specdec::linear16_dot``, Linear kind "w16dot", CPUs with avx512_bf16):
the product of bf16 rows and bf16 weights equals the exact product of the same bf16 values up to float32
sums, for 1 to 97 rows (1-6 rows against 4 blocks of 16 weight rows, 7-12 against 2, more in passes), odd shapes and two
threads; where the CPU has AMX, passes of 5+ rows on AMX tiles over the same layout are exact the same way; bf16
weights take it wherever it runs; bad input is refused with a message; and a model loaded through the real path
decodes the same greedy tokens eager and compiled."""

import pytest
import torch

from specdec.models import cpu, linear16
from specdec.models.linear import Linear, dot_products

pytestmark = pytest.mark.skipif(not dot_products(), reason="the bf16 dot-product kernel needs avx512_bf16")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ w^T in float64 of the bf16 values: [rows, out]."""
    return x.double() @ w.double().t()


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 sums in any order: ~in * 2^-24 * sum |x w| (each bf16 x bf16 product is exact in float32)."""
    return (x.abs().double() @ w.abs().double().t()) * x.shape[-1] * 2.0**-23 + 1e-30


@pytest.mark.parametrize("out_features,in_features", [(1, 3), (5, 8), (13, 37), (64, 512), (1027, 515), (36, 2048)])
def test_products_equal_the_exact_product_of_the_bf16_values(out_features, in_features):
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()  # [out, in]
    packed = linear16.pack_dot(w)
    assert packed.shape == (-(-out_features // 16), -(-in_features // 2), 16, 2)
    for rows in [*range(1, 18), 24, 33, 40, 97]:  # every pass shape, and slabs of 48 rows
        x = torch.randn(rows, in_features, generator=g).bfloat16()  # [rows, in]
        y = linear16.linear16_dot(x, packed, out_features)
        assert y.shape == (rows, out_features) and y.dtype == torch.float32
        err = (y.double() - reference(x, w)).abs()
        assert (err <= bound(x, w)).all(), f"rows={rows}: max error {err.max():.3g}"


def test_two_or_more_rows_give_each_row_the_same_sums_whatever_their_count():
    """Passes of several rows sum each row in one order (one chain per row and block), so a row's result does not
    depend on how many rows share the call; one row alone (decoding) sums in four chains, within rounding."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 300, generator=g).bfloat16()
    packed = linear16.pack_dot(w)
    x = torch.randn(40, 300, generator=g).bfloat16()
    full = linear16.linear16_dot(x, packed, 70)
    for n in (2, 3, 5, 7, 12, 13, 17, 33):
        assert torch.equal(linear16.linear16_dot(x[:n], packed, 70), full[:n]), f"{n} rows"
    alone = linear16.linear16_dot(x[:1], packed, 70)
    torch.testing.assert_close(alone, full[:1], rtol=0, atol=float(bound(x[:1], w).max()))


def test_two_threads_and_a_prefill_of_rows():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=g).bfloat16()
    x = torch.randn(130, 200, generator=g).bfloat16()  # three slabs of up to 48 rows
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y = linear16.linear16_dot(x, linear16.pack_dot(w), 300)
    finally:
        torch.set_num_threads(n)
    assert ((y.double() - reference(x, w)).abs() <= bound(x, w)).all()


def test_bad_input_is_refused_with_a_message():
    w = linear16.pack_dot(torch.randn(8, 16).bfloat16())
    with pytest.raises(RuntimeError, match="x and w must be bfloat16"):
        linear16.linear16_dot(torch.randn(2, 16), w, 8)
    with pytest.raises(RuntimeError, match="x and w must be bfloat16"):
        linear16.linear16_dot(torch.randn(2, 16).bfloat16(), linear16.pack_dot(torch.randn(8, 16).half()), 8)
    with pytest.raises(RuntimeError, match="does not hold 8 x 24"):
        linear16.linear16_dot(torch.randn(2, 24).bfloat16(), w, 8)
    with pytest.raises(RuntimeError, match="packed w"):
        linear16.linear16_dot(torch.randn(2, 16).bfloat16(), torch.randn(8, 16).bfloat16(), 8)


def test_bf16_weights_take_it_where_bf16_is_native(monkeypatch):
    """The input is rounded to bf16 as oneDNN rounds it; the result stays float32 (oneDNN rounds it too)."""
    w = torch.randn(24, 40)
    lin = Linear(w.bfloat16(), bias=torch.randn(24).bfloat16())
    assert lin.kind == "w16dot" and lin.dtype == torch.bfloat16
    x = torch.randn(2, 3, 40)  # any dtype and leading dims in; float32 out
    y = lin(x)
    assert y.shape == (2, 3, 24) and y.dtype == torch.float32
    expected = x.bfloat16().double() @ w.bfloat16().double().t() + lin.bias.double()
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    assert Linear(w.half()).kind == "w16"  # f16 keeps the float32 products
    monkeypatch.setenv(cpu.NO_NATIVE_ENV, "1")  # as on a CPU without native bf16
    assert Linear(w.bfloat16()).kind == "w16"


def test_cpus_with_amx_take_it_where_its_tiles_run(monkeypatch):
    """A CPU with amx_bf16 runs bf16 weights on the kernel where its AMX tiles run (passes of 5+ rows, a prefill,
    go to them), and keeps oneDNN's AMX kernels where they do not (as SPECDEC_NO_BF16_DOT=1 asks anywhere)."""
    caps = {**torch.cpu.get_capabilities(), "amx_bf16": True}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    monkeypatch.setattr(linear16, "amx_tiles", lambda: False)
    assert not dot_products() and Linear(torch.randn(24, 40).bfloat16()).kind == "onednn"
    monkeypatch.setattr(linear16, "amx_tiles", lambda: True)
    assert dot_products() and Linear(torch.randn(24, 40).bfloat16()).kind == "w16dot"


amx = pytest.mark.skipif(not linear16.amx_tiles(), reason="the kernel's AMX tiles need amx_bf16 and the OS's leave")


@amx
@pytest.mark.parametrize("out_features,in_features", [(1, 32), (13, 64), (64, 512), (1027, 544), (36, 2048)])
def test_tiles_equal_the_exact_product_of_the_bf16_values(out_features, in_features):
    """AMX tiles on pack_dot's layout: any row count (padded to tiles of 16 rows), output counts that leave half a
    unit of 32 weight rows or part of a block, inputs in tiles of 32."""
    g = torch.Generator().manual_seed(out_features * 7 + in_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()  # [out, in]
    packed = linear16.pack_dot(w)
    for rows in (1, 4, 5, 15, 16, 17, 31, 32, 33, 70, 130):
        x = torch.randn(rows, in_features, generator=g).bfloat16()  # [rows, in]
        y = linear16.linear16_dot_amx(x, packed, out_features)
        assert y.shape == (rows, out_features) and y.dtype == torch.float32 and y.is_contiguous()
        err = (y.double() - reference(x, w)).abs()
        assert (err <= bound(x, w)).all(), f"rows={rows}: max error {err.max():.3g}"
        if rows >= linear16.amx_min_rows():  # what linear16_dot runs for these rows
            assert torch.equal(linear16.linear16_dot(x, packed, out_features), y)


@amx
def test_rows_on_tiles_give_each_row_the_same_sums_whatever_their_count():
    """A row's sums on tiles do not depend on the rows beside it (its own row of each tile), so passes of 5+ rows
    agree with each other, as passes of 2-4 rows on dot products do; the two differ within float32 rounding."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, 320, generator=g).bfloat16()
    packed = linear16.pack_dot(w)
    x = torch.randn(40, 320, generator=g).bfloat16()
    full = linear16.linear16_dot(x, packed, 70)
    for n in (5, 7, 12, 16, 17, 33):
        assert torch.equal(linear16.linear16_dot(x[:n], packed, 70), full[:n]), f"{n} rows"
    few = linear16.linear16_dot(x[:4], packed, 70)
    for n in (1, 2, 3):  # on AMX CPUs one row alone runs as 2-4 rows do (their faster read of the weights there)
        assert torch.equal(linear16.linear16_dot(x[:n], packed, 70), few[:n]), f"{n} rows"
    torch.testing.assert_close(few, full[:4], rtol=0, atol=float(bound(x[:4], w).max()))


@amx
def test_tiles_refuse_inputs_off_their_width():
    w = linear16.pack_dot(torch.randn(8, 48).bfloat16())
    with pytest.raises(RuntimeError, match="multiple of 32"):
        linear16.linear16_dot_amx(torch.randn(2, 48).bfloat16(), w, 8)
    x = torch.randn(20, 48).bfloat16()  # linear16_dot keeps such inputs on dot products
    assert ((linear16.linear16_dot(x, w, 8).double() - reference(x, linear16_unpack(w, 8, 48))).abs()
            <= bound(x, linear16_unpack(w, 8, 48))).all()


def linear16_unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """pack_dot's layout [blocks, in / 2, 16, 2] -> the weight [out, in]."""
    blocks, pairs = packed.shape[:2]
    return packed.transpose(1, 2).reshape(blocks * 16, pairs * 2)[:out_features, :in_features]


def test_a_model_compiled_and_eager_on_the_kernel(tmp_path):
    """A small bf16 model loaded through the real path runs its products here, and its compiled step (the
    kernel an extern call in inductor's graph) gives the eager step's logits at and between its compiled
    sizes (1, 2, 4, 6, 8, 10, 12, 17) and past them; both within bf16 input rounding of the float32 forward of the same weights."""
    from specdec.models.base import ForwardBatch
    from specdec.models.compiled import sizes_for
    from specdec.models.llama import LlamaRunner
    from specdec.models.load import load_model
    from tiny_models import make_model

    folder = str(make_model(tmp_path / "m", "llama", hidden=64, vocab_rows=203))
    compiled = LlamaRunner(load_model(folder, "bfloat16"), enforce_eager=False, longest_feed=17)
    eager = LlamaRunner(load_model(folder, "bfloat16"), enforce_eager=True)
    with torch.no_grad():  # the float32 path on the same (bf16-rounded) weights
        f32_model = load_model(folder, "bfloat16")
        f32_model.hf_model.float()
    f32 = LlamaRunner(f32_model, enforce_eager=True)
    assert compiled.lm_head.kind == eager.layers[0].gate_up.kind == "w16dot"
    assert "bf16 dot products" in compiled.describe()
    assert compiled.compiled.sizes == sizes_for("w16dot", 17)
    prompt = list(range(5, 45))
    for r in (compiled, eager, f32):
        r.sync_rows(["a"])
        r.forward(ForwardBatch.from_rows([prompt[:12]], [0], logits="none"))
    for n in (1, 2, 5, 8, 9, 13, 17, 20):
        tokens = prompt[12:12 + n]
        outs = [r.forward(ForwardBatch.from_rows([tokens], [12], logits="all")) for r in (compiled, eager, f32)]
        assert (compiled.last_path == "compiled") if n <= 17 else compiled.last_path.startswith("eager")
        scale = outs[2].abs().max().item()
        # inductor fuses RoPE and the norms in another float32 order (keys 1 ulp apart), which can move an input
        # across a bf16 rounding step (0.4%): on Xeon-AMX one of 8 x 64 o_proj inputs did, logits 0.023 / 6.0 apart
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-2 * scale)
        torch.testing.assert_close(outs[1], outs[2], rtol=0, atol=3e-2 * scale)
