"""Parallel drafting (PARD, drafters/pard.py): one forward over the history and k - 1 masks proposes k
drafts; greedy output equals plain decoding on both backends, sampled outputs follow the target's
distribution, and drafts without a mask token or asked for more than they were trained for are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lossless import assert_first_tokens_follow_target, assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.drafters.pard import ParallelDraftDrafter
from specdec.models.load import load_model
from tiny_models import make_model, random_prompts, small_vocab_pair


def pard_copy(src: str | Path, dst: Path, scale: float, max_k: int | None = 8, seed: int = 2) -> str:
    """A parallel draft made from ``src``: its weights plus noise of std ``scale``, one embedding row
    more (the mask token, id = the old row count) and the mask named in config.json."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src)
    rows = model.config.vocab_size
    model.resize_token_embeddings(rows + 1, mean_resizing=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.get_input_embeddings().weight[rows] = torch.randn(model.config.hidden_size, generator=g) * 0.2
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    model.config.pard_token = rows
    if max_k is not None:
        model.config.pard_max_k = max_k
    model.save_pretrained(dst, safe_serialization=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return str(dst)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pard")
    target = make_model(root / "target", "llama", layers=2, seed=0)
    return {"target": str(target), "pard": pard_copy(target, root / "pard", 0.01),
            "hf": load_model(str(target)).hf_model}


def plain_greedy(target, prompts, max_tokens, backend="auto"):
    llm = LLM(target, backend=backend)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


def pard_config(draft: str, k: int, **extra) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, "parallel_drafting": True,
            "adaptive": False, **extra}


def test_one_forward_proposes_the_drafts_the_mask_positions_predict(models):
    """The drafts are the argmaxes of the draft's logits at the last history token and at each of the
    k - 1 masks that follow it (transformers' own forward as the reference), from one draft forward."""
    llm = LLM(models["target"], speculative_config=pard_config(models["pard"], 4))
    drafter = llm.engine.drafter
    assert isinstance(drafter, ParallelDraftDrafter)
    calls = []
    forward = drafter.runner.forward
    drafter.runner.forward = lambda batch: (calls.append(batch), forward(batch))[1]
    proposals = []
    propose = drafter.propose
    drafter.propose = lambda seqs, n, sb: proposals.append((list(seqs[0].token_ids),
                                                            propose(seqs, n, sb))) or proposals[-1][1]
    prompt = random_prompts(1, [9], seed=3)[0]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert proposals and len(calls) == len(proposals)  # one draft forward per round
    hf = load_model(models["pard"]).hf_model
    mask = drafter.mask_token_id
    for history, proposal in proposals:
        n = proposal.num_draft_tokens[0]  # 4, fewer near max_tokens
        with torch.no_grad():
            logits = hf(torch.tensor([history + [mask] * (n - 1)])).logits[0, -n:, : llm.target.vocab_size]  # [n, V]
        assert proposal.draft_token_ids[0, :n].tolist() == logits.argmax(-1).tolist()
    assert max(p.num_draft_tokens[0] for _, p in proposals) == 4
    # the cache keeps the committed history only: each round feeds what was accepted since, then masks
    for batch, (history, proposal) in zip(calls[1:], proposals[1:]):
        masks = proposal.num_draft_tokens[0] - 1
        assert batch.start[0] + batch.lengths[0] == len(history) + masks
        assert batch.token_ids[0, batch.lengths[0] - masks: batch.lengths[0]].tolist() == [mask] * masks
        assert mask not in batch.token_ids[0, : batch.lengths[0] - masks].tolist()


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_equals_plain_decoding(models, k, batch):
    prompts = random_prompts(batch, [1, 5, 11, 23], seed=batch + k)
    expected = plain_greedy(models["target"], prompts, 30)
    llm = LLM(models["target"], speculative_config=pard_config(models["pard"], k))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] > 0


def test_greedy_output_equals_plain_decoding_adaptive_and_with_requests_joining(models):
    prompts = random_prompts(5, [3, 17, 6, 2, 9], seed=11)
    expected = plain_greedy(models["target"], prompts, 20)
    llm = LLM(models["target"], speculative_config=pard_config(models["pard"], 4, adaptive=True), max_num_seqs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    # the controller charges the draft per round, timed by k (cost_model.round_cost), not per drafted token
    costs = llm.engine.controller.costs
    assert costs.parallel and not costs.draft_time
    assert costs.parallel_draft_time and all(k >= 1 for _, k in costs.parallel_draft_time)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_equals_plain_decoding_on_llamacpp(models, batch):
    prompts = random_prompts(batch, [4, 13, 7], seed=5)
    expected = plain_greedy(models["target"], prompts, 24, backend="llama.cpp")
    llm = LLM(models["target"], backend="llama.cpp", speculative_config=pard_config(models["pard"], 4))
    assert llm.backend == "llama.cpp" and llm.engine.drafter.runner.backend == "torch"  # models/choose.choose_draft
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)  # f32 GGUF: float32's rounding
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] > 0


def test_a_parallel_draft_runs_on_torch_beside_a_llamacpp_target():
    """choose_draft: a parallel draft's checkpoint runs on torch beside a llama.cpp target (its one forward
    of accepted tokens and masks costs about a step there); an autoregressive draft where the target runs."""
    from specdec.models.choose import Choice, choose_draft
    from specdec.models.resolve import resolve

    hf = resolve("specdec/demo-draft-pard")
    on_llamacpp, on_torch = Choice("llama.cpp", "asked for", None), Choice("torch", "asked for", "bfloat16")
    assert choose_draft(hf, on_llamacpp, parallel=True).backend == "torch"
    assert "parallel draft" in choose_draft(hf, on_llamacpp, parallel=True).reason
    assert choose_draft(hf, on_llamacpp).backend == "llama.cpp"
    assert choose_draft(hf, on_torch, parallel=True).backend == "torch"


# -- trees: the one forward's per-depth distributions branch -----------------------------------------


def test_a_tree_branches_from_the_per_depth_distributions_of_one_forward(models):
    from specdec.sampling import SamplingBatch, make_generator, probs_from_logits
    from specdec.sequence import Sequence
    from specdec.tree import TreeShape

    def seq(tokens):
        p = SamplingParams(temperature=0, max_tokens=4)
        return Sequence(list(tokens), p, make_generator(p.seed), max_len=200)

    llm = LLM(models["target"], backend="torch", speculative_config=pard_config(models["pard"], 4))
    drafter = llm.engine.drafter
    assert drafter.can_draft_trees
    history = random_prompts(1, [9], seed=3)[0]
    row = seq(history)
    sb = SamplingBatch.from_params([row.params])
    calls = []
    forward = drafter.runner.forward
    drafter.runner.forward = lambda batch: calls.append(batch) or forward(batch)
    shape = TreeShape(num_nodes=9, max_depth=3, max_children=3)
    (tree,) = drafter.propose_tree([row], [shape], sb)
    assert len(calls) == 1  # one forward over the history and 2 masks, whatever the tree's size
    assert tree.num_nodes == 9 and max(tree.depths()) <= 3
    # the distributions: the forward's logits after the history (depth 1) and at each mask (depths 2, 3)
    drafter.runner.forward = forward
    ref = LLM(models["target"], backend="torch", speculative_config=pard_config(models["pard"], 4)).engine.drafter
    ref.num_masks = 2
    q = probs_from_logits(ref._sync([seq(history)])[0][0].float(), sb.select([0, 0, 0]))  # [3, V]
    depth = tree.depths()
    for node in [-1] + list(range(tree.num_nodes)):
        kids = tree.children(node)
        if not kids:
            continue
        d = 0 if node < 0 else depth[node]  # the children's distribution: q_{d+1}
        top = q[d].topk(len(kids)).indices.tolist()
        assert [tree.token_ids[c] for c in kids] == top  # a greedy row's children: q_{d+1}'s top tokens


@pytest.mark.parametrize("batch", [1, 3])
def test_tree_rounds_greedy_output_equals_plain_decoding(models, batch):
    prompts = random_prompts(batch, [2, 8, 15], seed=7 + batch)
    expected = plain_greedy(models["target"], prompts, 24, backend="torch")
    llm = LLM(models["target"], backend="torch", speculative_config=pard_config(
        models["pard"], 4, draft_tree="tree", draft_tree_max_nodes=7, draft_tree_top_k=2))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    m = llm.get_metrics()
    assert m["num_tree_drafts"] > 0 and m["num_tree_accepted_tokens"] > 0


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_k=4)], ids=["t1", "topk"])
def test_tree_rounds_sampled_outputs_follow_the_target_distribution(small_vocab, params):
    target, draft, hf = small_vocab
    prompt = [5, 9, 3]
    N = 3000
    llm = LLM(target, backend="torch", speculative_config=pard_config(
        draft, 3, draft_tree="tree", draft_tree_max_nodes=6, draft_tree_top_k=2))
    sps = [SamplingParams(max_tokens=3, seed=2000 + i, ignore_eos=True, **params) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, sps)
    tokens = np.array([o.outputs[0].token_ids for o in outs])  # [N, 3]
    assert_first_tokens_follow_target(hf, prompt, tokens, sps[0], 23)
    m = llm.get_metrics()
    assert m["num_tree_drafts"] > 0 and m["num_tree_accepted_tokens"] > 0


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("pard-small")
    target, _, hf = small_vocab_pair(root)
    return target, pard_copy(target, root / "pard", 0.05), hf


@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=4),
    dict(temperature=1.0, top_p=0.7),
], ids=["t1", "topk", "topp"])
def test_sampled_outputs_follow_the_target_distribution(small_vocab, params, backend):
    target, draft, hf = small_vocab
    prompt = [5, 9, 3]
    N = 3000 if backend == "torch" else 2000
    llm = LLM(target, backend=backend, speculative_config=pard_config(draft, 2))
    sps = [SamplingParams(max_tokens=3, seed=1000 + i, ignore_eos=True, **params) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, sps)
    tokens = np.array([o.outputs[0].token_ids for o in outs])  # [N, 3]
    assert_first_tokens_follow_target(hf, prompt, tokens, sps[0], 23)
    assert llm.get_metrics()["num_accepted_tokens"] > 0


# -- bad input ---------------------------------------------------------------------------------------


def test_parallel_drafting_is_validated_by_the_config():
    with pytest.raises(ValueError, match="parallel_drafting must be true or false"):
        SpeculativeConfig(model="d", parallel_drafting="yes")
    with pytest.raises(ValueError, match="needs method 'draft_model'"):
        SpeculativeConfig(method="ngram", parallel_drafting=True)


def test_a_draft_without_a_mask_token_is_refused(models, tmp_path):
    plain = make_model(tmp_path / "plain", "llama", layers=1, seed=4)
    with pytest.raises(ValueError, match="no mask token in its config.json.*distill --method pard"):
        LLM(models["target"], speculative_config=pard_config(str(plain), 4))


def test_k_above_what_the_draft_was_trained_for_is_refused(models, tmp_path):
    draft = pard_copy(models["target"], tmp_path / "k3", 0.01, max_k=3)
    LLM(models["target"], speculative_config=pard_config(draft, 3))  # within what it was trained for
    with pytest.raises(ValueError, match="trained to propose at most 3 drafts.*num_speculative_tokens=4"):
        LLM(models["target"], speculative_config=pard_config(draft, 4))


def test_a_mask_token_past_the_embedding_rows_is_refused(models, tmp_path):
    draft = Path(pard_copy(models["target"], tmp_path / "bad", 0.01))
    config = json.loads((draft / "config.json").read_text())
    config["pard_token"] = config["vocab_size"] + 5
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="names mask token .* embedding rows"):
        LLM(models["target"], speculative_config=pard_config(str(draft), 4))


# -- export ------------------------------------------------------------------------------------------


def test_export_writes_each_engines_parallel_drafting_settings(models):
    """vLLM: draft_model with parallel_drafting (it reads pard_token from the draft's config.json, as its
    proposer does); TensorRT-LLM: decoding_type PARD with the draft's mask_token_id; engines without
    parallel drafting keep their draft-model setting and say so."""
    from specdec.workbench.export import export_config

    mask = json.loads((Path(models["pard"]) / "config.json").read_text())["pard_token"]
    spec = pard_config(models["pard"], 4)
    vllm = export_config("vllm", spec, models["target"])
    assert vllm.supported and vllm.options["speculative_config"] == {
        "method": "draft_model", "model": models["pard"], "num_speculative_tokens": 4, "parallel_drafting": True}
    assert '"parallel_drafting": true' in vllm.command
    trt = export_config("trtllm", spec, models["target"])
    assert trt.options["speculative_config"] == {"decoding_type": "PARD", "max_draft_len": 4,
                                                 "speculative_model_dir": models["pard"], "mask_token_id": mask}
    assert "decoding_type: PARD" in trt.text and f"mask_token_id: {mask}" in trt.text
    for engine in ("sglang", "llamacpp"):
        exp = export_config(engine, spec, models["target"])
        assert exp.supported and any("has no parallel drafting" in n for n in exp.notes)
    plain = export_config("vllm", {**spec, "parallel_drafting": False}, models["target"])
    assert "parallel_drafting" not in plain.options["speculative_config"]


# -- the shipped parallel draft ------------------------------------------------------------------------

SHIPPED_PARD = Path(__file__).resolve().parents[1] / "specdec" / "assets" / "demo-draft-pard"


@pytest.mark.skipif(not (SHIPPED_PARD / "config.json").exists(), reason="the shipped parallel draft is not installed")
def test_the_shipped_parallel_draft_is_lossless_and_accepted_beside_the_shipped_target():
    from specdec.near_tie import first_divergence

    config = json.loads((SHIPPED_PARD / "config.json").read_text())
    assert (config["pard_token"], config["pard_max_k"], config["vocab_size"]) == (8192, 8, 8193)
    prompts = ['def fibonacci(n):\n    """', "class Stack:\n    def __init__(self):\n        self."]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain_llm = LLM("specdec/demo-target", backend="torch")
    plain = plain_llm.generate(prompts, sp)
    llm = LLM("specdec/demo-target", backend="torch", speculative_config=pard_config(str(SHIPPED_PARD), 4))
    got = llm.generate(prompts, sp)
    for a, b in zip(plain, got):
        d = first_divergence(plain_llm.engine.target, a.prompt_token_ids, a.outputs[0].token_ids,
                             b.outputs[0].token_ids)
        assert d is None or d["near_tie"], d
    assert llm.get_metrics()["mean_acceptance_length"] > 2.0  # the adapted draft's masks predict (tau 2.9)
