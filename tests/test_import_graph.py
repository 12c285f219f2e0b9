"""The package's import graph: no cycles inside `verl_patches`, and production code never imports
`verl_patches.testing` (the test-only helpers depend on production code, not the other way round).

The graph is read from the source with `ast`, so it sees imports inside functions too (a lazy
import that only hides a cycle is still a cycle). Imports under `if TYPE_CHECKING:` are not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

PACKAGE = "verl_patches"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Dotted names this module imports (``from a import b`` yields a.b and a)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    prefix = ".".join(base + ([child.module] if child.module else []))
                else:
                    prefix = child.module or ""
                out.add(prefix)
                out.update(f"{prefix}.{a.name}" for a in child.names)
            visit(child)

    visit(tree)
    return out


def import_graph(root: Path = REPO, package: str = PACKAGE) -> dict[str, set[str]]:
    """module -> modules of ``package`` it imports. An import of a.b.c is an edge to the deepest
    name that is a module (a symbol imported from a module is an edge to that module)."""
    files = {_module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        names = _imports(ast.parse(path.read_text(), str(path)), mod, path.name == "__init__.py")
        edges = set()
        for name in names:
            parts = name.split(".")
            while parts and ".".join(parts) not in files:
                parts.pop()
            target = ".".join(parts)
            if parts and target != mod and target != package:
                edges.add(target)
        graph[mod] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), each as a
    closed path through that component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    cycles = []
    for comp in comps:
        members, start = set(comp), comp[0]
        # Walk from start inside the component until it returns: a concrete cycle to name.
        path, seen, v = [start], {start}, start
        while True:
            nxt = sorted(w for w in graph[v] if w in members)
            back = [w for w in nxt if w == start]
            if back and len(path) > 1 or not [w for w in nxt if w not in seen]:
                path.append(start if back else nxt[0])
                break
            v = [w for w in nxt if w not in seen][0]
            seen.add(v)
            path.append(v)
        cycles.append(path)
    return cycles


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    cycles = find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert len(cycles) == 1 and cycles[0][0] == cycles[0][-1] and set(cycles[0]) == {"a", "b", "c"}


def test_the_graph_sees_function_level_and_relative_imports_and_skips_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from ..a import f\nfrom typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from pkg.sub import c\n")
    (pkg / "sub" / "c.py").write_text("import pkg.a\n")
    g = import_graph(tmp_path, "pkg")
    assert g["pkg.a"] == {"pkg.sub", "pkg.sub.b"} and g["pkg.sub.b"] == {"pkg.a"} and g["pkg.sub.c"] == {"pkg.a"}
    assert find_cycles(g) and set(find_cycles(g)[0]) == {"pkg.a", "pkg.sub.b"}


def test_no_import_cycle_inside_the_package():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles in verl_patches (move what both sides need into a leaf module):\n" + \
        "\n".join(" -> ".join(c) for c in cycles)


def test_production_modules_do_not_import_the_testing_helpers():
    bad = sorted(f"{mod} imports {t}" for mod, edges in import_graph().items()
                 if not mod.startswith(f"{PACKAGE}.testing") for t in edges if t.startswith(f"{PACKAGE}.testing"))
    assert not bad, "production code imports verl_patches.testing (move the helper out of testing/):\n" + "\n".join(bad)
