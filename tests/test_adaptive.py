"""The adaptive controller: the cost model with measured inputs, switching off, probing."""

import collections

import pytest

from specdec.adaptive import AdaptiveK, PositionStats, Timing, choose_k
from specdec.adaptive.measure import PLAIN_SAMPLES, REFRESH_ROUNDS, wilson_upper
from specdec.adaptive.probe import PROBE_BUDGET, can_ever_pay
from specdec.cost_model import expected_tokens, round_cost, speedup


def feed(ctrl: AdaptiveK, rounds: int, accept, t1=0.010, per_token=0.001, draft=0.001, batch=1):
    """Simulate rounds: accept(k) -> accepted count; costs t1 + per_token*(T-1), draft per position."""
    ids = list(range(batch))
    for _ in range(rounds):
        ks = ctrl.choose(ids)
        k = max(ks)
        acc = [min(accept(kk), kk) for kk in ks]
        ctrl.record(ids, ks, acc, draft * k, t1 + per_token * k)
    return ks


def test_the_controller_computes_the_cost_models_speedup_from_measured_costs():
    ctrl = AdaptiveK(4)
    for T, t in [(1, 0.010), (2, 0.011), (3, 0.012), (4, 0.013), (5, 0.014)]:
        ctrl.verify_time.setdefault((1, T), Timing(skip=0)).update(t)
    ctrl.costs.draft_time.setdefault(1, Timing(skip=0)).update(0.002)
    alpha = 0.7
    for k in range(1, 5):
        got = ctrl.speedups(1, [[alpha] * 4])[k]
        assert got == pytest.approx(speedup(expected_tokens([alpha] * k, k), round_cost(k, 0.2, 1 + 0.1 * k)))


def test_good_drafts_keep_k_high():
    ctrl = AdaptiveK(4)
    ks = feed(ctrl, 30, accept=lambda k: k)  # everything accepted, drafting cheap
    assert ks == [4]


def test_each_batch_size_times_its_plain_steps_before_speculating():
    ctrl = AdaptiveK(4)
    chosen = []
    for batch in (1, 2):
        ids = list(range(batch))
        for _ in range(PLAIN_SAMPLES + 3):
            k = max(ctrl.choose(ids))
            chosen.append((batch, k))
            ctrl.record(ids, [k] * batch, [k] * batch, 0.001 * k, 0.010 + 0.001 * k)
    # the first plain step builds kernels and is not timed; then PLAIN_SAMPLES timed ones
    for batch in (1, 2):
        ks = [k for b, k in chosen if b == batch]
        assert ks[: PLAIN_SAMPLES + 1] == [0] * (PLAIN_SAMPLES + 1) and ks[-1] > 0


def test_a_plain_round_right_after_drafted_ones_is_not_timed_as_the_plain_step():
    """Its first step pays the switch back from drafting, which plain decoding pays once a stretch: the refresh
    of the plain step takes the next plain round's time instead (plain again, as the step stays due)."""
    ctrl = AdaptiveK(4)
    ids = [0]
    plain_rounds_after_drafting = []
    last_k = 0
    for _ in range(REFRESH_ROUNDS + 40):
        k = max(ctrl.choose(ids))
        switch_back = k == 0 and last_k > 0
        if switch_back:
            plain_rounds_after_drafting.append(len(ctrl.verify_time[(1, 1)].samples))
        ctrl.record(ids, [k], [k], 0.001 * k, 0.030 if switch_back else 0.010 + 0.001 * k)
        last_k = k
    assert plain_rounds_after_drafting, "no refresh of the plain step"
    samples = list(ctrl.verify_time[(1, 1)].samples)
    assert 0.030 not in samples and len(samples) > PLAIN_SAMPLES  # the refresh timed the round after it


def test_useless_drafts_switch_speculation_off_and_probes_back_off():
    ctrl = AdaptiveK(4)
    drafted = 0
    ids = [0]
    for r in range(400):
        k = ctrl.choose(ids)[0]
        drafted += k > 0
        ctrl.record(ids, [k], [0], 0.002 * k, 0.010 + 0.002 * k)
    assert ctrl.choose(ids) == [0]
    assert drafted < 20  # a handful of early rounds and probes with exponential back-off


def test_while_off_the_cost_model_waits_for_the_next_probe_or_batch_size(monkeypatch):
    ctrl = AdaptiveK(4)
    feed(ctrl, 60, accept=lambda k: 0, per_token=0.004)  # useless drafts: speculation switches off
    assert ctrl.prober.off_rounds > 0 and not ctrl.prober.probing
    calls = []
    speedups = ctrl.speedups
    monkeypatch.setattr(ctrl, "speedups", lambda B, alphas, line=None, reuse=False: calls.append(B) or speedups(B, alphas, line, reuse))
    plain_rounds = 0
    while not ctrl.prober.due(1, ctrl.costs, 4) or ctrl.prober.since_rounds + 1 < ctrl.prober.interval:
        assert ctrl.choose([0]) == [0]
        ctrl.record([0], [0], [0], 0.0, 0.010)
        plain_rounds += 1
        assert plain_rounds < 1000
    assert calls == []
    assert ctrl.choose([0]) == [1] and ctrl.prober.probing  # the probe, on schedule
    ctrl.record([0], [1], [0], 0.001, 0.014)
    assert ctrl.choose([0]) == [0] and calls and set(calls) == {1}  # the probe's result is weighed
    feed(ctrl, PLAIN_SAMPLES + 3, accept=lambda k: 0, batch=2)  # another batch size is weighed anew
    assert 2 in calls


def test_probes_cost_at_most_their_budget_of_the_plain_time():
    """Useless drafts and dear probes (the drafter catches up on every token since its last draft:
    40 ms, four plain steps): with speculation off, what the probes add over the plain steps they
    replace stays within PROBE_BUDGET of the time, however many rounds run."""
    ctrl = AdaptiveK(4)
    plain_s = excess_s = 0.0
    last = 0
    for r in range(3000):
        k = ctrl.choose([0])[0]
        if k == 0:
            ctrl.record([0], [0], [0], 0.0, 0.010)
            plain_s += 0.010
        else:
            draft, verify = (0.040 if last == 0 else 0.0) + 0.002 * k, 0.010 + 0.004 * k
            ctrl.record([0], [k], [0], draft, verify)
            if r > 100:  # past the first rounds, which learn that speculation does not pay
                excess_s += draft + verify - 0.010
        last = k
    assert excess_s > 0  # it does probe
    assert excess_s <= 1.2 * PROBE_BUDGET * plain_s


def test_multi_step_plain_rounds_count_every_step_towards_the_next_probe():
    one, four = AdaptiveK(4), AdaptiveK(4)
    for ctrl, steps in ((one, 1), (four, 4)):
        feed(ctrl, 40, accept=lambda k: 0, per_token=0.004)
        ctrl.prober.since_s = 0.0
        ctrl.record([0], [0], [0], 0.0, 0.010, num_steps=steps)
    assert four.prober.since_s == pytest.approx(4 * one.prober.since_s)


def test_no_probe_where_no_acceptance_could_pay():
    """A draft step costing as much as a plain step and a verify pass growing by a step per token: even
    drafts that are always accepted lose, so once off, speculation is never probed again."""
    ctrl = AdaptiveK(4)
    drafted = []
    for _ in range(2000):
        k = ctrl.choose([0])[0]
        drafted.append(k)
        ctrl.record([0], [k], [k], 0.010 * k, 0.010 * (k + 1))
    assert not can_ever_pay(ctrl.costs, 1, 4)
    assert max(drafted[200:]) == 0


def test_expensive_drafts_are_not_worth_it_even_when_accepted():
    ctrl = AdaptiveK(4)
    ks = feed(ctrl, 40, accept=lambda k: k, t1=0.010, per_token=0.004, draft=0.012)
    assert ks == [0]


def test_a_round_after_plain_ones_does_not_time_drafting():
    """Its drafter first catches up on every token of the plain rounds: a one-off cost of switching
    on. Timed as drafting, it made a probe look several times dearer and kept speculation off."""
    ctrl = AdaptiveK(4)
    for _ in range(5):
        ctrl.record([0], [0], [0], 0.0, 0.010)
    ctrl.record([0], [1], [1], 0.050, 0.011)  # the probe: 50 ms of catching up, then one draft
    assert 1 not in ctrl.costs.draft_time
    for _ in range(3):  # steady drafting: timed (the first sample builds kernels and is skipped)
        ctrl.record([0], [2], [2], 0.002, 0.012)
    assert ctrl.costs.draft_time[1].value == pytest.approx(0.001)


def test_the_controller_picks_the_k_the_cost_model_says_is_best():
    """Positions 1 and 2 are accepted with probability 0.9, later ones with 0.05: with these costs
    (c = 0.1, v(k) = 1 + 0.2k) docs/algorithm.md's S(k) is 1.46, 1.69, 1.45, 1.25 for k = 1..4, so k = 2
    and only k = 2 is right; the controller, measuring all of it, must settle on it."""
    import random

    rnd = random.Random(0)
    alphas = [0.9, 0.9] + [0.05] * 6

    def accept(k):  # position i accepted with probability alphas[i], stop at the first miss
        n = 0
        while n < k and rnd.random() < alphas[n]:
            n += 1
        return n

    def s(k):  # the cost model's S(k) with these alphas and costs
        return speedup(expected_tokens(alphas, k), round_cost(k, 0.1, 1 + 0.2 * k))

    best = max(range(9), key=s)
    assert best == 2 and s(2) > 1.1 * max(s(1), s(3))
    ctrl = AdaptiveK(8)
    chosen = []
    for _ in range(300):
        k = ctrl.choose([0])[0]
        chosen.append(k)
        ctrl.record([0], [k], [accept(k)], 0.001 * k, 0.010 + 0.002 * k)
    # Late rounds: mostly k = 2. A plain step now and then remeasures the baseline, a neighbouring k
    # its verify pass, and k = 3 comes back now and then: a position rarely reached is smoothed
    # towards the one before it (0.9), so the controller tries it again (and then its neighbour 4).
    late = collections.Counter(chosen[-100:])
    assert late.most_common(1)[0][0] == best and late[best] >= 75 and max(late) <= best + 2


def test_position_stats_count_reached_and_accepted():
    st = PositionStats()
    st.update(num_draft=3, num_accepted=1, decay=1.0)  # reached 1, 2; accepted 1
    st.update(num_draft=2, num_accepted=2, decay=1.0)  # reached 1, 2; accepted 1, 2
    assert st.reached == [2.0, 2.0, 0.0] and st.accepted == [2.0, 1.0, 0.0]
    assert st.alphas(2, [0.5, 0.5], weight=0.0) == [1.0, 0.5]
    a = st.alphas(3, [0.5, 0.5, 0.5], weight=1.0)
    assert a[0] == pytest.approx((2 + 0.5) / 3) and a[1] == pytest.approx((1 + a[0]) / 3)
    assert a[2] == pytest.approx(a[1])  # never reached: the estimate of the position before


# -- the confidence bound: give a drafter up only on the samples that rule it out ------------------


def test_wilson_upper_by_hand():
    z = 1.645
    assert wilson_upper(0.5, 0) == 1.0  # no samples: anything is possible
    # p = 0: z^2 / (n + z^2); three rejections still leave 0.47
    assert wilson_upper(0.0, 3) == pytest.approx(z * z / (3 + z * z))
    assert wilson_upper(0.0, 3) == pytest.approx(0.4742, abs=1e-4)
    # p = 1: the bound is 1
    assert wilson_upper(1.0, 10) == pytest.approx(1.0)
    # p = 0.5, n = 100: (0.5 + z^2/200 + z sqrt(0.25/100 + z^2/40000)) / (1 + z^2/100)
    want = (0.5 + z * z / 200 + z * (0.0025 + z * z / 40000) ** 0.5) / (1 + z * z / 100)
    assert wilson_upper(0.5, 100) == pytest.approx(want) and 0.58 < want < 0.59


def test_the_bound_holds_the_true_rate_in_95_percent_of_samples():
    """Coverage: over 4000 draws of 40 Bernoulli(0.3) samples, the bound falls below 0.3 in at most
    ~5% of them (Wilson's one-sided 95% bound; its coverage at n = 40 is 94-97%). A binomial count of
    4000 at 5% has sd 14: 300 (7.5%) is 7 sd away, a false alarm rate far below 1e-6."""
    import random

    rnd = random.Random(7)
    misses = 0
    for _ in range(4000):
        hits = sum(rnd.random() < 0.3 for _ in range(40))
        misses += wilson_upper(hits / 40, 40) < 0.3
    assert 80 < misses < 300


def test_choose_k_drafts_where_the_estimate_or_the_bound_may_pay():
    assert choose_k([1.0, 1.10, 1.20, 1.05], [1.0, 1.5, 1.6, 1.7]) == 2  # the estimate's best pays
    assert choose_k([1.0, 0.95, 0.97, 0.90], [1.0, 1.2, 1.1, 1.3]) == 2  # it does not, the bound may: learn
    assert choose_k([1.0, 0.95, 0.97, 0.90], [1.0, 1.2, 1.1, 1.3], [1.0, 0.99, 0.97, 0.98]) == 1  # hopeful's k
    # only k = 3 may pay at the bound: learn there, not at the k the hopeful view likes best overall
    assert choose_k([1.0, 0.95, 0.97, 0.90], [1.0, 0.9, 0.95, 1.3], [1.0, 0.99, 0.97, 0.98]) == 3
    assert choose_k([1.0, 0.95, 0.97, 0.90], [1.0, 0.99, 1.0, 0.98]) == 0  # the bound says none can
    assert choose_k([1.0, 1.02, 0.90], [1.0, 0.99, 0.98]) == 1  # the estimate pays (a sequence's own)
    assert choose_k([1.0], [1.0]) == 0


def known_costs(ctrl: AdaptiveK, t1: float, per_token: float, draft: float, k_max: int) -> None:
    """Plain steps and verify passes of 2..k_max+1 tokens timed, draft time known: t_v(T) = t1 +
    per_token * (T - 1); the plain step needs no more timing."""
    for T in range(1, k_max + 2):
        em = ctrl.verify_time.setdefault((1, T), Timing(skip=0))
        for _ in range(4):
            em.update(t1 + per_token * (T - 1))
    ctrl.costs.draft_time.setdefault(1, Timing(skip=0)).update(draft)
    ctrl.costs.plain_measured_at[1] = 0


def test_a_drafter_that_pays_survives_unlucky_first_rounds():
    """The llama.cpp backend's shape: a plain step of 4 ms, a verify pass 1.2 ms dearer plus 0.9 ms a
    token (host work every round), 0.6 ms a draft step, acceptance 0.72: k = 2 pays ~1.09x, k = 1 and
    k = 3 less. The first three drafted rounds accept nothing (a 2% chance): the estimate says the
    drafter loses, the bound after three samples that it may pay, so it keeps drafting, learns its
    acceptance, and its choices earn at least 0.97x of the best fixed k. (The controller before this
    one switched off after such a start.)"""
    import random

    t1, over, per_token, draft, alpha = 0.004, 0.0012, 0.0009, 0.0006, 0.72

    def verify(T):
        return t1 if T == 1 else t1 + over + per_token * (T - 1)

    def s(k):
        return speedup(expected_tokens([alpha] * k, k), round_cost(k, draft, verify(k + 1)), t1)

    best = max(range(1, 9), key=s)
    assert best == 2 and 1.05 < s(2) < 1.15 and s(1) < s(2) and s(3) < s(2)
    ctrl = AdaptiveK(8)
    rnd = random.Random(3)
    chosen = []
    for r in range(400):
        k = ctrl.choose([0])[0]
        chosen.append(k)
        n = 0
        while r >= 7 and n < k and rnd.random() < alpha:
            n += 1
        ctrl.record([0], [k], [n], draft * k, verify(k + 1))
        if r == 6:  # three drafted rounds (after four plain ones), nothing accepted
            assert min(chosen[4:]) > 0
            assert max(ctrl.speedups(1, ctrl.acceptance.per_seq([0], 8))[1:]) < 1.0  # the estimate: it loses
            assert max(ctrl.speedups(1, [ctrl.acceptance.upper(8)], ctrl.costs.optimistic_line(1))) > 1.0
    assert 0 not in chosen[4:100]  # never gave up
    late = chosen[-200:]  # what its choices earn, by the cost model's truth
    tokens = sum(expected_tokens([alpha] * k, k) for k in late)
    time = sum(round_cost(k, draft, verify(k + 1)) for k in late)
    assert tokens * t1 / time >= 0.97 * s(best)


def test_a_drafter_that_cannot_pay_stops_after_the_samples_its_bound_needs():
    """Nothing is ever accepted; a draft step costs 0.1 plain steps and a verify pass 0.15 more per
    token: drafting pays only if position 1 is accepted more often than ~0.25. The controller drafts
    exactly until the bound on position 1 over its decayed samples rules that out at every k (later
    positions never reached: bound 1), then decodes plainly; far more than three rounds."""
    from specdec.adaptive.measure import BATCH_DECAY

    t1, per_token, draft, k_max = 0.010, 0.0015, 0.001, 4
    ctrl = AdaptiveK(k_max)
    known_costs(ctrl, t1, per_token, draft, k_max)

    def may_pay(n: int) -> bool:  # S at the bound, after n rejected rounds, for some k
        r = sum(BATCH_DECAY ** j for j in range(n))
        u = wilson_upper(0.0, r) if n else 1.0
        return any(speedup(expected_tokens([u] + [1.0] * (k - 1), k), round_cost(k, draft, t1 + per_token * k), t1) > 1
                   for k in range(1, k_max + 1))

    needed = next(n for n in range(1000) if not may_pay(n))
    assert needed > 5  # not three: nine rounds here
    drafted = 0
    for _ in range(needed + 20):
        k = ctrl.choose([0])[0]
        if k == 0:
            break
        ctrl.record([0], [k], [0], draft * k, t1 + per_token * k)
        drafted += 1
    assert drafted == needed
    assert ctrl.choose([0]) == [0]


def test_timings_are_medians_so_a_preempted_pass_does_not_move_them():
    t = Timing(skip=1)
    for x in (0.500, 0.010, 0.011, 0.400, 0.009):  # the first builds kernels; one pass in four preempted
        t.update(x)
    assert t.value == pytest.approx(0.0105)


def test_a_length_timed_often_enough_stands_for_itself():
    """The 1B stand-in's q4_k_m curve (ms: T=1 30.8, 2 53.2, 3 74.4, 9 248.8) is no line: a least-squares
    line through 2, 3 and 9 puts v(2) at 50 ms, and k = 1 would look like it pays (1.7 * 30.8 / (1.5 +
    49.9) = 1.02 at acceptance 0.7, a 1.5 ms draft) where it loses (0.96x). Each length timed three
    times is its own median; others follow the line."""
    from specdec.adaptive.measure import SOLID_SAMPLES, fit_line

    ctrl = AdaptiveK(8)
    curve = {1: 0.0308, 2: 0.0532, 3: 0.0744, 9: 0.2488}
    for T, v in curve.items():
        for _ in range(SOLID_SAMPLES + 1):  # the first is skipped
            ctrl.costs.record_verify(1, T, v, 0)
    line = ctrl.verify_line(1)
    assert all(line(T) == pytest.approx(v) for T, v in curve.items())
    fit = fit_line(sorted(curve.items()))
    assert fit(2) < 0.95 * curve[2]  # what the line alone would have said
    assert line(5) == pytest.approx(fit(5)) and curve[3] < line(5) < curve[9]
