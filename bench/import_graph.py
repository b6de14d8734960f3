"""The import graph of the package against its floors (test/architecture/import_graph.py): upward imports, module
and package circles. Pass another checkout's package folder to measure it (e.g. a worktree of an older commit).

    python bench/import_graph.py [PATH/msmodelslim]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, print_result  # noqa: E402

sys.path.insert(0, str(ROOT / "test"))
from architecture.import_graph import PACKAGE, cycles, imports, package_cycles, upward_imports  # noqa: E402


def main() -> None:
    package = Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE
    graph = imports(package)
    upward = upward_imports(graph)
    for importer, imported in upward:
        print(f"upward: {importer} -> {imported}")
    for circle in package_cycles(graph):
        print(f"package circle: {' <-> '.join(circle)}")
    print_result({"bench": "import_graph", "package": str(package), "modules": len(graph),
                  "imports": sum(len(t) for t in graph.values()), "upward_imports": len(upward),
                  "module_circles": len(cycles(graph)), "package_circles": len(package_cycles(graph))})


if __name__ == "__main__":
    main()
