"""How the controller probes while speculation is off: a one-token draft now and then, spaced so
that probes cost at most PROBE_BUDGET of the plain decoding between them, and none where even drafts
that are always accepted could not pay (``can_ever_pay``).

A probe costs more than the plain step it replaces (the drafter first catches up on every token
since its last draft, then a verify pass of 2 tokens); where speculation cannot pay that excess is
all a probe adds. Plain rounds change no acceptance estimate, so while off the controller does not
weigh k again until a probe (or another batch size) has given it something new.
"""

from __future__ import annotations

from specdec.adaptive.measure import Costs, Timing, timing
from specdec.cost_model import round_cost, speedup

PROBE_K = 1  # a probe drafts one token: the cheapest measurement of position 1
PROBE_INTERVAL = 8  # rounds; doubles after every probe that does not switch speculation back on
MAX_PROBE_INTERVAL = 128
PROBE_BUDGET = 0.01  # probes may cost at most this share of the plain decoding time between them
PRIOR_PROBE_COST = 1.0  # a probe's excess over plain decoding, in one-token steps, until measured


def can_ever_pay(costs: Costs, B: int, k_max: int) -> bool:
    """Whether drafts accepted every time would beat plain decoding at batch size B with the measured
    draft cost, verify line (flat beyond the longest pass timed, ``Costs.optimistic_line``) and host work
    o per round (o_1 per plain token): S(k) = (k + 1) · (t_1 + o_1) / (k · c + t_v(k + 1) + o) > 1 for
    some k <= k_max.
    If not, no acceptance can make speculation pay here and probing only costs."""
    line = costs.optimistic_line(B)
    t1 = line(1)
    plain, extra = t1 + costs.overhead(B, plain=True), costs.overhead(B, plain=False)  # host work (measure.py)
    return any(speedup(k + 1.0, round_cost(k, costs.draft_cost(B, t1, k), line(k + 1), costs.parallel) + extra,
                       plain) > 1.0 for k in range(1, k_max + 1))


class Prober:
    """The off state of one controller: since when, at which batch size, and when the next probe is due."""

    def __init__(self):
        self.off_rounds = 0  # rounds decoded plainly since speculation was switched off
        self.off_batch = 0  # the batch size speculation was last switched off at
        self.probing = False  # this round is a probe
        self.interval = PROBE_INTERVAL
        self.since_rounds = 0  # plain rounds since the last probe (or since speculation went off)
        self.since_s = 0.0  # seconds of plain decoding since then
        self.cost: dict[int, Timing] = {}  # B -> a probe's seconds beyond the plain steps it replaces
        self.wait_s: float | None = None  # plain seconds between probes (None: to be worked out)

    def holds_off(self, B: int, was_probe: bool) -> bool:
        """Whether the last decision (off, at this batch size) stands without weighing k again."""
        return bool(self.off_rounds) and not was_probe and B == self.off_batch

    def on(self) -> None:
        self.off_rounds, self.interval = 0, PROBE_INTERVAL

    def off(self, B: int, was_probe: bool, costs: Costs, k_max: int) -> int:
        """A round with speculation off at batch size B: PROBE_K if a probe is due, else 0."""
        if was_probe:  # the probe did not switch speculation back on: wait longer next time
            self.interval = min(2 * self.interval, MAX_PROBE_INTERVAL)
        if not self.off_rounds:
            self.since_rounds, self.since_s = 0, 0.0
        if not self.off_rounds or B != self.off_batch:
            self.wait_s = None  # a probe's cost depends on the batch size
        self.off_rounds += 1
        self.off_batch = B
        self.since_rounds += 1
        if self.due(B, costs, k_max):
            self.probing = True
            self.since_rounds, self.since_s, self.wait_s = 0, 0.0, None
            return min(PROBE_K, k_max)
        return 0

    def due(self, B: int, costs: Costs, k_max: int) -> bool:
        """Whether speculation, off at batch size B, probes this round: after ``interval`` plain rounds
        (doubling while probes fail), once the plain decoding since the last probe took
        1 / PROBE_BUDGET times a probe's measured excess cost, and only where some acceptance could
        pay (``can_ever_pay``)."""
        if self.since_rounds < self.interval:
            return False
        if self.wait_s is None:  # once per wait: off rounds stay cheap
            em = self.cost.get(B)
            cost = em.value if em is not None and em.value is not None else PRIOR_PROBE_COST * costs.verify_line(B)(1)
            self.wait_s = cost / PROBE_BUDGET if can_ever_pay(costs, B, k_max) else float("inf")
        return self.since_s >= self.wait_s

    def forget(self, B: int) -> None:
        """Batch size B's costs were forgotten (Costs.expire): its probes' measured cost goes too, and
        whether and when to probe is worked out again at the next due round."""
        self.cost.pop(B, None)
        self.wait_s = None

    def record_plain(self, seconds: float) -> None:
        self.since_s += seconds

    def record_probe(self, B: int, excess_s: float) -> None:
        """What the probe cost beyond the plain steps its tokens would have taken."""
        timing(self.cost, B, window=8, skip=0).update(max(excess_s, 0.0))
