"""verify_cost.py's table for one bf16 checkpoint on the torch runner's CPU paths, in one run: float32
weights (ATen), bf16 weights on oneDNN (only where bf16 is native), and bf16 weights on specdec's
16-bit weight kernel (models/linear16.py: float32 products), eager and compiled, beside llama.cpp
GGUF files. Where bf16 is native the kernel is timed by loading that runner with
SPECDEC_NO_NATIVE_BF16=1 (its other kernels keep the CPU's full ISA). Run it under the restricted
environment (SPECDEC_NO_NATIVE_BF16=1 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2) to stand in
for an AVX2-only CPU.

    python benchmarks/linear16_cost.py --hf specdec/demo-target [--gguf X.gguf] [--threads 1] [--contexts 256]
"""

from __future__ import annotations

import os
import sys

import verify_cost

from specdec.models import cpu

GGUF_RUNNERS = verify_cost.runners  # verify_cost's own, before main() is pointed at the one below


def runners(args) -> dict[str, object]:
    from specdec.models.load import load_runner

    hf, args.hf = args.hf, []
    out = GGUF_RUNNERS(args)  # the GGUF files on llama.cpp
    native = cpu.native_bf16().native
    for path in hf:
        variants = {"float32": ("float32", False), "bf16 oneDNN": ("bfloat16", False), "bf16 linear16": ("bfloat16", True)}
        for name, (dtype, switch_off) in variants.items():
            if name == "bf16 oneDNN" and not native:
                continue
            for eager in (True,) if args.eager_only else (True, False):
                before = os.environ.get(cpu.NO_NATIVE_ENV)
                if switch_off:
                    os.environ[cpu.NO_NATIVE_ENV] = "1"
                try:
                    runner = load_runner(path, "torch", dtype=dtype, enforce_eager=eager)[0]
                finally:
                    if before is None:
                        os.environ.pop(cpu.NO_NATIVE_ENV, None)
                    else:
                        os.environ[cpu.NO_NATIVE_ENV] = before
                kind = runner.lm_head.kind
                if name != "float32" and kind != {"bf16 oneDNN": "onednn", "bf16 linear16": "w16"}[name]:
                    sys.exit(f"{name}: the runner took the {kind!r} kind; is the 16-bit weight kernel available here?")
                out[f"{os.path.basename(os.path.normpath(path))} torch {name}{'' if eager else ', compiled'}"] = runner
    return out


if __name__ == "__main__":
    verify_cost.runners = runners
    verify_cost.main()
