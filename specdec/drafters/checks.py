"""What the engine checks of a drafter's output before it verifies it. A check that fails raises a
ValueError inside the engine's drafter-failure guard, so a drafter bug degrades its sequences to
plain decoding (strict mode, the tests: it raises) instead of crashing the step or, worse, letting
the verifier read a token outside the vocabulary."""

from __future__ import annotations

from specdec.drafters.base import DraftProposal
from specdec.tree import DraftTree, TreeShape


def check_proposal(proposal: DraftProposal, num_wanted: list[int], vocab_size: int) -> DraftProposal:
    """``proposal`` unchanged, or a ValueError unless it holds at most ``num_wanted[b]`` drafts per row,
    token ids in the vocabulary and a q [B, k, V] per draft where it has one."""
    ids, B = proposal.draft_token_ids, len(num_wanted)
    if ids.dim() != 2 or ids.shape[0] != B or len(proposal.num_draft_tokens) != B:
        raise ValueError(f"propose returned drafts of shape {tuple(ids.shape)} for {B} sequences; "
                         "return [B, k] token ids and one draft count per row")
    rows = proposal.token_rows()  # [B, k] on the host: a few ints, cheaper than tensor ops per row at batch 1
    for b, (n, want) in enumerate(zip(proposal.num_draft_tokens, num_wanted)):
        if not 0 <= n <= min(want, ids.shape[1]):
            raise ValueError(f"propose gave row {b} {n} drafts; it asked for {want} (at most {ids.shape[1]} fit)")
        if not all(0 <= t < vocab_size for t in rows[b][:n]):
            raise ValueError(f"propose's drafts for row {b} {rows[b][:n]} leave the vocabulary 0..{vocab_size - 1}")
    q = proposal.draft_probs
    if q is not None and (q.dim() != 3 or tuple(q.shape[:2]) != tuple(ids.shape) or q.shape[2] != vocab_size):
        raise ValueError(f"propose's draft_probs have shape {tuple(q.shape)}; the drafts need "
                         f"[{ids.shape[0]}, {ids.shape[1]}, {vocab_size}]")
    return proposal


def check_trees(trees: list[DraftTree | None], shapes: list[TreeShape | None],
                vocab_size: int) -> list[DraftTree | None]:
    """``trees`` with empty ones as None, or a ValueError unless the drafter gave one tree per row
    within its shape (None where it asked none), token ids in the vocabulary, and, for sampled
    siblings, a q under which each node could be drawn once its elder siblings are removed (what
    verify_tree's recursive rejection needs)."""
    if len(trees) != len(shapes):
        raise ValueError(f"propose_tree returned {len(trees)} trees for {len(shapes)} sequences; return one per row")
    for b, (tree, shape) in enumerate(zip(trees, shapes)):
        if tree is None or tree.num_nodes == 0:
            continue
        depth = max(tree.depths())
        children = max(sum(1 for p in tree.parents if p == node) for node in range(-1, tree.num_nodes))
        if (shape is None or tree.num_nodes > shape.num_nodes or depth > shape.max_depth
                or children > shape.max_children):
            raise ValueError(f"propose_tree's tree for row {b} ({tree.num_nodes} nodes, depth {depth}, {children} "
                             f"children at most) exceeds the shape asked for: {shape}")
        if not all(0 <= t < vocab_size for t in tree.token_ids):
            raise ValueError(f"propose_tree's tree for row {b} has token ids outside the vocabulary "
                             f"0..{vocab_size - 1}")
        if tree.draft_probs is not None:
            _check_siblings(tree, b, vocab_size)
    return [t if t is not None and t.num_nodes > 0 else None for t in trees]


def _check_siblings(tree: DraftTree, b: int, vocab_size: int) -> None:
    q = tree.draft_probs  # [N, V]
    if tuple(q.shape) != (tree.num_nodes, vocab_size):
        raise ValueError(f"propose_tree's draft_probs for row {b} have shape {tuple(q.shape)}; "
                         f"the tree needs [{tree.num_nodes}, {vocab_size}]")
    own = q[list(range(tree.num_nodes)), tree.token_ids].tolist()  # [N] q(x) of each node's own token
    for parent in range(-1, tree.num_nodes):
        tokens = [tree.token_ids[c] for c in tree.children(parent)]
        if len(set(tokens)) != len(tokens):
            raise ValueError(f"propose_tree's tree for row {b} repeats a token among siblings {tokens}: "
                             "siblings are drawn from q without replacement")
    for c, p in enumerate(own):
        if not p > 0:
            raise ValueError(f"propose_tree's tree for row {b}: node {c} (token {tree.token_ids[c]}) has "
                             "probability 0 under its draft_probs; pass draft_probs=None for deterministic candidates")
