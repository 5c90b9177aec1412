"""Small files with one owner each: no Python file of the repo (the package, its tests and
benchmarks) over 400 lines, no function over 60 (tests/unit/test_csrc_function_length.py holds
the C++ side to 80)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
# Every Python file of the repo; virtual environments and build folders are not ours.
MODULES = sorted(p for d in ("srt_lite", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py"))
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in `source` longer than `limit` lines."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            length = node.end_lineno - first + 1
            if length > limit:
                out.append((node.name, length))
    return out


def test_long_functions_are_found():
    body = "\n".join(f"        x{i} = {i}" for i in range(8))
    source = f"def short():\n    pass\n\n\nclass A:\n    @staticmethod\n    def long():\n{body}\n"
    assert long_functions(source, 8) == [("long", 10)]
    assert long_functions(source, 10) == []


def test_no_module_over_the_limit():
    big = {str(p.relative_to(ROOT)): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert big == {}


def test_no_function_over_the_limit():
    found = {str(p.relative_to(ROOT)): f for p in MODULES if (f := long_functions(p.read_text(), MAX_FUNCTION_LINES))}
    assert found == {}
