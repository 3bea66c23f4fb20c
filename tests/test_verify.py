"""The verifier on hand-built distributions: accepted, recovered and bonus tokens, and exactness."""

import numpy as np
import pytest
import torch
from scipy import stats

from lossless import FALSE_ALARM, chi_square_p

from specdec.config import SamplingParams
from specdec.sampling import SamplingBatch, make_generator, sample
from specdec.verify import rejection_sample, verify, verify_greedy


def logits_for(*rows):
    """A [1, len(rows), V] tensor of logits whose argmax per position is given."""
    V = 6
    t = torch.zeros(1, len(rows), V)
    for i, tok in enumerate(rows):
        t[0, i, tok] = 5.0
    return t


def test_greedy_accepts_matching_prefix_then_emits_the_target_argmax():
    r = verify_greedy(torch.tensor([[1, 2, 3]]), logits_for(1, 2, 4, 5).argmax(-1))
    assert r.num_accepted == [2] and r.next_token_ids == [4]  # x_3 = 3 rejected; recovered = argmax p_3 = 4


def test_greedy_full_acceptance_emits_the_bonus_token():
    r = verify_greedy(torch.tensor([[1, 2, 3]]), logits_for(1, 2, 3, 5).argmax(-1))
    assert r.num_accepted == [3] and r.next_token_ids == [5]


def test_greedy_first_mismatch_ends_the_round_even_if_later_drafts_match():
    r = verify_greedy(torch.tensor([[0, 2, 3]]), logits_for(1, 2, 3, 5).argmax(-1))
    assert r.num_accepted == [0] and r.next_token_ids == [1]


def test_greedy_with_no_drafts_is_plain_decoding():
    r = verify_greedy(torch.zeros(1, 0, dtype=torch.long), logits_for(4).argmax(-1))
    assert r.num_accepted == [0] and r.next_token_ids == [4]


def test_a_draft_the_target_cannot_produce_is_always_rejected_and_never_recovered():
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]])  # [1, k+1=2, V=4]
    for seed in range(50):
        r = rejection_sample(torch.tensor([[3]]), None, p, [make_generator(seed)])
        assert r.num_accepted == [0] and r.next_token_ids[0] in (1, 2)


def test_a_draft_with_p_equal_q_is_always_accepted_and_gets_a_bonus():
    p = torch.tensor([[[0.2, 0.8, 0.0], [0.0, 0.0, 1.0]]])
    q = torch.tensor([[[0.2, 0.8, 0.0]]])
    for seed in range(50):
        r = rejection_sample(torch.tensor([[1]]), q, p, [make_generator(seed)])
        assert r.num_accepted == [1] and r.next_token_ids == [2]  # bonus drawn from p_2 = one-hot(2)


def test_recovered_token_comes_from_the_residual_of_probabilities():
    # p = [0.5, 0.5, 0], q = [0, 0.5, 0.5]: draft 2 is always rejected (p(2) = 0); the residual
    # max(0, p - q) = [0.5, 0, 0] puts all mass on token 0. A residual built from logits would not.
    p = torch.tensor([[[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]]])
    q = torch.tensor([[[0.0, 0.5, 0.5]]])
    for seed in range(50):
        r = rejection_sample(torch.tensor([[2]]), q, p, [make_generator(seed)])
        assert r.num_accepted == [0] and r.next_token_ids == [0]


def test_seeded_verification_is_deterministic():
    p = torch.softmax(torch.randn(4, 4, 20, generator=torch.Generator().manual_seed(0)), -1)
    q = torch.softmax(torch.randn(4, 3, 20, generator=torch.Generator().manual_seed(1)), -1)
    x = torch.randint(0, 20, (4, 3), generator=torch.Generator().manual_seed(2))
    runs = [rejection_sample(x, q, p, [make_generator(s) for s in range(4)]) for _ in range(2)]
    assert runs[0] == runs[1]


def test_mixed_batch_uses_greedy_rules_only_for_greedy_rows():
    """Draft x_1 = 4 is not the argmax (token 1 is, barely): the greedy row always rejects it and
    emits 1; the sampled row accepts it with probability p_1(4) and emits 1 (the residual) otherwise."""
    logits = torch.full((2, 2, 6), float("-inf"))
    logits[:, 0, 1], logits[:, 0, 4] = 1.0, 0.9  # p_1: token 1 0.525, token 4 0.475
    logits[:, 1, 3] = 0.0  # p_2: token 3 surely (the bonus)
    p4 = float(torch.softmax(logits[1, 0], -1)[4])
    sb = SamplingBatch.from_params([SamplingParams(temperature=0), SamplingParams(temperature=1.0)])
    N, accepted = 400, 0
    for seed in range(N):
        r = verify(torch.tensor([[4], [4]]), None, logits, sb, [make_generator(seed), make_generator(N + seed)])
        assert r.num_accepted[0] == 0 and r.next_token_ids[0] == 1
        assert (r.num_accepted[1], r.next_token_ids[1]) in ((1, 3), (0, 1))
        accepted += r.num_accepted[1]
    assert stats.binomtest(accepted, N, p4).pvalue > FALSE_ALARM


def test_a_row_draws_what_it_would_draw_alone():
    """Rows with fewer drafts than the widest row, next to it, get the result they get alone and leave
    their generator where it is alone: for sampled drafts (one uniform per draft, then one draw) and
    for one-hot drafts (one draw per emitted token)."""
    V, k = 10, 4
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, k + 1, V, generator=g), -1)  # [B, k+1, V]
    q = torch.softmax(torch.randn(3, k, V, generator=g), -1)  # [B, k, V]
    x = torch.stack([torch.multinomial(q[b], 1, generator=g).squeeze(1) for b in range(3)])  # [B, k]
    num_draft = torch.tensor([1, 4, 0])
    for draft_probs in (q, None):
        for seed in range(30):
            gens = [make_generator(seed + 100 * b) for b in range(3)]
            batch = rejection_sample(x, draft_probs, p, gens, num_draft)
            for b in range(3):
                n = int(num_draft[b])
                alone_gen = make_generator(seed + 100 * b)
                alone = rejection_sample(x[b:b + 1, :n], None if draft_probs is None else draft_probs[b:b + 1, :n],
                                         p[b:b + 1, : n + 1], [alone_gen])
                assert (batch.num_accepted[b], batch.next_token_ids[b]) == (alone.num_accepted[0],
                                                                             alone.next_token_ids[0])
                assert torch.equal(gens[b].get_state(), alone_gen.get_state())


def test_one_hot_drafts_emit_what_plain_sampling_emits_with_the_same_seed():
    """With a deterministic drafter a seeded row's tokens are plain decoding's: the accepted drafts and
    the next token equal the first tokens drawn one by one from p_1, p_2, ... with the same seed."""
    V, k = 5, 3
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(2 * torch.randn(1, k + 1, V, generator=g), -1)
    drafts = torch.tensor([[int(p[0, i].argmax()) for i in range(k)]])  # likely, but not sure, to be accepted
    lengths = []
    for seed in range(200):
        r = rejection_sample(drafts, None, p, [make_generator(seed)])
        plain_gen = make_generator(seed)
        plain = [int(sample(p[:, i], [plain_gen])) for i in range(r.num_accepted[0] + 1)]
        assert drafts[0, : r.num_accepted[0]].tolist() + r.next_token_ids == plain
        lengths.append(r.num_accepted[0])
    assert set(lengths) == set(range(k + 1))  # every outcome from a rejection at x_1 to the bonus occurred


@pytest.mark.parametrize("drafter", ["deterministic", "sampling"])
def test_emitted_tokens_follow_the_target_distribution(drafter):
    """Per-position target distributions p_1..p_3 fixed; drafts from a very different q.
    The first emitted token must be ~ p_1, and the second (when x_1 was accepted) ~ p_2."""
    V, k, N = 8, 2, 20000
    g = torch.Generator().manual_seed(123)
    p = torch.softmax(2 * torch.randn(k + 1, V, generator=g), -1)  # [k+1, V]
    q = torch.softmax(2 * torch.randn(k, V, generator=g), -1)  # [k, V]
    gens = [make_generator(10_000 + i) for i in range(N)]
    if drafter == "sampling":
        draft = torch.stack([torch.multinomial(q, 1, generator=gg).squeeze(1) for gg in gens])  # [N, k]
        draft_probs = q.expand(N, k, V)
    else:
        draft = torch.tensor([[int(q[0].argmax()), int(q[1].argmax())]]).expand(N, k)
        draft_probs = None
    r = rejection_sample(draft, draft_probs, p.expand(N, k + 1, V), gens)
    n_acc = np.array(r.num_accepted)
    nxt = np.array(r.next_token_ids)
    d = draft.numpy()
    first = np.where(n_acc >= 1, d[:, 0], nxt)
    assert chi_square_p(first, p[0].numpy()) > FALSE_ALARM
    second = np.where(n_acc >= 2, d[:, 1], nxt)[n_acc >= 1]
    assert len(second) > 500
    assert chi_square_p(second, p[1].numpy()) > FALSE_ALARM


def test_the_chi_square_check_catches_a_logit_residual():
    """The same statistics reject the blog-post residual softmax(clamp(logits_p - logits_q, 0))."""
    V, N = 8, 20000
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(2 * torch.randn(2, V, generator=g), -1)
    q = torch.softmax(2 * torch.randn(1, V, generator=g), -1)
    gens = [make_generator(i) for i in range(N)]
    draft = torch.stack([torch.multinomial(q[0], 1, generator=gg) for gg in gens])  # [N, 1]
    accepted = torch.stack([torch.rand(1, generator=gg) for gg in gens])[:, 0] * q[0, draft[:, 0]] < p[0, draft[:, 0]]
    wrong_residual = torch.softmax((p[0].log() - q[0].log()).clamp(min=0), -1)
    recovered = torch.stack([torch.multinomial(wrong_residual, 1, generator=gg) for gg in gens])[:, 0]
    first = torch.where(accepted, draft[:, 0], recovered).numpy()
    assert chi_square_p(first, p[0].numpy()) < FALSE_ALARM


def test_rows_with_fewer_drafts_get_their_bonus_from_the_right_position():
    # row 0 drafted 1 token (of k = 3) and it matches: its bonus is argmax p_2, not a rejection
    logits = logits_for(1, 2, 3, 4).repeat(2, 1, 1)
    draft = torch.tensor([[1, 0, 0], [1, 2, 5]])
    r = verify_greedy(draft, logits.argmax(-1), torch.tensor([1, 3]))
    assert r.num_accepted == [1, 2] and r.next_token_ids == [2, 3]
    p = torch.softmax(logits * 10, -1)  # nearly one-hot
    for seed in range(20):
        s = rejection_sample(draft[:1], None, p[:1], [make_generator(seed)], torch.tensor([1]))
        assert s.num_accepted == [1] and s.next_token_ids == [2]
        z = rejection_sample(draft[:1], None, p[:1], [make_generator(seed)], torch.tensor([0]))
        assert z.num_accepted == [0] and z.next_token_ids == [1]  # no drafts: plain sampling from p_1


def test_the_row_by_row_rule_draws_and_decides_as_the_batched_one():
    """Sampled drafts on the CPU: a few rows go through ``_accept_or_recover_row`` one at a time, more rows
    through the batched tensors; given generators in the same states, both take the same draws and reach
    the same accepted counts and tokens, whatever each row proposed (rejections, full acceptance, none)."""
    from specdec.verify import _accept_or_recover_batched, _accept_or_recover_row

    torch.manual_seed(0)
    B, k, V = 6, 4, 50
    for trial in range(40):
        sharp = 0.5 + 3 * trial / 40  # from flat to peaked: rejections early and late
        q = torch.softmax(torch.randn(B, k, V) * sharp, dim=-1)
        p = torch.softmax(torch.randn(B, k + 1, V) * sharp, dim=-1)
        p[:2, :k] = 0.7 * q[:2] + 0.3 * p[:2, :k]  # rows that agree more, to accept often
        ids = torch.stack([torch.multinomial(q[b], 1).squeeze(-1) for b in range(B)])  # [B, k]
        num_draft = torch.tensor([k, k, 3, 1, 0, 2])
        batched = _accept_or_recover_batched(ids, q, p, [torch.Generator().manual_seed(100 * trial + b) for b in range(B)],
                                             num_draft)
        rows = [_accept_or_recover_row(ids[b], q[b], p[b], torch.Generator().manual_seed(100 * trial + b), int(num_draft[b]))
                for b in range(B)]
        assert [n for n, _ in rows] == batched.num_accepted and [t for _, t in rows] == batched.next_token_ids, trial


def test_target_rows_made_when_read_decide_as_the_whole_tensor():
    """With a top-k / top-p cut on the CPU, ``verify`` makes each row's p_i only when the verifier reads it
    (``ProbRows``: up to the first rejection); given generators in the same states it accepts and emits
    what the verifier does on every p_i made up front, for sampled and one-hot drafts, and reads fewer rows."""
    from specdec.sampling import probs_from_logits
    from specdec.verify import ProbRows, rejection_sample

    torch.manual_seed(1)
    B, k, V = 3, 4, 64
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=0), SamplingParams(temperature=1.0, top_k=20, seed=0),
              SamplingParams(temperature=0.7, top_k=30, top_p=0.8, seed=0)]
    sb = SamplingBatch.from_params(params)
    made = read = 0
    for trial in range(60):
        sharp = 0.5 + 3 * trial / 60
        logits = torch.randn(B, k + 1, V) * sharp
        p = probs_from_logits(logits, sb)  # [B, k+1, V]
        q = None if trial % 3 == 0 else torch.softmax(logits[:, :k] * 0.8 + torch.randn(B, k, V), dim=-1)
        ids = torch.stack([torch.multinomial(q[b] if q is not None else p[b, :k], 1).squeeze(-1) for b in range(B)])
        num_draft = torch.tensor([k, 2, 0]) if trial % 2 else torch.tensor([k, k, k])
        seeds = [1000 * trial + b for b in range(B)]
        lazy = verify(ids, q, logits, sb, [torch.Generator().manual_seed(s) for s in seeds], num_draft)
        whole = rejection_sample(ids, q, p, [torch.Generator().manual_seed(s) for s in seeds], num_draft)
        assert (lazy.num_accepted, lazy.next_token_ids) == (whole.num_accepted, whole.next_token_ids), trial
        rows = [ProbRows(logits[b], sb.select([b])) for b in range(B)]
        again = rejection_sample(ids, q, rows, [torch.Generator().manual_seed(s) for s in seeds], num_draft)
        assert again.next_token_ids == whole.next_token_ids
        for b, r in enumerate(rows):
            torch.testing.assert_close(torch.stack([r[i] for i in r.made]), p[b, list(r.made)])
        made += sum(len(r.made) for r in rows)
        read += B * (k + 1)
    assert made < 0.8 * read  # rows past a rejection were never made


def test_the_native_row_rule_draws_and_decides_as_the_python_rule():
    """``verify_row`` (one sampling-kernel call a row on the CPU) against ``rejection_sample`` on the same row's
    p_i made up front: from generators in the same states, the same accepted count and token and the generator
    left in the same state, for sampled drafts (rejections early and late, full acceptance, none drafted),
    one-hot drafts, drafts without q, and each cut (temperature alone, top-k, top-p, min-p)."""
    from specdec import sampling_kernel
    from specdec.sampling import probs_from_logits
    from specdec.verify import rejection_sample, verify_row

    if not sampling_kernel.available().ok:
        pytest.skip(f"sampling kernel: {sampling_kernel.available().reason}")
    torch.manual_seed(3)
    B, k, V = 4, 4, 80
    sb = SamplingBatch.from_params([SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=20),
                                    SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05),
                                    SamplingParams(temperature=1.2, top_k=30, top_p=0.9)])
    outcomes = set()
    for trial in range(120):
        sharp = 0.5 + 4 * (trial % 40) / 40
        logits = torch.randn(B, k + 1, V) * sharp
        p = probs_from_logits(logits, sb)  # [B, k+1, V]
        q = torch.softmax(logits[:, :k] * 0.9 + 0.5 * torch.randn(B, k, V), dim=-1)
        if trial % 4 == 1:  # one-hot drafts: q_i = one-hot(x_i)
            ids = torch.randint(V, (B, k))
            q = torch.nn.functional.one_hot(ids, V).float()
        else:
            ids = torch.stack([torch.multinomial(q[b], 1).squeeze(-1) for b in range(B)])  # [B, k]
        if trial % 4 == 2:
            q = None
        num_draft = torch.tensor([k, k - 1, 0, 2]) if trial % 3 else torch.full((B,), k)
        for b in range(B):
            a, c = make_generator(trial * 10 + b), make_generator(trial * 10 + b)
            native = verify_row(logits, ids, q, int(num_draft[b]), sb, b, a)
            ref = rejection_sample(ids[b:b + 1], None if q is None else q[b:b + 1], p[b:b + 1], [c], num_draft[b:b + 1])
            assert native == (ref.num_accepted[0], ref.next_token_ids[0]), (trial, b)
            assert torch.equal(a.get_state(), c.get_state()), (trial, b)
            outcomes.add((native[0] == int(num_draft[b]), native[0] == 0))
    assert len(outcomes) >= 3  # full acceptance, a rejection at the first draft, one later
