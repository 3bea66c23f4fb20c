"""The OpenAI-compatible server over HTTP: a real uvicorn on 127.0.0.1 (ephemeral port), the official
openai client, tiny random models. Outputs must equal the library's; errors must leave it serving."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lossless import assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.server import ServerThread, build_app
from specdec.server.chat import default_chat_prompt
from tiny_models import make_model, perturbed_copy

KEY = "sk-test"
NAME = "tiny"
K = 3
PROMPTS = ["w1 w2 w3", "w7 w8", "w20 w21 w22 w23 w24", "w5", "w90 w91 w92", "w30 w40 w50 w60"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    target = make_model(root / "target", "llama", max_pos=128)
    draft = perturbed_copy(target, root / "draft", 0.01)
    return str(target), str(draft)


def spec_config(draft: str) -> dict:
    # k fixed: these tests need every request to speculate; whether it pays is the controller's
    # business (test_adaptive.py), and on tiny random models it often decides it does not.
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": K, "adaptive": False}


@contextmanager
def serving(target: str, draft: str, max_num_seqs: int):
    """A server of ``target`` speculating with ``draft`` (``spec_config``), behind the API key; ``.llm`` is its LLM."""
    llm = LLM(target, speculative_config=spec_config(draft), max_num_seqs=max_num_seqs)
    with ServerThread(build_app(llm, served_model_name=NAME, api_key=KEY)) as server:
        server.llm = llm
        yield server


@pytest.fixture(scope="module")
def spec_server(models):
    with serving(*models, max_num_seqs=4) as server:
        yield server


@pytest.fixture(scope="module")
def plain_server(models):
    llm = LLM(models[0])
    with ServerThread(build_app(llm, served_model_name=NAME)) as server:
        server.llm = llm
        yield server


@pytest.fixture(scope="module")
def client(spec_server):
    return openai.OpenAI(base_url=spec_server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def hf_target(models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(models[0]).eval()


def greedy(client, prompt, max_tokens=16, **extra):
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True, **extra})
    return r.choices[0]


def scrape(url: str) -> dict:
    out = {}
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# -- basics -------------------------------------------------------------------------------------------


def test_models_health_and_completion(spec_server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(spec_server.url + "/health").status_code == 200
    r = client.completions.create(model=NAME, prompt="w1 w2 w3", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.choices[0].text.split()[0].startswith("w")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 5, 8)


def test_a_list_of_prompts_gives_one_choice_each(spec_server, client, hf_target):
    r = client.completions.create(model=NAME, prompt=PROMPTS[:3], max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for p, c in zip(PROMPTS, r.choices):  # batched, so equal up to near-ties
        want = greedy(client, p, 6).model_extra["token_ids"]
        assert_greedy_equal(hf_target, spec_server.llm.tokenizer.encode(p), want, c.model_extra["token_ids"])
    assert r.usage.completion_tokens == 18
    two = client.completions.create(model=NAME, prompt=PROMPTS[:2], max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[:2], max_tokens=6, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    for i in range(2):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == two.choices[i].text


def test_seeded_sampling_is_reproducible_and_equals_llm_generate(models, client):
    target, draft = models
    kw = dict(temperature=0.9, top_p=0.95, seed=11, max_tokens=12)
    a = client.completions.create(model=NAME, prompt=PROMPTS[0], **kw,
                                  extra_body={"top_k": 40, "ignore_eos": True, "return_token_ids": True})
    b = client.completions.create(model=NAME, prompt=PROMPTS[0], **kw,
                                  extra_body={"top_k": 40, "ignore_eos": True, "return_token_ids": True})
    assert a.choices[0].text == b.choices[0].text
    ref = LLM(target, speculative_config=spec_config(draft)).generate(
        PROMPTS[0], SamplingParams(top_k=40, ignore_eos=True, **kw))[0].outputs[0]
    assert a.choices[0].text == ref.text
    assert a.choices[0].model_extra["token_ids"] == ref.token_ids


def test_greedy_with_speculation_equals_greedy_without(spec_server, plain_server, client, hf_target):
    plain = openai.OpenAI(base_url=plain_server.url + "/v1", api_key="unused", max_retries=0)
    tok = spec_server.llm.tokenizer
    for prompt in PROMPTS[:4]:
        want = greedy(plain, prompt, 24)
        got = greedy(client, prompt, 24)
        assert_greedy_equal(hf_target, tok.encode(prompt), want.model_extra["token_ids"], got.model_extra["token_ids"])
    assert spec_server.llm.get_metrics()["num_drafts"] > 0


def test_chat_uses_the_default_template(client):
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 w4 w5"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    same = client.completions.create(model=NAME, prompt=default_chat_prompt(messages), max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == same.choices[0].text
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens == same.usage.prompt_tokens


# -- streaming ----------------------------------------------------------------------------------------


def test_streaming_completion_equals_non_streaming(spec_server, client):
    full = greedy(client, PROMPTS[2], 20)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].choices == []
    # the wire format ends with data: [DONE]
    with httpx.stream("POST", spec_server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": PROMPTS[2], "max_tokens": 4, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_streaming_chat_and_stop_strings(client):
    full = greedy(client, PROMPTS[1], 16).text
    stop = full.split()[5]
    cut = full[: full.index(stop)]
    chunks = list(client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "w1"}], max_tokens=6, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason is not None
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True,
                                            stop=[stop], extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_concurrent_streams_equal_sequential_ones(spec_server, client, hf_target):
    """More streams than max_num_seqs (4): the rest wait in the engine's queue; all equal sequential runs."""
    tok = spec_server.llm.tokenizer
    prompts = PROMPTS + PROMPTS[:2]
    sequential = [greedy(client, p, 20).model_extra["token_ids"] for p in prompts]

    async def one(ac, prompt):
        ids = []
        stream = await ac.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
        async for c in stream:
            ids += c.choices[0].model_extra["token_ids"]
        return ids

    async def main():
        async with openai.AsyncOpenAI(base_url=spec_server.url + "/v1", api_key=KEY, max_retries=0) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    for p, want, got in zip(prompts, sequential, asyncio.run(main())):
        assert_greedy_equal(hf_target, tok.encode(p), want, got)


def test_a_client_that_disconnects_is_aborted_and_disturbs_no_one(spec_server, client, hf_target):
    tok = spec_server.llm.tokenizer
    want = [greedy(client, p, 30).model_extra["token_ids"] for p in PROMPTS[:3]]
    before = scrape(spec_server.url)
    abort_key = ("specdec:request_success_total", (("finished_reason", "abort"),))

    async def full(ac, prompt):
        ids = []
        stream = await ac.completions.create(model=NAME, prompt=prompt, max_tokens=30, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
        async for c in stream:
            ids += c.choices[0].model_extra["token_ids"]
        return ids

    async def leaver(ac):
        stream = await ac.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=100, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            break
        await stream.close()

    async def main():
        async with openai.AsyncOpenAI(base_url=spec_server.url + "/v1", api_key=KEY, max_retries=0) as ac:
            return await asyncio.gather(leaver(ac), *(full(ac, p) for p in PROMPTS[:3]))

    results = asyncio.run(main())[1:]
    for p, w, got in zip(PROMPTS, want, results):
        assert_greedy_equal(hf_target, tok.encode(p), w, got)
    deadline = time.monotonic() + 5
    while scrape(spec_server.url).get(abort_key, 0) < before.get(abort_key, 0) + 1:
        assert time.monotonic() < deadline, "the disconnected request was not aborted"
        time.sleep(0.05)
    assert not spec_server.llm.engine.running
    assert greedy(client, PROMPTS[0], 30).model_extra["token_ids"] == want[0]


def test_a_non_streaming_client_that_disconnects_is_aborted(spec_server, client):
    engine = spec_server.llm.engine
    real = engine.step

    def slow():
        time.sleep(0.02)
        return real()

    abort_key = ("specdec:request_success_total", (("finished_reason", "abort"),))
    before = scrape(spec_server.url).get(abort_key, 0)
    engine.step = slow
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(spec_server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=0.3,
                       json={"prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True})
        deadline = time.monotonic() + 5
        while scrape(spec_server.url).get(abort_key, 0) < before + 1:
            assert time.monotonic() < deadline, "the disconnected request was not aborted"
            time.sleep(0.05)
    finally:
        engine.step = real
    assert greedy(client, PROMPTS[0], 4).finish_reason == "length"


def test_kv_caches_are_released_when_the_server_goes_idle(spec_server, client):
    greedy(client, PROMPTS[0], 8)
    runners = [spec_server.llm.engine.target, spec_server.llm.engine.drafter.runner]
    deadline = time.monotonic() + 5
    while any(r.cache is not None for r in runners):
        assert time.monotonic() < deadline, "the KV caches were kept after the last request finished"
        time.sleep(0.02)
    assert greedy(client, PROMPTS[0], 8).finish_reason == "length"


def test_an_engine_failure_fails_the_request_alone_without_its_text_and_the_server_keeps_serving(spec_server,
                                                                                                  client):
    engine = spec_server.llm.engine
    real = engine.step

    def boom():
        engine.step = real  # fail one round only
        raise RuntimeError("boom")

    engine.step = boom
    with pytest.raises(openai.InternalServerError, match="request id") as e:
        greedy(client, PROMPTS[0], 8)
    assert "boom" not in str(e.value)  # exception text goes to the log, not to the client
    engine.step = boom
    with httpx.stream("POST", spec_server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": PROMPTS[0], "max_tokens": 8, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    message = json.loads(lines[-2][6:])["error"]["message"]
    assert "request id" in message and "boom" not in message and lines[-1] == "data: [DONE]"
    assert greedy(client, PROMPTS[0], 8).finish_reason == "length"
    assert httpx.get(spec_server.url + "/health").status_code == 200


def test_a_failing_drafter_falls_back_to_plain_decoding(models, plain_server):
    target, draft = models
    llm = LLM(target, speculative_config=spec_config(draft))

    def broken(*args, **kwargs):
        raise RuntimeError("drafter bug")

    llm.engine.drafter.propose = broken
    llm.engine.strict_drafter = False  # as for users: the failure degrades, it does not raise
    plain = openai.OpenAI(base_url=plain_server.url + "/v1", api_key="unused", max_retries=0)
    with ServerThread(build_app(llm, served_model_name=NAME)) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        got = greedy(c, PROMPTS[1], 12)
    assert got.finish_reason == "length"
    assert got.model_extra["token_ids"] == greedy(plain, PROMPTS[1], 12).model_extra["token_ids"]


# -- metrics ------------------------------------------------------------------------------------------


def test_metrics_move_as_requests_complete(spec_server, client):
    before = scrape(spec_server.url)
    greedy(client, PROMPTS[3], 16)
    after = scrape(spec_server.url)

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert moved("specdec:spec_decode_num_drafts_total") > 0
    drafts = moved("specdec:spec_decode_num_drafts_total")
    assert drafts <= moved("specdec:spec_decode_num_draft_tokens_total") <= K * drafts
    accepted = moved("specdec:spec_decode_num_accepted_tokens_total")
    per_pos = sum(moved("specdec:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))
                  for i in range(K))
    assert accepted == per_pos
    assert moved("specdec:time_to_first_token_seconds_count") == 1
    assert moved("specdec:time_per_output_token_seconds_count") == 1
    assert moved("specdec:request_success_total", (("finished_reason", "length"),)) == 1
    assert moved("specdec:generation_tokens_total") == 16
    m = spec_server.llm.get_metrics()
    assert after[("specdec:spec_decode_num_drafts_total", ())] == m["num_drafts"]


# -- errors -------------------------------------------------------------------------------------------

GOOD = {"model": NAME, "prompt": "w1 w2", "max_tokens": 2}
TOO_LONG = {"model": NAME, "prompt": [5] * 128, "max_tokens": 2}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b'{"prompt": "w1", ', 400, None),  # malformed JSON
    ("/v1/completions", b"[1, 2]", 400, None),  # not an object
    ("/v1/completions", {"model": NAME, "max_tokens": 2}, 400, "prompt"),  # missing field
    ("/v1/completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),  # mistyped field
    ("/v1/completions", {**GOOD, "prompt": 3}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [5, "w1"]}, 400, "prompt"),  # forms mixed
    ("/v1/completions", {**GOOD, "prompt": [[5], "w1"]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [[5, 1.5]]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [True]}, 400, "prompt"),  # a bool is not a token id
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "top_k": -3}, 400, "top_k"),
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n"),
    ("/v1/completions", {**GOOD, "n": 17}, 400, "n"),  # past the server's max_n (16)
    ("/v1/completions", {**GOOD, "n": 5}, 400, None),  # 5 sequences: more than max_num_seqs (4) at once
    ("/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {**GOOD, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/completions", {**GOOD, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {**GOOD, "frequency_penalty": float("nan")}, 400, "frequency_penalty"),
    ("/v1/completions", {**GOOD, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {**GOOD, "logit_bias": {"w5": 1}}, 400, "logit_bias"),
    ("/v1/completions", {**GOOD, "logit_bias": {"100000": 1}}, 400, "logit_bias"),  # outside the vocabulary
    ("/v1/completions", {**GOOD, "logit_bias": {str(i): 1 for i in range(1025)}}, 400, "logit_bias"),
    ("/v1/completions", {**GOOD, "allowed_token_ids": [5, 100000]}, 400, "allowed_token_ids"),
    ("/v1/completions", {**GOOD, "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {**GOOD, "bad_words": [""]}, 400, "bad_words"),
    ("/v1/completions", {**GOOD, "min_tokens": 3}, 400, "min_tokens"),  # more than max_tokens
    ("/v1/completions", {**GOOD, "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", {**GOOD, "best_of": 3, "stream": True}, 400, "best_of"),
    ("/v1/completions", {**GOOD, "suffix": "w9"}, 400, "suffix"),
    ("/v1/completions", {**GOOD, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/completions", {**GOOD, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/completions", {**GOOD, "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, 400,
     "response_format"),
    ("/v1/completions", {**GOOD, "structured_outputs": {"regex": "a+", "choice": ["a"]}}, 400, "structured_outputs"),
    ("/v1/completions", {**GOOD, "structured_outputs": {"structural_tag": "x"}}, 400, "structured_outputs"),
    ("/v1/completions", {**GOOD, "structured_outputs": {}}, 400, "structured_outputs"),
    ("/v1/completions", {**GOOD, "guided_json": "{not json"}, 400, "guided_json"),
    ("/v1/completions", {**GOOD, "guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {**GOOD, "guided_regex": "a", "response_format": {"type": "json_object"}}, 400, "guided_regex"),
    ("/v1/completions", {**GOOD, "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {**GOOD, "stop": [""]}, 400, "stop"),
    ("/v1/completions", TOO_LONG, 400, "prompt"),
    ("/v1/completions", {**TOO_LONG, "stream": True}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [5, 10_000]}, 400, "prompt"),  # outside the vocabulary
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"model": NAME}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"content": "w1"}]}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs: true
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/nowhere", GOOD, 404, None),
])
def test_errors_are_openai_shaped_and_the_server_keeps_serving(spec_server, client, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(spec_server.url + path, content=content,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert greedy(client, "w1 w2", 2).finish_reason == "length"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_key_is_required(spec_server, client, headers):
    r = httpx.post(spec_server.url + "/v1/completions", json=GOOD, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(spec_server.url + "/v1/models", headers=headers).status_code == 401
    assert httpx.get(spec_server.url + "/health").status_code == 200  # health and metrics stay open
    assert greedy(client, "w1 w2", 2).finish_reason == "length"


def test_openai_client_sees_typed_errors(spec_server, client):
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=NAME, prompt=[5] * 200, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="w1", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=spec_server.url + "/v1", api_key="bad", max_retries=0).models.list()
    assert greedy(client, "w1 w2", 2).finish_reason == "length"


def test_serve_command_refuses_bad_input_with_exit_2(models):
    from typer.testing import CliRunner

    from specdec.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["serve", "--model", models[0], "--max-num-seqs", "0"])
    assert r.exit_code == 2 and "max_num_seqs must be an integer >= 1" in r.output
    r = runner.invoke(app, ["serve", "--model", models[0], "--num-scheduler-steps", "0"])
    assert r.exit_code == 2 and "num_scheduler_steps must be an integer >= 1, got 0" in r.output
    r = runner.invoke(app, ["serve", "--model", models[0], "--speculative-config", "{"])
    assert r.exit_code == 2 and "not valid JSON" in r.output
