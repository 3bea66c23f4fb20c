"""The other-tokenizer draft against the shipped target: lossless, acceptance, speed (one process).

Three drafters for ``specdec/demo-target`` on held-out code (benchmarks/prompts/code_heldout.jsonl,
prefixes of the standard library's ``test/`` files, never trained on), greedy:

- ``same-vocab``: ``specdec/demo-draft``, the shipped draft (the target's tokenizer, distilled
  from its logits);
- ``bpe-<mapping>``: the draft with its own tokenizer (``--draft``), through
  ``draft_tokenizer_mapping`` ``string``, ``intersection`` and ``auto``.

Part 1, acceptance: each drafter with k fixed (adaptive off, every round drafts k target tokens)
over all prompts in one batch; prints the acceptance rate, acceptance per draft position (share of
rounds whose positions 1..j were all accepted) and tau (tokens per verify pass, bonus included),
and compares every output with plain greedy decoding in the same batch (lossless: equal, or parting
only at a near-tie, where the target's top-2 logits are closer than its dtype's rounding:
specdec/near_tie.py). Part 2, speed (``--speed N``):
the first N prompts one at a time, plain and each drafter (adaptive k) in a rotating order per
prompt, tokens/s and the ratio to plain from the summed times, each output compared with plain's.

    python benchmarks/drafts/bpe-draft/measure.py --draft specdec/assets/demo-draft-bpe [--speed 8]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS = HERE.parent.parent / "prompts" / "code_heldout.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="specdec/demo-target")
    ap.add_argument("--same-vocab-draft", default="specdec/demo-draft")
    ap.add_argument("--draft", required=True, help="the draft with its own tokenizer")
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--mappings", default="string,intersection,auto")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="above 0: acceptance only (seeded sampling; no comparison with plain, no timing)")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--speed", type=int, default=0, help="prompts timed one at a time (0: no timing)")
    ap.add_argument("--speed-mapping", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from specdec import LLM, SamplingParams
    from specdec.prompts import load_prompts

    prompts = [p["prompt"] if isinstance(p, dict) else p for p in load_prompts(Path(args.prompts), args.num_prompts)]
    greedy = args.temperature == 0
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                            seed=None if greedy else 0)
    specs = {"same-vocab": {"method": "draft_model", "model": args.same_vocab_draft}}
    for m in args.mappings.split(","):
        specs[f"bpe-{m}"] = {"method": "draft_model", "model": args.draft, "draft_tokenizer_mapping": m}

    plain = LLM(args.target, backend=args.backend)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params)] if greedy else None
    results: dict = {"temperature": args.temperature, "k": args.k, "prompts": len(prompts), "max_tokens": args.max_tokens, "backend": args.backend,
                     "acceptance": {}, "speed": {}}
    for name, spec in specs.items():
        llm = LLM(args.target, backend=args.backend,
                  speculative_config={**spec, "num_speculative_tokens": args.k, "adaptive": False})
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        m = llm.get_metrics()
        r = {"lossless": _compare(plain, prompts, reference, outs) if greedy else None, "acceptance_rate": m["acceptance_rate"],
             "acceptance_rate_per_pos": m["acceptance_rate_per_pos"], "tau": m["mean_acceptance_length"],
             "num_drafts": m["num_drafts"], "mapping": _mapping(llm)}
        results["acceptance"][name] = r
        per_pos = " / ".join(f"{a:.2f}" for a in r["acceptance_rate_per_pos"])
        print(f"{name:>18}: {_says(r['lossless']) if greedy else f'temperature {args.temperature:g}'}, acceptance {r['acceptance_rate']:.3f}, per position {per_pos}, "
              f"tau {r['tau']:.2f} (k={args.k} fixed{', mapping ' + r['mapping'] if r['mapping'] else ''})", flush=True)
        del llm

    if args.speed and greedy:
        timed = {"plain": plain}
        for name in ("same-vocab", f"bpe-{args.speed_mapping}"):
            timed[name] = LLM(args.target, backend=args.backend,
                              speculative_config={**specs[name], "num_speculative_tokens": args.k})
        for llm in timed.values():  # warm-up
            llm.generate(prompts[:1], params)
        seconds = dict.fromkeys(timed, 0.0)
        tokens = dict.fromkeys(timed, 0)
        names = list(timed)
        outputs: dict[str, list] = {name: [] for name in names}
        for i, prompt in enumerate(prompts[: args.speed]):
            for name in names[i % len(names):] + names[: i % len(names)]:  # rotate who goes first
                t0 = time.perf_counter()
                out = timed[name].generate([prompt], params)[0].outputs[0].token_ids
                seconds[name] += time.perf_counter() - t0
                tokens[name] += len(out)
                outputs[name].append(out)
        for name in names[1:]:
            results["speed"][f"{name}_lossless"] = _compare(plain, prompts[: args.speed], outputs["plain"], outputs[name])
            print(f"{name:>18}: batch 1 {_says(results['speed'][f'{name}_lossless'])}", flush=True)
        for name in names:
            tps = tokens[name] / seconds[name]
            results["speed"][name] = {"tokens_per_s": tps, "speedup": seconds["plain"] / seconds[name]
                                      * tokens[name] / tokens["plain"]}
            print(f"{name:>18}: {tps:.1f} tok/s, x{results['speed'][name]['speedup']:.2f} vs plain "
                  f"({args.speed} prompts x {args.max_tokens} tokens, batch 1, adaptive k<={args.k})", flush=True)
        bpe = timed[f"bpe-{args.speed_mapping}"]
        results["speed"]["bpe_mapping"] = _mapping(bpe)
        results["speed"]["bpe_tau"] = bpe.get_metrics()["mean_acceptance_length"]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _compare(plain, prompts: list[str], expected: list[list[int]], got: list[list[int]]) -> dict:
    """How many outputs equal plain greedy decoding's, and whether each one that parts does so at a
    near-tie (the target's top-2 gap below its dtype's rounding: lossless) or not (a bug)."""
    from specdec.near_tie import first_divergence

    parted = []
    for prompt, e, g in zip(prompts, expected, got):
        if e != g:
            ids = plain.tokenize(prompt)
            parted.append(first_divergence(plain.engine.target, ids, e, g))
    return {"equal": len(prompts) - len(parted), "total": len(prompts),
            "near_ties": sum(bool(d and d["near_tie"]) for d in parted), "parted": parted}


def _says(c: dict) -> str:
    ok = "lossless" if c["equal"] + c["near_ties"] == c["total"] else "NOT LOSSLESS"
    return f"{ok} ({c['equal']}/{c['total']} equal to plain, {c['near_ties']} parted at a near-tie)"


def _mapping(llm) -> str | None:
    """Which mapping the other-tokenizer drafter ran (None for a same-vocabulary draft)."""
    drafter = getattr(llm.engine, "drafter", None)
    return getattr(drafter, "mapping", None)


if __name__ == "__main__":
    main()
