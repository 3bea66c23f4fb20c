"""What a round records (the engine's step 5), alike for chain, tree and plain rounds: the engine's
counters and each sequence's (metrics.py), and the adaptive controller's costs (adaptive/)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.adaptive import AdaptiveK
from specdec.metrics import SpecDecodingStats
from specdec.sequence import Sequence
from specdec.tree import DraftTree


@dataclass
class RoundRecord:
    """One round's outcome; lists are [B]."""

    drafted: list[int]  # drafts verified per row (a tree: its nodes)
    accepted: list[int]  # drafts accepted per row (a tree: its accepted path's length)
    asked: list[int]  # drafts (nodes) asked of the drafter per row
    sources: list[str]  # the method that drafted each row
    draft_s: float
    verify_s: float
    timed: bool = True  # False: the pass also carried a prompt, or followed a prefill (the controller skips its times)
    depths: list[int] | None = None  # a tree round: each row's tree depth
    trees: list[DraftTree | None] | None = None  # a tree round: the trees and the accepted paths
    paths: list[list[int]] | None = None
    plain_steps: int = 0  # a plain round of several greedy steps in one runner call: how many

    def file(self, seqs: list[Sequence], stats: SpecDecodingStats, controller: AdaptiveK | None) -> None:
        """Count the round in ``stats`` and in each sequence's (charged the round's whole draft and
        verify time), and give the controller its costs."""
        ids, verify_s = [s.seq_id for s in seqs], self.verify_s
        if self.plain_steps:
            stats.record_plain_steps(len(seqs), self.plain_steps)
            for s in seqs:
                s.stats.record_plain(self.plain_steps, verify_s)
            if controller is not None:
                controller.record(ids, self.drafted, self.accepted, 0.0,
                                  verify_s / self.plain_steps if self.timed else None, num_steps=self.plain_steps)
        else:
            if self.depths is None:
                stats.record_round(self.drafted, self.accepted, self.asked)
            else:
                stats.record_tree_round(self.drafted, self.depths, self.accepted, self.asked)
            stats.record_sources(self.drafted, self.accepted, self.sources)
            for b, s in enumerate(seqs):
                s.stats.record(self.drafted[b], self.accepted[b], self.asked[b], self.sources[b], self.draft_s,
                               verify_s, **({} if self.depths is None else {"depth": self.depths[b]}))
            if controller is not None and self.depths is None:  # a pass that carried a prompt times no verify
                controller.record(ids, self.drafted, self.accepted, self.draft_s, verify_s if self.timed else None)
            elif controller is not None:  # tokens per pass and costs per node count (adaptive/)
                controller.record_tree(ids, self.drafted, self.accepted, self.draft_s, verify_s if self.timed else None,
                                       trees=self.trees, paths=self.paths)
        stats.draft_time_s += self.draft_s
        stats.verify_time_s += verify_s
