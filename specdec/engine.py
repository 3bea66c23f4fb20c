"""The engine: one speculative round over the running batch per ``step()`` (docs/algorithm.md).

The scheduler decides who runs and what each row drafts (scheduler.py; tree or chain: policy.py),
intake.py takes requests in, the engine runs the rounds, the runners compute (models/), the verifier
decides what is kept (verify.py; verify_tree.py for a round of draft trees, ``_tree_round``), the
detokenizer stops sequences (detokenizer.py), round_record.py files each round's counters. With no
drafter (or k = 0) the same loop is plain autoregressive decoding: the baseline every benchmark
compares against. ``reference.py`` is the same algorithm for one sequence, written to be read.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TypeVar

import torch

from specdec import policy, sampling_kernel
from specdec.adaptive import AdaptiveK
from specdec.config import SamplingParams, SchedulerConfig
from specdec.detokenizer import Detokenizer
from specdec.drafters.base import Drafter
from specdec.drafters.checks import check_proposal, check_trees
from specdec.host_memory import trim_heap
from specdec.intake import Intake, prefill
from specdec.logprobs import TokenText, check_logprobs_mode, record_emitted
from specdec.metrics import NO_DRAFT, SpecDecodingStats
from specdec.models.base import ModelRunner, pad_rows
from specdec.processing import constrain_drafts, process_verify_logits
from specdec.round_record import RoundRecord
from specdec.scheduler import KvBudget, RoundBatch, Scheduler
from specdec.sequence import Sequence
from specdec.tree import TreeShape
from specdec.verify import verify, verify_greedy
from specdec.verify_tree import verify_tree

log = logging.getLogger(__name__)
T = TypeVar("T")
COLD_ROUNDS = 4  # rounds after a prefill not timed for the controller (``Engine._admit``)


class Engine:
    def __init__(self, target: ModelRunner, drafter: Drafter | None = None, num_speculative_tokens: int = 0,
                 tokenizer=None, eos_token_ids: Iterable[int] = (), scheduler_config: SchedulerConfig | None = None,
                 adaptive: bool = False, strict_drafter: bool | None = None, logprobs_mode: str = "raw_logprobs",
                 draft_tree: str = "chain", draft_tree_max_nodes: int = 7, draft_tree_top_k: int = 4):
        self.target = target
        self.drafter = drafter
        self.k = num_speculative_tokens if drafter is not None else 0
        # draft trees (SpeculativeConfig.draft_tree): "chain" | "auto" | "tree", where drafter and target can
        tree_mode = policy.tree_mode(draft_tree, self.k, drafter, target)
        # adaptive: one k per round for the batch, from measured acceptance and costs; else k fixed
        controller = AdaptiveK(self.k) if adaptive and self.k > 0 else None
        # the KV budget: the target's bytes per position, and what the drafter's caches hold (Drafter.kv_use)
        self.scheduler = Scheduler(scheduler_config, self.k, controller, target.kv_bytes_per_token(),
                                   target.max_model_len, tree_mode, draft_tree_max_nodes, draft_tree_top_k, drafter,
                                   target.min_cache_rows, target.max_tree_sequences)
        self._bound_cache()
        if drafter is not None:
            drafter.bind(controller)
        # A failing drafter degrades its sequences to plain decoding; strict (tests): it raises.
        self.strict_drafter = (os.environ.get("SPECDEC_STRICT_DRAFTER", "0") not in ("0", "")
                               if strict_drafter is None else strict_drafter)
        self.drafter_failures = 0
        self.detokenizer = Detokenizer(tokenizer, eos_token_ids)
        self.stats = SpecDecodingStats()
        self.device = target.device
        if self.device.type == "cpu":
            sampling_kernel.available()  # built (once per machine, seconds) at load, not at a first sampled request
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)  # logprobs.py
        self.token_text = TokenText(tokenizer)
        self.intake = Intake(target, self.scheduler, self.detokenizer, self.token_text)
        self._last_sampling = None  # the previous round's SamplingBatch (RoundBatch.build reuses it)
        self._cold_rounds = 0  # rounds after the last prefill still to be left untimed for the controller (``_admit``)

    # -- requests (intake.py) and the batch (scheduler.py) ----------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, grammar=None) -> Sequence:
        return self.intake.add_request(prompt_token_ids, params, grammar)

    def add_choices(self, prompt_token_ids: list[int], params: SamplingParams,
                    grammars: list | None = None) -> list[Sequence]:
        return self.intake.add_choices(prompt_token_ids, params, grammars)

    def add_group(self, prompts: list[tuple[list[int], SamplingParams, list | None]]) -> list[Sequence]:
        return self.intake.add_group(prompts)

    @property
    def grammar_compiler(self):
        return self.intake.grammar_compiler

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence (a client went away); it leaves the batch at the next step."""
        self.scheduler.abort(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def limit_admission(self, kv_cache_memory: int | None, max_num_batched_tokens: int | None) -> KvBudget | None:
        """Bound admission by KV memory (bytes) and prompt tokens a round (a server's limits); returns
        the KV budget to check requests against before they queue (None: no bound)."""
        budget = self.scheduler.limit(kv_cache_memory, max_num_batched_tokens)
        self._bound_cache()
        return budget

    def _bound_cache(self) -> None:
        """The caches grow past what they need only within the KV budget's share for them: as many target
        positions as the budget holds with every cache at the same positions."""
        kv = self.scheduler.kv
        self.target.max_cache_positions = positions = None if kv is None else kv.budget // kv.bytes_per_token
        if self.drafter is not None:
            self.drafter.bound_caches(positions)

    def next_in_line(self) -> list[Sequence]:
        """The waiting sequences the next step may admit."""
        return self.scheduler.next_in_line()

    def isolated(self, seqs: list[Sequence]) -> AbstractContextManager[None]:
        """Within it only ``seqs`` (rows of the batch or of ``next_in_line``) run or join: a server retrying
        a failed step over part of it. The others come back after and recompute their history."""
        return self.scheduler.alone(seqs)

    running = property(lambda self: self.scheduler.running)
    waiting = property(lambda self: self.scheduler.waiting_seqs())
    max_num_seqs = property(lambda self: self.scheduler.max_num_seqs)
    controller = property(lambda self: self.scheduler.controller)
    plain_only = property(lambda self: self.scheduler.plain_only)

    def release_memory(self) -> None:
        """Free the KV caches while nothing runs (a server between bursts); they regrow on demand."""
        if self.running:
            raise RuntimeError("release_memory() while sequences are running would lose their caches")
        self._free_caches()
        self.scheduler.memory_released()

    def _free_caches(self) -> None:
        """Free the runners' and the drafter's caches; the KV budget is the scheduler's to update."""
        self.target.release()
        if self.drafter is not None:
            self.drafter.release_memory()
        trim_heap()

    # -- the round --------------------------------------------------------------------------------

    def step(self) -> list[tuple[Sequence, list[int]]]:
        """Admit waiting requests, run one round, and return (sequence, tokens it gained) per running sequence."""
        self._admit()
        self._retire()
        if not self.running:
            return []
        t0 = time.perf_counter()
        self.target.sync_rows([s.seq_id for s in self.running])  # cache rows follow batch order
        shapes = self.scheduler.tree_shapes()  # [B] a draft tree per row, or None: a chain round (policy.tree_round)
        wanted = (self.scheduler.num_wanted(timed=not self._cold) if shapes is None
                  else [sh.num_nodes if sh else 0 for sh in shapes])
        batch = RoundBatch.build(self.running, wanted, self.device, self._last_sampling)
        self._last_sampling = batch.sampling
        if shapes is not None:  # draft trees: _tree_round's steps 1-5
            return self._tree_round(batch, shapes, t0)

        # 1. draft: up to num_wanted[b] tokens x_1..x_k per row (and q_1..q_k when it samples)
        t_draft = time.perf_counter()
        sources = self._draft(batch)  # [B] the method that drafted each row
        t1 = time.perf_counter()
        steps = self.scheduler.num_plain_steps(batch)
        if steps > 1:  # nothing drafted and every row greedy: several plain steps in one call
            return self._plain_round(batch, steps, t0)

        # 2. verify: one target pass over [feed, x_1..x_k] -> p_1..p_{k+1} per row  [B, k+1, V];
        #    position j of a row with penalties / biases / a grammar is processed as if x_1..x_j were emitted.
        #    Where only the argmax is read (greedy rows, no processor, no logprobs): argmax p_1..p_{k+1}  [B, k+1]
        raw_logits = target_logits = target_argmax = None
        if batch.argmax_only:
            target_argmax = self.target.forward_argmax(batch.verify_batch())
        else:
            raw_logits = self.target.forward(batch.verify_batch())
            target_logits = process_verify_logits(raw_logits, batch.seqs, batch.draft_token_ids, batch.num_draft)

        # 3. accept: a prefix of the drafts, then one recovered or bonus token per row
        if target_argmax is not None:
            result = verify_greedy(batch.draft_rows, target_argmax, batch.num_draft)
        else:
            result = verify(batch.draft_token_ids, batch.draft_probs, target_logits, batch.sampling,
                            [s.generator for s in batch.seqs], batch.num_draft)
        t2 = time.perf_counter()

        # 4. commit: the target cache keeps [feed, accepted drafts]; the rest is rolled back by the
        #    length alone. Each sequence appends its tokens until a stop condition.
        drafts = batch.draft_rows  # [B][k]
        gained = []
        for s, feed, d, n, nxt in zip(batch.seqs, batch.feed, drafts, result.num_accepted, result.next_token_ids):
            s.num_computed += len(feed) + n
            gained.append((s, self._commit(s, d[:n] + [nxt])))
        record_emitted(gained, raw_logits, target_logits, batch.sampling, self.logprobs_mode, self.token_text)

        # 5. update: the drafter learns what was accepted; counters, costs; finished sequences leave
        if batch.draft_token_ids.shape[1] > 0:
            self.drafter.observe(batch.seqs, result.num_accepted)
        self._update(batch, RoundRecord(batch.num_draft, result.num_accepted, batch.num_wanted, sources, t1 - t_draft,
                                        t2 - t1, timed=not (batch.carries_prompt or self._cold)), t0)
        return gained

    def _tree_round(self, batch: RoundBatch, shapes: list[TreeShape | None],
                    t0: float) -> list[tuple[Sequence, list[int]]]:
        """``step()``'s round with a draft tree per row (tree.py, verify_tree.py). Every row feeds just its
        newest token; a row with a logits processor or logprobs drafted a chain (policy.row_tree), so
        its logits and logprobs are a chain round's: position j after its first j drafts."""
        # 1. draft: a tree per row within its shape (None: the row decodes plainly this round)
        t_draft = time.perf_counter()
        trees = self._guarded(batch, lambda: check_trees(self.drafter.propose_tree(batch.seqs, shapes, batch.sampling),
                                                         shapes, self.target.vocab_size))
        trees = trees or [None] * len(batch.seqs)
        sources = [self.drafter.label if t is not None else NO_DRAFT for t in trees]  # [B]
        t1 = time.perf_counter()

        # 2. verify: one target pass over [newest token, nodes] per row, each node at the position of
        #    its depth seeing only its ancestors -> p after the root and after each node  [B, 1 + N_max, V];
        #    a row with penalties / biases / a grammar drafted a chain: processed as a chain round's
        raw_logits = self.target.forward(batch.tree_verify_batch(trees))
        nodes = [t.num_nodes if t is not None else 0 for t in trees]
        target_logits = raw_logits
        if any(s.processor is not None for s in batch.seqs):
            chains = pad_rows([t.token_ids if t is not None else [] for t in trees], self.device)  # [B, N_max]
            target_logits = process_verify_logits(raw_logits, batch.seqs, chains, nodes)

        # 3. accept: a root path per row, then one recovered or bonus token (greedy: the argmax path;
        #    sampled: recursive rejection over siblings, verify_tree.py)
        result = verify_tree(trees, target_logits, batch.sampling, [s.generator for s in batch.seqs])
        t2 = time.perf_counter()

        # 4. commit: the target cache keeps [newest token, accepted path], moved to consecutive slots
        #    (the other nodes' KV is dropped by the length); each sequence appends its tokens until a stop
        keep = [[0] + [1 + j for j in path] for path in result.accepted_nodes]
        if any(len(k) > 1 for k in keep):
            self.target.compact(list(range(len(batch.seqs))), batch.start, keep)
        gained = []
        for s, tree, path, nxt in zip(batch.seqs, trees, result.accepted_nodes, result.next_token_ids):
            s.num_computed += 1 + len(path)
            gained.append((s, self._commit(s, [tree.token_ids[j] for j in path] + [nxt])))
        record_emitted(gained, raw_logits, target_logits, batch.sampling, self.logprobs_mode, self.token_text)

        # 5. update: the drafter learns each accepted path's length; counters (a tree counts its nodes as
        #    drafts, its path as accepted: tau is path + 1 per verify pass), the controller; finished leave
        if any(nodes):
            self.drafter.observe(batch.seqs, result.num_accepted)
        depths = [max(t.depths(), default=0) if t is not None else 0 for t in trees]
        asked = [sh.num_nodes if sh is not None else 0 for sh in shapes]
        self._update(batch, RoundRecord(nodes, result.num_accepted, asked, sources, t1 - t_draft, t2 - t1,
                                        timed=not self._cold, depths=depths, trees=trees, paths=result.accepted_nodes), t0)
        return gained

    def _plain_round(self, batch: RoundBatch, steps: int, t0: float) -> list[tuple[Sequence, list[int]]]:
        """Up to ``steps`` greedy plain steps through ``target.greedy_steps``: the tokens a verify pass
        without drafts would pick (its argmax), without the per-step bookkeeping of a round, which on a
        fast CPU step is a tenth of its time or more. Tokens past a stop condition are dropped by the
        commit, as a speculative round's are."""
        stop_ids = set()  # the loop may end once every row has emitted one of these
        for s in batch.seqs:
            stop_ids.update(s.params.stop_token_ids)
            if not s.params.ignore_eos:
                stop_ids.update(self.detokenizer.eos_token_ids)
        t1 = time.perf_counter()
        tokens = self.target.greedy_steps([f[0] for f in batch.feed], batch.start, steps,
                                          stop_token_ids=sorted(stop_ids))  # [B, n]
        t2 = time.perf_counter()
        gained = []
        for s, row in zip(batch.seqs, tokens):
            s.num_computed += len(row)  # [feed, x_1..x_{n-1}] are cached; x_n is fed next round
            gained.append((s, self._commit(s, row)))
        zeros = [0] * len(batch.seqs)
        self._update(batch, RoundRecord(zeros, zeros, zeros, [NO_DRAFT] * len(zeros), 0.0, t2 - t1,
                                        timed=not self._cold, plain_steps=len(tokens[0])), t0)
        return gained

    def _update(self, batch: RoundBatch, r: RoundRecord, t0: float) -> None:
        """Step 5's bookkeeping, one for every kind of round: counters and costs (round_record.py);
        finished sequences leave."""
        r.file(batch.seqs, self.stats, self.controller)
        self.stats.step_time_s += time.perf_counter() - t0
        self._retire()

    def _guarded(self, batch: RoundBatch, propose: Callable[[], T]) -> T | None:
        """Step 1 under the drafter-failure guard, the one degrade path of every round: ``propose`` runs
        the drafter and checks its output (drafters/checks.py); if either raises, the batch's sequences
        fall back to plain decoding and None is returned (strict: it raises)."""
        try:
            return propose()
        except Exception:
            self.drafter_failures += 1
            if self.strict_drafter:
                raise
            log.exception("drafter failed; its %d sequence(s) fall back to plain decoding", len(batch.seqs))
            self.plain_only.update(s.seq_id for s in batch.seqs)
            try:
                self.drafter.release(batch.seqs)
            except Exception:
                log.exception("drafter failed to release its state")
            return None

    def _draft(self, batch: RoundBatch) -> list[str]:
        """Step 1 of a chain round. Returns the method that drafted each row  [B] (the proposal's
        ``sources``, else the drafter's ``method``; the counters file a row without drafts under "none")."""
        wanted = batch.num_wanted
        proposal = None
        if max(wanted) > 0:
            proposal = self._guarded(batch, lambda: check_proposal(
                self.drafter.propose(batch.seqs, wanted, batch.sampling), wanted, self.target.vocab_size))
        if proposal is None or proposal.draft_token_ids.shape[1] == 0:
            batch.set_drafts(None, None, None)
            return [NO_DRAFT] * len(batch.seqs)
        # 1b. a one-hot draft ends where the row's grammar forbids it (processing.constrain_drafts)
        B = len(batch.seqs)
        deterministic = ([True] * B if proposal.draft_probs is None else [False] * B if batch.sampling.all_sampled
                         else batch.sampling.greedy.tolist())  # [B] one-hot drafts (read without a tensor where known)
        num_draft = constrain_drafts(batch.seqs, proposal.draft_token_ids, proposal.num_draft_tokens, deterministic)
        batch.set_drafts(proposal.draft_token_ids, proposal.draft_probs, num_draft, proposal.token_rows())
        return proposal.sources or [self.drafter.label] * len(batch.seqs)

    def _commit(self, s: Sequence, tokens: list[int]) -> list[int]:
        """Step 4 for one sequence: append tokens until a stop condition or the end of its grammar
        (stop tokens drafted past that end are dropped, as plain decoding never reaches them)."""
        kept = self.detokenizer.append(s, tokens)
        if s.processor is not None:
            used = s.processor.append(kept)
            trimmed = used < len(kept)
            if trimmed:
                del s.token_ids[used - len(kept):]
                kept = kept[:used]
            if s.processor.grammar_done and (not s.finished or trimmed):  # else the detokenizer's reason stands
                s.finish_reason, s.stop_reason = "stop", None
        return kept

    def _admit(self) -> None:
        """Admit and prefill newcomers. The COLD_ROUNDS rounds right after a prefill are not timed for the
        controller (``_cold``): their passes run on caches the prompt's long forward filled (the shipped target's
        first step after a 250-token prefill 1.8 ms against 1.2 on torch; on llama.cpp, Xeon-AMX-FP16, steps 1-4
        after it 5.6, 4.4, 3.7 and 3.1 ms against 2.5-2.6 from the fifth on, medians over 7 prompts), and the
        first one's drafter catches up on the prompt. In them the controller drafts only where its estimate says
        drafting pays (``AdaptiveK.choose``'s ``timed``): learning waits for rounds it can time."""
        seconds = self.intake.admit(self._free_caches, self._prefill)  # seconds prefilling
        self.stats.prefill_time_s += seconds
        self._cold_rounds = COLD_ROUNDS if seconds > 0 else max(0, self._cold_rounds - 1)

    @property
    def _cold(self) -> bool:
        """This step's round follows a prefill within COLD_ROUNDS: not timed for the controller (``_admit``)."""
        return self._cold_rounds > 0

    def _prefill(self, new: list[Sequence], first: int) -> None:
        """Prefill the newcomers at cache rows first, first + 1, ... (``intake.prefill``)."""
        prefill(self.target, self.running, new, first, self.token_text)

    def _retire(self) -> None:
        done = self.scheduler.retire()
        if done and self.drafter is not None:
            self.drafter.release(done)
