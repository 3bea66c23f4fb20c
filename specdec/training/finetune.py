"""Continue training a saved causal LM on new text, e.g. a draft taught on its target's outputs.

A draft whose tokenizer differs from the target's cannot be distilled from the target's logits
(``distill`` needs one vocabulary), but it can learn from the target's *text*: sequence-level
distillation (Kim & Rush 2016), the target's own continuations written as files and read in the
draft's tokenizer. This starts from a Hugging Face folder's weights and tokenizer (``--init-model``)
and runs ``train``'s loop (next-token cross-entropy, the same options) on ``--data``; it writes a
Hugging Face folder with a model card.

    python -m specdec.training.finetune --init-model runs/draft --data target_texts/ --out OUT [options]

Steps: 1. set up processes; 2. the starting folder's tokenizer; 3. tokenize ``--data``; 4. load
the starting weights; 5. resume if asked and 6. train, both in ``loop.run_loop``; 7. save.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specdec.training import distributed
from specdec.training.data import TextSplit, describe_sources, text_split
from specdec.training.loop import (RunConfig, RunLog, add_loop_args, launch_command, loop_config_from_args, run_loop,
                                   start_run)
from specdec.training.model_card import write_model_card
from specdec.training.tokenizer import load_tokenizer
from specdec.training.train import export_hf_folder, lm_loss


@dataclass(kw_only=True)
class FinetuneConfig(RunConfig):
    """Where to start from (see :class:`RunConfig` for data, output and the loop)."""

    init_model: str  # a Hugging Face folder: its weights and its tokenizer

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (Path(self.init_model) / "config.json").exists():
            raise ValueError(f"init_model {self.init_model!r} is not a Hugging Face model folder (no config.json)")


@dataclass
class Start:
    """What a run from a saved folder has after its steps 1-4 (``start_from``)."""

    d: distributed.Dist
    log: RunLog
    bf16: bool
    tokenizer: Any
    text: TextSplit
    model: torch.nn.Module  # in fp32 (the loop's master weights), on the CPU


def start_from(cfg: RunConfig, folder: str, log_name: str) -> Start:
    """Steps 1-4 of a run that continues a saved Hugging Face ``folder`` (finetune, pard): the
    processes, the folder's tokenizer, ``cfg.data`` in it, and the folder's weights, checked against
    the tokenizer and ``cfg.seq_len``."""
    d, log, bf16 = start_run(cfg, log_name)
    log(f"world_size={d.world_size} device={d.device} threads={torch.get_num_threads()} bf16={bf16}")
    tokenizer = load_tokenizer(folder)
    text = text_split(cfg.data, tokenizer, cfg.seq_len, cfg.val_fraction, cfg.eval_windows, cfg.seed, d.rank, log)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if model.config.vocab_size < len(tokenizer):
        raise ValueError(f"{folder}: the model has {model.config.vocab_size} token rows but its tokenizer "
                         f"{len(tokenizer)} tokens; save them together")
    if cfg.seq_len > model.config.max_position_embeddings:
        raise ValueError(f"seq_len {cfg.seq_len} exceeds {folder}'s max_position_embeddings "
                         f"{model.config.max_position_embeddings}")
    return Start(d, log, bf16, tokenizer, text, model)


def finetune(cfg: FinetuneConfig) -> dict:
    """Train ``cfg.init_model`` further on ``cfg.data``; returns a summary dict (losses, tokens, wall time)."""
    # 1. Processes, 2. the starting folder's tokenizer, 3. the new text in it, 4. its weights.
    start = start_from(cfg, cfg.init_model, "finetune.log")
    d, log, bf16, tokenizer, text = start.d, start.log, start.bf16, start.tokenizer, start.text
    sampler, val_windows = text.sampler, text.val_windows  # val_windows: [n, seq_len + 1] or None
    model = start.model.to(d.device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters from {cfg.init_model}, vocab {len(tokenizer)}")

    # 5. Resume if asked, and 6. train with periodic eval and checkpoints.
    def batch(step: int, micro: int) -> torch.Tensor:
        return sampler.batch(cfg.batch_size, step, micro).to(d.device)  # [batch, seq_len + 1]

    r = run_loop(cfg, d, log, model, sampler, batch, lambda m, windows: lm_loss(m, windows, bf16), val_windows)
    summary = r.summary("loss", parameters=n_params, vocab=len(tokenizer), train_tokens=len(text.train_tokens),
                        held_out_tokens=len(text.val_tokens), train_files=text.train_files,
                        held_out_files=text.val_files, bf16=bf16)

    # 7. Hugging Face folder.
    if d.is_main:
        out = export_hf_folder(model, tokenizer, Path(cfg.out), cfg.save_dtype)
        write_finetune_card(out, cfg, summary)
        log(f"saved {cfg.save_dtype} model to {out}")
    d.barrier()
    distributed.teardown(d)
    return summary


def write_finetune_card(out: Path, cfg: FinetuneConfig, summary: dict) -> Path:
    facts = {
        "architecture": "LlamaForCausalLM",
        "initialised from": f"`{cfg.init_model}` (its card says how it was made)",
        "parameters": summary["parameters"],
        "vocab": summary["vocab"],
        "data": describe_sources(cfg.data),
        "train documents / tokens": f"{summary['train_files']:,} / {summary['train_tokens']:,}",
        "held-out documents / tokens": f"{summary['held_out_files']:,} / {summary['held_out_tokens']:,}",
        **loop_facts(cfg, summary),
    }
    summary_text = f"`{cfg.init_model}` trained further with `specdec.training.finetune`."
    return write_model_card(out, f"specdec model: {out.name}", summary_text, facts, cfg.command)


def loop_facts(cfg: RunConfig, summary: dict) -> dict:
    """The model card's facts of a run from a saved folder's loop (finetune, pard): steps, optimizer,
    precision, time and losses."""
    return {
        "steps (done / planned)": f"{summary['steps']:,} / {cfg.max_steps:,}",
        "tokens seen": summary["tokens_seen"],
        "optimizer": f"AdamW lr {cfg.optim.lr:g}, warmup {cfg.optim.warmup_steps}, "
        f"cosine to {cfg.optim.min_lr_ratio:g}x, wd {cfg.optim.weight_decay}, clip {cfg.optim.grad_clip}",
        "precision": ("bf16 autocast" if summary["bf16"] else "fp32") + f", saved as {cfg.save_dtype}",
        "wall time (training)": f"{summary['wall_time_s']:.0f} s ({summary['wall_time_s'] / 60:.1f} min)",
        "initial / final train loss": f"{summary['first_loss']:.4f} / {summary['train_loss']:.4f}",
        "final held-out loss": summary["held_out_loss"],
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specdec.training.finetune",
                                description="Continue training a saved causal LM on new text.")
    add_loop_args(p)
    p.add_argument("--init-model", required=True, help="the Hugging Face folder to start from (weights and tokenizer)")
    return p


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    cfg = FinetuneConfig(**loop_config_from_args(args), init_model=args.init_model,
                         command=launch_command("specdec.training.finetune", argv))
    return finetune(cfg)


if __name__ == "__main__":
    main()
