"""The one interface every model backend offers: run a batch of token rows, get logits.

There is no explicit rollback call: a row's ``start`` is its cached length, so a caller rolls back
by passing a smaller ``start`` next time (what lies past it is overwritten or dropped).
Backends: the torch runner (``models/llama.py``) and llama.cpp (``models/llamacpp.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.models.kv_cache import CACHE_STEP
from specdec.sampling import argmax



def long_tensor(values: Sequence, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.long, device=device)``; on the CPU made through numpy, which costs
    half as much right after a forward pass has streamed the weights through the caches (a round makes a
    few such small tensors between passes: benchmarks/host_cost.py)."""
    if torch.device(device).type == "cpu":
        return torch.from_numpy(np.array(values, dtype=np.int64))
    return torch.tensor(values, dtype=torch.long, device=device)


def pad_rows(rows: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """Right-pad token rows (possibly empty) with 0 into one [B, longest] long tensor."""
    width = max((len(r) for r in rows), default=0)
    padded = [list(r) + [0] * (width - len(r)) for r in rows]  # padding past a row's tokens is never read
    return long_tensor(padded, device).reshape(len(rows), width)


@dataclass
class ForwardBatch:
    """One forward pass: row b feeds ``token_ids[b, :lengths[b]]`` at positions ``start[b]``, ``start[b] + 1``, ...
    into cache row ``row_offset + b``; what that row held from ``start[b]`` on is discarded."""

    token_ids: torch.Tensor  # [B, T] long, right-padded
    start: list[int]  # [B] each row's first position = the cached length it keeps
    lengths: list[int]  # [B] real tokens per row, 0..T (0: the row feeds nothing)
    logits_index: torch.Tensor | None = None  # [B] or [B, L] indices into T whose logits come back; None: none
    row_offset: int = 0  # the batch is cache rows row_offset .. row_offset + B - 1
    num_layers: int | None = None  # run only the first layers, then the final norm and head (self-speculation)
    # a tree pass (tree.py): parents[b][t] is the index within row b's fed tokens of token t's parent
    # (-1: it continues the cached prefix). Token t sits at position start[b] + depth(t) and sees the
    # prefix and its ancestors; its KV goes to slot start[b] + t until ``compact`` keeps a path.
    # None: every row is a chain (positions start[b] + t). Only runners with can_verify_trees take it.
    parents: list[list[int]] | None = None  # [B][T]

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[int]], start: Sequence[int], logits: str | int = "last",
                  row_offset: int = 0, num_layers: int | None = None, device: torch.device | str = "cpu") -> ForwardBatch:
        """A batch from token lists. ``logits``: "last" ([B, V] after each row's last token), "none", "all"
        (every position, equal-length rows), or L (the last L positions of each row: [B, L, V])."""
        tokens = pad_rows(rows, device)  # [B, T]
        lengths = [len(r) for r in rows]
        return cls(tokens, list(start), lengths, _logits_index(logits, lengths, tokens.shape[1], device),
                   row_offset, num_layers)

    @classmethod
    def dense(cls, token_ids: torch.Tensor, start: Sequence[int], logits: str = "none", row_offset: int = 0,
              num_layers: int | None = None) -> ForwardBatch:
        """A batch whose rows all hold T real tokens [B, T]; ``logits``: "none", "last" or "all"."""
        B, T = token_ids.shape
        return cls(token_ids, list(start), [T] * B, _logits_index(logits, [T] * B, T, token_ids.device),
                   row_offset, num_layers)


def _logits_index(logits: str | int, lengths: list[int], T: int, device: torch.device | str) -> torch.Tensor | None:
    """ForwardBatch.logits_index for rows of ``lengths`` padded to T: "none", "last" [B], "all" [B, T]
    or the last L positions [B, L]."""
    if logits == "none":
        return None
    if logits == "last":
        return long_tensor([max(n - 1, 0) for n in lengths], device)  # [B]
    if logits == "all":
        return torch.arange(T, device=device).expand(len(lengths), T)  # [B, T]
    return long_tensor([[n - logits + j for j in range(logits)] for n in lengths], device)  # [B, L]


class ModelRunner(ABC):
    """What every backend offers its callers: the attributes below, the cache methods and ``forward``.
    Callers ask a capability (``can_run_layer_subsets``), never a backend's name."""

    vocab_size: int  # width of the returned logits: the tokenizer's length, padded rows cut off
    max_model_len: int  # longest sequence (prompt + output) the model accepts
    num_layers: int
    device: torch.device
    dtype: torch.dtype  # the weights' dtype, or the one whose rounding they resemble (near-tie thresholds)
    tokenizer: object | None  # the model's transformers tokenizer; None: prompts go in as token ids
    backend: str  # the backend's name, for messages and reports: "torch" | "llama.cpp"
    can_run_layer_subsets: bool = False  # honours ForwardBatch.num_layers (layer_skip's self-speculation)
    casts_weights: bool = False  # True: the weights were cast at load to a dtype specdec chose (dtype_choice.py)
    can_keep_hidden_states: bool = False  # honours keep_hidden_states (EAGLE-3 heads read the target's states)
    can_verify_trees: bool = False  # honours ForwardBatch.parents and compact (draft trees, tree.py)
    # the most rows x tree nodes a tree round may hold (llama.cpp: a context's sequence ids), None: no bound
    max_tree_sequences: int | None = None
    cache_step: int = CACHE_STEP  # the KV cache grows in steps of this many positions (round_cache_len)
    min_cache_rows: int = 1  # the KV cache holds at least this many rows, however few run (a KV budget counts them)
    max_cache_positions: int | None = None  # a KV budget's bound on positions in all rows: growth past need stops there

    def round_cache_len(self, n: int) -> int:
        """The cache length a row of ``n`` positions makes this runner reserve: n rounded up to ``cache_step``
        (what a KV budget counts)."""
        return -(-n // self.cache_step) * self.cache_step

    @abstractmethod
    def describe(self) -> str:
        """The compute path in one line (kernels, weights' dtype, ...), for demo and bench."""

    @abstractmethod
    def reserve(self, num_rows: int, length: int) -> None:
        """Make room for ``num_rows`` sequences of ``length`` positions, keeping what is cached."""

    @abstractmethod
    def release(self) -> None:
        """Free the KV cache; the next forward allocates what it needs (every row starts empty)."""

    @abstractmethod
    def sync_rows(self, ids: Sequence[Hashable]) -> list[bool]:
        """Put the cache rows of sequences ``ids`` at rows 0..B-1 and forget every other id; returns
        which ids are new (cached length 0)."""

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Run ``batch``, writing its KV. Returns float32 logits [B, V] or [B, L, V] at
        ``batch.logits_index``, or None when it is None. A backend that cannot honour
        ``num_layers`` raises ValueError."""

    def forward_argmax(self, batch: ForwardBatch) -> list:
        """``argmax(forward(batch)).tolist()``: token ids [B] or [B][L] (the first maximal index), for a caller
        that reads nothing else of the logits (a verify pass of greedy rows). A backend whose forward
        computes the argmax anyway overrides this and skips copying the logits out."""
        if batch.logits_index is None:
            raise ValueError("forward_argmax needs a batch with logits (ForwardBatch.logits_index)")
        return argmax(self.forward(batch)).tolist()

    def greedy_steps(self, token_ids: Sequence[int], start: Sequence[int], steps: int, row_offset: int = 0,
                     stop_token_ids: Sequence[int] = ()) -> list[list[int]]:
        """Greedy decoding of up to ``steps`` tokens per row in one call (plain rounds, greedy drafts):
        row b feeds ``token_ids[b]`` at ``start[b]``, takes the argmax, feeds it, and so on. Returns
        the argmax tokens [B, n], n <= steps: it stops early once every row has produced one of
        ``stop_token_ids``. The cache then holds start[b] + n positions (the last argmax is not fed).
        A backend overrides this with a loop that skips the general forward's bookkeeping."""
        x = torch.as_tensor(list(token_ids), dtype=torch.long)[:, None].to(self.device)  # [B, 1]
        stops = torch.as_tensor(list(stop_token_ids), dtype=torch.long, device=self.device)
        stopped = torch.zeros(len(start), dtype=torch.bool, device=self.device)  # [B]
        out = []
        for i in range(steps):
            logits = self.forward(ForwardBatch.dense(x, [p + i for p in start], logits="last", row_offset=row_offset))
            x = argmax(logits)[:, None]  # [B, 1]
            out.append(x)
            if len(stops):
                stopped |= torch.isin(x[:, 0], stops)
                if bool(stopped.all()):
                    break
        return torch.cat(out, dim=1).tolist()

    def sampled_steps(self, token_ids: Sequence[int], start: Sequence[int], steps: int,
                      pick: Callable[[torch.Tensor], Sequence[int]], row_offset: int = 0) -> list[list[int]]:
        """``greedy_steps`` with each next token chosen by the caller (a sampling drafter's chain): row b
        feeds ``token_ids[b]`` at ``start[b]``; after each step ``pick(logits)`` (logits [B, V] or [B, 1, V], valid
        until the next step) gives the next tokens [B], fed at the next positions. Returns the picks [B, steps];
        the cache then holds start[b] + steps positions (the last pick is not fed). A backend overrides this
        with a loop that skips the general forward's bookkeeping."""
        x = list(token_ids)
        out = []
        for i in range(steps):
            batch = ForwardBatch.dense(long_tensor([[t] for t in x], self.device), [p + i for p in start],
                                       logits="last", row_offset=row_offset)
            x = [int(t) for t in pick(self.forward(batch))]
            out.append(x)
        return [list(row) for row in zip(*out)] if out else [[] for _ in token_ids]

    def keep_hidden_states(self, layer_ids: Sequence[int]) -> None:
        """From now on every forward (``greedy_steps`` too) also keeps, per cache row and position, the
        inputs of layers ``layer_ids`` (Hugging Face's ``hidden_states[i]``) concatenated, [len(layer_ids) * D]:
        a cache beside the KV that moves, copies and rolls back with it (sync_rows, copy_prefix, start).
        A backend that cannot raises ValueError."""
        raise ValueError(f"the {self.backend} backend cannot give the target's hidden states that EAGLE-3 heads "
                         "read; use backend='torch'")

    def hidden_states(self, row: int, start: int, end: int) -> torch.Tensor:
        """What ``keep_hidden_states`` kept for cache row ``row`` at positions start..end-1  [end - start, n * D]
        float32 (positions the target has computed since it was asked to keep them)."""
        raise ValueError(f"the {self.backend} backend keeps no hidden states")

    def token_embedding(self) -> torch.Tensor:
        """The input token embedding [V_rows, D] (an EAGLE-3 head embeds its tokens with it)."""
        raise ValueError(f"the {self.backend} backend does not expose its token embedding")

    def compact(self, rows: Sequence[int], start: Sequence[int], keep: Sequence[Sequence[int]]) -> None:
        """After a tree pass: cache row ``rows[b]`` keeps, at slots start[b], start[b] + 1, ..., what
        slots start[b] + keep[b][0], start[b] + keep[b][1], ... held (KV and kept states; keep[b] is
        increasing). Its cached length is then start[b] + len(keep[b]): the accepted path, made a chain."""
        raise ValueError(f"the {self.backend} backend cannot verify draft trees; use backend='torch' or chains")

    @abstractmethod
    def copy_prefix(self, src_row: int, dst_rows: Sequence[int], length: int) -> None:
        """Make cache rows ``dst_rows`` hold what row ``src_row`` holds at positions 0..length-1 (and
        nothing past it): choices of one prompt share its prefill."""

    @abstractmethod
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one position of one row takes (all layers, k and v)."""


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """``layer_ids`` as ints, each the input of one of ``num_layers`` layers (keep_hidden_states), or a ValueError."""
    ids = [int(i) for i in layer_ids]
    bad = [i for i in ids if not 0 <= i < num_layers]
    if not ids or bad:
        raise ValueError(f"keep_hidden_states: layer ids {ids} must be in 0..{num_layers - 1} "
                         f"(inputs of this target's {num_layers} layers)")
    return ids


def next_token_logits(runner: ModelRunner, prompts: list[list[int]], row_tag: str = "__specdec_probe__") -> torch.Tensor:
    """Next-token logits [B, V] after each prompt (equal lengths), computed in fresh cache rows tagged
    ``row_tag``. It takes rows 0..B-1, so any sequence the runner held is forgotten (recomputed from
    its start if it runs again): call it while no engine is mid-generation on this runner."""
    B = len(prompts)
    runner.sync_rows([(row_tag, b) for b in range(B)])
    return runner.forward(ForwardBatch.from_rows(prompts, [0] * B, logits="last", device=runner.device))
