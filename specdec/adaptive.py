"""Adaptive speculation: each round, each sequence gets the k that the cost model says pays most.

ALGORITHM.md's cost model with measured quantities instead of assumptions:
- acceptance: per sequence and per draft position i, the conditional rate
  alpha_i = P(x_i accepted | x_1..x_{i-1} accepted), from decayed counts, smoothed towards
  the same rates over all sequences;
- E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j  (tokens per round, bonus included);
- costs: t_v(B, T), the wall time of a verify pass of T tokens per row at batch size B, and
  t_d(B), the drafter's time per drafted position, both moving averages of what the engine timed;
- S(k) = E(k) * t_v(B, 1) / (k * t_d(B) + t_v(B, k + 1)); S(0) = 1 is plain decoding.
The sequence drafts k* = argmax S(k). When k* = 0 it decodes plainly and probes again with a
one-token draft after a while, backing off while the probes keep failing, so a drafter that
never helps costs almost nothing. A new sequence starts from the probe interval the last finished
one had reached: a workload where speculation does not pay keeps probing rarely.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_ALPHA = 0.6  # acceptance assumed before anything is measured
PRIOR_WEIGHT = 4.0  # pseudo-rounds of the batch-wide rates mixed into a sequence's own counts
DECAY = 0.95  # per update: older rounds weigh less, so a sequence's estimate follows its text
PRIOR_VERIFY_SLOPE = 0.07  # v(T) = 1 + slope * (T - 1) until measured (ALGORITHM.md: v(4) ~ 1.2-1.3 on CPU)
PRIOR_DRAFT_COST = 0.1  # c, one draft step in units of a 1-token target step, until measured
PROBE_K = 1  # a probe drafts one token: the cheapest measurement of position 1
PROBE_INTERVAL = 8  # rounds; doubles after every probe that does not switch speculation back on
MAX_PROBE_INTERVAL = 128


class Ema:
    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.value: float | None = None

    def update(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.weight) * self.value + self.weight * x


@dataclass
class PositionStats:
    """Decayed counts per draft position: rounds that reached position i (drafted it with 1..i-1
    accepted) and rounds that accepted it."""

    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def update(self, num_draft: int, num_accepted: int, decay: float) -> None:
        if len(self.reached) < num_draft:
            grow = num_draft - len(self.reached)
            self.reached += [0.0] * grow
            self.accepted += [0.0] * grow
        for i in range(len(self.reached)):
            self.reached[i] *= decay
            self.accepted[i] *= decay
        for i in range(min(num_draft, num_accepted + 1)):
            self.reached[i] += 1.0
        for i in range(num_accepted):
            self.accepted[i] += 1.0

    def alphas(self, k: int, prior: list[float], weight: float) -> list[float]:
        """Conditional acceptance alpha_1..alpha_k, each smoothed towards ``prior``."""
        out = []
        for i in range(k):
            r = self.reached[i] if i < len(self.reached) else 0.0
            a = self.accepted[i] if i < len(self.accepted) else 0.0
            out.append((a + weight * prior[i]) / (r + weight))
        return out


@dataclass
class _SeqState:
    stats: PositionStats = field(default_factory=PositionStats)
    off_rounds: int = 0  # rounds decoded plainly since speculation was switched off
    probe_interval: int = PROBE_INTERVAL
    probing: bool = False


class AdaptiveK:
    def __init__(self, k_max: int):
        self.k_max = k_max
        self.batch_stats = PositionStats()
        self.verify_time: dict[tuple[int, int], Ema] = {}  # (B, T) -> seconds per verify pass
        self.draft_time: dict[int, Ema] = {}  # B -> seconds per drafted position
        self.seqs: dict[int, _SeqState] = {}
        self.initial_probe_interval = PROBE_INTERVAL  # for new sequences; learnt from finished ones

    # -- decisions --------------------------------------------------------------------------------

    def choose(self, seq_ids: list[int]) -> list[int]:
        B = len(seq_ids)
        prior = self._batch_alphas()
        ks = []
        for sid in seq_ids:
            st = self.seqs.get(sid)
            if st is None:
                st = self.seqs[sid] = _SeqState(probe_interval=self.initial_probe_interval)
            alphas = st.stats.alphas(self.k_max, prior, PRIOR_WEIGHT)
            best = max(range(self.k_max + 1), key=lambda k: self._speedup(B, k, alphas))
            st.probing = False
            if best == 0:
                st.off_rounds += 1
                if st.off_rounds % st.probe_interval == 0:
                    best, st.probing = min(PROBE_K, self.k_max), True
            else:
                st.off_rounds, st.probe_interval = 0, PROBE_INTERVAL
            ks.append(best)
        return ks

    def predicted_speedup(self, batch: int, k: int, alphas: list[float] | None = None) -> float:
        return self._speedup(batch, k, alphas if alphas is not None else self._batch_alphas())

    def _speedup(self, B: int, k: int, alphas: list[float]) -> float:
        if k == 0:
            return 1.0
        expected, run = 1.0, 1.0
        for a in alphas[:k]:
            run *= a
            expected += run
        t1 = self._verify_cost(B, 1)
        return expected * t1 / (k * self._draft_cost(B, t1) + self._verify_cost(B, k + 1))

    def _batch_alphas(self) -> list[float]:
        prior = [PRIOR_ALPHA] * self.k_max
        alphas = self.batch_stats.alphas(self.k_max, prior, 1.0)
        # positions never reached keep the last measured rate, not the optimistic prior
        for i in range(1, self.k_max):
            if i >= len(self.batch_stats.reached) or self.batch_stats.reached[i] < 1e-3:
                alphas[i] = alphas[i - 1]
        return alphas

    def _verify_cost(self, B: int, T: int) -> float:
        """Seconds of a verify pass with T tokens per row, measured, else scaled from a measured T."""
        e = self.verify_time.get((B, T))
        if e is not None and e.value is not None:
            return e.value
        known = [(t, em.value) for (b, t), em in self.verify_time.items() if b == B and em.value is not None]
        if not known:
            return 1.0 + PRIOR_VERIFY_SLOPE * (T - 1)  # unitless prior; only ratios matter
        lower = [(t, v) for t, v in known if t <= T]
        upper = [(t, v) for t, v in known if t >= T]
        if lower and upper:  # interpolate between the nearest measured lengths
            (t0, v0), (t1, v1) = max(lower), min(upper)
            return v0 if t1 == t0 else v0 + (v1 - v0) * (T - t0) / (t1 - t0)
        t0, v0 = min(known, key=lambda tv: abs(tv[0] - T))
        return v0 * (1.0 + PRIOR_VERIFY_SLOPE * (T - 1)) / (1.0 + PRIOR_VERIFY_SLOPE * (t0 - 1))

    def _draft_cost(self, B: int, t1: float) -> float:
        e = self.draft_time.get(B)
        if e is None or e.value is None:
            return PRIOR_DRAFT_COST * t1
        return e.value

    # -- measurements -----------------------------------------------------------------------------

    def record(self, seq_ids: list[int], num_draft: list[int], num_accepted: list[int],
               draft_time_s: float, verify_time_s: float) -> None:
        B = len(seq_ids)
        k_round = max(num_draft)
        self.verify_time.setdefault((B, k_round + 1), Ema()).update(verify_time_s)
        if k_round > 0:
            self.draft_time.setdefault(B, Ema()).update(draft_time_s / k_round)
        for sid, nd, na in zip(seq_ids, num_draft, num_accepted):
            if nd == 0:
                continue
            st = self.seqs.setdefault(sid, _SeqState())
            st.stats.update(nd, na, DECAY)
            self.batch_stats.update(nd, na, DECAY ** (1.0 / max(B, 1)))
            if st.probing and na == 0:
                st.probe_interval = min(2 * st.probe_interval, MAX_PROBE_INTERVAL)

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            st = self.seqs.pop(sid, None)
            if st is not None:  # speculation off at the end: the next sequence probes as rarely
                self.initial_probe_interval = st.probe_interval if st.off_rounds else PROBE_INTERVAL
