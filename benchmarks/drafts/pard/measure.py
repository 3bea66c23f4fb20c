"""A parallel draft (PARD) beside the autoregressive draft it was adapted from: same process, same prompts.

Per backend (torch, llama.cpp): plain decoding, then the autoregressive draft and the parallel draft
with k fixed (adaptive off), batch 1, greedy, over held-out code prompts
(benchmarks/prompts/code_heldout.jsonl: Python's own test files, which no training set here reads).
Prints tau (tokens per verify pass, bonus included), acceptance per position, draft time per round
(the engine's draft_time_s / verify passes) and end-to-end tokens/s, and the PARD / autoregressive
ratios. The engine's draft time includes each request's first catch-up, where the draft reads the
whole prompt; "steady" leaves it out: each prompt is run again for k + 2 tokens (its first rounds,
that catch-up among them), and (draft time - theirs) / (rounds - theirs) is the draft time of the
rounds after those. Plain and the two drafts alternate prompt by prompt after a warm-up, so load on a shared
machine falls on all three alike. ``--json`` writes the figures for a model card.

    python benchmarks/drafts/pard/measure.py --pard specdec/assets/demo-draft-pard --k 4
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
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--pard", required=True)
    ap.add_argument("--prompts", default=str(ROOT / "benchmarks/prompts/code_heldout.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--backends", default="torch,llama.cpp")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from specdec import LLM, SamplingParams
    from specdec.training.eagle3 import read_prompts_file

    prompts = read_prompts_file(args.prompts)[: args.num_prompts]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    out = {"args": vars(args), "backends": {}}
    for backend in args.backends.split(","):
        spec = {"method": "draft_model", "num_speculative_tokens": args.k, "adaptive": False}
        llms = {"plain": LLM(args.target, backend=backend),
                "autoregressive": LLM(args.target, backend=backend, speculative_config={**spec, "model": args.draft}),
                "pard": LLM(args.target, backend=backend,
                            speculative_config={**spec, "model": args.pard, "parallel_drafting": True})}
        for llm in llms.values():  # warm-up
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
            llm.reset_metrics()
        seconds, tokens = dict.fromkeys(llms, 0.0), dict.fromkeys(llms, 0)
        for p in prompts:
            for name, llm in llms.items():
                t0 = time.perf_counter()
                o = llm.generate([p], sp)[0]
                seconds[name] += time.perf_counter() - t0
                tokens[name] += len(o.outputs[0].token_ids)
        metrics = {name: llm.get_metrics() for name, llm in llms.items()}
        first = {name: [0.0, 0] for name in llms}  # each request's first round: its draft time, rounds
        for p in prompts:
            for name, llm in llms.items():
                m = llm.generate([p], SamplingParams(temperature=0, max_tokens=args.k + 2, ignore_eos=True))[0].metrics
                first[name][0] += m.get("spec_decoding", {}).get("draft_time_s", 0.0)
                first[name][1] += m.get("spec_decoding", {}).get("num_verify_passes", 0)
        rows = {}
        for name, llm in llms.items():
            m = metrics[name]
            steady_rounds = m["num_verify_passes"] - first[name][1]
            rows[name] = {"tok_s": tokens[name] / seconds[name], "tau": m["mean_acceptance_length"],
                          "acceptance_per_pos": m["acceptance_rate_per_pos"], "verify_passes": m["num_verify_passes"],
                          "draft_ms_per_round": 1e3 * m["draft_time_s"] / max(1, m["num_verify_passes"]),
                          "steady_draft_ms_per_round": 1e3 * (m["draft_time_s"] - first[name][0]) / max(1, steady_rounds),
                          "verify_ms_per_round": 1e3 * m["verify_time_s"] / max(1, m["num_verify_passes"])}
        ar, pard = rows["autoregressive"], rows["pard"]
        ratios = {"tau": pard["tau"] / ar["tau"], "draft_time": pard["draft_ms_per_round"] / ar["draft_ms_per_round"],
                  "steady_draft_time": pard["steady_draft_ms_per_round"] / ar["steady_draft_ms_per_round"],
                  "tok_s": pard["tok_s"] / ar["tok_s"], "pard_vs_plain": pard["tok_s"] / rows["plain"]["tok_s"],
                  "autoregressive_vs_plain": ar["tok_s"] / rows["plain"]["tok_s"]}
        out["backends"][backend] = {"rows": rows, "pard_over_autoregressive": ratios,
                                    "path": llms["plain"].target.describe()}
        print(f"[{backend}] {llms['plain'].target.describe()}", flush=True)
        for name, r in rows.items():
            per_pos = " / ".join(f"{a:.2f}" for a in r["acceptance_per_pos"])
            print(f"  {name:14s} {r['tok_s']:6.1f} tok/s  tau {r['tau']:.2f}  draft {r['draft_ms_per_round']:.2f} ms "
                  f"(steady {r['steady_draft_ms_per_round']:.2f}) verify {r['verify_ms_per_round']:.2f} ms per round  acceptance per position {per_pos}", flush=True)
        print(f"  PARD / autoregressive: tau {ratios['tau']:.2f}x, draft time per round {ratios['draft_time']:.2f}x "
              f"(steady {ratios['steady_draft_time']:.2f}x), "
              f"tok/s {ratios['tok_s']:.2f}x (vs plain: PARD {ratios['pard_vs_plain']:.2f}x, autoregressive "
              f"{ratios['autoregressive_vs_plain']:.2f}x)", flush=True)
        del llms
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
