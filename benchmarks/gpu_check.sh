#!/usr/bin/env bash
# The GPU check, in about 8 minutes on a machine with CUDA (the default path there: the compiled step
# replayed as CUDA graphs; eager with --device cpu, to fit its time limits):
#   1. the suite's device-parametrized tests on cuda (tests/test_devices.py: the `device` fixture);
#   2. benchmarks/row_invariance.py: does a verify pass score tokens as one-token steps do;
#   3. the chi-square self-test, `specdec verify-lossless`, on the shipped pair;
#   4. `specdec bench` on the shipped pair (8 held-out code prompts, greedy: outputs must match);
#   5. the same with suffix decoding (no draft model);
#   6. the 1B stand-in (benchmarks/make_standin.py: TinyLlama-1.1B's cost, the shipped target's
#      function) with the shipped draft and suffix decoding: the size users run;
#   7. the shipped target with its EAGLE-3 head;
#   8. the compiled step (CUDA graphs) against eager (benchmarks/compiled_vs_eager.py: plain and draft
#      k=4, outputs equal);
#   9. the same on the 1B stand-in (only when STEPS names it: compiled_standin, about 2.5 minutes);
#  10. benchmarks/round_cost.py: where a round's time goes (kernels against host work), with a profile.
# STEPS="tests compiled ..." runs only the named steps (tests rows lossless bench bench_suffix standin
# bench_eagle3 compiled compiled_standin round_cost); by default all but compiled_standin.
# Each step has its own time limit; a step that runs out is reported as such and the next one runs.
# Prints a short report; logs, JSON results and report.txt go to a folder, packed after every step
# into $OUT/gpu_check.tar.gz when OUT is set (else the folder is a temp folder, left in place).
#
# Usage: benchmarks/gpu_check.sh [--device cpu]
#   --device cpu runs the same steps on the CPU, to check the script itself where no GPU is lent
#   (smaller there: PROMPTS=2 MAX_TOKENS=32 SAMPLES=300 STANDIN=0 fit the CPU in the steps' time limits).
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
command -v "$PY" >/dev/null || { echo "error: $PY not found; run make install or set PYTHON" >&2; exit 2; }
DIR=$(mktemp -d)
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DEVICE" = cuda ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "error: torch sees no CUDA device here ($("$PY" -c 'import torch; print(torch.__version__)')); " \
       "run on a machine with a GPU and a CUDA build of torch, or pass --device cpu to check the script" >&2
  exit 2
fi

FAILED=()
# pack: the folder into $OUT (one file: what comes back from a lent machine is a few files)
pack() { if [ -n "${OUT:-}" ]; then tar -czf "$OUT/gpu_check.tar.gz" -C "$DIR" . ; fi; }
# run NAME LIMIT_S CMD...: the command's output to $DIR/NAME.log, its time and exit status noted
run() {
  local name=$1 limit=$2
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
  local t0=$SECONDS rc=0
  echo "== $name (limit ${limit} s)"
  timeout "$limit" "$@" >"$DIR/$name.log" 2>&1 || rc=$?
  echo "$rc $((SECONDS - t0))" >"$DIR/$name.rc"
  echo "   exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || { FAILED+=("$name"); tail -n 25 "$DIR/$name.log"; }
  pack
}
# the device's default path (CUDA: the compiled step as CUDA graphs); the CPU runs eager to fit the time limits
EAGER=(); EAGER_ENV=(); COMPILED=(--compiled)
if [ "$DEVICE" = cpu ]; then EAGER=(--enforce-eager); EAGER_ENV=(SPECDEC_ENFORCE_EAGER=1); COMPILED=(); fi
PAIR=(--model specdec/demo-target --prompts benchmarks/prompts/code_heldout.jsonl
      --num-prompts "${PROMPTS:-8}" --max-tokens "${MAX_TOKENS:-128}" --device "$DEVICE" --json)

"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')"
# 1. pytest exits 5 when nothing is collected: here that means no device-parametrized test exists, a failure.
run tests 120 "$PY" -m pytest -q -rs -p no:cacheprovider -k "$DEVICE and not bad_input" tests/test_devices.py
run rows 90 "$PY" benchmarks/row_invariance.py --device "$DEVICE" --num-prompts "${PROMPTS:-8}" "${COMPILED[@]}"
run lossless 90 env "${EAGER_ENV[@]}" "$PY" -m specdec verify-lossless --model specdec/demo-target --draft specdec/demo-draft \
  --samples "${SAMPLES:-1000}" --device "$DEVICE" --json
run bench 90 "$PY" -m specdec bench "${PAIR[@]}" --draft specdec/demo-draft "${EAGER[@]}"
run bench_suffix 60 "$PY" -m specdec bench "${PAIR[@]}" --method suffix "${EAGER[@]}"
if [ "${STANDIN:-1}" = 1 ]; then
  run standin 150 bash -c "'$PY' benchmarks/make_standin.py --shape tinyllama-1.1b --out '$DIR/standin' \
    && '$PY' -m specdec bench --model '$DIR/standin' --draft specdec/demo-draft --enable-suffix-decoding \
       --prompts benchmarks/prompts/code_heldout.jsonl --num-prompts ${PROMPTS:-4} --max-tokens ${MAX_TOKENS:-128} \
       --device $DEVICE --json ${EAGER[*]}; rc=\$?; rm -rf '$DIR/standin'; exit \$rc"
fi
run bench_eagle3 60 "$PY" -m specdec bench "${PAIR[@]}" --method eagle3 --draft specdec/demo-eagle3 "${EAGER[@]}"
run compiled 200 "$PY" benchmarks/compiled_vs_eager.py 8 "$DEVICE"
if [ "${STANDIN:-1}" = 1 ] && [[ " ${STEPS:-} " == *" compiled_standin "* ]]; then
  run compiled_standin 240 bash -c "'$PY' benchmarks/make_standin.py --shape tinyllama-1.1b --out '$DIR/standin' \
    && '$PY' benchmarks/compiled_vs_eager.py 8 $DEVICE '$DIR/standin'; rc=\$?; rm -rf '$DIR/standin'; exit \$rc"
fi
run round_cost 150 "$PY" benchmarks/round_cost.py --device "$DEVICE" --backends torch --methods draft_model,eagle3 \
  --ks 2,4 --num-prompts "${PROMPTS:-4}" --max-tokens "${MAX_TOKENS:-64}" --profile 25 "${EAGER[@]}"

"$PY" - "$DIR" "$DEVICE" <<'EOF' | tee "$DIR/report.txt"
import json, sys
from pathlib import Path

out, device = Path(sys.argv[1]), sys.argv[2]


def status(name):
    if not Path(out, f"{name}.rc").exists():
        return "not run"
    rc, secs = (Path(out, f"{name}.rc").read_text().split())
    verdict = {"0": "ok", "124": "TIMED OUT", "5": "FAILED (no tests collected)"}.get(rc, f"FAILED (exit {rc})")
    return f"{verdict}, {secs} s"


def last_json(name):
    path = Path(out, f"{name}.log")
    for line in reversed(path.read_text().splitlines() if path.exists() else []):
        if line.startswith("{"):
            return json.loads(line)
    return None


def bench_line(n, name, what):
    b = last_json(name)
    line = f"{n}. bench, {what}: {status(name)}"
    if b:
        gm = b.get("greedy_match") or {}
        line += (f": plain {b['ar']['tokens_per_s']:.1f} tok/s, speculative {b['spec']['tokens_per_s']:.1f} tok/s, "
                 f"{b['speedup']:.2f}x, tau {b['spec']['mean_acceptance_length']:.2f}, "
                 f"greedy equal {gm.get('matched', 0) + gm.get('near_ties', 0)}/{gm.get('total', '?')}")
    print(line)
    for side, path in ((b or {}).get("paths") or {}).items():
        print(f"   {side} path: {path}")


import torch

name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
print(f"specdec GPU check on {device} ({name}), torch {torch.__version__}")
log = Path(out, "tests.log").read_text().strip().splitlines() if Path(out, "tests.log").exists() else []
print(f"1. device tests: {status('tests')}: {log[-1] if log else '(no output)'}")
r = last_json("rows")
print(f"2. verify rows against one-token steps: {status('rows')}" + (
    f": {r['path']}; verify {r['verify_vs_steps']}; beside another request {r['beside_vs_steps']}" if r else ""))
v = last_json("lossless")
line = f"3. verify-lossless: {status('lossless')}"
if v:
    ps = [t["p_value"] for t in v.get("tests", [])]
    line += f": {'passed' if v.get('passed') else 'FAILED'}, {len(ps)} tests, smallest p {min(ps):.3g}" if ps else ""
print(line)
path = "eager" if device == "cpu" else "compiled"
bench_line(4, "bench", f"shipped pair, draft model, {path}")
bench_line(5, "bench_suffix", f"shipped target, suffix decoding, {path}")
bench_line(6, "standin", f"1B stand-in + shipped draft with suffix decoding, {path}")
bench_line(7, "bench_eagle3", f"shipped target + EAGLE-3 head, {path}")
for n, name, what in ((8, "compiled", "shipped pair"), (9, "compiled_standin", "1B stand-in")):
    log = Path(out, f"{name}.log")
    table = [l for l in (log.read_text().splitlines() if log.exists() else [])
             if l.startswith(("target", "| plain", "| draft", "draft k=4 /", "outputs equal"))]
    print(f"{n}. compiled step against eager, {what}: {status(name)}" + "".join(f"\n   {l}" for l in table))
log = Path(out, "round_cost.log")
table = [l for l in (log.read_text().splitlines() if log.exists() else []) if l.startswith(("| torch", "torch "))]
print(f"10. round cost: {status('round_cost')}" + "".join(f"\n   {l}" for l in table))
EOF
pack

if [ ${#FAILED[@]} -gt 0 ]; then
  echo "FAILED: ${FAILED[*]} (see $DIR/<step>.log)"
  exit 1
fi
echo "all passed"
