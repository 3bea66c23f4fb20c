"""The scheduler: the one owner of admission (seats, prompt tokens a round, KV memory, merged prefills)
for ``LLM.generate`` and the server alike."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.config import SchedulerConfig
from specdec.sampling import make_generator
from specdec.scheduler import MERGED_PREFILL_TOKENS, KvBudget, Scheduler
from specdec.sequence import Sequence
from specdec.server.async_engine import AsyncEngine, Prompt
from specdec.server.limits import ServerLimits
from tiny_models import make_model, perturbed_copy

K = 3
BYTES = 10  # KV bytes per position in the unit tests


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("scheduler")
    target = make_model(root / "target", "llama", max_pos=512)
    return str(target), str(perturbed_copy(target, root / "draft", 0.01))


def test_suffix_decoding_in_front_of_a_draft_model_counts_the_drafts_kv(models):
    """With suffix decoding in front of a draft model (HybridDrafter), the KV budget counts the draft
    model's cache beside the target's: a request whose target cache alone would just fit is refused."""
    target, draft = models
    llm = LLM(target, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": K,
                                          "enable_suffix_decoding": True, "adaptive": False})
    target_bytes = llm.engine.target.kv_bytes_per_token()
    draft_bytes = llm.engine.drafter.model.runner.kv_bytes_per_token()
    assert draft_bytes > 0
    sp = SamplingParams(temperature=0, max_tokens=100)
    positions = 256  # 10 prompt tokens + 100 outputs + a verify pass, in the torch cache's steps
    loop = AsyncEngine(llm.engine, limits=ServerLimits(kv_cache_memory=positions * target_bytes))
    assert loop.budget is llm.engine.scheduler.kv  # the HTTP side checks against the scheduler's own budget
    assert loop.budget.bytes_per_token == target_bytes + draft_bytes
    with pytest.raises(ValueError, match="KV cache"):
        loop.check([Prompt(list(range(3, 13)), sp)])


# -- admission decisions, without a model ---------------------------------------------------------------------


def seq(num_prompt_tokens: int, max_tokens: int = 100, outputs: int = 0, **params) -> Sequence:
    s = Sequence(list(range(3, 3 + num_prompt_tokens)), SamplingParams(temperature=0, max_tokens=max_tokens, **params),
                 torch.Generator(), max_len=512)
    s.token_ids += [7] * outputs
    return s


def choices(num_prompt_tokens: int, n: int) -> list[Sequence]:
    """n choices of one prompt, as Engine makes them: one prefill group."""
    seqs = [seq(num_prompt_tokens) for _ in range(n)]
    for s in seqs:
        s.prefill_group = seqs[0].seq_id
    return seqs


def test_seats_admit_in_order_a_request_whole_and_none_overtakes():
    sched = Scheduler(SchedulerConfig(max_num_seqs=3))
    first, pair, single = [seq(4)], choices(4, 2), [seq(4)]
    for r in (first, pair, single):
        sched.add(r)
    assert sched.admit().seqs == first + pair
    assert sched.admit() is None  # the batch is full
    sched.abort(first[0])
    assert sched.admit() is None  # a finished sequence holds its seat until it is retired
    assert sched.retire() == first and sched.running == [pair[1], pair[0]]  # the last row moves into the hole
    assert sched.admit().seqs == single
    late_pair, after = choices(4, 2), [seq(4)]
    sched.add(late_pair)
    sched.add(after)
    sched.abort(pair[0])
    sched.retire()
    assert sched.admit() is None  # one seat is free: the pair waits, and the single behind it waits too
    sched.abort(late_pair[0])
    assert sched.admit().seqs == [late_pair[1]]  # an aborted choice is skipped; its sibling still joins
    assert sched.waiting_seqs() == after


def test_the_rounds_prompt_tokens_are_bounded_and_a_prompt_alone_always_fits():
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=100))
    shared = choices(60, 3)  # choices of one prompt share its prefill: 60 tokens, not 180
    for r in ([seq(10)], shared, [seq(40)], [seq(150)], [seq(20)]):
        sched.add(r)
    rounds = []
    while sched.waiting:
        rounds.append([s.num_prompt_tokens for s in sched.admit().seqs])
    assert rounds == [[10, 60, 60, 60], [40], [150], [20]]


def test_the_kv_budget_counts_the_caches_peak_shape_and_rows_until_retired():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8), k=K, kv_bytes_per_token=BYTES, max_model_len=512)
    kv = sched.limit(kv_cache_memory=4 * 256 * BYTES)  # 4 rows of 256 positions
    assert kv.positions(10, 100) == 256 and kv.positions(10, 10_000) == 512 + 256  # the context bounds the output
    a, b = seq(10), seq(10)
    sched.add([a, b])
    assert sched.admit().seqs == [a, b] and kv.reserved == 2 * 256 * BYTES
    sched.add([seq(10, max_tokens=400)])  # 3 rows of 512 positions: the caches grow to the longest row
    assert sched.admit() is None
    sched.waiting.clear()
    c, d, e = seq(10), seq(10), seq(10)
    sched.add([c, d, e])
    assert sched.admit() is None  # 5 rows
    sched.abort(a)
    assert sched.admit() is None  # a is still in the batch until it is retired
    sched.retire()
    assert sched.admit().seqs == [c, d, e] and kv.reserved == 4 * 256 * BYTES
    for s in (b, c, d, e):
        sched.abort(s)
    sched.retire()
    big = seq(10, max_tokens=900)  # 768 positions: alone it fits, beside the caches' old peak (4 rows) not
    sched.add([big])
    admitted = sched.admit()
    assert admitted.seqs == [big] and admitted.release_caches and kv.reserved == 768 * BYTES


def test_the_scheduler_config_refuses_bad_bounds_and_a_server_bounds_it_again():
    for bad, message in (({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1, got 0"),
                         ({"max_num_seqs": 2.0}, "max_num_seqs must be an integer >= 1, got 2.0"),
                         ({"num_scheduler_steps": True}, "num_scheduler_steps must be an integer >= 1"),
                         ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be an integer >= 1 or None"),
                         ({"kv_cache_memory": -1}, "kv_cache_memory must be a number of bytes >= 0 or None")):
        with pytest.raises(ValueError, match=message):
            SchedulerConfig(**bad)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4), kv_bytes_per_token=BYTES, max_model_len=512)
    assert sched.kv is None  # LLM.generate: no KV bound
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.limit(kv_cache_memory=1024, max_num_batched_tokens=-5)
    kv = sched.limit(kv_cache_memory=2 * 256 * BYTES, max_num_batched_tokens=64)
    assert sched.kv is kv and sched.config == SchedulerConfig(4, max_num_batched_tokens=64,
                                                               kv_cache_memory=2 * 256 * BYTES)
    assert kv.max_rows == 4 and kv.budget == 2 * 256 * BYTES


def test_a_request_that_can_never_fit_is_refused_before_it_queues():
    kv = KvBudget(budget=4 * 256 * BYTES, bytes_per_token=BYTES, max_rows=2, max_model_len=512, k=K)
    kv.check([256, 256])
    with pytest.raises(ValueError, match="3 sequence"):
        kv.check([256] * 3)  # more sequences than max_num_seqs
    with pytest.raises(ValueError, match="KV cache"):
        kv.check([256 * 5])


def test_small_prompts_ride_in_the_next_verify_pass_while_others_decode():
    sched = Scheduler()
    sched.add([seq(600)])
    assert not sched.admit().merged  # nothing decodes yet: a prefill of its own
    sched.add([seq(MERGED_PREFILL_TOKENS - 10)])
    sched.add([seq(10)])
    assert sched.admit().merged
    sched.add([seq(MERGED_PREFILL_TOKENS - 10)])
    sched.add([seq(11)])
    assert not sched.admit().merged  # together past MERGED_PREFILL_TOKENS
    sched.add([seq(10, prompt_logprobs=1)])
    assert not sched.admit().merged  # a verify pass has no prompt logits


def test_drafts_asked_per_row():
    sched = Scheduler(k=K)
    new, short, plain, full = seq(4), seq(4, max_tokens=3, outputs=1), seq(4, outputs=1), seq(4, outputs=1)
    sched.add([new, short, plain, full])
    sched.admit()
    sched.plain_only.add(plain.seq_id)  # the drafter failed on it
    # the first token comes from a plain pass; no drafts past the room left (2 tokens: 1 draft + 1 bonus)
    assert sched.num_wanted() == [0, 1, 0, K]


def test_a_group_runs_alone_and_the_others_come_back_to_recompute():
    sched = Scheduler()
    a, b, c = seq(4), seq(4), seq(4)
    sched.add([a, b])
    sched.admit()
    sched.add([c])
    a.num_computed = b.num_computed = 3
    with sched.alone([b]):
        assert sched.running == [b] and sched.admit() is None
    assert sched.running == [b, a] and a.num_computed == 0 and b.num_computed == 3
    assert sched.waiting_seqs() == [c]
    with sched.alone([b, c]):  # a waiting one of the group may join
        assert sched.admit().seqs == [c]
    assert sched.running == [b, c, a] and not sched.waiting


def test_caches_freed_at_admission_leave_the_newcomers_reserved(models):
    """When admission frees caches held at an old peak, the KV budget still counts what it admits
    after them: the engine frees the memory, the budget keeps the newcomers' reservation."""
    target, _ = models
    llm = LLM(target)
    bytes_per_token = llm.engine.target.kv_bytes_per_token()
    kv = llm.engine.scheduler.limit(kv_cache_memory=2 * 256 * bytes_per_token)
    sp = SamplingParams(temperature=0, max_tokens=100)
    llm.generate([list(range(3, 13)), list(range(13, 23))], sp)  # the caches' peak: 2 rows of 256 positions
    assert kv.reserved == 2 * 256 * bytes_per_token
    # 10 + 400 tokens: 512 positions, which fit alone but not beside the old peak's 2 rows
    seq = llm.engine.add_request(list(range(3, 13)), SamplingParams(temperature=0, max_tokens=400))
    llm.engine.step()
    assert llm.engine.running == [seq]
    assert kv.reserved == 512 * bytes_per_token


def _decoding(params: SamplingParams, outputs: int = 2) -> Sequence:
    """A sequence past its first output tokens, its newest token still to feed."""
    s = Sequence([1, 2, 3], params, make_generator(0), max_len=64)
    s.token_ids += [4] * outputs
    s.num_computed = len(s.token_ids) - 1
    return s


def test_tree_shapes_per_row_and_when_a_round_takes_chains():
    from specdec.tree import TreeShape

    sched = Scheduler(k=3, draft_tree="tree", draft_tree_max_nodes=8, draft_tree_top_k=2)
    greedy, seeded = SamplingParams(temperature=0, max_tokens=20), SamplingParams(seed=1, max_tokens=20)
    first = _decoding(greedy, outputs=0)  # its first token comes from a plain pass
    short = _decoding(greedy)
    short.params = SamplingParams(temperature=0, max_tokens=4)  # room 2: a tree of depth 1
    sched.running = [_decoding(greedy), _decoding(seeded), first, short]
    assert sched.tree_shapes() == [TreeShape(8, 3, 2), TreeShape(8, 3, 2), None, TreeShape(8, 1, 2)]
    sched.running[0].num_computed = 0  # a merged prompt rides in the pass: chains
    assert sched.tree_shapes() is None
    sched.running = [_decoding(greedy), _decoding(SamplingParams(temperature=0, max_tokens=20, logprobs=2))]
    assert sched.tree_shapes() == [TreeShape(8, 3, 2), TreeShape(3, 3, 1)]  # logprobs: a chain in the tree round
    deep = Scheduler(k=9, draft_tree="tree", draft_tree_max_nodes=5)
    deep.running = [_decoding(greedy)]
    assert deep.tree_shapes() == [TreeShape(5, 5, 4)]  # no more levels than nodes
    auto = Scheduler(k=3, draft_tree="auto")
    auto.running = [_decoding(greedy)]
    assert auto.tree_shapes() is None  # auto without a controller: chains
    assert Scheduler(k=3, draft_tree="chain").tree_shapes() is None


def test_the_policy_decides_tree_or_chain_and_how_a_seeded_row_drafts():
    from specdec import policy
    from specdec.tree import TreeShape

    full, chosen = TreeShape(8, 3, 2), TreeShape(4, 2, 2)
    seeded, greedy = SamplingParams(seed=1, max_tokens=20), SamplingParams(temperature=0, max_tokens=20)
    asked = []

    def controller(force: bool):
        asked.append(force)
        return chosen

    rows = [_decoding(greedy)]
    assert policy.tree_round("chain", rows, False, controller, full) is None
    assert policy.tree_round("tree", rows, True, controller, full) is None  # a prompt rides in the pass
    assert policy.tree_round("tree", rows, False, lambda force: None, full) == full  # no controller
    assert policy.tree_round("auto", rows, False, controller, full) == chosen and asked == [False]
    assert policy.tree_round("auto", rows + [_decoding(seeded)], False, controller, full) is None
    assert asked == [False]  # a seeded sampled row takes chains in auto, whatever the controller would say
    two = [_decoding(greedy), _decoding(greedy)]  # a target holding rows x nodes <= 8 (full: 8 nodes)
    assert policy.tree_round("auto", rows, False, controller, full, tree_sequences=8) == chosen
    assert policy.tree_round("auto", two, False, controller, full, tree_sequences=8) is None  # past it: chains
    assert policy.tree_round("auto", two, False, controller, full, tree_sequences=16) == chosen
    s = _decoding(seeded)
    assert policy.row_tree(s, 2, chosen, full) == TreeShape(8, 2, 2)  # the largest tree, never the controller's
    assert policy.row_tree(_decoding(greedy), 5, chosen, full) == TreeShape(4, 2, 2)
    assert policy.row_tree(_decoding(SamplingParams(max_tokens=20, logprobs=1)), 5, chosen, full) == TreeShape(2, 2, 1)
    assert policy.row_tree(s, 0, chosen, full) is None
    assert policy.seeded_k(seeded, 4, 1) == 4 and policy.seeded_k(greedy, 4, 1) == 1
    assert policy.seeded_members(["draft_model", "suffix", "ngram"]) == ["suffix", "ngram"]
    assert policy.seeded_members(["eagle3", "draft_model"]) == ["eagle3"]
