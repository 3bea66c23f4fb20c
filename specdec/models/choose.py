"""Step 2 of loading a model: the backend and the dtype it runs in, and why.

``backend="auto"`` runs a GGUF file on llama.cpp; torch on CUDA and for layer_skip (which runs the
target's first layers); and a checkpoint on a CPU that llama.cpp can convert on the backend expected
fastest here for the method, k and draft model asked for (backend_choice.py: timed forwards through
the cost model). The dtype follows dtype_choice.py's rule for the backend chosen. A
draft model runs where the target does, a GGUF draft on llama.cpp whatever the target's backend, and
a parallel draft's checkpoint on torch beside a llama.cpp target (``choose_draft``).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from specdec.config import BACKENDS as RUNNER_BACKENDS
from specdec.models import llamacpp_lib
from specdec.models.backend_choice import auto_backend
from specdec.models.dtype_choice import dtype_for
from specdec.models.gguf import ARCHITECTURES
from specdec.models.llamacpp_ext import ARCHITECTURES as EAGLE3_ARCHITECTURES
from specdec.models.resolve import ModelSource

BACKENDS = ("auto", *RUNNER_BACKENDS)  # what callers may ask for
LAYER_SKIP_NEEDS_TORCH = ("layer_skip runs the target's first layers, which the llama.cpp backend cannot do (it runs "
                          "whole models only); use backend='torch' with an HF checkpoint, or method draft_model, ngram "
                          "or suffix")


@dataclass(frozen=True)
class Choice:
    """Where a model runs, in what dtype, and why."""

    backend: str  # "torch" | "llama.cpp"
    reason: str  # why this backend: "asked for", or auto's reason
    dtype: str | None  # the weights' dtype by name (dtype_choice.dtype_for); None: a GGUF file's own types


def choose(source: ModelSource, backend: str = "auto", dtype: str = "auto", device: str = "cpu",
           method: str | None = None, num_speculative_tokens: int = 0, draft: ModelSource | None = None,
           enforce_eager: bool | None = None) -> Choice:
    """The backend and dtype the target ``source`` runs in, for speculative ``method`` with drafts of
    up to ``num_speculative_tokens`` (0: plain decoding); ``draft``: draft_model's draft, whose step
    auto times beside the target's; ``enforce_eager``: the torch path auto times (LLM's option)."""
    chosen, reason = _backend(source, backend, device, method, num_speculative_tokens, dtype, draft, enforce_eager)
    if method == "layer_skip" and chosen == "llama.cpp":
        raise ValueError(LAYER_SKIP_NEEDS_TORCH)
    return Choice(chosen, reason, dtype_for(source, chosen, dtype, device))


PARALLEL_DRAFT_ON_TORCH = ("a parallel draft's one forward feeds the accepted tokens and k - 1 masks: on torch's "
                           "kernels it costs about one step, on llama.cpp's about two or more")


def choose_draft(source: ModelSource, target: Choice, dtype: str = "auto", device: str = "cpu",
                 parallel: bool = False) -> Choice:
    """The backend and dtype of draft model ``source`` beside a target that runs as ``target`` says;
    ``parallel``: the draft proposes all its drafts from one forward (parallel_drafting). Such a
    forward of up to 2k tokens costs about a step on torch's CPU kernels (16-bit weights read once for
    every row) and about two steps or more on llama.cpp's (docs/benchmarks.md, "a parallel draft at a
    160M draft's cost"), so a parallel draft's checkpoint runs on torch beside a llama.cpp target."""
    if source.is_gguf:
        return Choice("llama.cpp", "a GGUF draft", dtype_for(source, "llama.cpp"))
    if parallel and target.backend == "llama.cpp" and str(device).startswith("cpu"):
        return Choice("torch", PARALLEL_DRAFT_ON_TORCH, dtype_for(source, "torch", dtype, device))
    return Choice(target.backend, "where the target runs", dtype_for(source, target.backend, dtype, device))


def _backend(source: ModelSource, backend: str, device: str, method: str | None, k: int,
             dtype: str, draft: ModelSource | None = None, enforce_eager: bool | None = None) -> tuple[str, str]:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    on_cpu = str(device).startswith("cpu")
    if backend == "torch":
        return "torch", "asked for"  # a GGUF file is dequantized into transformers' model (load.py)
    if backend == "llama.cpp":
        if not on_cpu:
            raise ValueError(f"specdec's llama.cpp backend runs on the CPU; got device={device!r} (use backend='torch')")
        return "llama.cpp", "asked for"
    if source.is_gguf:
        return "llama.cpp", "auto: a GGUF file"
    if not on_cpu:
        return "torch", f"auto: device {device}"
    if method == "layer_skip":
        return "torch", "auto: layer_skip runs the target's first layers (torch only)"
    if method == "eagle3" and _gguf_arch(source) not in EAGLE3_ARCHITECTURES:
        return "torch", "auto: llama.cpp gives EAGLE-3 heads the layer inputs of llama-architecture models only"
    if not llamacpp_lib.available():
        return "torch", "auto: llama-cpp-python is not installed"
    if not _convertible(source):
        return "torch", "auto: not a checkpoint specdec converts to GGUF"
    verdict = auto_backend(source, dtype, k, method, draft, enforce_eager)
    return verdict.backend, f"auto: {verdict.reason}"


def _convertible(source: ModelSource) -> bool:
    archs = source.config.get("architectures") or []
    return bool(archs) and archs[0] in ARCHITECTURES and bool(glob.glob(os.path.join(source.path, "*.safetensors")))


def _gguf_arch(source: ModelSource) -> str:
    """The llama.cpp architecture name an HF checkpoint converts to ("" when it does not)."""
    archs = (source.config or {}).get("architectures") or [""]
    return ARCHITECTURES.get(archs[0], ("",))[0]
