"""Several greedy steps in one runner call against one step per call, alternating in one process:
plain decoding with ``num_scheduler_steps`` 4 against 1, and a draft model's greedy drafts through
the runner's own ``greedy_steps`` against the base class's loop of one ``forward`` per draft.
Fresh prompts and a fresh LLM per run; medians of the runs and their ratio; outputs compared.

    python benchmarks/bench_scheduler_steps.py --target T.gguf --draft D.gguf [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent / "prompts" / "code_heldout.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="target model (a GGUF runs on llama.cpp)")
    ap.add_argument("--draft", required=True, help="draft model for the draft_model rows")
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=4, help="draft tokens per round (fixed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alternations of every configuration")
    args = ap.parse_args()

    import torch

    from specdec import LLM, SamplingParams
    from specdec.models.base import ModelRunner
    from specdec.prompts import load_prompts

    torch.set_num_threads(args.threads)
    draft_cfg = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k, "adaptive": False}
    configs = {  # name -> (LLM arguments, whether the draft runner keeps its own greedy_steps)
        "plain, 4 steps a call": ({"num_scheduler_steps": 4}, True),
        "plain, 1 step a call": ({"num_scheduler_steps": 1}, True),
        "draft, greedy drafts in one call": ({"speculative_config": draft_cfg}, True),
        "draft, one forward a draft": ({"speculative_config": draft_cfg}, False),
    }
    tok = LLM(args.target).tokenizer
    prompts = [tok.encode(r["prompt"]) for r in load_prompts(args.prompts, args.num_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in configs}
    outputs: dict[str, list[list[int]]] = {}
    names = list(configs)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            kwargs, own = configs[name]
            llm = LLM(args.target, **kwargs)
            if not own:  # the base class's loop: one forward and one argmax per draft
                runner = llm.engine.drafter.runner
                runner.greedy_steps = ModelRunner.greedy_steps.__get__(runner)
            t0, n, outs = time.perf_counter(), 0, []
            for p in prompts:  # batch 1, one request after another
                ids = llm.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids
                n, outs = n + len(ids), outs + [ids]
            rates[name].append(n / (time.perf_counter() - t0))
            outputs[name] = outs
            print(f"round {r}: {name:34s} {rates[name][-1]:7.1f} tok/s", flush=True)
    med = {name: statistics.median(v) for name, v in rates.items()}
    print(f"\n{llm.backend} backend, {args.threads} threads, {len(prompts)} prompts x {args.max_tokens} tokens, "
          f"medians of {args.rounds} rounds (tok/s, end to end):")
    for name, v in med.items():
        print(f"  {name:34s} {v:7.1f}")
    for a, b in ((names[0], names[1]), (names[2], names[3])):
        print(f"{a} / {b}: {med[a] / med[b]:.2f}x; same outputs: {outputs[a] == outputs[b]}")


if __name__ == "__main__":
    main()
