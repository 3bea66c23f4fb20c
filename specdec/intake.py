"""Request intake: prompts and sampling parameters in, validated ``Sequence``s out, queued with the
scheduler; and the prefill that brings newcomers' prompts into the target's cache.

The engine runs rounds (engine.py); this module is what it takes in before: each request checked
against the target (context, vocabulary), given its generator (``params.seed``), its logits
processor (penalties, biases, a grammar: processing.py) and, for ``n`` choices, one sequence per
choice that shares one prefill.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from specdec.config import SamplingParams
from specdec.detokenizer import Detokenizer
from specdec.logprobs import TokenText, prompt_logprobs
from specdec.models.base import ForwardBatch, ModelRunner, pad_rows
from specdec.processing import RowProcessor, bad_words_token_ids
from specdec.sampling import make_generator
from specdec.scheduler import Scheduler
from specdec.sequence import Sequence


class Intake:
    def __init__(self, target: ModelRunner, scheduler: Scheduler, detokenizer: Detokenizer, token_text: TokenText):
        self.target, self.scheduler, self.detokenizer, self.token_text = target, scheduler, detokenizer, token_text
        self._grammar_compiler = None

    def admit(self, free_caches: Callable[[], None], prefill_new: Callable[[list[Sequence], int], None]) -> float:
        """Carry out the scheduler's admission (``Scheduler.admit``); returns the seconds spent
        prefilling. A merged newcomer feeds its whole prompt in the next verify pass (each row feeds
        what its cache lacks); the others are prefilled now but their last token (``prefill_new``:
        the engine's ``prefill``, given the newcomers and their first cache row), which the first
        round's verify pass feeds. ``free_caches``: the engine's, for caches held at an old peak
        that nothing uses."""
        admitted = self.scheduler.admit()
        if admitted is None:
            return 0.0
        t0 = time.perf_counter()
        if admitted.release_caches:
            free_caches()  # the newcomers have no cache yet; nothing else runs (the budget already knows)
        running, new = self.scheduler.running, admitted.seqs
        # room for the prompts now; the cache grows in steps as the outputs do
        self.target.reserve(len(running), max(s.num_prompt_tokens for s in running)
                            + self.scheduler.max_draft_positions + 1)
        self.target.sync_rows([s.seq_id for s in running])
        if admitted.merged:
            for s in new:
                s.num_computed = 0
            return 0.0
        prefill_new(new, len(running) - len(new))
        elapsed = time.perf_counter() - t0
        for s in new:  # each newcomer waited for the whole prefill
            s.stats.prefill_time_s += elapsed
        return elapsed

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, grammar=None) -> Sequence:
        """Queue a request. ``grammar``: a compiled matcher for ``params.structured_outputs`` (a server
        compiles it off the engine thread with ``grammar_compiler``); compiled here when None."""
        seq = self._sequence(prompt_token_ids, params, grammar)
        self.scheduler.add([seq])
        return seq

    def add_choices(self, prompt_token_ids: list[int], params: SamplingParams,
                    grammars: list | None = None) -> list[Sequence]:
        """``params.n`` sequences for one prompt (vLLM's n): choice i has n = 1 and, when seeded,
        seed + i (vLLM's rule), so each is reproducible alone. They share one prefill (``prefill``).
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

    def _sequence(self, prompt_token_ids: list[int], params: SamplingParams, grammar) -> Sequence:
        n, target = len(prompt_token_ids), self.target
        if n == 0:
            raise ValueError("prompt is empty; pass at least one token")
        if n >= target.max_model_len:
            raise ValueError(f"prompt has {n} tokens but the model's context is {target.max_model_len} "
                             "(prompt + at least one new token); shorten the prompt or raise max_model_len")
        bad = [t for t in prompt_token_ids if not (0 <= t < target.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{target.vocab_size - 1}")
        seq = Sequence(list(prompt_token_ids), params, make_generator(params.seed, target.device),
                       max_len=target.max_model_len)
        if params.processes_logits:
            seq.processor = self._processor(seq, grammar)
        return seq

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
        return RowProcessor(seq, V, stop_ids, bad_words, grammar, self.target.device)

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


def prefill(target: ModelRunner, running: list[Sequence], new: list[Sequence], first: int,
            token_text: TokenText) -> None:
    """Prefill each new sequence (cache rows first, first + 1, ...) but its last prompt token, which
    the first round's verify pass feeds, in one packed pass. A choice whose sibling (same
    prefill_group) is or will be prefilled copies that sibling's cache instead; a prompt that asks
    for prompt_logprobs gets a pass of its own with logits at every position."""
    row = {s.seq_id: i for i, s in enumerate(running)}
    source: dict[int, Sequence] = {}  # seq_id -> the sibling whose prompt cache it copies
    for s in new:
        if s.prefill_group is None:
            continue
        done = [o for o in running if o.prefill_group == s.prefill_group and o not in new
                and o.num_computed >= o.num_prompt_tokens - 1]
        first_new = next(o for o in new if o.prefill_group == s.prefill_group)
        src = done[0] if done else first_new
        if src is not s:
            source[s.seq_id] = src
    alone = [s for s in new if s.params.prompt_logprobs is not None and s.seq_id not in source]
    rows = [[] if s.seq_id in source or s in alone else s.prompt_token_ids[:-1] for s in new]
    if any(rows):
        target.forward(ForwardBatch(pad_rows(rows, target.device), [0] * len(new), [len(r) for r in rows],
                                    row_offset=first))
    for s in alone:
        logits = None
        if s.num_prompt_tokens > 1:
            logits = target.forward(ForwardBatch.from_rows([s.prompt_token_ids[:-1]], [0], logits="all",
                                                           row_offset=row[s.seq_id], device=target.device))[0]
        s.prompt_logprobs = prompt_logprobs(logits, s.prompt_token_ids, s.params.prompt_logprobs, token_text)
    for src in {id(v): v for v in source.values()}.values():
        dst = [row[d.seq_id] for d in new if source.get(d.seq_id) is src]
        target.copy_prefix(row[src.seq_id], dst, src.num_prompt_tokens - 1)
    for s in new:
        s.num_computed = s.num_prompt_tokens - 1
        if s.seq_id in source:
            s.prompt_logprobs = source[s.seq_id].prompt_logprobs
