"""Constrained (JSON-schema) decoding: what the grammar costs, and what speculation buys under it.

Every prompt of ``prompts/json_records.jsonl`` asks for one more record of a fixed schema (SCHEMA
below), in compact JSON (``disable_any_whitespace``: with free whitespace the shipped code model
fills the record with newlines). Each side runs every prompt at batch 1, greedy, in one rotation (the order shifts by one
each prompt, so machine noise hits every side alike): plain decoding without a grammar, plain
decoding under the schema, and speculative decoding under the schema for each method. Reported:
tokens/s end to end and of decoding alone (prefill left out); the grammar's cost per token as a
fraction of a plain step, both from the end-to-end times (noisy: different outputs, a busy machine)
and from replaying the outputs through a matcher (mask + accept per token, caches cold as on first
decoding, and warm); spec vs plain constrained speedup, acceptance and tau (tokens per
verify pass, bonus included); whether each speculative output equals plain constrained decoding's
(a difference only at a near-tie of the masked logits); and that every output follows the schema.

    OMP_NUM_THREADS=1 python benchmarks/bench_structured.py [--model specdec/demo-target]
        [--draft specdec/demo-draft] [--methods draft_model suffix ngram draft_model:suffix]
        [--num-prompts 24] [--max-tokens 128] [-k 4] [--json]

Methods are named as in bench_methods.py (``suffix:k=8``, ``draft_model:suffix``, ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench_methods import method_config

PROMPTS = Path(__file__).resolve().parent / "prompts" / "json_records.jsonl"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 16, "maximum": 99},
        "email": {"type": "string", "maxLength": 32},
        "city": {"type": "string", "maxLength": 16},
        "role": {"enum": ["engineer", "designer", "manager", "analyst"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "city", "role", "skills", "active"],
    "additionalProperties": False,
}


def follows_schema(text: str) -> bool:
    """A complete record of SCHEMA (checked here by hand, independently of the grammar engine)."""
    try:
        r = json.loads(text)
    except json.JSONDecodeError:
        return False
    p = SCHEMA["properties"]
    return (isinstance(r, dict) and list(r) == SCHEMA["required"]
            and all(isinstance(r[k], str) and len(r[k]) <= p[k]["maxLength"] for k in ("name", "email", "city"))
            and type(r["age"]) is int and 16 <= r["age"] <= 99 and r["role"] in p["role"]["enum"]
            and isinstance(r["skills"], list) and 1 <= len(r["skills"]) <= 3
            and all(isinstance(s, str) and len(s) <= 16 for s in r["skills"]) and type(r["active"]) is bool)


def masked_divergence(llm, compiler, so, prompt_ids, expected, got) -> dict | None:
    """Where ``got`` parts from ``expected``: the top-2 gap of the target's logits under the grammar's
    mask there, and whether that is a near-tie."""
    from specdec.models.base import next_token_logits
    from specdec.near_tie import first_mismatch, near_tie_threshold

    j = first_mismatch(expected, got)
    if j is None:
        return None
    if j >= min(len(expected), len(got)):
        return {"position": j, "gap": None, "near_tie": False}
    m = compiler.matcher(so)
    for t in expected[:j]:
        m.accept_token(t)
    runner = llm.engine.target
    logits = next_token_logits(runner, [list(prompt_ids) + list(expected[:j])], row_tag="__bench_structured__")[0]
    top = logits[:m.vocab_size].masked_fill(~m.allowed_mask(), float("-inf")).topk(2).values
    gap = float(top[0] - top[1])
    return {"position": j, "gap": gap, "near_tie": gap < near_tie_threshold(runner, float(top[0]))}


def replay_cost_s(compiler, so, outputs: list[list[int]], cold: bool) -> tuple[float, int]:
    """Seconds and tokens of the grammar's per-token work (mask, then accept) over ``outputs``; ``cold``
    compiles the grammar afresh for each output (untimed), so no state was visited before, as when the
    engine first decoded them; warm reuses the compiled grammar whose caches have seen them all."""
    seconds, tokens = 0.0, 0
    for ids in outputs:
        if cold:
            compiler.clear_cache()
        m = compiler.matcher(so)
        t0 = time.perf_counter()
        for t in ids:
            m.allowed_mask()
            m.accept_token(t)
        seconds += time.perf_counter() - t0
        tokens += len(ids)
    return seconds, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="specdec/demo-target")
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--methods", nargs="+", default=["draft_model", "suffix", "ngram", "draft_model:suffix"])
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from specdec import LLM, SamplingParams
    from specdec.config import StructuredOutputsParams
    from specdec.prompts import load_prompts

    prompts = [p["prompt"] for p in load_prompts(PROMPTS, args.num_prompts)]
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=so)
    plain = LLM(args.model)
    sides = {"plain": (plain, free), "plain+json": (plain, constrained)}
    for method in args.methods:
        sides[method] = (LLM(args.model, speculative_config=method_config(method, args.draft, args.k)), constrained)
    names = list(sides)
    for llm, params in sides.values():  # warm-up
        llm.generate([prompts[0]], params)
        llm.reset_metrics()

    stats = {n: {"tokens": 0, "time_s": 0.0, "prefill_s": 0.0, "drafts": 0, "draft_tokens": 0, "accepted": 0,
                 "per_prompt_ms": []} for n in names}  # per_prompt_ms: decoding time per token, each prompt
    outputs: dict[str, list[list[int]]] = {n: [] for n in names}
    texts: dict[str, list[str]] = {n: [] for n in names}
    prompt_ids: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names):] + names[:i % len(names)]:
            llm, params = sides[name]
            before = llm.get_metrics()
            t0 = time.perf_counter()
            request = llm.generate([prompt], params)[0]
            elapsed = time.perf_counter() - t0
            after = llm.get_metrics()
            s, out = stats[name], request.outputs[0]
            s["tokens"] += len(out.token_ids)
            s["time_s"] += elapsed
            s["prefill_s"] += after["prefill_time_s"] - before["prefill_time_s"]
            for key, metric in (("drafts", "num_drafts"), ("draft_tokens", "num_draft_tokens"),
                                ("accepted", "num_accepted_tokens")):
                s[key] += after[metric] - before[metric]
            s["per_prompt_ms"].append((elapsed - (after["prefill_time_s"] - before["prefill_time_s"]))
                                      / max(len(out.token_ids), 1) * 1e3)
            outputs[name].append(list(out.token_ids))
            texts[name].append(out.text)
            if name == "plain":
                prompt_ids.append(list(request.prompt_token_ids))

    compiler = plain.engine.grammar_compiler  # warm: the plain runs compiled SCHEMA already
    warm_s, replay_tokens = replay_cost_s(compiler, so, outputs["plain+json"], cold=False)
    replay_s, _ = replay_cost_s(compiler, so, outputs["plain+json"], cold=True)

    def rate(n, decode_only=False):
        s = stats[n]
        return s["tokens"] / (s["time_s"] - (s["prefill_s"] if decode_only else 0.0))

    plain_step_s = 1.0 / rate("plain", decode_only=True)
    report = {
        "num_prompts": len(prompts), "max_tokens": args.max_tokens, "k": args.k,
        "plain_step_ms": plain_step_s * 1e3,
        "grammar_cost_per_token": {
            "replay_us": replay_s / replay_tokens * 1e6,
            "replay_fraction_of_plain_step": replay_s / replay_tokens / plain_step_s,
            "warm_replay_us": warm_s / replay_tokens * 1e6,
            "end_to_end_fraction_of_plain_step": rate("plain", True) / rate("plain+json", True) - 1.0,
            "end_to_end_median_per_prompt": statistics.median(
                j / f - 1.0 for j, f in zip(stats["plain+json"]["per_prompt_ms"], stats["plain"]["per_prompt_ms"])),
        },
        "sides": {},
    }
    for n in names:
        s = stats[n]
        row = {"tokens": s["tokens"], "tokens_per_s": rate(n), "decode_tokens_per_s": rate(n, True)}
        if n not in ("plain", "plain+json"):
            row["speedup_vs_plain_json"] = rate(n) / rate("plain+json")
            row["decode_speedup_vs_plain_json"] = rate(n, True) / rate("plain+json", True)
            row["acceptance_rate"] = s["accepted"] / s["draft_tokens"] if s["draft_tokens"] else 0.0
            row["tau"] = 1.0 + s["accepted"] / s["drafts"] if s["drafts"] else 1.0
            divergences = [masked_divergence(sides[n][0], compiler, so, p, e, g)
                           for p, e, g in zip(prompt_ids, outputs["plain+json"], outputs[n])]
            row["equal_to_plain_json"] = sum(d is None for d in divergences)
            row["near_ties"] = sum(bool(d and d["near_tie"]) for d in divergences)
            row["not_near_tie"] = [dict(prompt=i, **d) for i, d in enumerate(divergences) if d and not d["near_tie"]]
        if n != "plain":
            row["complete_and_valid"] = sum(follows_schema(t) for t in texts[n])
            row["cut_by_max_tokens"] = sum(len(o) >= args.max_tokens for o in outputs[n])
        report["sides"][n] = row

    if args.json:
        print(json.dumps(report, indent=2))
        return
    g = report["grammar_cost_per_token"]
    print(f"prompts {len(prompts)}, greedy, batch 1, max_tokens {args.max_tokens}, k {args.k}; "
          f"plain step {report['plain_step_ms']:.2f} ms")
    print(f"grammar cost per token: {g['replay_us']:.1f} us = {100 * g['replay_fraction_of_plain_step']:.2f}% of a "
          f"plain step (replay, cold caches; warm {g['warm_replay_us']:.1f} us); end to end {100 * g['end_to_end_fraction_of_plain_step']:+.1f}% "
          f"(median over prompts {100 * g['end_to_end_median_per_prompt']:+.1f}%)")
    print(f"{'side':<22}{'tok/s':>8}{'decode':>8}{'speedup':>9}{'decode':>8}{'accept':>8}{'tau':>6}"
          f"{'equal':>7}{'ties':>5}{'valid':>7}{'cut':>5}")
    for n, r in report["sides"].items():
        sp = f"{r['speedup_vs_plain_json']:.2f}x" if "speedup_vs_plain_json" in r else "-"
        dsp = f"{r['decode_speedup_vs_plain_json']:.2f}x" if "decode_speedup_vs_plain_json" in r else "-"
        acc = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-"
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        eq = f"{r['equal_to_plain_json']}/{len(prompts)}" if "equal_to_plain_json" in r else "-"
        valid = f"{r['complete_and_valid']}/{len(prompts)}" if "complete_and_valid" in r else "-"
        cut = str(r.get("cut_by_max_tokens", "-"))
        ties = str(r.get("near_ties", "-"))
        print(f"{n:<22}{r['tokens_per_s']:>8.1f}{r['decode_tokens_per_s']:>8.1f}{sp:>9}{dsp:>8}{acc:>8}{tau:>6}"
              f"{eq:>7}{ties:>5}{valid:>7}{cut:>5}")
        for d in r.get("not_near_tie", []):
            print(f"    prompt {d['prompt']}: differs at token {d['position']} (masked top-2 gap {d['gap']}): NOT a near-tie")


if __name__ == "__main__":
    main()
