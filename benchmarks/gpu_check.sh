#!/usr/bin/env bash
# The GPU check, in under 8 minutes on a machine with CUDA:
#   1. the suite's device-parametrized tests on cuda (pytest -k cuda: tests/test_devices.py and any
#      other test taking the `device` fixture);
#   2. `specdec bench` on the shipped pair (8 held-out code prompts, greedy: outputs must match);
#   3. the chi-square self-test, `specdec verify-lossless`, on the shipped pair.
# Prints a short report; logs, JSON results and report.txt go to $OUT when it is set (else a temp folder).
#
# Usage: benchmarks/gpu_check.sh [--device cpu]
#   --device cpu runs the same steps on the CPU, to check the script itself where no GPU is lent
#   (smaller there: PROMPTS=2 MAX_TOKENS=32 SAMPLES=300 fit the CPU in the steps' time limits).
# Needs the project's environment (make install): .venv/bin/python, or $PYTHON.
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda
if [ "${1:-}" = "--device" ]; then
  DEVICE=${2:?--device needs cpu or cuda}
elif [ $# -gt 0 ]; then
  echo "usage: $0 [--device cpu|cuda]" >&2
  exit 2
fi
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || { echo "error: $PY not found; run make install or set PYTHON" >&2; exit 2; }
DIR=${OUT:-$(mktemp -d)}
mkdir -p "$DIR"
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DEVICE" = cuda ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "error: torch sees no CUDA device here ($("$PY" -c 'import torch; print(torch.__version__)')); " \
       "run on a machine with a GPU and a CUDA build of torch, or pass --device cpu to check the script" >&2
  exit 2
fi

FAILED=()
# run NAME LIMIT_S CMD...: the command's output to $DIR/NAME.log, its time and exit status noted
run() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" >"$DIR/$name.log" 2>&1 || rc=$?
  echo "$rc $((SECONDS - t0))" >"$DIR/$name.rc"
  [ "$rc" -eq 0 ] || FAILED+=("$name")
}

# 1. pytest exits 5 when nothing is collected: here that means no device-parametrized test exists, a failure.
run tests 270 "$PY" -m pytest -q -rs -p no:cacheprovider -k "$DEVICE and not bad_input" tests
run bench 120 "$PY" -m specdec bench --model specdec/demo-target --draft specdec/demo-draft \
  --prompts benchmarks/prompts/code_heldout.jsonl --num-prompts "${PROMPTS:-8}" --max-tokens "${MAX_TOKENS:-128}" \
  --device "$DEVICE" --json
run lossless 120 "$PY" -m specdec verify-lossless --model specdec/demo-target --draft specdec/demo-draft \
  --samples "${SAMPLES:-2000}" --device "$DEVICE" --json

"$PY" - "$DIR" "$DEVICE" <<'EOF' | tee "$DIR/report.txt"
import json, sys
from pathlib import Path

out, device = Path(sys.argv[1]), sys.argv[2]


def status(name):
    rc, secs = (Path(out, f"{name}.rc").read_text().split())
    verdict = {"0": "ok", "124": "TIMED OUT", "5": "FAILED (no tests collected)"}.get(rc, f"FAILED (exit {rc})")
    return f"{verdict}, {secs} s"


def last_json(name):
    for line in reversed(Path(out, f"{name}.log").read_text().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None


import torch

name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
print(f"specdec GPU check on {device} ({name}), torch {torch.__version__}; logs in {out}")
log = Path(out, "tests.log").read_text().strip().splitlines()
print(f"1. device tests: {status('tests')}: {log[-1] if log else '(no output)'}")
b = last_json("bench")
line = f"2. bench, shipped pair: {status('bench')}"
if b:
    gm = b.get("greedy_match") or {}
    line += (f": plain {b['ar']['tokens_per_s']:.1f} tok/s, speculative {b['spec']['tokens_per_s']:.1f} tok/s, "
             f"{b['speedup']:.2f}x, tau {b['spec']['mean_acceptance_length']:.2f}, "
             f"greedy equal {gm.get('matched', 0) + gm.get('near_ties', 0)}/{gm.get('total', '?')}")
print(line)
for side, path in ((b or {}).get("paths") or {}).items():
    print(f"   {side} path: {path}")
v = last_json("lossless")
line = f"3. verify-lossless: {status('lossless')}"
if v:
    ps = [t["p_value"] for t in v.get("tests", [])]
    line += f": {'passed' if v.get('passed') else 'FAILED'}, {len(ps)} tests, smallest p {min(ps):.3g}" if ps else ""
print(line)
EOF

if [ ${#FAILED[@]} -gt 0 ]; then
  echo "FAILED: ${FAILED[*]} (see $DIR/<step>.log)"
  exit 1
fi
echo "all passed"
