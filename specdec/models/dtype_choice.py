"""The dtype a model's weights run in, and why: part of the choose step (choose.py).

torch casts a checkpoint's weights at load (``torch_dtype``); llama.cpp runs a GGUF file's own
weight types, converting a checkpoint to its own dtype first. ``dtype="auto"`` keeps the
checkpoint's dtype where this device computes in it well: on a CPU float16 never, and bfloat16
where the model's largest product measured faster in it than in float32: on oneDNN where bf16 is
native (cpu.py), elsewhere on specdec's 16-bit weight kernel (linear16.py: float32 products of
the bf16 weights, AVX2). That product is timed once in both dtypes, at 1 row (decoding) and k+1
rows (a verify pass), and the verdict is cached per machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from specdec.models import linear16, timings
from specdec.models.cpu import native_bf16
from specdec.models.linear import Linear
from specdec.models.resolve import ModelSource

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the dtype a GGUF file's weights load in on the torch backend: their own where torch has it; dequantized
# types (q8_0, k-quants) as float32, which holds their values exactly
GGUF_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
OUTTYPE_OF_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # a checkpoint's GGUF conversion
VERIFY_ROWS = 5  # k+1 for the default k = 4
# Products are timed at most this large (elements): beyond the caches both dtypes stream their
# weights from memory, so a larger one orders them the same and would only cost load time.
MAX_TIMED_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class Bf16Verdict:
    """Whether ``dtype="auto"`` keeps a bf16 checkpoint in bf16 on this CPU, and why."""

    use_bf16: bool
    reason: str
    ms: dict  # {"bf16": [ms at 1 row, ms at VERIFY_ROWS rows], "float32": [...]}; empty when not timed


def dtype_for(source: ModelSource, backend: str, dtype: str = "auto", device: str = "cpu") -> str | None:
    """The weights' dtype, by name, for ``source`` on ``backend`` ("torch" or "llama.cpp") when
    ``dtype`` is asked for: on torch what they are cast to at load; on llama.cpp what a checkpoint
    is converted to (under "auto" its own dtype, float32 when it names none), None for a GGUF file,
    which runs in its own weight types."""
    if backend == "torch":
        return str(torch_dtype(dtype, config_of(source), device)).removeprefix("torch.")
    if source.is_gguf:
        if dtype != "auto":
            raise ValueError(f"dtype={dtype!r} cannot change a GGUF file's weight types ({source.name!r}); leave dtype "
                             "at 'auto' or convert the checkpoint again with `specdec convert --outtype`")
        return None
    if dtype == "auto":
        own = source.config.get("dtype") or source.config.get("torch_dtype")
        return own if own in OUTTYPE_OF_DTYPE else "float32"
    if dtype not in OUTTYPE_OF_DTYPE:
        raise ValueError(f"dtype must be one of {list(OUTTYPE_OF_DTYPE)} or 'auto', got {dtype!r}")
    return dtype


def config_of(source: ModelSource):
    """The fields of a model's config that the dtype rule reads (its dtype, its shape), as attributes:
    a checkpoint's config.json, or a GGUF file's metadata under the same names."""
    if not source.is_gguf:
        return SimpleNamespace(**source.config)
    info = source.gguf
    return SimpleNamespace(dtype=GGUF_DTYPES.get(info.weight_type, "float32"), hidden_size=info.hidden_size,
                           intermediate_size=info.intermediate_size, vocab_size=info.vocab_size,
                           num_attention_heads=info.num_attention_heads,
                           num_key_value_heads=info.num_key_value_heads, head_dim=info.head_dim)


def torch_dtype(dtype: str, config, device: str = "cpu") -> torch.dtype:
    """The weights' dtype on torch. ``auto`` keeps the checkpoint's dtype where this device computes
    in it well: on a CPU, bfloat16 only where the model's largest product measured faster in it
    (``bf16_verdict``: native bf16, or float32 products of bf16 weights), and float16 never (both become
    float32 otherwise)."""
    if dtype == "auto":
        dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(dt, str):
            dt = DTYPES.get(dt)
        if dt not in DTYPES.values():
            return torch.float32
        if str(device).startswith("cpu"):
            if dt == torch.float16 or (dt == torch.bfloat16 and not bf16_verdict(*largest_product(config)).use_bf16):
                return torch.float32
        return dt
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


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
    """Keep bf16 only where a product of this shape is faster in bf16 than in float32 at both 1 and
    ``VERIFY_ROWS`` rows: native bf16 on oneDNN, or without it the 16-bit weight kernel (linear16.py,
    float32 products) where it runs. Timed once per machine and shape (cached)."""
    support = native_bf16()
    kernel = linear16.available() if not support.native else None
    if kernel is not None and not kernel.ok:
        return Bf16Verdict(False, f"no native bf16: {support.reason}; {kernel.reason}", {})
    key = f"{timings.machine_key()} {out_features}x{in_features}"
    ms = timings.cached(cache_path(), key, lambda: _time_products(out_features, in_features), ("bf16", "float32"))
    faster = all(b < f for b, f in zip(ms["bf16"], ms["float32"]))
    timing = ", ".join(f"{b:.2f} vs {f:.2f} ms at {r} row{'s' * (r > 1)}"
                       for r, b, f in zip((1, VERIFY_ROWS), ms["bf16"], ms["float32"]))
    path = "native bf16" if support.native else f"no native bf16 ({support.reason}), float32 products of bf16 weights"
    verdict = f"{path} and faster" if faster else f"{path} but not faster"
    return Bf16Verdict(faster, f"{verdict}: {out_features}x{in_features} product bf16 vs float32 {timing}", ms)


def describe_path(runner, requested: str) -> str:
    """One line for ``specdec demo`` and ``bench``: the runner's compute path (``ModelRunner.describe``)
    and, for weights cast at load on a CPU, why that dtype, given the dtype that was asked for."""
    line = runner.describe()
    if not runner.casts_weights or runner.device.type != "cpu":
        return line
    support = native_bf16()
    checkpoint = getattr(runner.config, "dtype", None) or getattr(runner.config, "torch_dtype", None)
    if requested != "auto":
        why = f"--dtype {requested}"
        if runner.dtype == torch.bfloat16 and not support.native:
            why += f", no native bf16: {support.reason}"
    elif str(checkpoint).removeprefix("torch.") == "bfloat16":
        why = "auto: " + bf16_verdict(*largest_product(runner.config)).reason
    else:
        why = f"auto: the checkpoint is {str(checkpoint).removeprefix('torch.')}"
    return f"{line} ({why})"


def _time_products(out_features: int, in_features: int, repeats: int = 11) -> dict:
    """Milliseconds of one product with this shape, bf16 (oneDNN, or linear16 without native bf16) and
    float32, at 1 and VERIFY_ROWS rows: the minimum over ``repeats`` runs, the dtypes and row counts
    taking turns within each, so other work on the machine disturbs them alike (timed one after the
    other, a loaded 2-thread run once cached bf16 at 1 row 27x slower than at 5 rows)."""
    g = torch.Generator().manual_seed(0)
    w = 0.02 * torch.randn(out_features, in_features, generator=g)  # [out, in]
    linears = {"bf16": Linear(w.bfloat16()), "float32": Linear(w)}
    inputs = [torch.randn(rows, in_features, generator=g) for rows in (1, VERIFY_ROWS)]
    best = {(name, i): float("inf") for name in linears for i in range(len(inputs))}
    for name, lin in linears.items():
        for x in inputs:
            lin(x)  # builds and caches the kernel
    for _ in range(repeats):
        for (name, i) in best:
            t0 = time.perf_counter()
            linears[name](inputs[i])
            best[name, i] = min(best[name, i], time.perf_counter() - t0)
    return {name: [round(1e3 * best[name, i], 4) for i in range(len(inputs))] for name in linears}


def cache_path() -> Path:
    return timings.cache_file("cpu_bf16.json")
