"""Adaptive k against fixed k and plain decoding, alternating prompt by prompt in one process.

Batch 1, greedy, the shipped pair by default; prints tok/s, the ratio to plain, τ (tokens per verify
pass, the bonus or recovered token included) and the adaptive controller's ratio to the best fixed k
(issue target: ≥ 0.97x; ≥ 0.98x plain where nothing pays). ``--trace``: what the controller chose,
how often and why (AdaptiveK.trace), and its last estimate of S(k).

    python benchmarks/bench_adaptive.py --backend llama.cpp --num-prompts 6 --max-tokens 96 --threads 1 \
        --ks 1,2,3,4,5,6,7,8 --adaptive-k 8 --trace
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

PROMPTS = Path(__file__).parent / "prompts"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="specdec/demo-target")
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--method", default="draft_model", help="draft_model (with --draft), ngram or suffix")
    ap.add_argument("--backend", default="llama.cpp", choices=["llama.cpp", "torch"])
    ap.add_argument("--set", default="code_heldout", help="a prompt set in benchmarks/prompts")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--ks", default="1,2,3,4", help="fixed k to run")
    ap.add_argument("--adaptive-k", default="4,8", help="largest k of each adaptive run")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--trace", action="store_true", help="print the adaptive runs' decisions")
    ap.add_argument("--unpaced", action="store_true", help="also each adaptive run with its learning rounds unpaced "
                    "(adaptive/pace.py), for comparison")
    args = ap.parse_args()
    if args.method not in ("draft_model", "ngram", "suffix"):
        ap.error(f"--method must be draft_model, ngram or suffix, got {args.method!r}")

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec import LLM, SamplingParams
    from specdec.prompts import load_prompts

    prompts = [p["prompt"] for p in load_prompts(PROMPTS / f"{args.set}.jsonl", args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def spec(k: int, adaptive: bool) -> dict:
        cfg = {"method": args.method, "num_speculative_tokens": k, "adaptive": adaptive}
        return cfg | {"model": args.draft} if args.method == "draft_model" else cfg

    configs = {"plain": None} | {f"k={k} fixed": spec(int(k), False) for k in args.ks.split(",")} \
        | {f"adaptive k<={k}": spec(int(k), True) for k in args.adaptive_k.split(",")} \
        | ({f"adaptive k<={k} unpaced": spec(int(k), True) for k in args.adaptive_k.split(",")} if args.unpaced else {})
    llms = {}
    for name, cfg in configs.items():
        llms[name] = LLM(args.model, speculative_config=cfg, backend=args.backend,
                         enforce_eager=args.enforce_eager or None)
        if name.endswith("unpaced"):
            llms[name].engine.controller.pacer.share = float("inf")
        llms[name].generate([prompts[0]], params)  # warm-up
        if args.trace and llms[name].engine.controller is not None:
            llms[name].engine.controller.trace = []
    names = list(configs)
    before = {n: llms[n].get_metrics() for n in names}
    tokens, seconds = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0)
    for _ in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for n in names[i % len(names):] + names[:i % len(names)]:  # a rotating order per prompt
                t0 = time.perf_counter()
                out = llms[n].generate([prompt], params)[0].outputs[0]
                seconds[n] += time.perf_counter() - t0
                tokens[n] += len(out.token_ids)
    tps = {n: tokens[n] / seconds[n] for n in names}
    target = llms["plain"].target
    print(f"backend {llms['plain'].backend}, target dtype {getattr(target, 'dtype', '?')}, "
          f"compiled {not args.enforce_eager if args.backend == 'torch' else '-'}: {llms['plain'].backend_reason}")
    for n in names:
        m, b = llms[n].get_metrics(), before[n]
        passes = m["num_drafts"] - b["num_drafts"]
        tau = 1 + (m["num_accepted_tokens"] - b["num_accepted_tokens"]) / passes if passes else None
        print(f"{n:>16}: {tps[n]:7.1f} tok/s  {tps[n] / tps['plain']:5.2f}x plain  "
              f"τ {'-' if tau is None else f'{tau:.2f}'}  drafted tokens {m['num_draft_tokens'] - b['num_draft_tokens']}")
    best = max(tps[n] for n in names if n.endswith("fixed"))
    for n in names:
        if n.startswith("adaptive"):
            print(f"{n}: {tps[n] / best:.3f}x the best fixed k")
            if args.trace:
                print_trace(llms[n].engine.controller)


def print_trace(controller) -> None:
    """How often each k was chosen and why, and the controller's last estimate of S(0..k_max) with the
    verify line and draft cost behind it (batch 1)."""
    from collections import Counter

    trace = controller.trace
    counts = Counter((k, why) for _, k, why, _ in trace)
    print("  decisions (k, why): " + ", ".join(f"{k}/{why} x{c}" for (k, why), c in sorted(counts.items())))
    drafted = [(r, k, why, est) for r, k, why, est in trace if k > 0 and why != "held"]
    print("  drafting decisions (round: k why [S(k) at that k]): " + ", ".join(
        f"{r}: {k} {why}" + (f" [{est[k]:.2f}]" if est is not None else "") for r, k, why, est in drafted[:60]))
    last = next((est for *_, est in reversed(trace) if est is not None), None)
    if last is not None:
        print("  last S(k): " + " ".join(f"{s:.2f}" for s in last))
    line = controller.verify_line(1)
    t1 = line(1)
    print("  v(T) / t1, T=1..9: " + " ".join(f"{line(T) / t1:.2f}" for T in range(1, 10))
          + f"   c: {controller.costs.draft_cost(1, t1) / t1:.3f}   host work per round: "
          f"{controller.costs.overhead(1, plain=False) / t1:.2f}, per plain token: {controller.costs.overhead(1, plain=True) / t1:.2f}")
    timed = {T: len(em.samples) for (b, T), em in controller.verify_time.items() if b == 1}
    print(f"  verify samples per T: {dict(sorted(timed.items()))}")
    alphas = controller.acceptance.batch_alphas(controller.k_max)
    print("  batch alpha_i: " + " ".join(f"{a:.2f}" for a in alphas)
          + "   reached: " + " ".join(f"{r:.0f}" for r in controller.acceptance.batch.reached))


if __name__ == "__main__":
    main()
