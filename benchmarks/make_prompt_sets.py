"""Build the benchmark prompt sets from text held out of the shipped pair's training data.

The shipped models were trained on the standard library's ``.py`` files outside its test
folders; these prompts come from inside them (``Lib/test/``), so nothing here was seen in
training. Writes JSONL files (``prompt`` / ``prompt_token_ids`` and ``category``) into
benchmarks/prompts/:

- code_heldout.jsonl  prefixes (~256 tokens) of test files, cut at a line start;
- code_copy.jsonl     ~384-token prefixes whose next 128 tokens mostly repeat n-grams of the
                      prefix (names, lines, patterns), the case prompt lookup is made for;
                      prefix and continuation fill the shipped target's 512-token training
                      context (past it the target ignores the prompt and copies nothing);
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
PREFIX = 384  # tokens of a copy prompt; + 128 generated = the target's trained context


def test_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"]) / "test"
    return sorted(p for p in root.rglob("*.py") if p.stat().st_size > 4000)


def copy_share(prefix: list[int], continuation: list[int], n: int = 4) -> float:
    """Share of the continuation's n-grams that already occur in the prefix."""
    seen = {tuple(prefix[i : i + n]) for i in range(len(prefix) - n + 1)}
    grams = [tuple(continuation[i : i + n]) for i in range(len(continuation) - n + 1)]
    return sum(g in seen for g in grams) / max(len(grams), 1)


def cut(tok, ids: list[int], from_start: bool) -> str:
    """The text of ``ids`` cut at the file's own token boundaries, starting at a line.

    Cutting the text at a line end instead leaves a bare newline token where training text has a
    newline merged with the next line's indentation: the model then starts a top-level line and
    ignores the prompt. Cut token ids, so the prompt ends as the file's tokens do, and keep only a
    cut whose text encodes back to the same ids."""
    if not from_start:  # begin after the first token that ends a line
        first = next((i for i, t in enumerate(ids) if "\n" in tok.decode([t])), -1)
        ids = ids[first + 1 :]
    for n in range(len(ids), max(len(ids) - 8, 0), -1):
        text = tok.decode(ids[:n])
        if tok.encode(text) == ids[:n]:
            return text
    return tok.decode(ids)


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
            heldout.append({"prompt": cut(tok, ids[start : start + 256], start == 0), "category": "code", "source": name})
        if len(copy) < args.num and len(ids) > PREFIX + 200:
            best = max(range(0, len(ids) - PREFIX - 128, 64), key=lambda s: copy_share(ids[s : s + PREFIX], ids[s + PREFIX : s + PREFIX + 128]))
            if copy_share(ids[best : best + PREFIX], ids[best + PREFIX : best + PREFIX + 128]) >= 0.6:
                copy.append({"prompt": cut(tok, ids[best : best + PREFIX], best == 0), "category": "code-copy",
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
