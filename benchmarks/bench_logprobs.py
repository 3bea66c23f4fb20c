"""What logprobs cost under speculation: tokens/s of the shipped pair with logprobs off, logprobs=N
and processed logprobs, greedy, same process, alternating, best of --repeats; and the share of the
engine's step time spent computing them (timed inside the same runs, so load on the machine cancels).

    python benchmarks/bench_logprobs.py --logprobs 5 --batch 1
"""

from __future__ import annotations

import argparse
import time

import specdec.engine
from specdec import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef list_files(path):",
           "def quicksort(items):", "The quick brown fox", "for i in range(10):", "def parse_args():",
           "# Read a CSV file\nimport csv\n"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="specdec/demo-target")
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    spec = {"model": args.draft, "num_speculative_tokens": args.k, "adaptive": False}
    llms = {mode: LLM(args.model, backend="torch", speculative_config=spec, logprobs_mode=mode)
            for mode in ("raw_logprobs", "processed_logprobs")}
    prompts = (PROMPTS * args.batch)[: args.batch]
    cases = {"off": ("raw_logprobs", None), f"raw logprobs={args.logprobs}": ("raw_logprobs", args.logprobs),
             f"processed logprobs={args.logprobs}": ("processed_logprobs", args.logprobs)}
    best = dict.fromkeys(cases, float("inf"))
    spent = {"s": 0.0}
    record = specdec.engine.record_emitted

    def timed_record(*a):
        t0 = time.perf_counter()
        record(*a)
        spent["s"] += time.perf_counter() - t0

    specdec.engine.record_emitted = timed_record
    shares = {name: [0.0, 0.0] for name in cases}  # logprobs seconds, step seconds
    tokens = {}
    for _ in range(args.repeats):
        for name, (mode, n) in cases.items():
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=n)
            llms[mode].reset_metrics()
            spent["s"] = 0.0
            t0 = time.perf_counter()
            out = llms[mode].generate(prompts, params)
            best[name] = min(best[name], time.perf_counter() - t0)
            shares[name][0] += spent["s"]
            shares[name][1] += llms[mode].get_metrics()["step_time_s"]
            tokens[name] = [o.outputs[0].token_ids for o in out]
    assert len({str(t) for t in tokens.values()}) == 1, "logprobs changed the output"
    n_tokens = sum(len(t) for t in tokens["off"])
    tau = llms["raw_logprobs"].get_metrics()["mean_acceptance_length"]
    print(f"{args.model} + {args.draft}, k={args.k}, batch {args.batch}, {args.max_tokens} tokens each, tau {tau:.2f}")
    for name in cases:
        print(f"{name:>24}: {n_tokens / best[name]:7.1f} tok/s ({best['off'] / best[name]:.3f} of off), "
              f"logprobs {100 * shares[name][0] / shares[name][1]:.1f}% of step time")


if __name__ == "__main__":
    main()
