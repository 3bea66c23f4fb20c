"""Adaptive speculation: each round, the k that the cost model says pays most for the batch.

The cost model (specdec/cost_model.py, docs/algorithm.md) with measured quantities instead of
assumptions:
- acceptance: per sequence and per draft position i, the conditional rate
  alpha_i = P(x_i accepted | x_1..x_{i-1} accepted), from decayed counts, smoothed towards
  the same rates over all sequences;
- E_b(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j  (tokens per round for sequence b, bonus included);
- costs: t_v(B, T), the wall time of a verify pass of T tokens per row at batch size B, and
  t_d(B), the drafter's time per drafted position, both means of their recent timings (Timing);
- S(k) = mean_b E_b(k) * t_v(B, 1) / (k * t_d(B) + t_v(B, k + 1)); S(0) = 1 is plain decoding.
One k for the whole batch: a verify pass runs k + 1 tokens for every row as soon as one row drafts
k, and a draft step costs the same for the batch however many rows draft, so rows that would
draft less only give up expected tokens. The batch drafts k* = argmax S(k), unless S(k*) is
within MIN_GAIN of 1: a predicted gain that small is inside the estimates' noise. Every batch
size first takes plain steps (and again every REFRESH_ROUNDS rounds), so that S is measured
against its real baseline.
When k* = 0 the batch decodes plainly and probes again with a one-token draft after a while,
backing off while the probes keep failing, so a drafter that never helps costs almost nothing;
until the next probe (or another batch size) S is not evaluated again, as plain rounds change
no acceptance estimate (README, llama.cpp backend: what evaluating it every round cost). A probe
costs more than the plain step it replaces (the drafter first catches up on every token since
its last draft, then the verify pass of 2 tokens), and where speculation cannot pay that excess
is all a probe adds; so probes are also spaced by time: the next one waits until the plain
decoding since the last is worth PROBE_BUDGET of the probes' measured excess cost, and none
comes where even drafts that are always accepted could not pay at the measured costs.

Draft trees (``choose_tree`` / ``record_tree``; tree.py, cost_model.py "draft trees"): where the
engine may draft a tree, it first asks for a tree shape. The controller weighs the best tree of N
nodes within D levels for N = 1..max_nodes and D = 1..k, S_tree(N, D) = E_tree(N, D) · t_1 /
(D · c_tree + t_v(B, 1 + N)), against the best chain, S(k) above: E_tree from the chain's acceptance per depth and the share of each miss
that a further sibling catches (cost_model.rank_acceptance), both measured on tree rounds too
(their first children's path is the chain; SIBLING_PRIOR until siblings are seen), scaled by what
tree rounds accepted against what was predicted; c_tree the measured draft time per tree level; t_v(B, T) the verify line through every pass timed at this batch size,
chains' and trees'.
A tree is drafted only where it beats the best chain by TREE_MIN_GAIN: on a flat verify curve (1 + N
tokens cost about one step) and at small batches; on a steep curve or a large batch the chain wins.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from specdec.cost_model import best_k, mean_expected_tokens, rank_acceptance, round_cost, speedup, tree_node_values
from specdec.tree import DraftTree, TreeShape

PRIOR_ALPHA = 0.6  # acceptance assumed before anything is measured
PRIOR_WEIGHT = 4.0  # pseudo-rounds of the batch-wide rates mixed into a sequence's own counts
DECAY = 0.95  # per update: older rounds weigh less, so a sequence's estimate follows its text
PRIOR_VERIFY_SLOPE = 0.07  # v(T) = 1 + slope * (T - 1) until measured (measured curves: README, Speed)
PRIOR_DRAFT_COST = 0.1  # c, one draft step in units of a 1-token target step, until measured
MIN_GAIN = 0.06  # speculate only where the predicted speedup exceeds 1 + MIN_GAIN: a smaller margin
#                  let a marginal drafter flip on and off, slower than plain decoding (README, Drafters)
PROBE_K = 1  # a probe drafts one token: the cheapest measurement of position 1
PROBE_INTERVAL = 8  # rounds; doubles after every probe that does not switch speculation back on
MAX_PROBE_INTERVAL = 128
PROBE_BUDGET = 0.01  # probes may cost at most this share of the plain decoding time between them
PRIOR_PROBE_COST = 1.0  # a probe's excess over plain decoding, in one-token steps, until measured
PLAIN_SAMPLES = 3  # plain steps timed at a batch size before it may speculate: the fastest of one or
#                    two samples is a poor baseline beside the fastest of eight speculative rounds
REFRESH_ROUNDS = 128  # a batch size's plain-step time older than this many rounds is measured again
# draft trees
SIBLING_PRIOR = 0.5  # share of a depth's remaining miss that each further sibling catches, until tree rounds
#                     calibrate it (cost_model.rank_acceptance). Measured: the shipped draft on the target's
#                     greedy output of 12 held-out code prompts catches 0.73 at rank 1, then 0.51, 0.60, 0.32
#                     of what the ranks before missed (ranks 2-4; 96% within the top 4)
TREE_DRAFT_PRIOR = 1.25  # a tree's draft time per level, in chain draft steps, until measured (wider feeds)
TREE_MIN_GAIN = 0.05  # a tree is drafted only where its predicted speedup beats the best chain's by this much
TREE_CALIBRATION_WEIGHT = 4.0  # pseudo-rounds of "as predicted" mixed into the measured tree calibration
TREE_DECIDE_ROUNDS = 8  # rounds a tree decision stands while its inputs change (choose_tree)
FLAT_RATIO = 1.3  # a verify pass of T tokens within this many one-token steps: the backend is flat there


class Timing:
    """A wall-time estimate: the mean of the last ``window`` samples, skipping the first ``skip``
    (the first pass at a new shape also builds its kernels). The mean, not the median or the
    minimum, because throughput is tokens over the sum of round times, and a speculative round's
    time is skewed (most rounds feed the drafter one or two tokens, some a newcomer's prompt)."""

    def __init__(self, window: int = 16, skip: int = 1):
        self.samples: deque[float] = deque(maxlen=window)
        self.skip = skip
        self.value: float | None = None  # the mean, kept current: the controller reads it ~10 times a round

    def update(self, x: float) -> None:
        if self.skip > 0:
            self.skip -= 1
        else:
            self.samples.append(x)
            self.value = statistics.fmean(self.samples)


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
        """Conditional acceptance alpha_1..alpha_k: alpha_1 smoothed towards ``prior[0]``, each later
        one towards the estimate before it. A position the sequence has not reached lately (its
        counts decay) thus follows the one before, instead of staying at an old low value that no
        round would ever correct once k had dropped below it."""
        out = []
        for i in range(k):
            r = self.reached[i] if i < len(self.reached) else 0.0
            a = self.accepted[i] if i < len(self.accepted) else 0.0
            toward = prior[0] if i == 0 else out[-1]
            out.append((a + weight * toward) / (r + weight))
        return out


class AdaptiveK:
    def __init__(self, k_max: int):
        self.k_max = k_max
        self.batch_stats = PositionStats()
        self.verify_time: dict[tuple[int, int], Timing] = {}  # (B, T) -> seconds per verify pass
        self.draft_time: dict[int, Timing] = {}  # B -> seconds per drafted position
        self.seqs: dict[int, PositionStats] = {}
        self.rounds = 0  # rounds recorded
        self.plain_measured_at: dict[int, int] = {}  # B -> the round its plain step was last timed
        self.off_rounds = 0  # rounds decoded plainly since speculation was switched off
        self.probe_interval = PROBE_INTERVAL
        self.probing = False
        self.off_batch = 0  # the batch size speculation was last switched off at
        self.since_probe_rounds = 0  # plain rounds since the last probe (or since speculation went off)
        self.since_probe_s = 0.0  # seconds of plain decoding since then
        self.probe_cost: dict[int, Timing] = {}  # B -> a probe's seconds beyond the plain steps it replaces
        self.probe_wait_s: float | None = None  # plain seconds between probes (None: to be worked out)
        self.last_k = 0  # the previous round's k: a round after plain ones drafts from a lagging draft state
        # draft trees
        self.tree_verify_time: dict[tuple[int, int], Timing] = {}  # (B, 1 + N) -> seconds per tree verify pass
        self.tree_draft_time: dict[int, Timing] = {}  # B -> seconds per tree level drafted
        self.tree_tokens: dict[int, Timing] = {}  # N -> tokens per row per tree pass (1 + accepted path)
        self.tree_observed = 0.0  # decayed accepted tree nodes, over the rows of tree rounds
        self.tree_predicted = 0.0  # decayed accepted nodes the prior predicted for the same rows
        self.tree_rows = 0.0  # decayed rows of tree rounds
        self.sibling_tried = 0.0  # decayed siblings tried after a first child missed (record_tree's trees)
        self.sibling_caught = 0.0  # and those that caught the token
        self._tree_prior: list[float] = []  # E_tree(0..max_nodes) before calibration, from the last choose_tree
        self._tree_depth = 1  # depth of the tree shape the last choose_tree returned
        self._version = 0  # drafting rounds recorded: what the tree decision reads changes with them
        self._tree_key: tuple | None = None  # the last tree decision: its arguments, inputs' version, round
        self._tree_version = self._tree_round = -1
        self._tree_shape: TreeShape | None = None

    # -- decisions --------------------------------------------------------------------------------

    def choose(self, seq_ids: list[int]) -> list[int]:
        B = len(seq_ids)
        stale = self.rounds - self.plain_measured_at.get(B, -REFRESH_ROUNDS - 1) > REFRESH_ROUNDS
        if self.measuring_plain(B) or stale:
            return [0] * B  # every speedup at this batch size is relative to a fresh plain step of it
        was_probe, self.probing = self.probing, False
        if self.off_rounds and not was_probe and B == self.off_batch:
            best = 0  # off: plain rounds teach the estimates nothing, so the decision waits for a probe
        else:
            prior = self._batch_alphas()
            alphas = [self.seqs.setdefault(sid, PositionStats()).alphas(self.k_max, prior, PRIOR_WEIGHT)
                      for sid in seq_ids]
            best = best_k(self._speedups(B, alphas), MIN_GAIN)  # from S(0..k_max)
        if best == 0:
            if was_probe:  # the probe did not switch speculation back on: wait longer next time
                self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
            if not self.off_rounds:
                self.since_probe_rounds, self.since_probe_s = 0, 0.0
            if not self.off_rounds or B != self.off_batch:
                self.probe_wait_s = None  # a probe's cost depends on the batch size
            self.off_rounds += 1
            self.off_batch = B
            self.since_probe_rounds += 1
            if self.probe_due(B):
                best, self.probing = min(PROBE_K, self.k_max), True
                self.since_probe_rounds, self.since_probe_s, self.probe_wait_s = 0, 0.0, None
        else:
            self.off_rounds, self.probe_interval = 0, PROBE_INTERVAL
        return [best] * B

    def probe_due(self, B: int) -> bool:
        """Whether speculation, off at batch size B, probes this round: after ``probe_interval`` plain
        rounds (doubling while probes fail), once the plain decoding since the last probe took
        1 / PROBE_BUDGET times a probe's measured excess cost (so probes cost at most that share of
        the time), and only where some acceptance could pay (``can_ever_pay``)."""
        if self.since_probe_rounds < self.probe_interval:
            return False
        if self.probe_wait_s is None:  # once per wait: off rounds stay cheap (README, the controller's own cost)
            em = self.probe_cost.get(B)
            cost = em.value if em is not None and em.value is not None else PRIOR_PROBE_COST * self.verify_line(B)(1)
            self.probe_wait_s = cost / PROBE_BUDGET if self.can_ever_pay(B) else float("inf")
        return self.since_probe_s >= self.probe_wait_s

    def can_ever_pay(self, B: int) -> bool:
        """Whether drafts accepted every time would reach 1 + MIN_GAIN at batch size B with the measured
        verify line and draft cost: S(k) = (k + 1) · t_1 / (k · c + t_v(k + 1)) for some k. If not, no
        acceptance can make speculation pay here and probing only costs."""
        line = self.verify_line(B)
        t1 = line(1)
        c = self._draft_cost(B, t1)
        return any(speedup(k + 1.0, round_cost(k, c, line(k + 1)), t1) >= 1.0 + MIN_GAIN
                   for k in range(1, self.k_max + 1))

    def choose_tree(self, seq_ids: list[int], max_nodes: int, top_k: int, max_depth: int,
                    force: bool = False) -> TreeShape | None:
        """The tree the batch drafts this round, or None: draft a chain (then ``choose`` decides k).

        Call it each round in which the batch may draft a tree (SpeculativeConfig.draft_tree "auto",
        a drafter that can branch, a backend that verifies trees), before ``choose``; one shape for
        every row. ``max_nodes``: draft_tree_max_nodes; ``top_k``: draft_tree_top_k (children per node
        at most); ``max_depth``: num_speculative_tokens. The shape has the node count N and depth D of
        the highest predicted S_tree(N, D) (module docstring) and the most children per node of that
        best tree under this model; the drafter builds its tree within it (EAGLE-2's expansion by
        cumulative draft probability). None unless that tree beats the best chain by TREE_MIN_GAIN
        and plain decoding by MIN_GAIN, and while this batch size's plain steps are being timed or
        refreshed (``choose`` returns zeros then). ``force`` (draft_tree "tree"): always a shape, the
        best one that branches (a chain only when top_k or max_nodes allow no branching).
        After the round, report it with ``record_tree``. The decision is worked out again only when
        the batch size or the arguments change, or a drafting round has been recorded since and
        TREE_DECIDE_ROUNDS rounds have passed: weighing every tree size takes ~0.1 ms, 1% of a torch
        step, and plain rounds (speculation off) change no estimate it reads but the plain step."""
        B = len(seq_ids)
        if not force:
            stale = self.rounds - self.plain_measured_at.get(B, -REFRESH_ROUNDS - 1) > REFRESH_ROUNDS
            if self.measuring_plain(B) or stale:
                return None
        key = (B, max_nodes, top_k, max_depth, force)
        if key == self._tree_key and (self._tree_version == self._version
                                      or self.rounds - self._tree_round < TREE_DECIDE_ROUNDS):
            return self._tree_shape
        self._tree_key, self._tree_version, self._tree_round = key, self._version, self.rounds
        self._tree_shape = self._decide_tree(seq_ids, max_nodes, top_k, max_depth, force)
        return self._tree_shape

    def _decide_tree(self, seq_ids: list[int], max_nodes: int, top_k: int, max_depth: int,
                     force: bool) -> TreeShape | None:
        B = len(seq_ids)
        max_nodes, top_k, max_depth = max(1, max_nodes), max(1, top_k), max(1, max_depth)
        alphas = self._mean_alphas(seq_ids, max_depth)
        sibling = self.sibling_rate()
        rank_probs = [rank_acceptance(a, top_k, sibling) for a in alphas]
        line = self.tree_verify_line(B)
        t1 = line(1)
        c = self._tree_draft_cost(B, t1)
        r = self.tree_calibration()
        best = None  # (S, N, depth, width, prior curve)
        for limit in range(1, max_depth + 1):  # each depth costs a draft level: weigh them all
            nodes = tree_node_values(rank_probs[:limit], max_nodes, top_k)  # (value, depth, rank), best first
            prior, depth, width = [1.0], 0, 0
            for v, d, j in nodes:
                prior.append(prior[-1] + v)
                depth, width = max(depth, d), max(width, j)
                if force and width < 2 and len(nodes) > 1 and any(jj >= 2 for _, _, jj in nodes):
                    continue  # force: a tree that branches, where one can
                n = len(prior) - 1
                S = speedup(1.0 + r * (prior[n] - 1.0), depth * c + line(n + 1), t1)
                if best is None or S > best[0] * (1 + 1e-9):
                    best = (S, n, depth, width, prior)
        S, n, depth, width, prior = best
        self._tree_prior = prior
        shape = TreeShape(n, max(depth, 1), max(width, 1))
        if not force:
            if width < 2:
                return None  # the best "tree" is a chain: choose() sizes it from its own measurements
            best_chain = max(self._speedups(B, [alphas]))
            if S < max(best_chain * (1.0 + TREE_MIN_GAIN), 1.0 + MIN_GAIN):
                return None
        self._tree_depth = shape.max_depth
        return shape

    def tree_tokens_curve(self, prior: list[float]) -> list[float]:
        """E_tree(N) as predicted (``prior``, cost_model.tree_expected_tokens) scaled by what tree rounds
        accepted against what was predicted for them: 1 + r · (E - 1), r = observed / predicted
        accepted nodes (decayed), pulled towards 1 by TREE_CALIBRATION_WEIGHT pseudo-rounds."""
        r = self.tree_calibration()
        return [1.0 + r * (e - 1.0) for e in prior]

    def tree_calibration(self) -> float:
        """Accepted tree nodes measured over those predicted (1.0 before any tree round)."""
        w = TREE_CALIBRATION_WEIGHT * (self.tree_predicted / self.tree_rows if self.tree_rows else 1.0)
        return (self.tree_observed + w) / (self.tree_predicted + w)

    def verify_ratio(self, batch: int, num_tokens: int) -> float | None:
        """t_v(B, T) / t_v(B, 1) from the verify passes measured at batch size B (chains' and trees'), or
        None before two lengths are measured there: how many one-token steps a pass of T tokens per
        row costs. Cheap (a least-squares line over the lengths measured)."""
        known = {t for (b, t), em in list(self.verify_time.items()) + list(self.tree_verify_time.items())
                 if b == batch and em.value is not None}
        if len(known) < 2:
            return None
        line = self.tree_verify_line(batch)
        return line(num_tokens) / line(1)

    def is_flat(self, batch: int, num_tokens: int, max_ratio: float = FLAT_RATIO) -> bool | None:
        """Whether a verify pass of ``num_tokens`` per row costs at most ``max_ratio`` one-token steps at
        this batch size (where trees can pay); None before it is measured (``verify_ratio``)."""
        r = self.verify_ratio(batch, num_tokens)
        return None if r is None else r <= max_ratio

    def tree_verify_line(self, B: int):
        """T -> seconds of a verify pass of T tokens per row at batch size B: the least-squares line
        through every length measured there, chain passes and tree passes alike (a tree of N nodes
        is a pass of 1 + N tokens), never below the plain step; the chain's prior slope before two
        lengths are known."""
        points: dict[int, float] = {}
        for table in (self.verify_time, self.tree_verify_time):
            for (b, t), em in table.items():
                if b == B and em.value is not None:
                    points[t] = em.value if t not in points else (points[t] + em.value) / 2
        return _line(sorted(points.items()))

    def _mean_alphas(self, seq_ids: list[int], depth: int) -> list[float]:
        """The batch's conditional acceptance per depth: each sequence's estimate, averaged per position
        (one tree shape serves the batch)."""
        prior = self._batch_alphas()
        prior = prior + [prior[-1]] * (depth - len(prior)) if prior else [PRIOR_ALPHA] * depth
        rows = [self.seqs.setdefault(sid, PositionStats()).alphas(depth, prior, PRIOR_WEIGHT) for sid in seq_ids]
        if not rows:
            return prior[:depth]
        return [sum(col) / len(rows) for col in zip(*rows)]

    def _tree_draft_cost(self, B: int, t1: float) -> float:
        e = self.tree_draft_time.get(B)
        if e is None or e.value is None:
            return TREE_DRAFT_PRIOR * self._draft_cost(B, t1)
        return e.value

    def measuring_plain(self, batch: int) -> bool:
        """Whether this batch size's first plain steps are still being timed. The engine takes them one
        a round, so that speculation starts after PLAIN_SAMPLES + 1 tokens (a refresh of a stale
        timing may take several steps a round)."""
        plain = self.verify_time.get((batch, 1))
        return plain is None or len(plain.samples) < PLAIN_SAMPLES

    def predicted_speedup(self, batch: int, k: int, alphas: list[float] | None = None) -> float:
        """S(k) at this batch size for sequences whose conditional acceptance is ``alphas``."""
        return self._speedups(batch, [alphas if alphas is not None else self._batch_alphas()])[k]

    def _speedups(self, B: int, alphas_per_seq: list[list[float]]) -> list[float]:
        """S(k) for k = 0..k_max (the longest list of alphas given), the costs computed once."""
        K = max([self.k_max] + [len(a) for a in alphas_per_seq])
        tokens = mean_expected_tokens(alphas_per_seq, K)  # E(k), mean over the batch
        line = self.verify_line(B)
        t1 = line(1)
        c = self._draft_cost(B, t1)
        return [1.0] + [speedup(tokens[k], round_cost(k, c, line(k + 1)), t1) for k in range(1, K + 1)]

    def _batch_alphas(self) -> list[float]:
        prior = [PRIOR_ALPHA] * self.k_max
        alphas = self.batch_stats.alphas(self.k_max, prior, 1.0)
        # positions never reached keep the last measured rate, not the optimistic prior
        for i in range(1, self.k_max):
            if i >= len(self.batch_stats.reached) or self.batch_stats.reached[i] < 1e-3:
                alphas[i] = alphas[i - 1]
        return alphas

    def verify_line(self, B: int):
        """T -> seconds of a verify pass with T tokens per row. T = 1: the measured plain step. T > 1:
        the least-squares line through the lengths measured at this batch size (single timings
        are noisy enough to make k = 3 look cheaper than k = 2), never below the plain step; with
        one length measured, the prior slope from it."""
        return _line(sorted((t, em.value) for (b, t), em in self.verify_time.items() if b == B and em.value is not None))

    def _draft_cost(self, B: int, t1: float) -> float:
        e = self.draft_time.get(B)
        if e is None or e.value is None:
            return PRIOR_DRAFT_COST * t1
        return e.value

    # -- measurements -----------------------------------------------------------------------------

    def record(self, seq_ids: list[int], num_draft: list[int], num_accepted: list[int],
               draft_time_s: float, verify_time_s: float | None, num_steps: int = 1) -> None:
        """Report a round: per row the drafts it verified and how many were accepted; the round's
        drafting time and its verify pass's time (None: the pass did more than verify, it carried a
        new prompt; not timed). A plain round of several steps in one runner call
        (Engine._plain_round) gives the time per step and ``num_steps``."""
        B = len(seq_ids)
        k_round = max(num_draft)
        self.rounds += 1
        if verify_time_s is not None:
            if k_round == 0:
                self.plain_measured_at[B] = self.rounds
                self.since_probe_s += verify_time_s * num_steps
            elif self.probing and B == self.off_batch:  # what the probe cost beyond the plain steps it replaced
                t1 = self.verify_line(B)(1)
                tokens = sum(1 + min(n, d) for n, d in zip(num_accepted, num_draft)) / B
                self.probe_cost.setdefault(B, Timing(window=8, skip=0)).update(
                    max(draft_time_s + verify_time_s - tokens * t1, 0.0))
            self.verify_time.setdefault((B, k_round + 1), Timing()).update(verify_time_s)
        # A round right after plain ones first feeds the drafter everything it missed (a draft model
        # catches up on every token since its last proposal): a cost of switching on, not of drafting.
        # Timed with the rest, a probe after a plain stretch looks far dearer than steady drafting
        # and keeps speculation off where it pays.
        if k_round > 0:
            self._version += 1
        if k_round > 0 and self.last_k > 0:
            self.draft_time.setdefault(B, Timing()).update(draft_time_s / k_round)
        self.last_k = k_round
        for sid, nd, na in zip(seq_ids, num_draft, num_accepted):
            if nd == 0:
                continue
            self.seqs.setdefault(sid, PositionStats()).update(nd, na, DECAY)
            self.batch_stats.update(nd, na, DECAY ** (1.0 / max(B, 1)))

    def record_tree(self, seq_ids: list[int], num_nodes: list[int], num_accepted: list[int],
                    draft_s: float, verify_s: float | None, trees: list[DraftTree | None] | None = None,
                    paths: list[list[int]] | None = None) -> None:
        """Report a tree round (instead of ``record``): per row, the nodes its tree had (0: the row drafted
        nothing) and the nodes on its accepted path (the bonus or recovered token not counted); the
        round's drafting time and its verify pass's time (None: the pass carried a prompt, not
        timed). Records the pass's time at 1 + max(num_nodes) tokens, the draft time per level of
        the shape the last ``choose_tree`` returned, tokens per pass per node count, and what the rows
        accepted against the prediction (``tree_calibration``).

        ``trees`` and ``paths`` (optional, recommended): each row's DraftTree (None: no tree) and its
        accepted node indices, root's child first (verify_tree's ``accepted_nodes``), siblings in
        the drafter's rank order (node order). From them the controller learns what a chain would
        have accepted (the first children's path: the chain's per-position acceptance keeps
        being measured while trees run) and how often a sibling catches what the ranks before it
        missed (``sibling_rate``), instead of the prior."""
        B = len(seq_ids)
        n_round = max(num_nodes) if num_nodes else 0
        self.rounds += 1
        if n_round == 0:
            self.last_k = 0
            return
        self._version += 1
        self.off_rounds = 0  # a chain switched off was decided before these drafts: weigh it anew next time
        if verify_s is not None:
            self.tree_verify_time.setdefault((B, n_round + 1), Timing()).update(verify_s)
        if self.last_k > 0:  # as in record: a round after plain ones catches the drafter up first
            self.tree_draft_time.setdefault(B, Timing()).update(draft_s / max(self._tree_depth, 1))
        self.last_k = n_round
        if trees is not None and paths is not None:
            self._learn_from_trees(seq_ids, trees, paths)
        prior = self._tree_prior
        d = DECAY ** (1.0 / max(B, 1))
        for n, a in zip(num_nodes, num_accepted):
            if n == 0:
                continue
            self.tree_tokens.setdefault(n, Timing(window=64, skip=0)).update(1.0 + a)
            if n < len(prior):
                self.tree_observed = d * self.tree_observed + a
                self.tree_predicted = d * self.tree_predicted + (prior[n] - 1.0)
                self.tree_rows = d * self.tree_rows + 1.0

    def _learn_from_trees(self, seq_ids: list[int], trees: list[DraftTree | None], paths: list[list[int]]) -> None:
        """Per row: the chain of first children, as a chain round (``record``) would have counted it, and
        at each node of the accepted path whose first child missed, the siblings tried after it
        (ranks 2.. until the accepted one, or all of them) and whether one caught the token."""
        B = len(seq_ids)
        decay = DECAY ** (1.0 / max(B, 1))
        for sid, tree, path in zip(seq_ids, trees, paths):
            if tree is None or tree.num_nodes == 0:
                continue
            kids: dict[int, list[int]] = {}
            for i, p in enumerate(tree.parents):
                kids.setdefault(p, []).append(i)
            top, node = 0, -1  # the first children's chain: its length, and how much of it was accepted
            while node in kids:
                node = kids[node][0]
                top += 1
            lead = 0
            while lead < len(path) and kids.get(tree.parents[path[lead]], [None])[0] == path[lead]:
                lead += 1
            self.seqs.setdefault(sid, PositionStats()).update(top, lead, DECAY)
            self.batch_stats.update(top, lead, decay)
            node = -1
            for depth in range(len(path) + 1):
                children = kids.get(node)
                if not children:
                    break
                nxt = path[depth] if depth < len(path) else None
                if nxt != children[0]:  # the first child missed: its siblings were tried in rank order
                    caught = nxt is not None and nxt in children
                    tried = children.index(nxt) if caught else len(children) - 1
                    self.sibling_tried = self.sibling_tried * decay + tried
                    self.sibling_caught = self.sibling_caught * decay + (1.0 if caught else 0.0)
                if nxt is None:
                    break
                node = nxt

    def sibling_rate(self) -> float:
        """The share of the remaining miss each further sibling catches: measured from tree rounds
        (``record_tree`` with trees and paths), smoothed towards SIBLING_PRIOR."""
        w = TREE_CALIBRATION_WEIGHT
        return (self.sibling_caught + w * SIBLING_PRIOR) / (self.sibling_tried + w)

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.seqs.pop(sid, None)


def _line(known: list[tuple[int, float]]):
    """T -> seconds through measured (T, seconds) points, sorted by T (see ``AdaptiveK.verify_line``)."""
    if not known:
        return lambda T: 1.0 + PRIOR_VERIFY_SLOPE * (T - 1)  # unitless prior; only ratios matter
    plain = known[0][1] if known[0][0] == 1 else None
    if len(known) == 1:
        t0, v0 = known[0]
        scale = v0 / (1.0 + PRIOR_VERIFY_SLOPE * (t0 - 1))
        return lambda T: scale * (1.0 + PRIOR_VERIFY_SLOPE * (T - 1))
    n = len(known)
    mt = sum(t for t, _ in known) / n
    mv = sum(v for _, v in known) / n
    slope = sum((t - mt) * (v - mv) for t, v in known) / sum((t - mt) ** 2 for t, _ in known)
    floor = plain or 0.0
    return lambda T: plain if T == 1 and plain is not None else max(mv + slope * (T - mt), floor)
