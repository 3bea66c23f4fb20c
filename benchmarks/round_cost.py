"""Where a speculative round's time goes: its wall time against the time inside the backend's forward
calls, by phase, at batch 1.

Each configuration (plain decoding, then the drafter at each k, fixed) runs the same prompts, greedy,
one prompt at a time, the configurations alternating prompt by prompt after one warm-up each. The
benchmark wraps the runner objects' ``forward`` / ``greedy_steps`` (the target's and the draft's),
``Engine.step`` (one round), the verify batch's construction and the verifier call, and splits each
round into:

- draft kernel: inside the draft runner's forward / greedy_steps / sampled_steps calls (an EAGLE-3 head's step /
  fuse), less the time in sampled_steps' picks (the drafter drawing each token: host work)
- draft host: the rest of the round before the verify batch is built (scheduling, the drafter's own work)
- verify kernel: inside the target's forward call
- hand-over (EAGLE-3): of the above, the target's kept layer inputs on their way to the head: copying
  them out of llama.cpp's buffers after each decode (inside the verify kernel) and reading them back
  for the head (inside the draft host)
- verify host: building the verify batch, then the logits' processing and the verifier (accept)
- commit/update: after the verifier: appending tokens, the drafter's observe, counters, the controller

"kernel" is the runner call as a whole (for llama.cpp, also the runner's own batch and logits
handling; ``decode`` gives the share inside ``llama_decode`` itself). Rounds that prefilled a prompt
(the target's or the draft's) are left out. Plain decoding runs several greedy steps per call
(``greedy_steps``): its row gives ms per token. The share outside the kernels is what host code costs.

    python benchmarks/round_cost.py [--model specdec/demo-target] [--draft specdec/demo-draft]
        [--methods draft_model,eagle3,suffix,ngram] [--eagle3-head specdec/demo-eagle3] [--adaptive]
        [--backends llama.cpp,torch] [--ks 2,4] [--num-prompts 4] [--max-tokens 64] [--threads 2]

``--adaptive`` adds each method with the adaptive controller (k up to the largest of ``--ks``); its
rounds of any k are split the same way. ``--eagle3-head-variants`` adds eagle3 beside llama.cpp with each runner
of the head, whatever the default (drafters/eagle3.head_runner): llama.cpp's eagle3 graphs
(models/llamacpp_head.py, on the target's threads; on one thread for passes of up to 16 tokens; its file in
q8_0) and the torch head (eager; compiled); the ``--eagle3-variants`` below
are the torch head's, run eager: they add eagle3 with its chain steps
eager (the torch head's one-row chain step is compiled beside a compiled target), through the head's general step (the draft step before ``HeadRunner.chain_step``), with the head on all of
torch's threads (before ``head_threads``). ``--eagle3-quantizations none,int8`` adds eagle3 with the head's
products in the target's 16 bits and in int8 (speculative_config ``quantization``) beside the default.
With eagle3 on llama.cpp it ends with a verify-sized forward timed with and without the kept states.

``--device cuda`` (torch backend only) runs on a GPU; each wrapped call then ends with
``torch.cuda.synchronize()``, so that its "kernel" time holds the GPU's work too (this removes what
overlap the host's next launches had with it: the round's wall time grows by a little).

``--profile N`` ends with one more prompt per configuration under cProfile (not counted in the table)
and prints each configuration's N costliest functions by own time: where host time goes.

``--model`` takes the stand-in too (benchmarks/make_standin.py): its HF folder, or a GGUF file for
llama.cpp (``--gguf`` per backend: ``--model-llama.cpp X.gguf``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.config import DRAFT_QUANTIZATIONS

PROMPTS = Path(__file__).resolve().parent / "prompts" / "code_heldout.jsonl"
PHASES = ("draft_kernel", "draft_host", "verify_kernel", "verify_host", "update")


@dataclass
class Round:
    """One ``Engine.step`` of a configuration, in seconds."""

    wall: float
    tokens: int
    draft_kernel: float = 0.0
    draft_host: float = 0.0
    verify_kernel: float = 0.0
    verify_host: float = 0.0
    update: float = 0.0
    decode: float = 0.0  # of the kernels, the time inside llama_decode (llama.cpp runners)
    handover: float = 0.0  # EAGLE-3: the target's kept states copied out after decodes and read back for the head
    plain: bool = False  # a greedy_steps round: no draft, several steps in one call
    drafted: bool = True

    @property
    def kernel(self) -> float:
        return self.draft_kernel + self.verify_kernel


SYNC: Callable[[], None] = lambda: None  # noqa: E731  # torch.cuda.synchronize with --device cuda


@dataclass
class Recorder:
    """The intervals of one ``Engine.step``: (kind, start, end) of each wrapped call."""

    events: list[tuple[str, float, float, int]] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    skipped: int = 0  # rounds that prefilled
    wrapped: list[tuple[object, str, object]] = field(default_factory=list)  # (object, name, what it held)

    def wrap(self, obj, name: str, kind: str, tokens_of: Callable | None = None) -> None:
        """Replace ``obj.name`` (on the object, not its class) by a timed call, until ``unwrap``."""
        inner = getattr(obj, name)
        self.wrapped.append((obj, name, obj.__dict__.get(name)))

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                SYNC()
                n = tokens_of(*args, **kwargs) if tokens_of else 0
                self.events.append((kind, t0, time.perf_counter(), n))

        setattr(obj, name, timed)

    def wrap_picks(self, obj, name: str, kind: str) -> None:
        """``wrap`` for ``sampled_steps``: the time inside its ``pick`` calls (the drafter's sampling, host
        work) is recorded as "pick" events, which the round takes out of ``kind``'s kernel time."""
        def with_timed_pick(token_ids, start, steps, pick, *args, **kwargs):
            def timed_pick(logits):
                t0 = time.perf_counter()
                try:
                    return pick(logits)
                finally:
                    self.events.append(("pick", t0, time.perf_counter(), 0))
            return inner(token_ids, start, steps, timed_pick, *args, **kwargs)

        inner = getattr(obj, name)
        self.wrapped.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, with_timed_pick)
        self.wrap(obj, name, kind)
        self.wrapped.pop()  # restored once, by the entry above

    def unwrap(self) -> None:
        for obj, name, held in reversed(self.wrapped):
            if held is None:
                delattr(obj, name)
            else:
                setattr(obj, name, held)
        self.wrapped.clear()

    def close_round(self, t0: float, t1: float, tokens: int, max_feed: int) -> None:
        """Turn the events of the step [t0, t1] into a ``Round``; a step that prefilled is counted apart."""
        ev, self.events = self.events, []
        span = lambda e: e[2] - e[1]  # noqa: E731
        target = [e for e in ev if e[0] == "target"]
        # a forward that fed more than a round's tokens: a prompt's prefill (the target's, or the draft
        # model's catch-up)
        if any(e[3] > max_feed for e in ev if e[0] in ("target", "draft")):
            self.skipped += 1
            return
        decode = covered([e for e in ev if e[0] == "decode"])
        handover = covered([e for e in ev if e[0] == "handover"])
        steps = [e for e in ev if e[0] == "target_steps"]
        if steps:
            self.rounds.append(Round(t1 - t0, tokens, verify_kernel=sum(map(span, steps)),
                                     verify_host=t1 - t0 - sum(map(span, steps)), decode=decode, plain=True,
                                     drafted=False))
            return
        # greedy_steps may call forward: counted once; a sampled chain's picks are the drafter's host work
        draft = covered([e for e in ev if e[0] == "draft"]) - covered([e for e in ev if e[0] == "pick"])
        built = next((e[1] for e in ev if e[0] == "verify_batch"), None)
        accepted = next((e[2] for e in ev if e[0] == "accept"), None)
        if built is None or accepted is None or not target:
            self.skipped += 1  # a round of another shape (a tree round): not what this table splits
            return
        fwd = target[-1]  # the verify pass; a forward inside forward_argmax (the base one) is its kernel
        fwd = next((e for e in reversed(target[:-1]) if e[1] >= fwd[1] and e[2] <= fwd[2]), fwd)
        self.rounds.append(Round(
            t1 - t0, tokens, draft_kernel=draft, draft_host=built - t0 - draft, verify_kernel=span(fwd),
            verify_host=(fwd[1] - built) + (accepted - fwd[2]), update=t1 - accepted, decode=decode,
            handover=handover, drafted=fwd[3] > 1))  # batch 1: a verify pass of more than the newest token


def covered(events: list[tuple[str, float, float, int]]) -> float:
    """Seconds covered by the events' intervals, nested or overlapping ones counted once."""
    total, end = 0.0, float("-inf")
    for _, a, b, _ in sorted(events, key=lambda e: e[1]):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def fed_tokens(batch, *args, **kwargs) -> int:
    return sum(batch.lengths)


@contextmanager
def instrumented(llm, recorder: Recorder):
    """Time ``llm``'s rounds into ``recorder``: its runners' calls, its engine's steps, and (for the
    duration) the verify batch's construction and the verifier as the engine module calls them."""
    import specdec.engine as engine_module
    from specdec.scheduler import RoundBatch

    engine = llm.engine
    recorder.wrap(engine.target, "forward", "target", fed_tokens)
    recorder.wrap(engine.target, "forward_argmax", "target", fed_tokens)  # a greedy verify pass
    recorder.wrap(engine.target, "greedy_steps", "target_steps")
    if hasattr(engine.target, "_decode"):
        recorder.wrap(engine.target, "_decode", "decode")
    for name in ("_keep_states", "hidden_states", "kept_states"):  # EAGLE-3's hand-over (models/llamacpp.py)
        if hasattr(engine.target, name):
            recorder.wrap(engine.target, name, "handover")
    drafter = engine.drafter
    runner = getattr(drafter, "runner", None)
    if runner is not None and runner is not engine.target:
        if hasattr(runner, "forward"):
            recorder.wrap(runner, "forward", "draft", fed_tokens)
            recorder.wrap(runner, "forward_argmax", "draft", fed_tokens)  # a greedy draft's catch-up pass
        # a model's steps; an EAGLE-3 head's (drafters/eagle3.py)
        for name in ("greedy_steps", "step", "chain_step", "catch_up_row", "fuse"):
            if hasattr(runner, name):
                recorder.wrap(runner, name, "draft")
        if hasattr(runner, "sampled_steps"):
            recorder.wrap_picks(runner, "sampled_steps", "draft")
        if hasattr(runner, "_decode"):
            recorder.wrap(runner, "_decode", "decode")
    max_feed = 1 + max(engine.k, 0)
    step = engine.step

    def timed_step():
        t0 = time.perf_counter()
        gained = step()
        t1 = time.perf_counter()
        recorder.close_round(t0, t1, sum(len(t) for _, t in gained), max_feed)
        return gained

    engine.step = timed_step
    recorder.wrapped.append((engine, "step", None))
    verify, verify_greedy, verify_batch = engine_module.verify, engine_module.verify_greedy, RoundBatch.verify_batch

    def timing(accept):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = accept(*args, **kwargs)
            recorder.events.append(("accept", t0, time.perf_counter(), 0))
            return out
        return timed

    def timed_verify_batch(self, *args, **kwargs):
        recorder.events.append(("verify_batch", time.perf_counter(), 0.0, 0))
        return verify_batch(self, *args, **kwargs)

    engine_module.verify, engine_module.verify_greedy = timing(verify), timing(verify_greedy)
    RoundBatch.verify_batch = timed_verify_batch
    try:
        yield
    finally:
        engine_module.verify, engine_module.verify_greedy, RoundBatch.verify_batch = verify, verify_greedy, verify_batch
        recorder.unwrap()


@dataclass
class Config:
    backend: str
    k: int  # 0: plain decoding; with ``adaptive``, the largest k
    name: str
    adaptive: bool = False
    llm: object = None
    recorder: Recorder = field(default_factory=Recorder)
    generate_s: float = 0.0  # wall time of the generate calls (tokenizing and detokenizing included)
    tokens: int = 0


def load_prompts(n: int, tokenizer, max_prompt: int) -> list[list[int]]:
    rows = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()][:n]
    return [tokenizer.encode(p)[-max_prompt:] for p in rows]


METHODS = ("draft_model", "eagle3", "suffix", "ngram")
QUANTIZATIONS = tuple(q for q in DRAFT_QUANTIZATIONS if q)  # --eagle3-quantizations: speculative_config's values


def build(args) -> list[Config]:
    from specdec import LLM

    configs = []
    drafts = {"draft_model": args.draft, "eagle3": args.eagle3_head}
    for backend in args.backends:
        model = args.model_llamacpp if backend == "llama.cpp" and args.model_llamacpp else args.model
        runs = [(None, 0, False)] + [(m, k, False) for m in args.methods for k in args.ks]
        if args.adaptive:
            runs += [(m, max(args.ks), True) for m in args.methods]
        if args.eagle3_variants:
            runs += [(f"eagle3 {v}", k, False) for v in ("eager-chain", "general-step", "torch-threads") for k in args.ks]
        for q in args.eagle3_quantizations.split(",") if args.eagle3_quantizations else []:
            runs += [(f"eagle3 {q}", k, False) for k in args.ks]
        if args.eagle3_head_variants and backend == "llama.cpp":  # the head beside a llama.cpp target
            runs += [(f"eagle3 {v}", k, False) for v in ("llama.cpp-head", "torch-head", "compiled-torch-head", "one-thread-head",
                                                       "q8_0-head")
                     for k in args.ks]
        for method, k, adaptive in runs:
            spec = None if method is None else {
                "method": method.split()[0], "num_speculative_tokens": k, "adaptive": adaptive, "draft_tree": "chain"}
            if method is not None and method.split()[0] in drafts:
                spec["model"] = drafts[method.split()[0]]
            if method is not None and method.split()[-1] in QUANTIZATIONS:
                spec["quantization"] = method.split()[-1]
            name = (f"{backend} plain" if method is None else
                    f"{backend} {method} " + (f"adaptive k<={k}" if adaptive else f"k={k}"))
            c = Config(backend, k, name, adaptive)
            c.llm = LLM(model=model, backend=backend, speculative_config=spec, enforce_eager=args.enforce_eager,
                        device=args.device)
            if method in ("eagle3 llama.cpp-head", "eagle3 one-thread-head", "eagle3 q8_0-head"):
                from specdec.models.llamacpp_head import LlamaCppHead

                d = c.llm.engine.drafter
                d.runner, d.can_draft_trees = LlamaCppHead(d.head, d.target, weight_type="q8_0" if "q8_0" in method else "bf16"), False
                if method == "eagle3 one-thread-head":
                    d.runner.one_thread_tokens = 16  # a round's small passes on one thread
            elif method is not None and method.startswith("eagle3 ") and method.split()[-1] not in QUANTIZATIONS:  # the torch head's
                torch_head(c.llm.engine.drafter)
                if "compiled" in method:
                    c.llm.engine.drafter.runner.compile(args.eagle3_head)
            if method == "eagle3 general-step":
                general_steps(c.llm.engine.drafter)
            elif method == "eagle3 torch-threads":
                c.llm.engine.drafter.pinned_one_thread = False  # the head on torch's threads, as before head_threads
            configs.append(c)
    return configs


def torch_head(drafter) -> None:
    """An EAGLE-3 drafter beside a llama.cpp target with the torch head (HeadRunner, eager until compiled),
    whatever the default runs, to time them in one run."""
    from specdec.drafters.eagle3 import HeadRunner, head_dtype

    drafter.runner = HeadRunner(drafter.head, head_dtype(drafter.target), drafter.device)
    drafter.can_draft_trees = True


def general_steps(drafter) -> None:
    """An EAGLE-3 drafter whose chain steps go through the head's general ``step`` at T = 1 (the draft
    step before ``HeadRunner.chain_step``), to time both in one run."""
    r = drafter.runner
    step = r.step

    def chain_step(ids, hidden, rows, pos):
        logits, g = step(ids[:, None], hidden[:, None], rows, torch.tensor(pos)[:, None])
        return logits[:, 0], g[:, 0]

    r.chain_step = chain_step


def run(configs: list[Config], prompts: list[list[int]], max_tokens: int, options: dict | None = None) -> None:
    """Every prompt through every configuration; ``options``: SamplingParams' (temperature, top_p, top_k)."""
    from specdec import SamplingParams

    def params(i: int) -> SamplingParams:  # sampled: seeded by the prompt, the same for every configuration
        return SamplingParams(**(options or {}), max_tokens=max_tokens, ignore_eos=True, seed=i)

    for c in configs:  # warm-up: kernels, the compiled step, the first steps
        c.llm.generate([{"prompt_token_ids": prompts[0]}], params(0))
    for i, ids in enumerate(prompts):
        order = configs[i % len(configs):] + configs[:i % len(configs)]
        for c in order[::-1] if i % 2 else order:
            with instrumented(c.llm, c.recorder):
                t0 = time.perf_counter()
                out = c.llm.generate([{"prompt_token_ids": ids}], params(i))[0].outputs[0]
                c.generate_s += time.perf_counter() - t0
            c.tokens += len(out.token_ids)


def table(configs: list[Config]) -> str:
    """One row per configuration: ms per round (plain: per token) by phase, the share outside the kernels,
    and tok/s with its ratio to the same backend's plain decoding."""
    head = ("| configuration | rounds | tokens/round | ms/round | draft kernel | draft host | verify kernel | "
            "verify host | commit/update | hand-over | outside kernels | in llama_decode | tok/s (x plain) |")
    lines = [head, "| --- " * 13 + "|"]
    plain = {c.backend: c.tokens / c.generate_s for c in configs if c.k == 0 and c.generate_s}
    for c in configs:
        rate = c.tokens / c.generate_s if c.generate_s else 0.0
        speed = f"{rate:.1f} ({rate / plain[c.backend]:.2f}x)" if plain.get(c.backend) else f"{rate:.1f}"
        # plain decoding: its greedy_steps calls, or (sampled) its one-token rounds through the verifier
        rs = [r for r in c.recorder.rounds if (r.plain or not r.drafted)] if c.k == 0 else \
            [r for r in c.recorder.rounds if not r.plain]
        if not rs:  # an adaptive run that switched drafting off: plain steps only
            plain_steps = sum(r.plain for r in c.recorder.rounds)
            lines.append(f"| {c.name} | 0 (drafting off: {plain_steps} plain rounds) | | | | | | | | | | | {speed} |")
            continue
        n = len(rs)
        toks = sum(r.tokens for r in rs)
        per = (lambda x: 1e3 * x / toks) if c.k == 0 else (lambda x: 1e3 * x / n)  # noqa: E731
        wall = sum(r.wall for r in rs)
        cells = [per(sum(getattr(r, p) for r in rs)) for p in PHASES]
        kernel = sum(r.kernel for r in rs)
        decode = sum(r.decode for r in rs)
        handover = sum(r.handover for r in rs)
        outside = 1 - kernel / wall if wall else 0.0
        label = c.name + (" (per token)" if c.k == 0 else "")
        lines.append(
            f"| {label} | {n} | {toks / n:.2f} | {per(wall):.2f} | " + " | ".join(f"{x:.2f}" for x in cells)
            + f" | {f'{per(handover):.2f}' if handover else '-'} | {outside:.0%} | "
            f"{f'{decode / kernel:.0%} of kernel' if decode else '-'} | {speed} |")
    return "\n".join(lines)


def cpu_path() -> str:
    """The CPU and the vector extensions its kernels can use, in a few words."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({' + '.join(isa) or 'no AVX2'})"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="specdec/demo-target", help="target: a name, HF folder or GGUF file")
    ap.add_argument("--model-llamacpp", default=None, help="the target for llama.cpp only (e.g. the stand-in's GGUF)")
    ap.add_argument("--draft", default="specdec/demo-draft", help="the draft_model drafter's model")
    ap.add_argument("--eagle3-head", default="specdec/demo-eagle3", help="the eagle3 drafter's head")
    ap.add_argument("--methods", default="draft_model",
                    help="drafters, comma-separated: draft_model, eagle3 (models), suffix, ngram (draft-free)")
    ap.add_argument("--adaptive", action="store_true", help="also each method adaptive, k up to the largest of --ks")
    ap.add_argument("--eagle3-variants", action="store_true",
                    help="also eagle3 at each k with its chain steps eager (not compiled), through the head's general "
                         "step, and on all of torch's threads (the variants run the head eager)")
    ap.add_argument("--eagle3-quantizations", default="",
                    help="also eagle3 at each k with each of these speculative_config quantizations, comma-separated: "
                         "none (the target's 16 bits), int8, int4 (beside the default, unset)")
    ap.add_argument("--eagle3-head-variants", action="store_true",
                    help="also eagle3 beside llama.cpp with each runner of the head: llama.cpp's graphs (on the "
                         "target's threads, on one thread for small passes, its file in q8_0) and the torch head "
                         "(eager, compiled)")
    ap.add_argument("--backends", default="llama.cpp,torch")
    ap.add_argument("--ks", default="2,4", help="fixed k per configuration, comma-separated")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=256, help="prompt tokens kept (the last ones)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled, seeded per prompt")
    ap.add_argument("--top-p", type=float, default=1.0, help="sampled rounds: top-p (1: off)")
    ap.add_argument("--top-k", type=int, default=0, help="sampled rounds: top-k (0: off)")
    ap.add_argument("--enforce-eager", action="store_true", help="torch: eager, not the compiled step")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (torch backend only)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then profile one prompt per configuration (cProfile) and print its N costliest functions")
    args = ap.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.methods or any(m not in METHODS for m in args.methods):
        ap.error(f"--methods takes {', '.join(METHODS)}, got {args.methods}")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in args.backends if b not in ("llama.cpp", "torch")]
    if bad or not args.backends:
        ap.error(f"--backends takes llama.cpp and/or torch, got {args.backends}")
    if args.device != "cpu" and args.backends != ["torch"]:
        ap.error(f"--device {args.device} runs the torch backend only: pass --backends torch")
    try:
        args.ks = [int(k) for k in args.ks.split(",") if k.strip()]
    except ValueError:
        ap.error(f"--ks takes integers, got {args.ks!r}")
    if any(k < 1 for k in args.ks):
        ap.error(f"--ks must be at least 1, got {args.ks}")
    for name in ("num_prompts", "max_tokens", "max_prompt", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> None:
    global SYNC
    args = parse(argv)
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        SYNC = torch.cuda.synchronize
    configs = build(args)
    prompts = load_prompts(args.num_prompts, configs[0].llm.tokenizer, args.max_prompt)
    t0 = time.perf_counter()
    options = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    run(configs, prompts, args.max_tokens, options)
    cuts = "".join(f", {name} {v:g}" for name, v, off in (("top_p", args.top_p, 1.0), ("top_k", args.top_k, 0)) if v != off)
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}{cuts}, seeded per prompt"
    print(f"\n{len(prompts)} prompts x {args.max_tokens} tokens, {sampling}, batch 1, {args.threads} threads, "
          f"configurations alternating; {time.perf_counter() - t0:.0f} s; {cpu_path()}"
          + (f"; {torch.cuda.get_device_name()}, torch {torch.__version__}" if args.device != "cpu" else ""))
    print("ms per round (plain: per token) by phase; kernel = inside the runners' forward / greedy_steps calls; "
          f"rounds that prefilled left out ({', '.join(f'{c.name} {c.recorder.skipped}' for c in configs)})")
    print(table(configs))
    for c in configs:
        undrafted = sum(not r.drafted for r in c.recorder.rounds if not r.plain)
        if c.k and undrafted:
            print(f"{c.name}: {undrafted} of its rounds drafted nothing")
        m = c.llm.get_metrics()
        if c.k:
            print(f"{c.name}: τ {m['mean_acceptance_length']:.2f}, acceptance {m['acceptance_rate']:.1%}")
        if c.k and hasattr(c.llm.engine.drafter, "head"):  # which ran the EAGLE-3 head
            from specdec.models.llamacpp_head import describe_head

            print(f"{c.name}: {describe_head(c.llm.engine.drafter.runner)}")
    if "eagle3" in args.methods and "llama.cpp" in args.backends:
        print(keep_cost(configs, max(args.ks) + 1))
    if args.profile:
        profile(configs, prompts[0], args.max_tokens, args.profile, options)


def profile(configs: list[Config], ids: list[int], max_tokens: int, top: int, options: dict | None = None) -> None:
    """One prompt per configuration under cProfile: its ``top`` functions by own time."""
    import cProfile
    import io
    import pstats

    from specdec import SamplingParams

    params = SamplingParams(**(options or {}), max_tokens=max_tokens, ignore_eos=True, seed=0)
    for c in configs:
        prof = cProfile.Profile()
        prof.enable()
        c.llm.generate([{"prompt_token_ids": ids}], params)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        body = text.getvalue()
        print(f"\n## {c.name}: cProfile, {max_tokens} tokens (times inflated by the profiler)\n"
              + body[body.find("   ncalls"):].rstrip())


def keep_cost(configs: list[Config], tokens: int, context: int = 300, repeats: int = 60) -> str:
    """A verify-sized forward (``tokens`` tokens over ``context`` cached positions) of the llama.cpp
    target with and without keeping an EAGLE-3 head's layer inputs, alternating in this process: what
    llama.cpp's copy of the states costs inside ``llama_decode``, and the runner's copy after it."""
    from specdec.models.base import ForwardBatch
    from specdec.models.load import load_runner

    c = next(c for c in configs if c.backend == "llama.cpp" and "eagle3" in c.name)
    path, layers = c.llm.target.path, c.llm.engine.drafter.head.config.layer_ids
    runners = {}
    for name in ("without", "with"):
        r, _ = load_runner(path, "llama.cpp")
        if name == "with":
            r.keep_hidden_states(layers)
        r.reserve(1, context + tokens + 1)
        r.sync_rows(["a"])
        r.forward(ForwardBatch.from_rows([[1 + i % 100 for i in range(context)]], [0]))
        runners[name] = r
    spent = dict.fromkeys(runners, 0.0)
    for i in range(repeats):
        for name, r in (runners.items() if i % 2 else reversed(runners.items())):
            t0 = time.perf_counter()
            r.forward(ForwardBatch.from_rows([list(range(7, 7 + tokens))], [context], logits="all"))
            spent[name] += time.perf_counter() - t0
    ms = {name: 1e3 * t / repeats for name, t in spent.items()}
    return (f"{tokens}-token forward over {context} positions, llama.cpp target keeping the head's layer inputs "
            f"{ms['with']:.2f} ms, keeping none {ms['without']:.2f} ms ({repeats} each, alternating)")


if __name__ == "__main__":
    main()
