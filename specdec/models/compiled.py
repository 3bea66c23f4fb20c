"""The torch runner's few-token step (decode, verify, tree pass) compiled by inductor.

On CPU a one-token step of a small model is dispatch-bound: eager PyTorch spends more time launching
~1,000 small ops (norms, RoPE, casts, slices, allocations) than multiplying. ``torch.compile``
(inductor) fuses them into a few C++ loops and, with its C++ wrapper, calls the linears without
Python in between (weights are not frozen: see install_linear_fallback). One graph serves chains
and trees alike, so verify passes stay flat:

    inputs:  tokens [B, T] long, pos [B, T] long (RoPE), slots [B, T] long (where k, v and kept
             states are written), rows [B] long (cache rows), mask [W, B, T, L] float (additive,
             0 = seen, -inf = not; one per distinct sliding window W), the KV cache tensors
    output:  logits [B, T, V] float32 at every fed position

Each row's T is padded to the smallest compiled size (``DEFAULT_SIZES``: 1 for decoding, 8 for verify
passes and small trees; padding tokens continue the row, write past its tokens and are seen by none).
The cache's rows and length and the attended length L (a multiple of CACHE_STEP) are traced as
dynamic dims, so no batch compiles again after load. Batches of several rows, longer feeds
(prefills) and layer subsets run eager (``CompiledStep.why_not``; the runner's ``last_path`` says
which path ran). The linears call the runner's own prepacked oneDNN weights (bf16) or ``w @ x^T``
(float32) as extern kernels; norms, RoPE, residuals, cache writes and softmax are fused C++ loops.
Inductor's FX graph and AOT autograd caches keep the compiled graphs on disk
(TORCHINDUCTOR_CACHE_DIR, by default ~/.cache/specdec/inductor/<isa key>): a second load compiles nothing.

On CUDA the same graph is compiled with mode="reduce-overhead" (CUDA graphs); not tested here.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.linear import Linear
from specdec.models.timings import cache_dir, isa_key
from specdec.tree import ancestor_mask, depths_of, tree_mask

if TYPE_CHECKING:
    from specdec.models.base import ForwardBatch, ModelRunner

log = logging.getLogger("specdec.compiled")

ENFORCE_EAGER_ENV = "SPECDEC_ENFORCE_EAGER"
DEFAULT_SIZES = (1, 8)  # fed tokens per row compiled at load: 1 (decode), up to 8 (verify k <= 7, small trees)
CACHE_STEP = 256  # the scratch cache of the warm-up compile is laid out in these steps (llama.CACHE_LEN_STEP)
ATTEND_STEP = 64  # the attended length L is a multiple of this: at most 63 masked keys more than needed
# inductor's on-disk caches (generated code, compiled graphs) live beside specdec's other caches, not in
# /tmp, so that a compile is once per machine; set before inductor first reads it. A value set stays.
# One folder per instruction set (timings.isa_key): inductor's cache key does not name the ISA limits a
# process runs under, and code generated under other limits gave NaN.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor" / isa_key()))
EAGER_HINT = "pass enforce_eager=True (CLI: --enforce-eager; environment: SPECDEC_ENFORCE_EAGER=1) to run eager"


def enforce_eager_default() -> bool:
    """Whether the environment asks for eager (SPECDEC_ENFORCE_EAGER=1): the tests' default."""
    return os.environ.get(ENFORCE_EAGER_ENV, "0") not in ("0", "")


def install_linear_fallback() -> None:
    """Let inductor call oneDNN's prepacked linear (``mkldnn._linear_pointwise``) on weights that are
    graph inputs. Its own lowering takes only weights it froze itself, as constants; but frozen
    oneDNN constants cannot be pickled, so a frozen graph never enters inductor's on-disk cache and
    every load would compile again. The runner packs its weights itself (linear.py); with this, the
    graph calls the same kernel on them as an extern call, and the graph caches. Graphs whose
    weights are frozen constants still take inductor's own lowering."""
    from torch._inductor import lowering
    from torch._inductor.virtualized import V

    op = torch.ops.mkldnn._linear_pointwise.default
    original = lowering.lowerings[op]
    if getattr(original, "specdec_fallback", False):
        return
    fallback = lowering.fallback_handler(op, add_to_fallback_set=False)

    def lower(x, w, *args, **kwargs):
        try:
            frozen = w.get_name() in V.graph.constants
        except (AttributeError, NotImplementedError):
            frozen = False
        return original(x, w, *args, **kwargs) if frozen else fallback(x, w, *args, **kwargs)

    lower.specdec_fallback = True
    lowering.lowerings[op] = lower


class StepGraph(nn.Module):
    """The runner's forward as one traceable function over explicit cache tensors (see the module
    docstring for the inputs). It holds the runner's own weights (bf16 ones already in oneDNN's
    blocked layout): no copy, and no freezing, whose MKL-packed constants inductor cannot cache."""

    def __init__(self, runner: ModelRunner, layer_windows: list[int], kept_layers: Sequence[int] = ()):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = runner.num_heads, runner.num_kv_heads, runner.head_dim
        self.hidden_size, self.eps, self.act = runner.hidden_size, runner.eps, runner.act
        self.compute_dtype = runner.compute_dtype
        self.rope_scaling = runner.rope_scaling
        self.layer_windows = layer_windows  # per layer: its mask's index in the mask's first dim
        self.kept_layers = list(kept_layers)
        self.num_layers = runner.num_layers
        self.has_qk_norm = runner.layers[0].q_norm is not None
        self.linears: dict[str, Linear] = {}
        tensors = {"embed": runner.embed, "final_norm": runner.final_norm, "inv_freq": runner.inv_freq}
        self._add_linear("lm_head", runner.lm_head, tensors)
        for i, w in enumerate(runner.layers):
            for name in ("input_norm", "post_norm", "q_norm", "k_norm"):
                if getattr(w, name) is not None:
                    tensors[f"l{i}_{name}"] = getattr(w, name)
            for name in ("qkv", "o", "gate_up", "down"):
                self._add_linear(f"l{i}_{name}", getattr(w, name), tensors)
        for name, t in tensors.items():
            self.register_buffer(name, t, persistent=False)

    def _add_linear(self, name: str, lin: Linear, tensors: dict) -> None:
        self.linears[name] = lin
        tensors[name] = lin.weight
        if lin.bias is not None:
            tensors[name + "_bias"] = lin.bias

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The runner's Linear ``name`` on x [B, T, in] -> [B, T, out] in the weight's dtype, as linear.py computes it."""
        lin = self.linears[name]
        w, b = getattr(self, name), getattr(self, name + "_bias", None)
        *lead, n = x.shape
        x2 = x.to(lin.dtype).reshape(-1, n)  # [rows, in]
        if lin.kind == "onednn":
            rows = x2.shape[0]
            if rows < lin.min_rows:  # as linear.py pads: a row's result then equals the verify pass's
                x2 = F.pad(x2, (0, 0, 0, lin.min_rows - rows))
            y = torch.ops.mkldnn._linear_pointwise(x2, w, b, "none", [], "")[:rows]
        elif lin.kind == "wxt":  # (w @ x^T)^T: F.linear's x @ w^T takes slow paths for few rows
            y = (w @ x2.t()).t()
            if b is not None:
                y = y + b
        else:
            y = F.linear(x2, w, b)
        return y.reshape(*lead, lin.out_features)

    def forward(self, tokens, pos, slots, rows, mask, k_cache, v_cache, states=None):
        B, T = tokens.shape
        H, KVH, hd = self.num_heads, self.num_kv_heads, self.head_dim
        G = H // KVH
        cd = self.compute_dtype
        L = mask.shape[-1]
        # RoPE from the positions, as the eager runner's table holds it: x cos + rotate_half(x) sin
        freqs = pos[..., None].to(torch.float32) * self.inv_freq  # [B, T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, hd]
        cos = (emb.cos() * self.rope_scaling).to(cd)[:, :, None]  # [B, T, 1, hd]
        sin = emb.sin() * self.rope_scaling
        half = hd // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).to(cd)[:, :, None]
        where = (None, rows[:, None].expand(B, T), None, slots)  # cache[li, rows[b], :, slots[b, t]]
        x = F.embedding(tokens, self.embed).to(cd)  # [B, T, D]
        kept = []
        for li in range(self.num_layers):
            if li in self.kept_layers:
                kept.append(x)
            p = f"l{li}_"
            h = F.rms_norm(x, (self.hidden_size,), getattr(self, p + "input_norm"), self.eps)
            qkv = self._linear(p + "qkv", h)  # [B, T, (H + 2 KVH) hd] in the weights' dtype
            qk = qkv[..., : (H + KVH) * hd].view(B, T, H + KVH, hd).to(cd)
            v = qkv[..., (H + KVH) * hd :].view(B, T, KVH, hd).to(cd)
            if self.has_qk_norm:
                qk = torch.cat([F.rms_norm(qk[..., :H, :], (hd,), getattr(self, p + "q_norm"), self.eps),
                                F.rms_norm(qk[..., H:, :], (hd,), getattr(self, p + "k_norm"), self.eps)], dim=-2)
            qk = qk * cos + qk.roll(half, dims=-1) * sin
            q, k = qk[..., :H, :], qk[..., H:, :]
            # one index_put_ on the whole cache: writing through a view (cache[li]) copies the layer
            at = (torch.full_like(slots, li), *where[1:])
            torch.ops.aten.index_put_(k_cache, at, k)  # [B, T, KVH, hd] at each row's slots
            torch.ops.aten.index_put_(v_cache, at, v)
            keys = k_cache[li, :, :, :L][rows]  # [B, KVH, L, hd]
            values = v_cache[li, :, :, :L][rows]
            qg = q.view(B, T, KVH, G, hd).permute(0, 2, 3, 1, 4).reshape(B, KVH, G * T, hd)
            scores = torch.matmul(qg, keys.transpose(-1, -2)).view(B, KVH, G, T, L) * hd ** -0.5
            scores = scores + mask[self.layer_windows[li]][:, None, None]  # [B, 1, 1, T, L]
            probs = torch.softmax(scores, dim=-1).view(B, KVH, G * T, L)
            attn = torch.matmul(probs, values).view(B, KVH, G, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, H * hd)
            x = x + self._linear(p + "o", attn)  # promotes a bf16 product to x's float32
            h = F.rms_norm(x, (self.hidden_size,), getattr(self, p + "post_norm"), self.eps)
            gate, up = self._linear(p + "gate_up", h).chunk(2, dim=-1)  # [B, T, I] each, in the weights' dtype
            x = x + self._linear(p + "down", self.act(gate) * up)
        if kept:
            states[rows[:, None].expand(B, T), slots] = torch.cat(kept, dim=-1).float()  # [B, T, n * D]
        x = F.rms_norm(x, (self.hidden_size,), self.final_norm, self.eps)
        return self._linear("lm_head", x).float()  # [B, T, V]


class CompiledStep:
    """The compiled forward of one runner for batches of one row and up to max(sizes) tokens: it
    compiles each size at construction (a progress line on stderr; inductor's FX graph and AOT
    autograd caches make a second load on this machine fast), and runs the batches that
    ``why_not`` accepts. Batches it refuses run eager in the runner."""

    def __init__(self, runner: ModelRunner, sizes: Sequence[int] = DEFAULT_SIZES):  # the torch runner (llama.py)
        if not sizes or any(s < 1 for s in sizes):
            raise ValueError(f"compile sizes must be positive token counts, got {list(sizes)!r}")
        self.runner = runner
        self.sizes = tuple(sorted(set(sizes)))
        long_window = runner.max_model_len
        windows = [w.sliding_window if w.sliding_window is not None and w.sliding_window < long_window else None
                   for w in runner.layers]
        self.windows = list(dict.fromkeys(windows))  # distinct windows, None (no window) included
        self.graph = StepGraph(runner, [self.windows.index(w) for w in windows], runner.kept_layers)
        self.kept_layers = list(runner.kept_layers)
        device = runner.device
        self.cuda = device.type == "cuda"
        if device.type == "cpu" and torch.backends.mkldnn.is_available():
            install_linear_fallback()
        options = {} if self.cuda else {"cpp_wrapper": True}
        self.fn = torch.compile(self.graph, backend="inductor", fullgraph=True, dynamic=False, options=options,
                                mode="reduce-overhead" if self.cuda else None)
        self.keys = torch.arange(0, dtype=torch.long, device=device)
        self.compile_seconds = self._warm()

    def _warm(self) -> float:
        """Compile every size now: each on scratch inputs whose cache rows (2) and lengths (768 cached,
        512 attended) differ from each other, so the cache's rows and length and the attended length
        are traced as dynamic dims and no later batch compiles again."""
        r = self.runner
        print(f"specdec: compiling the torch forward for T={','.join(map(str, self.sizes))} "
              f"(once per machine, cached in {os.environ['TORCHINDUCTOR_CACHE_DIR']}; {EAGER_HINT.split(' to ')[0]} "
              "to skip) ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        rows, cached, attended = 2, 3 * CACHE_STEP, 2 * CACHE_STEP
        shape = (r.num_layers, rows, r.num_kv_heads, cached, r.head_dim)
        for T in self.sizes:
            with torch.inference_mode():  # as the runner's cache is made
                k = torch.zeros(shape, dtype=r.compute_dtype, device=r.device)
                v = torch.zeros_like(k)
                states = torch.zeros(rows, cached, len(self.kept_layers) * r.hidden_size, device=r.device) \
                    if self.kept_layers else None
                tokens = torch.zeros(1, T, dtype=torch.long, device=r.device)
                pos = torch.arange(T, device=r.device)[None]
                mask = torch.zeros(len(self.windows), 1, T, attended, device=r.device)
            for t, dims in ((k, (1, 3)), (v, (1, 3)), (mask, (3,)), (states, (0, 1))):
                if t is not None:
                    torch._dynamo.mark_dynamic(t, dims)
            try:
                with torch.inference_mode():
                    self.fn(tokens, pos, pos.clone(), torch.zeros(1, dtype=torch.long, device=r.device), mask, k, v, states)
            except Exception as e:
                raise RuntimeError(f"compiling the torch forward (T={T}) failed: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}; {EAGER_HINT}") from e
        seconds = time.perf_counter() - t0
        print(f"specdec: compiled the torch forward in {seconds:.1f} s", file=sys.stderr, flush=True)
        return seconds

    def why_not(self, batch: ForwardBatch) -> str | None:
        """Why the compiled graph cannot run ``batch`` (then it runs eager), or None when it can."""
        B, T = batch.token_ids.shape
        if batch.num_layers is not None and batch.num_layers != self.runner.num_layers:
            return f"a layer subset (num_layers={batch.num_layers})"
        if B != 1:
            return f"{B} rows (compiled: one row)"
        if T > self.sizes[-1]:
            return f"{T} tokens (compiled: up to {self.sizes[-1]})"
        if self.runner.kept_layers != self.kept_layers:
            return "kept hidden states changed since the compile"
        return None

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """``batch`` through the compiled graph, padded to its size: padding tokens continue each
        row (a chain past the last token, or in a tree a chain below the last node), write past
        the row's tokens and are seen by no real token."""
        r = self.runner
        device = r.device
        B, T = batch.token_ids.shape
        Tb = next(s for s in self.sizes if s >= T)
        start = torch.tensor(batch.start, device=device)[:, None]  # [B, 1]
        offsets = torch.arange(Tb, device=device)  # [Tb]
        slots = start + offsets  # [B, Tb]
        end = max(batch.start) + Tb
        L = max(-(-end // ATTEND_STEP) * ATTEND_STEP, 2 * ATTEND_STEP)  # keys 0..L-1 attended, masked past each token
        r.reserve(batch.row_offset + B, L + 1)  # the graph was traced with the cache longer than L: keep it so
        if self.keys.shape[0] < L:
            self.keys = torch.arange(r.cache.max_len, device=device)
        keys = self.keys[:L]
        tokens = torch.zeros(B, Tb, dtype=torch.long, device=device)  # made here: an inference tensor, as traced
        tokens[:, :T] = batch.token_ids
        if batch.parents is None:
            pos = slots.clone()  # not the same tensor: the graph was traced with distinct ones
            seen = keys[None, None, :] <= pos[:, :, None]  # [B, Tb, L]
            masks = [seen if w is None else seen & (keys[None, None, :] > pos[:, :, None] - w) for w in self.windows]
        else:
            parents = [list(p) + list(range(len(p) - 1, Tb - 1)) for p in batch.parents]  # padding: a chain below
            pos = start + torch.tensor([depths_of(p) for p in parents], device=device)
            ancestors = torch.stack([ancestor_mask(p) for p in parents]).to(device)  # [B, Tb, Tb]
            masks = [tree_mask(pos, ancestors, start[:, 0], L, w, additive=False)[:, 0] for w in self.windows]
        mask = torch.zeros(len(masks), B, Tb, L, device=device).masked_fill_(~torch.stack(masks), float("-inf"))
        rows = torch.arange(batch.row_offset, batch.row_offset + B, device=device)
        with torch.inference_mode():
            logits = self.fn(tokens, pos, slots, rows, mask, r.cache.k, r.cache.v, r.cache.states)  # [B, Tb, V]
        if batch.logits_index is None:
            return None
        index = batch.logits_index
        b = torch.arange(B, device=device)
        return logits[b if index.dim() == 1 else b[:, None], index]


