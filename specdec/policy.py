"""The speculation policy in one place: the rules and priors that decide how a round speculates,
read by the controller (adaptive/), the drafter choice (drafters/choice.py) and the backend choice
(models/backend_choice.py)."""

from __future__ import annotations

# -- priors: what the cost model assumes until the controller has measured it ----------------------
PRIOR_ALPHA = 0.6  # acceptance per draft position before anything is measured
PRIOR_WEIGHT = 4.0  # pseudo-rounds of the batch-wide rates mixed into a sequence's own counts
PRIOR_VERIFY_SLOPE = 0.07  # v(T) = 1 + slope * (T - 1) one-token steps until measured (docs/benchmarks.md)
PRIOR_DRAFT_COST = 0.1  # c, one draft step in units of a 1-token target step, until measured


def prior_verify_line(T: int) -> float:
    """The verify pass of T tokens per row in one-token steps, before any pass is timed."""
    return 1.0 + PRIOR_VERIFY_SLOPE * (T - 1)
