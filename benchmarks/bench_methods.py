"""Every speculative method against plain decoding, per prompt set, in one process.

For each prompt set and each method the target runs every prompt at batch 1, greedy, once plainly
and once with speculation, alternating (specdec.bench.run_bench); the table gives tokens/s of
both, their ratio, the acceptance rate and tau (tokens per verify pass, bonus included), and
checks that the outputs match token for token (near-ties aside).

    python benchmarks/bench_methods.py [--model specdec/demo-target] [--draft specdec/demo-draft]
        [--sets code_copy code_heldout random_tokens] [--methods draft_model ngram suffix layer_skip:2]
        [--num-prompts 8] [--max-tokens 128] [--json]

A method is a name with options after colons: ``draft_model``, ``draft_model:k=2:fixed``,
``ngram``, ``suffix``, ``layer_skip:2`` (num_draft_layers), ``...:k=N`` and ``...:fixed`` (adaptive off);
``draft_model:suffix`` and ``layer_skip:1:suffix`` put suffix decoding in front of the model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent / "prompts"


def method_config(spec: str, draft: str, k_default: int) -> dict:
    name, *opts = spec.split(":")
    cfg: dict = {"method": name, "num_speculative_tokens": k_default}
    for o in opts:
        if o == "fixed":
            cfg["adaptive"] = False
        elif o.startswith("k="):
            cfg["num_speculative_tokens"] = int(o[2:])
        elif o == "suffix" and name in ("draft_model", "layer_skip"):
            cfg["enable_suffix_decoding"] = True  # suffix drafts in front of the model's
        elif name == "layer_skip" and o.isdigit():
            cfg["num_draft_layers"] = int(o)
        else:
            raise ValueError(f"unknown option {o!r} in method {spec!r}")
    if name == "draft_model":
        cfg["model"] = draft
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="specdec/demo-target")
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--sets", nargs="+", default=["code_copy", "code_heldout", "random_tokens"])
    ap.add_argument("--methods", nargs="+", default=["draft_model", "ngram", "suffix", "layer_skip:2"])
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec import LLM, SamplingParams
    from specdec.bench import run_bench
    from specdec.prompts import load_prompts

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    plain = LLM(args.model)
    results = []
    for method in args.methods:
        spec = LLM(args.model, speculative_config=method_config(method, args.draft, args.k))
        for name in args.sets:
            path = Path(name) if Path(name).exists() else PROMPTS / f"{name}.jsonl"
            prompts = load_prompts(path, args.num_prompts)
            r = run_bench(plain, spec, prompts, params).as_dict()
            row = {"set": path.stem, "method": method, "ar_tokens_per_s": r["ar"]["tokens_per_s"],
                   "spec_tokens_per_s": r["spec"]["tokens_per_s"], "speedup": r["speedup"],
                   "acceptance_rate": r["spec"]["acceptance_rate"],
                   "mean_acceptance_length": r["spec"]["mean_acceptance_length"],
                   "acceptance_rate_per_pos": r["spec"]["acceptance_rate_per_pos"],
                   "decode_speedup": r["decode_speedup"],
                   "matched": r["greedy_match"]["matched"], "near_ties": r["greedy_match"]["near_ties"],
                   "prompts": r["greedy_match"]["total"]}
            results.append(row)
            if not args.json:
                per_pos = " ".join(f"{a:.2f}" for a in row["acceptance_rate_per_pos"])
                print(f"{row['set']:>14} {method:>22}  plain {row['ar_tokens_per_s']:6.1f} tok/s  "
                      f"spec {row['spec_tokens_per_s']:6.1f} tok/s  x{row['speedup']:.2f} (decode x{row['decode_speedup']:.2f})  "
                      f"accept {row['acceptance_rate']:.2f} [{per_pos}]  tau {row['mean_acceptance_length']:.2f}  "
                      f"equal {row['matched']}/{row['prompts']} +{row['near_ties']} near-tie", flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
