"""specdec.training.finetune: a saved model trained further on new text (tiny model, tiny corpus, CPU)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specdec.training.finetune import FinetuneConfig, finetune, main  # noqa: E402
from specdec.training.train import ModelShape, OptimConfig, TrainConfig, train  # noqa: E402

CODE = '''\
def add(a, b):
    """Return the sum of a and b."""
    return a + b


class Counter:
    def __init__(self, start=0):
        self.value = start
'''
# the "target's outputs": text the starting model never saw, in the same tokens
OUTPUTS = "        self.value = self.value + 1\n        return self.value\n"

LOOP = dict(val_fraction=0.2, seq_len=32, batch_size=4, eval_every=0, eval_windows=4, checkpoint_minutes=0,
            precision="fp32", threads=1, save_dtype="float32", optim=OptimConfig(lr=1e-2, warmup_steps=3))


@pytest.fixture(scope="module")
def start(tmp_path_factory) -> Path:
    """A tiny model trained from scratch on CODE, with its own tokenizer."""
    root = tmp_path_factory.mktemp("ft")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(10):
        (corpus / f"mod_{i}.py").write_text(CODE.replace("add", f"add_{i}") * 3)
    out = root / "start"
    shape = ModelShape(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                       max_position_embeddings=64)
    train(TrainConfig(data=[str(corpus)], out=str(out), vocab_size=300, max_steps=30, model=shape, **LOOP))
    return out


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("outputs")
    for i in range(10):
        (folder / f"out_{i}.py").write_text(OUTPUTS.replace("1", str(i)) * 6)
    return folder


def test_finetune_starts_from_the_weights_learns_the_new_text_and_keeps_the_tokenizer(tmp_path, start, outputs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "tuned"
    summary = main(["--init-model", str(start), "--data", str(outputs), "--out", str(out), "--val-fraction", "0.2",
                    "--seq-len", "32", "--batch-size", "4", "--max-steps", "30", "--lr", "1e-2", "--warmup-steps", "3",
                    "--eval-every", "30", "--eval-windows", "4", "--threads", "1", "--precision", "fp32",
                    "--save-dtype", "float32"])
    vocab = len(AutoTokenizer.from_pretrained(str(start)))
    # a random initialisation would start near ln(vocab); the trained start is far below it
    assert summary["first_loss"] < math.log(vocab) - 1.5
    assert summary["train_loss"] < summary["first_loss"] - 0.5
    assert summary["held_out_loss"] < summary["first_loss"]
    assert AutoTokenizer.from_pretrained(str(out)).get_vocab() == AutoTokenizer.from_pretrained(str(start)).get_vocab()
    before = AutoModelForCausalLM.from_pretrained(str(start))
    after = AutoModelForCausalLM.from_pretrained(str(out))
    assert after.config.hidden_size == before.config.hidden_size == 32
    assert not torch.equal(after.model.embed_tokens.weight, before.model.embed_tokens.weight)
    card = (out / "README.md").read_text()
    assert "python -m specdec.training.finetune --init-model" in card and str(start) in card


def test_init_model_must_be_a_model_folder(tmp_path, outputs):
    with pytest.raises(ValueError, match="not a Hugging Face model folder"):
        FinetuneConfig(data=[str(outputs)], out=str(tmp_path / "o"), init_model=str(tmp_path))


def test_seq_len_beyond_the_model_positions_is_refused(tmp_path, start, outputs):
    cfg = FinetuneConfig(data=[str(outputs)], out=str(tmp_path / "o"), init_model=str(start), max_steps=1,
                         **{**LOOP, "seq_len": 128})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        finetune(cfg)
