"""Logit processing shared by the target and every drafter, and seeded sampling.

One pipeline, in this order: temperature -> top-k -> top-p -> min-p, then softmax.
The verifier's p and a sampling drafter's q both come from ``probs_from_logits``
with the same per-row parameters (docs/algorithm.md: "Sampling options apply to p and q").
A row's probabilities do not depend on the other rows' parameters (a row without top-p is not cut
at a rounded cumulative mass because another row uses top-p), so a seeded request samples alike
in any batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec import sampling_kernel
from specdec.config import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of a batch, as tensors."""

    temperature: torch.Tensor  # [B]; 1.0 stands in for greedy rows, which never sample
    top_k: torch.Tensor  # [B] long; 0 disables (greedy rows: 0)
    top_p: torch.Tensor  # [B]; 1.0 disables (greedy rows: 1.0)
    min_p: torch.Tensor  # [B]; 0.0 disables (greedy rows: 0.0)
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    cut_rows: tuple[int, ...]  # the sampled rows that use top-k or top-p
    needs_min_p: bool
    params: tuple[SamplingParams, ...] = ()  # what the rows were built from (``from_params(..., reuse=)``)
    all_sampled: bool = False  # no greedy row (False where unsure: a ``select`` of a mixed batch)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu",
                    reuse: SamplingBatch | None = None) -> SamplingBatch:
        """The batch for ``params``; ``reuse``, last round's, comes back as is when its rows hold the
        same SamplingParams objects (a decoding batch's usual round: no tensors to build)."""
        if (reuse is not None and len(reuse.params) == len(params)
                and all(a is b for a, b in zip(reuse.params, params))):
            return reuse

        def t(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)

        greedy = [p.greedy for p in params]
        return cls(
            temperature=t([1.0 if p.greedy else p.temperature for p in params]),
            top_k=t([0 if p.greedy else p.top_k for p in params], torch.long),
            top_p=t([1.0 if p.greedy else p.top_p for p in params]),
            min_p=t([0.0 if p.greedy else p.min_p for p in params]),
            greedy=t(greedy, torch.bool),
            all_greedy=all(greedy),
            cut_rows=tuple(b for b, p in enumerate(params) if not p.greedy and (p.top_k > 0 or p.top_p < 1.0)),
            needs_min_p=any(not p.greedy and p.min_p > 0 for p in params),
            params=tuple(params),
            all_sampled=not any(greedy),
        )

    @property
    def device(self) -> torch.device:
        return self.temperature.device

    def select(self, rows: Sequence[int]) -> SamplingBatch:
        """The batch of ``rows``; this one itself when they are every row in order (batch 1 mostly): a
        SamplingBatch is never changed once built (``from_params`` hands the same one back)."""
        if list(rows) == list(range(len(self.greedy))):
            return self
        idx = torch.tensor(rows, device=self.temperature.device)
        cut_rows = tuple(i for i, r in enumerate(rows) if r in self.cut_rows)
        return SamplingBatch(self.temperature[idx], self.top_k[idx], self.top_p[idx], self.min_p[idx],
                             self.greedy[idx], self.all_greedy, cut_rows, self.needs_min_p,
                             tuple(self.params[r] for r in rows) if self.params else (), self.all_sampled)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (the first maximal index, as torch's); float32 CPU tensors through numpy,
    whose argmax over a vocabulary row costs a fraction of torch's: every greedy step and greedy draft
    takes one (figures: docs/benchmarks.md, "Where the time goes at batch 1")."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad:
        return torch.from_numpy(np.asarray(x.numpy().argmax(axis=-1)))
    return x.argmax(dim=-1)


def probs_from_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits [B, ..., V] -> probabilities [B, ..., V] after temperature, top-k, top-p and min-p (float32)."""
    extra = logits.dim() - 1
    shape = (-1,) + (1,) * extra  # broadcast a [B] parameter over the remaining dims

    if logits.device.type == "cpu" and sampling_kernel.available().ok:  # every row in one native pass, min-p too
        return sampling_kernel.cut_probs(logits, sb.temperature, sb.top_k, sb.top_p, sb.min_p)
    logits = logits.float() / sb.temperature.view(shape)
    if sb.cut_rows:  # only the rows that use top-k or top-p: finding the cut costs more than the rest
        if len(sb.cut_rows) == len(logits):
            logits = _top_k_top_p(logits, sb.top_k, sb.top_p)
        else:
            rows = torch.tensor(sb.cut_rows, device=logits.device)  # [S]
            logits[rows] = _top_k_top_p(logits[rows], sb.top_k[rows], sb.top_p[rows])
    probs = torch.softmax(logits, dim=-1)
    if sb.needs_min_p:
        probs = _min_p(probs, sb.min_p.view(shape))
    return probs


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Rows with min_p > 0 keep the tokens of at least min_p times their top probability, renormalised."""
    kept = probs * (probs >= min_p * probs.amax(dim=-1, keepdim=True))
    return torch.where(min_p > 0, kept / kept.sum(dim=-1, keepdim=True), probs)  # others: untouched


def sample_from_logits(logits: torch.Tensor, sb: SamplingBatch, generators: Sequence[torch.Generator],
                       out: torch.Tensor | None = None, step: int = 0) -> tuple[torch.Tensor, list[int]]:
    """``probs_from_logits`` then ``sample``: logits [B, V] (or [B, 1, V]) -> (probabilities [B, V], ids [B] as a
    list); with ``out`` [B, n, V] the probabilities go to out[:, step] and out is returned. On the CPU with the
    sampling kernel, one native call for both (a sampling drafter's step: each torch call right after a forward
    costs tens of µs in cache misses)."""
    return row_sampler(sb, generators, logits.device)(logits, out, step)


def row_sampler(sb: SamplingBatch, generators: Sequence[torch.Generator], device: torch.device | str,
                vocab_map: torch.Tensor | None = None):
    """``sample_from_logits`` for these rows, with their parameters and generators bound and the kernel's
    availability read once: ``(logits, out=None, step=0) -> (probabilities, ids)`` (a drafter's k picks).
    ``vocab_map`` [Vd] (long): logits over a drafter's vocabulary whose token c is the target's token
    vocab_map[c]; the probabilities then go to those columns of out[:, step] [B, n, V] (0 elsewhere, ``out``
    required) and the ids are the target's."""
    if torch.device(device).type == "cpu" and sampling_kernel.available().ok:
        native = sampling_kernel.module().sample_rows
        bound = (sb.temperature, sb.top_k, sb.top_p, sb.min_p, list(generators))
        return lambda logits, out=None, step=0: native(logits, *bound, out, step, vocab_map)

    def rows(logits: torch.Tensor, out: torch.Tensor | None = None, step: int = 0) -> tuple[torch.Tensor, list[int]]:
        logits = logits.reshape(logits.shape[0], logits.shape[-1])  # [B, V] (or [B, Vd])
        if vocab_map is not None:  # into the target's vocabulary: tokens outside the map get no mass
            wide = logits.new_full((logits.shape[0], out.shape[-1]), float("-inf"))
            logits = wide.index_copy_(1, vocab_map.to(logits.device), logits)
        probs = probs_from_logits(logits, sb)
        ids = sample(probs, generators).tolist()
        if out is None:
            return probs, ids
        out[:, step] = probs
        return out, ids

    return rows


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf everything outside the top-k, then outside the smallest prefix whose mass reaches top_p.
    logits [S, ..., V] float32; top_k, top_p [S]. Ties at a cut are cut by rank."""
    if logits.device.type == "cpu":
        return _top_k_top_p_numpy(logits, top_k.numpy(), top_p.numpy())
    shape = (-1,) + (1,) * (logits.dim() - 1)  # a row's parameter over its positions and tokens
    return _top_k_top_p_sorted(logits, top_k.view(shape), top_p.view(shape))


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``_top_k_top_p`` by sorting each row with its token ids (the rule as written; on GPUs a sort is cheap).
    top_k, top_p broadcastable to [S, ..., 1]."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [..., V]
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    drop = torch.arange(V, device=logits.device) >= k  # [..., V] in sorted order; ties at the k-th value are cut by rank
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly higher-ranked tokens
    drop = drop | ((mass_before >= top_p) & (top_p < 1.0))  # keep a token while the prefix before it is below top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _top_k_top_p_numpy(logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray) -> torch.Tensor:
    """``_top_k_top_p`` on the CPU (top_k, top_p [S] arrays): the same cut, found from each row's logit values
    sorted by numpy without the token order (torch sorts an 8,192-token row with its indices in ~0.36 ms,
    numpy its values in ~0.013 on EPYC-Zen5; a round cuts k draft rows and k + 1 target rows). A row keeps
    the tokens at or above its cut value; where tokens tie at the cut, as many as the rank rule keeps, the
    first by id. Row by row: a round's rows are few, and each numpy call costs more than its arithmetic."""
    shape, V = logits.shape, logits.shape[-1]
    z = logits.reshape(len(top_k), -1, V).numpy()  # [S, positions, V] float32
    out = np.empty_like(z)
    for s, (k, p) in enumerate(zip(top_k.tolist(), top_p.tolist())):
        k = min(k, V) if k > 0 else V
        for j, row in enumerate(z[s]):
            ranked = np.sort(row)  # ascending: the token of rank r from the top is at V - 1 - r
            kept = k
            if p < 1.0:  # top-p over the top-k: keep a token while the mass strictly above it is below top_p
                weight = np.exp(ranked[V - k:] - ranked[-1])  # the softmax's numerators, in the same order
                below = torch.from_numpy(weight).cumsum(dim=0).numpy()  # mass at or below: above = total - below
                kept = max(1, k - int(np.searchsorted(below, (1.0 - p) * below[-1], side="right")))
            cut = ranked[V - kept]  # the lowest value kept
            out[s, j] = np.where(row >= cut, row, np.float32(-np.inf))
            if kept < V and ranked[V - kept - 1] == cut:  # ties at the cut: drop those the rank rule drops
                tied = np.flatnonzero(row == cut)
                out[s, j, tied[kept - int((row > cut).sum()):]] = -np.inf
    return torch.from_numpy(out).reshape(shape)


def sample(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row: probs [B, V] -> ids [B], row b drawn with ``generators[b]`` (``draw``): each row
    takes one float64 uniform from its own generator whatever else is in the batch."""
    if probs.device.type == "cpu" and sampling_kernel.available().ok:
        return torch.tensor(sampling_kernel.module().draw_rows(probs, list(generators)))
    return torch.stack([_draw(probs[b], g) for b, g in enumerate(generators)])  # on the device: no wait for a GPU


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One id from probs [V] (not necessarily normalised) with one float64 uniform u from ``generator``:
    the inverse of the cumulative distribution, x such that C(x - 1) <= u·C(V) < C(x) with C the running
    sums in float64, so x comes with probability p(x) / sum(p) and a token of p 0 never. On the CPU the
    sums are found in blocks of DRAW_BLOCK (the block, then the token in it): 16 µs for 8,192 tokens,
    where the exponential race, argmax p(x) / E_x with V exponentials, took 69 (Xeon-AMX-FP16)."""
    if probs.device.type == "cpu" and sampling_kernel.available().ok:  # u drawn there as ``_draw`` draws it
        return sampling_kernel.module().draw_rows(probs, [generator])[0]
    return int(_draw(probs, generator))


DRAW_BLOCK = 128  # tokens a block on the CPU (``draw``); vocabularies of 8,192, 32,000 and 128,256 are multiples


def _draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    u = torch.rand(1, dtype=torch.float64, generator=generator, device=probs.device)
    if probs.device.type != "cpu":
        c = probs.double().cumsum(-1)  # [V]
        return _last_positive(c, torch.searchsorted(c, u * c[-1], right=True)[0])
    return torch.tensor(inverse_cdf(probs.detach().numpy(), float(u)))


def inverse_cdf(x: np.ndarray, u: float) -> int:
    """``draw``'s token on the CPU: x [V] the probabilities, u in [0, 1). The block whose running sum first
    exceeds u·C(V), then the token in it; where rounding puts u·C(V) at a sum's end, the last token with mass."""
    if len(x) % DRAW_BLOCK:
        x = np.concatenate([x, np.zeros(DRAW_BLOCK - len(x) % DRAW_BLOCK, dtype=x.dtype)])
    cb = np.cumsum(x.reshape(-1, DRAW_BLOCK).sum(axis=1, dtype=np.float64))  # [V / DRAW_BLOCK] sums up to each block
    v = u * cb[-1]
    j = min(int(np.searchsorted(cb, v, side="right")), int(np.searchsorted(cb, cb[-1], side="left")))
    cw = np.cumsum(x[j * DRAW_BLOCK:(j + 1) * DRAW_BLOCK], dtype=np.float64)  # [DRAW_BLOCK] within block j
    w = v - (cb[j - 1] if j else 0.0)
    i = min(int(np.searchsorted(cw, w, side="right")), int(np.searchsorted(cw, cw[-1], side="left")))
    return j * DRAW_BLOCK + i


def _last_positive(c: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """Index i into running sums c [V], or the last token with mass where rounding put u·C(V) at C(V)."""
    return torch.minimum(i, torch.searchsorted(c, c[-1:], right=False)[0])


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator: seeded when asked, otherwise from fresh OS entropy (never the global RNG)."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def exponentials(n: int, generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """n i.i.d. Exp(1) draws [n] from ``generator``, as -log(U): argmax_x p(x) / E_x picks x with probability
    p(x), and the m largest of p(x) / E_x are m draws without replacement (drafters/tree_expand.py). U = 0
    (probability 2^-24 per draw) gives E = inf, which only makes that token lose this one race."""
    return torch.rand(n, generator=generator, device=device).log_().neg_()
