"""The EAGLE-3 head's compiled one-row passes (models/compiled_head.py) against its eager pass on the
same weights: chain steps and padded catch-ups give the same logits, g and k, v, across attended
lengths, a grown cache, rollback and two heads in one process; and through ``LLM`` beside a compiled target, greedy output equal to plain
decoding with the compiled step having run. The first run on a machine compiles (seconds per head);
inductor's disk cache makes later runs fast."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.drafters.eagle3 import SPECDEC_KERNELS, HeadRunner
from specdec.models import cache_attention, linear8
from specdec.models.compiled_head import SIZES
from specdec.models.eagle3 import load_head
from specdec.models.load import load_model
from test_eagle3 import LAYERS, make_head, plain_greedy, spec
from tiny_models import make_model, random_prompts

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not cache_attention.available().ok,
                                 reason="the compiled chain step runs where the cache attention kernel does")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled_head")
    target = str(make_model(root / "target", "llama", layers=LAYERS, seed=0, max_pos=512))
    hf = load_model(target).hf_model
    heads = [load_head(make_head(target, root / f"head{i}", seed=i, draft_vocab=40, norm_before_fc=bool(i)),
                       hf.model.embed_tokens.weight.detach(), LAYERS) for i in range(2)]
    return {"target": target, "hf": hf, "heads": heads, "root": root}


@pytest.mark.parametrize("quantize", [None, "int8", "int4"], ids=["bf16", "int8", "int4"])
def test_compiled_chain_steps_equal_eager_ones(models, quantize):
    """Chain steps of one row at positions that cross the attended length's steps (64) and the cache's
    first 256 positions (it grows), then rolled back; two heads of one shape keep their own weights.
    int8, int4: the products on the VNNI kernels, compiled as an extern call."""
    if quantize and not linear8.available(int(quantize[3:])).ok:
        pytest.skip(f"the {quantize} kernel cannot run here: {linear8.available(int(quantize[3:])).reason}")
    D = models["heads"][0].config.hidden_size
    for head in models["heads"]:
        eager = HeadRunner(head, torch.bfloat16, torch.device("cpu"), quantize)
        compiled = HeadRunner(head, torch.bfloat16, torch.device("cpu"), quantize)
        assert quantize is None or compiled.w.lm_head.kind == {"int8": "w8", "int4": "w4"}[quantize]
        compiled.compile("test head")
        assert compiled.compiled is not None and eager.compiled is None
        assert sorted(compiled.compiled.direct.graphs) == list(SIZES)  # each size called without dynamo's frame
        torch.manual_seed(3)
        history = torch.randint(0, head.config.vocab_size, (1, 60))
        with torch.inference_mode():
            hidden = torch.randn(1, 60, D)
            for r in (eager, compiled):
                r.reserve(2, 64)
                r.step(history, hidden, [1], torch.arange(60)[None])  # row 1: positions 0..59
            positions = list(range(60, 70)) + [250, 251, 300, 62, 63, 64]  # 300: the cache grows; 62..: rollback
            for p in positions:
                ids, g = torch.randint(0, head.config.vocab_size, (1,)), torch.randn(1, D)
                for r in (eager, compiled):  # as the drafter reserves a round's positions (Eagle3Drafter._start)
                    r.reserve(2, p + 2)
                want_logits, want_g = eager.chain_step(ids, g, [1], [p])
                got_logits, got_g = compiled.chain_step(ids, g, [1], [p])
                torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(got_g, want_g, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(compiled.cache.k[0, 1, :, : p + 1], eager.cache.k[0, 1, :, : p + 1])
                torch.testing.assert_close(compiled.cache.v[0, 1, :, : p + 1], eager.cache.v[0, 1, :, : p + 1])
        assert compiled.cache.max_len > 256


def test_compiled_catch_ups_equal_eager_ones(models):
    """Catch-ups of 1 to 10 tokens (padded to 3, 6, 9; 10 runs eager): the last token's logits and g, and
    the k, v of the real tokens; the padding's entries past them are rewritten by the next pass."""
    head = models["heads"][1]
    D = head.config.hidden_size
    eager = HeadRunner(head, torch.bfloat16, torch.device("cpu"))
    compiled = HeadRunner(head, torch.bfloat16, torch.device("cpu"))
    compiled.compile("test head")
    assert compiled.compiled.why_not(9) is None and compiled.compiled.why_not(10) == "10 tokens (compiled: up to 9)"
    torch.manual_seed(4)
    start = 0
    with torch.inference_mode():
        for T in [5, 1, 2, 3, 4, 6, 7, 8, 9, 10, 4]:
            ids, hidden = torch.randint(0, head.config.vocab_size, (T,)), torch.randn(T, D)
            for r in (eager, compiled):
                r.reserve(2, start + T + 1)
            want_logits, want_g = eager.catch_up_row(ids, hidden, 1, start)
            got_logits, got_g = compiled.catch_up_row(ids, hidden, 1, start)
            torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got_g, want_g, rtol=1e-4, atol=1e-4)
            end = start + T
            torch.testing.assert_close(compiled.cache.k[0, 1, :, :end], eager.cache.k[0, 1, :, :end])
            torch.testing.assert_close(compiled.cache.v[0, 1, :, :end], eager.cache.v[0, 1, :, :end])
            start = end - 1  # as a round after one accepted token: the last entry is written again


def test_greedy_output_beside_a_compiled_target_equals_plain_decoding(models):
    target = models["target"]
    prompts = random_prompts(3, [2, 9, 30], seed=5)
    expected = plain_greedy(target, prompts, 16)
    llm = LLM(target, backend="torch", enforce_eager=False,
              speculative_config=spec(str(models["root"] / "head0"), 3, adaptive=False))
    runner = llm.engine.drafter.runner
    assert runner.compiled is not None
    calls = []
    row_pass = runner.compiled.row_pass
    runner.compiled.row_pass = lambda *a: calls.append(1) or row_pass(*a)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = [llm.generate([{"prompt_token_ids": p}], sp)[0] for p in prompts]  # one row: the compiled chain step
    assert [[o.outputs[0].token_ids] for o in outs] == expected
    assert calls and llm.get_metrics()["num_draft_tokens"] > 0


def test_an_eager_target_keeps_the_head_eager(models):
    llm = LLM(models["target"], backend="torch", enforce_eager=True,
              speculative_config=spec(str(models["root"] / "head0"), 3, adaptive=False))
    assert llm.engine.drafter.runner.compiled is None


def test_a_kv_budget_counts_the_rows_the_compiled_head_keeps(models):
    """The compiled passes traced the head's cache rows as a dynamic dim (>= 2): one running row holds two,
    and the drafter's KvUse says so, so that the scheduler's budget counts what the cache holds."""
    from specdec.scheduler import KvBudget

    llm = LLM(models["target"], backend="torch", enforce_eager=False,
              speculative_config=spec(str(models["root"] / "head0"), 3, adaptive=False))
    drafter, target = llm.engine.drafter, llm.engine.target
    drafter.runner.reserve(1, 300)
    cache = drafter.runner.cache
    assert cache.k.shape[1] == 2 and drafter.runner.min_cache_rows == 2
    head_use = drafter.kv_use(3)[0]
    assert head_use.min_rows == 2
    held = cache.k.nbytes + cache.v.nbytes
    tokens = cache.max_len - head_use.extra  # a row whose head cache spans max_len positions
    assert head_use.bytes(tokens) * 2 == held
    budget = KvBudget(10**9, 0, 4, 1024, 0, drafter=[head_use])
    assert budget.bytes_for(1, tokens + 1) == held  # length - k - 1 tokens (k = 0)


def test_beside_a_llamacpp_target_the_head_runs_where_it_is_fastest(models):
    """A bf16 llama.cpp target: where the torch head's products run on one of specdec's kernels (the 16-bit
    kernel on x86 without native bf16, the bf16 dot products on AVX-512 BF16 without AMX) the head runs
    compiled in torch, else in llama.cpp's eagle3 graphs; eager asked, llama.cpp's.
    Greedy output equals plain decoding on llama.cpp either way."""
    import llama_cpp  # noqa: F401  (a required dependency: built by `make install`)

    from specdec.models.gguf import convert
    from specdec.models.llamacpp_head import LlamaCppHead

    gguf = convert(models["target"], str(models["root"] / "target-bf16.gguf"), "bf16")
    head = str(models["root"] / "head0")
    prompts = random_prompts(2, [9, 30], seed=6)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(gguf, backend="llama.cpp")
    expected = [plain.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(gguf, backend="llama.cpp", enforce_eager=False, speculative_config=spec(head, 3, adaptive=False))
    runner = llm.engine.drafter.runner
    w16 = HeadRunner(llm.engine.drafter.head, torch.bfloat16, torch.device("cpu")).w.qkv.kind in SPECDEC_KERNELS
    if w16:
        assert isinstance(runner, HeadRunner) and runner.compiled is not None
    else:
        assert isinstance(runner, LlamaCppHead)
    got = [llm.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids for p in prompts]
    assert got == expected and llm.get_metrics()["num_draft_tokens"] > 0
    assert llm.engine.drafter.one_thread == (not w16)  # head_threads: the compiled head on torch's threads
    eager = LLM(gguf, backend="llama.cpp", enforce_eager=True, speculative_config=spec(head, 3, adaptive=False))
    d = eager.engine.drafter
    assert isinstance(d.runner, LlamaCppHead) and d.one_thread
    d.runner = HeadRunner(d.head, torch.bfloat16, torch.device("cpu"))  # an eager torch head swapped in: one thread
    assert d.one_thread
    d.runner.compile("test head")
    assert not d.one_thread


def test_inputs_unlike_the_traced_ones_compile_again_rather_than_fail(models):
    """The compiled pass skips dynamo's frame (DirectGraphs), or, through it, dynamo's guards; an input it
    was not traced for (made outside inference mode, a strided view) still gives eager's result."""
    head = models["heads"][0]
    D = head.config.hidden_size
    eager, compiled = (HeadRunner(head, torch.bfloat16, torch.device("cpu")) for _ in range(2))
    compiled.compile("test head")
    for r in (eager, compiled):
        r.reserve(2, 64)
    ids = torch.tensor([3])  # not an inference tensor: the traced ones were
    hidden = torch.randn(D, 2)[:, 0][None]  # [1, D], a strided view
    want = eager.chain_step(ids, hidden, [0], [5])
    got = compiled.chain_step(ids, hidden, [0], [5])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantize,bound", [("int8", 0.05), ("int4", 0.3)])
def test_a_quantized_head_drafts_near_its_16_bit_self(models, quantize, bound):
    """int8 products move a chain step's logits by about 1% of their spread, int4 (the default where the kernel
    runs) by about 10% on this random head, and keep its top token on nearly every row."""
    if not linear8.available(int(quantize[3:])).ok:
        pytest.skip(f"the {quantize} kernel cannot run here: {linear8.available(int(quantize[3:])).reason}")
    head = models["heads"][0]
    D = head.config.hidden_size
    full, quantized = (HeadRunner(head, torch.bfloat16, torch.device("cpu"), q) for q in (None, quantize))
    torch.manual_seed(7)
    history = torch.randint(0, head.config.vocab_size, (1, 20))
    same_top, errors = 0, []
    with torch.inference_mode():
        hidden = torch.randn(1, 20, D)
        for r in (full, quantized):
            r.reserve(2, 64)
            r.step(history, hidden, [1], torch.arange(20)[None])
        for p in range(20, 40):
            ids, g = torch.randint(0, head.config.vocab_size, (1,)), torch.randn(1, D)
            want, _ = full.chain_step(ids, g, [1], [p])
            got, _ = quantized.chain_step(ids, g, [1], [p])
            errors.append(((got - want).norm() / (want - want.mean()).norm()).item())
            same_top += int(got.argmax() == want.argmax())
    assert max(errors) < bound, errors
    assert same_top >= 16, same_top
