"""Suffix decoding in front of a model drafter (``"enable_suffix_decoding": true`` with ``draft_model``
or ``layer_skip``), as Arctic Inference pairs suffix decoding with its speculator.

Each round, per sequence, the suffix tries propose first: that costs no forward pass. A sequence
whose suffix draft is expected to have at least ``min_score`` tokens accepted (the summed path
probabilities that rank suffix drafts, SuffixDrafter) takes it; the others draft with the model.
When no sequence needs the model it does not run at all: text that repeats (code, a template,
an earlier answer) is drafted for the cost of a dictionary walk, and the model covers the rest.
A draft model catches up on the tokens it missed the next time it runs, in that same forward.

Suffix drafts are deterministic (q = one-hot); the model's are sampled from q. Next to a
sampled model draft, a suffix row's q is its one-hot, so the verifier's rule stays exact per row.

Trees (``propose_tree``): the same choice per row (the suffix chain's score), then the suffix
trie's tree for the rows it takes and the model's tree (its chain where it cannot branch) for the rest.

A seeded sampled row drafts with the suffix tries alone, whatever its score (``policy.seeded_members``):
the score reads the global trie, which earlier and running requests' outputs fill, so it must not
decide how the row draws; the tries' one-hot drafts leave the row its plain output.
"""

from __future__ import annotations

from specdec.drafters.base import DraftProposal, Drafter, KvUse, chains_as_trees
from specdec.drafters.merge import merge_proposals
from specdec.drafters.suffix import SuffixDrafter
from specdec.policy import is_seeded, seeded_members
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.tree import DraftTree, TreeShape


class HybridDrafter(Drafter):
    def __init__(self, suffix: SuffixDrafter, model: Drafter, min_score: float):
        if min_score < 0:
            raise ValueError(f"min_score must be >= 0, got {min_score}")
        self.suffix, self.model, self.min_score = suffix, model, min_score
        self.seeded_suffix = seeded_members(["suffix", model.method])[0] == "suffix"  # who drafts seeded rows
        self.suffix_rows = 0  # sequence-rounds drafted from the suffix tries, and by the model
        self.model_rows = 0

    def propose(self, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        # 1. the suffix tries' draft and its expected accepted length, per sequence that drafts
        rows: list[list[int] | None] = []  # None: the model drafts this row
        for s, want in zip(seqs, num_draft):
            if want == 0:
                self.suffix.sync(s)
                rows.append([])
                continue
            draft, score = self.suffix.draft(s, want)
            if is_seeded(s.params):
                rows.append(draft if self.seeded_suffix else None)
            else:
                rows.append(draft if draft and score >= min(self.min_score, want) else None)
        model_want = [want if r is None else 0 for r, want in zip(rows, num_draft)]
        self.suffix_rows += sum(1 for r in rows if r)
        self.model_rows += sum(1 for w in model_want if w)
        suffix = DraftProposal.from_rows([r or [] for r in rows], sb.device)
        if not any(model_want):
            suffix.sources = ["suffix"] * len(seqs)
            return suffix

        # 2. the model drafts the other rows (they ask for 0 of it otherwise); one proposal, row by row
        parts = {"suffix": suffix, self.model.method: self.model.propose(seqs, model_want, sb)}
        owner = ["suffix" if r else self.model.method for r in rows]
        return merge_proposals(parts, owner, sb.device)

    can_draft_trees = True  # the suffix tries' trees; the model's where it branches, else its chains
    tree_sources: list[str] | None = None  # [B] the method that drafted each row of the last propose_tree

    def propose_tree(self, seqs: list[Sequence], shapes: list[TreeShape | None], sb: SamplingBatch) -> list[DraftTree | None]:
        """As ``propose``, with the suffix trie's tree for a row whose suffix chain would be taken (the
        same score decides) and the model's tree (or chain, where it cannot branch) for the others."""
        trees: list[DraftTree | None] = []
        model_shapes: list[TreeShape | None] = []
        for s, shape in zip(seqs, shapes):
            if shape is None:
                self.suffix.sync(s)
                trees.append(None)
                model_shapes.append(None)
                continue
            tree, score = self.suffix.draft_tree(s, shape)
            take = tree is not None and score >= min(self.min_score, shape.max_depth)
            if is_seeded(s.params):
                take = self.seeded_suffix
            trees.append(tree if take else None)
            model_shapes.append(None if take else shape)
        self.suffix_rows += sum(1 for t in trees if t is not None)
        self.model_rows += sum(1 for m in model_shapes if m is not None)
        self.tree_sources = ["suffix" if m is None else self.model.method for m in model_shapes]
        if not any(m is not None for m in model_shapes):
            return trees
        if self.model.can_draft_trees:
            model = self.model.propose_tree(seqs, model_shapes, sb)
        else:
            model = chains_as_trees(self.model, seqs, model_shapes, sb)
        return [t if m is None else mt for t, m, mt in zip(trees, model_shapes, model)]

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        self.suffix.observe(seqs, num_accepted)
        self.model.observe(seqs, num_accepted)

    def release(self, seqs: list[Sequence]) -> None:
        self.suffix.release(seqs)
        self.model.release(seqs)

    def bound_caches(self, target_positions: int | None) -> None:
        self.model.bound_caches(target_positions)

    def release_memory(self) -> None:
        self.suffix.release_memory()
        self.model.release_memory()

    def kv_use(self, k: int, tree: TreeShape | None = None) -> list[KvUse]:
        return self.suffix.kv_use(k, tree) + self.model.kv_use(k, tree)
