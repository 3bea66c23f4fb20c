"""A hostile client against a real uvicorn server on 127.0.0.1 (tiny random models): values that
break float32 sampling, requests that fail a step, oversized and slow requests, idle and slowloris
connections, floods past the queue and the KV budget, probes for paths and internals.

Each case runs while a well-behaved client streams the same greedy request over and over (the
bystander). Every bystander stream must equal its solo output (up to a near-tie of the target),
no chunk may wait more than a second, the abuse must get 4xx (or the one request at fault a
5xx), and the server must answer /health afterwards with its caches and queues empty.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch

from lossless import assert_greedy_equal
from specdec import LLM, SamplingParams
from specdec.sampling import SamplingBatch, probs_from_logits
from specdec.server import ServerThread, build_app
from specdec.server.async_engine import AsyncEngine, Prompt, RequestError
from specdec.server.limits import ServerLimits
from test_server_outputs import byte_models  # noqa: F401 (a fixture: tiny models with a byte-level tokenizer)
from tiny_models import make_model, perturbed_copy

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread, the machine is shared

KEY = "sk-hard"
NAME = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
BYSTANDER_PROMPT = "w3 w9 w27 w81 w4"
BYSTANDER_TOKENS = 48
MAX_GAP_S = 1.5  # the longest any abuse may hold a well-behaved stream: a second, plus slack for a shared machine
TIMEOUT_S = 0.5  # header, body and keep-alive timeouts of the test servers


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    target = make_model(root / "target", "llama", max_pos=512)
    return str(target), str(perturbed_copy(target, root / "draft", 0.01))


def make_server(models, **limits) -> ServerThread:
    target, draft = models
    llm = LLM(target, max_num_seqs=8, speculative_config={"method": "draft_model", "model": draft,
                                                          "num_speculative_tokens": 3, "adaptive": False})
    limits = ServerLimits(**{"max_body_bytes": 256 * 1024, "max_prompts_per_request": 8, "header_timeout": TIMEOUT_S,
                             "body_timeout": TIMEOUT_S, "timeout_keep_alive": TIMEOUT_S, **limits})
    server = ServerThread(build_app(llm, served_model_name=NAME, api_key=KEY, limits=limits)).start()
    server.llm = llm
    server.loop = server.config.app.state.server.engine
    return server


@pytest.fixture(scope="module")
def server(models):
    s = make_server(models, kv_cache_memory=64 * 2**20)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf_target(models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(models[0]).eval()


def body(prompt=BYSTANDER_PROMPT, max_tokens=BYSTANDER_TOKENS, **extra) -> dict:
    return {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def stream_once(url: str, started: threading.Event | None = None) -> tuple[list[int], float]:
    """One bystander stream: its token ids and the longest wait for a chunk (first one included);
    ``started`` is set when the first chunk arrives."""
    ids, gap, last = [], 0.0, time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", headers=AUTH, json=body(stream=True), timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            now = time.perf_counter()
            gap, last = max(gap, now - last), now
            if line.startswith("data: {"):
                if started is not None:
                    started.set()
                obj = json.loads(line[6:])
                assert "error" not in obj, obj
                ids += obj["choices"][0].get("token_ids") or []
    return ids, gap


class Bystander:
    """Streams the bystander request back to back in a thread while a case runs."""

    def __init__(self, server: ServerThread, hf_target):
        self.server, self.hf_target = server, hf_target
        self.prompt = server.llm.tokenizer.encode(BYSTANDER_PROMPT)
        self.solo = server.solo if hasattr(server, "solo") else None
        self.results: list[tuple[list[int], float]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def __enter__(self) -> Bystander:
        if self.solo is None:
            self.server.solo = self.solo = stream_once(self.server.url)[0]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        while not self.results and self.error is None:  # the case starts once a stream has run
            time.sleep(0.01)
        return self

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                self.results.append(stream_once(self.server.url))
        except BaseException as e:
            self.error = e

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)
        if exc[0] is not None:
            return
        assert self.error is None, f"the bystander failed: {self.error!r}"
        for ids, gap in self.results:
            assert_greedy_equal(self.hf_target, self.prompt, self.solo, ids)
            assert gap < MAX_GAP_S, f"the bystander waited {gap:.2f} s for a chunk"
        assert httpx.get(self.server.url + "/health").status_code == 200


def post(server, payload, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", headers={**AUTH, **(headers or {})}, json=payload, timeout=10)


def metric(server, key: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key + " "))


def error_count(server, status: str) -> float:
    return metric(server, f'specdec:request_errors_total{{status="{status}"}}')


# -- values that break float32 sampling -------------------------------------------------------------


UNSAFE_VALUES = [
    {"temperature": 1e-40}, {"temperature": 5e-324}, {"temperature": 1e-300, "top_p": 1e-300},
    {"temperature": 0.8, "top_p": 1e-300, "seed": 1}, {"temperature": 0.8, "min_p": 1e-300, "seed": 2},
    {"temperature": 0.8, "top_k": 2**63}, {"temperature": 0.8, "top_k": 10**30}, {"temperature": 1e39},
    {"temperature": 0.8, "top_k": 2**31 - 1, "seed": 3}, {"stop_token_ids": [2**70]}, {"stop": ["x"] * 1000},
    {"stop_token_ids": list(range(5000))},
]


def test_values_float32_cannot_hold_are_made_safe_or_refused(server, hf_target):
    with Bystander(server, hf_target):
        for extra in UNSAFE_VALUES:
            r = post(server, body(max_tokens=8, **extra))
            assert r.status_code in (200, 400), (extra, r.text)
            if r.status_code == 400:
                assert len(r.text) < 1200
            else:
                assert len(r.json()["choices"][0]["token_ids"]) == 8


@pytest.mark.parametrize("kwargs", [
    {"temperature": 1e-40}, {"temperature": 5e-324}, {"temperature": 9e-6, "top_p": 1e-300},
    {"temperature": 0.5, "top_p": 1e-300}, {"temperature": 0.5, "top_p": 1e-39}, {"min_p": 1e-300},
    {"top_k": 2**31 - 1}, {"temperature": 1e30},
])
def test_sampling_params_are_made_safe_for_float32_without_changing_their_meaning(kwargs):
    p = SamplingParams(**kwargs)
    assert p.greedy == (kwargs.get("temperature", 1.0) < 1e-5)  # vLLM's epsilon
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))  # [B=3 rows, V]
    probs = probs_from_logits(logits, SamplingBatch.from_params([p] * 3))
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3))
    if not p.greedy and kwargs.get("top_p", 1.0) < 1e-30:  # keeps the top token only, as top_p -> 0 means
        assert ((probs > 0).sum(-1) == 1).all() and (probs.argmax(-1) == logits.argmax(-1)).all()


@pytest.mark.parametrize("kwargs", [
    {"temperature": float("inf")}, {"temperature": 1e39}, {"top_k": 2**63}, {"top_k": 10**30}, {"stop": ["x"] * 65},
    {"stop": "x" * 257}, {"stop_token_ids": list(range(1025))}, {"stop_token_ids": [2**63]}, {"top_p": float("nan")},
])
def test_sampling_params_refuse_values_no_sampler_can_hold(kwargs):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert len(str(e.value)) < 300  # never the whole input echoed back


def test_a_request_that_fails_the_step_fails_alone(server, hf_target):
    """Requests whose rows break a step, handed to the engine loop past the HTTP checks: one caught
    by the per-row check, one only by re-running the step over halves of the batch."""

    class Poison(int):  # passes every check, breaks the engine's stop-token test
        def __eq__(self, other):
            raise RuntimeError("poison")

        __hash__ = int.__hash__

    bad_k = SamplingParams(temperature=0.7, max_tokens=40, ignore_eos=True)
    bad_k.top_k = 2**63  # changed after validation: int64 cannot hold it
    hidden = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[Poison(5)])
    good = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = server.llm.tokenizer.encode("w1 w2 w3")

    async def run(params: SamplingParams):
        handle = server.loop.submit([(ids, params)])
        out = []
        async for ev in handle.events():
            out += ev.token_ids
        return out

    async def main():
        return await asyncio.gather(run(bad_k), run(hidden), run(good), run(good), return_exceptions=True)

    solo = asyncio.run(run(good))
    failures = metric(server, "specdec:engine_step_failures_total")
    with Bystander(server, hf_target):
        failed_k, failed_hidden, ok1, ok2 = asyncio.run(main())
    assert isinstance(failed_k, RequestError) and failed_k.status == 400
    assert isinstance(failed_hidden, RequestError) and failed_hidden.status == 500
    assert "poison" not in failed_hidden.message
    assert_greedy_equal(hf_target, ids, solo, ok1)
    assert_greedy_equal(hf_target, ids, solo, ok2)
    assert metric(server, "specdec:engine_step_failures_total") >= failures + 2


# -- size and work --------------------------------------------------------------------------------------


def test_oversized_prompts_and_bodies_are_refused_in_milliseconds(server, hf_target):
    with Bystander(server, hf_target):
        t0 = time.perf_counter()
        r = post(server, body(prompt="w1 " * 80_000))  # 240 kB: under the body limit, over what the context holds
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert time.perf_counter() - t0 < 0.5
        r = post(server, body(prompt="w1 " * 200_000))  # 600 kB: over the body limit
        assert r.status_code == 413
        r = post(server, body(prompt=[[5, 6]] * 10_000))
        assert r.status_code in (400, 413)
        r = post(server, body(prompt=[[5, 6]] * 9))
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_prompts"
        r = post(server, body(prompt=list(range(3, 120)) * 5))  # 585 token ids: longer than the context
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = post(server, body(prompt=[5, 10**6]))
        assert r.status_code == 400
        r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=10, json={
            "model": NAME, "messages": [{"role": "user", "content": "w1 " * 80_000}]})
        assert r.status_code == 400


# -- connections that stall --------------------------------------------------------------------------------


def raw(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    return s


def closed(s: socket.socket, within: float) -> bool:
    """Whether the server closes ``s`` within ``within`` seconds (reading what it sends until then)."""
    s.settimeout(within)
    try:
        while s.recv(65536):
            pass
        return True
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True


def test_idle_slow_and_lying_connections_are_closed(server, hf_target):
    with Bystander(server, hf_target):
        idle = [raw(server) for _ in range(20)]
        slow = [raw(server) for _ in range(5)]
        for s in slow:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3 * TIMEOUT_S:  # a header line now and then: never done
            for s in slow:
                try:
                    s.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    pass
            time.sleep(TIMEOUT_S / 5)
        assert all(closed(s, 2 * TIMEOUT_S) for s in idle + slow)

        liar = raw(server)  # promises a large body, sends 11 bytes
        liar.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":")
        liar.settimeout(3 * TIMEOUT_S + 1)
        assert liar.recv(100).startswith(b"HTTP/1.1 408")
        huge = raw(server)
        huge.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000000\r\n\r\n{}")
        assert huge.recv(100).startswith(b"HTTP/1.1 413")
        for s in idle + slow + [liar, huge]:
            s.close()


def test_a_client_that_hangs_up_while_sending_is_not_an_error(server, hf_target):
    before = error_count(server, "500") + error_count(server, "400")
    with Bystander(server, hf_target):
        for _ in range(5):
            s = raw(server)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
                      + b"\r\nContent-Length: 500\r\n\r\n{\"prompt\": \"w1")
            time.sleep(0.05)
            s.close()
        time.sleep(0.2)
    assert error_count(server, "500") + error_count(server, "400") == before


# -- exposure -----------------------------------------------------------------------------------------------


def test_nothing_internal_is_exposed(server, models, hf_target):
    with Bystander(server, hf_target):
        r = post(server, body(model="m" * 200_000))
        assert r.status_code == 404 and len(r.text) < 500
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(server.url + path).status_code == 404
        assert httpx.get(server.url + "/metrics").status_code == 401
        models_text = httpx.get(server.url + "/v1/models", headers=AUTH).text
        assert models[0] not in models_text and "root" not in models_text
        r = httpx.get(server.url + "/health", headers={"Host": "rebound.example.com"})
        assert r.status_code == 400
        r = post(server, body(max_tokens=4), headers={"Origin": "http://evil.example.com"})
        assert r.status_code == 403
        same_origin = {"Origin": f"http://localhost:{server.port}"}
        assert post(server, body(max_tokens=4), headers=same_origin).status_code == 200
        r = httpx.post(server.url + "/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                       content=b'{"prompt": "w1", "max_tokens": "' + b"9" * 5000 + b'"}')
        assert r.status_code == 400 and len(r.text) < 1200


# -- floods: the queue bound and the KV budget ------------------------------------------------------------------


def test_a_flood_gets_429_past_the_queue_and_never_over_commits_the_kv_budget(models, hf_target):
    # 1 KiB of KV a position (target + draft); each request here reaches 256 positions: 3 rows fit
    budget = 3 * 256 * 1024
    tight = make_server(models, kv_cache_memory=budget, max_queued_requests=3)
    try:
        tight.solo = stream_once(tight.url)[0]
        runners = [tight.llm.engine.target, tight.llm.engine.drafter.runner]
        peak = [0]
        done = threading.Event()

        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], sum(0 if r.cache is None else 2 * r.cache.k.numel() * r.cache.k.element_size()
                                           for r in runners))
                time.sleep(0.002)

        async def flood():
            async with httpx.AsyncClient(base_url=tight.url, headers=AUTH, timeout=60) as c:
                started = threading.Event()
                bystander = asyncio.ensure_future(asyncio.to_thread(stream_once, tight.url, started))
                await asyncio.to_thread(started.wait, 30)
                replies = await asyncio.gather(*(c.post("/v1/completions", json=body(max_tokens=60, seed=i))
                                                 for i in range(12)))
                return await bystander, replies

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        (ids, gap), replies = asyncio.run(flood())
        too_big = post(tight, body(prompt=["w1", "w2", "w3", "w4"], max_tokens=200))
        done.set()
        watcher.join()
        assert_greedy_equal(hf_target, tight.llm.tokenizer.encode(BYSTANDER_PROMPT), tight.solo, ids)
        assert gap < MAX_GAP_S
        codes = sorted(r.status_code for r in replies)
        assert set(codes) == {200, 429} and codes.count(429) >= 4, codes
        assert all(r.headers["retry-after"] for r in replies if r.status_code == 429)
        assert too_big.status_code == 400
        assert 0 < peak[0] <= budget
        assert_idle(tight)
    finally:
        tight.stop()


def test_stop_lists_are_bounded_by_the_servers_limits(models):
    s = make_server(models, kv_cache_memory=16 * 2**20, max_stop_strings=2, max_stop_token_ids=3)
    try:
        assert post(s, body(max_tokens=2, stop=["a", "b"], stop_token_ids=[5, 6, 7])).status_code == 200
        for extra, param in (({"stop": ["a", "b", "c"]}, "stop"), ({"stop_token_ids": [5, 6, 7, 8]}, "stop_token_ids")):
            r = post(s, body(max_tokens=2, **extra))
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        s.stop()
    with pytest.raises(ValueError, match="max_stop_strings must be at most 64"):
        ServerLimits(max_stop_strings=65)


def test_admission_takes_at_most_max_num_batched_tokens_of_prompts_a_round(models):
    """The server's max_num_batched_tokens bounds the scheduler's rounds: queued prompts enter the batch
    in order while their tokens fit the round (a prompt alone always does), so one burst of long prompts
    cannot make a single round's prefill stall the streams already decoding."""
    llm = LLM(models[0], max_num_seqs=8)
    AsyncEngine(llm.engine, limits=ServerLimits(max_num_batched_tokens=100, kv_cache_memory=64 * 2**20))
    sp = SamplingParams(temperature=0, max_tokens=4)
    sizes = [60, 30, 20, 90, 150]
    for n in sizes:
        llm.engine.add_group([Prompt([3 + i % 100 for i in range(n)], sp)])
    rounds = []
    while llm.engine.waiting:
        rounds.append([s.num_prompt_tokens for s in llm.engine.scheduler.admit().seqs])
    assert rounds == [[60, 30], [20], [90], [150]]


def assert_idle(server) -> None:
    """Memory back to baseline: no sequence, queue entry or KV cache left once the server is idle."""
    deadline = time.monotonic() + 5
    runners = [server.llm.engine.target, server.llm.engine.drafter.runner]
    while any(r.cache is not None for r in runners) or server.loop.num_queued or server.loop.budget.reserved:
        assert time.monotonic() < deadline, "the server kept memory after going idle"
        time.sleep(0.02)
    assert not server.llm.engine.has_unfinished()
    assert httpx.get(server.url + "/health").status_code == 200


# -- grammars -------------------------------------------------------------------------------------------------


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": {"type": "array", "items": schema}}, "required": ["a"]}
    return schema


GRAMMARS = [  # (body fields, the statuses it may get)
    ({"guided_regex": "(a"}, (400,)),  # does not parse
    ({"structured_outputs": {"json": {"type": "objekt"}}}, (400,)),
    ({"guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}, (400,)),  # refers to itself
    ({"guided_json": nested_schema(60)}, (400,)),  # deeper than the grammar engine recurses
    ({"guided_regex": "x" * 100_001}, (400,)),  # longer than MAX_GRAMMAR_CHARS
    ({"guided_json": {"enum": [f"value number {i}" for i in range(4500)]}}, (200,)),  # 100 kB
    # seconds in the grammar engine's lexer, then its limits: it ends the output (200) or gives up at the start (400)
    ({"guided_regex": "(a{1000}){1000}"}, (200, 400)),
    ({"guided_choice": [f"choice {i}" for i in range(256)], "n": 8}, (200,)),
]


def test_bad_huge_and_pathological_grammars_stall_no_one(byte_models):
    """Grammars compile off the engine thread (and off the tokenizing pool): a bystander's chunks keep
    coming while the server refuses or serves them."""
    from transformers import AutoModelForCausalLM

    s = make_server(byte_models, kv_cache_memory=64 * 2**20)
    try:
        hf = AutoModelForCausalLM.from_pretrained(byte_models[0]).eval()
        with Bystander(s, hf):
            for extra, statuses in GRAMMARS:
                t0 = time.perf_counter()
                r = post(s, body(prompt="x", max_tokens=8, temperature=1.0, seed=1, **extra))
                assert r.status_code in statuses and len(r.text) < 1200, (next(iter(extra)), r.text[:300])
                assert time.perf_counter() - t0 < 20
                if statuses == (400,):  # refused before it ran: the field is named
                    assert r.json()["error"]["param"] == next(iter(extra))
        assert_idle(s)
    finally:
        s.stop()


def test_the_server_is_idle_and_healthy_after_the_abuse(server):
    assert_idle(server)
    r = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).completions.create(
        model=NAME, prompt=BYSTANDER_PROMPT, max_tokens=BYSTANDER_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == server.solo
