"""What a request's SamplingParams do to the target's logits before temperature and truncation:
a grammar, allowed / bad words, min_tokens, logit_bias and the penalties, in vLLM's order.

Under speculation the target scores k+1 positions in one pass, and position j continues the
history *plus the row's first j drafts*: each position is processed with the counts, the bad-word
context and the grammar state it would have had if those drafts had been emitted. The verifier then
runs unchanged on processed logits, so the output is exactly what plain decoding with the same
processing would give. Model drafters process their own logits the same way (high acceptance).

One ``RowProcessor`` per sequence that needs one (``params.processes_logits``); it keeps output
counts and the grammar matcher in step with the committed history (``append``). The grammar
matcher advances speculatively through drafts and rolls back on the next commit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.config import SamplingParams
from specdec.sequence import Sequence


class GrammarMatcher(Protocol):
    """A grammar's state for one sequence (specdec/grammar.py builds them)."""

    def accept_token(self, token_id: int) -> bool: ...  # False: forbidden, state unchanged
    def rollback(self, num_tokens: int) -> None: ...
    def allowed_mask(self) -> torch.Tensor: ...  # [V] bool
    def is_terminated(self) -> bool: ...
    @property
    def failed(self) -> bool: ...  # the grammar engine gave up on this sequence (its limits)


class RowProcessor:
    def __init__(self, seq: Sequence, vocab_size: int, stop_token_ids: Iterable[int],
                 bad_words_ids: list[list[int]] = (), grammar: GrammarMatcher | None = None,
                 device: torch.device | str = "cpu"):
        p: SamplingParams = seq.params
        self.seq, self.params, self.vocab_size, self.grammar = seq, p, vocab_size, grammar
        V = vocab_size
        self.bad_words_ids = [list(w) for w in bad_words_ids if w]
        self.allowed: torch.Tensor | None = None  # [V] bool
        if p.allowed_token_ids is not None:
            self.allowed = torch.zeros(V, dtype=torch.bool, device=device)
            self.allowed[torch.tensor(p.allowed_token_ids, device=device)] = True
        self.min_tokens_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)
        self.bias: torch.Tensor | None = None  # [V]
        if p.logit_bias:
            self.bias = torch.zeros(V, device=device)
            self.bias[torch.tensor(list(p.logit_bias), device=device)] = torch.tensor(list(p.logit_bias.values()),
                                                                                     device=device)
        # the penalties touch few tokens: they work on the columns of the history's tokens and the drafts'
        self.repetition = p.repetition_penalty != 1.0  # over prompt + output
        self.counting = bool(p.presence_penalty or p.frequency_penalty)  # over the output
        self.columns: _Columns | None = None
        if self.repetition or self.counting:
            self.columns = _Columns.start(seq.prompt_token_ids if self.repetition else [], seq.output_token_ids,
                                          device)
        # the grammar's speculative path: tokens accepted past the committed history, and the mask
        # after each prefix of them (masks[i]: after spec[:i])
        self._spec: list[int] = []
        self._masks: list[torch.Tensor] = []
        self._grammar_failed = False

    # -- the committed history --------------------------------------------------------------------

    def append(self, tokens: list[int]) -> int:
        """The sequence committed ``tokens`` (already appended to its history); returns how many of them
        count: all, unless the grammar ended (or its engine gave up) before the last."""
        if self.grammar is not None:
            self._rollback_spec()
            for i, t in enumerate(tokens):
                if self.grammar_done:
                    tokens = tokens[:i]
                    break
                if not self.grammar.accept_token(t):
                    if self.grammar.failed:  # the engine gave up (its limits): the output ends here
                        self._grammar_failed = True
                        tokens = tokens[:i]
                        break
                    raise RuntimeError(f"token {t} was emitted but the grammar forbids it")
        if self.columns is not None:
            self.columns.add(tokens)
        return len(tokens)

    @property
    def grammar_done(self) -> bool:
        """The grammar is complete (or its engine gave up on this sequence): the output ends."""
        return self.grammar is not None and (self._grammar_failed or self.grammar.is_terminated())

    # -- the grammar along a draft ----------------------------------------------------------------

    def num_valid_drafts(self, drafts: list[int]) -> int:
        """How many of ``drafts`` the grammar allows in a row (all of them without a grammar)."""
        return len(drafts) if self.grammar is None else len(self._walk(drafts)) - 1

    def _walk(self, drafts: list[int]) -> list[torch.Tensor]:
        """Advance the matcher along ``drafts`` (reusing the speculative path where it agrees) and return
        the masks after each allowed prefix: [mask after drafts[:0], ..., after drafts[:n]], n allowed."""
        common = 0
        while common < min(len(drafts), len(self._spec)) and drafts[common] == self._spec[common]:
            common += 1
        if common < len(self._spec):
            self.grammar.rollback(len(self._spec) - common)
            del self._spec[common:], self._masks[common + 1:]
        if not self._masks:
            self._masks.append(self.grammar.allowed_mask())
        for t in drafts[common:]:
            if self.grammar.is_terminated() or not self._masks[-1][t] or not self.grammar.accept_token(t):
                break
            self._spec.append(t)
            self._masks.append(self.grammar.allowed_mask())
        return self._masks[: min(len(drafts), len(self._spec)) + 1]

    def _rollback_spec(self) -> None:
        if self._spec:
            self.grammar.rollback(len(self._spec))
        self._spec, self._masks = [], []

    # -- processing -------------------------------------------------------------------------------

    def process(self, logits: torch.Tensor, drafts: list[int], first: int = 0) -> torch.Tensor:
        """logits [T, V] (float32, modified in place and returned): position j continues the history
        plus ``drafts[:first + j]``. Positions past a draft the grammar forbids keep the last mask
        (the verifier never reads them: that draft is rejected)."""
        T, V = logits.shape
        drafts = drafts[: first + T - 1]
        if self.grammar is not None:
            walked = self._walk(drafts)
            masks = walked[first:] or walked[-1:]  # [<= T] x [V]
            mask = torch.stack(masks + [masks[-1]] * (T - len(masks)))  # [T, V]
            logits.masked_fill_(~mask, float("-inf"))
        # the masks below may leave nothing the grammar allows (allowed_token_ids outside it, min_tokens
        # banning the EOS a complete grammar needs): there the grammar wins, so the output stays valid
        grammar_only = (logits.clone() if self.grammar is not None and (
            self.allowed is not None or self.bad_words_ids or self.params.min_tokens) else None)  # [T, V]
        if self.allowed is not None:
            logits.masked_fill_(~self.allowed, float("-inf"))
        for j in range(T) if self.bad_words_ids else ():
            context = self.seq.token_ids + drafts[: first + j]
            for word in self.bad_words_ids:
                if len(word) == 1 or context[-(len(word) - 1):] == word[:-1]:
                    logits[j, word[-1]] = float("-inf")
        if self.params.min_tokens:
            emitted = self.seq.num_output_tokens + first + torch.arange(T, device=logits.device)  # [T]
            early = (emitted < self.params.min_tokens).nonzero().flatten()
            if len(early) and len(self.min_tokens_ids):
                logits[early[:, None], self.min_tokens_ids] = float("-inf")
        if grammar_only is not None:
            empty = torch.isneginf(logits).all(-1)  # [T]
            logits[empty] = grammar_only[empty]
        if self.bias is not None:
            logits += self.bias
        if self.columns is not None:
            self._penalize(logits, drafts, first)
        return logits

    def _penalize(self, logits: torch.Tensor, drafts: list[int], first: int) -> None:
        """Repetition, frequency and presence penalties on the columns of the tokens they touch."""
        T, p, cols = logits.shape[0], self.params, self.columns
        col, index = cols.col, cols.index
        extra = [t for t in dict.fromkeys(drafts) if t not in col]  # draft tokens new to the history
        if extra:
            col = {**col, **{t: len(col) + i for i, t in enumerate(extra)}}
            index = torch.cat([index, torch.tensor(extra, dtype=torch.long, device=logits.device)])  # [U]
        added = torch.zeros(first + T, len(col), device=logits.device)  # row m: drafts[m - 1] arrives
        if drafts:
            rows = torch.arange(1, len(drafts) + 1, device=logits.device)
            added.index_put_((rows, torch.tensor([col[t] for t in drafts], device=logits.device)),
                             torch.ones(len(drafts), device=logits.device), accumulate=True)
        added = added.cumsum(0)[first:]  # [T, U]: each column's count in drafts[:first + j]
        sub = logits[:, index]  # [T, U]
        if self.repetition:
            seen = added > 0  # [T, U]: the history's columns are seen, a draft's once it came
            seen[:, : len(cols.col)] = True
            rp = p.repetition_penalty
            sub = torch.where(seen, torch.where(sub > 0, sub / rp, sub * rp), sub)
        if self.counting:
            counts = torch.cat([cols.counts, cols.counts.new_zeros(len(extra))]) + added  # [T, U]
            sub = sub - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        logits[:, index] = sub


@dataclass
class _Columns:
    """The tokens of a row's history that penalties touch, as columns (prompt tokens for the repetition
    penalty, output tokens for all): ids [U], each id's column and its output count [U]. Each commit
    adds its tokens in place."""

    index: torch.Tensor  # [U] long
    col: dict[int, int]
    counts: torch.Tensor  # [U] float32

    @classmethod
    def start(cls, prompt: list[int], output: list[int], device) -> _Columns:
        empty = cls(torch.zeros(0, dtype=torch.long, device=device), {}, torch.zeros(0, device=device))
        empty.add(prompt, counted=False)
        empty.add(output)
        return empty

    def add(self, tokens: list[int], counted: bool = True) -> None:
        new = [t for t in dict.fromkeys(tokens) if t not in self.col]
        if new:
            device = self.index.device
            self.col.update({t: len(self.col) + i for i, t in enumerate(new)})
            self.index = torch.cat([self.index, torch.tensor(new, dtype=torch.long, device=device)])
            self.counts = torch.cat([self.counts, torch.zeros(len(new), device=device)])
        if counted and tokens:
            self.counts.index_add_(0, torch.tensor([self.col[t] for t in tokens], device=self.counts.device),
                                   torch.ones(len(tokens), device=self.counts.device))


def process_verify_logits(logits: torch.Tensor, seqs: list[Sequence], draft_token_ids: torch.Tensor,
                          num_draft: list[int]) -> torch.Tensor:
    """logits [B, k+1, V] of the verify pass -> the same with each processed row's first
    num_draft[b] + 1 positions processed (a new tensor when some row is; others untouched)."""
    rows = [b for b, s in enumerate(seqs) if s.processor is not None]
    if not rows:
        return logits
    out = logits.float().clone()
    drafts = draft_token_ids.tolist()
    for b in rows:
        n = num_draft[b]
        seqs[b].processor.process(out[b, : n + 1], drafts[b][:n])
    return out


def process_draft_logits(logits: torch.Tensor, seqs: list[Sequence], drafted: list[torch.Tensor]) -> torch.Tensor:
    """A model drafter's logits [B, V] for draft position i = len(drafted) (drafted: i tensors [B]),
    processed per row as the target's will be at that position."""
    rows = [b for b, s in enumerate(seqs) if s.processor is not None]
    if not rows:
        return logits
    out = logits.float().clone()
    prefix = torch.stack(drafted, dim=1).tolist() if drafted else [[] for _ in seqs]  # [B, i]
    i = len(drafted)
    for b in rows:
        seqs[b].processor.process(out[b : b + 1], prefix[b], first=i)
    return out


def constrain_drafts(seqs: list[Sequence], draft_token_ids: torch.Tensor, num_draft: list[int],
                     deterministic: list[bool]) -> list[int]:
    """Step 1b: a deterministic (one-hot) draft ends at the first token the row's grammar forbids: the
    verifier would reject it anyway (p = 0 there, and the residual of a one-hot q is p itself).
    Sampled drafts are left alone: their q was processed, and truncating them would bias the output."""
    rows = [b for b, s in enumerate(seqs) if s.processor is not None and s.processor.grammar is not None
            and num_draft[b] > 0 and deterministic[b]]
    if not rows:
        return num_draft
    num_draft = list(num_draft)
    drafts = draft_token_ids.tolist()
    for b in rows:
        num_draft[b] = seqs[b].processor.num_valid_drafts(drafts[b][: num_draft[b]])
    return num_draft


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word as token ids, alone and after a space (at the start of text and mid-text), as vLLM does."""
    if tokenizer is None:
        raise ValueError("bad_words needs a tokenizer; this model has none (ban token ids with logit_bias instead)")
    out: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out
