"""model.registry: config/config.ini maps --model_type display names to adapter classes (imported lazily);
version pins only warn. References: the shipped config.ini's literal entries and hand-written ini files."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest

from msmodelslim.errors import UserError
from msmodelslim.model.base import ModelAdapter
from msmodelslim.model.registry import load_registry, resolve_model_type


def test_shipped_registry_maps_both_display_names_to_kimi_k3():
    for name in ("Kimi-K3", "Kimi-Linear"):
        entry = resolve_model_type(name)
        assert entry.group == "kimi_k3"
        assert entry.entry_point == "msmodelslim.model.kimi_k3.adapter:KimiK3ModelAdapter"
        assert entry.dependencies == {"transformers": "==5.23.0", "compressed-tensors": "==0.20.0"}


def test_shipped_entry_point_is_a_model_adapter():
    cls = resolve_model_type("Kimi-K3").load_adapter_class()
    assert issubclass(cls, ModelAdapter) and cls.__name__ == "KimiK3ModelAdapter"


def test_unknown_model_type_lists_known_names():
    with pytest.raises(UserError) as info:
        resolve_model_type("Llama-3")
    assert "--model_type 'Llama-3' is not registered" in str(info.value)
    assert "known model types: Kimi-K3, Kimi-Linear" in str(info.value)


def test_model_type_is_case_sensitive_with_a_hint():
    with pytest.raises(UserError, match="case-sensitive: did you mean 'Kimi-K3'"):
        resolve_model_type("kimi-k3")


def _ini(tmp_path, body: str):
    path = tmp_path / "config.ini"
    path.write_text(textwrap.dedent(body))
    return path


def test_adapter_module_is_imported_only_on_demand(tmp_path, monkeypatch):
    pkg = tmp_path / "lazy_adapter_pkg.py"
    pkg.write_text(
        "from msmodelslim.model.base import ModelAdapter\n"
        "class Lazy(ModelAdapter):\n"
        "    units = load_unit = prepare_samples = forward_unit = checkpoint_name = checkpoint_state = None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _ini(tmp_path, """
        [ModelAdapter]
        lazy = Lazy-1
        [ModelAdapterEntryPoints]
        lazy = lazy_adapter_pkg:Lazy
        """)
    entry = load_registry(path).resolve("Lazy-1")
    assert "lazy_adapter_pkg" not in sys.modules
    assert entry.load_adapter_class().__name__ == "Lazy"
    assert "lazy_adapter_pkg" in sys.modules


def test_dependency_mismatch_logs_a_warning_not_an_error(tmp_path, caplog):
    path = _ini(tmp_path, """
        [ModelAdapter]
        m = M
        [ModelAdapterEntryPoints]
        m = x:Y
        [ModelAdapterDependencies]
        m = {"pyyaml": "==0.0.1", "surely-not-installed-pkg": ">=1"}
        """)
    with caplog.at_level(logging.WARNING, logger="msmodelslim.model.registry"):
        warnings = load_registry(path).resolve("M").check_dependencies()
    assert len(warnings) == 2
    assert any("pyyaml==0.0.1; installed" in w for w in warnings)
    assert any("surely-not-installed-pkg>=1, which is not installed" in w for w in warnings)
    assert len(caplog.records) == 2


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[ModelAdapter]\nm = M\n", "[ModelAdapterEntryPoints] m: expected 'module:Class'"),
        ("[ModelAdapter]\nm = M\n[ModelAdapterEntryPoints]\nm = a:B\n[ModelAdapterDependencies]\nm = {bad\n",
         "[ModelAdapterDependencies] m: invalid JSON"),
        ("[ModelAdapter]\nm = M\n[ModelAdapterEntryPoints]\nm = a:B\n[ModelAdapterDependencies]\nm = {\"t\": \"~~1\"}\n",
         "bad specifier '~~1' for t"),
        ("[Models]\nm = M\n", "unknown section [Models]"),
        ("[ModelAdapter]\nm = A\nn = A\n[ModelAdapterEntryPoints]\nm = a:B\nn = a:B\n",
         "model type 'A' listed under both m and n"),
    ],
)
def test_bad_ini_names_file_and_entry(tmp_path, body, message):
    path = _ini(tmp_path, body)
    with pytest.raises(UserError) as info:
        load_registry(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_missing_entry_point_module_and_class(tmp_path):
    path = _ini(tmp_path, "[ModelAdapter]\nm = M\nk = K\n[ModelAdapterEntryPoints]\nm = no_such_mod_xyz:A\n"
                          "k = msmodelslim.errors:Nope\n")
    registry = load_registry(path)
    with pytest.raises(UserError, match="module 'no_such_mod_xyz' not found"):
        registry.resolve("M").load_adapter_class()
    with pytest.raises(UserError, match="has no class 'Nope'"):
        registry.resolve("K").load_adapter_class()
