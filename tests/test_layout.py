"""The package's layout: specdec's modules import one another without a circle, counting every
import (inside functions too, where a circle hides from Python's import machinery), and models/
gives no private name to another module."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "specdec"


def module_names() -> dict[str, Path]:
    """specdec's modules by dotted name (a package by its own name, for its __init__.py)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """Every import in module ``name``, anywhere in it: (the specdec module imported, the names taken
    from it). ``from a import b`` imports module a.b when there is one, else names b from a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub, []) if sub in modules else (base, [alias.name]))
    return [(m, taken) for m, taken in found if m in modules and m != name]


def graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: {m for m, _ in imports(name, path, modules)} for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules (Tarjan), as the path that closes it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(set(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_circle(group, edges) for group in groups]


def _circle(group: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A path v -> ... -> v inside ``group`` (breadth first, so the shortest from v)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start} in {group}")


def test_the_checker_finds_a_circle_hidden_in_a_function():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_checker_sees_imports_inside_functions():
    edges = graph()
    assert "specdec.drafters.draft_model" in edges["specdec.drafters"]  # imported inside _build
    assert "specdec.models.resolve" in edges["specdec.llm"]


def test_no_import_circle_in_specdec():
    found = cycles(graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_no_private_name_is_imported_from_another_module_of_models():
    modules = module_names()
    private = [f"{name} takes {taken} from {m}" for name, path in modules.items()
               for m, names in imports(name, path, modules) if m.startswith("specdec.models")
               for taken in names if taken.startswith("_")]
    assert not private, private
