"""What the sampling kernel costs a row (sampling_kernel.cut_probs: temperature, top-k / top-p, softmax, min-p),
on real draft rows: the logits a sampling draft model hands its picks in a run of the shipped pair on held-out
code (draft_model, k = 4, temperature 0.8, top_p 0.95), saved, then cut again and again per option, hot (one row at a time, the
median of ``--repeats`` calls a row). Prints each option's median and 90th percentile over the rows, and how
many tokens top_p keeps and how deep below the top it reaches.

    python benchmarks/sampling_rows.py [--num-prompts 8] [--max-rows 120] [--repeats 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

PROMPTS = Path(__file__).resolve().parent / "prompts" / "code_heldout.jsonl"
OPTIONS = {  # name -> (top_k, top_p, min_p)
    "temperature only": (0, 1.0, 0.0),
    "top_p 0.95": (0, 0.95, 0.0),
    "top_k 40": (40, 1.0, 0.0),
    "top_k 50, top_p 0.9": (50, 0.9, 0.0),
    "min_p 0.05": (0, 1.0, 0.05),
}


def draft_rows(num_prompts: int, max_rows: int, temperature: float) -> torch.Tensor:
    """[R, V] the logits of the draft model's sampled steps in a run of the shipped pair (every other row
    beyond ``max_rows`` left out, so that late prompts are represented too)."""
    from specdec import LLM, SamplingParams, sampling_kernel
    from specdec.prompts import load_prompts

    module = sampling_kernel.module()
    sample_rows = module.sample_rows
    rows: list[torch.Tensor] = []

    def saving(logits, *args):
        rows.append(logits.reshape(-1, logits.shape[-1]).clone())
        return sample_rows(logits, *args)

    llm = LLM(model="specdec/demo-target", backend="torch",
              speculative_config={"method": "draft_model", "model": "specdec/demo-draft",
                                  "num_speculative_tokens": 4, "adaptive": False})
    prompts = [p["prompt"] for p in load_prompts(PROMPTS, num_prompts)]
    module.sample_rows = saving
    try:
        for i, prompt in enumerate(prompts):
            llm.generate([prompt], SamplingParams(temperature=temperature, top_p=0.95, max_tokens=128, seed=i))
    finally:
        module.sample_rows = sample_rows
    every = torch.cat(rows)
    step = max(1, len(every) // max_rows)
    return every[::step][:max_rows].contiguous()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-rows", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from specdec import sampling_kernel

    rows = draft_rows(args.num_prompts, args.max_rows, args.temperature)
    print(f"{len(rows)} draft rows of {rows.shape[1]} tokens, temperature {args.temperature}; "
          f"{torch.backends.cpu.get_cpu_capability()} CPU capability, sampling kernel (AVX2 code)")
    cut = sampling_kernel.module().cut_probs
    print("| option | median µs a row | p90 |\n| --- | --- | --- |")
    for name, (k, p, min_p) in OPTIONS.items():
        params = (torch.tensor([args.temperature]), torch.tensor([k]), torch.tensor([p]), torch.tensor([min_p]))
        per_row = []
        for r in range(len(rows)):
            one = rows[r:r + 1]
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                cut(one, *params)
                times.append(time.perf_counter() - t0)
            per_row.append(statistics.median(times))
        per_row.sort()
        print(f"| {name} | {statistics.median(per_row) * 1e6:.1f} | {per_row[int(0.9 * len(per_row))] * 1e6:.1f} |")
    z = rows.double() / args.temperature
    w = torch.exp(z - z.max(dim=-1, keepdim=True).values)
    ranked = w.sort(dim=-1, descending=True).values
    kept = ((ranked.cumsum(-1) - ranked) < 0.95 * w.sum(-1, keepdim=True)).sum(-1).double()  # top_p 0.95: kept
    depth = -torch.log(ranked.gather(-1, (kept.long() - 1)[:, None]))[:, 0]
    print(f"top_p 0.95 keeps {int(kept.median())} tokens (median; 90th percentile {int(kept.quantile(0.9))}), "
          f"down to {float(depth.median()):.2f} nats below the top token ({float(depth.quantile(0.9)):.2f})")


if __name__ == "__main__":
    main()
