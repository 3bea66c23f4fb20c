"""Whether this CPU multiplies bfloat16 natively.

A CPU multiplies bf16 natively only with bf16 dot-product instructions: avx512_bf16 or AMX on
x86, the bf16 extension on arm64. oneDNN also *emulates* bf16 on any AVX-512 CPU (its own check,
``torch.ops.mkldnn._is_mkldnn_bf16_supported``, says yes there), slower than float32, so the
CPU's features decide here, and an ISA held back by ``ONEDNN_MAX_CPU_ISA`` or
``ATEN_CPU_CAPABILITY`` counts as not native. Whether ``dtype="auto"`` then keeps bf16 weights
is measured in dtype_choice.py.

``SPECDEC_NO_NATIVE_BF16=1`` makes specdec behave as on a CPU without native bf16, so that every
CPU path can be tested on any CPU.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

NO_NATIVE_ENV = "SPECDEC_NO_NATIVE_BF16"
# oneDNN ISAs (ONEDNN_MAX_CPU_ISA) whose kernels have bf16 dot products; the lower ones emulate them.
ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                    "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2",
                    "ALL", "DEFAULT")


@dataclass(frozen=True)
class Bf16Support:
    """Whether bf16 products run natively here, on which instructions, and why not when not."""

    native: bool
    isa: str  # e.g. "x86_64 AVX512 + avx512_bf16, amx_bf16"
    reason: str


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
