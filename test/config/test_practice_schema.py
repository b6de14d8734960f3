"""core.config.load_practice: a valid practice parses into typed configs; every kind of mistake is an error that
names the file and the key path. Dummy processor/saver registries stand in for the real ones (passed explicitly,
nothing is registered globally). References are literal expected values/messages.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from msmodelslim.core.config import Label, PracticeError, PracticeStep, load_practice, load_practice_header
from msmodelslim.processor.iter_smooth import IterSmoothConfig
from msmodelslim.processor.linear_quant import LinearQuantConfig, WeightExt, WeightQConfig


@dataclass
class Inner:
    scope: Literal["per_token", "per_channel"] = "per_token"
    bits: int = 8


@dataclass
class SmoothCfg:
    alpha: float = 0.5
    scale_min: float = 1e-5
    enable_subgraph_type: list[str] = field(default_factory=list)
    inner: Inner = field(default_factory=Inner)
    extra: dict[str, int] = field(default_factory=dict)
    seed: int | None = None

    def validate(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")


@dataclass
class SaveCfg:
    part_file_size: float = 4.0


class SmoothProc:
    config_cls = SmoothCfg


class SaveProc:
    config_cls = SaveCfg


class QuantizingSmoothProc(SmoothProc):
    quantizes_linears = True  # a w4a8 practice must list a quantizer: this stub is the GOOD practice's one


PROCESSORS = {"smooth": QuantizingSmoothProc, "quarot": SmoothProc}
SAVERS = {"ascendv1_saver": SaveProc}

GOOD = """\
apiversion: multimodal_vlm_modelslim_v1
metadata:
  config_id: test_w4a8
  score: 90
  verified_model_types: [Kimi-K3]
  label: {w_bit: 4, a_bit: 8, is_sparse: false, kv_cache: false}
spec:
  runner: dp_layer_wise
  process:
    - type: quarot
    - type: smooth
      alpha: 0.9
      enable_subgraph_type: [norm-linear, up-down]
      inner: {scope: per_channel, bits: 4}
      extra: {a: 1}
  dataset: calibImages
  default_text: "Describe this image."
  max_samples: 8
  save:
    - type: ascendv1_saver
      part_file_size: 4
"""


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load(path: Path):
    return load_practice(path, processors=PROCESSORS, savers=SAVERS)


def test_valid_practice_builds_typed_configs(tmp_path):
    practice = load(write(tmp_path, GOOD))
    assert practice.apiversion == "multimodal_vlm_modelslim_v1" and practice.is_multimodal
    assert practice.metadata.label == Label(4, 8, False, False)
    assert practice.quant_type == "w4a8"
    spec = practice.spec
    assert spec.runner == "dp_layer_wise" and spec.max_samples == 8 and spec.max_seq_len == 4096  # the default cap
    assert [e.type for e in spec.process] == ["quarot", "smooth"]
    assert spec.process[0] == PracticeStep("quarot", SmoothCfg(), SmoothProc)
    smooth = spec.process[1].config
    assert smooth == SmoothCfg(alpha=0.9, enable_subgraph_type=["norm-linear", "up-down"],
                               inner=Inner("per_channel", 4), extra={"a": 1})
    assert isinstance(smooth.alpha, float)
    assert spec.save == [PracticeStep("ascendv1_saver", SaveCfg(4.0), SaveProc)]
    assert practice.path == tmp_path / "p.yaml"


@pytest.mark.parametrize(
    ("label", "quant_type"),
    [((4, 8, False, False), "w4a8"), ((8, 8, False, False), "w8a8"), ((4, 4, False, False), "w4a4"),
     ((8, 16, False, False), "w8a16"), ((8, 8, True, False), "w8a8s"), ((4, 8, False, True), "w4a8c8"),
     ((8, 8, False, True), "w8a8c8")],
)
def test_quant_type_is_derived_from_label(label, quant_type):
    assert Label(*label).quant_type == quant_type


def _bad(tmp_path: Path, old: str, new: str) -> str:
    assert old in GOOD
    path = write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(PracticeError) as info:
        load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    return message


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("      alpha: 0.9", "      alfa: 0.9",
         "spec.process[1].alfa: unknown key; expected one of alpha, scale_min, enable_subgraph_type, inner, extra, "
         "seed (did you mean 'alpha'?)"),
        ("inner: {scope: per_channel, bits: 4}", "inner: {scope: per_channel, bitz: 4}",
         "spec.process[1].inner.bitz: unknown key; expected one of scope, bits"),
        ("  runner: dp_layer_wise", "  runner: dp_layer_wise\n  runer: auto", "spec.runer: unknown key"),
        ("  config_id: test_w4a8", "  config_id: test_w4a8\n  owner: me", "metadata.owner: unknown key"),
        ("is_sparse: false,", "is_sparse: false, sparse: true,", "metadata.label.sparse: unknown key"),
        ("apiversion: multimodal_vlm_modelslim_v1", "apiversion: multimodal_vlm_modelslim_v1\nkind: x",
         "kind: unknown key; expected one of apiversion, metadata, spec"),
        ("    - type: quarot", "    - type: quarto",
         "spec.process[0].type: unknown processor type 'quarto'; expected one of quarot, smooth (did you mean 'quarot'?)"),
        ("    - type: ascendv1_saver", "    - type: safetensors_saver",
         "spec.save[0].type: unknown saver type 'safetensors_saver'; expected one of ascendv1_saver"),
        ("    - type: quarot", "    - seed: 1", "spec.process[0].type: required key is missing"),
        ("      alpha: 0.9", "      alpha: high", "spec.process[1].alpha: expected a number, got str 'high'"),
        ("      alpha: 0.9", "      alpha: 1.5", "spec.process[1]: alpha must be in [0, 1], got 1.5"),
        ("      alpha: 0.9", "      alpha: true", "spec.process[1].alpha: expected a number, got bool True"),
        ("bits: 4}", "bits: 4.5}", "spec.process[1].inner.bits: expected an integer, got float 4.5"),
        ("scope: per_channel", "scope: per_row",
         "spec.process[1].inner.scope: 'per_row' is not allowed; expected one of per_token, per_channel"),
        ("enable_subgraph_type: [norm-linear, up-down]", "enable_subgraph_type: norm-linear",
         "spec.process[1].enable_subgraph_type: expected a list, got str 'norm-linear'"),
        ("enable_subgraph_type: [norm-linear, up-down]", "enable_subgraph_type: [norm-linear, 3]",
         "spec.process[1].enable_subgraph_type[1]: expected a string, got int 3"),
        ("extra: {a: 1}", "extra: {a: one}", "spec.process[1].extra.a: expected an integer, got str 'one'"),
        ("  runner: dp_layer_wise", "  runner: fast",
         "spec.runner: 'fast' is not allowed; expected one of auto, layer_wise, dp_layer_wise"),
        ("apiversion: multimodal_vlm_modelslim_v1", "apiversion: modelslim_v2",
         "apiversion: 'modelslim_v2' is not allowed; expected one of modelslim_v1, multimodal_vlm_modelslim_v1"),
        ("w_bit: 4", "w_bit: 5", "metadata.label: w_bit must be one of 2, 3, 4, 8, 16, got 5"),
        ("  score: 90", "  score: high", "metadata.score: expected a number, got str 'high'"),
        ("  verified_model_types: [Kimi-K3]", "  verified_model_types: []",
         "metadata: verified_model_types or verified_tags must name at least one model type"),
        ("  max_samples: 8", "  max_samples: 0", "spec: max_samples must be positive, got 0"),
        ("  max_samples: 8", "  max_samples: eight", "spec.max_samples: expected an integer, got str 'eight'"),
        ("  max_samples: 8", "  max_samples: 8\n  calibrate_all_experts: true\n  affinity_guided_experts: true",
         "spec: affinity_guided_experts weighs the tokens the router sends an expert by its weights"),
        ("  max_samples: 8", "  max_samples: 8\n  calibrate_all_experts: true\n  balanced_experts: true",
         "spec: balanced_experts tops each routed expert's tokens up to its share"),
        ("  dataset: calibImages\n", "", "spec.dataset: required key is missing"),
        ('  default_text: "Describe this image."\n', "",
         "spec.default_text: required (non-empty) for apiversion multimodal_vlm_modelslim_v1"),
        ("  process:\n", "  process: []\n  unused:\n", "spec.unused: unknown key"),
        ("      part_file_size: 4", "      part_file_size: big",
         "spec.save[0].part_file_size: expected a number, got str 'big'"),
        ("    - type: quarot\n", "    - quarot\n", "spec.process[0]: expected a mapping with a 'type' key, got str"),
    ],
)
def test_schema_errors_name_file_and_key_path(tmp_path, old, new, expected):
    assert expected in _bad(tmp_path, old, new)


def test_empty_process_list_is_an_error(tmp_path):
    text = GOOD.split("  process:")[0] + "  process: []\n  dataset: x\n  default_text: t\n  save: [{type: ascendv1_saver}]\n"
    with pytest.raises(PracticeError, match=r"spec\.process: empty; at least one processor is required"):
        load(write(tmp_path, text))


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, GOOD.replace("  score: 90", "  score: [90"))
    with pytest.raises(PracticeError) as info:
        load(path)
    assert str(info.value).startswith(f"{path}:")
    assert "invalid YAML" in str(info.value)
    line = int(str(info.value)[len(str(path)) + 1:].split(":")[0])
    assert 4 <= line <= 6  # the unclosed bracket opens on line 4; PyYAML reports where it notices


def test_duplicate_key_is_an_error_with_line(tmp_path):
    path = write(tmp_path, GOOD.replace("  score: 90", "  score: 90\n  score: 80"))
    with pytest.raises(PracticeError, match=rf"{path}:5:\d+: invalid YAML: duplicate key 'score'"):
        load(path)


def test_missing_file_and_non_mapping_top_level(tmp_path):
    with pytest.raises(PracticeError, match="practice file not found"):
        load(tmp_path / "nope.yaml")
    with pytest.raises(PracticeError, match="top level must be a mapping"):
        load(write(tmp_path, "- a\n- b\n"))


def test_header_reads_metadata_without_registries(tmp_path):
    header = load_practice_header(write(tmp_path, GOOD.replace("type: quarot", "type: not_registered")))
    assert header.quant_type == "w4a8" and header.metadata.score == 90.0
    assert header.metadata.verified_model_types == ["Kimi-K3"]


@pytest.mark.parametrize("key, value", [("score", ".inf"), ("score", ".nan"), ("score", "-.inf")])
def test_non_finite_number_is_refused(tmp_path, key, value):
    # reference: the literal message; YAML's .inf/.nan parse as floats, so only the schema can refuse them
    path = write(tmp_path, GOOD.replace("score: 90", f"{key}: {value}"))
    with pytest.raises(PracticeError, match=r"metadata\.score: expected a finite number"):
        load(path)


def test_nested_non_finite_number_is_refused(tmp_path):
    path = write(tmp_path, GOOD.replace("alpha: 0.9", "alpha: .nan"))
    with pytest.raises(PracticeError, match=r"spec\.process\[1\]\.alpha: expected a finite number"):
        load(path)


def test_practice_without_a_quantizer_is_refused(tmp_path):
    # the label says w4a8; with only quarot listed the output would be all FLOAT
    text = GOOD.replace("    - type: smooth\n      alpha: 0.9\n      enable_subgraph_type: [norm-linear, up-down]\n"
                        "      inner: {scope: per_channel, bits: 4}\n      extra: {a: 1}\n", "")
    assert "type: smooth" not in text
    with pytest.raises(PracticeError, match=r"spec\.process: metadata\.label promises w4a8, but no processor "
                                            r"listed quantizes linears \(add one of: smooth\)"):
        load(write(tmp_path, text))


def test_float_practice_needs_no_quantizer(tmp_path):
    text = GOOD.replace("label: {w_bit: 4, a_bit: 8,", "label: {w_bit: 16, a_bit: 16,").replace(
        "type: smooth", "type: quarot").replace("      alpha: 0.9\n      enable_subgraph_type: [norm-linear, up-down]\n"
                                                "      inner: {scope: per_channel, bits: 4}\n      extra: {a: 1}\n", "")
    assert load(write(tmp_path, text)).quant_type == "w16a16"


def test_kv_cache_label_without_attention_quantizer_is_refused(tmp_path):
    path = write(tmp_path, GOOD.replace("kv_cache: false", "kv_cache: true"))
    with pytest.raises(PracticeError, match=r"metadata\.label\.kv_cache: true needs a processor"):
        load(path)


def test_the_practice_schema_does_not_reach_up_into_the_processors():
    # core is a floor below processor/: loading the schema imports no processor module (the registries are given)
    import subprocess
    import sys

    code = ("import sys, msmodelslim.core.config; "
            "print(sorted(m for m in sys.modules if m.startswith('msmodelslim.processor')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- configs built in code: the same conversions and checks as a practice entry's (exact messages) -------------
def test_a_config_built_in_code_converts_its_fields_as_the_practice_loader_does():
    config = LinearQuantConfig(qconfig={"weight": {"dtype": "int4", "method": "gptq", "ext": {"percdamp": 0.02}}},
                               include=("*experts*",))
    assert config.qconfig.weight.ext == WeightExt(percdamp=0.02)  # the nested mappings became configs
    assert config.qconfig.weight.gptq.damp == 0.02 and config.qconfig.weight.gptq.block_size == 128
    assert config.include == ["*experts*"]  # list[str]: a tuple is taken as a list


@pytest.mark.parametrize("build,message", [
    (lambda: WeightExt(group_size="64"), r"^group_size: expected an integer, got str '64'$"),
    (lambda: WeightQConfig(method="rtn"), r"^method: 'rtn' is not allowed; expected one of ssz, minmax, grid, gptq$"),
    (lambda: LinearQuantConfig(qconfig={"weight": {"ext": {"percdamp": 2.0}}}),
     r"^qconfig\.weight\.ext: percdamp: must be in \(0, 1\)"),
    (lambda: IterSmoothConfig(enable_subgraph_type=["up-down", "qk"]), r"^enable_subgraph_type\[1\]: 'qk' is not allowed"),
    (lambda: Label(w_bit="4", a_bit=8), r"^w_bit: expected an integer"),
])
def test_a_config_built_in_code_refuses_what_a_practice_would(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_name_lists_are_their_literals():
    import typing

    from msmodelslim.model.maps import SUBGRAPH_TYPES, SubgraphType

    assert SUBGRAPH_TYPES == typing.get_args(SubgraphType) == ("up-down", "ov", "linear-linear",
                                                                "gated-norm-linear", "norm-linear")
