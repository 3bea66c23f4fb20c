"""Sequence-level distillation data: the target's own greedy continuations of corpus windows, as text.

A draft with a tokenizer of its own cannot learn from the target's logits (different vocabulary),
but it can learn from the target's outputs: text. This picks random windows of the target's
training split (``specdec.training.data.read_split``, so the held-out files and the standard
library's ``test/`` folders, where benchmarks/prompts/code_heldout.jsonl comes from, stay unseen),
lets the target continue each one greedily in batches on the torch backend, and writes each
window's text followed by its continuation to ``OUT/kd_NNNNN.py`` (the ``.py`` suffix is what
``specdec train --data OUT`` collects). It stops after ``--windows`` windows, or after the batch
running when ``--minutes`` have passed. The windows depend only on ``--seed``: a run stopped early
writes a prefix of a longer run's files.

    python benchmarks/drafts/bpe-draft/make_kd_data.py --target specdec/demo-target --out runs/kd \
        --windows 832 --threads 1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="specdec/demo-target")
    ap.add_argument("--data", nargs="+", default=["stdlib"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=128, help="tokens of corpus text before each continuation")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens the target writes per window")
    ap.add_argument("--batch", type=int, default=32, help="windows generated together")
    ap.add_argument("--windows", type=int, default=0, help="stop after this many windows (0: no limit)")
    ap.add_argument("--minutes", type=float, default=15.0, help="stop starting new batches after this (0: no limit)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from specdec import LLM, SamplingParams
    from specdec.training.data import read_split, tokenize_documents

    llm = LLM(args.target, backend="torch")
    tok = llm.tokenizer
    (_, _), (train_texts, _) = read_split(args.data, 0.02)  # the split `specdec train` uses by default
    tokens = tokenize_documents(train_texts, tok)  # [n_tokens], documents joined by eos
    eos = tok.eos_token_id
    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=False,
                            seed=None if args.temperature == 0 else args.seed)
    t0, n_files, n_new = time.time(), 0, 0
    while (not args.minutes or time.time() - t0 < args.minutes * 60) and (not args.windows or n_files < args.windows):
        prompts = []
        while len(prompts) < min(args.batch, args.windows - n_files if args.windows else args.batch):
            start = int(rng.integers(0, len(tokens) - args.prompt_tokens))
            window = tokens[start:start + args.prompt_tokens].astype(np.int64).tolist()
            if eos in window:  # stay inside one document
                window = window[:window.index(eos)]
            if len(window) >= args.prompt_tokens // 2:
                prompts.append(window)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for p, o in zip(prompts, outs):
            ids = o.outputs[0].token_ids
            text = tok.decode(p + [i for i in ids if i != eos], skip_special_tokens=True)
            (out / f"kd_{n_files:05d}.py").write_text(text, encoding="utf-8")
            n_files += 1
            n_new += len(ids)
        el = time.time() - t0
        print(f"{el:7.0f}s {n_files} windows, {n_new} target tokens ({n_new / el:.0f} tok/s)", flush=True)
    print(f"done: {n_files} windows, {n_new} generated tokens in {time.time() - t0:.0f}s -> {out}")


if __name__ == "__main__":
    main()
