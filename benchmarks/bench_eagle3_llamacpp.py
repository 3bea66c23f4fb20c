"""EAGLE-3 on the llama.cpp backend (or ``--backend torch``) end to end: the head as specdec runs it by default
(drafters/eagle3.head_runner: the compiled torch head where its products run on specdec's own kernels,
else llama.cpp's eagle3 graphs), the head in llama.cpp (models/llamacpp_head.py; on the target's threads,
and its passes of up to 16 tokens on one thread), the eager torch head on one thread, the draft model and
plain decoding, in one process, alternating prompt by prompt.

Batch 1, fixed k, greedy and sampled (temperature 1, seeded per prompt), the shipped target, draft and
head by default; prints tok/s, the ratio to plain and to draft_model, τ (tokens per verify pass) and
which ran each head.

    python benchmarks/bench_eagle3_llamacpp.py --num-prompts 8 --max-tokens 96 --threads 2 --k 4
    python benchmarks/bench_eagle3_llamacpp.py --head specdec/demo-eagle3,runs/new-head --backend torch  # two heads
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PROMPTS = Path(__file__).parent / "prompts" / "code_heldout.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="specdec/demo-target")
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--head", default="specdec/demo-eagle3",
                    help="the head, or several comma-separated (each run as the default runs it; the runner "
                    "variants for the first only)")
    ap.add_argument("--backend", default="llama.cpp", choices=["llama.cpp", "torch"],
                    help="the target's backend (torch: no runner variants)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.k < 1 or args.num_prompts < 1 or args.max_tokens < 1:
        ap.error("--k, --num-prompts and --max-tokens must be positive")

    import torch

    from specdec import LLM, SamplingParams
    from specdec.drafters.eagle3 import HeadRunner, head_dtype
    from specdec.models.llamacpp_head import LlamaCppHead, describe_head

    torch.set_num_threads(args.threads)
    spec = {"num_speculative_tokens": args.k, "adaptive": False, "draft_tree": "chain"}
    heads = args.head.split(",")
    runs = {
        "plain": LLM(args.model, backend=args.backend),
        "draft_model": LLM(args.model, backend=args.backend,
                           speculative_config={"method": "draft_model", "model": args.draft, **spec}),
    }
    eagle3 = ["eagle3 (default)"]
    if args.backend == "llama.cpp":
        eagle3 += ["eagle3 (llama.cpp head)", "eagle3 (llama.cpp head, small passes on one thread)",
                   "eagle3 (torch head, eager, one thread)"]
    for name in eagle3:
        runs[name] = LLM(args.model, backend=args.backend, speculative_config={"method": "eagle3", "model": heads[0], **spec})
    for i, head in enumerate(heads[1:], 1):
        runs[f"eagle3 (default), head {i}"] = LLM(args.model, backend=args.backend,
                                                  speculative_config={"method": "eagle3", "model": head, **spec})
    if args.backend == "llama.cpp":
        for name in eagle3[1:3]:  # llama.cpp's eagle3 graphs, whatever the default (drafters/eagle3.head_runner)
            d = runs[name].engine.drafter
            if not isinstance(d.runner, LlamaCppHead):
                d.runner, d.can_draft_trees = LlamaCppHead(d.head, d.target), False
        runs[eagle3[2]].engine.drafter.runner.one_thread_tokens = 16
        d = runs[eagle3[3]].engine.drafter
        d.runner, d.can_draft_trees = HeadRunner(d.head, head_dtype(d.target), d.device), True  # eager: one thread
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = prompts[: args.num_prompts]
    print(f"{runs['plain'].target.describe()}; k={args.k}; {len(prompts)} prompts x {args.max_tokens} tokens")
    for name in [n for n in runs if n.startswith("eagle3")]:
        print(f"{name}: {describe_head(runs[name].engine.drafter.runner)}")
    for i, head in enumerate(heads):
        print(f"head {i}: {head}")
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        seconds = dict.fromkeys(runs, 0.0)
        tokens = dict.fromkeys(runs, 0)
        for llm in runs.values():  # warm-up
            llm.generate([prompts[0]], SamplingParams(temperature=temperature, max_tokens=16, seed=0))
        before = {n: llm.get_metrics() for n, llm in runs.items()}
        for i, prompt in enumerate(prompts):
            for name, llm in runs.items():
                sp = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=i)
                t0 = time.perf_counter()
                out = llm.generate([prompt], sp)
                seconds[name] += time.perf_counter() - t0
                tokens[name] += len(out[0].outputs[0].token_ids)
        rate = {n: tokens[n] / seconds[n] for n in runs}
        print(f"\ntemperature {temperature:g}")
        print("| configuration | tok/s | x plain | x draft_model | τ |")
        print("| --- | --- | --- | --- | --- |")
        for name in runs:
            m, b = runs[name].get_metrics(), before[name]
            passes = m.get("num_drafts", 0) - b.get("num_drafts", 0)
            accepted = m.get("num_accepted_tokens", 0) - b.get("num_accepted_tokens", 0)
            tau = f"{1 + accepted / passes:.2f}" if passes else "-"
            print(f"| {name} | {rate[name]:.1f} | {rate[name] / rate['plain']:.2f}x | "
                  f"{rate[name] / rate['draft_model']:.2f}x | {tau} |")


if __name__ == "__main__":
    main()
