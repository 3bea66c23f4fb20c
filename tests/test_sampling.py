"""Logit processing: temperature -> top-k -> top-p -> min-p, one pipeline for target and drafts."""

import math

import numpy as np

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import sampling
from specdec.config import SamplingParams
from specdec.sampling import SamplingBatch, make_generator, probs_from_logits, sample


def probs(logits, **kw):
    sb = SamplingBatch.from_params([SamplingParams(**kw)])
    return probs_from_logits(torch.tensor([logits]), sb)[0]


def test_temperature_scales_logits_before_softmax():
    p = probs([0.0, 1.0, 2.0], temperature=0.5)
    torch.testing.assert_close(p, torch.softmax(torch.tensor([0.0, 2.0, 4.0]), -1))


def test_top_k_keeps_the_k_largest():
    p = probs([1.0, 4.0, 3.0, 2.0], top_k=2)
    expected = torch.softmax(torch.tensor([4.0, 3.0]), -1)
    torch.testing.assert_close(p, torch.tensor([0.0, expected[0], expected[1], 0.0]))


def test_top_p_keeps_the_smallest_prefix_reaching_top_p():
    base = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    torch.testing.assert_close(probs(base, top_p=0.8), torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]))
    # 0.81 needs the third token as well
    torch.testing.assert_close(probs(base, top_p=0.81), torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    # the top token always survives
    torch.testing.assert_close(probs(base, top_p=0.1), torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_top_p_applies_after_top_k_renormalisation():
    base = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().tolist()
    # after top-k=2 the masses are 4/7 and 3/7; top_p=0.5 keeps only the first
    torch.testing.assert_close(probs(base, top_k=2, top_p=0.5), torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    base = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    torch.testing.assert_close(probs(base, min_p=0.5), torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)


def test_rows_keep_their_own_parameters():
    sb = SamplingBatch.from_params([SamplingParams(top_k=1), SamplingParams(temperature=2.0)])
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    p = probs_from_logits(logits, sb)
    torch.testing.assert_close(p[0], torch.tensor([0.0, 0.0, 1.0]))
    torch.testing.assert_close(p[1], torch.softmax(logits[1] / 2, -1))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=2, max_size=12), st.integers(0, 12), st.floats(0.05, 1.0),
       st.floats(0.1, 3.0))
def test_processed_probs_are_a_distribution_within_top_k(logits, top_k, top_p, temperature):
    p = probs(logits, top_k=top_k, top_p=top_p, temperature=temperature)
    assert math.isclose(p.sum().item(), 1.0, rel_tol=1e-5)
    assert (p >= 0).all()
    if top_k:
        assert int((p > 0).sum()) <= top_k
    assert p[torch.tensor(logits).argmax()] > 0  # the most likely token always survives


def cut_case(seed: int, rows: int, V: int, scale: float, coarse: bool) -> torch.Tensor:
    """Logits [rows, 3, V] for the cut tests; ``coarse``: on a grid of a few values (ties at a cut), -inf among them."""
    logits = torch.randn(rows, 3, V, generator=torch.Generator().manual_seed(seed)) * scale
    if coarse:
        logits = logits.round().clamp(-3, 3)
        logits[logits == -3] = float("-inf")
        logits[..., 0] = 3.0  # a row keeps something
    return logits


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 300),
       st.lists(st.tuples(st.sampled_from([0, 1, 2, 7, 50, 400]), st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.05])),
                min_size=1, max_size=4), st.booleans())
def test_the_cpu_cut_keeps_what_the_sort_rule_keeps(seed, V, params, coarse):
    """sampling._top_k_top_p_numpy (values sorted without their ids) against the rule written as a sort of
    each row, rows with their own top-k and top-p over 3 positions each: the same tokens kept, and where
    tokens tie at a cut (``coarse``: logits on a grid of a few values, -inf among them) as many of them."""
    logits = cut_case(seed, len(params), V, 3, coarse)
    k, p = torch.tensor([k for k, _ in params]), torch.tensor([p for _, p in params])
    ours = sampling._top_k_top_p_numpy(logits, k.numpy(), p.numpy())
    rule = sampling._top_k_top_p_sorted(logits, k.view(-1, 1, 1), p.view(-1, 1, 1))
    kept_ours, kept_rule = ours > float("-inf"), rule > float("-inf")
    # where the mass above some token is top_p itself up to float32's rounding, summing in another order may cut
    # one token more or less: such rows are left out of the counts (exact ties of mass, as only a grid makes)
    ranked = logits.double().sort(dim=-1, descending=True).values
    ranked = ranked.masked_fill(torch.arange(V) >= torch.where(k > 0, k, V).clamp(max=V).view(-1, 1, 1), float("-inf"))
    q = torch.softmax(ranked, dim=-1)
    on_edge = ((q.cumsum(-1) - q - p.view(-1, 1, 1)).abs() < 1e-5).any(-1) & (p < 1.0).view(-1, 1)
    assert torch.equal(kept_ours.sum(-1)[~on_edge], kept_rule.sum(-1)[~on_edge])
    if not coarse:  # distinct values: the same tokens, with their logits
        assert torch.equal(kept_ours, kept_rule)
    assert torch.equal(ours[kept_ours], logits[kept_ours])


def test_seeded_generators_repeat_and_differ():
    p = torch.full((2, 50), 1 / 50)
    a = [sample(p, [make_generator(7), make_generator(8)]).tolist() for _ in range(1)]
    b = [sample(p, [make_generator(7), make_generator(8)]).tolist() for _ in range(1)]
    assert a == b
    draws = [sample(p[:1], [make_generator(s)]).item() for s in range(20)]
    assert len(set(draws)) > 5


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=-0.1), "temperature must be"),
    (dict(top_p=0.0), "top_p must be in \\(0, 1\\]"),
    (dict(top_p=1.5), "top_p must be in \\(0, 1\\]"),
    (dict(top_k=-2), "top_k must be an integer >= 0"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(min_p=2.0), "min_p must be in \\[0, 1\\]"),
    (dict(temperature=float("nan")), "temperature must be"),
    (dict(stop=[""]), "stop must be"),
    (dict(seed="x"), "seed must be"),
])
def test_bad_sampling_values_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_top_k_minus_one_means_disabled_as_in_vllm():
    assert SamplingParams(top_k=-1).top_k == 0


def test_seed_range_is_what_a_torch_generator_takes():
    for seed in (-(2**63), 0, 2**64 - 1):
        make_generator(SamplingParams(seed=seed).seed)
    with pytest.raises(ValueError, match="seed must be an integer in"):
        SamplingParams(seed=2**64)


def test_a_rows_probabilities_do_not_depend_on_the_other_rows_parameters():
    """A row without top-p or min-p gets bit-for-bit the probabilities it gets alone, next to rows that
    use them (a top-p of 1 must not cut a tail whose rounded cumulative mass reaches 1)."""
    g = torch.Generator().manual_seed(0)
    logits = 8 * torch.randn(3, 4000, generator=g)  # a long tail: cumsum rounds to 1 before the end
    params = [SamplingParams(temperature=0.7), SamplingParams(top_p=0.9), SamplingParams(min_p=0.1, top_k=50)]
    batch = probs_from_logits(logits, SamplingBatch.from_params(params))
    alone = probs_from_logits(logits[:1], SamplingBatch.from_params(params[:1]))
    assert torch.equal(batch[0], alone[0])
    assert (alone[0] > 0).all()


def test_sampling_a_row_takes_the_same_draws_whatever_the_batch():
    p = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    gens = [make_generator(s) for s in (1, 2, 3)]
    batch = sample(p, gens)
    alone = make_generator(2)
    assert int(sample(p[1:2], [alone])) == int(batch[1])
    assert torch.equal(alone.get_state(), gens[1].get_state())


def test_sampled_tokens_follow_the_probabilities():
    from lossless import FALSE_ALARM, chi_square_p

    p = torch.softmax(2 * torch.randn(1, 30, generator=torch.Generator().manual_seed(3)), -1)
    p[0, 7] = 0.0  # a token the distribution excludes is never drawn (chi_square_p checks)
    p /= p.sum()
    draws = torch.stack([sample(p, [make_generator(s)])[0] for s in range(20000)]).numpy()
    assert chi_square_p(draws, p[0].double().numpy()) > FALSE_ALARM


def test_select_takes_the_rows_asked_and_every_row_in_order_is_the_batch_itself():
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=0), SamplingParams(top_k=3)]
    sb = SamplingBatch.from_params(params)
    assert sb.select([0, 1, 2]) is sb
    sub = sb.select([2, 0])
    assert sub is not sb and sub.params == (params[2], params[0])
    assert sub.temperature.tolist() == [1.0, 0.5] and sub.top_k.tolist() == [3, 0] and sub.greedy.tolist() == [False, False]
    assert sb.select([1, 0, 2]).temperature.tolist() == [1.0, 0.5, 1.0]  # every row, another order: a new batch


def test_draws_follow_the_probabilities_across_blocks():
    """``draw`` on the CPU finds the block, then the token in it (sampling.DRAW_BLOCK): a vocabulary that is
    not a multiple of the block, a block without mass, tokens without mass at either end of a block."""
    from lossless import FALSE_ALARM, chi_square_p

    from specdec.sampling import DRAW_BLOCK, draw

    V = 2 * DRAW_BLOCK + 44
    p = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(5)), -1)
    p[DRAW_BLOCK:2 * DRAW_BLOCK] = 0.0  # a whole block
    p[[0, DRAW_BLOCK - 1, 2 * DRAW_BLOCK, V - 1]] = 0.0
    p[3] = 0.2  # one likely token
    p /= p.sum()
    g = make_generator(11)
    draws = np.array([draw(p, g) for _ in range(40000)])
    assert chi_square_p(draws, p.double().numpy()) > FALSE_ALARM


@pytest.mark.parametrize("kernel", [False, True])
def test_a_draw_at_the_end_of_the_mass_takes_the_last_token_with_mass(kernel):
    """sampling.inverse_cdf, and the sampling kernel's, which ``draw`` takes where it builds."""
    from specdec.sampling import DRAW_BLOCK

    if kernel and not sampling.sampling_kernel.available().ok:
        pytest.skip(f"sampling kernel: {sampling.sampling_kernel.available().reason}")

    def inverse_cdf(x, u):
        return sampling.sampling_kernel.module().inverse_cdf(torch.from_numpy(x), u) if kernel else sampling.inverse_cdf(x, u)

    x = np.zeros(3 * DRAW_BLOCK + 5, dtype=np.float32)
    x[[5, DRAW_BLOCK + 7]] = [0.25, 0.75]
    assert inverse_cdf(x, 0.0) == 5 and inverse_cdf(x, 0.2499) == 5 and inverse_cdf(x, 0.25) == DRAW_BLOCK + 7
    assert inverse_cdf(x, 1.0 - 2.0**-53) == DRAW_BLOCK + 7
    assert inverse_cdf(x, 1.0) == DRAW_BLOCK + 7  # u·C(V) at C(V) itself: never a token past the mass


native = pytest.mark.skipif(not sampling.sampling_kernel.available().ok,
                            reason=f"sampling kernel: {sampling.sampling_kernel.available().reason}")


@native
@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 700),
       st.lists(st.tuples(st.sampled_from([0, 1, 2, 7, 50, 400]), st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.05]),
                          st.sampled_from([0.3, 1.0, 1.7])), min_size=1, max_size=4), st.booleans())
def test_the_sampling_kernel_keeps_what_the_sort_rule_keeps(seed, V, params, coarse):
    """sampling_kernel.cut_probs (buckets of values, the cut's bucket ranked) against the rule written as a sort:
    the same tokens kept (as many where they tie at a cut), and the probabilities the softmax of what it keeps."""
    from specdec import sampling_kernel

    logits = cut_case(seed, len(params), V, 6, coarse)
    k = torch.tensor([k for k, _, _ in params])
    p = torch.tensor([p for _, p, _ in params])
    t = torch.tensor([t for _, _, t in params])
    ours = sampling_kernel.cut_probs(logits, t, k, p, torch.zeros(len(params)))
    scaled = logits / t.view(-1, 1, 1)
    rule = sampling._top_k_top_p_sorted(scaled, k.view(-1, 1, 1), p.view(-1, 1, 1))
    kept_ours, kept_rule = ours > 0, torch.softmax(rule, dim=-1) > 0  # kept, and not rounded to 0 in float32
    ranked = scaled.double().sort(dim=-1, descending=True).values
    ranked = ranked.masked_fill(torch.arange(V) >= torch.where(k > 0, k, V).clamp(max=V).view(-1, 1, 1), float("-inf"))
    q = torch.softmax(ranked, dim=-1)
    on_edge = ((q.cumsum(-1) - q - p.view(-1, 1, 1)).abs() < 1e-5).any(-1) & (p < 1.0).view(-1, 1)
    assert torch.equal(kept_ours.sum(-1)[~on_edge], kept_rule.sum(-1)[~on_edge])
    if not coarse:
        assert torch.equal(kept_ours[~on_edge], kept_rule[~on_edge])
    want = torch.softmax(torch.where(kept_ours, scaled, float("-inf")), dim=-1)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-7)


@native
@pytest.mark.parametrize("scale", [0.0, 0.05, 0.5, 2.0, 8.0, 40.0])
def test_the_sampling_kernels_cut_at_every_depth_keeps_what_the_sort_rule_keeps(scale):
    """A vocabulary of 8,192: the kernel ranks only the tokens down to the shallowest depth below the maximum
    (4, 8, 16, 32 nats, then all) that holds the cut; logits from flat (every token a candidate) to peaked,
    some -inf, against the rule written as a sort."""
    from specdec import sampling_kernel

    params = [(k, p, t) for k in (0, 1, 40, 2000, 8191) for p in (1.0, 0.999, 0.95, 0.5) for t in (0.5, 1.0)
              if (k, p) != (0, 1.0)]
    logits = scale * torch.randn(len(params), 1, 8192, generator=torch.Generator().manual_seed(int(scale * 10)))
    logits[:, :, ::97] = float("-inf")
    k, p, t = (torch.tensor(c) for c in zip(*params))
    ours = sampling_kernel.cut_probs(logits, t.float(), k, p.float(), torch.zeros(len(params)))
    scaled = logits / t.view(-1, 1, 1)
    rule = torch.softmax(sampling._top_k_top_p_sorted(scaled, k.view(-1, 1, 1), p.view(-1, 1, 1)), dim=-1)
    ranked = scaled.double().sort(dim=-1, descending=True).values
    ranked = ranked.masked_fill(torch.arange(8192) >= torch.where(k > 0, k, 8192).view(-1, 1, 1), float("-inf"))
    q = torch.softmax(ranked, dim=-1)
    on_edge = ((q.cumsum(-1) - q - p.view(-1, 1, 1)).abs() < 1e-5).any(-1) & (p < 1.0).view(-1, 1)
    assert torch.equal((ours > 0).sum(-1)[~on_edge], (rule > 0).sum(-1)[~on_edge])
    if scale > 0:  # without ties, the same tokens (the sort rule breaks ties by no rule)
        assert torch.equal((ours > 0)[~on_edge], (rule > 0)[~on_edge])
    want = torch.softmax(torch.where(ours > 0, scaled, float("-inf")), dim=-1)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-7)


@native
def test_a_cut_rows_probabilities_are_the_same_alone_and_in_a_batch():
    g = torch.Generator().manual_seed(1)
    logits = 5 * torch.randn(4, 2, 3000, generator=g)
    params = [SamplingParams(temperature=0.7), SamplingParams(top_p=0.9), SamplingParams(top_k=40, temperature=1.3),
              SamplingParams(top_p=0.5, top_k=100, min_p=0.05)]
    batch = probs_from_logits(logits, SamplingBatch.from_params(params))
    for b in range(4):
        alone = probs_from_logits(logits[b:b + 1], SamplingBatch.from_params(params[b:b + 1]))
        assert torch.equal(batch[b], alone[0]), b


def test_the_devices_draw_takes_the_last_token_with_mass_at_the_end():
    """``draw`` off the CPU (torch's running sums and searchsorted, as on a GPU), run here on CPU tensors."""
    p = torch.zeros(300)
    p[[5, 200]] = torch.tensor([0.25, 0.75])
    c = p.double().cumsum(-1)
    for u, want in ((0.0, 5), (0.2499, 5), (0.25, 200), (1 - 2**-53, 200), (1.0, 200)):
        v = torch.tensor([u], dtype=torch.float64) * c[-1]
        assert int(sampling._last_positive(c, torch.searchsorted(c, v, right=True)[0])) == want


def test_without_the_sampling_kernel_the_numpy_cut_and_draw_give_the_same_distribution(monkeypatch):
    """Where the kernel cannot be built (no compiler, no AVX2: ARM), probs_from_logits cuts with numpy's sort of
    values (min-p in torch) and ``draw`` sums in numpy: the same kept tokens and probabilities, and draws that
    follow them."""
    from lossless import FALSE_ALARM, chi_square_p

    from specdec import sampling_kernel
    from specdec.models.native import Availability
    from specdec.sampling import draw

    logits = 4 * torch.randn(4, 3, 500, generator=torch.Generator().manual_seed(2))
    sb = SamplingBatch.from_params([SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(top_k=30),
                                    SamplingParams(temperature=0.7, min_p=0.1), SamplingParams(top_p=0.95, min_p=0.02)])
    with_kernel = probs_from_logits(logits, sb) if sampling_kernel.available().ok else None
    monkeypatch.setattr(sampling_kernel, "available", lambda: Availability(False, "test"))
    without = probs_from_logits(logits, sb)
    assert torch.allclose(without.sum(-1), torch.ones(4, 3))
    if with_kernel is not None:
        assert torch.equal(with_kernel > 0, without > 0)
        torch.testing.assert_close(with_kernel, without, rtol=1e-5, atol=1e-7)
    p = without[0, 0]
    g = make_generator(4)
    draws = np.array([draw(p, g) for _ in range(20000)])
    assert chi_square_p(draws, p.double().numpy()) > FALSE_ALARM


@pytest.mark.parametrize("kernel", [True, False])
def test_sample_from_logits_is_probs_from_logits_then_sample(kernel, monkeypatch):
    """``sample_from_logits`` (one native call on the CPU: a sampling drafter's step) gives the probabilities
    ``probs_from_logits`` gives and the tokens ``sample`` draws from them with generators in the same states,
    and leaves each generator where ``sample`` leaves it; with and without the sampling kernel."""
    from specdec import sampling_kernel
    from specdec.models.native import Availability
    from specdec.sampling import sample_from_logits

    if kernel and not sampling_kernel.available().ok:
        pytest.skip(f"sampling kernel: {sampling_kernel.available().reason}")
    if not kernel:
        monkeypatch.setattr(sampling_kernel, "available", lambda: Availability(False, "test"))
    rows = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.9),
            SamplingParams(temperature=0.6, top_k=7), SamplingParams(temperature=1.3, top_k=40, top_p=0.5),
            SamplingParams(temperature=0.9, min_p=0.1)]
    sb = SamplingBatch.from_params(rows)
    for trial in range(30):
        logits = (0.5 + trial / 5) * torch.randn(5, 300, generator=torch.Generator().manual_seed(trial))
        a = [make_generator(10 * trial + b) for b in range(5)]
        b = [make_generator(10 * trial + b) for b in range(5)]
        probs, ids = sample_from_logits(logits, sb, a)
        expected = probs_from_logits(logits, sb)
        assert torch.equal(probs, expected) and ids == sample(expected, b).tolist(), trial
        assert all(torch.equal(x.get_state(), y.get_state()) for x, y in zip(a, b))
        # into step 1 of a [B, 3, V] buffer (a drafter's q), from logits [B, 1, V] (the compiled step's own output)
        c = [make_generator(10 * trial + b) for b in range(5)]
        out = torch.zeros(5, 3, 300)
        got, again = sample_from_logits(logits[:, None], sb, c, out, 1)
        assert got is out and again == ids and torch.equal(out[:, 1], expected), trial
        assert not out[:, 0].any() and not out[:, 2].any()


def test_the_kernels_uniform_is_torchs():
    """The sampling kernel draws its float64 uniform from the generator itself: the value, and the generator's
    state after it, are those of ``torch.rand(1, dtype=torch.float64, generator=g)`` (a seed's draws do not
    depend on which path drew them)."""
    from specdec import sampling_kernel

    if not sampling_kernel.available().ok:
        pytest.skip(f"sampling kernel: {sampling_kernel.available().reason}")
    p = torch.ones(1, 1000)
    for seed in range(20):
        a, b = make_generator(seed), make_generator(seed)
        token = sampling_kernel.module().draw_rows(p, [a])[0]
        u = float(torch.rand(1, dtype=torch.float64, generator=b))
        assert token == int(u * 1000) and torch.equal(a.get_state(), b.get_state())
