"""Train an EAGLE-3 draft head (specdec/models/eagle3.py) on a frozen target's own hidden states and logits.

The head reads the inputs of three target layers (``layer_ids``, Hugging Face's ``hidden_states[L]``),
concatenated [3 * Dt] and fused by ``fc``, plus the target's (frozen) token embedding; its own LM head
covers a reduced draft vocabulary: the ``--draft-vocab`` tokens that carry the most of the target's
probability mass over the training windows (draft id i is target id ``i + d2t[i]``, as EAGLE-3 stores it).

The loss is EAGLE-3's training-time test: ``--ttt-steps`` draft steps unrolled per position p, step 0
reading (fc(features of p), token p + 1), step j reading (step j - 1's pre-norm output, token p + 1 + j)
at position id p + j, attending to step 0's keys at positions <= p and to its own earlier steps' keys of
the same p (exactly what a chain sees at inference). Step j's target is the target's distribution at
position p + 1 + j on the draft vocabulary (forward KL over the target's top-k tokens plus one bucket for
the rest of its mass, so the head learns the target's spread and not only its order), weighted 0.8 ** j.

Windows never cross a document boundary (a document's last piece is padded and its padding never
scored). Two ways to tame the few feature dimensions that run hundreds of times larger than the rest:
``--norm-before-fc`` (an RMSNorm over the fused states, a config key vLLM and llama.cpp read) and
``--scale-features`` (fc trained on features / their per-dimension RMS, folded into fc when saved, so
the head's format does not change).

The target is frozen, so its features and top-k logits are computed once per window into memory, and the
epochs run over that cache: on one CPU thread that is what makes a head for a 28M target train in under
an hour. Steps: 1. processes; 2. target; 3. windows and the cache; 4. draft vocabulary and head (its LM
head and final norm start from the target's); 5./6. resume and train in ``loop.run_loop`` (DDP over the
head under torchrun); 7. save the head; 8. acceptance per position on held-out prompts.

    python -m specdec.training.distill --method eagle3 --target TARGET --data stdlib --out HEAD
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.models.eagle3 import Eagle3Config, Eagle3Head, default_layer_ids, save_head
from specdec.training import distributed
from specdec.training.acceptance import draft_acceptance, format_acceptance
from specdec.training.data import describe_sources, read_split, tokenize_documents
from specdec.training.draft_calibration import fit_scale, format_fit, write_scale
from specdec.training.loop import (LoopResult, RunConfig, add_loop_args, fields_from_args, launch_command,
                                   loop_config_from_args, run_loop, start_run)
from specdec.training.model_card import write_model_card
from specdec.training.tokenizer import load_tokenizer

MODULE = "specdec.training.distill"  # launched as `distill --method eagle3`


@dataclass(kw_only=True)
class Eagle3TrainConfig(RunConfig):
    """What head to train for which target (see :class:`RunConfig` for data, output and the loop)."""

    target: str
    draft_vocab: int = 0  # rows of the head's LM head; 0: the target's whole vocabulary
    layer_ids: list[int] | None = None  # None: default_layer_ids(target layers)
    intermediate_size: int = 0  # the head's MLP width; 0: the target's
    ttt_steps: int = 7  # draft steps unrolled per position (training-time test)
    step_decay: float = 0.8  # loss weight of step j: step_decay ** j
    argmax_weight: float = 0.0  # plus this x cross-entropy on the target's argmax (what greedy acceptance needs)
    tv_weight: float = 0.0  # plus this x total variation to the target (1 - acceptance at temperature 1)
    topk: int = 32  # target log-probabilities kept per position (soft labels)
    full_labels: bool = False  # soft labels over the whole vocabulary, from the target's cached last state
    max_windows: int = 1024  # training windows cached (0: all; each costs seq_len * 3 * Dt * 2 bytes, 4 * Dt with full_labels)
    cache_batch: int = 8  # windows per target forward while caching
    init_from_target: bool = True  # the head's LM head rows and final norm start as the target's
    init_head: str | None = None  # start from this trained head (its layers; its draft vocabulary, or a wider one)
    norm_before_fc: bool = False  # the head's fc reads an RMSNorm of the features (config key norm_before_fc)
    scale_features: bool = False  # train fc on features / their per-dimension RMS, folded into fc when saved
    accept_prompts: int = 8  # held-out prompts for the final acceptance report (0: skip)
    accept_prompts_file: str | None = None  # a .jsonl of {"prompt": ...} instead of held-out windows
    accept_k: int = 4
    accept_max_tokens: int = 64

    def __post_init__(self) -> None:
        steps, self.max_steps = self.max_steps, max(self.max_steps, 1)  # 0 is allowed here: an untrained head
        super().__post_init__()
        self.max_steps = steps
        if steps < 0:
            raise ValueError(f"max_steps must be >= 0 (0 writes an untrained head), got {steps}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 for an EAGLE-3 head, got {self.seq_len}")
        if self.draft_vocab < 0:
            raise ValueError(f"--draft-vocab must be >= 1 (or 0 for the target's whole vocabulary), got {self.draft_vocab}")
        if not 1 <= self.ttt_steps <= 16:
            raise ValueError(f"--ttt-steps must be in [1, 16], got {self.ttt_steps}")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"--step-decay must be in (0, 1], got {self.step_decay}")
        if self.argmax_weight < 0 or self.tv_weight < 0:
            raise ValueError(f"--argmax-weight and --tv-weight must be >= 0, got {self.argmax_weight} and "
                             f"{self.tv_weight}")
        if self.topk < 1 or self.max_windows < 0 or self.cache_batch < 1 or self.intermediate_size < 0:
            raise ValueError("--topk and --cache-batch must be >= 1, --max-windows and --intermediate-size >= 0")
        if self.norm_before_fc and self.scale_features:
            raise ValueError("--scale-features folds a fixed per-dimension scale into fc, which an RMSNorm before fc "
                             "(--norm-before-fc) does not commute with: pass one of them")
        if self.init_head and self.resume:
            raise ValueError("--init-head starts a new run from a trained head; --resume continues a run from its "
                             "checkpoint: pass one of them")
        if self.accept_prompts < 0 or not 1 <= self.accept_k <= 16 or self.accept_max_tokens < 1:
            raise ValueError("--accept-prompts must be >= 0, --accept-k in [1, 16], --accept-max-tokens >= 1")


# -- the target and its cache -----------------------------------------------------------------------


def load_target(name: str, device: torch.device):
    """The target as a frozen transformers model (fp32 master weights) and its folder."""
    from transformers import AutoModelForCausalLM

    from specdec.models.resolve import find_gguf, resolve_model_path

    if find_gguf(name):
        raise ValueError(f"target {name!r} is a GGUF file: training reads the target with transformers; pass the "
                         "Hugging Face folder it was converted from (the head then works for both)")
    path = resolve_model_path(name)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    return target.requires_grad_(False), path


@dataclass
class FeatureCache:
    """The frozen target's view of N windows of T tokens, computed once (train windows first, then held-out)."""

    tokens: torch.Tensor  # [N, T] long
    features: torch.Tensor  # [N, T, 3 * Dt] bf16: hidden_states[L] for L in layer_ids, concatenated
    top_ids: torch.Tensor  # [N, T, K] long: the target's K likeliest next tokens after position t
    top_logp: torch.Tensor  # [N, T, K] float32: their log-probabilities (over the whole vocabulary)
    lengths: torch.Tensor  # [N] long: real tokens of each window (the rest is padding, never scored)
    n_train: int
    last: torch.Tensor | None = None  # [N, T, Dt] bf16: the target's final (normed) state; its LM head gives p

    def gather(self, idx: torch.Tensor, device) -> tuple[torch.Tensor | None, ...]:
        """(tokens, features, top_ids, top_logp, lengths, last) of windows ``idx``: TTTModel.forward's arguments."""
        idx = idx.cpu()
        return tuple(None if t is None else t[idx].to(device)
                     for t in (self.tokens, self.features, self.top_ids, self.top_logp, self.lengths, self.last))


@torch.no_grad()
def build_cache(target, windows: torch.Tensor, lengths: torch.Tensor, n_train: int, layer_ids: list[int], topk: int,
                batch: int, bf16: bool, device, log, keep_last: bool = False) -> FeatureCache:
    """Run the target over ``windows`` [N, T] once: kept layer inputs and top-k log-probabilities (the
    padding past each window's ``lengths`` [N] comes after its real tokens, so causal attention keeps
    it out of them); with ``keep_last`` also its final normed state, whose LM head product is the logits."""
    N, T = windows.shape
    if not 1 <= topk <= target.config.vocab_size:
        raise ValueError(f"topk must be in 1..{target.config.vocab_size} (the target's vocabulary), got {topk}")
    dt = target.config.hidden_size
    # filled in place (a list of batches and a cat would hold the cache twice at its peak)
    feats = torch.empty(N, T, len(layer_ids) * dt, dtype=torch.bfloat16)
    ids, logps = torch.empty(N, T, topk, dtype=torch.long), torch.empty(N, T, topk)
    lasts = torch.empty(N, T, dt, dtype=torch.bfloat16) if keep_last else None
    t0 = time.time()
    for i in range(0, N, batch):
        x = windows[i:i + batch].to(device)  # [b, T]
        rows = slice(i, i + len(x))
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            out = target(input_ids=x, output_hidden_states=True)
        feats[rows] = torch.cat([out.hidden_states[L] for L in layer_ids], dim=-1).to(torch.bfloat16).cpu()
        v, k = F.log_softmax(out.logits.float(), dim=-1).topk(topk, dim=-1)  # [b, T, K]
        if lasts is not None:
            last = out.hidden_states[-1]  # [b, T, Dt]: Hugging Face's last entry is after the final norm
            if i == 0:
                gap = (target.get_output_embeddings()(last.float()) - out.logits.float()).abs().max().item()
                if gap > 1e-2 * max(1.0, out.logits.float().abs().max().item()):
                    raise ValueError(f"--full-labels: the target's LM head over its last hidden state misses its "
                                     f"logits by {gap:.3g} (a final norm or logit scale outside hidden_states); "
                                     "train with top-k labels (leave --full-labels out)")
            lasts[rows] = last.to(torch.bfloat16).cpu()
        ids[rows], logps[rows] = k.cpu(), v.cpu()
        done = min(i + batch, N)
        if done == N or (i // batch) % 20 == 19:
            log(f"cache: {done}/{N} windows through the target ({done * T / (time.time() - t0):,.0f} tok/s)")
    return FeatureCache(windows.clone(), feats, ids, logps, lengths.clone(), n_train, lasts)


def document_windows(tokens: np.ndarray, eos: int, seq_len: int, limit: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows [n, seq_len] that never cross a document boundary, and their real lengths [n]: each
    document of a flat ``doc EOS doc EOS ...`` array (its EOS included) is cut into pieces of ``seq_len``;
    a shorter last piece (of >= 2 tokens: one position to score) is padded with EOS. ``limit`` > 0
    keeps that many, drawn at random. A window across a boundary would teach the head to predict one
    file from the states of another, which drafting never sees."""
    ends = np.flatnonzero(tokens == eos) + 1
    if not len(ends) or ends[-1] != len(tokens):
        ends = np.append(ends, len(tokens))
    starts, lens = [], []
    prev = 0
    for end in ends.tolist():
        for a in range(prev, end, seq_len):
            if min(end - a, seq_len) >= 2:
                starts.append(a)
                lens.append(min(end - a, seq_len))
        prev = end
    n = len(starts)
    if limit and n > limit:
        keep = np.sort(np.random.default_rng([seed, 7]).choice(n, size=limit, replace=False))
        starts, lens = [starts[i] for i in keep], [lens[i] for i in keep]
    w = np.full((len(starts), seq_len), eos, dtype=np.int64)
    for r, (a, m) in enumerate(zip(starts, lens)):
        w[r, :m] = tokens[a:a + m]
    return torch.from_numpy(w), torch.tensor(lens, dtype=torch.long)


def feature_rms(features: torch.Tensor, lengths: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Per-dimension RMS of ``features`` [N, T, F] over each window's real positions (``lengths`` [N])  [F]
    float32 (at least 1e-3). A few dimensions of a target's layer inputs run hundreds of times larger
    than the rest; fc trained on features divided by this sees them all at one scale."""
    sq = torch.zeros(features.shape[-1], dtype=torch.float64)
    n = 0
    for i in range(0, len(features), chunk):
        f = features[i:i + chunk].float()  # [c, T, F]
        real = torch.arange(f.shape[1])[None] < lengths[i:i + chunk, None]  # [c, T]
        sq += f[real].pow(2).sum(0).double()
        n += int(real.sum())
    return (sq / max(n, 1)).sqrt().float().clamp(min=1e-3)


def choose_draft_vocab(top_ids: torch.Tensor, top_logp: torch.Tensor, vocab_size: int, n: int,
                       keep: torch.Tensor | None = None) -> torch.Tensor:
    """The ``n`` target ids with the most target probability mass over the cached positions (ties: lower id),
    sorted ascending  [n] long; ids ``keep`` (a head's vocabulary being widened) first, whatever their mass.
    Mass, not argmax counts: sampling at temperature 1 draws from all of it."""
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    mass.index_add_(0, top_ids.flatten().clamp(max=vocab_size - 1), top_logp.flatten().double().exp())
    if keep is not None:
        mass[keep] = float("inf")
    order = torch.sort(-mass, stable=True).indices[:n]
    return order.sort().values


class CacheSampler:
    """Which cached training windows a micro-batch gets: epochs of a seeded permutation, a function of
    (seed, step, micro, rank) only, so a resumed run replays the same batches."""

    def __init__(self, n_train: int, batch_size: int, grad_accum: int, world_size: int, rank: int, seed: int):
        if n_train < 1:
            raise ValueError("no training windows: the corpus is shorter than one --seq-len window")
        self.n, self.bs, self.accum, self.world, self.rank, self.seed = n_train, batch_size, grad_accum, world_size, rank, seed

    def batch(self, batch_size: int, step: int, micro: int = 0) -> torch.Tensor:
        first = ((step * self.accum + micro) * self.world + self.rank) * batch_size
        s = np.arange(first, first + batch_size)
        out = np.empty(batch_size, dtype=np.int64)
        for epoch in np.unique(s // self.n):
            perm = np.random.default_rng([self.seed, int(epoch)]).permutation(self.n)
            sel = s // self.n == epoch
            out[sel] = perm[s[sel] % self.n]
        return torch.from_numpy(out)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "n_train": self.n}

    def check_state(self, state: dict) -> None:
        if state != self.state_dict():
            raise ValueError(f"checkpoint sampler state {state} does not match this run's {self.state_dict()}: "
                             "resume with the same data, --seq-len, --max-windows and --seed")


# -- the training-time test -------------------------------------------------------------------------


def ttt_mask(P: int, j: int, device) -> torch.Tensor:
    """Attention of step j's queries [P] over step 0's keys [P] then steps 1..j's [P each]: causal over
    step 0, the diagonal (same position) over the later steps  [P, P * (j + 1)] bool."""
    causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
    eye = torch.eye(P, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * j, dim=1)


def shift(x: torch.Tensor, j: int) -> torch.Tensor:
    """[B, T, ...] -> [B, T - 1, ...]: what step j at position p reads or is scored against, x[:, p + 1 + j]
    (padded at the end)."""
    return F.pad(x[:, 1 + j:], (0, 0) * (x.dim() - 2) + (0, j))


class TTTModel(nn.Module):
    """The head plus its training-time-test loss; the module DDP wraps (forward = the loss)."""

    shift = staticmethod(shift)  # for callers that hold a model (draft_calibration), not this module

    def __init__(self, head: Eagle3Head, ttt_steps: int, step_decay: float, argmax_weight: float = 0.0,
                 tv_weight: float = 0.0):
        super().__init__()
        self.head, self.steps, self.decay, self.argmax_weight = head, ttt_steps, step_decay, argmax_weight
        self.tv_weight = tv_weight
        c = head.config
        index = torch.full((c.vocab_size,), -1, dtype=torch.long)
        index[head.draft_to_target] = torch.arange(c.draft_vocab_size)
        self.register_buffer("to_draft", index, persistent=False)  # target id -> draft id, -1 outside
        # fc reads features * feature_scale [3 Dt] while training (1: unscaled); fold_feature_scale moves it into
        # fc. Kept in checkpoints, so a head can be taken from any of them (head_from_checkpoint)
        self.register_buffer("feature_scale", torch.ones(head.fc.in_features))
        self.register_buffer("label_head", None, persistent=False)  # [V, Dt] float32: the target's LM head (full labels)

    def set_label_head(self, weight: torch.Tensor) -> None:
        """Score against the target's whole distribution, made from its cached last state by ``weight`` [V, Dt]."""
        self.label_head = weight.detach().float().clone()

    def fold_feature_scale(self) -> None:
        """fc(x * s) == fc'(x) with fc' = fc.weight * s: the saved head reads the target's features as they are."""
        with torch.no_grad():
            self.head.fc.weight.mul_(self.feature_scale.to(self.head.fc.weight.dtype))
        self.feature_scale.fill_(1.0)

    def labels(self, top_ids: torch.Tensor, top_logp: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Soft labels over the draft vocabulary: draft ids [..., K] (0 where outside), whether each is inside
        [..., K], their probabilities [..., K] (0 outside), the rest [...] (the target's mass beyond its top K,
        which falls on the draft vocabulary's other tokens), renormalised together over what the draft
        vocabulary holds, and whether it holds any [...]. Keeping the rest, rather than renormalising over
        the top K, keeps the head as spread as the target: acceptance at temperature 1 depends on it."""
        didx = self.to_draft[top_ids.clamp(max=self.to_draft.numel() - 1)]  # [..., K]
        inside = didx >= 0
        full = top_logp.float().exp()
        p = full * inside
        rest = (1 - full.sum(-1)).clamp(min=0)  # [...]
        z = (p.sum(-1) + rest).clamp(min=1e-12)
        return didx.clamp(min=0), inside, p / z[..., None], rest / z, p.sum(-1) > 0

    def full_labels(self, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's log-probabilities over its whole vocabulary ``logp`` [..., V] -> its distribution on
        the draft vocabulary, renormalised [..., Vd], and whether that holds any mass [...]."""
        p = logp[..., self.head.draft_to_target].exp()  # [..., Vd]
        z = p.sum(-1)
        return p / z.clamp(min=1e-12)[..., None], z > 0

    def unroll(self, tokens: torch.Tensor, features: torch.Tensor, lengths: torch.Tensor | None = None):
        """The training-time test's steps over windows tokens [B, T] with features [B, T, 3Dt] (lengths [B]:
        real tokens per window; None: all T): yields, for j = 0, 1, ..., step j's draft-vocabulary logits
        [B, P, Vd] (P = T - 1), where they are scored [B, P] and its pre-norm output g [B, P, D]. Step j at position p reads token p + 1 + j
        and guesses the token after it; a position is scored while token p + 1 + j is within the window's
        real length."""
        head = self.head
        B, T = tokens.shape
        P = T - 1
        dev = tokens.device
        h = head.fuse(features[:, :P] * self.feature_scale.to(features.dtype))  # [B, P, D]
        past_k = past_v = None
        base = torch.arange(P, device=dev)
        real = T if lengths is None else lengths.to(dev)[:, None]  # [B, 1]: token p + 1 + j must be < this
        for j in range(min(self.steps, P)):
            logits, h, k, v = head.step(shift(tokens, j), h, (base + j).expand(B, P), past_k, past_v,
                                        ttt_mask(P, j, dev).expand(B, P, P * (j + 1)))  # h: step j's g
            past_k = k if past_k is None else torch.cat([past_k, k], dim=2)
            past_v = v if past_v is None else torch.cat([past_v, v], dim=2)
            yield logits, (base[None] + 1 + j < real).expand(B, P), h

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor,
                lengths: torch.Tensor | None = None, last: torch.Tensor | None = None, stats: bool = False):
        """Weighted sum over steps of the mean forward KL; with ``stats`` also per-step figures.

        tokens [B, T], features [B, T, 3Dt], top_ids / top_logp [B, T, K] (the target's next-token
        distribution after each position), lengths [B] (real tokens per window; None: all T), last
        [B, T, Dt] (the target's final state: with ``set_label_head``, the labels are its whole distribution
        instead of top K and a rest). Step j at position p (0 <= p < P = T - 1) is scored against the
        distribution after position p + 1 + j (``unroll``).
        """
        B, T = tokens.shape
        total = tokens.new_zeros((), dtype=torch.float32)
        figs = []
        alive = torch.ones(B, T - 1, dtype=torch.bool, device=tokens.device)
        full = None  # the whole distribution on the draft vocabulary after each position, once a batch
        if last is not None and self.label_head is not None:
            with torch.autocast(last.device.type, enabled=False):  # labels in float32
                full = self.full_labels(F.log_softmax(last.float() @ self.label_head.T, dim=-1))  # [B, T, Vd], [B, T]
        for j, (logits, in_range, _) in enumerate(self.unroll(tokens, features, lengths)):
            logq_all = F.log_softmax(logits, dim=-1)  # [B, P, Vd]
            if full is not None:
                p, held = shift(full[0], j), shift(full[1], j)  # [B, P, Vd], [B, P]
                q = logq_all.float().exp()
                kl = (p * (torch.log(p.clamp(min=1e-12)) - logq_all)).sum(-1)  # [B, P]
                q_off = rest = None
            else:  # top K and one bucket for the rest
                didx, inside, p, rest, held = self.labels(shift(top_ids, j), shift(top_logp, j))  # [B, P, K] x3, [B, P] x2
                logq = logq_all.gather(-1, didx)  # [B, P, K]
                q = logq.exp() * inside  # [B, P, K]: the head's q at the target's top K (0 outside its vocabulary)
                q_off = 1 - q.sum(-1)  # [B, P]: the head's mass off the target's top K
                q_rest = q_off.clamp(min=1e-6)
                kl = ((p * (torch.log(p.clamp(min=1e-12)) - logq)).sum(-1)
                      + rest * (torch.log(rest.clamp(min=1e-12)) - torch.log(q_rest)))  # [B, P]: KL of (top K, rest)
            valid = held & in_range
            n = valid.sum().clamp(min=1)
            step_loss = (kl * valid).sum() / n
            if self.argmax_weight:  # the target's greedy token, where the draft vocabulary has it
                top1 = self.to_draft[shift(top_ids, j)[..., 0]]  # [B, P]
                hard = valid & (top1 >= 0)
                ce = -logq_all.gather(-1, top1.clamp(min=0)[..., None])[..., 0]  # [B, P]
                step_loss = step_loss + self.argmax_weight * (ce * hard).sum() / hard.sum().clamp(min=1)
            if self.tv_weight:  # sum min(p, q) = 1 - TV is a sampled draft's acceptance: the same buckets as the KL
                tv = 0.5 * (p - q).abs().sum(-1)  # [B, P]
                if rest is not None:
                    tv = tv + 0.5 * (rest - q_off).abs()
                step_loss = step_loss + self.tv_weight * (tv * valid).sum() / n
            total = total + self.decay ** j * step_loss
            if stats:
                with torch.no_grad():
                    top1 = self.to_draft[shift(top_ids, j)[..., 0]]  # the target's greedy token, as a draft id
                    hit = logits.argmax(-1) == top1
                    alive = alive & hit
                    m = in_range.sum().clamp(min=1).item()
                    figs.append({"kl": step_loss.item(), "top1": (hit & in_range).sum().item() / m,
                                 "chain": (alive & in_range).sum().item() / m})
        return (total, figs) if stats else total


@torch.no_grad()
def teacher_forced_stats(model: TTTModel, cache: FeatureCache, idx: torch.Tensor, batch: int, device) -> list[dict]:
    """Per step on windows ``idx``: KL, how often the head's top token is the target's (top1), and how often
    steps 0..j all are (chain: the share of positions a greedy chain of j + 1 drafts survives when the text
    is the target's own greedy output). An estimate that needs no engine; the engine's figure is the real one."""
    was = model.training
    model.eval()
    sums: list[dict] = []
    n = 0
    for i in range(0, len(idx), batch):
        chunk = idx[i:i + batch]
        _, figs = model(*cache.gather(chunk, device), stats=True)
        if not sums:
            sums = [dict.fromkeys(f, 0.0) for f in figs]
        for s, f in zip(sums, figs):
            for key in f:
                s[key] += f[key] * len(chunk)
        n += len(chunk)
    model.train(was)
    return [{key: v / max(n, 1) for key, v in s.items()} for s in sums]


def format_stats(figs: list[dict]) -> str:
    tau = 1 + sum(f["chain"] for f in figs)
    return ("top1 per step " + " / ".join(f"{f['top1']:.2f}" for f in figs) + "; chain " +
            " / ".join(f"{f['chain']:.2f}" for f in figs) + f"; teacher-forced tau {tau:.2f} (k={len(figs)})")


# -- acceptance through the engine ------------------------------------------------------------------


def read_prompts_file(path: str) -> list[str]:
    lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return [x["prompt"] if isinstance(x, dict) else x for x in lines]


# -- the run ----------------------------------------------------------------------------------------


def train_eagle3(cfg: Eagle3TrainConfig) -> dict:
    # 1. Processes.
    d, log, bf16 = start_run(cfg, "eagle3.log")
    t_start = time.time()

    # 2. Target, frozen, and its tokenizer.
    target, target_path = load_target(cfg.target, d.device)
    tc = target.config
    vocab, n_layers = tc.vocab_size, tc.num_hidden_layers
    layer_ids = list(cfg.layer_ids) if cfg.layer_ids else default_layer_ids(n_layers)
    init = None
    if cfg.init_head:  # a trained head to go on from: its layers and vocabulary stand (``init_head``)
        init = init_head(cfg, target, n_layers, vocab)
        layer_ids = list(init.config.layer_ids)
    if len(layer_ids) != 3 or not all(0 <= L < n_layers for L in layer_ids):
        raise ValueError(f"--layer-ids must be 3 target layers in 0..{n_layers - 1}, got {layer_ids}")
    # asked for (a head's may only widen: init_head), else the head's, else the whole vocabulary
    draft_vocab = cfg.draft_vocab or (init.config.draft_vocab_size if init is not None else vocab)
    if draft_vocab > vocab:
        raise ValueError(f"--draft-vocab {draft_vocab} is larger than the target's vocabulary ({vocab} tokens); "
                         f"pass at most {vocab}, or 0 for all of it")
    topk = min(cfg.topk, vocab)  # soft labels: at most every token the target has
    if topk < cfg.topk:
        log(f"--topk {cfg.topk} is more than the target's vocabulary ({vocab} tokens): keeping all {vocab}")
    tokenizer = load_tokenizer(target_path)
    log(f"target {cfg.target}: {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M parameters, {n_layers} "
        f"layers, vocabulary {vocab}; features from layers {layer_ids}; bf16={bf16}")

    # 3. Windows (within documents, train then held-out) and the target's view of them, once.
    _, (train_texts, val_texts) = read_split(cfg.data, cfg.val_fraction)
    train_tokens = tokenize_documents(train_texts, tokenizer)
    val_tokens = tokenize_documents(val_texts, tokenizer)
    eos = tokenizer.eos_token_id
    train_w, train_len = document_windows(train_tokens, eos, cfg.seq_len, cfg.max_windows, cfg.seed)
    val_w, val_len = document_windows(val_tokens, eos, cfg.seq_len, cfg.eval_windows, cfg.seed)
    if len(train_w) == 0:
        raise ValueError(f"the training data has {len(train_tokens)} tokens, not one document of 2 or more; "
                         "pass more text")
    log(f"data: {len(train_tokens):,} train tokens -> {len(train_w)} windows of <= {cfg.seq_len} within documents "
        f"({int(train_len.sum()):,} tokens); {len(val_tokens):,} held-out tokens -> {len(val_w)} windows")
    t0 = time.time()
    cache = build_cache(target, torch.cat([train_w, val_w]), torch.cat([train_len, val_len]), len(train_w),
                        layer_ids, topk, cfg.cache_batch, bf16, d.device, log, keep_last=cfg.full_labels)
    cache_s = time.time() - t0
    val_idx = torch.arange(len(train_w), len(train_w) + len(val_w)) if len(val_w) else None

    # 4. Draft vocabulary and head.
    n_tr = cache.n_train
    real = torch.arange(cfg.seq_len)[None] < cache.lengths[:n_tr, None]  # [n_tr, T]: not padding
    real_ids, real_logp = cache.top_ids[:n_tr][real], cache.top_logp[:n_tr][real]  # [M, K]
    kept = init.draft_to_target.cpu() if init is not None else None  # [Vd] the head's vocabulary stays in
    draft_ids = choose_draft_vocab(real_ids, real_logp, vocab, draft_vocab, kept)  # [Vd']
    mass = torch.zeros(vocab, dtype=torch.float64)
    mass.index_add_(0, real_ids.flatten(), real_logp.flatten().double().exp())
    del real_ids, real_logp
    coverage = (mass[draft_ids].sum() / mass.sum()).item()
    log(f"draft vocabulary: {draft_vocab} of {vocab} tokens, covering {coverage:.2%} of the target's top-{topk} "
        "probability mass on the training windows")
    torch.manual_seed(cfg.seed)
    if init is None:
        hc = Eagle3Config.for_target(tc, draft_vocab_size=draft_vocab, layer_ids=layer_ids,
                                     intermediate_size=cfg.intermediate_size or None)
        hc.norm_before_fc = cfg.norm_before_fc
        head = Eagle3Head(hc)
        head.set_draft_vocab(draft_ids)
    else:
        if draft_vocab > init.config.draft_vocab_size:
            init = widen_draft_vocab(init, draft_ids, target.get_output_embeddings().weight.detach().float().cpu())
            log(f"--init-head's draft vocabulary widened to {draft_vocab} tokens (new LM head rows: the target's "
                "output rows mapped by a least-squares fit over the kept rows)")
        head, hc = init, init.config
    if cfg.init_from_target and init is None:
        with torch.no_grad():
            head.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids].float().cpu())
            norm = getattr(target.get_decoder(), "norm", None)
            if norm is not None and norm.weight.shape == head.norm.weight.shape:
                head.norm.weight.copy_(norm.weight.float().cpu())
    head.set_embedding(target.get_input_embeddings().weight.detach().float().cpu())
    n_params = sum(p.numel() for p in head.parameters())
    model = TTTModel(head, cfg.ttt_steps, cfg.step_decay, cfg.argmax_weight, cfg.tv_weight)
    if cfg.full_labels:
        model.set_label_head(target.get_output_embeddings().weight)
    if cfg.scale_features:
        model.feature_scale.copy_(1 / feature_rms(cache.features[:n_tr], cache.lengths[:n_tr]))
        s = 1 / model.feature_scale
        if init is not None:  # a saved head's fc reads raw features: fc(x) == (fc.weight * rms)(x / rms)
            with torch.no_grad():
                head.fc.weight.mul_(s.to(head.fc.weight.dtype))
        log(f"features scaled per dimension while training (RMS median {s.median():.3g}, max {s.max():.3g}); "
            "folded into fc when saved")
    model = model.to(d.device)
    log(f"head: {n_params / 1e6:.2f}M trained parameters (hidden {hc.hidden_size}, MLP {hc.intermediate_size}, "
        f"draft vocabulary {draft_vocab}); training-time test over {cfg.ttt_steps} steps")
    del target

    # 5./6. Resume if asked, and train over the cache.
    sampler = CacheSampler(n_tr, cfg.batch_size, cfg.grad_accum, d.world_size, d.rank, cfg.seed)

    def batch(step: int, micro: int) -> torch.Tensor:
        return sampler.batch(cfg.batch_size, step, micro)  # [batch] cache indices

    def loss(m, idx: torch.Tensor) -> torch.Tensor:
        with torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=bf16):
            return m(*cache.gather(idx, d.device))

    if cfg.max_steps:
        r = run_loop(cfg, d, log, model, sampler, batch, loss, val_idx, "loss")
    else:
        log("max_steps 0: writing the untrained head")
        r = LoopResult(0, 0, float("nan"), float("nan"), float("nan"), 0.0, True, d.world_size)
    model.fold_feature_scale()
    summary = r.summary("loss", parameters=n_params, bf16=bf16, draft_vocab=draft_vocab, vocab=vocab, topk=topk,
                        layer_ids=layer_ids, coverage=coverage, train_windows=n_tr, cache_s=cache_s,
                        train_tokens_cached=int(train_len.sum()), norm_before_fc=cfg.norm_before_fc,
                        scale_features=cfg.scale_features)

    # 7. Save the head; 8. how well it drafts on held-out text.
    if d.is_main:
        out = save_head(head, cfg.out, dtype=getattr(torch, cfg.save_dtype))
        size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
        log(f"saved head to {out} ({size / 1e6:.1f} MB)")
        summary["size_mb"] = size / 1e6
        if len(val_w):  # the draft temperature scale, fitted on the held-out windows (training/draft_calibration.py)
            summary["q_scale"] = calibrate(model, cfg.target, val_w, val_len, d.device, out)
            log(f"held-out, q calibration: {format_fit(summary['q_scale'])}")
        if val_idx is not None:
            with torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=bf16):
                figs = teacher_forced_stats(model, cache, val_idx, cfg.batch_size, d.device)
            summary["held_out_steps"] = figs
            log(f"held-out (teacher-forced) {format_stats(figs)}")
        prompts: list = []
        if cfg.accept_prompts and cfg.accept_prompts_file:
            prompts = read_prompts_file(cfg.accept_prompts_file)[: cfg.accept_prompts]
        elif cfg.accept_prompts and len(val_w):
            plen = min(128, cfg.seq_len // 2)
            prompts = [w[:plen].tolist() for w in val_w[: cfg.accept_prompts]]
        if prompts:
            try:
                summary["held_out_acceptance"] = draft_acceptance(cfg.target, str(out), prompts, k=cfg.accept_k,
                                                                  max_tokens=cfg.accept_max_tokens, method="eagle3",
                                                                  backend="torch")
                log(f"held-out, through the engine: {format_acceptance(summary['held_out_acceptance'])}")
            except Exception as e:  # the head is saved; say why there is no figure and write the card
                log(f"held-out acceptance through the engine failed: {type(e).__name__}: {e}")
        summary["total_wall_s"] = time.time() - t_start
        write_eagle3_card(out, cfg, summary)
    d.barrier()
    distributed.teardown(d)
    return summary


def init_head(cfg: Eagle3TrainConfig, target, n_layers: int, vocab: int) -> Eagle3Head:
    """The trained head ``cfg.init_head`` (float32) to go on training from, checked against the target and
    the run's arguments: its layers and draft vocabulary stand, and ``--layer-ids`` / ``--draft-vocab`` /
    ``--intermediate-size`` / ``--norm-before-fc``, where given, must agree with it."""
    from specdec.models.eagle3 import load_head
    from specdec.models.resolve import resolve_model_path

    head = load_head(resolve_model_path(cfg.init_head), target.get_input_embeddings().weight.detach().float().cpu(),
                     n_layers, vocab).train().requires_grad_(True)  # its parameters: the embedding is a buffer
    c = head.config
    given = {"--layer-ids": (cfg.layer_ids, list(c.layer_ids)), "--intermediate-size": (cfg.intermediate_size, c.intermediate_size)}
    for flag, (asked, has) in given.items():
        if asked and asked != has:
            raise ValueError(f"--init-head {cfg.init_head!r} has {flag.removeprefix('--')} {has}, but {flag} asks "
                             f"for {asked}: leave {flag} out (the head's stands) or start from scratch")
    if cfg.draft_vocab and cfg.draft_vocab < c.draft_vocab_size:
        raise ValueError(f"--init-head {cfg.init_head!r} has a draft vocabulary of {c.draft_vocab_size} tokens, but "
                         f"--draft-vocab asks for {cfg.draft_vocab}: a head's vocabulary can be widened, not narrowed; "
                         "leave --draft-vocab out or ask for more")
    if bool(c.norm_before_fc) != cfg.norm_before_fc:
        raise ValueError(f"--init-head {cfg.init_head!r} has norm_before_fc {c.norm_before_fc}; pass --norm-before-fc "
                         "exactly when it does")
    return head


def widen_draft_vocab(head: Eagle3Head, draft_ids: torch.Tensor, target_rows: torch.Tensor) -> Eagle3Head:
    """``head`` with the draft vocabulary ``draft_ids`` [Vd'] (sorted target ids, a superset of the head's):
    every other weight as it was, the LM head's rows of the kept tokens as they were, the new tokens' rows
    the target's output rows ``target_rows`` [V, Dt] mapped into the head's by the least-squares fit of the
    kept rows (held-out cosine ~0.8 on the shipped pair: a start that training corrects, not zeros)."""
    from dataclasses import replace

    kept = head.draft_to_target.cpu()  # [Vd]
    if not bool(torch.isin(kept, draft_ids).all()):
        raise ValueError("widen_draft_vocab: the new draft vocabulary must hold the head's")
    old_rows = head.lm_head.weight.detach().float()  # [Vd, D]
    fit = torch.linalg.lstsq(target_rows[kept], old_rows).solution  # [Dt, D]
    rows = target_rows[draft_ids] @ fit  # [Vd', D]
    where = torch.searchsorted(draft_ids, kept)  # each kept token's new draft id
    rows[where] = old_rows
    c = replace(head.config, draft_vocab_size=len(draft_ids))
    wide = Eagle3Head(c, head.embed_tokens)
    state = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    wide.load_state_dict(state, strict=False)
    with torch.no_grad():
        wide.lm_head.weight.copy_(rows.to(wide.lm_head.weight.dtype))
    wide.set_draft_vocab(draft_ids)
    return wide.train().requires_grad_(True)


def calibrate(model: TTTModel, target_name: str, windows: torch.Tensor, lengths: torch.Tensor, device,
              out: str | Path | None = None) -> dict:
    """Fit the draft temperature scale of ``model``'s head on held-out ``windows`` [N, T] (real lengths [N])
    read by the target (loaded again, float32) and, with ``out``, write it into that folder's config.json."""
    was = model.training
    model.eval()
    target, _ = load_target(target_name, device)
    r = fit_scale(model, target, windows, lengths)
    model.train(was)
    if out is not None:
        write_scale(out, r["scale"])
    return r


def head_from_checkpoint(run_dir: str | Path, out: str | Path, save_dtype: str = "bfloat16") -> Path:
    """The head of a run's last checkpoint (``run_dir/checkpoint.pt``), its feature scale folded into fc,
    written to ``out`` (config.json, model.safetensors): a stopped or unfinished run still gives a head,
    without rebuilding the target's cache."""
    from transformers import AutoConfig

    from specdec.models.resolve import resolve_model_path
    from specdec.training.checkpoint import CHECKPOINT_NAME, load_checkpoint

    path = Path(run_dir) / CHECKPOINT_NAME
    if not path.is_file():
        raise ValueError(f"{str(run_dir)!r} holds no {CHECKPOINT_NAME}; pass the --run-dir of an eagle3 distill run")
    ckpt = load_checkpoint(path)
    cfg, state = ckpt["config"], ckpt["model"]
    if "head.fc.weight" not in state:
        raise ValueError(f"{str(path)!r} is not the checkpoint of an EAGLE-3 head (no head.fc.weight)")
    tc = AutoConfig.from_pretrained(resolve_model_path(cfg["target"]))
    hc = Eagle3Config.for_target(tc, draft_vocab_size=state["head.lm_head.weight"].shape[0],
                                 layer_ids=cfg["layer_ids"] or default_layer_ids(tc.num_hidden_layers),
                                 intermediate_size=state["head.midlayer.mlp.down_proj.weight"].shape[1])
    hc.norm_before_fc = bool(cfg.get("norm_before_fc", False))
    model = TTTModel(Eagle3Head(hc), 1, 1.0)
    model.load_state_dict(state, strict=False)  # feature_scale is absent from checkpoints before it was kept
    model.fold_feature_scale()
    return save_head(model.head, out, dtype=getattr(torch, save_dtype))


def write_eagle3_card(out: Path, cfg: Eagle3TrainConfig, s: dict, notes: str = "") -> Path:
    facts = {
        "architecture": "LlamaForCausalLMEagle3 (EAGLE-3 head: one decoder layer over fused target states)",
        "target": cfg.target,
        "target layers read (inputs of)": ", ".join(map(str, s["layer_ids"])),
        "draft vocabulary": f"{s['draft_vocab']:,} of {s['vocab']:,} tokens ({s['coverage']:.2%} of the target's "
                            "probability mass on the training windows)",
        "trained parameters": s["parameters"],
        **({"initialised from": cfg.init_head} if cfg.init_head else {}),
        "objective": f"training-time test over {cfg.ttt_steps} steps, forward KL to the target's distribution on the "
                     + ("draft vocabulary (all of it, renormalised there)" if cfg.full_labels else
                        f"draft vocabulary (its top {s['topk']} tokens and the rest as one bucket)")
                     + (f" plus {cfg.argmax_weight:g} x cross-entropy on its argmax" if cfg.argmax_weight else "")
                     + (f" plus {cfg.tv_weight:g} x total variation" if cfg.tv_weight else "")
                     + f", step j weighted {cfg.step_decay:g}^j",
        "data": describe_sources(cfg.data),
        "windows cached": f"{s['train_windows']:,} of <= {cfg.seq_len} tokens within documents "
                          f"({s['train_tokens_cached']:,} tokens)",
        "fc input": ("RMSNorm over the fused states (norm_before_fc)" if s.get("norm_before_fc") else
                     "trained on features / their per-dimension RMS, folded into fc" if s.get("scale_features") else
                     "the target's features as they are"),
        "steps (done / planned)": f"{s['steps']:,} / {cfg.max_steps:,}",
        "tokens seen": s["tokens_seen"],
        "precision": ("bf16 autocast" if s["bf16"] else "fp32") + f", saved as {cfg.save_dtype}",
        "wall time": f"{s.get('total_wall_s', 0):.0f} s in all (target cache {s['cache_s']:.0f} s, training "
                     f"{s['wall_time_s']:.0f} s)",
        "first / final train loss": f"{s['first_loss']:.4f} / {s['train_loss']:.4f}",
        "final held-out loss": s["held_out_loss"],
        "files": f"{s.get('size_mb', 0):.1f} MB",
    }
    if "held_out_steps" in s:
        facts["held-out, teacher-forced"] = format_stats(s["held_out_steps"])
    if "q_scale" in s:
        facts["draft temperature scale (config.json specdec_draft_temperature_scale)"] = format_fit(s["q_scale"])
    if "held_out_acceptance" in s:
        facts["held-out acceptance (engine, greedy)"] = format_acceptance(s["held_out_acceptance"])
    text = ("An EAGLE-3 draft head trained with `specdec distill --method eagle3` on the target's own hidden "
            "states and logits. Use it with `speculative_config={\"method\": \"eagle3\", \"model\": ..., "
            "\"num_speculative_tokens\": k}`; the token embedding is the target's and is not stored here.")
    return write_model_card(out, f"specdec EAGLE-3 head: {out.name}", text, facts, cfg.command, notes)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec distill --method eagle3",
                                description="Train an EAGLE-3 draft head on a target's hidden states and logits.")
    p.add_argument("--target", required=True)
    add_loop_args(p)
    p.add_argument("--draft-vocab", type=int, default=0, help="rows of the head's LM head (0: the whole vocabulary)")
    p.add_argument("--layer-ids", default=None, help="3 target layers whose inputs the head reads, e.g. 2,4,5 "
                   "(default: 2, N/2, N-3)")
    p.add_argument("--intermediate-size", type=int, default=0, help="the head's MLP width (0: the target's)")
    p.add_argument("--ttt-steps", type=int, default=7, help="draft steps unrolled per position (training-time test)")
    p.add_argument("--step-decay", type=float, default=0.8, help="loss weight of step j: DECAY ** j")
    p.add_argument("--argmax-weight", type=float, default=0.0,
                   help="add W x cross-entropy on the target's argmax token to each step's KL (greedy acceptance)")
    p.add_argument("--tv-weight", type=float, default=0.0,
                   help="add W x total variation to the target's distribution to each step's KL (1 - TV is the "
                   "acceptance of a draft sampled at temperature 1)")
    p.add_argument("--topk", type=int, default=32, help="target log-probabilities cached per position")
    p.add_argument("--full-labels", action="store_true",
                   help="score each step against the target's whole distribution on the draft vocabulary (its last "
                   "state cached, Dt x 2 bytes a token; the LM head applied a batch at a time) instead of its top "
                   "--topk tokens and one bucket for the rest: the head then learns how the rest is spread, which "
                   "sampled drafts are accepted on")
    p.add_argument("--max-windows", type=int, default=1024, help="training windows cached (0: all)")
    p.add_argument("--cache-batch", type=int, default=8, help="windows per target forward while caching")
    p.add_argument("--no-init-from-target", dest="init_from_target", action="store_false",
                   help="start the LM head and final norm at random instead of from the target's")
    p.add_argument("--init-head", default=None,
                   help="go on from this trained head (a folder or shipped name): its layers stand, and its draft "
                   "vocabulary unless --draft-vocab asks for a wider one; a new optimizer and schedule over this run's data")
    p.add_argument("--norm-before-fc", action="store_true",
                   help="an RMSNorm over the fused target states before fc (config key norm_before_fc; vLLM, "
                   "speculators and llama.cpp read it)")
    p.add_argument("--scale-features", action="store_true",
                   help="train fc on the target's features divided by their per-dimension RMS (folded into fc when "
                   "saved: the head's format does not change)")
    p.add_argument("--accept-prompts", type=int, default=8, help="held-out prompts for the acceptance report (0: skip)")
    p.add_argument("--accept-prompts-file", default=None, help='a .jsonl of {"prompt": ...} for that report')
    p.add_argument("--accept-k", type=int, default=4)
    p.add_argument("--accept-max-tokens", type=int, default=64)
    return p


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    own = fields_from_args(a, "target draft_vocab intermediate_size ttt_steps step_decay argmax_weight tv_weight topk full_labels max_windows cache_batch "
                              "init_from_target init_head norm_before_fc scale_features accept_prompts accept_prompts_file accept_k "
                              "accept_max_tokens")
    if a.layer_ids:
        try:
            own["layer_ids"] = [int(x) for x in a.layer_ids.split(",")]
        except ValueError:
            raise ValueError(f"--layer-ids takes 3 comma-separated integers, got {a.layer_ids!r}") from None
    return train_eagle3(Eagle3TrainConfig(**loop_config_from_args(a), **own,
                                          command=launch_command(MODULE, ["--method", "eagle3", *argv])))


if __name__ == "__main__":
    main()
