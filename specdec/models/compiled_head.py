"""The EAGLE-3 head's one-row passes compiled by inductor (beside a compiled torch target, on CPU).

A chain step of one row is one decoder layer at one token: five products and some forty small ops
(four RMSNorms, RoPE, the cache writes, casts, SiLU, residuals); a catch-up is the same at a few
tokens, of which only the last goes past k and v. Eager, dispatching the small ops costs about as
much as the products themselves; compiled, inductor fuses them into a few C++ loops around the products
and the attention kernel (figures: docs/benchmarks.md, "the EAGLE-3 head's passes compiled"). What it compiles is the eager pass itself, ``HeadWeights.row_pass``
(drafters/eagle3.py), so there is one definition of the head however it runs:

    inputs:  ids [Tb] long, hidden [Tb, D] float32, pos [Tb] long, query [1] long (the token that goes
             on), rows [1] long (the cache row), key_pos [1, 1, L] float (0..L-1: it sees those up to
             its own position; L a multiple of ATTEND_STEP, the last L's tensor kept), the head's k, v
             cache [1, rows, KVH, max_len, hd] float32 and its RoPE tables [max_len, hd]
    output:  draft-vocabulary logits [1, Vd] and the pre-norm output g [1, D], float32

Tb is one of ``SIZES`` (linear16's cost steps every 3 rows): a catch-up of T tokens is padded to the
next, its padding continuing the row past its last token. The padding's k and v land past the query's
position, where no query of this round reads (the mask hides them) and the next chain step or catch-up
writes first (rollback is a length change). The cache's rows and length, the tables' length and L
are traced as dynamic dims, so nothing compiles again after load. Longer catch-ups (a prompt's) and
batches of several rows stay eager.
"""

from __future__ import annotations

import torch

from specdec.models.compiled import (ATTEND_STEP, EAGER_HINT, RECOMPILE_LIMIT, W16_SIZES, attended_length, compile_pass,
                                     warm_announced)
from specdec.models.kv_cache import CACHE_STEP

SIZES = W16_SIZES  # tokens per pass: 1 (a chain step), 3, 6, 9 (catch-ups, padded)


class CompiledHeadStep:
    """``HeadWeights.row_pass`` at each of ``SIZES`` tokens, compiled at construction (one line on
    stderr per head)."""

    def __init__(self, runner, name: str):
        self.runner = runner
        self.device = runner.device
        self._key_pos = torch.zeros(1, 1, 0)  # [1, 1, L] float 0..L-1 for the last L
        self._query: dict[int, torch.Tensor] = {}  # T -> [1] long T - 1
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.fn, self.direct = compile_pass(runner.w.row_pass, "ids", 0, self.device)  # keyed by the ids' T
        sizes = ",".join(map(str, SIZES))
        self.compile_seconds = warm_announced(f"specdec: the compiled passes of EAGLE-3 head {name} (T={sizes})",
                                              self._warm)

    def _warm(self) -> None:
        """Trace each size on a scratch cache whose rows (2), length and attended length differ, so that
        they are dynamic."""
        c, dev = self.runner.c, self.device
        rows, cached, attended = 2, 3 * CACHE_STEP, 2 * ATTEND_STEP
        for T in SIZES:
            with torch.inference_mode():
                k = torch.zeros(1, rows, c.num_key_value_heads, cached, c.head_dim, device=dev)
                v = torch.zeros_like(k)
                cos = torch.zeros(cached + 1, c.head_dim, device=dev)
                sin = torch.zeros_like(cos)
                key_pos = torch.arange(attended, dtype=torch.float32, device=dev)[None, None]
                ids, pos = torch.zeros(T, dtype=torch.long, device=dev), torch.arange(1, T + 1, device=dev)
                query, row = torch.tensor([T - 1], device=dev), torch.zeros(1, dtype=torch.long, device=dev)
                hidden = torch.zeros(T, c.hidden_size, device=dev)
            for t, dims in ((k, (1, 3)), (v, (1, 3)), (cos, (0,)), (sin, (0,)), (key_pos, (2,))):
                torch._dynamo.mark_dynamic(t, dims)
            try:
                with torch.inference_mode():
                    self.fn(ids, hidden, pos, query, row, key_pos, k, v, cos, sin)
            except Exception as e:
                raise RuntimeError(f"compiling the EAGLE-3 head's pass (T={T}) failed: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}; {EAGER_HINT}") from e

    def why_not(self, T: int) -> str | None:
        """Why a pass of T tokens runs eager, or None when it runs compiled."""
        return None if T <= SIZES[-1] else f"{T} tokens (compiled: up to {SIZES[-1]})"

    def row_pass(self, ids: torch.Tensor, hidden: torch.Tensor, row: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T] at positions start..start+T-1 of cache row ``row``, hidden [T, D] float32 (T <= SIZES[-1]);
        the last token goes on -> logits [1, Vd], g [1, D] (``HeadRunner._row_pass``)."""
        r, dev = self.runner, self.device
        T = ids.shape[0]
        Tb = next(s for s in SIZES if s >= T)
        last = start + T - 1  # the query's position
        L = attended_length(last + 1)  # keys 0..L-1, seen up to it
        r.reserve(row + 1, max(L, start + Tb) + 1)  # traced with the cache longer than L (and 2+ rows: reserve)
        if self._key_pos.shape[2] != L:
            with torch.inference_mode():
                self._key_pos = torch.arange(L, dtype=torch.float32, device=dev)[None, None]
        query = self._query.get(T)
        if query is None:
            with torch.inference_mode():
                query = self._query[T] = torch.tensor([T - 1], device=dev)
        ids, hidden = ids.reshape(T), hidden.reshape(T, -1)
        if Tb > T:  # padding continues the row past its last token (see the module docstring)
            ids = torch.cat([ids, ids.new_zeros(Tb - T)])
            hidden = torch.cat([hidden, hidden.new_zeros(Tb - T, hidden.shape[1])])
        args = (ids.contiguous(), hidden.contiguous(), torch.arange(start, start + Tb, device=dev), query, r._row(row),
                self._key_pos, r.cache.k, r.cache.v, r.cos, r.sin)
        # contiguous: g arrives as a view with the strides of its pass
        if self.direct is not None:
            with torch.inference_mode():
                out = self.direct.call(Tb, *args)
            if out is not None:
                return out[0], out[1]
        # dynamo checks only the guards that tell its graphs apart (which head, which size): the rest hold by
        # construction
        try:
            with torch.inference_mode(), torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self.fn(*args)
        except RuntimeError as e:  # inputs unlike the traced ones: check every guard (it compiles once more)
            if "Recompilation" not in str(e):
                raise
        with torch.inference_mode():
            return self.fn(*args)
