"""benchmarks/make_standin.py: the padded stand-in computes its source's function exactly.

A tiny random target is padded to a larger small shape (wider stream, MLP and heads, a wider head,
more q/kv heads and layers) and loaded through specdec's own loading path: its logits must equal the
source's in float32 within rounding, and greedy decoding must give the same tokens.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.models.base import ForwardBatch
from specdec.models.load import load_runner
from tiny_models import make_model, random_prompts

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "make_standin.py"
_spec = importlib.util.spec_from_file_location("make_standin", _path)
standin = importlib.util.module_from_spec(_spec)
sys.modules["make_standin"] = standin
_spec.loader.exec_module(standin)
Shape = standin.Shape

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    # hidden 64, 4 q heads / 2 kv heads of 16 dims, MLP 128, 2 layers; tied embeddings as the shipped target
    return make_model(tmp_path_factory.mktemp("src"), hidden=64, layers=2, heads=4, kv_heads=2, tie=True, seed=5)


def logits_of(path: str, prompts: list[list[int]], backend: str = "torch", dtype: str = "float32") -> torch.Tensor:
    runner, _ = load_runner(path, backend, dtype=dtype)
    out = []
    for p in prompts:
        runner.reserve(1, len(p) + 1)
        runner.sync_rows([object()])
        out.append(runner.forward(ForwardBatch.from_rows([p], [0], logits="all")))  # [1, T, V]
    return torch.cat(out, dim=1)


SHAPES = {
    # a wider stream, MLP and group (8 q heads over the 2 kv heads), one layer more, the same head size
    "same head": Shape(hidden=160, intermediate=320, heads=8, kv_heads=2, layers=3, head_dim=16),
    # heads twice as wide (RoPE pairs at every 2nd pair), more kv heads than the source, 2 extra layers
    "wide head": Shape(hidden=256, intermediate=256, heads=8, kv_heads=4, layers=4, head_dim=32),
}


@pytest.mark.parametrize("name", SHAPES)
def test_standin_logits_and_greedy_equal_the_source(source, tmp_path, name):
    shape = SHAPES[name]
    out = standin.build(source, shape, tmp_path / "standin", seed=1, progress=lambda line: None)
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (
        shape.hidden, shape.layers, shape.head_dim)
    assert config["rms_norm_eps"] == pytest.approx(1e-6 * 64 / shape.hidden)
    assert (out / "tokenizer.json").exists()
    prompts = random_prompts(3, [5, 17, 9], seed=2)
    want, got = logits_of(str(source), prompts), logits_of(str(out), prompts)
    assert got.shape == want.shape
    assert want.abs().max() > 1.0  # logits worth comparing: a broken pad would move them by as much
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    texts = ["w1 w2 w3", "w40 w7 w9 w100 w3"]
    a = [o.outputs[0].token_ids for o in LLM(model=str(source), backend="torch").generate(texts, params)]
    b = [o.outputs[0].token_ids for o in LLM(model=str(out), backend="torch").generate(texts, params)]
    assert a == b


def test_the_extra_parts_cost_but_change_nothing(source, tmp_path):
    """Extra heads, units and layers hold nonzero weights (they cost a full forward) but write nothing:
    o_proj and down_proj are zero outside the source's rows and columns."""
    from safetensors.torch import load_file

    shape = SHAPES["same head"]
    w = load_file(str(standin.build(source, shape, tmp_path / "s", progress=lambda line: None) / "model.safetensors"))
    extra = "model.layers.2."
    assert w[extra + "self_attn.q_proj.weight"].abs().sum() > 0 and w[extra + "mlp.up_proj.weight"].abs().sum() > 0
    assert w[extra + "self_attn.o_proj.weight"].abs().sum() == 0 and w[extra + "mlp.down_proj.weight"].abs().sum() == 0
    down = w["model.layers.0.mlp.down_proj.weight"]
    assert down[64:].abs().sum() == 0 and down[:, 128:].abs().sum() == 0 and down[:64, :128].abs().sum() > 0
    assert w["model.embed_tokens.weight"][:, 64:].abs().sum() == 0
    up = w["model.layers.0.mlp.up_proj.weight"]
    assert up[128:].abs().sum() > 0  # the extra MLP units are random, not zero


def test_a_parallel_draft_keeps_its_mask_token(source, tmp_path):
    """A draft padded to a draft's shape (the shipped drafts at llama-160m's) keeps the config keys the
    engine reads, such as a parallel draft's mask token and trained k."""
    import json
    import shutil

    pard = tmp_path / "pard"
    shutil.copytree(source, pard)
    config = json.loads((pard / "config.json").read_text())
    (pard / "config.json").write_text(json.dumps({**config, "pard_token": 7, "pard_max_k": 8}))
    out = standin.build(pard, SHAPES["same head"], tmp_path / "s", progress=lambda line: None)
    padded = json.loads((out / "config.json").read_text())
    assert (padded["pard_token"], padded["pard_max_k"], padded["hidden_size"]) == (7, 8, 160)
    assert standin.SHAPES["llama-160m"] == Shape(768, 3072, 12, 12, 12, 64)


def test_fit_and_its_errors():
    src = Shape(hidden=512, intermediate=1408, heads=8, kv_heads=4, layers=8, head_dim=64)  # the shipped target
    tiny, notes = standin.fit(standin.SHAPES["tinyllama-1.1b"], src)
    assert tiny == standin.SHAPES["tinyllama-1.1b"] and notes == []
    qwen, notes = standin.fit(standin.SHAPES["qwen2.5-0.5b"], src)  # 14 q / 2 kv heads: too few kv heads
    assert (qwen.heads, qwen.kv_heads) == (16, 4) and "16 q heads / 4 kv heads instead of 14 / 2" in notes[0]
    with pytest.raises(ValueError, match="hidden 256 is smaller than the source's 512"):
        standin.fit(Shape(256, 5632, 32, 4, 22, 64), src)
    with pytest.raises(ValueError, match="head_dim 96 is not a multiple of the source's 64"):
        standin.fit(Shape(2048, 5632, 32, 4, 22, 96), src)
    with pytest.raises(ValueError, match="hidden 2000 is not a multiple of 32 q heads"):
        standin.fit(Shape(2000, 5632, 32, 4, 22, 64), src)
    with pytest.raises(SystemExit):
        standin.parse_args(["--gguf", "q5_k"])


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_standin_on_llamacpp_matches_the_source(source, tmp_path, monkeypatch):
    """The GGUF path (specdec's float32 conversion, q/k rows permuted for llama.cpp's RoPE) keeps the
    function too, the wide head included."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    out = standin.build(source, SHAPES["wide head"], tmp_path / "standin", seed=1, progress=lambda line: None)
    prompts = random_prompts(2, [6, 11], seed=3)
    want, got = logits_of(str(source), prompts, "llama.cpp"), logits_of(str(out), prompts, "llama.cpp")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_gguf_files_of_a_bf16_standin(source, tmp_path, monkeypatch):
    """A bf16 source (as the shipped target): the stand-in's bf16 GGUF computes what the source's own bf16
    GGUF computes; q8_0 is written by llama.cpp's quantizer (an approximation, only its type is checked)."""
    from safetensors.torch import load_file, save_file

    from specdec.models.gguf import read_info

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "bf16"
    src.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (src / f.name).write_bytes(f.read_bytes())
    save_file({n: t.to(torch.bfloat16) for n, t in load_file(str(source / "model.safetensors")).items()},
              str(src / "model.safetensors"), metadata={"format": "pt"})
    # hidden 64 -> 256: RMSNorm weights scaled by sqrt(1/4), exact in bf16
    out = standin.build(src, Shape(256, 256, 8, 2, 3, 16), tmp_path / "standin", progress=lambda line: None)
    paths = standin.write_gguf(out, tmp_path, ["bf16", "q8_0"], progress=lambda line: None)
    assert read_info(str(paths["bf16"])).weight_type == "BF16" and read_info(str(paths["q8_0"])).weight_type == "Q8_0"
    prompts = random_prompts(2, [7, 12], seed=4)
    want = logits_of(str(src), prompts, "llama.cpp", "bfloat16")  # specdec's bf16 conversion of the source
    got = logits_of(str(paths["bf16"]), prompts, "llama.cpp", "auto")
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
