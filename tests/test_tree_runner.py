"""A tree pass on the torch runner: each node's logits equal those of its root-to-node path run as a
chain, and ``compact`` leaves the cache as if the accepted path had been fed alone."""

import pytest
import torch

from specdec.models.base import ForwardBatch
from specdec.models.llama import LlamaRunner
from specdec.models.load import load_model
from specdec.tree import DraftTree, block_parents
from tiny_models import make_model

# node:       0  1  2  3  4  5  6
PARENTS = [-1, -1, 0, 0, 1, 2, 5]  # two children of the root, a branch at node 0, a depth-4 path
TOKENS = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module", params=["llama", "qwen3", "mistral"])
def runner(request, tmp_path_factory):
    kw = {"mistral": dict(sliding_window=64), "qwen3": dict(head_dim=32)}.get(request.param, {})
    folder = make_model(tmp_path_factory.mktemp(request.param), request.param, **kw)
    return LlamaRunner(load_model(str(folder)))


def chain_logits(runner, prefix: list[int], path_tokens: list[int]) -> torch.Tensor:
    """Logits after each token of prefix[-1:] + path, run as a plain chain in a fresh row  [len(path) + 1, V]."""
    runner.sync_rows(["chain"])
    runner.forward(ForwardBatch.from_rows([prefix[:-1]], [0], logits="none"))
    return runner.forward(ForwardBatch.from_rows([prefix[-1:] + path_tokens], [len(prefix) - 1], logits="all"))[0]


@pytest.mark.parametrize("batch", [1, 2])
def test_tree_pass_matches_each_path_as_a_chain(runner, batch):
    tree = DraftTree(TOKENS, PARENTS)
    prefixes = [[3, 4, 5, 6, 7], [8, 9, 10]][:batch]
    refs = []
    for prefix in prefixes:
        refs.append({node: chain_logits(runner, prefix, [TOKENS[j] for j in tree.path_to(node)])[-1]
                     for node in range(tree.num_nodes)})
        refs[-1][-1] = chain_logits(runner, prefix, [])[-1]
    runner.sync_rows([("tree", b) for b in range(batch)])
    for b, prefix in enumerate(prefixes):  # prefill all but the newest token
        runner.forward(ForwardBatch.from_rows([prefix[:-1]], [0], logits="none", row_offset=b))
    width = 1 + tree.num_nodes
    tokens = torch.tensor([[p[-1]] + TOKENS for p in prefixes])  # [B, 1 + N]
    batch_ = ForwardBatch(tokens, [len(p) - 1 for p in prefixes], [width] * batch,
                          torch.arange(width).expand(batch, width), parents=[block_parents(1, tree)] * batch)
    logits = runner.forward(batch_)  # [B, 1 + N, V]
    for b in range(batch):
        torch.testing.assert_close(logits[b, 0], refs[b][-1], atol=2e-4, rtol=1e-4)
        for node in range(tree.num_nodes):
            torch.testing.assert_close(logits[b, 1 + node], refs[b][node], atol=2e-4, rtol=1e-4)

    # keep the path root -> 0 -> 2 -> 5 -> 6 in row 0 and root -> 1 -> 4 in row 1, then continue both
    paths = [tree.path_to(6), tree.path_to(4)][:batch]
    starts = [len(p) - 1 for p in prefixes]
    runner.compact(list(range(batch)), starts, [[0] + [1 + j for j in path] for path in paths])
    nxt = 21
    cont = runner.forward(ForwardBatch.from_rows([[nxt]] * batch, [s + 1 + len(path) for s, path in zip(starts, paths)]))
    for b, (prefix, path) in enumerate(zip(prefixes, paths)):
        ref = chain_logits(runner, prefix, [TOKENS[j] for j in path] + [nxt])[-1]
        torch.testing.assert_close(cont[b], ref, atol=2e-4, rtol=1e-4)


def test_tree_pass_keeps_hidden_states_at_slots(runner):
    """Kept layer inputs (EAGLE-3) move with the KV when the path is compacted."""
    runner.release()
    runner.keep_hidden_states([1])
    try:
        tree = DraftTree(TOKENS, PARENTS)
        prefix = [3, 4, 5, 6]
        path = tree.path_to(6)
        chain_logits(runner, prefix, [TOKENS[j] for j in path])
        want = runner.hidden_states(0, 0, len(prefix) + len(path)).clone()
        runner.sync_rows(["t"])
        runner.forward(ForwardBatch.from_rows([prefix[:-1]], [0], logits="none"))
        runner.forward(ForwardBatch(torch.tensor([[prefix[-1]] + TOKENS]), [len(prefix) - 1], [8], None,
                                    parents=[block_parents(1, tree)]))
        runner.compact([0], [len(prefix) - 1], [[0] + [1 + j for j in path]])
        torch.testing.assert_close(runner.hidden_states(0, 0, len(prefix) + len(path)), want, atol=1e-4, rtol=1e-4)
    finally:
        runner.kept_layers = []
        runner.release()
