"""What the controller measures: acceptance per draft position (a point estimate and an upper
confidence bound) and costs (the verify pass per length, a draft step, a tree level), per batch size.

Acceptance is conditional per position, alpha_i = P(x_i accepted | x_1..x_{i-1} accepted), from
decayed counts: rounds that reached position i and rounds that accepted it. The upper bound is the
Wilson score bound on those counts (``wilson_upper``): it is wide after a few rounds and narrows as
samples come, so the controller can tell "this drafter cannot pay" from "too few samples to say".
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.policy import PRIOR_ALPHA, PRIOR_DRAFT_COST, PRIOR_WEIGHT, prior_verify_line

DECAY = 0.95  # per round a sequence drafts: older rounds weigh less, so its estimate follows its text
BATCH_DECAY = 0.995  # per round, over every sequence: ~200 rounds of samples, enough for the bound to
#                     tell a drafter at 0.05 from one at 0.1 (the break-even of a flat verify pass)
WINDOW_ROUNDS = 20  # a stretch of a sequence's rounds (its DECAY's horizon) whose rates are compared
WINDOWS = 64  # stretches kept
MIN_WINDOWS = 4  # stretches seen before their spread sets the prior's weight
MAX_WEIGHT = 40.0  # the prior's weight at most: two stretches of a sequence's own rounds
Z = 1.645  # the one-sided 95% bound: speculation stops when even this optimistic acceptance cannot pay
PLAIN_SAMPLES = 3  # plain steps timed at a batch size before it may speculate: the fastest of one or
#                    two samples is a poor baseline beside the fastest of eight speculative rounds
SOLID_SAMPLES = 3  # timings of a verify length that stand for it without the line through the others
REFRESH_ROUNDS = 128  # a batch size's plain-step time older than this many rounds is measured again
REFRESH_THIN_ROUNDS = 16  # ... and a verify length timed fewer than SOLID_SAMPLES times, after this many
EXPIRE_ROUNDS = REFRESH_ROUNDS  # a draft or verify cost not timed for this many rounds may be forgotten ...
IMPLAUSIBLE = 1.5  # ... where it exceeds this many plain steps per token (Costs.expire)


class Timing:
    """A wall-time estimate: the median of the last ``window`` samples, skipping the first ``skip``
    (the first pass at a new shape also builds its kernels). The median, not the mean: on a shared
    machine one pass in a few is preempted for many times its length, and a mean of a few such
    samples made a 5-token verify pass look 5x a plain step and switched off a drafter that paid
    1.45x. What it times is not skewed otherwise: passes that carry a prompt are not timed, nor
    the draft of a round after plain ones (the drafter's catch-up)."""

    def __init__(self, window: int = 16, skip: int = 1):
        self.samples: deque[float] = deque(maxlen=window)
        self.skip = skip
        self._median: float | None = None  # ``value``, worked out when read after samples came
        self._stale = False
        self.at: int | None = None  # the round of the last sample, where the caller says (Costs.expire)

    @property
    def value(self) -> float | None:
        """The median of the samples kept (None before the first): read at a weighing, every few rounds."""
        if self._stale:
            s, n = sorted(self.samples), len(self.samples)
            self._median, self._stale = (s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])), False
        return self._median

    def update(self, x: float, at: int | None = None) -> None:
        self.at = at
        if self.skip > 0:
            self.skip -= 1
        else:
            self.samples.append(x)
            self._stale = True


def timing(table: dict, key, window: int = 16, skip: int = 1) -> Timing:
    """``table[key]``, a new Timing there if none (``setdefault`` would build one every call, a few a round)."""
    em = table.get(key)
    if em is None:
        em = table[key] = Timing(window, skip)
    return em


def wilson_upper(p: float, n: float, z: float = Z) -> float:
    """The Wilson score upper bound of a rate observed as ``p`` over ``n`` (possibly fractional,
    decayed) samples; 1.0 with no samples. Unlike p + z·sqrt(p(1-p)/n) it is not 0 wide at p = 0:
    three rejections in three rounds still leave 0.47 possible at z = 1.645."""
    if n <= 0.0:
        return 1.0
    z2n = z * z / n
    centre = p + z2n / 2
    half = z * math.sqrt(p * (1.0 - p) / n + z2n / (4 * n))
    return min(1.0, (centre + half) / (1.0 + z2n))


def _logit(p: float) -> float:
    p = min(max(p, 1e-3), 1.0 - 1e-3)
    return math.log(p / (1.0 - p))


def prior_steps(prior: list[float], k: int) -> list[float | None]:
    """The prior's log-odds step from each position to the next, positions 1..k (None where it is flat
    or ends: the estimate there follows the one before)  [k - 1]."""
    return [None if i >= len(prior) or prior[i] == prior[i - 1] else _logit(prior[i]) - _logit(prior[i - 1])
            for i in range(1, k)]


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
        reached, accepted = [x * decay for x in self.reached], [x * decay for x in self.accepted]
        for i in range(min(num_draft, num_accepted + 1)):
            reached[i] += 1.0
        for i in range(num_accepted):
            accepted[i] += 1.0
        self.reached, self.accepted = reached, accepted

    def counts(self, i: int) -> tuple[float, float]:
        """(accepted, reached) at position i (0-based)."""
        if i < len(self.reached):
            return self.accepted[i], self.reached[i]
        return 0.0, 0.0

    def alphas(self, k: int, prior: list[float], weight: float, steps: list[float | None] | None = None) -> list[float]:
        """Conditional acceptance alpha_1..alpha_k, each position's counts plus ``weight`` pseudo-rounds
        of a prior: at position 1 ``prior[0]``; at position i > 1 the estimate at i - 1 moved by the
        prior's step from i - 1 to i in log-odds. The prior (the batch's rates) gives
        the shape over positions, a row's own counts its level: a row that rejects position 1 more
        than the batch keeps the batch's higher rates deeper down, a little lower, instead of
        dropping them to its position-1 rate (llama.cpp's draft accepts position 2 at 0.9 after 0.72
        at position 1). A position not reached lately (its counts decay) thus follows the one
        before, as the prior steps, instead of staying at an old value that no round would ever
        correct once k had dropped below it. With a flat prior (or past its end), each follows the one
        before. ``steps``: ``prior_steps(prior, k)``, where the caller has it (one for every row)."""
        steps = prior_steps(prior, k) if steps is None else steps
        out: list[float] = []
        for i in range(k):
            a, r = self.counts(i)
            if i == 0:
                toward = prior[0]
            elif steps[i - 1] is None:
                toward = out[-1]
            else:  # the estimate at i - 1 as far above or below the prior at i as at i - 1, in log-odds
                p = min(max(out[-1], 1e-3), 1.0 - 1e-3)
                toward = 1.0 / (1.0 + (1.0 - p) / p * math.exp(-steps[i - 1]))
            out.append((a + weight * toward) / (r + weight))
        return out

    def upper(self, k: int, z: float = Z) -> list[float]:
        """Upper confidence bounds of alpha_1..alpha_k, each position's Wilson bound over its own
        samples alone (1.0 where it has none: a position never reached could accept everything)."""
        out = []
        for i in range(k):
            a, r = self.counts(i)
            out.append(wilson_upper(a / r, r, z) if r > 0 else 1.0)
        return out


class Acceptance:
    """Acceptance per sequence (its own decayed counts, smoothed towards the batch's: what k to draft)
    and over every sequence (the drafter's rates, over a longer horizon: the prior of a sequence that
    has drafted little, and the samples behind the upper bound that decides whether to draft at all)."""

    def __init__(self):
        self.batch = PositionStats()
        self.seqs: dict[int, PositionStats] = {}
        self.window: dict[int, list[int]] = {}  # sid -> [accepted, reached] at position 1, this window
        self.windows: deque[tuple[int, int]] = deque(maxlen=WINDOWS)  # closed windows' counts
        self._closed = 0  # windows closed so far
        self._weight = (-1, PRIOR_WEIGHT)  # (_closed then, prior_weight then): it changes as windows close

    def seq(self, sid: int) -> PositionStats:
        return self.seqs.setdefault(sid, PositionStats())

    def record(self, sid: int, num_draft: int, num_accepted: int, batch_size: int) -> None:
        self.seq(sid).update(num_draft, num_accepted, DECAY)
        self.batch.update(num_draft, num_accepted, BATCH_DECAY ** (1.0 / max(batch_size, 1)))  # per round
        w = self.window.setdefault(sid, [0, 0])
        w[0] += num_accepted > 0
        w[1] += 1
        if w[1] == WINDOW_ROUNDS:
            self.windows.append((w[0], w[1]))
            self._closed += 1
            self.window[sid] = [0, 0]

    def prior_weight(self) -> float:
        """Pseudo-rounds of the batch's rates in a sequence's estimate (empirical Bayes): how much the
        rate at position 1 truly differs between stretches of WINDOW_ROUNDS rounds (any sequence's),
        tau^2 = their rates' spread about the batch's less the binomial noise a(1 - a) / n, read as a
        Beta prior's weight a(1 - a) / tau^2 - 1. Where stretches differ little beyond their noise, a
        sequence's few recent rejections are mostly luck, and its estimate stays near the batch's;
        where they differ, near its own counts. PRIOR_WEIGHT until MIN_WINDOWS stretches are seen;
        within [PRIOR_WEIGHT, MAX_WEIGHT] (a sequence's own counts always move it)."""
        if len(self.windows) < MIN_WINDOWS:
            return PRIOR_WEIGHT
        if self._weight[0] == self._closed:
            return self._weight[1]
        a = sum(x for x, _ in self.windows) / sum(n for _, n in self.windows)
        spread = sum((x / n - a) ** 2 for x, n in self.windows) / len(self.windows)
        noise = sum(a * (1.0 - a) / n for _, n in self.windows) / len(self.windows)
        tau2 = spread - noise
        weight = MAX_WEIGHT if tau2 <= 0.0 else min(MAX_WEIGHT, max(PRIOR_WEIGHT, a * (1.0 - a) / tau2 - 1.0))
        self._weight = (self._closed, weight)
        return weight

    def batch_alphas(self, k: int) -> list[float]:
        """The batch's alpha_1..alpha_k; a position never reached keeps the last measured rate, not
        the optimistic prior."""
        alphas = self.batch.alphas(k, [PRIOR_ALPHA] * k, 1.0)
        for i in range(1, k):
            if i >= len(self.batch.reached) or self.batch.reached[i] < 1e-3:
                alphas[i] = alphas[i - 1]
        return alphas

    def profile(self, k: int) -> list[float]:
        """The prior of a sequence's alpha_1..alpha_k: the batch's alpha_1, then the batch's steps from
        one position to the next in log-odds, each shrunk by how sure the batch is of it (empirical
        Bayes): a step measured over r rounds has sampling variance ~1 / (r a (1 - a)); the spread of
        true steps, tau^2, is what the steps' spread exceeds that by (method of moments about 0,
        precision-weighted), and each step keeps tau^2 / (tau^2 + its variance) of itself. A drafter
        whose rates do not change with depth (tau^2 = 0) gives a flat prior, whatever noise its
        deep positions show; one whose position 2 clearly accepts more than position 1 keeps that."""
        m = self.batch_alphas(k)
        logits = [_logit(a) for a in m]
        steps, variances = [], []
        for i in range(1, k):
            r = self.batch.reached[i] if i < len(self.batch.reached) else 0.0
            steps.append(logits[i] - logits[i - 1])
            variances.append(1.0 / (r * m[i] * (1.0 - m[i])) if r >= 1.0 and 0.0 < m[i] < 1.0 else math.inf)
        weights = [1.0 / v for v in variances]
        n = sum(1 for w in weights if w > 0)
        q = sum(w * d * d for w, d in zip(weights, steps))
        tau2 = max(0.0, (q - n) / sum(weights)) if n else 0.0
        if tau2 == 0.0:
            return [m[0]] * k if k else []
        out, x = m[:1], logits[0]
        for d, v in zip(steps, variances):
            x += tau2 / (tau2 + v) * d
            out.append(1.0 / (1.0 + math.exp(-x)))
        return out

    def per_seq(self, seq_ids: list[int], k: int) -> list[list[float]]:
        """Per sequence: its alpha_1..alpha_k, smoothed towards the batch's ``profile``."""
        prior, weight = self.profile(k), self.prior_weight()
        steps = prior_steps(prior, k)
        return [self.seq(sid).alphas(k, prior, weight, steps) for sid in seq_ids]

    def upper(self, k: int, own: Sequence[int] = ()) -> list[float]:
        """The drafter's alpha_1..alpha_k at their upper confidence bounds (``PositionStats.upper``);
        ``own``: rows whose own bounds count too (the highest of all, per position): a request with
        little evidence of its own may pay where the drafter's rates so far say it cannot."""
        out = self.batch.upper(k)
        for sid in own:
            out = [max(a, b) for a, b in zip(out, self.seq(sid).upper(k))]
        return out

    def mean_alphas(self, seq_ids: list[int], depth: int) -> list[float]:
        """The batch's conditional acceptance per depth: each sequence's estimate, averaged per position
        (one tree shape serves the batch)."""
        prior = self.profile(depth) if depth else []
        weight = self.prior_weight()
        steps = prior_steps(prior, depth)
        rows = [self.seq(sid).alphas(depth, prior, weight, steps) for sid in seq_ids]
        if not rows:
            return prior
        return [sum(col) / len(rows) for col in zip(*rows)]

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.seqs.pop(sid, None)
            self.window.pop(sid, None)


def fit_line(known: list[tuple[int, float]], plain_in_fit: bool = False):
    """T -> seconds through measured (T, seconds) points sorted by T. T = 1 is the plain step, exactly
    as measured; T > 1 the least-squares line through the verify passes measured (single timings are
    noisy enough to make k = 3 look cheaper than k = 2), never below the plain step. The plain step
    joins the fit only while fewer than two longer passes are known: a verify pass carries host work
    a plain step does not, and a line through both turns that fixed cost into a slope (``plain_in_fit``:
    always, for the tree line, whose passes of up to 1 + max_nodes tokens dwarf that cost). With one
    point, the prior slope from it; with none, the prior line in one-token steps (only ratios matter)."""
    if not known:
        return prior_verify_line
    plain = known[0][1] if known[0][0] == 1 else None
    if len(known) == 1:
        t0, v0 = known[0]
        scale = v0 / prior_verify_line(t0)
        return lambda T: scale * prior_verify_line(T)
    longer = [(t, v) for t, v in known if t > 1]
    fit = longer if len(longer) >= 2 and not plain_in_fit else known
    n = len(fit)
    mt = sum(t for t, _ in fit) / n
    mv = sum(v for _, v in fit) / n
    slope = sum((t - mt) * (v - mv) for t, v in fit) / sum((t - mt) ** 2 for t, _ in fit)
    floor = plain or 0.0
    return lambda T: plain if T == 1 and plain is not None else max(mv + slope * (T - mt), floor)


def robust_line(known: list[tuple[int, float, int]]):
    """k -> seconds through (k, median seconds, samples) points, k distinct: the Theil-Sen line, its slope
    the median of the slopes between pairs of points (weighted by their samples and how far apart they
    are: two neighbours timed often said 0.07 ms a draft where it cost 0.1) and its level the median of what each point leaves (weighted by samples), so that a
    point timed once or twice under another job's load does not tilt it; never below a tenth of the
    cheapest point."""

    def weighted_median(pairs: list[tuple[float, float]]) -> float:
        pairs.sort()
        half, run = sum(w for _, w in pairs) / 2, 0.0
        for x, w in pairs:
            run += w
            if run >= half:
                return x
        return pairs[-1][0]

    slope = weighted_median([((v2 - v1) / (k2 - k1), n1 * n2 * (k2 - k1))
                             for i, (k1, v1, n1) in enumerate(known) for k2, v2, n2 in known[i + 1:]])
    level = weighted_median([(v - slope * k, n) for k, v, n in known])
    floor = 0.1 * min(v for _, v, _ in known)
    return lambda k: max(level + slope * k, floor)


def monotone(points: dict[int, tuple[float, int]]) -> dict[int, float]:
    """T -> seconds through measured (seconds, samples) per T, made non-decreasing in T by pooling
    adjacent violators, weighted by samples: a longer pass never costs less than a shorter one, and
    on a loaded machine medians taken minutes apart can say it does (v(4) 1.18 beside v(3) 1.68),
    which locked the controller onto the length that happened to be timed in a quiet moment."""
    blocks: list[list[float]] = []  # [value, weight, count of T]
    ts = sorted(points)
    for t in ts:
        v, w = points[t]
        blocks.append([v, float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    out, i = {}, 0
    for v, _, n in blocks:
        for t in ts[i:i + n]:
            out[t] = v
        i += n
    return out


TREE_DRAFT_PRIOR = 1.25  # a tree's draft time per level, in chain draft steps, until measured (wider feeds)


class Costs:
    """Wall times per batch size B: verify passes by tokens per row T (chains' and trees'), a chain's
    draft time per drafted position (a parallel draft's: per round, by k), a tree's per level, and
    when the plain step was last timed."""

    def __init__(self):
        self.verify_time: dict[tuple[int, int], Timing] = {}  # (B, T) -> seconds per chain verify pass
        self.tree_verify_time: dict[tuple[int, int], Timing] = {}  # (B, 1 + N) -> seconds per tree pass
        self.parallel = False  # the drafter proposes all k drafts from one forward (drafters/pard.py)
        self.draft_time: dict[int, Timing] = {}  # B -> seconds per drafted position
        self.round_draft_time: dict[tuple[int, int], Timing] = {}  # (B, k) -> seconds of a round's k draft steps
        self._draft_records = 0  # round_draft_time's updates: when its line is fitted again
        self._draft_lines: dict[int, tuple[int, object]] = {}  # B -> (_draft_records then, the line or None)
        self.parallel_draft_time: dict[tuple[int, int], Timing] = {}  # (B, k) -> a parallel draft's seconds per round
        self.tree_draft_time: dict[int, Timing] = {}  # B -> seconds per tree level drafted
        self.plain_measured_at: dict[int, int] = {}  # B -> the round its plain step was last timed
        self.timed_at: dict[tuple[int, int], int] = {}  # (B, T) -> the round a chain pass of T was last timed
        # B -> seconds outside the forward calls: per round of drafts, per token of plain decoding. A
        # round of drafts pays its host work once per round, plain decoding runs several steps per
        # call: left out, a round's cost looked ~0.5 steps cheaper than it was, most at small k.
        self.overhead_time: dict[int, Timing] = {}
        self.plain_overhead_time: dict[int, Timing] = {}

    def verify_line(self, B: int):
        """T -> seconds of a chain verify pass with T tokens per row at batch size B: the median of a
        length timed SOLID_SAMPLES times or more, else ``fit_line`` through the lengths measured
        there (a line misses a curve's points: at 1B sizes v(2) by 20%, enough to keep k = 1 on
        where it lost 4%)."""
        mine = [(t, em) for (b, t), em in self.verify_time.items() if b == B and em.value is not None]
        line = fit_line(sorted((t, em.value) for t, em in mine))
        solid = monotone({t: (em.value, len(em.samples)) for t, em in mine if len(em.samples) >= SOLID_SAMPLES})
        return (lambda T: solid[T] if T in solid else line(T)) if solid else line

    def tree_verify_line(self, B: int):
        """T -> seconds of a verify pass of T tokens per row at batch size B through every length
        measured there, chain passes and tree passes alike (a tree of N nodes is a pass of 1 + N)."""
        points: dict[int, float] = {}
        for table in (self.verify_time, self.tree_verify_time):
            for (b, t), em in table.items():
                if b == B and em.value is not None:
                    points[t] = em.value if t not in points else (points[t] + em.value) / 2
        return fit_line(sorted(points.items()), plain_in_fit=True)

    def record_overhead(self, B: int, plain: bool, seconds: float) -> None:
        """A round's wall time outside its draft and verify calls (scheduling, sampling, commit, the
        drafter's bookkeeping): per round of drafts, or per token of a plain round (``plain``)."""
        table = self.plain_overhead_time if plain else self.overhead_time
        timing(table, B, window=32).update(max(seconds, 0.0))

    def overhead(self, B: int, plain: bool) -> float:
        """Seconds a round of drafts (or a plain token, ``plain``) spends outside its forward calls at
        batch size B; 0 until measured."""
        em = (self.plain_overhead_time if plain else self.overhead_time).get(B)
        return 0.0 if em is None or em.value is None else em.value

    def optimistic_line(self, B: int):
        """``verify_line`` up to the longest pass measured at batch size B, and flat beyond it: a
        length not yet timed may cost no more than the longest one that was (so the bound may try it)."""
        longest = max((t for (b, t), em in self.verify_time.items() if b == B and em.value is not None), default=None)
        line = self.verify_line(B)
        return line if longest is None else (lambda T: line(min(T, longest)))

    def draft_cost(self, B: int, t1: float, k: int = 1) -> float:
        """Seconds per drafted position at batch size B in a round of k drafts; PRIOR_DRAFT_COST plain
        steps until measured. Once rounds of two or more k are timed, the line through their round
        times (``fit_line``) over k: a round's first draft step also reads the tokens accepted since
        the last one (llama.cpp, shipped draft: 0.82, 0.80, 1.25, 1.90 ms a round at k = 1, 2, 4, 8),
        so one mean per drafted position overcharged long rounds and undercharged short ones.
        A parallel draft (``parallel``): seconds of its one forward for k drafts (``parallel_draft_line``)."""
        if self.parallel:
            return self.parallel_draft_line(B, t1)(k)
        line = self._round_draft_line(B)
        if line is not None:
            return line(k) / k
        e = self.draft_time.get(B)
        return PRIOR_DRAFT_COST * t1 if e is None or e.value is None else e.value

    def _round_draft_line(self, B: int):
        """k -> seconds of a round's k draft steps at batch size B, ``robust_line`` through the k timed
        (None below two): a k timed once in a busy moment (8.5 plain steps for 6 drafts beside 0.2 for
        4) tilted a least-squares line and held k two below the best, and no round re-timed it. Fitted
        once per timing recorded (the controller reads it for every k)."""
        cached = self._draft_lines.get(B)
        if cached is None or cached[0] != self._draft_records:
            known = sorted((n, em.value, len(em.samples)) for (b, n), em in self.round_draft_time.items()
                           if b == B and em.value is not None)
            cached = self._draft_lines[B] = (self._draft_records, robust_line(known) if len(known) >= 2 else None)
        return cached[1]

    def parallel_draft_line(self, B: int, t1: float):
        """k -> seconds of a parallel draft's round at batch size B: ``fit_line`` through the k measured
        (its forward reads the new tokens and k - 1 masks, so it grows with k like a verify pass);
        PRIOR_DRAFT_COST plain steps whatever k until one is measured."""
        known = sorted((k, em.value) for (b, k), em in self.parallel_draft_time.items()
                       if b == B and em.value is not None)
        if not known:
            return lambda k: PRIOR_DRAFT_COST * t1
        return fit_line(known, plain_in_fit=True)

    def record_draft(self, B: int, k: int, seconds: float, rounds: int | None = None) -> None:
        """A chain round's drafting time at batch size B for k drafts, at round ``rounds``: per drafted
        position, or for a parallel draft per round at that k."""
        if self.parallel:
            timing(self.parallel_draft_time, (B, k)).update(seconds, rounds)
        else:
            timing(self.draft_time, B).update(seconds / k, rounds)
            timing(self.round_draft_time, (B, k)).update(seconds, rounds)
            self._draft_records += 1

    def tree_draft_cost(self, B: int, t1: float) -> float:
        """Seconds per tree level at batch size B; TREE_DRAFT_PRIOR chain draft steps until measured."""
        e = self.tree_draft_time.get(B)
        return TREE_DRAFT_PRIOR * self.draft_cost(B, t1) if e is None or e.value is None else e.value

    def record_verify(self, B: int, T: int, seconds: float, rounds: int) -> None:
        """A chain verify pass of T tokens per row at batch size B, at round ``rounds``."""
        em = timing(self.verify_time, (B, T))
        em.update(seconds, rounds)
        if em.samples:
            self.timed_at[(B, T)] = rounds

    def expire(self, B: int, rounds: int) -> bool:
        """Forget batch size B's draft and verify costs that were last timed more than EXPIRE_ROUNDS rounds
        before ``rounds`` and that the plain step now says cannot be: a pass of T tokens dearer than
        IMPLAUSIBLE x T plain steps, drafting dearer than IMPLAUSIBLE x a plain step per drafted position.
        Whether any went. Such costs were timed while another job loaded the machine, and a length no
        longer chosen is never timed again: passes timed 9-60x their cost in a busy first minute (and the
        draft at 20x) once kept speculation off for good after the load was gone (``can_ever_pay`` said
        no acceptance could pay). A forgotten length follows the line through the others
        (``verify_line``), a forgotten draft cost its prior, until timed again; costs that are merely
        high (a draft as dear as the target) stand, and decide as before."""
        plain = self.verify_time.get((B, 1))
        if plain is None or plain.value is None:
            return False
        t1 = plain.value

        def gone_by(em: Timing, allowed: float) -> bool:  # allowed: what the plain step says it may cost
            return (em.at is not None and rounds - em.at > EXPIRE_ROUNDS and em.value is not None
                    and em.value > IMPLAUSIBLE * allowed)

        gone = False
        for table in (self.verify_time, self.tree_verify_time, self.round_draft_time, self.parallel_draft_time):
            for key in [key for key, em in table.items() if key[0] == B and key[1] > 1 and gone_by(em, key[1] * t1)]:
                del table[key]
                if table is self.verify_time:  # timed_at holds chain verify passes only
                    self.timed_at.pop(key, None)
                gone = True
        em = self.draft_time.get(B)
        if em is not None and gone_by(em, t1):
            del self.draft_time[B]
            gone = True
        if gone:
            self._draft_records += 1  # the round-draft line is fitted again
        return gone

    def stale(self, B: int, T: int, rounds: int, thin: bool = False) -> bool:
        """Whether a chain pass of T tokens at batch size B has not been timed for REFRESH_ROUNDS
        rounds (or never): the machine's load or the cache length may have changed its cost since.
        ``thin``: a length timed fewer than SOLID_SAMPLES times is stale after REFRESH_THIN_ROUNDS
        already: one preempted sample (a 5-token pass timed at 2.08 ms beside 1.35 for 4 tokens)
        otherwise held the controller a k below the best for REFRESH_ROUNDS rounds."""
        em = self.verify_time.get((B, T))
        few = thin and em is not None and len(em.samples) < SOLID_SAMPLES
        period = REFRESH_THIN_ROUNDS if few else REFRESH_ROUNDS
        return rounds - self.timed_at.get((B, T), -REFRESH_ROUNDS - 1) > period

    def measuring_plain(self, B: int) -> bool:
        """Whether this batch size's first PLAIN_SAMPLES plain steps are still being timed."""
        plain = self.verify_time.get((B, 1))
        return plain is None or len(plain.samples) < PLAIN_SAMPLES

    def plain_due(self, B: int, rounds: int) -> bool:
        """Whether batch size B decodes plainly this round to time its plain step: at first, and
        again once the last timing is REFRESH_ROUNDS rounds old (every S is relative to it)."""
        stale = rounds - self.plain_measured_at.get(B, -REFRESH_ROUNDS - 1) > REFRESH_ROUNDS
        return stale or self.measuring_plain(B)
