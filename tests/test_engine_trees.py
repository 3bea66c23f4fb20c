"""The engine's tree rounds: greedy equality with plain decoding (batch 1, several rows, rows joining and
leaving, n > 1), seeded sampled outputs independent of the batch, exact sampled distributions, the
counters, and the errors for a tree option that cannot run.

The tree source is a test-local drafter that runs a real draft model: its top-k per node (deterministic
candidates) or siblings sampled from its q without replacement, level by level, each level one tree
pass of the draft runner over the history and the tree so far."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lossless import assert_first_tokens_follow_target, assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.drafters.base import DraftProposal, Drafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine
from specdec.models.base import ForwardBatch, pad_rows
from specdec.models.llama import LlamaRunner
from specdec.models.load import load_model
from specdec.sampling import probs_from_logits, sample
from specdec.tree import DraftTree, TreeShape, block_parents
from tiny_models import SMALL_WORDS, make_model, perturbed_copy, random_prompts, small_vocab_pair



class DraftModelTrees(Drafter):
    """Draft trees from a draft model. ``sampled``: a sampled row's children of a node are drawn from
    the draft's q there without replacement, as many as the node budget allows in node order (never
    chosen by their values); otherwise (and for greedy rows) the children are the best candidates by
    cumulative draft probability, EAGLE-2 style, proposed as deterministic candidates."""

    can_draft_trees = True
    method = "draft_model"

    def __init__(self, runner: LlamaRunner, sampled: bool = False):
        self.runner, self.sampled = runner, sampled

    def propose(self, seqs, num_draft, sb):
        """Chains (a chain round): the tree of one child per node."""
        trees = self.propose_tree(seqs, [TreeShape(k, k, 1) if k else None for k in num_draft], sb)
        rows = [t.token_ids if t is not None else [] for t in trees]
        tokens = pad_rows(rows)  # [B, k]
        probs = None
        if any(t is not None and t.draft_probs is not None for t in trees):
            probs = torch.zeros(len(rows), tokens.shape[1], self.runner.vocab_size)  # [B, k, V]
            for b, t in enumerate(trees):
                if t is not None and t.draft_probs is not None:
                    probs[b, : t.num_nodes] = t.draft_probs
                elif t is not None:  # a greedy row's one-hot q
                    probs[b, torch.arange(t.num_nodes), torch.tensor(t.token_ids, dtype=torch.long)] = 1.0
        return DraftProposal(tokens, probs, [len(r) for r in rows])

    def propose_tree(self, seqs, shapes, sb):
        greedy = sb.greedy.tolist()
        trees = [DraftTree([], []) if sh is not None else None for sh in shapes]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        score: list[list[float]] = [[] for _ in seqs]  # cumulative log q of each node's path
        frontier = [[-1] if sh is not None else [] for sh in shapes]
        for level in range(max((sh.max_depth for sh in shapes if sh is not None), default=0)):
            rows = [b for b, sh in enumerate(shapes) if frontier[b] and level < sh.max_depth
                    and trees[b].num_nodes < sh.num_nodes]
            if not rows:
                break
            logits = self._logits_at_frontier(seqs, trees, frontier, rows)  # [R, L, V]
            probs = probs_from_logits(logits, sb.select(rows))
            for r, b in enumerate(rows):
                sampled = self.sampled and not greedy[b]
                new = (self._sample_children if sampled else self._best_children)(
                    seqs[b], shapes[b], trees[b], frontier[b], probs[r], score[b])
                for parent, x, q, sc in new:
                    trees[b].token_ids.append(x)
                    trees[b].parents.append(parent)
                    qs[b].append(q)
                    score[b].append(sc)
                frontier[b] = list(range(trees[b].num_nodes - len(new), trees[b].num_nodes))
        for b, t in enumerate(trees):
            if t is not None and self.sampled and not greedy[b] and t.num_nodes:
                t.draft_probs = torch.stack(qs[b])  # [N, V]
        return trees

    def _logits_at_frontier(self, seqs, trees, frontier, rows):
        """The draft's logits after each frontier node (-1: the history's end) of each row  [R, L, V]:
        one tree pass over [history, tree] from position 0 in the drafter's own cache rows."""
        self.runner.sync_rows([("trees", r) for r in range(len(rows))])
        fed = [seqs[b].token_ids + trees[b].token_ids for b in rows]
        T = max(len(f) for f in fed)
        parents = [block_parents(len(seqs[b].token_ids), trees[b]) + [-1] * (T - len(f)) for b, f in zip(rows, fed)]
        L = max(len(frontier[b]) for b in rows)
        index = [[len(seqs[b].token_ids) + n for n in frontier[b]] for b in rows]
        index = torch.tensor([ix + ix[-1:] * (L - len(ix)) for ix in index])  # [R, L]
        return self.runner.forward(ForwardBatch(pad_rows(fed), [0] * len(rows), [len(f) for f in fed], index,
                                                parents=parents))

    @staticmethod
    def _best_children(seq, shape, tree, frontier, probs, score):
        """Deterministic candidates: the best (node, child) pairs by cumulative log q within the budget."""
        budget = shape.num_nodes - tree.num_nodes
        cands = []
        for i, node in enumerate(frontier):
            base = 0.0 if node < 0 else score[node]
            top = probs[i].topk(shape.max_children)
            for p, x in zip(top.values.tolist(), top.indices.tolist()):
                if p > 0:
                    cands.append((base + float(np.log(p)), node, x))
        best = sorted(cands, key=lambda c: -c[0])[:budget]
        best.sort(key=lambda c: frontier.index(c[1]))  # parents first, in frontier order
        return [(node, x, None, sc) for sc, node, x in best]

    @staticmethod
    def _sample_children(seq, shape, tree, frontier, probs, score):
        """Siblings drawn from q without replacement with the row's own generator; how many each node
        gets depends on the budget left, never on the drawn values."""
        budget = shape.num_nodes - tree.num_nodes
        new = []
        for i, node in enumerate(frontier):
            q = probs[i]
            rest = q.clone()
            for _ in range(min(shape.max_children, budget - len(new))):
                if not float(rest.sum()) > 0:
                    break
                x = int(sample((rest / rest.sum())[None], [seq.generator])[0])
                rest[x] = 0.0
                new.append((node, x, q, 0.0))
        return new


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("trees")
    target = make_model(root / "target", "llama", layers=2, seed=0)
    near = perturbed_copy(target, root / "near", 0.02)  # a partly agreeing draft
    return {"target": str(target), "near": str(near), "hf": load_model(str(target)).hf_model}


def tree_llm(target: str, draft: str, k: int = 3, sampled: bool = False, max_nodes: int = 8, top_k: int = 3,
             mode: str = "tree", **kw) -> LLM:
    """An LLM whose engine drafts trees with ``DraftModelTrees`` over ``draft``."""
    llm = LLM(target, **kw)
    drafter = DraftModelTrees(LlamaRunner(load_model(draft)), sampled)
    llm.engine = Engine(llm.target, drafter, k, tokenizer=llm.tokenizer, strict_drafter=True, draft_tree=mode,
                        draft_tree_max_nodes=max_nodes, draft_tree_top_k=top_k)
    return llm


def plain(target: str, prompts, sp) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM(target).generate([{"prompt_token_ids": p} for p in prompts], sp)]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("shape", [(8, 3), (4, 1), (12, 4)], ids=["8x3", "4-chain", "12x4"])
def test_greedy_output_equals_plain_decoding(models, batch, shape):
    prompts = random_prompts(batch, [1, 5, 11, 23], seed=batch)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = plain(models["target"], prompts, sp)
    nodes, top_k = shape
    llm = tree_llm(models["target"], models["near"], k=3 if top_k > 1 else 4, max_nodes=nodes, top_k=top_k)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, e, o in zip(prompts, expected, outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    m = llm.get_metrics()
    assert m["num_tree_drafts"] == m["num_drafts"] > 0
    assert m["num_tree_accepted_tokens"] > 0
    assert m["mean_acceptance_length_trees"] == m["mean_acceptance_length"] > 1.0
    assert max(len(m["num_draft_tokens_per_pos"]), 1) <= 4  # positions are depths, not nodes


def test_self_drafted_trees_accept_whole_paths(models):
    """The target drafting for itself: every round accepts a full-depth path (tau = depth + 1)."""
    prompts = random_prompts(2, [4, 9], seed=5)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = tree_llm(models["target"], models["target"], k=3, max_nodes=14, top_k=2)  # every path of 2 children a node
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, e, o in zip(prompts, plain(models["target"], prompts, sp), outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    m = llm.get_metrics()
    assert m["mean_acceptance_length_trees"] > 3.5


def test_rows_joining_and_leaving_and_n_choices(models):
    """Requests of different lengths join while others decode (each gets its own prefill with
    draft_tree='tree') and leave at different rounds; a request with n = 2 greedy choices."""
    prompts = random_prompts(4, [3, 8, 13, 6], seed=11)
    lengths = [5, 17, 9, 12]
    llm = tree_llm(models["target"], models["near"], k=3)
    eng = llm.engine
    seqs, added = {}, 0
    for step in range(200):
        if added < len(prompts) and step % 3 == 0:  # one new request every third round
            sp = SamplingParams(temperature=0, max_tokens=lengths[added], ignore_eos=True, n=2 if added == 1 else 1)
            seqs[added] = eng.add_choices(prompts[added], sp)
            added += 1
        eng.step()
        if added == len(prompts) and not eng.has_unfinished():
            break
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True)
        want = plain(models["target"], [p], sp)[0]
        for s in seqs[i]:
            assert_greedy_equal(models["hf"], p, want, s.output_token_ids)
    assert eng.stats.num_tree_drafts > 0


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-siblings", "deterministic"])
def test_seeded_sampled_output_does_not_depend_on_the_batch(models, sampled):
    prompt = random_prompts(1, [7], seed=3)[0]
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=42, ignore_eos=True)
    alone = tree_llm(models["target"], models["near"], sampled=sampled).generate(
        [{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in random_prompts(3, [2, 9, 15], seed=8)]
    mixed = tree_llm(models["target"], models["near"], sampled=sampled).generate(
        others[:2] + [{"prompt_token_ids": prompt}] + others[2:],
        [SamplingParams(temperature=0.7, max_tokens=25, ignore_eos=True), SamplingParams(temperature=0, max_tokens=8),
         sp, SamplingParams(temperature=1.0, top_k=5, max_tokens=30, seed=1, ignore_eos=True)])
    assert mixed[2].outputs[0].token_ids == alone
    if not sampled:  # deterministic candidates: one draw from p per emitted token, plain decoding's own
        assert alone == plain(models["target"], [prompt], sp)[0]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    return small_vocab_pair(tmp_path_factory.mktemp("small"))


@pytest.mark.parametrize("params, sampled", [
    (dict(temperature=1.0), True),
    (dict(temperature=0.8, top_k=4, top_p=0.7), True),
    (dict(temperature=1.0, top_p=0.7), False),  # deterministic candidates (plain decoding's draws, above)
], ids=["t1", "topk-topp", "topp-deterministic"])
def test_sampled_outputs_follow_the_target_distribution(small_vocab, params, sampled):
    """The first token comes from a plain pass, the next ones from trees of depth 2 (up to 3 children
    a node, 6 nodes): the joint of the first two and the marginal of the third follow the target."""
    target, draft, hf = small_vocab
    prompt = [5, 9, 3]
    N = 2000
    llm = tree_llm(target, draft, k=2, sampled=sampled, max_nodes=6, top_k=3)
    sps = [SamplingParams(max_tokens=4, seed=1000 + i, ignore_eos=True, **params) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, sps)
    tokens = np.array([o.outputs[0].token_ids for o in outs])  # [N, 4]
    assert_first_tokens_follow_target(hf, prompt, tokens, sps[0], len(SMALL_WORDS) + 3)
    m = llm.get_metrics()
    assert m["num_tree_drafts"] >= N and m["num_tree_draft_tokens"] > 3 * m["num_tree_drafts"]  # real trees


def test_auto_without_a_controller_verifies_chains(models):
    prompts = random_prompts(2, [4, 9], seed=5)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = tree_llm(models["target"], models["near"], mode="auto")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, e, o in zip(prompts, plain(models["target"], prompts, sp), outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and m["num_tree_drafts"] == 0


def test_auto_with_the_controller_greedy_equal_plain_decoding(models):
    """draft_tree="auto" with the adaptive controller (it picks trees or chains each round, from timings)."""
    prompts = random_prompts(2, [5, 9], seed=1)
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    llm = LLM(models["target"], backend="torch", speculative_config={
        "method": "draft_model", "model": models["near"], "num_speculative_tokens": 3, "draft_tree": "auto"})
    llm.engine.strict_drafter = True
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, e, o in zip(prompts, plain(models["target"], prompts, sp), outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    assert llm.get_metrics()["num_drafts"] > 0


def test_logits_processors_draft_a_chain_in_the_tree_round(models):
    """A row with a repetition penalty drafts a chain inside the tree round (policy.row_tree), the other
    row its tree: every round stays a tree round, and both outputs equal plain's."""
    prompts = random_prompts(2, [4, 9], seed=6)
    sps = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    llm = tree_llm(models["target"], models["near"])
    asked = []
    propose_tree = llm.engine.drafter.propose_tree

    def recorded(seqs, shapes, sb):
        asked.extend((s.params.repetition_penalty != 1.0, sh) for s, sh in zip(seqs, shapes) if sh is not None)
        return propose_tree(seqs, shapes, sb)

    llm.engine.drafter.propose_tree = recorded
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps)
    want = LLM(models["target"]).generate([{"prompt_token_ids": p} for p in prompts], sps)
    for p, w, o in zip(prompts, want, outs):
        assert_greedy_equal(models["hf"], p, w.outputs[0].token_ids, o.outputs[0].token_ids)
    m = llm.get_metrics()
    assert m["num_drafts"] == m["num_tree_drafts"] > 0  # no chain round
    assert {penalized for penalized, _ in asked} == {True, False}
    for penalized, shape in asked:
        assert (shape.max_children == 1 and shape.num_nodes == shape.max_depth) == penalized


def test_tree_option_errors(models):
    llm = LLM(models["target"])
    chains_only = NgramDrafter()
    with pytest.raises(ValueError, match="draft_tree='auto' or 'chain'"):
        Engine(llm.target, chains_only, 3, draft_tree="tree")
    with pytest.raises(ValueError, match="draft_tree must be one of"):
        Engine(llm.target, chains_only, 3, draft_tree="trees")
    Engine(llm.target, chains_only, 3, draft_tree="auto")  # auto: chains from a chain drafter


def test_a_target_that_verifies_chains_only_refuses_tree(models):
    llm = LLM(models["target"])
    drafter = DraftModelTrees(LlamaRunner(load_model(models["near"])))
    llm.target.can_verify_trees = False  # an instance that cannot (every shipped backend can)
    with pytest.raises(ValueError, match="backend='torch' or draft_tree='chain'"):
        Engine(llm.target, drafter, 3, draft_tree="tree")
    assert Engine(llm.target, drafter, 3, draft_tree="auto").scheduler.draft_tree == "chain"


def test_llamacpp_trees_hold_fewer_rows_within_its_sequence_ids(models, tmp_path):
    """llama.cpp's tree branches are sequence ids (256 a context): "tree" runs fewer rows at once, "auto"
    verifies chains when the batch is too large for trees of the full size."""
    from specdec.config import SchedulerConfig
    from specdec.models.gguf import convert
    from specdec.models.llamacpp import MAX_SEQUENCES, LlamaCppRunner
    target = LlamaCppRunner(convert(models["target"], str(tmp_path / "t.gguf"), "f32"))
    drafter = DraftModelTrees(LlamaRunner(load_model(models["near"])))
    engine = Engine(target, drafter, 3, draft_tree="tree", draft_tree_max_nodes=8)
    assert engine.scheduler.draft_tree == "tree" and engine.scheduler.max_num_seqs == MAX_SEQUENCES // 8
    engine = Engine(target, drafter, 3, draft_tree="tree", scheduler_config=SchedulerConfig(max_num_seqs=4))
    assert engine.scheduler.max_num_seqs == 4


class OversizedTrees(DraftModelTrees):
    def propose_tree(self, seqs, shapes, sb):
        return [DraftTree([1] * (sh.num_nodes + 1), [-1] * (sh.num_nodes + 1)) if sh else None for sh in shapes]


def test_a_tree_beyond_its_shape_is_a_drafter_failure(models):
    llm = LLM(models["target"])
    drafter = OversizedTrees(LlamaRunner(load_model(models["near"])))
    llm.engine = Engine(llm.target, drafter, 3, strict_drafter=True, draft_tree="tree", draft_tree_top_k=20)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with pytest.raises(ValueError, match="exceeds the shape"):
        llm.generate([{"prompt_token_ids": [3, 4, 5]}], sp)
    llm.engine = Engine(llm.target, drafter, 3, strict_drafter=False, draft_tree="tree", draft_tree_top_k=20)
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], sp)[0].outputs[0].token_ids
    assert out == plain(models["target"], [[3, 4, 5]], sp)[0] and llm.engine.drafter_failures == 1


# -- the shipped drafters' trees, end to end through LLM -------------------------------------------

@pytest.mark.parametrize("batch", [1, 4])
def test_draft_model_trees_greedy_equal_plain_decoding(models, batch):
    prompts = random_prompts(batch, [1, 5, 11, 23], seed=batch + 20)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2 if batch == 1 else 1)
    llm = LLM(models["target"], speculative_config={"method": "draft_model", "model": models["near"],
                                                    "num_speculative_tokens": 3, "draft_tree": "tree",
                                                    "draft_tree_max_nodes": 8, "draft_tree_top_k": 3})
    llm.engine.strict_drafter = True
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    expected = plain(models["target"], prompts, replace_n(sp))
    for p, e, o in zip(prompts, expected, outs):
        for choice in o.outputs:
            assert_greedy_equal(models["hf"], p, e, choice.token_ids)
    m = llm.get_metrics()
    assert m["num_tree_drafts"] == m["num_drafts"] > 0 and m["num_tree_draft_tokens"] > 3 * m["num_tree_drafts"]


def test_suffix_trees_greedy_equal_plain_decoding(models):
    """Suffix decoding's trie branches: prompts that repeat themselves give it something to branch on."""
    base = random_prompts(2, [6, 9], seed=31)
    prompts = [b * 4 for b in base]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = LLM(models["target"], speculative_config={"method": "suffix", "num_speculative_tokens": 4,
                                                    "draft_tree": "tree", "draft_tree_max_nodes": 8})
    llm.engine.strict_drafter = True
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, e, o in zip(prompts, plain(models["target"], prompts, sp), outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    assert llm.get_metrics()["num_tree_drafts"] > 0


def test_draft_model_trees_follow_the_target_distribution(small_vocab):
    params = dict(temperature=1.0)
    target, draft, hf = small_vocab
    prompt = [5, 9, 3]
    N = 2000
    llm = LLM(target, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2,
                                          "draft_tree": "tree", "draft_tree_max_nodes": 6, "draft_tree_top_k": 3})
    llm.engine.strict_drafter = True
    sps = [SamplingParams(max_tokens=4, seed=1000 + i, ignore_eos=True, **params) for i in range(N)]
    tokens = np.array([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": prompt}] * N, sps)])
    assert_first_tokens_follow_target(hf, prompt, tokens, sps[0], len(SMALL_WORDS) + 3)
    assert llm.get_metrics()["num_tree_drafts"] >= N


def replace_n(sp: SamplingParams) -> SamplingParams:
    from dataclasses import replace
    return replace(sp, n=1)


def eagle3_llm(target: str, k: int, siblings: str, max_nodes: int, top_k: int) -> LLM:
    """An LLM whose engine drafts trees with an EAGLE-3 head of random weights over ``target``'s states."""
    from transformers import AutoConfig

    from specdec.drafters.eagle3 import Eagle3Drafter
    from specdec.models.eagle3 import Eagle3Config, Eagle3Head

    llm = LLM(target)
    c = Eagle3Config.for_target(AutoConfig.from_pretrained(target))
    torch.manual_seed(3)
    head = Eagle3Head(c, llm.target.token_embedding()[: c.vocab_size].float())
    drafter = Eagle3Drafter(head, llm.target, siblings=siblings)
    llm.engine = Engine(llm.target, drafter, k, tokenizer=llm.tokenizer, strict_drafter=True, draft_tree="tree",
                        draft_tree_max_nodes=max_nodes, draft_tree_top_k=top_k)
    return llm


def test_eagle3_trees_greedy_equal_plain_decoding(models):
    prompts = random_prompts(3, [4, 9, 14], seed=41)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = eagle3_llm(models["target"], 3, "top_k", 8, 3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, e, o in zip(prompts, plain(models["target"], prompts, sp), outs):
        assert_greedy_equal(models["hf"], p, e, o.outputs[0].token_ids)
    assert llm.get_metrics()["num_tree_drafts"] > 0


@pytest.mark.parametrize("method, siblings", [("draft_model", "sampled"), ("eagle3", "sampled"),
                                              ("eagle3", "top_k")])
def test_shipped_drafters_sampled_trees_follow_the_target(small_vocab, method, siblings):
    """Sampled siblings (drawn from q without replacement) and the head's top-k, at top-p 0.9."""
    target, draft, hf = small_vocab
    prompt, N = [5, 9, 3], 2000
    sps = [SamplingParams(max_tokens=4, seed=3000 + i, ignore_eos=True, temperature=1.0, top_p=0.9) for i in range(N)]
    if method == "eagle3":
        llm = eagle3_llm(target, 2, siblings, 6, 3)
    else:
        llm = LLM(target)
        llm.engine = Engine(llm.target, DraftModelDrafter(LlamaRunner(load_model(draft)), siblings=siblings), 2,
                            tokenizer=llm.tokenizer, strict_drafter=True, draft_tree="tree", draft_tree_max_nodes=6,
                            draft_tree_top_k=3)
    tokens = np.array([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": prompt}] * N, sps)])
    assert_first_tokens_follow_target(hf, prompt, tokens, sps[0], len(SMALL_WORDS) + 3)
    assert llm.get_metrics()["num_tree_draft_tokens"] > 2 * N
