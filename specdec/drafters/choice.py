"""Several methods (``"method": ["suffix", "draft_model", "ngram"]``): each round, each sequence drafts
with the method whose measured acceptance and cost give the most expected tokens per unit of time.

Acceptance depends on the text: suffix decoding wins on code and repeated answers, a draft model on
prose, nothing on random text. One method per server leaves the rest on the table; this drafter
keeps one drafter per method and picks per request and round, with the controller's cost model
(specdec/cost_model.py, docs/algorithm.md).

Measured, per method:
- acceptance: conditional per-position rates alpha_i per sequence from decayed counts
  (adaptive.PositionStats), smoothed towards the method's rates over all sequences, which start at
  adaptive.PRIOR_ALPHA;
- cost: the wall time of its own propose calls, per drafted position for a model when it also
  drafted the round before, per call for a lookup and for a parallel draft (drafters/pard.py: one
  forward drafts all k, ``cost_model.round_cost``); and for a model, what a call after a pause costs
  beyond that (it first catches up on the tokens it missed), charged when it is switched on; in the
  seconds of the controller's measured verify passes (AdaptiveK, handed over by ``bind``). With no controller, or before a verify pass is timed at this batch size, the
  priors of adaptive.py (verify slope, c = PRIOR_DRAFT_COST for a model, 0 for a lookup).

The choice. Lookups (ngram, suffix) run no model, so they propose for every row first and what they
found counts: a lookup that finds nothing offers nothing, one that finds n tokens offers E(n) from
its rates. A model method offers E(k) for the k the scheduler asked. A model's cost is the batch's:
it runs over every row once one row needs it. So for each set of model methods that could run
(2^models sets, usually 2 or 4), each row takes its best offer among that set and the lookups, and
the set with the highest S = mean_b E_b * t_1 / (lookups + sum_m k_m * c_m + v(T)) wins
(``cost_model.speedup``, ``round_cost``). At batch 1 that is the request's own best tokens per time.

Exploration is optimism for what a request has measured little: each alpha_i is raised by
EXPLORE * sqrt(alpha_i (1 - alpha_i) / (1 + n_i)), n_i the request's own decayed count of rounds
that reached position i with that method, which fades further (DECAY per round) while the method
does not draft for it. A request thus tries each method early unless its rates over all sequences
rule it out even optimistically (a model's cost counts: trying it for one row runs it for the
batch), and re-checks the others as its own evidence about them fades, so a request whose text
shifts finds the method that now pays.

Seeded sampled requests draft only with the listed lookups (their one-hot drafts race plain
decoding's own draws, verify._exact_match, so the output is the seed's plain output whatever the
batch and the timings); with no lookup listed, only with the first method listed. Timings must not
steer a seeded request's random draws, as the scheduler keeps their k fixed for the same reason
(the seeds rule, ``policy.seeded_members``).

Sub-drafters that do not draft a row still see it: a model is called with num_draft 0 for the rows
that are not its own and catches up on them (and on rounds it skipped) the next time it runs; a
lookup reconciles its index with the history (drafters.base.grew_from).

Trees (``propose_tree``): the methods are chosen as for chains of each shape's depth; a chosen method
that branches (suffix, draft_model, eagle3) then drafts its rows' trees, the others their chains.
Acceptance is recorded per position of the tree's depth, as a chain's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from itertools import combinations

from specdec.adaptive import DECAY, PositionStats, Timing
from specdec.policy import PRIOR_ALPHA, PRIOR_DRAFT_COST, PRIOR_VERIFY_SLOPE, PRIOR_WEIGHT
from specdec.cost_model import draft_passes, expected_tokens, round_cost, speedup
from specdec.drafters.base import DraftProposal, Drafter, KvUse, chains_as_trees
from specdec.drafters.merge import merge_proposals
from specdec.metrics import NO_DRAFT
from specdec.policy import LOOKUP_METHODS, is_seeded, seeded_members
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.tree import DraftTree, TreeShape

EXPLORE = 1.0  # optimism: standard errors of a request's own acceptance estimate added to it


def member_config(spec, method: str):
    """The SpeculativeConfig of one member of a method list: ``spec`` with that method, and
    parallel_drafting only on the draft_model member (a lookup or a head does not draft in parallel)."""
    from dataclasses import replace

    return replace(spec, method=method, parallel_drafting=spec.parallel_drafting and method == "draft_model")


@dataclass
class MethodState:
    """What is measured about one method over all sequences."""

    drafter: Drafter
    lookup: bool
    stats: PositionStats = field(default_factory=PositionStats)  # acceptance over all sequences
    time: dict[int, Timing] = field(default_factory=dict)  # B -> seconds per drafted position (lookup, parallel: per call)
    switch_on: dict[int, Timing] = field(default_factory=dict)  # B -> a model's extra seconds after a pause
    ran_last: bool = False  # drafted the previous round too (a model's timing then holds no catch-up)
    parallel: bool = False  # one forward drafts all k (a parallel draft): timed and charged per call


@dataclass
class RequestState:
    """What is measured about one sequence."""

    stats: dict[str, PositionStats] = field(default_factory=dict)  # method -> its acceptance here
    last_served: dict[str, int] = field(default_factory=dict)  # method -> the round it last drafted this sequence
    rounds: int = 0  # rounds some method drafted this sequence (the clock its evidence fades by)


@dataclass
class Offer:
    tokens: float  # E: expected tokens of the round for this row (bonus included), optimistic (EXPLORE)
    length: int  # drafts it would propose


class ChoosingDrafter(Drafter):
    def __init__(self, drafters: dict[str, Drafter]):
        if len(drafters) < 2:
            raise ValueError(f"ChoosingDrafter picks among several methods; got {list(drafters)}")
        self.methods = list(drafters)
        self.method = ",".join(self.methods)
        self.parts = {m: MethodState(d, m in LOOKUP_METHODS, parallel=getattr(d, "parallel_drafting", False))
                      for m, d in drafters.items()}
        self.lookups = [m for m in self.methods if m in LOOKUP_METHODS]
        self.models = [m for m in self.methods if m not in LOOKUP_METHODS]
        self.seeded = seeded_members(self.methods)  # the methods a seeded sampled row may draft with
        self.controller = None  # AdaptiveK: measured verify-pass times
        self.requests: dict[int, RequestState] = {}
        self.rounds_per_method = {m: 0 for m in self.methods}  # (sequence, round) pairs each method drafted
        self._last: dict[int, tuple[str, int]] = {}  # seq_id -> (method, drafts) of the last proposal
        self._priors: dict[tuple[str, int], list[float]] = {}  # _method_alphas of the current round
        self.tree_sources: list[str] | None = None  # [B] the method that drafted each row of the last propose_tree

    # -- the Drafter interface --------------------------------------------------------------------

    def propose(self, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        B = len(seqs)
        parts, chosen = self._choose_rows(seqs, num_draft, sb)

        # 4. the chosen models draft their own rows (num_draft 0 for the others)
        for m in self.models:
            want = [w if c == m else 0 for c, w in zip(chosen, num_draft)]
            if any(want):
                parts[m] = self._timed(m, seqs, want, sb, B)
            else:
                self.parts[m].ran_last = False
        parts[NO_DRAFT] = DraftProposal.from_rows([[]] * B, sb.device)
        owner = [c if c is not None else NO_DRAFT for c in chosen]
        proposal = merge_proposals(parts, owner, sb.device)
        self._record(seqs, chosen, proposal.num_draft_tokens)
        return proposal

    @property
    def can_draft_trees(self) -> bool:
        return any(part.drafter.can_draft_trees for part in self.parts.values())

    def propose_tree(self, seqs: list[Sequence], shapes: list[TreeShape | None], sb: SamplingBatch) -> list[DraftTree | None]:
        """Each row's method chosen as for chains of its shape's depth; then each method that can branch
        drafts trees for its rows (a lookup's found chain is replaced by its tree), the others their chains."""
        B = len(seqs)
        num_draft = [0 if s is None else s.max_depth for s in shapes]
        parts, chosen = self._choose_rows(seqs, num_draft, sb)
        trees: list[DraftTree | None] = [None] * B
        for m in self.methods:
            mine = [s if c == m else None for c, s in zip(chosen, shapes)]
            part = self.parts[m]
            if not any(x is not None for x in mine):
                if not part.lookup:
                    part.ran_last = False
                continue
            if part.drafter.can_draft_trees:
                t0 = time.perf_counter()
                got = part.drafter.propose_tree(seqs, mine, sb)
                if not part.lookup:
                    self._time_model(m, time.perf_counter() - t0, max(x.max_depth for x in mine if x is not None), B)
            elif part.lookup:  # its chains are drafted already
                proposal = parts[m]
                rows = proposal.draft_token_ids.tolist()
                got = [DraftTree.chain(rows[b][: proposal.num_draft_tokens[b]]) if x is not None
                       and proposal.num_draft_tokens[b] else None for b, x in enumerate(mine)]
            else:
                t0 = time.perf_counter()
                got = chains_as_trees(part.drafter, seqs, mine, sb)
                self._time_model(m, time.perf_counter() - t0, max(x.max_depth for x in mine if x is not None), B)
            for b, x in enumerate(mine):
                if x is not None:
                    trees[b] = got[b]
        self._record(seqs, chosen, [0 if t is None else max(t.depths()) for t in trees])
        self.tree_sources = [c if c is not None else NO_DRAFT for c in chosen]
        return trees

    def _choose_rows(self, seqs: list[Sequence], num_draft: list[int],
                     sb: SamplingBatch) -> tuple[dict[str, DraftProposal], list[str | None]]:
        """Steps 1-3 of a round: the lookups' proposals and each row's method (None: no draft)."""
        B = len(seqs)
        # 1. the lookups draft for every row: what each finds is known before choosing
        parts: dict[str, DraftProposal] = {}
        for m in self.lookups:
            parts[m] = self._timed(m, seqs, num_draft, sb, B)

        # 2. what each method offers each row (a seeded request without lookups: the first method, always)
        line, t1, costs, switch = self._costs(B)
        self._priors = {}  # (method, k) -> its rates over all sequences, this round
        offers: list[dict[str, Offer]] = []
        forced: list[str | None] = []
        for b, (s, want) in enumerate(zip(seqs, num_draft)):
            req = self.requests.setdefault(s.seq_id, RequestState())
            offers.append(self._offers(b, s, want, req, parts) if want > 0 else {})
            fixed = is_seeded(s.params) and not self.lookups  # whatever it costs: its draws must not follow timings
            forced.append(self.seeded[0] if fixed and offers[-1] else None)

        # 3. the set of model methods to run, and each row's method under it
        return parts, self._choose(offers, forced, line, t1, costs, switch, B)

    def _record(self, seqs: list[Sequence], chosen: list[str | None], drafted: list[int]) -> None:
        """Step 5, bookkeeping: what each row drafted with (``drafted``: its drafts, a tree's depth), for observe."""
        self._last = {}
        for s, m, n in zip(seqs, chosen, drafted):
            if m is None:
                continue
            req = self.requests[s.seq_id]
            req.last_served[m] = req.rounds
            req.rounds += 1
            if n:
                self._last[s.seq_id] = (m, n)
                self.rounds_per_method[m] += 1

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        B = len(seqs)
        for s, a in zip(seqs, num_accepted):
            got = self._last.get(s.seq_id)
            if got is None:
                continue
            m, n = got
            req = self.requests.setdefault(s.seq_id, RequestState())
            req.stats.setdefault(m, PositionStats()).update(n, a, DECAY)
            self.parts[m].stats.update(n, a, DECAY ** (1.0 / max(B, 1)))
        self._last = {}
        for part in self.parts.values():
            part.drafter.observe(seqs, num_accepted)

    def release(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.requests.pop(s.seq_id, None)
            self._last.pop(s.seq_id, None)
        for part in self.parts.values():
            part.drafter.release(seqs)

    def bound_caches(self, target_positions: int | None) -> None:
        for part in self.parts.values():
            part.drafter.bound_caches(target_positions)

    def release_memory(self) -> None:
        for part in self.parts.values():
            part.drafter.release_memory()
            part.ran_last = False

    def bind(self, controller) -> None:
        self.controller = controller
        for part in self.parts.values():
            part.drafter.bind(controller)
        if controller is not None:  # rounds mix members: each member's cost shape is weighed here (_choose)
            controller.set_parallel_draft(False)

    def kv_use(self, k: int, tree: TreeShape | None = None) -> list[KvUse]:
        return [use for part in self.parts.values() for use in part.drafter.kv_use(k, tree)]

    # -- the choice -------------------------------------------------------------------------------

    def _offers(self, b: int, s: Sequence, want: int, req: RequestState,
                parts: dict[str, DraftProposal]) -> dict[str, Offer]:
        """method -> what it offers row b: lookups that found a draft, and the model methods."""
        allowed = self.methods
        if is_seeded(s.params):  # no timing may steer its draws (the seeds rule, policy.py)
            allowed = self.seeded
        out = {}
        for m in allowed:
            length = parts[m].num_draft_tokens[b] if self.parts[m].lookup else want
            if length:
                own = req.stats.setdefault(m, PositionStats())
                alphas = own.alphas(length, self._method_alphas(m, length), PRIOR_WEIGHT)
                fade = DECAY ** (req.rounds - req.last_served.get(m, req.rounds))  # evidence ages unused
                for i, a in enumerate(alphas):
                    n = own.reached[i] * fade if i < len(own.reached) else 0.0
                    alphas[i] = min(1.0, a + EXPLORE * math.sqrt(a * (1.0 - a) / (1.0 + n)))
                out[m] = Offer(expected_tokens(alphas, length), length)
        return out

    def _choose(self, offers: list[dict[str, Offer]], forced: list[str | None], line, t1: float,
                costs: dict[str, float], switch: dict[str, float], B: int) -> list[str | None]:
        """Each row's method under the best set of model methods to run (the highest predicted speedup
        for the batch); rows with no offer draft nothing."""
        must = {m for m in forced if m in self.models}
        optional = [m for m in self.models if m not in must]
        lookup_cost = sum(costs[m] for m in self.lookups)
        best, best_value = None, float("-inf")
        for size in range(len(optional) + 1):
            for extra in combinations(optional, size):
                run = must | set(extra)
                chosen, tokens, width, k = [], 0.0, 0, dict.fromkeys(run, 0)
                for row, f in zip(offers, forced):
                    m = f if f is not None else max((m for m in row if m in run or self.parts[m].lookup),
                                                    key=lambda m: row[m].tokens, default=None)
                    chosen.append(m)
                    if m is None:
                        tokens += 1.0
                        continue
                    tokens += row[m].tokens
                    width = max(width, row[m].length)
                    if m in k:
                        k[m] = max(k[m], row[m].length)
                cost = lookup_cost + line(width + 1)
                for m, km in k.items():
                    cost = round_cost(km, costs[m], cost, self.parts[m].parallel)  # k_m drafts of c_m on top
                    if km and not self.parts[m].ran_last:
                        cost += switch[m]  # it first catches up on what it missed
                value = speedup(tokens / B, cost, t1)
                if value > best_value:  # ties: the fewest models (smaller sets come first)
                    best, best_value = chosen, value
        return best

    def _costs(self, B: int):
        """(T -> seconds of a verify pass of T tokens per row, t_1, method -> c, model -> its extra time
        after a pause): the controller's measured verify line and each method's measured draft times at
        batch size B, or the priors (in units of t_1; no switch-on cost) until both are measured."""
        c = self.controller
        measured = c is not None and any(b == B and t.value is not None for (b, _), t in c.verify_time.items())
        if measured:
            line = c.verify_line(B)
        else:
            def line(T: int) -> float:
                return 1.0 + PRIOR_VERIFY_SLOPE * (T - 1)
        t1 = line(1)
        costs = {}
        for m, part in self.parts.items():
            timing = part.time.get(B)
            if measured and timing is not None and timing.value is not None:
                costs[m] = timing.value
            else:
                costs[m] = 0.0 if part.lookup else PRIOR_DRAFT_COST * t1
        switch = {}
        for m in self.models:
            timing = self.parts[m].switch_on.get(B)
            switch[m] = timing.value if measured and timing is not None and timing.value is not None else 0.0
        return line, t1, costs, switch

    def _method_alphas(self, m: str, k: int) -> list[float]:
        """The method's conditional acceptance over all sequences, alpha_1..alpha_k (the prior a
        sequence's own counts are smoothed towards); positions never reached keep the last measured rate."""
        got = self._priors.get((m, k))
        if got is None:
            stats = self.parts[m].stats
            got = self._priors[(m, k)] = stats.alphas(k, [PRIOR_ALPHA], 1.0)
            for i in range(1, k):
                if i >= len(stats.reached) or stats.reached[i] < 1e-3:
                    got[i] = got[i - 1]
        return got

    def _timed(self, m: str, seqs: list[Sequence], want: list[int], sb: SamplingBatch, B: int) -> DraftProposal:
        """Method m's proposal, its time recorded: per call for a lookup; for a model per drafted position
        when it drafted the round before, else what the call took beyond that (its catch-up)."""
        part = self.parts[m]
        t0 = time.perf_counter()
        proposal = part.drafter.propose(seqs, want, sb)
        dt = time.perf_counter() - t0
        if part.lookup:
            part.time.setdefault(B, Timing()).update(dt)
        else:
            self._time_model(m, dt, max(want), B)
        return proposal

    def _time_model(self, m: str, dt: float, k: int, B: int) -> None:
        """A model's call of ``dt`` seconds drafting up to k positions: per position (a parallel draft:
        per call) when it drafted the round before, else what the call took beyond that (its catch-up)."""
        part = self.parts[m]
        steady = part.time.get(B)
        passes = draft_passes(k, part.parallel)
        if part.ran_last:
            part.time.setdefault(B, Timing()).update(dt / passes)
        elif steady is not None and steady.value is not None:  # after a pause: the catch-up beyond steady drafting
            part.switch_on.setdefault(B, Timing(skip=0)).update(max(dt - passes * steady.value, 0.0))
        part.ran_last = True
