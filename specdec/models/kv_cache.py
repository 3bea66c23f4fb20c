"""A KV cache written by absolute position, with one row per running sequence.

Rollback is a length change: the cache itself holds no lengths. Whoever owns a
row remembers how many positions of it are valid and simply overwrites the rest
on the next forward (gpt-fast's ``KVCache.update`` with ``input_pos``).

Rows are kept dense: the sequences of a batch of B occupy rows 0..B-1, so a
forward reads ``cache[:, :B]`` without a gather. ``RowTable`` maps sequence ids
to rows and moves rows only when the batch composition changes.

A cache may also keep per-position states beside the KV (``state_width`` > 0: the target's layer
inputs that an EAGLE-3 head reads); they live in the same rows and positions, so they move, copy
and roll back with the KV.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

CACHE_STEP = 256  # caches grow in steps of this many positions, not one token at a time


class KVCache:
    def __init__(self, num_layers: int, num_rows: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, state_width: int = 0):
        shape = (num_layers, num_rows, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, rows, kv_heads, max_len, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # per-position states kept beside the KV, float32  [rows, max_len, state_width]; None: none kept
        self.states = torch.zeros(num_rows, max_len, state_width, device=device) if state_width else None

    def grown_from(self, old: KVCache) -> None:
        """Copy what ``old`` (a smaller cache: fewer rows or positions) holds into this one."""
        R, L = old.num_rows, old.max_len
        self.k[:, :R, :, :L] = old.k
        self.v[:, :R, :, :L] = old.v
        if self.states is not None and old.states is not None and old.states.shape[2] == self.states.shape[2]:
            self.states[:R, :L] = old.states

    @property
    def num_rows(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def move_rows(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy row ``src`` into row ``dst`` for each (dst, src), all sources read before any write."""
        if not moves:
            return
        dst = torch.tensor([d for d, _ in moves], device=self.k.device)
        src = torch.tensor([s for _, s in moves], device=self.k.device)
        self.k[:, dst] = self.k[:, src]  # advanced indexing on the right copies first: no aliasing
        self.v[:, dst] = self.v[:, src]
        if self.states is not None:
            self.states[dst] = self.states[src]

    def copy_prefix(self, src_row: int, dst_rows: Sequence[int], length: int) -> None:
        """Rows ``dst_rows`` take row ``src_row``'s positions 0..length-1 (KV and kept states)."""
        if not dst_rows or length == 0:
            return
        dst = torch.tensor(list(dst_rows), device=self.k.device)
        self.k[:, dst, :, :length] = self.k[:, src_row : src_row + 1, :, :length]  # broadcast over dst
        self.v[:, dst, :, :length] = self.v[:, src_row : src_row + 1, :, :length]
        if self.states is not None:
            self.states[dst, :length] = self.states[src_row : src_row + 1, :length]

    def compact(self, row: int, start: int, keep: Sequence[int]) -> None:
        """Row ``row``'s slots start + keep[i] move to start + i (keep increasing: a tree's accepted path)."""
        if list(keep) == list(range(len(keep))):
            return  # already in place (a chain, or a path down the first children)
        src = torch.tensor([start + j for j in keep], device=self.k.device)
        dst = torch.arange(start, start + len(keep), device=self.k.device)
        self.k[:, row, :, dst] = self.k[:, row, :, src]  # gathered before written: no aliasing
        self.v[:, row, :, dst] = self.v[:, row, :, src]
        if self.states is not None:
            self.states[row, dst] = self.states[row, src]


def grow(old: KVCache | None, num_rows: int, length: int, step: int, make) -> KVCache:
    """``old`` when it has room for ``num_rows`` rows of ``length`` positions; else a cache of at least
    as many rows and positions as both ask (positions rounded up to ``step``), made by
    ``make(rows, max_len)``, holding what ``old`` held."""
    length = -(-length // step) * step
    if old is not None and old.num_rows >= num_rows and old.max_len >= length:
        return old
    new = make(max(num_rows, old.num_rows if old else 0), max(length, old.max_len if old else 0))
    if old is not None:
        new.grown_from(old)
    return new


class RowTable:
    """Keeps ``ids[i]`` in cache row i, moving rows when sequences join or leave.

    ``sync(ids)`` returns, for each id, whether its row is new (its cached length is 0).
    """

    def __init__(self) -> None:
        self.row_of: dict[Hashable, int] = {}

    def holds(self, ids: Sequence[Hashable]) -> bool:
        """Whether ``ids`` are the rows already, in order (most rounds: nothing joins, leaves or moves)."""
        return len(ids) == len(self.row_of) and all(self.row_of.get(i) == n for n, i in enumerate(ids))

    def sync(self, ids: Sequence[Hashable], cache: KVCache) -> list[bool]:
        rows = [self.row_of.get(i) for i in ids]
        is_new = [r is None for r in rows]
        # Only sequences that were cached and now sit elsewhere are copied; the rows of new ones hold
        # stale data that their owners overwrite from length 0. The engine keeps survivors in place
        # and fills holes from the end, so a departure usually moves one row, not the whole cache.
        cache.move_rows([(n, r) for n, r in enumerate(rows) if r is not None and r != n])
        self.row_of = {i: n for n, i in enumerate(ids)}
        return is_new
