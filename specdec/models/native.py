"""specdec's C++ CPU kernels (linear16.py, cache_attention.py): each built once per machine and torch
version (``torch.utils.cpp_extension``, into specdec's cache folder; a C++ compiler and ninja) and
registered as a ``specdec::`` operator that the compiled step (compiled.py) calls as an extern kernel.
They use AVX2 + FMA (+ F16C) intrinsics: ``cpu_reason`` says why a CPU cannot run them."""

from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass

import torch

from specdec.models.timings import cache_dir

# -fopenmp: at::parallel_for runs its range on torch's threads only where _OPENMP is defined; without it
# a kernel runs the whole range on one thread (EPYC-AVX2, the shipped target's 33 products at T = 1:
# 3.6 -> 2.3 ms; T = 9: 8.2 -> 4.5 ms). It links libgomp.so.1, which resolves to torch's (one thread pool).
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")


# C++ for the kernels' sources: whether the AVX-512 code paths they carry (compiled under their own target options
# inside libraries built with the AVX2 flags) run here: AVX-512 F/BW/DQ/VL, and ATen not held below AVX-512
# (ATEN_CPU_CAPABILITY, as torch reads it)
WIDE_ISA_CPP = r"""
bool wide_isa() {
  static const bool wide = [] {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")))
      return false;
    const char* held = std::getenv("ATEN_CPU_CAPABILITY");
    return held == nullptr || held[0] == '\0' || std::string(held) == "avx512";
  }();
  return wide;
}
"""


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str  # why not, when not


def cpu_reason() -> str | None:
    """Why this CPU (or ATEN_CPU_CAPABILITY) cannot run the kernels, or None when it can."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU (or ATEN_CPU_CAPABILITY) offers no AVX2: {torch.backends.cpu.get_cpu_capability()}"
    caps = torch.cpu.get_capabilities()
    missing = [f for f in ("fma3", "f16c") if f in caps and not caps[f]]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def build(stem: str, source_text: str, what: str, flags: tuple[str, ...] = FLAGS,
          ldflags: tuple[str, ...] = ("-fopenmp",), python_module: bool = False):
    """Compile and load ``source_text`` as the library ``specdec_<stem>_<tag>`` (a cached build loads in
    well under a second); ``what`` names it in the line printed before a first build. ``python_module``:
    a pybind11 module, returned (its tag also names the Python version, whose ABI it is built for)."""
    from torch.utils import cpp_extension

    key = source_text + " ".join(flags) + torch.__version__ + (sys.version if python_module else "")
    tag = hashlib.sha1(key.encode()).hexdigest()[:12]
    folder = cache_dir() / stem / tag
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / f"{stem}.cpp"
    if not source.exists() or source.read_text() != source_text:
        tmp = source.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source_text)
        tmp.replace(source)
    name = f"specdec_{stem}_{tag}"
    built = any(folder.glob(f"{name}*.so"))
    if not built:  # a C++ compile of up to a minute: say so before it starts, as the compiled step does
        print(f"specdec: building {what} into {folder} (once per machine) ...", end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        loaded = cpp_extension.load(name, [str(source)], extra_cflags=list(flags), extra_ldflags=list(ldflags),
                                    build_directory=str(folder), is_python_module=python_module, verbose=False)
    except BaseException:
        if not built:
            print(" failed", file=sys.stderr, flush=True)
        raise
    if not built:
        print(f" built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return loaded


def availability(op: str, build_it, what: str) -> Availability:
    """Whether ``specdec::<op>`` runs here: the CPU's reason, or ``build_it()``'s failure (no compiler, no
    ninja, a read-only cache), or ok."""
    return module_availability(lambda: None if hasattr(torch.ops.specdec, op) else build_it(), what)[1]


def module_availability(build_it, what: str) -> tuple[object | None, Availability]:
    """``availability`` for a kernel built as a Python module (``build(..., python_module=True)``, called
    without the dispatcher: a few µs where an operator's dispatch costs tens right after a forward):
    (``build_it()``'s module or None, whether it runs here and why not)."""
    reason = cpu_reason()
    if reason is not None:
        return None, Availability(False, reason)
    try:
        return build_it(), Availability(True, "")
    except Exception as e:  # no compiler, no ninja, a read-only cache, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return None, Availability(False, f"building {what} failed: {type(e).__name__}: {first}")
