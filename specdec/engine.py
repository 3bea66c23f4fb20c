"""The engine: one speculative round over the running batch per ``step()`` (docs/algorithm.md).

The scheduler decides who runs and what each row drafts (scheduler.py), the engine carries it out
(prefills, rounds), the runners compute (models/), the verifier decides what is kept (verify.py;
verify_tree.py for a round of draft trees, ``_tree_round``), the detokenizer stops sequences
(detokenizer.py). With no drafter (or
k = 0) the same loop is plain autoregressive decoding: the baseline every benchmark compares against.
``reference.py`` is the same algorithm for one sequence, written to be read.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import replace

import torch

from specdec.adaptive import AdaptiveK
from specdec.config import DRAFT_TREE_MODES, SamplingParams
from specdec.detokenizer import Detokenizer
from specdec.drafters.base import Drafter
from specdec.host_memory import trim_heap
from specdec.logprobs import TokenText, check_logprobs_mode, prompt_logprobs, record_emitted
from specdec.metrics import NO_DRAFT, SpecDecodingStats
from specdec.models.base import ForwardBatch, ModelRunner, pad_rows
from specdec.processing import RowProcessor, bad_words_token_ids, constrain_drafts, process_verify_logits
from specdec.sampling import make_generator
from specdec.scheduler import PLAIN_STEPS, RoundBatch, Scheduler, check_num_scheduler_steps
from specdec.sequence import Sequence
from specdec.tree import DraftTree, TreeShape
from specdec.verify import verify
from specdec.verify_tree import verify_tree

__all__ = ["PLAIN_STEPS", "Engine", "check_num_scheduler_steps"]

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, target: ModelRunner, drafter: Drafter | None = None, num_speculative_tokens: int = 0,
                 tokenizer=None, eos_token_ids: Iterable[int] = (), max_num_seqs: int = 256,
                 adaptive: bool = False, strict_drafter: bool | None = None, logprobs_mode: str = "raw_logprobs",
                 num_scheduler_steps: int = PLAIN_STEPS, draft_tree: str = "chain", draft_tree_max_nodes: int = 7,
                 draft_tree_top_k: int = 4):
        self.target = target
        self.drafter = drafter
        self.k = num_speculative_tokens if drafter is not None else 0
        # draft trees (SpeculativeConfig.draft_tree): "chain" | "auto" | "tree"
        self.draft_tree, self.draft_tree_max_nodes, self.draft_tree_top_k = draft_tree, draft_tree_max_nodes, draft_tree_top_k
        tree_mode = self._tree_mode(target, drafter, draft_tree)
        # adaptive: one k per round for the batch, from measured acceptance and costs; else k fixed
        controller = AdaptiveK(self.k) if adaptive and self.k > 0 else None
        kv_bytes = target.kv_bytes_per_token() + (drafter.kv_bytes_per_token() if drafter is not None else 0)
        self.scheduler = Scheduler(max_num_seqs, self.k, controller, num_scheduler_steps, kv_bytes,
                                   target.max_model_len, tree_mode, draft_tree_max_nodes, draft_tree_top_k)
        if drafter is not None:
            drafter.bind(controller)
        # A failing drafter degrades its sequences to plain decoding; strict (tests): it raises.
        self.strict_drafter = (os.environ.get("SPECDEC_STRICT_DRAFTER", "0") not in ("0", "")
                               if strict_drafter is None else strict_drafter)
        self.drafter_failures = 0
        self.detokenizer = Detokenizer(tokenizer, eos_token_ids)
        self.stats = SpecDecodingStats()
        self.device = target.device
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)  # logprobs.py
        self.token_text = TokenText(tokenizer)
        self._grammar_compiler = None
        self._last_sampling = None  # the previous round's SamplingBatch (RoundBatch.build reuses it)

    def _tree_mode(self, target: ModelRunner, drafter: Drafter | None, draft_tree: str) -> str:
        """The draft_tree mode the scheduler runs: "tree" needs a drafter that branches and a backend
        that verifies trees (else a ValueError); "auto" is "chain" where either cannot (llama.cpp
        verifies chains: such a target runs the drafter's chains; a drafter that gave only trees would
        be verified along ``DraftTree.best_chain``)."""
        if draft_tree not in DRAFT_TREE_MODES:
            raise ValueError(f"draft_tree must be one of {DRAFT_TREE_MODES}, got {draft_tree!r}")
        if drafter is None or self.k == 0 or draft_tree == "chain":
            return "chain"
        name = drafter.method or type(drafter).__name__
        if draft_tree == "tree" and not target.can_verify_trees:
            raise ValueError(f"draft_tree='tree' needs a backend that verifies draft trees in one pass; the "
                             f"{target.backend} backend verifies chains only: use backend='torch' or draft_tree='chain'")
        if draft_tree == "tree" and not drafter.can_draft_trees:
            raise ValueError(f"draft_tree='tree' needs a drafter that branches; the {name} drafter drafts chains "
                             "only: use draft_tree='auto' or 'chain'")
        return draft_tree if target.can_verify_trees and drafter.can_draft_trees else "chain"

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, grammar=None) -> Sequence:
        """Queue a request. ``grammar``: a compiled matcher for ``params.structured_outputs`` (a server
        compiles it off the engine thread with ``self.grammar_compiler``); compiled here when None."""
        seq = self._sequence(prompt_token_ids, params, grammar)
        self.scheduler.add([seq])
        return seq

    def _sequence(self, prompt_token_ids: list[int], params: SamplingParams, grammar) -> Sequence:
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
        if params.processes_logits:
            seq.processor = self._processor(seq, grammar)
        return seq

    def add_choices(self, prompt_token_ids: list[int], params: SamplingParams,
                    grammars: list | None = None) -> list[Sequence]:
        """``params.n`` sequences for one prompt (vLLM's n): choice i has n = 1 and, when seeded,
        seed + i (vLLM's rule), so each is reproducible alone. They share one prefill (``_prefill``).
        ``grammars``: one matcher per choice (a server compiles them off this thread), or None. Each
        choice is admitted on its own, as a request of its own would be."""
        seqs = self._choices(prompt_token_ids, params, grammars)
        for s in seqs:
            self.scheduler.add([s])
        return seqs

    def add_group(self, prompts: list[tuple[list[int], SamplingParams, list | None]]) -> list[Sequence]:
        """Queue one request of several prompts (token ids, params, grammar matchers or None), ``n``
        choices each, admitted together (a server's request): choice i of the request is the i-th
        sequence returned, prompt-major. A ValueError queues nothing."""
        seqs = [s for ids, params, grammars in prompts for s in self._choices(ids, params, grammars)]
        self.scheduler.add(seqs)
        return seqs

    def _choices(self, prompt_token_ids: list[int], params: SamplingParams, grammars: list | None) -> list[Sequence]:
        if grammars is not None and len(grammars) != params.n:
            raise ValueError(f"got {len(grammars)} grammar matchers for n={params.n} choices; pass one per choice")
        if params.n == 1:
            return [self._sequence(prompt_token_ids, params, grammars[0] if grammars else None)]
        seqs = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            seqs.append(self._sequence(prompt_token_ids, replace(params, n=1, seed=seed),
                                       grammars[i] if grammars else None))
            seqs[-1].prefill_group = seqs[0].seq_id
        return seqs

    def _processor(self, seq: Sequence, grammar) -> RowProcessor:
        p, V = seq.params, self.target.vocab_size
        for name, ids in (("allowed_token_ids", p.allowed_token_ids or []), ("logit_bias", p.logit_bias or {})):
            bad = [t for t in ids if t >= V]
            if bad:
                raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary 0..{V - 1}")
        if p.structured_outputs is not None and grammar is None:
            grammar = self.grammar_compiler.matcher(p.structured_outputs)
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.detokenizer.eos_token_ids)
        bad_words = bad_words_token_ids(self.detokenizer.tokenizer, p.bad_words) if p.bad_words else []
        return RowProcessor(seq, V, stop_ids, bad_words, grammar, self.device)

    @property
    def grammar_compiler(self):
        """Compiles structured_outputs into grammar matchers, with a cache (thread-safe: a server calls it
        from its tokenizing threads)."""
        if self._grammar_compiler is None:
            from specdec.grammar import GrammarCompiler
            if self.detokenizer.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer; this model folder has none")
            self._grammar_compiler = GrammarCompiler(self.detokenizer.tokenizer, self.target.vocab_size,
                                                     self.detokenizer.eos_token_ids)
        return self._grammar_compiler

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence (a client went away); it leaves the batch at the next step."""
        self.scheduler.abort(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self) -> list[Sequence]:
        return self.scheduler.waiting_seqs()

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def controller(self) -> AdaptiveK | None:
        return self.scheduler.controller

    @property
    def plain_only(self) -> set[int]:
        return self.scheduler.plain_only

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
        # [B] a draft tree per row, or None: a chain round (asked each round: a test may swap the drafter)
        shapes = self.scheduler.tree_shapes() if self.drafter is not None and self.drafter.can_draft_trees else None
        wanted = self.scheduler.num_wanted() if shapes is None else [sh.num_nodes if sh else 0 for sh in shapes]
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
        #    position j of a row with penalties / biases / a grammar is processed as if x_1..x_j were emitted
        raw_logits = self.target.forward(batch.verify_batch())
        target_logits = process_verify_logits(raw_logits, batch.seqs, batch.draft_token_ids, batch.num_draft)

        # 3. accept: a prefix of the drafts, then one recovered or bonus token per row
        result = verify(batch.draft_token_ids, batch.draft_probs, target_logits, batch.sampling,
                        [s.generator for s in batch.seqs], torch.tensor(batch.num_draft, device=self.device))
        t2 = time.perf_counter()

        # 4. commit: the target cache keeps [feed, accepted drafts]; the rest is rolled back by the
        #    length alone. Each sequence appends its tokens until a stop condition.
        drafts = batch.draft_token_ids.tolist()
        gained = []
        for s, feed, d, n, nxt in zip(batch.seqs, batch.feed, drafts, result.num_accepted, result.next_token_ids):
            s.num_computed += len(feed) + n
            gained.append((s, self._commit(s, d[:n] + [nxt])))
        record_emitted(gained, raw_logits, target_logits, batch.sampling, self.logprobs_mode, self.token_text)

        # 5. update: the drafter learns what was accepted; counters (the engine's, and each sequence's,
        #    charged the round's whole draft and verify time), costs; finished sequences leave
        if batch.draft_token_ids.shape[1] > 0:
            self.drafter.observe(batch.seqs, result.num_accepted)
        self.stats.record_round(batch.num_draft, result.num_accepted, batch.num_wanted)
        self.stats.record_sources(batch.num_draft, result.num_accepted, sources)
        for s, k, n, asked, method in zip(batch.seqs, batch.num_draft, result.num_accepted, batch.num_wanted, sources):
            s.stats.record(k, n, asked, method, t1 - t_draft, t2 - t1)
        if self.controller is not None:  # a pass that carried a prompt times no verify pass
            self.controller.record([s.seq_id for s in batch.seqs], batch.num_draft, result.num_accepted,
                                   t1 - t_draft, None if batch.carries_prompt else t2 - t1)
        self.stats.draft_time_s += t1 - t_draft
        self.stats.verify_time_s += t2 - t1
        self.stats.step_time_s += time.perf_counter() - t0
        self._retire()
        return gained

    def _tree_round(self, batch: RoundBatch, shapes: list[TreeShape | None],
                    t0: float) -> list[tuple[Sequence, list[int]]]:
        """``step()``'s round with a draft tree per row (tree.py, verify_tree.py). Every row feeds just its
        newest token and has no logits processor or logprobs (Scheduler.tree_shapes)."""
        # 1. draft: a tree per row within its shape (None: the row decodes plainly this round)
        t_draft = time.perf_counter()
        trees, sources = self._draft_trees(batch, shapes)  # [B] each
        t1 = time.perf_counter()

        # 2. verify: one target pass over [newest token, nodes] per row, each node at the position of
        #    its depth seeing only its ancestors -> p after the root and after each node  [B, 1 + N_max, V]
        target_logits = self.target.forward(batch.tree_verify_batch(trees))

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

        # 5. update: the drafter learns each accepted path's length; counters (a tree counts its nodes as
        #    drafts, its path as accepted: tau is path + 1 per verify pass), the controller; finished leave
        nodes = [t.num_nodes if t is not None else 0 for t in trees]
        depths = [max(t.depths(), default=0) if t is not None else 0 for t in trees]
        asked = [sh.num_nodes if sh is not None else 0 for sh in shapes]
        num_accepted = result.num_accepted
        if any(nodes):
            self.drafter.observe(batch.seqs, num_accepted)
        self.stats.record_tree_round(nodes, depths, num_accepted, asked)
        self.stats.record_sources(nodes, num_accepted, sources)
        for s, k, d, n, a, method in zip(batch.seqs, nodes, depths, num_accepted, asked, sources):
            s.stats.record(k, n, a, method, t1 - t_draft, t2 - t1, depth=d)
        if self.controller is not None:  # tokens per pass and costs per node count (adaptive.py)
            self.controller.record_tree([s.seq_id for s in batch.seqs], nodes, num_accepted, t1 - t_draft, t2 - t1,
                                        trees=trees, paths=result.accepted_nodes)
        self.stats.draft_time_s += t1 - t_draft
        self.stats.verify_time_s += t2 - t1
        self.stats.step_time_s += time.perf_counter() - t0
        self._retire()
        return gained

    def _draft_trees(self, batch: RoundBatch,
                     shapes: list[TreeShape | None]) -> tuple[list[DraftTree | None], list[str]]:
        """Step 1 of a tree round: the drafter's tree per row, checked against its shape, and the method
        that drafted each row [B]. A drafter that fails degrades its sequences to plain decoding (strict:
        it raises), as in ``_draft``."""
        B = len(batch.seqs)
        try:
            trees = self.drafter.propose_tree(batch.seqs, shapes, batch.sampling)
            _check_trees(trees, shapes, self.target.vocab_size)
        except Exception:
            self.drafter_failures += 1
            if self.strict_drafter:
                raise
            log.exception("drafter failed to draft trees; its %d sequence(s) fall back to plain decoding", B)
            self.plain_only.update(s.seq_id for s in batch.seqs)
            try:
                self.drafter.release(batch.seqs)
            except Exception:
                log.exception("drafter failed to release its state")
            return [None] * B, [NO_DRAFT] * B
        trees = [t if t is not None and t.num_nodes > 0 else None for t in trees]
        method = self.drafter.method or type(self.drafter).__name__
        return trees, [method if t is not None else NO_DRAFT for t in trees]

    # -- helpers ----------------------------------------------------------------------------------

    def _plain_round(self, batch: RoundBatch, steps: int, t0: float) -> list[tuple[Sequence, list[int]]]:
        """Up to ``steps`` greedy plain steps through ``target.greedy_steps``: the tokens a verify pass
        without drafts would pick (its argmax), without the per-step bookkeeping of a round, which on a
        fast CPU step is a tenth of its time or more (README, llama.cpp backend). Tokens past a stop
        condition are dropped by the commit, as a speculative round's are."""
        seqs = batch.seqs
        stop_ids = set()  # the loop may end once every row has emitted one of these
        for s in seqs:
            stop_ids.update(s.params.stop_token_ids)
            if not s.params.ignore_eos:
                stop_ids.update(self.detokenizer.eos_token_ids)
        t1 = time.perf_counter()
        tokens = self.target.greedy_steps([f[0] for f in batch.feed], batch.start, steps,
                                          stop_token_ids=sorted(stop_ids))  # [B, n]
        t2 = time.perf_counter()
        gained = []
        for s, row in zip(seqs, tokens):
            s.num_computed += len(row)  # [feed, x_1..x_{n-1}] are cached; x_n is fed next round
            gained.append((s, self._commit(s, row)))
        n = len(tokens[0])
        self.stats.record_plain_steps(len(seqs), n)
        for s in seqs:
            s.stats.record_plain(n, t2 - t1)
        if self.controller is not None:
            self.controller.record([s.seq_id for s in seqs], [0] * len(seqs), [0] * len(seqs), 0.0, (t2 - t1) / n,
                                   num_steps=n)
        self.stats.verify_time_s += t2 - t1
        self.stats.step_time_s += time.perf_counter() - t0
        self._retire()
        return gained

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

    def _draft(self, batch: RoundBatch) -> list[str]:
        """Step 1. Returns the method that drafted each row  [B] (the proposal's ``sources``, else the
        drafter's ``method``; the counters file a row without drafts under "none"). A drafter that fails
        degrades its sequences to plain decoding (strict: it raises)."""
        plain = [NO_DRAFT] * len(batch.seqs)
        if max(batch.num_wanted) == 0:
            batch.set_drafts(None, None, None)
            return plain
        try:
            proposal = self.drafter.propose(batch.seqs, batch.num_wanted, batch.sampling)
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
            batch.set_drafts(None, None, None)
            return plain
        if proposal.draft_token_ids.shape[1] == 0:
            batch.set_drafts(None, None, None)
            return plain
        # 1b. a one-hot draft ends where the row's grammar forbids it (processing.constrain_drafts)
        deterministic = [proposal.draft_probs is None or g for g in batch.sampling.greedy.tolist()]
        num_draft = constrain_drafts(batch.seqs, proposal.draft_token_ids, proposal.num_draft_tokens, deterministic)
        batch.set_drafts(proposal.draft_token_ids, proposal.draft_probs, num_draft)
        return proposal.sources or [self.drafter.method or type(self.drafter).__name__] * len(batch.seqs)

    def _admit(self) -> None:
        """Carry out the scheduler's admission (``Scheduler.admit``). A merged newcomer feeds its whole
        prompt in the next verify pass (each row feeds what its cache lacks); the others are prefilled
        now but their last token (``_prefill``), which the first round's verify pass feeds."""
        admitted = self.scheduler.admit()
        if admitted is None:
            return
        t0 = time.perf_counter()
        if admitted.release_caches:
            self._free_caches()  # the newcomers have no cache yet; nothing else runs (the budget already knows)
        running, new = self.running, admitted.seqs
        # room for the prompts now; the cache grows in steps as the outputs do
        self.target.reserve(len(running), max(s.num_prompt_tokens for s in running)
                            + self.scheduler.max_draft_positions + 1)
        self.target.sync_rows([s.seq_id for s in running])
        if admitted.merged:
            for s in new:
                s.num_computed = 0
            return
        self._prefill(new, len(running) - len(new))
        elapsed = time.perf_counter() - t0
        self.stats.prefill_time_s += elapsed
        for s in new:  # each newcomer waited for the whole prefill
            s.stats.prefill_time_s += elapsed

    def _prefill(self, new: list[Sequence], first: int) -> None:
        """Prefill each new sequence (cache rows first, first + 1, ...) but its last prompt token, in
        one packed pass. A choice whose sibling (same prefill_group) is or will be prefilled copies
        that sibling's cache instead; a prompt that asks for prompt_logprobs gets a pass of its own
        with logits at every position."""
        row = {s.seq_id: i for i, s in enumerate(self.running)}
        source: dict[int, Sequence] = {}  # seq_id -> the sibling whose prompt cache it copies
        for s in new:
            if s.prefill_group is None:
                continue
            done = [o for o in self.running if o.prefill_group == s.prefill_group and o not in new
                    and o.num_computed >= o.num_prompt_tokens - 1]
            first_new = next(o for o in new if o.prefill_group == s.prefill_group)
            src = done[0] if done else first_new
            if src is not s:
                source[s.seq_id] = src
        alone = [s for s in new if s.params.prompt_logprobs is not None and s.seq_id not in source]
        rows = [[] if s.seq_id in source or s in alone else s.prompt_token_ids[:-1] for s in new]
        if any(rows):
            self.target.forward(ForwardBatch(pad_rows(rows, self.device), [0] * len(new), [len(r) for r in rows],
                                             row_offset=first))
        for s in alone:
            logits = None
            if s.num_prompt_tokens > 1:
                logits = self.target.forward(ForwardBatch.from_rows([s.prompt_token_ids[:-1]], [0], logits="all",
                                                                    row_offset=row[s.seq_id], device=self.device))[0]
            s.prompt_logprobs = prompt_logprobs(logits, s.prompt_token_ids, s.params.prompt_logprobs, self.token_text)
        for src in {id(v): v for v in source.values()}.values():
            dst = [row[d.seq_id] for d in new if source.get(d.seq_id) is src]
            self.target.copy_prefix(row[src.seq_id], dst, src.num_prompt_tokens - 1)
        for s in new:
            s.num_computed = s.num_prompt_tokens - 1
            if s.seq_id in source:
                s.prompt_logprobs = source[s.seq_id].prompt_logprobs

    def _retire(self) -> None:
        done = self.scheduler.retire()
        if done and self.drafter is not None:
            self.drafter.release(done)


def _check_trees(trees: list[DraftTree | None], shapes: list[TreeShape | None], vocab_size: int) -> None:
    """ValueError unless the drafter gave one tree per row within its shape (None where it asked none)."""
    if len(trees) != len(shapes):
        raise ValueError(f"propose_tree returned {len(trees)} trees for {len(shapes)} sequences; return one per row")
    for b, (tree, shape) in enumerate(zip(trees, shapes)):
        if tree is None or tree.num_nodes == 0:
            continue
        depth = max(tree.depths())
        children = max(sum(1 for p in tree.parents if p == node) for node in range(-1, tree.num_nodes))
        if (shape is None or tree.num_nodes > shape.num_nodes or depth > shape.max_depth
                or children > shape.max_children):
            raise ValueError(f"propose_tree's tree for row {b} ({tree.num_nodes} nodes, depth {depth}, {children} "
                             f"children at most) exceeds the shape asked for: {shape}")
        if not all(0 <= t < vocab_size for t in tree.token_ids):
            raise ValueError(f"propose_tree's tree for row {b} has token ids outside the vocabulary "
                             f"0..{vocab_size - 1}")
