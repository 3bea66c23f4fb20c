"""Pretrain a small Llama-architecture causal LM from scratch.

Runs as a plain process or under ``torchrun`` (DDP; gloo on CPU, nccl on CUDA)
with no code change: every rank samples different windows, gradients are
averaged, rank 0 writes files, and all ranks end with identical weights.

    python -m specdec.training.train --data stdlib --out OUT [options]
    torchrun --nproc_per_node 2 -m specdec.training.train --data stdlib --out OUT

Steps: 1. set up processes; 2. tokenizer (train or reuse); 3. tokenize the
corpus; 4. build the model; 5. resume if asked and 6. train with periodic eval
and checkpoints, both in ``loop.run_loop`` (which makes the optimizer and its
schedule); 7. save a Hugging Face folder with a model card.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from specdec.training import distributed
from specdec.training.data import TokenWindows, describe_sources, held_out_windows, read_split, tokenize_documents
from specdec.training.loop import (
    SAVE_DTYPES,
    OptimConfig,  # noqa: F401  (re-exported with lr_lambda: `from specdec.training.train import OptimConfig`)
    RunConfig,
    add_loop_args,
    launch_command,
    loop_config_from_args,
    lr_lambda,  # noqa: F401
    run_loop,
    start_run,
)
from specdec.training.model_card import write_model_card
from specdec.training.tokenizer import TokenizerConfig, load_tokenizer, save_tokenizer, train_tokenizer


# ModelShape field: (its LlamaConfig name, its command-line option). tie_embeddings has no option of
# its own (only `specdec train` has --no-tie-embeddings).
SHAPE_NAMES = {
    "hidden_size": ("hidden_size", "--hidden-size"),
    "num_layers": ("num_hidden_layers", "--layers"),
    "num_heads": ("num_attention_heads", "--heads"),
    "num_kv_heads": ("num_key_value_heads", "--kv-heads"),
    "intermediate_size": ("intermediate_size", "--intermediate-size"),
    "max_position_embeddings": ("max_position_embeddings", "--max-position-embeddings"),
    "rope_theta": ("rope_theta", "--rope-theta"),
}


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 8
    intermediate_size: int = 1408
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}")
        if min(self.hidden_size, self.num_layers, self.intermediate_size) < 1:
            raise ValueError("model sizes must be positive")

    def llama_config(self, vocab_size: int, eos_id: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab_size,
            **{hf_name: getattr(self, name) for name, (hf_name, _) in SHAPE_NAMES.items()},
            tie_word_embeddings=self.tie_embeddings,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
        )


@dataclass
class TrainConfig(RunConfig):
    """What to train (see :class:`RunConfig` for data, output and the loop)."""

    tokenizer: str | None = None  # reuse this tokenizer folder instead of training one
    vocab_size: int = 8192
    model: ModelShape = field(default_factory=ModelShape)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seq_len > self.model.max_position_embeddings:
            raise ValueError("seq_len exceeds max_position_embeddings")


def lm_loss(model: torch.nn.Module, windows: torch.Tensor, bf16: bool) -> torch.Tensor:
    """Mean next-token cross-entropy over ``windows``: ``[batch, seq_len + 1]``."""
    x, y = windows[:, :-1], windows[:, 1:]  # [batch, seq_len] each
    with torch.autocast(windows.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=x).logits  # [batch, seq_len, vocab]
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def prepare_tokenizer(cfg: TrainConfig, train_texts: list[str], d: distributed.Dist):
    folder = Path(cfg.tokenizer) if cfg.tokenizer else cfg.run_path / "tokenizer"
    if not (folder / "tokenizer.json").exists():
        if cfg.tokenizer:
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        if d.is_main:
            tok = train_tokenizer(train_texts, TokenizerConfig(vocab_size=cfg.vocab_size))
            save_tokenizer(tok, folder)
        d.barrier()
    return load_tokenizer(folder)


@dataclass
class TrainResult:
    model: LlamaForCausalLM  # unwrapped, on this rank's device, fp32
    summary: dict


def train(cfg: TrainConfig) -> dict:
    """Train per ``cfg``; returns a summary dict (losses, tokens seen, wall time)."""
    return run_training(cfg).summary


def run_training(cfg: TrainConfig) -> TrainResult:
    # 1. Processes.
    d, log, bf16 = start_run(cfg, "train.log")
    log(f"world_size={d.world_size} device={d.device} threads={torch.get_num_threads()} bf16={bf16}")

    # 2. Tokenizer, trained on the training documents only.
    (train_files, val_files), (train_texts, val_texts) = read_split(cfg.data, cfg.val_fraction)
    tokenizer = prepare_tokenizer(cfg, train_texts, d)

    # 3. Tokens.
    t0 = time.time()
    train_tokens = tokenize_documents(train_texts, tokenizer)
    val_tokens = tokenize_documents(val_texts, tokenizer)
    del train_texts, val_texts
    log(
        f"data: {len(train_files)} train files ({len(train_tokens):,} tokens), "
        f"{len(val_files)} held-out files ({len(val_tokens):,} tokens), tokenized in {time.time() - t0:.1f}s"
    )
    sampler = TokenWindows(train_tokens, cfg.seq_len, seed=cfg.seed, rank=d.rank)
    val_windows = held_out_windows(val_tokens, cfg.seq_len, cfg.eval_windows)  # [n, seq_len + 1] or None

    # 4. Model. Same seed on every rank; DDP also broadcasts.
    torch.manual_seed(cfg.seed)
    config = cfg.model.llama_config(len(tokenizer), tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).to(d.device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}")

    # 5. Resume if asked, and 6. train with periodic eval and checkpoints.
    def batch(step: int, micro: int) -> torch.Tensor:
        return sampler.batch(cfg.batch_size, step, micro).to(d.device)  # [batch, seq_len + 1]

    r = run_loop(cfg, d, log, model, sampler, batch, lambda m, windows: lm_loss(m, windows, bf16), val_windows)
    summary = r.summary(
        "loss",
        parameters=n_params,
        vocab=len(tokenizer),
        train_tokens=len(train_tokens),
        held_out_tokens=len(val_tokens),
        train_files=len(train_files),
        held_out_files=len(val_files),
        bf16=bf16,
    )

    # 7. Hugging Face folder.
    if d.is_main:
        save_hf_folder(model, tokenizer, cfg, summary)
        log(f"saved {cfg.save_dtype} model to {cfg.out}")
    d.barrier()
    distributed.teardown(d)
    return TrainResult(model=model, summary=summary)


def save_hf_folder(model: LlamaForCausalLM, tokenizer, cfg: TrainConfig, summary: dict) -> Path:
    out = export_hf_folder(model, tokenizer, Path(cfg.out), cfg.save_dtype)
    write_card(out, cfg, summary)
    return out


def export_hf_folder(model: LlamaForCausalLM, tokenizer, out: Path, save_dtype: str) -> Path:
    """Save a copy of ``model`` in ``save_dtype`` with ``tokenizer`` as a Hugging Face folder (no card)."""
    out.mkdir(parents=True, exist_ok=True)
    export = copy.deepcopy(model).to("cpu", SAVE_DTYPES[save_dtype])
    eos = tokenizer.eos_token_id
    export.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    export.save_pretrained(str(out))  # safetensors is the only format in transformers 5
    tokenizer.save_pretrained(str(out))
    return out


def write_card(out: Path, cfg: TrainConfig, summary: dict, notes: str = "") -> Path:
    m = cfg.model
    facts = {
        "architecture": "LlamaForCausalLM",
        "parameters": summary["parameters"],
        "hidden / layers / heads / kv heads": f"{m.hidden_size} / {m.num_layers} / {m.num_heads} / {m.num_kv_heads}",
        "intermediate size": m.intermediate_size,
        "vocab (byte-level BPE)": summary["vocab"],
        "context trained / max positions": f"{cfg.seq_len} / {m.max_position_embeddings}",
        "training data": describe_sources(cfg.data),
        "train documents / tokens": f"{summary['train_files']:,} / {summary['train_tokens']:,}",
        "held-out documents / tokens": f"{summary['held_out_files']:,} / {summary['held_out_tokens']:,}",
        "steps (done / planned)": f"{summary['steps']:,} / {cfg.max_steps:,}",
        "tokens seen": summary["tokens_seen"],
        "epochs (tokens seen / train tokens)": summary["tokens_seen"] / max(1, summary["train_tokens"]),
        "batch (tokens per step)": cfg.batch_size * cfg.grad_accum * cfg.seq_len * summary["world_size"],
        "optimizer": f"AdamW lr {cfg.optim.lr:g}, betas ({cfg.optim.beta1}, {cfg.optim.beta2}), "
        f"wd {cfg.optim.weight_decay}, warmup {cfg.optim.warmup_steps}, cosine to {cfg.optim.min_lr_ratio:g}x, clip {cfg.optim.grad_clip}",
        "precision": ("bf16 autocast" if summary["bf16"] else "fp32") + f", saved as {cfg.save_dtype}",
        "processes x threads": f"{summary['world_size']} x {cfg.threads or torch.get_num_threads()}",
        "wall time (training)": f"{summary['wall_time_s']:.0f} s ({summary['wall_time_s'] / 60:.1f} min)",
        "initial / final train loss": f"{summary['first_loss']:.4f} / {summary['train_loss']:.4f}",
        "final held-out loss": summary["held_out_loss"],
    }
    summary_text = (
        "A small Llama-architecture causal LM trained from scratch with `specdec.training.train`. "
        "It is a demonstration model for speculative decoding on CPU, not a useful code assistant."
    )
    return write_model_card(out, f"specdec model: {out.name}", summary_text, facts, cfg.command, notes)


def add_shape_args(p: argparse.ArgumentParser, default: ModelShape) -> None:
    """The options of :data:`SHAPE_NAMES`, each stored under its ModelShape field's name."""
    for name, (_, option) in SHAPE_NAMES.items():
        value = getattr(default, name)
        p.add_argument(option, dest=name, type=type(value), default=value)


def shape_from_args(a: argparse.Namespace) -> ModelShape:
    return ModelShape(
        **{name: getattr(a, name) for name in SHAPE_NAMES},
        tie_embeddings=not getattr(a, "no_tie_embeddings", False),  # only `specdec train` has --no-tie-embeddings
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec train", description="Pretrain a small Llama model from scratch.")
    add_loop_args(p)
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer folder")
    p.add_argument("--vocab-size", type=int, default=8192)
    add_shape_args(p, ModelShape())
    p.add_argument("--no-tie-embeddings", action="store_true")
    p.add_argument("--beta2", type=float, default=0.95)
    return p


def config_from_args(args: argparse.Namespace, command: str) -> TrainConfig:
    return TrainConfig(**loop_config_from_args(args), tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                       model=shape_from_args(args), command=command)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return train(config_from_args(args, launch_command("specdec.training.train", argv)))


if __name__ == "__main__":
    main()
