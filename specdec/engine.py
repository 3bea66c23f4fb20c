"""The engine: admits requests, runs speculative rounds over the batch, and stops sequences.

One round, for every running sequence at once (ALGORITHM.md):
  1. draft   - the drafter proposes x_1..x_k (and q_1..q_k when it samples);
  2. verify  - one target pass over [last committed token, x_1..x_k] gives p_1..p_{k+1};
  3. accept  - the verifier keeps a prefix of the drafts and adds one recovered or bonus token;
  4. commit  - each sequence appends its own tokens, checks its stop conditions, and rolls its
               target cache back by a length change (num_computed);
  5. update  - the drafter learns what was accepted; finished sequences leave the batch.
With no drafter (or k = 0) the same loop is plain autoregressive decoding: that is the baseline.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable

import torch

from specdec.adaptive import AdaptiveK
from specdec.config import SamplingParams
from specdec.drafters.base import DraftProposal, Drafter
from specdec.host_memory import trim_heap
from specdec.metrics import SpecDecodingStats
from specdec.models.base import ModelRunner
from specdec.sampling import SamplingBatch, make_generator
from specdec.sequence import Sequence
from specdec.verify import verify

log = logging.getLogger(__name__)

MERGED_PREFILL_TOKENS = 512  # new prompts up to this many tokens in all join a running batch's verify pass


class Engine:
    def __init__(self, target: ModelRunner, drafter: Drafter | None = None, num_speculative_tokens: int = 0,
                 tokenizer=None, eos_token_ids: Iterable[int] = (), max_num_seqs: int = 256,
                 adaptive: bool = False):
        self.target = target
        self.drafter = drafter
        self.k = num_speculative_tokens if drafter is not None else 0
        # adaptive: k per sequence and round from measured acceptance and costs; else k fixed
        self.controller = AdaptiveK(self.k) if adaptive and self.k > 0 else None
        self.plain_only: set[int] = set()  # sequences that decode plainly since the drafter failed on them
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SpecDecodingStats()
        self.device = target.device

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty; pass at least one token")
        if n >= self.target.max_model_len:
            raise ValueError(f"prompt has {n} tokens but the model's context is {self.target.max_model_len} "
                             "(prompt + at least one new token); shorten the prompt or raise max_model_len")
        bad = [t for t in prompt_token_ids if not (0 <= t < self.target.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{self.target.vocab_size - 1}")
        seq = Sequence(list(prompt_token_ids), params, make_generator(params.seed, self.device),
                       max_len=self.target.max_model_len)
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence (a client went away); it leaves the batch at the next step."""
        if seq.finish_reason is None:
            seq.finish_reason = "abort"
        if seq in self.waiting:
            self.waiting.remove(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def release_memory(self) -> None:
        """Free the KV caches while nothing runs (a server between bursts); they regrow on demand."""
        if self.running:
            raise RuntimeError("release_memory() while sequences are running would lose their caches")
        self.target.release()
        if self.drafter is not None:
            self.drafter.release_memory()
        trim_heap()

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[tuple[Sequence, list[int]]]:
        """Admit waiting requests, run one round, and return (sequence, tokens it gained) per running sequence."""
        self._admit()
        self._retire()
        if not self.running:
            return []
        seqs = self.running
        t0 = time.perf_counter()
        self.target.sync_rows([s.seq_id for s in seqs])
        sb = SamplingBatch.from_params([s.params for s in seqs], self.device)
        ks = [self.k] * len(seqs)
        if self.controller is not None:
            # A seeded sampled request keeps k fixed: its random draws depend on k, and the
            # controller's choices depend on timings, so only a fixed k makes the seed reproducible.
            chosen = self.controller.choose([s.seq_id for s in seqs])
            ks = [self.k if s.params.seed is not None and not s.params.greedy else c for s, c in zip(seqs, chosen)]
        # what each target cache row lacks: the newest token, or a newcomer's whole prompt when its
        # prefill rides in this round's verify pass (_admit)
        hist = [s.token_ids[s.num_computed:] for s in seqs]
        # A sequence's first token comes from a plain pass, as vLLM's does from its prefill: drafting
        # for it would add the draft's prompt catch-up and a longer verify pass to the time to first
        # token. Drafts beyond the room left are wasted.
        wanted = [0 if s.seq_id in self.plain_only or s.num_output_tokens == 0 else max(0, min(k, s.room - 1))
                  for k, s in zip(ks, seqs)]

        # 1. draft: up to wanted[b] tokens per sequence; a drafter may propose fewer
        t_draft = time.perf_counter()
        proposal = self._propose(seqs, wanted, sb) if max(wanted) > 0 else None
        if proposal is None:
            draft_ids = torch.zeros(len(seqs), 0, dtype=torch.long, device=self.device)  # [B, 0]
            num_draft = [0] * len(seqs)
        else:
            draft_ids, num_draft = proposal.draft_token_ids, proposal.num_draft_tokens  # [B, k], [B]
        t1 = time.perf_counter()

        # 2. verify: one target pass over [last committed token, x_1..x_k] -> p_1..p_{k+1}
        #    (a merged prompt comes before its last token; only the last k+1 positions give logits)
        tokens, logits_index = self._verify_tokens(hist, draft_ids)
        lengths = [len(h) + n for h, n in zip(hist, num_draft)]  # real tokens per row; the rest is padding
        target_logits = self.target.forward(tokens, [s.num_computed for s in seqs], all_logits=logits_index is None,
                                            logits_index=logits_index, lengths=lengths)  # [B, k+1, V]

        # 3. accept / reject
        result = verify(draft_ids, proposal.draft_probs if proposal else None, target_logits, sb,
                        [s.generator for s in seqs], torch.tensor(num_draft, device=self.device))
        t2 = time.perf_counter()

        # 4. commit: accepted drafts + the recovered/bonus token; the target cache keeps
        #    [last, accepted drafts], everything after is rolled back by the length alone.
        drafts = draft_ids.tolist()
        gained = []
        for s, h, d, n, nxt in zip(seqs, hist, drafts, result.num_accepted, result.next_token_ids):
            s.num_computed += len(h) + n
            gained.append((s, self._append(s, d[:n] + [nxt])))

        # 5. update the drafter and the counters
        if self.drafter is not None and proposal is not None:
            self.drafter.observe(seqs, result.num_accepted)
        self.stats.record_round(num_draft, result.num_accepted)
        if self.controller is not None:  # a pass that carried a prompt (logits_index set) times no verify pass
            self.controller.record([s.seq_id for s in seqs], num_draft, result.num_accepted, t1 - t_draft,
                                   None if logits_index is not None else t2 - t1)
        self.stats.draft_time_s += t1 - t_draft
        self.stats.verify_time_s += t2 - t1
        self.stats.step_time_s += time.perf_counter() - t0
        self._retire()
        return gained

    # -- helpers ----------------------------------------------------------------------------------

    def _verify_tokens(self, hist: list[list[int]], draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The verify pass's tokens: each row's ``hist`` then its drafts (padded to k). Returns them and,
        when some row carries a prompt, the index of each row's last k+1 positions [B, k+1]
        (None: the tokens are exactly those positions)."""
        k = draft_ids.shape[1]
        if all(len(h) == 1 for h in hist):
            return torch.cat([torch.tensor(hist, device=self.device), draft_ids], dim=1), None  # [B, k+1]
        tokens = torch.zeros(len(hist), max(map(len, hist)) + k, dtype=torch.long)  # [B, T]
        for b, (h, d) in enumerate(zip(hist, draft_ids.tolist())):
            tokens[b, : len(h) + k] = torch.tensor(h + d)
        index = torch.tensor([[len(h) - 1 + j for j in range(k + 1)] for h in hist], device=self.device)
        return tokens.to(self.device), index

    def _propose(self, seqs: list[Sequence], wanted: list[int], sb: SamplingBatch) -> DraftProposal | None:
        try:
            proposal = self.drafter.propose(seqs, wanted, sb)
            if proposal.draft_token_ids.shape[1] == 0:
                return None
            return proposal
        except Exception:  # a failing drafter must not fail the requests: they decode plainly instead
            log.exception("drafter failed; its %d sequence(s) fall back to plain decoding", len(seqs))
            self.plain_only.update(s.seq_id for s in seqs)
            try:
                self.drafter.release(seqs)
            except Exception:
                log.exception("drafter failed to release its state")
            return None

    def _admit(self) -> None:
        new = []
        while self.waiting and len(self.running) + len(new) < self.max_num_seqs:
            seq = self.waiting.popleft()
            if seq.finish_reason is None:
                new.append(seq)
        if not new:
            return
        t0 = time.perf_counter()
        decoding = bool(self.running)
        self.running += new
        # room for the prompts now; the cache grows in steps as the outputs do
        self.target.reserve(len(self.running), max(s.num_prompt_tokens for s in self.running) + self.k + 1)
        self.target.sync_rows([s.seq_id for s in self.running])
        if decoding and sum(s.num_prompt_tokens for s in new) <= MERGED_PREFILL_TOKENS:
            # Sequences are decoding: the new prompts ride in the next verify pass (step() feeds each
            # row what its cache lacks), which costs far less than a pass of their own that reads
            # every weight once more (vLLM's chunked prefill does the same).
            for s in new:
                s.num_computed = 0
            return
        # Prefill each new prompt but its last token, which the first round's verify pass feeds.
        prefill = [s for s in new if s.num_prompt_tokens > 1]
        if prefill:
            T = max(s.num_prompt_tokens - 1 for s in prefill)
            tokens = torch.zeros(len(new), T, dtype=torch.long)  # [B_new, T], right-padded
            for b, s in enumerate(new):
                tokens[b, : s.num_prompt_tokens - 1] = torch.tensor(s.prompt_token_ids[:-1])
            self.target.forward(tokens.to(self.device), [0] * len(new), row_offset=len(self.running) - len(new),
                                lengths=[s.num_prompt_tokens - 1 for s in new])  # packed: no padding to the longest
        for s in new:
            s.num_computed = s.num_prompt_tokens - 1
        self.stats.prefill_time_s += time.perf_counter() - t0

    def _retire(self) -> None:
        done = [s for s in self.running if s.finished]
        if done:
            self.running = _fill_holes(self.running)
            if self.drafter is not None:
                self.drafter.release(done)
            if self.controller is not None:
                self.controller.release([s.seq_id for s in done])
            self.plain_only.difference_update(s.seq_id for s in done)

    def _append(self, seq: Sequence, new_tokens: list[int]) -> list[int]:
        """Append tokens one by one until a stop condition; returns the tokens kept."""
        p = seq.params
        kept = []
        for t in new_tokens:
            seq.token_ids.append(t)
            kept.append(t)
            if not p.ignore_eos and t in self.eos_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", None
            elif t in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", t
            elif p.stop and self._hit_stop_string(seq):
                pass
            elif seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= seq.max_len:
                seq.finish_reason = "length"
            if seq.finished:
                break
        return kept

    def _hit_stop_string(self, seq: Sequence) -> bool:
        stop = seq.params.stop
        window = 4 * max(len(s) for s in stop) + 8  # tokens enough to spell any stop string
        tail = self.decode(seq.output_token_ids[-window:], seq.params)
        if not any(s in tail for s in stop):
            return False
        text = self.decode(seq.output_token_ids, seq.params)
        hits = [(text.find(s), s) for s in stop if s in text]
        pos, s = min(hits)
        seq.text = text[:pos]
        seq.finish_reason, seq.stop_reason = "stop", s
        return True

    def decode(self, token_ids: list[int], params: SamplingParams) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)

    def output_text(self, seq: Sequence) -> str:
        """The final text: cut at the stop string when one ended the sequence."""
        if isinstance(seq.stop_reason, str):
            return seq.text
        return self.decode(seq.output_token_ids, seq.params)


def _fill_holes(running: list[Sequence]) -> list[Sequence]:
    """The unfinished sequences, each in its old place where that is still inside the batch; the
    ones past the new end move into the places the finished left. Cache rows follow batch order,
    so this moves as few rows as possible (RowTable.sync)."""
    n = sum(not s.finished for s in running)
    kept = running[:n]
    movers = iter(s for s in running[n:] if not s.finished)
    return [s if not s.finished else next(movers) for s in kept]
