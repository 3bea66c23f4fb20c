"""Load and speed of the OpenAI-compatible server, speculative against plain, measured over HTTP.

Two servers run as subprocesses (``specdec serve``) on 127.0.0.1: the target with the drafter, and
the target alone. This process is only the client (asyncio + httpx, server-sent events).

1. Load (speculative server): the requests are first sent one at a time (greedy) for reference; then
   N streaming requests (default 64) and D more that disconnect mid-stream (default 10) are sent at
   once. Every completed output must equal its sequential one token for token (greedy; a divergence
   can only come from a near-tie of the target's top-2 logits, which is listed, not hidden). Reports
   throughput (generated tokens/s over all requests), TTFT and TPOT medians and p95, the aborts the
   server counted, and the server's RSS before the load, at its peak and after it.
2. Speculative vs plain, alternating runs so machine noise hits both alike: throughput at C (default 8)
   concurrent greedy requests, two ways: a burst of C sent at once, timed to the end of the last (the
   slowest request sets the time), and a sustained run of --sustained-requests with C in flight, a new
   one sent as each ends (vLLM's ``benchmark_serving --max-concurrency``); and TPOT at 1 request.

    python benchmarks/bench_server.py --model T --draft D [-k 4] [--num-requests 64] [--num-disconnect 10]
        [--max-tokens 64] [--prompts FILE [--max-prompt-tokens N] | --token-prompts] [--threads N] [--json]

3. Abuse (``--abuse SECONDS``, instead of 1 and 2): N well-behaved clients (default 64) stream greedy
   requests back to back, first alone for --baseline-seconds, then while a second client sends the
   adversarial classes of tests/test_server_hardening.py in a loop for SECONDS: values float32
   cannot hold, oversized bodies and prompts, 10,000 prompts, idle, slowloris and lying
   connections, long model names, foreign Host/Origin, hang-ups mid-body. Reports the well-behaved
   requests' completion and equality to their solo outputs, their TPOT p50/p95 with and without
   the abuse, the abuse's status codes, and the server's RSS (HTTP and engine processes) after the
   baseline and after the abuse, both idle. The hostile client replays pre-encoded bodies, as an
   attacker would: its own JSON encoding would otherwise take the shared cores' time.

    python benchmarks/bench_server.py --model T --draft D --abuse 60 [--num-requests 64] [--baseline-seconds 30]

Constrained output (``--json-schema FILE``, or ``records``: the schema of prompts/json_records.jsonl):
every request carries ``response_format`` {"type": "json_schema"} with that schema (``--compact-json``:
vLLM's ``structured_outputs`` with ``disable_any_whitespace``); the report adds how many outputs parse
as JSON. Use it with prompts that ask for such records:

    python benchmarks/bench_server.py --model T --draft D --prompts benchmarks/prompts/json_records.jsonl \
        --json-schema records --compact-json

Without --prompts a built-in set of 12 short code and prose prompts is cycled; --token-prompts sends
random token ids instead (for tiny test models whose tokenizers know no real words). With enough
prompts (Spec-Bench's 480: ``--prompts "$SPEC_BENCH"``, the Spec-Bench repository's
data/spec_bench/question.jsonl) the comparison sends each prompt once and none from the load test,
so drafters that learn from earlier outputs (suffix) are not measured on text they have already seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# Code prompts end where the tokenizer ends a token in running code (a bare trailing newline is a
# token that training text merges with the next line's indentation).
DEFAULT_PROMPTS = [
    'def fibonacci(n):\n    """',
    'def is_prime(n):\n    """',
    "class Stack:\n    def __init__(self):\n        self.",
    "The three most important ideas in computer science are",
    "import numpy as np\n\ndef softmax(x):\n   ",
    "Once upon a time, in a small village by the sea,",
    'def quicksort(items):\n    """',
    "Here is a short summary of how a transformer language model works:",
    "for i in range(10):\n       ",
    "The capital of France is",
    'def binary_search(arr, target):\n    """',
    "SELECT name, COUNT(*) FROM",
]


# -- servers --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``specdec serve`` in a subprocess, its log in a temporary file."""

    def __init__(self, name: str, args: list[str], threads: int | None):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench_server_{name}_", suffix=".log", delete=False)
        cmd = [sys.executable, "-c", "from specdec.cli import main; main()", "serve", *args, "--port", str(self.port),
               "--served-model-name", "bench"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"the {self.name} server exited:\n{self.log.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"the {self.name} server did not start within {timeout} s (log: {self.log.name})")

    def rss_mib(self) -> float:
        """The server's resident memory: its HTTP process and its engine process (``specdec serve`` runs
        the engine in a child process)."""
        pids = [self.proc.pid]
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
        total = 0.0
        for pid in pids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
            except (OSError, StopIteration):
                pass
        return total or float("nan")

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.unlink(self.log.name)


# -- requests ---------------------------------------------------------------------------------------


@dataclass
class Result:
    prompt: object = None  # as sent (sustained runs finish out of order)
    token_ids: list[int] = field(default_factory=list)
    start: float = 0.0
    first: float | None = None  # first generated token arrived
    last: float = 0.0
    finish_reason: str | None = None

    @property
    def ttft(self) -> float:
        return self.first - self.start

    @property
    def tpot(self) -> float | None:
        n = len(self.token_ids)
        return (self.last - self.first) / (n - 1) if n > 1 else None


REQUEST_EXTRA: dict = {}  # fields every request carries (main sets response_format for --json-schema)


def body(prompt, max_tokens: int, stream: bool) -> dict:
    return {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True, "return_token_ids": True, **REQUEST_EXTRA}


def openai_chunk(obj: dict) -> tuple[list[int], str | None]:
    choice = obj["choices"][0]
    return choice.get("token_ids") or [], choice["finish_reason"]


@dataclass(frozen=True)
class Api:
    """How to ask a server for a greedy completion of exactly max_tokens tokens: the path, the JSON
    body (prompt, max_tokens, stream) and a stream chunk's (new token ids, finish reason or None).
    specdec serve's is OpenAI's /v1/completions; another server (a peer) brings its own."""

    path: str = "/v1/completions"
    body: Callable[[object, int, bool], dict] = body
    chunk: Callable[[dict], tuple[list[int], str | None]] = openai_chunk


OPENAI = Api()


def json_schema_fields(source: str, compact: bool) -> dict:
    """Request fields for --json-schema: a schema file's, or ("records") the schema of
    prompts/json_records.jsonl (bench_structured.py's), as OpenAI's response_format or, ``compact``,
    as vLLM's structured_outputs without free whitespace (a model may emit newlines forever where
    the grammar lets it)."""
    if source == "records":
        from bench_structured import SCHEMA as schema
    else:
        schema = json.loads(Path(source).read_text())
    fields = {"ignore_eos": False}  # a record ends where the grammar does
    if compact:
        return {**fields, "structured_outputs": {"json": schema, "disable_any_whitespace": True}}
    return {**fields, "response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": schema,
                                                                                 "strict": True}}}


def parses(tok, token_ids: list[int]) -> bool:
    try:
        json.loads(tok.decode(token_ids, skip_special_tokens=True))
        return True
    except ValueError:
        return False


async def stream_one(client: httpx.AsyncClient, url: str, prompt, max_tokens: int,
                     leave_after: int | None = None, api: Api = OPENAI) -> Result:
    """One streaming request; ``leave_after`` chunks, then disconnect (None: read to the end)."""
    r = Result(prompt=prompt, start=time.perf_counter())
    chunks = 0
    async with client.stream("POST", url + api.path, json=api.body(prompt, max_tokens, True)) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(obj["error"]["message"])
            token_ids, finish_reason = api.chunk(obj)
            if token_ids:
                now = time.perf_counter()
                r.first = r.first or now
                r.last = now
                r.token_ids += token_ids
            r.finish_reason = finish_reason or r.finish_reason
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                break  # leaving the block closes the connection mid-stream
    return r


async def complete_one(client: httpx.AsyncClient, url: str, prompt, max_tokens: int) -> list[int]:
    resp = await client.post(url + "/v1/completions", json=body(prompt, max_tokens, False))
    resp.raise_for_status()
    return resp.json()["choices"][0]["token_ids"]


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=httpx.Limits(max_connections=1000,
                                                                                   max_keepalive_connections=0))


async def sequential(url: str, prompts: list, max_tokens: int) -> list[list[int]]:
    async with client() as c:
        return [await complete_one(c, url, p, max_tokens) for p in prompts]


async def concurrent(url: str, prompts: list, max_tokens: int, leavers: list | None = None,
                     seed: int = 0, api: Api = OPENAI) -> tuple[list[Result], float]:
    """All prompts at once (plus ``leavers`` that disconnect after 1-4 chunks); returns results and wall time."""
    rng = random.Random(seed)
    leavers = leavers or []
    async with client() as c:
        t0 = time.perf_counter()
        tasks = [stream_one(c, url, p, max_tokens, api=api) for p in prompts]
        tasks += [stream_one(c, url, p, 4 * max_tokens, leave_after=rng.randint(1, 4), api=api) for p in leavers]
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return list(results[: len(prompts)]), wall


async def sustained(url: str, prompts: list, max_tokens: int, concurrency: int,
                    api: Api = OPENAI) -> tuple[list[Result], float]:
    """Every prompt, with ``concurrency`` requests in flight until the last is sent (as vLLM's
    ``benchmark_serving --max-concurrency`` does): a client starts its next request as soon as one
    finishes. Returns results and the wall time from the first request to the last token."""
    queue = list(reversed(prompts))
    results: list[Result] = []

    async def worker(c: httpx.AsyncClient) -> None:
        while queue:
            results.append(await stream_one(c, url, queue.pop(), max_tokens, api=api))

    async with client() as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


# -- abuse ------------------------------------------------------------------------------------------


async def well_behaved(url: str, prompts: list, max_tokens: int, workers: int, seconds: float) -> list[tuple]:
    """``workers`` clients streaming back to back for ``seconds``; returns (prompt index, Result or error)."""
    deadline = time.perf_counter() + seconds
    out: list[tuple] = []
    counter = iter(range(10**9))

    async def worker(c: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            i = next(counter) % len(prompts)
            try:
                out.append((i, await stream_one(c, url, prompts[i], max_tokens)))
            except Exception as e:  # a failed well-behaved request is a finding, not a crash
                out.append((i, e))

    async with client() as c:
        await asyncio.gather(*(worker(c) for _ in range(workers)))
    return out


async def abuse(url: str, port: int, seconds: float, only: set[str] | None = None) -> dict[str, int]:
    """The adversarial classes (``only`` these, if given) in a loop for ``seconds``; returns counts of
    '<case> <status>'."""
    deadline = time.perf_counter() + seconds
    counts: dict[str, int] = {}

    def note(case: str, outcome) -> None:
        key = f"{case} {outcome}"
        counts[key] = counts.get(key, 0) + 1

    encoded: dict[int, bytes] = {}  # each payload is encoded once, as an attacker replaying bytes would:
    # on a 2-core machine the client's own JSON encoding of 5 MB bodies would take the server's CPU

    async def post(c: httpx.AsyncClient, case: str, payload=None, headers=None) -> None:
        data = encoded.get(id(payload))
        if data is None:
            data = encoded[id(payload)] = json.dumps(payload).encode()
        try:
            r = await c.post(url + "/v1/completions", content=data,
                             headers={"Content-Type": "application/json", **(headers or {})})
            note(case, r.status_code)
        except httpx.HTTPError:  # the server answered early (413) and closed while the body was being sent
            note(case, "closed early")

    async def raw(case: str, data: bytes, hold: float = 15, drip: bytes = b"") -> None:
        """A connection that sends ``data``, then ``drip`` every 0.5 s until the server answers or closes
        it (noted), or ``hold`` seconds pass (noted as held open); hold 0 hangs up at once."""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as e:
            note(case, type(e).__name__)
            return
        t0 = time.perf_counter()
        try:
            writer.write(data)
            if not hold:
                return note(case, "hung up")
            while time.perf_counter() - t0 < hold:
                if drip:
                    writer.write(drip)
                try:
                    got = await asyncio.wait_for(reader.read(100), 0.5)
                except TimeoutError:
                    continue
                return note(case, got[9:12].decode() if got.startswith(b"HTTP/1.1") else "closed")
            note(case, "held open")
        except OSError:
            note(case, "closed")
        finally:
            writer.close()

    async def repeat(make) -> None:  # each class in its own loop: a slow one does not hold the others back
        while time.perf_counter() < deadline:
            await make()
            await asyncio.sleep(0.01)  # this client shares the machine's cores with the server

    sample = {"model": "bench", "prompt": "Hello", "max_tokens": 4}
    bad_values = [{"temperature": 1e-40}, {"temperature": 5e-324}, {"top_p": 1e-300}, {"top_k": 2**63},
                  {"top_k": 10**30}, {"temperature": 0.8, "min_p": 1e-300}, {"stop": ["x"] * 1000},
                  {"stop_token_ids": list(range(100_000))}]
    bad_values = [{**sample, **v} for v in bad_values]
    big_body, big_prompt = {**sample, "prompt": "hello " * 900_000}, {**sample, "prompt": "hello " * 170_000}
    many_prompts, long_name = {**sample, "prompt": [[1, 2, 3]] * 10_000}, {**sample, "model": "m" * 2**20}
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=httpx.Limits(max_connections=100)) as c:
        cases = {
            "bad value": [lambda v=v: post(c, "bad value", v) for v in bad_values],
            "5 MB body": [lambda: post(c, "5 MB body", big_body)],
            "1 MB prompt": [lambda: post(c, "1 MB prompt", big_prompt)],
            "10,000 prompts": [lambda: post(c, "10,000 prompts", many_prompts)],
            "1 MiB model name": [lambda: post(c, "1 MiB model name", long_name)],
            "foreign Host": [lambda: post(c, "foreign Host", sample, headers={"Host": "rebound.example.com"})],
            "foreign Origin": [lambda: post(c, "foreign Origin", sample,
                                            headers={"Origin": "http://evil.example.com"})],
            "idle connection": [lambda: raw("idle connection", b"")] * 10,
            "slowloris": [lambda: raw("slowloris", head, drip=b"X-Slow: 1\r\n")] * 5,
            "Content-Length 1e9": [lambda: raw("Content-Length 1e9", head + b"Content-Length: 1000000000\r\n\r\n")],
            "11 of 1000 bytes": [lambda: raw("11 of 1000 bytes", head + b"Content-Length: 1000\r\n\r\n{\"p\": 1,", 45)],
            "hang-up mid-body": [lambda: raw("hang-up mid-body", head + b"Content-Length: 500\r\n\r\n{\"p\": 1,", 0)],
        }
        await asyncio.gather(*(repeat(make) for name, makes in cases.items() if only is None or name in only
                               for make in makes))
    return counts


def run_abuse(url: str, port: int, seconds: float, only: set[str] | None = None) -> dict[str, int]:
    return asyncio.run(abuse(url, port, seconds, only))


def abuse_main(args, spec_args: list[str], common: list[str], prompts: list) -> None:
    from specdec.near_tie import first_mismatch

    server = Server("spec", common + spec_args, args.threads)
    try:
        server.wait_ready()
        asyncio.run(sequential(server.url, prompts[:2], 8))  # warm up
        solo = asyncio.run(sequential(server.url, prompts, args.max_tokens))
        time.sleep(1.0)
        rss_start = server.rss_mib()
        base = asyncio.run(well_behaved(server.url, prompts, args.max_tokens, args.num_requests, args.baseline_seconds))
        time.sleep(2.0)  # idle: the engine releases its caches; what stays is the load's working set
        rss_before = server.rss_mib()  # (oneDNN's kernels for each batch shape, the allocator's pools)

        async def both():
            # the hostile client is a process of its own: in this one its JSON encoding of 5 MB bodies
            # would delay the well-behaved streams' chunks here, not on the server
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                abuser = asyncio.get_running_loop().run_in_executor(pool, run_abuse, server.url, server.port,
                                                                    args.abuse)
                load = await well_behaved(server.url, prompts, args.max_tokens, args.num_requests, args.abuse)
                return load, await abuser

        load, counts = asyncio.run(both())
        time.sleep(2.0)  # the engine goes idle and releases its caches
        rss_after = server.rss_mib()
        healthy = httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()

    def summary(runs: list[tuple]) -> dict:
        ok = [(i, r) for i, r in runs if isinstance(r, Result) and r.finish_reason is not None]
        differ = [(i, r) for i, r in ok if first_mismatch(solo[i], r.token_ids) is not None]
        divergences = classify(args, [(prompts[i], solo[i], r.token_ids) for i, r in differ])
        return {"requests": len(runs), "completed": len(ok), "failed": [repr(r)[:200] for _, r in runs
                                                                          if not isinstance(r, Result)][:5],
                "equal_to_solo": len(ok) - len(differ), "near_ties": sum(d["near_tie"] for d in divergences),
                "not_near_ties": sum(not d["near_tie"] for d in divergences),
                **latency_summary([r for _, r in ok])}

    report = {"model": args.model, "speculative": spec_args, "streams": args.num_requests,
              "baseline": summary(base), "abuse": summary(load), "abuse_seconds": args.abuse,
              "abuse_outcomes": dict(sorted(counts.items())), "health_after": healthy,
              "server_rss_mib": {"start": rss_start, "before": rss_before, "after": rss_after,
                                 "after_over_before": rss_after / rss_before}}
    report["tpot_p95_abuse_over_baseline"] = report["abuse"]["tpot_p95_ms"] / report["baseline"]["tpot_p95_ms"]
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"model {args.model} | {' '.join(spec_args)} | {args.num_requests} well-behaved greedy streams, "
          f"{args.max_tokens} tokens each, back to back")
    for name, secs in (("baseline", args.baseline_seconds), ("abuse", args.abuse)):
        r = report[name]
        print(f"  {name:8} ({secs:.0f} s): completed {r['completed']}/{r['requests']}, equal to solo "
              f"{r['equal_to_solo']}/{r['completed']} (near-ties {r['near_ties']}, other {r['not_near_ties']}); "
              f"TPOT p50 {r['tpot_median_ms']:.1f} ms, p95 {r['tpot_p95_ms']:.1f} ms; TTFT p50 "
              f"{r['ttft_median_ms']:.0f} ms, p95 {r['ttft_p95_ms']:.0f} ms"
              + (f"; failed: {r['failed']}" if r["failed"] else ""))
    print(f"  TPOT p95 under abuse / baseline: {report['tpot_p95_abuse_over_baseline']:.2f}x")
    print("  abuse outcomes: " + ", ".join(f"{k}: {v}" for k, v in report["abuse_outcomes"].items()))
    m = report["server_rss_mib"]
    print(f"  server RSS (HTTP and engine processes): {m['start']:.0f} MiB before the baseline, {m['before']:.0f} MiB "
          f"after it (before the abuse), {m['after']:.0f} MiB after the abuse ({m['after_over_before']:.2f}x); "
          f"/health after: {'200' if healthy else 'failed'}")


# -- figures -----------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    i = min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))
    return v[i]


def latency_summary(results: list[Result]) -> dict:
    ttft = [r.ttft for r in results if r.first is not None]
    tpot = [t for r in results if (t := r.tpot) is not None]
    return {"ttft_median_ms": 1e3 * statistics.median(ttft), "ttft_p95_ms": 1e3 * pct(ttft, 95),
            "tpot_median_ms": 1e3 * statistics.median(tpot), "tpot_p95_ms": 1e3 * pct(tpot, 95)}


def classify(args, cases: list[tuple]) -> list[dict]:
    """For (prompt, sequential output, concurrent output) that differ: where they part, the target's
    top-2 logit gap there, and whether it is a near-tie (specdec.near_tie), judged in-process."""
    if not cases:
        return []
    from specdec import LLM
    from specdec.near_tie import first_divergence

    judge = LLM(args.model, dtype=args.dtype, device=args.device)
    out = []
    for prompt, ref, got in cases:
        ids = prompt if isinstance(prompt, list) else judge.get_tokenizer().encode(prompt)
        out.append(first_divergence(judge.engine.target, ids, ref, got))
    return out


def spec_counters(before: dict, after: dict) -> dict:
    d = {k: after.get(f"specdec:spec_decode_{k}_total", 0) - before.get(f"specdec:spec_decode_{k}_total", 0)
         for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    return {"acceptance_rate": d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0.0,
            "mean_acceptance_length": 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 1.0}


def target_tokenizer(args):
    """The target's tokenizer and context length (the shipped pair's names resolve to its folders)."""
    from transformers import AutoConfig, AutoTokenizer

    from specdec.models.resolve import resolve_model_path

    path = resolve_model_path(args.model)
    return AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path).max_position_embeddings


def make_prompts(args, tok) -> list:
    """The distinct prompts, in order: a file's, random token ids, or the built-in set."""
    if args.prompts:
        from specdec.prompts import load_prompts

        return [r["prompt"] for r in load_prompts(args.prompts)]
    if args.token_prompts:
        rng = random.Random(0)
        return [[rng.randrange(3, len(tok)) for _ in range(rng.randint(4, 24))]
                for _ in range(args.num_requests + args.num_disconnect + comparison_size(args))]
    return DEFAULT_PROMPTS


def fitting(prompts: list, args, tok, context: int) -> list:
    """The prompts whose tokens and max_tokens fit the target's context, and at most --max-prompt-tokens
    long (Spec-Bench's summarization and RAG prompts run to 2,000 tokens: their prefill, not decoding,
    would set the throughput of 64-token answers)."""
    limit = min(context - args.max_tokens, args.max_prompt_tokens or context)
    kept = [p for p in prompts if (len(p) if isinstance(p, list) else len(tok.encode(p))) <= limit]
    if not kept:
        raise SystemExit(f"no prompt is at most {limit} tokens long (the context of {context} less --max-tokens "
                         f"{args.max_tokens}, or --max-prompt-tokens); raise the limit or pass shorter prompts")
    if len(kept) < len(prompts):
        print(f"({len(prompts) - len(kept)} of {len(prompts)} prompts left out: longer than {limit} tokens)",
              file=sys.stderr)
    return kept


def comparison_size(args) -> int:
    """Prompts the speculative-vs-plain comparison sends: per repeat a burst and a sustained run, then
    the single requests."""
    return args.repeats * (args.concurrency + args.sustained_requests) + args.single_requests


def cycle(prompts: list, start: int, n: int) -> list:
    return [prompts[(start + i) % len(prompts)] for i in range(n)]


def main() -> None:
    from specdec.near_tie import first_mismatch  # here, not at the top: specdec loads torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="target: a checkpoint folder or hub id")
    ap.add_argument("--draft", help="draft model (method draft_model)")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--speculative-config", help="vLLM-style JSON instead of --draft/-k")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--num-disconnect", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8, help="concurrent requests in the throughput comparison")
    ap.add_argument("--sustained-requests", type=int, default=32,
                    help="requests per sustained run: --concurrency in flight until all are sent (0: skip)")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per server in the comparison")
    ap.add_argument("--single-requests", type=int, default=12,
                    help="requests per server for TPOT at 1 request (12: each built-in prompt once)")
    ap.add_argument("--prompts", help="JSONL prompts file ({prompt} or Spec-Bench question.jsonl)")
    ap.add_argument("--max-prompt-tokens", type=int, help="leave out longer prompts")
    ap.add_argument("--token-prompts", action="store_true", help="random token-id prompts (tiny test models)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--threads", type=int, help="torch threads of each server (OMP_NUM_THREADS)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--serve-args", default="", help="more options for every specdec serve, e.g. "
                    "'--engine-in-process' or '--http-nice 0'")
    ap.add_argument("--abuse", type=float, metavar="SECONDS",
                    help="abuse mode: well-behaved streams while a hostile client runs for SECONDS")
    ap.add_argument("--baseline-seconds", type=float, default=30.0, help="abuse mode: seconds without the abuse")
    ap.add_argument("--json-schema", metavar="FILE", help="constrain every output to this JSON schema "
                    "(response_format json_schema; 'records': the schema of prompts/json_records.jsonl)")
    ap.add_argument("--compact-json", action="store_true", help="with --json-schema: send vLLM's structured_outputs "
                    "with disable_any_whitespace instead of response_format")
    args = ap.parse_args()
    if args.json_schema:
        REQUEST_EXTRA.update(json_schema_fields(args.json_schema, args.compact_json))

    if args.speculative_config:
        spec_args = ["--speculative-config", args.speculative_config]
    elif args.draft:
        spec_args = ["--draft", args.draft, "-k", str(args.num_speculative_tokens)]
    else:
        raise SystemExit("pass --draft D or --speculative-config JSON")
    common = ["--model", args.model, "--dtype", args.dtype, "--device", args.device,
              "--max-num-seqs", str(args.max_num_seqs), *shlex.split(args.serve_args)]
    tok, context = target_tokenizer(args)
    distinct = fitting(make_prompts(args, tok), args, tok, context)
    if args.abuse:
        return abuse_main(args, spec_args, common, distinct)
    n_load = args.num_requests + args.num_disconnect
    load_prompts_ = cycle(distinct, 0, args.num_requests)
    leavers = cycle(distinct, args.num_requests, args.num_disconnect)
    # The comparison sends prompts neither server has seen, each once, when there are enough: a drafter
    # that learns from earlier outputs (suffix, ngram over its cache) would otherwise be measured on
    # text it has memorized. With too few (the built-in 12), it cycles them and says so.
    fresh = len(distinct) >= n_load + comparison_size(args)
    pool = iter(cycle(distinct, n_load if fresh else 0, comparison_size(args)))
    n_tok = args.max_tokens

    spec, plain = Server("spec", common + spec_args, args.threads), Server("plain", common, args.threads)
    try:
        spec.wait_ready()
        plain.wait_ready()
        for s in (spec, plain):  # warm up
            asyncio.run(sequential(s.url, distinct[:2], 8))
        report: dict = {"model": args.model, "speculative": spec_args, "max_tokens": n_tok,
                        "json_schema": args.json_schema and f"{args.json_schema}{' compact' * args.compact_json}"}

        # 1. load on the speculative server
        t0 = time.perf_counter()
        reference = asyncio.run(sequential(spec.url, load_prompts_, n_tok))
        seq_wall = time.perf_counter() - t0
        time.sleep(0.5)
        rss_before = spec.rss_mib()
        m0 = spec.metrics()
        peak = [rss_before]

        async def load():
            async def watch():
                while True:
                    peak.append(spec.rss_mib())
                    await asyncio.sleep(0.1)

            w = asyncio.ensure_future(watch())
            try:
                return await concurrent(spec.url, load_prompts_, n_tok, leavers)
            finally:
                w.cancel()

        results, wall = asyncio.run(load())
        time.sleep(1.0)  # let the engine retire the aborted sequences and release its caches
        rss_after = spec.rss_mib()
        m1 = spec.metrics()
        mismatches = [(i, j) for i, (r, ref) in enumerate(zip(results, reference))
                      if (j := first_mismatch(ref, r.token_ids)) is not None]
        divergences = classify(args, [(load_prompts_[i], reference[i], results[i].token_ids) for i, _ in mismatches])
        tokens = sum(len(r.token_ids) for r in results)
        report["load"] = {
            "requests": len(results), "disconnected": len(leavers),
            "completed": sum(r.finish_reason is not None for r in results),
            "aborted_by_server": m1.get('specdec:request_success_total{finished_reason="abort"}', 0)
            - m0.get('specdec:request_success_total{finished_reason="abort"}', 0),
            "equal_to_sequential": len(results) - len(mismatches),
            "mismatches_first_position": mismatches,
            "divergences": divergences,
            "near_ties": sum(d["near_tie"] for d in divergences),
            "generated_tokens": tokens, "wall_s": wall, "throughput_tokens_per_s": tokens / wall,
            "valid_json": sum(parses(tok, r.token_ids) for r in results) if args.json_schema else None,
            "sequential_tokens_per_s": sum(map(len, reference)) / seq_wall,
            **latency_summary(results), **spec_counters(m0, m1),
            "server_rss_mib": {"before": rss_before, "peak": max(peak), "after": rss_after,
                               "after_over_before": rss_after / rss_before},
        }

        # 2. speculative vs plain: throughput at C concurrent, TPOT at 1 request; alternating runs
        side = {name: {"tokens": 0, "wall": 0.0, "s_tokens": 0, "s_wall": 0.0, "tpot": [], "ttft": []}
                for name in ("spec", "plain")}
        m0 = spec.metrics()
        for _ in range(args.repeats):
            batch = [next(pool) for _ in range(args.concurrency)]
            stream = [next(pool) for _ in range(args.sustained_requests)]
            for name, s in (("plain", plain), ("spec", spec)):
                res, w = asyncio.run(concurrent(s.url, batch, n_tok))  # a burst: C at once, wait for all
                side[name]["tokens"] += sum(len(r.token_ids) for r in res)
                side[name]["wall"] += w
                if stream:  # sustained: C in flight, a new request as soon as one ends
                    res, w = asyncio.run(sustained(s.url, stream, n_tok, args.concurrency))
                    side[name]["s_tokens"] += sum(len(r.token_ids) for r in res)
                    side[name]["s_wall"] += w
        for p in [next(pool) for _ in range(args.single_requests)]:
            for name, s in (("plain", plain), ("spec", spec)):
                res, _ = asyncio.run(concurrent(s.url, [p], n_tok))
                side[name]["tpot"].append(res[0].tpot)
                side[name]["ttft"].append(res[0].ttft)
        m1 = spec.metrics()
        cmp_ = {name: {"throughput_tokens_per_s": v["tokens"] / v["wall"],
                       "sustained_throughput_tokens_per_s": v["s_tokens"] / v["s_wall"] if v["s_wall"] else None,
                       "tpot_1_request_median_ms": 1e3 * statistics.median(v["tpot"]),
                       "ttft_1_request_median_ms": 1e3 * statistics.median(v["ttft"])} for name, v in side.items()}
        cmp_["throughput_ratio_spec_over_plain"] = (cmp_["spec"]["throughput_tokens_per_s"]
                                                    / cmp_["plain"]["throughput_tokens_per_s"])
        cmp_["sustained_throughput_ratio_spec_over_plain"] = (
            cmp_["spec"]["sustained_throughput_tokens_per_s"] / cmp_["plain"]["sustained_throughput_tokens_per_s"]
            if args.sustained_requests else None)
        cmp_["sustained_requests"] = args.sustained_requests
        cmp_["fresh_prompts"] = fresh
        cmp_["distinct_prompts"] = len(distinct)
        cmp_["tpot_ratio_plain_over_spec"] = (cmp_["plain"]["tpot_1_request_median_ms"]
                                              / cmp_["spec"]["tpot_1_request_median_ms"])
        cmp_["concurrency"] = args.concurrency
        cmp_.update(spec_counters(m0, m1))
        report["compare"] = cmp_
    finally:
        spec.stop()
        plain.stop()

    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    if any(not d["near_tie"] for d in divergences):
        sys.exit(1)  # a divergence that rounding cannot explain


def print_report(r: dict) -> None:
    L, C = r["load"], r["compare"]
    tau = "τ (tokens per verify pass, incl. bonus)"
    print(f"model {r['model']} | {' '.join(r['speculative'])} | greedy, {r['max_tokens']} tokens per request"
          + (f" | JSON schema {r['json_schema']}" if r["json_schema"] else ""))
    print(f"load: {L['requests']} streaming requests + {L['disconnected']} that disconnect mid-stream")
    print(f"  completed {L['completed']}/{L['requests']}, equal to sequential {L['equal_to_sequential']}/"
          f"{L['requests']}" + (f"; the others part at a near-tie of the target: {L['near_ties']}/"
                                f"{len(L['divergences'])} (gap vs threshold: "
                                + ", ".join(f"{d['gap']:.3f}/{d['threshold']:.3f}" if d["gap"] is not None else "length"
                                            for d in L["divergences"]) + ")" if L["divergences"] else ""))
    print(f"  aborted by the server: {L['aborted_by_server']:.0f} (expected {L['disconnected']})")
    if L["valid_json"] is not None:
        print(f"  outputs that parse as JSON: {L['valid_json']}/{L['requests']}")
    print(f"  throughput {L['throughput_tokens_per_s']:.1f} tokens/s ({L['generated_tokens']} tokens in "
          f"{L['wall_s']:.2f} s); one at a time: {L['sequential_tokens_per_s']:.1f} tokens/s")
    print(f"  TTFT median {L['ttft_median_ms']:.1f} ms, p95 {L['ttft_p95_ms']:.1f} ms | "
          f"TPOT median {L['tpot_median_ms']:.2f} ms, p95 {L['tpot_p95_ms']:.2f} ms")
    print(f"  acceptance rate {L['acceptance_rate']:.1%}, {tau} {L['mean_acceptance_length']:.2f}")
    m = L["server_rss_mib"]
    print(f"  server RSS: before {m['before']:.0f} MiB, peak {m['peak']:.0f} MiB, after {m['after']:.0f} MiB "
          f"({m['after_over_before']:.2f}x before)")
    print("speculative vs plain (alternating runs, same prompts; "
          + ("each prompt new to both servers):" if C["fresh_prompts"] else
             f"the {C['distinct_prompts']} prompts repeat, also from the load above):"))
    sustained = C["sustained_requests"] > 0
    for name in ("plain", "spec"):
        s = C[name]
        print(f"  {name:5}: {C['concurrency']} at once: {s['throughput_tokens_per_s']:.1f} tokens/s | "
              + (f"{C['concurrency']} in flight: {s['sustained_throughput_tokens_per_s']:.1f} tokens/s | "
                 if sustained else "")
              + f"1 request: TPOT {s['tpot_1_request_median_ms']:.2f} ms, TTFT {s['ttft_1_request_median_ms']:.1f} ms")
    print(f"  throughput, {C['concurrency']} requests at once (wall time to the last one's end), spec / plain: "
          f"{C['throughput_ratio_spec_over_plain']:.2f}x")
    if sustained:
        print(f"  throughput, {C['concurrency']} in flight over {C['sustained_requests']} requests, spec / plain: "
              f"{C['sustained_throughput_ratio_spec_over_plain']:.2f}x")
    print(f"  TPOT at 1 request, plain / spec: {C['tpot_ratio_plain_over_spec']:.2f}x")
    print(f"  acceptance rate {C['acceptance_rate']:.1%}, {tau} {C['mean_acceptance_length']:.2f}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
