"""The one small interface every drafter implements.

A drafter sees the committed history of each sequence (``seq.token_ids``) and
proposes up to k tokens for it. It reconciles its own state (a KV cache, an
index over text) with that history itself: the engine never tells it about
rollbacks, joins or departures beyond calling ``propose`` with the current batch
and ``observe`` with what was accepted.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specdec.models.base import long_tensor, pad_rows
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.tree import DraftTree, TreeShape


@dataclass
class DraftProposal:
    draft_token_ids: torch.Tensor  # [B, k_max] long; row b's drafts are its first num_draft_tokens[b]
    draft_probs: torch.Tensor | None  # [B, k_max, V]: q_i each draft was sampled from; None when drafts
    #                                    are deterministic (q = one-hot), as for greedy or lookup drafters
    num_draft_tokens: list[int]  # [B] drafts per row, 0..k_max; a row may propose fewer than asked
    sources: list[str] | None = None  # [B] the method that drafted each row (a drafter that picks among
    #                                   several says which); None: every row's is the drafter's ``method``
    rows: list[list[int]] | None = None  # draft_token_ids as host lists [B][k_max] where the drafter has them
    #                                     (``token_rows`` reads the tensor once otherwise)

    def token_rows(self) -> list[list[int]]:
        """draft_token_ids as lists [B][k_max] (on the host: a round reads them several times)."""
        if self.rows is None:
            self.rows = self.draft_token_ids.tolist()
        return self.rows

    @classmethod
    def from_rows(cls, rows: list[list[int]], device: torch.device | str) -> DraftProposal:
        """Pack per-row deterministic drafts (possibly empty) into a right-padded [B, longest row] proposal."""
        return cls(pad_rows(rows, device), None, [len(r) for r in rows])  # [B, k]

    @classmethod
    def of_rows(cls, rows: list[list[int]], draft_probs: torch.Tensor | None, num_draft_tokens: list[int],
                device: torch.device | str) -> DraftProposal:
        """Drafts as lists of equal length [B][k] (row b's first num_draft_tokens[b] drafted), kept as they are."""
        return cls(long_tensor(rows, device), draft_probs, list(num_draft_tokens), rows=rows)


@dataclass(frozen=True)
class KvUse:
    """One cache a drafter keeps (or keeps in the target's cache), per row: for a row of n target tokens
    it spans ceil(per_token x n) + extra positions, allocated in steps of ``step``, each position of
    ``bytes_per_position``. What the scheduler's KV budget counts beside the target's own cache."""

    bytes_per_position: int
    per_token: float = 1.0  # its positions per target token (a draft with another tokenizer spells more)
    extra: int = 0  # positions a round writes past the history: drafts fed, tree blocks, a head's slots
    step: int = 1  # the cache grows in steps of this many positions
    min_rows: int = 1  # rows the cache holds however few run (a compiled pass traced 2+ rows)

    def positions(self, num_tokens: int) -> int:
        n = math.ceil(self.per_token * num_tokens - 1e-9) + self.extra
        return -(-n // self.step) * self.step

    def bytes(self, num_tokens: int) -> int:
        return self.bytes_per_position * self.positions(num_tokens)


class Drafter(ABC):
    method: str = ""  # the speculative method this drafter carries out (build_drafter sets it)
    can_draft_trees: bool = False  # implements propose_tree (tree.py)

    @property
    def label(self) -> str:
        """What counters and messages call this drafter: its method, else its class's name."""
        return self.method or type(self).__name__

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        """Propose up to ``num_draft[b]`` tokens continuing ``seqs[b].token_ids``."""

    def propose_tree(self, seqs: list[Sequence], shapes: list[TreeShape | None], sb: SamplingBatch) -> list[DraftTree | None]:
        """A draft tree per row within ``shapes[b]`` (None: draft nothing for row b), continuing
        ``seqs[b].token_ids``; a row may get a smaller tree, a chain, or None. ``observe`` then receives
        the number of nodes on each row's accepted path (its history already includes them)."""
        raise ValueError(f"the {self.label} drafter drafts chains only")

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Learn how many drafts of the last proposal each sequence accepted (its history already includes them)."""

    def release(self, seqs: list[Sequence]) -> None:
        """Forget finished sequences (their histories are final)."""

    def release_memory(self) -> None:
        """No sequence is running: free buffers that the next proposal can rebuild (a KV cache)."""

    def bind(self, controller) -> None:
        """Receive the engine's adaptive controller (AdaptiveK, or None when k is fixed): its measured
        verify-pass costs, for a drafter that weighs several methods against each other (choice.py)."""

    def bound_caches(self, target_positions: int | None) -> None:
        """Let its model caches grow past what they need only as far as ``target_positions`` target
        positions (all rows) take in them: the KV budget's share (None: no bound)."""

    def kv_use(self, k: int, tree: TreeShape | None = None) -> list[KvUse]:
        """What its caches hold per row when a round asks up to ``k`` drafts, or trees up to ``tree``
        (None: chains only): one KvUse per cache ([]: it keeps none). The scheduler's KV budget counts
        them beside the target's cache; a drafter never lets a cache outgrow what it says here."""
        return []

    def kv_bytes_per_token(self) -> int:
        """Bytes its caches take per target token of one row (0: it keeps none), not counting the
        positions a round writes past the history (``kv_use`` says all)."""
        return sum(math.ceil(u.bytes_per_position * u.per_token) for u in self.kv_use(0))


def runner_kv(runner, per_token: float = 1.0, extra: int = 0) -> KvUse:
    """A model runner's own KV cache as a KvUse: its bytes per position, the steps it grows in, the rows it
    holds however few run."""
    return KvUse(runner.kv_bytes_per_token(), per_token, extra, runner.cache_step, runner.min_cache_rows)


def grew_from(tokens: list[int], history: list[int], tail_check: int = 8) -> bool:
    """Whether ``history`` grew from ``tokens`` (a drafter's copy of it), checked by length and the last
    ``tail_check`` tokens: histories only grow or get replaced, so a cheap check suffices."""
    m = len(tokens)
    if m > len(history):
        return False
    w = min(m, tail_check)
    return history[m - w:m] == tokens[m - w:]


def chains_as_trees(drafter: Drafter, seqs: list[Sequence], shapes: list[TreeShape | None],
                    sb: SamplingBatch) -> list[DraftTree | None]:
    """``drafter``'s chains as trees: up to each shape's depth of drafts in a line (a drafter, or a
    drafter's runner, that cannot branch, inside a round that verifies trees)."""
    proposal = drafter.propose(seqs, [0 if s is None else s.max_depth for s in shapes], sb)
    rows = proposal.draft_token_ids.tolist()
    out: list[DraftTree | None] = []
    for b, n in enumerate(proposal.num_draft_tokens):
        probs = None if proposal.draft_probs is None else proposal.draft_probs[b, :n]  # [n, V]
        out.append(DraftTree.chain(rows[b][:n], probs) if n else None)
    return out
