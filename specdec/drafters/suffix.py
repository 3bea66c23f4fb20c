"""``method: "suffix"`` (suffix decoding, Oliaro et al. 2024): propose the most frequent continuation.

Two kinds of suffix tries, each holding every substring of its token sequences
up to ``max_tree_depth`` tokens with its number of occurrences:
- one per running request, over its prompt and output, grown as tokens are committed;
- one global trie over the outputs of the last ``max_cached_requests`` requests, running
  ones included: a request's output joins when the drafter first sees the request and
  grows token by token as it is committed (as in Arctic Inference, whose cache vLLM's
  ``method: suffix`` uses), so a request drafts from what the other running requests
  have written so far, and its own output's counts pool with the earlier outputs'. When
  a request joins and the trie holds more than ``max_cached_requests`` outputs, the
  oldest leaves (a running request's output that leaves stops joining; a released
  request's stays until it is the oldest).

Each round, per sequence, every suffix of the history that the tries hold (at most
``max_tree_depth - 1`` tokens) is a candidate *match*; from its node the drafter follows
the most frequent child (of equal ones, the one first seen last: +0.1-1.0% τ over the
first seen in benchmarks/suffix_replay.py), token by token, while the path's empirical
probability (the product of the children's estimated probabilities along it) stays at
or above ``min_token_prob``, for at most min(k, floor(max_spec_factor * match length),
max_tree_depth - match length) tokens. The candidate whose draft has the largest
expected number of accepted tokens (the sum of its path probabilities) wins; ties go to
the longer match and to the request's own trie. (The longest match alone is a poor
choice in repetitive text: in a loop of period p its only earlier occurrence ends p
tokens before the end, so it could propose p tokens at most.) Candidates whose cap
cannot beat the best so far are skipped, so deep matches that draft well end the search.
Drafts are deterministic (q = one-hot).

Trees (``propose_tree``): from the same winning match, the trie's branches best-first by path
probability (``SuffixTrie.tree``): each node's children are its most frequent continuations (at
most the shape's max_children), nodes are taken while the path probability stays at or above
``min_token_prob``, up to the shape's node budget and depth (capped as a chain's length is); the
path probabilities are the tree's scores. Deterministic too (draft_probs None).

A child's probability is its count over (``probability``, the option
``suffix_decoding_probability``: neither wins on every workload, see the replay):
- ``"continuations"``: the summed counts of the node's children, i.e. the occurrences
  that continue. Occurrences that end at the node (at the end of a sequence: always the
  running request's own latest one) say nothing about the next token and are left out.
- ``"occurrences"``: the node's count, every occurrence, those that end there included
  (Arctic's estimate). It shrinks every step that has few occurrences behind it, so
  drafts resting on one earlier occurrence score 1/2 a token rather than 1: fewer of
  them pass ``min_token_prob`` and they lose to better-supported candidates.

Memory and time: a string that occurs once is not stored node by node but as a
*leaf*, one int naming its occurrence (its continuation is read from the tokens),
so nodes exist only for repeated substrings, and leaves are neither Python objects
with a header nor tracked by the garbage collector. Appending a token touches one
node per open suffix that is still repeated (at most max_tree_depth), in the
request's trie and, for an output token, in the global one; evicting a request walks
its substrings once more and removes what only it contributed.

Implementations: the classes here are the reference. The engine's drafter comes from
``suffix_native.suffix_drafter``: a ``NativeSuffixDrafter`` where its C++ extension builds (the
same tries, nodes in arrays and the tokens held natively, with the same drafts, scores, trees and
counts, tie-breaking included, and a round's work per sequence in two calls), else this one
(``SPECDEC_NO_NATIVE_SUFFIX=1``, or a failed build, logged).
"""

from __future__ import annotations

import heapq

from specdec.drafters.base import DraftProposal, Drafter, KvUse, grew_from
from specdec.drafters.ngram import TAIL_CHECK
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.tree import DraftTree, TreeShape

PROBABILITY_ESTIMATES = ("continuations", "occurrences")


class SuffixDrafter(Drafter):
    """The reference implementation, on the Python tries below (suffix_native.suffix_drafter picks)."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 1000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, probability: str = "continuations"):
        if max_tree_depth < 1 or max_cached_requests < 0 or max_spec_factor <= 0 or not 0 <= min_token_prob <= 1:
            raise ValueError("need max_tree_depth >= 1, max_cached_requests >= 0, max_spec_factor > 0 and "
                             f"0 <= min_token_prob <= 1; got {max_tree_depth}, {max_cached_requests}, "
                             f"{max_spec_factor}, {min_token_prob}")
        if probability not in PROBABILITY_ESTIMATES:
            raise ValueError(f"probability must be one of {PROBABILITY_ESTIMATES}, got {probability!r}")
        self.depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.count_ends = probability == "occurrences"
        self.requests: dict[int, RequestTrie] = {}  # seq_id -> trie over its prompt + output
        self.cache = SuffixTrie(max_tree_depth)  # requests' outputs (cache.seqs, oldest first)
        self.running: dict[int, RequestTrie] = {}  # cache slot -> the running request whose output it is

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

    can_draft_trees = True

    def propose_tree(self, seqs: list[Sequence], shapes: list[TreeShape | None], sb: SamplingBatch) -> list[DraftTree | None]:
        out: list[DraftTree | None] = []
        for s, shape in zip(seqs, shapes):
            if shape is None:
                self.sync(s)
                out.append(None)
            else:
                out.append(self.draft_tree(s, shape)[0])
        return out

    def draft(self, seq: Sequence, want: int) -> tuple[list[int], float]:
        """Up to ``want`` tokens continuing ``seq`` and their expected accepted count (the summed
        path probabilities)."""
        return self._draft(self.sync(seq), want)

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        for s in seqs:
            self.sync(s)

    def kv_use(self, k: int, tree: TreeShape | None = None) -> list[KvUse]:
        """No KV. Its tries are host memory outside the KV budget: one per running request over its prompt
        and output, and the global one over the outputs of at most ``max_cached_requests`` requests, each
        holding every substring of up to ``max_tree_depth`` tokens (at most that many nodes per token)."""
        return []

    def release(self, seqs: list[Sequence]) -> None:
        """The request's trie goes; its output stays in the global trie, completed with the tokens of the
        last round (which the drafter may not have been shown), until it is the oldest."""
        for s in seqs:
            req = self.requests.pop(s.seq_id, None)
            if req is None:  # never drafted for (it finished in its first round): its output joins now
                if s.output_token_ids and self.max_cached_requests:
                    self._evict(self.cache.insert(s.output_token_ids))
                continue
            if req.slot is None:  # evicted while running, or no global trie
                continue
            del self.running[req.slot]
            if req.is_prefix_of(s.token_ids):
                self._grow_output(req, s.token_ids)
                self.cache.finish(req.slot)
            else:  # the history was replaced since the last round: its output joins afresh
                self.cache.remove(req.slot)
                if s.output_token_ids:
                    self._evict(self.cache.insert(s.output_token_ids))
                continue
            if not self._has_output(req):  # nothing to draft from; don't let it push out another output
                self.cache.remove(req.slot)

    # -- the tries --------------------------------------------------------------------------------

    def sync(self, seq: Sequence) -> RequestTrie:
        """The sequence's trie, grown to its committed history, and its output in the global trie."""
        req = self.requests.get(seq.seq_id)
        if req is None or not req.is_prefix_of(seq.token_ids):
            if req is not None and req.slot is not None:  # its old output leaves with its old history
                self.cache.remove(req.slot)
                del self.running[req.slot]
            req = self.requests[seq.seq_id] = RequestTrie(self.depth, seq)
            if self.max_cached_requests:
                req.slot = self.cache.add([])  # req.output, empty until its first output token
                req.output = self.cache.seqs[req.slot]
                self.running[req.slot] = req
                self._evict(req.slot)
        req.extend(seq.token_ids[len(req.tokens):])
        if req.slot is not None:
            self._grow_output(req, req.tokens)
        return req

    def _grow_output(self, req: RequestTrie, history: list[int]) -> None:
        """Append the output tokens of ``history`` that the global trie lacks (one trie step each)."""
        cache, output = self.cache, req.output
        for t in history[req.num_prompt + len(output):]:
            output.append(t)
            cache.append(req.slot, len(output) - 1)

    def _has_output(self, req: RequestTrie) -> bool:
        return bool(req.output)

    def _evict(self, keep: int) -> None:
        """Hold at most max_cached_requests outputs: the oldest leave (never ``keep``, the newest)."""
        while len(self.cache.seqs) > self.max_cached_requests:
            slot = next(iter(self.cache.seqs))
            assert slot != keep
            self.cache.remove(slot)
            req = self.running.pop(slot, None)
            if req is not None:  # a running request: its output stops joining
                req.slot, req.output = None, []

    # -- drafting ---------------------------------------------------------------------------------

    def _draft(self, req: RequestTrie, want: int) -> tuple[list[int], float]:
        best, best_score, _ = self._best_match(req, want)
        return best, best_score

    def _best_match(self, req: RequestTrie, want: int) -> tuple[list[int], float, tuple | None]:
        """The winning candidate's draft, its score and where it drafts from: (trie, position, limit),
        None when no candidate drafts anything."""
        history = req.tokens
        best, best_score, where = [], 0.0, None
        for node, m in req.open:  # the request's own repeated suffixes, longest first
            limit = self._limit(want, m)
            if limit > best_score:
                draft, score = req.follow(node, limit, self.min_token_prob, self.count_ends)
                if score > best_score:
                    best, best_score, where = draft, score, (req, node, limit)
        if req.slot is not None and len(req.output) >= self.depth - 1:
            # Every suffix that can match lies in the output, which is in the global trie: the repeated
            # ones are its open suffixes there (one held once is the request's own occurrence, which
            # has no continuation).
            candidates = self.cache.growing[req.slot]
        elif self.cache.seqs:
            longest = self.cache.longest_match(history, self.depth - 1)
            candidates = ((None, m) for m in range(longest, 0, -1))  # walked to when worth following
        else:
            candidates = ()
        for at, m in candidates:  # longest first
            limit = self._limit(want, m)
            if limit > best_score:
                if at is None:
                    at = self.cache.walk(history, len(history) - m, len(history))
                draft, score = self.cache.follow(at, limit, self.min_token_prob, self.count_ends)
                if score > best_score:
                    best, best_score, where = draft, score, (self.cache, at, limit)
        return best, best_score, where

    def draft_tree(self, seq: Sequence, shape: TreeShape) -> tuple[DraftTree | None, float]:
        """A tree within ``shape`` from the match whose chain would win (``draft``): its most frequent
        continuations best-first by path probability (SuffixTrie.tree), and that chain's score."""
        _, score, where = self._best_match(self.sync(seq), shape.max_depth)
        if where is None:
            return None, 0.0
        trie, at, limit = where
        return trie.tree(at, TreeShape(shape.num_nodes, limit, shape.max_children), self.min_token_prob,
                         self.count_ends), score

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

    A sequence is inserted token by token and may still grow while others are inserted
    (it is *growing* until ``finish``); its open suffixes (those of its tokens so far that
    are repeated and shorter than ``depth``) each move one node down per token, so
    appending costs O(depth) at worst and usually much less."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = Node(0)
        self.seqs: dict[int, list[int]] = {}  # slot -> an inserted sequence, in insertion order
        self.growing: dict[int, list[OpenSuffix]] = {}  # slot -> its open suffixes, deepest first
        self._next_slot = 0

    def add(self, tokens: list[int]) -> int:
        """A new growing slot holding ``tokens`` (kept by reference) and nothing inserted yet: ``append``
        inserts its tokens one by one. The sequence may grow at its end, but must not change otherwise."""
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        self.seqs[slot] = tokens
        self.growing[slot] = []
        return slot

    def append(self, slot: int, j: int) -> None:
        """Insert the occurrences that end at ``seqs[slot][j]`` (already in the sequence; ``seqs[slot][:j]``
        inserted before)."""
        seq, D = self.seqs[slot], self.depth
        t = seq[j]
        still_open = []
        for node, d in self.growing[slot] + [(self.root, 0)]:
            child = node.children.get(t)
            if child is None:  # a new string: one occurrence, kept as a leaf
                node.children[t] = (slot << SLOT_SHIFT) | j
                continue
            if type(child) is int:  # a second occurrence: store the string as a node
                child = node.children[t] = self._repeat(child, d + 1)
            child.count += 1
            if d + 1 < D:
                still_open.append((child, d + 1))
        self.growing[slot] = still_open

    def _repeat(self, leaf: int, d: int) -> Node:
        """The node for a string of d tokens held as a leaf until its second occurrence (not counted yet)."""
        first, e = leaf >> SLOT_SHIFT, (leaf & END_MASK) + 1
        repeated = Node(1)
        if d < self.depth:
            if e < len(self.seqs[first]):  # the first occurrence's extension, if it has one
                repeated.children[self.seqs[first][e]] = leaf + 1
            elif first in self.growing:  # it ends a sequence that grows: now an open suffix of it
                suffixes = self.growing[first]
                at = next((i for i, (_, depth) in enumerate(suffixes) if depth < d), len(suffixes))
                suffixes.insert(at, (repeated, d))
        return repeated

    def finish(self, slot: int) -> None:
        """The sequence in ``slot`` will not grow any more."""
        self.growing.pop(slot, None)

    def insert(self, tokens: list[int]) -> int:
        """Add a whole sequence (kept by reference: it must not change while it is in the trie); its slot."""
        slot = self.add(tokens)
        for j in range(len(tokens)):
            self.append(slot, j)
        self.finish(slot)
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
        self.growing.pop(slot, None)

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

    def follow(self, at: Node | int, limit: int, min_prob: float, count_ends: bool = False
               ) -> tuple[list[int], float]:
        """The greedy most-frequent path of at most ``limit`` tokens from a trie position (of equally frequent
        continuations, the one first seen last: a recent pattern beats an old one), stopping before
        its probability falls below ``min_prob``; returns the drafts and their summed path probabilities
        (the expected number of accepted drafts, were the counts the truth). A child's probability is its
        count over its siblings' summed counts, or with ``count_ends`` over the node's count (the
        occurrences that end at the node included)."""
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
                    if n >= top:  # ties: the newest (children are in the order they were first seen)
                        token, child, top = t, c, n
                if child is None:
                    break
                prob *= top / (at.count if count_ends else total)
                at = child
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
        return draft, score


    def continuations(self, at: Node | int, count_ends: bool = False) -> list[tuple[int, Node | int, float]]:
        """(token, its trie position, its probability) for each continuation of a trie position, the most
        frequent first (of equal ones, the one first seen last, as ``follow``)."""
        if type(at) is int:  # a string seen once: its one continuation, p = 1
            seq, e = self.seqs[at >> SLOT_SHIFT], (at & END_MASK) + 1
            return [(seq[e], at + 1, 1.0)] if e < len(seq) else []
        kids = [(t, c, 1 if type(c) is int else c.count, i) for i, (t, c) in enumerate(at.children.items())]
        total = at.count if count_ends else sum(n for _, _, n, _ in kids)
        kids.sort(key=lambda k: (-k[2], -k[3]))
        return [(t, c, n / total) for t, c, n, _ in kids]

    def tree(self, at: Node | int, shape: TreeShape, min_prob: float, count_ends: bool = False) -> DraftTree | None:
        """The trie's branches below a position as a draft tree within ``shape``: nodes taken best-first by
        path probability (the product of the continuations' probabilities, the tree's scores) while it
        stays at or above ``min_prob``, each node's children among its ``max_children`` most frequent
        continuations. A child's probability is at most its parent's, so the order is topological."""
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        heap: list[tuple[float, int, int, Node | int, int, int]] = []  # (-p, tie, token, position, parent, depth)
        tie = 0

        def push(pos: Node | int, parent: int, prob: float, depth: int) -> None:
            nonlocal tie
            for t, child, p in self.continuations(pos, count_ends)[: shape.max_children]:
                heapq.heappush(heap, (-prob * p, tie, t, child, parent, depth))
                tie += 1

        push(at, -1, 1.0, 1)
        while heap and len(tokens) < shape.num_nodes:
            neg, _, t, child, parent, depth = heapq.heappop(heap)
            if -neg < min_prob:
                break
            tokens.append(t)
            parents.append(parent)
            scores.append(-neg)
            if depth < shape.max_depth:
                push(child, len(tokens) - 1, -neg, depth + 1)
        return DraftTree(tokens, parents, None, scores) if tokens else None


class RequestTrie(SuffixTrie):
    """A running request's trie over its history (slot 0), and the open suffixes that grow with each token;
    also where its output stands in the drafter's global trie."""

    def __init__(self, depth: int, seq: Sequence):
        super().__init__(depth)
        self.tokens: list[int] = []  # the history inserted so far (a copy: leaves point into it)
        self.add(self.tokens)  # slot 0
        self.num_prompt = seq.num_prompt_tokens
        self.slot: int | None = None  # its output's slot in the drafter's global trie (None: not there)
        self.output: list[int] = []  # the output tokens inserted there so far

    @property
    def open(self) -> list[OpenSuffix]:
        """The repeated suffixes of the history (shorter than depth), deepest first."""
        return self.growing[0]

    def is_prefix_of(self, history: list[int]) -> bool:
        """Whether ``history`` grew from the inserted tokens."""
        return grew_from(self.tokens, history, TAIL_CHECK)

    def extend(self, new_tokens: list[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(new_tokens)
        for j in range(start, len(self.tokens)):
            self.append(0, j)
