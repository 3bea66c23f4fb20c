"""The layer math of a Llama-family decoder, written once: RoPE, the q/k/v projection with qk-norm,
grouped-query attention, the MLP, the masks.

The torch runner (llama.py) calls these functions eagerly and its compiled step (compiled.py) traces
the same functions with ``torch.compile``; the EAGLE-3 head (eagle3.py) uses the RoPE and the attention.
Where k and v go and which keys a query reads differs between the two ways of running (a cache row
sliced or gathered, packed ragged rows, a whole-cache scatter in the compiled graph), so
``decoder_layer`` takes that part as ``attend``; everything else is the code below. The linears are
``linear.Linear`` (one kernel choice and one padding rule).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.models.linear import Linear

FEW_QUERIES = 16  # up to this many queries per row, batched attention uses few_query_attention


@dataclass(frozen=True)
class Dims:
    """A model's shape and the dtype its residual stream, norms, RoPE and attention run in."""

    hidden_size: int  # D
    num_heads: int  # H
    num_kv_heads: int  # KVH (H is a multiple of it)
    head_dim: int  # hd
    eps: float  # RMSNorm's
    compute_dtype: torch.dtype


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


@dataclass
class ModelWeights:
    """Everything a forward reads besides the cache: what the compiled step traces (compiled.py)."""

    dims: Dims
    embed: torch.Tensor  # [V_rows, D]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [D]
    lm_head: Linear  # D -> V
    act: Callable[[torch.Tensor], torch.Tensor]  # the MLP's activation (transformers' ACT2FN)
    inv_freq: torch.Tensor  # [hd / 2] RoPE's frequencies
    rope_scaling: float  # RoPE's attention scaling (1.0 but for yarn-like types)


# -- RoPE ----------------------------------------------------------------------------------------


def rope_tables(pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin at positions pos [...] -> [..., hd] each (``apply_rope``'s tables)."""
    freqs = pos[..., None].to(torch.float32) * inv_freq  # [..., hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., hd]
    cos = (emb.cos() * scaling).to(dtype)
    sin = emb.sin() * scaling
    half = inv_freq.shape[0]  # rotate_half(x) = cat(-x2, x1) = roll(x, half) * [-1]*half + [1]*half
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin (Llama's layout) with rotate_half's sign folded into ``sin``
    (``rope_tables``); x [..., heads, hd], cos and sin broadcastable to it."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


# -- attention -------------------------------------------------------------------------------------


def attention_mask(pos: torch.Tensor, end: int, window: int | None, additive: bool = False) -> torch.Tensor | None:
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


def few_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention: q [B, H, T, hd]; k, v [B, KVH, S, hd]; mask [B, 1, T, S] -> [B, H, T, hd].

    An additive float mask (``attention_mask(additive=True)``, for a few queries per row) takes two
    batched matmuls (``few_query_attention``: SDPA's CPU kernel is built for long sequences); a boolean
    mask or None (one query that sees every key) takes SDPA."""
    if mask is not None and mask.dtype != torch.bool:
        return few_query_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


# -- the decoder ---------------------------------------------------------------------------------

# attend(layer, q [*lead, H, hd], k [*lead, KVH, hd], v [*lead, KVH, hd], window) -> [*lead, H, hd]:
# writes k and v into the cache, then attends over the row's keys (the caller's layout)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, "int | None"], torch.Tensor]


def qkv_rope(h: torch.Tensor, w: LayerWeights, d: Dims, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The normed input h [*lead, D] -> q [*lead, H, hd], k [*lead, KVH, hd] (qk-normed when the model
    has qk-norm, rotated; compute dtype), v [*lead, KVH, hd] (the weights' dtype)."""
    lead = h.shape[:-1]
    H, KVH, hd = d.num_heads, d.num_kv_heads, d.head_dim
    qkv = w.qkv(h)  # [*lead, (H + 2*KVH) * hd], in the weights' dtype
    qk = qkv[..., : (H + KVH) * hd].view(*lead, H + KVH, hd).to(d.compute_dtype)
    v = qkv[..., (H + KVH) * hd :].view(*lead, KVH, hd)
    if w.q_norm is not None:
        qk = torch.cat([F.rms_norm(qk[..., :H, :], (hd,), w.q_norm, d.eps),
                        F.rms_norm(qk[..., H:, :], (hd,), w.k_norm, d.eps)], dim=-2)
    qk = apply_rope(qk, cos, sin)  # q and k at once: [*lead, H + KVH, hd]
    return qk[..., :H, :], qk[..., H:, :], v


def decoder_layer(x: torch.Tensor, li: int, w: LayerWeights, m: ModelWeights, cos: torch.Tensor, sin: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
    """Layer ``li`` on the residual stream x [*lead, D] (compute dtype) -> [*lead, D]; cos, sin
    broadcastable to [*lead, heads, hd]."""
    d = m.dims
    lead = x.shape[:-1]
    q, k, v = qkv_rope(F.rms_norm(x, (d.hidden_size,), w.input_norm, d.eps), w, d, cos, sin)
    attn = attend(li, q, k, v, w.sliding_window)  # [*lead, H, hd]; k, v now cached
    x = x + w.o(attn.reshape(*lead, d.num_heads * d.head_dim))  # promotes a bf16 product to x's float32
    h = F.rms_norm(x, (d.hidden_size,), w.post_norm, d.eps)
    gate, up = w.gate_up(h).chunk(2, dim=-1)  # [*lead, I] each, in the weights' dtype
    return x + w.down(m.act(gate) * up)


def decoder(m: ModelWeights, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
            num_layers: int, keep: Sequence[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The embedding and the first ``num_layers`` layers: tokens [*lead] -> the residual stream
    [*lead, D] before the final norm, and the inputs of layers ``keep`` (layer id -> [*lead, D])."""
    x = F.embedding(tokens, m.embed).to(m.dims.compute_dtype)  # [*lead, D]
    kept: dict[int, torch.Tensor] = {}  # x is rebound, never written in place
    for li in range(num_layers):
        if li in keep:
            kept[li] = x
        x = decoder_layer(x, li, m.layers[li], m, cos, sin, attend)
    return x, kept


def logits(m: ModelWeights, x: torch.Tensor) -> torch.Tensor:
    """The final norm and the LM head: x [..., D] -> float32 logits [..., V]."""
    return m.lm_head(F.rms_norm(x, (m.dims.hidden_size,), m.final_norm, m.dims.eps)).float()
