"""Prompt files for benchmarks: JSONL with a ``prompt`` field, or Spec-Bench's ``question.jsonl``.

One JSON object per line. A line gives its prompt as ``{"prompt": "..."}``, as token ids
``{"prompt_token_ids": [1, 2, 3]}``, or in Spec-Bench's format as
``{"turns": ["first turn", ...], "category": "..."}`` (only the first turn is used: benchmarks
here are single-turn). Blank lines are skipped.
"""

from __future__ import annotations

from pathlib import Path

from specdec.json_input import json_object


def load_prompts(path: str | Path, num: int | None = None) -> list[dict]:
    """Read ``path`` and return ``[{"prompt": str, "category": str | None}, ...]``, the first ``num``
    of them when ``num`` is given. Raises ``ValueError`` naming the file (and line) on bad input."""
    if num is not None and not (isinstance(num, int) and not isinstance(num, bool) and num >= 1):
        raise ValueError(f"the number of prompts must be an integer >= 1, got {num!r}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file {str(path)!r} does not exist"
                         + (" (it is a folder)" if path.is_dir() else ""))
    prompts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            prompts.append(_parse_line(line, path, lineno))
            if num is not None and len(prompts) == num:
                break
    if not prompts:
        raise ValueError(f"prompts file {str(path)!r} has no prompts; write one JSON object per line, "
                         'e.g. {"prompt": "def fib(n):"}')
    return prompts


def _parse_line(line: str, path: Path, lineno: int) -> dict:
    where = f"{path}:{lineno}"
    obj = json_object(line, f"{where}: line {lineno}")
    category = obj.get("category")
    if category is not None and not isinstance(category, str):
        category = str(category)
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not (isinstance(prompt, str) and prompt):
            raise ValueError(f"{where}: line {lineno} has a 'prompt' that is not a non-empty string")
        return {"prompt": prompt, "category": category}
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                      for t in ids)):
            raise ValueError(f"{where}: line {lineno} has 'prompt_token_ids' that is not a non-empty list of "
                             "non-negative integers")
        return {"prompt": {"prompt_token_ids": ids}, "category": category}
    if "turns" in obj:
        turns = obj["turns"]
        if not (isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0]):
            raise ValueError(f"{where}: line {lineno} has 'turns' but turns[0] is not a non-empty string")
        return {"prompt": turns[0], "category": category}
    raise ValueError(f"{where}: line {lineno} has no 'prompt', 'prompt_token_ids' or Spec-Bench 'turns'; "
                     'write {"prompt": "..."} or {"turns": ["..."], "category": "..."}')
