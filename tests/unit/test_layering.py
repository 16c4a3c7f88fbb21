"""The package layering of docs/design.md §1, read from the sources' import statements.

- runtime/'s subpackages import one another without cycles (module-level, function-level and
  type-checking imports all count: a cycle anywhere makes the two packages one in practice);
- grammars/ never imports the runtime, and lang/ imports neither the runtime nor the grammars at
  module level (its backends load the runtime lazily);
- the code cites no file outside the repository.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"phloem": "phloem", "lang": "phloem.lang", "runtime": "phloem.runtime", "grammars": "phloem.grammars"}


def _sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _imports(path: Path, *, module_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def runtime_subpackage_graph() -> dict[str, set[str]]:
    """``{subpackage: subpackages it imports}`` for the folders under runtime/."""
    graph: dict[str, set[str]] = {}
    for path in _sources("runtime"):
        rel = path.relative_to(ROOT / "runtime").parts
        if len(rel) < 2:
            continue  # runtime/*.py modules are shared by all subpackages
        deps = graph.setdefault(rel[0], set())
        for module in _imports(path):
            parts = module.split(".")
            if parts[:2] == ["phloem", "runtime"] and len(parts) > 2 and parts[2] != rel[0]:
                if (ROOT / "runtime" / parts[2]).is_dir():
                    deps.add(parts[2])
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_finds_and_clears() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_runtime_subpackages_have_no_cycle() -> None:
    graph = runtime_subpackage_graph()
    assert {"scheduler", "executor", "attention", "cache"} <= set(graph)
    assert find_cycle(graph) is None, f"import cycle between runtime subpackages: {find_cycle(graph)}"


@pytest.mark.parametrize("folder", ["grammars", "lang"])
def test_lower_layers_do_not_import_the_runtime(folder: str) -> None:
    module_level_only = folder == "lang"
    offenders = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in _sources(folder)
        for module in _imports(path, module_level_only=module_level_only)
        if module.startswith("phloem.runtime") or (folder == "lang" and module.startswith("phloem.grammars"))
    ]
    assert offenders == []


def test_no_citation_of_files_outside_the_repository() -> None:
    pattern = re.compile(r"(?<![\w/])(DESIGN|STYLE)\.md")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in [*FOLDERS, "benchmarks", "training", "tests"]
        for path in _sources(folder)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and path.name != "test_layering.py"
    ]
    assert offenders == []
