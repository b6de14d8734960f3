"""The import graph of the msmodelslim package and its floors (docs/dev/architecture.md): a module may import its
own floor or a lower one, never a higher one, and no chain of imports comes back to where it started.

Every import statement counts, wherever it stands (module level, inside a function, under TYPE_CHECKING): a lazy
import is still a dependency, and one under TYPE_CHECKING still ties the two floors together."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "msmodelslim"

# Lowest first. A module belongs to the floor of the longest prefix that names it.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("leaves", ("msmodelslim", "msmodelslim.errors", "msmodelslim.log")),
    ("core", ("msmodelslim.core",)),
    ("math, source and serving", ("msmodelslim.ops", "msmodelslim.quant", "msmodelslim.source", "msmodelslim.serving")),
    ("model", ("msmodelslim.model",)),
    ("processor", ("msmodelslim.processor",)),
    ("pipeline", ("msmodelslim.pipeline",)),
    ("app", ("msmodelslim.app", "msmodelslim.eval")),
    ("cli", ("msmodelslim.cli",)),
)


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the msmodelslim modules it imports (`from a.b import c` counts as a.b.c when that is a module)."""
    files = {module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in files)
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def floor_of(module: str) -> int:
    best, floor = -1, None
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), index
    if floor is None:
        raise KeyError(f"{module} is on no floor: add its package to FLOORS")
    return floor


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the imported module sits on a higher floor."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if floor_of(b) > floor_of(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each holds at least one import circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles between packages (msmodelslim.core.config and msmodelslim.core.dist are both `core`)."""
    def package(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2])

    packages: dict[str, set[str]] = {}
    for a, targets in graph.items():
        packages.setdefault(package(a), set()).update(package(b) for b in targets if package(b) != package(a))
    return cycles(packages)
