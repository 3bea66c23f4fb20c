"""Fit the draft temperature scale of an existing EAGLE-3 head (specdec/training/draft_calibration.py) on
held-out text and write it into a head folder's config.json (``specdec_draft_temperature_scale``).

The text: the held-out files of ``--data`` (the split ``specdec distill`` makes with the same
``--val-fraction``, so a head trained on that data never read them), cut into windows within documents.
Best with the target's own temperature-1 continuations (what sampled rows draft in).

    python benchmarks/drafts/eagle3/calibrate.py --head specdec/demo-eagle3 --data runs/kd-eagle3-t1 runs/kd-eagle3-t1-s3 --out runs/demo-eagle3-cal
    python benchmarks/drafts/eagle3/calibrate.py --head runs/my-head --data runs/kd --in-place
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True, help="an EAGLE-3 head folder or name")
    ap.add_argument("--target", default="specdec/demo-target")
    ap.add_argument("--data", nargs="+", required=True, help="text folders or files (their held-out part is read)")
    ap.add_argument("--val-fraction", type=float, default=0.02, help="as the head's training run split the data")
    ap.add_argument("--seq-len", type=int, default=288)
    ap.add_argument("--windows", type=int, default=24, help="held-out windows read (0: all)")
    ap.add_argument("--steps", type=int, default=5, help="draft steps unrolled per position")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="write a copy of the head with the scale here")
    where.add_argument("--in-place", action="store_true", help="write the scale into --head's own config.json")
    ap.add_argument("--json", default=None, help="write the fit's figures here")
    a = ap.parse_args()
    if not 0 < a.val_fraction < 1 or a.seq_len < 2 or a.windows < 0 or not 1 <= a.steps <= 16:
        raise SystemExit("--val-fraction must be in (0, 1), --seq-len >= 2, --windows >= 0, --steps in [1, 16]")

    import torch

    torch.set_num_threads(a.threads)
    from specdec.models.eagle3 import load_head
    from specdec.models.resolve import resolve_model_path
    from specdec.training.data import read_split, tokenize_documents
    from specdec.training.draft_calibration import fit_scale, format_fit, write_scale
    from specdec.training.eagle3 import TTTModel, document_windows, load_target
    from specdec.training.tokenizer import load_tokenizer

    head_dir = Path(a.head) if Path(a.head).is_dir() else Path(resolve_model_path(a.head))
    target, target_path = load_target(a.target, torch.device("cpu"))
    tok = load_tokenizer(target_path)
    _, (_, held_out) = read_split(a.data, a.val_fraction)
    if not held_out:
        raise SystemExit(f"no held-out files in {a.data} at --val-fraction {a.val_fraction}")
    windows, lengths = document_windows(tokenize_documents(held_out, tok), tok.eos_token_id, a.seq_len, a.windows,
                                        a.seed)
    embedding = target.get_input_embeddings().weight.detach().float()
    head = load_head(head_dir, embedding, target.config.num_hidden_layers, target.config.vocab_size)
    t0 = time.time()
    r = fit_scale(TTTModel(head, a.steps, 1.0), target, windows, lengths)
    r.update(head=str(a.head), data=a.data, windows=len(windows), seconds=round(time.time() - t0, 1))
    print(f"{a.head}: {format_fit(r)} ({len(held_out)} held-out files, {len(windows)} windows, {r['seconds']} s)")
    out = head_dir
    if a.out:
        out = Path(a.out)
        if out.resolve() != head_dir.resolve():
            shutil.copytree(head_dir, out, dirs_exist_ok=True)
    print(f"wrote {write_scale(out, r['scale'])}")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
