"""``dtype="auto"`` against ``float32``, plain and speculative, in one process on the same prompts.

The four sides take turns prompt by prompt (``specdec.bench.run_bench`` with the float32 pair as
peers), so machine noise hits them alike. Prints tokens/s per side, the auto / float32 ratios and
which compute path each dtype took here.

    python benchmarks/bench_dtypes.py --prompts benchmarks/prompts/code_heldout.jsonl --num-prompts 8
"""

from __future__ import annotations

import argparse
import json

from specdec import LLM, SamplingParams
from specdec.bench import compute_paths, run_bench
from specdec.prompts import load_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="specdec/demo-target")
    p.add_argument("--draft", default="specdec/demo-draft")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompts", default="benchmarks/prompts/code_heldout.jsonl")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
    llms = {(dtype, side): LLM(args.model, dtype=dtype, speculative_config=spec if side == "spec" else None)
            for dtype in ("auto", "float32") for side in ("ar", "spec")}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    peers = {f"{side}_float32": (lambda prompt, llm=llms["float32", side]: llm.generate([prompt], params)[0]
                                 .outputs[0].token_ids) for side in ("ar", "spec")}
    records = load_prompts(args.prompts, args.num_prompts)
    r = run_bench(llms["auto", "ar"], llms["auto", "spec"], records, params, peers=peers).as_dict()
    rates = {"ar_auto": r["ar"]["tokens_per_s"], "spec_auto": r["spec"]["tokens_per_s"],
             **{name: v["tokens_per_s"] for name, v in r["peers"].items()}}
    result = {"tokens_per_s": rates,
              "auto_over_float32": {side: rates[f"{side}_auto"] / rates[f"{side}_float32"] for side in ("ar", "spec")},
              "paths": {"auto": r["paths"], "float32": compute_paths(llms["float32", "spec"])}}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{r['num_prompts']} prompts, max {r['max_tokens']} tokens, greedy, k={args.k}; tokens/s:")
    for side, name in (("ar", "plain"), ("spec", "speculative")):
        print(f"  {name:<12} auto {rates[f'{side}_auto']:.1f}  float32 {rates[f'{side}_float32']:.1f}  "
              f"auto/float32 {result['auto_over_float32'][side]:.2f}x")
    for dtype, paths in result["paths"].items():
        for side, path in paths.items():
            print(f"  {dtype} {side}: {path}")


if __name__ == "__main__":
    main()
