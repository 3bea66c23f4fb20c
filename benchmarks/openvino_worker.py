"""The OpenVINO GenAI side of ``benchmarks/peer_openvino.py``: a long-lived worker that runs in the
throwaway venv (openvino, openvino-genai; no specdec, no project pins) and answers one JSON line per
request on stdin with one JSON line on stdout.

Requests (``op``):
- ``info``: versions, the CPU, and the compiled target's properties as the CPU plugin read them back
  (``INFERENCE_PRECISION_HINT``: bf16 where the CPU has avx512_bf16 or AMX, else f32; KV cache precision).
- ``generate``: ``{"config": "plain" | "plain-sdpa" | "draft" | "lookup", "ids": [...], "n": N, "k": k,
  "ngram": m}``: greedy, exactly N new tokens (ignore_eos, min_new_tokens), batch 1, on an
  ``LLMPipeline`` built once per config and kept; replies the tokens, the seconds ``generate`` took
  (timed here, so the pipe's transfer is not counted) and, when speculating, the drafted and accepted counts.
- ``step_cost``: ``{"context": C, "tokens": [1, 5], "repeats": R, "burst": B}``: ms of one forward of T
  tokens after C cached positions on the exported stateful model with the plain runtime (the target
  alone): per repeat and length, the state reset, C positions filled (untimed), then B forwards of T
  tokens in a row, the second half timed (a decode or verify loop's steady state).
- ``top2``: ``{"ids": [...]}``: the target's two best tokens after ``ids`` and the gap between their
  logits (where two greedy outputs part: a near-tie or not).
- ``quit``.

Started as ``VENV/bin/python openvino_worker.py --target DIR --draft DIR --threads 2``; OpenVINO's own
prints go to stderr, so stdout carries the replies only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="the target's OpenVINO IR folder (optimum-intel export)")
    ap.add_argument("--draft", default=None, help="the draft's OpenVINO IR folder")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own stdout ...
    os.dup2(2, 1)  # ... and everything else printed (C++ included) goes to stderr

    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    props = {"INFERENCE_NUM_THREADS": args.threads}
    pipes: dict[str, object] = {}

    def pipeline(config: str):
        """One LLMPipeline per config, built on first use and kept across prompts."""
        if config not in pipes:
            if config == "plain":
                pipes[config] = genai.LLMPipeline(args.target, "CPU", **props)
            elif config == "plain-sdpa":  # the stateful model, no paged attention
                pipes[config] = genai.LLMPipeline(args.target, "CPU", ATTENTION_BACKEND="SDPA", **props)
            elif config == "draft":
                if not args.draft:
                    raise ValueError("config 'draft' needs the worker started with --draft")
                pipes[config] = genai.LLMPipeline(args.target, "CPU", **props,
                                                  draft_model=genai.draft_model(args.draft, "CPU", **props))
            elif config == "lookup":
                pipes[config] = genai.LLMPipeline(args.target, "CPU", prompt_lookup=True, **props)
            else:
                raise ValueError(f"unknown config {config!r}: plain, plain-sdpa, draft or lookup")
        return pipes[config]

    def generate(req: dict) -> dict:
        pipe = pipeline(req["config"])
        cfg = pipe.get_generation_config()
        cfg.max_new_tokens = cfg.min_new_tokens = int(req["n"])
        cfg.ignore_eos, cfg.do_sample = True, False
        if req["config"] in ("draft", "lookup"):
            cfg.num_assistant_tokens = int(req["k"])
        if req["config"] == "lookup":
            cfg.max_ngram_size = int(req.get("ngram", 3))
        ids = np.array([req["ids"]], dtype=np.int64)  # [1, L]
        inputs = genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        t0 = time.perf_counter()
        res = pipe.generate(inputs, cfg)
        seconds = time.perf_counter() - t0
        out = {"tokens": [int(t) for t in res.tokens[0]], "seconds": seconds,
               "ttft_ms": res.perf_metrics.get_ttft().mean, "tpot_ms": res.perf_metrics.get_tpot().mean}
        ext = res.extended_perf_metrics
        if ext is not None and hasattr(ext, "get_num_accepted_tokens"):
            out |= {"drafted": ext.get_num_draft_tokens(), "accepted": ext.get_num_accepted_tokens()}
        return out

    core = ov.Core()
    compiled = None

    def target_model():
        nonlocal compiled
        if compiled is None:
            compiled = core.compile_model(os.path.join(args.target, "openvino_model.xml"), "CPU", props)
        return compiled

    def info() -> dict:
        cm = target_model()
        return {"openvino": ov.__version__, "openvino_genai": genai.__version__,
                "cpu": core.get_property("CPU", "FULL_DEVICE_NAME"),
                "capabilities": list(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")),
                "inference_precision": cm.get_property("INFERENCE_PRECISION_HINT").to_string(),
                "kv_cache_precision": cm.get_property("KV_CACHE_PRECISION").to_string(),
                "threads": cm.get_property("INFERENCE_NUM_THREADS"),
                "cpu_pinning": cm.get_property("ENABLE_CPU_PINNING")}

    def step_cost(req: dict) -> dict:
        request = target_model().create_infer_request()
        C, repeats = int(req["context"]), int(req.get("repeats", 15))
        vocab = 8000  # ids below every vocabulary this is run with; the values do not change the cost

        def feed(ids: list[int], start: int) -> None:
            x = np.array([ids], dtype=np.int64)  # [1, T]
            request.infer({"input_ids": x, "attention_mask": np.ones((1, start + len(ids)), dtype=np.int64),
                           "position_ids": np.arange(start, start + len(ids), dtype=np.int64)[None],
                           "beam_idx": np.zeros(1, dtype=np.int32)})

        burst = int(req.get("burst", 6))
        prompt = [(i * 7919) % (vocab - 10) + 5 for i in range(C)]
        times: dict[int, list[float]] = {int(T): [] for T in req["tokens"]}
        for _ in range(repeats):
            for T in times:  # lengths alternate within a repeat, so noise hits them alike
                request.reset_state()
                feed(prompt, 0)
                for i in range(burst):
                    t0 = time.perf_counter()
                    feed([(j * 31) % (vocab - 10) + 5 for j in range(T)], C + i * T)  # logits at every position
                    if i >= burst // 2:
                        times[T].append(time.perf_counter() - t0)
        return {"ms": {str(T): [1e3 * t for t in v] for T, v in times.items()}}

    def top2(req: dict) -> dict:
        request = target_model().create_infer_request()
        ids = np.array([req["ids"]], dtype=np.int64)  # [1, L]
        request.infer({"input_ids": ids, "attention_mask": np.ones_like(ids),
                       "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None],
                       "beam_idx": np.zeros(1, dtype=np.int32)})
        last = request.get_tensor("logits").data[0, -1].astype(np.float64)  # [V]
        a, b = np.argsort(last)[::-1][:2]
        return {"top": [int(a), int(b)], "gap": float(last[a] - last[b])}

    ops = {"generate": generate, "info": lambda req: info(), "step_cost": step_cost, "top2": top2}
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        try:
            reply = ops[req["op"]](req)
        except Exception as e:  # the parent shows it and stops; the worker stays up for a clean quit
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
