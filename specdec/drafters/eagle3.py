"""``method: "eagle3"``: an EAGLE-3 head (models/eagle3.py) drafts from the target's own hidden states.

The target keeps, per cache row and position, the inputs of the head's three layers
(``ModelRunner.keep_hidden_states``). When ``propose`` runs, the target has computed positions
0..L-2 of a history t_0..t_{L-1} (``seq.num_computed = L - 1``), so features f_0..f_{L-2} are there.
A round, per sequence:

1. catch up: head step 0 at each position p the head's own KV lacks, up to p = L-2, reading
   (fc(f_p), t_{p+1}); the logits at p = L-2 give the first draft d_1 (a guess at t_L);
2. draft: step j at position L-2+j reads (the previous step's pre-norm output g, d_j) -> d_{j+1}.

The head keeps its own one-layer KV per sequence (rows synced with the batch, like the target's).
Step 0's entry at position p depends only on f_p and t_{p+1}, both committed, so it stays valid as
long as the history t_0..t_{p+1} does; rollback is a length change: the draft steps' entries past
L-2 are overwritten by next round's catch-up. A row whose target has not computed its history yet
(a prompt merged into this round's verify pass) proposes nothing this round.

Draft-vocabulary logits map into the target's vocabulary (``Eagle3Head.to_target_logits``) and go
through ``draft_autoregressive``, so temperature, top-k / top-p / min-p, penalties, grammars, seeds
and ``draft_p_min`` behave as for draft_model; q is zero outside the draft vocabulary, which keeps
the verifier exact.
"""

from __future__ import annotations

import torch

from specdec.drafters.autoregressive import draft_autoregressive
from specdec.drafters.base import DraftProposal, Drafter
from specdec.models.base import ModelRunner
from specdec.models.eagle3 import Eagle3Head
from specdec.models.kv_cache import KVCache, RowTable
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence

CATCH_UP_TOGETHER = 4  # rows catching up on at most this many positions share one padded head pass
CACHE_LEN_STEP = 256  # the head's KV grows in steps, not one position at a time
OFF_VOCAB = -1e30  # logit of target tokens outside the draft vocabulary: q = 0 there, finite so that a row
#                    whose grammar allows none of the draft vocabulary still gets a distribution


class Eagle3Drafter(Drafter):
    def __init__(self, head: Eagle3Head, target: ModelRunner, draft_p_min: float = 0.0):
        target.keep_hidden_states(head.config.layer_ids)  # ValueError on a backend that cannot
        self.head, self.target, self.draft_p_min = head, target, draft_p_min
        c = head.config
        self.num_kv_heads, self.head_dim = c.num_key_value_heads, c.head_dim
        self.device = target.device
        self.cache: KVCache | None = None  # the head's own KV: 1 layer [1, rows, KVH, max_len, hd] float32
        self.rows = RowTable()
        self.done: dict[int, int] = {}  # seq_id -> step-0 entries at positions 0..done-1 are in the head's KV
        self.seen: dict[int, list[int]] = {}  # seq_id -> the history those entries read (t_0..t_done)

    # -- the Drafter interface --------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        B = len(seqs)
        self._reserve(B, max(len(s.token_ids) for s in seqs) + max(num_draft, default=0) + 1)
        is_new = self.rows.sync([s.seq_id for s in seqs], self.cache)
        # rows that draft: asked for drafts, and the target has computed all of the history but its last token
        active = [b for b, s in enumerate(seqs) if num_draft[b] > 0 and 0 < s.num_computed == len(s.token_ids) - 1]
        if not active:
            return DraftProposal.from_rows([[]] * B, sb.device)

        # 1. catch up: step 0 over the positions each active row's head KV lacks, up to L-2
        starts = {b: self._valid_start(seqs[b], is_new[b]) for b in active}
        together = [b for b in active if len(seqs[b].token_ids) - 1 - starts[b] <= CATCH_UP_TOGETHER]
        groups = ([together] if together else []) + [[b] for b in active if b not in together]
        V = self.target.vocab_size
        logits = torch.zeros(B, V, device=self.device)  # [B, V]; rows that do not draft keep zeros
        hidden = torch.zeros(B, self.head.config.hidden_size, device=self.device, dtype=self.head.fc.weight.dtype)
        for group in groups:
            draft_logits, g = self._catch_up([seqs[b] for b in group], group, [starts[b] for b in group])
            logits[group] = self._to_target(draft_logits)
            hidden[group] = g
        for b in active:
            s = seqs[b]
            self.done[s.seq_id] = len(s.token_ids) - 1
            self.seen[s.seq_id] = list(s.token_ids)

        # 2. draft: step j (1-based) at position L-2+j reads (g of step j-1, d_j)
        idx = torch.tensor(active, device=self.device)
        pos = torch.tensor([len(seqs[b].token_ids) - 2 for b in active], device=self.device)  # [A] p = L-2

        def feed(x: torch.Tensor, i: int) -> torch.Tensor:  # x [B] draft i+1 -> logits [B, V] for draft i+2
            draft_logits, g = self._draft_step(x[idx], hidden[idx], active, pos + i + 1)
            hidden[idx] = g
            out = torch.zeros(B, V, device=self.device)
            out[idx] = self._to_target(draft_logits)
            return out

        drafting = set(active)
        want = [n if b in drafting else 0 for b, n in enumerate(num_draft)]
        return draft_autoregressive(logits, feed, seqs, want, sb, self.draft_p_min)

    def release(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.done.pop(s.seq_id, None)
            self.seen.pop(s.seq_id, None)

    def release_memory(self) -> None:
        self.cache = None
        self.rows = RowTable()
        self.done.clear()
        self.seen.clear()

    def kv_bytes_per_token(self) -> int:
        """The head's KV (one layer, float32) plus the target's kept layer inputs (float32), per position."""
        c = self.head.config
        return 2 * self.num_kv_heads * self.head_dim * 4 + len(c.layer_ids) * c.target_hidden_size * 4

    # -- the head's passes -----------------------------------------------------------------------

    def _valid_start(self, s: Sequence, new: bool) -> int:
        """The first position whose step-0 entry must be (re)computed, at most L-2 (the first draft's
        logits come from that position). An entry at p read t_0..t_{p+1}: it is valid while those stay."""
        L = len(s.token_ids)
        if new or s.seq_id not in self.done:
            return 0
        done, seen = self.done[s.seq_id], self.seen[s.seq_id]
        m = min(len(seen), L)
        if seen[:m] != s.token_ids[:m]:  # the history was replaced: keep the common prefix's entries
            m = next(i for i in range(m) if seen[i] != s.token_ids[i])
            done = min(done, max(m - 1, 0))
        return min(done, L - 2)

    def _catch_up(self, seqs: list[Sequence], rows: list[int], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 0 for row r = rows[i] at positions starts[i]..L_i-2, padded to the longest; writes the
        head's KV. Returns the draft-vocabulary logits [G, Vd] and pre-norm output g [G, D] at L_i-2."""
        G = len(seqs)
        n = [len(s.token_ids) - 1 - st for s, st in zip(seqs, starts)]  # [G] positions fed, >= 1
        T, S = max(n), max(starts)
        dev = self.device
        ids = torch.zeros(G, T, dtype=torch.long)
        feats = torch.zeros(G, T, self.head.fc.in_features, device=dev)  # [G, T, 3 * Dt]
        for i, (s, r, st) in enumerate(zip(seqs, rows, starts)):
            ids[i, : n[i]] = torch.tensor(s.token_ids[st + 1 :])  # token p + 1 at position p
            feats[i, : n[i]] = self.target.hidden_states(r, st, st + n[i])
        st = torch.tensor(starts, device=dev)
        positions = st[:, None] + torch.arange(T, device=dev)  # [G, T]
        k_rows = self._rows(rows)
        past_k, past_v = self.cache.k[0, k_rows, :, :S], self.cache.v[0, k_rows, :, :S]  # [G, KVH, S, hd]
        mask = None
        if G > 1 and (min(n) < T or min(starts) < S):
            keys = torch.arange(S + T, device=dev)
            sees_past = keys[None, None, :] < st[:, None, None]  # [G, 1, S + T]: past keys of the row
            t = torch.arange(T, device=dev)
            sees_new = (keys[None, :] >= S) & (keys[None, :] - S <= t[:, None])  # [T, S + T]: causal over new
            mask = (sees_past & (keys < S)) | sees_new[None]  # [G, T, S + T]
        logits, g, k, v = self.head.step(ids.to(dev), self.head.fuse(feats), positions, past_k, past_v, mask)
        for i, (r, s0) in enumerate(zip(rows, starts)):
            self.cache.k[0, r, :, s0 : s0 + n[i]] = k[i, :, : n[i]]
            self.cache.v[0, r, :, s0 : s0 + n[i]] = v[i, :, : n[i]]
        last = torch.tensor(n, device=dev) - 1
        a = torch.arange(G, device=dev)
        return logits[a, last], g[a, last]  # [G, Vd], [G, D]

    def _draft_step(self, x: torch.Tensor, hidden: torch.Tensor, rows: list[int],
                    pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for rows ``rows``: token x [A] with the previous step's output hidden [A, D] at
        positions pos [A]; attends to the row's entries 0..pos-1. Returns logits [A, Vd], g [A, D]."""
        A = len(rows)
        S = int(pos.max())
        k_rows = self._rows(rows)
        past_k, past_v = self.cache.k[0, k_rows, :, :S], self.cache.v[0, k_rows, :, :S]  # [A, KVH, S, hd]
        mask = None
        if A > 1 and int(pos.min()) < S:
            keys = torch.arange(S + 1, device=self.device)
            mask = ((keys[None, :] < pos[:, None]) | (keys[None, :] == S))[:, None]  # [A, 1, S + 1]
        logits, g, k, v = self.head.step(x[:, None], hidden[:, None], pos[:, None], past_k, past_v, mask)
        rows_t = torch.tensor(rows, device=self.device)
        self.cache.k[0, rows_t, :, pos] = k[:, :, 0]  # [A, KVH, hd] at each row's position
        self.cache.v[0, rows_t, :, pos] = v[:, :, 0]
        return logits[:, 0], g[:, 0]

    def _to_target(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[..., Vd] -> [..., V] target vocabulary; tokens outside the draft vocabulary get OFF_VOCAB."""
        return self.head.to_target_logits(draft_logits, self.target.vocab_size).clamp(min=OFF_VOCAB)

    def _rows(self, rows: list[int]) -> slice | torch.Tensor:
        """Cache rows as a slice when contiguous (no gather), else an index tensor."""
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return slice(rows[0], rows[0] + len(rows))
        return torch.tensor(rows, device=self.device)

    def _reserve(self, num_rows: int, length: int) -> None:
        length = -(-length // CACHE_LEN_STEP) * CACHE_LEN_STEP
        old = self.cache
        if old is not None and old.num_rows >= num_rows and old.max_len >= length:
            return
        rows = max(num_rows, old.num_rows if old else 0)
        max_len = max(length, old.max_len if old else 0)
        new = KVCache(1, rows, self.num_kv_heads, max_len, self.head_dim, torch.float32, self.device)
        if old is not None:
            new.grown_from(old)
        self.cache = new
