"""The engine process dies under load (SIGKILL, as the out-of-memory killer sends it): every request in
flight ends with a 503 within 2 s (a stream with an error event), /health and /metrics say so, a new
engine process loads and the server serves the same outputs again; restarts that keep failing stop.
A real uvicorn on 127.0.0.1, tiny models loaded in a spawned process."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time

import httpx
import pytest

from specdec.server import ServerThread, build_app
from specdec.server.limits import ServerLimits
from test_server import NAME, spec_config
from tiny_models import make_model, perturbed_copy

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread, the machine is shared

UP, RESTARTS = ("specdec:engine_up", ()), ("specdec:engine_restarts_total", ())
DRAFTS = ("specdec:spec_decode_num_drafts_total", ())
RUNNING, WAITING = ("specdec:num_requests_running", ()), ("specdec:num_requests_waiting", ())
LONG = 3000  # tokens: a request that cannot finish before the kill


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    target = make_model(root / "target", "llama", max_pos=4096)
    return str(target), str(perturbed_copy(target, root / "draft", 0.01))


def scrape(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def start(target: str, draft: str, **limits) -> ServerThread:
    limits = ServerLimits(metrics_public=True, engine_restart_backoff=0.05, **limits)
    app = build_app(served_model_name=NAME, engine_process=True, limits=limits, model=target, max_num_seqs=2,
                    speculative_config=spec_config(draft))
    s = ServerThread(app).start()
    s.loop = app.state.server.engine
    return s


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def completion(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={"model": NAME, "temperature": 0, **body})


def test_a_killed_engine_fails_what_is_in_flight_with_503_and_the_server_serves_again(models):
    s = start(*models)
    try:
        url, pid = s.url, s.loop._proc.pid
        want = completion(url, prompt="w1 w2 w3", max_tokens=12, ignore_eos=True).json()["choices"][0]["text"]
        drafts = scrape(url)[DRAFTS]
        assert drafts > 0 and scrape(url)[UP] == 1 and scrape(url)[RESTARTS] == 0

        # in flight: one stream and two plain requests; max_num_seqs=2, so one of them waits in the queue
        replies: dict[int, tuple[float, httpx.Response]] = {}

        def plain(i: int) -> None:
            r = completion(url, prompt=f"w{i} w{i + 1}", max_tokens=LONG, ignore_eos=True)
            replies[i] = (time.monotonic(), r)

        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": NAME, "prompt": "w5 w6", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
                "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            threads = [threading.Thread(target=plain, args=(i,)) for i in (10, 20)]
            for t in threads:
                t.start()
            wait_for(lambda: (m := scrape(url))[RUNNING] == 2 and m[WAITING] == 1, 30, "the requests never queued")
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
            stream_ended = time.monotonic()
        health = httpx.get(url + "/health")  # the new engine takes seconds to load: still restarting
        for t in threads:
            t.join(30)

        assert stream_ended - killed < 2.0, f"the stream ended {stream_ended - killed:.1f} s after the kill"
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["code"] == "engine_unavailable" and "engine stopped" in error["message"], error
        assert sorted(replies) == [10, 20]
        for ended, r in replies.values():
            assert ended - killed < 2.0, f"a request ended {ended - killed:.1f} s after the kill"
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "engine_unavailable" and "engine stopped" in r.text
            assert models[0] not in r.text and "Traceback" not in r.text  # no local paths, no exception text
        assert health.status_code == 503 and "restarting" in health.json()["error"]["message"]
        refused = completion(url, prompt="w1", max_tokens=2)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert scrape(url)[UP] == 0

        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 120, "the engine never came back")
        assert s.loop._proc.pid != pid and s.loop.state == "serving"
        r = completion(url, prompt="w1 w2 w3", max_tokens=12, ignore_eos=True)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want  # the same model, serving again
        after = scrape(url)
        assert after[UP] == 1 and after[RESTARTS] == 1
        assert after[DRAFTS] > drafts  # the counters carry over the restart: never backwards
        assert after[RUNNING] == 0 and after[WAITING] == 0  # the failed requests left no queue slot behind
        assert s.loop.num_queued == 0
    finally:
        s.stop()
    assert not s.loop._proc.is_alive()


def test_restarts_that_keep_failing_are_bounded(models, tmp_path, caplog):
    """The model's files vanish while it serves; the engine is killed: two restarts fail, then the
    server stops trying and says so on /health, without looping."""
    target = shutil.copytree(models[0], tmp_path / "target")
    s = start(str(target), models[1], engine_restarts=2)
    try:
        assert completion(s.url, prompt="w1", max_tokens=2).status_code == 200
        (target / "config.json").unlink()
        with caplog.at_level(logging.INFO, logger="specdec.server.engine_process"):
            os.kill(s.loop._proc.pid, signal.SIGKILL)
            wait_for(lambda: s.loop.state == "failed", 120, "the server kept restarting")
            time.sleep(1.0)  # nothing more happens
        failed = [r for r in caplog.records if "could not be restarted" in r.getMessage()]
        assert len(failed) == 2 and s.loop.state == "failed" and not s.loop._proc.is_alive()
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and "could not be restarted" in health.json()["error"]["message"]
        assert "retry-after" not in health.headers and str(tmp_path) not in health.text
        r = completion(s.url, prompt="w1", max_tokens=2)
        assert r.status_code == 503 and "could not be restarted" in r.text
        m = scrape(s.url)
        assert m[UP] == 0 and m[RESTARTS] == 0
    finally:
        s.stop()


def test_a_hung_engine_is_killed_and_restarted(models, caplog):
    """The engine process stops making progress (SIGSTOP: alive, but no pass of its loop) with a
    stream in flight: past ``engine_iteration_timeout`` it is killed, the stream ends with the 503
    error, and a new engine serves again. An idle engine is never taken as hung."""
    s = start(*models, engine_iteration_timeout=1.5)
    try:
        url, pid = s.url, s.loop._proc.pid
        want = completion(url, prompt="w1 w2 w3", max_tokens=12, ignore_eos=True).json()["choices"][0]["text"]
        time.sleep(2.5)  # idle past the timeout: nothing in flight, so nothing is killed
        assert s.loop._proc.pid == pid and s.loop._proc.is_alive() and s.loop.state == "serving"
        with caplog.at_level(logging.INFO, logger="specdec.server.engine_process"), \
                httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "model": NAME, "prompt": "w5 w6", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            frozen = time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            rest = [line for line in lines if line.startswith("data: ")]
            ended = time.monotonic()
        assert 1.5 <= ended - frozen < 4.0, f"the stream ended {ended - frozen:.1f} s after the engine froze"
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "engine_unavailable"
        assert any("made no progress" in r.getMessage() for r in caplog.records)
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 120, "the engine never came back")
        assert s.loop._proc.pid != pid and scrape(url)[RESTARTS] == 1
        r = completion(url, prompt="w1 w2 w3", max_tokens=12, ignore_eos=True)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    finally:
        s.stop()
