"""The shape of the code, checked over its import graph.

Every module of ``jobs/``, ``bot/`` and ``runner/`` is parsed (never imported) and every
import statement in it collected, those inside functions included: a function-local
import is where a cycle hides, since it does not fail at start. Type-only imports (under
``if TYPE_CHECKING:``) are left out of the cycle check, because they never run, but not
out of the layering check: ``runner/`` is installed alone on an instance and must not
even name the control plane's types.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jobs", "bot", "runner")
MAX_LINES = 600

#: Who may import whom (DESIGN.md, Processes): the runner is installed alone on every
#: instance, and the control plane does not know its chat front ends.
FORBIDDEN = {"runner": ("jobs", "bot"), "jobs": ("bot",)}


@dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to a project module."""

    target: str
    line: int
    #: Under ``if TYPE_CHECKING:``: never executed.
    typing_only: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Every module of the checked packages, by dotted name."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST) -> Iterable[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement anywhere in ``tree``, with whether it is type-only."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, typing_only = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, typing_only
        for field, value in ast.iter_fields(node):
            children = value if isinstance(value, list) else [value]
            for child in children:
                if not isinstance(child, ast.AST):
                    continue
                guarded = (
                    isinstance(node, ast.If) and field == "body" and _is_type_checking(node.test)
                )
                stack.append((child, typing_only or guarded))


def imports_of(name: str, path: Path, modules: Mapping[str, Path]) -> list[Import]:
    """The project modules ``name`` imports: ``from a.b import c`` is ``a.b.c`` where that
    is a module, else ``a.b``; relative imports are resolved against ``name``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    for node, typing_only in _statements(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                child = f"{base}.{alias.name}"
                targets.append(child if child in modules else base)
        for target in targets:
            # ``import a.b.c`` of something that is not a module of ours: its nearest module.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append(Import(target, node.lineno, typing_only))
    return found


def import_graph(*, runtime_only: bool) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: the line of the first such import}."""
    modules = project_modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for imp in imports_of(name, path, modules):
            if runtime_only and imp.typing_only:
                continue
            edges.setdefault(imp.target, imp.line)
        graph[name] = edges
    return graph


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's
    algorithm, iteratively), each as a path that returns to its first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop(0)
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return [_cycle_in(graph, set(c)) for c in components]


def _cycle_in(graph: Mapping[str, Iterable[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside it."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ())):
                if nxt not in component:
                    continue
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start} in its own component")  # unreachable


def describe(cycle: list[str], graph: Mapping[str, Mapping[str, int]]) -> str:
    hops = [f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)]
    return " -> ".join([*hops, cycle[-1]])


# --- the checks ----------------------------------------------------------------------


def test_no_import_cycle_in_our_packages() -> None:
    """Over jobs/, bot/ and runner/ together: a cycle anywhere fails, the one inside a
    package (runner.dryrun and runner.dryrun_sync once imported each other) as the one
    across packages."""
    graph = import_graph(runtime_only=True)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(describe(c, graph) for c in cycles)


def test_no_module_is_over_600_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): count
        for path in project_modules().values()
        if (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them along a seam): {long}"


def test_the_control_plane_has_no_loose_modules() -> None:
    """jobs/ is packages that say what they are (domain, database, usecases, background,
    outbound, web, process, and the features); a new module goes into one of them."""
    loose = sorted(p.name for p in (ROOT / "jobs").glob("*.py") if p.name != "__init__.py")
    assert not loose, (
        f"modules at jobs/' top level (put each in the package it belongs to): {loose}"
    )
    for package in sorted(p for p in (ROOT / "jobs").iterdir() if p.is_dir()):
        if any(package.glob("*.py")):
            assert (package / "__init__.py").read_text(encoding="utf-8").startswith('"""'), (
                f"{package.name}/__init__.py says in a docstring what the package is"
            )


def test_the_layers_import_only_downwards() -> None:
    graph = import_graph(runtime_only=False)
    wrong = [
        f"{name} imports {target} (line {line})"
        for name, edges in sorted(graph.items())
        for target, line in sorted(edges.items())
        if target.split(".")[0] in FORBIDDEN.get(name.split(".")[0], ())
    ]
    assert not wrong, "\n".join(wrong)


def test_the_rules_reach_no_table() -> None:
    """Alert rules are pure functions of events and ``now``: nothing they import, however
    indirectly, defines or opens the database (their Severity is jobs.domain.severity)."""
    graph = import_graph(runtime_only=True)
    seen: set[str] = set()
    stack = [name for name in graph if name.split(".")[:2] == ["jobs", "rules"]]
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(graph.get(name, {}))
    assert not seen & {
        "jobs.database.models",
        "jobs.database.replica_tables",
        "jobs.database.db",
    }, sorted(seen)


# --- the checker itself --------------------------------------------------------------


def test_the_cycle_finder_finds_a_cycle_and_its_path() -> None:
    graph = {
        "a": ["b"],
        "b": ["c", "d"],
        "c": ["a"],  # a -> b -> c -> a
        "d": ["e"],
        "e": ["d"],  # d <-> e
        "f": ["a"],  # reaches the cycle without being on it
    }
    assert find_cycles(graph) == [["d", "e", "d"], ["a", "b", "c", "a"]]
    assert find_cycles({"a": ["b"], "b": ["c"], "c": []}) == []


def test_imports_inside_functions_count_and_type_only_ones_do_not(tmp_path: Path) -> None:
    """The parser sees what the real check relies on: a function-local import is an edge,
    one under TYPE_CHECKING is marked, and relative imports resolve to the module."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.c import Thing\n"
        "def later():\n"
        "    from .d import helper\n"
        "    import pkg.e.f\n"
    )
    (package / "a.py").write_text(source)
    modules = {f"pkg.{m}": package / f"{m}.py" for m in ("a", "b", "c", "d", "e")}
    modules["pkg"] = package / "__init__.py"
    found = imports_of("pkg.a", package / "a.py", modules)
    assert [(i.target, i.typing_only) for i in sorted(found, key=lambda i: i.line)] == [
        ("pkg.b", False),
        ("pkg.c", True),
        ("pkg.d", False),
        ("pkg.e", False),
    ]
