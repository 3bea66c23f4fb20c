"""specdec::cache_attention (models/cache_attention.py): attention read straight from the KV cache equals
layers.few_query_attention over the gathered keys, for a few queries per row, grouped query heads, any
attended length and several rows; bad inputs are refused with a message; the compiled step uses it
where it runs (tests/test_compiled.py checks the compiled step's logits against eager with it)."""

import pytest
import torch

from specdec.models import cache_attention as ca
from specdec.models.layers import few_query_attention

pytestmark = pytest.mark.skipif(not ca.available().ok, reason=f"the kernel does not run here: {ca.available().reason}")


def causal_bias(starts: list[int], T: int, L: int, window: int | None = None) -> torch.Tensor:
    """[B, T, L] additive: query t of row b at position starts[b] + t sees keys up to it (and within window)."""
    pos = torch.tensor(starts)[:, None] + torch.arange(T)  # [B, T]
    keys = torch.arange(L)
    seen = keys[None, None] <= pos[:, :, None]
    if window is not None:
        seen &= keys[None, None] > pos[:, :, None] - window
    return torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))


@pytest.mark.parametrize("T,L,H,KVH,hd,window", [
    (1, 320, 8, 4, 64, None), (3, 67, 8, 4, 64, None), (9, 130, 4, 4, 32, None), (2, 9, 8, 2, 16, None),
    (5, 64, 6, 3, 8, 4), (1, 5, 4, 1, 128, None),
])
def test_equals_few_query_attention_on_the_gathered_cache(T, L, H, KVH, hd, window):
    g = torch.Generator().manual_seed(T * 1000 + L)
    layers, rows, length = 3, 4, L + 11
    k = torch.randn(layers, rows, KVH, length, hd, generator=g)
    v = torch.randn(layers, rows, KVH, length, hd, generator=g)
    q = torch.randn(2, T, H, hd, generator=g)
    rows_of = torch.tensor([2, 0])  # two batch rows on cache rows 2 and 0
    bias = causal_bias([L - T, L - T - 3], T, L, window)
    for layer in range(layers):
        out = ca.cache_attention(q, k, v, layer, rows_of, bias)
        keys, values = k[layer, :, :, :L][rows_of], v[layer, :, :, :L][rows_of]
        ref = few_query_attention(q.transpose(1, 2), keys, values, bias[:, None]).transpose(1, 2)
        assert out.shape == (2, T, H, hd)
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_non_contiguous_queries_as_the_graph_passes_them():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 2, 40, 16, generator=g)
    v = torch.randn(1, 1, 2, 40, 16, generator=g)
    qk = torch.randn(1, 3, 6, 16, generator=g)  # q and k heads side by side, as qkv_rope slices them
    q = qk[:, :, :4]
    bias = causal_bias([30], 3, 33)
    ref = few_query_attention(q.transpose(1, 2), k[0, :, :, :33], v[0, :, :, :33], bias[:, None]).transpose(1, 2)
    torch.testing.assert_close(ca.cache_attention(q, k, v, 0, torch.tensor([0]), bias), ref, atol=2e-6, rtol=1e-5)


def test_bad_inputs_are_refused_with_what_was_wrong():
    k = torch.zeros(2, 2, 2, 16, 8)
    q, bias, rows = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 8), torch.tensor([0])
    with pytest.raises(RuntimeError, match="cache row 5 of 2"):
        ca.cache_attention(q, k, k, 0, torch.tensor([5]), bias)
    with pytest.raises(RuntimeError, match="shapes do not agree"):
        ca.cache_attention(q, k, k, 2, rows, bias)  # layer 2 of 2
    with pytest.raises(RuntimeError, match="shapes do not agree"):
        ca.cache_attention(q, k, k, 0, rows, torch.zeros(1, 1, 17))  # attends past the cache
    with pytest.raises(RuntimeError, match="float32"):
        ca.cache_attention(q.bfloat16(), k, k, 0, rows, bias)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ca.cache_attention(torch.zeros(1, 1, 4, 6), torch.zeros(2, 2, 2, 16, 6), torch.zeros(2, 2, 2, 16, 6), 0, rows, bias)


def test_supports_names_what_the_kernel_takes():
    cpu = torch.device("cpu")
    assert ca.supports(torch.float32, cpu, 64)
    assert not ca.supports(torch.bfloat16, cpu, 64)
    assert not ca.supports(torch.float32, cpu, 60)
    assert not ca.supports(torch.float32, torch.device("meta"), 64)


def test_a_kernel_that_does_not_build_is_unavailable_with_the_reason(tmp_path, monkeypatch, capsys):
    """No compiler, no OpenMP, a broken source: the kernel is reported unavailable with why (and the
    runner takes its other path), never an exception out of ``available``."""
    from specdec.models import native

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    got = native.availability("no_such_kernel", lambda: native.build("broken", "this is not C++\n", "a broken kernel"),
                              "a broken kernel")
    assert not got.ok and got.reason.startswith("building a broken kernel failed:"), got
    assert "building a broken kernel into" in capsys.readouterr().err  # said before the build, then " failed"
