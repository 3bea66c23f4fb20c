"""A lean PyTorch forward for Llama-family checkpoints (Llama, Qwen2, Qwen3, Mistral).

Weights come from the transformers model that load.py loads (``LoadedModel``); this
module re-packs them (fused q/k/v and gate/up projections, ``layers.ModelWeights``) and
runs the layer math of layers.py over its own KV cache, written by absolute position:
eagerly for any batch (the attention layouts below), or through the compiled step
(compiled.py) for one row of a few tokens. Logits match transformers' forward within
float32 rounding.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from specdec.models import cache_attention as attention_kernel
from specdec.models import linear16
from specdec.models.base import ForwardBatch, ModelRunner, check_layer_ids
from specdec.models.compiled import CompiledStep, enforce_eager_default, sizes_for
from specdec.models.cpu import native_bf16
from specdec.models.kv_cache import CACHE_STEP, KVCache, RowTable, grow
from specdec.models.layers import (FEW_QUERIES, Dims, LayerWeights, ModelWeights, attention, attention_mask, decoder,
                                   logits, rope_tables)
from specdec.models.linear import KERNEL_NAMES, ONEDNN_MIN_ROWS, Linear
from specdec.tree import ancestor_mask, depths_of, tree_mask

log = logging.getLogger("specdec.runner")

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
CACHE_RESIDENT_BYTES = 16 << 20  # weights up to this size stay in a server CPU's caches between tokens


@dataclass
class LoadedModel:
    """A checkpoint as transformers loads it: what ``LlamaRunner`` packs its weights from."""

    path: str
    config: object  # transformers.PretrainedConfig
    hf_model: torch.nn.Module  # the transformers model, used only as a source of weights
    tokenizer: object | None  # transformers tokenizer, or None when the folder ships none


PACK_BELOW = 0.75  # ragged rows are packed when their real tokens are at most this share of B * T


class LlamaRunner(ModelRunner):
    backend = "torch"
    can_run_layer_subsets = True
    casts_weights = True
    can_keep_hidden_states = True
    can_verify_trees = True

    def __init__(self, loaded: LoadedModel, max_model_len: int | None = None, vocab_size: int | None = None,
                 enforce_eager: bool | None = None, compile_sizes: Sequence[int] | None = None,
                 longest_feed: int | None = None):
        """``enforce_eager`` (vLLM's name): True runs every forward eager; False compiles the few-token
        step at once (compiled.py; on CUDA replayed as CUDA graphs); None: compile on CPU and CUDA unless
        SPECDEC_ENFORCE_EAGER=1 (other devices run eager). ``compile_sizes``:
        the token counts per row compiled (default: compiled.sizes_for the weights' product kind, reaching
        ``longest_feed``: the most tokens a verify pass will feed a row, k + 1 for a chain)."""
        cfg = loaded.config
        model = loaded.hf_model
        inner = model.model
        self.config = cfg
        self.name = os.path.basename(os.path.normpath(loaded.path)) or loaded.path  # for messages
        self.tokenizer = loaded.tokenizer
        self.device = inner.embed_tokens.weight.device
        self.dtype = inner.embed_tokens.weight.dtype  # of the weights
        # The residual stream, norms, RoPE, attention and the KV cache: float32 whatever the weights
        # are. On CPU its kernels for half-precision elementwise ops and attention are slower than
        # float32 ones; on CUDA a bf16 stream would round every layer's result, and the rounding moves
        # with the kernel a batch's shape picks: a verify pass's rows would then differ from the
        # one-token steps of plain decoding by far more than a near-tie (linear.py: products into float32).
        compute_dtype = torch.float32
        dims = Dims(hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                    num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                    head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                    eps=cfg.rms_norm_eps, compute_dtype=compute_dtype)
        self.num_layers = cfg.num_hidden_layers
        limit = cfg.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")
        self.max_model_len = max_model_len or limit

        from transformers.activations import ACT2FN

        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.min_rows = ONEDNN_MIN_ROWS if weight_bytes > CACHE_RESIDENT_BYTES else 1
        with torch.no_grad():
            embed = inner.embed_tokens.weight.detach()  # [V_rows, D]
            tok_len = len(loaded.tokenizer) if loaded.tokenizer is not None else embed.shape[0]
            self.vocab_size = min(vocab_size or tok_len, embed.shape[0])
            act = lambda t: t.detach().to(compute_dtype)  # noqa: E731
            # the weights the layer math (layers.py) reads, eager or compiled
            self.model = ModelWeights(
                dims=dims, embed=embed, layers=[self._pack_layer(i, layer, cfg, act) for i, layer in enumerate(inner.layers)],
                final_norm=act(inner.norm.weight),
                lm_head=self._linear(model.lm_head.weight[: self.vocab_size], None),  # D -> V; ids past the tokenizer cut
                act=ACT2FN[cfg.hidden_act], inv_freq=inner.rotary_emb.inv_freq.detach().float().to(self.device),
                rope_scaling=float(inner.rotary_emb.attention_scaling))
        self._init_rope(cfg)
        self.cache: KVCache | None = None
        self.rows = RowTable()
        self.kept_layers: list[int] = []  # keep_hidden_states' layer ids, in the order they are concatenated
        # the compiled step (compiled.py), and which path the last forward took: "compiled" or "eager: <why>"
        if enforce_eager is None:
            enforce_eager = enforce_eager_default() or self.device.type not in ("cpu", "cuda")
        self.enforce_eager = bool(enforce_eager)
        self.compile_sizes = tuple(compile_sizes or sizes_for(self.lm_head.kind, longest_feed))
        self.compiled: CompiledStep | None = None
        self.last_path = "eager: enforce_eager" if self.enforce_eager else "compiled"
        if not self.enforce_eager:
            self.compiled = CompiledStep(self, self.compile_sizes)

    @property
    def layers(self) -> list[LayerWeights]:
        return self.model.layers

    @property
    def lm_head(self) -> Linear:
        return self.model.lm_head

    @property
    def compute_dtype(self) -> torch.dtype:
        """The residual stream's, norms', RoPE's, attention's and the KV cache's dtype."""
        return self.model.dims.compute_dtype

    def describe(self) -> str:
        """The compute path in one line: the ISA (or device), the weights' dtype, the product kernel."""
        dtype = str(self.dtype).removeprefix("torch.")
        step = "eager" if self.compiled is None else "compiled step (inductor)"
        if self.device.type != "cpu":
            return f"{self.device.type}: {dtype} weights, {KERNEL_NAMES[self.lm_head.kind]}, {step}"
        kernel = KERNEL_NAMES.get(self.lm_head.kind, self.lm_head.kind)
        if self.lm_head.kind == "w16dot" and linear16.amx_tiles():
            kernel += f"; AMX tiles for {linear16.amx_min_rows()}+ rows"
        return f"{native_bf16().isa}: {dtype} weights, {kernel}, {step}"

    # -- weights ---------------------------------------------------------------------------------

    def _pack_layer(self, i: int, layer, cfg, act) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp

        def cat(mods, attr):
            parts = [getattr(m, attr) for m in mods]
            return None if parts[0] is None else torch.cat([p.detach() for p in parts], dim=0).contiguous()

        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            window = cfg.sliding_window if layer_types[i] == "sliding_attention" else None
        else:
            window = getattr(cfg, "sliding_window", None)
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        return LayerWeights(
            input_norm=act(layer.input_layernorm.weight),
            qkv=self._linear(cat([attn.q_proj, attn.k_proj, attn.v_proj], "weight"),
                             cat([attn.q_proj, attn.k_proj, attn.v_proj], "bias")),
            q_norm=None if q_norm is None else act(q_norm.weight),
            k_norm=None if k_norm is None else act(k_norm.weight),
            o=self._linear(attn.o_proj.weight, attn.o_proj.bias),
            post_norm=act(layer.post_attention_layernorm.weight),
            gate_up=self._linear(cat([mlp.gate_proj, mlp.up_proj], "weight"), cat([mlp.gate_proj, mlp.up_proj], "bias")),
            down=self._linear(mlp.down_proj.weight, mlp.down_proj.bias),
            sliding_window=window,
        )

    def _linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        return Linear(weight.detach(), None if bias is None else bias.detach(), self.min_rows)

    def _init_rope(self, cfg) -> None:
        params = getattr(cfg, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(f"RoPE type {rope_type!r} is not supported (its frequencies change with length); "
                             f"supported: {', '.join(STATIC_ROPE_TYPES)}")
        self.cos = self.sin_signed = torch.empty(0, self.model.dims.head_dim)
        self._grow_rope(min(self.max_model_len, 2 * CACHE_STEP))

    def _grow_rope(self, length: int) -> None:
        if length <= self.cos.shape[0]:
            return
        m = self.model
        pos = torch.arange(length, device=self.device, dtype=torch.float32)
        self.cos, self.sin_signed = rope_tables(pos, m.inv_freq, m.rope_scaling, m.dims.compute_dtype)  # [L, hd]

    # -- cache -----------------------------------------------------------------------------------

    @property
    def min_cache_rows(self) -> int:
        """2 on the compiled path (its graph traced the cache's rows as a dynamic dim, >= 2), else 1."""
        return 2 if self.compiled is not None else 1

    def reserve(self, num_rows: int, length: int) -> None:
        """Make room for ``num_rows`` sequences of ``length`` positions, keeping what is cached."""
        c = self.cache
        if c is not None and c.num_rows >= max(num_rows, self.min_cache_rows) and c.max_len >= length:
            return  # room already (most calls: every compiled pass asks), without entering inference mode

        def make(rows: int, max_len: int) -> KVCache:
            d = self.model.dims
            return KVCache(self.num_layers, rows, d.num_kv_heads, max_len, d.head_dim, d.compute_dtype,
                           self.device, state_width=len(self.kept_layers) * d.hidden_size)

        with torch.inference_mode():  # the cache is only ever touched in inference mode, wherever it was made
            self.cache = grow(self.cache, max(num_rows, self.min_cache_rows), length, self.cache_step, make)
            self._grow_rope(self.cache.max_len)

    def release(self) -> None:
        self.cache = None
        self.rows = RowTable()

    def sync_rows(self, ids: Sequence[Hashable]) -> list[bool]:
        if self.cache is not None and self.rows.holds(ids):  # most rounds: no torch call at all
            return [False] * len(ids)
        with torch.inference_mode():
            self.reserve(len(ids), self.cache.max_len if self.cache else 1)
            return self.rows.sync(ids, self.cache)

    @torch.inference_mode()
    def copy_prefix(self, src_row: int, dst_rows: Sequence[int], length: int) -> None:
        self.cache.copy_prefix(src_row, dst_rows, length)

    # -- kept hidden states (EAGLE-3) ------------------------------------------------------------

    @torch.inference_mode()
    def keep_hidden_states(self, layer_ids: Sequence[int]) -> None:
        """Keep, per cache row and position, the inputs of layers ``layer_ids`` concatenated [n * D]
        float32 in the KV cache's ``states`` (so they move, copy and grow with it). Positions cached
        before this call read as zeros."""
        ids = check_layer_ids(layer_ids, self.num_layers)
        if ids == self.kept_layers:
            return
        self.kept_layers = ids
        if self.compiled is not None:  # the graph writes the kept states: compile it again, now
            self.compiled = CompiledStep(self, self.compile_sizes)
        old = self.cache
        if old is not None:  # re-made with room for the states; the KV is kept
            self.cache = None
            self.reserve(old.num_rows, old.max_len)
            self.cache.grown_from(old)

    def hidden_states(self, row: int, start: int, end: int) -> torch.Tensor:
        """The kept layer inputs of cache row ``row`` at positions start..end-1  [end - start, n * D]
        float32: a view into the cache, valid until the next forward or cache change."""
        if not self.kept_layers:
            raise ValueError("hidden_states: call keep_hidden_states(layer_ids) first")
        if self.cache is None or end > self.cache.max_len:
            raise ValueError(f"hidden_states: positions {start}..{end - 1} of row {row} are not cached")
        return self.cache.states[row, start:end]

    def token_embedding(self) -> torch.Tensor:
        return self.model.embed  # [V_rows, D]

    # -- forward ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        if self.compiled is not None:
            reason = self.compiled.why_not(batch)
            if reason is None:
                self.last_path = "compiled"
                return self.compiled.run(batch)
            self.last_path = f"eager: {reason}"
            log.debug("torch runner: eager forward: %s", reason)
        return self._eager_forward(batch)

    def forward_argmax(self, batch: ForwardBatch) -> list:
        """The compiled graph computes the argmax beside the logits: taken as it is (ModelRunner.forward_argmax)."""
        if self.compiled is not None and batch.logits_index is not None and self.compiled.why_not(batch) is None:
            self.last_path = "compiled"
            return self.compiled.run(batch, argmax=True)
        return super().forward_argmax(batch)

    @torch.inference_mode()
    def greedy_steps(self, token_ids: Sequence[int], start: Sequence[int], steps: int, row_offset: int = 0,
                     stop_token_ids: Sequence[int] = ()) -> list[list[int]]:
        """The base contract; one row on the compiled step runs its lean loop (CompiledStep.greedy_steps)."""
        if self.compiled is None or len(token_ids) != 1 or 1 not in self.compiled.sizes \
                or self.compiled.why_not_shape(1, 1) is not None:
            return super().greedy_steps(token_ids, start, steps, row_offset, stop_token_ids)
        self.last_path = "compiled"
        return [self.compiled.greedy_steps(int(token_ids[0]), start[0], steps, row_offset, stop_token_ids)]

    @torch.inference_mode()
    def sampled_steps(self, token_ids: Sequence[int], start: Sequence[int], steps: int, pick,
                      row_offset: int = 0) -> list[list[int]]:
        """The base contract; one row on the compiled step runs its lean loop (CompiledStep.sampled_steps)."""
        if self.compiled is None or len(token_ids) != 1 or 1 not in self.compiled.sizes \
                or self.compiled.why_not_shape(1, 1) is not None:
            return super().sampled_steps(token_ids, start, steps, pick, row_offset)
        self.last_path = "compiled"
        return [self.compiled.sampled_steps(int(token_ids[0]), start[0], steps, row_offset, pick)]

    def _eager_forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        B, T = batch.token_ids.shape  # [B, T]
        # Rows padded to T by more than a quarter of the batch are packed: every layer runs on the N
        # real tokens only, attention included, so a prompt merged into a verify pass costs what its
        # tokens cost and does not pad the other rows to its length.
        ragged = B > 1 and min(batch.lengths) < T
        if batch.parents is not None:  # a tree: padding writes past each row's tokens, seen by none
            attention = _Dense(batch.start, None, T, batch.row_offset, self.device, batch.parents)
        elif ragged and sum(batch.lengths) <= PACK_BELOW * B * T:
            attention = _Packed(batch.start, batch.lengths, T, batch.row_offset, self.device)
        else:
            attention = _Dense(batch.start, batch.lengths if ragged else None, T, batch.row_offset, self.device)
        self.reserve(batch.row_offset + B, attention.end)
        cos, sin = attention.rope(self.cos, self.sin_signed)  # broadcastable to q and k
        x, kept = decoder(self.model, attention.tokens(batch.token_ids), cos, sin,
                          lambda li, q, k, v, window: attention.attend(self.cache, li, q, k, v, window),
                          batch.num_layers or self.num_layers, self.kept_layers)  # [B, T, D] or [N, D]
        if kept and len(kept) == len(set(self.kept_layers)):  # a layer subset (layer_skip) keeps nothing
            attention.store(self.cache.states, torch.cat([kept[i] for i in self.kept_layers], dim=-1).float())
        if batch.logits_index is None:
            return None
        return logits(self.model, attention.select(x, batch.logits_index))  # [B, V] or [B, L, V]

    @torch.inference_mode()
    def compact(self, rows: Sequence[int], start: Sequence[int], keep: Sequence[Sequence[int]]) -> None:
        for r, s, kept in zip(rows, start, keep):
            self.cache.compact(r, s, kept)

    def kv_bytes_per_token(self) -> int:
        d = self.model.dims
        return 2 * self.num_layers * d.num_kv_heads * d.head_dim * torch.finfo(d.compute_dtype).bits // 8


class _Dense:
    """Attention for a [B, T] batch: write k and v at their positions, read each row's keys
    0..end-1. Ragged rows' padding goes to one scratch position past every row's real tokens, so a
    long row never pushes the others' padding past the context. Batches of a few queries per row
    (decoding, verifying) use two batched matmuls, where SDPA's CPU kernel is built for long ones; one
    sequence keeps SDPA."""

    def __init__(self, start: Sequence[int], lengths: Sequence[int] | None, T: int, row_offset: int,
                 device: torch.device, parents: list[list[int]] | None = None):
        B = len(start)
        self.start = start[0]  # row 0's first position (the B == 1 path slices from it)
        if lengths is not None:  # ragged: clamp the padding to the scratch position
            self.end = max(s + n for s, n in zip(start, lengths)) + 1
        else:
            self.end = max(start) + T  # keys 0..end-1 are read
        if B == 1:
            self.pos = torch.arange(self.start, self.start + T, device=device)[None]  # [1, T]
        else:
            self.pos = torch.tensor(start, device=device)[:, None] + torch.arange(T, device=device)  # [B, T]
            if lengths is not None:
                self.pos.clamp_(max=self.end - 1)
        self.slot = self.pos  # [B, T] where k, v and states are written: the position, but in a tree
        self.r0, self.r1 = row_offset, row_offset + B
        self.rows = None if B == 1 else torch.arange(self.r0, self.r1, device=device)[:, None].expand(B, T)
        self.small = B > 1 and T <= FEW_QUERIES
        self.masks: dict[Hashable, torch.Tensor | None] = {}  # by window; the kernel's bias by ("bias", window)
        self.tree = None
        if parents is not None:  # positions by depth, a mask of ancestors (tree.py); slots stay start + t
            depth = torch.tensor([depths_of(p) for p in parents], device=device)  # [B, T]
            self.pos = torch.tensor(start, device=device)[:, None] + depth
            self.tree = (torch.stack([ancestor_mask(p) for p in parents]).to(device),  # [B, T, T]
                         torch.tensor(start, device=device))
            self.small = T <= FEW_QUERIES

    def rope(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables' rows for this batch, shaped to broadcast over [B, T, heads, hd]."""
        if self.rows is None and self.tree is None:  # one chain: slices, not gathers
            s, T = self.start, self.pos.shape[1]
            return cos[s : s + T, None], sin[s : s + T, None]  # [T, 1, hd]
        return cos[self.pos].unsqueeze(2), sin[self.pos].unsqueeze(2)  # [B, T, 1, hd]

    def tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return token_ids  # [B, T]

    def store(self, states: torch.Tensor, x: torch.Tensor) -> None:
        """Write per-position states x [B, T, W] into states [rows, max_len, W] at the rows' positions
        (ragged rows' padding lands on the scratch position, as its k and v do)."""
        if self.rows is None:
            states[self.r0, self.start : self.start + x.shape[1]] = x[0]
        else:
            states[self.rows, self.slot] = x

    def select(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] at index [B] or [B, L] -> [B, D] or [B, L, D]."""
        rows = torch.arange(x.shape[0], device=x.device)
        return x[rows if index.dim() == 1 else rows[:, None], index]

    @functools.cached_property
    def row_tensor(self) -> torch.Tensor:
        """[1] long: the cache row of a one-row batch."""
        return torch.tensor([self.r0], device=self.pos.device)

    def attend(self, cache: KVCache, li: int, q, k, v, window: int | None) -> torch.Tensor:
        """q [B, T, H, hd]; k, v [B, T, KVH, hd] -> [B, T, H, hd]."""
        r0, r1, end = self.r0, self.r1, self.end
        if self.rows is None:
            s, T = self.start, q.shape[1]
            cache.k[li, r0, :, s : s + T] = k[0].transpose(0, 1)  # [KVH, T, hd]
            cache.v[li, r0, :, s : s + T] = v[0].transpose(0, 1)
        else:
            cache.k[li][self.rows, :, self.slot] = k  # [B, T, KVH, hd] into rows at their slots
            cache.v[li][self.rows, :, self.slot] = v.to(cache.v.dtype)
        if self.rows is None and self.tree is None and attention_kernel.supports(q.dtype, q.device, q.shape[-1]):
            # one row (a prefill, an eager step): specdec's kernel reads the cache in place and skips the keys its
            # causal mask hides (EPYC-Zen5, 8 heads on 4, a prefill of 250 tokens: 0.32-0.36 ms a layer, SDPA 0.81)
            if ("bias", window) not in self.masks:
                self.masks[("bias", window)] = attention_mask(self.pos, end, window, additive=True)[:, 0]  # [1, T, end]
            return attention_kernel.cache_attention(q, cache.k, cache.v, li, self.row_tensor,
                                                    self.masks[("bias", window)])  # [1, T, H, hd]
        keys, values = cache.k[li, r0:r1, :, :end], cache.v[li, r0:r1, :, :end]  # [B, KVH, end, hd]
        if window not in self.masks:
            if self.tree is None:
                self.masks[window] = attention_mask(self.pos, end, window, additive=self.small)
            else:
                self.masks[window] = tree_mask(self.pos, *self.tree, end, window, additive=self.small)
        return attention(q.transpose(1, 2), keys, values, self.masks[window]).transpose(1, 2)  # [B, T, H, hd]


@dataclass
class _ShortRows:
    """The packed rows of typical length, attending together padded to the longest of them (S rows, Ts)."""

    gather: torch.Tensor  # [S, Ts] index into [q; zeros] ([N + 1] rows): padding reads the zero row
    real: torch.Tensor  # [S, Ts] bool, the real tokens
    dst: torch.Tensor  # [n_short] each real token's place among the N packed ones
    pos: torch.Tensor  # [S, Ts] positions; padding sits at its row's last real position
    end: int  # keys 0..end-1 are read
    cache_rows: slice | torch.Tensor  # the S cache rows: a slice when contiguous


@dataclass
class _LongRow:
    """A packed row much longer than the others (a merged prompt): it attends alone with SDPA."""

    cache_row: int
    offset: int  # its first token among the N packed ones
    length: int
    start: int  # its first position


class _Packed:
    """Attention for ragged rows packed into their N real tokens (row-major): row b's tokens are
    positions start[b]..start[b]+lengths[b]-1 of cache row row_offset + b. k and v are written for
    the real tokens only; rows of typical length attend together (_ShortRows), each much longer
    row alone (_LongRow), so nothing is padded to a merged prompt's length."""

    def __init__(self, start: Sequence[int], lengths: Sequence[int], T: int, row_offset: int, device: torch.device):
        B = len(lengths)
        n = torch.tensor(lengths, device=device)
        valid = torch.arange(T, device=device)[None] < n[:, None]  # [B, T]
        self.index = valid.nonzero(as_tuple=True)  # (row [N], t [N])
        self.pos = torch.tensor(start, device=device)[self.index[0]] + self.index[1]  # [N]
        self.rows = self.index[0] + row_offset  # [N] cache rows
        self.end = max(s + m for s, m in zip(start, lengths))
        self.shape = (B, T)
        N = len(self.pos)
        offsets = [0, *itertools.accumulate(lengths)][:B]  # row b's first token in the packed order
        # A row longer than twice the median (a newcomer's prompt among 1-5 token feeds) attends alone.
        together = min(FEW_QUERIES, 2 * sorted(lengths)[B // 2])
        short = [b for b in range(B) if 0 < lengths[b] <= together]  # a row may have nothing to feed
        self.short = None
        if short:
            Ts = max(lengths[b] for b in short)
            t = torch.arange(Ts, device=device)
            real = t[None] < n[short][:, None]  # [S, Ts]
            offs = torch.tensor([offsets[b] for b in short], device=device)[:, None]
            gather = torch.where(real, offs + t, N)  # [S, Ts]
            pos = torch.minimum(torch.tensor([start[b] for b in short], device=device)[:, None] + t,
                                torch.tensor([start[b] + lengths[b] - 1 for b in short], device=device)[:, None])
            contiguous = short == list(range(short[0], short[0] + len(short)))
            cache_rows = slice(row_offset + short[0], row_offset + short[-1] + 1) if contiguous \
                else torch.tensor([row_offset + b for b in short], device=device)
            self.short = _ShortRows(gather, real, gather[real], pos, max(start[b] + lengths[b] for b in short),
                                    cache_rows)
        self.long = [_LongRow(row_offset + b, offsets[b], lengths[b], start[b]) for b in range(B)
                     if lengths[b] > together]
        self.masks: dict[tuple, torch.Tensor | None] = {}

    def rope(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cos[self.pos].unsqueeze(1), sin[self.pos].unsqueeze(1)  # [N, 1, hd]

    def tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return token_ids[self.index]  # [N]

    def store(self, states: torch.Tensor, x: torch.Tensor) -> None:
        """Write per-position states x [N, W] (packed) into states [rows, max_len, W]."""
        states[self.rows, self.pos] = x

    def select(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """x [N, D] (packed) at index [B] or [B, L] into each row's T -> [B, D] or [B, L, D]."""
        full = x.new_zeros(*self.shape, x.shape[-1]).index_put_(self.index, x)  # [B, T, D]
        rows = torch.arange(self.shape[0], device=x.device)
        return full[rows if index.dim() == 1 else rows[:, None], index]

    def _mask(self, key, pos: torch.Tensor, end: int, window: int | None, additive: bool):
        if (key, window) not in self.masks:
            self.masks[(key, window)] = attention_mask(pos, end, window, additive=additive)
        return self.masks[(key, window)]

    def attend(self, cache: KVCache, li: int, q, k, v, window: int | None) -> torch.Tensor:
        """q [N, H, hd]; k, v [N, KVH, hd] -> [N, H, hd]."""
        cache.k[li][self.rows, :, self.pos] = k  # [N, KVH, hd] into their rows and positions
        cache.v[li][self.rows, :, self.pos] = v.to(cache.v.dtype)
        out = torch.empty_like(q)
        if (sr := self.short) is not None:
            qs = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[sr.gather]  # [S, Ts, H, hd]
            keys = cache.k[li][sr.cache_rows, :, : sr.end]  # [S, KVH, end, hd]
            values = cache.v[li][sr.cache_rows, :, : sr.end]
            o = attention(qs.transpose(1, 2), keys, values, self._mask("short", sr.pos, sr.end, window, True))
            out[sr.dst] = o.transpose(1, 2)[sr.real]  # [S, Ts, H, hd] -> the real tokens
        for r in self.long:
            end = r.start + r.length
            pos = self.pos[r.offset : r.offset + r.length][None]  # [1, n]
            keys, values = cache.k[li, r.cache_row : r.cache_row + 1, :, :end], cache.v[li, r.cache_row : r.cache_row + 1, :, :end]
            o = attention(q[r.offset : r.offset + r.length].transpose(0, 1)[None], keys, values,
                          self._mask(r.cache_row, pos, end, window, False))  # [1, H, n, hd]
            out[r.offset : r.offset + r.length] = o[0].transpose(0, 1)
        return out

