"""No import cycle in the package: a walk over every module's import statements (those inside functions too, which
run on first use and close a cycle as surely), each resolved to the module it loads."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ds_megatron"


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports.  ``from a.b import c`` loads ``a.b.c`` where that is a module, else
    ``a.b``; a relative import is resolved against the importing module's package.  A parent package that Python
    initialises on the way to a submodule is not an edge: it runs first and cannot wait on its child."""
    modules = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for a in node.names:
                    edges.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as the list of its modules (first repeated last), or None; depth-first search with three colours."""
    state: dict[str, int] = {}  # absent: unvisited, 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_finder_finds_a_cycle_and_a_lazy_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_resolves_submodules_relative_and_function_level_imports(tmp_path):
    pkg = tmp_path / "ds_megatron"
    (pkg / "tune").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tune" / "__init__.py").write_text("from ds_megatron.tune.spec import X\n")
    (pkg / "tune" / "spec.py").write_text("X = 1\n")
    (pkg / "tune" / "cli.py").write_text("from . import spec\n\ndef main():\n    from ds_megatron.tune import tool\n")
    (pkg / "tune" / "tool.py").write_text("from ds_megatron.tune.cli import main\n")
    graph = import_graph(pkg)
    assert graph["ds_megatron.tune"] == {"ds_megatron.tune.spec"}
    assert graph["ds_megatron.tune.cli"] == {"ds_megatron.tune.spec", "ds_megatron.tune.tool"}
    assert find_cycle(graph) == ["ds_megatron.tune.cli", "ds_megatron.tune.tool", "ds_megatron.tune.cli"]


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 100 and "ds_megatron.tune.core.cli" in graph["ds_megatron.tune.__main__"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
