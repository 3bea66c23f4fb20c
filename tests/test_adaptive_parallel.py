"""A parallel draft (drafters/pard.py) in the cost model and the adaptive controller: one draft forward
per round whatever k, so its cost is charged per round (c(k) + v(k)), timed per k, not per drafted token."""

import collections
import random

import pytest

from specdec.adaptive import AdaptiveK, Timing
from specdec.adaptive.probe import can_ever_pay
from specdec.cost_model import (
    draft_passes,
    expected_tokens,
    mean_round_cost,
    predicted_speedups,
    round_cost,
    speedup,
)


def test_a_parallel_round_costs_one_draft_forward_whatever_k():
    assert [draft_passes(k) for k in range(4)] == [0, 1, 2, 3]
    assert [draft_passes(k, parallel=True) for k in range(4)] == [0, 1, 1, 1]
    assert round_cost(4, 0.5, 1.3, parallel=True) == pytest.approx(1.8)  # c + v(4), not 4c + v(4)
    assert round_cost(0, 0.5, 1.0, parallel=True) == 1.0  # plain decoding drafts nothing
    v = [1.0, 1.1, 1.2, 1.3]
    c = [0.0, 0.40, 0.45, 0.50]  # c(k): the forward grows with its masks
    assert mean_round_cost(3, c, v, parallel=True) == pytest.approx(0.50 + 1.3)
    # proposal lengths: a round that proposed n drafts costs c(n) + v(n)
    assert mean_round_cost(3, c, v, [1, 0, 1, 2], parallel=True) == pytest.approx((1.0 + 1.65 + 2 * 1.8) / 4)
    alphas = [0.8, 0.7, 0.6]
    got = predicted_speedups(alphas, c, v, parallel=True)
    assert got == pytest.approx([1.0] + [expected_tokens(alphas, k) / (c[k] + v[k]) for k in (1, 2, 3)])
    # the same draft charged per token pays less the more it drafts: the best k moves down
    per_token = predicted_speedups(alphas, 0.5, v)
    assert max(range(4), key=got.__getitem__) == 3 and max(range(4), key=per_token.__getitem__) == 1


def known_costs(ctrl: AdaptiveK, t1: float, per_token: float, k_max: int) -> None:
    for T in range(1, k_max + 2):
        em = ctrl.verify_time.setdefault((1, T), Timing(skip=0))
        for _ in range(4):
            em.update(t1 + per_token * (T - 1))
    ctrl.costs.plain_measured_at[1] = 0


def test_the_controller_charges_a_parallel_draft_its_measured_time_per_round():
    ctrl = AdaptiveK(4)
    ctrl.set_parallel_draft(True)
    known_costs(ctrl, 0.010, 0.001, 4)
    c1 = ctrl.costs.draft_cost(1, 0.010, 1)
    assert [ctrl.costs.draft_cost(1, 0.010, k) for k in (2, 4)] == pytest.approx([c1, c1])  # the prior: flat
    for k, seconds in ((2, 0.0040), (4, 0.0050)):  # rounds after drafting ones: timed per round, by k
        ctrl.last_k = k
        for _ in range(3):
            ctrl.record([0], [k], [k], seconds, 0.010 + 0.001 * k)
    line = [ctrl.costs.draft_cost(1, 0.010, k) for k in range(1, 5)]
    assert line == pytest.approx([0.0035, 0.0040, 0.0045, 0.0050])  # the line through k = 2 and k = 4
    alpha = 0.7
    for k in range(1, 5):
        want = speedup(expected_tokens([alpha] * k, k), round_cost(k, line[k - 1], 0.010 + 0.001 * k, True), 0.010)
        assert ctrl.speedups(1, [[alpha] * 4])[k] == pytest.approx(want)
    assert not ctrl.costs.draft_time  # nothing was charged per drafted token
    assert can_ever_pay(ctrl.costs, 1, 4)  # probing weighs the same shape: 5 tokens for 0.005 + 0.014 s pay
    ctrl.costs.parallel_draft_time.clear()
    ctrl.last_k = 4
    for _ in range(3):
        ctrl.record([0], [4], [4], 0.045, 0.014)  # a draft forward dearer than four plain steps
    assert not can_ever_pay(ctrl.costs, 1, 4)


def simulate(parallel: bool, alpha: float, rounds: int = 400, k_max: int = 8, seed: int = 0):
    """A draft that costs 6 ms a round whatever k (a parallel draft), a 10 ms plain step and 1 ms a
    verified token, i.i.d. acceptance ``alpha``; the controller told (or not) that the draft is parallel."""
    rnd = random.Random(seed)
    ctrl = AdaptiveK(k_max)
    ctrl.set_parallel_draft(parallel)
    chosen = []
    for _ in range(rounds):
        k = ctrl.choose([0])[0]
        chosen.append(k)
        n = 0
        while n < k and rnd.random() < alpha:
            n += 1
        ctrl.record([0], [k], [n], 0.006 if k else 0.0, 0.010 + 0.001 * k)
    return collections.Counter(chosen[-150:])


@pytest.mark.parametrize("alpha", [0.8, 0.6])
def test_the_controller_settles_near_the_parallel_drafts_best_k(alpha):
    """S(k) = E(k) · t_1 / (c + v(k + 1)). Told the draft is parallel, the controller charges it per
    round from the start; not told, it learns the same from its round times at two or more k (a
    draft round's time is a line in k, measure.Costs.draft_cost) and settles as near. (Charged per
    drafted token, the old rule, the same draft looked k times dearer at k drafts and the controller
    stayed at k <= 1 or switched off.)"""
    def s(k):
        return speedup(expected_tokens([alpha] * k, k), round_cost(k, 0.006, 0.010 + 0.001 * k, True), 0.010)

    best = max(s(k) for k in range(9))
    late = simulate(True, alpha)
    assert sum(n * s(k) for k, n in late.items()) / 150 >= 0.95 * best
    untold = simulate(False, alpha)
    assert sum(n * s(k) for k, n in untold.items()) / 150 >= 0.95 * best
