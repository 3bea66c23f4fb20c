"""Which backend ``backend="auto"`` runs an HF checkpoint on, on a CPU: the one expected to decode
fastest here, for the method, draft length and acceptance asked for.

Neither backend is faster on every CPU: llama.cpp's one-token step was the cheaper on the CPUs
measured (docs/benchmarks.md, "Verify cost curves"), torch's verify pass the flatter (oneDNN; AMX), and which of the
two matters depends on how many drafted tokens a verify pass gets accepted. So auto weighs the whole
round with the cost model the adaptive controller uses (cost_model.py):

1. time on both backends, alternating, once per machine (CPU, threads, torch), checkpoint, dtype, torch
   path, method, draft model and k: the target's forward of 1, 2 and k+1 tokens after CONTEXT cached
   positions (k = 0: 1 token), and the draft model's one-token step where one drafts;
2. take the acceptance: the one measured for this target, method and draft (acceptance.json, kept by
   ``specdec demo`` through ``record_acceptance``), else a prior per method (``PRIOR_ALPHAS``);
3. per backend, the cost model's speedup S(k') for every k' <= k (the verify pass interpolated
   between the timed lengths; a draft step c per drafted token, 0 for the lookups), the best of them
   by the controller's break-even rule (k' = 0: plain decoding), as tokens/s: S(k') * 1000 / t(1);
4. the backend with the most expected tokens/s wins (llama.cpp on a tie).

A checkpoint too large to hold twice (above MEMORY_SHARE of the memory available) is timed on copies
of its first layers (1, and the most that fit, 3 to 8), each forward extrapolated linearly in the
layer count.
``SPECDEC_AUTO_BACKEND=torch|llama.cpp`` fixes the choice (the test suite fixes torch, so that every
test runs the same backend on every machine). Called by choose.py, the choose step.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec.config import BACKENDS
from specdec.cost_model import best_k, expected_tokens, predicted_speedups
from specdec.models import timings
from specdec.models.base import ForwardBatch
from specdec.models.compiled import enforce_eager_default
from specdec.models.dtype_choice import dtype_for
from specdec.models.gguf import checkpoint_digest
from specdec.models.load import load
from specdec.models.resolve import ModelSource, resolve
from specdec.policy import LOOKUP_METHODS, PRIOR_ALPHA, PRIOR_DRAFT_COST

ENV = "SPECDEC_AUTO_BACKEND"
CONTEXT = 256  # positions cached before the timed forwards (fewer if the model is shorter)
REPEATS = 5  # alternations of the backends
BURST = 8  # forwards of one length in a row; the second half's median is kept (step times settle)
# Both backends hold the checkpoint at once while timed (torch's weights, llama.cpp's GGUF beside a
# conversion): above this share of the memory available, time its first layers and extrapolate
MEMORY_SHARE = 1 / 3
# A large checkpoint is timed on copies of its first PROBE_LOW and n layers, n the most that fit
# (MEMORY_SHARE), at least 3 and at most PROBE_HIGH: the extrapolation multiplies their difference by
# (layers - 1) / (n - 1), and with it the timing noise
PROBE_LOW, PROBE_HIGH = 1, 8
# Acceptance per draft position before any is measured: α_1 of the shipped pair on held-out code,
# greedy (docs/benchmarks.md, "EAGLE-3 heads": draft model 0.70, head 0.76); the adaptive controller's prior else
PRIOR_ALPHAS = {"draft_model": 0.70, "eagle3": 0.76}


@dataclass(frozen=True)
class Estimate:
    """One backend's timings and what the cost model expects of it."""

    ms: dict[int, float]  # the target's forward of T tokens, T -> ms (1, 2, k+1)
    draft_ms: float  # c: one draft step, ms (0 for lookups and plain decoding)
    draft_how: str  # "timed", "prior", "none"
    k: int  # the k' <= k the break-even rule keeps (0: plain decoding pays best)
    tau: float  # E(k'), tokens per round
    tokens_per_s: float


@dataclass(frozen=True)
class BackendVerdict:
    """The backend auto picks for one checkpoint, method and draft length, and why."""

    backend: str  # "torch" | "llama.cpp"
    reason: str
    estimates: dict[str, Estimate]  # per backend; empty when fixed by the environment

    @property
    def ms(self) -> dict[str, list[float]]:
        """{backend: [t(1), t(k+1)]} in ms (t(1) twice for plain decoding)."""
        return {b: [e.ms[1], e.ms[max(e.ms)]] for b, e in self.estimates.items()}


def auto_backend(source: ModelSource, dtype: str, k: int, method: str | None = None,
                 draft: ModelSource | None = None, enforce_eager: bool | None = None) -> BackendVerdict:
    """The backend expected fastest for checkpoint ``source`` (convertible, on a CPU with llama.cpp)
    decoding with ``method`` and drafts of up to ``k`` tokens (0: plain decoding); ``draft``: the draft
    model of draft_model; ``enforce_eager``: the torch runner's path as LLM(enforce_eager=) asks."""
    fixed = os.environ.get(ENV, "")
    if fixed:
        if fixed not in BACKENDS:
            raise ValueError(f"{ENV} must be 'torch' or 'llama.cpp', got {fixed!r}; unset it to let auto measure")
        return BackendVerdict(fixed, f"{ENV}={fixed}", {})
    method = method if k else None
    draft = draft if method == "draft_model" else None

    def measure() -> dict:
        print(f"specdec: timing {Path(source.path).name} on llama.cpp and torch for backend=auto "
              f"({method or 'plain'}, k={k}), once", file=sys.stderr, flush=True)
        return time_backends(source, dtype, k, draft, enforce_eager)

    key = cache_key(source, dtype, k, method, draft, enforce_eager)
    entry = timings.cached(cache_path(), key, measure, BACKENDS, len(lengths_for(k)) + (draft is not None),
                           notes=("how", "torch_path"))
    alphas, acceptance = acceptance_for(source, method, draft, k)
    return decide(entry, k, method, alphas, acceptance)


def cache_key(source: ModelSource, dtype: str, k: int, method: str | None, draft: ModelSource | None,
              enforce_eager: bool | None = None) -> str:
    """Everything the timings depend on: the machine (CPU, features, torch, threads), the checkpoint's
    digest, the dtype asked for, the torch path (compiled or eager), k, the method, the draft model."""
    draft_id = checkpoint_digest(draft.path) if draft is not None and not draft.is_gguf else (
        Path(draft.path).name if draft is not None else "-")
    runs_in = ",".join(str(dtype_for(source, b, dtype)) for b in BACKENDS)  # per backend: the dtype_choice rule's
    return (f"{timings.machine_key()} {checkpoint_digest(source.path)} {dtype} ({runs_in}) "
            f"torch-path {torch_path(enforce_eager)} k {k} method {method or 'plain'} draft {draft_id}")


def torch_path(enforce_eager: bool | None = None) -> str:
    """How the torch runner runs its forward, as far as it changes the timings: "eager" when asked
    (``enforce_eager`` True, or None and $SPECDEC_ENFORCE_EAGER set and not "0"), else "compiled"
    (the few-token step compiled at load where the runner compiles it)."""
    if enforce_eager is None:
        enforce_eager = enforce_eager_default()
    return "eager" if enforce_eager else "compiled"


def lengths_for(k: int) -> tuple[int, ...]:
    """The forward lengths timed for drafts of up to k: 1, 2 (where the curve bends on llama.cpp) and k+1."""
    return tuple(sorted({1, min(2, k + 1), k + 1}))


# -- the decision ------------------------------------------------------------------------------------


def decide(entry: dict, k: int, method: str | None, alphas: list[float], acceptance: str) -> BackendVerdict:
    """The verdict from timed ``entry`` ({backend: [t(T) for T in lengths_for(k)] + [draft ms]}),
    the conditional acceptance ``alphas`` (one per draft position) and where it came from."""
    estimates = {b: estimate(entry[b], k, method, alphas) for b in BACKENDS}
    backend = max(BACKENDS, key=lambda b: (estimates[b].tokens_per_s, b == "llama.cpp"))
    how = "" if entry.get("how", "timed") == "timed" else f"; {entry['how']}"
    path = f"; torch path: {entry['torch_path']}" if entry.get("torch_path") else ""
    if not k:
        figures = ", ".join(f"{b} {e.ms[1]:.2f} ms ({e.tokens_per_s:.1f} tok/s)" for b, e in estimates.items())
        return BackendVerdict(backend, f"faster here: t(1) {figures}{how}{path}", estimates)
    parts = []
    for b, e in estimates.items():
        times = ", ".join(f"t({T}) {ms:.2f}" for T, ms in e.ms.items())
        draft = f", draft step {e.draft_ms:.2f} ms ({e.draft_how})" if e.draft_how != "none" else ""
        pick = f"k={e.k}, expected τ {e.tau:.2f}" if e.k else "plain decoding pays best"
        parts.append(f"{b} {e.tokens_per_s:.1f} tok/s ({times} ms{draft}; {pick})")
    reason = (f"expected fastest here for {method} k<={k} with acceptance {acceptance}: "
              f"{'; '.join(parts)}{how}{path}")
    return BackendVerdict(backend, reason, estimates)


def estimate(ms: Sequence[float], k: int, method: str | None, alphas: list[float]) -> Estimate:
    """One backend: the best k' <= k by the cost model and its expected tokens/s."""
    lengths = lengths_for(k)
    t = dict(zip(lengths, ms[:len(lengths)]))
    t1 = t[1]
    if not k:
        return Estimate(t, 0.0, "none", 0, 1.0, 1e3 / t1)
    if method in LOOKUP_METHODS:  # they read the text, no model: no draft step to time
        c, how = 0.0, "none"
    elif len(ms) > len(lengths):
        c, how = ms[len(lengths)], "timed"
    else:  # a drafter whose step is not timed here (an EAGLE-3 head, a draft model not passed)
        c, how = PRIOR_DRAFT_COST * t1, "prior"
    verify = [interpolate(t, kk + 1) / t1 for kk in range(k + 1)]  # v(k') in 1-token steps, v(0) = 1
    speedups = predicted_speedups(alphas, c / t1, verify)
    kk = best_k(speedups)
    return Estimate(t, c, how, kk, expected_tokens(alphas, kk), speedups[kk] * 1e3 / t1)


def interpolate(t: dict[int, float], T: int) -> float:
    """The forward of T tokens, piecewise linear between the timed lengths (flat past the last)."""
    points = sorted(t.items())
    for (a, ta), (b, tb) in zip(points, points[1:]):
        if a <= T <= b:
            return ta + (tb - ta) * (T - a) / (b - a)
    return points[-1][1] if T > points[-1][0] else points[0][1]


# -- acceptance --------------------------------------------------------------------------------------


def acceptance_for(source: ModelSource, method: str | None, draft: ModelSource | None,
                   k: int) -> tuple[list[float], str]:
    """α_1..α_k for ``method`` on ``source`` and where they come from: measured (acceptance.json)
    or the prior."""
    if not k:
        return [], "none"
    kept = timings.read(acceptance_path()).get(acceptance_key(source, method, draft))
    if isinstance(kept, dict) and _alphas_ok(kept.get("alphas")):
        alphas = list(kept["alphas"])[:k]
        alphas += [alphas[-1]] * (k - len(alphas))
        shown = " / ".join(f"{a:.2f}" for a in alphas[:4]) + (" ..." if k > 4 else "")
        where = f"{kept.get('source', 'acceptance.json')}, {kept.get('drafts', '?')} rounds"
        return alphas, f"α {shown} (measured: {where})"
    prior = PRIOR_ALPHAS.get(method, PRIOR_ALPHA)
    return [prior] * k, f"α {prior:.2f} per position (prior for {method}; none measured for this model yet)"


def record_acceptance(source: ModelSource, method: str, draft: ModelSource | None, alphas: Sequence[float],
                      drafts: int, where: str) -> None:
    """Keep the conditional acceptance α_1.. (one value: the same at every position) measured for
    ``method`` on ``source`` (over ``drafts`` rounds that drafted, by ``where``), for the next
    backend=auto of the same models."""
    if _alphas_ok(list(alphas)):
        timings.write(acceptance_path(), acceptance_key(source, method, draft),
                      {"alphas": [round(a, 4) for a in alphas], "drafts": drafts, "source": where})


def alpha_from_tau(tau: float, k: float) -> float:
    """The i.i.d. acceptance α whose E(k) (cost_model.expected_tokens) is the measured ``tau`` at
    ``k`` drafts a round (the mean, rounded): per-position rates of rounds of mixed k would read the
    controller's choice of k (long drafts where acceptance runs high) as acceptance."""
    k = max(1, round(k))
    tau = min(max(tau, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(40):  # E(k) grows with α: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens([mid] * k, k) < tau else (lo, mid)
    return (lo + hi) / 2


def acceptance_key(source: ModelSource, method: str | None, draft: ModelSource | None) -> str:
    draft_id = "-" if draft is None else (Path(draft.path).name if draft.is_gguf else checkpoint_digest(draft.path))
    return f"{checkpoint_digest(source.path)} {method} {draft_id}"


def _alphas_ok(alphas) -> bool:
    return (isinstance(alphas, list) and len(alphas) > 0
            and all(isinstance(a, (int, float)) and 0.0 <= a <= 1.0 for a in alphas))


# -- timing ------------------------------------------------------------------------------------------


def time_backends(source: ModelSource, dtype: str, k: int, draft: ModelSource | None = None,
                  enforce_eager: bool | None = None) -> dict:
    """{backend: [ms of the target's forward of T tokens, T in lengths_for(k)] + [the draft's
    one-token step], "how": how, "torch_path": the torch runner's describe()}: the whole checkpoint
    when it fits twice in memory, else copies of its first layers, extrapolated."""
    size = checkpoint_bytes(source)
    free = available_memory()
    layers = int(source.config.get("num_hidden_layers", 0))
    if free is None or size <= MEMORY_SHARE * free or layers <= 3:
        return _time_loaded(source, dtype, k, draft, "timed", enforce_eager)
    low = PROBE_LOW
    high = min(layers - 1, PROBE_HIGH, max(3, int(layers * MEMORY_SHARE * free / size)))
    with tempfile.TemporaryDirectory(prefix="specdec-probe-") as tmp:
        stem = Path(tmp).name  # unique: also names the copies' GGUF conversions, dropped below
        try:
            cut = {n: _time_loaded(first_layers(source, n, Path(tmp) / f"{stem}-{n}-layers"), dtype, k,
                                   draft if n == low else None, "timed", enforce_eager) for n in (low, high)}
        finally:
            for f in (timings.cache_dir() / "gguf").glob(f"{stem}-*"):
                f.unlink(missing_ok=True)
    out = {}
    for b in BACKENDS:  # per length: t(low) + (layers - low) * (the cost of one more layer, never below 0)
        target = [lo + (layers - low) * max(0.0, hi - lo) / (high - low) for lo, hi in zip(cut[low][b], cut[high][b])]
        out[b] = [round(t, 4) for t in target] + cut[low][b][len(target):]
    out["how"] = (f"timed on its first {low} and {high} layers and extrapolated to {layers} (the checkpoint, "
                  f"{size / 2**30:.1f} GiB, is over {MEMORY_SHARE:.2f} of the {free / 2**30:.1f} GiB available)")
    out["torch_path"] = cut[low]["torch_path"]
    return out


def _time_loaded(source: ModelSource, dtype: str, k: int, draft: ModelSource | None, how: str,
                 enforce_eager: bool | None = None) -> dict:
    lengths = lengths_for(k)
    sources = {"target": source} | ({"draft": draft} if draft is not None else {})
    context = max(1, min(CONTEXT, *(s.config.get("max_position_embeddings", CONTEXT + k + 1) - k - 1
                                    for s in sources.values() if s.config)))
    runners = {}
    for role, s in sources.items():
        for b in BACKENDS:
            run_on = "llama.cpp" if s.is_gguf else b  # a GGUF draft runs on llama.cpp beside either target
            path = {"enforce_eager": enforce_eager} if enforce_eager is not None and run_on == "torch" else {}
            # the target compiled up to the k + 1 tokens it is timed at, as LLM loads it (longest_verify)
            runners[b, role] = load(s, run_on, dtype_for(s, run_on, dtype), "cpu", max_model_len=context + k + 1,
                                    longest_feed=k + 1 if role == "target" else None, **path)[0]
    try:
        ms = time_runners(runners, {(b, role): lengths if role == "target" else (1,) for b, role in runners}, context)
        path = runners["torch", "target"].describe()
    finally:
        for r in runners.values():
            r.release()
        del runners
        gc.collect()
    out: dict = {b: ms[b, "target"] + (ms[b, "draft"] if draft is not None else []) for b in BACKENDS}
    return out | {"how": how, "torch_path": path}


def time_runners(runners: dict, lengths: dict, context: int) -> dict:
    """Milliseconds of each runner's forward of T tokens for T in ``lengths[name]`` after ``context``
    cached positions (fewer where a runner holds fewer), the runners alternating: per name [ms per
    length], the median over REPEATS of each burst's settled half. The runners keep nothing: their probe row is dropped."""
    vocab = min(r.vocab_size for r in runners.values())
    longest = max(max(t) for t in lengths.values())
    room = min(getattr(r, "max_model_len", None) or context + longest for r in runners.values())
    context = max(1, min(context, room - longest))  # a model shorter than CONTEXT: fewer cached positions
    prompt = [(i * 7919 + 3) % vocab for i in range(context + longest)]
    for r in runners.values():
        r.sync_rows(["__specdec_backend_probe__"])
        r.forward(ForwardBatch.from_rows([prompt[:context]], [0], logits="none"))
    times: dict = {(name, T): [] for name in runners for T in lengths[name]}
    for _ in range(REPEATS):
        for name, r in runners.items():
            for T in lengths[name]:
                batch = ForwardBatch.from_rows([prompt[context:context + T]], [context], logits=T)  # [1, T, V]
                burst = []
                for _ in range(BURST):
                    t0 = time.perf_counter()
                    r.forward(batch)
                    burst.append(time.perf_counter() - t0)
                times[name, T].append(statistics.median(burst[BURST // 2:]))
    for r in runners.values():
        r.sync_rows([])
    return {name: [round(1e3 * statistics.median(times[name, T]), 4) for T in lengths[name]] for name in runners}


# -- large checkpoints -------------------------------------------------------------------------------

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def first_layers(source: ModelSource, n: int, folder: Path) -> ModelSource:
    """A checkpoint of ``source``'s first ``n`` decoder layers (embeddings, final norm and head kept)
    in ``folder``, read tensor by tensor: timing it costs what the whole model costs per layer."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    tensors = {}
    for f in sorted(Path(source.path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                m = _LAYER.search(name)
                if m is None or int(m.group(1)) < n:
                    tensors[name] = st.get_tensor(name)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = dict(source.config) | {"num_hidden_layers": n}
    for name, value in source.config.items():  # per-layer lists (layer_types) cut to the layers kept
        if isinstance(value, list) and len(value) == source.config.get("num_hidden_layers"):
            config[name] = value[:n]
    (folder / "config.json").write_text(json.dumps(config))
    for f in Path(source.path).iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith((".safetensors", ".index.json")):
            shutil.copy(f, folder / f.name)
    return resolve(str(folder))


def checkpoint_bytes(source: ModelSource) -> int:
    return sum(f.stat().st_size for f in Path(source.path).glob("*.safetensors"))


def available_memory() -> int | None:
    """Bytes of memory available (Linux's MemAvailable; else the free pages), None when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def cache_path() -> Path:
    return timings.cache_file("backend.json")


def acceptance_path() -> Path:
    return timings.cache_file("acceptance.json")
