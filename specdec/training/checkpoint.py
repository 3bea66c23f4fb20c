"""Resumable training checkpoints: one ``checkpoint.pt`` per run folder.

Holds everything needed to continue bit-for-bit: model and optimizer state,
scheduler, step, RNG states, the data sampler's state and run counters
(tokens seen, wall time). Written atomically so a crash mid-save leaves the
previous checkpoint intact.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

CHECKPOINT_NAME = "checkpoint.pt"


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, **state) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict:
    # Our own file: it holds RNG tuples and numpy arrays, not only tensors.
    return torch.load(path, map_location="cpu", weights_only=False)
