"""The import graph of the tokentape package, checked: every import, the lazy ones inside
functions and those under `if TYPE_CHECKING` included (read with ast, nothing is imported).
Exit 1, naming each offending edge, when

- two modules import each other, directly or through others (a module cycle);
- two top-level parts import each other (a package cycle: `engine` <-> `kernels`);
- a module imports one from a higher layer, in this order from the bottom:
  version, errors (and progress, extras) -> events -> engine, kernels, lora -> replay ->
  postmortem -> chaos, integrations -> entrypoints, the CLI and the package's facade (`tokentape`);
- a module below the entrypoints imports a facade (`tokentape`, `tokentape.engine`'s package,
  `LLM`'s or `AsyncLLM`'s module), other than a facade itself.

    python tools/check_imports.py [PACKAGE_DIR]     # default: tokentape/ beside tools/
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

LAYERS: dict[str, int] = {
    "version": 0,
    "errors": 0,
    "progress": 0,
    "extras": 0,
    "events": 1,
    "engine": 2,
    "kernels": 2,
    "lora": 2,
    "replay": 3,
    "postmortem": 4,
    "chaos": 5,
    "integrations": 5,
    "entrypoints": 6,
    "cli": 6,
    "__main__": 6,
    "pytest_plugin": 6,
    "": 6,  # the package's own __init__: the facade
}
FACADES = {"tokentape", "tokentape.engine", "tokentape.engine.llm", "tokentape.engine.async_llm"}
ROOT = "tokentape"


def module_name(package_dir: Path, path: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(tree: ast.AST, name: str, is_package: bool) -> Iterator[tuple[str, list[str]]]:
    """(module, names) of every import statement, relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield target, [a.name for a in node.names]


def build_graph(package_dir: Path) -> dict[str, set[str]]:
    files = {module_name(package_dir, p): p for p in sorted(package_dir.rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for target, names in imports_of(tree, name, path.name == "__init__.py"):
            if target != ROOT and not target.startswith(ROOT + "."):
                continue
            # `from pkg import mod` imports the module; `from mod import name` the module.
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in files]
            for dep in subs or [target]:
                while dep not in files and "." in dep:
                    dep = dep.rsplit(".", 1)[0]
                if dep != name:
                    graph[name].add(dep)
    return graph


def part(module: str) -> str:
    """The top-level part of the package a module belongs to ('' for the package itself)."""
    return module.split(".")[1] if "." in module else ""


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def cycle_edges(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    members = set(component)
    return [f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in members]


def check(package_dir: Path) -> list[str]:
    graph = build_graph(package_dir)
    problems = []
    for component in cycles(graph):
        problems.append("module cycle: " + "; ".join(cycle_edges(graph, component)))
    parts: dict[str, set[str]] = {}
    for a, deps in graph.items():
        for b in deps:
            if part(a) != part(b) and part(a) and part(b):
                parts.setdefault(part(a), set()).add(part(b))
    for p in parts:
        parts[p] &= set(parts)
    for component in cycles({p: parts.get(p, set()) for p in parts}):
        edges = [
            f"{a} -> {b}"
            for a in sorted(graph)
            for b in sorted(graph[a])
            if part(a) in component and part(b) in component and part(a) != part(b)
        ]
        problems.append(f"package cycle {' <-> '.join(component)}: " + "; ".join(edges))
    for a in sorted(graph):
        for b in sorted(graph[a]):
            la, lb = LAYERS.get(part(a)), LAYERS.get(part(b))
            if la is None or lb is None:
                problems.append(f"no layer for {a if la is None else b} (add it to LAYERS)")
            elif lb > la:
                problems.append(f"upward import: {a} -> {b} ({part(a)} is below {part(b) or ROOT})")
            elif b in FACADES and a not in FACADES and la < LAYERS["entrypoints"]:
                problems.append(f"facade import: {a} -> {b} (only the front ends import a facade)")
    return sorted(set(problems))


def main(argv: list[str]) -> int:
    here = Path(__file__).resolve().parent.parent
    package_dir = Path(argv[0]) if argv else here / ROOT
    problems = check(package_dir)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} import problem(s) in {package_dir}")
        return 1
    print(f"imports of {package_dir}: no cycle, no upward import")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
