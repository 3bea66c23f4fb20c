"""``method: "ngram"`` (prompt lookup): propose what followed the last n tokens when they last occurred.

For each sequence, the last n tokens of its history (prompt + output), n from
``prompt_lookup_max`` down to ``prompt_lookup_min``, are looked up in the same
history; at the first n that matches, the tokens that followed the most recent
earlier occurrence are proposed, k of them: when that occurrence is near the
end the copy runs on through its own drafts (a repeating history keeps
repeating); none when no n matches. Drafts are deterministic
(q = one-hot), so the verifier needs no draft probabilities.

The lookup is incremental: each sequence keeps an index from n-gram to the end
position of its most recent occurrence, and each round indexes only the tokens
added since the last one. The index is reconciled with the committed history
by length and by the tail it saw last; a history it does not recognise (a new
sequence, a rollback, a changed tail) is indexed from scratch.
"""

from __future__ import annotations

from specdec.drafters.base import DraftProposal, Drafter, KvUse, grew_from
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.tree import TreeShape

TAIL_CHECK = 8  # tokens compared to tell a grown history from a changed one


class NgramDrafter(Drafter):
    def __init__(self, prompt_lookup_min: int = 2, prompt_lookup_max: int = 4):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min} "
                             f"and {prompt_lookup_max}")
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self.index: dict[int, NgramIndex] = {}  # seq_id -> its history's n-gram index

    def propose(self, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        rows = []
        for s, want in zip(seqs, num_draft):
            index = self._sync(s)
            rows.append(index.lookup(want) if want > 0 else [])
        return DraftProposal.from_rows(rows, sb.device)

    def release(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.index.pop(s.seq_id, None)

    def kv_use(self, k: int, tree: TreeShape | None = None) -> list[KvUse]:
        """No KV. Its index is host memory outside the KV budget: per running sequence a copy of the
        history and one entry per distinct n-gram of it (n_min..n_max), freed when the sequence is."""
        return []

    def _sync(self, seq: Sequence) -> NgramIndex:
        history = seq.token_ids
        index = self.index.get(seq.seq_id)
        if index is None or not index.is_prefix_of(history):
            index = self.index[seq.seq_id] = NgramIndex(self.n_min, self.n_max)
        index.extend(history[len(index.tokens):])
        return index


class NgramIndex:
    """One history and, for every n-gram (n_min..n_max) ending before its last token, where it last ended."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []  # the history indexed so far (a copy: the engine's list keeps growing)
        self.last_end: dict[tuple[int, ...], int] = {}  # n-gram -> end position of its most recent occurrence

    def is_prefix_of(self, history: list[int]) -> bool:
        """Whether ``history`` grew from the indexed tokens."""
        return grew_from(self.tokens, history, TAIL_CHECK)

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens and index the n-grams that now end before the last token: O(new tokens * n sizes)."""
        if not new_tokens:
            return
        toks = self.tokens
        first = max(len(toks) - 1, 0)  # the old last token ends n-grams that could not be indexed until now
        toks.extend(new_tokens)
        last_end = self.last_end
        for e in range(first, len(toks) - 1):
            for n in range(self.n_min, min(self.n_max, e + 1) + 1):
                last_end[tuple(toks[e - n + 1:e + 1])] = e

    def lookup(self, k: int) -> list[int]:
        """k tokens that followed the most recent earlier occurrence of the longest matching suffix.

        When that occurrence is closer to the end than k tokens, the copy runs on into its own
        drafts: the history is repeating with a period of L - 1 - e tokens, and so do the drafts.
        """
        toks = self.tokens
        L = len(toks)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            e = self.last_end.get(tuple(toks[L - n:]))
            if e is not None:
                draft = toks[e + 1:e + 1 + k]
                period = L - 1 - e
                while len(draft) < k:
                    draft.append(draft[len(draft) - period])
                return draft
        return []
