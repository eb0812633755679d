"""The import graph of a Python package, read with ast (nothing is imported or run): which of
its modules import which. Every import counts, at module level or inside a function (a lazy
import still ties two modules together) and under TYPE_CHECKING. Shared by the layout tests."""
from __future__ import annotations

import ast
from pathlib import Path


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the package at ``root`` (a folder with __init__.py)."""
    root = Path(root)
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` inside ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imported_names(module: str, path: Path, modules: set[str]) -> set[str]:
    """Every absolute module name ``module`` imports. ``from x import y`` names x.y when that is
    one of ``modules`` (a submodule), else x (y is a name defined in x)."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            for a in node.names:
                sub = f"{base}.{a.name}"
                names.add(sub if sub in modules else base)
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's own modules it imports (edges to anything outside are dropped)."""
    files = module_files(root)
    known = set(files)
    return {m: {n for n in imported_names(m, f, known) if n in files and n != m} for m, f in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted:
    every such component is a set of modules that import each other in a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def describe(graph: dict[str, set[str]], comp: list[str]) -> str:
    """One circle with the arrows that close it, for an assertion message."""
    arrows = [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]
    return "circle: " + "; ".join(arrows)
