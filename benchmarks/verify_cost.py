"""The verify cost curve v(k) of each backend: one forward of k+1 tokens over one of 1 token, at a
given context, for GGUF files on llama.cpp (flash attention off, as specdec's runner runs them, and
on, as llama.cpp's tools do by default) and HF checkpoints on the torch runner, eager and compiled
(``enforce_eager=False``: compiled.py; its compile at load is not timed).

The cost model (docs/algorithm.md) divides τ by c·k + v(k): the flatter v, the more drafted tokens pay.
Variants alternate within each repeat, so machine noise hits them alike; medians are printed.

``--burst N`` times each length N forwards in a row and keeps the second half of each burst: the
cost a loop that keeps one length meets. On some CPUs step times depend on what ran just before,
so the two differ widely (docs/benchmarks.md, "Verify cost curves", has both), and a speculative loop sees
something in between.

    python benchmarks/verify_cost.py --gguf X.gguf [--hf CHECKPOINT] [--threads 2] [--contexts 64,600] [--burst 20]
        [--compile-sizes 1,3,5,8] [--onednn]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

TOKENS = (1, 2, 3, 5, 9)  # k = 0, 1, 2, 4, 8


def runners(args) -> dict[str, object]:
    from specdec.models.linear import NO_DOT_ENV
    from specdec.models.llamacpp import LlamaCppRunner
    from specdec.models.load import load_runner

    out = {}
    for path in args.gguf:
        name = path.rsplit("/", 1)[-1]
        out[f"{name} llama.cpp"] = LlamaCppRunner(path)
        out[f"{name} llama.cpp, flash attention"] = LlamaCppRunner(path, flash_attn=True)
    for path in args.hf:
        out[f"{path} torch"] = load_runner(path, "torch", enforce_eager=True)[0]
        if not args.eager_only:  # the compiled step (compiled.py), sizes 1 and 8: T = 2..8 run padded to 8
            out[f"{path} torch, compiled"] = load_runner(path, "torch", enforce_eager=False)[0]
        if args.onednn:  # bf16 weights on oneDNN, where they would run on specdec's bf16 kernel
            os.environ[NO_DOT_ENV] = "1"
            try:
                for eager in (True,) if args.eager_only else (True, False):
                    runner = load_runner(path, "torch", enforce_eager=eager)[0]
                    out[f"{path} torch{'' if eager else ', compiled'}, oneDNN"] = runner
            finally:
                del os.environ[NO_DOT_ENV]
        for sizes in args.compile_sizes:  # other compiled sizes: T runs padded to the next one
            from specdec.models.llama import LlamaRunner
            from specdec.models.load import load_model

            sizes = tuple(int(x) for x in sizes.split(","))
            runner = LlamaRunner(load_model(path), enforce_eager=False, compile_sizes=sizes)
            out[f"{path} torch, compiled T={','.join(map(str, sizes))}"] = runner
    return out


def main() -> None:
    from specdec.models.base import ForwardBatch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", action="append", default=[], help="a GGUF file (repeatable)")
    ap.add_argument("--hf", action="append", default=[], help="an HF checkpoint for the torch runner (repeatable)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eager-only", action="store_true", help="time the torch runner eager only, not compiled too")
    ap.add_argument("--onednn", action="store_true",
                    help="also the torch runner with bf16 weights on oneDNN (SPECDEC_NO_BF16_DOT=1) beside specdec's kernel")
    ap.add_argument("--compile-sizes", action="append", default=[],
                    help="also the torch runner compiled for these token counts, e.g. 1,3,5,8 (repeatable)")
    ap.add_argument("--contexts", default="64,600", help="positions already cached before the timed forward")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts T to time, e.g. 1,2,3,4,5")
    ap.add_argument("--burst", type=int, default=1,
                    help="forwards of one length in a row; the second half of each burst is timed (1: alternate)")
    args = ap.parse_args()
    if not args.gguf and not args.hf:
        ap.error("give at least one --gguf or --hf model")
    if args.burst < 1:
        ap.error(f"--burst must be at least 1, got {args.burst}")
    try:
        tokens = tuple(int(x) for x in args.tokens.split(","))
    except ValueError:
        ap.error(f"--tokens takes token counts separated by commas, e.g. 1,2,3,5,9; got {args.tokens!r}")
    if not tokens or tokens[0] != 1 or min(tokens) < 1:
        ap.error(f"--tokens must start with 1 (v(k) is over the one-token step), got {args.tokens!r}")
    torch.set_num_threads(args.threads)
    models = runners(args)
    for C in map(int, args.contexts.split(",")):
        times: dict[str, dict[int, list[float]]] = {m: {T: [] for T in tokens} for m in models}
        for m, r in models.items():  # each runner's row holds C positions of a fixed pseudo-random prompt
            r.reserve(1, C + max(tokens) + 1)
            r.sync_rows(["probe"])
            prompt = [(i * 7919) % (r.vocab_size - 10) + 5 for i in range(C)]
            r.forward(ForwardBatch.from_rows([prompt], [0], logits="none"))
        for _ in range(args.repeats):
            for m, r in models.items():
                for T in tokens:
                    feed = ForwardBatch.from_rows([[(j * 31) % (r.vocab_size - 10) + 5 for j in range(T)]], [C],
                                                  logits="all")
                    for i in range(args.burst):
                        t = time.perf_counter()
                        r.forward(feed)  # a verify pass: logits at every position
                        if i >= args.burst // 2:
                            times[m][T].append(time.perf_counter() - t)
        shape = "each length alternating" if args.burst == 1 else f"bursts of {args.burst} of each length"
        print(f"\ncontext {C}, {args.threads} threads, {shape}: ms per forward of T tokens (median of "
              f"{args.repeats} repeats); v(k) = t(k+1) / t(1)")
        print("| model, backend | " + " | ".join(f"T={T}" for T in tokens) + " | " +
              " | ".join(f"v({T - 1})" for T in tokens[1:]) + " |")
        print("| --- " * (2 * len(tokens)) + "|")
        for m in models:
            med = [1e3 * statistics.median(times[m][T]) for T in tokens]
            print(f"| {m} | " + " | ".join(f"{x:.2f}" for x in med) + " | " +
                  " | ".join(f"{x / med[0]:.2f}" for x in med[1:]) + " |")


if __name__ == "__main__":
    main()
