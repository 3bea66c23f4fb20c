"""The server with its engine loop in a process of its own (what ``specdec serve`` runs): the same
outputs as the library, metrics from the other side of the pipe, grammars compiled there, aborts that
reach it, and a clean 503 when it dies. A real uvicorn on 127.0.0.1, the official openai client,
tiny models loaded in a spawned process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.config import StructuredOutputsParams
from specdec.server import ServerThread, build_app
from specdec.server.async_engine import Prompt
from test_server import KEY, NAME, scrape, spec_config
from test_server_outputs import byte_models  # noqa: F401 (a fixture: tiny models with a byte-level tokenizer)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread, the machine is shared

AUTH = {"Authorization": f"Bearer {KEY}"}
DRAFTS, GENERATED = ("specdec:spec_decode_num_drafts_total", ()), ("specdec:generation_tokens_total", ())
RUNNING = ("specdec:num_requests_running", ())
PROMPTS = ["w1 w2 w3", "w7 w8", "w20 w21 w22 w23 w24", "w5"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def models(byte_models):
    """Byte-level tokenizer, so a JSON schema can be spelled; a draft close to the target."""
    return byte_models


def llm_kwargs(models) -> dict:
    target, draft = models
    return {"model": target, "max_num_seqs": 8, "speculative_config": spec_config(draft)}


@pytest.fixture(scope="module")
def server(models):
    with ServerThread(build_app(served_model_name=NAME, api_key=KEY, engine_process=True,
                                **llm_kwargs(models))) as s:
        s.loop = s.config.app.state.server.engine
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0)
        yield s


@pytest.fixture(scope="module")
def library(models):
    return LLM(**llm_kwargs(models))


def test_the_engine_runs_in_another_process(server):
    assert server.loop._proc.pid != os.getpid() and server.loop.alive
    assert httpx.get(server.url + "/health").status_code == 200


def test_outputs_equal_the_library(server, library):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].text for o in library.generate(PROMPTS, params)]
    r = server.client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
    text = "".join(ch.choices[0].text for ch in server.client.completions.create(
        model=NAME, prompt=PROMPTS[2], max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert text == want[2]
    # sampled, seeded: the same draws as the library's
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=16, n=2)
    want = [o.text for o in library.generate(PROMPTS[0], seeded)[0].outputs]
    r = server.client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=1.0, top_p=0.9,
                                         seed=11, n=2)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want


def test_metrics_come_over_the_pipe(server):
    before = scrape(server.url)
    server.client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    after = scrape(server.url)
    length = ("specdec:request_success_total", (("finished_reason", "length"),))
    assert after[length] == before.get(length, 0) + 1
    assert after[DRAFTS] > before[DRAFTS]
    assert after[GENERATED] == before.get(GENERATED, 0) + 12
    assert after[RUNNING] == 0
    assert after[("specdec:kv_cache_budget_bytes", ())] > 0


def test_grammars_compile_in_the_engine_process_too(server, library):
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    want = library.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, structured_outputs=so))
    r = server.client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                         extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    assert r.choices[0].text == want[0].outputs[0].text
    assert json.loads(r.choices[0].text)["n"] in range(10)
    bad = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=10, json={
        "model": NAME, "prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "("}})
    assert bad.status_code == 400


def test_a_client_that_goes_away_aborts_its_sequence_in_the_engine_process(server):
    before = scrape(server.url)
    abort = ("specdec:request_success_total", (("finished_reason", "abort"),))
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, timeout=30, json={
            "model": NAME, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # hang up after the first chunk
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = scrape(server.url)
        if now.get(abort, 0) > before.get(abort, 0) and now[RUNNING] == 0:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the engine process never dropped the request")
    assert now[GENERATED] - before.get(GENERATED, 0) < 200


def test_a_grammar_the_engine_process_cannot_compile_fails_its_request_and_frees_its_queue_slot(models):
    """The engine process's side alone, over a real pipe: the HTTP side counted the request as queued,
    so the failure must say it left the queue, or the HTTP side's count would never come down."""
    import multiprocessing

    from specdec.server.engine_process import _PipedEngine
    from specdec.server.limits import ServerLimits

    ours, theirs = multiprocessing.Pipe()
    loop = _PipedEngine(LLM(**llm_kwargs(models)).engine, theirs, ServerLimits(kv_cache_memory=2**26), True)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="("))
    loop.add(7, [Prompt([5, 6], params)], time.perf_counter())
    kind, events, _, dequeued, snapshot = ours.recv()
    assert kind == "round" and dequeued == 1 and [rid for rid, _ in events] == [7]
    assert events[0][1].error.status == 400 and "could not be compiled" in events[0][1].error.message
    assert loop.num_queued == 0 and snapshot.waiting == 0 and 7 not in loop.handles


def test_a_model_that_cannot_load_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="no-such-model"):
        build_app(engine_process=True, model=str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="not an LLM"):
        build_app(object(), engine_process=True)


def test_when_the_engine_process_dies_requests_fail_with_503_and_health_says_so(models):
    with ServerThread(build_app(served_model_name=NAME, engine_process=True, **llm_kwargs(models))) as s:
        url = s.url + "/v1/completions"
        assert httpx.post(url, json={"model": NAME, "prompt": "w1", "max_tokens": 2}).status_code == 200
        with httpx.stream("POST", url, timeout=30, json={"model": NAME, "prompt": "w1 w2", "max_tokens": 250,
                                                          "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            os.kill(s.config.app.state.server.engine._proc.pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert any('"error"' in line and "engine stopped" in line for line in rest), rest[-3:]
        deadline = time.monotonic() + 10
        while httpx.get(s.url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(url, json={"model": NAME, "prompt": "w1", "max_tokens": 2})
        assert r.status_code == 503 and "Traceback" not in r.text


def test_specdec_serve_runs_the_engine_in_a_child_process_and_stops_it(models):
    """The real command line (``python -m specdec serve``): it answers with the engine in a child
    process, the HTTP process runs at --http-nice, and SIGTERM ends both, with nothing leaked."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--model", models[0], "--port", str(port),
                             "--served-model-name", NAME], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "w1 w2", "max_tokens": 4,
                                                       "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 5)  # --http-nice
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode in (0, -signal.SIGTERM), out[-2000:]  # uvicorn re-raises the signal it handled
    deadline = time.monotonic() + 10  # the engine and multiprocessing's resource tracker exit after the server
    while any(Path(f"/proc/{c}").exists() for c in children):
        assert time.monotonic() < deadline, "a child of the server outlived it"
        time.sleep(0.1)
    assert len(children) >= 1
    assert "leaked" not in out and "Traceback" not in out
