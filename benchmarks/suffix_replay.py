"""Replay greedy token traces through suffix-decoding caches offline and compare their acceptance (τ).

The traces are the shipped target's plain greedy outputs (``specdec/assets/demo-target``) for a few
Spec-Bench prompts per category (first turns; ``--spec-bench`` or $SPEC_BENCH, default
../shared/data/spec_bench/question.jsonl) and for benchmarks/prompts' sets (code by default); they are generated
once and kept in ``--traces``. Each cache is then shown the same requests, ``--in-flight`` at a time,
in rounds as the engine runs them: every running request drafts up to k tokens from its history, the
drafts are accepted while they equal the trace (greedy verification), and the accepted tokens plus
the bonus token are committed; a finished request is released and the next one starts. τ is the
committed tokens per verify pass (mean accepted + 1), per prompt set.

Caches:
- ``ours``: specdec's SuffixDrafter as it is in the working tree, with each probability estimate
  (``continuations``, ``occurrences``);
- ``baseline``: SuffixDrafter at git revision ``--baseline-rev`` (before in-flight outputs joined
  the global trie), loaded from ``git show``;
- ``arctic``: Arctic Inference's SuffixDecodingCache (what vLLM's ``method: suffix`` runs), driven
  as vLLM drives it, in the Python given by ``--arctic-python`` (a venv with ``arctic-inference``;
  its replay runs there as ``--replay-arctic``, since it needs neither torch nor specdec).

    python3 -m venv /tmp/arctic && /tmp/arctic/bin/pip install arctic-inference numpy
    python benchmarks/suffix_replay.py --arctic-python /tmp/arctic/bin/python [--in-flight 1 8] [--k 8]
    # a second trace set: the next 4 Spec-Bench prompts per category and the JSON records
    python benchmarks/suffix_replay.py --traces /tmp/suffix_traces_heldout.jsonl --skip-per-category 4 \
        --sets json_records --arctic-python /tmp/arctic/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "benchmarks" / "prompts"
DEPTH, FACTOR, MIN_PROB = 24, 1.0, 0.1  # vLLM's and specdec's defaults


# -- the replay (pure Python: it also runs in the Arctic venv) ---------------------------------------


def replay(traces: list[dict], cache, k: int, in_flight: int) -> dict[str, list[float]]:
    """Run the traces through ``cache`` (start / draft / commit / stop) ``in_flight`` at a time; per
    prompt set, [tokens committed in drafting rounds, verify passes, seconds spent in the cache]. The
    first output token comes from the prefill, undrafted, as in the engine and in vLLM."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    clock = time.perf_counter
    waiting = list(range(len(traces)))[::-1]
    running: dict[int, int] = {}  # trace index -> output tokens committed
    while waiting or running:
        while waiting and len(running) < in_flight:
            i = waiting.pop()
            t0 = clock()
            cache.start(i, traces[i]["prompt"], traces[i]["output"][:1])
            totals[traces[i]["set"]][2] += clock() - t0
            running[i] = 1
        drafts = {}
        for i, n in running.items():
            if n < len(traces[i]["output"]):
                t0 = clock()
                drafts[i] = cache.draft(i, k)
                totals[traces[i]["set"]][2] += clock() - t0
        for i, draft in drafts.items():  # verify: drafts accepted while they equal the trace
            out, n = traces[i]["output"], running[i]
            a = 0
            while a < len(draft) and n + a < len(out) and draft[a] == out[n + a]:
                a += 1
            new = out[n:n + a + 1]
            t = totals[traces[i]["set"]]
            t0 = clock()
            cache.commit(i, new)
            t[2] += clock() - t0
            running[i] = n + len(new)
            t[0] += len(new)
            t[1] += 1
        for i in [i for i, n in running.items() if n >= len(traces[i]["output"])]:
            t0 = clock()
            cache.stop(i)
            totals[traces[i]["set"]][2] += clock() - t0
            del running[i]
    return dict(totals)


class ArcticCache:
    """Arctic Inference's SuffixDecodingCache, called as vLLM's SuffixDecodingProposer calls it."""

    def __init__(self, max_cached_requests: int):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=DEPTH, max_cached_requests=max_cached_requests)
        self.history: dict[int, list[int]] = {}

    def start(self, i, prompt, first):
        if i in self.cache.cached_requests:
            self.cache.evict_cached_response(i)
        self.cache.start_request(i, prompt)
        self.history[i] = list(prompt)
        self.commit(i, first)

    def draft(self, i, k):
        h = self.history[i]
        return list(self.cache.speculate(i, h[-DEPTH:], max_spec_tokens=k, max_spec_factor=FACTOR,
                                         min_token_prob=MIN_PROB).token_ids)

    def commit(self, i, tokens):
        self.history[i] += tokens
        self.cache.add_active_response(i, tokens)

    def stop(self, i):
        self.cache.stop_request(i)
        del self.history[i]


# -- specdec's drafters ----------------------------------------------------------------------------


class OursCache:
    """A specdec SuffixDrafter, shown the requests as the engine shows them (Sequence objects)."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.seqs = {}

    def start(self, i, prompt, first):
        import torch

        from specdec import SamplingParams
        from specdec.sequence import Sequence

        s = self.seqs[i] = Sequence(list(prompt), SamplingParams(temperature=0), torch.Generator(), 10**9)
        s.token_ids += first

    def draft(self, i, k):
        return self.drafter.draft(self.seqs[i], k)[0]

    def commit(self, i, tokens):
        self.seqs[i].token_ids += tokens

    def stop(self, i):
        self.drafter.release([self.seqs.pop(i)])


def baseline_module(rev: str) -> types.ModuleType:
    """specdec/drafters/suffix.py as it was at git revision ``rev``."""
    src = subprocess.run(["git", "show", f"{rev}:specdec/drafters/suffix.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    mod = types.ModuleType("suffix_baseline")
    mod.__dict__["__name__"] = "suffix_baseline"
    sys.modules["suffix_baseline"] = mod
    exec(compile(src, f"suffix.py@{rev}", "exec"), mod.__dict__)
    return mod


# -- traces ----------------------------------------------------------------------------------------


def make_traces(path: Path, spec_bench: Path, per_category: int, skip: int, sets: list[str], per_set: int,
                max_tokens: int) -> None:
    """The shipped target's plain greedy outputs, written to ``path`` (JSONL), for Spec-Bench's first turns
    (``per_category`` of each category after its first ``skip``) and the first ``per_set`` prompts of each
    of benchmarks/prompts' ``sets``."""
    import torch

    from specdec import LLM, SamplingParams

    torch.set_num_threads(1)
    prompts: list[tuple[str, str]] = []  # (set, text)
    seen: dict[str, int] = defaultdict(int)
    for line in spec_bench.read_text().splitlines():
        q = json.loads(line)
        seen[q["category"]] += 1
        if skip < seen[q["category"]] <= skip + per_category:
            prompts.append(("spec_bench", q["turns"][0]))
    for name in sets:
        for line in (PROMPTS / f"{name}.jsonl").read_text().splitlines()[:per_set]:
            prompts.append((name, json.loads(line)["prompt"]))
    llm = LLM(str(ROOT / "specdec" / "assets" / "demo-target"), backend="torch")
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt": p} for _, p in prompts], sp)
    with path.open("w") as f:
        for (name, _), o in zip(prompts, outs):
            if len(o.outputs[0].token_ids) > 1:
                f.write(json.dumps({"set": name, "prompt": list(o.prompt_token_ids),
                                    "output": list(o.outputs[0].token_ids)}) + "\n")


def tau(totals: dict[str, list[float]]) -> dict[str, float]:
    """τ per prompt set and over all, and the microseconds spent in the cache per verify pass."""
    out = {name: t[0] / t[1] for name, t in sorted(totals.items())}
    passes = sum(t[1] for t in totals.values())
    out["all"] = sum(t[0] for t in totals.values()) / passes
    out["us/pass"] = 1e6 * sum(t[2] for t in totals.values()) / passes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=Path("/tmp/suffix_traces.jsonl"))
    ap.add_argument("--spec-bench", type=Path, default=Path(os.environ.get(
        "SPEC_BENCH", ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl")))
    ap.add_argument("--per-category", type=int, default=4, help="Spec-Bench prompts per category")
    ap.add_argument("--skip-per-category", type=int, default=0, help="Spec-Bench prompts per category to skip")
    ap.add_argument("--sets", nargs="*", default=["code_heldout", "code_copy"], help="benchmarks/prompts sets")
    ap.add_argument("--per-set", type=int, default=24, help="prompts of each of those sets")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=8, help="the most drafts per round")
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-cached-requests", type=int, default=1000)
    ap.add_argument("--baseline-rev", default="6cdacdd", help="git revision of the suffix drafter to compare")
    ap.add_argument("--repeat", type=int, default=3, help="replays of each cache (timings: the median)")
    ap.add_argument("--arctic-python", help="a Python with arctic-inference installed")
    ap.add_argument("--replay-arctic", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    traces = lambda: [json.loads(line) for line in args.traces.read_text().splitlines()]  # noqa: E731

    if args.replay_arctic:  # in the Arctic venv: print its totals per in-flight count
        print(json.dumps({b: replay(traces(), ArcticCache(args.max_cached_requests), args.k, b)
                          for b in args.in_flight}))
        return
    if not args.traces.exists():
        make_traces(args.traces, args.spec_bench, args.per_category, args.skip_per_category, args.sets,
                    args.per_set, args.max_tokens)
    from specdec.drafters.suffix import SuffixDrafter

    old = baseline_module(args.baseline_rev).SuffixDrafter
    kw = dict(max_tree_depth=DEPTH, max_cached_requests=args.max_cached_requests, max_spec_factor=FACTOR,
              min_token_prob=MIN_PROB)
    caches = {f"baseline@{args.baseline_rev}": lambda: OursCache(old(**kw)),
              "ours continuations": lambda: OursCache(SuffixDrafter(**kw, probability="continuations")),
              "ours occurrences": lambda: OursCache(SuffixDrafter(**kw, probability="occurrences"))}
    results: dict[int, dict[str, dict[str, float]]] = {b: {} for b in args.in_flight}
    times: dict[tuple[int, str], list[float]] = defaultdict(list)
    for _ in range(args.repeat):  # the caches alternate, so their timings share the machine's load
        for b in args.in_flight:
            for name, make in caches.items():
                results[b][name] = tau(replay(traces(), make(), args.k, b))
                times[b, name].append(results[b][name]["us/pass"])
    for (b, name), ts in times.items():
        results[b][name]["us/pass"] = statistics.median(ts)
    if args.arctic_python:
        cmd = [args.arctic_python, __file__, "--replay-arctic", "--traces", str(args.traces), "--k", str(args.k),
               "--max-cached-requests", str(args.max_cached_requests), "--in-flight", *map(str, args.in_flight)]
        arctic = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        for b in args.in_flight:
            results[b]["arctic"] = tau(arctic[str(b)])
    counts = defaultdict(int)
    for t in traces():
        counts[t["set"]] += 1
    print(f"traces: {dict(counts)} from {args.traces}; k={args.k}, depth {DEPTH}, max_spec_factor {FACTOR}, "
          f"min_token_prob {MIN_PROB}, max_cached_requests {args.max_cached_requests}")
    for b, rows in results.items():
        sets = list(next(iter(rows.values())))
        print(f"\nin flight {b}: tau per prompt set; us/pass: time in the cache (start, draft, commit, "
              "release) per verify pass, median of the alternating replays")
        print(f"{'cache':<28}" + "".join(f"{s:>14}" for s in sets))
        for name, r in rows.items():
            print(f"{name:<28}" + "".join(f"{r[s]:>14.4f}" for s in sets))


if __name__ == "__main__":
    main()
