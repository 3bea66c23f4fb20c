"""Does speculation keep its speedup when a request asks for penalties, biases or logprobs?

For each set of sampling options the same plain and speculative ``LLM`` run every prompt at batch 1,
greedy, alternating (specdec.bench.run_bench), so the speedups are same-run ratios. Penalties change
the output (and so the acceptance); the overhead of processing shows as the gap between the speedup
with them and without.

    python benchmarks/bench_processing.py [--model specdec/demo-target] [--draft specdec/demo-draft]
        [--method draft_model] [--set code_heldout] [--num-prompts 8] [--max-tokens 128] [--threads 1]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_methods import PROMPTS, method_config

OPTIONS = {
    "none": {},
    "penalties": dict(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2),
    "logit_bias": dict(logit_bias={13: -5.0, 29: 2.0}),
    "logprobs": dict(logprobs=5),
    "penalties+logprobs": dict(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2, logprobs=5),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="specdec/demo-target")
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--method", default="draft_model")
    ap.add_argument("--set", default="code_heldout")
    ap.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec import LLM, SamplingParams
    from specdec.bench import run_bench
    from specdec.prompts import load_prompts

    plain = LLM(args.model)
    spec = LLM(args.model, speculative_config=method_config(args.method, args.draft, args.k))
    path = Path(args.set) if Path(args.set).exists() else PROMPTS / f"{args.set}.jsonl"
    prompts = load_prompts(path, args.num_prompts)
    print(f"{path.stem}, {args.method}, greedy, batch 1, {args.max_tokens} tokens, backend {plain.backend}")
    base = None
    for name in args.options:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, **OPTIONS[name])
        r = run_bench(plain, spec, prompts, params).as_dict()
        base = r["speedup"] if base is None else base
        print(f"{name:>20}  plain {r['ar']['tokens_per_s']:6.1f} tok/s  spec {r['spec']['tokens_per_s']:6.1f} tok/s  "
              f"x{r['speedup']:.2f} ({r['speedup'] / base:.2f} of the first)  "
              f"accept {r['spec']['acceptance_rate']:.2f}  tau {r['spec']['mean_acceptance_length']:.2f}  "
              f"equal {r['greedy_match']['matched']}/{r['greedy_match']['total']}", flush=True)


if __name__ == "__main__":
    main()
