"""The package's import graph: no cycles, and the backend never leans on the standalone trainer.

Imports are read from the source (``ast``), at module level and inside functions alike, so a
lazy import that only hides a cycle still counts. Imports under ``if TYPE_CHECKING:`` are left
out: they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "rllm_skyrl"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports; ``from pkg import sub`` (a submodule) imports ``sub`` only."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules
            found.update(submodules)
            if len(submodules) < len(node.names):
                found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {module for module in found if module in modules and module != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(path) for path in paths}
    return {_module_name(path): _imports(path, modules) for path in paths}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            connect(node)
    return found


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_the_graph_sees_known_imports():
    """Guards the reader itself: a reader that found nothing would pass every test below."""
    graph = import_graph()
    assert "rllm_skyrl.runtime" in graph["rllm_skyrl.backend"]
    assert "rllm_skyrl.run_config" in graph["rllm_skyrl.backend"]
    assert "rllm_skyrl.standalone.driver" in graph["rllm_skyrl.standalone"]


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    cycles = _cycles(import_graph())
    assert not cycles, f"modules that import each other: {cycles}"


@pytest.mark.parametrize("module", ["rllm_skyrl.backend", "rllm_skyrl.rollout.engine", "rllm_skyrl.runtime"])
def test_backend_code_does_not_use_the_standalone_trainer(module):
    reached = _closure(import_graph(), module)
    standalone = sorted(m for m in reached if m.startswith("rllm_skyrl.standalone"))
    assert not standalone, f"{module} reaches {standalone}"


def test_no_test_module_imports_another():
    """Shared test code lives in ``helpers.py`` and the harness modules: a test file can be run,
    moved or deleted on its own."""
    offenders = []
    for path in sorted((ROOT.parent / "test").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            offenders += [f"{path.name} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not offenders, offenders


def _unit(module: str) -> str:
    """The folder a module lives in (``rllm_skyrl.rollout``), or the module itself at the top."""
    parts = module.split(".")
    return ".".join(parts[:2])


def folder_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        unit = _unit(module)
        graph.setdefault(unit, set()).update(_unit(t) for t in targets if _unit(t) != unit)
    return graph


def test_folders_are_layers():
    """Folders and top-level modules import each other one way only: a folder never reaches back
    up into code that uses it, so each can be read, tested and moved as a unit."""
    cycles = _cycles(folder_graph())
    assert not cycles, f"folders that import each other: {cycles}"
