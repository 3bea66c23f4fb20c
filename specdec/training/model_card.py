"""README.md model card for a trained or distilled checkpoint."""

from __future__ import annotations

from pathlib import Path


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def write_model_card(folder: str | Path, title: str, summary: str, facts: dict, command: str, notes: str = "") -> Path:
    """Write ``folder/README.md``: a summary, a facts table and the reproducing command."""
    rows = "\n".join(f"| {k} | {_fmt(v)} |" for k, v in facts.items())
    text = f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [llama, code, python, speculative-decoding, specdec]
---

# {title}

{summary}

| | |
|---|---|
{rows}

## Reproduce

```bash
{command}
```
"""
    if notes:
        text += f"\n## Notes\n\n{notes.strip()}\n"
    path = Path(folder) / "README.md"
    path.write_text(text)
    return path
