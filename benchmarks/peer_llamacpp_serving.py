"""Serving on the same GGUF files: ``specdec serve`` on its llama.cpp backend against ``llama-server
-np 8`` (continuous batching), the same fresh Spec-Bench prompts, greedy, exactly --max-tokens
tokens a request (EOS ignored), every server started once and the runs alternating.

llama-server runs plain and with the draft (``-md``, ``--spec-draft-n-max`` each of --ks); specdec
serve runs plain, the draft (-k, adaptive), suffix and the draft with suffix in front. Throughput:
--concurrency requests kept in flight over --requests prompts (bench_server's ``sustained``), tok/s
from the first request to the last token. TPOT and TTFT: medians over --single-requests requests sent
one at a time. Prompts go to both as token ids of specdec's tokenizer; each server sees each prompt
once (suffix learns from earlier outputs). Each side's speculative outputs are checked against its
plain outputs token for token; a divergence is judged a near-tie or not by specdec's runner
(``specdec.near_tie``). Same threads on both sides: llama-server ``-t/-tb`` (``-td/-tbd`` for the
draft), specdec serve OMP_NUM_THREADS.

    python benchmarks/peer_llamacpp_serving.py --prompts "$SPEC_BENCH" \\
        --threads 2 [--rounds 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_server, peer_llamacpp
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # specdec

from bench_server import OPENAI, Api, Server as SpecdecServer, concurrent, spec_counters, sustained  # noqa: E402
from peer_llamacpp import (Server as LlamaServer, add_model_args, build_tools, completion_body,  # noqa: E402
                           completion_chunk, gguf_of, quantized)

LLAMA_API = Api("/completion", completion_body, completion_chunk)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--prompts", required=True, help="Spec-Bench question.jsonl (or any prompts file)")
    ap.add_argument("--max-prompt-tokens", type=int, default=256, help="leave out longer prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight; llama-server's -np")
    ap.add_argument("--requests", type=int, default=32, help="requests per throughput run")
    ap.add_argument("--single-requests", type=int, default=8, help="requests per server for TPOT at 1 request")
    ap.add_argument("--rounds", type=int, default=1, help="alternations of every server (new prompts each)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-k", type=int, default=4, help="specdec's draft tokens per round (adaptive below it)")
    ap.add_argument("--ks", default="2,4", help="llama-server --spec-draft-n-max values")
    ap.add_argument("--slot-context", type=int, default=1024, help="llama-server positions per slot")
    ap.add_argument("--server-fa", default="auto,off",
                    help="llama-server --flash-attn settings to run every configuration with (its default is auto: "
                         "on for the CPU; specdec's runner turns it off)")
    ap.add_argument("--serve-args", default="", help="more options for every specdec serve, e.g. "
                    "'--engine-in-process' or '--http-nice 0'")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from specdec import LLM
    from specdec.near_tie import first_divergence
    from specdec.prompts import load_prompts

    bin_dir = build_tools()
    target, draft = gguf_of(args.target, args.target_outtype), gguf_of(args.draft, args.draft_outtype)
    judge = LLM(target)  # the tokenizer, and the near-tie judge after the runs
    tok = judge.tokenizer
    limit = min(args.max_prompt_tokens, args.slot_context - args.max_tokens)
    ids = [p for r in load_prompts(args.prompts) if len(p := tok.encode(r["prompt"])) <= limit]
    per_round = args.requests + args.single_requests
    if len(ids) < args.rounds * per_round + 1:
        raise SystemExit(f"{len(ids)} prompts of at most {limit} tokens in {args.prompts}; the runs need "
                         f"{args.rounds * per_round + 1}: lower --rounds/--requests or raise --max-prompt-tokens")
    warm = ids[-1]

    k = str(args.k)
    specdec_cfgs = {
        "plain": [],
        f"draft k={k} adaptive": ["--draft", draft, "-k", k],
        "suffix k=8": ["--speculative-config", json.dumps({"method": "suffix", "num_speculative_tokens": 8})],
        "draft+suffix": ["--speculative-config", json.dumps({"method": "draft_model", "model": draft,
                                                             "num_speculative_tokens": args.k,
                                                             "enable_suffix_decoding": True})],
    }
    repack = ["--no-repack"] if quantized(target) else []  # as specdec's runner loads quantized files
    server_cfgs = {"plain": repack, **{f"-md k={n}": [*repack, "-md", draft, "--spec-draft-n-max", n, "-td",
                                                     str(args.threads), "-tbd", str(args.threads)]
                                       for n in args.ks.split(",")}}
    server_cfgs = {(name if fa == "auto" else f"{name} -fa {fa}"): [*extra, "-fa", fa]
                   for name, extra in server_cfgs.items() for fa in args.server_fa.split(",")}

    servers: dict[str, object] = {}
    try:
        for name, extra in specdec_cfgs.items():
            servers[f"specdec {name}"] = SpecdecServer(name.split()[0], ["--model", target, *extra,
                                                                        *shlex.split(args.serve_args)], args.threads)
        for name, extra in server_cfgs.items():
            servers[f"llama-server {name}"] = LlamaServer(bin_dir, target, args.threads, extra,
                                                          ctx=args.concurrency * args.slot_context,
                                                          parallel=args.concurrency)
        for key, s in servers.items():
            if key.startswith("specdec"):
                s.wait_ready()
        api = {key: LLAMA_API if key.startswith("llama-server") else OPENAI for key in servers}
        for key, s in servers.items():
            asyncio.run(concurrent(s.url, [warm], 8, api=api[key]))
        counters0 = {key: s.metrics() for key, s in servers.items() if key.startswith("specdec")}

        ours = [k_ for k_ in servers if k_.startswith("specdec")]
        theirs = [k_ for k_ in servers if k_.startswith("llama-server")]
        order = [x for i in range(max(len(ours), len(theirs))) for x in ours[i : i + 1] + theirs[i : i + 1]]
        res = {key: {"tokens": 0, "wall": 0.0, "tpot": [], "ttft": [], "outputs": {}} for key in servers}
        for r in range(args.rounds):
            pool = ids[r * per_round : (r + 1) * per_round]
            batch, singles = pool[: args.requests], pool[args.requests :]
            for key in order if r % 2 == 0 else order[::-1]:
                out, wall = asyncio.run(sustained(servers[key].url, batch, args.max_tokens, args.concurrency,
                                                  api=api[key]))
                res[key]["tokens"] += sum(len(x.token_ids) for x in out)
                res[key]["wall"] += wall
                res[key]["outputs"].update({tuple(x.prompt): x.token_ids for x in out})
                print(f"round {r}: {key:36s} {sum(len(x.token_ids) for x in out) / wall:7.1f} tok/s "
                      f"({args.concurrency} in flight)", flush=True)
            for p in singles:
                for key in order if r % 2 == 0 else order[::-1]:
                    out, _ = asyncio.run(concurrent(servers[key].url, [p], args.max_tokens, api=api[key]))
                    res[key]["tpot"].append(out[0].tpot)
                    res[key]["ttft"].append(out[0].ttft)
                    res[key]["outputs"][tuple(p)] = out[0].token_ids
        counters = {key: spec_counters(counters0[key], servers[key].metrics()) for key in counters0}
    finally:
        for key, s in servers.items():
            s.stop() if key.startswith("specdec") else s.close()

    rows = {}
    for key, v in res.items():
        plain = res[f"{key.split()[0]} plain" + "".join(key.partition(" -fa ")[1:])]["outputs"]
        diverged = [(p, plain[p], got) for p, got in v["outputs"].items() if got != plain[p]]
        judged = [first_divergence(judge.target, list(p), e, g) for p, e, g in diverged]
        rows[key] = {"tok_s": v["tokens"] / v["wall"], "tpot_ms": 1e3 * statistics.median(v["tpot"]),
                     "ttft_ms": 1e3 * statistics.median(v["ttft"]), "equal": len(v["outputs"]) - len(diverged),
                     "outputs": len(v["outputs"]), "near_ties": sum(d["near_tie"] for d in judged),
                     "divergences": judged, **counters.get(key, {})}
    best_lc = max(theirs, key=lambda x: rows[x]["tok_s"])
    best_md = min((x for x in theirs if "-md" in x), key=lambda x: rows[x]["tpot_ms"])
    print(f"\n{Path(target).name} + {Path(draft).name}, {args.threads} threads each, greedy, {args.max_tokens} "
          f"tokens, {args.concurrency} in flight over {args.requests} fresh prompts x {args.rounds} round(s); "
          f"TPOT/TTFT: medians of {args.single_requests * args.rounds} single requests")
    print(f"| server | tok/s, {args.concurrency} in flight | / best llama-server ({best_lc.split(' ', 1)[1]}) | "
          "TPOT 1 req (ms) | TTFT 1 req (ms) | accept | τ | equal to plain (near-ties) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in ours + theirs:
        x = rows[key]
        acc = f"{x['acceptance_rate']:.0%} | {x['mean_acceptance_length']:.2f}" if x.get("mean_acceptance_length", 1) > 1 else "- | -"
        print(f"| {key} | {x['tok_s']:.1f} | {x['tok_s'] / rows[best_lc]['tok_s']:.2f}x | {x['tpot_ms']:.2f} | "
              f"{x['ttft_ms']:.1f} | {acc} | {x['equal']}/{x['outputs']} ({x['near_ties']}) |")
    best_sd = max(ours, key=lambda x: rows[x]["tok_s"])
    sd_draft = f"specdec draft k={k} adaptive"
    print(f"\nthroughput, specdec best ({best_sd}) / llama-server best ({best_lc}): "
          f"{rows[best_sd]['tok_s'] / rows[best_lc]['tok_s']:.2f}x")
    print(f"TPOT at 1 request, {best_md} / {sd_draft}: {rows[best_md]['tpot_ms'] / rows[sd_draft]['tpot_ms']:.2f}x "
          "(> 1: specdec faster)")
    for key, x in rows.items():
        for d in x["divergences"]:
            if not d["near_tie"]:
                print(f"  {key}: diverges from plain at {d['position']}, gap {d['gap']} >= threshold {d['threshold']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
