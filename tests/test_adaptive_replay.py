"""benchmarks/adaptive_replay.py's pure parts: the run of matching drafts at each output position, and
rounds replayed at a fixed k against a hand count. The replay's models (the target's outputs, the draft's
argmax) need the shipped pair and run in the script only."""

import importlib.util
import random
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "adaptive_replay.py"
_spec = importlib.util.spec_from_file_location("adaptive_replay", _path)
replay_mod = importlib.util.module_from_spec(_spec)
sys.modules["adaptive_replay"] = replay_mod
_spec.loader.exec_module(replay_mod)


def test_match_runs_count_the_drafts_a_round_starting_there_would_accept():
    target = [5, 6, 7, 8, 9, 10]
    draft = [5, 6, 0, 8, 9, 10]  # the draft's argmax after each true prefix
    assert replay_mod.match_runs(target, draft, k_max=8) == [2, 1, 0, 3, 2, 1]
    assert replay_mod.match_runs(target, draft, k_max=2) == [2, 1, 0, 2, 2, 1]


def test_a_fixed_k_replay_takes_the_rounds_a_hand_count_gives():
    runs = [[0, 2, 1, 0, 3, 2, 1, 0]]  # L(p) at positions 0..7; decoding starts at 1 (the prefill's token)
    verify, draft = [1.0, 1.5, 2.0], [0.25, 0.5]
    seconds, tokens = replay_mod.replay(runs, 2, 2, verify, draft, host_s=0.0, rng=None, warmup=False)
    # p=1: k=2, accepts 2 -> p=4; p=4: k=2, accepts 2 -> p=7; p=7: k=min(2, 0)=0, a plain step -> p=8
    assert tokens == 3 + 3 + 1
    assert seconds == (2.0 + 0.5) * 2 + 1.0


def test_an_adaptive_replay_decodes_every_token_and_charges_its_own_time():
    rng = random.Random(0)
    runs = [[rng.randint(0, 6) for _ in range(64)] for _ in range(3)]
    verify = [1e-3 * (1 + 0.05 * t) for t in range(9)]
    draft = [2e-4 * k for k in range(1, 9)]
    free, tokens = replay_mod.replay(runs, None, 8, verify, draft, 0.0, None, warmup=False)
    assert tokens == 3 * 63  # every token after each prompt's first
    charged, _ = replay_mod.replay(runs, None, 8, verify, draft, 0.0, None, warmup=False, controller_s=1e-4)
    assert charged > free
