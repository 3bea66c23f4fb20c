"""What a round's host work costs once a forward has streamed the weights through the caches.

Between two forward passes of the target every Python object and every line of torch's dispatcher
code that the round touches has been evicted (the shipped target's weights, 56 MB, stream through a
32 MB L3 each pass), so host work costs several times what a hot loop measures. This replays the
suffix drafter's per-round calls (``draft`` of k tokens, then ``observe`` of the tokens a round
commits) over held-out code prompts, each call either right after the previous one ("hot") or after
a sweep over a buffer the size of the weights ("cold"), for both implementations of its tries
(``suffix_native.suffix_drafter``: the C++ one; ``SuffixDrafter``: the Python reference), and times a
few small torch calls the same two ways.

    python benchmarks/host_cost.py --num-prompts 8 --sweep-mb 56
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from round_cost import load_prompts


def replay(make_drafter: Callable, prompts: list[list[int]], k: int, per_round: int, sweep) -> tuple[float, float]:
    """Median µs of ``draft`` and of ``observe`` per round: each prompt's output is the next prompt's first
    tokens (code continuing code), committed ``per_round`` tokens a round."""
    from specdec.config import SamplingParams
    from specdec.sequence import Sequence

    drafter = make_drafter()
    drafts, observes = [], []
    for i, prompt in enumerate(prompts):
        output = prompts[(i + 1) % len(prompts)][:128]
        s = Sequence(list(prompt), SamplingParams(max_tokens=len(output)), torch.Generator(), 10**6)
        drafter.observe([s], [0])  # the prompt's tries built before the timed rounds
        for j in range(0, len(output), per_round):
            sweep()
            t0 = time.perf_counter()
            drafter.draft(s, k)
            drafts.append(time.perf_counter() - t0)
            s.token_ids.extend(output[j:j + per_round])
            sweep()
            t0 = time.perf_counter()
            drafter.observe([s], [per_round])
            observes.append(time.perf_counter() - t0)
        drafter.release([s])
    return statistics.median(drafts) * 1e6, statistics.median(observes) * 1e6


def torch_calls(sweep, repeats: int = 200) -> dict[str, float]:
    """Median µs of a few calls a round makes, each after ``sweep``."""
    logits = torch.randn(1, 9, 8192)
    calls = {"torch.tensor([[1, 2, 3]])": lambda: torch.tensor([[1, 2, 3]]),
             "torch.arange(300, 309)[None]": lambda: torch.arange(300, 309)[None],
             "argmax of [1, 9, 8192] (numpy)": lambda: logits.numpy().argmax(-1),
             "logits.index_select(1, 9 positions)": lambda: logits.index_select(1, torch.arange(9)),
             "a Python list's tolist-sized work": lambda: [int(x) for x in range(9)]}
    out = {}
    for name, call in calls.items():
        times = []
        for _ in range(repeats):
            sweep()
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--k", type=int, default=8, help="drafts asked per round")
    ap.add_argument("--per-round", type=int, default=4, help="tokens committed per round (the benchmark's τ ~ 3.9)")
    ap.add_argument("--sweep-mb", type=int, default=56, help="the buffer swept before each cold call (the weights' size)")
    args = ap.parse_args()
    torch.set_num_threads(2)

    from transformers import AutoTokenizer

    from specdec.drafters.suffix import SuffixDrafter
    from specdec.drafters.suffix_native import suffix_drafter, unavailable_reason
    from specdec.models.resolve import SHIPPED

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED["specdec/demo-target"])
    prompts = load_prompts(args.num_prompts, tokenizer, 10**6)
    buffer = np.ones(args.sweep_mb * 2**20 // 8)
    sweeps = {"hot": lambda: None, "cold": lambda: buffer.sum()}
    drafters = {"python": SuffixDrafter}
    if unavailable_reason() is None:
        drafters["native"] = lambda: suffix_drafter(native=True)
    print(f"{len(prompts)} prompts, k={args.k}, {args.per_round} tokens a round; cold: after a {args.sweep_mb} MB sweep")
    print("| suffix tries | draft hot | draft cold | observe hot | observe cold |  (µs per round, median)")
    print("| --- | --- | --- | --- | --- |")
    for name, make in drafters.items():
        (dh, oh), (dc, oc) = (replay(make, prompts, args.k, args.per_round, sweeps[s]) for s in ("hot", "cold"))
        print(f"| {name} | {dh:.1f} | {dc:.1f} | {oh:.1f} | {oc:.1f} |")
    hot, cold = torch_calls(sweeps["hot"]), torch_calls(sweeps["cold"])
    print("\n| call | hot µs | cold µs |\n| --- | --- | --- |")
    for name in hot:
        print(f"| {name} | {hot[name]:.1f} | {cold[name]:.1f} |")


if __name__ == "__main__":
    main()
