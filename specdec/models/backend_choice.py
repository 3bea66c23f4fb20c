"""Which backend ``backend="auto"`` runs an HF checkpoint on, on a CPU: the one that is faster here.

Neither backend is faster on every CPU: llama.cpp's one-token step is the cheaper on the CPUs
measured (README, llama.cpp backend), but torch's verify pass is flatter (oneDNN; AMX), so with
long drafts torch can win. The choice is therefore measured. The target's forward is timed on both
backends, once per machine, checkpoint, dtype, thread count and draft length: 1 token (a plain
step) and k+1 tokens (a verify pass), after ``CONTEXT`` cached positions. The verdict is cached
(~/.cache/specdec/backend.json). llama.cpp wins when its t(1) is lower without speculation, and
when its t(1) + t(k+1) is lower with it (rounds that draft nothing decode plainly).

Checkpoints above ``MAX_TIMED_BYTES`` go to llama.cpp without timing: at those sizes decoding is
bound by memory, where llama.cpp is the faster, and timing both would load the model twice.
``SPECDEC_AUTO_BACKEND=torch|llama.cpp`` fixes the choice (the test suite fixes torch, so that
every test runs the same backend on every machine). Called by choose.py, the choose step.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.models import timings
from specdec.models.base import ForwardBatch
from specdec.models.dtype_choice import dtype_for
from specdec.models.gguf import checkpoint_digest
from specdec.models.load import load
from specdec.models.resolve import ModelSource

ENV = "SPECDEC_AUTO_BACKEND"
CONTEXT = 256  # positions cached before the timed forwards (fewer if the model is shorter)
MAX_TIMED_BYTES = 1 << 30  # larger checkpoints (safetensors bytes) go to llama.cpp untimed
REPEATS = 5  # alternations of the two backends
BURST = 8  # forwards of one length in a row; the second half's median is kept (step times settle)


@dataclass(frozen=True)
class BackendVerdict:
    """The backend auto picks for one checkpoint and draft length, and why."""

    backend: str  # "torch" | "llama.cpp"
    reason: str
    ms: dict  # {"torch": [t(1), t(k+1)], "llama.cpp": [...]} in ms; empty when not timed


def auto_backend(source: ModelSource, dtype: str, k: int) -> BackendVerdict:
    """The faster backend for checkpoint ``source`` (convertible, on a CPU with llama.cpp) decoding
    with drafts of up to ``k`` tokens (0: plain decoding)."""
    fixed = os.environ.get(ENV, "")
    if fixed:
        if fixed not in ("torch", "llama.cpp"):
            raise ValueError(f"{ENV} must be 'torch' or 'llama.cpp', got {fixed!r}; unset it to let auto measure")
        return BackendVerdict(fixed, f"{ENV}={fixed}", {})
    size = sum(f.stat().st_size for f in Path(source.path).glob("*.safetensors"))
    if size > MAX_TIMED_BYTES:
        return BackendVerdict("llama.cpp", f"a checkpoint of {size / 2**30:.1f} GiB decodes bound by memory, "
                              "where llama.cpp is the faster", {})

    def measure() -> dict:
        print(f"specdec: timing {Path(source.path).name} on llama.cpp and torch for backend=auto (k={k}), once",
              file=sys.stderr, flush=True)
        return time_backends(source, dtype, k)

    key = f"{timings.machine_key()} {checkpoint_digest(source.path)} {dtype} k {k}"
    return _decide(timings.cached(cache_path(), key, measure, ("llama.cpp", "torch")), k)


def _decide(ms: dict, k: int) -> BackendVerdict:
    cost = {b: t[0] + (t[1] if k else 0) for b, t in ms.items()}
    backend = min(cost, key=lambda b: (cost[b], b != "llama.cpp"))
    what = "t(1)" if not k else f"t(1) + t({k + 1})"
    timing = ", ".join(f"{b} {cost[b]:.2f} ms" for b in ("llama.cpp", "torch"))
    return BackendVerdict(backend, f"faster here: {what} {timing}", ms)


def time_backends(source: ModelSource, dtype: str, k: int) -> dict:
    """Milliseconds of the target's forward of 1 and k+1 tokens (k=0: 1 token only, reported twice) on
    both backends, alternating, after CONTEXT positions (or what the model allows): the median over
    repeats of each burst's settled half."""
    lengths = (1, k + 1) if k else (1,)
    context = max(1, min(CONTEXT, source.config.get("max_position_embeddings", CONTEXT + k + 1) - k - 1))
    runners = {b: load(source, b, dtype_for(source, b, dtype), "cpu", max_model_len=context + k + 1)[0]
               for b in ("llama.cpp", "torch")}
    prompt = [(i * 7919 + 3) % min(r.vocab_size for r in runners.values()) for i in range(context + k + 1)]
    for r in runners.values():
        r.sync_rows(["__specdec_backend_probe__"])
        r.forward(ForwardBatch.from_rows([prompt[:context]], [0], logits="none"))
    times: dict = {(b, T): [] for b in runners for T in lengths}
    for _ in range(REPEATS):
        for b, r in runners.items():
            for T in lengths:
                batch = ForwardBatch.from_rows([prompt[context:context + T]], [context], logits=T)  # [1, T, V]
                burst = []
                for _ in range(BURST):
                    t0 = time.perf_counter()
                    r.forward(batch)
                    burst.append(time.perf_counter() - t0)
                times[b, T].append(statistics.median(burst[BURST // 2:]))
    for r in runners.values():
        r.release()
    del runners
    gc.collect()
    ms = {b: [round(1e3 * statistics.median(times[b, T]), 4) for T in lengths] for b in ("llama.cpp", "torch")}
    return {b: t * 2 if len(t) == 1 else t for b, t in ms.items()}


def cache_path() -> Path:
    return timings.cache_file("backend.json")
