"""Fit an EAGLE-3 head's draft temperature scale s on held-out text: sampled rows then draw from
q = softmax(z / (T s)) (drafters/eagle3.py), z the head's logits.

At temperature T > 0 the verifier accepts a draft x with probability min(1, p(x) / q(x)), so a draft
position is accepted with probability sum_x min(p(x), q(x)), and any q keeps the output exact (a
rejection is recovered from norm(max(0, p - q))). A head trained to imitate the target can still be
sharper or flatter than it; s is chosen, over a grid, to maximise the teacher-forced chain value
sum_j prod_{i <= j} a_i(s) at T = 1, a_j(s) being step j's mean of sum_x min(p, q_s) over the text's
positions (p the target's distribution there). Argmaxes do not move, so greedy drafts stay as they are.

The result goes into the head's config.json as ``specdec_draft_temperature_scale`` (``write_scale``).

    python benchmarks/drafts/eagle3/calibrate.py --head HEAD --data DIR [DIR ...]
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.models.eagle3 import SCALE_KEY, check_q_scale

GRID = [round(0.4 * (2.5 / 0.4) ** (i / 48), 4) for i in range(49)]  # 0.4 .. 2.5, each 3.9% above the last


@torch.no_grad()
def acceptance_by_scale(model, target, windows: torch.Tensor, lengths: torch.Tensor, batch: int = 4,
                        scales: list[float] = GRID) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced expected acceptance at T = 1 of each draft step of ``model`` (a TTTModel: its head and
    steps) on ``windows`` [N, T] (real lengths [N]) read by ``target`` (a transformers causal LM, float32),
    for each scale: a [steps, S], each step's mean over its scored positions of sum_x min(p(x), q_s(x))
    (p: the target's distribution after the token the step guesses; q_s: softmax(z / s) on the draft
    vocabulary), and the positions scored per step [steps]."""
    head = model.head
    layer_ids = head.config.layer_ids
    vocab = torch.as_tensor(head.draft_to_target).long()  # [Vd] target id of each draft id
    keep = vocab < target.config.vocab_size
    s = torch.tensor(scales, dtype=torch.float32)
    sums = torch.zeros(model.steps, len(scales), dtype=torch.float64)
    counts = torch.zeros(model.steps, dtype=torch.float64)
    dev = next(head.parameters()).device
    for i in range(0, len(windows), batch):
        x, n = windows[i:i + batch].to(dev), lengths[i:i + batch]
        out = target(input_ids=x, output_hidden_states=True)
        features = torch.cat([out.hidden_states[L] for L in layer_ids], dim=-1).float()  # [b, T, 3 Dt]
        p_all = torch.softmax(out.logits.float(), dim=-1)  # [b, T, V]
        p_draft = torch.zeros(*p_all.shape[:2], len(vocab), device=dev)  # [b, T, Vd] p on the draft vocabulary
        p_draft[..., keep] = p_all[..., vocab[keep]]
        del out, p_all
        for j, (z, scored, _) in enumerate(model.unroll(x, features, n)):
            p = model.shift(p_draft, j)[scored]  # [m, Vd]
            z = z.float()[scored]  # [m, Vd]
            if not len(z):
                continue
            for c, scale in enumerate(s.tolist()):
                sums[j, c] += torch.minimum(p, torch.softmax(z / scale, dim=-1)).sum(-1).double().sum().cpu()
            counts[j] += len(z)
    return (sums / counts.clamp(min=1)[:, None]).float(), counts


def chain_value(a: torch.Tensor) -> torch.Tensor:
    """a [steps, S] per-step acceptance -> [S] sum_j prod_{i <= j} a_i: the expected drafts accepted in a
    chain of ``steps`` if each step's acceptance were independent of the others'."""
    return a.cumprod(dim=0).sum(dim=0)


def fit_scale(model, target, windows: torch.Tensor, lengths: torch.Tensor, batch: int = 4,
              scales: list[float] = GRID) -> dict:
    """The scale of ``scales`` with the best teacher-forced chain value (``acceptance_by_scale``), and the
    figures behind it: per-step acceptance at s = 1 and at the scale, and both chain values."""
    if 1.0 not in scales:
        raise ValueError("the scales tried must include 1.0 (the head as it is), to compare against")
    if len(windows) == 0:
        raise ValueError("no held-out windows to fit the draft temperature scale on; pass held-out text")
    a, counts = acceptance_by_scale(model, target, windows, lengths, batch, scales)
    value = chain_value(a)
    best, one = int(value.argmax()), scales.index(1.0)
    return {"scale": scales[best], "acceptance_at_1": a[:, one].tolist(), "acceptance": a[:, best].tolist(),
            "chain_at_1": float(value[one]), "chain": float(value[best]), "positions": int(counts[0]),
            "grid": [scales[0], scales[-1], len(scales)]}


def format_fit(r: dict) -> str:
    per = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    return (f"draft temperature scale {r['scale']:g}: expected acceptance per step at T=1 {per(r['acceptance'])} "
            f"(s = 1: {per(r['acceptance_at_1'])}); chain value {r['chain']:.3f} (s = 1: {r['chain_at_1']:.3f}); "
            f"{r['positions']:,} held-out positions")


def write_scale(head_dir: str | Path, scale: float) -> Path:
    """Set ``specdec_draft_temperature_scale`` in the head folder's config.json (1.0 removes it)."""
    path = Path(head_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{str(head_dir)!r} has no config.json: pass an EAGLE-3 head folder")
    check_q_scale(scale)
    config = json.loads(path.read_text())
    if scale == 1.0:
        config.pop(SCALE_KEY, None)
    else:
        config[SCALE_KEY] = float(scale)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path
