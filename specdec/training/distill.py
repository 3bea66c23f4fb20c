"""Distill a small draft model from a target's logits (forward KL).

The draft uses the target's tokenizer, so their vocabularies match token for
token, which speculative decoding requires. Per position the loss is

    KL(p || q) = sum_v p(v) (log p(v) - log q(v)),   p = target, q = draft,

on temperature-softened distributions, scaled by T^2 so gradient size does not
depend on T. Forward KL makes q cover p's mass, which is what raises the
acceptance probability sum_v min(p, q).

Data is either windows of a corpus (off-policy) or, with
``on_policy_fraction > 0``, partly continuations sampled from the target after
a short corpus prefix: the contexts the draft will see when drafting.

Steps: 1. processes; 2. target and its tokenizer; 3. data; 4. draft,
optimizer, schedule; 5. resume; 6. distill; 7. save the draft folder; 8. measure
the saved draft's acceptance by the target on held-out prompts (greedy, k fixed).

    python -m specdec.training.distill --target TARGET --data stdlib --out DRAFT
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaForCausalLM

from specdec.training import distributed
from specdec.training.acceptance import draft_acceptance, format_acceptance
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
from specdec.training.tokenizer import load_tokenizer
from specdec.training.train import (
    SAVE_DTYPES,
    ModelShape,
    OptimConfig,
    RunLog,
    launch_command,
    lr_lambda,
    make_optimizer,
    use_bf16,
    weights_checksum,
)


ACCEPT_PROMPT_LEN = 128  # tokens of held-out text before each acceptance-report continuation


@dataclass
class DistillConfig:
    target: str  # Hugging Face folder (or hub id) of the target
    data: list[str]
    out: str
    run_dir: str | None = None
    init_draft: str | None = None  # start from this folder instead of random init
    draft: ModelShape = field(default_factory=lambda: ModelShape(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=704))
    temperature: float = 1.0
    on_policy_fraction: float = 0.0  # share of each batch sampled from the target
    prompt_len: int = 32  # corpus prefix before an on-policy continuation
    val_fraction: float = 0.02
    seq_len: int = 512
    batch_size: int = 8
    grad_accum: int = 1
    max_steps: int = 1000
    stop_at_step: int | None = None
    eval_every: int = 100
    eval_windows: int = 32
    log_every: int = 10
    checkpoint_every: int = 0
    checkpoint_minutes: float = 10.0
    resume: bool = False
    precision: str = "auto"
    threads: int = 0
    device: str = "auto"
    seed: int = 0
    save_dtype: str = "bfloat16"
    accept_prompts: int = 8  # held-out prompts for the final acceptance report (0: skip it)
    accept_k: int = 4
    optim: OptimConfig = field(default_factory=OptimConfig)
    command: str = ""

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError("no distillation data given")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 <= self.on_policy_fraction <= 1:
            raise ValueError(f"on_policy_fraction must be in [0, 1], got {self.on_policy_fraction}")
        if self.on_policy_fraction and not 0 < self.prompt_len < self.seq_len:
            raise ValueError("prompt_len must be in (0, seq_len) for on-policy data")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"save_dtype must be one of {sorted(SAVE_DTYPES)}, got {self.save_dtype!r}")
        if min(self.seq_len, self.batch_size, self.grad_accum, self.max_steps) < 1:
            raise ValueError("seq_len, batch_size, grad_accum and max_steps must be >= 1")
        if self.accept_prompts < 0 or not 1 <= self.accept_k <= 16:
            raise ValueError("accept_prompts must be >= 0 and accept_k in [1, 16]")

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir or self.out)


def forward_kl(p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of T^2 * KL(p || q). Logits: ``[..., vocab]``; p target, q draft."""
    log_p = F.log_softmax(p_logits.float() / temperature, dim=-1)
    log_q = F.log_softmax(q_logits.float() / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [...]
    return kl.mean() * temperature**2


def distill_loss(target, draft, tokens: torch.Tensor, temperature: float, bf16: bool) -> torch.Tensor:
    """``tokens``: ``[batch, seq_len]``; KL at every position."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        with torch.no_grad():
            p_logits = target(input_ids=tokens).logits  # [batch, seq_len, vocab]
        q_logits = draft(input_ids=tokens).logits  # [batch, seq_len, vocab]
    return forward_kl(p_logits, q_logits, temperature)


@torch.no_grad()
def sample_from_target(target, prompts: torch.Tensor, seq_len: int, seed: int, bf16: bool) -> torch.Tensor:
    """Continue ``prompts`` ``[batch, prompt_len]`` to ``[batch, seq_len]`` by sampling p at T=1."""
    # generate() draws from the global RNG; seed it per (rank, step) so resume replays it.
    torch.manual_seed(seed)
    with torch.autocast(prompts.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = target.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=seq_len - prompts.shape[1],
            # Fixed length (EOS masked until the end): no padding to track. A small
            # deviation from p, which would otherwise end documents with EOS.
            min_new_tokens=seq_len - prompts.shape[1],
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
        )
    return out[:, :seq_len]


def make_batch(cfg: DistillConfig, sampler: TokenWindows, target, step: int, micro: int, rank: int, bf16: bool, device) -> torch.Tensor:
    """One micro-batch of token sequences ``[batch, seq_len]``."""
    windows = sampler.batch(cfg.batch_size, step, micro)[:, : cfg.seq_len].to(device)  # [batch, seq_len]
    n_policy = round(cfg.batch_size * cfg.on_policy_fraction)
    if n_policy:
        seed = int(np.random.SeedSequence([cfg.seed, rank, step, micro]).generate_state(1)[0])
        sampled = sample_from_target(target, windows[:n_policy, : cfg.prompt_len], cfg.seq_len, seed, bf16)
        windows = torch.cat([sampled, windows[n_policy:]])
    return windows


@dataclass
class DistillResult:
    model: LlamaForCausalLM
    summary: dict


def distill(cfg: DistillConfig) -> dict:
    return run_distill(cfg).summary


def run_distill(cfg: DistillConfig) -> DistillResult:
    # 1. Processes.
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    d = distributed.setup(cfg.device)
    run = cfg.run_path
    if d.is_main:
        run.mkdir(parents=True, exist_ok=True)
    d.barrier()
    progress = TrainProgress(cfg.max_steps, enabled=d.is_main)
    log = RunLog(run / "distill.log", d.is_main, progress)
    bf16 = use_bf16(cfg.precision, d.device)

    # 2. Target, frozen, and its tokenizer.
    tokenizer = load_tokenizer(cfg.target)
    target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32).to(d.device).eval()
    target.requires_grad_(False)
    log(f"target {cfg.target}: {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M parameters; bf16={bf16}")

    # 3. Data (the seq_len + 1 windows of TokenWindows; distillation uses the first seq_len).
    train_files, val_files = split_files(collect_files(cfg.data), cfg.val_fraction)
    train_tokens = tokenize_documents(filter(None, map(read_text, train_files)), tokenizer)
    val_tokens = tokenize_documents(filter(None, map(read_text, val_files)), tokenizer)
    sampler = TokenWindows(train_tokens, cfg.seq_len, seed=cfg.seed, rank=d.rank)
    val_windows = None
    if len(val_tokens) > cfg.seq_len:
        val_windows = TokenWindows(val_tokens, cfg.seq_len).fixed(cfg.eval_windows)[:, : cfg.seq_len]
    log(f"data: {len(train_tokens):,} train tokens, {len(val_tokens):,} held-out tokens")

    # 4. Draft, optimizer, schedule.
    torch.manual_seed(cfg.seed)
    if cfg.init_draft:
        draft = AutoModelForCausalLM.from_pretrained(cfg.init_draft, dtype=torch.float32)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError("init_draft vocabulary differs from the target's")
    else:
        draft = LlamaForCausalLM(cfg.draft.llama_config(target.config.vocab_size, tokenizer.eos_token_id))
    draft = draft.to(d.device)
    n_params = sum(p.numel() for p in draft.parameters())
    log(f"draft: {n_params / 1e6:.2f}M parameters")
    optimizer = make_optimizer(draft, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, cfg.max_steps))

    # 5. Resume.
    step, tokens_seen, elapsed, last_loss, first_loss = 0, 0, 0.0, float("nan"), float("nan")
    ckpt_path = run / CHECKPOINT_NAME
    if cfg.resume and ckpt_path.exists():
        ckpt = load_checkpoint(ckpt_path)
        draft.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        sampler.check_state(ckpt["sampler"])
        set_rng_state(ckpt["rng"])
        step, tokens_seen, elapsed = ckpt["step"], ckpt["tokens_seen"], ckpt["elapsed"]
        last_loss, first_loss = ckpt["last_loss"], ckpt["first_loss"]
        log(f"resumed from {ckpt_path} at step {step}")
        del ckpt

    ddp_draft = DDP(draft, device_ids=[d.device.index] if d.device.type == "cuda" else None) if d.enabled else draft

    def checkpoint() -> None:
        if d.is_main:
            save_checkpoint(
                ckpt_path,
                model=draft.state_dict(),
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

    @torch.no_grad()
    def evaluate() -> float:
        draft.eval()
        mine = val_windows[d.rank :: d.world_size]
        total = torch.zeros(2, dtype=torch.float64)
        for i in range(0, len(mine), cfg.batch_size):
            chunk = mine[i : i + cfg.batch_size].to(d.device)
            total[0] += distill_loss(target, draft, chunk, cfg.temperature, bf16).item() * len(chunk)
            total[1] += len(chunk)
        total = d.sum(total).cpu()
        draft.train()
        return (total[0] / total[1]).item() if total[1] else float("nan")

    # 6. Distill.
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * d.world_size
    draft.train()
    last_ckpt = time.time()
    window_start, window_tokens = time.time(), 0
    eval_loss = float("nan")
    end = min(cfg.max_steps, cfg.stop_at_step or cfg.max_steps)
    progress.start(step)
    while step < end:
        step_start = time.time()
        loss_sum = 0.0
        for micro in range(cfg.grad_accum):
            tokens = make_batch(cfg, sampler, target, step, micro, d.rank, bf16, d.device)  # [batch, seq_len]
            sync = micro == cfg.grad_accum - 1
            ctx = ddp_draft.no_sync() if (d.enabled and not sync) else nullcontext()
            with ctx:
                loss = distill_loss(target, ddp_draft, tokens, cfg.temperature, bf16) / cfg.grad_accum
                loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.optim.grad_clip)
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
            log(f"step {step}/{cfg.max_steps} kl {last_loss:.4f} lr {scheduler.get_last_lr()[0]:.2e} tok/s {tok_s:,.0f}")
            window_start, window_tokens = time.time(), 0
        if val_windows is not None and cfg.eval_every and (step % cfg.eval_every == 0 or step == end):
            eval_loss = evaluate()
            log(f"step {step} held-out kl {eval_loss:.4f}")
        due_by_steps = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
        due_by_time = cfg.checkpoint_minutes and time.time() - last_ckpt >= cfg.checkpoint_minutes * 60
        if due_by_steps or due_by_time or step == end:
            checkpoint()
            last_ckpt = time.time()
    progress.stop()
    if val_windows is not None and math.isnan(eval_loss):
        eval_loss = evaluate()

    identical = True
    if d.enabled:
        fp = weights_checksum(draft)
        lo, hi = fp.clone(), fp.clone()
        torch.distributed.all_reduce(lo, op=torch.distributed.ReduceOp.MIN)
        torch.distributed.all_reduce(hi, op=torch.distributed.ReduceOp.MAX)
        identical = bool(torch.equal(lo, hi))

    summary = {
        "steps": step,
        "tokens_seen": tokens_seen,
        "first_kl": first_loss,
        "train_kl": last_loss,
        "held_out_kl": eval_loss,
        "wall_time_s": elapsed,
        "parameters": n_params,
        "bf16": bf16,
        "world_size": d.world_size,
        "ranks_identical": identical,
    }

    # 7. Save the draft with the target's tokenizer.
    if d.is_main:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        export = copy.deepcopy(draft).to("cpu", SAVE_DTYPES[cfg.save_dtype])
        eos = tokenizer.eos_token_id
        export.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
        export.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        log(f"saved draft to {out}")

        # 8. Acceptance of the saved draft on held-out prompts (prefixes of held-out windows).
        plen = min(ACCEPT_PROMPT_LEN, cfg.seq_len // 2)  # prompt + continuation stay within the trained context
        if cfg.accept_prompts and len(val_tokens) > plen + 1:
            prompts = TokenWindows(val_tokens, plen).fixed(cfg.accept_prompts)[:, :plen]
            summary["held_out_acceptance"] = draft_acceptance(cfg.target, str(out), prompts.tolist(), k=cfg.accept_k,
                                                              max_tokens=plen // 2, device=str(d.device))
            log(f"held-out {format_acceptance(summary['held_out_acceptance'])}")
        write_distill_card(out, cfg, summary)
    d.barrier()
    distributed.teardown(d)
    return DistillResult(model=draft, summary=summary)


def write_distill_card(out: Path, cfg: DistillConfig, summary: dict) -> Path:
    m = cfg.draft
    facts = {
        "architecture": "LlamaForCausalLM (draft)",
        "target": cfg.target,
        "parameters": summary["parameters"],
        "hidden / layers / heads / kv heads": f"{m.hidden_size} / {m.num_layers} / {m.num_heads} / {m.num_kv_heads}"
        if not cfg.init_draft
        else f"initialised from {cfg.init_draft}",
        "objective": f"forward KL(p_target || q_draft), temperature {cfg.temperature:g}",
        "on-policy share": cfg.on_policy_fraction,
        "data": describe_sources(cfg.data),
        "steps (done / planned)": f"{summary['steps']:,} / {cfg.max_steps:,}",
        "tokens seen": summary["tokens_seen"],
        "precision": ("bf16 autocast" if summary["bf16"] else "fp32") + f", saved as {cfg.save_dtype}",
        "wall time": f"{summary['wall_time_s']:.0f} s",
        "initial / final train KL": f"{summary['first_kl']:.4f} / {summary['train_kl']:.4f}",
        "final held-out KL": summary["held_out_kl"],
    }
    if "held_out_acceptance" in summary:
        facts["greedy acceptance on held-out prompts"] = format_acceptance(summary["held_out_acceptance"])
    text = (
        "A draft model distilled from the target's logits with `specdec.training.distill`, "
        "sharing the target's tokenizer, for speculative decoding."
    )
    return write_model_card(out, f"specdec draft: {out.name}", text, facts, cfg.command)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec distill", description="Distill a draft model from a target's logits.")
    p.add_argument("--target", required=True)
    p.add_argument("--data", nargs="+", required=True, help="files or folders ('stdlib' = Python stdlib minus tests)")
    p.add_argument("--out", required=True)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--init-draft", default=None)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=704)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--on-policy-fraction", type=float, default=0.0)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--val-fraction", type=float, default=0.02)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--stop-at-step", type=int, default=None)
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
    p.add_argument("--accept-prompts", type=int, default=8, help="held-out prompts for the acceptance report (0: skip)")
    p.add_argument("--accept-k", type=int, default=4, help="draft length for the acceptance report")
    return p


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    cfg = DistillConfig(
        target=a.target,
        data=a.data,
        out=a.out,
        run_dir=a.run_dir,
        init_draft=a.init_draft,
        draft=ModelShape(
            hidden_size=a.hidden_size,
            num_layers=a.layers,
            num_heads=a.heads,
            num_kv_heads=a.kv_heads,
            intermediate_size=a.intermediate_size,
            max_position_embeddings=a.max_position_embeddings,
            rope_theta=a.rope_theta,
        ),
        temperature=a.temperature,
        on_policy_fraction=a.on_policy_fraction,
        prompt_len=a.prompt_len,
        val_fraction=a.val_fraction,
        seq_len=a.seq_len,
        batch_size=a.batch_size,
        grad_accum=a.grad_accum,
        max_steps=a.max_steps,
        stop_at_step=a.stop_at_step,
        eval_every=a.eval_every,
        eval_windows=a.eval_windows,
        log_every=a.log_every,
        checkpoint_every=a.checkpoint_every,
        checkpoint_minutes=a.checkpoint_minutes,
        resume=a.resume,
        precision=a.precision,
        threads=a.threads,
        device=a.device,
        seed=a.seed,
        save_dtype=a.save_dtype,
        accept_prompts=a.accept_prompts,
        accept_k=a.accept_k,
        optim=OptimConfig(
            lr=a.lr, warmup_steps=a.warmup_steps, min_lr_ratio=a.min_lr_ratio, weight_decay=a.weight_decay, grad_clip=a.grad_clip
        ),
        command=launch_command("specdec.training.distill", argv),
    )
    return distill(cfg)


if __name__ == "__main__":
    main()
