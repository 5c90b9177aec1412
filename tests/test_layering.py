"""Imports go one way: no layer imports one above it (docs/architecture.md draws the layers).

Read from the source (every import statement, in functions and TYPE_CHECKING blocks too), so a
new upward import fails here rather than surfacing later as an import cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "srt_lite"

# Top: processes and their front ends.
FRONT = ("srt_lite.entrypoints", "srt_lite.engine", "srt_lite.launch_server")
# The scheduler, tokenizer and detokenizer managers and their collaborators.
MANAGERS = ("srt_lite.managers",)
# Everything below the managers: the model, its executor, KV memory, sampling, drafting.
LOWER = (
    "srt_lite.model_executor",
    "srt_lite.models",
    "srt_lite.layers",
    "srt_lite.mem_cache",
    "srt_lite.sampling",
    "srt_lite.speculative",
    "srt_lite.distributed",
    "srt_lite.model_loader",
    "srt_lite.parser",
    "srt_lite.constrained",
)
# Shared vocabulary and settings: import nothing of srt_lite but each other.
BOTTOM = (
    "srt_lite.req",
    "srt_lite.envs",
    "srt_lite.utils",
    "srt_lite.cpu_caps",
    "srt_lite.server_args",
    "srt_lite.sampling.sampling_params",
)

# (modules, what they must not import)
RULES = [
    (LOWER + BOTTOM, FRONT + MANAGERS),
    (MANAGERS, FRONT),
    (("srt_lite.mem_cache", "srt_lite.sampling", "srt_lite.speculative"), ("srt_lite.layers", "srt_lite.models", "srt_lite.model_executor")),
    (BOTTOM, LOWER),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("srt_lite")}


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_package_is_covered_by_the_layers():
    names = {module_name(p) for p in MODULES}
    placed = FRONT + MANAGERS + LOWER + BOTTOM + ("srt_lite", "srt_lite.metrics", "srt_lite.model_config")
    assert {n for n in names if not within(n, placed)} == set()


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) for p in MODULES])
def test_no_upward_import(path):
    name = module_name(path)
    bad = []
    for importers, forbidden in RULES:
        if not within(name, importers):
            continue
        # A bottom module may import the bottom, though it also sits inside a lower package.
        bad += [m for m in imports_of(path) if within(m, forbidden) and not within(m, BOTTOM)]
    assert bad == [], f"{name} imports {sorted(set(bad))}"
