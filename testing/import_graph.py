"""The import graph of the repository's Python packages, read from the source by ``ast``
(nothing is imported), and its cycles.

A module is named as it is imported: ``package_dirs`` maps a dotted package name to its
folder (``{"tengrad_fx": "tengrad_fx", "tengrad_fx.zoo": "zoo"}``: the folder ``zoo/``
is imported as ``tengrad_fx.zoo``). An edge ``a → b`` is any ``import`` / ``from … import``
statement of ``a`` — module level, under ``if TYPE_CHECKING:``, or inside a function (a
function-local import only defers a cycle) — that names module ``b`` of the graph, after
resolving relative imports; ``from p import name`` points at ``p.name`` where that is a
module, else at ``p``. Parent packages are not edges: importing ``a.b.c`` runs ``a``'s
``__init__`` first, but that order is Python's, not a dependency of the importer.
"""
from __future__ import annotations

import ast
import os
from typing import Iterator

__all__ = ["module_files", "import_graph", "cycles", "imported_names"]


def module_files(root: str, package_dirs: dict[str, str]) -> dict[str, str]:
    """``{dotted module name: file}`` of every ``.py`` under the folders of ``package_dirs``
    (relative to ``root``); a folder mapped to another name is left out of its parent's."""
    mapped = {os.path.normpath(os.path.join(root, d)) for d in package_dirs.values()}
    out: dict[str, str] = {}
    for name, folder in package_dirs.items():
        top = os.path.normpath(os.path.join(root, folder))
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__"
                                 and os.path.join(dirpath, d) not in mapped)
            rel = os.path.relpath(dirpath, top)
            pkg = name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}"
            for f in sorted(filenames):
                if f.endswith(".py"):
                    out[pkg if f == "__init__.py" else f"{pkg}.{f[:-3]}"] = os.path.join(dirpath, f)
    return out


def _imports(path: str) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of the file, at any depth."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _package(module: str, path: str) -> str:
    return module if path.endswith("__init__.py") else module.rpartition(".")[0]


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def imported_names(module: str, path: str) -> set[str]:
    """The absolute names the file of ``module`` imports from: ``a.b`` of ``import a.b``
    and of ``from a.b import c`` (relative ones resolved)."""
    package = _package(module, path)
    out: set[str] = set()
    for node in _imports(path):
        if isinstance(node, ast.ImportFrom):
            out.add(_absolute(node, package))
        else:
            out.update(a.name for a in node.names)
    return out


def _deepest(name: str, modules: dict[str, str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """``{module: the modules of ``modules`` it imports}`` (module docstring)."""
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        package = _package(mod, path)
        targets: set[str | None] = set()
        for node in _imports(path):
            if isinstance(node, ast.Import):
                targets.update(_deepest(a.name, modules) for a in node.names)
                continue
            base = _absolute(node, package)
            for a in node.names:
                full = f"{base}.{a.name}"
                targets.add(full if full in modules else _deepest(base, modules))
        graph[mod] = {t for t in targets if t is not None and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[a, b, …, a]`` per strongly connected component of more than one module
    (Tarjan's algorithm, iterative), each the shortest from the component's first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return [_shortest_cycle(graph, set(c), c[0]) for c in comps]


def _shortest_cycle(graph: dict[str, set[str]], comp: set[str], start: str) -> list[str]:
    """Breadth-first from ``start`` inside ``comp`` back to ``start``."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]
