"""Which path bfloat16 weights take on this CPU: native bf16 products or float32.

A CPU multiplies bf16 natively only with bf16 dot-product instructions: avx512_bf16 or AMX on
x86, the bf16 extension on arm64. oneDNN also *emulates* bf16 on any AVX-512 CPU (its own check,
``torch.ops.mkldnn._is_mkldnn_bf16_supported``, says yes there), slower than float32, so the
CPU's features decide here, and an ISA held back by ``ONEDNN_MAX_CPU_ISA`` or
``ATEN_CPU_CAPABILITY`` counts as not native. Where bf16 is native, ``dtype="auto"`` also needs it
to be faster: the model's largest product is timed once in both dtypes, at 1 row (decoding) and
k+1 rows (a verify pass), and the verdict is cached per machine.

``SPECDEC_NO_NATIVE_BF16=1`` makes specdec behave as on a CPU without native bf16, so that every
CPU path can be tested on any CPU.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.models import timings

NO_NATIVE_ENV = "SPECDEC_NO_NATIVE_BF16"
# oneDNN ISAs (ONEDNN_MAX_CPU_ISA) whose kernels have bf16 dot products; the lower ones emulate them.
ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                    "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2",
                    "ALL", "DEFAULT")
VERIFY_ROWS = 5  # k+1 for the default k = 4
# Products are timed at most this large (elements): beyond the caches both dtypes stream their
# weights from memory, so a larger one orders them the same and would only cost load time.
MAX_TIMED_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class Bf16Support:
    """Whether bf16 products run natively here, on which instructions, and why not when not."""

    native: bool
    isa: str  # e.g. "x86_64 AVX512 + avx512_bf16, amx_bf16"
    reason: str


@dataclass(frozen=True)
class Bf16Verdict:
    """Whether ``dtype="auto"`` keeps a bf16 checkpoint in bf16 on this CPU, and why."""

    use_bf16: bool
    reason: str
    ms: dict  # {"bf16": [ms at 1 row, ms at VERIFY_ROWS rows], "float32": [...]}; empty when not timed


def native_bf16() -> Bf16Support:
    """This CPU's native bf16 support, as restricted by the environment (read on every call)."""
    found = _detect()
    if os.environ.get(NO_NATIVE_ENV, "0") not in ("0", ""):
        return Bf16Support(False, found.isa, f"{NO_NATIVE_ENV}={os.environ[NO_NATIVE_ENV]} is set")
    return found


@functools.cache
def _detect() -> Bf16Support:
    machine = platform.machine().lower()
    caps = torch.cpu.get_capabilities()
    if machine in ("x86_64", "amd64"):
        features = [f for f in ("avx512_bf16", "amx_bf16") if caps.get(f)]
        aten = torch.backends.cpu.get_cpu_capability()
        isa = f"{machine} {aten}" + (f" + {', '.join(features)}" if features else "")
        if not features:
            return Bf16Support(False, isa, "this CPU has no avx512_bf16 or amx_bf16 (oneDNN would only emulate bf16)")
        if aten != "AVX512":
            return Bf16Support(False, isa, f"ATen is held to {aten} (ATEN_CPU_CAPABILITY)")
        onednn_isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
        if onednn_isa and onednn_isa.upper() not in ONEDNN_BF16_ISAS:
            return Bf16Support(False, isa, f"oneDNN is held to {onednn_isa} (ONEDNN_MAX_CPU_ISA)")
    elif machine in ("aarch64", "arm64"):
        isa = f"{machine}" + (" + bf16" if caps.get("bf16") else "")
        if not caps.get("bf16"):
            return Bf16Support(False, isa, "this CPU has no bf16 extension")
    else:
        return Bf16Support(False, machine, f"native bf16 is used on x86_64 and arm64 only, not on {machine}")
    try:
        onednn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        onednn = False
    if not onednn:
        return Bf16Support(False, isa, "this torch build's oneDNN has no bf16 kernels for this CPU")
    return Bf16Support(True, isa, "native bf16 instructions")


def largest_product(config) -> tuple[int, int]:
    """(out, in) of the largest weight matrix of a Llama-family config: the LM head, fused gate/up
    or fused q/k/v, capped at ``MAX_TIMED_ELEMENTS`` by cutting its outputs."""
    d = config.hidden_size
    heads = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or d // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    out = max(config.vocab_size, 2 * config.intermediate_size, (heads + 2 * kv) * hd)
    return min(out, max(1, MAX_TIMED_ELEMENTS // d)), d


def bf16_verdict(out_features: int, in_features: int) -> Bf16Verdict:
    """Keep bf16 only where it is native and a product of this shape is faster in bf16 than in
    float32 at both 1 and ``VERIFY_ROWS`` rows. Timed once per machine and shape (cached)."""
    support = native_bf16()
    if not support.native:
        return Bf16Verdict(False, f"no native bf16: {support.reason}", {})
    key = f"{timings.machine_key()} {out_features}x{in_features}"
    ms = timings.cached(cache_path(), key, lambda: _time_products(out_features, in_features), ("bf16", "float32"))
    faster = all(b < f for b, f in zip(ms["bf16"], ms["float32"]))
    timing = ", ".join(f"{b:.2f} vs {f:.2f} ms at {r} row{'s' * (r > 1)}"
                       for r, b, f in zip((1, VERIFY_ROWS), ms["bf16"], ms["float32"]))
    verdict = "native bf16 and faster" if faster else "native bf16 but not faster"
    return Bf16Verdict(faster, f"{verdict}: {out_features}x{in_features} product bf16 vs float32 {timing}", ms)


KIND_NAMES = {"onednn": "oneDNN bf16 inner product", "wxt": "w @ x^T (ATen)", "dense": "F.linear"}


def describe_path(runner, requested: str) -> str:
    """One line for ``specdec demo`` and ``bench``: the ISA, the weights' dtype, the product kernel
    and why, for a loaded runner and the dtype that was asked for."""
    if getattr(runner, "backend", "torch") == "llama.cpp":
        return runner.describe()
    dtype = str(runner.dtype).removeprefix("torch.")
    kind = getattr(getattr(runner, "lm_head", None), "kind", "dense")
    if runner.device.type != "cpu":
        return f"{runner.device.type}: {dtype} weights, {KIND_NAMES['dense']}"
    support = native_bf16()
    head = f"{support.isa}: {dtype} weights, {KIND_NAMES.get(kind, kind)}"
    checkpoint = getattr(runner.config, "dtype", None) or getattr(runner.config, "torch_dtype", None)
    if requested != "auto":
        why = f"--dtype {requested}"
        if runner.dtype == torch.bfloat16 and not support.native:
            why += f", no native bf16: {support.reason}"
    elif str(checkpoint).removeprefix("torch.") == "bfloat16":
        why = "auto: " + bf16_verdict(*largest_product(runner.config)).reason
    else:
        why = f"auto: the checkpoint is {str(checkpoint).removeprefix('torch.')}"
    return f"{head} ({why})"


def _time_products(out_features: int, in_features: int, repeats: int = 7) -> dict:
    """Milliseconds of one product with this shape, bf16 (oneDNN) and float32, at 1 and VERIFY_ROWS
    rows: the minimum over ``repeats`` interleaved runs, the least disturbed by other work."""
    from specdec.models.linear import Linear

    g = torch.Generator().manual_seed(0)
    w = 0.02 * torch.randn(out_features, in_features, generator=g)  # [out, in]
    linears = {"bf16": Linear(w.bfloat16()), "float32": Linear(w)}
    out = {}
    for name, lin in linears.items():
        times = []
        for rows in (1, VERIFY_ROWS):
            x = torch.randn(rows, in_features, generator=g)
            lin(x)  # builds and caches the kernel
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                lin(x)
                best = min(best, time.perf_counter() - t0)
            times.append(round(1e3 * best, 4))
        out[name] = times
    return out


def cache_path() -> Path:
    return timings.cache_file("cpu_bf16.json")
