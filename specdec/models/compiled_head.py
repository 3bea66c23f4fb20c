"""The EAGLE-3 head's chain step compiled by inductor (beside a compiled torch target, on CPU).

A chain step of one row is one decoder layer at one token: five products and some forty small ops
(four RMSNorms, RoPE, the cache writes, casts, SiLU, residuals). Eager, the small ops cost about as
much as the products on a 2-core CPU (each RMSNorm alone ~70 µs); compiled, inductor fuses them into a
few C++ loops around the products and the attention kernel. What it compiles is the eager pass itself,
``HeadWeights.row_pass`` (drafters/eagle3.py), so there is one definition of the head however it runs:

    inputs:  ids [1] long, hidden [1, D] float32, pos [1] long, rows [1] long (the cache row),
             bias [1, 1, L] float (additive: 0 for keys 0..pos, -inf past; L a multiple of ATTEND_STEP),
             the head's k, v cache [1, rows, KVH, max_len, hd] float32 and its RoPE tables [max_len, hd]
    output:  draft-vocabulary logits [1, Vd] and the pre-norm output g [1, D], float32

The cache's rows and length, the tables' length and L are traced as dynamic dims, so no step compiles
again after load. Catch-ups (several tokens) and batches of several rows stay eager.
"""

from __future__ import annotations

import torch

from specdec.models.compiled import ATTEND_STEP, EAGER_HINT, RECOMPILE_LIMIT, compile_settings, warm_announced
from specdec.models.kv_cache import CACHE_STEP


class CompiledHeadStep:
    """``HeadWeights.row_pass`` at one token, compiled at construction (one line on stderr per head)."""

    def __init__(self, runner, name: str):
        self.runner = runner
        self.device = runner.device
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.fn = torch.compile(runner.w.row_pass, backend="inductor", fullgraph=True, dynamic=False,
                                **compile_settings(self.device))
        self.compile_seconds = warm_announced(f"specdec: the compiled chain step of EAGLE-3 head {name}", self._warm)

    def _warm(self) -> None:
        """Trace on a scratch cache whose rows (2), length and attended length differ, so they are dynamic."""
        c, dev = self.runner.c, self.device
        rows, cached, attended = 2, 3 * CACHE_STEP, 2 * ATTEND_STEP
        with torch.inference_mode():
            k = torch.zeros(1, rows, c.num_key_value_heads, cached, c.head_dim, device=dev)
            v = torch.zeros_like(k)
            cos = torch.zeros(cached + 1, c.head_dim, device=dev)
            sin = torch.zeros_like(cos)
            bias = torch.zeros(1, 1, attended, device=dev)
            ids, pos, row = torch.zeros(1, dtype=torch.long, device=dev), torch.ones(1, dtype=torch.long, device=dev), \
                torch.zeros(1, dtype=torch.long, device=dev)
            hidden = torch.zeros(1, c.hidden_size, device=dev)
        for t, dims in ((k, (1, 3)), (v, (1, 3)), (cos, (0,)), (sin, (0,)), (bias, (2,))):
            torch._dynamo.mark_dynamic(t, dims)
        try:
            with torch.inference_mode():
                self.fn(ids, hidden, pos, row, bias, k, v, cos, sin)
        except Exception as e:
            raise RuntimeError(f"compiling the EAGLE-3 head's chain step failed: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}; {EAGER_HINT}") from e

    def chain_step(self, ids: torch.Tensor, hidden: torch.Tensor, row: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [1] at position ``p`` of cache row ``row``, hidden [1, D] float32 -> logits [1, Vd], g [1, D]."""
        r = self.runner
        L = max(-(-(p + 1) // ATTEND_STEP) * ATTEND_STEP, 2 * ATTEND_STEP)  # keys 0..L-1, masked past p
        r.reserve(max(row + 1, 2), L + 1)  # traced with 2+ rows and the cache longer than L: keep it so
        bias = torch.zeros(1, 1, L, device=self.device)
        bias[..., p + 1 :] = float("-inf")
        pos = torch.tensor([p], device=self.device)
        args = (ids.reshape(1).contiguous(), hidden.reshape(1, -1).contiguous(), pos, r._row(row), bias, r.cache.k,
                r.cache.v, r.cos, r.sin)  # contiguous: g arrives as a view with the strides of its pass
        # dynamo checks only the guards that tell its graphs apart (which head): the rest hold by construction
        try:
            with torch.inference_mode(), torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self.fn(*args)
        except RuntimeError as e:  # inputs unlike the traced ones: check every guard (it compiles once more)
            if "Recompilation" not in str(e):
                raise
        with torch.inference_mode():
            return self.fn(*args)
