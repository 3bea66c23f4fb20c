"""Does distillation help? Two drafts of the same shape against the shipped target.

- ``specdec/demo-draft``: distilled from the target's logits (forward KL), the shipped draft;
- ``benchmarks/drafts/corpus-only-128x2``: the same architecture (hidden 128, 2 layers) trained
  on the same corpus with the same steps, tokens, schedule and seed, from the text alone (no
  target): ``specdec train`` with the target's tokenizer (its model card has the command).

Both run against ``specdec/demo-target`` on held-out code (prefixes of the standard library's
``test/`` files, never trained on: benchmarks/prompts/code_heldout.jsonl), k fixed so that every
round drafts k tokens, greedy and at temperature 1. Prints acceptance rate, acceptance per draft
position (share of rounds whose positions 1..j were all accepted) and tau (tokens per verify
pass, bonus included); ``--speed`` adds tokens/s against plain decoding in the same process.

    python benchmarks/compare_drafts.py [--num-prompts 24] [--max-tokens 128] [-k 4] [--speed] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
DRAFTS = {"distilled": "specdec/demo-draft", "corpus-only": str(HERE / "drafts" / "corpus-only-128x2")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="specdec/demo-target")
    ap.add_argument("--prompts", default=str(HERE / "prompts" / "code_heldout.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--speed", action="store_true", help="also time both drafts against plain decoding (batch 1)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from specdec.prompts import load_prompts
    from specdec.training.acceptance import draft_acceptance, format_acceptance

    prompts = load_prompts(Path(args.prompts), args.num_prompts)
    rows = []
    for name, draft in DRAFTS.items():
        for temperature in (0.0, 1.0):
            r = draft_acceptance(args.target, draft, prompts, k=args.k, max_tokens=args.max_tokens,
                                 temperature=temperature, seed=0)
            rows.append({"draft": name, "path": draft, **r})
            if not args.json:
                print(f"{name:>12}: {format_acceptance(r)}", flush=True)
    if args.speed:
        rows += speed(args, prompts)
    if args.json:
        print(json.dumps(rows))


def speed(args, prompts) -> list[dict]:
    from specdec import LLM, SamplingParams
    from specdec.bench import run_bench

    plain = LLM(args.target)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    out = []
    for name, draft in DRAFTS.items():
        spec = LLM(args.target, speculative_config={"method": "draft_model", "model": draft,
                                                    "num_speculative_tokens": args.k})
        r = run_bench(plain, spec, prompts[:8], params).as_dict()
        out.append({"draft": name, "speedup": r["speedup"], "ar_tokens_per_s": r["ar"]["tokens_per_s"],
                    "spec_tokens_per_s": r["spec"]["tokens_per_s"]})
        if not args.json:
            print(f"{name:>12}: greedy, adaptive k<={args.k}, 8 prompts: plain {r['ar']['tokens_per_s']:.1f} tok/s, "
                  f"speculative {r['spec']['tokens_per_s']:.1f} tok/s, x{r['speedup']:.2f}", flush=True)
    return out


if __name__ == "__main__":
    main()
