"""Print the strongly connected components of espalier's module import graph.

``python scripts/import_cycles.py [--top-level] [--json] [--root DIR]``

Nodes are the modules of the product packages (``constrained``, ``kernels``, ``engine``,
``server``; the repository root is the ``espalier`` package); an edge ``a -> b`` is an import of
``b`` anywhere in ``a`` (function-level and ``TYPE_CHECKING`` imports included: a cycle hidden
by a lazy import is still a cycle; ``--top-level`` counts only imports run at import time).
Importing ``pkg.mod`` also imports ``pkg/__init__.py``, so that edge is added too.

Prints each component of more than one module (largest first) with its concepts (a module's
concept is its first folder below the package, ``constrained/tree``, ``engine/model``, or the
module itself where it sits directly in a package, ``engine/closing``), then one summary line:
components, modules in them, and components that span more than one concept. ``--json``
prints JSON lines instead.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("constrained", "kernels", "engine", "server")
PREFIX = "espalier"


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file of the product packages under ``root``."""
    files: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([PREFIX, *parts])] = path
    return files


def _deferred(node: ast.AST) -> bool:
    """Whether ``node``'s imports do not run at import: a function body or a TYPE_CHECKING
    block."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return True
    return isinstance(node, ast.If) and _type_checking(node)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_names(path: Path, package: str, top_level: bool) -> set[str]:
    """Dotted names ``path`` imports (``from a import b`` gives ``a`` and ``a.b``)."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()

    def visit(node: ast.AST, runs_at_import: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _deferred(child):
                visit(child, False)
            else:
                if runs_at_import or not top_level:
                    _collect(child, package, names)
                visit(child, runs_at_import)

    visit(tree, True)
    return names


def _collect(node: ast.AST, package: str, names: set[str]) -> None:
    if isinstance(node, ast.Import):
        names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            stem = ".".join([*base, node.module] if node.module else base)
        else:
            stem = node.module or ""
        names.add(stem)
        names.update(f"{stem}.{alias.name}" for alias in node.names)


def graph(files: dict[str, Path], top_level: bool) -> dict[str, set[str]]:
    """Module -> the product modules it imports."""
    edges: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for name in imported_names(path, package, top_level):
            parts = name.split(".")
            for end in range(2, len(parts) + 1):  # pkg/__init__.py of every level runs too
                candidate = ".".join(parts[:end])
                if candidate in files:
                    targets.add(candidate)
        targets.discard(module)
        edges[module] = targets
    return edges


def components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                found.append(sorted(members))
    return found


def concept(module: str, files: dict[str, Path], root: Path) -> str:
    """A module's concept: its first folder below the package (``constrained/tree``,
    ``engine/model``, sub-folders included), or, for a module directly in a package, the module
    itself (``engine/closing``); a package's own ``__init__`` is its package."""
    parts = files[module].relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return "/".join(parts[:2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--top-level", action="store_true", help="imports run at import only")
    parser.add_argument("--json", action="store_true", help="JSON lines")
    parser.add_argument("--root", type=Path, default=ROOT, help="a checkout (default: this one)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    files = module_files(root)
    cycles = [c for c in components(graph(files, args.top_level)) if len(c) > 1]
    cycles.sort(key=lambda c: (-len(c), c))
    cross = 0
    for members in cycles:
        concepts = sorted({concept(m, files, root) for m in members})
        cross += len(concepts) > 1
        short = [m.removeprefix(PREFIX + ".") for m in members]
        if args.json:
            print(json.dumps({"size": len(members), "concepts": concepts, "modules": short}))
        else:
            print(f"{len(members)} modules, concepts {', '.join(concepts)}:")
            print("    " + " ".join(short))
    summary = {
        "modules": len(files),
        "components": len(cycles),
        "modules_in_cycles": sum(len(c) for c in cycles),
        "cross_concept_components": cross,
        "imports": "top-level" if args.top_level else "all",
    }
    print(json.dumps(summary) if args.json else f"summary: {json.dumps(summary)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
