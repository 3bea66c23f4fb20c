"""Draft trees: several candidate continuations of one sequence, verified in one target pass.

A tree's nodes are draft tokens; node i continues its parent ``parents[i]`` (-1: the root, the
sequence's newest committed token, which the verify pass feeds first). Nodes are in topological
order (a parent before its children), so a chain of k drafts is the tree with parents -1, 0, .., k-2.
In a verify pass node i sits at position ``start + 1 + depth(i)`` and attends to the cached prefix,
the root and its own ancestors; its KV is written at cache slot ``start + 1 + i`` until the accepted
path is compacted to consecutive slots (``ModelRunner.compact``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """One row's draft tree. ``draft_probs`` [N, V]: the distribution q that node i was drawn from
    given its parent's path; siblings share it and were drawn from it without replacement (Sequoia).
    None: the candidates were chosen deterministically (top-k by the draft, a suffix trie's branches),
    each verified as a one-hot q."""

    token_ids: list[int]  # [N]
    parents: list[int]  # [N] parent node index, -1 for a child of the root; parents[i] < i
    draft_probs: torch.Tensor | None = None  # [N, V] or None (deterministic candidates)
    scores: list[float] | None = None  # [N] the drafter's estimate that the path to node i is accepted

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents):
            raise ValueError(f"a draft tree needs one parent per token: {len(self.token_ids)} tokens, "
                             f"{len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft tree node {i} has parent {p}; parents must come first (-1 <= parent < {i})")

    @classmethod
    def chain(cls, token_ids: list[int], draft_probs: torch.Tensor | None = None) -> DraftTree:
        """k drafts in a line: the tree a chain drafter proposes."""
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)), draft_probs)

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    def depths(self) -> list[int]:
        """Depth of each node: 1 for a child of the root."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def children(self, node: int) -> list[int]:
        """The children of ``node`` (-1: the root), in node order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (empty for the root, -1)."""
        return root_path(self.parents, node)

    def best_chain(self) -> list[int]:
        """The root-to-leaf path the drafter scores highest (the longest when unscored): the fallback
        for a backend that verifies chains only."""
        leaves = [i for i in range(self.num_nodes) if not self.children(i)]
        if not leaves:
            return []
        if self.scores is None:
            depth = self.depths()
            return self.path_to(max(leaves, key=lambda i: (depth[i], -i)))
        score = lambda i: sum(self.scores[j] for j in self.path_to(i))  # noqa: E731 -- expected accepted length
        return self.path_to(max(leaves, key=lambda i: (score(i), -i)))


@dataclass
class TreeShape:
    """How big a tree a round may draft for one row (the controller sizes it from the verify cost
    per node count): at most ``num_nodes`` nodes, ``max_depth`` levels, ``max_children`` per node."""

    num_nodes: int
    max_depth: int
    max_children: int = 4

    def __post_init__(self) -> None:
        if not (self.num_nodes >= 1 and self.max_depth >= 1 and self.max_children >= 1):
            raise ValueError(f"a tree shape needs num_nodes, max_depth and max_children >= 1, got {self}")


def root_path(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node`` (empty for the root, -1), given each node's parent."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def block_parents(num_fed: int, tree: DraftTree) -> list[int]:
    """Parents within a verify pass's fed block of ``num_fed`` committed tokens (a chain, usually just
    the newest token) followed by the tree's nodes: index num_fed - 1 is the root."""
    root = num_fed - 1
    return [i - 1 for i in range(num_fed)] + [root if p < 0 else num_fed + p for p in tree.parents]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[T, T] bool: entry (i, j) is True when fed token j is token i or one of its ancestors."""
    T = len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def tree_mask(pos: torch.Tensor, ancestors: torch.Tensor, start: torch.Tensor, end: int, window: int | None,
               additive: bool) -> torch.Tensor:
    """Mask [B, 1, T, end] for a tree pass: fed token i of row b sees the cached keys 0..start[b]-1
    (within ``window`` of its position) and the fed tokens that are its ancestors or itself, at slots
    start[b] + j. pos [B, T] positions by depth; ancestors [B, T, T] bool (tree.ancestor_mask)."""
    B, T = pos.shape
    keys = torch.arange(end, device=pos.device)
    allowed = (keys[None, None, :] < start[:, None, None]).expand(B, T, end).clone()  # [B, T, end]
    if window is not None:
        allowed &= keys[None, None, :] > pos[:, :, None] - window
    block = start[:, None] + torch.arange(T, device=pos.device)  # [B, T] slots of the fed tokens
    allowed.scatter_(2, block[:, None, :].expand(B, T, T), ancestors)  # ancestors sit in the window (T < window)
    if additive:
        return torch.zeros(allowed.shape, device=pos.device).masked_fill_(~allowed, float("-inf"))[:, None]
    return allowed[:, None]


def depths_of(parents: list[int]) -> list[int]:
    """Depth of each fed token in a block given its parents within the block (-1: continues the cache): 0, 1, ..."""
    d: list[int] = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def static_tree(shape: TreeShape, rank_acceptance: list[float]) -> list[tuple[int, ...]]:
    """The fixed tree of ``shape.num_nodes`` nodes with the most expected accepted tokens when the
    child of rank r (0: the draft's top choice) is the accepted one with probability
    ``rank_acceptance[r]`` at every level, as vLLM's ``speculative_token_tree`` and TensorRT-LLM's
    ``eagle_choices`` write it: each node the path of child ranks from the root, breadth-first.
    A node's value, the product of its ranks' probabilities, is at most its parent's and its elder
    sibling's, so taking the best values one at a time keeps a tree and is optimal (Sequoia)."""
    ranks = [float(a) for a in rank_acceptance[: shape.max_children]]
    if not ranks or any(not 0 < a <= 1 for a in ranks):
        raise ValueError(f"rank_acceptance must hold probabilities in (0, 1], got {rank_acceptance!r}")
    chosen: list[tuple[int, ...]] = []
    frontier = {(0,): ranks[0]}  # candidate path -> its value
    while frontier and len(chosen) < shape.num_nodes:
        path = max(frontier, key=lambda p: (frontier[p], -len(p), [-r for r in p]))
        value = frontier.pop(path)
        chosen.append(path)
        if len(path) < shape.max_depth:
            frontier[path + (0,)] = value * ranks[0]  # its first child
        if path[-1] + 1 < len(ranks):  # its next sibling
            frontier[path[:-1] + (path[-1] + 1,)] = value / ranks[path[-1]] * ranks[path[-1] + 1]
    return sorted(chosen, key=lambda p: (len(p), p))
