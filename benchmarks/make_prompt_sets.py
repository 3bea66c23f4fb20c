"""Build the benchmark prompt sets from text held out of the shipped pair's training data.

The shipped models were trained on the standard library's ``.py`` files outside its test
folders; these prompts come from inside them (``Lib/test/``), so nothing here was seen in
training. Writes JSONL files (``prompt`` / ``prompt_token_ids`` and ``category``) into
benchmarks/prompts/:

- code_heldout.jsonl  prefixes (~256 tokens) of test files, cut at a line start;
- code_copy.jsonl     ~512-token prefixes whose next 128 tokens mostly repeat n-grams of the
                      prefix (names, lines, patterns), the case prompt lookup is made for;
- random_tokens.jsonl uniformly random token ids: nothing in them is predictable.

    python benchmarks/make_prompt_sets.py [--tokenizer specdec/assets/demo-target]
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
from pathlib import Path

OUT = Path(__file__).resolve().parent / "prompts"


def test_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"]) / "test"
    return sorted(p for p in root.rglob("*.py") if p.stat().st_size > 4000)


def copy_share(prefix: list[int], continuation: list[int], n: int = 4) -> float:
    """Share of the continuation's n-grams that already occur in the prefix."""
    seen = {tuple(prefix[i : i + n]) for i in range(len(prefix) - n + 1)}
    grams = [tuple(continuation[i : i + n]) for i in range(len(continuation) - n + 1)]
    return sum(g in seen for g in grams) / max(len(grams), 1)


def cut_at_line(tok, ids: list[int], from_start: bool) -> str:
    """Decode and keep whole lines only."""
    text = tok.decode(ids)
    if not from_start:
        text = text[text.find("\n") + 1 :]
    return text[: text.rfind("\n") + 1] or text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=str(Path(__file__).resolve().parents[1] / "specdec/assets/demo-target"))
    ap.add_argument("--num", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    rnd = random.Random(args.seed)
    files = test_files()
    rnd.shuffle(files)
    OUT.mkdir(exist_ok=True)

    heldout, copy = [], []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tok.encode(text)
        name = str(path.relative_to(path.parents[1]))
        if len(heldout) < args.num and len(ids) > 400:
            start = rnd.randrange(0, len(ids) - 400)
            heldout.append({"prompt": cut_at_line(tok, ids[start : start + 256], start == 0), "category": "code", "source": name})
        if len(copy) < args.num and len(ids) > 700:
            best = max(range(0, len(ids) - 640, 64), key=lambda s: copy_share(ids[s : s + 512], ids[s + 512 : s + 640]))
            if copy_share(ids[best : best + 512], ids[best + 512 : best + 640]) >= 0.6:
                copy.append({"prompt": cut_at_line(tok, ids[best : best + 512], best == 0), "category": "code-copy",
                             "source": name})
        if len(heldout) >= args.num and len(copy) >= args.num:
            break

    vocab = len(tok)
    random_prompts = [{"prompt_token_ids": [rnd.randrange(vocab) for _ in range(128)], "category": "random"}
                      for _ in range(args.num)]
    for name, rows in [("code_heldout", heldout), ("code_copy", copy), ("random_tokens", random_prompts)]:
        with (OUT / f"{name}.jsonl").open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"{name}: {len(rows)} prompts -> {OUT / name}.jsonl")


if __name__ == "__main__":
    main()
