"""A KV cache written by absolute position, with one row per running sequence.

Rollback is a length change: the cache itself holds no lengths. Whoever owns a
row remembers how many positions of it are valid and simply overwrites the rest
on the next forward (gpt-fast's ``KVCache.update`` with ``input_pos``).

Rows are kept dense: the sequences of a batch of B occupy rows 0..B-1, so a
forward reads ``cache[:, :B]`` without a gather. ``RowTable`` maps sequence ids
to rows and moves rows only when the batch composition changes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


class KVCache:
    def __init__(self, num_layers: int, num_rows: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_rows, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, rows, kv_heads, max_len, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)

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


class RowTable:
    """Keeps ``ids[i]`` in cache row i, moving rows when sequences join or leave.

    ``sync(ids)`` returns, for each id, whether its row is new (its cached length is 0).
    """

    def __init__(self) -> None:
        self.row_of: dict[Hashable, int] = {}

    def sync(self, ids: Sequence[Hashable], cache: KVCache) -> list[bool]:
        rows = [self.row_of.get(i) for i in ids]
        is_new = [r is None for r in rows]
        # Only sequences that were cached and now sit elsewhere are copied; the rows of new ones hold
        # stale data that their owners overwrite from length 0. The engine keeps survivors in place
        # and fills holes from the end, so a departure usually moves one row, not the whole cache.
        cache.move_rows([(n, r) for n, r in enumerate(rows) if r is not None and r != n])
        self.row_of = {i: n for n, i in enumerate(ids)}
        return is_new
