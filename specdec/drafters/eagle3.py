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

The head runs here as ``HeadRunner``: its weights re-packed for the CPU kernels the target uses
(models/linear.py: fused q/k/v and gate/up, in the target's weights' dtype, so oneDNN's bf16 inner
product beside a bf16 target), its keys read straight from its cache. ``Eagle3Head.step`` stays the
reference it is tested against.

Draft-vocabulary logits map into the target's vocabulary (``Eagle3Head.draft_to_target``) and go
through ``draft_autoregressive``, so temperature, top-k / top-p / min-p, penalties, grammars, seeds
and ``draft_p_min`` behave as for draft_model; q is zero outside the draft vocabulary, which keeps
the verifier exact.

Trees (``propose_tree``), as EAGLE-3 drafts them: EAGLE-2's dynamic expansion (tree_expand.py) with
one head step per level over the nodes it expands, each at position L-2+depth reading its parent's
g, its k, v at its own slot past the committed entries, attending to those, its ancestors and itself
(``HeadRunner.step``'s slots and visibility mask).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from specdec.drafters.autoregressive import argmax_drafts, draft_autoregressive, every_row_draws, sampled_chain
from specdec.drafters.base import DraftProposal, Drafter, KvUse, grew_from
from specdec.drafters.tree_expand import SIBLINGS, Block, QCalibration, RankAcceptance, draft_tree
from specdec.models import cache_attention as attention_kernel
from specdec.models import linear8
from specdec.models.base import ModelRunner, long_tensor
from specdec.models.eagle3 import Eagle3Config, Eagle3Head, check_q_scale
from specdec.models.kv_cache import CACHE_STEP, KVCache, RowTable, grow
from specdec.models.layers import apply_rope, attention, rope_tables
from specdec.models.linear import Linear
from specdec.models.llamacpp_head import native_head
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.tree import DraftTree, TreeShape, depths_of

CATCH_UP_TOGETHER = 4  # rows catching up on at most this many positions share one padded head pass
# Beside a target that is not torch (llama.cpp, whose OpenMP workers keep spinning between its decodes),
# a round of at most this many rows drafts on one torch thread where the torch head runs eager: its passes
# are small products and many small operations, and a second torch thread only competes for the target's
# cores (docs/benchmarks.md, "EAGLE-3 on the llama.cpp backend"); compiled, it drafts on torch's threads
ONE_THREAD_ROWS = 4
OFF_VOCAB = -1e30  # logit of target tokens outside the draft vocabulary: q = 0 there, finite so that a row
#                    whose grammar allows none of the draft vocabulary still gets a distribution


def head_threads(method):
    """Run a drafter's method on one torch thread when its ``one_thread`` is set and the round has at
    most ONE_THREAD_ROWS rows; torch's setting is restored after."""
    @functools.wraps(method)
    def run(self, seqs, *args):
        n = torch.get_num_threads()
        if not self.one_thread or n == 1 or len(seqs) > ONE_THREAD_ROWS:
            return method(self, seqs, *args)
        torch.set_num_threads(1)
        try:
            return method(self, seqs, *args)
        finally:
            torch.set_num_threads(n)

    return run


def tree_pool(shape: TreeShape) -> int:
    """Node ids a growing tree within ``shape`` can reach (each a head slot past the history): the root's
    children, then per level max_children nodes expanded into max_children each."""
    return shape.max_children + (shape.max_depth - 1) * shape.max_children ** 2


@dataclass(frozen=True)
class HeadWeights:
    """An ``Eagle3Head``'s weights packed into ``Linear`` kernels of one dtype (norms float32), and the
    layer's math over them: what ``HeadRunner`` runs eager and models/compiled_head.py compiles (one
    definition). Never changed after ``pack``: the compiled step reads them as they are."""

    c: Eagle3Config
    fc: Linear  # 3 Dt -> D
    qkv: Linear  # 2D -> (H + 2 KVH) hd
    o: Linear  # H hd -> D
    gate_up: Linear  # D -> 2 I
    down: Linear  # I -> D
    lm_head: Linear  # D -> Vd
    input_norm: torch.Tensor  # [D] each, float32
    hidden_norm: torch.Tensor
    post_norm: torch.Tensor
    final_norm: torch.Tensor
    fc_norm: torch.Tensor | None  # [3 Dt]: a head with norm_before_fc normalizes the features before fc
    embed: torch.Tensor  # [V, D] the target's

    @classmethod
    def pack(cls, head: Eagle3Head, dtype: torch.dtype, device: torch.device, quantize: str | None = None) -> HeadWeights:
        """``quantize`` "int8" / "int4": the layer's and the LM head's products quantized where the kernel runs
        (``Linear``'s ``quantize``); fc stays in ``dtype``, its inputs (the target's layer inputs) hold a few
        dimensions hundreds of times the others' size, which one scale a row would crush."""
        L = head.midlayer
        a, m = L.self_attn, L.mlp

        def lin(*weights: torch.Tensor, q: str | None = quantize) -> Linear:
            return Linear(torch.cat([w.detach() for w in weights]).to(device=device, dtype=dtype).contiguous(), quantize=q)

        def vec(w: torch.Tensor) -> torch.Tensor:
            return w.detach().to(device=device, dtype=torch.float32)

        fc_norm = getattr(head, "input_norm", None) if getattr(head.config, "norm_before_fc", False) else None
        return cls(head.config, lin(head.fc.weight, q=None), lin(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                   lin(a.o_proj.weight), lin(m.gate_proj.weight, m.up_proj.weight), lin(m.down_proj.weight),
                   lin(head.lm_head.weight), vec(L.input_layernorm.weight), vec(L.hidden_norm.weight),
                   vec(L.post_attention_layernorm.weight), vec(head.norm.weight),
                   None if fc_norm is None else vec(fc_norm.weight), head.embed_tokens.detach().to(device))

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's layer inputs [..., 3 Dt] -> the head's hidden state [..., D] float32."""
        if self.fc_norm is not None:
            features = F.rms_norm(features.float(), (features.shape[-1],), self.fc_norm, self.c.rms_norm_eps)
        return self.fc(features).float()

    def attention_input(self, ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [...] and hidden [..., D] float32 -> q, k, v fused [..., (H + 2 KVH) hd] float32 (not yet
        rotated) and the residual [..., D] the attention's output adds to."""
        c, D = self.c, self.c.hidden_size
        emb = F.embedding(ids, self.embed).float()  # [..., D]
        h_normed = F.rms_norm(hidden, (D,), self.hidden_norm, c.rms_norm_eps)
        x = torch.cat([F.rms_norm(emb, (D,), self.input_norm, c.rms_norm_eps), h_normed], dim=-1)  # [..., 2D]
        return self.qkv(x).float(), (h_normed if c.norm_before_residual else hidden)

    def after_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [..., H hd] -> draft-vocabulary logits [..., Vd] and the pre-norm output g [..., D], float32."""
        D, eps = self.c.hidden_size, self.c.rms_norm_eps
        a = residual + self.o(attn)  # [..., D] (bf16 + float32 promotes to float32)
        gate, up = self.gate_up(F.rms_norm(a, (D,), self.post_norm, eps)).float().chunk(2, dim=-1)
        g = a + self.down(F.silu(gate) * up)  # [..., D]: pre-norm output
        return self.lm_head(F.rms_norm(g, (D,), self.final_norm, eps)).float(), g

    def row_pass(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, query: torch.Tensor,
                 rows: torch.Tensor, key_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cos_table: torch.Tensor, sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One row's pass over tensors only (what the compiled step traces): ids [T] at positions pos [T]
        of cache row rows [1]; writes their k, v; token ``query`` [1] (an index into the T) alone goes
        on, attending to the row's keys at positions key_pos [1, 1, L] (float: 0..L-1) up to its own.
        Logits [1, Vd] and g [1, D], float32."""
        c = self.c
        T = ids.shape[0]
        H, KVH, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv, residual = self.attention_input(ids, hidden)  # [T, (H + 2 KVH) hd], [T, D]
        cos, sin = cos_table[pos][:, None], sin_table[pos][:, None]  # [T, 1, hd]
        k = apply_rope(qkv[:, H * hd : (H + KVH) * hd].view(T, KVH, hd), cos, sin)  # [T, KVH, hd]
        at = (torch.zeros_like(pos), rows.expand(T), None, pos)  # cache[0, row, :, pos[t]]
        torch.ops.aten.index_put_(k_cache, at, k)
        torch.ops.aten.index_put_(v_cache, at, qkv[:, (H + KVH) * hd :].view(T, KVH, hd))
        q = apply_rope(qkv[query, : H * hd].view(1, 1, H, hd), cos[query], sin[query])  # that token's query only
        bias = torch.where(key_pos <= pos[query].to(key_pos.dtype), 0.0, float("-inf"))  # [1, 1, L] additive
        attn = attention_kernel.cache_attention(q, k_cache, v_cache, 0, rows, bias)  # [1, 1, H, hd]
        return self.after_attention(attn.reshape(1, H * hd), residual[query])


class HeadRunner:
    """The head's forward over its own KV cache (one layer, float32, rows like the target's): the
    weights of ``Eagle3Head`` packed into ``Linear`` kernels of ``dtype`` (``HeadWeights``); norms, RoPE
    and attention (models/layers.py's) in float32. Computes what ``Eagle3Head.step`` computes (within the
    weights' dtype's rounding). ``step`` runs any shape (a catch-up, a tree level); ``chain_step`` a
    chain's draft step, one token per row, in fewer operations; one row's chain steps and catch-ups are
    compiled where the target is (``compile``); all share the layer's code (``HeadWeights``)."""

    def __init__(self, head: Eagle3Head, dtype: torch.dtype, device: torch.device, quantize: str | None = None):
        c = head.config
        self.c, self.device = c, device
        self.w = HeadWeights.pack(head, dtype, device, quantize)
        self.inv_freq = head.inv_freq.detach().float().to(device)  # [hd / 2]
        self.cos = self.sin = torch.empty(0, c.head_dim, device=device)
        self.cache: KVCache | None = None
        self.rows = RowTable()
        # a chain step of one row attends with specdec's kernel where it runs (float32 cache: always here)
        self.in_cache = attention_kernel.supports(torch.float32, torch.device(device), c.head_dim)
        self._row_tensors: dict[int, torch.Tensor] = {}  # cache row -> [1] long, the kernel's rows input
        self.compiled = None  # CompiledHeadStep: one row's passes compiled (``compile``)

    @property
    def min_cache_rows(self) -> int:
        """2 where one row's passes are compiled (traced with the cache's rows dynamic, >= 2), else 1."""
        return 2 if self.compiled is not None else 1

    @property
    def fc(self) -> Linear:
        return self.w.fc  # the drafter reads its in_features (the target states' width), as of LlamaCppHead's

    def compile(self, name: str) -> None:
        """Compile one row's passes, chain steps and catch-ups (models/compiled_head.py), where they run:
        the cache attention kernel's CPUs. ``head_runner`` calls it unless eager is asked."""
        if self.in_cache and self.compiled is None:
            from specdec.models.compiled_head import CompiledHeadStep

            self.compiled = CompiledHeadStep(self, name)

    def _row(self, row: int) -> torch.Tensor:
        t = self._row_tensors.get(row)
        if t is None:
            t = self._row_tensors[row] = torch.tensor([row], device=self.device)
        return t

    def reserve(self, num_rows: int, length: int) -> None:
        self.cache = grow(self.cache, max(num_rows, self.min_cache_rows), length, CACHE_STEP, lambda rows, max_len: KVCache(
            1, rows, self.c.num_key_value_heads, max_len, self.c.head_dim, torch.float32, self.device))
        max_len = self.cache.max_len
        if self.cos.shape[0] < max_len:
            positions = torch.arange(max_len, device=self.device)
            self.cos, self.sin = rope_tables(positions, self.inv_freq, 1.0, torch.float32)  # [max_len, hd] each

    def release(self) -> None:
        self.cache = None
        self.rows = RowTable()

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's layer inputs [..., 3 Dt] -> the head's hidden state [..., D] float32."""
        return self.w.fuse(features)

    def chain_step(self, ids: torch.Tensor, hidden: torch.Tensor, rows: list[int],
                   pos: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain's draft step, one token per row (``step`` at T = 1 in fewer operations): ids [B], hidden
        [B, D] float32 at positions ``pos`` [B] of cache rows ``rows``; each query sees its row's keys at
        positions <= its own. Returns logits [B, Vd] and g [B, D], float32."""
        c = self.c
        B = len(rows)
        H, KVH, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if B == 1 and self.in_cache:  # the row's keys 0..p read where the cache holds them (about 60 µs less than SDPA)
            return self._row_pass(ids, hidden, rows[0], pos[0])
        qkv, residual = self.w.attention_input(ids, hidden)  # [B, (H + 2 KVH) hd]
        if B == 1:
            row, p = rows[0], pos[0]
            cos, sin = self.cos[p], self.sin[p]  # [hd]
            q = apply_rope(qkv[:, : H * hd].view(1, H, 1, hd), cos, sin)
            self.cache.k[0, row, :, p] = apply_rope(qkv[0, H * hd : (H + KVH) * hd].view(KVH, hd), cos, sin)
            self.cache.v[0, row, :, p] = qkv[0, (H + KVH) * hd :].view(KVH, hd)
            keys, values = self.cache.k[0, row : row + 1, :, : p + 1], self.cache.v[0, row : row + 1, :, : p + 1]
            mask = None
        else:
            at = torch.tensor(pos, device=self.device)  # [B]
            cos, sin = self.cos[at][:, None], self.sin[at][:, None]  # [B, 1, hd]
            q = apply_rope(qkv[:, : H * hd].view(B, H, hd), cos, sin)[:, :, None]  # [B, H, 1, hd]
            row_t = torch.tensor(rows, device=self.device)
            self.cache.k[0][row_t, :, at] = apply_rope(qkv[:, H * hd : (H + KVH) * hd].view(B, KVH, hd), cos, sin)
            self.cache.v[0][row_t, :, at] = qkv[:, (H + KVH) * hd :].view(B, KVH, hd)
            end = max(pos) + 1
            cache_rows = _rows(rows, self.device)
            keys = self.cache.k[0, cache_rows, :, :end]  # [B, KVH, end, hd]
            values = self.cache.v[0, cache_rows, :, :end]
            mask = (torch.arange(end, device=self.device)[None] <= at[:, None])[:, None, None]  # [B, 1, 1, end]
        attn = attention(q, keys, values, mask)  # [B, H, 1, hd]
        return self.w.after_attention(attn.reshape(B, H * hd), residual)

    def catch_up_row(self, ids: torch.Tensor, hidden: torch.Tensor, row: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``step`` for one row's T tokens at positions start..start+T-1 with ``query_at`` the last (a
        catch-up), in fewer operations: ids [T], hidden [T, D] float32. Writes the T tokens' k, v, and
        only the last query goes on, attending with the cache attention kernel (``in_cache``).
        Returns logits [1, Vd] and g [1, D], float32."""
        return self._row_pass(ids, hidden, row, start)

    def _row_pass(self, ids: torch.Tensor, hidden: torch.Tensor, row: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """catch_up_row's pass, also one row's chain step (T = 1), compiled where it can be
        (models/compiled_head.py). Apart from the public methods so that wrappers timing them
        (benchmarks/round_cost.py) never count a call twice."""
        T = ids.shape[0]
        if self.compiled is not None and self.compiled.why_not(T) is None:
            return self.compiled.row_pass(ids, hidden, row, start)
        end = start + T
        pos = torch.arange(start, end, device=self.device)  # [T]
        key_pos = torch.arange(end, dtype=torch.float32, device=self.device)[None, None]  # [1, 1, L = end]
        query = torch.tensor([T - 1], device=self.device)
        return self.w.row_pass(ids, hidden, pos, query, self._row(row), key_pos, self.cache.k, self.cache.v,
                               self.cos, self.sin)

    def step(self, ids: torch.Tensor, hidden: torch.Tensor, rows: list[int], pos: torch.Tensor,
             real: torch.Tensor | None = None, query_at: torch.Tensor | None = None,
             slots: torch.Tensor | None = None, visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the decoder layer for cache rows ``rows`` [B]: ids [B, T] (token p + 1 at position
        p), hidden [B, T, D], positions pos [B, T]; ``real`` [B, T] bool marks the tokens whose k, v are
        written (None: all). Query (b, t) attends to the row's keys at positions <= pos[b, t]. Returns
        draft-vocabulary logits [B, T, Vd] float32 and the pre-norm output g [B, T, D] float32.
        ``query_at`` [B]: only that query per row goes past k and v (a catch-up needs the others' keys
        and values only): logits [B, 1, Vd], g [B, 1, D]. A tree level: ``slots`` [B, T] where k, v go
        (None: at their positions) and ``visible`` [B, T, end] bool, the keys each query sees (None:
        the row's keys at positions <= its own)."""
        c = self.c
        B, T = ids.shape
        H, KVH, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv, residual = self.w.attention_input(ids, hidden.float())  # [B, T, (H + 2 KVH) hd], [B, T, D]
        q = qkv[..., : H * hd].view(B, T, H, hd)
        k = qkv[..., H * hd : (H + KVH) * hd].view(B, T, KVH, hd)
        v = qkv[..., (H + KVH) * hd :].view(B, T, KVH, hd)
        cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]  # [B, T, 1, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        row_t = torch.tensor(rows, device=self.device)[:, None].expand(B, T)
        at = pos if slots is None else slots  # [B, T]
        if real is None:
            self.cache.k[0][row_t, :, at] = k  # [B, T, KVH, hd] into each row's positions
            self.cache.v[0][row_t, :, at] = v
        else:
            self.cache.k[0][row_t[real], :, at[real]] = k[real]
            self.cache.v[0][row_t[real], :, at[real]] = v[real]
        end = int(pos.max()) + 1 if visible is None else visible.shape[-1]
        if query_at is not None:
            b = torch.arange(B, device=self.device)
            q, pos, residual, T = q[b, query_at][:, None], pos[b, query_at][:, None], residual[b, query_at][:, None], 1
        cache_rows = _rows(rows, self.device)
        keys, values = self.cache.k[0, cache_rows, :, :end], self.cache.v[0, cache_rows, :, :end]  # [B, KVH, end, hd]
        mask = None
        if visible is not None:
            mask = visible[:, None]  # [B, 1, T, end]
        elif not (B == 1 and T == 1):
            mask = (torch.arange(end, device=self.device)[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, end]
        attn = attention(q.transpose(1, 2), keys, values, mask)  # [B, H, T, hd]
        return self.w.after_attention(attn.transpose(1, 2).reshape(B, T, H * hd), residual)  # [B, T, Vd], [B, T, D]


def _rows(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """Cache rows as a slice when contiguous (no gather), else an index tensor."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


SPECDEC_KERNELS = ("w16", "w16dot", "w8", "w4")  # Linear kinds of specdec's own product kernels (models/linear.py)


def head_dtype(target: ModelRunner) -> torch.dtype:
    """The torch head's products take the target's weights' dtype: bf16 beside a bf16 target (half the
    bytes), float32 beside anything else."""
    return torch.bfloat16 if target.dtype == torch.bfloat16 else torch.float32


DEFAULT_QUANTIZATION = "int4"  # the head's products where speculative_config leaves quantization unset


def head_quantization(target: ModelRunner, quantization: str | None = None) -> str | None:
    """How the torch head's products are quantized (speculative_config ``quantization``): unset, as
    ``DEFAULT_QUANTIZATION`` where specdec's kernel for it runs on the target's device, else not at all; "int8"
    or "int4" there or a ValueError; "none" never (None: the target's dtype)."""
    if quantization == "none":
        return None
    wanted = quantization or DEFAULT_QUANTIZATION
    can = linear8.available(8 if wanted == "int8" else 4)
    runs = target.device.type == "cpu" and can.ok
    if quantization is not None and not runs:
        why = can.reason if target.device.type == "cpu" else f"the target runs on {target.device.type}"
        raise ValueError(f"speculative_config quantization {quantization!r} runs the head on specdec's CPU "
                         f"kernels, which cannot run it here ({why}); leave quantization unset or set it to 'none'")
    return wanted if runs else None


def head_runner(head: Eagle3Head, target: ModelRunner, quantization: str | None = None):
    """What runs the head beside ``target``, decided here once (the torch head's dtype: ``head_dtype``).

    - A torch target: the torch head (HeadRunner), its one-row passes compiled where the target's step is.
    - A llama.cpp target: the torch head compiled where its products run on one of specdec's kernels
      (``w4`` / ``w8``: x86 with AVX2 / VNNI, ``head_quantization``; ``w16``: x86 without native bf16;
      ``w16dot``: AVX-512 BF16), on torch's threads: its drafting 3.6 against 5.6 ms a round in llama.cpp's graphs on EPYC-AVX2, 1.3 against 2.5 on EPYC-Zen5
      (docs/benchmarks.md, "the EAGLE-3 head's passes compiled" and "2026-12-05, night"); elsewhere
      llama.cpp's own eagle3 graphs (models/llamacpp_head.py); the torch head eager where the build cannot
      run eagle3.
    """
    torch_head = HeadRunner(head, head_dtype(target), target.device, head_quantization(target, quantization))
    name = getattr(head, "name", "") or "head"
    if getattr(target, "backend", "torch") != "llama.cpp":
        if getattr(target, "compiled", None) is not None:
            torch_head.compile(name)
        return torch_head
    if not target.enforce_eager and torch_head.in_cache and torch_head.w.qkv.kind in SPECDEC_KERNELS:
        torch_head.compile(name)
        return torch_head
    return native_head(head, target) or torch_head


class Eagle3Drafter(Drafter):
    can_draft_trees = True  # the head runs in torch beside a torch target (the only one that keeps states)

    def __init__(self, head: Eagle3Head, target: ModelRunner, draft_p_min: float = 0.0, siblings: str = "sampled",
                 quantization: str | None = None):
        if siblings not in SIBLINGS:
            raise ValueError(f"siblings must be one of {SIBLINGS}, got {siblings!r}")
        self.siblings = siblings  # a tree's candidates: the head's top tokens, or drawn from q (tree_expand.py)
        self.rank_acceptance = RankAcceptance()  # sizes sampled trees from how their siblings fared
        self.q_calibration = QCalibration()  # values top-k candidates by how often such a q was accepted
        target.keep_hidden_states(head.config.layer_ids)  # ValueError on a backend that cannot
        self.head, self.target, self.draft_p_min = head, target, draft_p_min
        self.device = target.device
        self.runner = head_runner(head, target, quantization)
        if not isinstance(self.runner, HeadRunner):  # llama.cpp's eagle3 graphs draft chains (trees: chains_as_trees)
            self.can_draft_trees = False
        self.pinned_one_thread: bool | None = None  # a benchmark's choice over ``one_thread``'s rule
        V = target.vocab_size
        ids = head.draft_to_target.to(self.device)  # [Vd] target id of each draft id
        self.keep = (ids < V).nonzero().flatten()  # draft ids the target's vocabulary has
        self.to_target_ids = ids[self.keep]
        self.all_kept = len(self.keep) == len(ids)
        self.same_vocab = len(ids) == V and bool((ids == torch.arange(V, device=self.device)).all())
        self.q_scale = getattr(head.config, "draft_temperature_scale", 1.0)  # 1: q as the head gives it
        self.done: dict[int, int] = {}  # seq_id -> step-0 entries at positions 0..done-1 are in the head's KV
        self.seen: dict[int, list[int]] = {}  # seq_id -> the history those entries read (t_0..t_done)

    @property
    def one_thread(self) -> bool:
        """Whether ``head_threads`` runs small rounds on one torch thread: beside a target that is not torch,
        unless the torch head runs compiled (eager, many small ops, and a second thread competes with the
        target's spinning workers; compiled, few small ops are left and two threads draft faster
        (docs/benchmarks.md). Read from the runner now running, so a runner swapped in keeps the rule."""
        if self.pinned_one_thread is not None:
            return self.pinned_one_thread
        return (getattr(self.target, "backend", "torch") != "torch"
                and not (isinstance(self.runner, HeadRunner) and self.runner.compiled is not None))

    @property
    def q_scale(self) -> float:
        """s in q = softmax(z / (T s)) for sampled rows: the head's calibration (docs/algorithm.md, "Calibrating
        the draft distribution"). Any q keeps the output exact; argmaxes, and so greedy drafts, do not move
        (``draft_p_min`` reads the scaled q, greedy rows' too)."""
        return self._q_scale

    @q_scale.setter
    def q_scale(self, s: float) -> None:
        self._q_scale = check_q_scale(s)

    # -- the Drafter interface --------------------------------------------------------------------

    @head_threads
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_draft: list[int], sb: SamplingBatch) -> DraftProposal:
        B = len(seqs)
        r = self.runner
        active, first_logits, g = self._start(seqs, num_draft, max(num_draft, default=0) + 1)
        if not active:
            return DraftProposal.from_rows([[]] * B, sb.device)

        # 2. draft: step j (1-based) at position L-2+j reads (g of step j-1, d_j)
        pos = [len(seqs[b].token_ids) - 2 for b in active]  # [A] p = L-2
        state = {"g": g}

        def step(x: torch.Tensor, i: int) -> torch.Tensor:  # x [A] draft i+1 -> draft logits [A, Vd] for draft i+2
            logits, state["g"] = r.chain_step(x, state["g"], active, [p + i + 1 for p in pos])  # [A, Vd], [A, D]
            return logits

        every = len(active) == B
        want = list(num_draft) if every else [n if b in set(active) else 0 for b, n in enumerate(num_draft)]
        idx = torch.tensor(active, device=self.device)

        def widen(draft_logits: torch.Tensor) -> torch.Tensor:  # [A, Vd] -> [B, V] (rows that do not draft: 0)
            logits = self._to_target(draft_logits)
            if every:
                return logits
            return logits.new_zeros(B, logits.shape[-1]).index_copy_(0, idx, logits)

        def feed(x: torch.Tensor, i: int) -> torch.Tensor:  # x [B] -> logits [B, V]
            return widen(step(x[idx] if not every else x, i))

        def argmaxes(t: torch.Tensor, n: int) -> torch.Tensor:  # x_1 [A] -> x_2..x_{n+1} [A, n], target ids
            out = []
            for i in range(n):
                t = self._top_ids(step(t, i))  # [A]
                out.append(t)
            return torch.stack(out, dim=1) if out else t.new_zeros(len(t), 0)

        def to_rows(drafts: torch.Tensor) -> torch.Tensor:  # [A, n] -> [B, n] (rows that do not draft: 0)
            return drafts if every else drafts.new_zeros(B, drafts.shape[1]).index_copy_(0, idx, drafts)

        if argmax_drafts(seqs, sb, self.draft_p_min):  # every draft an argmax: no target-vocabulary logits built
            first = self._top_ids(first_logits)  # [A]
            drafts = torch.cat([first[:, None], argmaxes(first, max(want) - 1)], dim=1)  # [A, k]
            return DraftProposal(to_rows(drafts), None, want)

        if every and self.all_kept and every_row_draws(seqs, want, sb, self.draft_p_min):
            # every row draws all its drafts: each step's q and draw in one kernel call over the draft vocabulary,
            # written into the target's (sampling.row_sampler's vocab_map), without target-vocabulary logits
            def draws(pick, n: int) -> list[list[int]]:  # x_1 from the first logits, then n - 1 head steps
                x = pick(first_logits)  # [A] target ids
                picked = [x]
                for i in range(n - 1):
                    x = pick(step(long_tensor(x, self.device), i))
                    picked.append(x)
                return [list(row) for row in zip(*picked)]  # [A, n]

            scaled = sb if self._q_scale == 1.0 else replace(sb, temperature=sb.temperature * self._q_scale)
            return sampled_chain(draws, seqs, max(want), scaled, self.device, self.to_target_ids,
                                 self.target.vocab_size)

        def greedy(x: list[int], n: int) -> list[list[int]]:  # x_1 [B] -> x_2..x_{n+1} [B, n], argmaxes
            t = torch.tensor(x, device=self.device)
            return to_rows(argmaxes(t if every else t[idx], n)).tolist()

        return draft_autoregressive(widen(first_logits), feed, seqs, want, sb, self.draft_p_min, greedy)

    def _start(self, seqs: list[Sequence], wants: list[int], extra: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Sync the head's rows and catch up (step 1 of a round) for the rows that draft: asked for
        drafts (wants[b] > 0), and the target has computed all of the history but its last token.
        Returns those rows, their first draft-vocabulary logits [A, Vd] and pre-norm outputs g [A, D];
        ``extra``: positions to reserve past the longest history."""
        B = len(seqs)
        r = self.runner
        r.reserve(B, max(len(s.token_ids) for s in seqs) + extra)
        is_new = r.rows.sync([s.seq_id for s in seqs], r.cache)
        active = [b for b, s in enumerate(seqs) if wants[b] > 0 and 0 < s.num_computed == len(s.token_ids) - 1]
        if not active:
            return active, torch.empty(0), torch.empty(0)

        # catch up: step 0 over the positions each active row's head KV lacks, up to L-2
        starts = {b: self._valid_start(seqs[b], is_new[b]) for b in active}
        together = [b for b in active if len(seqs[b].token_ids) - 1 - starts[b] <= CATCH_UP_TOGETHER]
        groups = ([together] if together else []) + [[b] for b in active if b not in together]
        first, hidden = {}, {}
        for group in groups:
            if len(group) == 1 and starts[group[0]] == 0:  # a prompt: a choice of the same request may have it
                starts[group[0]] = self._copy_from_sibling(seqs, group[0])
            draft_logits, g = self._catch_up([seqs[b] for b in group], group, [starts[b] for b in group])
            for i, b in enumerate(group):
                first[b], hidden[b] = draft_logits[i], g[i]
                s = seqs[b]
                self.done[s.seq_id] = len(s.token_ids) - 1
                self.seen[s.seq_id] = list(s.token_ids)
        if len(groups) == 1:  # one pass caught every active row up, in their order
            return active, draft_logits, g
        return active, torch.stack([first[b] for b in active]), torch.stack([hidden[b] for b in active])

    @head_threads
    @torch.inference_mode()
    def propose_tree(self, seqs: list[Sequence], shapes: list[TreeShape | None], sb: SamplingBatch) -> list[DraftTree | None]:
        """EAGLE-2's dynamic tree (tree_expand.py) drafted by the head, as EAGLE-3 drafts: one head step
        per level over the expanded nodes, each at position L-2+depth reading its parent's g, its k, v
        at slot L-1+node (the head keeps every level's), attending to the committed entries
        (positions <= L-2), its ancestors and itself. The slots past L-2 are overwritten by the
        next round's catch-up, as a chain's drafts are."""
        B = len(seqs)
        pool = max((tree_pool(s) for s in shapes if s is not None), default=0)
        active, first_logits, g0 = self._start(seqs, [0 if s is None else 1 for s in shapes], pool + 1)
        if not active:
            return [None] * B
        r = self.runner
        hidden: dict[tuple[int, int], torch.Tensor] = {(b, -1): g0[i] for i, b in enumerate(active)}  # (row, node) -> g
        length = {b: len(seqs[b].token_ids) for b in active}
        logits = self._to_target(first_logits)  # [A, V]
        full = logits.new_zeros(B, logits.shape[-1])
        full[torch.tensor(active, device=self.device)] = logits

        def feed(blocks: list[Block | None]) -> list[torch.Tensor | None]:
            rows = [b for b, k in enumerate(blocks) if k is not None]
            M = max(len(blocks[b].want) for b in rows)
            end = max(length[b] - 1 + max(blocks[b].nodes) + 1 for b in rows)
            ids = torch.zeros(len(rows), M, dtype=torch.long, device=self.device)
            h = torch.zeros(len(rows), M, g0.shape[-1], device=self.device)
            pos = torch.zeros(len(rows), M, dtype=torch.long, device=self.device)
            slots = torch.zeros(len(rows), M, dtype=torch.long, device=self.device)
            real = torch.zeros(len(rows), M, dtype=torch.bool, device=self.device)
            visible = torch.zeros(len(rows), M, end, dtype=torch.bool, device=self.device)
            for i, b in enumerate(rows):
                k, L = blocks[b], length[b]
                depth = depths_of(k.parents)  # 0 for a child of the root
                visible[i, :, : L - 1] = True  # the committed entries (padding queries read them too)
                for j, w in enumerate(k.want):
                    node, parent = k.nodes[w], k.parents[w]
                    ids[i, j] = k.tokens[w]
                    h[i, j] = hidden[(b, -1 if parent < 0 else k.nodes[parent])]
                    pos[i, j] = L - 1 + depth[w]
                    slots[i, j] = L - 1 + node
                    real[i, j] = True
                    a = w
                    while a >= 0:  # itself and its ancestors, at their slots
                        visible[i, j, L - 1 + k.nodes[a]] = True
                        a = k.parents[a]
            draft_logits, g = r.step(ids, h, rows, pos, real, slots=slots, visible=visible)  # [R, M, Vd], [R, M, D]
            out: list[torch.Tensor | None] = [None] * B
            for i, b in enumerate(rows):
                k = blocks[b]
                for j, w in enumerate(k.want):
                    hidden[(b, k.nodes[w])] = g[i, j]
                out[b] = self._to_target(draft_logits[i, : len(k.want)])  # [len(want), V]
            return out

        k = max((x.max_children for x in shapes if x is not None), default=1)
        trees = draft_tree(full, feed, seqs, [s if b in length else None for b, s in enumerate(shapes)], sb,
                           self.draft_p_min, self.siblings, self.rank_acceptance.probs(seqs, k), self.q_calibration)
        self.rank_acceptance.propose(seqs, trees)
        return trees

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        self.rank_acceptance.observe(seqs, num_accepted)
        self.q_calibration.observe(seqs, num_accepted)

    def release(self, seqs: list[Sequence]) -> None:
        self.rank_acceptance.release(seqs)
        self.q_calibration.release(seqs)
        for s in seqs:
            self.done.pop(s.seq_id, None)
            self.seen.pop(s.seq_id, None)

    def release_memory(self) -> None:
        self.runner.release()
        self.done.clear()
        self.seen.clear()

    def kv_use(self, k: int, tree: TreeShape | None = None) -> list[KvUse]:
        """The head's KV (one layer, float32): each history and the slots a round reserves past it (k + 1
        for a chain, a tree's candidate pool + 1: ``_start``); and the target's kept layer inputs
        (float32), in the target's cache: at its positions, the history and a verify pass's."""
        c = self.head.config
        pool = tree_pool(tree) if tree is not None else 0
        head = KvUse(2 * c.num_key_value_heads * c.head_dim * 4, extra=max(k, pool) + 1, step=CACHE_STEP,
                     min_rows=getattr(self.runner, "min_cache_rows", 1))
        verify = max(k, tree.num_nodes if tree is not None else 0) + 1
        states = KvUse(len(c.layer_ids) * c.target_hidden_size * 4, extra=verify, step=self.target.cache_step)
        return [head, states]

    # -- the head's passes -----------------------------------------------------------------------

    def _valid_start(self, s: Sequence, new: bool) -> int:
        """The first position whose step-0 entry must be (re)computed, at most L-2 (the first draft's
        logits come from that position). An entry at p read t_0..t_{p+1}: it is valid while those stay."""
        L = len(s.token_ids)
        if new or s.seq_id not in self.done:
            return 0
        done, seen = self.done[s.seq_id], self.seen[s.seq_id]
        if not grew_from(seen, s.token_ids):  # the history was replaced: keep the common prefix's entries
            m = min(len(seen), L)
            m = next((i for i in range(m) if seen[i] != s.token_ids[i]), m)
            done = min(done, max(m - 1, 0))
        return min(done, L - 2)

    def _copy_from_sibling(self, seqs: list[Sequence], b: int) -> int:
        """Row b's first position to compute after copying the head's entries for its prompt from a choice
        of the same request (same prefill_group) that has them: the entries at p < P - 1 read prompt
        tokens only. 0 when no sibling has any."""
        s = seqs[b]
        if s.prefill_group is None:
            return 0
        P = s.num_prompt_tokens
        for r, o in enumerate(seqs):
            if o is not s and o.prefill_group == s.prefill_group and o.seq_id in self.done:
                shared = min(self.done[o.seq_id], P - 1)
                if shared > 0:
                    self.runner.cache.copy_prefix(r, [b], shared)
                    return min(shared, len(s.token_ids) - 2)
        return 0

    def _catch_up(self, seqs: list[Sequence], rows: list[int], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 0 for row r = rows[i] at positions starts[i]..L_i-2, padded to the longest; writes the
        head's KV. Returns the draft-vocabulary logits [G, Vd] and pre-norm output g [G, D] at L_i-2."""
        G = len(seqs)
        n = [len(s.token_ids) - 1 - st for s, st in zip(seqs, starts)]  # [G] positions fed, >= 1
        T = max(n)
        dev = self.device
        if G == 1:  # the target's states as they are kept (a view: no copy), its tokens as they are
            ids = torch.tensor(seqs[0].token_ids[starts[0] + 1 :])[None]  # [1, T] token p + 1 at position p
            feats = self.target.hidden_states(rows[0], starts[0], starts[0] + T)[None]  # [1, T, 3 Dt]
        else:
            ids = torch.zeros(G, T, dtype=torch.long)
            feats = torch.zeros(G, T, self.runner.fc.in_features, device=dev)  # [G, T, 3 Dt]
            for i, (s, r, st) in enumerate(zip(seqs, rows, starts)):
                ids[i, : n[i]] = torch.tensor(s.token_ids[st + 1 :])  # token p + 1 at position p
                feats[i, : n[i]] = self.target.hidden_states(r, st, st + n[i])
        if G == 1 and isinstance(self.runner, HeadRunner) and self.runner.in_cache:  # one row: the lean path
            return self.runner.catch_up_row(ids[0].to(dev), self.runner.fuse(feats[0]), rows[0], starts[0])
        t = torch.arange(T, device=dev)
        lengths = torch.tensor(n, device=dev)
        real = t[None] < lengths[:, None]  # [G, T]
        # padding sits at its row's last real position (it reads only what that one does; its k, v are not written)
        pos = torch.tensor(starts, device=dev)[:, None] + torch.minimum(t[None], lengths[:, None] - 1)  # [G, T]
        logits, g = self.runner.step(ids.to(dev), self.runner.fuse(feats), rows, pos, None if min(n) == T else real,
                                     query_at=lengths - 1)
        return logits[:, 0], g[:, 0]  # [G, Vd], [G, D]

    def _top_ids(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[A, Vd] -> [A] the target id of each row's argmax over the draft vocabulary's target tokens: the
        argmax of ``_to_target``'s logits without building them (an exact tie may break the other way where
        a head's draft ids do not run in its target ids' order; any draft keeps the output exact)."""
        return self.to_target_ids[(draft_logits if self.all_kept else draft_logits[:, self.keep]).argmax(dim=-1)]

    def _to_target(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[A, Vd] -> [A, V] target vocabulary, divided by ``q_scale``; tokens outside the draft vocabulary
        get OFF_VOCAB."""
        if self._q_scale != 1.0:
            draft_logits = draft_logits / self._q_scale
        if self.same_vocab:
            return draft_logits
        out = draft_logits.new_full((draft_logits.shape[0], self.target.vocab_size), OFF_VOCAB)
        out[:, self.to_target_ids] = draft_logits[:, self.keep]
        return out
