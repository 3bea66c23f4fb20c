"""Plain vs speculative decoding on the same prompts, in one process, at batch size 1.

The baseline and the speculative ``LLM`` are both warmed up, then every prompt runs once with
each, alternating which goes first, so that machine noise (another job, frequency scaling) hits
both alike. Tokens/s is end-to-end: every generated token over the wall time of the
``generate`` calls, prefill included. With greedy settings the two outputs must match token for
token (docs/algorithm.md); the result says how many prompts did. Peers (other implementations, such as
transformers' ``generate`` for ``specdec bench --peer hf``) join the same rotation, so every side
takes every slot in turn.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.config import SamplingParams
from specdec.llm import LLM
from specdec.near_tie import first_divergence, first_mismatch

Prompt = str | dict | list[int]
Peer = Callable[[Prompt], list[int]]  # runs one prompt with the bench's settings, returns the output token ids


@dataclass
class PromptRun:
    """One prompt's totals over the repeats."""

    category: str | None
    ar_tokens: int = 0
    ar_time_s: float = 0.0
    spec_tokens: int = 0
    spec_time_s: float = 0.0
    ar_prefill_s: float = 0.0  # of the times above, the target's prompt prefill
    spec_prefill_s: float = 0.0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    matched: bool | None = None  # greedy only: spec output == plain output, token for token
    first_mismatch: int | None = None  # index into the output of the first differing token
    divergence: dict | None = None  # where it differs: the target's top-2 gap there and whether it is a near-tie
    peer_tokens: dict[str, int] = field(default_factory=dict)  # per peer (e.g. "hf_ar"): tokens over the repeats
    peer_time_s: dict[str, float] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # per side: the output of the last repeat

    @property
    def ar_tokens_per_s(self) -> float:
        return _rate(self.ar_tokens, self.ar_time_s)

    @property
    def spec_tokens_per_s(self) -> float:
        return _rate(self.spec_tokens, self.spec_time_s)

    @property
    def near_tie(self) -> bool:
        return bool(self.divergence and self.divergence["near_tie"])


@dataclass
class BenchResult:
    runs: list[PromptRun]
    spec_metrics: dict  # spec LLM.get_metrics() over the timed runs (warm-up excluded)
    greedy: bool
    repeats: int
    max_tokens: int
    num_speculative_tokens: int
    extra: dict = field(default_factory=dict)

    @property
    def ar_tokens_per_s(self) -> float:
        return _rate(sum(r.ar_tokens for r in self.runs), sum(r.ar_time_s for r in self.runs))

    @property
    def spec_tokens_per_s(self) -> float:
        return _rate(sum(r.spec_tokens for r in self.runs), sum(r.spec_time_s for r in self.runs))

    @property
    def speedup(self) -> float:
        return self.spec_tokens_per_s / self.ar_tokens_per_s if self.ar_tokens_per_s else 0.0

    @property
    def decode_speedup(self) -> float:
        """The speedup of the generation phase alone: the prompt's prefill, the same on both sides, left out."""
        ar = _rate(sum(r.ar_tokens for r in self.runs), sum(r.ar_time_s - r.ar_prefill_s for r in self.runs))
        spec = _rate(sum(r.spec_tokens for r in self.runs), sum(r.spec_time_s - r.spec_prefill_s for r in self.runs))
        return spec / ar if ar else 0.0

    @property
    def num_matched(self) -> int | None:
        return sum(bool(r.matched) for r in self.runs) if self.greedy else None

    def by_category(self) -> dict[str, dict]:
        cats: dict[str, list[PromptRun]] = {}
        for r in self.runs:
            cats.setdefault(r.category or "-", []).append(r)
        out = {}
        for name, runs in cats.items():
            ar = _rate(sum(r.ar_tokens for r in runs), sum(r.ar_time_s for r in runs))
            spec = _rate(sum(r.spec_tokens for r in runs), sum(r.spec_time_s for r in runs))
            drafted = sum(r.num_draft_tokens for r in runs)
            drafts = sum(r.num_drafts for r in runs)
            accepted = sum(r.num_accepted_tokens for r in runs)
            out[name] = {"num_prompts": len(runs), "ar_tokens_per_s": ar, "spec_tokens_per_s": spec,
                         "speedup": spec / ar if ar else 0.0,
                         "acceptance_rate": accepted / drafted if drafted else 0.0,
                         "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0}
        return out

    def as_dict(self) -> dict:
        m = self.spec_metrics
        runs = self.runs
        return {
            "num_prompts": len(runs), "repeats": self.repeats, "max_tokens": self.max_tokens, "greedy": self.greedy,
            "num_speculative_tokens": self.num_speculative_tokens,
            "ar": {"tokens": sum(r.ar_tokens for r in runs), "time_s": sum(r.ar_time_s for r in runs),
                   "tokens_per_s": self.ar_tokens_per_s,
                   "median_tokens_per_s": statistics.median(r.ar_tokens_per_s for r in runs)},
            "spec": {"tokens": sum(r.spec_tokens for r in runs), "time_s": sum(r.spec_time_s for r in runs),
                     "tokens_per_s": self.spec_tokens_per_s,
                     "median_tokens_per_s": statistics.median(r.spec_tokens_per_s for r in runs),
                     "acceptance_rate": m["acceptance_rate"],
                     "mean_acceptance_length": m["mean_acceptance_length"],
                     "acceptance_rate_per_pos": m["acceptance_rate_per_pos"],
                     "draft_time_s": m["draft_time_s"], "verify_time_s": m["verify_time_s"],
                     "metrics": m},
            "speedup": self.speedup,
            "decode_speedup": self.decode_speedup,
            "prefill_time_s": {"ar": sum(r.ar_prefill_s for r in runs), "spec": sum(r.spec_prefill_s for r in runs)},
            "greedy_match": ({"matched": self.num_matched, "total": len(runs),
                              "near_ties": sum(r.near_tie for r in runs),
                              "mismatched": [{"prompt": i, "first_mismatch": r.first_mismatch, **(r.divergence or {})}
                                             for i, r in enumerate(runs) if not r.matched]}
                             if self.greedy else None),
            "by_category": self.by_category(),
            **({"peers": self.peers()} if any(r.peer_tokens for r in runs) else {}),
            **self.extra,
        }

    def peers(self) -> dict[str, dict]:
        """Totals per peer: tokens, time and tokens/s."""
        names = list(dict.fromkeys(name for r in self.runs for name in r.peer_tokens))
        out = {}
        for name in names:
            tokens = sum(r.peer_tokens.get(name, 0) for r in self.runs)
            seconds = sum(r.peer_time_s.get(name, 0.0) for r in self.runs)
            out[name] = {"tokens": tokens, "time_s": seconds, "tokens_per_s": _rate(tokens, seconds)}
        return out


def run_bench(ar_llm: LLM, spec_llm: LLM, prompts: list[Prompt] | list[dict], params: SamplingParams,
              repeats: int = 1, warmup: int = 1, peers: dict[str, Peer] | None = None) -> BenchResult:
    """Time ``ar_llm`` (no drafter) against ``spec_llm`` on each prompt, one at a time.

    ``prompts``: strings, ``{"prompt_token_ids": [...]}`` dicts, or ``load_prompts`` records
    (``{"prompt": ..., "category": ...}``). Both LLMs' metrics are reset after the warm-up.
    ``peers``: other implementations (name -> run one prompt), timed in the same rotation.
    """
    peers = peers or {}
    if not prompts:
        raise ValueError("no prompts to benchmark")
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    if not (isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    if not isinstance(params, SamplingParams):
        raise ValueError("params must be a SamplingParams")
    items = [_split(p) for p in prompts]

    for _ in range(warmup):
        for llm in (ar_llm, spec_llm):
            llm.generate([items[0][0]], params)
        for peer in peers.values():
            peer(items[0][0])
    ar_llm.reset_metrics()
    spec_llm.reset_metrics()

    runs = [PromptRun(category=cat) for _, cat in items]
    for rep in range(repeats):
        for i, (prompt, _) in enumerate(items):
            run = runs[i]
            order = ("ar", "spec") if (i + rep) % 2 == 0 else ("spec", "ar")
            if peers:  # rotate every side through every slot
                sides = ["ar", "spec", *peers]
                shift = (i + rep) % len(sides)
                order = tuple(sides[shift:] + sides[:shift])
            outs = {}
            for side in order:
                if side in peers:
                    t0 = time.perf_counter()
                    ids = peers[side](prompt)
                    run.peer_time_s[side] = run.peer_time_s.get(side, 0.0) + time.perf_counter() - t0
                    run.peer_tokens[side] = run.peer_tokens.get(side, 0) + len(ids)
                    outs[side] = ids
                    continue
                llm = ar_llm if side == "ar" else spec_llm
                before = llm.get_metrics()
                t0 = time.perf_counter()
                request = llm.generate([prompt], params)[0]
                elapsed = time.perf_counter() - t0
                out = request.outputs[0]
                outs[side] = out.token_ids
                after = llm.get_metrics()
                prefill = after["prefill_time_s"] - before["prefill_time_s"]
                if side == "ar":
                    run.ar_tokens += len(out.token_ids)
                    run.ar_time_s += elapsed
                    run.ar_prefill_s += prefill
                    prompt_ids = request.prompt_token_ids
                else:
                    run.spec_prefill_s += prefill
                    run.spec_tokens += len(out.token_ids)
                    run.spec_time_s += elapsed
                    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                        setattr(run, key, getattr(run, key) + after[key] - before[key])
            run.outputs = outs
            if params.greedy:
                mismatch = first_mismatch(outs["ar"], outs["spec"])
                if run.matched is None or mismatch is not None:
                    run.matched = mismatch is None
                    run.first_mismatch = mismatch if mismatch is not None else run.first_mismatch
                if mismatch is not None and "ar" in outs and run.divergence is None:
                    run.divergence = first_divergence(ar_llm.engine.target, prompt_ids, outs["ar"], outs["spec"])

    spec = spec_llm.speculative_config
    return BenchResult(runs=runs, spec_metrics=spec_llm.get_metrics(), greedy=params.greedy, repeats=repeats,
                       max_tokens=params.max_tokens,
                       num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
                       extra={"paths": compute_paths(spec_llm)})


def compute_paths(llm: LLM) -> dict[str, str]:
    """Which compute path the target and the draft model took and why (``cpu.describe_path``)."""
    from specdec.models.base import ModelRunner
    from specdec.models.dtype_choice import describe_path

    requested = llm.model_config.dtype
    paths = {"backend": f"{llm.backend} ({llm.backend_reason})", "target": describe_path(llm.engine.target, requested)}
    draft = getattr(llm.engine.drafter, "runner", None)
    if draft is not None:
        paths["draft"] = describe_path(draft, requested) if isinstance(draft, ModelRunner) else _describe_head(draft)
    return paths


def _describe_head(runner) -> str:
    """A draft runner that is not a model runner (an EAGLE-3 head's): its own line where it has one (the
    head in llama.cpp), else what it is, its layers and kernels."""
    if hasattr(runner, "describe"):
        return runner.describe()
    c, fc = getattr(runner, "c", None), getattr(runner, "fc", None)
    if c is None or not hasattr(c, "layer_ids"):
        return type(runner).__name__
    kernels = f", {str(fc.dtype).removeprefix('torch.')} linears ({fc.kind})" if hasattr(fc, "kind") else ""
    lm_head = getattr(getattr(runner, "w", None), "lm_head", None)
    if hasattr(fc, "kind") and getattr(lm_head, "kind", fc.kind) != fc.kind:  # quantized products beside a 16-bit fc
        kernels = f", {str(fc.dtype).removeprefix('torch.')} fc ({fc.kind}), the rest {lm_head.kind}"
    return (f"EAGLE-3 head on {getattr(runner, 'device', 'cpu')}: one decoder layer over the target's layers "
            f"{c.layer_ids}, draft vocabulary {c.draft_vocab_size}{kernels}")


def _split(p) -> tuple[Prompt, str | None]:
    """(what LLM.generate takes, category) for a plain prompt or a load_prompts record."""
    if isinstance(p, dict) and "prompt" in p and "prompt_token_ids" not in p:
        return p["prompt"], p.get("category")
    return p, None


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0
