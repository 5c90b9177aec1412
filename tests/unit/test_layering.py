"""Imports go one way: each package imports only itself and the layers below it, and no
import cycle exists (docs/architecture.md draws the layers).

Read from the source (every import statement, in functions and TYPE_CHECKING blocks too), so
a new upward import or cycle fails here rather than surfacing later at import time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
PACKAGE = ROOT / "srt_lite"

# Bottom to top. A module belongs to the longest name below that contains it; it may import
# its own group and any group of a lower layer, never one of its own layer or above, so
# groups that share a layer (the three managers, say) stay independent of each other.
LAYERS: list[tuple[str, ...]] = [
    ("srt_lite.envs",),  # environment variables
    ("srt_lite.utils", "srt_lite.cpu_caps"),
    ("srt_lite.cpu_kernels", "srt_lite.server_args", "srt_lite.sampling.sampling_params"),
    ("srt_lite.req", "srt_lite.cli_args"),  # Req: one request's scheduling state, shared above
    ("srt_lite.distributed", "srt_lite.constrained", "srt_lite.parser", "srt_lite.model_loader"),
    ("srt_lite.mem_cache", "srt_lite.sampling", "srt_lite.speculative"),
    ("srt_lite.model_executor.forward_batch",),  # the forward pass's vocabulary for the layers
    ("srt_lite.layers",),
    ("srt_lite.models",),
    ("srt_lite.model_config",),
    ("srt_lite.model_executor",),
    ("srt_lite.managers.io_struct", "srt_lite.managers.validation"),
    ("srt_lite.managers.scheduler", "srt_lite.managers.tokenizer", "srt_lite.managers.detokenizer"),
    ("srt_lite.entrypoints",),
    ("srt_lite.engine", "srt_lite.launch_server"),
    ("srt_lite",),  # the package's own __init__: the public names
]
LEVEL = {group: i for i, layer in enumerate(LAYERS) for group in layer}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def group_of(name: str) -> str | None:
    found = [g for g in LEVEL if name == g or name.startswith(g + ".")]
    return max(found, key=len) if found else None


def imports_of(name: str) -> set[str]:
    """The srt_lite modules `name` imports: `from a.b import c` counts as a.b.c where that is a
    module, else as a.b (a name defined in a.b)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found.add(full if full in MODULES else node.module)
    return {m for m in found if m.startswith("srt_lite") and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def test_every_module_is_in_a_layer():
    assert {n for n in MODULES if group_of(n) is None} == set()
    assert set(LEVEL) - {group_of(n) for n in MODULES} == set(), "a layer names a package that does not exist"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_only_its_own_group_and_lower_layers(name):
    own = group_of(name)
    bad = sorted(m for m in GRAPH[name] if group_of(m) != own and LEVEL[group_of(m)] >= LEVEL[own])
    assert bad == [], f"{name} ({own}) imports {bad}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None (depth-first, colouring)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": {"z"}, "z": {"y"}}) == ["y", "z", "y"]


def test_no_import_cycle():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))
