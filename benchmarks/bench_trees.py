"""Draft trees against chains of the same method, each against plain decoding in the same process.

For each prompt set and method, three speculative settings run every prompt at batch 1, each
alternating with plain decoding (specdec.bench.run_bench): a chain of k drafts, a chain as long as
the tree's node budget, and trees of ``--nodes`` nodes of depth k and of depth ``--nodes``
(draft_tree="tree", adaptive off, so the shapes are the ones asked for). The table gives τ (tokens per verify pass, bonus included),
tokens/s and the ratio to plain, and the tree's τ and speed over the better chain's; greedy
outputs are checked against plain decoding token for token (near-ties aside).

    python benchmarks/bench_trees.py [--model specdec/demo-target] [--draft specdec/demo-draft]
        [--head specdec/demo-eagle3] [--methods draft_model suffix eagle3] [--sets code_heldout
        "$SPEC_BENCH"] [-k 4] [--nodes 16] [--top-k 4]
        [--temperature 0] [--num-prompts 8] [--max-tokens 128] [--backend torch] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent / "prompts"


def settings(method: str, draft: str, head: str, k: int, nodes: int, top_k: int) -> dict[str, dict]:
    """The three settings compared for ``method``: name -> speculative_config."""
    base: dict = {"method": method, "adaptive": False}
    if method in ("draft_model", "eagle3"):
        base["model"] = draft if method == "draft_model" else head
    return {f"chain k={k}": {**base, "num_speculative_tokens": k, "draft_tree": "chain"},
            f"chain k={nodes}": {**base, "num_speculative_tokens": nodes, "draft_tree": "chain"},
            f"tree {nodes} nodes, depth {k}": {**base, "num_speculative_tokens": k, "draft_tree": "tree",
                                                "draft_tree_max_nodes": nodes, "draft_tree_top_k": top_k},
            f"tree {nodes} nodes, depth {nodes}": {**base, "num_speculative_tokens": nodes, "draft_tree": "tree",
                                                    "draft_tree_max_nodes": nodes, "draft_tree_top_k": top_k}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="specdec/demo-target")
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--head", default="specdec/demo-eagle3")
    ap.add_argument("--methods", nargs="+", default=["draft_model", "suffix", "eagle3"])
    ap.add_argument("--sets", nargs="+", default=["code_heldout"])
    ap.add_argument("-k", type=int, default=4, help="drafts per chain; the tree's depth")
    ap.add_argument("--nodes", type=int, default=16, help="the tree's node budget")
    ap.add_argument("--top-k", type=int, default=4, help="children per tree node at most")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--backend", default="torch", help="a backend that verifies trees (torch)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec import LLM, SamplingParams
    from specdec.bench import run_bench
    from specdec.prompts import load_prompts

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                            seed=0 if args.temperature > 0 else None)
    plain = LLM(args.model, backend=args.backend)
    if not args.json:
        print(f"target {args.model}: {plain.target.describe()} ({plain.backend})", flush=True)
    results = []
    for method in args.methods:
        for name in args.sets:
            path = Path(name) if Path(name).exists() else PROMPTS / f"{name}.jsonl"
            prompts = load_prompts(path, args.num_prompts)
            rows = {}
            for label, cfg in settings(method, args.draft, args.head, args.k, args.nodes, args.top_k).items():
                spec = LLM(args.model, backend=args.backend, speculative_config=cfg)
                r = run_bench(plain, spec, prompts, params).as_dict()
                rows[label] = row = {
                    "set": path.stem, "method": method, "setting": label, "speculative_config": cfg,
                    "tau": r["spec"]["mean_acceptance_length"], "ar_tokens_per_s": r["ar"]["tokens_per_s"],
                    "spec_tokens_per_s": r["spec"]["tokens_per_s"], "speedup": r["speedup"],
                    "matched": r["greedy_match"]["matched"], "near_ties": r["greedy_match"]["near_ties"],
                    "prompts": r["greedy_match"]["total"]}
                results.append(row)
                del spec
                if not args.json:
                    print(f"{row['set']:>14} {method:>12} {label:>24}  tau {row['tau']:5.2f}  plain "
                          f"{row['ar_tokens_per_s']:6.1f} tok/s  spec {row['spec_tokens_per_s']:6.1f} tok/s  "
                          f"x{row['speedup']:.2f}  equal {row['matched']}/{row['prompts']} +{row['near_ties']} near-tie",
                          flush=True)
            chains = [r for r in rows.values() if r["setting"].startswith("chain")]
            trees = [r for r in rows.values() if r["setting"].startswith("tree")]
            best, tree = max(chains, key=lambda c: c["speedup"]), max(trees, key=lambda c: c["speedup"])
            summary = {"set": path.stem, "method": method, "best_chain": best["setting"], "best_tree": tree["setting"],
                       "tree_tau_over_chain": tree["tau"] / best["tau"],
                       "tree_speed_over_chain": tree["speedup"] / best["speedup"]}
            results.append(summary)
            if not args.json:
                print(f"{'':>14} {method:>12} best tree ({tree['setting']}) / best chain ({best['setting']}): "
                      f"τ x{summary['tree_tau_over_chain']:.2f}, end to end x{summary['tree_speed_over_chain']:.2f}",
                      flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
