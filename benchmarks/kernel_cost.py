"""The torch runner's CPU kernels against what they replace, in one process, alternating: a bf16 model's
products on specdec's bf16 dot-product kernel (``linear16_dot``, kind ``w16dot``) against oneDNN's inner
product, hot, at several row counts; specdec's cache attention against SDPA / two batched matmuls; and a
one-row prefill on the runner each way. Needs a CPU with avx512_bf16 for the dot kernel (else says why).

    python benchmarks/kernel_cost.py --hf specdec/demo-target --rows 1,4,8,12,33,128,512 \\
        --queries 1,4,10,16,33 --prefill 128,250,512 --threads 2
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from specdec.models import cache_attention, linear
from specdec.models.base import ForwardBatch
from specdec.models.cpu import native_bf16
from specdec.models.layers import attention_mask, few_query_attention
from specdec.models.linear import NO_DOT_ENV, Linear
from specdec.models.llama import LlamaRunner
from specdec.models.load import load_model


def int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, e.g. 1,4,8, got {text!r}")


def best_ms(fns: dict[str, callable], repeats: int) -> dict[str, float]:
    """The fastest of ``repeats`` calls of each, the functions taking turns."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], 1e3 * (time.perf_counter() - t0))
    return best


def with_kernel(dot: bool, make):
    """``make()`` with bf16 weights on the dot kernel (True) or oneDNN (False)."""
    before = os.environ.get(NO_DOT_ENV)
    os.environ[NO_DOT_ENV] = "0" if dot else "1"
    try:
        return make()
    finally:
        if before is None:
            del os.environ[NO_DOT_ENV]
        else:
            os.environ[NO_DOT_ENV] = before


def products(model, rows: list[int], repeats: int) -> None:
    weights = [p.detach() for name, p in model.hf_model.named_parameters() if p.dim() == 2 and "embed" not in name]
    kinds = {"dot": with_kernel(True, lambda: [Linear(w) for w in weights]),
             "oneDNN": with_kernel(False, lambda: [Linear(w) for w in weights])}
    print(f"\n{len(weights)} products ({sum(w.numel() for w in weights) / 1e6:.1f}M weights), hot, ms "
          f"(fastest of {repeats}):\n\n| rows | dot | oneDNN | dot / oneDNN |\n| --- | --- | --- | --- |")
    for T in rows:
        xs = [torch.randn(T, w.shape[1]).bfloat16() for w in weights]
        ms = best_ms({k: (lambda ls=ls: [lin(x) for lin, x in zip(ls, xs)]) for k, ls in kinds.items()}, repeats)
        print(f"| {T} | {ms['dot']:.2f} | {ms['oneDNN']:.2f} | {ms['dot'] / ms['oneDNN']:.2f} |")


def attention(queries: list[int], prefill: list[int], repeats: int, heads: int = 8, kv_heads: int = 4,
              hd: int = 64, context: int = 256) -> None:
    print(f"\nattention of one layer, {heads} heads on {kv_heads}, head_dim {hd}, µs (fastest of {repeats}):\n\n"
          "| queries | keys | specdec kernel | SDPA / batched matmuls | ratio |\n| --- | --- | --- | --- | --- |")
    rows = torch.zeros(1, dtype=torch.long)
    for T, start in [(T, context) for T in queries] + [(T, 0) for T in prefill]:
        L = start + T if start == 0 else -(-(start + T) // 64) * 64  # the compiled step pads to 64 keys
        k = torch.randn(1, 1, kv_heads, L, hd)
        v = torch.randn_like(k)
        q = torch.randn(1, T, heads, hd)
        pos = torch.arange(start, start + T)[None]
        bias = attention_mask(pos, L, None, additive=True)  # [1, 1, T, L]
        ref = (lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k[0], v[0], is_causal=True, enable_gqa=True)
               ) if start == 0 else (lambda: few_query_attention(q.transpose(1, 2), k[0], v[0], bias))
        ms = best_ms({"kernel": lambda: cache_attention.cache_attention(q, k, v, 0, rows, bias[:, 0]), "ref": ref},
                     repeats)
        print(f"| {T}{' (prefill)' if start == 0 else ''} | {L} | {1e3 * ms['kernel']:.1f} | {1e3 * ms['ref']:.1f} | "
              f"{ms['kernel'] / ms['ref']:.2f} |")


def prefills(path: str, lengths: list[int], repeats: int) -> None:
    runners = {k: with_kernel(dot, lambda: LlamaRunner(load_model(path, "bfloat16"), enforce_eager=True))
               for k, dot in (("dot", True), ("oneDNN", False))}
    print(f"\none-row prefill on the runner (eager), ms (fastest of {repeats}):\n\n"
          "| tokens | dot kernel | oneDNN | ratio |\n| --- | --- | --- | --- |")
    for T in lengths:
        prompt = [(j * 17) % 1000 + 5 for j in range(T)]

        def run(r):
            r.sync_rows([("p", T)])
            r.forward(ForwardBatch.from_rows([prompt], [0], logits="last"))
        ms = best_ms({k: (lambda r=r: run(r)) for k, r in runners.items()}, repeats)
        print(f"| {T} | {ms['dot']:.1f} | {ms['oneDNN']:.1f} | {ms['dot'] / ms['oneDNN']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", default="specdec/demo-target", help="a bf16 HF checkpoint (a name or a folder)")
    ap.add_argument("--rows", type=int_list, default=[1, 4, 8, 12, 33, 128, 512])
    ap.add_argument("--queries", type=int_list, default=[1, 4, 10, 16, 33], help="queries a row, 256 keys cached")
    ap.add_argument("--prefill", type=int_list, default=[128, 250, 512], help="prompt lengths")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    support = native_bf16()
    if not (support.native and linear.dot_products()):
        raise SystemExit(f"the bf16 dot-product kernel does not run here ({support.isa}: {support.reason}; "
                         "it needs avx512_bf16 without AMX and SPECDEC_NO_BF16_DOT unset)")
    print(f"{support.isa}, {args.threads} threads")
    with torch.inference_mode():
        products(load_model(args.hf, "bfloat16"), args.rows, args.repeats)
        if cache_attention.available().ok:
            attention(args.queries, args.prefill, args.repeats)
        prefills(args.hf, args.prefill, max(3, args.repeats // 4))


if __name__ == "__main__":
    main()
