"""The adaptive controller in simulation: i.i.d. acceptance, a draft step of c plain steps, a verify
pass of 1 + slope * k plain steps, no noise. Prints each case's speed over plain decoding (and over
the best fixed k where some k pays), paced as shipped (1% and 3 plain steps) and unpaced (adaptive/pace.py), over runs of
several lengths and seeds: what pacing the learning rounds trades near break-even.

    python benchmarks/adaptive_sim.py [--rounds 150,600] [--seeds 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from specdec.adaptive import AdaptiveK  # noqa: E402
from test_adaptive_choice import run_time, true_speedups  # noqa: E402  (the tests' simulation, one copy)

LOSING = [(0.4, 0.15, 0.35), (0.5, 0.25, 0.4), (0.6, 0.3, 0.45), (0.1, 0.1, 0.3), (0.45, 0.15, 0.3)]
PAYING = [(0.5, 0.15, 0.3), (0.55, 0.1, 0.35), (0.72, 0.15, 0.3), (0.3, 0.05, 0.2), (0.6, 0.1, 0.3)]


def run(alpha: float, c: float, slope: float, rounds: int, seed: int, paced: bool = True) -> float:
    """One run at batch 1: its tokens over the time plain decoding would have taken for them."""
    ctrl = AdaptiveK(8)
    if not paced:
        ctrl.pacer.share = float("inf")
    return run_time(ctrl, rounds, alpha, c, slope, random.Random(seed))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", default="150,600")
    ap.add_argument("--seeds", type=int, default=8)
    a = ap.parse_args()
    print("| case (alpha, c, slope) | best fixed | rounds | paced: mean (min) | unpaced: mean (min) |")
    print("| --- | --- | --- | --- | --- |")
    for case in LOSING + PAYING:
        best = max(true_speedups(*case))  # S(0) = 1: plain decoding where nothing pays
        for rounds in map(int, a.rounds.split(",")):
            cells = []
            for paced in (True, False):
                r = [run(*case, rounds, s, paced) / best for s in range(a.seeds)]
                cells.append(f"{statistics.mean(r):.3f} ({min(r):.3f})")
            print(f"| {case} | {best:.3f} | {rounds} | {cells[0]} | {cells[1]} |")
    print("(speeds over the best fixed k's, or over plain decoding where nothing pays)")


if __name__ == "__main__":
    main()
