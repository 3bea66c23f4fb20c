"""Adaptive speculation: each round, the k (or the draft tree) that the cost model (cost_model.py,
docs/algorithm.md) says pays most for the batch, with measured quantities instead of assumptions.

    measure.py     what it measures: acceptance per draft position (estimate and upper bound), the
                   verify pass per length, a draft step, per batch size
    probe.py       how it probes while speculation is off, within a budget
    pace.py        how it paces drafting that only the confidence bound keeps on, within a budget
    controller.py  how it chooses k (``choose_k``), and AdaptiveK, the object the engine talks to
    trees.py       how it chooses a tree shape, and what tree rounds teach it
"""

from specdec.adaptive.controller import AdaptiveK, choose_k
from specdec.adaptive.measure import DECAY, PositionStats, Timing

__all__ = ["DECAY", "AdaptiveK", "PositionStats", "Timing", "choose_k"]
