"""Pretrain a small Llama-architecture causal LM from scratch.

Runs as a plain process or under ``torchrun`` (DDP; gloo on CPU, nccl on CUDA)
with no code change: every rank samples different windows, gradients are
averaged, rank 0 writes files, and all ranks end with identical weights.

    python -m specdec.training.train --data stdlib --out OUT [options]
    torchrun --nproc_per_node 2 -m specdec.training.train --data stdlib --out OUT

Steps: 1. set up processes; 2. tokenizer (train or reuse); 3. tokenize the
corpus; 4. build the model, optimizer and schedule; 5. resume if asked;
6. train with periodic eval and checkpoints; 7. save a Hugging Face folder
with a model card.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import shlex
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from specdec.training import distributed
from specdec.training.checkpoint import CHECKPOINT_NAME, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from specdec.training.data import (
    TokenWindows,
    collect_files,
    describe_sources,
    read_text,
    split_files,
    tokenize_documents,
)
from specdec.training.model_card import write_model_card
from specdec.training.progress import TrainProgress
from specdec.training.tokenizer import TokenizerConfig, load_tokenizer, save_tokenizer, train_tokenizer

SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # cosine decays to this fraction of lr
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"bad optimizer settings: {self}")


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
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"save_dtype must be one of {sorted(SAVE_DTYPES)}, got {self.save_dtype!r}")
        if min(self.seq_len, self.batch_size, self.grad_accum, self.max_steps) < 1:
            raise ValueError("seq_len, batch_size, grad_accum and max_steps must be >= 1")
        if self.seq_len > self.model.max_position_embeddings:
            raise ValueError("seq_len exceeds max_position_embeddings")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir or self.out)


def lr_lambda(optim: OptimConfig, max_steps: int):
    """Linear warmup, then cosine decay from lr to min_lr_ratio * lr at max_steps."""

    def f(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        progress = min(1.0, (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps))
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def use_bf16(precision: str, device: torch.device) -> bool:
    if precision != "auto":
        return precision == "bf16"
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    # Measured on one avx512_bf16 core with the 28M demo model at seq_len 512:
    # a training step ~1.8-2x faster than fp32, the loss within 1e-4 of fp32.
    return cpu_has_bf16()


def make_optimizer(model: torch.nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    # No weight decay on norms (1-D weights); tied embeddings appear once in parameters().
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
    )


def lm_loss(model: torch.nn.Module, windows: torch.Tensor, bf16: bool) -> torch.Tensor:
    """Mean next-token cross-entropy over ``windows``: ``[batch, seq_len + 1]``."""
    x, y = windows[:, :-1], windows[:, 1:]  # [batch, seq_len] each
    with torch.autocast(windows.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=x).logits  # [batch, seq_len, vocab]
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, d: distributed.Dist, bf16: bool, batch_size: int) -> float:
    """Mean loss over fixed windows, sharded over ranks. ``windows``: ``[n, seq_len + 1]``.

    Takes the unwrapped model: DDP's forward may sync buffers, and ranks can
    hold different numbers of eval batches.
    """
    was_training = model.training
    model.eval()
    mine = windows[d.rank :: d.world_size]
    total = torch.zeros(2, dtype=torch.float64)  # [sum of losses, count]
    for i in range(0, len(mine), batch_size):
        chunk = mine[i : i + batch_size].to(d.device)
        total[0] += lm_loss(model, chunk, bf16).item() * len(chunk)
        total[1] += len(chunk)
    total = d.sum(total).cpu()
    model.train(was_training)
    return (total[0] / total[1]).item() if total[1] else float("nan")


def weights_checksum(model: torch.nn.Module) -> torch.Tensor:
    """A per-parameter fingerprint, cheap enough to compare across ranks."""
    return torch.stack([p.detach().double().cpu().flatten().dot(torch.linspace(1, 2, p.numel(), dtype=torch.float64)) for p in model.parameters()])


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


class RunLog:
    """Plain-text log lines on rank 0: to stdout and ``run_dir/train.log``."""

    def __init__(self, path: Path, enabled: bool, progress: TrainProgress | None = None):
        self.path, self.enabled, self.progress = path, enabled, progress

    def __call__(self, msg: str) -> None:
        if not self.enabled:
            return
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} {msg}"
        if self.progress is not None and self.progress.live:
            self.progress.print(line)
        else:
            print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


@dataclass
class TrainResult:
    model: LlamaForCausalLM  # unwrapped, on this rank's device, fp32
    summary: dict


def train(cfg: TrainConfig) -> dict:
    """Train per ``cfg``; returns a summary dict (losses, tokens seen, wall time)."""
    return run_training(cfg).summary


def run_training(cfg: TrainConfig) -> TrainResult:
    # 1. Processes.
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    d = distributed.setup(cfg.device)
    run = cfg.run_path
    if d.is_main:
        run.mkdir(parents=True, exist_ok=True)
    d.barrier()
    progress = TrainProgress(cfg.max_steps, enabled=d.is_main)
    log = RunLog(run / "train.log", d.is_main, progress)
    bf16 = use_bf16(cfg.precision, d.device)
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
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, cfg.max_steps))

    # 5. Resume.
    step, tokens_seen, elapsed, last_loss, first_loss = 0, 0, 0.0, float("nan"), float("nan")
    ckpt_path = run / CHECKPOINT_NAME
    if cfg.resume and ckpt_path.exists():
        ckpt = load_checkpoint(ckpt_path)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        sampler.check_state(ckpt["sampler"])
        set_rng_state(ckpt["rng"])
        step, tokens_seen, elapsed = ckpt["step"], ckpt["tokens_seen"], ckpt["elapsed"]
        last_loss, first_loss = ckpt["last_loss"], ckpt.get("first_loss", float("nan"))
        if ckpt.get("world_size", d.world_size) != d.world_size:
            log(f"warning: checkpoint was written with world_size={ckpt['world_size']}, resuming with {d.world_size}")
        log(f"resumed from {ckpt_path} at step {step} ({tokens_seen:,} tokens seen)")
        del ckpt
    elif cfg.resume:
        log(f"no checkpoint at {ckpt_path}; starting fresh")

    ddp_model = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None) if d.enabled else model

    def checkpoint() -> None:
        if d.is_main:
            save_checkpoint(
                ckpt_path,
                model=model.state_dict(),
                optimizer=optimizer.state_dict(),
                scheduler=scheduler.state_dict(),
                sampler=sampler.state_dict(),
                rng=rng_state(),
                step=step,
                tokens_seen=tokens_seen,
                elapsed=elapsed,
                last_loss=last_loss,
                first_loss=first_loss,
                world_size=d.world_size,
                config=asdict(cfg),
            )
            log(f"checkpoint: step {step} -> {ckpt_path}")

    # 6. Train.
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * d.world_size
    model.train()
    last_ckpt = time.time()
    window_start, window_tokens = time.time(), 0
    eval_loss = float("nan")
    progress.start(step)
    end = min(cfg.max_steps, cfg.stop_at_step or cfg.max_steps)
    while step < end:
        step_start = time.time()
        loss_sum = 0.0
        for micro in range(cfg.grad_accum):
            windows = sampler.batch(cfg.batch_size, step, micro).to(d.device)  # [batch, seq_len + 1]
            sync = micro == cfg.grad_accum - 1
            ctx = ddp_model.no_sync() if (d.enabled and not sync) else nullcontext()
            with ctx:
                loss = lm_loss(ddp_model, windows, bf16) / cfg.grad_accum
                loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += tokens_per_step
        window_tokens += tokens_per_step
        elapsed += time.time() - step_start
        last_loss = d.mean(loss_sum)
        if step == 1:
            first_loss = last_loss
        tok_s = window_tokens / max(1e-9, time.time() - window_start)
        progress.update(step, last_loss, tok_s)

        if step % cfg.log_every == 0 or step == end:
            lr = scheduler.get_last_lr()[0]
            log(f"step {step}/{cfg.max_steps} loss {last_loss:.4f} lr {lr:.2e} tok/s {tok_s:,.0f} tokens {tokens_seen:,}")
            window_start, window_tokens = time.time(), 0
        if val_windows is not None and cfg.eval_every and (step % cfg.eval_every == 0 or step == end):
            t = time.time()
            eval_loss = evaluate(model, val_windows, d, bf16, cfg.batch_size)
            elapsed += time.time() - t
            log(f"step {step} held-out loss {eval_loss:.4f}")
        due_by_steps = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
        due_by_time = cfg.checkpoint_minutes and time.time() - last_ckpt >= cfg.checkpoint_minutes * 60
        if due_by_steps or due_by_time or step == end:
            checkpoint()
            last_ckpt = time.time()
    progress.stop()

    if val_windows is not None and math.isnan(eval_loss):
        eval_loss = evaluate(model, val_windows, d, bf16, cfg.batch_size)

    # All ranks must hold the same weights; a mismatch means a DDP bug.
    identical = True
    if d.enabled:
        fp = weights_checksum(model)
        lo, hi = fp.clone(), fp.clone()
        torch.distributed.all_reduce(lo, op=torch.distributed.ReduceOp.MIN)
        torch.distributed.all_reduce(hi, op=torch.distributed.ReduceOp.MAX)
        identical = bool(torch.equal(lo, hi))
        log(f"weights identical across {d.world_size} ranks: {identical}")

    summary = {
        "steps": step,
        "tokens_seen": tokens_seen,
        "first_loss": first_loss,
        "train_loss": last_loss,
        "held_out_loss": eval_loss,
        "wall_time_s": elapsed,
        "parameters": n_params,
        "vocab": len(tokenizer),
        "train_tokens": len(train_tokens),
        "held_out_tokens": len(val_tokens),
        "train_files": len(train_files),
        "held_out_files": len(val_files),
        "bf16": bf16,
        "world_size": d.world_size,
        "ranks_identical": identical,
    }

    # 7. Hugging Face folder.
    if d.is_main:
        save_hf_folder(model, tokenizer, cfg, summary)
        log(f"saved {cfg.save_dtype} model to {cfg.out}")
    d.barrier()
    distributed.teardown(d)
    return TrainResult(model=model, summary=summary)


def save_hf_folder(model: LlamaForCausalLM, tokenizer, cfg: TrainConfig, summary: dict) -> Path:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    export = copy.deepcopy(model).to("cpu", SAVE_DTYPES[cfg.save_dtype])
    eos = tokenizer.eos_token_id
    export.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    export.save_pretrained(str(out))  # safetensors is the only format in transformers 5
    tokenizer.save_pretrained(str(out))
    write_card(out, cfg, summary)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec train", description="Pretrain a small Llama model from scratch.")
    p.add_argument("--data", nargs="+", required=True, help="files or folders ('stdlib' = Python stdlib minus tests)")
    p.add_argument("--out", required=True, help="final Hugging Face folder")
    p.add_argument("--run-dir", default=None, help="checkpoints and train.log (default: --out)")
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer folder")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--val-fraction", type=float, default=0.02)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate-size", type=int, default=1408)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--no-tie-embeddings", action="store_true")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8, help="windows per rank per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--stop-at-step", type=int, default=None, help="stop early; --resume continues later")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--checkpoint-minutes", type=float, default=10.0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dtype", choices=sorted(SAVE_DTYPES), default="bfloat16")
    return p


def launch_command(module: str, argv: list[str]) -> str:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    head = f"torchrun --nproc_per_node {world} -m {module}" if world > 1 else f"python -m {module}"
    return f"{head} {shlex.join(argv)}"


def config_from_args(args: argparse.Namespace, command: str) -> TrainConfig:
    return TrainConfig(
        data=args.data,
        out=args.out,
        run_dir=args.run_dir,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        max_steps=args.max_steps,
        stop_at_step=args.stop_at_step,
        eval_every=args.eval_every,
        eval_windows=args.eval_windows,
        log_every=args.log_every,
        checkpoint_every=args.checkpoint_every,
        checkpoint_minutes=args.checkpoint_minutes,
        resume=args.resume,
        precision=args.precision,
        threads=args.threads,
        device=args.device,
        seed=args.seed,
        save_dtype=args.save_dtype,
        model=ModelShape(
            hidden_size=args.hidden_size,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            intermediate_size=args.intermediate_size,
            max_position_embeddings=args.max_position_embeddings,
            rope_theta=args.rope_theta,
            tie_embeddings=not args.no_tie_embeddings,
        ),
        optim=OptimConfig(
            lr=args.lr,
            warmup_steps=args.warmup_steps,
            min_lr_ratio=args.min_lr_ratio,
            weight_decay=args.weight_decay,
            beta2=args.beta2,
            grad_clip=args.grad_clip,
        ),
        command=command,
    )


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return train(config_from_args(args, launch_command("specdec.training.train", argv)))


if __name__ == "__main__":
    main()
