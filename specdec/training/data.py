"""Training text: collect files, tokenize once, serve random windows.

The corpus becomes one flat token array with documents separated by the EOS
token. A window of ``seq_len + 1`` tokens gives inputs ``w[:-1]`` and labels
``w[1:]``. Which windows a step sees depends only on ``(seed, rank, step,
micro)``, so the sampler has no hidden state: resuming at step ``s`` replays
exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

HELD_OUT_DIRS = frozenset({"test", "tests", "idle_test"})
DEFAULT_SUFFIXES = (".py",)


def stdlib_files(include_tests: bool = False) -> list[Path]:
    """The running Python's standard-library ``.py`` files, sorted.

    Test folders (``test``, ``tests``, ``idle_test``) are excluded by default and
    stay held out for evaluation; ``include_tests=True`` returns only them.
    ``site-packages`` is never included.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts[:-1]
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        if any(p in HELD_OUT_DIRS for p in parts) == include_tests:
            out.append(path)
    return out


def collect_files(paths: Iterable[str | Path], suffixes: Sequence[str] = DEFAULT_SUFFIXES) -> list[Path]:
    """Files named directly, plus files under folders whose name ends in ``suffixes``.

    The special path ``stdlib`` stands for :func:`stdlib_files`.
    """
    out: list[Path] = []
    for p in paths:
        if str(p) == "stdlib":
            out.extend(stdlib_files())
            continue
        p = Path(p)
        if p.is_dir():
            out.extend(f for f in sorted(p.rglob("*")) if f.is_file() and f.name.endswith(tuple(suffixes)))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(p)
    # De-duplicate, keep first occurrence order.
    return list(dict.fromkeys(f.resolve() for f in out))


def read_text(path: Path) -> str | None:
    """File contents, or None for empty or non-UTF-8 files."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text if text.strip() else None


def split_files(files: Sequence[Path], val_fraction: float) -> tuple[list[Path], list[Path]]:
    """Deterministic document-level split by a hash of the file name and size.

    Hashing (not shuffling) keeps each file's side stable when files are added.
    """
    train, val = [], []
    for f in files:
        key = f"{f.name}:{f.stat().st_size}".encode()
        u = int.from_bytes(hashlib.sha1(key).digest()[:8], "big") / 2**64
        (val if u < val_fraction else train).append(f)
    if val_fraction > 0 and not val and len(train) > 1:
        val.append(train.pop())  # tiny corpora: still hold out one document
    return train, val


def read_split(
    paths: Iterable[str | Path], val_fraction: float
) -> tuple[tuple[list[Path], list[Path]], tuple[list[str], list[str]]]:
    """``(train_files, held_out_files), (train_texts, held_out_texts)`` of the files under ``paths``
    (see :func:`collect_files`), split by :func:`split_files`; empty and non-UTF-8 files have no text."""
    files = split_files(collect_files(paths), val_fraction)
    return files, tuple([t for t in map(read_text, side) if t is not None] for side in files)


def tokenize_documents(texts: Iterable[str], tokenizer, batch_size: int = 256) -> np.ndarray:
    """Concatenate ``doc0 EOS doc1 EOS ...`` into one flat array.

    uint16 when the vocabulary fits (halves memory), else int32.
    """
    eos = tokenizer.eos_token_id
    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.int32
    chunks: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            chunks.append(np.asarray(ids + [eos], dtype=dtype))
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    if not chunks:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(chunks)


@dataclass
class TokenWindows:
    """Random contiguous windows of ``seq_len + 1`` tokens from a flat array."""

    tokens: np.ndarray  # [n_tokens]
    seq_len: int
    seed: int = 0
    rank: int = 0

    def __post_init__(self) -> None:
        if len(self.tokens) < self.seq_len + 1:
            raise ValueError(
                f"corpus has {len(self.tokens)} tokens, need at least seq_len + 1 = {self.seq_len + 1}"
            )

    def batch(self, batch_size: int, step: int, micro: int = 0) -> torch.Tensor:
        """Windows for one micro-batch: ``[batch_size, seq_len + 1]`` int64."""
        rng = np.random.default_rng([self.seed, self.rank, step, micro])
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=batch_size)
        return self._gather(starts)

    def fixed(self, n: int, seed: int = 1234) -> torch.Tensor:
        """``n`` windows that do not depend on rank or step (for evaluation)."""
        rng = np.random.default_rng([seed, n])
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=n)
        return self._gather(starts)

    def _gather(self, starts: np.ndarray) -> torch.Tensor:
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]  # [batch, seq_len + 1]
        return torch.from_numpy(self.tokens[idx].astype(np.int64))

    def state_dict(self) -> dict:
        return {"seed": self.seed, "seq_len": self.seq_len, "n_tokens": len(self.tokens)}

    def check_state(self, state: dict) -> None:
        """Refuse to resume on a different corpus or sampler."""
        mine = self.state_dict()
        if state != mine:
            raise ValueError(f"checkpoint sampler state {state} does not match this run's {mine}")


def held_out_windows(tokens: np.ndarray, seq_len: int, n: int) -> torch.Tensor | None:
    """``n`` fixed windows ``[n, seq_len + 1]`` of held-out ``tokens`` for evaluation, or None when
    they do not fill a window."""
    return TokenWindows(tokens, seq_len).fixed(n) if len(tokens) > seq_len else None


@dataclass
class TextSplit:
    """The text of a run's data, tokenized: its training windows for this rank and its held-out part."""

    sampler: TokenWindows
    train_tokens: np.ndarray  # [n] all training tokens
    val_tokens: np.ndarray  # [m] held-out tokens
    val_windows: torch.Tensor | None  # [eval_windows, seq_len + 1] of val_tokens, or None when they do not fill one
    train_files: int
    val_files: int


def text_split(data: Sequence[str | Path], tokenizer, seq_len: int, val_fraction: float, eval_windows: int,
               seed: int, rank: int, log) -> TextSplit:
    """Read ``data``'s files, hold out ``val_fraction`` of them, tokenize both parts and cut windows
    (what finetune and pard train on); ``log`` gets one line of counts."""
    (train_files, val_files), (train_texts, val_texts) = read_split(data, val_fraction)
    train_tokens = tokenize_documents(train_texts, tokenizer)
    val_tokens = tokenize_documents(val_texts, tokenizer)
    del train_texts, val_texts
    log(f"data: {len(train_files)} train files ({len(train_tokens):,} tokens), "
        f"{len(val_files)} held-out files ({len(val_tokens):,} tokens)")
    return TextSplit(TokenWindows(train_tokens, seq_len, seed=seed, rank=rank), train_tokens, val_tokens,
                     held_out_windows(val_tokens, seq_len, eval_windows), len(train_files), len(val_files))


def describe_sources(paths: Iterable[str | Path]) -> str:
    """Human-readable data sources for model cards."""
    names = []
    for p in paths:
        if str(p) == "stdlib":
            v = sysconfig.get_python_version()
            names.append(f"Python {v} standard library `.py` files (no `test`/`tests`/`idle_test` folders, no site-packages)")
        else:
            names.append(f"`{p}`")
    return ", ".join(names)
