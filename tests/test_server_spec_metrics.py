"""The server's opt-in per-request speculative counters: ``"return_spec_metrics": true`` in the body
(``extra_body`` with the openai client) adds ``usage["spec_decoding"]`` to completions and chat
completions, streamed too (with ``stream_options.include_usage``); the counters equal the library's
``RequestOutput.metrics["spec_decoding"]`` for the same request, and /metrics counts rounds per method.
A real uvicorn on 127.0.0.1, the official openai client, tiny random models."""

from __future__ import annotations

import httpx
import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.metrics import NO_DRAFT
from specdec.server import ServerThread, build_app
from specdec.server.chat import render_chat
from specdec.server.protocol import ChatMessage
from test_server import KEY, NAME, models, scrape, serving, spec_config  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread, the machine is shared

PROMPT = "w1 w2 w3 w1 w2 w3 w1 w2"
COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_draft_tokens_per_pos",
          "num_accepted_tokens_per_pos", "num_emitted_tokens", "num_verify_passes", "num_rounds_per_method",
          "num_draft_tokens_per_method", "num_accepted_tokens_per_method", "mean_acceptance_length")
ON = {"return_spec_metrics": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(models):
    with serving(*models, max_num_seqs=4) as s:
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0)
        yield s


@pytest.fixture(scope="module")
def library(models):
    target, draft = models
    return LLM(target, speculative_config=spec_config(draft))


def library_metrics(library: LLM, prompt_ids: list[int], **kw) -> dict:
    out = library.generate({"prompt_token_ids": prompt_ids}, SamplingParams(ignore_eos=True, **kw))[0]
    return out.metrics["spec_decoding"]


def spec(usage) -> dict | None:
    return (usage.model_extra or {}).get("spec_decoding")


def test_usage_carries_the_counters_only_when_asked(server):
    c = server.client
    off = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert spec(off.usage) is None and "spec_decoding" not in off.usage.model_dump()
    on = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=ON)
    assert on.choices[0].text == off.choices[0].text
    assert on.usage.completion_tokens == 8
    m = spec(on.usage)
    assert m["num_drafts"] > 0 and m["num_emitted_tokens"] == 8  # ignore_eos: every emitted token is kept
    assert sum(m["num_rounds_per_method"].values()) == m["num_verify_passes"]
    assert set(m["num_rounds_per_method"]) <= {"draft_model", NO_DRAFT}
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    assert m["draft_time_s"] > 0 and m["verify_time_s"] > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_counters_equal_the_library_s(server, library, stream):
    """Greedy with k fixed, alone in the server: the same rounds as the library's, so the same counts;
    n = 2 sums the two choices, as usage sums their tokens."""
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0, n=2, extra_body=ON)
    if stream:
        chunks = list(server.client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        usage = chunks[-1].usage
        assert all(ch.usage is None for ch in chunks[:-1])
    else:
        usage = server.client.completions.create(**kw).usage
    want = library_metrics(library, library.tokenizer.encode(PROMPT), temperature=0, max_tokens=10, n=2)
    got = spec(usage)
    for name in COUNTS:
        assert got[name] == want[name], name
    assert got["num_emitted_tokens"] == usage.completion_tokens == 20


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_counters_equal_the_library_s(server, library, stream):
    messages = [{"role": "user", "content": "w5 w6 w7 w5 w6 w7"}]
    kw = dict(model=NAME, messages=messages, max_tokens=9, temperature=0, extra_body=ON)
    if stream:
        chunks = list(server.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        usage = chunks[-1].usage
    else:
        usage = server.client.chat.completions.create(**kw).usage
    ids = render_chat(library.tokenizer, [ChatMessage(**m) for m in messages])
    want = library_metrics(library, ids, temperature=0, max_tokens=9)
    for name in COUNTS:
        assert spec(usage)[name] == want[name], name


@pytest.mark.parametrize("value", ["yes", 1, None, {"on": True}], ids=["string", "int", "null", "object"])
def test_a_value_that_is_not_a_boolean_is_a_400_naming_the_field(server, value):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2,
                                         extra_body={"return_spec_metrics": value})
    assert e.value.status_code == 400
    assert e.value.body["param"] == "return_spec_metrics" and "bool" in e.value.body["message"]


def test_a_stream_without_usage_cannot_carry_them(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "w1"}], max_tokens=2,
                                              stream=True, extra_body={"return_spec_metrics": True})
    assert e.value.body["param"] == "return_spec_metrics" and "include_usage" in e.value.body["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_count_rounds_per_method(server):
    before = scrape(server.url)
    server.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    after = scrape(server.url)

    def get(snapshot, name, method):
        return snapshot.get((f"specdec:spec_decode_{name}_total", (("method", method),)), 0)

    drafted = get(after, "num_rounds_per_method", "draft_model") - get(before, "num_rounds_per_method", "draft_model")
    drafts = (after[("specdec:spec_decode_num_drafts_total", ())]
              - before.get(("specdec:spec_decode_num_drafts_total", ()), 0))
    assert drafted == drafts > 0
    assert get(after, "num_rounds_per_method", NO_DRAFT) > get(before, "num_rounds_per_method", NO_DRAFT)
    accepted = get(after, "num_accepted_tokens_per_method", "draft_model")
    assert accepted == after[("specdec:spec_decode_num_accepted_tokens_total", ())]


def test_the_engine_process_sends_them_over_its_pipe(models, library):
    target, draft = models
    with ServerThread(build_app(served_model_name=NAME, engine_process=True, model=target,
                                speculative_config=spec_config(draft))) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        usage = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                          extra_body=ON).usage
        rounds = scrape(s.url)[("specdec:spec_decode_num_rounds_per_method_total", (("method", "draft_model"),))]
    want = library_metrics(library, library.tokenizer.encode(PROMPT), temperature=0, max_tokens=8)
    for name in COUNTS:
        assert spec(usage)[name] == want[name], name
    assert rounds == want["num_rounds_per_method"]["draft_model"]
