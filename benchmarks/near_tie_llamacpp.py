"""Verify-pass logits against one-token steps on the llama.cpp backend: the rounding that the near-tie
rule (specdec.near_tie) must cover, for one GGUF file.

    python benchmarks/near_tie_llamacpp.py X.gguf [X2.gguf ...]   (from the repository root)
"""
import sys

import torch

from specdec.models.base import ForwardBatch
from specdec.models.load import load_runner
from specdec.prompts import load_prompts


def measure(path: str, K: int = 4) -> None:
    runner, _ = load_runner(path, backend="llama.cpp")
    tok = runner.tokenizer
    prompts = [tok.encode(r["prompt"])[:200] for r in load_prompts("benchmarks/prompts/code_heldout.jsonl", 8)]
    diffs, rel = [], []
    for ids in prompts:
        runner.sync_rows([0])
        runner.reserve(1, len(ids) + 64)
        # one-token steps along the prompt tail (teacher forced), from a prefill of ids[:-K-1]
        base = len(ids) - K - 1
        runner.forward(ForwardBatch.dense(torch.tensor([ids[:base]]), [0], logits="none"))
        steps = []
        for j in range(K + 1):
            step = ForwardBatch.dense(torch.tensor([[ids[base + j]]]), [base + j], logits="last")
            steps.append(runner.forward(step)[0])
        steps = torch.stack(steps)  # [K+1, V]
        verify = ForwardBatch.dense(torch.tensor([ids[base:base + K + 1]]), [base], logits="all")
        d = (runner.forward(verify)[0] - steps).abs().amax(-1)  # [K+1]
        diffs += d.tolist()
        rel += (d / steps.abs().amax(-1)).tolist()
    worst = max(rel)
    print(f"{path.split('/')[-1]}: max |verify - steps| {max(diffs):.4g}, median {sorted(diffs)[len(diffs) // 2]:.4g}; "
          f"relative to the top |logit|: max {worst:.4g} (2^{torch.tensor(worst).log2():.1f})")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        measure(p)
