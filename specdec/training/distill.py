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

Steps: 1. processes; 2. target and its tokenizer; 3. data; 4. draft; 5. resume
and 6. distill, both in ``loop.run_loop`` (which makes the optimizer and its
schedule); 7. save the draft folder; 8. measure the saved draft's acceptance by
the target on held-out prompts (greedy, k fixed).

    python -m specdec.training.distill --target TARGET --data stdlib --out DRAFT
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from specdec.training import distributed
from specdec.training.acceptance import draft_acceptance, format_acceptance
from specdec.training.data import TokenWindows, describe_sources, held_out_windows, read_split, tokenize_documents
from specdec.training.loop import (RunConfig, add_loop_args, fields_from_args, launch_command, loop_config_from_args,
                                   run_loop, start_run)
from specdec.training.model_card import write_model_card
from specdec.training.tokenizer import load_tokenizer
from specdec.training.train import ModelShape, add_shape_args, export_hf_folder, shape_from_args


DEFAULT_DRAFT = ModelShape(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=704)
ACCEPT_PROMPT_LEN = 128  # tokens of held-out text before each acceptance-report continuation


@dataclass
class DistillConfig(RunConfig):
    """What to distill from which target (see :class:`RunConfig` for data, output and the loop)."""

    target: str  # Hugging Face folder (or hub id) of the target
    init_draft: str | None = None  # start from this folder instead of random init
    draft: ModelShape = field(default_factory=lambda: DEFAULT_DRAFT)
    temperature: float = 1.0
    on_policy_fraction: float = 0.0  # share of each batch sampled from the target
    prompt_len: int = 32  # corpus prefix before an on-policy continuation
    accept_prompts: int = 8  # held-out prompts for the final acceptance report (0: skip it)
    accept_k: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 <= self.on_policy_fraction <= 1:
            raise ValueError(f"on_policy_fraction must be in [0, 1], got {self.on_policy_fraction}")
        if self.on_policy_fraction and not 0 < self.prompt_len < self.seq_len:
            raise ValueError("prompt_len must be in (0, seq_len) for on-policy data")
        if self.accept_prompts < 0 or not 1 <= self.accept_k <= 16:
            raise ValueError("accept_prompts must be >= 0 and accept_k in [1, 16]")


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
    d, log, bf16 = start_run(cfg, "distill.log")

    # 2. Target, frozen, and its tokenizer.
    tokenizer = load_tokenizer(cfg.target)
    target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32).to(d.device).eval()
    target.requires_grad_(False)
    log(f"target {cfg.target}: {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M parameters; bf16={bf16}")

    # 3. Data (the seq_len + 1 windows of TokenWindows; distillation uses the first seq_len).
    _, (train_texts, val_texts) = read_split(cfg.data, cfg.val_fraction)
    train_tokens = tokenize_documents(train_texts, tokenizer)
    val_tokens = tokenize_documents(val_texts, tokenizer)
    del train_texts, val_texts
    sampler = TokenWindows(train_tokens, cfg.seq_len, seed=cfg.seed, rank=d.rank)
    val_windows = held_out_windows(val_tokens, cfg.seq_len, cfg.eval_windows)
    if val_windows is not None:
        val_windows = val_windows[:, : cfg.seq_len]  # [n, seq_len]
    log(f"data: {len(train_tokens):,} train tokens, {len(val_tokens):,} held-out tokens")

    # 4. Draft.
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

    # 5. Resume if asked, and 6. distill with periodic eval and checkpoints.
    def batch(step: int, micro: int) -> torch.Tensor:
        return make_batch(cfg, sampler, target, step, micro, d.rank, bf16, d.device)  # [batch, seq_len]

    def loss(ddp_draft, tokens: torch.Tensor) -> torch.Tensor:
        return distill_loss(target, ddp_draft, tokens, cfg.temperature, bf16)

    r = run_loop(cfg, d, log, draft, sampler, batch, loss, val_windows, "kl")
    summary = r.summary("kl", parameters=n_params, bf16=bf16)

    # 7. Save the draft with the target's tokenizer.
    if d.is_main:
        out = export_hf_folder(draft, tokenizer, Path(cfg.out), cfg.save_dtype)
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
    p.add_argument("--method", choices=["draft_model", "eagle3", "pard"], default="draft_model",
                   help="draft_model: a small draft model (this command's options); eagle3: an EAGLE-3 head "
                        "(options: --method eagle3 --help); pard: a draft adapted to parallel drafting "
                        "(options: --method pard --help)")
    p.add_argument("--target", required=True)
    add_loop_args(p)
    p.add_argument("--init-draft", default=None)
    add_shape_args(p, DEFAULT_DRAFT)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--on-policy-fraction", type=float, default=0.0)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--accept-prompts", type=int, default=8, help="held-out prompts for the acceptance report (0: skip)")
    p.add_argument("--accept-k", type=int, default=4, help="draft length for the acceptance report")
    return p


def split_method(argv: list[str]) -> tuple[str, list[str]]:
    """``--method`` (draft_model, eagle3 or pard) and the other options."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--method", default="draft_model")
    known, _ = pre.parse_known_args(argv)
    if known.method not in ("draft_model", "eagle3", "pard"):
        raise ValueError(f"--method {known.method!r} is not one distill trains: draft_model (a small draft model), "
                         "eagle3 (an EAGLE-3 head) or pard (a draft adapted to parallel drafting)")
    rest, skip = [], False
    for i, x in enumerate(argv):
        if skip:
            skip = False
        elif x == "--method":
            skip = True
        elif not x.startswith("--method="):
            rest.append(x)
    return known.method, rest


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    method, argv = split_method(argv)
    if method == "eagle3":
        from specdec.training.eagle3 import main as eagle3_main

        return eagle3_main(argv)
    if method == "pard":
        from specdec.training.pard import main as pard_main

        return pard_main(argv)
    a = build_parser().parse_args(argv)
    own = fields_from_args(a, "target init_draft temperature on_policy_fraction prompt_len accept_prompts accept_k")
    return distill(DistillConfig(**loop_config_from_args(a), **own, draft=shape_from_args(a),
                                 command=launch_command("specdec.training.distill", argv)))


if __name__ == "__main__":
    main()
