"""Does a verify pass compute the logits plain decoding computes? Speculation is exact only if the
target scores a drafted token the same way in a pass of k+1 tokens (and beside other requests) as in
a one-token step; a kernel that changes its sums with the batch's shape breaks that by its rounding.

For each prompt (its first --prefix tokens, then its next k+1 tokens as the continuation) the
target's logits for the k+1 continuation positions are computed three ways after the same prefill:
  steps:  k+1 one-token forwards (plain decoding),
  verify: one forward of k+1 tokens (a verify pass),
  beside: the same forward with a second request's k+1 tokens in the batch (another prompt).
Prints, for verify and beside against steps, the largest |difference| of a logit, and how many
positions change their argmax or their top-8 set (where a top-k sampler's support moves), with the
gap between the 8th and 9th logits there. Batch 1 decoding's own numbers: the path (device, dtype,
product kernel) is printed with them.

  python benchmarks/row_invariance.py --device cuda [--model specdec/demo-target] [--dtype auto] [--compiled]

--compiled runs steps and verify passes on the compiled step (the CUDA graphs on CUDA: one graph per
padded size, so the kernels differ between the two); "beside" (two rows) runs eager either way.
"""

from __future__ import annotations

import argparse
import json

import torch

from specdec import LLM
from specdec.models.base import ForwardBatch
from specdec.prompts import load_prompts

TOP = 8


def logits_three_ways(runner, prefix: list[int], cont: list[int], other: tuple[list[int], list[int]]):
    """[3, k+1, V] float32: steps, verify, beside (see the module docstring)."""
    n, dev = len(prefix), runner.device
    runner.sync_rows([("steps", 0)])
    runner.forward(ForwardBatch.from_rows([prefix], [0], logits="none", device=dev))
    steps = torch.cat([runner.forward(ForwardBatch.from_rows([[t]], [n + j], device=dev)) for j, t in enumerate(cont)])
    runner.sync_rows([("verify", 0)])
    runner.forward(ForwardBatch.from_rows([prefix], [0], logits="none", device=dev))
    verify = runner.forward(ForwardBatch.from_rows([cont], [n], logits="all", device=dev))[0]
    runner.sync_rows([("beside", 0), ("other", 1)])
    runner.forward(ForwardBatch.from_rows([prefix, other[0]], [0, 0], logits="none", device=dev))
    beside = runner.forward(ForwardBatch.from_rows([cont, other[1]], [n, len(other[0])], logits="all", device=dev))[0]
    return torch.stack([steps, verify, beside]).float().cpu()


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """ref, got [N, V] -> the largest |difference|, argmax and top-8 set changes, the top-8 gaps there."""
    top_ref, top_got = ref.topk(TOP + 1, dim=-1), got.topk(TOP, dim=-1)
    moved = [i for i in range(ref.shape[0])
             if set(top_ref.indices[i, :TOP].tolist()) != set(top_got.indices[i].tolist())]
    gaps = (top_ref.values[:, TOP - 1] - top_ref.values[:, TOP])  # [N]
    return {"max_abs_diff": float((ref - got).abs().max()),
            "argmax_changed": int((ref.argmax(-1) != got.argmax(-1)).sum()),
            "top8_changed": len(moved), "positions": ref.shape[0],
            "top8_gap_where_changed": [round(float(gaps[i]), 6) for i in moved][:8],
            "top8_gap_median": round(float(gaps.median()), 6)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="specdec/demo-target")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", default="benchmarks/prompts/code_heldout.jsonl")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=48, help="prompt tokens prefilled before the continuation")
    ap.add_argument("-k", type=int, default=4, help="draft tokens: the verify pass holds k+1")
    ap.add_argument("--compiled", action="store_true", help="the compiled step (default: eager)")
    args = ap.parse_args()

    llm = LLM(args.model, device=args.device, dtype=args.dtype, backend="torch", enforce_eager=not args.compiled)
    runner, tok = llm.engine.target, llm.get_tokenizer()
    ids = [tok.encode(r["prompt"]) for r in load_prompts(args.prompts)[: args.num_prompts + 1]]
    need = args.prefix + args.k + 1
    if min(len(i) for i in ids) < need:
        ids = [(i * (need // len(i) + 1))[:need] for i in ids]  # short prompts repeated up to the length
    splits = [(i[: args.prefix], i[args.prefix : need]) for i in ids]
    results = []
    for j in range(args.num_prompts):
        prefix, cont = splits[j]
        other = (splits[j + 1][0][: args.prefix - 7], splits[j + 1][1])  # another length, another text
        results.append(logits_three_ways(runner, prefix, cont, other))
    every = torch.stack(results)  # [P, 3, k+1, V]
    flat = every.transpose(0, 1).reshape(3, -1, every.shape[-1])  # [3, P*(k+1), V]
    report = {"path": runner.describe(), "device": args.device, "compute_dtype": str(runner.compute_dtype),
              "verify_vs_steps": compare(flat[0], flat[1]), "beside_vs_steps": compare(flat[0], flat[2])}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
