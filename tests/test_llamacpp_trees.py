"""Draft trees on the llama.cpp backend (models/llamacpp.py: a tree's branches are sequence ids that
share the row's cells). A tree pass's logits equal the torch runner's on every node; after ``compact``
the row continues from the accepted path as from a chain; the shipped drafters' tree rounds give
plain decoding's greedy output and the target's distribution when sampled; branch ids never leak."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lossless import assert_first_tokens_follow_target, assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.models.base import ForwardBatch
from specdec.models.gguf import convert
from specdec.models.llamacpp import LlamaCppRunner
from specdec.models.load import load_model, load_runner
from tiny_models import SMALL_WORDS, make_model, perturbed_copy, random_prompts, small_vocab_pair


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamacpp-trees")
    target = make_model(root / "target", "llama", layers=2, seed=0)
    near = perturbed_copy(target, root / "near", 0.02)  # a partly agreeing draft
    gguf = convert(str(target), str(root / "target.gguf"), "f32")
    return {"target": str(target), "near": str(near), "gguf": gguf, "hf": load_model(str(target)).hf_model}


def runners(models):
    return LlamaCppRunner(models["gguf"]), load_runner(models["target"], "torch", enforce_eager=True)[0]


# a fed root token (parent -1) and five nodes: two children of the root, two under the first, one under the second
TOKENS = [12, 20, 21, 22, 23, 24]
PARENTS = [-1, 0, 0, 1, 1, 2]


def tree_pass(runner, start: int, tokens=TOKENS, parents=PARENTS) -> torch.Tensor:
    batch = ForwardBatch(torch.tensor([tokens]), [start], [len(tokens)], torch.arange(len(tokens))[None],
                         parents=[parents])
    return runner.forward(batch)[0]  # [T, V]


def test_a_tree_pass_equals_the_torch_runners_and_compact_keeps_a_path(models):
    history = [5, 9, 3, 11, 7]
    ours, ref = runners(models)
    for r in (ours, ref):
        r.sync_rows(["x"])
        r.forward(ForwardBatch.from_rows([history], [0], logits="none"))
    torch.testing.assert_close(tree_pass(ours, len(history)), tree_pass(ref, len(history)), atol=2e-4, rtol=1e-4)
    assert len(ours.tree_leaves[ours.order[0]]) == 2  # leaves 3, 4, 5: the first is the row's own id
    # keep the root, node 1 (child of the root) and node 4 (its second child): slots 0, 1, 4
    for r in (ours, ref):
        r.compact([0], [len(history)], [[0, 1, 4]])
    assert not ours.tree_leaves and ours.cached[ours.order[0]] == len(history) + 3
    nxt = [ForwardBatch.from_rows([[30, 31]], [len(history) + 3], logits="all") for _ in range(2)]
    torch.testing.assert_close(ours.forward(nxt[0]), ref.forward(nxt[1]), atol=2e-4, rtol=1e-4)
    # the same as a chain that fed the path's tokens
    chain = LlamaCppRunner(models["gguf"])
    chain.sync_rows(["y"])
    got = chain.forward(ForwardBatch.from_rows([history + [12, 20, 23, 30, 31]], [0], logits=2))
    torch.testing.assert_close(got, ours.forward(ForwardBatch.from_rows([[30, 31]], [len(history) + 3], logits="all")),
                               atol=2e-4, rtol=1e-4)


def test_branches_from_the_cache_and_rollback_without_compact(models):
    """Tokens that all continue the cache (parents -1: a draft's tree pass) and a pass left uncompacted:
    the next forward drops the branches, the row holds its history only."""
    history = [4, 8, 15, 16]
    ours, ref = runners(models)
    for r in (ours, ref):
        r.sync_rows(["a", "b"])
        r.forward(ForwardBatch.from_rows([history, history[:2]], [0, 0], logits="none"))
    tokens, parents = [20, 21, 22, 23], [-1, -1, 0, 1]
    batch = lambda: ForwardBatch(torch.tensor([tokens, tokens]), [4, 2], [4, 4], torch.arange(4).expand(2, 4),  # noqa: E731
                                 parents=[parents, parents])
    torch.testing.assert_close(ours.forward(batch()), ref.forward(batch()), atol=2e-4, rtol=1e-4)
    assert [ours.cached[s] for s in ours.order] == [6, 4]  # each row holds its leftmost branch (tokens 0, 2)
    free = len(ours.free)
    out = ours.forward(ForwardBatch.from_rows([[30], [31]], [4, 2], logits="last"))
    assert len(ours.free) == free + 2 and not ours.tree_leaves  # a branch id per row back
    torch.testing.assert_close(out, ref.forward(ForwardBatch.from_rows([[30], [31]], [4, 2], logits="last")),
                               atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("batch", [1, 3])
def test_draft_model_trees_greedy_equal_plain_decoding(models, batch):
    prompts = random_prompts(batch, [1, 5, 11], seed=batch + 50)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(models["target"], backend="llama.cpp").generate(
        [{"prompt_token_ids": p} for p in prompts], sp)]
    llm = LLM(models["target"], backend="llama.cpp", speculative_config={
        "method": "draft_model", "model": models["near"], "num_speculative_tokens": 3, "draft_tree": "tree",
        "draft_tree_max_nodes": 8, "draft_tree_top_k": 3})
    llm.engine.strict_drafter = True
    assert llm.engine.drafter.runner.backend == "llama.cpp"  # the draft's tree passes run on llama.cpp too
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    m = llm.get_metrics()
    assert m["num_tree_drafts"] == m["num_drafts"] > 0 and m["num_tree_draft_tokens"] > 3 * m["num_tree_drafts"]
    assert m["num_tree_accepted_tokens"] > 0
    assert not llm.target.tree_leaves or len(llm.target.tree_leaves) <= batch


def test_suffix_trees_greedy_equal_plain_decoding(models):
    base = random_prompts(2, [6, 9], seed=31)
    prompts = [b * 4 for b in base]  # prompts that repeat themselves give the trie something to branch on
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(models["target"], backend="llama.cpp").generate(
        [{"prompt_token_ids": p} for p in prompts], sp)]
    llm = LLM(models["target"], backend="llama.cpp", speculative_config={
        "method": "suffix", "num_speculative_tokens": 4, "draft_tree": "tree", "draft_tree_max_nodes": 8})
    llm.engine.strict_drafter = True
    for p, e, o in zip(prompts, expected, llm.generate([{"prompt_token_ids": p} for p in prompts], sp)):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    assert llm.get_metrics()["num_tree_drafts"] > 0


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    return small_vocab_pair(tmp_path_factory.mktemp("llamacpp-trees-small"))


def test_sampled_trees_follow_the_target_distribution(small_vocab):
    target, draft, hf = small_vocab
    prompt, N = [5, 9, 3], 2000
    llm = LLM(target, backend="llama.cpp", speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": 2, "draft_tree": "tree",
        "draft_tree_max_nodes": 6, "draft_tree_top_k": 3})
    llm.engine.strict_drafter = True
    sps = [SamplingParams(max_tokens=3, seed=5000 + i, ignore_eos=True, temperature=1.0, top_p=0.9) for i in range(N)]
    tokens = np.array([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": prompt}] * N, sps)])
    assert_first_tokens_follow_target(hf, prompt, tokens, sps[0], len(SMALL_WORDS) + 3)
    assert llm.get_metrics()["num_tree_drafts"] >= N
