"""The practice YAML schema: parsed strictly, so a typo is an error naming the file and key, never a silent default.

```yaml
apiversion: multimodal_vlm_modelslim_v1        # or modelslim_v1 (text service)
metadata: {config_id, score, verified_model_types: [...], label: {w_bit, a_bit, is_sparse, kv_cache}}
spec:
  runner: auto                                 # auto | layer_wise | dp_layer_wise
  process: [{type: <processor>, <fields of its config dataclass>}, ...]
  dataset: calibImages                         # lab_calib short name, or a path (jsonl file / dir with index.jsonl)
  default_text: "Describe this image."         # text of image-only samples (required for the multimodal service)
  max_samples: 16                              # optional
  max_seq_len: 512                             # optional; tokens per record (default 4096, null: no cap)
  micro_batch_tokens: 8192                     # optional; records of one length share a forward up to this
  report_tokens: 65536                         # optional; the quant report observes this many tokens (null: all)
  report_impact_tokens: 8192                   # optional; the report's loss-aware `impact` on this many (null: none)
  resume_every: 1                              # optional; the resumable state is kept after every this many units
  save: [{type: ascendv1_saver, part_file_size: 4}]
```
`spec.process` / `spec.save` become lists of `PracticeStep(type, config, cls)`. Processor and saver entries are built
generically from the config dataclass registered under their `type` in the registries `load_practice` is given (the
application's: `processor.catalog.registries()`): keys are checked against `dataclasses.fields`; a `StrictConfig`
then converts and checks its values against the field type hints (nested dataclasses, lists, tuples, dicts,
Literal, Optional) and runs `.validate()`, the same way when it is built in code.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from msmodelslim.core.files import read_small_text
from msmodelslim.core.report import ReportMetric, ranked, read_report
from msmodelslim.errors import UserError, shown

# A record's tokens beyond this are cut unless the practice sets spec.max_seq_len (a 1 MB record is 600k tokens:
# no layer-wise run finishes on that, and calibration needs far fewer).
DEFAULT_MAX_SEQ_LEN = 4096
DEFAULT_MICRO_BATCH_TOKENS = 8192  # a forward of 8k tokens: ~2 GiB of a full-size layer's activations
# The quant report's statistics come from the first 64k calibration tokens: ~1,200 per routed expert of Kimi-K3
# (top-16 of 896), enough to rank linears by their error, and past them a calibration token costs no report work.
DEFAULT_REPORT_TOKENS = 65536
# The report's `impact` (pipeline/impact.py) forwards each unit once per serving group on this many tokens when
# analyze or tune asks for it: a few forwards of a capped sample, against a calibration pass's million tokens.
DEFAULT_IMPACT_TOKENS = 8192
ApiVersion = Literal["modelslim_v1", "multimodal_vlm_modelslim_v1"]  # the text and the multimodal service
MULTIMODAL_APIVERSION = "multimodal_vlm_modelslim_v1"


class PracticeError(UserError):
    """A practice YAML that does not match the schema."""


class SchemaError(ValueError):
    """A value that does not fit the schema, with its key path (relative to the config being built; each enclosing
    builder adds its own part, the loader the file name)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.message = message


# --- YAML reading --------------------------------------------------------------------------------------------
class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML would keep the last one silently) and aliases: a few bytes of
    `*ref` can expand to billions of nodes, and a practice gains nothing from them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"alias *{event.anchor} (aliases are not allowed in a "
                                              "practice: write the value out)", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(path: Path, what: str) -> Any:
    """The YAML document of `path` (`what`: the kind of file, for the errors)."""
    try:
        text = read_small_text(path, what)
    except UserError as exc:
        raise PracticeError(str(exc)) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise PracticeError(f"{where}: invalid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise PracticeError(f"{path}: invalid YAML: {exc}") from None
    return data


def _read_yaml(path: Path) -> dict[str, Any]:
    data = _parse_yaml(path, "practice")
    if not isinstance(data, dict):
        raise PracticeError(f"{path}: the top level must be a mapping with apiversion, metadata and spec")
    return data


# --- the generic dataclass builder ---------------------------------------------------------------------------
def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check `value` (from YAML) against the type hint `tp`; return it converted (lists -> tuples, etc.)."""
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        if value is None:
            if type(None) in args:
                return None
            raise SchemaError(path, f"must not be null; expected {_type_name(tp)}")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except SchemaError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise SchemaError(path, f"expected {_type_name(tp)}, got {type(value).__name__} {shown(value)}")
    if origin is Literal:
        if value not in args or type(value) not in {type(a) for a in args}:
            raise SchemaError(path, f"{shown(value)} is not allowed; expected one of {', '.join(map(str, args))}")
        return value
    if value is None:
        raise SchemaError(path, f"must not be null; expected {_type_name(tp)}")
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise SchemaError(path, f"expected a list, got {type(value).__name__} {shown(value)}")
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise SchemaError(path, f"expected a list of {len(args)} items, got {len(value)}")
            return tuple(_convert(a, v, _join(path, i)) for i, (a, v) in enumerate(zip(args, value)))
        item_tp = args[0] if args else Any
        items = [_convert(item_tp, v, _join(path, i)) for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise SchemaError(path, f"expected a mapping, got {type(value).__name__} {shown(value)}")
        key_tp, val_tp = args if args else (Any, Any)
        return {
            _convert(key_tp, k, _join(path, str(k))): _convert(val_tp, v, _join(path, str(k))) for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return value if isinstance(value, tp) else build_dataclass(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        for member in tp:
            if value == member.value or value == member.name:
                return member
        raise SchemaError(path, f"{shown(value)} is not allowed; expected one of {', '.join(str(m.value) for m in tp)}")
    if tp is bool:
        if not isinstance(value, bool):
            raise SchemaError(path, f"expected true/false, got {type(value).__name__} {shown(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(path, f"expected an integer, got {type(value).__name__} {shown(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SchemaError(path, f"expected a number, got {type(value).__name__} {shown(value)}")
        if not math.isfinite(value):  # YAML's .inf / .nan: no field of a practice means "unbounded" by them
            raise SchemaError(path, f"expected a finite number, got {shown(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SchemaError(path, f"expected a string, got {type(value).__name__} {shown(value)}")
        return value
    if tp is Path:
        if isinstance(value, Path):
            return value
        if not isinstance(value, str):
            raise SchemaError(path, f"expected a path string, got {type(value).__name__} {shown(value)}")
        return Path(value)
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise SchemaError(path, f"expected {tp.__name__}, got {type(value).__name__} {shown(value)}")
        return value
    raise TypeError(f"{path}: unsupported type hint {tp!r} in a config dataclass")


def _unknown_key_message(key: Any, allowed: list[str]) -> str:
    message = f"unknown key; expected one of {', '.join(allowed) if allowed else '(no keys)'}"
    close = difflib.get_close_matches(str(key), allowed, n=1)
    return message + (f" (did you mean {close[0]!r}?)" if close else "")


def _within(path: str, inner: str) -> str:
    """`inner`, a key path relative to the config at `path`, as a path from the top."""
    if not inner:
        return path
    return f"{path}{inner}" if inner.startswith("[") or not path else f"{path}.{inner}"


def build_dataclass(
    cls: type,
    data: Any,
    path: str = "",
    custom: Mapping[str, Callable[[Any, str], Any]] | None = None,
) -> Any:
    """Build dataclass `cls` from a YAML mapping: unknown keys, missing required keys and wrong types are errors.

    A `StrictConfig` converts its fields itself (the same conversions whether it is built here or in code); any
    other dataclass is converted here. `custom` maps a field name to its own converter (value, key path) -> value.
    Errors are SchemaErrors with the key path from the top (`path` is where `data` sits).
    """
    if not isinstance(data, Mapping):
        raise SchemaError(path, f"expected a mapping of {cls.__name__} fields, got {type(data).__name__} {shown(data)}")
    strict = issubclass(cls, StrictConfig)
    hints = _field_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]
    allowed = [f.name for f in fields]
    for key in data:
        if key not in allowed:
            raise SchemaError(_join(path, str(key)), _unknown_key_message(key, allowed))
    kwargs: dict[str, Any] = {}
    for f in fields:
        key_path = _join(path, f.name)
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SchemaError(key_path, "required key is missing")
            continue
        converter = (custom or {}).get(f.name)
        if converter:
            kwargs[f.name] = converter(data[f.name], key_path)
        else:
            kwargs[f.name] = data[f.name] if strict else _convert(hints[f.name], data[f.name], key_path)
    try:
        obj = cls(**kwargs)
        if not strict and callable(getattr(obj, "validate", None)):
            obj.validate()
    except SchemaError as exc:
        raise SchemaError(_within(path, exc.path), exc.message) from None
    except (TypeError, ValueError) as exc:
        raise SchemaError(path, str(exc)) from None
    return obj


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class StrictConfig:
    """Base of every config dataclass: the practice's sections, processor and saver configs and their parts.

    Building one, from a practice (`build_dataclass`) or in code (`QuaRotConfig(seed=1)`, `build(**fields)`), runs
    the same conversion of each field against its type hint (lists, tuples, dicts, Literal, Optional, nested
    configs given as mappings), then `validate()`, which holds only the rules between fields. A value that does not
    fit raises SchemaError (a ValueError) naming the field."""

    def __post_init__(self) -> None:
        hints = _field_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.init and not f.name.startswith("_"):
                object.__setattr__(self, f.name, _convert(hints[f.name], getattr(self, f.name), f.name))
        try:
            self.validate()
        except SchemaError:
            raise
        except (TypeError, ValueError) as exc:
            raise SchemaError("", str(exc)) from None

    def validate(self) -> None:
        """Raise ValueError for values that do not go together (each field's own type and range are checked
        before this runs)."""

    @classmethod
    def build(cls, **fields: Any) -> Any:
        """`cls` from keyword fields, checked as a practice entry's are: unknown keys name the closest field."""
        try:
            return build_dataclass(cls, fields, getattr(cls, "_yaml_type", cls.__name__))
        except SchemaError as exc:
            raise ValueError(str(exc)) from None


# --- schema --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Label(StrictConfig):
    """What a practice produces; `quant_type` (the --quant_type it answers) is derived from it."""

    w_bit: int
    a_bit: int
    is_sparse: bool = False
    kv_cache: bool = False

    def validate(self) -> None:
        if self.w_bit not in (2, 3, 4, 8, 16):
            raise ValueError(f"w_bit must be one of 2, 3, 4, 8, 16, got {self.w_bit}")
        if self.a_bit not in (4, 8, 16):
            raise ValueError(f"a_bit must be one of 4, 8, 16, got {self.a_bit}")

    @property
    def quant_type(self) -> str:
        """`w{w_bit}a{a_bit}`, plus `s` for sparse and `c8` for an int8 KV cache (w8a8s, w4a8c8, ...)."""
        return f"w{self.w_bit}a{self.a_bit}" + ("s" if self.is_sparse else "") + ("c8" if self.kv_cache else "")


@dataclass(frozen=True)
class Metadata(StrictConfig):
    """`verified_tags` (msModelSlim 26.1.0's form): model type -> the scenarios a practice is verified in, each a
    list of tags (`[vLLM_Ascend, Ascend_950]`); `verified_model_types` names model types without a scenario."""

    config_id: str
    score: float
    label: Label
    verified_model_types: list[str] = field(default_factory=list)
    verified_tags: dict[str, list[list[str]]] = field(default_factory=dict)
    # what a user must know about the consumers that serve the output (versions, deployment limits): logged as a
    # warning whenever the practice is chosen, and kept in the copied practice
    serving_note: str | None = None

    def validate(self) -> None:
        if not self.config_id.strip():
            raise ValueError("config_id must not be empty")
        if not self.model_types:
            raise ValueError("verified_model_types or verified_tags must name at least one model type")
        for model_type, scenarios in self.verified_tags.items():
            if not scenarios or not all(scenarios):
                raise ValueError(f"verified_tags.{model_type} must list scenarios, each a non-empty list of tags")

    @property
    def model_types(self) -> list[str]:
        return sorted(set(self.verified_model_types) | set(self.verified_tags))


@dataclass(frozen=True)
class PracticeStep:
    """One `spec.process` / `spec.save` item: its registry name, its validated config and the registered class."""

    type: str  # key of PROCESSORS / SAVERS
    config: Any  # instance of PROCESSORS[type].config_cls (or SAVERS[type].config_cls)
    cls: type  # the registered class

    def build(self, *args: Any) -> Any:
        """The processor (`build()`) or saver (`build(adapter, work_dir, dist)`) this step describes."""
        return self.cls(self.config, *args)


FallbackScheme = Literal["FLOAT", "W8A8_DYNAMIC", "W8A8_MXFP8"]


@dataclass
class FallbackConfig(StrictConfig):
    """One `spec.fallback` item: linears kept in higher precision than the practice's quantizers give them
    (processor/fallback.py). They are named by checkpoint-name globs (`names`), a file of them (`names_file`: a YAML
    list, or the `disable_names` of `msmodelslim analyze --save_path`), or by a quant report of the same checkpoint
    (`report`): its worst linears by `metric`, each with its fused serving group, as long as at most `top_k` linears
    move. Files are relative to the practice."""

    to: FallbackScheme
    names: list[str] = field(default_factory=list)
    names_file: str | None = None
    report: str | None = None
    metric: ReportMetric = "error"
    top_k: int | None = None
    globs: list[str] = field(default_factory=list, init=False)  # names and names_file, once read (`load`)
    ranking: list[str] = field(default_factory=list, init=False)  # the report's linears, worst first
    report_source: dict[str, str] | None = field(default=None, init=False)  # the report's checkpoint identity

    def validate(self) -> None:
        if not (self.names or self.names_file or self.report):
            raise ValueError("names a linear in none of names, names_file or report")
        if (self.report is None) != (self.top_k is None):
            raise ValueError("report and top_k go together: the top_k worst linears of the report")
        if self.top_k is not None and self.top_k <= 0:
            raise ValueError(f"top_k: must be a positive integer, got {self.top_k}")

    def load(self, base: Path, path: str) -> None:
        """Read `names_file` into `globs` and `report` into `ranking` (relative to `base`); SchemaError naming the
        file."""
        self.globs = list(self.names)
        if self.names_file is not None:
            file = base / self.names_file
            data = _parse_yaml(file, _join(path, "names_file"))
            listed = data.get("disable_names") if isinstance(data, dict) else data
            if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
                raise SchemaError(_join(path, "names_file"), f"{file}: expected a list of linear names (or a "
                                  "mapping with disable_names: [...], as msmodelslim analyze writes it)")
            self.globs += listed
        if self.report is not None:
            file = base / self.report
            try:
                report = read_report(file)
            except UserError as exc:
                raise SchemaError(_join(path, "report"), str(exc)) from None
            self.report_source = report["source"]
            self.ranking = [name for name, _ in ranked(report["linears"], self.metric)]


@dataclass
class Spec(StrictConfig):
    process: list[PracticeStep]  # processors in YAML order
    dataset: str
    save: list[PracticeStep]
    runner: Literal["auto", "layer_wise", "dp_layer_wise"] = "auto"
    default_text: str = ""
    max_samples: int | None = None
    max_seq_len: int | None = DEFAULT_MAX_SEQ_LEN
    # Records of one length are forwarded together, up to this many tokens per forward (null: one record each).
    micro_batch_tokens: int | None = DEFAULT_MICRO_BATCH_TOKENS
    # The quant report observes the micro-batches that come first in the global order up to this many tokens (the
    # same ones on any number of ranks; null: every token). The routed experts' coverage counts their Hessians'.
    report_tokens: int | None = DEFAULT_REPORT_TOKENS
    # The report's loss-aware `impact` of each linear (pipeline/impact.py), from the first this many calibration
    # tokens: the unit forwarded once as float and once per serving group with that group float (null: not measured;
    # `msmodelslim analyze --metrics impact` and `tune --metric impact` set DEFAULT_IMPACT_TOKENS).
    report_impact_tokens: int | None = None
    fallback: list[FallbackConfig] = field(default_factory=list)  # linears kept in higher precision
    # MTP layers (Kimi-K3's layers.{N + k}): quantized like the rest, kept FLOAT, or left out of the output (and out
    # of config.json's num_nextn_predict_layers). vllm-ascend v0.26.0rc skips them; vLLM on GPU and SGLang draft
    # with them (docs/user_guide.md section 4).
    mtp: Literal["quantize", "float", "drop"] = "quantize"
    # The serving target the output is written for (serving/profiles.py: vllm-ascend-0.26, vllm-ascend-0.27): its
    # classes' fused layers and load rules are checked before any compute. None: the newest (--target overrides).
    target: str | None = None
    # Every routed expert computes on every token in the statistics passes (its Hessian and ranges see all of its
    # rank's tokens, not the ~top-k / E the router sends it); the layer's output keeps the router's choice.
    calibrate_all_experts: bool = False
    # MoEQuant's affinity-guided GPTQ: a routed expert's Hessian weighs each of its tokens by the router's weight
    # for it (core/routing.py); its tokens are still the routed ones (not with calibrate_all_experts)
    affinity_guided_experts: bool = False
    # MoEQuant's expert balance from the calibration set: in the statistics passes a routed expert the router sends
    # fewer than its balanced share of a micro-batch (tokens x top-k / experts) also computes, for its Hessian and
    # ranges only, on the tokens the router scores highest for it up to that share; the layer's output is as ever
    balanced_experts: bool = False
    # The resumable state (pipeline/resume.py) is kept after every this many units and after the last: a resume
    # recomputes at most resume_every - 1 units, and a run writes the samples' state (Kimi-K3: 140 KiB per token
    # and rank) that many times less often.
    resume_every: int = 1

    def validate(self) -> None:
        if not self.dataset.strip():
            raise ValueError("dataset must not be empty")
        for name in ("max_samples", "max_seq_len", "micro_batch_tokens", "report_tokens", "report_impact_tokens",
                     "resume_every"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.calibrate_all_experts and self.affinity_guided_experts:
            raise ValueError("affinity_guided_experts weighs the tokens the router sends an expert by its weights, "
                             "which are 0 for the others calibrate_all_experts adds: choose one")
        if self.balanced_experts and (self.calibrate_all_experts or self.affinity_guided_experts):
            raise ValueError("balanced_experts tops each routed expert's tokens up to its share; it goes with "
                             "neither calibrate_all_experts (every token already) nor affinity_guided_experts "
                             "(no router weight for the added tokens): choose one")


@dataclass
class PracticeConfig:
    apiversion: ApiVersion
    metadata: Metadata
    spec: Spec
    path: Path | None = field(default=None, init=False)  # the file it was read from

    @property
    def quant_type(self) -> str:
        return self.metadata.label.quant_type

    @property
    def is_multimodal(self) -> bool:
        return self.apiversion == MULTIMODAL_APIVERSION


@dataclass(frozen=True)
class PracticeHeader:
    """apiversion + metadata only: enough to choose a practice without building its processors."""

    apiversion: str
    metadata: Metadata
    path: Path

    @property
    def quant_type(self) -> str:
        return self.metadata.label.quant_type


def _build_steps(value: Any, path: str, registry: Mapping[str, Any], kind: str) -> list[PracticeStep]:
    """`[{type: name, ...fields}, ...]` -> PracticeStep(name, registry[name].config_cls built from the fields)."""
    if not isinstance(value, list):
        raise SchemaError(path, f"expected a list of {{type: ..., ...}} entries, got {type(value).__name__}")
    if not value:
        raise SchemaError(path, f"empty; at least one {kind} is required")
    entries = []
    known = ", ".join(sorted(registry)) or "(none registered)"
    for i, entry in enumerate(value):
        entry_path = _join(path, i)
        if not isinstance(entry, Mapping):
            raise SchemaError(entry_path, f"expected a mapping with a 'type' key, got {type(entry).__name__} {shown(entry)}")
        if "type" not in entry:
            raise SchemaError(_join(entry_path, "type"), f"required key is missing; expected one of {known}")
        name = entry["type"]
        if not isinstance(name, str) or name not in registry:
            close = difflib.get_close_matches(str(name), list(registry), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SchemaError(_join(entry_path, "type"), f"unknown {kind} type {name!r}; expected one of {known}{hint}")
        fields = {k: v for k, v in entry.items() if k != "type"}
        entries.append(PracticeStep(name, build_dataclass(registry[name].config_cls, fields, entry_path), registry[name]))
    return entries


def _check_label_is_kept(label: Label, process: list[PracticeStep], processors: Mapping[str, Any]) -> None:
    """A practice must do what its label says: a practice that quantizes nothing is not a w4a8 practice."""
    listed = [processors[e.type] for e in process]
    if (label.w_bit < 16 or label.a_bit < 16) and not any(getattr(p, "quantizes_linears", False) for p in listed):
        quantizers = sorted(n for n, p in processors.items() if getattr(p, "quantizes_linears", False))
        raise SchemaError("spec.process", f"metadata.label promises {label.quant_type}, but no processor listed "
                           f"quantizes linears (add one of: {', '.join(quantizers) or '(none registered)'})")
    if label.kv_cache and not any(getattr(p, "quantizes_attention", False) for p in listed):
        quantizers = sorted(n for n, p in processors.items() if getattr(p, "quantizes_attention", False))
        raise SchemaError("metadata.label.kv_cache", "true needs a processor in spec.process that quantizes the "
                           f"attention / KV cache; available: {', '.join(quantizers) or 'none in this version'}")


def _check_top_keys(data: Mapping[str, Any], required: tuple[str, ...]) -> None:
    allowed = ["apiversion", "metadata", "spec"]
    for key in data:
        if key not in allowed:
            raise SchemaError(str(key), _unknown_key_message(key, allowed))
    for key in required:
        if key not in data:
            raise SchemaError(key, "required key is missing")


def _header(data: Mapping[str, Any]) -> tuple[str, Metadata]:
    apiversion = _convert(ApiVersion, data["apiversion"], "apiversion")
    metadata = build_dataclass(Metadata, data["metadata"], "metadata")
    return apiversion, metadata


def load_practice_header(path: str | Path) -> PracticeHeader:
    """Read and validate only `apiversion` and `metadata` (used to rank practices for a --quant_type)."""
    path = Path(path)
    data = _read_yaml(path)
    try:
        _check_top_keys(data, ("apiversion", "metadata", "spec"))
        apiversion, metadata = _header(data)
    except SchemaError as exc:
        raise PracticeError(f"{path}: {exc}") from None
    return PracticeHeader(apiversion, metadata, path)


def load_practice(path: str | Path, processors: Mapping[str, Any], savers: Mapping[str, Any]) -> PracticeConfig:
    """Parse and validate a practice YAML against the registries given (the application's are
    `msmodelslim.processor.catalog.registries()`). Errors are `PracticeError("<file>: <key path>: <problem>")`."""
    path = Path(path)
    data = _read_yaml(path)

    def process_entries(value: Any, key_path: str) -> list[PracticeStep]:
        return _build_steps(value, key_path, processors, "processor")

    def save_entries(value: Any, key_path: str) -> list[PracticeStep]:
        return _build_steps(value, key_path, savers, "saver")

    try:
        _check_top_keys(data, ("apiversion", "metadata", "spec"))
        apiversion, metadata = _header(data)
        spec = build_dataclass(Spec, data["spec"], "spec", custom={"process": process_entries, "save": save_entries})
        if apiversion == MULTIMODAL_APIVERSION and not spec.default_text.strip():
            raise SchemaError("spec.default_text", f"required (non-empty) for apiversion {MULTIMODAL_APIVERSION}")
        _check_label_is_kept(metadata.label, spec.process, processors)
        for i, entry in enumerate(spec.fallback):
            try:
                entry.load(path.parent, f"spec.fallback[{i}]")
            except PracticeError as exc:  # a names file that cannot be read
                raise PracticeError(f"{path}: {exc}") from None
    except SchemaError as exc:
        raise PracticeError(f"{path}: {exc}") from None
    practice = PracticeConfig(apiversion=apiversion, metadata=metadata, spec=spec)
    practice.path = path
    return practice
