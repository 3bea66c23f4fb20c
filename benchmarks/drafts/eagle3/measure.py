"""Acceptance of EAGLE-3 heads beside a draft model, same process, same prompts, k fixed.

For each temperature, runs the target with ``method: eagle3`` (each head of ``--head``, comma-separated)
and ``method: draft_model`` (the draft) through specdec's engine with the adaptive controller off, over
held-out code prompts (benchmarks/prompts/code_heldout.jsonl: Python's own test files, which no training
set here reads), and prints acceptance per position and tau (tokens per verify pass, bonus included) for each and
each head's ratio to the draft. ``--json`` writes the figures for a model card.

    python benchmarks/drafts/eagle3/measure.py --head specdec/demo-eagle3 --draft specdec/demo-draft --k 4
    python benchmarks/drafts/eagle3/measure.py --head specdec/demo-eagle3,runs/new-head --k 4  # old and new
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="specdec/demo-target")
    ap.add_argument("--head", default="specdec/demo-eagle3", help="one head or several, comma-separated")
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--prompts", default=str(ROOT / "benchmarks/prompts/code_heldout.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from specdec.training.acceptance import draft_acceptance, format_acceptance
    from specdec.training.eagle3 import read_prompts_file

    prompts = read_prompts_file(args.prompts)[: args.num_prompts]
    rows = []
    for temp in [float(t) for t in args.temperatures.split(",")]:
        taus = {}
        heads = [h for h in args.head.split(",") if h]
        runs = [(f"head{i}" if len(heads) > 1 else "head", "eagle3", h) for i, h in enumerate(heads)]
        for name, method, model in [*runs, ("draft", "draft_model", args.draft)]:
            t0 = time.time()
            r = draft_acceptance(args.target, model, prompts, k=args.k, max_tokens=args.max_tokens, temperature=temp,
                                 seed=args.seed, method=method, backend=args.backend)
            r.update(name=name, model=model, method=method, seconds=round(time.time() - t0, 1))
            rows.append(r)
            taus[name] = r["mean_acceptance_length"]
            print(f"T={temp:g} {name:5s} {model}: {format_acceptance(r)} [{r['seconds']} s]", flush=True)
        for name, _, model in runs:
            print(f"T={temp:g} tau {model} / tau draft = {taus[name] / taus['draft']:.2f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
