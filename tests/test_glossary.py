"""docs/internals.md's glossary held against the code: one word, one meaning.

Read with :mod:`ast` (nothing of jaxstep is imported). Each row names where its word
lives in the code (``class X`` in ``path``, ``parameter name: T``, ``field C.name``)
and the names it retired; a row whose code moved, or a retired name that came back,
fails here by name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "jaxstep" / "_src"
DOC = ROOT / "docs" / "internals.md"


def _rows() -> list[list[str]]:
    text = DOC.read_text()
    section = text[text.index("## Glossary") :]
    section = section[: section.index("\n## ", 1)]
    rows = []
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| word") and "---" not in line:
            rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


ROWS = _rows()
TREES = {path: ast.parse(path.read_text()) for path in sorted(SRC.rglob("*.py"))}


def _defined() -> dict[str, list[Path]]:
    """Each class or function name defined under jaxstep/_src: where."""
    found: dict[str, list[Path]] = {}
    for path, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                found.setdefault(node.name, []).append(path)
    return found


DEFINED = _defined()


def _classes(name: str) -> list[ast.ClassDef]:
    return [
        node
        for tree in TREES.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name == name
    ]


def test_the_glossary_is_read():
    words = [row[0] for row in ROWS]
    assert len(ROWS) >= 20 and len(set(words)) == len(words), words
    assert all(len(row) == 4 for row in ROWS), [row for row in ROWS if len(row) != 4]


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row[0])
def test_each_word_lives_where_the_glossary_says(row):
    word, _, code, _ = row
    if match := re.fullmatch(r"`class (\w+)` in `([\w/.]+)`", code):
        name, path = match.groups()
        where = [p for p in DEFINED.get(name, []) if _classes(name)]
        assert [p.relative_to(SRC).as_posix() for p in where] == [path], (
            f"{word}: class {name} is defined in {where}, not (only) in {path}"
        )
    elif match := re.fullmatch(r"`parameter (\w+): ([\w\[\], |]+)`", code):
        name, annotation = match.groups()
        seen = [
            (path.relative_to(SRC).as_posix(), node.lineno, ast.unparse(arg.annotation))
            for path, tree in TREES.items()
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for arg in [*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs]
            if arg.arg == name and arg.annotation is not None
        ]
        assert seen, f"{word}: no function of jaxstep/_src takes {name}"
        other = [s for s in seen if s[2] != annotation]
        assert not other, f"{word}: {name} is not {annotation} in {other}"
    elif match := re.fullmatch(r"`field (\w+)\.(\w+)`", code):
        cls, field = match.groups()
        (node,) = _classes(cls)
        fields = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)]
        assert field in fields, f"{word}: {cls} has no field {field} ({fields})"
    else:
        assert code.startswith("(") and code.endswith(")"), f"{word}: unread {code!r}"


@pytest.mark.parametrize("row", [r for r in ROWS if r[3]], ids=lambda row: row[0])
def test_a_retired_name_does_not_come_back(row):
    for name in re.findall(r"`(\w+)`", row[3]):
        assert name not in DEFINED, f"{row[0]}: {name} is retired, yet {DEFINED[name]}"
