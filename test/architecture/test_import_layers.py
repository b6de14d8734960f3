"""The package's floors, read from its import statements (test/architecture/import_graph.py): leaves < core <
ops / quant / source / serving < model < processor < pipeline < app / eval < cli. No module imports a higher floor, and no
import circle exists, between modules or between packages. Exact: these are sets of names."""

from __future__ import annotations

import shutil

from architecture.import_graph import PACKAGE, cycles, imports, package_cycles, upward_imports


def test_no_module_imports_a_higher_floor():
    assert upward_imports(imports()) == []


def test_no_import_circle_between_modules_or_packages():
    graph = imports()
    assert cycles(graph) == []
    assert package_cycles(graph) == []


def test_a_planted_upward_import_is_found(tmp_path):
    """The checker is not blind: core/dist.py importing the app (a lazy import inside a function) is reported, and
    so is the package circle it closes (app imports core)."""
    copy = tmp_path / "msmodelslim"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    dist = copy / "core" / "dist.py"
    dist.write_text(dist.read_text() + "\n\ndef _planted():\n    from msmodelslim.app import quant  # noqa\n")
    graph = imports(copy)
    assert upward_imports(graph) == [("msmodelslim.core.dist", "msmodelslim.app"), ("msmodelslim.core.dist", "msmodelslim.app.quant")]
    assert any({"msmodelslim.app", "msmodelslim.core"} <= set(c) for c in package_cycles(graph))


def test_every_module_is_on_a_floor():
    from architecture.import_graph import floor_of

    for module in imports():
        floor_of(module)  # KeyError names a package missing from FLOORS
