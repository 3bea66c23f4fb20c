"""Draft-tree settings exported to each engine's own tree options, and the static tree vLLM takes."""

import ast

import pytest

from specdec.tree import TreeShape, static_tree
from specdec.workbench.export import export_config, vllm_token_tree
from specdec.config import SpeculativeConfig

TREE = {"num_speculative_tokens": 4, "adaptive": False, "draft_tree": "tree", "draft_tree_max_nodes": 10,
        "draft_tree_top_k": 3}
HEAD = {"method": "eagle3", "model": "org/head", **TREE}
DRAFT = {"method": "draft_model", "model": "org/draft", **TREE}


def test_static_tree_is_the_best_tree_within_the_shape():
    tree = static_tree(TreeShape(8, 4, 3), [0.6, 0.2, 0.1])
    assert len(tree) == 8 and len(set(tree)) == 8
    assert all(p[:-1] in tree or len(p) == 1 for p in tree)  # every node's parent is in the tree
    assert all(p[:-1] + (p[-1] - 1,) in tree for p in tree if p[-1] > 0)  # and its elder siblings
    assert max(len(p) for p in tree) <= 4 and max(max(p) for p in tree) <= 2
    # the values of the chosen nodes are the 8 largest of all nodes within the shape
    value = lambda p: __import__("math").prod([0.6, 0.2, 0.1][r] for r in p)  # noqa: E731
    every = [p for d in range(1, 5) for p in __import__("itertools").product(range(3), repeat=d)]
    assert sorted(map(value, tree)) == sorted(map(value, every))[-8:]
    assert static_tree(TreeShape(3, 3, 1), [0.5]) == [(0,), (0, 0), (0, 0, 0)]  # one child each: a chain
    with pytest.raises(ValueError, match="rank_acceptance"):
        static_tree(TreeShape(3, 3, 2), [0.0, 0.5])


def test_eagle3_tree_exports_to_each_engines_tree_options():
    vllm = export_config("vllm", HEAD, "org/target").options["speculative_config"]
    tree = ast.literal_eval(vllm["speculative_token_tree"])
    assert vllm["num_speculative_tokens"] == len(tree) == 10
    assert tree == vllm_token_tree(SpeculativeConfig.from_dict(HEAD))
    sglang = export_config("sglang", HEAD, "org/target").options
    assert sglang["--speculative-eagle-topk"] == 3 and sglang["--speculative-num-steps"] == 4
    assert sglang["--speculative-num-draft-tokens"] == 11  # the nodes plus the last committed token
    trt = export_config("trtllm", HEAD, "org/target").options["speculative_config"]
    assert trt["use_dynamic_tree"] is True and trt["dynamic_tree_max_topK"] == 3
    assert trt["max_total_draft_tokens"] == 10 and trt["max_draft_len"] == 4
    llama = export_config("llamacpp", HEAD, "org/target")
    assert "drafts chains only" in llama.text


def test_draft_model_tree_exports_where_the_engine_has_one_and_says_so_where_not():
    sglang = export_config("sglang", DRAFT, "org/target")
    assert sglang.options["--speculative-eagle-topk"] == 3 and sglang.options["--speculative-num-draft-tokens"] == 11
    for engine in ("vllm", "trtllm", "llamacpp"):
        exp = export_config(engine, DRAFT, "org/target")
        assert "exports a chain of 4 drafts" in exp.text, engine
    assert "speculative_token_tree" not in export_config("vllm", DRAFT).options["speculative_config"]
    chain = export_config("sglang", {**DRAFT, "draft_tree": "chain"}, "org/target").options
    assert chain["--speculative-eagle-topk"] == 1 and chain["--speculative-num-draft-tokens"] == 5
