"""The optimisation loop shared by ``train`` and ``distill``: resumable, DDP-aware.

The two differ only in how a micro-batch and its loss are made (next-token
cross-entropy vs forward KL on the target's logits) and in what they build
around the loop; both hand :func:`run_loop` a model, a data sampler, the
held-out windows and two callables.

Steps of :func:`run_loop`: 1. resume from ``run_dir/checkpoint.pt`` if asked;
2. wrap the model in DDP under torchrun; 3. step until ``stop_at_step`` or
``max_steps``, logging every ``log_every`` steps, evaluating every
``eval_every`` and checkpointing by steps or minutes and at the end; 4. check
that every rank ends with the same weights.

Also here: the configuration fields and command-line options both commands
share, the optimizer and its schedule, the precision choice and the run log.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from specdec.training import distributed
from specdec.training.checkpoint import CHECKPOINT_NAME, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from specdec.training.data import TokenWindows
from specdec.training.progress import TrainProgress

SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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


@dataclass(kw_only=True)
class RunConfig:
    """The fields ``TrainConfig`` and ``DistillConfig`` share: data, output and the loop's settings
    (the options of :func:`add_loop_args`)."""

    data: list[str]
    out: str
    run_dir: str | None = None  # checkpoints and logs; defaults to out
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
    optim: OptimConfig = field(default_factory=OptimConfig)
    command: str = ""  # recorded in the model card

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError("no data given (--data: files or folders)")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"save_dtype must be one of {sorted(SAVE_DTYPES)}, got {self.save_dtype!r}")
        if min(self.seq_len, self.batch_size, self.grad_accum, self.max_steps) < 1:
            raise ValueError("seq_len, batch_size, grad_accum and max_steps must be >= 1")

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


def make_optimizer(model: torch.nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    # No weight decay on norms (1-D weights); tied embeddings appear once in parameters().
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
    )


def make_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, max_steps))


def use_bf16(precision: str, device: torch.device) -> bool:
    if precision != "auto":
        return precision == "bf16"
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    # bf16 only where the CPU runs it natively: elsewhere it is emulated and slower than fp32.
    from specdec.models.cpu import native_bf16

    return native_bf16().native


class RunLog:
    """Plain-text log lines on rank 0: to stdout and a file in the run folder."""

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


def start_run(cfg: RunConfig, log_name: str) -> tuple[distributed.Dist, RunLog, bool]:
    """Set up threads, processes (torchrun or not), the run folder and its log; returns (dist, log, bf16)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    d = distributed.setup(cfg.device)
    if d.is_main:
        cfg.run_path.mkdir(parents=True, exist_ok=True)
    d.barrier()
    progress = TrainProgress(cfg.max_steps, enabled=d.is_main)
    log = RunLog(cfg.run_path / log_name, d.is_main, progress)
    return d, log, use_bf16(cfg.precision, d.device)


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, windows: torch.Tensor, d: distributed.Dist, batch_size: int, loss) -> float:
    """Mean of ``loss(model, chunk)`` over fixed ``windows`` ``[n, ...]``, sharded over ranks.

    Takes the unwrapped model: DDP's forward may sync buffers, and ranks can
    hold different numbers of eval batches.
    """
    was_training = model.training
    model.eval()
    mine = windows[d.rank :: d.world_size]
    total = torch.zeros(2, dtype=torch.float64)  # [sum of losses, count]
    for i in range(0, len(mine), batch_size):
        chunk = mine[i : i + batch_size].to(d.device)
        total[0] += loss(model, chunk).item() * len(chunk)
        total[1] += len(chunk)
    total = d.sum(total).cpu()
    model.train(was_training)
    return (total[0] / total[1]).item() if total[1] else float("nan")


def weights_checksum(model: torch.nn.Module) -> torch.Tensor:
    """A per-parameter fingerprint, cheap enough to compare across ranks."""
    return torch.stack([p.detach().double().cpu().flatten().dot(torch.linspace(1, 2, p.numel(), dtype=torch.float64)) for p in model.parameters()])


@dataclass
class LoopResult:
    steps: int
    tokens_seen: int
    first_loss: float
    last_loss: float  # mean over ranks of the last step's loss
    eval_loss: float  # nan without held-out data
    elapsed: float  # training seconds, summed over resumed runs
    ranks_identical: bool
    world_size: int

    def summary(self, loss_name: str, **facts) -> dict:
        """The run's summary: the loop's figures (losses as ``first_``/``train_``/``held_out_`` +
        ``loss_name``), then ``facts``, then how the ranks ran."""
        return {
            "steps": self.steps,
            "tokens_seen": self.tokens_seen,
            f"first_{loss_name}": self.first_loss,
            f"train_{loss_name}": self.last_loss,
            f"held_out_{loss_name}": self.eval_loss,
            "wall_time_s": self.elapsed,
            **facts,
            "world_size": self.world_size,
            "ranks_identical": self.ranks_identical,
        }


def run_loop(
    cfg: RunConfig,
    d: distributed.Dist,
    log: RunLog,
    model: torch.nn.Module,
    sampler: TokenWindows,
    batch: Callable[[int, int], torch.Tensor],
    loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    val_windows: torch.Tensor | None,
    loss_name: str = "loss",
) -> LoopResult:
    """Optimise ``model`` (unwrapped, on ``d.device``) for ``cfg``'s steps; see the module docstring.

    ``batch(step, micro)`` makes micro-batch ``micro`` of ``step`` on
    ``d.device``; ``loss(model, windows)`` is its mean loss, in training and on
    the fixed ``val_windows`` (None: no held-out data). ``sampler`` is the
    source of the batches, whose state the checkpoint checks on resume.
    ``cfg`` is stored in the checkpoint.
    """
    optimizer = make_optimizer(model, cfg.optim)
    scheduler = make_scheduler(optimizer, cfg.optim, cfg.max_steps)

    def evaluate() -> float:
        return held_out_loss(model, val_windows, d, cfg.batch_size, loss)

    # 1. Resume.
    step, tokens_seen, elapsed, last_loss, first_loss = 0, 0, 0.0, float("nan"), float("nan")
    ckpt_path = cfg.run_path / CHECKPOINT_NAME
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

    # 2. DDP (after loading: it broadcasts rank 0's weights).
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

    # 3. Steps.
    progress = log.progress or TrainProgress(cfg.max_steps, enabled=False)
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
            sync = micro == cfg.grad_accum - 1
            ctx = ddp_model.no_sync() if (d.enabled and not sync) else nullcontext()
            with ctx:
                micro_loss = loss(ddp_model, batch(step, micro)) / cfg.grad_accum
                micro_loss.backward()
            loss_sum += micro_loss.item()
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
            log(f"step {step}/{cfg.max_steps} {loss_name} {last_loss:.4f} lr {lr:.2e} tok/s {tok_s:,.0f} tokens {tokens_seen:,}")
            window_start, window_tokens = time.time(), 0
        if val_windows is not None and cfg.eval_every and (step % cfg.eval_every == 0 or step == end):
            t = time.time()
            eval_loss = evaluate()
            elapsed += time.time() - t
            log(f"step {step} held-out {loss_name} {eval_loss:.4f}")
        due_by_steps = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
        due_by_time = cfg.checkpoint_minutes and time.time() - last_ckpt >= cfg.checkpoint_minutes * 60
        if due_by_steps or due_by_time or step == end:
            checkpoint()
            last_ckpt = time.time()
    progress.stop()

    if val_windows is not None and math.isnan(eval_loss):
        eval_loss = evaluate()

    # 4. All ranks must hold the same weights; a mismatch means a DDP bug.
    identical = True
    if d.enabled:
        fp = weights_checksum(model)
        lo, hi = fp.clone(), fp.clone()
        torch.distributed.all_reduce(lo, op=torch.distributed.ReduceOp.MIN)
        torch.distributed.all_reduce(hi, op=torch.distributed.ReduceOp.MAX)
        identical = bool(torch.equal(lo, hi))
        log(f"weights identical across {d.world_size} ranks: {identical}")

    return LoopResult(step, tokens_seen, first_loss, last_loss, eval_loss, elapsed, identical, d.world_size)


# Command line ------------------------------------------------------------------


def add_loop_args(p: argparse.ArgumentParser) -> None:
    """The options ``specdec train`` and ``specdec distill`` share: the fields of :class:`RunConfig`."""
    p.add_argument("--data", nargs="+", required=True, help="files or folders ('stdlib' = Python stdlib minus tests)")
    p.add_argument("--out", required=True, help="the Hugging Face folder to write")
    p.add_argument("--run-dir", default=None, help="checkpoints and the run's log (default: --out)")
    p.add_argument("--val-fraction", type=float, default=0.02)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8, help="windows per rank per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--stop-at-step", type=int, default=None, help="stop early; --resume continues later")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
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


def loop_config_from_args(a: argparse.Namespace) -> dict:
    """:class:`RunConfig` fields from :func:`add_loop_args` options, ``optim`` included."""
    optim = OptimConfig(
        lr=a.lr,
        warmup_steps=a.warmup_steps,
        min_lr_ratio=a.min_lr_ratio,
        weight_decay=a.weight_decay,
        beta2=getattr(a, "beta2", OptimConfig.beta2),  # only `specdec train` has --beta2
        grad_clip=a.grad_clip,
    )
    names = (
        "data out run_dir val_fraction seq_len batch_size grad_accum max_steps stop_at_step eval_every eval_windows "
        "log_every checkpoint_every checkpoint_minutes resume precision threads device seed save_dtype"
    )
    return {**fields_from_args(a, names), "optim": optim}


def fields_from_args(a: argparse.Namespace, names: str) -> dict:
    """``{name: a.name}`` for the space-separated ``names``: options whose dest is the config field's name."""
    return {n: getattr(a, n) for n in names.split()}


def launch_command(module: str, argv: list[str]) -> str:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    head = f"torchrun --nproc_per_node {world} -m {module}" if world > 1 else f"python -m {module}"
    return f"{head} {shlex.join(argv)}"
