"""The profile per prompt category: a row per configured drafter and the recommended one.

A profile (workbench/profile.py) measures every drafter at k = K on every prompt, tagged with the
prompt's category; the cost model (specdec/cost_model.py) predicts each drafter's S(k) per category
from that category's acceptance. Here: the rows to compare and the pick, the drafter and k with the
highest predicted S(k) (plain decoding when none predicts a gain). Plain data, no model: report and
export read it from profile.json without loading torch.
"""

from __future__ import annotations

from pathlib import Path

ALL = "all"  # the category that pools every prompt


def drafter_rows(configs: list[dict], cat: str) -> list[dict]:
    """One row per configured drafter in category ``cat``: acceptance and τ at k = K, predicted and
    measured speedup at K, and the drafter's best k by the cost model."""
    rows = []
    for i, c in enumerate(configs):
        e, K = c["categories"][cat], c["k_measured"]
        rows.append({
            "config_index": i, "label": c.get("label") or config_label(c), "method": c["method"],
            "choice": is_choice(c),
            "acceptance_rate": e["acceptance_rate"], "mean_acceptance_length": e["mean_acceptance_length"],
            "alpha_conditional": e["alpha_conditional"], "acceptance_rate_per_pos": e["acceptance_rate_per_pos"],
            "predicted_speedup_at_k_max": e["predicted_speedup"][K],
            "predicted_speedup_end_to_end_at_k_max": e["predicted_speedup_end_to_end"][K],
            "measured_speedup_at_k_max": e["measured_speedup_at_k_max"],
            "best_k": e["best_k"], "best_speedup": e["best_speedup"],
            "best_speedup_end_to_end": e["predicted_speedup_end_to_end"][e["best_k"]],
        })
    return rows


def recommend(configs: list[dict], cat: str = ALL) -> dict:
    """The drafter and k with the highest predicted S(k) in category ``cat`` (ALL: every prompt);
    plain decoding (k = 0) when no drafter's best k predicts a gain. Ties go to the config listed first.
    A method list (per-request choice) is measured beside its methods but not picked: the pick is one
    method, what an engine with one method per deployment can take."""
    rows = [r for r in drafter_rows(configs, cat) if not r["choice"]]
    ranked = sorted(rows, key=lambda r: -r["best_speedup"])  # stable: the first listed wins a tie
    best = ranked[0]
    c, k = configs[best["config_index"]], best["best_k"]
    K = c["k_measured"]
    where = "on this workload" if cat == ALL else f"in category {cat!r}"
    rec_cfg = {**c["speculative_config"], "num_speculative_tokens": k, "adaptive": False}
    rec = {
        "config_index": best["config_index"], "label": best["label"], "method": c["method"], "k": k, "plain": k == 0,
        "predicted_speedup": best["best_speedup"],
        "predicted_speedup_end_to_end": best["best_speedup_end_to_end"],
        "speculative_config": rec_cfg,
        "reason": (f"no drafter and k predicts a gain over plain decoding {where}" if k == 0 else
                   f"{best['label']} with k={k} has the highest predicted speedup {where} of the "
                   f"{len(rows)} drafter(s) and k = 0..{K}"),
    }
    if len(ranked) > 1:
        r = ranked[1]
        rec["runner_up"] = {"config_index": r["config_index"], "label": r["label"], "k": r["best_k"],
                            "predicted_speedup": r["best_speedup"]}
    return rec


def is_choice(c: dict) -> bool:
    """Whether a profiled config lists several methods (specdec picks one per request and round)."""
    return isinstance(c["method"], list)


def config_label(c: dict) -> str:
    """A short name for a profiled config: its method, and the draft's (or head's) folder name."""
    cfg = c["speculative_config"]
    if is_choice(c):
        return "choice"  # its methods: speculative_config["method"]
    if c["method"] in ("draft_model", "eagle3"):
        return f"{c['method']} ({Path(str(cfg.get('model'))).name})"
    return c["method"]


def labels(configs: list[dict]) -> list[str]:
    """Labels that tell the configs apart: a label two configs share gets its config number."""
    labels = [config_label(c) for c in configs]
    return [f"{lab} #{i}" if labels.count(lab) > 1 else lab for i, lab in enumerate(labels)]


def with_categories(profile: dict) -> dict:
    """The profile with its per-category section (a profile written before it had one gets it from
    its per-config measurements, by the same rule)."""
    if "by_category" in profile:
        return profile
    first = profile["configs"][0]["categories"]
    by_cat = {cat: {"num_prompts": first[cat]["num_prompts"], "drafters": drafter_rows(profile["configs"], cat),
                    "recommendation": recommend(profile["configs"], cat)}
              for cat in profile.get("categories", []) if cat in first}
    return {**profile, "by_category": by_cat}
