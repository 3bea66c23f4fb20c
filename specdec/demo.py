"""What ``specdec demo`` runs: the configurations it measures on this machine, which wins, and why.

No configuration is fastest on every machine. On the CPUs measured so far the cheaper one-token step
is llama.cpp's or torch's (where specdec's 16-bit weight kernel runs), torch has the flatter verify
pass (oneDNN, AMX, the 16-bit kernel), and a drafter pays only where what it gets accepted per
verify pass outweighs what the pass and the drafting cost (cost_model.py). So the demo measures
instead of assuming: plain decoding on each backend and a few speculative configurations (method, k,
backend), each on the same short probe prompts, one prompt at a time, rotating the order so that
machine noise hits every configuration alike (as specdec.bench does for two). The fastest plain
backend is the baseline; the speculative configuration with the most tokens/s is the one the demo
runs. Why it wins is said from what this run measured: each backend's one-token step and verify pass
of VERIFY_K + 1 tokens, timed on the candidates' own loaded runners right after the probe
(``forward_costs``), the tokens each method gets per pass (τ), and per backend the limit that holds
it back most (``limits``): its step against the fastest backend's, its verify pass in steps, or
acceptance (tokens a round could emit over τ).
The acceptance measured per method is kept for ``backend="auto"`` (backend_choice.record_acceptance).

The choice (``choose``) and its explanation (``explain``) are pure functions of ``Measured``
records, so tests decide on injected figures; ``measure`` produces the records.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.config import BACKENDS, SamplingParams

# Short code prompts, not the demo's own: the configuration is chosen on other text than it is shown on.
PROBE_PROMPTS = [
    "def binary_search(items, target):\n    \"\"\"",
    "def merge_sort(xs):\n    \"\"\"",
    "class Queue:\n    def __init__(self):\n        self.",
]
PROBE_TOKENS = 48
VERIFY_K = 4  # the verify pass the explanation quotes: 5 tokens, a draft of 4 and its bonus
PROBE_ROUNDS = 2
EXTRA_ROUNDS = 2  # more rounds, at most, while a figure is implausible (``implausible``)
PLAUSIBLE = 1.15  # a speculative configuration runs at most τ times plain on its backend, give or take noise
# k is the most drafts per round; the adaptive controller drafts fewer where longer drafts do not pay
MODEL_K = 6  # draft_model, eagle3
SUFFIX_K = 16
# The demo runs its prompts more than once: suffix decoding's cache of earlier outputs would replay them
# (every draft accepted), so its candidates draft from each request's own prompt and output only.
OWN_TEXT_ONLY = {"suffix_decoding_max_cached_requests": 0}
MIN_ROUNDS = 10  # rounds that drafted, at least, before the acceptance measured is kept for backend=auto
# The final comparison (``final_comparison``): a ratio more than EXPLAIN_BAND away from what τ and the
# costs predict (``expected_ratio``), or plain backends whose ratio moved that much since the probe, is
# measured again, up to FINAL_EXTRA_ROUNDS times, and flagged if it stays so.
EXPLAIN_BAND = 1.3
FINAL_EXTRA_ROUNDS = 2
# The final comparison runs its prompts this many times, each prompt and side keeping its fastest run: one
# run of 3 prompts x 64 tokens is under a second a side, and its ratio moved 1.21x-1.46x between demo runs
# on one machine (pard and suffix,pard measured 1.41x-1.42x over six alternating runs of the same prompts)
FINAL_ROUNDS = 3
# A backend whose verify pass of k + 1 tokens costs more than (k + 1) / CANNOT_PAY one-token steps is out
# of arithmetic: a round with every draft accepted would gain less than CANNOT_PAY, and real rounds accept
# fewer and pay for their drafting, so nothing is left.
CANNOT_PAY = 1.5


@dataclass(frozen=True)
class Candidate:
    """One configuration: a backend, and a speculative method with its k (``method`` None: plain)."""

    backend: str
    method: str | tuple[str, ...] | None = None
    k: int = 0
    model: str | None = None  # the draft model or the EAGLE-3 head
    parallel: bool = False  # the draft model is a parallel draft (PARD, parallel_drafting): "pard" in its name

    @property
    def plain(self) -> bool:
        return self.method is None

    @property
    def method_name(self) -> str:
        if self.method is None:
            return "plain"
        names = [self.method] if isinstance(self.method, str) else list(self.method)
        return ",".join("pard" if self.parallel and m == "draft_model" else m for m in names)

    @property
    def name(self) -> str:
        return f"{self.backend} plain" if self.plain else f"{self.backend} + {self.method_name} k={self.k}"

    def speculative_config(self) -> dict | None:
        if self.plain:
            return None
        methods = [self.method] if isinstance(self.method, str) else list(self.method)
        cfg: dict = {"method": self.method if isinstance(self.method, str) else methods,
                     "num_speculative_tokens": self.k}
        if self.model is not None:
            cfg["model"] = self.model
        if self.parallel:
            cfg["parallel_drafting"] = True
        if "suffix" in methods:
            cfg.update(OWN_TEXT_ONLY)
        return cfg


@dataclass
class Measured:
    """What one candidate did on the probe: tokens and wall time (per prompt its fastest round), and
    the quantities the explanation uses."""

    candidate: Candidate
    tokens: int = 0
    time_s: float = 0.0
    tau: float = 1.0  # tokens per verify pass, the recovered or bonus token included
    mean_k: float = 0.0  # drafts per round that drafted (the controller may draft fewer than k; a tree round: its nodes)
    step_ms: float | None = None  # plain: ms per token end to end; speculative: the controller's 1-token step
    verify_steps: float | None = None  # the verify pass of mean_k + 1 tokens, in one-token steps (controller)
    error: str | None = None  # why this candidate could not run here

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.tokens > 0

    def as_dict(self) -> dict:
        c = self.candidate
        return {"name": c.name, "backend": c.backend, "method": c.method_name, "k": c.k,
                "tokens": self.tokens, "time_s": self.time_s, "tokens_per_s": self.tokens_per_s,
                "mean_acceptance_length": self.tau, "mean_k": self.mean_k, "step_ms": self.step_ms,
                "verify_steps": self.verify_steps, "error": self.error}


@dataclass
class DemoChoice:
    """The fastest plain backend, the best speculative configuration, and everything measured."""

    plain: Measured
    spec: Measured | None
    measured: list[Measured] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        """The best speculative configuration's tokens/s over plain decoding on the fastest backend."""
        if self.spec is None or not self.plain.tokens_per_s:
            return 0.0
        return self.spec.tokens_per_s / self.plain.tokens_per_s

    def plain_on(self, backend: str) -> Measured | None:
        return next((m for m in self.measured if m.ok and m.candidate.plain and m.candidate.backend == backend), None)


def candidates(backends: list[str], draft: str | None, head: str | None, methods: list[str] | None = None,
               k: int | None = None, pard: str | None = None) -> list[Candidate]:
    """Plain decoding on each backend, then per backend: the draft model, the parallel draft ``pard``
    (method "pard": draft_model with parallel_drafting), suffix decoding, the EAGLE-3 head (each when
    installed) and the list of suffix and the best model drafter (chosen per request; the parallel
    draft where installed: it measured fastest of the three on both backends, docs/benchmarks.md).
    ``methods``: only these speculative methods (one entry may be a list, e.g. ["suffix,eagle3"]);
    ``k``: this k for every one."""
    model_for = {"draft_model": draft, "pard": pard, "eagle3": head}
    if methods is None:
        model = next((m for m in ("pard", "eagle3", "draft_model") if model_for[m]), None)
        methods = [m for m in ("draft_model", "pard", "suffix", "eagle3") if m == "suffix" or model_for[m]]
        if model:
            methods.append(f"suffix,{model}")
    out = [Candidate(b) for b in backends]
    for b in backends:
        for entry in methods:
            names = tuple(entry.split(","))
            needs = [m for m in names if m in model_for]
            if len(needs) > 1:
                raise ValueError(f"method list {entry!r} names {' and '.join(needs)}; they read one model each, "
                                 "list one of them")
            model = model_for[needs[0]] if needs else None
            if needs and model is None:
                raise ValueError(f"method {needs[0]} needs its model, and none is installed: "
                                 + ("pass --draft HEAD" if needs[0] == "eagle3" else "pass --draft D"))
            default_k = MODEL_K if needs else SUFFIX_K
            parallel = "pard" in names
            names = tuple("draft_model" if m == "pard" else m for m in names)
            out.append(Candidate(b, names[0] if len(names) == 1 else names, default_k if k is None else k, model,
                                 parallel))
    return out


def build(cands: list[Candidate], target: str, device: str = "cpu",
          progress: Callable[[str], None] | None = None) -> dict[Candidate, object]:
    """An ``LLM`` per candidate, or the reason it cannot run here (a string: llama.cpp not installed,
    a method a backend cannot run)."""
    from specdec import LLM

    llms: dict[Candidate, object] = {}
    for c in cands:
        try:
            llms[c] = LLM(model=target, device=device, backend=c.backend, speculative_config=c.speculative_config())
        except ValueError as e:
            llms[c] = str(e)
            if progress:
                progress(f"  {c.name}: not available here ({e})")
    return llms


def measure(llms: dict[Candidate, object], prompts: list[str] | None = None, max_tokens: int = PROBE_TOKENS,
            rounds: int = PROBE_ROUNDS, clock: Callable[[], float] = time.perf_counter) -> list[Measured]:
    """Every runnable candidate on every probe prompt, greedy, batch 1, ``rounds`` times: after one
    warm-up call each (kernels; the controller's first plain steps), prompt by prompt, the order of
    the candidates rotated from prompt to prompt and reversed every other one, and up to
    EXTRA_ROUNDS more while a figure is implausible. A candidate's figure is per prompt its fastest
    round (noise from other work only ever adds time), summed."""
    prompts = prompts or PROBE_PROMPTS
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results = {c: Measured(c, error=llm if isinstance(llm, str) else None) for c, llm in llms.items()}
    live = [c for c, llm in llms.items() if not isinstance(llm, str)]
    runs: dict[Candidate, dict[int, list[tuple[float, int]]]] = {c: {} for c in live}  # prompt -> [(s, tokens)]

    def run(c: Candidate, prompt: str) -> int | None:
        try:
            return len(llms[c].generate([prompt], params)[0].outputs[0].token_ids)
        except Exception as e:  # reported in the table, and the candidate leaves the rotation
            results[c].error = f"{type(e).__name__}: {e}"
            live.remove(c)
            return None

    for c in list(live):
        if run(c, prompts[0]) is not None:
            llms[c].reset_metrics()

    def summarize() -> None:
        for c in live:
            fastest = [min(times) for times in runs[c].values()]
            results[c].time_s = sum(t for t, _ in fastest)
            results[c].tokens = sum(n for _, n in fastest)
            _fill_costs(results[c], llms[c])

    r = 0
    while r < rounds or (r < rounds + EXTRA_ROUNDS and implausible(list(results.values()))):
        for i, prompt in enumerate(prompts):
            turn = r * len(prompts) + i
            order = live[turn % len(live):] + live[:turn % len(live)] if live else []
            for c in order[::-1] if turn % 2 else order:
                t0 = clock()
                n = run(c, prompt)
                if n is not None:
                    runs[c].setdefault(i, []).append((clock() - t0, n))
        r += 1
        summarize()
    record_acceptance(llms, list(results.values()))
    return list(results.values())


def implausible(measured: list[Measured]) -> list[str]:
    """Speculative configurations measured faster over plain decoding on their own backend than their
    τ allows (a round emits τ tokens for at least one target step): another job slowed the plain runs
    or sped up these. ``measure`` runs more rounds while any is left (each prompt keeps its fastest)."""
    plain = {m.candidate.backend: m for m in measured if m.ok and m.candidate.plain}
    return [m.candidate.name for m in measured
            if m.ok and not m.candidate.plain and m.candidate.backend in plain
            and m.tokens_per_s > PLAUSIBLE * m.tau * plain[m.candidate.backend].tokens_per_s]


def record_acceptance(llms: dict[Candidate, object], measured: list[Measured]) -> None:
    """Keep each single method's measured acceptance (over its runs on every backend: the α whose
    E(k) is the τ measured at the drafts per round measured) for backend="auto" of the same target,
    method and draft (backend_choice.acceptance_for)."""
    from specdec.models.backend_choice import alpha_from_tau, record_acceptance as keep
    from specdec.models.resolve import resolve

    counts: dict[tuple[str, str | None], list[int]] = {}  # (method, model) -> [rounds, drafted, accepted]
    target = None
    for m in measured:
        c = m.candidate
        if not m.ok or c.plain or not isinstance(c.method, str):
            continue
        target = target or llms[c].model_config.model
        metrics = llms[c].get_metrics()
        total = counts.setdefault((c.method, c.model), [0, 0, 0])
        for i, name in enumerate(("drafts", "draft_tokens", "accepted_tokens")):  # chains only: a tree's
            total[i] += metrics[f"num_{name}"] - metrics.get(f"num_tree_{name}", 0)  # nodes are no draft length
    for (method, model), (rounds, drafted, accepted) in counts.items():
        if rounds < MIN_ROUNDS:
            continue
        try:
            draft = resolve(model) if method == "draft_model" and model else None
            alpha = alpha_from_tau(1 + accepted / rounds, drafted / rounds)
            keep(resolve(target), method, draft, [alpha], rounds, "specdec demo")
        except (ValueError, OSError):  # a cache that cannot be written only means priors next time
            pass


def _fill_costs(m: Measured, llm) -> None:
    """τ and drafts per round from the metrics; the one-token step and the verify pass of
    mean_k + 1 tokens (in steps) from the adaptive controller's measured verify line at batch 1; for
    plain decoding, its milliseconds per token."""
    metrics = llm.get_metrics()
    if m.candidate.plain:
        m.step_ms = 1e3 / m.tokens_per_s if m.tokens_per_s else None  # end to end, prefill included
        return
    m.tau = metrics["mean_acceptance_length"]
    m.mean_k = metrics["num_draft_tokens"] / metrics["num_drafts"] if metrics["num_drafts"] else 0.0
    controller = llm.engine.controller
    if controller is not None and any(b == 1 for b, _ in controller.verify_time):
        line = controller.verify_line(1)
        m.step_ms = 1e3 * line(1)
        if m.mean_k:
            m.verify_steps = line(round(m.mean_k) + 1) / line(1)


def forward_costs(llms: dict[Candidate, object] | str, k: int = VERIFY_K) -> dict[str, tuple[float, float]]:
    """Milliseconds of the target's forward of 1 and k + 1 tokens on each backend, after 256 cached
    positions, the backends alternating (backend_choice.time_runners), measured now: on the plain
    candidates' own runners when given the built ``llms``, else (a target name) on both backends
    loaded for it. Never from a cache: a figure timed another day, under another load or torch path,
    would explain this run with another run's costs."""
    from specdec.models import backend_choice

    if isinstance(llms, str):
        from specdec.models.resolve import resolve

        ms = backend_choice.time_backends(resolve(llms), "auto", k)
        return {b: (ms[b][0], ms[b][-1]) for b in BACKENDS}
    runners = {c.backend: llm.engine.target for c, llm in llms.items()
               if c.plain and not isinstance(llm, str)}
    if not runners:
        raise ValueError("no plain candidate loaded: nothing to time the forwards on")
    ms = backend_choice.time_runners(runners, {b: (1, k + 1) for b in runners}, backend_choice.CONTEXT)
    return {b: (t[0], t[1]) for b, t in ms.items()}


def limits(choice: DemoChoice, costs: dict[str, tuple[float, float]] | None = None,
           k: int = VERIFY_K) -> dict[str, tuple[str, float]]:
    """Per backend, what holds its best configuration back most, as (limit, factor): the loss of its
    round against an ideal one (the fastest backend's step, a verify pass at the cost of one step,
    every draft accepted), split in three factors, each >= 1:
    "step": its one-token step over the fastest backend's; "verify": its verify pass of the tokens
    drafted + 1 in steps (the controller's measured line, else ``costs`` at k + 1 tokens);
    "acceptance": the tokens a round could emit (drafted + 1) over τ. Plain-only backends: the step;
    where the controller drafted nothing, the verify pass of k + 1 tokens it would have paid for."""
    steps = _steps(choice, costs)
    fastest = min(steps.values(), default=0.0)
    out = {}
    for backend, step in steps.items():
        factors = {"step": step / fastest if fastest else 1.0}
        spec = _best_spec(choice, backend)
        if spec is not None and spec.mean_k:
            if spec.verify_steps is not None:
                factors["verify"] = spec.verify_steps
            elif costs and backend in costs:
                factors["verify"] = costs[backend][1] / costs[backend][0]
            factors["acceptance"] = (spec.mean_k + 1) / spec.tau
        elif spec is not None and costs and backend in costs:  # the controller drafted nothing: the pass it
            factors["verify"] = costs[backend][1] / costs[backend][0]  # would pay for, at k + 1 tokens
        limit = max(factors, key=factors.__getitem__)
        out[backend] = (limit, factors[limit])
    return out


def _best_spec(choice: DemoChoice, backend: str) -> Measured | None:
    return max((m for m in choice.measured if m.ok and not m.candidate.plain and m.candidate.backend == backend),
               key=lambda m: m.tokens_per_s, default=None)


def _steps(choice: DemoChoice, costs: dict[str, tuple[float, float]] | None) -> dict[str, float]:
    """Each backend's one-token step in ms: timed (``costs``), else plain decoding's ms per token."""
    steps = {}
    for backend in dict.fromkeys(m.candidate.backend for m in choice.measured if m.ok):
        plain = choice.plain_on(backend)
        if costs and backend in costs:
            steps[backend] = costs[backend][0]
        elif plain is not None and plain.step_ms:
            steps[backend] = plain.step_ms
    return steps


def _limit_text(limit: tuple[str, float], spec: Measured | None, fastest: str, k: int) -> str:
    name, factor = limit
    if name == "step":
        return (f"held back by its step ({factor:.2f}x {fastest}'s)" if factor > 1.0
                else "the fastest step here")
    if name == "verify":
        if not spec.mean_k:
            return (f"held back by its verify curve ({k + 1} tokens cost {factor:.2f} steps: the controller "
                    "drafted nothing)")
        tokens = round(spec.mean_k) + 1 if spec.verify_steps is not None else k + 1
        return f"held back by its verify curve ({tokens} tokens cost {factor:.2f} steps)"
    return f"held back by acceptance (τ {spec.tau:.2f} of the {spec.mean_k + 1:.1f} tokens a round could emit)"


def choose(measured: list[Measured]) -> DemoChoice:
    """The plain candidate with the most tokens/s (the baseline) and the speculative one with the most
    (None if none ran). Equal figures keep the earlier candidate."""
    plains = [m for m in measured if m.ok and m.candidate.plain]
    if not plains:
        errors = "; ".join(f"{m.candidate.name}: {m.error}" for m in measured if m.candidate.plain)
        raise ValueError(f"plain decoding ran on no backend ({errors or 'none measured'})")
    specs = [m for m in measured if m.ok and not m.candidate.plain]
    best = lambda ms: max(ms, key=lambda m: m.tokens_per_s)  # noqa: E731 -- max keeps the first of equals
    return DemoChoice(best(plains), best(specs) if specs else None, list(measured))


def explain(choice: DemoChoice, costs: dict[str, tuple[float, float]] | None = None, k: int = VERIFY_K) -> str:
    """One line: each backend's step and what a verify pass costs in steps (``costs``: ms of the
    forward of 1 and k + 1 tokens per backend, ``forward_costs``; else the controller's measured
    verify line at the k drafted) and the limit that holds it back most (``limits``), what the
    winning method gets per pass, and the verdict against plain decoding on the fastest backend."""
    held = limits(choice, costs, k)
    steps = _steps(choice, costs)
    fastest = min(steps, key=steps.__getitem__) if steps else choice.plain.candidate.backend
    parts = []
    for backend in dict.fromkeys(m.candidate.backend for m in choice.measured if m.ok):
        specs = [m for m in choice.measured if m.ok and not m.candidate.plain and m.candidate.backend == backend]
        best = _best_spec(choice, backend)
        if costs and backend in costs:
            t1, tk = costs[backend]
            text = f"{backend}: step {t1:.2f} ms, a verify pass of {k + 1} tokens costs {tk / t1:.2f} steps"
        else:
            plain = choice.plain_on(backend)
            timed = max((m for m in specs if m.verify_steps is not None), key=lambda m: m.tokens_per_s, default=None)
            text = f"{backend}: {plain.step_ms:.2f} ms per token plain" if plain and plain.step_ms else f"{backend}:"
            if timed is not None:
                text += f", a verify pass of {round(timed.mean_k) + 1} tokens costs {timed.verify_steps:.2f} steps"
        if best is not None:
            text += f", best {best.candidate.method_name} at {best.tokens_per_s:.1f} tok/s"
        if backend in held:
            text += ", " + _limit_text(held[backend], best, fastest, k)
        parts.append(text)
    spec, plain = choice.spec, choice.plain
    if spec is None:
        return "; ".join(parts) + (f" -> no speculative configuration ran; plain {plain.candidate.backend} "
                                   "is the fastest")
    if spec.mean_k:
        parts.append(f"{spec.candidate.method_name} gets {spec.tau:.2f} tokens per verify pass "
                     f"(drafting {spec.mean_k:.1f} a round)")
    else:
        parts.append(f"{spec.candidate.method_name} drafted nothing (the controller found no k that pays here): it "
                     "ran as plain decoding")
    if choice.speedup > 1.0:
        verdict = (f"{spec.candidate.name} is {choice.speedup:.2f}x plain {plain.candidate.backend} "
                   f"(the fastest plain backend)")
    else:
        verdict = (f"no speculative configuration beats plain {plain.candidate.backend} here: the best, "
                   f"{spec.candidate.name}, runs at {choice.speedup:.2f}x it")
    noisy = implausible(choice.measured)
    if noisy:  # still, after the extra rounds
        verdict += (f" (noisy: {', '.join(noisy)} measured faster over plain on the same backend than τ allows; "
                    "another job shared the CPU: run it again when the machine is quiet)")
    text = "; ".join(parts) + " -> " + verdict
    if costs:
        passes = {b: (k + 1, tk / t1) for b, (t1, tk) in costs.items() if t1 > 0}
    else:  # the controller's measured verify line at the drafts per round of each backend's best
        best = {b: _best_spec(choice, b) for b in steps}
        passes = {b: (round(s.mean_k) + 1, s.verify_steps) for b, s in best.items()
                  if s is not None and s.mean_k and s.verify_steps}
    why_not = cannot_pay(passes)
    return text + "".join(f". {line}" for line in why_not.values())


def cannot_pay(passes: dict[str, tuple[int, float]]) -> dict[str, str]:
    """Per backend out of arithmetic here, the sentence that says speculation cannot pay on it and why.
    ``passes``: per backend a verify pass as (tokens, its cost in one-token steps). A round emits at most
    that many tokens for the pass, so tokens / steps bounds its gain: below CANNOT_PAY nothing is left."""
    out = {}
    for backend, (tokens, steps) in passes.items():
        if steps > 0 and tokens / steps < CANNOT_PAY:
            out[backend] = (f"On this CPU {backend} is out of arithmetic: a verify pass of {tokens} tokens costs "
                            f"{steps:.2f} one-token steps, so even a round with every draft accepted is at most "
                            f"{tokens / steps:.2f}x plain before drafting costs: speculation cannot pay on it here "
                            "(a CPU with spare arithmetic, more cores or AVX-512 / AMX, verifies flatter)")
    return out


# -- the final comparison ----------------------------------------------------------------------------


def expected_ratio(tau: float, drafted_rounds: int, plain_steps: int, verify_steps: float,
                   draft_steps: float, host_steps: float = 0.0) -> float:
    """The speedup over plain decoding on the same backend that τ and the costs explain: rounds that
    drafted emit τ tokens for a verify pass of ``verify_steps`` one-token steps plus ``draft_steps`` of
    drafting; rounds that drafted nothing emit one token per step. ``host_steps``: the engine's own
    work per round outside drafting and verifying (scheduling, commit), paid by every round and, per
    token, by plain decoding too."""
    tokens = drafted_rounds * tau + plain_steps
    steps = drafted_rounds * (verify_steps + draft_steps + host_steps) + plain_steps * (1 + host_steps)
    return tokens / steps * (1 + host_steps) if steps > 0 else 1.0


@dataclass
class FinalFigures:
    """What the final comparison measured, and what the costs say it should have."""

    ratio: float  # speculative over plain on the same backend, decoding alone (prefill left out)
    tau: float
    drafted_rounds: int
    plain_steps: int  # rounds that drafted nothing (one token each)
    verify_steps: float | None  # the verify pass of the drafts per round + 1 tokens, in one-token steps
    draft_steps: float | None  # drafting per round that drafted, in one-token steps
    plain_ratio: float | None = None  # fastest plain backend over the same backend's plain: now ...
    probe_plain_ratio: float | None = None  # ... and in the probe
    host_steps: float = 0.0  # the engine's work per round outside drafting and verifying, in one-token steps

    @property
    def expected(self) -> float | None:
        if self.verify_steps is None or self.draft_steps is None:
            return None
        return expected_ratio(self.tau, self.drafted_rounds, self.plain_steps, self.verify_steps, self.draft_steps,
                              self.host_steps)


def doubts(f: FinalFigures, band: float = EXPLAIN_BAND) -> list[str]:
    """Why the final figures cannot be trusted as measured ([] when τ and the costs explain them): a
    ratio over τ allows, a ratio ``band`` away from what τ and the costs predict, plain backends whose
    ratio moved by ``band`` since the probe."""
    out = []
    if f.ratio > PLAUSIBLE * f.tau:
        out.append(f"{f.ratio:.2f}x over plain on the same backend is more than τ {f.tau:.2f} allows")
    elif f.expected is not None and not f.expected / band <= f.ratio <= f.expected * band:
        out.append(f"{f.ratio:.2f}x over plain on the same backend where τ {f.tau:.2f} and the measured costs "
                   f"predict {f.expected:.2f}x")
    if f.plain_ratio and f.probe_plain_ratio:
        moved = f.plain_ratio / f.probe_plain_ratio
        if not 1 / band <= moved <= band:
            out.append(f"the plain backends measured {f.plain_ratio:.2f}x apart now and "
                       f"{f.probe_plain_ratio:.2f}x in the probe")
    return out


def drafts_per_round(metrics: dict) -> dict[int, int] | None:
    """{k: rounds that drafted exactly k tokens} from the per-position counts (a chain round of k drafts
    counts at positions 0..k-1); None where trees were drafted (their positions are depths)."""
    per_pos = metrics.get("num_draft_tokens_per_pos") or []
    if metrics.get("num_tree_drafts") or not per_pos:
        return None
    rounds = {i + 1: n - (per_pos[i + 1] if i + 1 < len(per_pos) else 0) for i, n in enumerate(per_pos)}
    return {k: n for k, n in rounds.items() if n > 0}


def final_figures(result, spec_llm, choice: DemoChoice | None = None, peer: str | None = None,
                  costs: dict[str, tuple[float, float]] | None = None, k: int = VERIFY_K) -> FinalFigures:
    """``FinalFigures`` of a ``bench.BenchResult`` of plain (same backend) vs ``spec_llm``: τ and rounds
    from its metrics; the verify pass and the one-token step from the adaptive controller's measured
    line (averaged over the rounds' numbers of drafts: with the 16-bit kernel the cost steps every 3
    tokens, so a round of 6 drafts and one of 1 cost more than two of 3), else from ``costs``
    (``forward_costs``, interpolated between 1 and k + 1 tokens); ``peer``:
    the fastest plain backend's name in the result, compared with the probe's plain figures in ``choice``."""
    m = result.spec_metrics
    drafted, passes = m["num_drafts"], m["num_verify_passes"]
    mean_k = m["num_draft_tokens"] / drafted if drafted else 0.0
    verify_steps = draft_steps = None
    controller = spec_llm.engine.controller
    backend = spec_llm.backend
    if controller is not None and any(b == 1 for b, _ in controller.verify_time):
        line = controller.verify_line(1)
        step = line(1)
        rounds = drafts_per_round(m)
        verify_steps = (sum(n * line(k + 1) for k, n in rounds.items()) / sum(rounds.values()) / step if rounds
                        else line(round(mean_k) + 1) / step)
    elif costs and backend in costs:
        step, tk = costs[backend][0] / 1e3, costs[backend][1] / 1e3
        verify_steps = 1 + (tk / step - 1) * mean_k / k
    host_steps = 0.0
    if verify_steps is not None:
        draft_steps = (m["draft_time_s"] / drafted / step) if drafted else 0.0
        host_steps = m.get("overhead_time_s", 0.0) / passes / step if passes else 0.0
    plain_ratio = probe_ratio = None
    if peer is not None and choice is not None:
        fast, same = choice.plain, choice.plain_on(backend)
        peers = result.peers()
        if same is not None and peer in peers and result.ar_tokens_per_s:
            plain_ratio = peers[peer]["tokens_per_s"] / result.ar_tokens_per_s
            probe_ratio = fast.tokens_per_s / same.tokens_per_s if same.tokens_per_s else None
    return FinalFigures(result.decode_speedup, m["mean_acceptance_length"], drafted, max(0, passes - drafted),
                        verify_steps, draft_steps, plain_ratio, probe_ratio, host_steps)


def final_comparison(plain_llm, spec_llm, prompts: list, params: SamplingParams, peers: dict | None = None,
                     choice: DemoChoice | None = None, costs: dict[str, tuple[float, float]] | None = None,
                     extra_rounds: int = FINAL_EXTRA_ROUNDS, rounds: int = FINAL_ROUNDS) -> dict:
    """Plain decoding on the speculative side's backend (and ``peers``: the fastest plain backend)
    against ``spec_llm`` on ``prompts``, alternating prompt by prompt after a warm-up (bench.run_bench),
    ``rounds`` times, each prompt and side keeping its fastest run (noise only ever adds time). Figures
    that τ and the costs cannot explain (``doubts``) are measured again, up to ``extra_rounds`` times
    more. Returns the bench's dict with "runs" (runs in all), "remeasured" (the extra ones), "doubts"
    (what still does not add up: report, do not trust) and "expected_speedup" (τ and the costs' ratio
    on the same backend, or None)."""
    from specdec.bench import run_bench

    peer = next(iter(peers), None) if peers else None
    result = run_bench(plain_llm, spec_llm, prompts, params, peers=peers)
    for _ in range(rounds - 1):
        result = _fastest(result, run_bench(plain_llm, spec_llm, prompts, params, warmup=0, peers=peers))
    figures = final_figures(result, spec_llm, choice, peer, costs)
    tries = 0
    while doubts(figures) and tries < extra_rounds:
        result = _fastest(result, run_bench(plain_llm, spec_llm, prompts, params, warmup=0, peers=peers))
        figures = final_figures(result, spec_llm, choice, peer, costs)
        tries += 1
    out = result.as_dict()
    out.update(runs=rounds + tries, remeasured=tries, doubts=doubts(figures), expected_speedup=figures.expected)
    return out


def _fastest(a, b):
    """Per prompt and side, the faster of two BenchResults' runs (greedy: the same tokens); b's metrics."""
    from dataclasses import replace

    runs = []
    for x, y in zip(a.runs, b.runs):
        r = replace(x, peer_tokens=dict(x.peer_tokens), peer_time_s=dict(x.peer_time_s))
        if y.ar_time_s < x.ar_time_s:
            r.ar_tokens, r.ar_time_s, r.ar_prefill_s = y.ar_tokens, y.ar_time_s, y.ar_prefill_s
        if y.spec_time_s < x.spec_time_s:
            r.spec_tokens, r.spec_time_s, r.spec_prefill_s = y.spec_tokens, y.spec_time_s, y.spec_prefill_s
            r.num_drafts, r.num_draft_tokens, r.num_accepted_tokens = (y.num_drafts, y.num_draft_tokens,
                                                                       y.num_accepted_tokens)
        for name, t in y.peer_time_s.items():
            if t < r.peer_time_s.get(name, float("inf")):
                r.peer_time_s[name], r.peer_tokens[name] = t, y.peer_tokens[name]
        runs.append(r)
    return replace(b, runs=runs)


def acceptance_text(metrics: dict) -> str:
    """The speculative run's acceptance in words: τ and the acceptance rate, or that it drafted nothing
    (no acceptance to speak of: 0 of 0 drafts is not a 0% rate)."""
    if not metrics.get("num_draft_tokens"):
        return "drafted nothing: the adaptive controller found no k that pays here, so every step was plain decoding"
    return (f"τ {metrics['mean_acceptance_length']:.2f} tokens per verify pass; {metrics['acceptance_rate']:.1%} of "
            f"{metrics['num_draft_tokens']} drafted tokens accepted")


def final_lines(r: dict, fast_backend: str, backend: str, speedup: float, peer: str | None) -> list[str]:
    """The few lines under the final table: the speedup over the fastest plain backend (and over the
    same backend's plain), whether the figures add up, acceptance, greedy equality."""
    again = f", each prompt's fastest of {r['runs']} runs" if r.get("runs", 1) > 1 else ""
    lines = [f"speedup: {speedup:.2f}x over plain {fast_backend}, the fastest plain backend here (alternating prompt "
             f"by prompt after a warm-up{again})"]
    if peer is not None:
        lines.append(f"over plain {backend}, the same backend: {r['speedup']:.2f}x")
    if r.get("doubts"):
        lines.append("not to be trusted: " + "; ".join(r["doubts"]) + " (another job shared the CPU: run it again "
                     "when the machine is quiet)")
    elif r.get("expected_speedup"):
        measured = f", measured {r['decode_speedup']:.2f}x" if r.get("decode_speedup") else ""
        lines.append(f"as τ and the measured costs predict ({r['expected_speedup']:.2f}x on {backend}, "
                     f"decoding alone{measured})")
    lines.append(acceptance_text(r["spec"]["metrics"]))
    gm = r.get("greedy_match")
    if gm is not None:
        lines.append(f"greedy outputs equal to plain decoding: {gm['matched'] + gm['near_ties']}/{gm['total']} prompts")
    return lines
