"""``method: "draft_model"``: a small model with the target's vocabulary, run by the same runner.

The draft keeps its own KV cache. Before drafting it compares the tokens it has
cached for a sequence with the sequence's committed history, keeps the longest
common prefix (rolling back is a length change) and feeds the rest: usually
one token (the target's recovered or bonus token), two after a full acceptance.
Where every row feeds one token and drafts a chain of argmaxes or of draws, that
token is the first step of one ``greedy_steps`` / ``sampled_steps`` call that
drafts x_1..x_k (a round's draft in one runner call).

Trees (``propose_tree``, a runner that can_verify_trees): EAGLE-2's dynamic expansion
(tree_expand.py), one tree pass of the draft per level. A tree pass writes its nodes' KV past the
history (``ForwardBatch.parents``); the next round keeps the accepted path's nodes that the last
pass holds (``compact``) and feeds only what is left, as after a chain. On a runner that cannot
run tree passes (llama.cpp) ``can_draft_trees`` is False and ``propose_tree`` gives its chain.
"""

from __future__ import annotations

import torch

from specdec.drafters.autoregressive import (argmax_drafts, draft_autoregressive, every_row_draws, greedy_chain,
                                              sampled_chain)
from specdec.drafters.base import DraftProposal, Drafter, KvUse, chains_as_trees, grew_from, runner_kv
from specdec.drafters.tree_expand import SIBLINGS, Block, QCalibration, RankAcceptance, draft_tree
from specdec.models.base import ForwardBatch, ModelRunner, long_tensor
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.tree import DraftTree, TreeShape

CATCH_UP_TOGETHER = 4  # newcomers' chunks up to this long ride along in the running rows' forward


def tree_block_size(tree: TreeShape) -> int:
    """The most nodes one tree pass of ``tree_expand.draft_tree`` feeds a row within ``tree``: the nodes
    it expands (at most max_children at a level, or a sampled tree's fixed shape) and their ancestors."""
    return max(tree.num_nodes, tree.max_children * max(tree.max_depth - 1, 1))


class DraftModelDrafter(Drafter):
    def __init__(self, runner: ModelRunner, draft_p_min: float = 0.0, siblings: str = "sampled"):
        if siblings not in SIBLINGS:
            raise ValueError(f"siblings must be one of {SIBLINGS}, got {siblings!r}")
        self.runner = runner
        self.draft_p_min = draft_p_min
        self.siblings = siblings  # a tree's candidates: the draft's top tokens, or drawn from q (tree_expand.py)
        self.rank_acceptance = RankAcceptance()  # sizes sampled trees from how their siblings fared
        self.q_calibration = QCalibration()  # values top-k candidates by how often such a q was accepted
        self.cached: dict[int, list[int]] = {}  # seq_id -> tokens whose KV sits in the draft cache
        self.committed: dict[int, int] = {}  # seq_id -> history length at the last proposal (surely still valid)
        self.tree_slots: dict[int, Block] = {}  # seq_id -> the last tree pass's nodes, in the slots past cached

    @property
    def can_draft_trees(self) -> bool:
        return self.runner.can_verify_trees  # its tree passes are the runner's (llama.cpp: chains only)

    def propose(self, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        is_new, starts, chunks = self._plan(seqs)
        k = max(num_draft, default=0)
        if k > 0 and not any(is_new) and all(len(c) == 1 for c in chunks):  # the usual round: one token a row to feed
            # the catch-up is the chain's first step: x_1..x_k from one greedy_steps / sampled_steps call
            last = [c[0] for c in chunks]
            if argmax_drafts(seqs, sb, self.draft_p_min):
                proposal = DraftProposal.of_rows(self.runner.greedy_steps(last, starts, k), None, num_draft,
                                                 self.runner.device)
            elif every_row_draws(seqs, num_draft, sb, self.draft_p_min):
                proposal = sampled_chain(lambda pick, n: self.runner.sampled_steps(last, starts, n, pick), seqs, k, sb,
                                         self.runner.device)
            else:
                proposal = None
            if proposal is not None:
                self._remember(seqs, proposal)
                return proposal
        if argmax_drafts(seqs, sb, self.draft_p_min):  # x_1 the catch-up's argmax, the rest in one call
            first, pos = self._catch_up_rows(is_new, starts, chunks, argmax=True)  # [B]
            proposal = greedy_chain(first, lambda x, n: self.runner.greedy_steps(x, pos, n), num_draft,
                                    self.runner.device)
            self._remember(seqs, proposal)
            return proposal
        logits, pos = self._catch_up_rows(is_new, starts, chunks)  # [B, V] after each history

        def feed(x: torch.Tensor, i: int) -> torch.Tensor:  # x [B] -> logits [B, V]
            return self.runner.forward(ForwardBatch.dense(x[:, None], [p + i for p in pos], logits="last"))

        def greedy(x: list[int], n: int) -> list[list[int]]:  # x [B] fed at pos -> the next n argmaxes [B, n]
            return self.runner.greedy_steps(x, pos, n)

        def sampled(x: list[int], n: int, pick) -> list[list[int]]:  # x [B] fed at pos, then n picks fed [B, n]
            return self.runner.sampled_steps(x, pos, n, pick)

        proposal = draft_autoregressive(logits, feed, seqs, num_draft, sb, self.draft_p_min, greedy, sampled)
        self._remember(seqs, proposal)
        return proposal

    def _remember(self, seqs: list[Sequence], proposal: DraftProposal) -> None:
        """What the cache now holds: each history plus the drafts that were fed (all but the last)."""
        for s, row in zip(seqs, proposal.token_rows()):
            self.cached[s.seq_id] = s.token_ids + row[:-1]
            self.committed[s.seq_id] = len(s.token_ids)

    def propose_tree(self, seqs: list[Sequence], shapes: list[TreeShape | None], sb: SamplingBatch) -> list[DraftTree | None]:
        """EAGLE-2's dynamic tree (tree_expand.py), one tree pass of the draft per level. The cache then
        holds each history; the slots past it hold the last pass's nodes, and the next round keeps
        (``compact``) those on the accepted path instead of feeding them again."""
        if not self.can_draft_trees:  # a chain, the best this runner can draft
            return chains_as_trees(self, seqs, shapes, sb)
        logits, pos = self._sync(seqs)  # [B, V]
        last: list[Block | None] = [None] * len(seqs)  # what each row's slots past its history hold

        def feed(blocks: list[Block | None]) -> list[torch.Tensor | None]:
            T = max(len(k.tokens) for k in blocks if k is not None)
            L = max(len(k.want) for k in blocks if k is not None)
            tokens = torch.zeros(len(blocks), T, dtype=torch.long)  # [B, T]; padding: token 0 under the root
            parents = [[-1] * T for _ in blocks]
            index = torch.zeros(len(blocks), L, dtype=torch.long)  # [B, L]
            for b, k in enumerate(blocks):
                last[b] = k  # a row without a block gets padding over its slots
                if k is not None:
                    tokens[b, : len(k.tokens)] = torch.tensor(k.tokens)
                    parents[b][: len(k.parents)] = k.parents
                    index[b, : len(k.want)] = torch.tensor(k.want)
            batch = ForwardBatch(tokens.to(self.runner.device), list(pos), [T] * len(blocks),
                                 index.to(self.runner.device), parents=parents)
            out = self.runner.forward(batch)  # [B, L, V]
            return [None if k is None else out[b, : len(k.want)] for b, k in enumerate(blocks)]

        k = max((x.max_children for x in shapes if x is not None), default=1)
        trees = draft_tree(logits, feed, seqs, shapes, sb, self.draft_p_min, self.siblings,
                           self.rank_acceptance.probs(seqs, k), self.q_calibration)
        self.rank_acceptance.propose(seqs, trees)
        for b, s in enumerate(seqs):
            self.cached[s.seq_id] = list(s.token_ids)
            self.committed[s.seq_id] = len(s.token_ids)
            if last[b] is not None:
                self.tree_slots[s.seq_id] = last[b]
        return trees

    def _sync(self, seqs: list[Sequence], argmax: bool = False) -> tuple[torch.Tensor | list, list[int]]:
        """Bring the draft cache to each history (``_plan``, then ``_catch_up_rows``): the logits after each
        history [B, V] (``argmax``: their argmax as lists [B]) and the histories' lengths."""
        return self._catch_up_rows(*self._plan(seqs), argmax=argmax)

    def _plan(self, seqs: list[Sequence]) -> tuple[list[bool], list[int], list[list[int]]]:
        """What the draft cache lacks of each history: keep the longest common prefix (after keeping the last
        tree pass's nodes on the accepted path). Returns (which rows are new, where each row's feed starts, the
        tokens it feeds: at least the newest one)."""
        is_new = self.runner.sync_rows([s.seq_id for s in seqs])
        self._keep_accepted_paths(seqs, is_new)
        starts, chunks = [], []
        for s, new in zip(seqs, is_new):
            cached = [] if new else self.cached[s.seq_id]
            m = 0 if new else min(self.committed[s.seq_id], len(s.token_ids) - 1)  # the newest token is always fed
            limit = min(len(cached), len(s.token_ids) - 1)
            while m < limit and cached[m] == s.token_ids[m]:
                m += 1
            starts.append(m)
            chunks.append(s.token_ids[m:])
        return is_new, starts, chunks

    def _catch_up_rows(self, is_new: list[bool], starts: list[int], chunks: list[list[int]],
                       argmax: bool = False) -> tuple[torch.Tensor | list, list[int]]:
        """Feed ``_plan``'s chunks. Returns the logits after each history [B, V] (``argmax``: their argmax as
        lists [B]) and the histories' lengths."""
        B = len(chunks)
        # Newcomers join at the end of the batch with their whole prompt: they catch up in a forward
        # of their own, so the running rows' one- or two-token feeds are not padded to a prompt's length.
        split = B
        while split > 0 and is_new[split - 1]:
            split -= 1
        if split in (0, B) or max(len(c) for c in chunks[split:]) <= CATCH_UP_TOGETHER:
            split = B
        parts = [self._catch_up(chunks[lo:hi], starts[lo:hi], lo, argmax) for lo, hi in ((0, split), (split, B)) if hi > lo]
        if argmax:
            out = [row for part in parts for row in part]  # [B]
        else:
            out = parts[0] if len(parts) == 1 else torch.cat(parts)  # [B, V]
        return out, [s + len(c) for s, c in zip(starts, chunks)]

    def _keep_accepted_paths(self, seqs: list[Sequence], is_new: list[bool]) -> None:
        """After a tree round: the nodes of the last tree pass that the history now holds, root down,
        move to consecutive slots after the history they continued (one ``compact`` for all rows)."""
        rows, starts, keeps = [], [], []
        for b, (s, new) in enumerate(zip(seqs, is_new)):
            block = self.tree_slots.pop(s.seq_id, None)
            if block is None or new:
                continue
            cached = self.cached[s.seq_id]
            n = len(cached)
            if not grew_from(cached, s.token_ids) or len(s.token_ids) <= n:
                continue
            keep, at = [], -1  # block indices on the path, the last one kept
            for t in s.token_ids[n:]:
                nxt = next((j for j in range(len(block.tokens))
                            if block.parents[j] == at and block.tokens[j] == t), None)
                if nxt is None:
                    break
                keep.append(nxt)
                at = nxt
            if keep:
                rows.append(b)
                starts.append(n)
                keeps.append(keep)
                self.cached[s.seq_id] = cached + [block.tokens[j] for j in keep]
        if rows:
            self.runner.compact(rows, starts, keeps)

    def _catch_up(self, chunks: list[list[int]], starts: list[int], row_offset: int,
                  argmax: bool = False) -> torch.Tensor | list:
        """Feed each row's chunk at its start; returns the logits after each chunk's last token [B, V]
        (``argmax``: their argmax as lists [B])."""
        batch = ForwardBatch.from_rows(chunks, starts, logits="last", row_offset=row_offset, device=self.runner.device)
        return self.runner.forward_argmax(batch) if argmax else self.runner.forward(batch)

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        self.rank_acceptance.observe(seqs, num_accepted)
        self.q_calibration.observe(seqs, num_accepted)

    def kv_use(self, k: int, tree: TreeShape | None = None) -> list[KvUse]:
        """Its cache holds each history, then a chain's fed drafts (k - 1, and the padding position past
        the longest row of a catch-up: k in all) or a tree pass's block and its padding position."""
        block = tree_block_size(tree) + 1 if tree is not None and self.can_draft_trees else 0
        return [runner_kv(self.runner, extra=max(k, block))]

    def bound_caches(self, target_positions: int | None) -> None:
        self.runner.max_cache_positions = target_positions

    def release_memory(self) -> None:
        self.runner.release()  # every row starts empty again; propose() notices new rows
        self.tree_slots.clear()

    def release(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.cached.pop(s.seq_id, None)
            self.committed.pop(s.seq_id, None)
            self.tree_slots.pop(s.seq_id, None)
        self.rank_acceptance.release(seqs)
        self.q_calibration.release(seqs)
