"""SpecDecodingStats: the counters of one round by hand, and the drafts the engine asks for."""

import pytest

from specdec import LLM, SamplingParams
from specdec.metrics import SpecDecodingStats
from tiny_models import make_model


def test_record_round_counts_per_sequence_and_position():
    stats = SpecDecodingStats()
    # three rows asked for 3, 3, 2 drafts; they proposed 3, 1, 0 and accepted 2, 1, 0
    stats.record_round([3, 1, 0], [2, 1, 0], [3, 3, 2])
    assert stats.num_verify_passes == 1
    assert stats.num_drafts == 2  # the row that proposed nothing is no draft
    assert stats.num_draft_tokens == 4 and stats.num_asked_draft_tokens == 8
    assert stats.num_accepted_tokens == 3
    assert stats.num_draft_tokens_per_pos == [2, 1, 1]
    assert stats.num_accepted_tokens_per_pos == [2, 1, 0]
    assert stats.num_emitted_tokens == 3 + 2 + 1  # accepted + one recovered or bonus token per row
    assert stats.mean_acceptance_length == pytest.approx(1 + 3 / 2)
    stats.record_round([2], [2])  # not told what was asked: as proposed
    assert stats.num_asked_draft_tokens == 10 and stats.num_draft_tokens_per_pos == [3, 2, 1]


def test_the_engine_reports_the_drafts_it_asked_for(tmp_path):
    """A lookup drafter often finds no continuation: it was asked for drafts it did not propose."""
    target = make_model(tmp_path / "target", "llama", layers=1, seed=0)
    llm = LLM(str(target), speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False,
                                               "prompt_lookup_min": 3, "prompt_lookup_max": 3})
    llm.generate({"prompt_token_ids": [4, 5, 6, 7]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    m = llm.get_metrics()
    assert m["num_asked_draft_tokens"] > m["num_draft_tokens"] == sum(m["num_draft_tokens_per_pos"])
