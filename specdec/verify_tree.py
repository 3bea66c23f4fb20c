"""The tree verifier: which root path of a draft tree the target keeps, and the one token it adds.

A round verifies each row's draft tree (tree.py) in one target pass: position 0 of a row's logits
is p after the root (its newest committed token), position 1 + i is p after node i's path. The walk
starts at the root and, at each node, either moves to one of its children (that child's token is
*accepted*) or stops with one new token: the *recovered* token when the node has children and all
were rejected, the *bonus* token when it is a leaf. Every row emits its accepted path plus exactly
one recovered or bonus token, as a chain round does (verify.py).

Greedy rows move to the child whose token is p's argmax (the longest root path that plain greedy
decoding would emit) and stop with the argmax otherwise.

Sampled rows keep the target's distribution exactly with multi-candidate speculative sampling
(SpecInfer, Miao et al. 2024, "multi-step speculative sampling"), with the correction Sequoia
(Chen et al. 2024) gives for siblings drawn *without replacement*. At a node with target
distribution p and children c_1..c_m, tried in order, with r_1 = p:
- c_i was drawn from q_i = the drafter's q with c_1..c_{i-1} removed, renormalized;
- accept c_i with probability min(1, r_i(c_i) / q_i(c_i)) and move to it;
- on rejection r_{i+1} = max(0, r_i - q_i) / Z;
- after all m children are rejected the recovered token is drawn from r_{m+1}.
By the one-draft lemma (Leviathan et al. 2023) step i emits a token distributed as r_i whatever c_i
is, so the node emits p. Where the drafter chose its candidates deterministically (a top-k, a
suffix trie's branches: ``DraftTree.draft_probs`` is None) each candidate is a one-hot q: accept c_i
with probability r_i(c_i), residual r_i without c_i. That is the same law as drawing y ~ p once and
moving to the child whose token is y (else emitting y), which is what this module does: one draw per
level, plain decoding's own draw, so a seeded row emits what it would emit with no drafter at all.

What makes it exact, and what a drafter must keep: a sampled node's value may not decide whether
that node exists (whether sibling i is drafted may depend on anything drawn before it, never on its
own token); a drafter that keeps or prunes nodes by their values must propose deterministic
candidates (draft_probs None). Each row draws only from its own generator, only what it uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.sampling import SamplingBatch, argmax, probs_from_logits, sample
from specdec.tree import DraftTree


@dataclass
class TreeVerifyResult:
    accepted_nodes: list[list[int]]  # [B] node indices of the accepted path, the root's child first
    next_token_ids: list[int]  # [B] the recovered token (the path stops at a node with children) or the bonus token

    @property
    def num_accepted(self) -> list[int]:
        """[B] accepted drafts per row: the length of its accepted path."""
        return [len(p) for p in self.accepted_nodes]


def verify_tree(trees: Sequence[DraftTree | None], target_logits: torch.Tensor, sb: SamplingBatch,
                generators: Sequence[torch.Generator]) -> TreeVerifyResult:
    """trees [B] (None or no nodes: plain decoding for that row); target_logits [B, 1 + N_max, V]:
    position 0 after the root, 1 + i after node i (a row's positions past its nodes are not read)."""
    B = len(trees)
    paths: list[list[int]] = [[] for _ in range(B)]
    next_ids = [0] * B
    greedy = sb.greedy.tolist()
    greedy_rows = [b for b in range(B) if greedy[b]]
    sampled_rows = [b for b in range(B) if not greedy[b]]
    if greedy_rows:
        best = argmax(target_logits[greedy_rows]).tolist()  # [Bg, 1 + N_max]
        for i, b in enumerate(greedy_rows):
            paths[b], next_ids[b] = _greedy_walk(trees[b], best[i])
    if sampled_rows:
        probs = probs_from_logits(target_logits[sampled_rows], sb.select(sampled_rows))  # [Bs, 1 + N_max, V]
        for i, b in enumerate(sampled_rows):
            paths[b], next_ids[b] = _sampled_walk(trees[b], probs[i], generators[b])
    return TreeVerifyResult(paths, next_ids)


def _children(tree: DraftTree | None) -> list[list[int]]:
    """kids[node + 1]: the children of ``node`` (-1: the root) in node order."""
    n = tree.num_nodes if tree is not None else 0
    kids: list[list[int]] = [[] for _ in range(n + 1)]
    for i in range(n):
        kids[tree.parents[i] + 1].append(i)
    return kids


def _greedy_walk(tree: DraftTree | None, best: list[int]) -> tuple[list[int], int]:
    """best [1 + N]: p's argmax after the root and after each node. Moves to the child that equals it."""
    kids = _children(tree)
    path, node = [], -1
    while True:
        want = best[node + 1]
        child = next((c for c in kids[node + 1] if tree.token_ids[c] == want), None)
        if child is None:
            return path, want  # recovered (the node has children) or bonus (a leaf)
        path.append(child)
        node = child


def _sampled_walk(tree: DraftTree | None, probs: torch.Tensor, g: torch.Generator) -> tuple[list[int], int]:
    """probs [1 + N, V]: p after the root and after each node (sampling options applied)."""
    kids = _children(tree)
    path, node = [], -1
    while True:
        p = probs[node + 1]  # [V]
        children = kids[node + 1]
        if not children:  # a leaf: the bonus token
            return path, int(sample(p[None], [g])[0])
        if tree.draft_probs is None:  # deterministic candidates: y ~ p, move to the child whose token is y
            y = int(sample(p[None], [g])[0])
            child = next((c for c in children if tree.token_ids[c] == y), None)
            if child is None:
                return path, y  # recovered: y ~ p given y is no candidate, the one-hot residual
        else:
            child, residual = _try_children(tree, children, p, g)
            if child is None:
                return path, int(sample(residual[None], [g])[0])
        path.append(child)
        node = child


def _try_children(tree: DraftTree, children: list[int], p: torch.Tensor,
                  g: torch.Generator) -> tuple[int | None, torch.Tensor]:
    """Recursive rejection over siblings drawn without replacement (SpecInfer + Sequoia): returns the
    accepted child, or None and the last residual r_{m+1} [V]. One uniform per child tried."""
    r, drawn = p, []
    for c in children:
        x = tree.token_ids[c]
        q = tree.draft_probs[c].float()  # [V] the q node c was drawn from (siblings share it)
        if drawn:
            q = q.clone()
            q[drawn] = 0.0  # earlier siblings could not be drawn again
        mass = float(q.sum())
        if not mass > 0 or not float(q[x]) > 0:
            raise ValueError(f"draft tree node {c} (token {x}) has probability 0 under its draft_probs once its "
                             f"earlier siblings are removed: siblings must be drawn from q without replacement, "
                             f"or pass draft_probs=None for deterministic candidates")
        q = q / mass
        if float(torch.rand(1, generator=g, device=p.device)) * float(q[x]) < float(r[x]):  # u < r/q, no division
            return c, r
        nxt = (r - q).clamp(min=0)
        total = float(nxt.sum())
        if total > 0:  # 0 only when r == q up to rounding, where rejection has probability 0
            r = nxt / total
        drawn.append(x)
    return None, r
