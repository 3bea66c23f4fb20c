"""A ``ModelRunner`` on llama.cpp's kernels, through llama-cpp-python's low-level bindings.

One llama context per model with one unified KV cache; each specdec sequence owns one llama
sequence id for as long as it lives (rows never move: ``sync_rows`` maps ids to sequence ids).
A forward first removes each row's positions from its ``start`` on (rollback), then feeds every
row's real tokens as one llama batch (ragged rows, no padding) and asks for logits at exactly
the positions the caller indexes. When the cache is full the context is rebuilt twice as large
and every sequence's KV is copied over.

Draft trees (``ForwardBatch.parents``) are llama.cpp's own way of branching: a token may belong to
several sequence ids, and a token attends to the cells of its first one. Each tree leaf is a
sequence id that shares the row's cached prefix (seq_cp: the same cells): the leftmost leaf is the
row's own id, each other a temporary one; a token belongs to the leaves below it (first: the
leftmost), at the position of its depth. ``compact`` gives the row the accepted path's cells (seq_cp
from a leaf below its end, over the positions where the path leaves the leftmost branch) and drops
the temporary ids. A chain needs no temporary id; a tree of N nodes at most N - 1.

For EAGLE-3 heads (``keep_hidden_states``) llama.cpp copies the inputs of the asked-for layers out of
every decode (for all tokens fed, logits or not: llamacpp_ext.py); the runner keeps them per llama
sequence id and position in one float32 array beside llama.cpp's KV, read back by ``hidden_states``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from specdec.models import llamacpp_ext
from specdec.models.base import ForwardBatch, ModelRunner, check_layer_ids
from specdec.models.gguf import GGUFInfo, read_info
from specdec.models.llamacpp_lib import load_library
from specdec.tree import depths_of

BACKEND = "llama.cpp"
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: sequence ids one context can hold
MIN_SEQUENCES = 4  # a context's first n_seq_max; it doubles as rows need (each id costs every decode a little)
BATCH_TOKENS = 512  # tokens per llama_decode call; longer feeds are split
MIN_CELLS = 1024  # KV cells of a new context
MIN_UBATCH = 64  # fewest tokens per llama.cpp compute pass (n_ubatch)
KEEP_BYTES = 64 * 2**20  # release() clears a context whose KV cache is at most this large instead of freeing it
# the dtype whose rounding a GGUF weight type resembles, for the near-tie threshold (specdec.near_tie):
# llama.cpp rounds a product's activations to the weights' type (bf16, f16) or to 8-bit blocks (q8_0, k-quants)
WEIGHT_DTYPES = {"F32": torch.float32, "F16": torch.float16}


class LlamaCppRunner(ModelRunner):
    backend = BACKEND
    can_run_layer_subsets = False  # llama.cpp runs whole models only
    can_verify_trees = True  # a tree's branches are sequence ids sharing the row's cells (module docstring)
    max_tree_sequences = MAX_SEQUENCES  # a tree round's rows and their branches share the context's ids
    casts_weights = False  # a GGUF file's weights run in their own types

    def __init__(self, path: str, tokenizer=None, max_model_len: int | None = None, vocab_size: int | None = None,
                 threads: int | None = None, info: GGUFInfo | None = None, flash_attn: bool = False,
                 enforce_eager: bool | None = None):
        """``flash_attn``: llama.cpp's flash attention, off unless asked for (benchmarks/verify_cost.py
        compares both; with it a float32 file's attention rounds to f16). ``enforce_eager``: torch code
        run beside this target (an EAGLE-3 head) stays eager; None: unless SPECDEC_ENFORCE_EAGER=1."""
        from specdec.models.compiled import enforce_eager_default

        lib = load_library()
        self.lib = lib
        self.enforce_eager = enforce_eager_default() if enforce_eager is None else bool(enforce_eager)
        self.info = info or read_info(path)
        self.path = path
        self.tokenizer = tokenizer
        self.device = torch.device("cpu")
        self.dtype = WEIGHT_DTYPES.get(self.info.weight_type, torch.bfloat16)
        params = lib.llama_model_default_params()
        if self.info.weight_type not in ("F32", "BF16", "F16"):
            # no repacked (AMX / interleaved) copies of quantized weights: on an AMX CPU llama.cpp's
            # repacked q8_0 matmuls segfault in llama_decode (tiny models; any model after an
            # in-process quantize)
            params.use_extra_bufts = False
        model = lib.llama_model_load_from_file(path.encode(), params)
        if not model:
            raise ValueError(f"llama.cpp could not load {path!r} (architecture {self.info.architecture!r}); it needs a "
                             "GGUF of an architecture this llama.cpp build knows: reconvert with `specdec convert`, "
                             "or set SPECDEC_LLAMA_LOG=1 to see llama.cpp's reason")
        self.model = model
        self.num_layers = lib.llama_model_n_layer(model)
        n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        tok_len = len(tokenizer) if tokenizer is not None else n_vocab
        self.vocab_size = min(vocab_size or tok_len, n_vocab)
        self.n_vocab = n_vocab
        limit = lib.llama_model_n_ctx_train(model)
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context length {limit}")
        self.max_model_len = max_model_len or limit
        self.threads = threads or torch.get_num_threads()
        # float32 weights compute in float32 throughout (KV cache included), so their logits match the
        # torch runner's float32 ones within 1e-5; other weights keep llama.cpp's f16 KV cache
        self.exact = self.info.weight_type == "F32"
        self.kv_type = lib.GGML_TYPE_F32 if self.exact else lib.GGML_TYPE_F16
        # Flash attention stays off: ggml's CPU kernel walks the cache once per query, so a verify pass
        # of k+1 tokens paid k+1 times the attention (docs/backends.md, "llama.cpp and GGUF"). Without it the scores
        # are one matrix product, whose scratch (cells x ubatch x heads floats) the ubatch keeps within
        # the KV cache's own size.
        self.flash_attn = flash_attn
        self.ubatch = BATCH_TOKENS if flash_attn else _ubatch(self.kv_bytes_per_token(), lib.llama_model_n_head(model))
        self.ctx = None
        self.mem = None  # the context's llama_memory_t, fetched once per context
        self.cells = 0
        self.n_seq = 0  # the context's n_seq_max: sequence ids below it (free ids are reused lowest-first)
        self.seq_of: dict[Hashable, int] = {}  # specdec id -> llama sequence id
        self.free = list(range(MAX_SEQUENCES - 1, -1, -1))
        self.cached: dict[int, int] = {}  # llama sequence id -> positions held
        self.order: list[int] = []  # llama sequence id of cache row 0, 1, ...
        self.tree_leaves: dict[int, list[int]] = {}  # row's sequence id -> the last tree pass's temporary leaf ids
        self.tree_ids: dict[int, list[list[int]]] = {}  # row's sequence id -> each fed token's sequence ids
        self._batch = _Batch(lib, BATCH_TOKENS)
        self.hidden_size = lib.llama_model_n_embd(model)
        # EAGLE-3: whether this build and this model's graph give the layer inputs (llamacpp_ext.py)
        self.can_keep_hidden_states = llamacpp_ext.supported(self.info.architecture) is None
        self.kept_layers: list[int] = []  # keep_hidden_states' layer ids, in the order they are concatenated
        self.states: np.ndarray | None = None  # [sequence ids, positions, len(kept_layers) * D] float32
        self._embedding: torch.Tensor | None = None

    def __del__(self):
        lib = getattr(self, "lib", None)
        if lib is None:
            return
        if getattr(self, "ctx", None):
            lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lib.llama_model_free(self.model)
            self.model = None

    def describe(self) -> str:
        """The compute path in one line: llama.cpp's CPU features as built, weights, KV cache, threads."""
        info = self.lib.llama_print_system_info().decode(errors="replace")
        features = [f.split("=")[0].split(":")[-1].strip() for f in info.split("|") if f.strip().endswith("= 1")]
        kv = "f32" if self.kv_type == self.lib.GGML_TYPE_F32 else "f16"
        return (f"llama.cpp ggml-cpu ({', '.join(features) or 'no SIMD features'}): {self.info.weight_type} "
                f"weights, {kv} KV cache, {self.threads} threads")

    # -- cache ------------------------------------------------------------------------------------

    def reserve(self, num_rows: int, length: int) -> None:
        if num_rows > MAX_SEQUENCES:
            raise ValueError(f"llama.cpp holds at most {MAX_SEQUENCES} sequences per context, asked for {num_rows}; "
                             "lower max_num_seqs")
        need = num_rows * length
        if self.ctx is None or need > self.cells or num_rows > self.n_seq:
            self._rebuild(self._grown(need) if need > self.cells else self.cells, num_rows)

    def release(self) -> None:
        """Forget every sequence and free the KV cache. A small cache (``KEEP_BYTES``) is only cleared:
        a new context is costly (llama.cpp reserves its compute graphs), which a server would pay at
        every request that finds it idle."""
        if self.ctx is not None and self.cells * self.kv_bytes_per_token() <= KEEP_BYTES:
            self.lib.llama_memory_clear(self.mem, False)  # the cells are marked empty; their data is overwritten
        elif self.ctx is not None:
            self.lib.llama_free(self.ctx)
            self.ctx, self.mem, self.cells, self.n_seq = None, None, 0, 0
        self.seq_of.clear()
        self.cached.clear()
        self.tree_leaves.clear()
        self.tree_ids.clear()
        self.order = []
        self.free = list(range(MAX_SEQUENCES - 1, -1, -1))
        self.states = None  # the kept hidden states go with the KV (grown again by the next forward)

    def sync_rows(self, ids: Sequence[Hashable]) -> list[bool]:
        if len(ids) > MAX_SEQUENCES:
            raise ValueError(f"llama.cpp holds at most {MAX_SEQUENCES} sequences per context, got {len(ids)}; "
                             "lower max_num_seqs")
        if self.ctx is None or len(ids) > self.n_seq:
            self.reserve(len(ids), 1)
        keep = set(ids)
        for i in [i for i in self.seq_of if i not in keep]:
            s = self.seq_of.pop(i)
            self.lib.llama_memory_seq_rm(self.mem, s, -1, -1)
            self.cached.pop(s, None)
            self.free.append(s)
        new = []
        for i in ids:
            new.append(i not in self.seq_of)
            if new[-1]:
                s = self.free.pop()
                self.seq_of[i] = s
                self.cached[s] = 0
        self.order = [self.seq_of[i] for i in ids]
        return new

    def copy_prefix(self, src_row: int, dst_rows: Sequence[int], length: int) -> None:
        """llama.cpp's seq_cp: in the unified cache the destinations share the source's cells."""
        mem = self.mem
        src = self.order[src_row]
        if self.cached[src] < length:
            raise RuntimeError(f"row {src_row} holds {self.cached[src]} positions, fewer than the {length} to copy")
        for r in dst_rows:
            s = self.order[r]
            self.lib.llama_memory_seq_rm(mem, s, -1, -1)
            if length:
                self.lib.llama_memory_seq_cp(mem, src, s, 0, length)
                if self.states is not None:
                    states = self._states_for(s + 1, length)
                    states[s, :length] = states[src, :length]
            self.cached[s] = length

    def kv_bytes_per_token(self) -> int:
        per = 4 if self.kv_type == self.lib.GGML_TYPE_F32 else 2
        return self.num_layers * 2 * self.info.kv_width * per

    def _rebuild(self, cells: int, rows: int = 0) -> None:
        """A context of ``cells`` KV cells for at least ``rows`` sequences; the sequences of the old one
        are copied over."""
        lib = self.lib
        cells = self.round_cache_len(cells)
        n_seq = max(self.n_seq, MIN_SEQUENCES)
        while n_seq < rows:
            n_seq *= 2
        n_seq = min(n_seq, MAX_SEQUENCES)
        params = lib.llama_context_default_params()
        params.n_ctx = cells
        params.n_batch = BATCH_TOKENS
        params.n_ubatch = self.ubatch
        params.n_seq_max = n_seq
        params.kv_unified = True  # one batch of ragged rows is one graph; per-sequence streams would split it
        params.n_threads = params.n_threads_batch = self.threads
        params.type_k = params.type_v = self.kv_type
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        ctx = lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise ValueError(f"llama.cpp could not make a context of {cells} KV cells for {self.path!r} "
                             "(out of memory?); lower max_num_seqs or max_model_len")
        old = self.ctx
        if old is not None:
            for s, n in self.cached.items():
                if n == 0:
                    continue
                size = lib.llama_state_seq_get_size(old, s)
                buf = (ctypes.c_uint8 * size)()
                lib.llama_state_seq_get_data(old, buf, size, s)
                if lib.llama_state_seq_set_data(ctx, buf, size, s) == 0:
                    raise RuntimeError(f"llama.cpp could not move sequence {s} to a larger context")
            lib.llama_free(old)
        self.ctx, self.mem, self.cells, self.n_seq = ctx, lib.llama_get_memory(ctx), cells, n_seq
        if self.kept_layers:
            self._switch_layer_inputs(set(), set(self.kept_layers))

    # -- kept hidden states (EAGLE-3) -------------------------------------------------------------

    def keep_hidden_states(self, layer_ids: Sequence[int]) -> None:
        """From now on every decode also copies the inputs of layers ``layer_ids`` (llama.cpp's
        ``llama_set_embeddings_layer_inp``: Hugging Face's hidden_states[i]) of every token fed into
        ``self.states`` [sequence id, position, n * D]. Positions cached before this call read as zeros."""
        why = llamacpp_ext.supported(self.info.architecture)
        if why:
            raise ValueError(why)
        ids = check_layer_ids(layer_ids, self.num_layers)
        if ids == self.kept_layers:
            return
        if self.ctx is not None:
            self._switch_layer_inputs(set(self.kept_layers), set(ids))
        self.kept_layers = ids
        self.states = None

    def hidden_states(self, row: int, start: int, end: int) -> torch.Tensor:
        """The kept layer inputs of cache row ``row`` at positions start..end-1  [end - start, n * D]
        float32: a view into the runner's array, valid until the next forward or cache change."""
        if not self.kept_layers:
            raise ValueError("hidden_states: call keep_hidden_states(layer_ids) first")
        s = self.order[row] if 0 <= row < len(self.order) else None
        if s is None or self.states is None or end > self.cached[s] or s >= self.states.shape[0]:
            raise ValueError(f"hidden_states: positions {start}..{end - 1} of row {row} are not cached")
        return torch.from_numpy(self.states[s, start:end])

    def token_embedding(self) -> torch.Tensor:
        """The model's token embedding [n_vocab, D] float32, dequantized by llama.cpp
        (``llama_model_get_tok_embd``), read once."""
        if self._embedding is None:
            get = llamacpp_ext.functions()["get_tok_embd"]
            n = get(self.model, None)  # elements
            if n == 0 or n % self.hidden_size:
                raise ValueError(f"llama.cpp gives no token embedding for {self.path!r}; use backend='torch'")
            out = np.empty(n, dtype=np.float32)
            get(self.model, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
            self._embedding = torch.from_numpy(out.reshape(-1, self.hidden_size))
        return self._embedding

    def _switch_layer_inputs(self, off: set[int], on: set[int]) -> None:
        """Tell the context which layers' inputs to copy out of each decode."""
        set_inp = llamacpp_ext.functions()["set_layer_inp"]
        for lid in sorted(off - on):
            set_inp(self.ctx, lid, False)
        for lid in sorted(on):
            set_inp(self.ctx, lid, True)

    def _states_for(self, num_seqs: int, length: int) -> np.ndarray:
        """``self.states`` with room for sequence ids below ``num_seqs`` and ``length`` positions (grown,
        keeping what it holds)."""
        old = self.states
        if old is not None and old.shape[0] >= num_seqs and old.shape[1] >= length:
            return old
        old_rows, old_len = old.shape[:2] if old is not None else (0, 0)
        if self.max_cache_positions is None:  # a long prompt grows it once; decoding doubles it now and then
            rows = max(num_seqs, self.n_seq, old_rows)
            cap = old_len if length <= old_len else max(self.round_cache_len(length), 2 * old_len)
        else:  # under a KV budget: the sequence ids in use (freed ids are reused first) at their length
            rows = max(num_seqs, old_rows)
            cap = max(self.round_cache_len(length), old_len)
        new = np.zeros((rows, cap, len(self.kept_layers) * self.hidden_size), dtype=np.float32)
        if old is not None:
            new[:old_rows, :old_len] = old
        self.states = new
        return new

    def _keep_states(self, n: int, seq: np.ndarray, pos: np.ndarray) -> None:
        """After a decode of n tokens (sequence ids seq [n], positions pos [n]): copy the kept layers'
        inputs out of llama.cpp's buffer (batch order, [n, D] per layer) into self.states."""
        get = llamacpp_ext.functions()["get_layer_inp"]
        D = self.hidden_size
        rows = ctypes.c_float * (n * D)  # ctypes caches the type; from_address wraps without a copy
        if n == 1:  # a plain step: plain indexing with Python ints (a gather costs more than the copy)
            s, p = int(seq[0]), int(pos[0])
            states = self._states_for(s + 1, p + 1)
            for i, lid in enumerate(self.kept_layers):
                states[s, p, i * D : (i + 1) * D] = np.frombuffer(rows.from_address(get(self.ctx, lid)), np.float32)
            return
        p0 = int(pos[0])
        if seq[0] == seq[n - 1] and pos[n - 1] - p0 == n - 1 and (seq == seq[0]).all() and (np.diff(pos) == 1).all():
            # one row's consecutive positions (a verify pass, a prompt's chunk): a slice, no gather
            s = int(seq[0])
            states = self._states_for(s + 1, p0 + n)
            for i, lid in enumerate(self.kept_layers):
                x = np.frombuffer(rows.from_address(get(self.ctx, lid)), np.float32)  # [n * D], until the next decode
                states[s, p0 : p0 + n, i * D : (i + 1) * D] = x.reshape(n, D)
            return
        states = self._states_for(int(seq.max()) + 1, int(pos.max()) + 1)
        for i, lid in enumerate(self.kept_layers):
            x = np.frombuffer(rows.from_address(get(self.ctx, lid)), np.float32)  # [n * D], until the next decode
            states[seq, pos, i * D : (i + 1) * D] = x.reshape(n, D)

    # -- forward ----------------------------------------------------------------------------------

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        if batch.num_layers is not None:
            raise ValueError("the llama.cpp backend runs whole models only (num_layers is unsupported); "
                             "use backend='torch' for layer_skip")
        B, T = batch.token_ids.shape
        rows = self.order[batch.row_offset : batch.row_offset + B]
        if len(rows) != B:
            raise RuntimeError(f"forward over rows {batch.row_offset}..{batch.row_offset + B - 1} but sync_rows "
                               f"placed {len(self.order)}")
        lengths = np.asarray(batch.lengths, dtype=np.int64)  # [B]
        start = np.asarray(batch.start, dtype=np.int64)  # [B]
        end = start + lengths
        if int(end.max(initial=0)) > self.max_model_len:
            raise ValueError(f"a row reaches position {int(end.max())}, past max_model_len={self.max_model_len}")
        self._roll_back(rows, start, batch.row_offset)
        if batch.parents is not None:
            return self._tree_forward(batch, rows, start, lengths)

        index = batch.logits_index
        if index is not None and bool((lengths == T).all()):
            idx = index.cpu().numpy()
            if T == 1 if idx.ndim == 1 else idx.shape[1] == T and (idx == np.arange(T)).all():
                # every row feeds T tokens and wants the logits of each (a verify pass without a prompt,
                # a plain or draft step): the arrays are flat in row order, with no mask to build
                for b, s in enumerate(rows):
                    self.cached[s] = int(end[b])
                pos = (start[:, None] + np.arange(T)).reshape(-1)  # [B*T]
                logits = self._decode(batch.token_ids.cpu().numpy().reshape(-1), pos,
                                      np.repeat(np.asarray(rows, dtype=np.int32), T), np.ones(B * T, dtype=np.int8))
                out = torch.from_numpy(logits.reshape(B, T, self.vocab_size))  # [B, T, V]
                return out[:, 0] if idx.ndim == 1 else out

        # the real tokens, row-major: (row b, column t) for t < lengths[b]
        real = np.arange(T)[None, :] < lengths[:, None]  # [B, T]
        tokens = batch.token_ids.cpu().numpy()[real]  # [N]
        pos = (start[:, None] + np.arange(T)[None, :])[real]  # [N]
        seq = np.broadcast_to(np.asarray(rows, dtype=np.int32)[:, None], (B, T))[real]  # [N]
        out_rows = None
        if index is not None:
            idx = index.cpu().numpy()
            idx2 = idx[:, None] if idx.ndim == 1 else idx  # [B, L]
            valid = idx2 < lengths[:, None]  # asked-for positions past a row's tokens come back as zeros
            flat = np.cumsum(lengths) - lengths  # row b's first token in the flat order
            want = (flat[:, None] + idx2)[valid]  # [M] flat token indices whose logits come back
            flags = np.zeros(len(tokens), dtype=np.int8)
            flags[want] = 1
            # llama.cpp returns outputs in batch order; slot of each asked-for (b, j)
            slot = np.cumsum(flags) - 1
            out_rows = (valid, slot[want])
        else:
            flags = np.zeros(len(tokens), dtype=np.int8)
        for b, s in enumerate(rows):
            self.cached[s] = int(end[b])
        logits = self._decode(tokens, pos, seq, flags)  # [n_outputs, V]
        if out_rows is None:
            return None
        valid, slots = out_rows
        if valid.all() and np.array_equal(slots, np.arange(len(slots))):  # the outputs are already in (b, j) order
            out = logits.reshape(*valid.shape, self.vocab_size)  # [B, L, V]
        else:  # positions past a row's tokens, or an index out of order: scatter
            out = np.zeros((*valid.shape, self.vocab_size), dtype=np.float32)  # [B, L, V]
            out[valid] = logits[slots]
        out = torch.from_numpy(out)
        return out[:, 0] if index.dim() == 1 else out

    def _tree_forward(self, batch: ForwardBatch, rows: list[int], start: np.ndarray,
                      lengths: np.ndarray) -> torch.Tensor | None:
        """``forward`` of a tree pass (module docstring): row b's fed token t at position start[b] +
        depth(t), in the sequences of the leaves below it (and the row's own id where every leaf is)."""
        B, T = batch.token_ids.shape
        token_ids = batch.token_ids.cpu().numpy()
        plans = [_tree_plan(batch.parents[b][: int(lengths[b])]) for b in range(B)]  # [B] (depths, leaves)
        n_temp = sum(max(len(leaf_nodes) - 1, 0) for _, leaf_nodes in plans)
        if len(self.order) + n_temp > MAX_SEQUENCES:
            raise ValueError(f"a tree pass over {B} rows needs {n_temp} branch sequence ids beside the rows' "
                             f"{len(self.order)}; llama.cpp holds {MAX_SEQUENCES}: lower max_num_seqs or "
                             "draft_tree_max_nodes")
        if len(self.order) + n_temp > self.n_seq:
            self._rebuild(self.cells, len(self.order) + n_temp)
        tokens, pos, seq_ids, flags = [], [], [], []
        index = batch.logits_index
        idx = None if index is None else index.cpu().numpy()
        idx = idx[:, None] if idx is not None and idx.ndim == 1 else idx  # [B, L]
        for b, (s, (depth, leaf_nodes)) in enumerate(zip(rows, plans)):
            leaf_seq = {node: (s if i == 0 else self.free.pop()) for i, node in enumerate(leaf_nodes)}
            self.tree_leaves[s] = [q for q in leaf_seq.values() if q != s]
            under = _leaves_under(batch.parents[b][: int(lengths[b])], leaf_nodes)  # [n] leaves below each token
            ids = [[leaf_seq[node] for node in under[t]] for t in range(int(lengths[b]))]
            for t in range(int(lengths[b])):
                tokens.append(int(token_ids[b, t]))
                pos.append(int(start[b]) + depth[t])
                seq_ids.append(ids[t])
                flags.append(1 if idx is not None and t in idx[b] else 0)
            self.tree_ids[s] = ids
            self.cached[s] = int(start[b]) + sum(1 for x in ids if x[0] == s)  # the leftmost branch is the row's
        logits = self._decode_tree(rows, start, np.asarray(tokens, dtype=np.int32), np.asarray(pos, dtype=np.int32),
                                   seq_ids, np.asarray(flags, dtype=np.int8))
        if idx is None:
            return None
        out = np.zeros((B, idx.shape[1], self.vocab_size), dtype=np.float32)  # [B, L, V]; past a row's tokens: 0
        flat = np.cumsum(lengths) - lengths  # row b's first token in the flat order
        slot = np.cumsum(flags) - 1  # each flagged token's row in ``logits``
        for b in range(B):
            for j, t in enumerate(idx[b]):
                if t < lengths[b]:
                    out[b, j] = logits[slot[flat[b] + t]]
        out = torch.from_numpy(out)
        return out[:, 0] if index.dim() == 1 else out

    def _decode_tree(self, rows: list[int], start: np.ndarray, tokens: np.ndarray, pos: np.ndarray,
                     seq_ids: list[list[int]], flags: np.ndarray) -> np.ndarray:
        """Give each branch the row's cached prefix, then decode the tree tokens (several sequence ids
        each); a full cache is grown and the prefixes given again. Returns the flagged tokens' logits."""
        lib = self.lib
        extra = len(tokens)
        for attempt in range(2):
            need = sum(self.cached.values()) + extra
            if need > self.cells:
                self._rebuild(self._grown(need))
            for b, s in enumerate(rows):
                for leaf in self.tree_leaves[s]:
                    lib.llama_memory_seq_rm(self.mem, leaf, -1, -1)
                    if start[b] > 0:
                        lib.llama_memory_seq_cp(self.mem, s, leaf, 0, int(start[b]))
            parts, rc = [], 0
            for lo in range(0, len(tokens), BATCH_TOKENS):
                hi = min(len(tokens), lo + BATCH_TOKENS)
                batch = _MultiSeqBatch(lib, tokens[lo:hi], pos[lo:hi], seq_ids[lo:hi], flags[lo:hi])
                rc = lib.llama_decode(self.ctx, batch.batch)
                if rc != 0:
                    break
                self._decoded(np.asarray([ids[0] for ids in seq_ids[lo:hi]], dtype=np.int32), pos[lo:hi],
                              flags[lo:hi], parts)
            if rc == 0:
                break
            if rc != 1 or attempt:
                raise RuntimeError(f"llama_decode failed with code {rc} on a tree pass; set SPECDEC_LLAMA_LOG=1 for "
                                   "llama.cpp's reason")
            for b, s in enumerate(rows):  # no room in a fragmented cache: drop what this pass wrote, grow
                lib.llama_memory_seq_rm(self.mem, s, int(start[b]), -1)
            self._rebuild(2 * self.cells)
        return self._joined(parts)

    def compact(self, rows: Sequence[int], start: Sequence[int], keep: Sequence[Sequence[int]]) -> None:
        """After a tree pass: row ``rows[i]`` keeps its fed tokens ``keep[i]`` (a path from the first, in
        order) at positions start[i] .. start[i] + len(keep[i]) - 1, where their depths put them."""
        lib = self.lib
        for r, p0, kept in zip(rows, start, keep):
            s = self.order[r]
            ids = self.tree_ids.get(s)
            if ids is None or not kept:
                continue
            shared = 0  # the path's leading tokens on the leftmost branch: already the row's
            while shared < len(kept) and ids[kept[shared]][0] == s:
                shared += 1
            p0, end = int(p0), int(p0) + len(kept)
            lib.llama_memory_seq_rm(self.mem, s, p0 + shared, -1)  # the leftmost branch past the path
            if shared < len(kept):
                branch = ids[kept[-1]][0]  # a leaf below the path's end: its cells there are the path's
                lib.llama_memory_seq_cp(self.mem, branch, s, p0 + shared, end)
                if self.states is not None:
                    states = self._states_for(max(s, branch) + 1, end)
                    states[s, p0 + shared : end] = states[branch, p0 + shared : end]
            self.cached[s] = end
        self._drop_tree_ids()

    def _drop_tree_ids(self) -> None:
        """Free the last tree pass's branch sequence ids (their cells go unless a row holds them)."""
        for leaves in self.tree_leaves.values():
            for leaf in leaves:
                self.lib.llama_memory_seq_rm(self.mem, leaf, -1, -1)
                self.free.append(leaf)
        self.tree_leaves.clear()
        self.tree_ids.clear()

    def greedy_steps(self, token_ids: Sequence[int], start: Sequence[int], steps: int, row_offset: int = 0,
                     stop_token_ids: Sequence[int] = ()) -> list[list[int]]:
        """The base contract in a lean loop (``_steps``): the argmax read straight from llama.cpp's logits
        buffer (what a plain step costs in Python: docs/benchmarks.md, "Verify cost curves")."""
        return self._steps(token_ids, start, steps, row_offset, lambda logits: logits.argmax(axis=1), stop_token_ids)

    def sampled_steps(self, token_ids: Sequence[int], start: Sequence[int], steps: int, pick,
                      row_offset: int = 0) -> list[list[int]]:
        """The base contract in ``greedy_steps``' lean loop: ``pick`` reads llama.cpp's logits buffer itself."""
        return self._steps(token_ids, start, steps, row_offset, lambda logits: pick(torch.from_numpy(logits)))

    def _steps(self, token_ids: Sequence[int], start: Sequence[int], steps: int, row_offset: int, choose,
               stop_token_ids: Sequence[int] = ()) -> list[list[int]]:
        """Up to ``steps`` one-token steps per row, one llama batch of B tokens refilled in place each step with
        ``choose(logits [B, V] float32, a view of llama.cpp's buffer)``'s tokens; stops once every row has
        chosen one of ``stop_token_ids``. Returns the chosen tokens [B, n]."""
        B = len(token_ids)
        rows = self.order[row_offset : row_offset + B]
        if len(rows) != B:
            raise RuntimeError(f"steps over rows {row_offset}..{row_offset + B - 1} but sync_rows "
                               f"placed {len(self.order)}")
        if steps < 1 or max(start) + steps > self.max_model_len:
            raise ValueError(f"{steps} steps from position {max(start)} do not fit max_model_len="
                             f"{self.max_model_len}")
        self._roll_back(rows, start, row_offset)
        for b, s in enumerate(rows):
            self.cached[s] = start[b] + steps
        self._fit_cached()
        batch = self._batch.fill(np.asarray(token_ids, dtype=np.int32), np.asarray(start, dtype=np.int32),
                                 np.asarray(rows, dtype=np.int32), np.ones(B, dtype=np.int8))
        stops = np.asarray(stop_token_ids, dtype=np.int32)
        stopped = np.zeros(B, dtype=bool)
        out = np.empty((B, steps), dtype=np.int32)  # [B, steps]
        lib, V = self.lib, self.vocab_size
        keep = bool(self.kept_layers)
        for i in range(steps):
            if i:
                self._batch.token[:B] = out[:, i - 1]
                self._batch.pos[:B] += 1
            self._check(lib.llama_decode(self.ctx, batch), batch)  # self.ctx: _check may rebuild it
            if keep:
                self._keep_states(B, self._batch.seq[:B], self._batch.pos[:B])
            logits = np.ctypeslib.as_array(lib.llama_get_logits(self.ctx), shape=(B, self.n_vocab))  # [B, n_vocab]
            out[:, i] = choose(logits[:, :V])
            if len(stops):
                stopped |= np.isin(out[:, i], stops)
                if stopped.all():
                    for b, s in enumerate(rows):
                        self.cached[s] = start[b] + i + 1
                    return out[:, : i + 1].tolist()
        return out.tolist()

    def _roll_back(self, rows: list[int], start: Sequence[int], row_offset: int) -> None:
        """Drop what each row held from its start on (rollback is a length change), and the last tree
        pass's branches that ``compact`` did not keep."""
        self._drop_tree_ids()
        for b, s in enumerate(rows):
            held = self.cached[s]
            if start[b] > held:
                raise RuntimeError(f"row {row_offset + b} starts at {start[b]} but its cache holds {held} positions")
            if start[b] < held:
                self.lib.llama_memory_seq_rm(self.mem, s, int(start[b]), -1)
            self.cached[s] = int(start[b])

    def _fit_cached(self) -> None:
        """Grow the context when the positions the rows will hold (``self.cached``) exceed its cells."""
        need = sum(self.cached.values())
        if need > self.cells:
            self._rebuild(self._grown(need))

    def _grown(self, need: int) -> int:
        """Cells for a context that must hold ``need``: doubling (a new context copies every sequence),
        but never past ``max_cache_positions`` (a KV budget) beyond what is needed."""
        grown = max(2 * self.cells, MIN_CELLS)
        return max(need, grown if self.max_cache_positions is None else min(grown, self.max_cache_positions))

    def _check(self, rc: int, batch) -> None:
        """llama_decode's return code: 1 (no room in a fragmented cache) grows the cache and retries once."""
        if rc == 1:
            self._rebuild(2 * self.cells)
            rc = self.lib.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}; set SPECDEC_LLAMA_LOG=1 for llama.cpp's reason")

    def _decode(self, tokens: np.ndarray, pos: np.ndarray, seq: np.ndarray, flags: np.ndarray) -> np.ndarray:
        """Feed N tokens in llama_decode calls of up to BATCH_TOKENS; returns the logits of the flagged
        ones, in order [n_flagged, vocab_size]."""
        lib, n = self.lib, len(tokens)
        self._fit_cached()
        parts = []
        for lo in range(0, n, BATCH_TOKENS):
            hi = min(n, lo + BATCH_TOKENS)
            batch = self._batch.fill(tokens[lo:hi], pos[lo:hi], seq[lo:hi], flags[lo:hi])
            self._check(lib.llama_decode(self.ctx, batch), batch)
            self._decoded(seq[lo:hi], pos[lo:hi], flags[lo:hi], parts)
        return self._joined(parts)

    def _decoded(self, seq: np.ndarray, pos: np.ndarray, flags: np.ndarray, parts: list[np.ndarray]) -> None:
        """After a llama_decode of these tokens (``seq``: each one's first sequence id): keep their states
        (EAGLE-3) and append the flagged tokens' logits [n_flagged, vocab_size] to ``parts``."""
        if self.kept_layers:
            self._keep_states(len(seq), seq, pos)
        m = int(flags.sum())
        if m:
            arr = np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(m, self.n_vocab))
            parts.append(arr[:, : self.vocab_size].copy())  # the buffer is reused

    def _joined(self, parts: list[np.ndarray]) -> np.ndarray:
        if not parts:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _tree_plan(parents: Sequence[int]) -> tuple[list[int], list[int]]:
    """For one row's fed tokens with ``parents`` (-1: continues the cache): each token's depth (0 for
    -1) and the leaves (tokens without children), leftmost first."""
    has_child = {p for p in parents if p >= 0}
    return depths_of(list(parents)), [t for t in range(len(parents)) if t not in has_child]


def _leaves_under(parents: Sequence[int], leaves: list[int]) -> list[list[int]]:
    """The leaves below (or at) each token, leftmost first."""
    under: list[list[int]] = [[] for _ in parents]
    for leaf in leaves:
        t = leaf
        while t >= 0:
            under[t].append(leaf)
            t = parents[t]
    return under


class _MultiSeqBatch:
    """A llama_batch whose tokens may each belong to several sequence ids (a tree pass)."""

    def __init__(self, lib, tokens: np.ndarray, pos: np.ndarray, seq_ids: list[list[int]], flags: np.ndarray):
        n = len(tokens)
        i32 = ctypes.POINTER(ctypes.c_int32)
        self.token, self.pos, self.flags = tokens.astype(np.int32), pos.astype(np.int32), flags.astype(np.int8)
        self.n_seq_id = np.asarray([len(ids) for ids in seq_ids], dtype=np.int32)
        self.ids = np.asarray([i for ids in seq_ids for i in ids], dtype=np.int32)  # flat, token by token
        offsets = np.cumsum(self.n_seq_id) - self.n_seq_id
        base = self.ids.ctypes.data
        self.ptrs = (i32 * n)(*[ctypes.cast(base + 4 * int(o), i32) for o in offsets])
        self.batch = _llama_batch(lib, self.token, self.pos, self.n_seq_id, self.ptrs, self.flags)
        self.batch.n_tokens = n


def _llama_batch(lib, token: np.ndarray, pos: np.ndarray, n_seq_id: np.ndarray, seq_ptrs, logits: np.ndarray):
    """A llama_batch over these arrays (int32 token, pos and n_seq_id; seq_ptrs: each token's int32* of its
    sequence ids; int8 logits flags); the caller keeps the arrays alive and sets n_tokens."""
    i32 = ctypes.POINTER(ctypes.c_int32)
    batch = lib.llama_batch()
    batch.token = token.ctypes.data_as(i32)
    batch.embd = None
    batch.pos = pos.ctypes.data_as(i32)
    batch.n_seq_id = n_seq_id.ctypes.data_as(i32)
    batch.seq_id = ctypes.cast(seq_ptrs, ctypes.POINTER(i32))
    batch.logits = logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
    return batch


def _ubatch(kv_bytes_per_cell: int, n_head: int) -> int:
    """Tokens per compute pass: the largest power of two up to BATCH_TOKENS (at least MIN_UBATCH) whose
    attention scores, ubatch x heads float32s per cell, take no more than the cell's KV."""
    fits = kv_bytes_per_cell // (4 * n_head)
    return min(BATCH_TOKENS, max(MIN_UBATCH, 1 << max(fits.bit_length() - 1, 0)))


class _Batch:
    """A llama_batch over numpy arrays of ``cap`` tokens, filled without per-token Python calls."""

    def __init__(self, lib, cap: int):
        self.token = np.zeros(cap, dtype=np.int32)
        self.pos = np.zeros(cap, dtype=np.int32)
        self.n_seq_id = np.ones(cap, dtype=np.int32)
        self.seq = np.zeros(cap, dtype=np.int32)
        self.logits = np.zeros(cap, dtype=np.int8)
        i32 = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        self.seq_ptrs = (i32 * cap)(*[ctypes.cast(base + 4 * i, i32) for i in range(cap)])  # token i -> &seq[i]
        self.batch = _llama_batch(lib, self.token, self.pos, self.n_seq_id, self.seq_ptrs, self.logits)

    def fill(self, tokens: np.ndarray, pos: np.ndarray, seq: np.ndarray, flags: np.ndarray):
        n = len(tokens)
        self.token[:n], self.pos[:n], self.seq[:n], self.logits[:n] = tokens, pos, seq, flags
        self.batch.n_tokens = n
        return self.batch
