"""Dynamic draft trees for model drafters (EAGLE-2, Li et al. 2024): grow each row's tree level by level.

The root's children are the draft's top choices after the history. Then, per level up to the
shape's depth, the frontier nodes with the highest cumulative draft probability (the product of q
along the path: the drafter's estimate that the path is accepted) are expanded, each into its top
children, all rows' frontiers in ONE call of ``feed`` (one tree pass of the drafter). At the end the
nodes are reranked by cumulative probability and the best ``num_nodes`` kept; a child's value is at
most its parent's, so the kept set is a tree (ties go to the shallower, older node).

Expansion is pruned: a node outside the current best ``num_nodes`` can never be kept (its children
score lower still and the bar only rises), so it is not expanded; at most ``max_children`` nodes are
expanded per level (EAGLE-2's beam).

Candidates (``siblings``):
- ``"top_k"``: a node's children are the top tokens of q, deterministic (DraftTree.draft_probs None:
  the verifier treats each as a one-hot q, exact for greedy and sampled rows alike);
- ``"sampled"`` (the drafters' default): a sampled row's children are drawn from q without replacement (the exponential race
  ``sampling.sample`` uses, kept for the m best: Gumbel top-m), and draft_probs holds q for each node,
  the multi-candidate rule's input (verify_tree.py). Greedy rows stay top-k. The rule is exact only
  if no sampled node's own token decides whether it exists, so these trees are not pruned by value:
  their shape is fixed before the first draw (Sequoia's static tree, ``rank_tree``: the child of
  sibling rank r valued as the measured rate at which rank r is the accepted one, ``RankAcceptance``),
  and every drawn node is kept.
  Measured at temperature 1 on the shipped pair (16 nodes, 4 code prompts): τ 3.69 / 3.93 / 4.07 at
  depth 4 / 8 / 16 against 1.70 for top-k candidates, whose one-hot rule accepts a child only when
  the target's own draw is that token; chains of 4 and 16 drafts: 3.05, 3.77.

Logit processing (penalties, grammars) runs per expanded node on its own path, as the target's will.
A sampled row draws only for its own nodes, in node order: its generator's use does not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.policy import is_seeded
from specdec.sampling import SamplingBatch, exponentials, probs_from_logits
from specdec.sequence import Sequence
from specdec.tree import DraftTree, TreeShape, root_path, static_tree

SIBLINGS = ("top_k", "sampled")

# feed(blocks) runs one tree pass over each row's block: blocks[b] = (tokens, parents within the block,
# indices whose logits come back), or None for a row that feeds nothing; returns logits [len(want), V] per row
TreeFeed = Callable[[list["Block | None"]], list["torch.Tensor | None"]]


@dataclass
class Block:
    tokens: list[int]  # [T] nodes' tokens, in topological order
    parents: list[int]  # [T] parent within the block (-1: a child of the root)
    want: list[int]  # indices into the block whose logits come back (the nodes expanded this level)
    nodes: list[int]  # [T] each token's node id in the growing tree (stable across levels: a drafter that
    #                   keeps its earlier levels' keys, as the eagle3 head, feeds only ``want``)


@dataclass
class _Growth:
    """One row's tree while it grows: every candidate node, best-first bookkeeping, the q's drawn from."""

    shape: TreeShape
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # cumulative draft probability
    depth: list[int] = field(default_factory=list)
    dist: list[int] = field(default_factory=list)  # index into qs of the distribution each node was drawn from
    qs: list[torch.Tensor] = field(default_factory=list)  # [V] each, kept only for sampled siblings
    plan: dict[tuple[int, ...], int] | None = None  # sampled siblings: rank path -> its number of children
    ranks: list[tuple[int, ...]] = field(default_factory=list)  # each node's rank path (sampled siblings)
    q: list[float] = field(default_factory=list)  # each node's own draft probability
    kept: list[int] = field(default_factory=list)  # after final: the node ids the tree holds, in its order

    def add_children(self, parent: int, q: torch.Tensor, chosen: list[int], keep_q: bool,
                     value: Callable[[float], float] | None = None) -> None:
        """``value``: a candidate's estimated acceptance from its q (QCalibration.value; None: q itself)."""
        d = 1 if parent < 0 else self.depth[parent] + 1
        base = 1.0 if parent < 0 else self.scores[parent]
        if keep_q:
            self.qs.append(q)
        prefix = () if parent < 0 else self.ranks[parent]
        for r, t in enumerate(chosen):
            self.ranks.append(prefix + (r,))
            self.tokens.append(t)
            self.parents.append(parent)
            qt = float(q[t])
            self.q.append(qt)
            self.scores.append(base * (qt if value is None else value(qt)))
            self.depth.append(d)
            self.dist.append(len(self.qs) - 1 if keep_q else -1)

    def rank(self) -> list[int]:
        """Node ids best first: higher score, then shallower, then older (a parent before its children)."""
        return sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], self.depth[i], i))

    def path(self, node: int) -> list[int]:
        return root_path(self.parents, node)

    def block(self, expand: list[int]) -> Block:
        """The expanded nodes with their ancestors, in node order (topological), parents re-indexed."""
        nodes = sorted({j for i in expand for j in self.path(i)})
        at = {n: k for k, n in enumerate(nodes)}
        return Block([self.tokens[n] for n in nodes], [at.get(self.parents[n], -1) for n in nodes],
                     [at[i] for i in expand], nodes)

    def planned_children(self, parent: int) -> int:
        """Sampled siblings: how many children the fixed shape gives ``parent`` (-1: the root)."""
        return self.plan.get(() if parent < 0 else self.ranks[parent], 0)

    def spine(self) -> list[int]:
        """The draft's own chain: from the root, each node's first child (its top choice)."""
        first: dict[int, int] = {}
        for i, p in enumerate(self.parents):
            first.setdefault(p, i)
        out, node = [], -1
        while node in first:
            node = first[node]
            out.append(node)
        return out

    def final(self, sampled: bool) -> DraftTree:
        """The best num_nodes nodes (a parent always kept before its child), in node order; with
        sampled siblings every node (the shape held them to num_nodes). A top-k tree always keeps
        the draft's own chain (``spine``) first: acceptance comes in streaks, so the product of
        per-node rates undervalues deep nodes (measured: greedy trees of 16 nodes that dropped the
        chain's depth-3/4 nodes verified no more than the chain of 4 they replaced); with it a tree
        verifies at least what the chain of its depth would."""
        kept: set[int] = set(range(len(self.tokens))) if sampled else set(self.spine()[: self.shape.num_nodes])
        for i in [] if sampled else self.rank():
            if len(kept) == self.shape.num_nodes:
                break
            if self.parents[i] < 0 or self.parents[i] in kept:
                kept.add(i)
        nodes = self.kept = sorted(kept)
        at = {n: k for k, n in enumerate(nodes)}
        probs = torch.stack([self.qs[self.dist[n]] for n in nodes]) if sampled and nodes else None  # [N, V]
        return DraftTree([self.tokens[n] for n in nodes], [at.get(self.parents[n], -1) for n in nodes],
                         probs, [self.scores[n] for n in nodes])


def draft_tree(logits: torch.Tensor, feed: TreeFeed, seqs: list[Sequence], shapes: list[TreeShape | None],
               sb: SamplingBatch, draft_p_min: float = 0.0, siblings: str = "top_k",
               rank_probs: list[list[float]] | None = None,
               calibration: QCalibration | None = None) -> list[DraftTree | None]:
    """logits [B, V]: the drafter's logits after each history. Returns a tree per row within its shape
    (None where shapes[b] is None or nothing passes ``draft_p_min``). ``rank_probs``: the sampled
    siblings' shape's rates per rank, per row (RankAcceptance.probs; None: the root's sorted q).
    ``calibration``: top-k candidates are valued by their measured acceptance at their q, not by q
    (QCalibration), and it is told the trees proposed."""
    if siblings not in SIBLINGS:
        raise ValueError(f"siblings must be one of {SIBLINGS}, got {siblings!r}")
    B = len(seqs)
    greedy = sb.greedy.tolist()
    sampled = [siblings == "sampled" and not greedy[b] for b in range(B)]
    grow: dict[int, _Growth] = {b: _Growth(shapes[b]) for b in range(B) if shapes[b] is not None}

    def expand(rows_nodes: list[tuple[int, int]], node_logits: list[torch.Tensor]) -> None:
        """Add the children of node (b, parent) given its logits [V] (parent -1: the root)."""
        rows = [b for b, _ in rows_nodes]
        x = torch.stack(node_logits).float()  # [M, V]
        for m, (b, parent) in enumerate(rows_nodes):
            s = seqs[b]
            if s.processor is not None:
                path = [grow[b].tokens[j] for j in grow[b].path(parent)]
                x[m : m + 1] = s.processor.process(x[m : m + 1].clone(), path, first=len(path))
        q = probs_from_logits(x, sb.select(rows))  # [M, V]
        k = max(grow[b].shape.max_children for b in rows)
        top_q, top = q.topk(min(k, q.shape[-1]), dim=-1)  # [M, k] deterministic candidates
        top_q, top = top_q.tolist(), top.tolist()
        for m, (b, parent) in enumerate(rows_nodes):
            g, kb = grow[b], grow[b].shape.max_children
            if sampled[b]:  # without replacement from q: the m winners of one exponential race
                if parent < 0:  # the shape, fixed before any draw
                    g.plan = rank_tree(g.shape, top_q[m][:kb] if rank_probs is None else rank_probs[b])
                n = g.planned_children(parent)
                if n == 0 or top_q[m][0] < draft_p_min:  # too unsure: no children (q's property, not a draw's)
                    continue
                race = q[m] / exponentials(q.shape[-1], seqs[b].generator, q.device)
                chosen = [t for t in race.topk(n).indices.tolist() if q[m, t] > 0]
                g.add_children(parent, q[m], chosen, True)
                continue
            chosen = [t for t, p in zip(top[m][:kb], top_q[m][:kb]) if p > 0]
            if draft_p_min > 0.0:
                chosen = [t for t in chosen if float(q[m, t]) >= draft_p_min]
            g.add_children(parent, q[m], chosen, False, None if calibration is None else calibration.value)

    if grow:
        rows = sorted(grow)
        expand([(b, -1) for b in rows], [logits[b] for b in rows])
    for depth in range(2, max((g.shape.max_depth for g in grow.values()), default=0) + 1):
        blocks: list[Block | None] = [None] * B
        order: list[tuple[int, int]] = []
        for b, g in grow.items():
            if depth > g.shape.max_depth:
                continue
            if g.plan is not None:  # sampled siblings: every node the fixed shape gives children
                expand_nodes = [i for i in range(len(g.tokens)) if g.depth[i] == depth - 1 and g.planned_children(i)]
            else:
                best = g.rank()[: g.shape.num_nodes]  # only these can be kept
                expand_nodes = [i for i in best if g.depth[i] == depth - 1][: g.shape.max_children]
                spine = g.spine()  # the draft's own chain grows to the full depth whatever its values
                if len(spine) == depth - 1 and len(spine) < g.shape.num_nodes and spine[-1] not in expand_nodes:
                    expand_nodes = [spine[-1]] + expand_nodes[: g.shape.max_children - 1]
            if expand_nodes:
                expand_nodes.sort()
                blocks[b] = g.block(expand_nodes)
                order += [(b, i) for i in expand_nodes]
        if not order:
            break
        out = feed(blocks)
        node_logits = [row for b in range(B) if blocks[b] is not None for row in out[b]]  # in ``order``
        expand(order, node_logits)
    trees = [grow[b].final(sampled[b]) if b in grow and grow[b].tokens else None for b in range(B)]
    if calibration is not None:
        calibration.propose(seqs, [None if t is None or sampled[b] else (t, [grow[b].q[n] for n in grow[b].kept])
                                   for b, t in enumerate(trees)])
    return trees


def rank_tree(shape: TreeShape, rank_probs: list[float]) -> dict[tuple[int, ...], int]:
    """The fixed shape of ``shape.num_nodes`` nodes with the most expected accepted tokens when the child
    of rank r is accepted with probability ``rank_probs[r]`` at every level (tree.static_tree, Sequoia's
    best tree for a positional acceptance). Returns rank path -> number of children (() : the root)."""
    ranks = [min(max(float(p), 1e-9), 1.0) for p in rank_probs[: shape.max_children]]
    children: dict[tuple[int, ...], int] = {}
    for path in static_tree(shape, ranks) if ranks else []:
        children[path[:-1]] = children.get(path[:-1], 0) + 1
    return children


PRIOR_RANK_ACCEPTANCE = (0.7, 0.1, 0.05, 0.03, 0.02, 0.01, 0.01, 0.01)  # before any sampled tree is verified


class RankAcceptance:
    """How often the sibling of each rank is the accepted child, over a drafter's verified sampled trees:
    at every node the accepted path reaches that has children, each child of rank r was tried
    (``tried[r]``) and at most one accepted (``hits[r]``). Decayed counts smoothed towards
    PRIOR_RANK_ACCEPTANCE. The sampled trees' fixed shape (rank_tree) is sized from these rates: they
    depend on past rounds only, never on the draws of the tree they shape. A seeded request reads only
    its own counts, so its output does not depend on the batch."""

    def __init__(self, decay: float = 0.995, prior_weight: float = 4.0):
        self.decay, self.prior_weight = decay, prior_weight
        self.all = _RankCounts()
        self.own: dict[int, _RankCounts] = {}  # seq_id -> its own counts
        self.pending: dict[int, DraftTree] = {}  # seq_id -> its last sampled tree, until observe

    def probs(self, seqs: list[Sequence], k: int) -> list[list[float]]:
        """[B][k] each row's rate per rank."""
        prior = list(PRIOR_RANK_ACCEPTANCE) + [PRIOR_RANK_ACCEPTANCE[-1]] * max(k - len(PRIOR_RANK_ACCEPTANCE), 0)
        w = self.prior_weight
        out = []
        for s in seqs:
            c = self.own.get(s.seq_id, _RankCounts()) if is_seeded(s.params) else self.all
            out.append([(c.get(c.hits, r) + w * prior[r]) / (c.get(c.tried, r) + w) for r in range(k)])
        return out

    def propose(self, seqs: list[Sequence], trees: list[DraftTree | None]) -> None:
        """Remember the sampled trees (draft_probs set) proposed for ``seqs``."""
        for s, t in zip(seqs, trees):
            if t is not None and t.draft_probs is not None:
                self.pending[s.seq_id] = t
            else:
                self.pending.pop(s.seq_id, None)

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Each sequence's history now ends with its accepted path (num_accepted nodes) and one more token."""
        for s, a in zip(seqs, num_accepted):
            tree = self.pending.pop(s.seq_id, None)
            if tree is None or len(s.token_ids) < a + 1:
                continue
            path = s.token_ids[len(s.token_ids) - a - 1 : len(s.token_ids) - 1]
            for c in (self.all, self.own.setdefault(s.seq_id, _RankCounts())):
                c.decay(self.decay)
            node, seen = -1, 0
            while True:
                kids = tree.children(node)
                if not kids:
                    break
                nxt = next((r for r, c in enumerate(kids) if seen < a and tree.token_ids[c] == path[seen]), None)
                for c in (self.all, self.own[s.seq_id]):
                    for r in range(len(kids) if nxt is None else nxt + 1):  # tried in order until one is accepted
                        c.add(c.tried, r)
                    if nxt is not None:
                        c.add(c.hits, nxt)
                if nxt is None:
                    break
                node, seen = kids[nxt], seen + 1

    def release(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.pending.pop(s.seq_id, None)
            self.own.pop(s.seq_id, None)


@dataclass
class _RankCounts:
    hits: list[float] = field(default_factory=list)
    tried: list[float] = field(default_factory=list)

    def decay(self, f: float) -> None:
        self.hits = [h * f for h in self.hits]
        self.tried = [t * f for t in self.tried]

    @staticmethod
    def get(counts: list[float], r: int) -> float:
        return counts[r] if r < len(counts) else 0.0

    @staticmethod
    def add(counts: list[float], r: int) -> None:
        while len(counts) <= r:
            counts.append(0.0)
        counts[r] += 1.0


class QCalibration:
    """How often a top-k candidate whose draft probability is q turns out to be the accepted child, in
    ``BINS`` bins of q, over a drafter's verified top-k trees (every child of a node the accepted path
    reaches was a candidate; at most one is accepted). Decayed counts smoothed towards q itself.
    A small draft's q is no acceptance rate: the shipped draft's q(top token) averages about 0.5 where
    the target agrees with it about 0.8 of the time, so ranking nodes by raw q (EAGLE-2) spends the
    budget on siblings where depth pays. Top-k candidates are verified one-hot (the target's own draw
    decides), so the tree's shape never changes an output and the counts may pool every request."""

    BINS = 10

    def __init__(self, decay: float = 0.998, prior_weight: float = 4.0):
        self.decay, self.prior_weight = decay, prior_weight
        self.hits = [0.0] * self.BINS
        self.tried = [0.0] * self.BINS
        self.pending: dict[int, tuple[DraftTree, list[float]]] = {}  # seq_id -> (tree, each node's q)

    def value(self, q: float) -> float:
        j = min(int(q * self.BINS), self.BINS - 1)
        w = self.prior_weight
        return min(1.0, (self.hits[j] + w * q) / (self.tried[j] + w))

    def propose(self, seqs: list[Sequence], trees: list[tuple[DraftTree, list[float]] | None]) -> None:
        for s, t in zip(seqs, trees):
            if t is None:
                self.pending.pop(s.seq_id, None)
            else:
                self.pending[s.seq_id] = t

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Each sequence's history now ends with its accepted path (num_accepted nodes) and one more token."""
        for s, a in zip(seqs, num_accepted):
            got = self.pending.pop(s.seq_id, None)
            if got is None or len(s.token_ids) < a + 1:
                continue
            tree, qs = got
            path = s.token_ids[len(s.token_ids) - a - 1 : len(s.token_ids) - 1]
            self.hits = [h * self.decay for h in self.hits]
            self.tried = [t * self.decay for t in self.tried]
            node, seen = -1, 0
            while True:
                kids = tree.children(node)
                nxt = next((c for c in kids if seen < a and tree.token_ids[c] == path[seen]), None)
                for c in kids:
                    j = min(int(qs[c] * self.BINS), self.BINS - 1)
                    self.tried[j] += 1.0
                    self.hits[j] += 1.0 if c == nxt else 0.0
                if nxt is None:
                    break
                node, seen = nxt, seen + 1

    def release(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.pending.pop(s.seq_id, None)
