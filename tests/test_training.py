"""specdec.training on tiny models and a tiny corpus (fast, CPU only)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specdec.training.checkpoint import load_checkpoint  # noqa: E402
from specdec.training.data import (  # noqa: E402
    HELD_OUT_DIRS,
    TokenWindows,
    collect_files,
    split_files,
    stdlib_files,
    tokenize_documents,
)
from specdec.training.tokenizer import EOS_TOKEN, TokenizerConfig, save_tokenizer, train_tokenizer  # noqa: E402
from specdec.training.train import (  # noqa: E402
    ModelShape,
    OptimConfig,
    TrainConfig,
    lr_lambda,
    main,
    train,
)

SNIPPET = '''\
def add(a, b):
    """Return the sum of a and b."""
    return a + b


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value


for i in range(10):
    print(add(i, i * 2))
'''

TINY = ModelShape(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, max_position_embeddings=64)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(12):
        text = SNIPPET.replace("add", f"add_{i}").replace("Counter", f"Counter{i}")
        (root / f"mod_{i}.py").write_text(text * 3)
    (root / "notes.txt").write_text("not python\n")
    return root


def tiny_cfg(corpus: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        data=[str(corpus)],
        out=str(out),
        vocab_size=300,
        val_fraction=0.2,
        seq_len=32,
        batch_size=4,
        max_steps=30,
        eval_every=0,
        eval_windows=4,
        log_every=10,
        checkpoint_minutes=0,
        precision="fp32",
        threads=1,
        model=TINY,
        optim=OptimConfig(lr=1e-2, warmup_steps=3),
    )
    base.update(kw)
    return TrainConfig(**base)


# Data ------------------------------------------------------------------------


def test_stdlib_files_hold_out_tests():
    train_files = stdlib_files()
    test_files = stdlib_files(include_tests=True)
    assert train_files and test_files
    assert not set(train_files) & set(test_files)
    for f in train_files:
        assert not HELD_OUT_DIRS & set(f.parts), f
        assert "site-packages" not in f.parts
    assert any(f.name == "os.py" for f in train_files)


def test_collect_and_split(corpus):
    files = collect_files([corpus])
    assert len(files) == 12 and all(f.suffix == ".py" for f in files)
    train_a, val_a = split_files(files, 0.2)
    train_b, val_b = split_files(files, 0.2)
    assert (train_a, val_a) == (train_b, val_b)
    assert val_a and not set(train_a) & set(val_a)


def test_windows_are_deterministic_per_step_and_differ_per_rank():
    tokens = torch.arange(1000).numpy().astype("uint16")
    a = TokenWindows(tokens, seq_len=16, seed=0, rank=0)
    b = TokenWindows(tokens, seq_len=16, seed=0, rank=1)
    w = a.batch(4, step=7)
    assert w.shape == (4, 17) and w.dtype == torch.int64
    assert torch.equal(w[:, 1:] - w[:, :-1], torch.ones(4, 16, dtype=torch.int64))  # contiguous
    assert torch.equal(w, a.batch(4, step=7))
    assert not torch.equal(w, a.batch(4, step=8))
    assert not torch.equal(w, b.batch(4, step=7))


def test_lr_schedule_warmup_then_cosine_to_ten_percent():
    f = lr_lambda(OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1), max_steps=100)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.55)
    assert f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 100))


def test_config_validation():
    with pytest.raises(ValueError):
        ModelShape(hidden_size=30, num_heads=4)
    with pytest.raises(ValueError):
        ModelShape(num_heads=8, num_kv_heads=3)
    with pytest.raises(ValueError):
        TrainConfig(data=["x"], out="y", precision="fp8")
    with pytest.raises(ValueError):
        TrainConfig(data=["x"], out="y", seq_len=4096)
    from specdec.training.distill import DistillConfig

    with pytest.raises(ValueError, match="val_fraction"):  # the fields both configs share, checked for both
        DistillConfig(target="t", data=["x"], out="y", val_fraction=1.0)
    with pytest.raises(ValueError, match="no data given"):
        DistillConfig(target="t", data=[], out="y")


def test_train_options_reach_the_config():
    from specdec.training import train as train_cli

    args = train_cli.build_parser().parse_args([
        "--data", "a", "b", "--out", "o", "--hidden-size", "16", "--layers", "3", "--heads", "2", "--kv-heads", "1",
        "--max-position-embeddings", "64", "--rope-theta", "500", "--no-tie-embeddings", "--seq-len", "16",
        "--beta2", "0.9", "--lr", "1e-3", "--vocab-size", "300",
    ])  # fmt: skip
    cfg = train_cli.config_from_args(args, "cmd")
    assert cfg.model == ModelShape(hidden_size=16, num_layers=3, num_heads=2, num_kv_heads=1,
                                   max_position_embeddings=64, rope_theta=500.0, tie_embeddings=False)
    assert (cfg.data, cfg.out, cfg.seq_len, cfg.vocab_size, cfg.command) == (["a", "b"], "o", 16, 300, "cmd")
    assert (cfg.optim.lr, cfg.optim.beta2) == (1e-3, 0.9)
    llama = cfg.model.llama_config(vocab_size=300, eos_id=0)
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads,
            llama.max_position_embeddings, llama.tie_word_embeddings) == (16, 3, 2, 1, 64, False)


# Tokenizer -------------------------------------------------------------------


def test_tokenizer_round_trips_through_auto_tokenizer(tmp_path, corpus):
    from transformers import AutoTokenizer

    texts = [f.read_text() for f in collect_files([corpus])]
    tok = train_tokenizer(texts, TokenizerConfig(vocab_size=300))
    save_tokenizer(tok, tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert loaded.eos_token == loaded.bos_token == loaded.pad_token == EOS_TOKEN
    assert loaded.eos_token_id == 0
    sample = "def f(x):\n    return x  # ünïcode → ok\n\n\tTabs too\n"
    ids = loaded(sample, add_special_tokens=False)["input_ids"]
    assert loaded.decode(ids) == sample
    assert ids == tok(sample, add_special_tokens=False)["input_ids"]
    flat = tokenize_documents(["a = 1\n", "b = 2\n"], loaded)
    assert flat.dtype.name == "uint16" and (flat == 0).sum() == 2 and flat[-1] == 0


# Training --------------------------------------------------------------------


def test_train_loss_decreases_and_folder_loads(tmp_path, corpus):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    summary = main(
        [
            "--data", str(corpus), "--out", str(out), "--vocab-size", "300", "--val-fraction", "0.2",
            "--hidden-size", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
            "--intermediate-size", "64", "--max-position-embeddings", "64", "--seq-len", "32",
            "--batch-size", "4", "--max-steps", "40", "--lr", "1e-2", "--warmup-steps", "3",
            "--eval-every", "20", "--eval-windows", "4", "--threads", "1", "--save-dtype", "float32",
        ]
    )  # fmt: skip
    assert summary["steps"] == 40
    assert summary["train_loss"] < summary["first_loss"] - 1.0
    assert summary["held_out_loss"] < summary["first_loss"]
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md"):
        assert (out / name).exists(), name
    card = (out / "README.md").read_text()
    assert "python -m specdec.training.train --data" in card and "held-out loss" in card

    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert model.config.num_key_value_heads == 2 and model.config.tie_word_embeddings
    assert model.dtype == torch.float32
    ids = tok("def add", return_tensors="pt")["input_ids"]
    gen = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] >= ids.shape[1] + 1
    assert model.generation_config.eos_token_id == tok.eos_token_id


def test_save_dtype_bfloat16(tmp_path, corpus):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    train(tiny_cfg(corpus, out, max_steps=2, save_dtype="bfloat16"))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype="auto")
    assert model.dtype == torch.bfloat16


def test_resume_reaches_the_same_state(tmp_path, corpus):
    straight = tiny_cfg(corpus, tmp_path / "a", max_steps=12, batch_size=2, grad_accum=2)
    train(straight)
    split = replace(straight, out=str(tmp_path / "b"), stop_at_step=6)
    first = train(split)
    assert first["steps"] == 6
    train(replace(split, stop_at_step=None, resume=True))

    a = load_checkpoint(tmp_path / "a" / "checkpoint.pt")
    b = load_checkpoint(tmp_path / "b" / "checkpoint.pt")
    assert a["step"] == b["step"] == 12 and a["tokens_seen"] == b["tokens_seen"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["scheduler"] == b["scheduler"]
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    assert a["last_loss"] == b["last_loss"]


def test_bf16_autocast_trains(tmp_path, corpus):
    summary = train(tiny_cfg(corpus, tmp_path / "out", max_steps=20, precision="bf16"))
    assert summary["bf16"] and summary["train_loss"] < summary["first_loss"] - 0.5


DDP_SCRIPT = """
import faulthandler, os, pickle, sys
import torch
from specdec.training.train import run_training

faulthandler.dump_traceback_later(90, exit=True)  # a hung collective fails with stacks, not silence

cfg = pickle.loads(bytes.fromhex(sys.argv[1]))
result = run_training(cfg)
torch.save(
    {"weights": result.model.state_dict(), "summary": result.summary},
    os.path.join(cfg.run_dir, f"rank{os.environ['RANK']}.pt"),
)
"""


def test_ddp_two_ranks_identical_weights(tmp_path, corpus):
    cfg = tiny_cfg(corpus, tmp_path / "out", run_dir=str(tmp_path / "run"), max_steps=20)
    (tmp_path / "run").mkdir()
    script = tmp_path / "ddp_train.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), pickle.dumps(cfg).hex()]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    r0 = torch.load(tmp_path / "run" / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "run" / "rank1.pt", weights_only=False)
    for k in r0["weights"]:
        assert torch.equal(r0["weights"][k], r1["weights"][k]), k
    s = r0["summary"]
    assert s["world_size"] == 2 and s["ranks_identical"]
    assert s["tokens_seen"] == 20 * 2 * cfg.batch_size * cfg.seq_len
    assert s["train_loss"] < s["first_loss"] - 0.5
    assert (tmp_path / "out" / "model.safetensors").exists()


# Distillation ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("target")
    train(tiny_cfg(corpus, out, max_steps=30, save_dtype="float32"))
    return out


def test_forward_kl_is_zero_for_equal_logits_and_positive_otherwise():
    from specdec.training.distill import forward_kl

    p = torch.randn(2, 5, 11)
    assert forward_kl(p, p).item() == pytest.approx(0.0, abs=1e-6)
    q = torch.randn(2, 5, 11)
    manual = (p.softmax(-1) * (p.log_softmax(-1) - q.log_softmax(-1))).sum(-1).mean()
    assert forward_kl(p, q).item() == pytest.approx(manual.item(), rel=1e-5)
    assert forward_kl(p, q, temperature=2.0).item() > 0


def test_distill_reduces_kl_and_saves_draft_with_target_tokenizer(tmp_path, corpus, tiny_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.training.distill import DistillConfig, distill

    out = tmp_path / "draft"
    cfg = DistillConfig(
        target=str(tiny_target),
        data=[str(corpus)],
        out=str(out),
        draft=ModelShape(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, max_position_embeddings=64),
        val_fraction=0.2,
        seq_len=32,
        batch_size=4,
        max_steps=30,
        eval_every=0,
        eval_windows=4,
        checkpoint_minutes=0,
        precision="fp32",
        threads=1,
        save_dtype="float32",
        optim=OptimConfig(lr=1e-2, warmup_steps=3),
    )
    summary = distill(cfg)
    assert summary["train_kl"] < summary["first_kl"] * 0.7
    assert summary["held_out_kl"] < summary["first_kl"]
    acc = summary["held_out_acceptance"]  # greedy acceptance of the saved draft by the target, k = 4 fixed
    assert acc["num_drafts"] > 0 and 0 <= acc["acceptance_rate"] <= 1
    assert len(acc["acceptance_rate_per_pos"]) == 4 and 1 <= acc["mean_acceptance_length"] <= 5
    assert "greedy acceptance on held-out prompts" in (out / "README.md").read_text()
    draft = AutoModelForCausalLM.from_pretrained(str(out))
    target_tok = AutoTokenizer.from_pretrained(str(tiny_target))
    draft_tok = AutoTokenizer.from_pretrained(str(out))
    assert draft_tok.get_vocab() == target_tok.get_vocab()
    assert draft.config.vocab_size == AutoModelForCausalLM.from_pretrained(str(tiny_target)).config.vocab_size

    # On-policy batches (half sampled from the target) run and resume from the checkpoint.
    policy = replace(cfg, out=str(tmp_path / "draft2"), init_draft=str(out), on_policy_fraction=0.5, prompt_len=8, max_steps=4, resume=True)
    s2 = distill(policy)
    assert s2["steps"] == 4 and s2["train_kl"] == s2["train_kl"]  # finite


def test_distill_options_reach_the_config(tmp_path, corpus, tiny_target):
    from dataclasses import asdict

    from specdec.training.distill import DEFAULT_DRAFT, main as distill_main

    summary = distill_main([
        "--target", str(tiny_target), "--data", str(corpus), "--out", str(tmp_path / "d"), "--run-dir",
        str(tmp_path / "run"), "--layers", "1", "--hidden-size", "16", "--heads", "2", "--kv-heads", "1",
        "--intermediate-size", "32", "--max-position-embeddings", "64", "--temperature", "2",
        "--on-policy-fraction", "0.5", "--prompt-len", "8", "--accept-prompts", "0", "--accept-k", "3",
        "--val-fraction", "0.2", "--seq-len", "32", "--batch-size", "2", "--max-steps", "1", "--eval-windows", "2",
        "--lr", "1e-3", "--threads", "1", "--precision", "fp32", "--save-dtype", "float32",
    ])  # fmt: skip
    assert summary["steps"] == 1 and "held_out_acceptance" not in summary
    cfg = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["config"]  # the DistillConfig, as a dict
    shape = replace(DEFAULT_DRAFT, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32,
                    max_position_embeddings=64)
    assert cfg["draft"] == asdict(shape) and cfg["target"] == str(tiny_target) and cfg["init_draft"] is None
    assert (cfg["temperature"], cfg["on_policy_fraction"], cfg["prompt_len"]) == (2.0, 0.5, 8)
    assert (cfg["accept_prompts"], cfg["accept_k"], cfg["seq_len"], cfg["batch_size"]) == (0, 3, 32, 2)
    assert cfg["optim"] == asdict(OptimConfig(lr=1e-3)) and cfg["out"] == str(tmp_path / "d")
    assert cfg["command"].startswith("python -m specdec.training.distill --target")
