"""Adapt a draft model to parallel drafting (PARD, AMD 2025): ``specdec distill --method pard``.

A parallel draft reads the history followed by k - 1 mask tokens and predicts draft j + 1 at mask j
(drafters/pard.py). This teaches a draft that: it adds one mask token (a new embedding row, id =
the old row count, TensorRT-LLM's default) unless the draft has one, then trains next-token
cross-entropy on the text (the target's own continuations: sequence-level distillation, as PARD
trains on target-generated answers) over PARD's layout, built per window of L tokens:

    copy 0: the window's tokens at positions 0..L-1, causal, labels the next tokens (the usual LM loss)
    copy i (1 <= i < K): a mask at position p stands for "tokens 0..p-i, then i masks": it sees the
            real tokens at positions <= p - i and the masks of copies 1..i at positions p-i+1..p,
            and its label is token p + 1

all in one forward with a block attention mask. PARD's conditional drop keeps training near one
pass: copy i keeps max(r^i, r_min) of the positions (r = ``drop_ratio``), drawn only among those
whose chain of earlier masks (copy i-1 at p-1, ...) was kept.

Steps: 1. processes; 2. the draft's tokenizer and 3. the text in it; 4. the draft, with its mask
token; 5. resume if asked and 6. train, both in ``loop.run_loop``; 7. save the folder with
``pard_token`` / ``pard_max_k`` in config.json and a model card; 8. with ``--target``, measure the
saved draft's acceptance (parallel drafting, k fixed) on held-out prompts.

    python -m specdec.training.pard --init-draft specdec/demo-draft --data KD_TEXT --out OUT [options]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdec.training import distributed
from specdec.training.acceptance import draft_acceptance, format_acceptance
from specdec.training.data import TokenWindows, describe_sources
from specdec.training.finetune import loop_facts, start_from
from specdec.training.loop import (RunConfig, add_loop_args, fields_from_args, launch_command, loop_config_from_args,
                                   run_loop)
from specdec.training.model_card import write_model_card
from specdec.training.train import export_hf_folder

EVAL_SEED = 1234  # the held-out loss's conditional drop: the same positions at every evaluation
ACCEPT_PROMPT_LEN = 128


@dataclass(kw_only=True)
class PardConfig(RunConfig):
    """What to adapt (see :class:`RunConfig` for data, output and the loop)."""

    init_draft: str  # a Hugging Face folder: the draft's weights and tokenizer
    max_k: int = 8  # K: drafts per forward it learns (1 + masks); PARD's para_num
    drop_ratio: float = 0.7  # conditional drop: copy i keeps max(drop_ratio^i, drop_min) of its positions
    drop_min: float = 0.2
    target: str | None = None  # for the final acceptance report (None: skip it)
    accept_prompts: int = 8
    accept_k: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (Path(self.init_draft) / "config.json").exists():
            raise ValueError(f"init_draft {self.init_draft!r} is not a Hugging Face model folder (no config.json); "
                             "pass the draft's folder, e.g. specdec/assets/demo-draft")
        if not 1 <= self.max_k <= 32:
            raise ValueError(f"max_k must be in 1..32 (drafts per forward the draft learns), got {self.max_k}")
        if not (0 < self.drop_ratio <= 1 and 0 <= self.drop_min <= 1):
            raise ValueError(f"drop_ratio must be in (0, 1] and drop_min in [0, 1], got {self.drop_ratio} "
                             f"and {self.drop_min} (1 and 1: no drop)")
        if self.max_k > self.seq_len:
            raise ValueError(f"max_k {self.max_k} exceeds seq_len {self.seq_len}")
        if self.accept_prompts < 0 or not 1 <= self.accept_k <= self.max_k:
            raise ValueError(f"accept_prompts must be >= 0 and accept_k in 1..max_k ({self.max_k})")


@dataclass
class PardBatch:
    """PARD's layout of a batch of windows: N kept (copy, position) slots per row."""

    input_ids: torch.Tensor  # [B, N] a token (copy 0) or the mask (copies >= 1); padding: the mask
    position_ids: torch.Tensor  # [B, N] each slot's position in its window
    attention_mask: torch.Tensor  # [B, 1, N, N] 0 where a slot may attend, -inf elsewhere
    labels: torch.Tensor  # [B, N] the token each slot predicts; -100: none (padding)

    def to(self, device) -> PardBatch:
        return PardBatch(*(t.to(device) for t in (self.input_ids, self.position_ids, self.attention_mask, self.labels)))


def keep_counts(length: int, max_k: int, ratio: float, minimum: float) -> list[int]:
    """Slots kept per copy for windows of ``length`` tokens: all of copy 0, then max(ratio^i, minimum)."""
    return [length] + [int(length * max(ratio**i, minimum)) for i in range(1, max_k)]


def pard_layout(windows: torch.Tensor, max_k: int, mask_token_id: int, ratio: float, minimum: float,
                rng: np.random.Generator) -> PardBatch:
    """``windows`` [B, L + 1] (inputs w[:-1], labels w[1:]) -> PARD's conditional-drop layout."""
    B, L = windows.shape[0], windows.shape[1] - 1
    counts = keep_counts(L, max_k, ratio, minimum)
    rows = []
    for _ in range(B):
        slots = [(0, p) for p in range(L)]  # (copy, position)
        kept = np.arange(L)
        for i in range(1, max_k):
            # copy i at p needs copy i-1 at p-1 (and so on down to a real token at p-i)
            pool = kept[(kept + 1 < L) & (kept + 1 >= i)] + 1 if i > 1 else np.arange(1, L)
            kept = np.sort(rng.choice(pool, size=min(counts[i], len(pool)), replace=False)) if len(pool) else pool
            if not len(kept):
                break
            slots += [(i, int(p)) for p in kept]
        rows.append(slots)
    N = max(len(s) for s in rows)
    input_ids = torch.full((B, N), mask_token_id, dtype=torch.long)
    position_ids = torch.zeros(B, N, dtype=torch.long)
    labels = torch.full((B, N), -100, dtype=torch.long)
    allowed = torch.zeros(B, N, N, dtype=torch.bool)
    for b, slots in enumerate(rows):
        copy = torch.tensor([c for c, _ in slots])  # [n]
        pos = torch.tensor([p for _, p in slots])  # [n]
        n = len(slots)
        input_ids[b, :n] = torch.where(copy == 0, windows[b, pos], mask_token_id)
        position_ids[b, :n] = pos
        labels[b, :n] = windows[b, pos + 1]
        qc, qp, kc, kp = copy[:, None], pos[:, None], copy[None, :], pos[None, :]
        # a real token sees real tokens up to p - qc; a mask of copy kc >= 1 on the query's own chain
        # (position qp - qc + kc, copies 1..qc) is seen too; a real token's query (qc = 0) is causal
        sees_real = (kc == 0) & (kp <= qp - qc)
        sees_mask = (kc >= 1) & (kc <= qc) & (kp == qp - qc + kc)
        allowed[b, :n, :n] = sees_real | sees_mask
        allowed[b, n:, n:] = torch.eye(N - n, dtype=torch.bool)  # padding sees itself only
    mask = torch.zeros(B, 1, N, N).masked_fill(~allowed[:, None], float("-inf"))
    return PardBatch(input_ids, position_ids, mask, labels)


def pard_loss(model: torch.nn.Module, batch: PardBatch, bf16: bool) -> torch.Tensor:
    """Mean cross-entropy over the layout's labelled slots."""
    with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                       attention_mask=batch.attention_mask).logits  # [B, N, V]
    return F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(), ignore_index=-100)


def add_mask_token(model) -> int:
    """The draft's mask token: the one its config names, else a new embedding row (resized, the mean of
    the others) whose id is the old row count. Returns its id."""
    if isinstance(getattr(model.config, "pard_token", None), int):
        return model.config.pard_token
    rows = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(rows + 1)  # mean_resizing: the new row starts at the rows' mean
    return rows


def pard(cfg: PardConfig) -> dict:
    """Adapt ``cfg.init_draft`` to parallel drafting on ``cfg.data``; returns the run's summary."""
    # 1. Processes, 2. the draft's tokenizer, 3. the text in it, 4. the draft (finetune.start_from),
    #    with its mask token.
    start = start_from(cfg, cfg.init_draft, "pard.log")
    d, log, bf16, tokenizer, text, model = start.d, start.log, start.bf16, start.tokenizer, start.text, start.model
    sampler, val_windows = text.sampler, text.val_windows  # val_windows: [n, seq_len + 1] or None
    mask = add_mask_token(model)
    model.config.pard_token, model.config.pard_max_k = mask, cfg.max_k
    model = model.to(d.device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"draft: {n_params / 1e6:.2f}M parameters from {cfg.init_draft}; mask token {mask}, K = {cfg.max_k}, "
        f"slots per window {sum(keep_counts(cfg.seq_len, cfg.max_k, cfg.drop_ratio, cfg.drop_min)):,} "
        f"for {cfg.seq_len} tokens")

    # 5. Resume if asked, and 6. train with periodic eval and checkpoints.
    def layout(windows: torch.Tensor, rng: np.random.Generator) -> PardBatch:
        return pard_layout(windows.cpu(), cfg.max_k, mask, cfg.drop_ratio, cfg.drop_min, rng).to(d.device)

    def batch(step: int, micro: int) -> PardBatch:
        # the dropped slots depend only on (seed, rank, step, micro): a resumed run replays them
        rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, d.rank, step, micro]))
        return layout(sampler.batch(cfg.batch_size, step, micro), rng)

    def loss(m, x) -> torch.Tensor:  # x: a training PardBatch, or held-out windows [n, seq_len + 1]
        if isinstance(x, torch.Tensor):
            x = layout(x, np.random.default_rng(EVAL_SEED))
        return pard_loss(m, x, bf16)

    r = run_loop(cfg, d, log, model, sampler, batch, loss, val_windows)
    summary = r.summary("loss", parameters=n_params, mask_token_id=mask, train_tokens=len(text.train_tokens),
                        held_out_tokens=len(text.val_tokens), bf16=bf16)

    # 7. The folder, its config naming the mask token and K, and 8. the acceptance report.
    if d.is_main:
        out = export_hf_folder(model, tokenizer, Path(cfg.out), cfg.save_dtype)
        log(f"saved {cfg.save_dtype} parallel draft to {out}")
        plen = min(ACCEPT_PROMPT_LEN, cfg.seq_len // 2)
        if cfg.target and cfg.accept_prompts and len(text.val_tokens) > plen + 1:
            prompts = TokenWindows(text.val_tokens, plen).fixed(cfg.accept_prompts)[:, :plen]
            summary["held_out_acceptance"] = draft_acceptance(cfg.target, str(out), prompts.tolist(), k=cfg.accept_k,
                                                              max_tokens=plen // 2, device=str(d.device),
                                                              parallel_drafting=True)
            log(f"held-out {format_acceptance(summary['held_out_acceptance'])}")
        write_pard_card(out, cfg, summary)
    d.barrier()
    distributed.teardown(d)
    return summary


def write_pard_card(out: Path, cfg: PardConfig, summary: dict) -> Path:
    counts = keep_counts(cfg.seq_len, cfg.max_k, cfg.drop_ratio, cfg.drop_min)
    facts = {
        "architecture": "LlamaForCausalLM (parallel draft, PARD)",
        "initialised from": f"`{cfg.init_draft}` (its card says how it was made)",
        "parameters": summary["parameters"],
        "mask token (config.json `pard_token`)": summary["mask_token_id"],
        "drafts per forward trained (config.json `pard_max_k`)": cfg.max_k,
        "conditional drop": f"copy i keeps max({cfg.drop_ratio:g}^i, {cfg.drop_min:g}) of its positions: "
        f"{sum(counts):,} slots per {cfg.seq_len}-token window",
        "objective": "next-token cross-entropy at the real tokens and at every kept mask",
        "data": describe_sources(cfg.data),
        "train / held-out tokens": f"{summary['train_tokens']:,} / {summary['held_out_tokens']:,}",
        **loop_facts(cfg, summary),
    }
    if "held_out_acceptance" in summary:
        facts["greedy acceptance on held-out prompts (parallel drafting)"] = format_acceptance(
            summary["held_out_acceptance"])
    text = (f"`{cfg.init_draft}` adapted to parallel drafting with `specdec distill --method pard`: after the "
            "history it reads k - 1 mask tokens and proposes k drafts from one forward. Use it with "
            '`speculative_config={"method": "draft_model", "model": ..., "parallel_drafting": true}` '
            f"and num_speculative_tokens up to {cfg.max_k}.")
    return write_model_card(out, f"specdec parallel draft: {out.name}", text, facts, cfg.command)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec distill --method pard",
                                description="Adapt a draft model to parallel drafting (PARD) on the target's text.")
    add_loop_args(p)
    p.add_argument("--init-draft", required=True, help="the draft's Hugging Face folder (weights and tokenizer)")
    p.add_argument("--max-k", type=int, default=8, help="drafts per forward it learns (1 + masks)")
    p.add_argument("--drop-ratio", type=float, default=0.7, help="conditional drop: copy i keeps ratio^i ...")
    p.add_argument("--drop-min", type=float, default=0.2, help="... but at least this share of its positions")
    p.add_argument("--target", default=None, help="measure the saved draft's acceptance by this target")
    p.add_argument("--accept-prompts", type=int, default=8, help="held-out prompts for the acceptance report")
    p.add_argument("--accept-k", type=int, default=4)
    return p


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    own = fields_from_args(a, "init_draft max_k drop_ratio drop_min target accept_prompts accept_k")
    return pard(PardConfig(**loop_config_from_args(a), **own,
                           command=launch_command("specdec.distill --method pard", argv)))


if __name__ == "__main__":
    main()
