"""The adaptive controller's decisions replayed on real acceptance, with a known cost table.

Greedy decoding with a deterministic draft accepts, at each output position p, the drafts that match the
target's own greedy continuation: a round that starts at p with k drafts accepts min(k, L(p)), where L(p)
is how many positions from p on the draft's argmax (given the true prefix) equals the target's token. One
teacher-forced forward of the draft over prompt + output gives every L(p). This script takes the target's
greedy outputs from specdec (plain decoding), L(p) from the draft (transformers, float32), and replays
rounds at fixed k = 1..k_max and under ``AdaptiveK`` with the same cost table (ms: a verify pass of T
tokens, a round's k draft steps, host work per round; the controller's own time per weighing and per
round), noise-free and noisy as a shared machine is (±10%, 1 pass in 20 preempted 3x). It prints each
configuration's simulated tok/s and the adaptive controller's ratio to the best fixed k: what its
decisions and its own time cost, without the machine's drift between runs (benchmarks/bench_adaptive.py
measures everything together). ``--weigh-us 0 --controller-us 0``: the decisions alone.

    python benchmarks/adaptive_replay.py --num-prompts 6 --max-tokens 96 --seeds 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent / "prompts"
# Measured on EPYC-Zen5 (torch, bf16 weights, compiled step; shipped pair; 2 threads), 2026-12-05: each fixed
# k's engine over 8 held-out prompts, its verify and draft time per round; T = 1 the adaptive engine's plain step.
VERIFY_MS = "1.21,1.17,1.25,1.27,1.37,1.33,1.46,1.44,1.45"  # T = 1..9
DRAFT_MS = "0.25,0.47,0.55,0.65,0.73,0.81,0.89,0.96"  # a round's k draft steps, k = 1..8


def match_runs(target_out: list[int], draft_argmax: list[int], k_max: int) -> list[int]:
    """L(p) for each output position p, at most k_max: the run of positions j >= p where the draft's
    argmax after the true prefix (``draft_argmax[j]``) is the target's token ``target_out[j]``  [N]."""
    runs = [0] * (len(target_out) + 1)
    for j in range(len(target_out) - 1, -1, -1):
        runs[j] = min(k_max, runs[j + 1] + 1) if draft_argmax[j] == target_out[j] else 0
    return runs[:-1]


def replay(runs_per_prompt: list[list[int]], k: int | None, k_max: int, verify_s: list[float], draft_s: list[float],
           host_s: float, rng: random.Random | None, trace: list | None = None, warmup: bool = True,
           weigh_s: float = 0.0, controller_s: float = 0.0, drift: list[float] | None = None,
           drift_s: float = 0.02) -> tuple[float, int]:
    """(seconds, tokens) of decoding every prompt's output after its first token, at fixed ``k`` or
    (None) adaptive up to ``k_max``. ``rng``: noisy timings (what the controller sees is what it costs).
    ``warmup``: the first prompt is decoded once before, untimed, as bench_adaptive.py warms each engine.
    ``weigh_s``, ``controller_s``: the controller's own host time per weighing of k (a decision not held)
    and per round (its bookkeeping), charged to the adaptive run. ``drift``: the machine's speed drifts,
    every cost times ``drift[i]`` in the i-th stretch of ``drift_s`` seconds (the same for every
    configuration: a neighbour's job that comes and goes)."""
    from specdec.adaptive import AdaptiveK

    ctrl = AdaptiveK(k_max) if k is None else None
    if ctrl is not None:
        ctrl.trace = trace if trace is not None else []
    seconds, tokens = 0.0, 0

    def noise() -> float:
        slow = 1.0 if drift is None else drift[int(seconds / drift_s) % len(drift)]
        return slow if rng is None else slow * rng.uniform(0.9, 1.1) * (3.0 if rng.random() < 0.05 else 1.0)

    for sid, runs in enumerate(runs_per_prompt[:1] * warmup + runs_per_prompt):
        if warmup and sid == 1:
            seconds, tokens = 0.0, 0
            if ctrl is not None:
                ctrl.trace.clear()
        p = 1  # the first output token came from the prefill
        while p < len(runs):
            kk = k
            if ctrl is not None:
                kk = ctrl.choose([sid])[0]
                seconds += controller_s + (weigh_s if ctrl.trace[-1][3] is not None else 0.0)  # S(k) estimated: weighed
            kk = min(kk, len(runs) - p - 1)  # no drafts past the last token asked for
            n = noise()
            if kk == 0:
                v, d, a = verify_s[0] * n, 0.0, 0
            else:
                v, d, a = verify_s[kk] * n, draft_s[kk - 1] * n, min(kk, runs[p])
            if ctrl is not None:
                ctrl.record([sid], [kk], [a], d, v)
            seconds += v + d + host_s * n
            tokens += a + 1
            p += a + 1
        if ctrl is not None:
            ctrl.release([sid])
    return seconds, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="specdec/demo-target")
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--set", default="code_heldout", help="a prompt set in benchmarks/prompts")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--verify-ms", default=VERIFY_MS, help="a verify pass of T = 1..k_max+1 tokens, ms")
    ap.add_argument("--draft-ms", default=DRAFT_MS, help="a round's k = 1..k_max draft steps, ms")
    ap.add_argument("--host-ms", type=float, default=0.04, help="host work per round, ms")
    ap.add_argument("--weigh-us", type=float, default=128.0, help="the controller's host time per weighing of k, us "
                    "(measured in the engine right after its forward calls, EPYC-Zen5)")
    ap.add_argument("--controller-us", type=float, default=25.0, help="... and per round, us")
    ap.add_argument("--seeds", type=int, default=8, help="noisy replays (0: noise-free only)")
    ap.add_argument("--drift", type=float, default=0.0, help="noisy replays drift too: every 20 ms of decoding the "
                    "machine's speed is divided by a factor drawn from 1..1+drift (a shared machine's neighbours)")
    ap.add_argument("--trace", action="store_true", help="print the noise-free adaptive run's decisions")
    ap.add_argument("--no-warmup", action="store_true", help="no untimed first prompt before the timed ones")
    args = ap.parse_args()
    try:
        verify = [float(x) / 1e3 for x in args.verify_ms.split(",")]
        draft = [float(x) / 1e3 for x in args.draft_ms.split(",")]
    except ValueError:
        ap.error("--verify-ms and --draft-ms take comma-separated milliseconds, e.g. 1.2,1.3,1.3")
    if min(verify + draft) <= 0 or args.host_ms < 0 or args.weigh_us < 0 or args.controller_us < 0 or args.drift < 0:
        ap.error("costs must be positive (--verify-ms, --draft-ms) and --host-ms, --weigh-us, --controller-us, "
                 "--drift at least 0")
    if len(verify) < args.k_max + 1 or len(draft) < args.k_max:
        ap.error(f"--verify-ms needs {args.k_max + 1} values and --draft-ms {args.k_max} for --k-max {args.k_max}")
    if args.num_prompts < 1 or args.max_tokens < 2 or args.seeds < 0:
        ap.error("--num-prompts must be >= 1, --max-tokens >= 2, --seeds >= 0")

    import torch
    from transformers import AutoModelForCausalLM

    from specdec import LLM, SamplingParams
    from specdec.models.resolve import resolve_model_path
    from specdec.prompts import load_prompts

    t0 = time.perf_counter()
    prompts = [p["prompt"] for p in load_prompts(PROMPTS / f"{args.set}.jsonl", args.num_prompts)]
    llm = LLM(args.model)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.draft), dtype=torch.float32).eval()
    runs_per_prompt = []
    with torch.inference_mode():
        for out in outs:
            prompt, gen = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
            ids = torch.tensor([prompt + gen])
            argmax = model(ids).logits[0].argmax(-1).tolist()  # [len]: the draft's next token after each prefix
            runs_per_prompt.append(match_runs(gen, argmax[len(prompt) - 1:len(prompt) - 1 + len(gen)], args.k_max))
    print(f"{len(prompts)} prompts x {args.max_tokens} tokens; L(p) from {args.draft} in {time.perf_counter() - t0:.1f} s; "
          f"mean L {statistics.mean(x for r in runs_per_prompt for x in r):.2f}")
    print(f"costs (ms): verify T=1..{args.k_max + 1} {args.verify_ms}; draft rounds k=1..{args.k_max} {args.draft_ms}; "
          f"host {args.host_ms} per round; the controller's own {args.weigh_us:.0f} us a weighing, "
          f"{args.controller_us:.0f} us a round")

    host = args.host_ms / 1e3
    configs = [f"k={k}" for k in range(1, args.k_max + 1)] + ["adaptive"]
    rngs = [None] + [random.Random(s) for s in range(args.seeds)]
    ratios = []
    for i, rng in enumerate(rngs):
        tps = {}
        for name in configs:
            k = None if name == "adaptive" else int(name[2:])
            state = rng.getstate() if rng is not None else None
            trace = [] if (args.trace and rng is None and k is None) else None
            slow = random.Random(1000 + i)
            drift = None if rng is None or not args.drift else [slow.uniform(1.0, 1.0 + args.drift) for _ in range(1000)]
            s, n = replay(runs_per_prompt, k, args.k_max, verify, draft, host, rng, trace, not args.no_warmup,
                          args.weigh_us / 1e6, args.controller_us / 1e6, drift)
            if rng is not None:
                rng.setstate(state)  # every configuration sees the same noise sequence
            tps[name] = n / s
            if trace:
                print("decisions (round, k, why):", " ".join(f"{r}:{kk}{w[0]}" for r, kk, w, _ in trace))
        best = max(configs[:-1], key=tps.__getitem__)
        ratio = tps["adaptive"] / tps[best]
        label = "noise-free" if rng is None else f"noise seed {i - 1}"
        print(f"{label:>14}: " + "  ".join(f"{c} {tps[c]:.0f}" for c in configs) + f"  -> adaptive {ratio:.3f}x {best}")
        if rng is not None:
            ratios.append(ratio)
    if ratios:
        print(f"adaptive / best fixed k over {len(ratios)} noisy replays: median {statistics.median(ratios):.3f}, "
              f"min {min(ratios):.3f}, max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
