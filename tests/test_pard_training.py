"""``specdec distill --method pard`` (training/pard.py): PARD's layout computes, in one forward, what the
draft computes at inference after a history and its masks; a few steps train; a resumed run replays the
same weights; the saved draft loads as a parallel drafter whose greedy output equals the target's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lossless import assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.drafters.pard import ParallelDraftDrafter
from specdec.models.load import load_model
from specdec.training.distill import main as distill_main
from specdec.training.pard import keep_counts, pard_layout, pard_loss
from tiny_models import WORDS, make_model, random_prompts

TEXT = [" ".join(WORDS[(7 * d + 3 * i) % len(WORDS)] for i in range(300)) for d in range(6)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("pard-train")
    target = make_model(root / "target", "llama", layers=2, seed=0, max_pos=512)
    draft = make_model(root / "draft", "llama", layers=1, hidden=32, heads=2, kv_heads=1, seed=5, max_pos=512)
    data = root / "text"
    data.mkdir()
    for i, t in enumerate(TEXT):
        (data / f"doc{i}.py").write_text(t)
    return {"target": str(target), "draft": str(draft), "data": str(data), "root": root}


def test_the_layout_computes_what_inference_computes_after_the_history_and_its_masks(tiny):
    """Every kept slot's logits in the training forward equal the logits the draft gives when it reads
    the window's tokens up to p - i followed by i masks (transformers' plain causal forward)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny["draft"], dtype=torch.float32).eval()
    rows = model.config.vocab_size
    model.resize_token_embeddings(rows + 1)
    mask = rows
    windows = torch.randint(3, rows, (2, 17))  # [B, L + 1]
    batch = pard_layout(windows, 4, mask, 0.7, 0.2, np.random.default_rng(0))
    counts = keep_counts(16, 4, 0.7, 0.2)
    assert counts == [16, 11, 7, 5]
    with torch.no_grad():
        got = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                    attention_mask=batch.attention_mask).logits  # [B, N, V]
    checked = 0
    for b in range(2):
        per_copy = [0] * 4
        for n in range(batch.input_ids.shape[1]):
            if batch.labels[b, n] < 0:
                continue
            p = int(batch.position_ids[b, n])
            seen = batch.attention_mask[b, 0, n] == 0  # [N]
            i = int((seen & (batch.input_ids[b] == mask)).sum())  # masks on its chain, itself included
            per_copy[i] += 1
            ids = windows[b, : p - i + 1].tolist() + [mask] * i  # the history, then i masks
            with torch.no_grad():
                ref = model(torch.tensor([ids])).logits[0, -1]
            assert torch.allclose(got[b, n], ref, atol=1e-4), (b, n, p, i)
            assert int(batch.labels[b, n]) == int(windows[b, p + 1])
            checked += 1
        assert per_copy == counts  # conditional drop kept max(0.7^i, 0.2) of each copy
    assert checked == 2 * sum(counts)


def test_the_loss_trains_the_mask_positions(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["draft"], dtype=torch.float32)
    model.resize_token_embeddings(model.config.vocab_size + 1)
    windows = torch.randint(3, 100, (2, 17))
    batch = pard_layout(windows, 4, model.config.vocab_size - 1, 1.0, 1.0, np.random.default_rng(1))
    loss = pard_loss(model, batch, bf16=False)
    loss.backward()
    mask_row_grad = model.get_input_embeddings().weight.grad[-1]
    assert torch.isfinite(loss) and mask_row_grad.abs().sum() > 0  # the mask's embedding learns


def run(tiny, out: Path, extra: list[str]) -> dict:
    return distill_main(["--method", "pard", "--init-draft", tiny["draft"], "--data", tiny["data"],
                         "--out", str(out), "--seq-len", "32", "--batch-size", "2", "--max-steps", "6",
                         "--warmup-steps", "1", "--lr", "3e-3", "--eval-every", "3", "--eval-windows", "4",
                         "--val-fraction", "0.2", "--log-every", "1", "--max-k", "4", "--precision", "fp32",
                         "--save-dtype", "float32", "--seed", "3", "--accept-prompts", "0", *extra])


def test_training_resumes_to_the_same_weights_and_the_draft_serves(tiny):
    root = tiny["root"]
    whole = run(tiny, root / "whole", [])
    assert whole["steps"] == 6 and whole["train_loss"] < whole["first_loss"]
    run(tiny, root / "split", ["--stop-at-step", "3", "--checkpoint-every", "3"])
    resumed = run(tiny, root / "split", ["--resume"])
    assert resumed["steps"] == 6
    a, b = load_file(str(root / "whole" / "model.safetensors")), load_file(str(root / "split" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    config = json.loads((root / "whole" / "config.json").read_text())
    rows = json.loads((Path(tiny["draft"]) / "config.json").read_text())["vocab_size"]
    assert config["pard_token"] == rows and config["vocab_size"] == rows + 1 and config["pard_max_k"] == 4
    card = (root / "whole" / "README.md").read_text()
    assert "pard_token" in card and "--method pard" in card

    # the trained draft serves as a parallel drafter: greedy output equals the target's own
    prompts = random_prompts(2, [5, 12], seed=4)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(tiny["target"]).generate(
        [{"prompt_token_ids": p} for p in prompts], sp)]
    llm = LLM(tiny["target"], speculative_config={"method": "draft_model", "model": str(root / "whole"),
                                                  "num_speculative_tokens": 4, "parallel_drafting": True})
    assert isinstance(llm.engine.drafter, ParallelDraftDrafter) and llm.engine.drafter.mask_token_id == rows
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    hf = load_model(tiny["target"]).hf_model
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_equal(hf, p, e, o.outputs[0].token_ids)
    assert llm.get_metrics()["num_draft_tokens"] > 0
    with pytest.raises(ValueError, match="at most 4 drafts"):
        LLM(tiny["target"], speculative_config={"method": "draft_model", "model": str(root / "whole"),
                                                "num_speculative_tokens": 5, "parallel_drafting": True})


def test_bad_options_are_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="not a Hugging Face model folder"):
        run({**tiny, "draft": str(tmp_path)}, tmp_path / "o", [])
    with pytest.raises(ValueError, match="max_k must be in 1..32"):
        run(tiny, tmp_path / "o", ["--max-k", "0"])
    with pytest.raises(ValueError, match="drop_ratio must be in"):
        run(tiny, tmp_path / "o", ["--drop-ratio", "0"])


def test_torchrun_two_ranks_adapt_one_draft(tiny, tmp_path):
    """Under torchrun (2 ranks, gloo) each rank draws its own windows and dropped slots, and every rank
    ends with the same weights."""
    import os
    import subprocess
    import sys

    script = tmp_path / "ddp.py"
    script.write_text("import json, os, sys\nfrom specdec.training.distill import main\ns = main(sys.argv[1:])\n"
                      "rank = os.environ['RANK']\n"
                      "open(os.path.join(sys.argv[-1], f'rank{rank}.json'), 'w').write(json.dumps(s))\n")
    out = tmp_path / "p"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           "--method", "pard", "--init-draft", tiny["draft"], "--data", tiny["data"], "--seq-len", "32",
           "--batch-size", "2", "--max-steps", "4", "--warmup-steps", "1", "--eval-windows", "2", "--val-fraction",
           "0.2", "--threads", "1", "--max-k", "4", "--device", "cpu", "--accept-prompts", "0", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == 2 and r0["ranks_identical"] and r1["ranks_identical"]
    assert r0["tokens_seen"] == 4 * 2 * 2 * 32
    assert json.loads((out / "config.json").read_text())["pard_max_k"] == 4
