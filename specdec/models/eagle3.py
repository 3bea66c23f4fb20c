"""An EAGLE-3 draft head: one decoder layer that reads the target's own hidden states.

The target's inputs to three of its layers (a low, a middle and a high one: ``layer_ids``, the inputs
of those layers, i.e. Hugging Face's ``hidden_states[i]``) are concatenated per position, [3 * Dt], and
fused by ``fc`` into one hidden state [D] (with ``norm_before_fc``, after an RMSNorm over the [3 * Dt]
vector, ``input_norm``: the layers' inputs differ in scale by orders of magnitude). At position p the head reads the pair (hidden state of p,
embedding of token p + 1) and predicts token p + 2:

    step 0 (from the target):   h_p = fc([input_norm](f_p))     x = [norm(e(t_{p+1})), hidden_norm(h_p)]
    step j > 0 (its own):       h   = the previous step's pre-norm output g
    layer:  a = attn(x) + h;  g = mlp(norm(a)) + a;  logits = lm_head(norm(g))   (draft vocabulary)

A draft token i of the reduced draft vocabulary is target token ``i + d2t[i]``. The token embedding is
the target's (frozen, not saved); the LM head is the head's own, over ``draft_vocab_size`` tokens.

On disk the head is the SpecForge / EAGLE layout (``LlamaForCausalLMEagle3``: ``midlayer.*``, ``fc``,
``norm``, ``lm_head``, ``d2t``, ``t2d``, and ``input_norm`` when ``norm_before_fc``), which vLLM (``method: eagle3``) and llama.cpp's converter
read; the speculators layout (``layers.0.*``) loads too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.models.layers import apply_rope, attention, rope_tables

ARCHITECTURE = "LlamaForCausalLMEagle3"
SCALE_KEY = "specdec_draft_temperature_scale"  # config.json key of Eagle3Config.draft_temperature_scale
KNOWN_ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM", "Eagle3Speculator", "Eagle3DraftModel")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high layers (vLLM's and llama.cpp's default): inputs of layers
    2, N/2 and N-3, clamped into 0..N-1 (a target of fewer than 6 layers repeats some)."""
    return [min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)]


def check_q_scale(s) -> float:
    """A head's draft temperature scale (config.json's ``specdec_draft_temperature_scale``), checked."""
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
        raise ValueError(f"an EAGLE-3 head's draft temperature scale must be a positive finite number (1: q as the "
                         f"head gives it), got {s!r}: fix or remove {SCALE_KEY} in the head's "
                         "config.json, or refit it (benchmarks/drafts/eagle3/calibrate.py)")
    return float(s)


@dataclass
class Eagle3Config:
    """The head's shape and what it was made for (the target's hidden size, vocabulary and layers)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (rows of the embedding the head reads)
    draft_vocab_size: int  # rows of the head's own LM head (<= vocab_size)
    target_hidden_size: int
    layer_ids: list[int] = field(default_factory=list)  # eagle_aux_hidden_state_layer_ids
    target_num_layers: int = 0  # for validation; 0: unknown
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    norm_before_residual: bool = False  # residual = hidden_norm(h) (RedHat's variant) instead of h
    norm_before_fc: bool = False  # fc reads input_norm(features) (vLLM, speculators, llama.cpp: same key)
    draft_temperature_scale: float = 1.0  # q = softmax(z / (T s)) for sampled rows (specdec's own key; 1: none)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "vocab_size", "draft_vocab_size", "target_hidden_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"EAGLE-3 config: {name} must be a positive integer, got {v!r}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"EAGLE-3 config: draft_vocab_size {self.draft_vocab_size} exceeds vocab_size "
                             f"{self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("EAGLE-3 config: num_attention_heads must be a multiple of num_key_value_heads")
        if len(self.layer_ids) != 3:
            raise ValueError(f"EAGLE-3 config: needs 3 target layer ids, got {self.layer_ids!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"EAGLE-3 config: hidden_act {self.hidden_act!r} is not supported (silu only)")
        check_q_scale(self.draft_temperature_scale)

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int | None = None, layer_ids: list[int] | None = None,
                   intermediate_size: int | None = None) -> Eagle3Config:
        """A head shaped like one layer of ``target_config`` (a transformers config)."""
        c = target_config
        heads = c.num_attention_heads
        n = c.num_hidden_layers
        rope = getattr(c, "rope_parameters", None) or {}
        return cls(hidden_size=c.hidden_size, num_attention_heads=heads,
                   num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                   intermediate_size=intermediate_size or c.intermediate_size, vocab_size=c.vocab_size,
                   draft_vocab_size=draft_vocab_size or c.vocab_size, target_hidden_size=c.hidden_size,
                   layer_ids=list(layer_ids) if layer_ids is not None else default_layer_ids(n),
                   target_num_layers=n, rms_norm_eps=c.rms_norm_eps,
                   rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
                   max_position_embeddings=c.max_position_embeddings)

    def to_json(self) -> dict:
        """config.json in the SpecForge / EAGLE layout (what vLLM's eagle3 and llama.cpp's converter read)."""
        return {
            "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.layer_ids),
            # SGLang reads eagle_config's ids as layer OUTPUTS (it captures the input of id + 1); vLLM and
            # llama.cpp read the top-level key first, as layer inputs
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.layer_ids],
                             "use_aux_hidden_state": True},
            "specdec_target_num_layers": self.target_num_layers, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": self.hidden_act,
            "norm_before_residual": self.norm_before_residual, "norm_before_fc": self.norm_before_fc,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        } | ({SCALE_KEY: self.draft_temperature_scale} if self.draft_temperature_scale != 1.0 else {})

    @classmethod
    def from_json(cls, d: dict, where: str = "config.json") -> Eagle3Config:
        if "transformer_layer_config" in d:  # speculators' nesting
            d = {**d, **d["transformer_layer_config"]}
        arch = (d.get("architectures") or [None])[0]
        if arch not in KNOWN_ARCHITECTURES and not ("draft_vocab_size" in d and d.get("num_hidden_layers") == 1):
            raise ValueError(f"{where}: architecture {arch!r} is not an EAGLE-3 head (expected one of "
                             f"{KNOWN_ARCHITECTURES}); for a separate draft model use method 'draft_model'")
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{where}: an EAGLE-3 head has one layer, this config has {d['num_hidden_layers']}")
        ids = d.get("eagle_aux_hidden_state_layer_ids")
        if not ids and (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
            ids = [i + 1 for i in d["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]  # outputs -> inputs
        heads = d["num_attention_heads"]
        # vLLM reads eagle_config's copy first (NVIDIA's heads keep it there), then the top-level key
        norm_before_fc = (d.get("eagle_config") or {}).get("norm_before_fc", d.get("norm_before_fc", False))
        try:
            return cls(hidden_size=d["hidden_size"], num_attention_heads=heads,
                       num_key_value_heads=d.get("num_key_value_heads") or heads,
                       head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                       intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"],
                       draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
                       target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
                       layer_ids=list(ids) if ids else [], target_num_layers=d.get("specdec_target_num_layers", 0),
                       rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(d.get("rope_theta", 10000.0)),
                       max_position_embeddings=d.get("max_position_embeddings", 2048),
                       hidden_act=d.get("hidden_act", "silu"), norm_before_residual=d.get("norm_before_residual", False),
                       norm_before_fc=bool(norm_before_fc),
                       draft_temperature_scale=d.get(SCALE_KEY, 1.0))
        except KeyError as e:
            raise ValueError(f"{where}: missing key {e.args[0]!r}") from None

    def fill_layer_ids(self, target_num_layers: int) -> None:
        """A config without layer ids (some published heads) reads the default layers of its target."""
        if not self.layer_ids:
            self.layer_ids = default_layer_ids(target_num_layers)
        if not self.target_num_layers:
            self.target_num_layers = target_num_layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [norm(embedding), hidden_norm(hidden)] (2D wide), then an MLP."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.c = c
        D, H, KVH, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.input_layernorm = RMSNorm(D, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(D, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, c.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * D, H * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * D, KVH * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * D, KVH * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(H * hd, D, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(D, c.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(D, c.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(c.intermediate_size, D, bias=False)


class Eagle3Head(nn.Module):
    """The head's weights and its forward; whoever runs it keeps the KV (``step`` takes and returns it)."""

    def __init__(self, c: Eagle3Config, embed_tokens: torch.Tensor | None = None):
        super().__init__()
        self.config = c
        fc_in = len(c.layer_ids) * c.target_hidden_size
        if c.norm_before_fc:  # only then: a head without it keeps exactly its old tensors
            self.input_norm = RMSNorm(fc_in, c.rms_norm_eps)
        self.fc = nn.Linear(fc_in, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))  # draft id i -> i + d2t[i]
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))  # target ids the draft vocab has
        # the target's token embedding [V, D]: frozen, not saved (set_embedding gives it after loading)
        self.register_buffer("embed_tokens", embed_tokens if embed_tokens is not None else
                             torch.zeros(c.vocab_size, c.hidden_size), persistent=False)
        hd = c.head_dim
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2).float() / hd)), persistent=False)

    def set_embedding(self, weight: torch.Tensor) -> None:
        """Take the target's token embedding [V_rows >= vocab_size, D] (frozen)."""
        c = self.config
        if weight.shape[1] != c.hidden_size or weight.shape[0] < c.vocab_size:
            raise ValueError(f"the target's embedding is {tuple(weight.shape)}; this EAGLE-3 head needs "
                             f"[>= {c.vocab_size}, {c.hidden_size}]")
        self.embed_tokens = weight[: c.vocab_size].detach().to(self.fc.weight.dtype)

    @torch.no_grad()
    def set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        """The draft vocabulary: draft id i is target id ``draft_ids[i]`` [Vd] (d2t and t2d)."""
        self.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target token id of each draft-vocabulary id  [Vd] long."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's concatenated layer inputs [..., 3 * Dt] -> the head's hidden state [..., D]."""
        x = features.to(self.fc.weight.dtype)
        return self.fc(self.input_norm(x) if self.config.norm_before_fc else x)

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One pass of the decoder layer.

        input_ids [B, T] (token p + 1 at position p), hidden [B, T, D] (fused target state or the previous
        step's output g), positions [B, T]; past_k / past_v [B, KVH, S, hd] already rotated; mask [B, T, S + T]
        bool, True where a query may attend (None: causal over the T new positions after all S past ones).
        Returns draft-vocabulary logits [B, T, Vd] (float32), the pre-norm output g [B, T, D] (the next
        step's hidden), and this pass's k, v [B, KVH, T, hd] for the caller's cache.
        """
        c, L = self.config, self.midlayer
        B, T = input_ids.shape
        H, KVH, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        dt = self.fc.weight.dtype
        hidden = hidden.to(dt)
        emb = F.embedding(input_ids, self.embed_tokens).to(dt)  # [B, T, D]
        h_normed = L.hidden_norm(hidden)
        residual = h_normed if c.norm_before_residual else hidden
        x = torch.cat([L.input_layernorm(emb), h_normed], dim=-1)  # [B, T, 2D]

        q = L.self_attn.q_proj(x).view(B, T, H, hd).transpose(1, 2)  # [B, H, T, hd]
        k = L.self_attn.k_proj(x).view(B, T, KVH, hd).transpose(1, 2)  # [B, KVH, T, hd]
        v = L.self_attn.v_proj(x).view(B, T, KVH, hd).transpose(1, 2)
        cos, sin = rope_tables(positions.to(self.inv_freq.device), self.inv_freq, 1.0, dt)  # [B, T, hd]
        q, k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])
        keys = k if past_k is None else torch.cat([past_k.to(dt), k], dim=2)  # [B, KVH, S + T, hd]
        values = v if past_v is None else torch.cat([past_v.to(dt), v], dim=2)
        if mask is None:
            S = keys.shape[2] - T
            mask = torch.ones(T, S + T, dtype=torch.bool, device=q.device).tril(S)[None].expand(B, T, S + T)
        attn = attention(q, keys, values, mask[:, None])  # [B, H, T, hd]
        a = L.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, H * hd)) + residual  # [B, T, D]
        m = L.post_attention_layernorm(a)
        g = L.mlp.down_proj(F.silu(L.mlp.gate_proj(m)) * L.mlp.up_proj(m)) + a  # [B, T, D]: pre-norm output
        logits = self.lm_head(self.norm(g)).float()  # [B, T, Vd]
        return logits, g, k, v


# -- files ------------------------------------------------------------------------------------------


def save_head(head: Eagle3Head, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json and model.safetensors (float weights in ``dtype``; d2t int64, t2d bool)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(head.config.to_json(), indent=2) + "\n")
    tensors = {name: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).contiguous().cpu()
               for name, t in head.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def read_config(path: str | Path) -> Eagle3Config:
    p = Path(path)
    if not (p / CONFIG_FILE).is_file():
        raise ValueError(f"EAGLE-3 head folder {p.name!r} has no {CONFIG_FILE}; a head folder holds "
                         f"{CONFIG_FILE} and {WEIGHTS_FILE} (specdec distill --method eagle3 writes both)")
    return Eagle3Config.from_json(json.loads((p / CONFIG_FILE).read_text()), f"{p.name}/{CONFIG_FILE}")


def check_head_for_target(c: Eagle3Config, hidden_size: int, vocab_size: int, num_layers: int, name: str = "head") -> None:
    """ValueError naming the mismatch when the head was made for another target."""
    if c.target_hidden_size != hidden_size:
        raise ValueError(f"EAGLE-3 {name!r} reads target hidden states of size {c.target_hidden_size}, but this "
                         f"target's hidden size is {hidden_size}: the head was trained for another target")
    if c.vocab_size != vocab_size:
        raise ValueError(f"EAGLE-3 {name!r} was made for a vocabulary of {c.vocab_size} tokens, but this target's "
                         f"has {vocab_size}: the head was trained for another target")
    if c.hidden_size != hidden_size:
        raise ValueError(f"EAGLE-3 {name!r} has hidden size {c.hidden_size}, but it reads the target's token "
                         f"embedding of size {hidden_size}: the head was trained for another target")
    bad = [i for i in c.layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"EAGLE-3 {name!r} reads target layers {c.layer_ids}, but this target has {num_layers} "
                         f"layers (0..{num_layers - 1}): the head was trained for another target")
    if c.target_num_layers and c.target_num_layers != num_layers:
        raise ValueError(f"EAGLE-3 {name!r} was trained for a target with {c.target_num_layers} layers; this one "
                         f"has {num_layers}")


def load_head(path: str | Path, embed_tokens: torch.Tensor, num_layers: int, vocab_size: int | None = None,
              dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Eagle3Head:
    """Load a head folder for a target whose token embedding is ``embed_tokens`` [V_rows, D] and which has
    ``num_layers`` layers (``vocab_size``: its vocabulary, default the embedding's rows); checks the head
    was made for such a target."""
    from safetensors import safe_open

    p = Path(path)
    c = read_config(p)
    c.fill_layer_ids(num_layers)
    check_head_for_target(c, embed_tokens.shape[1], vocab_size or c.vocab_size, num_layers, p.name)
    if vocab_size is None and embed_tokens.shape[0] < c.vocab_size:
        raise ValueError(f"EAGLE-3 {p.name!r} was made for a vocabulary of {c.vocab_size} tokens, but this "
                         f"target's embedding has {embed_tokens.shape[0]} rows")
    weights = p / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"EAGLE-3 head folder {p.name!r} has no {WEIGHTS_FILE} (its weights; only safetensors "
                         "is read)")
    state = {}
    with safe_open(str(weights), framework="pt") as f:
        for name in f.keys():
            key = name.removeprefix("model.")
            if key.startswith("layers.0."):
                key = "midlayer." + key[len("layers.0."):]
            state[key] = f.get_tensor(name)
    state.pop("embed_tokens.weight", None)  # the target's own embedding is used
    head = Eagle3Head(c)
    missing = sorted(set(head.state_dict()) - set(state) - {"t2d", "d2t"})
    if missing:
        raise ValueError(f"EAGLE-3 head {p.name!r}: {WEIGHTS_FILE} lacks {missing[:4]}")
    unexpected = sorted(set(state) - set(head.state_dict()))
    if unexpected:
        raise ValueError(f"EAGLE-3 head {p.name!r}: {WEIGHTS_FILE} has tensors this head does not use: {unexpected[:4]}")
    for name, t in state.items():
        want = head.state_dict()[name].shape
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"EAGLE-3 head {p.name!r}: tensor {name} is {tuple(t.shape)}, its config implies "
                             f"{tuple(want)}")
    head.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}, strict=False)
    head = head.to(device=device, dtype=dtype)
    head.d2t = head.d2t.long()
    head.t2d = head.t2d.bool()
    head.set_embedding(embed_tokens.to(device))
    head.name = p.name  # for messages
    return head.eval().requires_grad_(False)
