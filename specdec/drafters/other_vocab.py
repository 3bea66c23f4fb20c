"""``method: "draft_model"`` with a draft whose tokenizer differs from the target's.

The algorithms of Timor et al. 2025, "Lossless Speculative Decoding Algorithms for Heterogeneous
Vocabularies", chosen by ``draft_tokenizer_mapping``:

- ``"string"`` (string-level exact match): the draft continues the text in its own tokens (its
  argmax), the text is re-encoded with the target's tokenizer after the history's last tokens, and
  the target tokens past the history are proposed, the last one dropped unless the draft ended
  (more text could have changed it). The proposal is deterministic (q = one-hot): the verifier
  accepts x with probability p(x) and samples a rejected position from p without x, exact for any
  proposal, and a seeded request draws exactly what it would draw without a drafter.
- ``"intersection"`` (token-level intersection): tokens with the same text in both vocabularies
  map 1:1 (vocab_map.py); the draft's logits are carried onto those target tokens, so a row drafts
  (argmax, or samples with its own parameters) from the draft's distribution restricted to the
  shared tokens and renormalized, and hands the verifier that q in the target's vocabulary
  [B, k, V_target], zero off the intersection: the standard rule is exact for it.
- ``"auto"``: the first rounds alternate the two; the one with more accepted tokens per drafting
  row-round is kept, the faster-drafting one when they are within 5% (``mapping`` says which, and it
  is logged). A round in which a seeded sampled row drafts runs ``"string"`` (``policy.SEEDED_MAPPING``):
  the measured choice follows other requests and timings, which must not steer the row's draws, and
  string drafts leave it its plain output.

The draft sees each sequence's history as text re-encoded with its own tokenizer (``TextView``):
the part more than ``MARGIN`` target tokens back is frozen once re-encoding shows it stable, and
each round re-encodes only the tail after it. Its KV cache then follows that view as the
same-vocabulary drafter's does: keep the longest common prefix, feed the rest.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from specdec.drafters.autoregressive import draft_autoregressive
from specdec.drafters.base import DraftProposal, Drafter, KvUse, runner_kv
from specdec.drafters.draft_model import CATCH_UP_TOGETHER
from specdec.drafters.vocab_map import (COVERAGE_SAMPLE, REPLACEMENT, VocabMap, decode, encode, encode_continuation,
                                        encode_start, token_texts)
from specdec.models.base import ForwardBatch, ModelRunner
from specdec.policy import SEEDED_MAPPING, is_seeded
from specdec.sampling import SamplingBatch, argmax
from specdec.sequence import Sequence
from specdec.tree import TreeShape

log = logging.getLogger(__name__)

MAPPINGS = ("string", "intersection")
CONTEXT = 8  # tokens of history decoded before a re-encoded piece, so it is spelt as a continuation
MARGIN = 16  # target tokens at the end of a history that are re-encoded every round (the rest is frozen)
TRIAL_ROWS = 16  # auto: drafting row-rounds each mapping is measured over before one is kept
NEAR = 0.05  # auto: acceptances this close (relative) count as a tie, which the cheaper mapping wins
VIEW_START = 1  # draft tokens a view may hold beyond the history's text: the draft's BOS (encode_start)
OFF_INTERSECTION = -1e30  # a target token's logit when the draft has no token of its text: probability 0


class OtherVocabDrafter(Drafter):
    def __init__(self, runner: ModelRunner, target_tokenizer, vocab_map: VocabMap, mapping: str = "auto",
                 draft_p_min: float = 0.0, name: str = "draft"):
        if mapping not in MAPPINGS + ("auto",):
            raise ValueError(f"draft_tokenizer_mapping must be 'auto', 'string' or 'intersection', got {mapping!r}")
        if mapping == "intersection" and not vocab_map.num_shared_text:
            raise ValueError(f"draft {name!r} and target share no token of the same text, so "
                             "draft_tokenizer_mapping 'intersection' has nothing to draft with; use 'string' or 'auto'")
        self.runner, self.map, self.draft_p_min, self.name = runner, vocab_map, draft_p_min, name
        self.target_tok, self.draft_tok = target_tokenizer, runner.tokenizer
        # the mapping that runs: None while auto measures both (an intersection of end-of-sequence alone
        # cannot draft text, so auto then keeps string)
        self.requested = mapping
        self.mapping: str | None = mapping if mapping != "auto" else (None if vocab_map.num_shared_text else "string")
        # mapping -> [row-rounds that asked for drafts, tokens they accepted, proposals, seconds drafting]
        self.measured = {m: [0, 0, 0, 0.0] for m in MAPPINGS}
        self._last: str | None = None  # the mapping of the last proposal
        self.views: dict[int, TextView] = {}  # seq_id -> its history in the draft's tokens
        self.cached: dict[int, list[int]] = {}  # seq_id -> draft tokens whose KV sits in the draft cache
        d2t = vocab_map.draft_to_target
        self._from = (d2t >= 0).nonzero().flatten()  # [S] draft ids of the shared tokens
        self._to = d2t[self._from]  # [S] their target ids
        self.target_vocab = len(vocab_map.target_to_draft)
        self._all_shared = bool((d2t >= 0).all())  # every draft token has a target token of its text
        self._per_token: float | None = None  # draft_tokens_per_token, measured when first asked

    # -- the round --------------------------------------------------------------------------------

    def propose(self, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        t0 = time.perf_counter()
        mapping = self.mapping or self._trial()
        if self.requested == "auto" and any(n and is_seeded(s.params) for s, n in zip(seqs, num_draft)):
            mapping = SEEDED_MAPPING  # the seeds rule (policy.py): the row's mapping never follows the batch
        proposal = self._propose(mapping, seqs, num_draft, sb)
        stats = self.measured[mapping]
        stats[2] += 1
        stats[3] += time.perf_counter() - t0
        return proposal

    def _propose(self, mapping: str, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        B = len(seqs)
        views = [self._view(s) for s in seqs]  # [B] each history in draft tokens
        k = max(num_draft)
        steps = self._string_steps(seqs, views, k) if mapping == "string" else k  # draft positions to run
        rows = [b for b in range(B) if len(views[b]) + steps <= self.runner.max_model_len
                and len(views[b]) <= self._kv_share(seqs[b])]  # the rest: no room, or past their KV share
        self._last = mapping
        self.measured[mapping][0] += sum(1 for n in num_draft if n > 0)  # observe() adds what they accept
        drafts: list[list[int]] = [[] for _ in range(B)]
        if not rows:
            return DraftProposal.from_rows(drafts, sb.device)
        sub = [seqs[b] for b in rows]
        logits, pos = self._catch_up(sub, [views[b] for b in rows])  # [R, V_draft], [R]
        if mapping == "string":
            for b, row in zip(rows, self._draft_string(sub, [views[b] for b in rows], logits, pos, steps)):
                drafts[b] = row[: num_draft[b]]
            return DraftProposal.from_rows(drafts, sb.device)
        proposal = self._draft_intersection(sub, [views[b] for b in rows], logits, pos,
                                            [num_draft[b] for b in rows], sb.select(rows))
        if len(rows) == B:
            return proposal
        n = proposal.draft_token_ids.shape[1]
        ids = torch.zeros(B, n, dtype=torch.long, device=sb.device)  # [B, n]
        ids[rows] = proposal.draft_token_ids
        probs = None
        if proposal.draft_probs is not None:  # [R, n, V] -> [B, n, V]; rows without room propose nothing
            probs = proposal.draft_probs.new_zeros(B, n, self.target_vocab)
            probs[rows] = proposal.draft_probs
        num = [0] * B
        for i, b in enumerate(rows):
            num[b] = proposal.num_draft_tokens[i]
        return DraftProposal(ids, probs, num)

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        if self._last is not None:
            self.measured[self._last][1] += sum(num_accepted)

    def _trial(self) -> str:
        """Auto: the mapping to measure next (the less measured one), or the better one for good once
        both have been measured over TRIAL_ROWS drafting row-rounds (acceptances within NEAR of each
        other: the one that drafts faster)."""
        if min(stats[0] for stats in self.measured.values()) < TRIAL_ROWS:
            return min(MAPPINGS, key=lambda m: self.measured[m][0])
        rate = {m: a / r for m, (r, a, _, _) in self.measured.items()}
        cost = {m: t / n for m, (_, _, n, t) in self.measured.items()}  # seconds drafting per proposal
        best = max(MAPPINGS, key=lambda m: rate[m])
        if min(rate.values()) >= (1 - NEAR) * rate[best]:  # a tie: the cheaper one
            best = min(MAPPINGS, key=lambda m: cost[m])
        self.mapping = best
        log.info("draft %s (another tokenizer): mapping %r kept; accepted tokens per drafting row-round: "
                 "string %.2f, intersection %.2f; ms drafting per round: string %.1f, intersection %.1f",
                 self.name, best, rate["string"], rate["intersection"], 1e3 * cost["string"],
                 1e3 * cost["intersection"])
        return self.mapping

    # -- the draft's view and cache ---------------------------------------------------------------

    def _view(self, s: Sequence) -> list[int]:
        view = self.views.get(s.seq_id)
        if view is None:
            view = self.views[s.seq_id] = TextView(self.target_tok, self.draft_tok, self.map.target_drop)
        return view.update(s.token_ids)

    def _catch_up(self, seqs: list[Sequence], views: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """Bring each row's draft cache to its view (the longest common prefix stays, at least the last
        token is fed); returns the logits after each view [R, V_draft] and each view's length."""
        R = len(seqs)
        is_new = self.runner.sync_rows([s.seq_id for s in seqs])
        starts, chunks = [], []
        for s, view, new in zip(seqs, views, is_new):
            cached = [] if new else self.cached[s.seq_id]
            limit = min(len(cached), len(view) - 1)
            m = 0
            while m < limit and cached[m] == view[m]:
                m += 1
            starts.append(m)
            chunks.append(view[m:])
        split = R  # newcomers with a long prompt catch up in a forward of their own (draft_model.py)
        while split > 0 and is_new[split - 1]:
            split -= 1
        if split in (0, R) or max(len(c) for c in chunks[split:]) <= CATCH_UP_TOGETHER:
            split = R
        logits = torch.cat([self.runner.forward(ForwardBatch.from_rows(chunks[lo:hi], starts[lo:hi], logits="last",
                                                                       row_offset=lo, device=self.runner.device))
                            for lo, hi in ((0, split), (split, R)) if hi > lo])  # [R, V_draft]
        return logits, [len(v) for v in views]

    # -- string-level exact match -----------------------------------------------------------------

    def _string_steps(self, seqs: list[Sequence], views: list[list[int]], k: int) -> int:
        """Draft tokens to run for k target tokens plus one (the last is dropped): k + 1 times the
        draft tokens per target token of the longest-spelt history, at most 2k + 2."""
        ratio = max(len(v) / max(len(s.token_ids), 1) for s, v in zip(seqs, views))
        return max(2, min(math.ceil((k + 1) * ratio), 2 * k + 2))

    def _draft_string(self, seqs: list[Sequence], views: list[list[int]], logits: torch.Tensor, pos: list[int],
                      steps: int) -> list[list[int]]:
        """The draft's argmax continuation, ``steps`` draft tokens per row, as target tokens per row."""
        eos = self.map.draft_eos
        first = argmax(logits).tolist()  # [R]
        rest = self.runner.greedy_steps(first, pos, steps - 1, stop_token_ids=eos) if steps > 1 else [[]] * len(seqs)
        out = []
        for s, view, x, more in zip(seqs, views, first, rest):
            self.cached[s.seq_id] = view + [x] + more[:-1]  # the last argmax is not fed
            tokens = [x] + more
            ended = next((i for i, t in enumerate(tokens) if t in eos), None)
            if ended is not None:
                tokens = tokens[:ended]
            out.append(self._as_target(s.token_ids, view, tokens, ended is not None))
        return out

    def _as_target(self, history: list[int], view: list[int], tokens: list[int], ended: bool) -> list[int]:
        """Draft ``tokens`` after ``view`` as target tokens after ``history``: decoded to text, re-encoded
        after the history's last tokens; the last one dropped unless the draft ended (then the target's
        end-of-sequence follows)."""
        drop = self.map.draft_drop
        context = decode(self.draft_tok, view[-CONTEXT:], drop)
        whole = decode(self.draft_tok, view[-CONTEXT:] + tokens, drop)
        text = whole[len(context):] if whole.startswith(context) else decode(self.draft_tok, tokens, drop)
        text = text.rstrip(REPLACEMENT)  # bytes of a character the draft has not finished
        ids: list[int] = []
        if text:
            lo = max(0, len(history) - CONTEXT)
            context = decode(self.target_tok, history[lo:], self.map.target_drop)
            ids = encode_continuation(self.target_tok, context, text)
            if ids is None:  # a target token would straddle the history's end: spell the text alone
                ids = encode(self.target_tok, text)
        if ended and self.map.target_eos is not None:
            return ids + [self.map.target_eos]
        return ids[:-1]

    # -- token-level intersection -----------------------------------------------------------------

    def _to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [R, V_draft] -> target logits [R, V_target]: each shared token's logit on its
        target id, a logit of probability 0 elsewhere (finite, so a row whose grammar forbids every
        shared token still drafts, from what it allows)."""
        out = logits.new_full((logits.shape[0], self.target_vocab), OFF_INTERSECTION)
        out[:, self._to] = logits[:, self._from]
        return out

    def _draft_intersection(self, seqs: list[Sequence], views: list[list[int]], logits: torch.Tensor,
                            pos: list[int], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        t2d = self.map.target_to_draft.to(logits.device)

        def feed(x: torch.Tensor, i: int) -> torch.Tensor:  # target ids x [R] -> target logits [R, V_target]
            d = t2d[x].clamp(min=0)  # [R]; a token off the intersection feeds draft id 0 (its drafts still exact)
            return self._to_target(self.runner.forward(ForwardBatch.dense(d[:, None], [p + i for p in pos],
                                                                          logits="last")))

        greedy = None
        if self._all_shared:  # the draft's own argmax is the restricted one: all greedy drafts in one call
            d2t = self.map.draft_to_target

            def greedy(x: list[int], n: int) -> list[list[int]]:  # target ids x [R] -> the next n [R, n]
                out = self.runner.greedy_steps(t2d[torch.tensor(x)].tolist(), pos, n)  # [R, n] draft ids
                return d2t[torch.tensor(out, dtype=torch.long)].tolist()

        proposal = draft_autoregressive(self._to_target(logits), feed, seqs, num_draft, sb, self.draft_p_min, greedy)
        n = proposal.draft_token_ids.shape[1]
        fed = t2d[proposal.draft_token_ids[:, : max(n - 1, 0)]].clamp(min=0).tolist()  # [R, n-1] draft ids
        for s, view, f in zip(seqs, views, fed):
            self.cached[s.seq_id] = view + f
        return proposal

    # -- bookkeeping ------------------------------------------------------------------------------

    def kv_use(self, k: int, tree: TreeShape | None = None) -> list[KvUse]:
        """Its cache holds each history in the draft's tokens (``TextView``, at most ``_kv_share`` of
        them: a row past it drafts nothing), then a round's draft steps and the padding position past
        the longest row: 2k + 2 steps when string mode may run (``_string_steps``), k for the intersection."""
        steps = k if self.requested == "intersection" else 2 * k + 2
        return [runner_kv(self.runner, self.draft_tokens_per_token(), steps + 1 + VIEW_START)]

    def draft_tokens_per_token(self) -> float:
        """The draft tokens per target token that the KV budget counts: the mean over a spread sample
        of the target's token texts spelt alone by the draft's tokenizer (at least 1, in eighths). Whole
        texts spell fewer: 1.12 on running text for the shipped vocab4k draft, 1.625 over its token texts."""
        if self._per_token is None:
            texts = [t for t in token_texts(self.target_tok, self.target_vocab) if t]
            sample = texts[:: max(1, len(texts) // COVERAGE_SAMPLE)]
            mean = sum(len(encode(self.draft_tok, t)) for t in sample) / max(len(sample), 1)
            self._per_token = max(1.0, math.ceil(8 * mean) / 8)
        return self._per_token

    def _kv_share(self, s: Sequence) -> int:
        """The draft tokens of history the KV budget counts for ``s``: per target token it may reach, and
        the draft's start of text."""
        n = min(s.num_prompt_tokens + s.params.max_tokens, s.max_len)
        return math.ceil(self.draft_tokens_per_token() * n - 1e-9) + VIEW_START

    def bound_caches(self, target_positions: int | None) -> None:
        self.runner.max_cache_positions = (None if target_positions is None
                                           else math.ceil(target_positions * self.draft_tokens_per_token()))

    def release_memory(self) -> None:
        self.runner.release()  # every row starts empty again; propose() notices new rows

    def release(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.views.pop(s.seq_id, None)
            self.cached.pop(s.seq_id, None)


class TextView:
    """One sequence's history (target tokens) in the draft's tokens: the text of the history, encoded
    with the draft's tokenizer. ``frozen`` holds the draft tokens of the history's first ``anchor``
    target tokens; each update re-encodes only what follows them (as a continuation of the
    ``CONTEXT`` tokens before), and moves the anchor up to ``MARGIN`` tokens from the end once the
    re-encoded tail shows the part before it stable."""

    def __init__(self, target_tok, draft_tok, drop: frozenset[int] = frozenset()):
        self.target_tok, self.draft_tok, self.drop = target_tok, draft_tok, drop  # drop: target specials left out
        self.anchor = 0  # target tokens whose text ``frozen`` spells
        self.frozen: list[int] = []  # [draft tokens] of the first ``anchor`` target tokens' text
        self.seen_len = 0  # the history last seen: its length and its last tokens
        self.seen_tail: list[int] = []

    def update(self, history: list[int]) -> list[int]:
        """The draft tokens of ``history`` (which grew from the last one seen, or replaced it)."""
        n = len(history)
        w = min(self.seen_len, CONTEXT)
        if n < self.seen_len or history[self.seen_len - w:self.seen_len] != self.seen_tail:
            self.anchor, self.frozen = 0, []  # a history it does not recognise: from the start
        self.seen_len, self.seen_tail = n, history[n - min(n, CONTEXT):]
        tail = self._continuation(history, self.anchor, n)
        if tail is None:  # the frozen part's last token would change: re-encode the whole history
            self.anchor, self.frozen = 0, []
            tail = self._continuation(history, 0, n)
        if n - self.anchor >= 2 * MARGIN:  # freeze all but the last MARGIN tokens, if the tail agrees
            head = self._continuation(history, self.anchor, n - MARGIN)
            if head is not None and tail[: len(head)] == head:
                self.frozen = self.frozen + head
                self.anchor = n - MARGIN
                return self.frozen + tail[len(head):]
        return self.frozen + tail

    def _continuation(self, history: list[int], a: int, b: int) -> list[int] | None:
        """Draft tokens of the text of history[a:b] where it follows history[:a]; None when the text of
        history[:a] would be re-encoded differently (a draft token straddles the boundary, or the
        boundary splits a character)."""
        if a == 0:
            return encode_start(self.draft_tok, decode(self.target_tok, history[:b], self.drop))
        lo = max(0, a - CONTEXT)
        context = decode(self.target_tok, history[lo:a], self.drop)
        whole = decode(self.target_tok, history[lo:b], self.drop)
        if not whole.startswith(context) or context.endswith(REPLACEMENT):
            return None
        return encode_continuation(self.draft_tok, context, whole[len(context):])
