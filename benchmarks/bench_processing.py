"""Does speculation keep its speedup when a request asks for penalties, biases, logprobs, or samples with
top-k, top-p or min-p?

For each set of sampling options the same plain and speculative ``LLM`` run every prompt at batch 1,
alternating (specdec.bench.run_bench), so the speedups are same-run ratios. The options are greedy
but for the sampled ones (temperature 0.8, seeded: the same seed for plain and speculative). Penalties
change the output (and so the acceptance); the overhead of processing shows as the gap between the
speedup with them and without. ``--sort-cut``: the options with top-k or top-p also run both LLMs
with the cut found by sorting each row with its token ids (``sampling._top_k_top_p_sorted``, the
GPU's way) in the same rotation, against the CPU's sort of values.

    python benchmarks/bench_processing.py [--model specdec/demo-target] [--draft specdec/demo-draft]
        [--method draft_model] [--backend torch] [--set code_heldout] [--num-prompts 8] [--max-tokens 128]
        [--threads 1] [--options temperature top_p top_k min_p] [--sort-cut]
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
    "temperature": dict(temperature=0.8, seed=0),
    "top_p": dict(temperature=0.8, top_p=0.95, seed=0),
    "top_k": dict(temperature=0.8, top_k=40, seed=0),
    "min_p": dict(temperature=0.8, min_p=0.05, seed=0),
}


def sort_cut(llm):
    """One prompt through ``llm`` with top-k / top-p cut by sorting each row with its ids (a peer of run_bench)."""
    from specdec import sampling

    def sorted_cut(logits, k, p):  # k, p [S]: each row's over its positions and tokens, as the GPU's path takes them
        shape = (-1,) + (1,) * (logits.dim() - 1)
        return sampling._top_k_top_p_sorted(logits, k.view(shape), p.view(shape))

    def run(prompt, params):
        values = sampling._top_k_top_p
        sampling._top_k_top_p = sorted_cut
        try:
            return llm.generate([prompt], params)[0].outputs[0].token_ids
        finally:
            sampling._top_k_top_p = values

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="specdec/demo-target")
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--method", default="draft_model")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "llama.cpp"])
    ap.add_argument("--set", default="code_heldout")
    ap.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--sort-cut", action="store_true", help="also run top-k / top-p options with the cut by a sort "
                    "of each row with its ids, in the same rotation")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec import LLM, SamplingParams
    from specdec.bench import run_bench
    from specdec.prompts import load_prompts

    plain = LLM(args.model, backend=args.backend)
    spec = LLM(args.model, backend=args.backend, speculative_config=method_config(args.method, args.draft, args.k))
    path = Path(args.set) if Path(args.set).exists() else PROMPTS / f"{args.set}.jsonl"
    prompts = load_prompts(path, args.num_prompts)
    print(f"{path.stem}, {args.method}, batch 1, {args.max_tokens} tokens, backend {plain.backend}")
    base = None
    for name in args.options:
        params = SamplingParams(**{"temperature": 0, **OPTIONS[name]}, max_tokens=args.max_tokens, ignore_eos=True)
        cut = args.sort_cut and (params.top_k > 0 or params.top_p < 1.0)
        peers = {"plain, sort cut": lambda prompt, run=sort_cut(plain): run(prompt, params),
                 "spec, sort cut": lambda prompt, run=sort_cut(spec): run(prompt, params)} if cut else None
        r = run_bench(plain, spec, prompts, params, peers=peers).as_dict()
        base = r["speedup"] if base is None else base
        match = f"equal {r['greedy_match']['matched']}/{r['greedy_match']['total']}" if params.greedy else "sampled"
        print(f"{name:>20}  plain {r['ar']['tokens_per_s']:6.1f} tok/s  spec {r['spec']['tokens_per_s']:6.1f} tok/s  "
              f"x{r['speedup']:.2f} ({r['speedup'] / base:.2f} of the first)  "
              f"accept {r['spec']['acceptance_rate']:.2f}  tau {r['spec']['mean_acceptance_length']:.2f}  {match}", flush=True)
        if cut:
            sp, pp = r["peers"]["spec, sort cut"]["tokens_per_s"], r["peers"]["plain, sort cut"]["tokens_per_s"]
            print(f"{'sorted with ids':>20}  plain {pp:6.1f} tok/s  spec {sp:6.1f} tok/s  x{sp / pp:.2f}   "
                  f"(the value sort: plain {r['ar']['tokens_per_s'] / pp:.2f}x, spec {r['spec']['tokens_per_s'] / sp:.2f}x)",
                  flush=True)


if __name__ == "__main__":
    main()
