"""`--model_type` -> adapter class, from config/config.ini (the adapter module is imported lazily)."""

from __future__ import annotations

import configparser
import importlib
import importlib.metadata
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from msmodelslim.errors import UserError

logger = logging.getLogger(__name__)

SECTIONS = ("ModelAdapter", "ModelAdapterEntryPoints", "ModelAdapterDependencies")


@dataclass(frozen=True)
class ModelEntry:
    """One model group of config.ini (a group is also the lab_practice/<group>/ folder name)."""

    group: str
    display_names: tuple[str, ...]
    entry_point: str  # "package.module:ClassName"
    dependencies: dict[str, str]  # package -> version specifier
    source: Path  # the config.ini it came from

    def load_adapter_class(self) -> type:
        """Import the entry point and return the adapter class (a `ModelAdapter` subclass)."""
        from msmodelslim.model.base import ModelAdapter

        module_name, _, class_name = self.entry_point.partition(":")
        where = f"{self.source} [ModelAdapterEntryPoints] {self.group}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                raise UserError(f"{where}: module {module_name!r} not found") from None
            raise
        cls = getattr(module, class_name, None)
        if cls is None:
            raise UserError(f"{where}: module {module_name!r} has no class {class_name!r}")
        if not (isinstance(cls, type) and issubclass(cls, ModelAdapter)):
            raise UserError(f"{where}: {self.entry_point} is not a ModelAdapter subclass")
        return cls

    def check_dependencies(self) -> list[str]:
        """Compare installed versions with the pins; log (and return) one warning per mismatch."""
        warnings = []
        for package, spec in sorted(self.dependencies.items()):
            try:
                installed = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                installed = None
            if installed is None:
                warnings.append(f"{self.group} is verified with {package}{spec}, which is not installed")
            elif installed not in SpecifierSet(spec):
                warnings.append(f"{self.group} is verified with {package}{spec}; installed {installed}")
        for message in warnings:
            logger.warning(message)
        return warnings


@dataclass(frozen=True)
class ModelRegistry:
    entries: tuple[ModelEntry, ...]
    source: Path

    @property
    def display_names(self) -> list[str]:
        return [name for entry in self.entries for name in entry.display_names]

    def resolve(self, model_type: str) -> ModelEntry:
        """The entry whose display names contain `model_type` (exact, case-sensitive)."""
        for entry in self.entries:
            if model_type in entry.display_names:
                return entry
        hint = ""
        folded = [n for n in self.display_names if n.lower() == model_type.lower()]
        if folded:
            hint = f" (model types are case-sensitive: did you mean {folded[0]!r}?)"
        raise UserError(
            f"--model_type {model_type!r} is not registered in {self.source}; "
            f"known model types: {', '.join(self.display_names)}{hint}"
        )


def default_config_path() -> Path:
    from msmodelslim.core.resources import resource_path

    return resource_path("config") / "config.ini"


def load_registry(path: str | Path | None = None) -> ModelRegistry:
    """Parse config.ini; each group needs a display-name line and an entry point (dependencies are optional)."""
    path = Path(path) if path is not None else default_config_path()
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # keep the case of group names
    try:
        with path.open(encoding="utf-8") as handle:
            parser.read_file(handle)
    except FileNotFoundError:
        raise UserError(f"model registry not found: {path}") from None
    except configparser.Error as exc:
        raise UserError(f"{path}: invalid ini file: {exc}") from None
    for section in parser.sections():
        if section not in SECTIONS:
            raise UserError(f"{path}: unknown section [{section}]; expected {', '.join(SECTIONS)}")
    if not parser.has_section("ModelAdapter"):
        raise UserError(f"{path}: missing section [ModelAdapter]")
    entries = []
    seen: dict[str, str] = {}
    for group, names_text in parser.items("ModelAdapter"):
        names = tuple(n.strip() for n in names_text.split(",") if n.strip())
        if not names:
            raise UserError(f"{path}: [ModelAdapter] {group}: no display names")
        for name in names:
            if name in seen:
                raise UserError(f"{path}: model type {name!r} listed under both {seen[name]} and {group}")
            seen[name] = group
        entry_point = parser.get("ModelAdapterEntryPoints", group, fallback="").strip()
        if ":" not in entry_point:
            raise UserError(f"{path}: [ModelAdapterEntryPoints] {group}: expected 'module:Class', got {entry_point!r}")
        deps_text = parser.get("ModelAdapterDependencies", group, fallback="{}")
        try:
            deps = json.loads(deps_text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: [ModelAdapterDependencies] {group}: invalid JSON ({exc})") from None
        if not isinstance(deps, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in deps.items()):
            raise UserError(f"{path}: [ModelAdapterDependencies] {group}: expected a JSON map of package -> specifier")
        for package, spec in deps.items():
            try:
                SpecifierSet(spec)
            except InvalidSpecifier:
                raise UserError(f"{path}: [ModelAdapterDependencies] {group}: bad specifier {spec!r} for {package}") from None
        entries.append(ModelEntry(group, names, entry_point, deps, path))
    return ModelRegistry(tuple(entries), path)


def resolve_model_type(model_type: str, config_path: str | Path | None = None) -> ModelEntry:
    return load_registry(config_path).resolve(model_type)
