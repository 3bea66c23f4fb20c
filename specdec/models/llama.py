"""A lean PyTorch forward for Llama-family checkpoints (Llama, Qwen2, Qwen3, Mistral).

Weights come from the transformers model loaded by ``loader.load_model``; this
module re-packs them (fused q/k/v and gate/up projections) and runs its own
forward over its own KV cache, written by absolute position. Logits match
transformers' forward within float32 rounding.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.models.base import ModelRunner
from specdec.models.kv_cache import KVCache, RowTable
from specdec.models.linear import ONEDNN_MIN_ROWS, Linear
from specdec.models.loader import LoadedModel

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
CACHE_RESIDENT_BYTES = 16 << 20  # weights up to this size stay in a server CPU's caches between tokens
_CACHE_LEN_STEP = 256  # grow the cache in steps, not one token at a time


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    qkv: Linear  # D -> (H + 2*KVH) * hd
    q_norm: torch.Tensor | None  # [hd], Qwen3 only
    k_norm: torch.Tensor | None
    o: Linear  # H * hd -> D
    post_norm: torch.Tensor  # [D]
    gate_up: Linear  # D -> 2 * I
    down: Linear  # I -> D
    sliding_window: int | None


FEW_QUERIES = 16  # up to this many queries per row, batched attention uses _few_query_attention
PACK_BELOW = 0.75  # ragged rows are packed when their real tokens are at most this share of B * T


class LlamaRunner(ModelRunner):
    def __init__(self, loaded: LoadedModel, max_model_len: int | None = None, vocab_size: int | None = None):
        cfg = loaded.config
        model = loaded.hf_model
        inner = model.model
        self.config = cfg
        self.tokenizer = loaded.tokenizer
        self.device = inner.embed_tokens.weight.device
        self.dtype = inner.embed_tokens.weight.dtype  # of the weights
        # The residual stream, norms, RoPE, attention and the KV cache: float32 on CPU whatever the
        # weights are (CPU kernels for half-precision elementwise ops and attention are slower than
        # float32 ones), the weights' dtype elsewhere. With bf16 weights each matrix product reads
        # half the bytes, takes its input rounded to bf16 and gives a bf16 result (logits included).
        self.compute_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.num_layers = cfg.num_hidden_layers
        limit = cfg.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")
        self.max_model_len = max_model_len or limit

        from transformers.activations import ACT2FN

        self.act = ACT2FN[cfg.hidden_act]
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.min_rows = ONEDNN_MIN_ROWS if weight_bytes > CACHE_RESIDENT_BYTES else 1
        with torch.no_grad():
            self.embed = inner.embed_tokens.weight.detach()  # [V_rows, D]
            rows = self.embed.shape[0]
            tok_len = len(loaded.tokenizer) if loaded.tokenizer is not None else rows
            self.vocab_size = min(vocab_size or tok_len, rows)
            self.lm_head = self._linear(model.lm_head.weight[: self.vocab_size], None)  # D -> V; ids past the tokenizer cut
            self.final_norm = self._act(inner.norm.weight)
            self.layers = [self._pack_layer(i, layer, cfg) for i, layer in enumerate(inner.layers)]
        self._init_rope(inner.rotary_emb, cfg)
        self.cache: KVCache | None = None
        self.rows = RowTable()

    # -- weights ---------------------------------------------------------------------------------

    def _pack_layer(self, i: int, layer, cfg) -> LayerWeights:
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
            input_norm=self._act(layer.input_layernorm.weight),
            qkv=self._linear(cat([attn.q_proj, attn.k_proj, attn.v_proj], "weight"),
                             cat([attn.q_proj, attn.k_proj, attn.v_proj], "bias")),
            q_norm=None if q_norm is None else self._act(q_norm.weight),
            k_norm=None if k_norm is None else self._act(k_norm.weight),
            o=self._linear(attn.o_proj.weight, attn.o_proj.bias),
            post_norm=self._act(layer.post_attention_layernorm.weight),
            gate_up=self._linear(cat([mlp.gate_proj, mlp.up_proj], "weight"), cat([mlp.gate_proj, mlp.up_proj], "bias")),
            down=self._linear(mlp.down_proj.weight, mlp.down_proj.bias),
            sliding_window=window,
        )

    def _linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        return Linear(weight.detach(), None if bias is None else bias.detach(), self.min_rows)

    def _act(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(self.compute_dtype)

    def _init_rope(self, rotary_emb, cfg) -> None:
        params = getattr(cfg, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(f"RoPE type {rope_type!r} is not supported (its frequencies change with length); "
                             f"supported: {', '.join(STATIC_ROPE_TYPES)}")
        self.inv_freq = rotary_emb.inv_freq.detach().float().to(self.device)  # [hd / 2]
        self.rope_scaling = float(rotary_emb.attention_scaling)
        self.cos = self.sin_signed = torch.empty(0, self.head_dim)
        self._grow_rope(min(self.max_model_len, 2 * _CACHE_LEN_STEP))

    def _grow_rope(self, length: int) -> None:
        if length <= self.cos.shape[0]:
            return
        pos = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]  # [L, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [L, hd]
        self.cos = (emb.cos() * self.rope_scaling).to(self.compute_dtype)
        sin = emb.sin() * self.rope_scaling
        half = self.head_dim // 2  # rotate_half(x) = cat(-x2, x1) = roll(x, half) * [-1]*half + [1]*half
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(self.compute_dtype)

    # -- cache -----------------------------------------------------------------------------------

    @torch.inference_mode()  # the cache is only ever touched in inference mode, wherever it was made
    def reserve(self, num_rows: int, length: int) -> None:
        """Make room for ``num_rows`` sequences of ``length`` positions, keeping what is cached."""
        length = -(-length // _CACHE_LEN_STEP) * _CACHE_LEN_STEP
        old = self.cache
        if old is not None and old.num_rows >= num_rows and old.max_len >= length:
            return
        rows = max(num_rows, old.num_rows if old else 0)
        max_len = max(length, old.max_len if old else 0)
        new = KVCache(self.num_layers, rows, self.num_kv_heads, max_len, self.head_dim, self.compute_dtype,
                      self.device)
        if old is not None:
            new.k[:, : old.num_rows, :, : old.max_len] = old.k
            new.v[:, : old.num_rows, :, : old.max_len] = old.v
        self.cache = new
        self._grow_rope(max_len)

    def release(self) -> None:
        self.cache = None
        self.rows = RowTable()

    @torch.inference_mode()
    def sync_rows(self, ids: Sequence[Hashable]) -> list[bool]:
        self.reserve(len(ids), self.cache.max_len if self.cache else 1)
        return self.rows.sync(ids, self.cache)

    # -- forward ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, start: Sequence[int], logits_index: torch.Tensor | None = None,
                all_logits: bool = False, row_offset: int = 0, num_layers: int | None = None,
                lengths: Sequence[int] | None = None) -> torch.Tensor | None:
        B, T = token_ids.shape  # [B, T]
        ragged = lengths is not None and B > 1 and min(lengths) < T
        if ragged:
            # Padding sits at one scratch position past every row's real tokens, so that a long row
            # (a merged prompt) does not push the others' padding past the context and grow the cache.
            end = max(s + n for s, n in zip(start, lengths)) + 1
        else:
            end = max(start) + T  # keys 0..end-1 are read
        self.reserve(row_offset + B, end)
        r0, r1 = row_offset, row_offset + B  # the cache rows of this batch
        cache = self.cache
        if B == 1:  # one sequence: slices, not gathers
            s = start[0]
            pos = torch.arange(s, s + T, device=self.device)[None]  # [1, T]
            cos, sin = self.cos[s : s + T, None], self.sin_signed[s : s + T, None]  # [T, 1, hd]
        else:
            pos = torch.tensor(start, device=self.device)[:, None] + torch.arange(T, device=self.device)  # [B, T]
            if ragged:
                pos = pos.clamp_(max=end - 1)
            cos, sin = self.cos[pos].unsqueeze(2), self.sin_signed[pos].unsqueeze(2)  # [B, T, 1, hd]
        masks: dict[int | None, torch.Tensor | None] = {}
        # Decoding and verifying a batch: a few queries per row. SDPA's CPU kernel is built for long
        # sequences and costs 2-2.5x more than two batched matmuls here (8 rows of 3 queries over 80
        # keys: 354 vs 144 us a layer); one sequence keeps SDPA, which is as fast for it.
        small = B > 1 and T <= FEW_QUERIES
        H, KVH, hd = self.num_heads, self.num_kv_heads, self.head_dim
        cd = self.compute_dtype

        # Ragged rows: row b holds lengths[b] real tokens, the rest of its T is padding. The per-token
        # work (embedding, norms, products, MLP) then runs on the N real tokens only, packed [N, D];
        # RoPE, the cache writes and attention stay padded [B, T] (cheap), so a pass costs what its
        # real tokens cost: a prompt merged into a round's verify pass does not pad the other rows.
        packed = None
        if ragged and sum(lengths) <= PACK_BELOW * B * T:
            valid = torch.arange(T, device=self.device)[None] < torch.tensor(lengths, device=self.device)[:, None]
            packed = valid.nonzero(as_tuple=True)  # (row [N], t [N]), row-major

        x = F.embedding(token_ids if packed is None else token_ids[packed], self.embed).to(cd)  # [B, T, D] or [N, D]
        for li, w in enumerate(self.layers[: num_layers or self.num_layers]):
            h = F.rms_norm(x, (self.hidden_size,), w.input_norm, self.eps)
            qkv = w.qkv(h)  # [B, T, (H + 2*KVH) * hd], in the weights' dtype
            if packed is not None:  # [N, ...] -> [B, T, ...], zeros at padding
                qkv = qkv.new_zeros(B, T, qkv.shape[-1]).index_put_(packed, qkv)
            qk = qkv[..., : (H + KVH) * hd].view(B, T, H + KVH, hd).to(cd)
            v = qkv[..., (H + KVH) * hd :].view(B, T, KVH, hd)
            if w.q_norm is not None:
                qk = torch.cat([F.rms_norm(qk[:, :, :H], (hd,), w.q_norm, self.eps),
                                F.rms_norm(qk[:, :, H:], (hd,), w.k_norm, self.eps)], dim=2)
            # RoPE on q and k at once: x cos + rotate_half(x) sin, with rotate_half's sign folded into sin
            qk = torch.addcmul(qk * cos, qk.roll(hd // 2, dims=-1), sin)  # [B, T, H + KVH, hd]
            q, k = qk[:, :, :H], qk[:, :, H:]
            if B == 1:
                cache.k[li, r0, :, s : s + T] = k[0].transpose(0, 1)  # [KVH, T, hd]
                cache.v[li, r0, :, s : s + T] = v[0].transpose(0, 1)
            else:
                rows = torch.arange(r0, r1, device=self.device)[:, None].expand(B, T)
                cache.k[li][rows, :, pos] = k  # [B, T, KVH, hd] into rows at their positions
                cache.v[li][rows, :, pos] = v.to(cd)
            keys = cache.k[li, r0:r1, :, :end]  # [B, KVH, end, hd]
            values = cache.v[li, r0:r1, :, :end]
            if w.sliding_window not in masks:
                masks[w.sliding_window] = _attention_mask(pos, end, w.sliding_window, additive=small)
            if small:
                attn = _few_query_attention(q.transpose(1, 2), keys, values, masks[w.sliding_window])  # [B, H, T, hd]
            else:
                attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values,
                                                      attn_mask=masks[w.sliding_window], enable_gqa=KVH != H)
            attn = attn.transpose(1, 2).reshape(B, T, H * hd)
            x = x + w.o(attn if packed is None else attn[packed])  # promotes a bf16 product to x's float32
            h = F.rms_norm(x, (self.hidden_size,), w.post_norm, self.eps)
            gate, up = w.gate_up(h).chunk(2, dim=-1)  # [B, T, I] each, in the weights' dtype
            x = x + w.down(self.act(gate) * up)

        if packed is not None and (logits_index is not None or all_logits):
            x = x.new_zeros(B, T, x.shape[-1]).index_put_(packed, x)  # [B, T, D]
        if logits_index is not None:  # [B] or [B, L]
            rows = torch.arange(B, device=self.device)
            x = x[rows if logits_index.dim() == 1 else rows[:, None], logits_index]  # [B, D] or [B, L, D]
        elif not all_logits:
            return None
        x = F.rms_norm(x, (self.hidden_size,), self.final_norm, self.eps)
        return self.lm_head(x).float()  # [B, V], [B, L, V] or [B, T, V]


def _attention_mask(pos: torch.Tensor, end: int, window: int | None, additive: bool = False) -> torch.Tensor | None:
    """Mask [B, 1, T, end]: query at position p sees keys p - window < j <= p. Boolean, or with
    ``additive`` float32 with 0 where a key is seen and -inf where not."""
    B, T = pos.shape
    if B == 1 and T == 1 and (window is None or end <= window) and not additive:
        return None  # one query at the last position sees every key
    keys = torch.arange(end, device=pos.device)
    allowed = keys[None, None, :] <= pos[:, :, None]  # [B, T, end]
    if window is not None:
        allowed &= keys[None, None, :] > pos[:, :, None] - window
    if additive:
        return torch.zeros(allowed.shape, device=pos.device).masked_fill_(~allowed, float("-inf"))[:, None]
    return allowed[:, None]


def _few_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd) + bias) v, as SDPA computes it, in two batched matmuls.

    q [B, H, T, hd]; k, v [B, KVH, end, hd] with H a multiple of KVH (grouped queries share their
    KV head: the G = H / KVH query heads of a group are stacked as G * T rows); bias [B, 1, T, end]."""
    B, H, T, hd = q.shape
    KVH, end = k.shape[1], k.shape[2]
    G = H // KVH
    scores = torch.matmul(q.reshape(B, KVH, G * T, hd), k.transpose(-1, -2))  # [B, KVH, G*T, end]
    scores = scores.view(B, KVH, G, T, end).mul_(hd ** -0.5).add_(bias[:, :, None])  # bias per row and query
    probs = torch.softmax(scores, dim=-1).view(B, KVH, G * T, end)
    return torch.matmul(probs, v).view(B, H, T, hd)
