"""``method: "layer_skip"``: self-speculation with the target's first layers.

The draft is the target truncated to its first ``num_draft_layers`` layers, followed by the
target's own final norm and LM head: no second copy of any weight. It also shares the target's
KV cache. For committed tokens the first layers' keys and values are exactly what the target
computed, so the draft reads them as they are; the draft writes its own entries only at the
positions it drafts, and the target's verify pass over those same positions overwrites them
(all layers) before anything else reads them.
"""

from __future__ import annotations

import torch

from specdec.drafters.autoregressive import draft_autoregressive
from specdec.drafters.base import DraftProposal, Drafter, KvUse
from specdec.models.base import ForwardBatch, ModelRunner
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.tree import TreeShape


class LayerSkipDrafter(Drafter):
    def __init__(self, target: ModelRunner, num_draft_layers: int | None = None, draft_p_min: float = 0.0):
        n = num_draft_layers or max(1, target.num_layers // 4)
        if not 1 <= n < target.num_layers:
            raise ValueError(f"num_draft_layers must be in 1..{target.num_layers - 1} for this "
                             f"{target.num_layers}-layer target, got {n}")
        self.target = target
        self.num_draft_layers = n
        self.draft_p_min = draft_p_min

    def propose(self, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        # The engine has put the batch in the target cache's rows 0..B-1 and each sequence's cache
        # holds its history but the newest token (num_computed = len - 1): feed that token first.
        start = [s.num_computed for s in seqs]
        last = torch.tensor([[s.token_ids[-1]] for s in seqs], device=self.target.device)  # [B, 1]
        n = self.num_draft_layers
        logits = self.target.forward(ForwardBatch.dense(last, start, logits="last", num_layers=n))  # [B, V]

        def feed(x: torch.Tensor, i: int) -> torch.Tensor:  # x [B] -> logits [B, V]
            return self.target.forward(ForwardBatch.dense(x[:, None], [p + 1 + i for p in start], logits="last",
                                                          num_layers=n))

        return draft_autoregressive(logits, feed, seqs, num_draft, sb, self.draft_p_min)

    def kv_use(self, k: int, tree: TreeShape | None = None) -> list[KvUse]:
        """None of its own: its keys and values live in the target's cache, at positions the target's
        verify pass writes anyway (the module docstring), so the target's share of the budget covers them."""
        return []
