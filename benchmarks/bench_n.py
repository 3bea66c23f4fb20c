"""n choices of one prompt against n copies of the prompt: the choices prefill it once
(ModelRunner.copy_prefix), the copies n times. Same process, alternating, best of --repeats.

    python benchmarks/bench_n.py --model specdec/assets/demo-target --prompt-tokens 1000 --n 4
"""

from __future__ import annotations

import argparse
import time

from specdec import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="specdec/assets/demo-target")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, backend=args.backend)
    prompt = {"prompt_token_ids": [(7 * i) % 1000 + 3 for i in range(args.prompt_tokens)]}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompt, params)  # warm up
    best = {"n": float("inf"), "copies": float("inf")}
    prefill = dict.fromkeys(best, float("inf"))
    for _ in range(args.repeats):
        for name in best:
            llm.reset_metrics()
            t0 = time.perf_counter()
            if name == "n":
                out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                          ignore_eos=True, n=args.n))[0].outputs
            else:
                out = [o.outputs[0] for o in llm.generate([prompt] * args.n, params)]
            best[name] = min(best[name], time.perf_counter() - t0)
            prefill[name] = min(prefill[name], llm.get_metrics()["prefill_time_s"])
            assert len(out) == args.n
    print(f"{args.backend} {args.model}: prompt {args.prompt_tokens} tokens, {args.max_tokens} new, n={args.n}")
    print(f"n={args.n} choices: {best['n'] * 1000:.0f} ms; {args.n} separate prompts: {best['copies'] * 1000:.0f} ms; "
          f"ratio {best['copies'] / best['n']:.2f}x")
    print(f"prefill alone: {prefill['n'] * 1000:.0f} ms vs {prefill['copies'] * 1000:.0f} ms, "
          f"ratio {prefill['copies'] / prefill['n']:.2f}x")


if __name__ == "__main__":
    main()
