"""The scheduler: the one owner of admission, for ``LLM.generate`` and the server alike.

It holds the waiting queue and the running batch and decides, between two rounds:
- who joins: waiting requests in arrival order, a request's sequences together, while there are
  seats (``max_num_seqs``), prompt tokens left in the round (``max_num_batched_tokens``) and KV
  memory (``kv_cache_memory``: ``KvBudget``: the target's cache and the drafter's, when it keeps one). A request that
  does not fit waits, and everyone behind it waits too: none overtakes, so none starves;
- how they join: small prompts ride in the next verify pass, others get a prefill of their own;
- what each row asks of the drafter (k per row, from the adaptive controller when there is one; or a
  draft tree's shape per row, ``tree_shapes``) and whether a round takes several plain steps in one
  runner call;
- who leaves: finished sequences, their places filled from the end of the batch so the cache rows
  (which follow batch order) move as little as possible.
Its bounds are one ``SchedulerConfig`` (config.py). The engine carries these decisions out
(engine.py); ``RoundBatch`` is what one round runs on.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import islice

import torch

from specdec.adaptive import AdaptiveK
from specdec.config import SchedulerConfig
from specdec.drafters.base import Drafter, KvUse
from specdec.models.base import ForwardBatch, long_tensor, pad_rows
from specdec.models.kv_cache import CACHE_STEP
from specdec.policy import row_tree, seeded_k, tree_round
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.tree import DraftTree, TreeShape, block_parents

MERGED_PREFILL_TOKENS = 512  # new prompts up to this many tokens in all join a running batch's verify pass


def round_up(n: int, step: int = CACHE_STEP) -> int:
    """n rounded up to the steps the runners grow their KV caches in (``ModelRunner.cache_step``)."""
    return -(-n // step) * step


class KvBudget:
    """KV cache memory that admission never over-commits.

    The runners keep their caches at the most rows and the longest length reached since they were
    last released (rows x length x bytes per position), so a request may join only while
    max(peak rows, rows with it) x max(peak length, its length) still fits the budget. A row counts
    while its sequence is in the batch: a finished one until it is retired. A row of the target's
    cache spans ``positions``: its tokens and a verify pass; each of the drafter's caches
    (``Drafter.kv_use``) what it says it holds for that many tokens: another tokenizer's spelling,
    the drafts it feeds, its tree blocks, a head's slots and kept states. The server's HTTP side
    checks requests against the same object (``check``) before they join the queue.
    """

    def __init__(self, budget: int, bytes_per_token: int, max_rows: int, max_model_len: int, k: int,
                 drafter: Iterable[KvUse] = (), target_min_rows: int = 1):
        """``bytes_per_token``: the target's per position; ``k``: positions a verify pass writes past a
        row's history (drafts or tree nodes); ``drafter``: the drafter's caches; ``target_min_rows``:
        rows the target's cache holds however few run (``ModelRunner.min_cache_rows``)."""
        self.budget, self.target_bytes, self.max_rows = budget, bytes_per_token, max_rows
        self.target_min_rows = target_min_rows
        self.max_model_len, self.k, self.drafter = max_model_len, k, tuple(drafter)
        self.peak_rows = self.peak_len = 0

    @property
    def bytes_per_token(self) -> int:
        """Bytes per target position of a row, all caches, not counting what a round writes past it."""
        return self.target_bytes + sum(math.ceil(u.bytes_per_position * u.per_token) for u in self.drafter)

    def positions(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """KV positions a sequence may reach: prompt + output (within the context) + a verify pass."""
        return round_up(min(num_prompt_tokens + max_tokens, self.max_model_len) + self.k + 1)

    def bytes_for(self, rows: int, length: int) -> int:
        """Bytes of ``rows`` rows whose target cache spans ``length`` positions (``positions``), at
        most ``length - k - 1`` tokens each."""
        tokens = max(length - self.k - 1, 0)
        if not rows:
            return 0
        return (max(rows, self.target_min_rows) * length * self.target_bytes
                + sum(max(rows, u.min_rows) * u.bytes(tokens) for u in self.drafter))

    @property
    def reserved(self) -> int:
        """Bytes the caches may hold now (their peak shape)."""
        return self.bytes_for(self.peak_rows, self.peak_len)

    def check(self, lengths: list[int]) -> None:
        """ValueError for a request (its sequences' KV positions) that can never run, even alone."""
        need = self.bytes_for(len(lengths), max(lengths))
        if len(lengths) > self.max_rows or need > self.budget:
            raise ValueError(
                f"this request needs {len(lengths)} sequence(s) and {need / 2**20:.0f} MiB of KV cache; the server "
                f"runs at most {self.max_rows} sequences in {self.budget / 2**20:.0f} MiB. Lower "
                "max_tokens or n, or send fewer prompts")

    def fits(self, rows: int, length: int) -> bool:
        """Whether the caches may grow to ``rows`` rows, one of ``length`` positions."""
        return self.bytes_for(max(self.peak_rows, rows), max(self.peak_len, length)) <= self.budget

    def grow(self, rows: int, length: int) -> None:
        self.peak_rows, self.peak_len = max(self.peak_rows, rows), max(self.peak_len, length)

    def released(self) -> None:
        """The caches were freed (nothing runs): nothing counts."""
        self.peak_rows = self.peak_len = 0


@dataclass
class Admitted:
    """What one admission decided: the newcomers (at the batch's end) and how they join."""

    seqs: list[Sequence]
    merged: bool  # their prompts ride in the next verify pass; else each gets a prefill now
    release_caches: bool = False  # free the caches first: they are held at an old peak that nothing uses


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None, k: int = 0, controller: AdaptiveK | None = None,
                 kv_bytes_per_token: int = 0, max_model_len: int = 0,
                 draft_tree: str = "chain", draft_tree_max_nodes: int = 7, draft_tree_top_k: int = 4,
                 drafter: Drafter | None = None, target_min_rows: int = 1, tree_sequences: int | None = None):
        """``config``: the seats, steps, token and KV bounds (default: 256 seats, no other bound).
        ``k``: drafts asked per row (the most, with a ``controller``); ``kv_bytes_per_token``: the
        target's, and ``drafter``'s caches (``Drafter.kv_use``), for the KV budget (without
        ``drafter``: the drafter's too, per position). ``draft_tree``: "chain"
        (never trees), "auto" (trees where the controller picks them) or "tree" (always); the engine
        passes "chain" where the drafter or the target cannot do trees. A tree has at most
        ``draft_tree_max_nodes`` nodes, ``k`` levels and ``draft_tree_top_k`` children per node.
        ``tree_sequences``: the most rows x nodes a tree round may hold (``ModelRunner.max_tree_sequences``):
        with "tree" fewer rows run at once, with "auto" a larger batch verifies chains."""
        self.k, self.controller = k, controller
        self.kv_bytes_per_token, self.max_model_len, self.drafter = kv_bytes_per_token, max_model_len, drafter
        self.target_min_rows = target_min_rows  # rows the target's cache holds however few run
        self.waiting: deque[list[Sequence]] = deque()  # requests; aborted ones stay until admission skips them
        self.running: list[Sequence] = []
        self.plain_only: set[int] = set()  # sequences that decode plainly since the drafter failed on them
        self.draft_tree = draft_tree if k > 0 else "chain"
        # the most a row drafts: k levels, and no more levels than nodes (SpeculativeConfig refuses
        # draft_tree "tree" with k > draft_tree_max_nodes; "auto" trees are this deep at most)
        self.max_tree = TreeShape(draft_tree_max_nodes, max(min(k, draft_tree_max_nodes), 1), draft_tree_top_k)
        self.tree_sequences = tree_sequences
        self.config = config or SchedulerConfig()
        self.kv = self._budget()  # None: no bound (LLM.generate)

    @property
    def max_num_seqs(self) -> int:
        """Seats: the configuration's, fewer where every round verifies trees of the target's bounded size."""
        if self.draft_tree == "tree" and self.tree_sequences is not None:
            return max(1, min(self.config.max_num_seqs, self.tree_sequences // self.max_tree.num_nodes))
        return self.config.max_num_seqs

    @property
    def max_draft_positions(self) -> int:
        """KV slots a verify pass may write past a row's history: k drafts, or a tree's nodes."""
        return self.k if self.draft_tree == "chain" else max(self.k, self.max_tree.num_nodes)

    def limit(self, kv_cache_memory: int | None = None, max_num_batched_tokens: int | None = None) -> KvBudget | None:
        """Bound admission by KV memory (bytes) and prompt tokens a round (a server's limits); returns
        the KV budget the server's HTTP side checks requests against."""
        self.config = replace(self.config, kv_cache_memory=kv_cache_memory,
                              max_num_batched_tokens=max_num_batched_tokens)  # validated again
        self.kv = self._budget()
        return self.kv

    def _budget(self) -> KvBudget | None:
        if self.config.kv_cache_memory is None:
            return None
        drafter = [] if self.drafter is None or self.k == 0 else self.drafter.kv_use(
            self.k, None if self.draft_tree == "chain" else self.max_tree)
        return KvBudget(self.config.kv_cache_memory, self.kv_bytes_per_token, self.max_num_seqs, self.max_model_len,
                        self.max_draft_positions, drafter, self.target_min_rows)

    # -- the queue ----------------------------------------------------------------------------------

    def add(self, seqs: list[Sequence]) -> None:
        """Queue one request: its sequences are admitted together."""
        if len(seqs) > self.max_num_seqs:
            raise ValueError(f"a request of {len(seqs)} sequences never fits a batch of max_num_seqs="
                             f"{self.max_num_seqs}; lower n or send fewer prompts")
        self.waiting.append(list(seqs))

    def abort(self, seq: Sequence) -> None:
        """Mark a sequence finished; a waiting one is skipped at admission, a running one retires."""
        if seq.finish_reason is None:
            seq.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        while self.waiting and all(s.finished for s in self.waiting[0]):
            self.waiting.popleft()
        return bool(self.running or self.waiting)

    def waiting_seqs(self) -> list[Sequence]:
        return [s for group in self.waiting for s in group]

    def next_in_line(self) -> list[Sequence]:
        """The waiting sequences the next admission may take: the first ones, up to the free seats."""
        free = max(self.max_num_seqs - len(self.running), 0)
        return list(islice((s for group in self.waiting for s in group if not s.finished), free))

    # -- admission and retirement -------------------------------------------------------------------

    def admit(self) -> Admitted | None:
        """Move waiting requests into the batch while they fit (see the module docstring); None when none
        joins. While others decode, small prompts ride in the next verify pass, which costs far less
        than a pass of their own that reads every weight once more (vLLM's chunked prefill does the
        same); a prompt that asks for prompt_logprobs needs a pass of its own (a verify pass has no
        prompt logits)."""
        decoding = bool(self.running)
        new: list[Sequence] = []
        tokens, release = 0, False
        while self.waiting:
            group = [s for s in self.waiting[0] if not s.finished]
            if not group:
                self.waiting.popleft()
                continue
            if len(self.running) + len(new) + len(group) > self.max_num_seqs:
                break
            cost = self._prompt_tokens(group)  # a prompt alone always fits the round
            bound = self.config.max_num_batched_tokens
            if tokens and bound is not None and tokens + cost > bound:
                break
            if self.kv is not None and not self.kv.fits(len(self.running) + len(new) + len(group),
                                                        self._kv_length(group)):
                if not self.running and not new and self.kv.peak_rows:
                    self.kv.released()  # the caches are held at an old peak that nothing uses
                    release = True
                    continue
                break  # wait for running sequences to finish: admitting now would over-commit memory
            self.waiting.popleft()
            new += group
            tokens += cost
        if not new:
            return None
        self.running += new
        if self.kv is not None:
            self.kv.grow(len(self.running), self._kv_length(new))
        # With draft_tree="tree" newcomers get a prefill of their own: a round that carries a prompt
        # verifies chains (policy.tree_round), and a seeded row's round type must not depend on who joins.
        merged = (decoding and sum(s.num_prompt_tokens for s in new) <= MERGED_PREFILL_TOKENS
                  and all(s.params.prompt_logprobs is None for s in new) and self.draft_tree != "tree")
        return Admitted(new, merged, release)

    def _prompt_tokens(self, group: list[Sequence]) -> int:
        """The prompt tokens a request's prefill computes: choices of one prompt share it."""
        return sum(s.num_prompt_tokens for s in group if s.prefill_group in (None, s.seq_id))

    def _kv_length(self, seqs: list[Sequence]) -> int:
        return max(self.kv.positions(s.num_prompt_tokens, s.params.max_tokens) for s in seqs)

    def retire(self) -> list[Sequence]:
        """Drop finished sequences from the batch; returns them."""
        done = [s for s in self.running if s.finished]
        if done:
            n = len(self.running) - len(done)
            kept = self.running[:n]
            movers = iter(s for s in self.running[n:] if not s.finished)
            # survivors keep their places; those past the new end move into the holes
            self.running = [s if not s.finished else next(movers) for s in kept]
            if self.controller is not None:
                self.controller.release([s.seq_id for s in done])
            self.plain_only.difference_update(s.seq_id for s in done)
        return done

    def memory_released(self) -> None:
        """The engine freed the caches (nothing runs)."""
        if self.kv is not None:
            self.kv.released()

    @contextmanager
    def alone(self, seqs: list[Sequence]) -> Iterator[None]:
        """Within it only ``seqs`` run or join (a server retrying a failed step over part of the batch).
        The others come back after, at the batch's end; they lose their cache rows to the group's, so
        they recompute their history in their next step (num_computed = 0)."""
        ids = {s.seq_id for s in seqs}
        aside = [s for s in self.running if s.seq_id not in ids]
        waiting = self.waiting
        self.running = [s for s in self.running if s.seq_id in ids]
        self.waiting = deque(g for g in ([s for s in group if s.seq_id in ids] for group in waiting) if g)
        try:
            yield
        finally:
            for s in aside:
                s.num_computed = 0
            joined = {s.seq_id for s in self.running}
            self.running += aside
            self.waiting = deque(g for g in ([s for s in group if s.seq_id not in joined] for group in waiting) if g)

    # -- what the round asks of the drafter ---------------------------------------------------------

    def num_wanted(self, timed: bool = True) -> list[int]:
        """Drafts to ask for per running row. A sequence's first token comes from a plain pass, as
        vLLM's comes from its prefill (drafting would add the draft's prompt catch-up to the time to
        first token); drafts beyond the room left are wasted. ``timed``: the engine times this round's
        costs for the controller (``AdaptiveK.choose``)."""
        seqs = self.running
        ks = [self.k] * len(seqs)
        if self.controller is not None:  # the seeds rule: a seeded sampled row keeps k (policy.seeded_k)
            chosen = self.controller.choose([s.seq_id for s in seqs], timed)
            ks = [seeded_k(s.params, self.k, c) for s, c in zip(seqs, chosen)]
        return [0 if s.seq_id in self.plain_only or s.num_output_tokens == 0 else max(0, min(k, s.room - 1))
                for k, s in zip(ks, seqs)]

    def tree_shapes(self) -> list[TreeShape | None] | None:
        """The draft tree each running row may propose this round (None: it drafts nothing), or None
        for a chain round (then ``num_wanted`` asks k per row). Whether the round verifies trees is
        ``policy.tree_round``'s to say, each row's shape ``policy.row_tree``'s (a seeded sampled row:
        the largest tree; a row with a logits processor or logprobs: a chain); the controller sizes
        the others' tree from the measured verify cost per node count (no controller: the largest)."""
        seqs, full = self.running, self.max_tree

        def controller_tree(force: bool) -> TreeShape | None:
            if self.controller is None:
                return None
            return self.controller.choose_tree([s.seq_id for s in seqs], max_nodes=full.num_nodes,
                                               top_k=full.max_children, max_depth=full.max_depth, force=force)

        # a row's first token comes from a plain pass (num_wanted); each accepted path leaves room for its bonus
        depth = [0 if s.seq_id in self.plain_only or s.num_output_tokens == 0 else s.room - 1 for s in seqs]
        if max(depth, default=0) <= 0:
            return None
        carries_prompt = any(len(s.token_ids) - s.num_computed != 1 for s in seqs)
        shape = tree_round(self.draft_tree, seqs, carries_prompt, controller_tree, full, self.tree_sequences)
        if shape is None:
            return None
        return [row_tree(s, d, shape, full) for s, d in zip(seqs, depth)]

    def num_plain_steps(self, batch: RoundBatch) -> int:
        """How many plain steps this round may take in one runner call: several only when it drafts
        nothing and every row is greedy with nothing that reads its logits (processors, logprobs),
        each row past its first output token (which streams at once), no request waiting for a place
        (it joins only between rounds), and not while the adaptive controller times plain steps before
        it may speculate (a plain stretch of several steps a round would delay speculation)."""
        steps = self.config.num_scheduler_steps
        if (steps == 1 or max(batch.num_wanted) > 0 or batch.carries_prompt
                or not batch.sampling.all_greedy or (self.waiting and len(self.running) < self.max_num_seqs)
                or (self.controller is not None and self.controller.measuring_plain(len(batch.seqs)))):
            return 1
        for s in batch.seqs:
            if s.processor is not None or s.params.logprobs is not None or s.num_output_tokens == 0:
                return 1
        return min(steps, min(s.room for s in batch.seqs))


@dataclass
class RoundBatch:
    """One round's state, for the B running sequences in cache-row order (docs/algorithm.md's notation:
    the drafter proposes x_1..x_k from q, the target's verify pass gives p_1..p_{k+1})."""

    seqs: list[Sequence]  # [B]
    start: list[int]  # [B] target cache length of each row = the position its feed starts at
    feed: list[list[int]]  # [B] what each target row lacks: its newest token, or a merged prompt
    num_wanted: list[int]  # [B] drafts asked of the drafter (0: this row decodes plainly)
    sampling: SamplingBatch
    # step 1, draft
    draft_token_ids: torch.Tensor | None = None  # [B, k] long; row b's drafts are its first num_draft[b]
    draft_probs: torch.Tensor | None = None  # [B, k, V] q of sampled drafts; None: one-hot (deterministic)
    num_draft: list[int] = field(default_factory=list)  # [B]
    draft_rows: list[list[int]] = field(default_factory=list)  # [B][k] draft_token_ids on the host

    @classmethod
    def build(cls, seqs: list[Sequence], num_wanted: list[int], device: torch.device,
              last: SamplingBatch | None = None) -> RoundBatch:
        """``last``: the previous round's SamplingBatch, reused when the rows' parameters are the same."""
        return cls(seqs, [s.num_computed for s in seqs], [s.token_ids[s.num_computed:] for s in seqs], num_wanted,
                   SamplingBatch.from_params([s.params for s in seqs], device, reuse=last))

    @property
    def carries_prompt(self) -> bool:
        """Whether some row feeds more than its newest token (a prompt merged into this round)."""
        return any(len(f) != 1 for f in self.feed)

    @property
    def argmax_only(self) -> bool:
        """Whether the verify pass's argmax is all this round reads of its logits: every row greedy,
        none with a logits processor or logprobs."""
        return self.sampling.all_greedy and all(s.processor is None and s.params.logprobs is None
                                                for s in self.seqs)

    def set_drafts(self, draft_token_ids: torch.Tensor | None, draft_probs: torch.Tensor | None,
                   num_draft: list[int] | None, rows: list[list[int]] | None = None) -> None:
        """``rows``: draft_token_ids as lists [B][k] where the caller has them (else read here once)."""
        if draft_token_ids is None:
            draft_token_ids = torch.zeros(len(self.seqs), 0, dtype=torch.long, device=self.sampling.device)
            num_draft, rows = [0] * len(self.seqs), [[] for _ in self.seqs]
        self.draft_token_ids, self.draft_probs, self.num_draft = draft_token_ids, draft_probs, list(num_draft)
        self.draft_rows = rows if rows is not None else draft_token_ids.tolist()

    def verify_batch(self) -> ForwardBatch:
        """The target's verify pass: each row's feed then its k drafts; logits at the last k+1 positions
        of each row [B, k+1]: p_1 after the newest committed token, p_{i+1} after draft x_i."""
        device, k = self.draft_token_ids.device, self.draft_token_ids.shape[1]  # [B, k]
        lengths = [len(f) + n for f, n in zip(self.feed, self.num_draft)]
        tokens = pad_rows([f + d for f, d in zip(self.feed, self.draft_rows)], device)  # [B, T]
        index = long_tensor([[len(f) - 1 + j for j in range(k + 1)] for f in self.feed], device)  # [B, k+1]
        return ForwardBatch(tokens, self.start, lengths, index)

    def tree_verify_batch(self, trees: list[DraftTree | None]) -> ForwardBatch:
        """A tree round's verify pass: each row feeds its newest token (the root) then its tree's nodes,
        each node at the position of its depth, seeing the cache and its ancestors (tree.py); logits at
        every fed position [B, 1 + N_max]: p after the root, then after each node."""
        rows = [f + (t.token_ids if t is not None else []) for f, t in zip(self.feed, trees)]
        T = max(len(r) for r in rows)
        B = len(rows)
        parents = None
        if T > 1:  # padding past a row's nodes continues its cache alone and is seen by nothing
            parents = [(block_parents(len(f), t) if t is not None else [-1]) + [-1] * (T - len(r))
                       for f, t, r in zip(self.feed, trees, rows)]
        index = torch.arange(T, device=self.sampling.device).expand(B, T)
        return ForwardBatch(pad_rows(rows, self.sampling.device), self.start, [len(r) for r in rows], index,
                            parents=parents)
