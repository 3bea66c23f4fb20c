"""Whether the adaptive controller drafts again after a busy stretch: other processes spin on every core
while one engine warms up and decodes its first prompts, then stop; each prompt's tok/s, τ and the
controller's decisions (AdaptiveK.trace) are printed. Without load (``--busy-procs 0``) it gives the same
prompts' figures for comparison. Batch 1, greedy, the shipped pair by default, held-out code prompts.

    python benchmarks/adaptive_after_load.py --busy-procs 2 --busy-prompts 2 --backend torch
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent / "prompts" / "code_heldout.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="specdec/demo-target")
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--backend", default="torch", choices=["llama.cpp", "torch"])
    ap.add_argument("--k", type=int, default=8, help="the adaptive controller's largest k")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--busy-procs", type=int, default=2, help="processes spinning during the busy stretch")
    ap.add_argument("--busy-prompts", type=int, default=2, help="prompts decoded while they spin (after the warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.num_prompts < 1 or args.max_tokens < 1 or args.busy_procs < 0 or args.busy_prompts < 0:
        ap.error("--num-prompts and --max-tokens must be at least 1, --busy-procs and --busy-prompts at least 0")

    import torch

    from specdec import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, backend=args.backend, speculative_config={
        "method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k})
    controller = llm.engine.controller
    controller.trace = []
    rows = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = [llm.tokenizer.encode(p) for p in rows[:args.num_prompts + 1]]
    warm, prompts = prompts[-1], prompts[:-1]
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy_procs)]
    try:
        llm.generate([{"prompt_token_ids": warm}], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        llm.reset_metrics()
        controller.trace.clear()
        sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        for i, ids in enumerate(prompts):
            if i == args.busy_prompts:
                for p in busy:
                    p.kill()
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], sp)
            seconds = time.perf_counter() - t0
            tau = llm.get_metrics().get("mean_acceptance_length") or 1.0
            llm.reset_metrics()
            decisions = collections.Counter((k, why) for _, k, why, _ in controller.trace)
            controller.trace.clear()
            state = "busy" if i < args.busy_prompts and busy else "quiet"
            print(f"prompt {i + 1} ({state}): {args.max_tokens / seconds:7.1f} tok/s  τ {tau:.2f}  decisions "
                  + ", ".join(f"k={k} {why} x{n}" for (k, why), n in decisions.most_common(4)), flush=True)
    finally:
        for p in busy:
            p.kill()


if __name__ == "__main__":
    main()
