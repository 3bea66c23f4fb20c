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
*leaf* pointing at its occurrence (its continuation is read from the tokens), so
nodes exist only for repeated substrings. Appending a token touches one node per
open suffix that is still repeated (at most max_tree_depth); evicting a request
walks its substrings once more and removes what only it contributed.
"""

from __future__ import annotations

from collections import deque

from specdec.drafters.base import DraftProposal, Drafter
from specdec.drafters.ngram import TAIL_CHECK, proposal_from_rows
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence


class SuffixDrafter(Drafter):
    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
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
        self.cache = SuffixTrie(max_tree_depth)  # earlier requests' outputs
        self.cached: deque[list[int]] = deque()  # those outputs, oldest first

    # -- the Drafter interface --------------------------------------------------------------------

    def propose(self, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        rows = []
        for s, want in zip(seqs, num_draft):
            req = self._sync(s)
            rows.append(self._draft(req, want) if want > 0 else [])
        return proposal_from_rows(rows, sb.temperature.device)

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        for s in seqs:
            self._sync(s)

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            req = self.requests.pop(i, None)
            if req is not None and self.max_cached_requests > 0:
                self._sync_final(req)
                output = req.tokens[req.num_prompt:]
                if output:
                    self._cache_output(output)

    # -- state ------------------------------------------------------------------------------------

    def _sync(self, seq: Sequence) -> RequestTrie:
        req = self.requests.get(seq.seq_id)
        if req is None or not req.is_prefix_of(seq.token_ids):
            req = self.requests[seq.seq_id] = RequestTrie(self.depth, seq)
        req.extend(seq.token_ids[len(req.tokens):])
        return req

    def _sync_final(self, req: RequestTrie) -> None:
        """Catch up with the tokens of the request's last round (the engine may not have shown them)."""
        history = req.seq.token_ids
        if req.is_prefix_of(history):
            req.tokens.extend(history[len(req.tokens):])  # the trie itself is about to be dropped
        else:
            req.tokens = list(history)

    def _cache_output(self, output: list[int]) -> None:
        output = list(output)
        self.cache.insert(output)
        self.cached.append(output)
        while len(self.cached) > self.max_cached_requests:
            self.cache.remove(self.cached.popleft())

    # -- drafting ---------------------------------------------------------------------------------

    def _draft(self, req: RequestTrie, want: int) -> list[int]:
        history = req.tokens
        best, best_score = [], 0.0
        for node, m in req.open:  # the request's own repeated suffixes, longest first
            limit = self._limit(want, m)
            if limit > best_score:
                draft, score = self._follow(node, limit)
                if score > best_score:
                    best, best_score = draft, score
        if self.cached:
            for m in range(self.cache.longest_match(history, self.depth - 1), 0, -1):
                limit = self._limit(want, m)
                if limit > best_score:
                    draft, score = self._follow(self.cache.walk(history, len(history) - m, len(history)), limit)
                    if score > best_score:
                        best, best_score = draft, score
        return best

    def _limit(self, want: int, m: int) -> int:
        """The most drafts a match of m tokens may propose (floor, as vLLM; the epsilon absorbs rounding)."""
        return min(want, int(self.max_spec_factor * m + 1e-9), self.depth - m)

    def _follow(self, cursor: Node | Leaf, limit: int) -> tuple[list[int], float]:
        """Greedy most-frequent path of at most ``limit`` tokens from a matched trie position; returns the
        drafts and their summed path probabilities (the expected number of accepted drafts, were the
        counts the truth)."""
        draft: list[int] = []
        prob, score = 1.0, 0.0
        node = cursor
        while len(draft) < limit:
            if type(node) is Leaf:  # a string seen once: its continuation is the next token of that occurrence
                e = node.end + 1
                if e >= len(node.tokens):
                    break
                token, node = node.tokens[e], Leaf(node.tokens, e)
            else:
                token, child, top, total = -1, None, 0, 0
                for t, c in node.children.items():
                    n = c.count if type(c) is Node else 1
                    total += n
                    if n > top:
                        token, child, top = t, c, n
                if child is None:
                    break
                prob *= top / total
                node = child
            if prob < self.min_token_prob:
                break
            draft.append(token)
            score += prob
        return draft, score


class Node:
    """A substring that occurred more than once: its count and its one-token extensions."""

    __slots__ = ("count", "children")

    def __init__(self, count: int):
        self.count = count
        self.children: dict[int, Node | Leaf] = {}


class Leaf:
    """A substring that occurred once, ending at ``tokens[end]``; its extensions are read from ``tokens``."""

    __slots__ = ("tokens", "end")

    def __init__(self, tokens: list[int], end: int):
        self.tokens, self.end = tokens, end


OpenSuffix = tuple[Node, int]  # (node of a repeated suffix of the tokens inserted so far, its depth)


class SuffixTrie:
    """All substrings of up to ``depth`` tokens of the inserted sequences, with their occurrence counts.

    A sequence is inserted token by token; the open suffixes (those of the tokens so
    far that are repeated and shorter than ``depth``) each move one node down per
    token, so appending costs O(depth) at worst and usually much less."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = Node(0)

    def append(self, tokens: list[int], j: int, open_suffixes: list[OpenSuffix]) -> list[OpenSuffix]:
        """Insert the occurrences that end at ``tokens[j]`` (already in ``tokens``), given the open suffixes
        of ``tokens[:j]``, deepest first; returns those of ``tokens[:j + 1]``."""
        t, D = tokens[j], self.depth
        still_open = []
        for node, d in open_suffixes + [(self.root, 0)]:
            child = node.children.get(t)
            if child is None:  # a new string: one occurrence, kept as a pointer into tokens
                node.children[t] = Leaf(tokens, j)
                continue
            if type(child) is Leaf:  # a second occurrence: store the string as a node
                old = child
                child = node.children[t] = Node(1)
                e = old.end + 1  # the first occurrence's extension, if it has one
                if d + 1 < D and e < len(old.tokens):
                    child.children[old.tokens[e]] = Leaf(old.tokens, e)
            child.count += 1
            if d + 1 < D:
                still_open.append((child, d + 1))
        return still_open

    def insert(self, tokens: list[int]) -> None:
        """Add a whole sequence (kept by reference: it must not change while it is in the trie)."""
        open_suffixes: list[OpenSuffix] = []
        for j in range(len(tokens)):
            open_suffixes = self.append(tokens, j, open_suffixes)

    def remove(self, tokens: list[int]) -> None:
        """Take an inserted sequence out again: every substring it contributed loses one occurrence."""
        for i in range(len(tokens)):
            node = self.root
            for d in range(min(self.depth, len(tokens) - i)):
                t = tokens[i + d]
                child = node.children[t]
                if type(child) is Leaf or child.count == 1:  # this occurrence was the only one
                    del node.children[t]
                    break
                child.count -= 1
                node = child

    def walk(self, tokens: list[int], start: int, stop: int) -> Node | Leaf | None:
        """The trie position of ``tokens[start:stop]``, or None when that string is not in the trie."""
        node: Node | Leaf = self.root
        for i in range(start, stop):
            t = tokens[i]
            if type(node) is Leaf:
                e = node.end + 1
                if e >= len(node.tokens) or node.tokens[e] != t:
                    return None
                node = Leaf(node.tokens, e)
            else:
                node = node.children.get(t)
                if node is None:
                    return None
        return node

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


class RequestTrie(SuffixTrie):
    """A running request's trie over its history, and the open suffixes that grow with each new token."""

    def __init__(self, depth: int, seq: Sequence):
        super().__init__(depth)
        self.seq = seq  # to read the final tokens on release
        self.num_prompt = seq.num_prompt_tokens
        self.tokens: list[int] = []  # the history inserted so far (a copy: leaves point into it)
        self.open: list[OpenSuffix] = []

    def is_prefix_of(self, history: list[int]) -> bool:
        m = len(self.tokens)
        if m > len(history):
            return False
        w = min(m, TAIL_CHECK)
        return history[m - w:m] == self.tokens[m - w:]

    def extend(self, new_tokens: list[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(new_tokens)
        for j in range(start, len(self.tokens)):
            self.open = self.append(self.tokens, j, self.open)
