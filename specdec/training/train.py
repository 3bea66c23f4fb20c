"""Pretrain a small Llama-architecture causal LM from scratch.

Runs as a plain process or under ``torchrun`` (DDP; gloo on CPU, nccl on CUDA)
with no code change: every rank samples different windows, gradients are
averaged, rank 0 writes files, and all ranks end with identical weights.

    python -m specdec.training.train --data stdlib --out OUT [options]
    torchrun --nproc_per_node 2 -m specdec.training.train --data stdlib --out OUT

Steps: 1. set up processes; 2. tokenizer (train or reuse); 3. tokenize the
corpus; 4. build the model, optimizer and schedule; 5. resume if asked and
6. train with periodic eval and checkpoints, both in ``loop.run_loop``; 7. save
a Hugging Face folder with a model card.
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
from specdec.training.data import (
    TokenWindows,
    collect_files,
    describe_sources,
    read_text,
    split_files,
    tokenize_documents,
)
from specdec.training.loop import (
    SAVE_DTYPES,
    OptimConfig,
    add_loop_args,
    check_loop_config,
    held_out_loss,
    launch_command,
    loop_config_from_args,
    lr_lambda,  # noqa: F401  (re-exported: `from specdec.training.train import lr_lambda`)
    make_optimizer,
    make_scheduler,
    run_loop,
    start_run,
)
from specdec.training.model_card import write_model_card
from specdec.training.tokenizer import TokenizerConfig, load_tokenizer, save_tokenizer, train_tokenizer


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
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            tie_word_embeddings=self.tie_embeddings,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
        )


@dataclass
class TrainConfig:
    data: list[str]
    out: str
    run_dir: str | None = None  # checkpoints and logs; defaults to out
    tokenizer: str | None = None  # reuse this tokenizer folder instead of training one
    vocab_size: int = 8192
    val_fraction: float = 0.02
    seq_len: int = 512
    batch_size: int = 8  # windows per rank per micro-batch
    grad_accum: int = 1
    max_steps: int = 1000
    stop_at_step: int | None = None  # leave early (schedule still spans max_steps), e.g. to split a run
    eval_every: int = 100
    eval_windows: int = 32
    log_every: int = 10
    checkpoint_every: int = 0  # steps; 0 = only by time
    checkpoint_minutes: float = 10.0
    resume: bool = False
    precision: str = "auto"  # auto | bf16 | fp32 (autocast; master weights stay fp32)
    threads: int = 0  # torch threads per rank; 0 = leave torch's default
    device: str = "auto"
    seed: int = 0
    save_dtype: str = "bfloat16"
    model: ModelShape = field(default_factory=ModelShape)
    optim: OptimConfig = field(default_factory=OptimConfig)
    command: str = ""  # recorded in the model card

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError("no training data given")
        check_loop_config(self)
        if self.seq_len > self.model.max_position_embeddings:
            raise ValueError("seq_len exceeds max_position_embeddings")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir or self.out)


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
    files = collect_files(cfg.data)
    train_files, val_files = split_files(files, cfg.val_fraction)
    train_texts = [t for t in map(read_text, train_files) if t is not None]
    val_texts = [t for t in map(read_text, val_files) if t is not None]
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
    val_windows = None
    if len(val_tokens) > cfg.seq_len:
        val_windows = TokenWindows(val_tokens, cfg.seq_len).fixed(cfg.eval_windows)  # [n, seq_len + 1]

    # 4. Model, optimizer, schedule. Same seed on every rank; DDP also broadcasts.
    torch.manual_seed(cfg.seed)
    config = cfg.model.llama_config(len(tokenizer), tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).to(d.device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
    optimizer = make_optimizer(model, cfg.optim)
    scheduler = make_scheduler(optimizer, cfg.optim, cfg.max_steps)

    # 5. Resume if asked, and 6. train with periodic eval and checkpoints.
    def micro_loss(ddp_model, step: int, micro: int) -> torch.Tensor:
        windows = sampler.batch(cfg.batch_size, step, micro).to(d.device)  # [batch, seq_len + 1]
        return lm_loss(ddp_model, windows, bf16)

    def evaluate() -> float:
        return held_out_loss(model, val_windows, d, cfg.batch_size, lambda m, w: lm_loss(m, w, bf16))

    r = run_loop(cfg, d, log, model, optimizer, scheduler, sampler, micro_loss, evaluate if val_windows is not None else None)

    summary = {
        "steps": r.steps,
        "tokens_seen": r.tokens_seen,
        "first_loss": r.first_loss,
        "train_loss": r.last_loss,
        "held_out_loss": r.eval_loss,
        "wall_time_s": r.elapsed,
        "parameters": n_params,
        "vocab": len(tokenizer),
        "train_tokens": len(train_tokens),
        "held_out_tokens": len(val_tokens),
        "train_files": len(train_files),
        "held_out_files": len(val_files),
        "bf16": bf16,
        "world_size": d.world_size,
        "ranks_identical": r.ranks_identical,
    }

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
    p.add_argument("--hidden-size", type=int, default=default.hidden_size)
    p.add_argument("--layers", type=int, default=default.num_layers)
    p.add_argument("--heads", type=int, default=default.num_heads)
    p.add_argument("--kv-heads", type=int, default=default.num_kv_heads)
    p.add_argument("--intermediate-size", type=int, default=default.intermediate_size)
    p.add_argument("--max-position-embeddings", type=int, default=default.max_position_embeddings)
    p.add_argument("--rope-theta", type=float, default=default.rope_theta)


def shape_from_args(a: argparse.Namespace) -> ModelShape:
    return ModelShape(
        hidden_size=a.hidden_size,
        num_layers=a.layers,
        num_heads=a.heads,
        num_kv_heads=a.kv_heads,
        intermediate_size=a.intermediate_size,
        max_position_embeddings=a.max_position_embeddings,
        rope_theta=a.rope_theta,
        tie_embeddings=not getattr(a, "no_tie_embeddings", False),  # only `specdec train` has --no-tie-embeddings
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec train", description="Pretrain a small Llama model from scratch.")
    p.add_argument("--data", nargs="+", required=True, help="files or folders ('stdlib' = Python stdlib minus tests)")
    p.add_argument("--out", required=True, help="final Hugging Face folder")
    p.add_argument("--run-dir", default=None, help="checkpoints and train.log (default: --out)")
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer folder")
    p.add_argument("--vocab-size", type=int, default=8192)
    add_shape_args(p, ModelShape())
    p.add_argument("--no-tie-embeddings", action="store_true")
    add_loop_args(p)
    p.add_argument("--beta2", type=float, default=0.95)
    return p


def config_from_args(args: argparse.Namespace, command: str) -> TrainConfig:
    return TrainConfig(
        data=args.data,
        out=args.out,
        run_dir=args.run_dir,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        model=shape_from_args(args),
        command=command,
        **loop_config_from_args(args),
    )


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return train(config_from_args(args, launch_command("specdec.training.train", argv)))


if __name__ == "__main__":
    main()
