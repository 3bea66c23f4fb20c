"""The compiled graphs called directly (compiled.DirectGraphs) against the same graphs called through
dynamo's frame, in one process: per configuration (torch plain, draft_model, the parallel draft,
eagle3; k fixed), batch 1, each prompt run both ways back to back, the order alternating by prompt.
Toggles ``CompiledStep.direct`` / ``CompiledHeadStep.direct`` of the target and the drafter; checks
that the outputs are identical (greedy, or seeded at --temperature > 0).

    python benchmarks/direct_call.py [--num-prompts 12] [--max-tokens 128] [--k 4] [--temperature 0] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def steps_of(llm) -> list:
    """The compiled steps behind an LLM: the target's, and its drafter's model or head's where compiled."""
    out = [llm.target.compiled]
    drafter = llm.engine.drafter
    runner = getattr(drafter, "runner", None) if drafter is not None else None
    if getattr(runner, "compiled", None) is not None:
        out.append(runner.compiled)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default=str(ROOT / "benchmarks/prompts/code_heldout.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from specdec import LLM, SamplingParams
    from specdec.training.eagle3 import read_prompts_file

    prompts = read_prompts_file(args.prompts)[: args.num_prompts]
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                        seed=0 if args.temperature else None)
    fixed = {"num_speculative_tokens": args.k, "adaptive": False}
    configs = {"plain": None,
               "draft_model": {"method": "draft_model", "model": "specdec/demo-draft", **fixed},
               "pard": {"method": "draft_model", "model": "specdec/demo-draft-pard", "parallel_drafting": True, **fixed},
               "eagle3": {"method": "eagle3", "model": "specdec/demo-eagle3", **fixed}}
    llms = {name: LLM("specdec/demo-target", backend="torch", speculative_config=c) for name, c in configs.items()}
    direct = {name: [s.direct for s in steps_of(llm)] for name, llm in llms.items()}
    for name, llm in llms.items():
        assert all(d is not None for d in direct[name]), f"{name}: a compiled step without DirectGraphs (not CPU?)"
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # warm-up
    rates = {(name, on): [] for name in llms for on in (True, False)}
    outputs: dict[tuple, list] = {}
    for i, prompt in enumerate(prompts):
        for name, llm in llms.items():
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                for step, d in zip(steps_of(llm), direct[name]):
                    step.direct = d if on else None
                t0 = time.perf_counter()
                out = llm.generate([prompt], sp)[0].outputs[0].token_ids
                rates[(name, on)].append(len(out) / (time.perf_counter() - t0))
                outputs.setdefault((name, i), []).append(out)
    same = all(a == b for pair in outputs.values() for a, b in zip(pair, pair[1:]))
    print(f"[torch] {llms['plain'].target.describe()}")
    print(f"{len(prompts)} prompts x {args.max_tokens} tokens, temperature {args.temperature}, k = {args.k} fixed, "
          f"{args.threads} threads; outputs identical both ways: {same}")
    print("| configuration | direct tok/s | through dynamo tok/s | direct / dynamo |")
    print("| --- | --- | --- | --- |")
    for name in llms:
        a, b = statistics.median(rates[(name, True)]), statistics.median(rates[(name, False)])
        print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.3f}x |")


if __name__ == "__main__":
    main()
