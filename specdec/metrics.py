"""Speculative-decoding counters with vLLM's names and meanings (docs/algorithm.md, "Metrics"); the cost
model that reads them is specdec/cost_model.py.

Counters count per sequence and round, as vLLM's do (a round over 8 sequences that all draft is 8
drafts), except ``num_verify_passes``: one target pass verifies the whole batch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecDecodingStats:
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
    num_verify_passes: int = 0  # target forwards that verified a round, one per round whatever the batch size
    draft_time_s: float = 0.0  # drafter.propose wall time
    verify_time_s: float = 0.0  # target forward + accept/reject wall time
    prefill_time_s: float = 0.0
    step_time_s: float = 0.0  # whole rounds, prefill excluded; the rest is loop overhead

    def record_plain_steps(self, num_seqs: int, steps: int) -> None:
        """``steps`` plain decoding steps of ``num_seqs`` sequences taken in one call (Engine._plain_round)."""
        self.num_verify_passes += steps
        self.num_emitted_tokens += num_seqs * steps

    def record_round(self, k_per_seq: list[int], num_accepted: list[int], num_asked: list[int] | None = None) -> None:
        """One round: drafts proposed, accepted and (``num_asked``, default: as proposed) asked for per
        sequence of the batch  [B] each."""
        self.num_verify_passes += 1
        self.num_asked_draft_tokens += sum(num_asked if num_asked is not None else k_per_seq)
        for k, n in zip(k_per_seq, num_accepted):
            self.num_emitted_tokens += n + 1
            if k == 0:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += n
            grow = k - len(self.num_accepted_tokens_per_pos)
            if grow > 0:
                self.num_accepted_tokens_per_pos += [0] * grow
                self.num_draft_tokens_per_pos += [0] * grow
            for i in range(k):
                self.num_draft_tokens_per_pos[i] += 1
            for i in range(n):
                self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens emitted per target verification pass, the recovered/bonus token included (1..k+1)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Share of the rounds that drafted position i in which position i was accepted."""
        return [a / d for a, d in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)]

    def as_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_acceptance_length"] = self.mean_acceptance_length
        d["acceptance_rate_per_pos"] = self.acceptance_rate_per_pos
        d["overhead_time_s"] = max(0.0, self.step_time_s - self.draft_time_s - self.verify_time_s)
        return d
