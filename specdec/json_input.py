"""A JSON object given by a user (a command-line flag, a line of a prompts file, a profile), parsed
with a ``ValueError`` that says where the input came from and what is wrong with it."""

from __future__ import annotations

import json


def json_object(text: str, where: str) -> dict:
    """``text`` parsed as a JSON object; ``where`` opens the error message (e.g. ``--speculative-config``)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(obj).__name__}")
    return obj
