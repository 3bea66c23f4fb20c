"""Speculative-decoding counters with vLLM's names and meanings (docs/algorithm.md, "Metrics"); the cost
model that reads them is specdec/cost_model.py.

One implementation (``SpecCounters``) counts for the whole engine (``SpecDecodingStats``,
``LLM.get_metrics()``, the server's /metrics) and for each request (``RequestSpecStats``, on every
``Sequence``: ``RequestOutput.metrics``, the server's opt-in ``usage["spec_decoding"]``), so the
per-request counters of all requests add up to the engine's.

Counters count per sequence and round, as vLLM's do (a round over 8 sequences that all draft is 8
drafts), except the engine's ``num_verify_passes``: one target pass verifies the whole batch. For one
request, ``num_verify_passes`` is the passes it took part in (a plain step counts as one).

Per method: ``num_rounds_per_method`` counts (sequence, round) pairs by the method that drafted them
(``DraftProposal.sources``, else the drafter's ``method``); a row that verified without drafts (plain
decoding, nothing asked, a lookup that found nothing) counts under ``"none"``. So the drafting methods'
counts add up to ``num_drafts``, and, for one request, all of them to ``num_verify_passes``.

Times: a round's draft and verify wall times are shared by its batch; the engine counts each once, a
request is charged the whole of each round it took part in (the time it waited), so with several
requests in flight their per-request times add up to more than the engine's."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

NO_DRAFT = "none"  # the method name of rows that verified without drafts


@dataclass
class SpecCounters:
    """What the engine and each request count alike."""

    num_drafts: int = 0  # (sequence, round) pairs that proposed at least one token
    num_draft_tokens: int = 0
    num_asked_draft_tokens: int = 0  # drafts the engine asked for: a lookup drafter may find fewer
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts proposed at position i
    # vLLM's meaning: what verification emitted (accepted + recovered + bonus; plain decoding one per
    # sequence and round), before stop conditions: tokens after a stop token or string count here
    # although the output drops them
    num_emitted_tokens: int = 0
    num_verify_passes: int = 0  # target forwards that verified a round (engine: one per round whatever the batch)
    # draft trees (tree.py): the (sequence, round) pairs above that verified a tree, their nodes and
    # accepted paths; chains are the rest, so trees and chains compare side by side (``as_dict``)
    num_tree_drafts: int = 0
    num_tree_draft_tokens: int = 0
    num_tree_accepted_tokens: int = 0
    num_rounds_per_method: dict[str, int] = field(default_factory=dict)  # method -> (sequence, round) pairs
    num_draft_tokens_per_method: dict[str, int] = field(default_factory=dict)  # method -> drafts proposed
    num_accepted_tokens_per_method: dict[str, int] = field(default_factory=dict)  # method -> drafts accepted
    draft_time_s: float = 0.0  # drafter.propose wall time
    verify_time_s: float = 0.0  # target forward + accept/reject wall time
    prefill_time_s: float = 0.0

    def record_row(self, k: int, n: int, asked: int, method: str | None = None, depth: int | None = None) -> None:
        """One sequence in one round: ``k`` drafts proposed (``asked`` asked for), ``n`` of them accepted,
        drafted by ``method`` (None: do not count per method). ``depth``: the drafts were a tree of k
        nodes and this depth, its accepted path n long; positions are depths (a chain's depth is k).
        Verify passes are the caller's."""
        self.num_asked_draft_tokens += asked
        self.num_emitted_tokens += n + 1
        if method is not None:
            self.record_method(method, k, n)
        if k == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += n
        if depth is not None:
            self.num_tree_drafts += 1
            self.num_tree_draft_tokens += k
            self.num_tree_accepted_tokens += n
        positions = k if depth is None else depth
        grow = positions - len(self.num_accepted_tokens_per_pos)
        if grow > 0:
            self.num_accepted_tokens_per_pos += [0] * grow
            self.num_draft_tokens_per_pos += [0] * grow
        for i in range(positions):
            self.num_draft_tokens_per_pos[i] += 1
        for i in range(n):
            self.num_accepted_tokens_per_pos[i] += 1

    def record_method(self, method: str, k: int, n: int) -> None:
        """One (sequence, round) pair per method: ``k`` drafts by ``method`` (``"none"`` when k is 0), ``n`` accepted."""
        key = method if k > 0 else NO_DRAFT
        self.num_rounds_per_method[key] = self.num_rounds_per_method.get(key, 0) + 1
        if k > 0:
            self.num_draft_tokens_per_method[key] = self.num_draft_tokens_per_method.get(key, 0) + k
            self.num_accepted_tokens_per_method[key] = self.num_accepted_tokens_per_method.get(key, 0) + n

    def record_plain_steps(self, num_seqs: int, steps: int) -> None:
        """``steps`` plain decoding steps of ``num_seqs`` sequences taken in one call (Engine._plain_round)."""
        self.num_verify_passes += steps
        self.num_emitted_tokens += num_seqs * steps
        self.num_rounds_per_method[NO_DRAFT] = self.num_rounds_per_method.get(NO_DRAFT, 0) + num_seqs * steps

    def merge(self, other: SpecCounters) -> None:
        """Add ``other``'s counts and times to these (a request's choices summed), field by field:
        numbers add, per-position lists add position by position, per-method dicts key by key."""
        for f in fields(other):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(theirs, list):
                mine += [0] * (len(theirs) - len(mine))
                for i, v in enumerate(theirs):
                    mine[i] += v
            elif isinstance(theirs, dict):
                for key, v in theirs.items():
                    mine[key] = mine.get(key, 0) + v
            else:
                setattr(self, f.name, mine + theirs)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens emitted per target verification pass, the recovered/bonus token included (1..k+1)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def mean_acceptance_length_trees(self) -> float:
        """tau of the rounds that verified a tree: its accepted path + 1 per verify pass."""
        return 1.0 + self.num_tree_accepted_tokens / self.num_tree_drafts if self.num_tree_drafts else 1.0

    @property
    def mean_acceptance_length_chains(self) -> float:
        """tau of the rounds that verified a chain of drafts."""
        drafts = self.num_drafts - self.num_tree_drafts
        return 1.0 + (self.num_accepted_tokens - self.num_tree_accepted_tokens) / drafts if drafts else 1.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Share of the rounds that drafted position i in which position i was accepted."""
        return [a / d for a, d in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)]

    def as_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_acceptance_length"] = self.mean_acceptance_length
        d["mean_acceptance_length_trees"] = self.mean_acceptance_length_trees
        d["mean_acceptance_length_chains"] = self.mean_acceptance_length_chains
        d["acceptance_rate_per_pos"] = self.acceptance_rate_per_pos
        return d


@dataclass
class SpecDecodingStats(SpecCounters):
    """The engine's counters, over every request since the last reset (``LLM.get_metrics()``)."""

    step_time_s: float = 0.0  # whole rounds, prefill excluded; the rest is loop overhead

    def record_round(self, k_per_seq: list[int], num_accepted: list[int], num_asked: list[int] | None = None) -> None:
        """One round: drafts proposed, accepted and (``num_asked``, default: as proposed) asked for per
        sequence of the batch  [B] each. Per method: ``record_sources``."""
        self.num_verify_passes += 1
        for k, n, a in zip(k_per_seq, num_accepted, num_asked if num_asked is not None else k_per_seq):
            self.record_row(k, n, a)

    def record_tree_round(self, nodes: list[int], depths: list[int], num_accepted: list[int],
                          num_asked: list[int]) -> None:
        """One round that verified a draft tree per sequence: ``nodes`` and ``depths`` of each row's tree
        (0: it drafted nothing), the length of its accepted path, the nodes asked for  [B] each."""
        self.num_verify_passes += 1
        for k, d, n, a in zip(nodes, depths, num_accepted, num_asked):
            self.record_row(k, n, a, depth=d)

    def record_sources(self, k_per_seq: list[int], num_accepted: list[int], sources: list[str]) -> None:
        """The same round per method: row b was drafted by ``sources[b]`` (``"none"`` when k is 0)  [B] each."""
        for k, n, method in zip(k_per_seq, num_accepted, sources):
            self.record_method(method, k, n)

    def as_dict(self) -> dict:
        d = super().as_dict()
        d["overhead_time_s"] = max(0.0, self.step_time_s - self.draft_time_s - self.verify_time_s)
        return d


@dataclass
class RequestSpecStats(SpecCounters):
    """One sequence's counters (``Sequence.stats``): the rounds it took part in, what it drafted and
    accepted in each, and the wall time of those rounds."""

    def record(self, k: int, n: int, asked: int, method: str, draft_s: float, verify_s: float,
               depth: int | None = None) -> None:
        """One round of this sequence: one verify pass, ``k`` drafts by ``method``, ``n`` accepted
        (``depth``: the drafts were a tree that deep, ``record_row``)."""
        self.num_verify_passes += 1
        self.record_row(k, n, asked, method, depth)
        self.draft_time_s += draft_s
        self.verify_time_s += verify_s

    def record_plain(self, steps: int, verify_s: float) -> None:
        """``steps`` plain steps taken in one runner call (Engine._plain_round)."""
        self.record_plain_steps(1, steps)
        self.verify_time_s += verify_s
