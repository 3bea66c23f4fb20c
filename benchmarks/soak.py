"""Soak: a mixed load against a server this script starts, for a given time, killing its engine process
along the way; then whether anything hung, was lost or failed unexpectedly, and whether memory and
latency stayed flat.

The server is ``specdec serve`` in a subprocess on 127.0.0.1 (the engine in a child process of its
own); this process is only the client (asyncio + httpx). At most --rate requests start per second and
at most --concurrency are in flight, drawn from a fixed mix: streamed completions and chats, n=2,
JSON-schema output, logprobs, penalties, seeded sampling, bad requests (each must get its 4xx), streams
the client hangs up on, plain requests it gives up on (client disconnects), and slow readers.

    python benchmarks/soak.py --model specdec/demo-target --draft specdec/demo-draft \\
        --duration 1800 --concurrency 8 --kill-engine 3 --out soak.json

Every request ends as one of: ok, rejected (a bad request's expected 4xx), aborted (the client left
by design), engine_503 (the engine died under it, or it came while the engine restarted), hung (no
end within --request-timeout), lost (200 but incomplete: no [DONE], a choice without a finish
reason), or unexpected (any other status or a transport error). --kill-engine N sends SIGKILL to the
engine process N times, evenly between the first and the last window (at a moment a stream is in
flight); each kill records the requests in flight, checks each ends within 2 s and /health turns 503
within 1 s, and times /health back to 200 and a request that succeeds.

Windows scale with --duration: warm-up min(120 s, 10%), first and last windows min(300 s, 20%) each.
Invariants (the summary's ``invariants``): 0 hung, 0 lost, 0 unexpected 5xx, every kill noticed
within 1 s, its requests ended within 2 s and the server served again; the HTTP process's RSS in the
last window within +-10% of the first, the engine process's too, and each engine process's own RSS
(the minute after its warm-up against its last minute) within +-10%, TPOT p95 of the last window within +-15% of the first. Per minute: requests by
outcome, TTFT p50, TPOT p50/p95, RSS. Writes the summary as JSON (--out) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

NAME = "soak"
KILL_DEADLINE_S = 2.0  # every request in flight at a kill must end within this
GRACE_S = 2.0  # a 503 this long after /health is back still counts as the restart's
PROMPTS = [
    "Once upon a time", "The quick brown fox", "def add(a, b):\n", "In the beginning there was",
    "Here is a list of fruits:", "The capital of France is", "import numpy as np\n", "She opened the door and",
    "The weather today is", "for i in range(10):\n", "My favourite book is", "Dear friend,",
]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}
# kind -> weight in the mix
MIX = {"stream": 4, "chat_stream": 2, "n2": 2, "json": 1, "logprobs": 1, "penalties": 1, "seeded": 1, "bad": 2,
       "hangup": 1, "disconnect": 1, "slow": 1}
STREAMS = ("stream", "chat_stream", "penalties", "seeded", "hangup", "slow")
# bad requests: (body or raw bytes, path, expected status)
BAD = [
    (b"{not json", "/v1/completions", 400),
    ({"model": NAME, "prompt": "hi", "max_tokens": -1}, "/v1/completions", 400),
    ({"model": "no-such-model", "prompt": "hi", "max_tokens": 4}, "/v1/completions", 404),
    ({"model": NAME, "prompt": "hi", "temperature": "hot"}, "/v1/completions", 400),
    ({"model": NAME, "prompt": "", "max_tokens": 4}, "/v1/completions", 400),
    ({"model": NAME, "prompt": "hi", "n": 1000}, "/v1/completions", 400),
    ({"model": NAME, "prompt": "hi", "max_tokens": 4, "structured_outputs": {"regex": "("}}, "/v1/completions", 400),
    ({"model": NAME, "prompt": "w " * 200_000, "max_tokens": 4}, "/v1/completions", 400),
    ({"model": NAME, "messages": "hi"}, "/v1/chat/completions", 400),
    ({"model": NAME, "prompt": "hi"}, "/v1/no-such-route", 404),
]


# -- the server -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``specdec serve`` in a subprocess on 127.0.0.1, its log in a file."""

    def __init__(self, args: list[str], threads: int | None, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "specdec", "serve", *args, "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", NAME, "--metrics-public"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> float:
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return time.monotonic() - began
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"the server did not start within {timeout:.0f} s (log: {self.log_path})")

    def engine_pid(self) -> int | None:
        """The engine process: the server's child started by multiprocessing's spawn (not its resource tracker)."""
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
                ppid = int(stat[stat.rindex(")") + 2:].split()[1])
                if ppid == self.proc.pid and b"spawn_main" in Path(entry.path, "cmdline").read_bytes():
                    return int(entry.name)
            except (OSError, ValueError):
                continue
        return None

    def rss_mib(self) -> tuple[float, float]:
        """Resident memory of the HTTP process and of the engine process (nan when absent)."""
        return _rss(self.proc.pid), _rss(self.engine_pid())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


def _rss(pid: int | None) -> float:
    if pid is None:
        return math.nan
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return math.nan


# -- requests ---------------------------------------------------------------------------------------


@dataclass
class Record:
    id: int
    kind: str
    start: float  # seconds since the run began
    end: float | None = None
    status: int | None = None
    outcome: str | None = None
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    detail: str = ""


class Load:
    """The mixed load: one request of a drawn kind at a time per task; each ends with an outcome."""

    def __init__(self, url: str, args, t0: float):
        self.url, self.args, self.t0 = url, args, t0
        self.rng = random.Random(args.seed)
        self.records: list[Record] = []
        self.client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.request_timeout, connect=10),
                                        limits=httpx.Limits(max_connections=args.concurrency + 8))

    def now(self) -> float:
        return time.monotonic() - self.t0

    def draw(self) -> Record:
        kind = self.rng.choices(list(MIX), weights=list(MIX.values()))[0]
        rec = Record(len(self.records), kind, self.now())
        self.records.append(rec)
        return rec

    async def run(self, rec: Record) -> None:
        try:
            await asyncio.wait_for(self._one(rec), self.args.request_timeout)
        except asyncio.TimeoutError:
            rec.outcome, rec.detail = "hung", f"no end within {self.args.request_timeout} s"
        except httpx.HTTPError as e:
            rec.outcome, rec.detail = "unexpected", f"transport: {type(e).__name__}"
        except Exception as e:  # a bug in this script must show, not vanish
            rec.outcome, rec.detail = "unexpected", f"client: {type(e).__name__}: {e}"[:200]
        rec.end = self.now()

    async def _one(self, rec: Record) -> None:
        rng, kind, max_tokens = self.rng, rec.kind, self.args.max_tokens
        prompt = rng.choice(PROMPTS)
        base = {"model": NAME, "max_tokens": rng.randint(max_tokens // 2, max_tokens), "temperature": 0.8,
                "top_p": 0.95}
        if kind == "bad":
            body, path, want = rng.choice(BAD)
            kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
                else {"json": body}
            r = await self.client.post(path, **kw)
            rec.status = r.status_code
            rec.outcome = "rejected" if r.status_code == want else self._status_outcome(r.status_code)
            rec.detail = f"{path} wanted {want}, got {r.status_code}"
            return
        if kind == "disconnect":  # a plain request the client gives up on
            body = {**base, "prompt": prompt, "max_tokens": max_tokens * 4}
            try:
                r = await asyncio.wait_for(self.client.post("/v1/completions", json=body), rng.uniform(0.05, 0.5))
            except asyncio.TimeoutError:
                rec.outcome = "aborted"
                return
            self._plain(rec, r, n=1)
            return
        if kind in ("n2", "logprobs", "json") and not (kind == "json" and rng.random() < 0.5):
            body = {**base, "prompt": prompt}
            if kind == "n2":
                body["n"] = 2
            elif kind == "logprobs":
                body.update(logprobs=3, temperature=0)
            else:
                body["structured_outputs"] = {"json": SCHEMA, "disable_any_whitespace": True}
            r = await self.client.post("/v1/completions", json=body)
            self._plain(rec, r, n=body.get("n", 1), json_text=kind == "json")
            return
        chat = kind in ("chat_stream", "json") or (kind == "slow" and rng.random() < 0.5)
        body = {**base, "stream": True, "stream_options": {"include_usage": True}}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if kind == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
        elif kind == "penalties":
            body.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
        elif kind == "seeded":
            body.update(seed=rng.randrange(2**31), temperature=1.0)
        elif kind == "stream" and rng.random() < 0.3:
            body.update(temperature=0, logprobs=2)
        hangup_after = rng.randint(1, 4) if kind == "hangup" else None
        delay = rng.uniform(0.01, 0.03) if kind == "slow" else 0.0
        await self._stream(rec, "/v1/chat/completions" if chat else "/v1/completions", body, hangup_after, delay)

    def _status_outcome(self, status: int) -> str:
        return "engine_503" if status == 503 else "unexpected"

    def _plain(self, rec: Record, r: httpx.Response, n: int, json_text: bool = False) -> None:
        rec.status = r.status_code
        if r.status_code != 200:
            rec.outcome, rec.detail = self._status_outcome(r.status_code), r.text[:200]
            return
        choices = r.json().get("choices", [])
        if len(choices) != n or any(c.get("finish_reason") not in ("stop", "length") for c in choices):
            reasons = [c.get("finish_reason") for c in choices]
            rec.outcome, rec.detail = "lost", f"{len(choices)} choices, finish reasons {reasons}"
            return
        rec.tokens = r.json()["usage"]["completion_tokens"]
        rec.outcome = "ok"
        if json_text and choices[0]["finish_reason"] == "stop":
            try:
                json.loads(choices[0]["text"])
            except ValueError:
                rec.outcome, rec.detail = "unexpected", "a schema-constrained output that stopped is not JSON"

    async def _stream(self, rec: Record, path: str, body: dict, hangup_after: int | None, delay: float) -> None:
        sent = time.monotonic()
        first = last = None
        chunks, finished, done, error = 0, 0, False, None
        async with self.client.stream("POST", path, json=body) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                rec.outcome, rec.detail = self._status_outcome(r.status_code), r.text[:200]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    error = obj["error"]
                    continue
                for c in obj.get("choices", []):
                    text = c.get("text") or (c.get("delta") or {}).get("content")
                    if text:
                        last = time.monotonic()
                        first = first or last
                        chunks += 1
                    if c.get("finish_reason"):
                        finished += 1
                if obj.get("usage"):
                    rec.tokens = obj["usage"]["completion_tokens"]
                if hangup_after is not None and chunks >= hangup_after:
                    rec.outcome = "aborted"  # closing the stream here hangs up the connection
                    return
                if delay:
                    await asyncio.sleep(delay)
        if first is not None:
            rec.ttft = first - sent
        if error is not None:
            status = 503 if error.get("code") == "engine_unavailable" else 500
            rec.outcome, rec.detail = self._status_outcome(status), str(error.get("message"))[:200]
            rec.status = status
        elif not done or finished != 1:
            rec.outcome, rec.detail = "lost", f"[DONE]: {done}, finished choices: {finished}"
        else:
            rec.outcome = "ok"
            if rec.tokens > 1 and first is not None:
                rec.tpot = (last - first) / (rec.tokens - 1)

    async def close(self) -> None:
        await self.client.aclose()


# -- the run --------------------------------------------------------------------------------------------


@dataclass
class Kill:
    at: float
    pid: int | None
    in_flight: list[int] = field(default_factory=list)
    noticed_s: float | None = None  # /health answered 503 this long after the kill
    ended_within_s: float | None = None  # the last of in_flight to end, seconds after the kill
    not_ended: list[int] = field(default_factory=list)
    health_back_s: float | None = None
    probe_status: int | None = None


def windows(duration: float) -> tuple[float, float]:
    """(warm-up, window) seconds for a run of ``duration``."""
    return min(120.0, 0.1 * duration), min(300.0, 0.2 * duration)


async def soak(server: Server, args) -> dict:
    t0 = time.monotonic()
    load = Load(server.url, args, t0)
    warmup, window = windows(args.duration)
    a, b = warmup + window, args.duration - window
    kill_at = [a + (b - a) * (i + 1) / (args.kill_engine + 1) for i in range(args.kill_engine)]
    kills: list[Kill] = []
    samples: list[tuple[float, float, float]] = []  # (t, http MiB, engine MiB)
    tasks: set[asyncio.Task] = set()
    sem = asyncio.Semaphore(args.concurrency)

    async def sampler() -> None:
        while load.now() < args.duration:
            samples.append((load.now(), *server.rss_mib()))
            await asyncio.sleep(args.sample_every)

    async def killer() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as probe:
            for at in kill_at:
                await asyncio.sleep(max(0.0, at - load.now()))
                for _ in range(50):  # up to 5 s for a moment with a stream in flight
                    if any(r.end is None and r.kind in STREAMS for r in load.records):
                        break
                    await asyncio.sleep(0.1)
                kill = Kill(load.now(), server.engine_pid())
                kills.append(kill)
                if kill.pid is None:
                    continue
                kill.in_flight = [r.id for r in load.records if r.end is None]
                os.kill(kill.pid, signal.SIGKILL)
                deadline = kill.at + args.restart_timeout
                while load.now() < deadline:  # /health turns 503 (the death seen), then 200 again
                    try:
                        up = (await probe.get("/health")).status_code == 200
                    except httpx.HTTPError:
                        up = None
                    if up is False and kill.noticed_s is None:
                        kill.noticed_s = load.now() - kill.at
                    if up and kill.noticed_s is not None:
                        kill.health_back_s = load.now() - kill.at
                        break
                    await asyncio.sleep(0.02 if kill.noticed_s is None else 0.1)
                if kill.health_back_s is not None:
                    r = await probe.post("/v1/completions", json={"model": NAME, "prompt": PROMPTS[0],
                                                                  "max_tokens": 8, "temperature": 0}, timeout=60)
                    kill.probe_status = r.status_code

    kills_task = asyncio.create_task(killer())
    background = [asyncio.create_task(sampler()), kills_task]
    next_start = 0.0
    while load.now() < args.duration:
        await sem.acquire()
        wait = next_start - load.now()
        if wait > 0:
            await asyncio.sleep(wait)
        if load.now() >= args.duration:
            sem.release()
            break
        next_start = max(next_start, load.now()) + 1.0 / args.rate
        task = asyncio.create_task(load.run(load.draw()))
        tasks.add(task)
        task.add_done_callback(lambda t: (tasks.discard(t), sem.release()))
    if tasks:
        await asyncio.wait(set(tasks), timeout=args.request_timeout + 5)
    # a restart still under way (its probe included) is waited for: bounded by its own timeouts
    await asyncio.wait({kills_task}, timeout=args.restart_timeout + 70)
    for t in [*tasks, *background]:
        t.cancel()
    await asyncio.gather(*tasks, *background, return_exceptions=True)
    for rec in load.records:
        if rec.end is None:
            rec.outcome, rec.end = "hung", load.now()
    await load.close()
    end_metrics = _metrics(server.url)
    return summarize(load.records, kills, samples, args, warmup, window, end_metrics, server.log_path)


def _metrics(url: str) -> dict[str, float]:
    out = {}
    try:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
    except httpx.HTTPError:
        pass
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def median(values: list[float]) -> float | None:
    return pct(values, 50)


def summarize(records: list[Record], kills: list[Kill], samples, args, warmup: float, window: float,
              end_metrics: dict, log_path: Path) -> dict:
    for k in kills:  # what each kill's in-flight requests did
        ends = {r.id: r for r in records if r.id in set(k.in_flight)}
        late = [i for i, r in ends.items() if r.end is None or r.end - k.at > KILL_DEADLINE_S]
        k.not_ended = late
        k.ended_within_s = max((r.end - k.at for r in ends.values() if r.end is not None), default=0.0)
    restarts = [(k.at, k.at + (k.health_back_s if k.health_back_s is not None else args.duration) + GRACE_S)
                for k in kills]
    for r in records:  # a 503 outside every restart is unexpected
        if r.outcome == "engine_503" and not any(r.start <= hi and r.end >= lo for lo, hi in restarts):
            r.outcome, r.detail = "unexpected", f"503 outside a restart: {r.detail}"
    outcomes: dict[str, int] = {}
    by_kind: dict[str, dict[str, int]] = {}
    for r in records:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
        by_kind.setdefault(r.kind, {}).setdefault(r.outcome, 0)
        by_kind[r.kind][r.outcome] += 1
    unexpected_5xx = [r for r in records if r.outcome == "unexpected" and (r.status or 0) >= 500]

    first, last = (warmup, warmup + window), (args.duration - window, args.duration)

    def in_window(t: float, w: tuple[float, float]) -> bool:
        return w[0] <= t < w[1]

    def tpots(w):
        return [r.tpot for r in records if r.tpot is not None and in_window(r.end, w)]

    def rss(w, i):
        return median([s[i] for s in samples if in_window(s[0], w) and not math.isnan(s[i])])

    win = {name: {"from_s": w[0], "to_s": w[1], "tpot_p95_ms": _ms(pct(tpots(w), 95)),
                  "tpot_p50_ms": _ms(median(tpots(w))), "requests": sum(in_window(r.end, w) for r in records),
                  "rss_http_mib": rss(w, 1), "rss_engine_mib": rss(w, 2)}
           for name, w in (("first", first), ("last", last))}

    def ratio(key: str) -> float | None:
        a, b = win["first"][key], win["last"][key]
        return None if not a or b is None else b / a

    minutes = []
    for m in range(math.ceil(args.duration / 60)):
        w = (60.0 * m, 60.0 * (m + 1))
        done = [r for r in records if in_window(r.end, w)]
        counts = {}
        for r in done:
            counts[r.outcome] = counts.get(r.outcome, 0) + 1
        minutes.append({"minute": m, "requests": len(done), "outcomes": counts,
                        "errors": sum(r.outcome in ("engine_503", "unexpected", "hung", "lost") for r in done),
                        "ttft_p50_ms": _ms(median([r.ttft for r in done if r.ttft is not None])),
                        "tpot_p50_ms": _ms(median([r.tpot for r in done if r.tpot is not None])),
                        "tpot_p95_ms": _ms(pct([r.tpot for r in done if r.tpot is not None], 95)),
                        "rss_http_mib": rss(w, 1), "rss_engine_mib": rss(w, 2)})
    rss_http, rss_engine, tpot = ratio("rss_http_mib"), ratio("rss_engine_mib"), ratio("tpot_p95_ms")
    # each engine process's own growth: the minute after its warm-up against the last minute before it
    # was killed (or the run ended); a life too short for both is not judged
    bounds = [0.0] + [k.at for k in kills] + [args.duration]
    lives = []
    for lo, hi in zip(bounds, bounds[1:]):
        early, late = (lo + warmup, lo + warmup + 60), (hi - 60, hi)
        if late[0] >= early[1]:
            a, b = rss(early, 2), rss(late, 2)
            lives.append({"from_s": lo, "to_s": hi, "early_mib": a, "late_mib": b,
                          "growth": None if not a or b is None else b / a})
    invariants = {
        "no_hung": outcomes.get("hung", 0) == 0,
        "no_lost": outcomes.get("lost", 0) == 0,
        "no_unexpected_5xx": not unexpected_5xx,
        "no_unexpected_other": outcomes.get("unexpected", 0) == len(unexpected_5xx),
        "kills_ended_in_2s": all(not k.not_ended for k in kills) and all(k.pid is not None for k in kills),
        "kills_noticed_in_1s": all(k.noticed_s is not None and k.noticed_s <= 1.0 for k in kills),
        "served_after_kills": all(k.health_back_s is not None and k.probe_status == 200 for k in kills),
        "rss_http_within_10pct": rss_http is not None and abs(rss_http - 1) <= 0.10,
        "rss_engine_within_10pct": rss_engine is not None and abs(rss_engine - 1) <= 0.10,
        "rss_engine_flat_each_life": bool(lives) and all(x["growth"] is not None and abs(x["growth"] - 1) <= 0.10
                                                         for x in lives),
        "tpot_p95_within_15pct": tpot is not None and abs(tpot - 1) <= 0.15,
    }
    log = log_path.read_text(errors="replace")
    return {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "requests": len(records), "outcomes": outcomes, "by_kind": by_kind,
        # Little's law: requests in flight on average (--concurrency is the cap, --rate may keep it below)
        "mean_in_flight": round(sum(r.end - r.start for r in records) / args.duration, 2),
        "statuses": _count(str(r.status) for r in records),
        "unexpected": [asdict(r) for r in records if r.outcome in ("unexpected", "hung", "lost")][:50],
        "kills": [asdict(k) | {"in_flight": len(k.in_flight)} for k in kills],
        "windows": win, "ratios": {"rss_http": rss_http, "rss_engine": rss_engine, "tpot_p95": tpot},
        "engine_lives": lives,
        "per_minute": minutes,
        "server": {"engine_restarts_total": end_metrics.get("specdec:engine_restarts_total"),
                   "engine_up": end_metrics.get("specdec:engine_up"),
                   "tracebacks_in_log": log.count("Traceback")},
        "invariants": invariants, "ok": all(invariants.values()),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 2)


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return dict(sorted(out.items()))


def table(s: dict) -> str:
    lines = [f"requests {s['requests']} ({s['mean_in_flight']} in flight on average): "
             + ", ".join(f"{k} {v}" for k, v in sorted(s["outcomes"].items())),
             "statuses: " + ", ".join(f"{k} {v}" for k, v in s["statuses"].items())]
    lines.append(f"{'minute':>6} {'reqs':>5} {'errors':>6} {'ttft p50':>9} {'tpot p50':>9} {'tpot p95':>9} "
                 f"{'http MiB':>9} {'engine MiB':>10}")
    for m in s["per_minute"]:
        lines.append(f"{m['minute']:>6} {m['requests']:>5} {m['errors']:>6} {_f(m['ttft_p50_ms']):>9} "
                     f"{_f(m['tpot_p50_ms']):>9} {_f(m['tpot_p95_ms']):>9} {_f(m['rss_http_mib']):>9} "
                     f"{_f(m['rss_engine_mib']):>10}")
    for k in s["kills"]:
        lines.append(f"kill at {k['at']:.0f} s: {k['in_flight']} in flight, last ended {_f(k['ended_within_s'])} s "
                     f"after, {len(k['not_ended'])} late; /health 503 after {_f(k['noticed_s'], 2)} s, back in "
                     f"{_f(k['health_back_s'])} s, "
                     f"probe {k['probe_status']}")
    w = s["windows"]
    lines.append(f"first window {w['first']['from_s']:.0f}-{w['first']['to_s']:.0f} s vs last "
                 f"{w['last']['from_s']:.0f}-{w['last']['to_s']:.0f} s: TPOT p95 {_f(w['first']['tpot_p95_ms'])} -> "
                 f"{_f(w['last']['tpot_p95_ms'])} ms, RSS http {_f(w['first']['rss_http_mib'])} -> "
                 f"{_f(w['last']['rss_http_mib'])} MiB, engine {_f(w['first']['rss_engine_mib'])} -> "
                 f"{_f(w['last']['rss_engine_mib'])} MiB")
    for x in s["engine_lives"]:
        lines.append(f"engine process {x['from_s']:.0f}-{x['to_s']:.0f} s: RSS {_f(x['early_mib'])} -> "
                     f"{_f(x['late_mib'])} MiB")
    for name, ok in s["invariants"].items():
        lines.append(f"  {'PASS' if ok else 'FAIL'} {name}")
    return "\n".join(lines)


def _f(x, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="target (what `specdec serve --model` takes)")
    p.add_argument("--draft", help="draft model (specdec serve --draft)")
    p.add_argument("-k", type=int, help="draft tokens per round (specdec serve -k)")
    p.add_argument("--server-arg", action="append", default=[], help="one more argument for specdec serve")
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (default 8)")
    p.add_argument("--rate", type=float, default=4.0, help="requests started per second at most (default 4)")
    p.add_argument("--max-tokens", type=int, default=48, help="longest request (default 48)")
    p.add_argument("--kill-engine", type=int, default=0, help="SIGKILL the engine process this many times")
    p.add_argument("--request-timeout", type=float, default=120.0, help="a request not ended by then is hung")
    p.add_argument("--restart-timeout", type=float, default=300.0, help="seconds /health may take to come back")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--threads", type=int, help="torch threads of the engine (OMP_NUM_THREADS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the JSON summary here")
    args = p.parse_args(argv)
    for name in ("duration", "rate", "max_tokens", "concurrency", "request_timeout", "restart_timeout", "sample_every"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.kill_engine < 0 or args.max_tokens < 2:
        p.error("--kill-engine must be >= 0 and --max-tokens >= 2")
    serve_args = ["--model", args.model, *(["--draft", args.draft] if args.draft else []),
                  *(["-k", str(args.k)] if args.k else []), "--max-num-seqs", str(2 * args.concurrency),
                  *args.server_arg]
    log_path = Path(tempfile.mkdtemp(prefix="soak_")) / "server.log"
    server = Server(serve_args, args.threads, log_path)
    try:
        ready_s = server.wait_ready(args.restart_timeout)
        print(f"server ready in {ready_s:.1f} s (log: {log_path})", flush=True)
        summary = asyncio.run(soak(server, args))
    finally:
        server.stop()
    summary["server"].update(log=str(log_path), first_start_s=ready_s)  # the model's load time, to compare restarts to
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    print(table(summary))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
