"""``method: "suffix"`` (suffix decoding, Oliaro et al. 2024): propose the most frequent continuation.

Two kinds of suffix tries, each holding every substring of its token sequences
up to ``max_tree_depth`` tokens with its number of occurrences:
- one per running request, over its prompt and output, grown as tokens are committed;
- one global trie over the outputs of the last ``max_cached_requests`` finished
  requests (a request's output is added when it is released; the oldest is evicted).

Each round, per sequence, every suffix of the history that the tries hold (at most
``max_tree_depth - 1`` tokens) is a candidate *match*; from its node the drafter follows
the most frequent child, token by token, while the path's empirical probability (the
product of count(child) / count(the node's continuations) along it) stays at or above
``min_token_prob``, for at most min(k, floor(max_spec_factor * match length),
max_tree_depth - match length) tokens. The candidate whose draft has the largest
expected number of accepted tokens (the sum of its path probabilities) wins; ties go to
the longer match and to the request's own trie. (The longest match alone is a poor
choice in repetitive text: in a loop of period p its only earlier occurrence ends p
tokens before the end, so it could propose p tokens at most.) Candidates whose cap
cannot beat the best so far are skipped, so deep matches that draft well end the search.
Drafts are deterministic (q = one-hot).

Memory and time: a string that occurs once is not stored node by node but as a
*leaf*, one int naming its occurrence (its continuation is read from the tokens),
so nodes exist only for repeated substrings, and leaves are neither Python objects
with a header nor tracked by the garbage collector. Appending a token touches one
node per open suffix that is still repeated (at most max_tree_depth); evicting a
request walks its substrings once more and removes what only it contributed.
"""

from __future__ import annotations

from specdec.drafters.base import DraftProposal, Drafter, grew_from
from specdec.drafters.ngram import TAIL_CHECK
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence


class SuffixDrafter(Drafter):
    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 1000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1):
        if max_tree_depth < 1 or max_cached_requests < 0 or max_spec_factor <= 0 or not 0 <= min_token_prob <= 1:
            raise ValueError("need max_tree_depth >= 1, max_cached_requests >= 0, max_spec_factor > 0 and "
                             f"0 <= min_token_prob <= 1; got {max_tree_depth}, {max_cached_requests}, "
                             f"{max_spec_factor}, {min_token_prob}")
        self.depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.requests: dict[int, RequestTrie] = {}  # seq_id -> trie over its prompt + output
        self.cache = SuffixTrie(max_tree_depth)  # earlier requests' outputs (cache.seqs, oldest first)

    # -- the Drafter interface --------------------------------------------------------------------

    def propose(self, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        rows = []
        for s, want in zip(seqs, num_draft):
            if want > 0:
                rows.append(self.draft(s, want)[0])
            else:
                self.sync(s)
                rows.append([])
        return DraftProposal.from_rows(rows, sb.device)

    def draft(self, seq: Sequence, want: int) -> tuple[list[int], float]:
        """Up to ``want`` tokens continuing ``seq`` and their expected accepted count (the summed
        path probabilities)."""
        return self._draft(self.sync(seq), want)

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        for s in seqs:
            self.sync(s)

    def release(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            req = self.requests.pop(s.seq_id, None)
            if req is None or self.max_cached_requests == 0:
                continue
            # Read the sequence itself, not the trie's copy: the last round's tokens may not have been shown.
            output = s.output_token_ids
            if output:
                self.cache.insert(output)
                while len(self.cache.seqs) > self.max_cached_requests:
                    self.cache.remove(next(iter(self.cache.seqs)))  # the oldest

    # -- drafting ---------------------------------------------------------------------------------

    def sync(self, seq: Sequence) -> RequestTrie:
        """The sequence's trie, grown to its committed history."""
        req = self.requests.get(seq.seq_id)
        if req is None or not req.is_prefix_of(seq.token_ids):
            req = self.requests[seq.seq_id] = RequestTrie(self.depth, seq)
        req.extend(seq.token_ids[len(req.tokens):])
        return req

    def _draft(self, req: RequestTrie, want: int) -> tuple[list[int], float]:
        history = req.tokens
        best, best_score = [], 0.0
        for node, m in req.open:  # the request's own repeated suffixes, longest first
            limit = self._limit(want, m)
            if limit > best_score:
                draft, score = req.follow(node, limit, self.min_token_prob)
                if score > best_score:
                    best, best_score = draft, score
        if self.cache.seqs:
            for m in range(self.cache.longest_match(history, self.depth - 1), 0, -1):
                limit = self._limit(want, m)
                if limit > best_score:
                    at = self.cache.walk(history, len(history) - m, len(history))
                    draft, score = self.cache.follow(at, limit, self.min_token_prob)
                    if score > best_score:
                        best, best_score = draft, score
        return best, best_score

    def _limit(self, want: int, m: int) -> int:
        """The most drafts a match of m tokens may propose (floor, as vLLM; the epsilon absorbs rounding)."""
        return min(want, int(self.max_spec_factor * m + 1e-9), self.depth - m)


class Node:
    """A substring that occurred more than once: its count and its one-token extensions."""

    __slots__ = ("count", "children")

    def __init__(self, count: int):
        self.count = count
        self.children: dict[int, Node | int] = {}  # token -> Node, or a leaf code


# A substring that occurred once is a *leaf*: the int (slot << SLOT_SHIFT) | end naming the sequence
# (its slot in SuffixTrie.seqs) and the position of the string's last token in it. Its extensions
# are read from that sequence: extending the string by the next token is adding 1 to the code.
SLOT_SHIFT = 32
END_MASK = (1 << SLOT_SHIFT) - 1
OpenSuffix = tuple[Node, int]  # (node of a repeated suffix of the tokens inserted so far, its depth)


class SuffixTrie:
    """All substrings of up to ``depth`` tokens of the inserted sequences, with their occurrence counts.

    A sequence is inserted token by token; the open suffixes (those of the tokens so
    far that are repeated and shorter than ``depth``) each move one node down per
    token, so appending costs O(depth) at worst and usually much less."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = Node(0)
        self.seqs: dict[int, list[int]] = {}  # slot -> an inserted sequence, in insertion order
        self._next_slot = 0

    def append(self, slot: int, j: int, open_suffixes: list[OpenSuffix]) -> list[OpenSuffix]:
        """Insert the occurrences that end at ``seqs[slot][j]`` (already in the sequence), given the open
        suffixes of ``seqs[slot][:j]``, deepest first; returns those of ``seqs[slot][:j + 1]``."""
        t, D = self.seqs[slot][j], self.depth
        still_open = []
        for node, d in open_suffixes + [(self.root, 0)]:
            child = node.children.get(t)
            if child is None:  # a new string: one occurrence, kept as a leaf
                node.children[t] = (slot << SLOT_SHIFT) | j
                continue
            if type(child) is int:  # a second occurrence: store the string as a node
                first_seq, e = self.seqs[child >> SLOT_SHIFT], (child & END_MASK) + 1
                repeated = Node(1)
                if d + 1 < D and e < len(first_seq):  # the first occurrence's extension, if it has one
                    repeated.children[first_seq[e]] = child + 1
                child = node.children[t] = repeated
            child.count += 1
            if d + 1 < D:
                still_open.append((child, d + 1))
        return still_open

    def insert(self, tokens: list[int]) -> int:
        """Add a whole sequence (kept by reference: it must not change while it is in the trie); its slot."""
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        self.seqs[slot] = tokens
        open_suffixes: list[OpenSuffix] = []
        for j in range(len(tokens)):
            open_suffixes = self.append(slot, j, open_suffixes)
        return slot

    def remove(self, slot: int) -> None:
        """Take an inserted sequence out again: every substring it contributed loses one occurrence."""
        tokens = self.seqs[slot]
        for i in range(len(tokens)):
            node = self.root
            for d in range(min(self.depth, len(tokens) - i)):
                t = tokens[i + d]
                child = node.children[t]
                if type(child) is int or child.count == 1:  # this occurrence was the only one
                    del node.children[t]
                    break
                child.count -= 1
                node = child
        del self.seqs[slot]

    def walk(self, tokens: list[int], start: int, stop: int) -> Node | int | None:
        """The trie position of ``tokens[start:stop]`` (a node or a leaf code), or None if it is not held."""
        at: Node | int = self.root
        for i in range(start, stop):
            t = tokens[i]
            if type(at) is int:
                seq, e = self.seqs[at >> SLOT_SHIFT], (at & END_MASK) + 1
                if e >= len(seq) or seq[e] != t:
                    return None
                at += 1
            else:
                at = at.children.get(t)
                if at is None:
                    return None
        return at

    def longest_match(self, tokens: list[int], max_len: int) -> int:
        """The length of the longest suffix of ``tokens`` (at most ``max_len`` tokens) that the trie holds.
        Binary search: every suffix of a string in the trie is in the trie too."""
        lo, hi = 0, min(max_len, len(tokens))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.walk(tokens, len(tokens) - mid, len(tokens)) is None:
                hi = mid - 1
            else:
                lo = mid
        return lo

    def follow(self, at: Node | int, limit: int, min_prob: float) -> tuple[list[int], float]:
        """The greedy most-frequent path of at most ``limit`` tokens from a trie position, stopping before
        its probability falls below ``min_prob``; returns the drafts and their summed path probabilities
        (the expected number of accepted drafts, were the counts the truth)."""
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < limit:
            if type(at) is int:  # a string seen once: it continues as its one occurrence does (p = 1)
                seq, e = self.seqs[at >> SLOT_SHIFT], (at & END_MASK) + 1
                if e >= len(seq):
                    break
                token, at = seq[e], at + 1
            else:
                token, child, top, total = -1, None, 0, 0
                for t, c in at.children.items():
                    n = 1 if type(c) is int else c.count
                    total += n
                    if n > top:
                        token, child, top = t, c, n
                if child is None:
                    break
                prob *= top / total
                at = child
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
        return draft, score


class RequestTrie(SuffixTrie):
    """A running request's trie over its history (slot 0), and the open suffixes that grow with each token."""

    def __init__(self, depth: int, seq: Sequence):
        super().__init__(depth)
        self.tokens: list[int] = []  # the history inserted so far (a copy: leaves point into it)
        self.seqs[0] = self.tokens
        self.open: list[OpenSuffix] = []

    def is_prefix_of(self, history: list[int]) -> bool:
        """Whether ``history`` grew from the inserted tokens."""
        return grew_from(self.tokens, history, TAIL_CHECK)

    def extend(self, new_tokens: list[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(new_tokens)
        for j in range(start, len(self.tokens)):
            self.open = self.append(0, j, self.open)
