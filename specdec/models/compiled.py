"""The torch runner's few-token step (decode, verify, tree pass) compiled by inductor.

On CPU a one-token step of a small model is dispatch-bound: eager PyTorch spends more time launching
~1,000 small ops (norms, RoPE, casts, slices, allocations) than multiplying. ``torch.compile``
(inductor) fuses them into a few C++ loops and, with its C++ wrapper, calls the linears without
Python in between (weights are not frozen: see install_linear_fallback). What it compiles is the
eager forward's own layer math (layers.py: ``decoder``, ``attention``, ``linear.Linear``), with k and v
scattered into the whole cache and an additive mask as its inputs. One graph serves chains and trees
alike, so verify passes stay flat:

    inputs:  tokens [B, T] long, pos [B, T] long (RoPE), slots [B, T] long (where k, v and kept
             states are written), rows [B] long (cache rows), mask [W, B, T, L] float (additive,
             0 = seen, -inf = not; one per distinct sliding window W), the KV cache tensors
    outputs: logits [B, T, V] float32 at every fed position, and their argmax [B, T] long (the
             first maximal index, as torch's: what a greedy step feeds next without leaving the graph)

Each row's T is padded to the smallest compiled size (``sizes_for``: 1 for decoding, 8 for verify passes
and small trees; 1, 3, 6, 9 with the 16-bit weight kernel, whose cost steps every 3 rows; padding
tokens continue the row, write past its tokens and are seen by none).
The cache's rows and length and the attended length L (a multiple of ATTEND_STEP) are traced as
dynamic dims, so no batch compiles again after load; on CPU the graph of a batch's size is then called
directly, not through dynamo's frame (``DirectGraphs``). Batches of several rows, longer feeds
(prefills) and layer subsets run eager (``CompiledStep.why_not``; the runner's ``last_path`` says
which path ran). The linears call the runner's own prepacked oneDNN weights (bf16) or ``w @ x^T``
(float32) as extern kernels; norms, RoPE, residuals, cache writes and softmax are fused C++ loops.
Where specdec's attention kernel runs (cache_attention.py: x86 with AVX2, a float32 cache) attention is
one extern call per layer that reads k and v in the cache, instead of a gathered copy and two matmuls.
Inductor's FX graph and AOT autograd caches keep the compiled graphs on disk
(TORCHINDUCTOR_CACHE_DIR, by default ~/.cache/specdec/inductor/<isa key>): a second load compiles nothing.

On CUDA the same graph is compiled with mode="reduce-overhead" and replayed as CUDA graphs (one per
size and attended length L): the KV cache tensors are marked as static addresses (``static_inputs``),
which is what lets inductor's CUDA graph trees keep a graph that writes them (it skips graphs that
write other inputs); a cache that grows moves, and the graphs are recorded again.
Plain greedy decoding of one row (and a draft model's greedy drafts) runs ``CompiledStep.greedy_steps``,
a loop over the one-token graph that feeds each argmax back without a ForwardBatch per step.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import nn

from specdec.models import cache_attention as attention_kernel
from specdec.models import linear16
from specdec.models.kv_cache import CACHE_STEP
from specdec.models.layers import ModelWeights, attention, attention_mask, decoder, logits, rope_tables
from specdec.models.timings import cache_dir, isa_key
from specdec.tree import ancestor_mask, depths_of, tree_mask

if TYPE_CHECKING:
    from specdec.models.base import ForwardBatch
    from specdec.models.kv_cache import KVCache

ENFORCE_EAGER_ENV = "SPECDEC_ENFORCE_EAGER"
# fed tokens per row compiled at load: 1 (decode), then up to 4, 8, 12 (verify k <= 11, small trees). oneDNN's
# bf16 product takes its rows 4 at a time (AMD Zen 5, AVX-512 bf16: 1-4 rows cost one read of the weights, 5-8
# one more; the shipped target's step 1.72 ms at T = 1, 2.04 at 4, 2.53 at 8, 2.85 at 9; padded to 8, T = 2
# cost 2.51 and T = 9 ran eager at 3.82)
DEFAULT_SIZES = (1, 4, 8, 12)
# linear16's kernel takes input rows 3 at a time: 1-3 rows cost one read of the weights, 4-6 and 7-9 one
# more tile each (AVX2, shipped target: 6.0 ms at T = 3, 8.1 at 5, 10.8 at 8; padded to 8, T = 3 cost 10.7)
W16_SIZES = (1, 3, 6, 9)
# 16 lanes wide (AVX-512) it takes up to 8 rows per pass, each row adding ~8% (EPYC-Zen5, the shipped target's
# products: 1.0 ms at 1-3 rows, 1.2 at 4, 1.4 at 6, 1.8 at 8, 2.3 at 9, 2.7 at 12)
W16_WIDE_SIZES = (1, 4, 6, 8, 12)
# bf16 dot products (w16dot) cost ~0.1 ms a row past 2 rows, the step's attention likewise (EPYC-Zen5, the shipped
# target compiled at every size: 0.90 ms at T = 1, 1.19 at 2-3, 1.29 at 4, 1.40 at 6, 1.61 at 8, 1.90 at 10,
# 2.12 at 12; padded to 4 / 8 / 12, T = 5 cost 1.58 and T = 9 2.01): a size every two rows
DOT_SIZES = (1, 2, 4, 6, 8, 10, 12)
RECOMPILE_LIMIT = 256  # graphs of the compiled step per process (torch._dynamo.config.recompile_limit): sizes x runners
STOP_READ_EVERY = 4  # CUDA greedy_steps: argmaxes read (waiting for the GPU) every this many steps
ATTEND_STEP = 64  # the attended length L is a multiple of this: at most 63 masked keys more than needed
# inductor's on-disk caches (generated code, compiled graphs) live beside specdec's other caches, not in
# /tmp, so that a compile is once per machine; set before inductor first reads it. A value set stays.
# One folder per instruction set (timings.isa_key): inductor's cache key does not name the ISA limits a
# process runs under, and code generated under other limits gave NaN.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor" / isa_key()))
_ANNOUNCED: set[str] = set()  # models whose load line this process printed (CompiledStep._warm)
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


class StepHost(Protocol):
    """What the compiled step reads from the runner that owns it (llama.LlamaRunner), and nothing else."""

    name: str  # the model's name, for the load line
    model: ModelWeights  # the weights and shape the layer math (layers.py) reads
    max_model_len: int
    kept_layers: list[int]  # layer inputs kept per position (keep_hidden_states), in their order
    cache: KVCache | None  # k, v [layers, rows, KVH, max_len, hd]; states [rows, max_len, n * D] or None

    def reserve(self, num_rows: int, length: int) -> None: ...


class StepGraph(nn.Module):
    """layers.decoder over explicit cache tensors, as one traceable function (see the module docstring
    for the inputs). It reads the runner's own weights (bf16 ones already in oneDNN's blocked layout):
    no copy, and no freezing, whose MKL-packed constants inductor cannot cache."""

    def __init__(self, model: ModelWeights, windows: list[int | None], long_window: int, kept_layers: Sequence[int] = (),
                 in_cache: bool = False):
        super().__init__()
        self.m = model
        self.in_cache = in_cache  # attention by specdec::cache_attention, reading k and v in the cache
        # a layer's window -> its mask's index in the mask's first dim (None: no window, or one longer than any row)
        self.window_index = {w.sliding_window: windows.index(w.sliding_window if w.sliding_window is not None
                                                             and w.sliding_window < long_window else None)
                             for w in model.layers}
        self.kept_layers = list(kept_layers)

    def forward(self, tokens, pos, slots, rows, mask, k_cache, v_cache, states=None):
        B, T = tokens.shape
        m = self.m
        cos, sin = rope_tables(pos, m.inv_freq, m.rope_scaling, m.dims.compute_dtype)  # [B, T, hd]
        row_of = rows[:, None].expand(B, T)  # [B, T]
        L = mask.shape[-1]

        def attend(li, q, k, v, window):
            # one index_put_ on the whole cache: writing through a view (cache[li]) copies the layer
            at = (torch.full_like(slots, li), row_of, None, slots)  # cache[li, rows[b], :, slots[b, t]]
            torch.ops.aten.index_put_(k_cache, at, k)  # [B, T, KVH, hd] at each row's slots
            torch.ops.aten.index_put_(v_cache, at, v.to(v_cache.dtype))
            bias = mask[self.window_index[window]]  # [B, T, L] additive
            if self.in_cache:
                return attention_kernel.cache_attention(q, k_cache, v_cache, li, rows, bias)  # [B, T, H, hd]
            keys, values = k_cache[li, :, :, :L][rows], v_cache[li, :, :, :L][rows]  # [B, KVH, L, hd]
            return attention(q.transpose(1, 2), keys, values, bias[:, None]).transpose(1, 2)  # [B, T, H, hd]

        x, kept = decoder(m, tokens, cos[:, :, None], sin[:, :, None], attend, len(m.layers), self.kept_layers)
        if kept:
            states[row_of, slots] = torch.cat([kept[i] for i in self.kept_layers], dim=-1).float()  # [B, T, n * D]
        out = logits(m, x)  # [B, T, V]
        return out, out.argmax(dim=-1)  # [B, T, V], [B, T]


def compile_settings(device: torch.device) -> dict:
    """torch.compile's mode or options for ``device`` (it refuses both at once): inductor's C++ wrapper
    on CPU (the linears called without Python in between), mode "reduce-overhead" on CUDA."""
    if device.type == "cuda":
        return {"mode": "reduce-overhead"}
    return {"options": {"cpp_wrapper": True}}


class DirectGraphs:
    """A torch.compile backend (inductor's ``compile_fx``) that keeps each graph it compiles with the
    plan of its inputs, so that a caller who knows which graph its inputs select (``key``: a size of one
    input) calls it without dynamo's frame: on CPU, dynamo's bytecode (gathering each weight by
    attribute from the traced object, through its wrappers) took 0.15 ms of a 0.5 ms draft step and
    0.3 ms of the shipped target's 2.7 ms one (EPYC-AVX2, docs/benchmarks.md). The plan reads each
    graph input's source: the traced function's arguments and their sizes per call, anything reached
    from ``self`` (weights, tables) once, at compile; a graph with another kind of input is called
    through dynamo as before (``call`` returns None). As with ``skip_guard_eval_unsafe``, the caller
    vouches that its inputs are like the traced ones (same dtypes, devices, static dims).

    Past dynamo's frame, a graph's call still passes AOTAutograd's runtime wrapper and inductor's
    CompiledFxGraph (~10 µs a call hot, ~25 µs right after another pass: 0.1 ms of a sampled round's
    four draft steps on Xeon-AMX-FP16). Where the graph's own callable gives exactly what the whole
    chain gives on a graph's first call (its outputs equal and aliasing no input: the cache is written
    inside the graph), later calls go to it directly (``_inner``); else through the chain."""

    def __init__(self, fn, key_input: str, key_dim: int, options: dict | None = None):
        traced = fn.forward if isinstance(fn, nn.Module) else fn  # a module's signature is its __call__'s
        self.names = list(inspect.signature(traced).parameters)  # the traced function's inputs, in order
        self.key_input, self.key_dim = self.names.index(key_input), key_dim
        self.options = dict(options or {})
        self.graphs: dict[int, tuple] = {}  # key -> (compiled, argument template, [(slot, input, dim or None)])
        self._sizes: dict[int, torch.Tensor] = {}  # size -> its 0-d tensor (``_size``)
        self._inner: dict[int, object] = {}  # key -> the graph's own callable, or False: the whole chain (``call``)

    def backend(self):
        """What torch.compile takes as its backend. Dynamo keeps its backends for the process's life: this
        one holds the graphs weakly, so that a runner dropped takes its weights (in the plans) with it."""
        ref = weakref.ref(self)

        def compile_and_plan(gm: torch.fx.GraphModule, example_inputs):
            from torch._inductor.compile_fx import compile_fx

            graphs = ref()
            compiled = compile_fx(gm, example_inputs, config_patches=graphs.options if graphs else {})
            planned = graphs._plan(gm) if graphs is not None else None
            if planned is not None:
                key, template, per_call = planned
                graphs.graphs[key] = (compiled, template, per_call)
                graphs._inner.pop(key, None)  # a graph compiled again for a key is checked again
            return compiled

        return compile_and_plan

    def _plan(self, gm: torch.fx.GraphModule):
        """(key, argument template with what is read once, [(slot, input index, dim or None)]), or None."""
        template, per_call, key = [], [], None
        for slot, node in enumerate(gm.graph.find_nodes(op="placeholder")):
            arg = node.meta.get("grapharg")
            name = arg.source.name if arg is not None and arg.source is not None else ""
            name = name() if callable(name) else name
            found = re.fullmatch(r"L\['(\w+)'\](?:\.size\(\)\[(\d+)\])?", name)
            if found and found.group(1) in self.names and found.group(1) != "self":
                i = self.names.index(found.group(1))
                per_call.append((slot, i, None if found.group(2) is None else int(found.group(2))))
                template.append(None)
                if i == self.key_input and found.group(2) is None:
                    key = node.meta["example_value"].shape[self.key_dim]
            elif name.startswith("L['self']") and not arg.pass_arg_as_tensor and arg.example is not None:
                template.append(arg.example)  # a weight or table of the traced object: the same every call
            else:
                return None
        outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
        if key is None or not isinstance(key, int) or not isinstance(outputs, (tuple, list)):
            return None
        return key, template, per_call

    def call(self, key: int, *inputs):
        """The graph of ``key`` on ``inputs`` (the traced function's arguments, in order): its outputs as a
        list, or None when no graph of that key was planned (then call through dynamo)."""
        entry = self.graphs.get(key)
        if entry is None:
            return None
        compiled, template, per_call = entry
        args = list(template)
        for slot, i, dim in per_call:
            args[slot] = inputs[i] if dim is None else self._size(inputs[i].shape[dim])
        inner = self._inner.get(key)
        if inner:
            return inner(args)  # boxed: it clears args
        out = compiled(*args)  # as dynamo calls it
        if inner is None:
            self._inner[key] = _same_inner(compiled, args, out)
        return out

    def _size(self, n: int) -> torch.Tensor:
        """A dynamic size as the 0-d tensor the graph's C++ wrapper reads it from (it would make one from
        the int each call: a tensor creation per size per pass, ~20 µs each right after a pass)."""
        t = self._sizes.get(n)
        if t is None:
            t = self._sizes[n] = torch.tensor(n)
        return t


def _same_inner(compiled, args: list, out) -> object:
    """The callable inside ``compiled`` (compile_fx's result: AOTAutograd's wrappers around inductor's
    CompiledFxGraph) if, called again on ``args``, it returns outputs equal to ``out`` that alias no
    input; else False. A second call on the same inputs rewrites the cache slots with the same keys and
    values, so the check leaves the state as it was."""
    c = compiled
    while hasattr(c, "__wrapped__"):
        c = c.__wrapped__
    inner = getattr(c, "current_callable", None)
    if inner is None or not getattr(c, "_boxed_call", False) or getattr(c, "inputs_to_check", None):
        return False
    try:
        again = inner(list(args))
    except Exception:
        return False
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    same = (isinstance(again, (list, tuple)) and len(again) == len(out)
            and all(isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                    and a.shape == b.shape and torch.equal(a, b) and a.untyped_storage().data_ptr() not in inputs
                    for a, b in zip(again, out)))
    return inner if same else False


def compile_pass(fn, key_input: str, key_dim: int, device: torch.device):
    """``fn`` compiled for ``device`` with fullgraph and static sizes but the ones marked dynamic:
    (the compiled callable, its DirectGraphs or None). On CPU the graphs are kept by DirectGraphs, keyed
    by ``key_input``'s size ``key_dim``, to be called directly; elsewhere (CUDA graphs) through dynamo."""
    if device.type != "cpu":
        return torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False, **compile_settings(device)), None
    direct = DirectGraphs(fn, key_input, key_dim, compile_settings(device)["options"])
    return torch.compile(fn, backend=direct.backend(), fullgraph=True, dynamic=False), direct


def attended_length(end: int) -> int:
    """The attended length L for tokens up to position ``end`` - 1: keys 0..L-1, masked past each token (a
    multiple of ATTEND_STEP, at least two, as traced)."""
    return max(-(-end // ATTEND_STEP) * ATTEND_STEP, 2 * ATTEND_STEP)


def static_inputs(*tensors: torch.Tensor | None) -> None:
    """Mark the graph inputs it writes in place (the KV cache, kept states) as static addresses, so that
    inductor's CUDA graph trees record the graph rather than skip it (``mark_static_address``, unguarded:
    a new address, after the cache grows, records again instead of compiling again)."""
    for t in tensors:
        if t is not None and getattr(t, "_dynamo_static_input_type", None) is None:
            torch._dynamo.mark_static_address(t)


def sizes_for(linear_kind: str, longest: int | None = None) -> tuple[int, ...]:
    """The token counts per row to compile for a runner whose products are of ``linear_kind``
    (linear.Linear.kind): the sizes at which a product's cost steps with its rows (linear16: every 3 rows,
    16 lanes wide passes of 8; its bf16 dot products every 2; oneDNN: every 4), then, up to ``longest``
    (the longest feed the engine will make, k + 1 for a chain), a size every two such steps; feeds past
    the compiled sizes run eager (EPYC-Zen5, shipped target: 16 tokens 4.34 ms eager against 3.48
    compiled, 24 tokens 5.26 against 4.40). With bf16 dot products, whose cost grows by the row, ``longest``
    is a size of its own (a full draft's pass unpadded: T = 9 1.76 ms, padded to 10 1.90)."""
    exact = linear_kind == "w16dot"
    if linear_kind == "w16":
        wide = linear16.lanes() == 16
        sizes, step = (list(W16_WIDE_SIZES), 8) if wide else (list(W16_SIZES), 6)
    elif exact:
        sizes, step = list(DOT_SIZES), 8
    else:
        sizes, step = list(DEFAULT_SIZES), 8
    if longest is None:
        return tuple(sizes)
    while sizes[-1] < longest and not (exact and sizes[-1] + step >= longest):
        sizes.append(sizes[-1] + step)
    return tuple(sorted({*sizes, longest})) if exact else tuple(sizes)


def warm_announced(what: str, warm) -> float:
    """Run ``warm()`` (it compiles, or loads compiled code from inductor's caches) and say so on stderr,
    one line per ``what`` and process: how long the compile took, or that the code came from the cache.
    Returns its seconds; a failure ends the line with "failed" and goes on up."""
    first = what not in _ANNOUNCED
    if first:  # the compile may take minutes: say so before it starts
        print(f"{what} ({EAGER_HINT.split(' to ')[0]} to skip) ...", end="", file=sys.stderr, flush=True)
    from torch._dynamo.utils import counters  # imported late: it reads TORCHINDUCTOR_CACHE_DIR, set above

    misses = counters["inductor"]["fxgraph_cache_miss"]
    t0 = time.perf_counter()
    try:
        warm()
    except Exception:
        if first:
            print(" failed", file=sys.stderr, flush=True)
        raise
    seconds = time.perf_counter() - t0
    compiled = counters["inductor"]["fxgraph_cache_miss"] > misses
    done = (f"compiled in {seconds:.0f} s (kept in {os.environ['TORCHINDUCTOR_CACHE_DIR']} for later loads)"
            if compiled else f"loaded compiled code from the cache ({seconds:.1f} s)")
    if first:
        print(f" {done}", file=sys.stderr, flush=True)
    elif compiled:  # again in this process, but it compiled (kept hidden states change the graph)
        print(f"{what}: {done}", file=sys.stderr, flush=True)
    _ANNOUNCED.add(what)
    return seconds


def chain_mask(out: np.ndarray, start: int, band: np.ndarray) -> np.ndarray:
    """out [T, L] float32 written: 0 up to each token's own position start + t, -inf past it (``band``: the
    upper triangle of T rows, ``CompiledStep._band``)."""
    out[:, : start + 1] = 0.0
    out[:, start + 1:] = band[:, : out.shape[1] - start - 1]
    return out


class ChainSteps:
    """One-token steps' inputs on a CPU graph called directly, for an attended length L: tokens, positions and
    slots [S, 1, 1] and masks [S, 1, 1, 1, L] in numpy buffers made once, and their torch views per step (made
    once too: a torch call right after a graph call costs tens of µs in cache misses). ``at`` writes a chain's
    steps in place; the views stay valid until the next ``at``."""

    def __init__(self, L: int, capacity: int):
        self.L, self.capacity = L, capacity
        self.tokens = np.zeros((capacity, 1, 1), np.int64)
        self.pos = np.zeros((capacity, 1, 1), np.int64)
        self.slots = np.zeros((capacity, 1, 1), np.int64)  # the same values as pos in another tensor, as traced
        self.mask = np.zeros((capacity, 1, 1, 1, self.L), np.float32)
        with torch.inference_mode():
            self.views = tuple(torch.from_numpy(a).unbind(0) for a in (self.tokens, self.pos, self.slots, self.mask))

    def at(self, start: int, steps: int, band: np.ndarray) -> tuple[Sequence[torch.Tensor], ...]:
        """Steps at start, start + 1, ...: step i attends keys up to start + i (``band``: an upper triangle of
        -inf with at least L - start - 1 columns, ``CompiledStep._band``). Returns the views of tokens,
        positions, slots and masks, indexed by step."""
        self.pos[:steps, 0, 0] = np.arange(start, start + steps)
        self.slots[:steps] = self.pos[:steps]
        chain_mask(self.mask[:steps].reshape(steps, self.L), start, band)  # into a view of the buffer
        return self.views


class CompiledStep:
    """The compiled forward of one runner for batches of one row and up to max(sizes) tokens: it
    compiles each size at construction (one line on stderr per model; inductor's FX graph and AOT
    autograd caches make a second load on this machine fast), and runs the batches that
    ``why_not`` accepts. Batches it refuses run eager in the runner."""

    def __init__(self, host: StepHost, sizes: Sequence[int] = DEFAULT_SIZES):
        if not sizes or any(s < 1 for s in sizes):
            raise ValueError(f"compile sizes must be positive token counts, got {list(sizes)!r}")
        self.host = host
        self.sizes = tuple(sorted(set(sizes)))
        m = host.model
        self.num_layers = len(m.layers)
        self.device = m.embed.device
        long_window = host.max_model_len
        self.windows = list(dict.fromkeys(  # distinct windows, None (no window, or longer than any row) included
            w.sliding_window if w.sliding_window is not None and w.sliding_window < long_window else None
            for w in m.layers))
        self.kept_layers = list(host.kept_layers)
        self.cuda_graphs = self.device.type == "cuda"  # mode "reduce-overhead": replayed as CUDA graphs
        self.read_every = STOP_READ_EVERY if self.device.type == "cuda" else 1  # greedy_steps' stop reads
        self._row_tensors: dict[int, torch.Tensor] = {}  # cache row -> [1] long, the graph's rows input
        self._triangles: dict[int, np.ndarray] = {}  # T -> the masks' upper triangle (_band)
        self._chain_steps: ChainSteps | None = None  # the last attended length's step inputs (_step_inputs)
        self.in_cache = attention_kernel.supports(m.dims.compute_dtype, self.device, m.dims.head_dim)
        self.graph = StepGraph(m, self.windows, long_window, self.kept_layers, self.in_cache)
        if self.device.type == "cpu" and torch.backends.mkldnn.is_available():
            install_linear_fallback()
        # dynamo counts the graphs of StepGraph.forward across the process's runners (sizes x targets,
        # drafts, kept-state variants): its default of 8 is a hard failure under fullgraph
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        if self.cuda_graphs:  # a graph per size and attended length (a multiple of ATTEND_STEP): past 8 by design,
            import torch._inductor.config as inductor_config  # so inductor's warning at 8 would only alarm

            inductor_config.triton.cudagraph_dynamic_shape_warn_limit = None
        self.fn, self.direct = compile_pass(self.graph, "tokens", 1, self.device)  # keyed by the tokens' T
        self.compile_seconds = self._warm()

    def _warm(self) -> float:
        """Compile every size now: each on scratch inputs whose cache rows (2) and lengths (768 cached,
        512 attended) differ from each other, so the cache's rows and length and the attended length
        are traced as dynamic dims and no later batch compiles again (``warm_announced``)."""
        m, device = self.host.model, self.device
        d = m.dims
        dtype = str(m.embed.dtype).removeprefix("torch.")
        what = f"specdec: the compiled torch step of {self.host.name} ({dtype} weights, T={','.join(map(str, self.sizes))})"

        def warm() -> None:
            rows, cached, attended = 2, 3 * CACHE_STEP, 2 * CACHE_STEP
            shape = (self.num_layers, rows, d.num_kv_heads, cached, d.head_dim)
            for T in self.sizes:
                with torch.inference_mode():  # as the runner's cache is made
                    k = torch.zeros(shape, dtype=d.compute_dtype, device=device)
                    v = torch.zeros_like(k)
                    states = torch.zeros(rows, cached, len(self.kept_layers) * d.hidden_size, device=device) \
                        if self.kept_layers else None
                    tokens = torch.zeros(1, T, dtype=torch.long, device=device)
                    pos = torch.arange(T, device=device)[None]
                    mask = torch.zeros(len(self.windows), 1, T, attended, device=device)
                for t, dims in ((k, (1, 3)), (v, (1, 3)), (mask, (3,)), (states, (0, 1))):
                    if t is not None:
                        torch._dynamo.mark_dynamic(t, dims)
                if self.cuda_graphs:
                    static_inputs(k, v, states)
                try:
                    with torch.inference_mode():
                        self.fn(tokens, pos, pos.clone(), torch.zeros(1, dtype=torch.long, device=device), mask, k, v,
                                states)
                except Exception as e:
                    raise RuntimeError(f"compiling the torch forward (T={T}) failed: {type(e).__name__}: "
                                       f"{str(e).splitlines()[0] if str(e) else ''}; {EAGER_HINT}") from e

        return warm_announced(what, warm)

    def why_not(self, batch: ForwardBatch) -> str | None:
        """Why the compiled graph cannot run ``batch`` (then it runs eager), or None when it can."""
        B, T = batch.token_ids.shape
        return self.why_not_shape(B, T, batch.num_layers)

    def why_not_shape(self, B: int, T: int, num_layers: int | None = None) -> str | None:
        """``why_not`` for a batch of B rows of T tokens through ``num_layers`` layers (None: all)."""
        if num_layers is not None and num_layers != self.num_layers:
            return f"a layer subset (num_layers={num_layers})"
        if B != 1:
            return f"{B} rows (compiled: one row)"
        if T > self.sizes[-1]:
            return f"{T} tokens (compiled: up to {self.sizes[-1]})"
        if self.host.kept_layers != self.kept_layers:
            return "kept hidden states changed since the compile"
        return None

    def run(self, batch: ForwardBatch, argmax: bool = False) -> torch.Tensor | list | None:
        """``batch`` (one row: ``why_not``) through the compiled graph, padded to its size: padding tokens
        continue the row (a chain past the last token, or in a tree a chain below the last node), write
        past the row's tokens and are seen by no real token. ``argmax``: the graph's argmax at the
        logits index as lists [1] or [1][L] instead of the logits [1, V] or [1, L, V]."""
        T = batch.token_ids.shape[1]
        Tb = next(s for s in self.sizes if s >= T)
        tokens = batch.token_ids  # taken as it is by a direct call (DirectGraphs) when of the graph's size
        direct = self._called_directly(Tb)
        if direct and Tb != T:  # padded in numpy: torch ops cost more in cache misses after each graph call
            padded = np.zeros((1, Tb), np.int64)
            padded[0, :T] = batch.token_ids.numpy()[0]
            tokens = torch.from_numpy(padded)
        elif not direct or tokens.dtype != torch.long or not tokens.is_contiguous():
            tokens = torch.zeros(1, Tb, dtype=torch.long, device=self.device)  # made here: an inference tensor, as traced
            tokens[:, :T] = batch.token_ids
        logits, ids = self._call(tokens, batch.start[0], batch.row_offset,
                                 None if batch.parents is None else batch.parents[0])
        if batch.logits_index is None:
            return None
        if argmax:  # as lists: no tensor op (each costs several µs of cache misses after the graph)
            index, row = batch.logits_index.tolist()[0], ids.tolist()[0]  # [] ("last") or [L]; [Tb]
            return [row[index] if isinstance(index, int) else [row[i] for i in index]]
        if not self.cuda_graphs:  # the graph's outputs are this call's own: a view of them, no copy
            where = batch.logits_index.tolist()[0]  # an int ("last") or [L] (a verify pass: consecutive)
            if isinstance(where, int):
                return logits[:, where]  # [1, V]
            if where == list(range(where[0], where[0] + len(where))):
                return logits[:, where[0]:where[0] + len(where)]  # [1, L, V]
        index = batch.logits_index[0]  # [] ("last") or [L]
        # index_select copies: on CUDA the graph's own output is overwritten by its next replay (indexing
        # with the 0-d index would return a view of it)
        out = logits.index_select(1, index.reshape(-1))  # [1, 1 or L, V]
        return out[:, 0] if index.dim() == 0 else out  # [1, V] or [1, L, V]

    def greedy_steps(self, token: int, start: int, steps: int, row: int, stop_token_ids: Sequence[int] = ()) -> list[int]:
        """ModelRunner.greedy_steps for one row on the one-token graph (``why_not_shape(1, 1)`` is None):
        feeds ``token`` at ``start``, then each argmax, without building a ForwardBatch per step: the
        positions and masks of all steps are made at once (attending up to the last step's length), and
        each step feeds the graph's own argmax. The argmaxes stay on the device; they are read (on CUDA
        a read waits for the GPU, which the loop otherwise runs ahead of) every ``read_every`` steps
        when stop tokens are given (STOP_READ_EVERY on CUDA, 1 on CPU), else once at the end. Steps past
        the first stop write cache positions the caller does not count (rollback is a length change)
        and are dropped from what is returned."""
        tokens, pos, slots, masks = self._step_inputs(start, steps, row)
        if tokens is not None:
            self._chain_steps.tokens[0] = token
            x = tokens[0]  # [1, 1]
        else:
            with torch.inference_mode():
                x = torch.tensor([[token]], dtype=torch.long, device=self.device)  # [1, 1]
        stops = set(stop_token_ids)
        out: list[torch.Tensor] = []  # [1, 1] argmaxes, the last len(out) - len(ids) not yet read
        ids: list[int] = []
        for i in range(steps):
            _, x = self._graph(x, pos[i], slots[i], row, masks[i])  # [1, 1]
            if self.cuda_graphs:
                x = x.clone()  # the graph's output buffer: the next replay writes it
            out.append(x)
            if stops and (len(out) - len(ids) >= self.read_every or i + 1 == steps):
                read = len(ids)
                ids += torch.cat(out[read:], dim=1)[0].tolist()
                first = next((j for j in range(read, len(ids)) if ids[j] in stops), None)
                if first is not None:
                    return ids[: first + 1]
        if len(ids) < len(out):
            ids += torch.cat(out[len(ids):], dim=1)[0].tolist()
        return ids

    def sampled_steps(self, token: int, start: int, steps: int, row: int, pick) -> list[int]:
        """ModelRunner.sampled_steps for one row on the one-token graph, as ``greedy_steps`` (every step's
        positions and masks made at once) but each next token chosen by ``pick(logits [1, 1, V]) -> [id]``
        (the graph's own output, valid until the next step) and fed from a buffer made once: no tensor is
        made per step."""
        tokens, pos, slots, masks = self._step_inputs(start, steps, row)
        fed = self._chain_steps.tokens if tokens is not None else np.empty((steps, 1, 1), np.int64)  # [steps, 1, 1]
        fed[0] = token
        ids: list[int] = []
        for i in range(steps):
            x = tokens[i] if tokens is not None else torch.tensor([[fed[i, 0, 0]]], device=self.device)
            logits, _ = self._graph(x, pos[i], slots[i], row, masks[i])  # [1, 1, V]
            ids.append(int(pick(logits)[0]))
            if i + 1 < steps:
                fed[i + 1] = ids[-1]
        return ids

    def _step_inputs(self, start: int, steps: int, row: int) -> tuple[Sequence[torch.Tensor], ...]:
        """One-token steps at start, start + 1, ...: each step's token (CPU graphs called directly: a view to
        write before the step; else None), positions and slots [1, 1] and mask [W, 1, 1, L] (attending up to
        the last step's length), the cache reserved for them. Without sliding windows on a CPU graph called
        directly, written in place into buffers made once per attended length (``ChainSteps``)."""
        device = self.device
        L = attended_length(start + steps)
        self.host.reserve(row + 1, L + 1)  # the graph was traced with the cache longer than L: keep it so
        if self.windows == [None] and self._called_directly(1):
            chain = self._chain_steps
            if chain is None or chain.L != L or chain.capacity < steps:
                chain = self._chain_steps = ChainSteps(L, max(steps, 16))
            return chain.at(start, steps, self._band(steps))
        with torch.inference_mode():
            pos = torch.arange(start, start + steps, device=device)  # step i at start + i
            slots = pos.clone().view(steps, 1, 1)  # [steps, 1, 1] (distinct from pos, as traced)
            each = torch.cat([attention_mask(pos[None], L, w, additive=True) for w in self.windows], dim=1)  # [1, W, steps, L]
            masks = torch.empty(steps, len(self.windows), 1, 1, L, device=device)  # strides as traced, size-1 dims too
            masks.copy_(each.permute(2, 1, 0, 3)[:, :, :, None])  # [steps, W, 1, 1, L]
        return None, pos.view(steps, 1, 1), slots, masks  # indexed by step

    def _call(self, tokens: torch.Tensor, start: int, row: int, parents: list[int] | None = None) -> torch.Tensor:
        """tokens [1, Tb] (Tb a compiled size) at positions from ``start`` (a chain; or a tree of
        ``parents``, padded here as a chain below its last node) into cache row ``row``: the graph's
        logits [1, Tb, V] and argmax [1, Tb] (on CUDA its output buffers, overwritten by the next replay)."""
        device = self.device
        Tb = tokens.shape[1]
        end = start + Tb
        L = attended_length(end)
        self.host.reserve(row + 1, L + 1)  # the graph was traced with the cache longer than L: keep it so
        if parents is None and self.windows == [None] and self._called_directly(Tb):
            pos, slots, mask = self._chain_inputs(start, Tb, L)
            return self._graph(tokens, pos, slots, row, mask)
        slots = torch.arange(start, end, device=device)[None]  # [1, Tb]
        if parents is None:
            pos = torch.arange(start, end, device=device)[None]  # not slots itself: the graph was traced with distinct ones
            if self.windows == [None]:  # -inf past each token's own position: key j > start + t
                mask = torch.full((1, 1, Tb, L), float("-inf"), device=device).triu_(start + 1)  # [W=1, 1, Tb, L]
            else:
                mask = torch.cat([attention_mask(pos, L, w, additive=True) for w in self.windows], dim=1).transpose(0, 1)
        else:
            parents = list(parents) + list(range(len(parents) - 1, Tb - 1))  # padding: a chain below
            pos = start + torch.tensor([depths_of(parents)], device=device)  # [1, Tb]
            ancestors = ancestor_mask(parents)[None].to(device)  # [1, Tb, Tb]
            first = torch.tensor([start], device=device)
            mask = torch.cat([tree_mask(pos, ancestors, first, L, w, additive=True) for w in self.windows],
                             dim=1).transpose(0, 1)  # [W, 1, Tb, L]: one per window
        return self._graph(tokens, pos, slots, row, mask)

    def _called_directly(self, Tb: int) -> bool:
        """Whether the graph of size Tb is called without dynamo (DirectGraphs planned it: CPU)."""
        return self.direct is not None and Tb in self.direct.graphs

    def _chain_inputs(self, start: int, Tb: int, L: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``_call``'s positions, slots [1, Tb] and mask [1, 1, Tb, L] for a chain on a CPU graph called directly
        (no sliding window), made in numpy: torch ops cost more in cache misses after each graph call. The
        mask is 0 up to each token's own position start + t and -inf past it: the band after column
        ``start`` is a slice of an upper triangle made once per size."""
        mask = self._chain_mask(start, Tb, L).reshape(1, 1, Tb, L)
        return (torch.from_numpy(np.arange(start, start + Tb)[None]), torch.from_numpy(np.arange(start, start + Tb)[None]),
                torch.from_numpy(mask))

    def _chain_mask(self, start: int, T: int, L: int) -> np.ndarray:
        """[T, L] float32: 0 up to each token's own position start + t, -inf past it."""
        return chain_mask(np.empty((T, L), np.float32), start, self._band(T))

    def _band(self, T: int) -> np.ndarray:
        """[T, 2 ATTEND_STEP + T] float32, -inf at column d >= t in row t (an upper triangle made once per T):
        a chain's mask past column start is its first L - start - 1 columns (L - start - 1 <= 2 ATTEND_STEP + T,
        attended_length)."""
        band = self._triangles.get(T)
        if band is None:
            band = self._triangles[T] = np.triu(np.full((T, 2 * ATTEND_STEP + T), -np.inf, np.float32))
        return band

    def _graph(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, row: int,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The graph of tokens' size [1, Tb] on these inputs (the cache reserved past the mask's length):
        logits [1, Tb, V] and their argmax [1, Tb]."""
        cache = self.host.cache
        rows = self._row_tensors.get(row)
        if rows is None:
            with torch.inference_mode():
                rows = self._row_tensors[row] = torch.tensor([row], device=self.device)
        if self.direct is not None:
            with torch.inference_mode():
                out = self.direct.call(tokens.shape[1], tokens, pos, slots, rows, mask, cache.k, cache.v, cache.states)
            if out is not None:
                return out[0], out[1]
        # as traced: tensors of their own (greedy_steps' are views into all its steps' positions and masks)
        tokens, pos, slots, mask = (t if t._base is None else t.clone(memory_format=torch.contiguous_format)
                                    for t in (tokens, pos, slots, mask))
        # dynamo checks only the guards that tell its compiled graphs apart (which runner, which size): the
        # rest hold by construction here (why_not, the padding above, the cache's traced dims), and checking
        # them all took about 0.2 ms a step (EPYC-AVX2, shipped target: 3.94 -> 3.75 ms)
        if self.cuda_graphs:
            static_inputs(cache.k, cache.v, cache.states)  # a grown cache is a new tensor
            torch.compiler.cudagraph_mark_step_begin()  # earlier replays' outputs are no longer read
        with torch.inference_mode(), torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return self.fn(tokens, pos, slots, rows, mask, cache.k, cache.v, cache.states)
