"""bf16 weights on specdec's kernel (dot products, AMX tiles where the CPU has them) against oneDNN's inner
product (``SPECDEC_NO_BF16_DOT=1``), plain and speculative, end to end on the torch runner.

Each configuration is built twice, one LLM per kernel, and every LLM runs each prompt in turn (greedy,
exactly --max-tokens new tokens, batch 1), so machine noise hits both kernels alike. Prints the median
tok/s per kernel, their ratio and how many outputs agree (the kernels round differently: oneDNN rounds
each product's result to bf16, specdec's keeps float32, so greedy outputs part at near-ties).

    python benchmarks/bench_kernels.py [--num-prompts 12] [--max-tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams
from specdec.models.linear import NO_DOT_ENV
from specdec.prompts import load_prompts

PROMPTS = Path(__file__).parent / "prompts" / "code_heldout.jsonl"
CONFIGS = {"plain": None,
           "suffix k=8": {"method": "suffix", "num_speculative_tokens": 8},
           "draft_model k=4": {"method": "draft_model", "model": "specdec/demo-draft", "num_speculative_tokens": 4,
                               "adaptive": False}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="specdec/demo-target")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [r["prompt"] for r in load_prompts(PROMPTS, args.num_prompts)]
    llms = {}
    for kernel in ("oneDNN", "specdec"):
        for name, spec in CONFIGS.items():
            if kernel == "oneDNN":
                os.environ[NO_DOT_ENV] = "1"
            try:
                llms[kernel, name] = LLM(args.model, backend="torch", speculative_config=spec)
            finally:
                os.environ.pop(NO_DOT_ENV, None)
        print(f"{kernel}: {llms[kernel, 'plain'].engine.target.describe()}")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in llms.values():  # warm-up
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16))
    rates = {key: [] for key in llms}
    outputs = {key: [] for key in llms}
    for prompt in prompts:
        for key, llm in llms.items():
            t = time.perf_counter()
            out = llm.generate([prompt], params)[0].outputs[0].token_ids
            rates[key].append(len(out) / (time.perf_counter() - t))
            outputs[key].append(out)
    print(f"{len(prompts)} prompts x {args.max_tokens} tokens, greedy, batch 1, {args.threads} threads; median tok/s:")
    for name in CONFIGS:
        a, b = (statistics.median(rates[kernel, name]) for kernel in ("oneDNN", "specdec"))
        same = sum(x == y for x, y in zip(outputs["oneDNN", name], outputs["specdec", name]))
        print(f"  {name:<16} oneDNN {a:7.1f}  specdec's kernel {b:7.1f}  {b / a:.2f}x   same outputs {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
