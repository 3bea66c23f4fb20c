"""The scheduler: the one owner of admission (seats, prompt tokens a round, KV memory, merged prefills)
for ``LLM.generate`` and the server alike."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.server.async_engine import AsyncEngine, Prompt
from specdec.server.limits import ServerLimits
from tiny_models import make_model, perturbed_copy

K = 3


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
    assert loop.budget.bytes_per_token == target_bytes + draft_bytes
    with pytest.raises(ValueError, match="KV cache"):
        loop.check([Prompt(list(range(3, 13)), sp)])
