"""The EAGLE-3 head inside llama.cpp, beside a llama.cpp target: llama.cpp's own ``eagle3`` model.

The head is written once to a GGUF file of architecture eagle3 (models/gguf_eagle3.py) and run by
llama.cpp's two graphs for it (src/models/eagle3.cpp), through the methods the drafter calls on
``HeadRunner`` (drafters/eagle3.py), so a round (catch up, draft, roll back) is the same code
whichever runs the head:

- ``fuse``: the encoder graph, ``llama_encode`` of the target's concatenated layer inputs [N, 3 Dt]
  -> fc's output g [N, D] (read with ``llama_get_embeddings_nextn``);
- ``step`` / ``chain_step``: the decoder graph, ``llama_decode`` of tokens each carrying its g as the
  batch's embedding row, at positions of the row's llama sequence id -> logits over the target's
  vocabulary (-inf off the draft vocabulary: d2t), read back at the draft vocabulary's ids, and the
  pre-norm output g (nextn embeddings, for the outputs asked);
- rollback: before a pass writes from position p on, the row's cells from p on are removed
  (``llama_memory_seq_rm``), a length change: a query sees its row's entries at positions <= its own,
  as in HeadRunner.

The head has no token embedding of its own: llama.cpp takes the target model's through the context the
head's context names as ``ctx_other``. That is a small context of the target model owned here, so the
target rebuilding its own (when its cache grows) never leaves the head pointing at a freed one.

What this llama.cpp build (llama-cpp-python 0.3.36) asks of a caller: the eagle3 decoder graph keeps
every token's row (no output-id selection) while the context copies out the first n_outputs, so a call
asks for all of its tokens' outputs or none (``_decode``); ``llama_batch_ext_set_embd_state`` is a stub,
so g rides as the ``embd`` row of a plain ``llama_batch`` that also carries the token ids; a batch's
positions must continue each sequence's cells (the encoder's too, though it writes none). Chains only:
a tree level's visibility (HeadRunner's ``visible``) has no llama.cpp batch form.
"""

from __future__ import annotations

import ctypes
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from specdec.models import llamacpp_ext
from specdec.models.kv_cache import CACHE_STEP
from specdec.models.llamacpp import BATCH_TOKENS, KEEP_BYTES, MAX_SEQUENCES, MIN_SEQUENCES, MIN_UBATCH

ANCHOR_CELLS = 256  # the target model's context that only names the model to the head's graphs
# Passes of at most this many tokens run on one thread (``one_thread_tokens``; 0: every pass on the
# target's threads, whose workers still spin from its pass: faster on a quiet CPU; one thread was
# steadier on a loaded one: docs/benchmarks.md, "the EAGLE-3 head inside llama.cpp")
ONE_THREAD_TOKENS = 0


def native_head(head, target):
    """The head in llama.cpp (``LlamaCppHead``) beside a llama.cpp target whose build runs the eagle3
    architecture; None where it cannot (a torch target, a build without the functions): the caller
    runs the torch head."""
    if getattr(target, "backend", None) != "llama.cpp":
        return None
    try:
        return LlamaCppHead(head, target)
    except ValueError as e:
        import logging

        logging.getLogger(__name__).warning("EAGLE-3 head: the torch head runs (%s)", e)
        return None


def describe_head(runner) -> str:
    """Which runs the head, in one line: llama.cpp's eagle3 graphs or torch."""
    if isinstance(runner, LlamaCppHead):
        return runner.describe()
    dtype = str(runner.fc.weight.dtype).removeprefix("torch.") if hasattr(runner.fc, "weight") else "?"
    kind = getattr(getattr(getattr(runner, "w", None), "lm_head", None), "kind", None)
    if kind in ("w8", "w4"):
        dtype = f"{'int8' if kind == 'w8' else 'int4'} ({dtype} fc)"
    compiled = ", one-row passes compiled" if getattr(runner, "compiled", None) is not None else ""
    return f"EAGLE-3 head in torch (HeadRunner, {dtype} products{compiled})"


class _Width:
    """What the drafter reads of the head's fc: the width of the target's concatenated states."""

    def __init__(self, in_features: int):
        self.in_features = in_features


class _EmbdBatch:
    """A llama_batch over numpy arrays of ``cap`` entries, each a token with an embedding row (the
    decoder's g) or an embedding row only (the encoder's target states: ``tokens=False``), one sequence
    id each, filled without per-token Python calls."""

    def __init__(self, lib, cap: int, width: int, tokens: bool = True):
        self.token = np.zeros(cap, dtype=np.int32)
        self.embd = np.zeros((cap, width), dtype=np.float32)
        self.pos = np.zeros(cap, dtype=np.int32)
        self.n_seq_id = np.ones(cap, dtype=np.int32)
        self.seq = np.zeros(cap, dtype=np.int32)
        self.flags = np.zeros(cap, dtype=np.int8)
        i32 = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        self.seq_ptrs = (i32 * cap)(*[ctypes.cast(base + 4 * i, i32) for i in range(cap)])  # entry i -> &seq[i]
        self.batch = lib.llama_batch()
        self.batch.token = self.token.ctypes.data_as(i32) if tokens else None
        self.batch.embd = self.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        self.batch.pos = self.pos.ctypes.data_as(i32)
        self.batch.n_seq_id = self.n_seq_id.ctypes.data_as(i32)
        self.batch.seq_id = ctypes.cast(self.seq_ptrs, ctypes.POINTER(i32))
        self.batch.logits = self.flags.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, tokens: np.ndarray | None, embd: np.ndarray, pos: np.ndarray, seq: np.ndarray,
             flags: np.ndarray):
        n = len(embd)
        if tokens is not None:
            self.token[:n] = tokens
        self.embd[:n], self.pos[:n], self.seq[:n], self.flags[:n] = embd, pos, seq, flags
        self.batch.n_tokens = n
        return self.batch


class LlamaCppHead:
    """The head's passes in llama.cpp over its own one-layer KV cache (rows: llama sequence ids, like
    the target's); its methods are HeadRunner's (drafters/eagle3.py). Chains only: a tree level's
    custom visibility has no llama.cpp batch form (the llama.cpp target verifies chains only too)."""

    def __init__(self, head, target, weight_type: str | None = None):
        """``weight_type``: the head file's matrices (f32, bf16, f16, q8_0); default the target's float
        type as HeadRunner's products (f32 beside an F32 file, else bf16)."""
        from specdec.models.gguf_eagle3 import cached_head_gguf

        self.fn = llamacpp_ext.head_functions()  # ValueError: this build cannot
        lib = target.lib
        self.lib, self.target, self.c = lib, target, head.config  # target: its model must outlive the head
        c = head.config
        self.weight_type = weight_type or ("f32" if target.info.weight_type == "F32" else "bf16")
        path = cached_head_gguf(head, self.weight_type)
        params = lib.llama_model_default_params()
        # no repacked (AMX) weight copies, as for a quantized target (llamacpp.py): ggml's AMX matmuls configure a
        # thread's tiles once, and torch's oneDNN releases them between calls on the same thread (SIGILL in
        # ggml_backend_amx_mul_mat on Xeon-AMX-FP16); a head's passes are too small for repacking to pay
        params.use_extra_bufts = False
        self.model = lib.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load the EAGLE-3 head converted to {path!r} (this build has no "
                             "eagle3 architecture?); set SPECDEC_LLAMA_LOG=1 for llama.cpp's reason")
        if self.fn["target_layer_ids_n"](self.model) != 3:
            raise ValueError(f"llama.cpp read {path!r} as a model without 3 target layers: not an EAGLE-3 head")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        if self.n_vocab != c.vocab_size:
            raise ValueError(f"the EAGLE-3 head's GGUF has {self.n_vocab} tokens, its config {c.vocab_size}")
        self.draft_ids = head.draft_to_target.cpu().numpy().astype(np.int64)  # [Vd] target id of each draft id
        self.D = c.hidden_size
        self.fc = _Width(len(c.layer_ids) * c.target_hidden_size)
        self.threads = target.threads  # for passes past one_thread_tokens
        self.one_thread_tokens = ONE_THREAD_TOKENS
        self._running = 0  # the context's thread count now
        self.anchor = self._context(target.model, ANCHOR_CELLS, 1, 1, None)
        self.ctx = None
        self.mem = None
        self.cells = 0
        self.shape = (0, 0)  # (rows, positions per row) the cells are sized for
        self.n_seq = 0
        self.kv_bytes = 2 * c.num_key_value_heads * c.head_dim * 4  # one layer, f32 keys and values
        # tokens per compute pass (an encode is one): the fewest the target's runner uses, as the
        # attention scores' scratch is cells x ubatch x heads floats
        self.ubatch = MIN_UBATCH
        self.seq_of: dict[Hashable, int] = {}  # drafter's id -> llama sequence id
        self.free = list(range(MAX_SEQUENCES - 1, -1, -1))
        self.order: list[int] = []  # llama sequence id of row 0, 1, ...
        self.rows = self  # the drafter syncs rows through runner.rows.sync(ids, cache)
        self.cache = self  # ... and copies a prompt's entries through runner.cache.copy_prefix
        self._dec = _EmbdBatch(lib, BATCH_TOKENS, self.D)
        self._enc = _EmbdBatch(lib, BATCH_TOKENS, self.fc.in_features, tokens=False)

    def __del__(self):
        lib = getattr(self, "lib", None)
        if lib is None:
            return
        if getattr(self, "ctx", None):
            lib.llama_free(self.ctx)
            self.ctx = None
        # the anchor is a context of the target's model: freed only while that model lives (a garbage
        # cycle may have finalized the target's runner first; then the small context is left)
        target = getattr(self, "target", None)
        if getattr(self, "anchor", None) and getattr(target, "model", None):
            lib.llama_free(self.anchor)
            self.anchor = None
        if getattr(self, "model", None):
            lib.llama_model_free(self.model)
            self.model = None

    def describe(self) -> str:
        small = f"1 thread for passes of up to {self.one_thread_tokens} tokens, else " if self.one_thread_tokens else ""
        return (f"EAGLE-3 head in llama.cpp (eagle3 encoder + decoder graphs): {self.weight_type} weights, f32 KV "
                f"cache, {small}{self.threads} threads")

    def set_threads(self, n: int) -> None:
        """llama.cpp threads for the head's passes (default: the target's)."""
        if n < 1:
            raise ValueError(f"threads must be at least 1, got {n}")
        self.threads = n

    # -- contexts and rows ----------------------------------------------------------------------------

    def _context(self, model, cells: int, n_seq: int, ubatch: int, other):
        lib = self.lib
        params = lib.llama_context_default_params()
        params.n_ctx = cells
        params.n_batch = BATCH_TOKENS if other is not None else ubatch
        params.n_ubatch = ubatch
        params.n_seq_max = n_seq
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = self.threads
        params.type_k = params.type_v = lib.GGML_TYPE_F32
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        params.ctx_other = other
        ctx = lib.llama_init_from_model(model, params)
        if not ctx:
            raise ValueError(f"llama.cpp could not make a context of {cells} cells for the EAGLE-3 head (out of "
                             "memory?); set SPECDEC_LLAMA_LOG=1 for llama.cpp's reason")
        return ctx

    def kv_bytes_per_token(self) -> int:
        """Bytes of one KV cell (one layer's keys and values, float32)."""
        return self.kv_bytes

    def reserve(self, num_rows: int, length: int) -> None:
        """Cells for ``num_rows`` rows of ``length`` positions: sized as HeadRunner's cache (rows x the
        longest row, in steps of CACHE_STEP positions), which the drafter's kv_use and a KV budget count."""
        if num_rows > MAX_SEQUENCES:
            raise ValueError(f"llama.cpp holds at most {MAX_SEQUENCES} sequences per context, asked for {num_rows}")
        rows = max(self.shape[0], num_rows)
        positions = max(self.shape[1], -(-length // CACHE_STEP) * CACHE_STEP)
        if self.ctx is None or rows * positions > self.cells or num_rows > self.n_seq:
            self.shape = (rows, positions)
            self._rebuild(rows * positions, num_rows)

    def _rebuild(self, cells: int, rows: int) -> None:
        """A context of ``cells`` cells for at least ``rows`` sequences; the old one's are copied over."""
        lib = self.lib
        n_seq = max(self.n_seq, MIN_SEQUENCES)
        while n_seq < rows:
            n_seq *= 2
        n_seq = min(n_seq, MAX_SEQUENCES)
        ctx = self._context(self.model, cells, n_seq, self.ubatch, self.anchor)
        self.fn["set_nextn"](ctx, True, True)  # g of the asked-for outputs (every one in an encode)
        old = self.ctx
        if old is not None:
            for s in self.seq_of.values():
                size = lib.llama_state_seq_get_size(old, s)
                buf = (ctypes.c_uint8 * size)()
                lib.llama_state_seq_get_data(old, buf, size, s)
                if lib.llama_state_seq_set_data(ctx, buf, size, s) == 0:
                    raise RuntimeError(f"llama.cpp could not move the head's sequence {s} to a larger context")
            lib.llama_free(old)
        self.ctx, self.mem, self.cells, self.n_seq = ctx, lib.llama_get_memory(ctx), lib.llama_n_ctx(ctx), n_seq
        self._running = self.threads

    def _threads_for(self, tokens: int) -> None:
        n = 1 if tokens <= self.one_thread_tokens else self.threads
        if n != self._running:
            self.lib.llama_set_n_threads(self.ctx, n, n)
            self._running = n

    def sync(self, ids: Sequence[Hashable], cache=None) -> list[bool]:
        """Rows ``ids`` in order (``RowTable.sync``'s contract): whether each one's row is new (empty)."""
        if self.ctx is None or len(ids) > self.n_seq:
            self.reserve(len(ids), 1)
        keep = set(ids)
        for i in [i for i in self.seq_of if i not in keep]:
            s = self.seq_of.pop(i)
            self.lib.llama_memory_seq_rm(self.mem, s, -1, -1)
            self.free.append(s)
        new = []
        for i in ids:
            new.append(i not in self.seq_of)
            if new[-1]:
                self.seq_of[i] = self.free.pop()
        self.order = [self.seq_of[i] for i in ids]
        return new

    def copy_prefix(self, src_row: int, dst_rows: Sequence[int], length: int) -> None:
        """Rows ``dst_rows`` hold row ``src_row``'s entries at positions < ``length`` (cells shared)."""
        src = self.order[src_row]
        for r in dst_rows:
            s = self.order[r]
            self.lib.llama_memory_seq_rm(self.mem, s, -1, -1)
            if length:
                self.lib.llama_memory_seq_cp(self.mem, src, s, 0, length)

    def release(self) -> None:
        """Forget every row; a context past KEEP_BYTES is freed (as the target's runner does)."""
        if self.ctx is not None and self.cells * self.kv_bytes <= KEEP_BYTES:
            self.lib.llama_memory_clear(self.mem, False)
        elif self.ctx is not None:
            self.lib.llama_free(self.ctx)
            self.ctx, self.mem, self.cells, self.n_seq, self.shape = None, None, 0, 0, (0, 0)
        self.seq_of.clear()
        self.order = []
        self.free = list(range(MAX_SEQUENCES - 1, -1, -1))

    # -- passes ------------------------------------------------------------------------------------------

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's layer inputs [..., 3 Dt] -> the head's hidden state [..., D] float32 (the encoder)."""
        if self.ctx is None:  # the encoder keeps nothing: any context runs it
            self.reserve(1, 1)
        lead = features.shape[:-1]
        x = np.ascontiguousarray(features.detach().float().reshape(-1, self.fc.in_features).numpy())  # [N, 3 Dt]
        out = np.empty((len(x), self.D), dtype=np.float32)
        lib, step = self.lib, min(self.ubatch, BATCH_TOKENS)  # an encode runs in one ubatch
        self._threads_for(len(x))
        for lo in range(0, len(x), step):
            hi = min(len(x), lo + step)
            n = hi - lo
            # the encoder writes no KV, but llama.cpp checks a batch's positions against sequence 0's cells
            p0 = lib.llama_memory_seq_pos_max(self.mem, 0) + 1
            batch = self._enc.fill(None, x[lo:hi], np.arange(p0, p0 + n, dtype=np.int32),
                                        np.zeros(n, dtype=np.int32), np.ones(n, dtype=np.int8))
            rc = lib.llama_encode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_encode of the EAGLE-3 head failed with code {rc}; set SPECDEC_LLAMA_LOG=1")
            out[lo:hi] = self._floats(self.fn["get_nextn"](self.ctx), n * self.D).reshape(n, self.D)
        return torch.from_numpy(out).reshape(*lead, self.D)

    def chain_step(self, ids: torch.Tensor, hidden: torch.Tensor, rows: list[int],
                   pos: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain's draft step, one token per row: ids [B], hidden [B, D] at positions ``pos`` [B] of rows
        ``rows``. Returns draft-vocabulary logits [B, Vd] and g [B, D], float32."""
        seq = np.asarray([self.order[r] for r in rows], dtype=np.int32)  # [B]
        at = np.asarray(pos, dtype=np.int32)
        for s, p in zip(seq.tolist(), at.tolist()):
            self.lib.llama_memory_seq_rm(self.mem, s, p, -1)
        logits, g = self._decode(ids.cpu().numpy().astype(np.int32), hidden.detach().float().cpu().numpy(), at, seq,
                                 np.arange(len(seq)))
        return torch.from_numpy(logits), torch.from_numpy(g)

    def step(self, ids: torch.Tensor, hidden: torch.Tensor, rows: list[int], pos: torch.Tensor,
             real: torch.Tensor | None = None, query_at: torch.Tensor | None = None,
             slots: torch.Tensor | None = None,
             visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """HeadRunner.step for chains: ids [B, T] (token p + 1 at position p), hidden [B, T, D], positions pos
        [B, T] (each row's run consecutive); ``real`` [B, T] the tokens fed (None: all); ``query_at`` [B]: only
        that query per row comes back ([B, 1, Vd], [B, 1, D]), else every one ([B, T, Vd], [B, T, D], zeros
        at padding)."""
        if slots is not None or visible is not None:
            raise ValueError("the EAGLE-3 head in llama.cpp drafts chains; draft trees need the torch head "
                             "beside a torch target (backend='torch')")
        B, T = ids.shape
        fed = np.ones((B, T), dtype=bool) if real is None else real.cpu().numpy()  # [B, T]
        P = pos.cpu().numpy().astype(np.int32)  # [B, T]
        n = fed.sum(axis=1)  # [B]
        seq = np.repeat(np.asarray([self.order[r] for r in rows], dtype=np.int32), n)  # [N]
        first = np.cumsum(n) - n  # row b's first token in the flat order
        for b, r in enumerate(rows):
            self.lib.llama_memory_seq_rm(self.mem, self.order[r], int(P[b][fed[b]][0]), -1)
        want = first + query_at.cpu().numpy() if query_at is not None else np.arange(int(n.sum()))
        logits, g = self._decode(ids.cpu().numpy()[fed].astype(np.int32), hidden.detach().float().cpu().numpy()[fed],
                                 P[fed], seq, want)  # [M, Vd], [M, D] in (b, t) order
        if query_at is not None:
            return torch.from_numpy(logits)[:, None], torch.from_numpy(g)[:, None]
        out_l = np.zeros((B, T, len(self.draft_ids)), dtype=np.float32)
        out_g = np.zeros((B, T, self.D), dtype=np.float32)
        out_l[fed], out_g[fed] = logits, g
        return torch.from_numpy(out_l), torch.from_numpy(out_g)

    def _decode(self, tokens: np.ndarray, embd: np.ndarray, pos: np.ndarray, seq: np.ndarray,
                want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Feed N (token, g) pairs in llama_decode calls of up to BATCH_TOKENS; the draft logits [M, Vd] and
        pre-norm outputs g [M, D] of tokens ``want`` [M] (ascending flat indices).

        llama.cpp's eagle3 decoder graph keeps every token's row (it selects no output ids), while the
        context copies out the first n_outputs rows: a call asks for all of its tokens' outputs or none,
        and the wanted rows are picked here."""
        lib, V, D = self.lib, self.n_vocab, self.D
        logits, gs = [], []
        self._threads_for(len(tokens))
        for lo in range(0, len(tokens), BATCH_TOKENS):
            hi = min(len(tokens), lo + BATCH_TOKENS)
            rows = want[(want >= lo) & (want < hi)] - lo  # this call's wanted tokens
            flags = np.full(hi - lo, 1 if len(rows) else 0, dtype=np.int8)
            batch = self._dec.fill(tokens[lo:hi], embd[lo:hi], pos[lo:hi], seq[lo:hi], flags)
            rc = lib.llama_decode(self.ctx, batch)
            if rc == 1:  # no room in a fragmented cache: grow it and retry once
                self._rebuild(2 * self.cells, self.n_seq)
                rc = lib.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode of the EAGLE-3 head failed with code {rc}; set SPECDEC_LLAMA_LOG=1")
            if len(rows):
                m = hi - lo
                full = self._floats(ctypes.addressof(lib.llama_get_logits(self.ctx).contents), m * V).reshape(m, V)
                logits.append(full[rows[:, None], self.draft_ids])  # [r, Vd] (a copy: the buffer is reused)
                gs.append(self._floats(self.fn["get_nextn"](self.ctx), m * D).reshape(m, D)[rows])
        if not logits:
            return np.zeros((0, len(self.draft_ids)), np.float32), np.zeros((0, D), np.float32)
        if len(logits) == 1:
            return logits[0], gs[0]
        return np.concatenate(logits), np.concatenate(gs)

    @staticmethod
    def _floats(address: int, n: int) -> np.ndarray:
        """n float32s at ``address`` (llama.cpp's output buffer, valid until its next pass), no copy."""
        return np.frombuffer((ctypes.c_float * n).from_address(address), dtype=np.float32)
