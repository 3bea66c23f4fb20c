"""specdec distill --method eagle3 (specdec/training/eagle3.py) on a tiny random target: the head it
writes, the training-time test's attention against a chain run step by step, and bad input."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tiny_models import SMALL_WORDS, WORDS, make_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A 4-layer random target and a folder of word documents."""
    root = tmp_path_factory.mktemp("eagle3")
    target = make_model(root / "target", layers=4, hidden=64, seed=3)
    data = root / "data"
    data.mkdir()
    rng = random.Random(0)
    for i in range(10):
        (data / f"doc{i}.py").write_text(" ".join(rng.choice(WORDS[:40]) for _ in range(200)))
    return target, data


def run(tiny, out: Path, *extra: str) -> dict:
    from specdec.training.distill import main

    target, data = tiny
    return main(["--method", "eagle3", "--target", str(target), "--data", str(data), "--out", str(out),
                 "--seq-len", "32", "--batch-size", "4", "--warmup-steps", "2", "--eval-windows", "2",
                 "--val-fraction", "0.2", "--threads", "1", "--accept-prompts", "0", "--ttt-steps", "3",
                 "--log-every", "5", *extra])


def load(tiny, out: Path):
    from transformers import AutoModelForCausalLM

    from specdec.models.eagle3 import load_head

    t = AutoModelForCausalLM.from_pretrained(tiny[0])
    return load_head(out, t.get_input_embeddings().weight.detach(), t.config.num_hidden_layers,
                     t.config.vocab_size), t


def test_max_steps_zero_writes_an_untrained_head_that_loads(tiny, tmp_path):
    s = run(tiny, tmp_path / "h", "--max-steps", "0", "--draft-vocab", "50", "--layer-ids", "1,2,3")
    assert s["steps"] == 0 and s["draft_vocab"] == 50
    head, target = load(tiny, tmp_path / "h")
    c = head.config
    assert c.layer_ids == [1, 2, 3] and c.draft_vocab_size == 50 and c.vocab_size == target.config.vocab_size
    ids = head.draft_to_target
    assert torch.equal(ids, ids.sort().values) and len(set(ids.tolist())) == 50  # ascending, distinct target ids
    assert int(head.t2d.sum()) == 50 and bool(head.t2d[ids].all())  # t2d marks exactly the draft vocabulary
    assert torch.equal(head.embed_tokens, target.get_input_embeddings().weight[: c.vocab_size])
    assert "python -m specdec.training.distill --method eagle3 --target" in (tmp_path / "h" / "README.md").read_text()


def test_a_few_steps_lower_the_loss_and_resume_replays_them(tiny, tmp_path):
    s = run(tiny, tmp_path / "a", "--max-steps", "12", "--lr", "3e-3")
    assert s["train_loss"] < s["first_loss"] and s["held_out_loss"] == s["held_out_loss"]  # not nan
    head, _ = load(tiny, tmp_path / "a")
    assert head.config.layer_ids == [2, 2, 1] and head.config.draft_vocab_size == head.config.vocab_size
    # stopped at step 6 and resumed: the same weights as the uninterrupted run
    run(tiny, tmp_path / "b", "--max-steps", "12", "--lr", "3e-3", "--stop-at-step", "6")
    run(tiny, tmp_path / "b", "--max-steps", "12", "--lr", "3e-3", "--resume")
    other, _ = load(tiny, tmp_path / "b")
    for (name, p), q in zip(head.state_dict().items(), other.state_dict().values()):
        assert torch.equal(p, q), name


def test_the_training_time_test_sees_what_a_chain_sees(tiny):
    """Step j at position p of the unrolled training pass gives the logits a chain computes at inference:
    step 0 over positions 0..p from the target's features, then steps 1..j one at a time, each reading
    the previous step's output and appending its key to the head's own cache."""
    from transformers import AutoModelForCausalLM

    from specdec.models.eagle3 import Eagle3Config, Eagle3Head
    from specdec.training.eagle3 import TTTModel, ttt_mask

    t = AutoModelForCausalLM.from_pretrained(tiny[0])
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(t.config, layer_ids=[1, 2, 3]), t.get_input_embeddings().weight.detach())
    for p_ in head.parameters():
        p_.data.normal_(0, 0.3)
    T, steps = 12, 3
    tokens = torch.randint(3, 100, (1, T))
    feats = torch.randn(1, T, 3 * 64)
    model = TTTModel(head, steps, 0.8)
    P = T - 1
    h = head.fuse(feats[:, :P])
    ks, vs, outs = None, None, []
    for j in range(steps):  # the unrolled pass, as TTTModel.forward runs it
        ids = torch.nn.functional.pad(tokens[:, 1 + j:], (0, j))
        logits, g, k, v = head.step(ids, h, (torch.arange(P) + j)[None], ks, vs, ttt_mask(P, j, "cpu")[None])
        ks = k if ks is None else torch.cat([ks, k], 2)
        vs = v if vs is None else torch.cat([vs, v], 2)
        outs.append(logits)
        h = g
    for p in (0, 4, P - steps):
        logits, g, k, v = head.step(tokens[:, 1:p + 2], head.fuse(feats[:, :p + 1]), torch.arange(p + 1)[None])
        torch.testing.assert_close(logits[:, -1], outs[0][:, p], rtol=1e-4, atol=1e-4)
        g = g[:, -1:]
        for j in range(1, steps):  # chain step j at position p + j reads token p + 1 + j
            logits, g, k2, v2 = head.step(tokens[:, p + 1 + j:p + 2 + j], g, torch.tensor([[p + j]]), k, v)
            k, v = torch.cat([k, k2], 2), torch.cat([v, v2], 2)
            torch.testing.assert_close(logits[:, -1], outs[j][:, p], rtol=1e-4, atol=1e-4)
    assert model.to_draft.numel() == head.config.vocab_size


def test_a_vocabulary_smaller_than_the_top_k_keeps_all_of_it(tmp_path):
    """--topk 32 (the default) on a 23-token target: the soft labels keep all 23 tokens, training runs and
    the head loads (it crashed in build_cache with "selected index k out of range")."""
    target = make_model(tmp_path / "target", layers=4, hidden=64, seed=3, words=SMALL_WORDS)
    data = tmp_path / "data"
    data.mkdir()
    rng = random.Random(0)
    for i in range(6):
        (data / f"doc{i}.py").write_text(" ".join(rng.choice(SMALL_WORDS) for _ in range(200)))
    s = run((target, data), tmp_path / "h", "--max-steps", "4")
    assert s["vocab"] == 23 and s["topk"] == 23 and s["draft_vocab"] == 23
    assert s["train_loss"] == s["train_loss"] and s["held_out_loss"] == s["held_out_loss"]  # not nan
    head, _ = load((target, data), tmp_path / "h")
    assert head.config.draft_vocab_size == 23
    assert "its top 23 tokens" in (tmp_path / "h" / "README.md").read_text()
    with pytest.raises(ValueError, match="--topk and --cache-batch must be >= 1"):
        run((target, data), tmp_path / "x", "--max-steps", "0", "--topk", "0")


def test_bad_input_says_what_is_wrong(tiny, tmp_path):
    from specdec.training.distill import main

    with pytest.raises(ValueError, match="draft-vocab 500 is larger than the target's vocabulary"):
        run(tiny, tmp_path / "x", "--max-steps", "0", "--draft-vocab", "500")
    with pytest.raises(ValueError, match="does not exist"):
        main(["--method", "eagle3", "--target", str(tmp_path / "nope"), "--data", str(tiny[1]), "--out",
              str(tmp_path / "y"), "--max-steps", "0"])
    with pytest.raises(ValueError, match="layer-ids must be 3 target layers"):
        run(tiny, tmp_path / "z", "--max-steps", "0", "--layer-ids", "1,2,9")
    with pytest.raises(ValueError, match="is not one distill trains"):
        main(["--method", "medusa", "--target", str(tiny[0]), "--data", str(tiny[1]), "--out", str(tmp_path / "w")])


DDP_SCRIPT = """
import faulthandler, json, os, sys
from specdec.training.distill import main

faulthandler.dump_traceback_later(90, exit=True)  # a hung collective fails with stacks, not silence
s = main(sys.argv[1:])
with open(os.path.join(os.path.dirname(sys.argv[sys.argv.index("--out") + 1]), f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({k: s[k] for k in ("world_size", "ranks_identical", "tokens_seen", "first_loss", "train_loss")}, f)
"""


def test_torchrun_two_ranks_train_one_head(tiny, tmp_path):
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    target, data = tiny
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           "--method", "eagle3", "--target", str(target), "--data", str(data), "--out", str(tmp_path / "h"),
           "--seq-len", "32", "--batch-size", "2", "--max-steps", "6", "--warmup-steps", "2", "--eval-windows", "2",
           "--val-fraction", "0.2", "--threads", "1", "--accept-prompts", "0", "--ttt-steps", "2", "--device", "cpu"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == 2 and r0["ranks_identical"] and r1["ranks_identical"]
    assert r0["tokens_seen"] == 6 * 2 * 2 * 32
    assert (tmp_path / "h" / "model.safetensors").exists()


def test_labels_keep_the_targets_mass_beyond_its_top_k():
    """The soft labels are the target's top-k probabilities on the draft vocabulary plus the rest of its
    mass as one bucket, summing to 1: a head that matches the target exactly has KL 0 (a head trained on
    top-k renormalised labels comes out sharper than the target and loses acceptance at temperature 1)."""
    from specdec.models.eagle3 import Eagle3Config, Eagle3Head
    from specdec.training.eagle3 import TTTModel

    c = Eagle3Config(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, head_dim=4, intermediate_size=8,
                     vocab_size=10, draft_vocab_size=6, target_hidden_size=8, layer_ids=[0, 1, 1])
    head = Eagle3Head(c)
    head.d2t.copy_(torch.tensor([0, 0, 1, 2, 3, 4]))  # draft vocabulary: target ids 0, 1, 3, 5, 7, 9
    model = TTTModel(head, 1, 0.8)
    target = torch.tensor([0.4, 0.05, 0.05, 0.2, 0.05, 0.1, 0.05, 0.05, 0.0, 0.05])
    top = target.topk(3)  # ids 0, 3, 5
    didx, inside, p, rest, held = model.labels(top.indices, top.values.log())
    assert didx.tolist() == [0, 2, 3] and inside.all() and held
    torch.testing.assert_close(p.sum() + rest, torch.tensor(1.0))
    torch.testing.assert_close(rest, torch.tensor(0.3 / 1.0))  # 1 - (0.4 + 0.2 + 0.1)


def test_windows_stay_inside_documents_and_padding_is_never_scored():
    """document_windows cuts each document (EOS included) into pieces of seq_len, pads the last piece, and
    the loss of a padded window equals the loss of its real tokens alone, whatever the padding holds."""
    import numpy as np

    from specdec.models.eagle3 import Eagle3Config, Eagle3Head
    from specdec.training.eagle3 import TTTModel, document_windows

    eos = 0
    docs = [list(range(1, 12)), [5, 6], [7], list(range(20, 27))]  # 11, 2, 1 and 7 tokens before each EOS
    flat = np.array([t for d in docs for t in d + [eos]], dtype=np.uint16)
    w, lengths = document_windows(flat, eos, 8, 0, 0)
    assert lengths.tolist() == [8, 4, 3, 2, 8]  # 12 = 8 + 4; 3; "7 EOS" = 2; 8
    assert w[1].tolist() == [9, 10, 11, eos, eos, eos, eos, eos] and w[2, :3].tolist() == [5, 6, eos]
    for row, m in zip(w.tolist(), lengths.tolist()):  # no window runs on past its document's EOS
        assert eos not in row[: m - 1]
    assert len(document_windows(flat, eos, 8, 2, 0)[0]) == 2

    c = Eagle3Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=8, intermediate_size=16,
                     vocab_size=40, draft_vocab_size=40, target_hidden_size=16, layer_ids=[0, 1, 1])
    torch.manual_seed(0)
    head = Eagle3Head(c, torch.randn(40, 16))
    model = TTTModel(head, 3, 0.8)
    T, m, K = 10, 7, 5
    tokens = torch.randint(1, 40, (1, T))
    feats = torch.randn(1, T, 48)
    logits = torch.randn(1, T, 40).log_softmax(-1)
    top_logp, top_ids = logits.topk(K, dim=-1)
    alone = model(tokens[:, :m], feats[:, :m], top_ids[:, :m], top_logp[:, :m])
    padded = model(tokens, feats, top_ids, top_logp, torch.tensor([m]))
    torch.testing.assert_close(padded, alone)
    tokens[:, m:], feats[:, m:] = 3, 100.0  # other padding: same loss
    torch.testing.assert_close(model(tokens, feats, top_ids, top_logp, torch.tensor([m])), alone)
    assert not torch.allclose(model(tokens, feats, top_ids, top_logp), alone)  # scored, the padding would count


def test_scaled_features_fold_into_fc_exactly(tiny, tmp_path):
    """--scale-features trains fc on features / their RMS and saves fc * scale: the saved head gives the
    loss the training model gave, on the target's features as they are."""
    from specdec.models.eagle3 import Eagle3Config, Eagle3Head
    from specdec.training.eagle3 import TTTModel, feature_rms

    c = Eagle3Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=8, intermediate_size=16,
                     vocab_size=40, draft_vocab_size=40, target_hidden_size=16, layer_ids=[0, 1, 1])
    torch.manual_seed(1)
    model = TTTModel(Eagle3Head(c, torch.randn(40, 16)), 2, 0.8)
    feats = torch.randn(2, 9, 48) * torch.logspace(0, 3, 48)  # dimensions from 1 to 1000
    lengths = torch.tensor([9, 5])
    rms = feature_rms(feats, lengths)
    real = torch.cat([feats[0], feats[1, :5]])
    torch.testing.assert_close(rms, real.pow(2).mean(0).sqrt())
    model.feature_scale.copy_(1 / rms)
    tokens = torch.randint(1, 40, (2, 9))
    top_logp, top_ids = torch.randn(2, 9, 40).log_softmax(-1).topk(6, dim=-1)
    before = model(tokens, feats, top_ids, top_logp, lengths)
    model.fold_feature_scale()
    assert torch.equal(model.feature_scale, torch.ones(48))
    torch.testing.assert_close(model(tokens, feats, top_ids, top_logp, lengths), before, rtol=1e-4, atol=1e-5)

    s = run(tiny, tmp_path / "h", "--max-steps", "3", "--scale-features")
    assert s["scale_features"] and "folded into fc" in (tmp_path / "h" / "README.md").read_text()
    with pytest.raises(ValueError, match="pass one of them"):
        run(tiny, tmp_path / "x", "--max-steps", "0", "--scale-features", "--norm-before-fc")


def test_norm_before_fc_trains_saves_and_loads(tiny, tmp_path):
    """--norm-before-fc: the head has an RMSNorm over its [3 Dt] input (input_norm, the name vLLM and
    llama.cpp's converter read), its config says norm_before_fc, and the loaded head applies it."""
    import json

    from safetensors import safe_open

    s = run(tiny, tmp_path / "h", "--max-steps", "4", "--norm-before-fc", "--layer-ids", "1,2,3")
    assert s["train_loss"] == s["train_loss"]
    assert json.loads((tmp_path / "h" / "config.json").read_text())["norm_before_fc"] is True
    with safe_open(str(tmp_path / "h" / "model.safetensors"), framework="pt") as f:
        assert tuple(f.get_slice("input_norm.weight").get_shape()) == (3 * 64,)
    head, _ = load(tiny, tmp_path / "h")
    assert head.config.norm_before_fc
    x = torch.randn(2, 5, 3 * 64) * 50
    w = head.input_norm.weight
    assert not torch.allclose(w, torch.ones_like(w))  # trained
    want = head.fc(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + head.config.rms_norm_eps) * w)
    torch.testing.assert_close(head.fuse(x), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(head.fuse(x * 7), head.fuse(x), rtol=1e-3, atol=1e-3)  # scale-free input


def test_a_head_from_the_checkpoint_is_the_head_the_run_saved(tiny, tmp_path):
    """head_from_checkpoint (a stopped run's head, scale folded) gives the tensors the run itself saved."""
    from safetensors.torch import load_file

    from specdec.training.eagle3 import head_from_checkpoint

    run(tiny, tmp_path / "h", "--max-steps", "8", "--stop-at-step", "4", "--scale-features", "--run-dir",
        str(tmp_path / "r"), "--save-dtype", "float32")
    head_from_checkpoint(tmp_path / "r", tmp_path / "c", "float32")
    saved, again = load_file(tmp_path / "h" / "model.safetensors"), load_file(tmp_path / "c" / "model.safetensors")
    assert set(saved) == set(again)
    for name in saved:
        assert torch.equal(saved[name], again[name]), name
    with pytest.raises(ValueError, match="holds no checkpoint.pt"):
        head_from_checkpoint(tmp_path / "h", tmp_path / "x")


def test_the_argmax_term_adds_the_cross_entropy_on_the_targets_greedy_token():
    """--argmax-weight w: each step's loss is the KL plus w x the head's cross-entropy on the target's
    argmax (mapped to its draft id; positions whose argmax is off the draft vocabulary do not count)."""
    import torch.nn.functional as F

    from specdec.models.eagle3 import Eagle3Config, Eagle3Head
    from specdec.training.eagle3 import TTTModel

    c = Eagle3Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=8, intermediate_size=16,
                     vocab_size=40, draft_vocab_size=30, target_hidden_size=16, layer_ids=[0, 1, 1])
    torch.manual_seed(3)
    head = Eagle3Head(c, torch.randn(40, 16))
    head.d2t.zero_()  # draft ids 0..29 are target ids 0..29; 30..39 are off the draft vocabulary
    tokens, feats = torch.randint(1, 40, (2, 8)), torch.randn(2, 8, 48)
    top_logp, top_ids = torch.randn(2, 8, 40).log_softmax(-1).topk(5, dim=-1)
    top_ids[0, 3, 0] = 35  # one argmax off the draft vocabulary
    plain = TTTModel(head, 1, 0.8)(tokens, feats, top_ids, top_logp)
    model = TTTModel(head, 1, 0.8, argmax_weight=0.5)
    got = model(tokens, feats, top_ids, top_logp)
    logits = head.step(tokens[:, 1:], head.fuse(feats[:, :7]), torch.arange(7)[None].expand(2, 7))[0]  # [2, 7, 30]
    want_ids = top_ids[:, 1:, 0]  # the argmax after position p + 1
    keep = want_ids < 30
    ce = F.cross_entropy(logits[keep], want_ids[keep])
    torch.testing.assert_close(got - plain, 0.5 * ce, rtol=1e-4, atol=1e-5)
    assert not keep[0, 2] and 0 < int(keep.sum()) < keep.numel()  # some argmaxes are off the draft vocabulary


def test_the_tv_term_adds_the_total_variation_to_the_target():
    """--tv-weight w: each step's loss is the KL plus w x the total variation between the head's q and the
    target's p (1 - TV: what a draft sampled at temperature 1 is accepted at); with the whole vocabulary in
    the draft's and the target's top k, that is 0.5 sum |p - q|."""
    from specdec.models.eagle3 import Eagle3Config, Eagle3Head
    from specdec.training.eagle3 import TTTModel

    c = Eagle3Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=8, intermediate_size=16,
                     vocab_size=40, draft_vocab_size=40, target_hidden_size=16, layer_ids=[0, 1, 1])
    torch.manual_seed(4)
    head = Eagle3Head(c, torch.randn(40, 16))
    head.d2t.zero_()
    tokens, feats = torch.randint(1, 40, (2, 8)), torch.randn(2, 8, 48)
    top_logp, top_ids = (torch.randn(2, 8, 40) * 2).log_softmax(-1).topk(40, dim=-1)
    plain = TTTModel(head, 1, 0.8)(tokens, feats, top_ids, top_logp)
    got = TTTModel(head, 1, 0.8, tv_weight=2.0)(tokens, feats, top_ids, top_logp)
    q = head.step(tokens[:, 1:], head.fuse(feats[:, :7]), torch.arange(7)[None].expand(2, 7))[0].softmax(-1)
    p = torch.zeros(2, 8, 40).scatter(-1, top_ids, top_logp.exp())[:, 1:]  # the target's after position p + 1
    tv = 0.5 * (p - q).abs().sum(-1).mean()
    torch.testing.assert_close(got - plain, 2.0 * tv, rtol=1e-4, atol=1e-5)
    assert 0.1 < float(tv) < 0.9


def test_a_run_can_go_on_from_a_trained_head(tiny, tmp_path):
    """--init-head: the run starts from a saved head (its layers, draft vocabulary and weights; the feature
    scale unfolded from fc and folded back), so it starts at the loss the head ended with."""
    from safetensors.torch import load_file

    first = run(tiny, tmp_path / "a", "--max-steps", "10", "--lr", "3e-3", "--draft-vocab", "50", "--layer-ids",
                "1,2,3", "--scale-features", "--save-dtype", "float32")
    for scale in ([], ["--scale-features"]):  # a head saved with its scale folded in reads raw features either way
        out = tmp_path / f"b{len(scale)}"
        run(tiny, out, "--max-steps", "0", "--init-head", str(tmp_path / "a"), "--save-dtype", "float32", *scale)
        want, got = load_file(tmp_path / "a" / "model.safetensors"), load_file(out / "model.safetensors")
        assert set(want) == set(got)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)
        assert f"initialised from | {tmp_path / 'a'}" in (out / "README.md").read_text()
    fresh = run(tiny, tmp_path / "f", "--max-steps", "2", "--draft-vocab", "50", "--layer-ids", "1,2,3")
    going_on = run(tiny, tmp_path / "c", "--max-steps", "2", "--init-head", str(tmp_path / "a"), "--scale-features")
    assert going_on["first_loss"] < 0.8 * fresh["first_loss"] and going_on["draft_vocab"] == 50
    assert going_on["layer_ids"] == [1, 2, 3]
    assert first["train_loss"] < fresh["first_loss"]
    with pytest.raises(ValueError, match="draft vocabulary of 50 tokens, but --draft-vocab asks for 40"):
        run(tiny, tmp_path / "x", "--max-steps", "0", "--init-head", str(tmp_path / "a"), "--draft-vocab", "40")
    with pytest.raises(ValueError, match="has layer-ids"):
        run(tiny, tmp_path / "x", "--max-steps", "0", "--init-head", str(tmp_path / "a"), "--layer-ids", "0,1,2")
    with pytest.raises(ValueError, match="pass one of them"):
        run(tiny, tmp_path / "x", "--max-steps", "1", "--init-head", str(tmp_path / "a"), "--resume")


def test_a_trained_head_s_draft_vocabulary_can_be_widened(tiny, tmp_path):
    """--init-head with a larger --draft-vocab: the head's tokens keep their LM head rows, every other weight
    stays, the new tokens (the heaviest of the rest) get rows mapped from the target's output rows, and the
    run starts below a fresh head's loss."""
    from safetensors.torch import load_file

    run(tiny, tmp_path / "a", "--max-steps", "10", "--lr", "3e-3", "--draft-vocab", "50", "--layer-ids", "1,2,3",
        "--save-dtype", "float32")
    wide = run(tiny, tmp_path / "w", "--max-steps", "0", "--init-head", str(tmp_path / "a"), "--draft-vocab", "70",
               "--save-dtype", "float32")
    assert wide["draft_vocab"] == 70
    (old, _), (new, target) = load(tiny, tmp_path / "a"), load(tiny, tmp_path / "w")
    old_ids, new_ids = old.draft_to_target, new.draft_to_target
    assert torch.equal(new_ids, new_ids.sort().values) and len(set(new_ids.tolist())) == 70
    assert bool(torch.isin(old_ids, new_ids).all()) and int(new.t2d.sum()) == 70 and bool(new.t2d[new_ids].all())
    at = torch.searchsorted(new_ids, old_ids)
    torch.testing.assert_close(new.lm_head.weight[at], old.lm_head.weight)
    added = new.lm_head.weight[~torch.isin(new_ids, old_ids)]
    assert added.shape[0] == 20 and bool((added.norm(dim=1) > 0).all())
    want, got = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "w" / "model.safetensors")
    for name in want:
        if "lm_head" not in name and name not in ("d2t", "t2d"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)
    fresh = run(tiny, tmp_path / "f", "--max-steps", "2", "--draft-vocab", "70", "--layer-ids", "1,2,3")
    going_on = run(tiny, tmp_path / "c", "--max-steps", "2", "--init-head", str(tmp_path / "a"), "--draft-vocab", "70")
    assert going_on["first_loss"] < fresh["first_loss"]


def test_full_labels_are_the_targets_whole_distribution_on_the_draft_vocabulary():
    """--full-labels: each step is scored against softmax(LM head x the target's last state), every token of
    the draft vocabulary its own label (renormalised there), not the top k and one bucket. With the whole
    vocabulary in the draft's and in the top k, the two losses are the same; with a smaller draft vocabulary
    the KL and TV are those of the renormalised distribution."""
    import torch.nn.functional as F

    from specdec.models.eagle3 import Eagle3Config, Eagle3Head
    from specdec.training.eagle3 import TTTModel

    def head_with(vd: int) -> Eagle3Head:
        c = Eagle3Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                         intermediate_size=16, vocab_size=40, draft_vocab_size=vd, target_hidden_size=16,
                         layer_ids=[0, 1, 1])
        torch.manual_seed(5)
        h = Eagle3Head(c, torch.randn(40, 16))
        h.d2t.zero_()  # draft ids 0..vd-1 are target ids 0..vd-1
        return h

    torch.manual_seed(6)
    W, last = torch.randn(40, 16), torch.randn(2, 8, 16)  # the target's LM head and last states
    logp = (last @ W.T).log_softmax(-1)  # [2, 8, 40]
    tokens, feats = torch.randint(1, 40, (2, 8)), torch.randn(2, 8, 48)
    top_logp, top_ids = logp.topk(40, dim=-1)
    head = head_with(40)
    want = TTTModel(head, 2, 0.8, tv_weight=1.5)(tokens, feats, top_ids, top_logp)
    full = TTTModel(head, 2, 0.8, tv_weight=1.5)
    full.set_label_head(W)
    torch.testing.assert_close(full(tokens, feats, top_ids, top_logp, None, last), want, rtol=1e-4, atol=1e-5)

    head = head_with(30)  # target ids 30..39 off the draft vocabulary
    model = TTTModel(head, 1, 0.8, tv_weight=2.0)
    model.set_label_head(W)
    got = model(tokens, feats, top_ids[..., :3], top_logp[..., :3], None, last)  # the top 3 are not the labels
    q = head.step(tokens[:, 1:], head.fuse(feats[:, :7]), torch.arange(7)[None].expand(2, 7))[0].softmax(-1)
    p = logp[:, 1:, :30].exp()
    p = p / p.sum(-1, keepdim=True)  # [2, 7, 30]
    kl = (p * (p.log() - q.log())).sum(-1).mean()
    tv = 0.5 * (p - q).abs().sum(-1).mean()
    torch.testing.assert_close(got, kl + 2.0 * tv, rtol=1e-4, atol=1e-5)
    assert float(F.kl_div(q.log(), p, reduction="none").sum(-1).mean() - kl).__abs__() < 1e-4


def test_a_run_with_full_labels_lowers_the_loss_and_says_so(tiny, tmp_path):
    s = run(tiny, tmp_path / "f", "--max-steps", "12", "--lr", "3e-3", "--draft-vocab", "50", "--full-labels",
            "--topk", "4", "--tv-weight", "1")
    assert s["train_loss"] < s["first_loss"] and s["held_out_loss"] == s["held_out_loss"]
    assert "draft vocabulary (all of it, renormalised there)" in (tmp_path / "f" / "README.md").read_text()
