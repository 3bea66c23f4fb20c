"""How the controller chooses a draft tree (tree.py, cost_model.py "draft trees"), and what tree rounds
teach it.

For N = 1..max_nodes nodes within D = 1..k levels it weighs S_tree(N, D) = E_tree(N, D) · t_1 /
(D · c_tree + t_v(B, 1 + N)) against the best chain's S(k): E_tree from the chain's acceptance per
depth and the share of each miss that a further sibling catches (cost_model.rank_acceptance), both
measured on tree rounds too (their first children's path is the chain; SIBLING_PRIOR until siblings
are seen), scaled by what tree rounds accepted against what was predicted; c_tree the measured draft
time per tree level; t_v(B, T) the verify line through every pass timed at this batch size, chains'
and trees'. A tree is drafted only where it beats the best chain by TREE_MIN_GAIN: on a flat verify
curve (1 + N tokens cost about one step) and at small batches; on a steep curve or a large batch the
chain wins.
"""

from __future__ import annotations

from collections.abc import Callable

from specdec.adaptive.measure import DECAY, Acceptance, Costs, Timing, timing
from specdec.cost_model import rank_acceptance, speedup, tree_node_values
from specdec.tree import DraftTree, TreeShape

SIBLING_PRIOR = 0.5  # share of a depth's remaining miss that each further sibling catches, until tree rounds
#                     calibrate it (cost_model.rank_acceptance). Measured: the shipped draft on the target's
#                     greedy output of 12 held-out code prompts catches 0.73 at rank 1, then 0.51, 0.60, 0.32
#                     of what the ranks before missed (ranks 2-4; 96% within the top 4)
TREE_MIN_GAIN = 0.05  # a tree is drafted only where its predicted speedup beats the best chain's by this much
MIN_GAIN = 0.06  # ... and plain decoding's by this much (a smaller predicted gain is inside the noise)
TREE_CALIBRATION_WEIGHT = 4.0  # pseudo-rounds of "as predicted" mixed into the measured tree calibration
TREE_DECIDE_ROUNDS = 8  # rounds a tree decision stands while its inputs change (TreeChooser.choose)
TREE_OFF_DECIDE_ROUNDS = 64  # ... and a decision that no tree pays (the chain's own choice of k goes on each round)


class TreeChooser:
    """The tree shape for the batch, and the calibration that tree rounds measure."""

    def __init__(self, acceptance: Acceptance, costs: Costs):
        self.acceptance, self.costs = acceptance, costs
        self.tokens: dict[int, Timing] = {}  # N -> tokens per row per tree pass (1 + accepted path)
        self.observed = 0.0  # decayed accepted tree nodes, over the rows of tree rounds
        self.predicted = 0.0  # decayed accepted nodes the prior predicted for the same rows
        self.rows = 0.0  # decayed rows of tree rounds
        self.sibling_tried = 0.0  # decayed siblings tried after a first child missed
        self.sibling_caught = 0.0  # and those that caught the token
        self.prior: list[float] = []  # E_tree(0..max_nodes) before calibration, from the last decision
        self.depth = 1  # depth of the tree shape the last decision returned
        self._key: tuple | None = None  # the last decision: its arguments, inputs' version, round
        self._version = self._round = -1
        self._shape: TreeShape | None = None

    def choose(self, seq_ids: list[int], max_nodes: int, top_k: int, max_depth: int, force: bool,
               version: int, rounds: int, prepare: Callable[[], None],
               best_chain: Callable[[list[float]], float]) -> TreeShape | None:
        """The decision (``decide``), worked out again only when the batch size or the arguments
        change, or a drafting round has been recorded since (``version``) and TREE_DECIDE_ROUNDS
        rounds have passed (TREE_OFF_DECIDE_ROUNDS after a decision for the chain): weighing every tree
        size takes ~0.2 ms right after a forward, 8% of a round of the shipped pair."""
        key = (len(seq_ids), max_nodes, top_k, max_depth, force)
        period = TREE_DECIDE_ROUNDS if self._shape is not None else TREE_OFF_DECIDE_ROUNDS
        if key == self._key and (self._version == version or rounds - self._round < period):
            return self._shape
        prepare()  # the controller takes in what it has not yet (AdaptiveK.flush)
        self._key, self._version, self._round = key, version, rounds
        self._shape = self.decide(seq_ids, max_nodes, top_k, max_depth, force, best_chain)
        return self._shape

    def decide(self, seq_ids: list[int], max_nodes: int, top_k: int, max_depth: int, force: bool,
               best_chain: Callable[[list[float]], float]) -> TreeShape | None:
        """The shape of the highest predicted S_tree(N, D) (``best_chain(alphas)``: the best chain's S
        for the batch's mean acceptance), or None where it does not beat that chain by TREE_MIN_GAIN
        and plain decoding by MIN_GAIN. ``force``: always a shape, the best one that branches."""
        B = len(seq_ids)
        max_nodes, top_k, max_depth = max(1, max_nodes), max(1, top_k), max(1, max_depth)
        alphas = self.acceptance.mean_alphas(seq_ids, max_depth)
        sibling = self.sibling_rate()
        rank_probs = [rank_acceptance(a, top_k, sibling) for a in alphas]
        line = self.costs.tree_verify_line(B)
        t1 = line(1)
        c = self.costs.tree_draft_cost(B, t1)
        plain, extra = t1 + self.costs.overhead(B, plain=True), self.costs.overhead(B, plain=False)  # host work
        r = self.calibration()
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
                S = speedup(1.0 + r * (prior[n] - 1.0), depth * c + line(n + 1) + extra, plain)
                if best is None or S > best[0] * (1 + 1e-9):
                    best = (S, n, depth, width, prior)
        S, n, depth, width, prior = best
        self.prior = prior
        shape = TreeShape(n, max(depth, 1), max(width, 1))
        if not force:
            if width < 2:
                return None  # the best "tree" is a chain: the chain rule sizes it from its own measurements
            if S < max(best_chain(alphas) * (1.0 + TREE_MIN_GAIN), 1.0 + MIN_GAIN):
                return None
        self.depth = shape.max_depth
        return shape

    def calibration(self) -> float:
        """Accepted tree nodes measured over those predicted (1.0 before any tree round)."""
        w = TREE_CALIBRATION_WEIGHT * (self.predicted / self.rows if self.rows else 1.0)
        return (self.observed + w) / (self.predicted + w)

    def sibling_rate(self) -> float:
        """The share of the remaining miss each further sibling catches: measured from tree rounds
        (``learn`` with trees and paths), smoothed towards SIBLING_PRIOR."""
        w = TREE_CALIBRATION_WEIGHT
        return (self.sibling_caught + w * SIBLING_PRIOR) / (self.sibling_tried + w)

    def record(self, num_nodes: list[int], num_accepted: list[int]) -> None:
        """Tokens per pass per node count, and what the rows accepted against the prediction."""
        d = DECAY ** (1.0 / max(len(num_nodes), 1))
        for n, a in zip(num_nodes, num_accepted):
            if n == 0:
                continue
            timing(self.tokens, n, window=64, skip=0).update(1.0 + a)
            if n < len(self.prior):
                self.observed = d * self.observed + a
                self.predicted = d * self.predicted + (self.prior[n] - 1.0)
                self.rows = d * self.rows + 1.0

    def learn(self, seq_ids: list[int], trees: list[DraftTree | None], paths: list[list[int]]) -> None:
        """Per row: the chain of first children, as a chain round would have counted it (into the
        acceptance), and at each node of the accepted path whose first child missed, the siblings
        tried after it (ranks 2.. until the accepted one, or all of them) and whether one caught it."""
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
            self.acceptance.record(sid, top, lead, B)
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
