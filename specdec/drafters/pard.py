"""``method: "draft_model"`` with ``parallel_drafting``: a parallel draft model (PARD, AMD 2025).

The draft was adapted with a mask token: after a history it reads the history's tokens followed by
k - 1 masks, and the logits at the last history token and at mask j are its distributions for
drafts 1 and j + 1. So one forward proposes all k drafts (and their q when the row samples), where
an autoregressive draft runs k. The drafts do not condition on one another: draft j + 1 is sampled
from q_{j+1}(. | history), which is what rejection sampling is told, so verification stays exact.

The cache is the draft model's (DraftModelDrafter's longest-common-prefix catch-up), with one
difference: it keeps the committed history only. The masks' KV sits past it and the next round
writes over it (rollback is a length change), and the drafts that were accepted are fed again as
tokens, since their KV was computed from masks.

Trees: the one forward's distributions q_1..q_D, one per depth, branch into a tree without another
forward (as Medusa's heads do): a node at depth d gets its children from q_{d+1}, its top tokens or,
for a sampled row, tokens drawn from it without replacement. q_{d+1} does not depend on the node's
path, and that is what verification is told (each node's draft_probs), so trees stay exact too.

The mask token and the most drafts it was trained for come from the draft's config.json
(``pard_token``, PARD's and vLLM's name; ``mask_token_id`` or ``ptd_token_id`` also read;
``pard_max_k``, written by ``specdec distill --method pard``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specdec.drafters.autoregressive import argmax_drafts, draft_autoregressive
from specdec.drafters.base import DraftProposal, KvUse, runner_kv
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.tree_expand import Block, draft_tree
from specdec.models.base import ForwardBatch, ModelRunner, long_tensor
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.tree import DraftTree, TreeShape, depths_of

MASK_TOKEN_KEYS = ("pard_token", "mask_token_id", "ptd_token_id")  # config.json fields naming the mask token
MAX_K_KEY = "pard_max_k"  # config.json: the most drafts (1 + masks) the draft was trained to propose


def pard_settings(config: dict | None, name: str, k: int, rows: int) -> tuple[int, int | None]:
    """(mask token id, the most drafts it was trained for or None) from the draft's config.json
    ``config``; a ValueError naming what is missing or out of range. ``k``: the most drafts a round
    asks; ``rows``: the draft's embedding rows (the mask must be one of them)."""
    if config is None:
        raise ValueError(f"parallel_drafting: draft {name!r} is a GGUF file, which does not name its mask token; "
                         "pass the draft's Hugging Face folder (its config.json has 'pard_token')")
    key = next((key for key in MASK_TOKEN_KEYS if isinstance(config.get(key), int)), None)
    if key is None:
        raise ValueError(f"parallel_drafting: draft {name!r} has no mask token in its config.json (none of "
                         f"{', '.join(MASK_TOKEN_KEYS)}), so it was not trained for parallel drafting; adapt it "
                         "with `specdec distill --method pard --init-draft DRAFT`, or drop parallel_drafting")
    mask = config[key]
    if not 0 <= mask < rows:
        raise ValueError(f"parallel_drafting: draft {name!r} names mask token {mask} ({key}) but has {rows} "
                         "embedding rows; its config.json and weights disagree")
    max_k = config.get(MAX_K_KEY)
    if max_k is not None:
        if not (isinstance(max_k, int) and max_k >= 1):
            raise ValueError(f"parallel_drafting: draft {name!r} has {MAX_K_KEY}={max_k!r} in its config.json; "
                             "it must be an integer >= 1")
        if k > max_k:
            raise ValueError(f"parallel_drafting: draft {name!r} was trained to propose at most {max_k} drafts "
                             f"per forward ({MAX_K_KEY}) but num_speculative_tokens={k}; lower "
                             f"num_speculative_tokens to {max_k} or train the draft for more")
    return mask, max_k


class ParallelDraftDrafter(DraftModelDrafter):
    """A draft model that proposes k tokens from one forward over the history and k - 1 masks."""

    parallel_drafting = True  # one draft forward per round whatever k: the cost model charges it per round

    def __init__(self, runner: ModelRunner, mask_token_id: int, max_k: int | None = None, draft_p_min: float = 0.0):
        super().__init__(runner, draft_p_min)
        self.mask_token_id = mask_token_id
        self.max_k = max_k
        self.num_masks = 0  # masks the next catch-up appends to each row (propose sets it)

    @property
    def can_draft_trees(self) -> bool:
        return True  # the one forward's per-depth distributions branch without another forward

    def propose(self, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        k = max(num_draft, default=0)
        if k == 0:  # nothing to draft: the cache catches up next time
            return DraftProposal.from_rows([[] for _ in seqs], self.runner.device)
        if self.max_k is not None and k > self.max_k:
            raise ValueError(f"the parallel draft was trained for at most {self.max_k} drafts, asked for {k}")
        self.num_masks = k - 1
        if argmax_drafts(seqs, sb, self.draft_p_min):
            ids, _ = self._sync(seqs, argmax=True)  # [B][k]: every draft at once, the argmaxes alone
            proposal = DraftProposal(long_tensor(ids, self.runner.device), None, list(num_draft))
        else:  # the drafts do not condition on one another: "feeding" draft i reads the next mask's logits
            logits, _ = self._sync(seqs)  # [B, k, V]: at the last history token, then at each mask
            proposal = draft_autoregressive(logits[:, 0], lambda x, i: logits[:, i + 1], seqs, num_draft, sb,
                                            self.draft_p_min)
        for s in seqs:  # the cache keeps the history; the masks past it are overwritten next round
            self.cached[s.seq_id] = list(s.token_ids)
            self.committed[s.seq_id] = len(s.token_ids)
        return proposal

    def bind(self, controller) -> None:
        """The adaptive controller times and charges this draft per round, by k (cost_model.round_cost)."""
        if controller is not None:
            controller.set_parallel_draft(True)

    def propose_tree(self, seqs: list[Sequence], shapes: list[TreeShape | None],
                     sb: SamplingBatch) -> list[DraftTree | None]:
        """A tree per row from one forward over its history and D - 1 masks (D: the deepest shape):
        the children of a node at depth d are candidates from q_{d+1} (tree_expand.draft_tree, whose
        ``feed`` here reads the forward's logits instead of running the draft again)."""
        if self.max_k is not None:  # the draft proposes at most max_k depths from one forward
            shapes = [s if s is None or s.max_depth <= self.max_k else replace(s, max_depth=self.max_k)
                      for s in shapes]
        depth = max((s.max_depth for s in shapes if s is not None), default=0)
        if depth == 0:
            return [None] * len(seqs)
        self.num_masks = depth - 1
        logits, _ = self._sync(seqs)  # [B, D, V]: q_1 after the history, q_{j+1} at mask j

        def feed(blocks: list[Block | None]) -> list[torch.Tensor | None]:  # no forward: q by the node's depth
            out: list[torch.Tensor | None] = []
            for b, block in enumerate(blocks):
                d = depths_of(block.parents) if block is not None else []  # 0: a child of the root
                out.append(None if block is None else logits[b, [d[i] + 1 for i in block.want]])  # [L, V]
            return out

        k = max((s.max_children for s in shapes if s is not None), default=1)
        trees = draft_tree(logits[:, 0], feed, seqs, shapes, sb, self.draft_p_min, self.siblings,
                           self.rank_acceptance.probs(seqs, k), self.q_calibration)
        self.rank_acceptance.propose(seqs, trees)
        for s in seqs:  # as for chains: the cache keeps the history, the masks past it are overwritten
            self.cached[s.seq_id] = list(s.token_ids)
            self.committed[s.seq_id] = len(s.token_ids)
        return trees

    def kv_use(self, k: int, tree: TreeShape | None = None) -> list[KvUse]:
        """Its cache holds each history, then the masks of one forward (k - 1, or the tree's depth - 1)
        and the padding position past the longest row of a catch-up."""
        return [runner_kv(self.runner, extra=max(k, tree.max_depth if tree is not None else 0))]

    def _catch_up(self, chunks: list[list[int]], starts: list[int], row_offset: int,
                  argmax: bool = False) -> torch.Tensor | list:
        """Feed each row's chunk and ``num_masks`` masks at its start; returns the logits at the chunk's
        last token and at each mask [B, num_masks + 1, V] (``argmax``: their argmax as lists [B][L])."""
        rows = [c + [self.mask_token_id] * self.num_masks for c in chunks]
        batch = ForwardBatch.from_rows(rows, starts, logits=self.num_masks + 1, row_offset=row_offset,
                                       device=self.runner.device)
        if argmax:
            return self.runner.forward_argmax(batch)
        out = self.runner.forward(batch)
        return out if out.dim() == 3 else out[:, None]  # [B, L, V]
