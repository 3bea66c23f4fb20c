"""The compiled step (models/compiled.py) against the eager forward on the same weights: chain steps,
verify passes, rollback, tree passes, greedy_steps and kept hidden states give the same logits (within
float32 / bf16 rounding) and the same greedy tokens; which path ran is asserted, never assumed.

The first run on a machine compiles (tens of seconds per graph); inductor's disk cache makes later
runs fast."""

import pytest
import torch

from specdec import LLM
from specdec.config import ModelConfig, SpeculativeConfig
from specdec.models import cache_attention, linear16
from specdec.models.base import ForwardBatch
from specdec.models.compiled import ATTEND_STEP, attended_length, compile_settings, sizes_for
from specdec.models.llama import LlamaRunner
from specdec.models.load import load_model
from specdec.scheduler import KvBudget
from specdec.tree import DraftTree, block_parents
from tiny_models import make_model

PROMPT = list(range(5, 35))  # 30 tokens
TREE = DraftTree([11, 12, 13, 14, 15, 16, 17], [-1, -1, 0, 0, 1, 2, 5])  # 1 + 7 nodes fill T=8
# float32: eager and compiled passes sum in other orders (a padded pass is a product of another shape); on Xeon-AMX-FP16
# with ATen held to AVX2, MKL's kernels (not held) put logits 2.4e-5 and hidden states 3.3e-5 apart
F32_ATOL = 5e-5
CASES = {  # name: (arch, dtype, model kwargs, atol)
    "llama-float32": ("llama", "float32", {}, F32_ATOL),
    "mistral-window-bf16": ("mistral", "bfloat16", dict(sliding_window=6), 0.1),  # bf16 products rounded apart
    "llama-float32-gathered": ("llama", "float32", {}, F32_ATOL),  # as where the cache attention kernel does not run
}
GATHERED = {"llama-float32-gathered"}  # attention over keys gathered from the cache (no specdec::cache_attention)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory, one_thread):
    arch, dtype, kw, atol = CASES[request.param]
    folder = str(make_model(tmp_path_factory.mktemp(request.param), arch, **kw))
    with pytest.MonkeyPatch.context() as mp:
        if request.param in GATHERED:
            mp.setattr(cache_attention, "supports", lambda *a: False)
        compiled = LlamaRunner(load_model(folder, dtype), enforce_eager=False)
    eager = LlamaRunner(load_model(folder, dtype), enforce_eager=True)
    assert compiled.compiled is not None and eager.compiled is None
    d = compiled.model.dims  # attention from the cache where the kernel runs (float32 here), else gathered
    assert compiled.compiled.in_cache == (request.param not in GATHERED and
                                          cache_attention.supports(d.compute_dtype, torch.device("cpu"), d.head_dim))
    return compiled, eager, atol


def assert_same_argmax(c: torch.Tensor, e: torch.Tensor) -> int:
    """The greedy tokens agree wherever eager's top-2 gap exceeds twice the largest difference seen:
    bf16 logits tie or nearly tie often, and one rounding apart may flip those. Returns how many
    positions were clear."""
    top2 = e.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * (c - e).abs().max()
    assert torch.equal(c.argmax(-1)[clear], e.argmax(-1)[clear])
    return int(clear.sum())


def run_both(pair, batch_of):
    """Run ``batch_of()`` on both runners; returns (compiled, eager) results and the compiled one's path."""
    compiled, eager, _ = pair
    out_c = compiled.forward(batch_of())
    path = compiled.last_path
    return out_c, eager.forward(batch_of()), path


def test_steps_verify_passes_and_rollback_equal_eager(pair):
    compiled, eager, atol = pair
    for r in (compiled, eager):
        r.release()
        r.sync_rows(["a"])
    _, _, path = run_both(pair, lambda: ForwardBatch.from_rows([PROMPT[:20]], [0], logits="none"))
    assert path == f"eager: 20 tokens (compiled: up to {compiled.compile_sizes[-1]})"  # a prefill
    feeds = [([PROMPT[20]], 20, "last"),  # one-token step
             (PROMPT[21:26], 21, "all"),  # a verify pass of 5, padded to 8 (to 6 on the w16 kernel)
             (PROMPT[21:29], 21, 3),  # 8 tokens, the last 3 logits
             ([PROMPT[23]], 23, "last")]  # rolled back: positions 24.. are overwritten
    clear = 0
    for tokens, start, logits in feeds:
        c, e, path = run_both(pair, lambda: ForwardBatch.from_rows([tokens], [start], logits=logits))
        assert path == "compiled"
        assert c.shape == e.shape
        torch.testing.assert_close(c, e, atol=atol, rtol=0)
        clear += assert_same_argmax(c, e)
    assert clear >= 5  # of 10 positions: the check is not vacuous


def test_forward_argmax_is_the_argmax_of_forward_on_both_paths(pair):
    """The graph's own argmax (a greedy verify pass reads nothing else) equals the argmax of the logits the
    same pass returns: compiled at the graph's exact size (its tokens taken as they are) and padded, eager."""
    compiled, eager, _ = pair
    for r in (compiled, eager):
        for tokens, logits in ((PROMPT[20:21], "last"), (PROMPT[20:20 + compiled.compile_sizes[1]], "all"),
                               (PROMPT[21:26], "all"), (PROMPT[21:29], 3)):
            r.release()
            r.sync_rows(["m"])
            r.forward(ForwardBatch.from_rows([PROMPT[:20]], [0], logits="none"))
            full = r.forward(ForwardBatch.from_rows([tokens], [20], logits=logits))
            ids = r.forward_argmax(ForwardBatch.from_rows([tokens], [20], logits=logits))
            if r is compiled:
                assert r.last_path == "compiled"
            assert ids == full.argmax(-1).tolist(), (r is compiled, tokens, logits)
    with pytest.raises(ValueError, match="logits_index"):
        eager.forward_argmax(ForwardBatch.from_rows([PROMPT[:3]], [0], logits="none"))


def test_greedy_steps_use_the_compiled_step_and_equal_eager(pair):
    compiled, eager, _ = pair
    outs = []
    for r in (compiled, eager):
        r.release()
        r.sync_rows(["g"])
        r.forward(ForwardBatch.from_rows([PROMPT[:-1]], [0], logits="none"))
        outs.append(r.greedy_steps([PROMPT[-1]], [len(PROMPT) - 1], 12))
    assert compiled.last_path == "compiled"
    assert outs[0] == outs[1]
    direct, compiled.compiled.direct = compiled.compiled.direct, None  # through dynamo, as on CUDA
    try:
        assert compiled.greedy_steps([PROMPT[-1]], [len(PROMPT) - 1], 12) == outs[1]
    finally:
        compiled.compiled.direct = direct
    # a stop token ends the loop there, also when argmaxes are read a few steps at a time (as on CUDA)
    stop = outs[1][0][5]
    expected = outs[1][0][: outs[1][0].index(stop) + 1]
    for every in (1, 4):
        compiled.compiled.read_every = every
        got = compiled.greedy_steps([PROMPT[-1]], [len(PROMPT) - 1], 12, stop_token_ids=[stop])
        assert got == [expected], every
    compiled.compiled.read_every = 1


def test_sampled_steps_use_the_compiled_step_and_hand_pick_eagers_logits(pair):
    """CompiledStep.sampled_steps (a sampling drafter's chain on one row): the logits handed to ``pick`` at
    each step equal eager's, its tokens are what is fed next (here a fixed chain), directly and through dynamo."""
    compiled, eager, atol = pair
    chain = [PROMPT[3], PROMPT[7], PROMPT[1], PROMPT[9], PROMPT[4], PROMPT[2]]

    def run(r):
        handed = []

        def pick(logits):  # [1, V] or [1, 1, V]
            handed.append(logits.reshape(1, -1).clone())
            return [chain[len(handed)]]

        r.release()
        r.sync_rows(["s"])
        r.forward(ForwardBatch.from_rows([PROMPT[:-1]], [0], logits="none"))
        assert r.sampled_steps([chain[0]], [len(PROMPT) - 1], len(chain) - 1, pick) == [chain[1:]]
        return torch.cat(handed)  # [steps, V]

    expected = run(eager)
    torch.testing.assert_close(run(compiled), expected, atol=atol, rtol=0)
    assert compiled.last_path == "compiled"
    direct, compiled.compiled.direct = compiled.compiled.direct, None  # through dynamo, as on CUDA
    try:
        torch.testing.assert_close(run(compiled), expected, atol=atol, rtol=0)
    finally:
        compiled.compiled.direct = direct


def test_each_size_is_called_without_dynamo_and_equals_the_call_through_it(pair):
    """DirectGraphs: every compiled size was planned, and its direct call gives what the call through
    dynamo gives (the same kernels on the same inputs: bitwise), cache writes included: on a size's first
    call through AOTAutograd's and inductor's wrappers, and on later ones straight to the graph's own
    callable, which the first call checked gives the same."""
    compiled, _, _ = pair
    step = compiled.compiled
    assert sorted(step.direct.graphs) == sorted(step.sizes)
    step.direct._inner.clear()
    outs = []
    for direct in (step.direct, step.direct, None):
        compiled.release()
        compiled.sync_rows(["d"])
        compiled.forward(ForwardBatch.from_rows([PROMPT[:20]], [0], logits="none"))
        saved, step.direct = step.direct, direct
        try:
            logits = [compiled.forward(ForwardBatch.from_rows([tokens], [start], logits="all"))
                      for tokens, start in (([PROMPT[20]], 20), (PROMPT[21:26], 21), (PROMPT[26:29], 26))]
        finally:
            step.direct = saved
        outs.append((logits, compiled.cache.k[:, 0, :, :29].clone(), compiled.cache.v[:, 0, :, :29].clone()))
    used = [size for size, inner in step.direct._inner.items() if inner]
    assert len(used) >= 3 and all(callable(step.direct._inner[size]) for size in used)  # 1, 5 and 3 tokens' sizes
    (la, ka, va) = outs[-1]
    for lb, kb, vb in outs[:-1]:
        assert all(torch.equal(a, b) for a, b in zip(la, lb))
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_a_graph_compiled_again_for_a_size_is_checked_again(monkeypatch):
    """A size whose graph is compiled anew (say, for a cache of another shape) drops the callable the old
    graph's check adopted: the next call goes through the new graph's wrappers and is checked again."""
    import torch._inductor.compile_fx as cfx

    from specdec.models.compiled import DirectGraphs

    def fn(tokens):
        return tokens

    d = DirectGraphs(fn, "tokens", 1)
    d._inner[3] = lambda args: None  # adopted for the old graph of size 3
    monkeypatch.setattr(cfx, "compile_fx", lambda gm, inputs, config_patches=None: "new graph")
    monkeypatch.setattr(d, "_plan", lambda gm: (3, [None], [(0, 0, None)]))
    assert d.backend()(None, []) == "new graph"
    assert d.graphs[3][0] == "new graph" and 3 not in d._inner


def test_a_compiled_runner_dropped_frees_its_weights(tmp_path, one_thread):
    """Dynamo keeps its backends for the process's life; the plans of DirectGraphs (which hold the
    weights) are held by the runner only, so an LLM dropped frees its memory."""
    import gc
    import weakref

    runner = LlamaRunner(load_model(str(make_model(tmp_path, "llama"))), enforce_eager=False)
    runner.sync_rows(["a"])
    runner.forward(ForwardBatch.from_rows([PROMPT[:3]], [0], logits="last"))
    assert runner.compiled.direct.graphs
    weight = weakref.ref(runner.model.embed)
    del runner
    gc.collect()
    assert weight() is None


def test_tree_pass_equals_eager(pair):
    compiled, eager, atol = pair
    for r in (compiled, eager):
        r.release()
        r.sync_rows(["t"])
        r.forward(ForwardBatch.from_rows([PROMPT[:-1]], [0], logits="none"))
    width = 1 + TREE.num_nodes
    c, e, path = run_both(pair, lambda: ForwardBatch(torch.tensor([[PROMPT[-1], *TREE.token_ids]]), [len(PROMPT) - 1],
                                                     [width], torch.arange(width)[None],
                                                     parents=[block_parents(1, TREE)]))
    assert path == "compiled"
    torch.testing.assert_close(c, e, atol=atol, rtol=0)
    path6 = TREE.path_to(6)
    for r in (compiled, eager):  # keep root -> 0 -> 2 -> 5 -> 6, then continue from it
        r.compact([0], [len(PROMPT) - 1], [[0] + [1 + j for j in path6]])
    nxt = len(PROMPT) + len(path6)
    c, e, path = run_both(pair, lambda: ForwardBatch.from_rows([[21]], [nxt]))
    assert path == "compiled"
    torch.testing.assert_close(c, e, atol=atol, rtol=0)


def test_layer_subsets_and_batches_run_eager_with_their_reason(pair):
    compiled, _, _ = pair
    compiled.release()
    compiled.sync_rows(["x", "y"])
    compiled.forward(ForwardBatch.from_rows([[3, 4]], [0], num_layers=1))
    assert compiled.last_path == "eager: a layer subset (num_layers=1)"
    compiled.forward(ForwardBatch.from_rows([[3], [4]], [0, 0]))
    assert compiled.last_path == "eager: 2 rows (compiled: one row)"


def test_a_kv_budget_counts_the_rows_the_compiled_cache_keeps(pair):
    """The compiled graph traced the cache's rows as a dynamic dim (>= 2): one running row holds two,
    and a budget built with the runner's min_cache_rows counts them (one that did not would under-count)."""
    compiled, eager, _ = pair
    assert (compiled.min_cache_rows, eager.min_cache_rows) == (2, 1)
    compiled.release()
    compiled.reserve(1, 300)
    held = compiled.cache.k.nbytes + compiled.cache.v.nbytes
    per_position = compiled.kv_bytes_per_token()
    length = compiled.cache.max_len
    assert compiled.cache.k.shape[1] == 2 and held == 2 * length * per_position
    counted = KvBudget(held, per_position, 4, 1024, 0, target_min_rows=compiled.min_cache_rows).bytes_for(1, length)
    assert counted == held
    assert KvBudget(held, per_position, 4, 1024, 0).bytes_for(1, length) < held


def test_kept_hidden_states_on_the_compiled_path(pair):
    compiled, eager, atol = pair
    if compiled.dtype != torch.float32:
        pytest.skip("keeping states compiles the graphs again: one model is enough")
    try:
        for r in (compiled, eager):
            r.release()
            r.keep_hidden_states([1])
            r.sync_rows(["h"])
            r.forward(ForwardBatch.from_rows([PROMPT[:20]], [0], logits="none"))
            r.forward(ForwardBatch.from_rows([PROMPT[20:25]], [20], logits="all"))
        assert compiled.last_path == "compiled"
        # the residual stream grows with depth: float32 reorderings differ relatively (AVX2 kernels: 3.5e-6)
        torch.testing.assert_close(compiled.hidden_states(0, 0, 25), eager.hidden_states(0, 0, 25),
                                   atol=atol, rtol=1e-5)
    finally:
        for r in (compiled, eager):
            r.kept_layers = []
            r.release()


def test_enforce_eager_is_the_default_here_and_validated(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_ENFORCE_EAGER", "1")  # what conftest sets for the suite
    runner = LlamaRunner(load_model(str(make_model(tmp_path, "llama"))))
    assert runner.compiled is None and runner.last_path == "eager: enforce_eager"
    with pytest.raises(ValueError, match="enforce_eager must be True, False or None"):
        ModelConfig(model="m", enforce_eager="yes")


def test_two_runners_of_one_shape_keep_their_own_weights(tmp_path, one_thread):
    """Dynamo checks only the guards that tell its graphs apart (CompiledStep.run): two compiled runners
    of the same shape and other weights, called in turn, each still give their own eager logits."""
    runners = []
    for seed in (1, 2):
        folder = str(make_model(tmp_path / f"m{seed}", "llama", seed=seed))
        runners.append((LlamaRunner(load_model(folder), enforce_eager=False), LlamaRunner(load_model(folder), enforce_eager=True)))
    for compiled, eager in runners:
        for r in (compiled, eager):
            r.sync_rows(["a"])
            r.forward(ForwardBatch.from_rows([PROMPT[:20]], [0], logits="none"))
    outs = []
    for tokens, start in (([PROMPT[20]], 20), (PROMPT[21:24], 21), ([PROMPT[24]], 24)):
        for compiled, eager in runners:  # in turn: one runner's call between the other's
            c = compiled.forward(ForwardBatch.from_rows([tokens], [start], logits="all"))
            assert compiled.last_path == "compiled"
            torch.testing.assert_close(c, eager.forward(ForwardBatch.from_rows([tokens], [start], logits="all")),
                                       atol=2e-5, rtol=0)
            outs.append(c)
    assert not torch.allclose(outs[0], outs[1])  # the two models differ


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_compile_settings_are_ones_torch_compile_takes(device):
    """torch.compile refuses a mode and options together (the CUDA step failed at load that way): the
    settings for each device are accepted (torch.compile checks them before compiling anything)."""
    settings = compile_settings(torch.device(device))
    assert len(settings) == 1 and set(settings) <= {"mode", "options"}
    torch.compile(lambda x: x + 1, backend="inductor", fullgraph=True, dynamic=False, **settings)


def test_chain_inputs_made_in_numpy_equal_the_torch_ones(pair):
    """The direct CPU path's positions, slots and mask (_chain_inputs) are the tensors the torch path makes,
    at every start from 0 to past a few attended lengths, for each compiled size."""
    compiled = pair[0].compiled
    for Tb in compiled.sizes:
        for start in range(0, 3 * ATTEND_STEP + 5):
            L = attended_length(start + Tb)
            pos, slots, mask = compiled._chain_inputs(start, Tb, L)
            want = torch.arange(start, start + Tb)[None]
            assert torch.equal(pos, want) and torch.equal(slots, want) and pos.data_ptr() != slots.data_ptr()
            assert torch.equal(mask, torch.full((1, 1, Tb, L), float("-inf")).triu_(start + 1)), (Tb, start)


def test_compiled_sizes_follow_the_row_blocks_and_reach_the_longest_verify_pass(tmp_path):
    """oneDNN's sizes at its 4-row blocks, the 16-bit kernel's at its 3-row ones, its bf16 dot products' every
    2 rows; a longer verify pass (suffix decoding's k = 32) adds a size every two blocks up to it, so it runs
    compiled, not eager; with bf16 dot products the longest pass is a size of its own."""
    assert sizes_for("onednn") == (1, 4, 8, 12) == sizes_for("onednn", 8) == sizes_for("onednn", 12)
    assert sizes_for("onednn", 33) == (1, 4, 8, 12, 20, 28, 36)
    assert sizes_for("w16dot") == (1, 2, 4, 6, 8, 10, 12) == sizes_for("w16dot", 12)
    assert sizes_for("w16dot", 9) == (1, 2, 4, 6, 8, 9, 10, 12) and sizes_for("w16dot", 17) == (1, 2, 4, 6, 8, 10, 12, 17)
    assert sizes_for("w16dot", 33) == (1, 2, 4, 6, 8, 10, 12, 20, 28, 33)
    if linear16.available().ok and linear16.lanes() == 16:  # passes of up to 8 rows
        assert sizes_for("w16") == (1, 4, 6, 8, 12) == sizes_for("w16", 12)
        assert sizes_for("w16", 33) == (1, 4, 6, 8, 12, 20, 28, 36)
    elif linear16.available().ok:  # AVX2: tiles of 3 rows
        assert sizes_for("w16") == (1, 3, 6, 9) == sizes_for("w16", 9)
        assert sizes_for("w16", 33) == (1, 3, 6, 9, 15, 21, 27, 33)
    assert SpeculativeConfig(method="suffix", num_speculative_tokens=32).longest_verify == 33
    assert SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=4).longest_verify == 8  # a tree
    assert SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=4,
                             draft_tree="chain").longest_verify == 5
    folder = str(make_model(tmp_path, "llama"))
    llm = LLM(folder, backend="torch", enforce_eager=True,
              speculative_config={"method": "suffix", "num_speculative_tokens": 16})
    target = llm.engine.target  # what it would compile, were it compiled
    assert target.compile_sizes == sizes_for(target.lm_head.kind, 17) and target.compile_sizes[-1] >= 17
    plain = LLM(folder, backend="torch", enforce_eager=True).engine.target
    assert plain.compile_sizes == sizes_for(plain.lm_head.kind)
