"""specdec's cache folder, and timings measured once per machine and kept there as JSON: dtype="auto"'s
bf16 verdict (dtype_choice.py) and backend="auto"'s forward timings (backend_choice.py)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch


def cache_dir() -> Path:
    """specdec's cache folder: $SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdec"


def cache_file(name: str) -> Path:
    return cache_dir() / name


# Settings that hold the kernels to fewer CPU features than the CPU has (make test-restricted sets them):
# the CPU's own capabilities do not show them, the timings do
ISA_ENV = ("SPECDEC_NO_NATIVE_BF16", "SPECDEC_NO_BF16_DOT", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
           "ATEN_CPU_CAPABILITY")
# Raised when specdec's choice of kernels changes, so that timings kept under the old ones are measured again
# (2: bf16 weights on linear16's dot products where avx512_bf16 runs)
KERNELS = 2


def isa_key() -> str:
    """A short name for the instructions generated code may use here: the CPU's features and the ISA
    limits set in the environment (inductor's own cache key includes neither, and code compiled for
    AVX-512 gave NaN under ATEN_CPU_CAPABILITY=avx2)."""
    caps = torch.cpu.get_capabilities()
    limits = [f"{name}={os.environ[name]}" for name in ISA_ENV if os.environ.get(name)]
    return hashlib.sha1(json.dumps([sorted((k, str(v)) for k, v in caps.items()), limits]).encode()).hexdigest()[:12]


def machine_key() -> str:
    """The machine as timings depend on it: the CPU model and features, the kernels' ISA limits set
    in the environment, torch, the thread count."""
    caps = torch.cpu.get_capabilities()
    features = hashlib.sha1(json.dumps(sorted((k, str(v)) for k, v in caps.items())).encode()).hexdigest()[:12]
    limits = "".join(f" {name}={os.environ[name]}" for name in ISA_ENV if os.environ.get(name))
    return (f"{caps.get('cpu_name', platform.processor())} {features}{limits} torch {torch.__version__} "
            f"threads {torch.get_num_threads()} kernels {KERNELS}")


def cached(path: Path, key: str, measure: Callable[[], dict], names: tuple[str, ...], length: int = 2,
           notes: tuple[str, ...] = ()) -> dict:
    """The timings kept under ``key`` in ``path``: {name: [length numbers]} for exactly ``names``,
    plus a string under each of ``notes`` (how they were measured), measured and kept when absent or
    damaged (a hand-edited or truncated file times again)."""
    value = read(path).get(key)
    if not _well_formed(value, names, length, notes):
        value = measure()
        write(path, key, value)
    return value


def _well_formed(value, names: tuple[str, ...], length: int, notes: tuple[str, ...] = ()) -> bool:
    return (isinstance(value, dict) and set(value) == set(names) | set(notes)
            and all(isinstance(value[n], str) for n in notes)
            and all(isinstance(value[n], list) and len(value[n]) == length
                    and all(isinstance(x, (int, float)) for x in value[n]) for n in names))


def read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write(path: Path, key: str, value) -> None:
    """Best effort: a read-only home only means timing again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = read(path)
        data[key] = value
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError:
        pass
