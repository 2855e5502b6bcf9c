"""No import circles in ``vime``: the module graph, read from the source, is acyclic.

Proves: no module of ``vime`` imports, through any chain of others, itself. The graph
is built statically (``ast``), without importing anything, from every ``import`` and
``from ... import`` statement of every module, wherever it stands: at module level,
inside a function or method, under ``if TYPE_CHECKING:``. Deferred imports count: one
that only breaks a circle at run time (the import runs once the other module has
loaded) leaves the circle in the design, and an import moved back to the top would
close it again.

An edge goes from the importing module to the module named (``from a.b import c`` names
``a.b.c`` where that is a module, else ``a.b``) and to every package above it, whose
``__init__.py`` Python runs first (``import vime.config.x`` runs ``vime/config/__init__.py``,
and whatever that imports), except the packages the importing module itself lies in,
which are already being imported when it runs. A failure names each circle as the chain
of imports that closes it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "vime"


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Dotted names every import statement in ``tree`` names, anywhere in the file; for
    ``from m import x`` both ``m.x`` (maybe a module) and ``m``."""
    here = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package, up level - 1
                anchor = here
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """``module -> the modules of ``modules`` that importing it imports directly``."""

    def known(name: str) -> str | None:  # the longest prefix of ``name`` that is a module
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for name in _imported_names(tree, module, path.name == "__init__.py"):
            target = known(name)
            while target:
                if not (module == target or module.startswith(f"{target}.")):
                    graph[module].add(target)
                target = known(target.rpartition(".")[0])
    return graph


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One circle (``[a, b, ..., a]``) through each group of modules that import each
    other (``import_groups``), in name order."""
    return sorted(_shortest_circle(graph, group) for group in import_groups(graph))


def import_groups(graph: Mapping[str, set[str]]) -> list[set[str]]:
    """The groups of modules that import each other, through any chain (the strongly
    connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def _shortest_circle(graph: Mapping[str, set[str]], group: set[str]) -> list[str]:
    """The shortest circle through the first module of ``group`` (breadth first)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no circle through {start} in its own component")


def test_vime_has_no_import_circles() -> None:
    graph = import_graph(module_files())
    assert "vime.trainer" in graph  # the package was found where it should be
    found = []
    for group in import_groups(graph):
        line = " -> ".join(_shortest_circle(graph, group))
        if len(group) > 2:
            line += f" (of {len(group)} modules that import each other: {', '.join(sorted(group))})"
        found.append(line)
    assert not found, "import circles in vime:\n" + "\n".join(sorted(found))


def test_the_graph_sees_deferred_imports_and_the_packages_above() -> None:
    """What the check rests on: an import inside a function is an edge, and so is the
    package whose ``__init__`` an import runs, but not the importer's own package."""
    graph = import_graph(module_files())
    assert "vime.ray.errors" in graph["vime.rollout.agent"]  # inside AgentLoop.generate_on
    assert "vime.config" in graph["vime.trainer"]  # vime.config.parser: its __init__ runs
    assert "vime.config.parser" in graph["vime.config"]
    assert "vime.config" not in graph["vime.config.parser"]  # its own package


def test_a_circle_is_named_as_its_chain(tmp_path: Path) -> None:
    """A deferred import that closes a circle, and a circle through a package's
    ``__init__``, are each found and named in import order."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "def later():\n    from . import c\n",
        "c.py": "import pkg.a as a\n",
        "sub/__init__.py": "from pkg.sub.x import X\n",
        "sub/x.py": "from pkg import d\nX = 1\n",
        "d.py": "from pkg.sub.y import Y\n",
        "sub/y.py": "Y = 2\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    found = circles(import_graph(module_files(tmp_path, "pkg")))
    assert found == [
        ["pkg.a", "pkg.b", "pkg.c", "pkg.a"],
        ["pkg.d", "pkg.sub", "pkg.sub.x", "pkg.d"],
    ]
