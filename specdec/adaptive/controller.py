"""How the controller chooses k for a chain round, and the AdaptiveK object the engine talks to.

Each round the batch drafts one k (a verify pass runs k + 1 tokens for every row as soon as one row
drafts k, and a draft step costs the same for the batch however many rows draft):

    S(k) = mean_b E_b(k) · t_v(B, 1) / (k · t_d(B) + t_v(B, k + 1)),   S(0) = 1 (plain decoding)

with E_b(k) from each sequence's measured acceptance per position and the costs measured at this
batch size (measure.py). A parallel draft (drafters/pard.py) runs one forward for all k drafts, so
k · t_d(B) is t_d(B, k) there: its round's draft time, measured per k (cost_model.round_cost).
The batch drafts the k of the highest estimated S(k) where that beats plain decoding; where it
does not but S at the upper confidence bound of the drafter's acceptance says some k may, it keeps
drafting (``choose_k``). A drafter is given up only once the bound, from the
samples seen, is at or below break-even at every k, so a few unlucky early rounds do not switch off
a drafter that pays; while the bound alone keeps it on, its rounds' cost is paced (pace.py). Once
off, probes (probe.py) bring it back where the text has become easier.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from specdec.adaptive.measure import Acceptance, Costs, Timing, timing
from specdec.adaptive.pace import Pacer
from specdec.adaptive.probe import Prober
from specdec.adaptive.trees import TreeChooser
from specdec.cost_model import mean_expected_tokens, round_cost, speedup
from specdec.tree import DraftTree, TreeShape

EXPIRE_EVERY = 16  # rounds between looks for costs that no longer stand (Costs.expire)
DECIDE_ROUNDS = 6  # rounds an estimate's k stands for the same rows before it is weighed again (``choose``)
COSTS_EVERY = 8  # rounds the round costs a weighing worked out serve the next ones (``speedups``)


def choose_k(estimated: Sequence[float], upper: Sequence[float], hopeful: Sequence[float] | None = None) -> int:
    """The k to draft, from three views of S(0..k_max): ``estimated`` (each sequence's acceptance, the
    measured costs), ``upper`` (the drafter's acceptance at its confidence bound, lengths not yet timed
    at the cost of the longest that was) and ``hopeful`` (the estimated acceptance at those optimistic
    costs; default ``estimated``). The k >= 1 of the highest estimate where that beats plain
    decoding; else, among the k that may still pay at the bound, the one the hopeful view likes best:
    drafting it is how the estimates learn whether it pays (its positions' acceptance, its length's
    cost), where the doubt that keeps speculation on lies; else 0, plain decoding. Ties: the
    smallest k."""
    if len(estimated) < 2:
        return 0
    best = max(range(1, len(estimated)), key=estimated.__getitem__)
    if estimated[best] > 1.0:
        return best
    hopeful = estimated if hopeful is None else hopeful
    may_pay = [k for k in range(1, len(upper)) if upper[k] > 1.0]
    return max(may_pay, key=hopeful.__getitem__) if may_pay else 0


def tokens_per_row(num_draft: list[int], num_accepted: list[int]) -> float:
    """Tokens a round gave each row on average: its accepted drafts and the bonus or recovered one."""
    return sum(1 + min(n, d) for n, d in zip(num_accepted, num_draft)) / len(num_draft)


class AdaptiveK:
    """The adaptive controller of one engine: ``choose`` (or ``choose_tree``) before a round,
    ``record`` (or ``record_tree``) after it, ``release`` when sequences finish."""

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.acceptance = Acceptance()
        self.costs = Costs()
        self.prober = Prober()
        self.pacer = Pacer()
        self.trees = TreeChooser(self.acceptance, self.costs)
        self.rounds = 0  # rounds recorded
        self.last_k = 0  # the previous round's k: a round after plain ones drafts from a lagging draft state
        self._version = 0  # drafting rounds recorded: what the tree decision reads changes with them
        self._recorded_at: float | None = None  # when the last round was reported: rounds' wall times
        self._cpu_at = 0.0  # ... and the process's CPU time then
        self._recorded_ids: list[int] = []  # ... and its rows: a round's wall is timed only after one of its batch
        self.trace: list[tuple] | None = None  # a list: each chain decision appended (``_note``)
        self._held: tuple[list[int], int, int] | None = None  # (rows, k, round): the estimate's k that stands
        self._expired_at = 0  # the round of the last look for costs that no longer stand
        self._pending: list[tuple] = []  # held rounds' records, taken in at the next weighing (``flush``)
        self._costs: tuple | None = None  # (B, round, [t_1, plain token, round cost at k = 1..K]): ``speedups``

    def set_parallel_draft(self, parallel: bool) -> None:
        """The drafter proposes all k drafts from one forward (drafters/pard.py, which says so when bound):
        its cost is timed and charged per round, as a function of k, not per drafted token."""
        self.costs.parallel = parallel

    # -- what the engine, the drafter choice and the demo read -------------------------------------

    @property
    def verify_time(self) -> dict[tuple[int, int], Timing]:
        """(B, T) -> seconds of a chain verify pass of T tokens per row at batch size B."""
        self.flush()
        return self.costs.verify_time

    def verify_line(self, B: int):
        """T -> seconds of a verify pass with T tokens per row at batch size B (measure.fit_line)."""
        self.flush()
        return self.costs.verify_line(B)

    def measuring_plain(self, batch: int) -> bool:
        """Whether this batch size's first plain steps are still being timed. The engine takes them one
        a round, so that speculation starts after PLAIN_SAMPLES + 1 tokens."""
        return self.costs.measuring_plain(batch)

    # -- decisions ---------------------------------------------------------------------------------

    def choose(self, seq_ids: list[int], timed: bool = True) -> list[int]:
        """k per row (one k for the batch): 0 while this batch size's plain step is timed, while
        speculation is off (but for probes) or its learning rounds are paced, else ``choose_k``.
        ``timed``: the engine will time this round (not so right after a prefill, engine.COLD_ROUNDS);
        a round it will not time does not learn (the bound's rounds, probes): what it would teach and
        cost goes unrecorded, and each new request's first rounds drafted unpaced (llama.cpp on
        Xeon-AMX-FP16, nothing paying: 3 rounds a request with the draft's prompt catch-up, 0.91x plain)."""
        B = len(seq_ids)
        if self.costs.plain_due(B, self.rounds):
            return self._note(B, 0, "plain timed", None)  # every S at B is relative to a fresh plain step
        held, self._held = self._held, None
        if (held is not None and held[0] == seq_ids and self.rounds - held[2] < DECIDE_ROUNDS
                and self.rounds - self._expired_at < EXPIRE_EVERY):
            self._held = held  # weighing every k takes ~0.1 ms in a round of a few ms: an estimate stands a few rounds
            return self._note(B, held[1], "held", None)
        self.flush()
        if not self.pacer.granted.issuperset(seq_ids):
            self.pacer.admit(seq_ids, self._plain_token(B))  # a new request's own learning allowance
        if self.rounds - self._expired_at >= EXPIRE_EVERY:
            self._expired_at = self.rounds
            if self.costs.expire(B, self.rounds):
                self.prober.forget(B)  # its probes' cost was timed under the same load: when to probe is weighed again
                self._costs = None
        if self.pacer.waiting(seq_ids):
            return self._note(B, 0, "paced", None)  # plain rounds change no estimate: the decision stands
        was_probe, self.prober.probing = self.prober.probing, False
        estimated = None
        fresh = self.pacer.fresh_s > 0.0  # a later request's own allowance: it learns on its own evidence
        if self.prober.holds_off(B, was_probe) and not fresh:
            best, why = 0, "off"  # plain rounds teach the estimates nothing: the decision waits for a probe
        else:
            alphas = self.acceptance.per_seq(seq_ids, self.k_max)
            estimated = self.speedups(B, alphas, reuse=True)
            if max(estimated[1:]) > 1.0:
                best, why = choose_k(estimated, estimated), "estimate"
            elif not timed:
                return self._note(B, 0, "cold", estimated)  # learning waits for a round the engine times
            else:  # the estimate says no k pays: the bound decides whether to keep learning
                hope = self.costs.optimistic_line(B)
                upper = self.acceptance.upper(self.k_max, seq_ids if fresh else ())
                best, why = choose_k(estimated, self.speedups(B, [upper], hope),
                                     self.speedups(B, alphas, hope)), "bound"
                if best and not self.pacer.allows(self._plain_token(B), seq_ids):
                    return self._note(B, 0, "paced", estimated)
                self.pacer.learning = best > 0
        if best == 0:
            k = self.prober.off(B, was_probe, self.costs, self.k_max) if timed else 0
            return self._note(B, k, "probe" if k else why if why == "off" else "gave up", estimated)
        self.prober.on()
        k = self._refresh(B, best, thin=why == "estimate")
        if why == "estimate":
            self.pacer.paid(seq_ids)
            if k == best:  # it stands a few rounds for these rows
                self._held = (list(seq_ids), k, self.rounds)
        return self._note(B, k, why if k == best else "refresh", estimated)

    def _note(self, B: int, k: int, why: str, estimated: list[float] | None) -> list[int]:
        """[k] * B, and the decision appended to ``trace`` when one is kept: (round, k, why, S(0..k_max))."""
        if self.trace is not None:
            self.trace.append((self.rounds, k, why, estimated))
        return [k] * B

    def _refresh(self, B: int, k: int, thin: bool = False) -> int:
        """k, or a neighbour k ± 1 whose verify pass has gone untimed for REFRESH_ROUNDS rounds: the
        estimate compares k with its neighbours by their costs, and a cost measured under other
        conditions (a loaded machine, a shorter cache) would otherwise never be corrected once its
        k stopped being chosen. Two rounds every REFRESH_ROUNDS per neighbour at most; ``thin`` (the
        estimate chose k): a neighbour timed fewer than SOLID_SAMPLES times every REFRESH_THIN_ROUNDS."""
        for n in (k + 1, k - 1):
            if 1 <= n <= self.k_max and self.costs.stale(B, n + 1, self.rounds, thin):
                self._costs = None  # the next weighing reads what this round times
                return n
        return k

    def _plain_token(self, B: int, t1: float | None = None) -> float:
        """Seconds of a plain token at batch size B: its step (``t1`` where the caller has it) and its
        host work."""
        return (self.costs.verify_line(B)(1) if t1 is None else t1) + self.costs.overhead(B, plain=True)

    def speedups(self, B: int, alphas_per_seq: list[list[float]], line=None, reuse: bool = False) -> list[float]:
        """S(k) for k = 0..k_max at batch size B for sequences whose acceptance is ``alphas_per_seq``,
        with the verify costs of ``line`` (default: the measured ``verify_line``); ``reuse`` (``choose``):
        the round costs worked out by a weighing up to COSTS_EVERY rounds before, where nothing that
        moves them much has happened since (a plain step or a new length timed, a refresh, an expiry)."""
        self.flush()
        K = max([self.k_max] + [len(a) for a in alphas_per_seq])
        tokens = mean_expected_tokens(alphas_per_seq, K)  # E(k), mean over the batch
        cached = self._costs
        if reuse and line is None and cached is not None and cached[0] == B and self.rounds - cached[1] < COSTS_EVERY \
                and len(cached[2]) >= K + 2:
            costs = cached[2]  # the costs move slowly; working them out is most of a weighing's time
        else:
            costs = self._round_costs(B, K, line)
            if line is None:
                self._costs = (B, self.rounds, costs)
        plain = costs[1]
        return [1.0] + [speedup(tokens[k], costs[k + 1], plain) for k in range(1, K + 1)]

    def _round_costs(self, B: int, K: int, line=None) -> list[float]:
        """[t_1, a plain token's wall time, then a round's at k = 1..K] at batch size B, with the verify
        costs of ``line`` (default: the measured ``verify_line``)."""
        line = line or self.costs.verify_line(B)
        t1 = line(1)
        cost = self.costs.draft_cost  # per drafted position; a parallel draft's per round at k
        extra = self.costs.overhead(B, plain=False)  # a round's host work
        return [t1, self._plain_token(B, t1)] + [round_cost(k, cost(B, t1, k), line(k + 1), self.costs.parallel) + extra
                                                 for k in range(1, K + 1)]

    def choose_tree(self, seq_ids: list[int], max_nodes: int, top_k: int, max_depth: int,
                    force: bool = False) -> TreeShape | None:
        """The tree the batch drafts this round, or None: draft a chain (then ``choose`` decides k).

        Call it each round in which the batch may draft a tree (SpeculativeConfig.draft_tree "auto",
        a drafter that can branch, a backend that verifies trees), before ``choose``; one shape for
        every row. ``max_nodes``: draft_tree_max_nodes; ``top_k``: draft_tree_top_k (children per node
        at most); ``max_depth``: num_speculative_tokens. None while this batch size's plain steps are
        timed, and where no tree beats the best chain (trees.py); ``force`` (draft_tree "tree"):
        always a shape, the best one that branches. After the round, report it with ``record_tree``."""
        if not force and self.costs.plain_due(len(seq_ids), self.rounds):
            return None
        B = len(seq_ids)
        return self.trees.choose(seq_ids, max_nodes, top_k, max_depth, force, self._version, self.rounds, self.flush,
                                 lambda alphas: max(self.speedups(B, [alphas])))

    # -- measurements ------------------------------------------------------------------------------

    def record(self, seq_ids: list[int], num_draft: list[int], num_accepted: list[int],
               draft_time_s: float, verify_time_s: float | None, num_steps: int = 1) -> None:
        """Report a round: per row the drafts it verified and how many were accepted; the round's
        drafting time and its verify pass's time (None: the pass did more than verify, it carried a
        new prompt; not timed). A plain round of several steps in one runner call gives the time per
        step and ``num_steps``."""
        self.rounds += 1
        round_wall = self._clock(seq_ids, verify_time_s is not None)  # a pass with a prompt: not timed
        entry = (seq_ids, num_draft, num_accepted, draft_time_s, verify_time_s, num_steps, round_wall, self.rounds,
                 self.last_k)
        self.last_k = max(num_draft)
        if self._held is not None and self.last_k > 0 and verify_time_s is not None:
            self._pending.append(entry)  # a held round's: what it measured is taken in at the next weighing,
            return  # several at once (each round's bookkeeping right after a forward costs ~3x its time warm)
        self.flush()
        self._take_in(*entry)

    def flush(self) -> None:
        """Take in the rounds recorded while a decision was held (``record``)."""
        pending, self._pending = self._pending, []
        for entry in pending:
            self._take_in(*entry)

    def _take_in(self, seq_ids: list[int], num_draft: list[int], num_accepted: list[int], draft_time_s: float,
                 verify_time_s: float | None, num_steps: int, round_wall: tuple[float, float] | None, at: int,
                 last_k: int) -> None:
        """What ``record`` reports, at round ``at`` (``round_wall``: the round's wall and CPU seconds where
        it was timed; ``last_k``: the k of the round before)."""
        B = len(seq_ids)
        k_round = max(num_draft)
        round_s = draft_time_s + (verify_time_s or 0.0) * num_steps
        if round_wall is not None:
            wall, cpu = round_wall
            spent = round_s
            if 0.5 * wall < spent <= 1.05 * wall:  # the round's calls fill its wall time: a real round
                # The share of the round this process ran (1 with one busy thread): on a shared machine
                # a round preempted for half its wall time is timed 2x, and lengths timed in busy and
                # quiet moments cannot be compared. Running several threads, the share is capped at 1.
                share = min(1.0, cpu / wall)
                draft_time_s, verify_time_s, wall, spent = (x * share for x in (draft_time_s, verify_time_s, wall, spent))
                round_s = wall
            outside = wall - spent
            self.costs.record_overhead(B, k_round == 0, outside / num_steps if k_round == 0 else outside)
        excess = None
        if self.pacer.learning and verify_time_s is not None and k_round > 0:  # what learning cost this round
            catch_up = 0.0  # a round after plain ones: the drafter's catch-up is switching on, not learning
            if last_k == 0:
                catch_up = max(0.0, draft_time_s - k_round * self.costs.draft_cost(B, self.costs.verify_line(B)(1), k_round))
            excess = round_s - catch_up - tokens_per_row(num_draft, num_accepted) * self._plain_token(B)
        self.pacer.record(round_s, excess)
        # A plain round right after drafted ones is not timed as the plain step: its first step pays the switch
        # back (the target's threads woken, its graph rebuilt for one token: llama.cpp on Xeon-AMX-FP16, a step
        # 2.82 ms after the draft's against 2.27 after a step), which a plain stretch pays once. Timed, the plain
        # step looked ~40% dearer than plain decoding ran and drafting paid on paper where it lost 5-8%. The
        # plain step stays due (``plain_due``), so the next round, plain again, is timed.
        if verify_time_s is not None and not (k_round == 0 and last_k > 0):
            if k_round == 0:
                self.costs.plain_measured_at[B] = at
                self.prober.record_plain(verify_time_s * num_steps)
            elif self.prober.probing and B == self.prober.off_batch:
                tokens = tokens_per_row(num_draft, num_accepted)
                self.prober.record_probe(B, draft_time_s + verify_time_s - tokens * self.costs.verify_line(B)(1))
            if k_round == 0 or (B, k_round + 1) not in self.costs.verify_time:
                self._costs = None  # a new plain step (every S is relative to it) or a length timed first
            self.costs.record_verify(B, k_round + 1, verify_time_s, at)
        # A round right after plain ones first feeds the drafter everything it missed (a draft model
        # catches up on every token since its last proposal): a cost of switching on, not of drafting.
        # Timed with the rest, a probe after a plain stretch looks far dearer than steady drafting.
        if k_round > 0:
            self._version += 1
            if last_k > 0 and verify_time_s is not None:  # an untimed round may have drafted on a new prompt
                self.costs.record_draft(B, k_round, draft_time_s, at)
        for sid, nd, na in zip(seq_ids, num_draft, num_accepted):
            if nd > 0:
                self.acceptance.record(sid, nd, na, B)

    def record_tree(self, seq_ids: list[int], num_nodes: list[int], num_accepted: list[int],
                    draft_s: float, verify_s: float | None, trees: list[DraftTree | None] | None = None,
                    paths: list[list[int]] | None = None) -> None:
        """Report a tree round (instead of ``record``): per row, the nodes its tree had (0: the row drafted
        nothing) and the nodes on its accepted path (the bonus or recovered token not counted); the
        round's drafting time and its verify pass's time (None: the pass carried a prompt, not timed).

        ``trees`` and ``paths`` (optional, recommended): each row's DraftTree (None: no tree) and its
        accepted node indices, root's child first (verify_tree's ``accepted_nodes``), siblings in the
        drafter's rank order. From them the controller learns what a chain would have accepted (the
        first children's path) and how often a sibling catches what the ranks before it missed."""
        self.flush()
        B = len(seq_ids)
        n_round = max(num_nodes) if num_nodes else 0
        self.rounds += 1
        round_wall = self._clock(seq_ids, verify_s is not None and n_round > 0)
        if round_wall is not None:
            self.costs.record_overhead(B, False, round_wall[0] - draft_s - verify_s)
        self.pacer.record(draft_s + (verify_s or 0.0), None)
        if n_round == 0:
            self.last_k = 0
            return
        self._version += 1
        self.prober.on()  # a chain switched off was decided before these drafts: weigh it anew next time
        if verify_s is not None:
            timing(self.costs.tree_verify_time, (B, n_round + 1)).update(verify_s, self.rounds)
        if self.last_k > 0 and verify_s is not None:  # as in record: a round after plain ones (or a prefill)
            timing(self.costs.tree_draft_time, B).update(draft_s / max(self.trees.depth, 1))  # catches up first
        self.last_k = n_round
        if trees is not None and paths is not None:
            self.trees.learn(seq_ids, trees, paths)
        self.trees.record(num_nodes, num_accepted)

    def _clock(self, seq_ids: list[int], timed: bool) -> tuple[float, float] | None:
        """(wall seconds, this process's CPU seconds) since the last round was reported, where ``timed``
        and this round ran the rows of that one (a new row's first round follows its admission, or an
        idle engine), else None; the clocks are read once (the CPU clock is a system call, ~5 us after
        a forward)."""
        now, cpu = time.perf_counter(), time.process_time()
        same = self._recorded_at is not None and seq_ids == self._recorded_ids
        since = (now - self._recorded_at, cpu - self._cpu_at) if timed and same else None
        self._recorded_at, self._cpu_at, self._recorded_ids = now, cpu, list(seq_ids)
        return since

    def release(self, seq_ids: list[int]) -> None:
        self.flush()
        self.acceptance.release(seq_ids)
        self.pacer.release(seq_ids)
