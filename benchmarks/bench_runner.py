"""Plain-decoding speed of specdec's runner against transformers' generate, in one process.

A 33M-parameter Llama (hidden 512, 8 layers, vocab 8192, random weights), batch 1, greedy,
float32 on the CPU. Runs alternate (specdec, transformers) so machine noise hits both alike;
medians are reported. Also prints the memory-bandwidth bound (weight bytes / measured read
bandwidth) and, for speculative decoding at k = 4, the share of a round spent outside the
model forwards (the loop's own overhead).

    python benchmarks/bench_runner.py [--threads N] [--tokens 128] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def build_models(root: Path):
    from tiny_models import make_model

    words = [f"w{i}" for i in range(8192 - 3)]
    target = make_model(root / "target", "llama", hidden=512, layers=8, heads=8, kv_heads=8, words=words,
                        max_pos=2048, intermediate_size=1376, init_std=0.02)
    draft = make_model(root / "draft", "llama", hidden=128, layers=2, heads=4, kv_heads=4, words=words,
                       max_pos=2048, intermediate_size=344, seed=1, init_std=0.02)
    return target, draft


def read_bandwidth_gbs() -> float:
    x = torch.ones(256 * 1024 * 1024 // 4)  # 256 MiB, far beyond the caches
    for _ in range(2):
        x.sum()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / min(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from specdec import LLM, SamplingParams

    root = Path(tempfile.mkdtemp())
    target_dir, draft_dir = build_models(root)
    llm = LLM(str(target_dir))
    spec = LLM(str(target_dir), speculative_config={"model": str(draft_dir), "num_speculative_tokens": 4,
                                                    "adaptive": False})  # every round drafts k = 4
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in hf_model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in hf_model.parameters())
    prompt = list(range(10, 42))
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def run_specdec(engine_llm):
        t = time.perf_counter()
        out = engine_llm.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0].token_ids
        return len(out) / (time.perf_counter() - t), out

    def run_hf():
        ids = torch.tensor([prompt])
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf_model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                                    pad_token_id=0)
        n = out.shape[1] - len(prompt)
        return n / (time.perf_counter() - t), out[0, len(prompt):].tolist()

    run_specdec(llm), run_hf(), run_specdec(spec)  # warm up
    ours, theirs, specs = [], [], []
    same = True
    for _ in range(args.repeats):
        a, out_a = run_specdec(llm)
        b, out_b = run_hf()
        ours.append(a)
        theirs.append(b)
        same &= out_a == out_b

    # the speculative loop's overhead: everything in a round except the two models' forwards
    forward_time = [0.0]

    def timed(fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            r = fn(*a, **kw)
            forward_time[0] += time.perf_counter() - t
            return r
        return wrapper

    spec.engine.target.forward = timed(spec.engine.target.forward)
    spec.engine.drafter.runner.forward = timed(spec.engine.drafter.runner.forward)
    spec.reset_metrics()
    forward_time[0] = 0.0
    for _ in range(args.repeats):
        s, _ = run_specdec(spec)
        specs.append(s)
    m = spec.get_metrics()
    prefill_forward = m["prefill_time_s"]
    loop_time = m["step_time_s"]
    overhead = (loop_time - (forward_time[0] - prefill_forward)) / loop_time

    bw = read_bandwidth_gbs()
    bound = bw * 1e9 / weight_bytes
    result = {
        "params_M": n_params / 1e6,
        "threads": torch.get_num_threads(),
        "specdec_plain_tokens_per_s": statistics.median(ours),
        "hf_generate_tokens_per_s": statistics.median(theirs),
        "ratio_vs_hf": statistics.median(ours) / statistics.median(theirs),
        "outputs_equal": same,
        "read_bandwidth_GBs": bw,
        "bandwidth_bound_tokens_per_s": bound,
        "fraction_of_bandwidth_bound": statistics.median(ours) / bound,
        "spec_k4_tokens_per_s": statistics.median(specs),
        "spec_loop_overhead_fraction": overhead,
        "spec_mean_acceptance_length": m["mean_acceptance_length"],
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"model: {n_params / 1e6:.1f}M params, float32, batch 1, {args.tokens} new tokens, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"specdec plain     {result['specdec_plain_tokens_per_s']:7.1f} tok/s")
    print(f"transformers      {result['hf_generate_tokens_per_s']:7.1f} tok/s   "
          f"ratio {result['ratio_vs_hf']:.2f}x   outputs equal: {same}")
    print(f"bandwidth bound   {bound:7.1f} tok/s   ({bw:.1f} GB/s read, {weight_bytes / 1e6:.0f} MB weights); "
          f"specdec reaches {result['fraction_of_bandwidth_bound']:.0%}")
    print(f"speculative k=4 (random 2x128 draft, tau {m['mean_acceptance_length']:.2f} incl. bonus): "
          f"{result['spec_k4_tokens_per_s']:.1f} tok/s; loop overhead outside forwards "
          f"{overhead:.1%} of round time")


if __name__ == "__main__":
    main()
