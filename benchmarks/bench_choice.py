"""Per-request drafter choice against each single drafter of its list, on a mixed workload, in one process.

The workload mixes what favours each method: Spec-Bench's 13 categories (prose: the draft model),
unseen code (benchmarks/prompts/code_heldout), a copy-heavy set (code_copy: the lookups) and random
tokens (nothing pays). Each configuration, plain decoding, each method of the list alone, and the
list, runs the same prompts greedily at batch 1 (one prompt at a time, the configurations' order
rotating per prompt) and with 8 requests in flight (the whole workload in one generate call with
max_num_seqs 8, the order rotating per repeat). It reports end-to-end tokens/s, tau, which method
drafted how many rounds, tokens/s per set at batch 1, outputs that differ from plain decoding, and
the list's ratio to the best and to the median single method (issue target: >= 1.0x and >= 1.15x).

    python benchmarks/bench_choice.py [--model specdec/demo-target] [--draft specdec/demo-draft]
        [--methods suffix draft_model ngram] [--per-set 1] [--max-tokens 64] [--batch 1 8]
        [--repeats 1] [--backend torch] [--threads 1] [--spec-bench PATH] [--json]

Spec-Bench: --spec-bench, else $SPEC_BENCH, else ../shared/data/spec_bench/question.jsonl when present
(--per-set prompts of each category); without it the mix is the three local sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PROMPTS = ROOT / "prompts"
SETS = ["code_heldout", "code_copy", "random_tokens"]


def spec_bench_path(arg: str | None) -> Path | None:
    for p in (arg, os.environ.get("SPEC_BENCH"), ROOT.parents[1] / "shared" / "data" / "spec_bench" / "question.jsonl"):
        if p and Path(p).is_file():
            return Path(p)
    return None


def workload(per_set: int, spec_bench: Path | None) -> list[dict]:
    """[{"prompt", "set"}]: --per-set prompts of each Spec-Bench category and of each local set."""
    from specdec.prompts import load_prompts

    out = []
    if spec_bench is not None:
        taken: dict[str, int] = {}
        for r in load_prompts(spec_bench):
            cat = r["category"] or "spec_bench"
            if taken.get(cat, 0) < per_set:
                taken[cat] = taken.get(cat, 0) + 1
                out.append({"prompt": r["prompt"], "set": f"spec_bench/{cat}"})
    for name in SETS:
        out += [{"prompt": r["prompt"], "set": name} for r in load_prompts(PROMPTS / f"{name}.jsonl", per_set)]
    return out


def configs(methods: list[str], draft: str, k: int) -> dict[str, dict | None]:
    def cfg(m):
        c = {"method": m, "num_speculative_tokens": k}
        return c | {"model": draft} if "draft_model" in (m if isinstance(m, list) else [m]) else c

    return {"plain": None, **{m: cfg(m) for m in methods}, "choice": cfg(list(methods))}


class Tally:
    """One configuration's totals at one batch size."""

    def __init__(self):
        self.tokens, self.seconds = 0, 0.0
        self.drafts = self.accepted = 0
        self.rounds: dict[str, int] = {}
        self.per_set: dict[str, list[float]] = {}  # set -> [tokens, seconds]
        self.outputs: list[list[int]] = []
        self.prompt_ids: list[list[int]] = []

    def add(self, llm, run) -> list:
        """``run()`` -> RequestOutputs; counts their tokens, time and the engine's counters."""
        before = llm.get_metrics()
        rounds_before = dict(getattr(llm.engine.drafter, "rounds_per_method", {}) or {})
        t0 = time.perf_counter()
        outs = run()
        self.seconds += time.perf_counter() - t0
        self.tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        after = llm.get_metrics()
        self.drafts += after["num_drafts"] - before["num_drafts"]
        self.accepted += after["num_accepted_tokens"] - before["num_accepted_tokens"]
        for m, n in (getattr(llm.engine.drafter, "rounds_per_method", {}) or {}).items():
            self.rounds[m] = self.rounds.get(m, 0) + n - rounds_before.get(m, 0)
        return outs

    def row(self) -> dict:
        return {"tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
                "tau": 1 + self.accepted / self.drafts if self.drafts else 1.0,
                "rounds_per_method": self.rounds, "tokens": self.tokens, "seconds": self.seconds,
                "per_set_tokens_per_s": {s: t / dt for s, (t, dt) in self.per_set.items() if dt}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="specdec/demo-target")
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--methods", nargs="+", default=["suffix", "draft_model", "ngram"])
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--per-set", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--spec-bench", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec import LLM, SamplingParams
    from specdec.bench import compute_paths
    from specdec.near_tie import first_divergence

    prompts = workload(args.per_set, spec_bench_path(args.spec_bench))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    cfgs = configs(args.methods, args.draft, args.k)
    llms = {name: LLM(args.model, speculative_config=c, backend=args.backend, max_num_seqs=max(args.batch))
            for name, c in cfgs.items()}
    names = list(llms)
    for llm in llms.values():  # warm-up: kernels, caches
        llm.generate([prompts[0]["prompt"]], params)

    results = {}
    for batch in args.batch:
        tally = {n: Tally() for n in names}
        for rep in range(args.repeats):
            if batch == 1:
                for i, p in enumerate(prompts):
                    shift = (i + rep) % len(names)
                    for n in names[shift:] + names[:shift]:
                        t = tally[n]
                        s0, t0 = t.seconds, t.tokens
                        out = t.add(llms[n], lambda: llms[n].generate([p["prompt"]], params))
                        acc = t.per_set.setdefault(p["set"].split("/")[0], [0, 0.0])
                        acc[0] += t.tokens - t0
                        acc[1] += t.seconds - s0
                        if rep == 0:
                            t.outputs += [o.outputs[0].token_ids for o in out]
                            t.prompt_ids += [o.prompt_token_ids for o in out]
            else:
                shift = rep % len(names)
                for n in names[shift:] + names[:shift]:
                    sched = llms[n].engine.scheduler  # this batch size's rows at most, one LLM per config
                    sched.config = dataclasses.replace(sched.config, max_num_seqs=batch)
                    out = tally[n].add(llms[n], lambda: llms[n].generate([p["prompt"] for p in prompts], params))
                    if rep == 0:
                        tally[n].outputs = [o.outputs[0].token_ids for o in out]
                        tally[n].prompt_ids = [o.prompt_token_ids for o in out]
        rows = {n: tally[n].row() for n in names}
        base = tally["plain"]
        for n in names:  # greedy outputs that differ from plain decoding, and whether each parts at a near-tie
            parts = [first_divergence(llms["plain"].engine.target, ids, a, b)
                     for ids, a, b in zip(base.prompt_ids, base.outputs, tally[n].outputs) if a != b]
            rows[n]["differ_from_plain"] = len(parts)
            rows[n]["differ_not_near_tie"] = sum(not d["near_tie"] for d in parts)
        singles = [rows[m]["tokens_per_s"] for m in args.methods]
        choice = rows["choice"]["tokens_per_s"]
        results[batch] = {"configs": rows, "choice_over_best_single": choice / max(singles),
                          "choice_over_median_single": choice / statistics.median(singles),
                          "choice_over_plain": choice / rows["plain"]["tokens_per_s"]}

    report = {"model": args.model, "draft": args.draft, "methods": args.methods, "k": args.k,
              "backend": args.backend, "threads": torch.get_num_threads(), "max_tokens": args.max_tokens,
              "num_prompts": len(prompts), "sets": sorted({p["set"] for p in prompts}),
              "paths": compute_paths(llms["choice"]), "results": results}
    if args.json:
        print(json.dumps(report))
        return
    print(f"{len(prompts)} prompts ({', '.join(sorted({p['set'].split('/')[0] for p in prompts}))}), "
          f"{args.max_tokens} tokens, greedy, k={args.k}, backend {args.backend}, {torch.get_num_threads()} threads")
    print(f"paths: {report['paths']}")
    for batch, r in results.items():
        print(f"\nbatch {batch}: choice / best single {r['choice_over_best_single']:.2f}x, / median single "
              f"{r['choice_over_median_single']:.2f}x, / plain {r['choice_over_plain']:.2f}x")
        print(f"{'config':<12} {'tok/s':>8} {'tau':>5} {'differ':>6}  rounds per method; tok/s per set (batch 1)"
              "  (differ: outputs not plain decoding's, all at near-ties unless '!' says how many not)")
        for n, row in r["configs"].items():
            per_set = ", ".join(f"{s} {v:.1f}" for s, v in row["per_set_tokens_per_s"].items())
            bad = f"!{row['differ_not_near_tie']}" if row["differ_not_near_tie"] else ""
            print(f"{n:<12} {row['tokens_per_s']:8.1f} {row['tau']:5.2f} {row['differ_from_plain']:6d}{bad}  "
                  f"{row['rounds_per_method'] or ''} {per_set}")


if __name__ == "__main__":
    main()
