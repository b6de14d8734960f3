"""quantization_config parsing and target/ignore matching, against compressed-tensors 0.20's own matcher."""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_factory import quantization_config
from compressed_tensors.utils.match import match_name as ct_match_name
from compressed_tensors.utils.match import match_targets as ct_match_targets

from msmodelslim.source.quant_scheme import (
    match_name,
    mxfp4_exponent_bias,
    parse_quant_scheme,
    read_config,
)

NAMES = [
    "lm_head",
    "model.layers.0.block_sparse_moe.experts.3.w1",
    "model.layers.0.block_sparse_moe.experts.3.w10",
    "model.layers.0.block_sparse_moe.experts.12.w2",
    "model.layers.0.block_sparse_moe.shared_experts.gate_proj",
    "language_model.model.layers.1.mlp.experts.0.w3",
    "model.layers.0.self_attn.q_proj",
]
TARGETS = [
    "Linear",
    "lm_head",
    "re:.*experts\\.\\d+\\.w[123]$",
    "re:.*experts\\.\\d+\\.w[123]",  # unanchored end: re.match also accepts "...w10"
    "re:experts",  # re.match anchors at the start: matches nothing here
    "re:model\\.layers\\.0\\.",
    "model.layers.0.self_attn.q_proj",
]


@pytest.mark.parametrize("target", TARGETS)
def test_match_name_equals_compressed_tensors(target):
    for name in NAMES:
        assert match_name(name, target) == ct_match_name(name, target), (name, target)


def _scheme(groups: dict, ignore=()) -> dict:
    return {"quantization_config": quantization_config(config_groups=groups, ignore=list(ignore))}


def _group(targets, fmt="mxfp4-pack-quantized"):
    return {"targets": targets, "format": fmt, "weights": {"num_bits": 4, "group_size": 32}}


def test_group_choice_equals_compressed_tensors_precedence():
    # exact name beats regex beats class name; compressed-tensors sorts targets the same way
    groups = {"by_class": _group(["Linear"], "nvfp4-pack-quantized"),
              "by_regex": _group(["re:.*experts.*"], "mxfp4-pack-quantized"),
              "by_name": _group(["model.layers.0.self_attn.q_proj"], "float-quantized")}
    scheme = parse_quant_scheme(_scheme(groups))
    linear = torch.nn.Linear(1, 1)
    target_to_group = {t: g for g, spec in groups.items() for t in spec["targets"]}
    for name in NAMES:
        expected = ct_match_targets(name, linear, list(target_to_group))
        got = scheme.group_for(name)
        assert got is not None and got.name == target_to_group[expected[0]], name


def test_linear_class_target_matches_every_packed_module_and_ignore_wins():
    scheme = parse_quant_scheme(_scheme({"g": _group(["Linear"])}, ignore=["lm_head", "re:.*shared_experts.*"]))
    assert scheme.format_for("model.layers.0.block_sparse_moe.experts.3.w1") == "mxfp4-pack-quantized"
    assert scheme.format_for("lm_head") is None
    assert scheme.format_for("model.layers.0.block_sparse_moe.shared_experts.gate_proj") is None
    assert scheme.format_for("x", module_class=None) is None  # unknown class: only names can match


def test_ignore_linear_class_ignores_everything():
    scheme = parse_quant_scheme(_scheme({"g": _group(["re:.*"])}, ignore=["Linear"]))
    assert scheme.group_for("model.layers.0.self_attn.q_proj") is None


def test_regex_target_uses_re_match_semantics():
    scheme = parse_quant_scheme(_scheme({"g": _group(["re:.*experts\\.\\d+\\.w[123]$"])}))
    assert scheme.group_for("model.layers.0.block_sparse_moe.experts.3.w1") is not None
    assert scheme.group_for("model.layers.0.block_sparse_moe.experts.3.w10") is None
    assert scheme.group_for("model.layers.0.block_sparse_moe.shared_experts.gate_proj") is None


def test_nested_text_config_is_found():
    config = {"model_type": "kimi_k3", "text_config": {"quantization_config": quantization_config("0.13.0")}}
    scheme = parse_quant_scheme(config)
    assert scheme is not None and scheme.version == "0.13.0" and scheme.exponent_bias == 125


def test_top_level_block_wins_over_text_config():
    config = {"quantization_config": quantization_config("0.20.0"),
              "text_config": {"quantization_config": quantization_config("0.13.0")}}
    assert parse_quant_scheme(config).version == "0.20.0"


def test_no_quantization_config_gives_none():
    assert parse_quant_scheme({"model_type": "kimi_linear"}) is None


def test_unknown_quant_method_is_an_error_naming_source():
    with pytest.raises(ValueError, match="cfg.json.*unsupported.*'gptq'"):
        parse_quant_scheme({"quantization_config": {"quant_method": "gptq"}}, source="cfg.json")


def test_invalid_regex_is_an_error():
    with pytest.raises(ValueError, match="invalid regex"):
        parse_quant_scheme(_scheme({"g": _group(["re:(unclosed"])}))


def test_other_format_is_an_error_when_a_tensor_needs_it():
    scheme = parse_quant_scheme(_scheme({"g": _group(["Linear"], "nvfp4-pack-quantized")}))
    with pytest.raises(ValueError, match="model.x.*nvfp4-pack-quantized.*only 'mxfp4-pack-quantized'"):
        scheme.require_mxfp4("model.x")


def test_untargeted_packed_module_is_an_error():
    scheme = parse_quant_scheme(_scheme({"g": _group(["re:.*experts.*"])}))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.*does not target"):
        scheme.require_mxfp4("model.layers.0.self_attn.q_proj")


def test_group_format_falls_back_to_top_level_format():
    groups = {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32}}}
    assert parse_quant_scheme(_scheme(groups)).require_mxfp4("a.b") == 127


def test_mxfp4_with_wrong_group_size_is_an_error():
    groups = {"g": {"targets": ["Linear"], "format": "mxfp4-pack-quantized", "weights": {"num_bits": 4, "group_size": 16}}}
    with pytest.raises(ValueError, match="group_size 16"):
        parse_quant_scheme(_scheme(groups)).require_mxfp4("a.b")


@pytest.mark.parametrize("version, bias", [("0.13.0", 125), ("0.13.1", 125), ("0.13", 125), ("0.13.0.dev3", 125),
                                           ("0.14.0", 127), ("0.130.0", 127), ("0.20.0", 127), (None, 127)])
def test_exponent_bias_keys_on_version(version, bias):
    assert mxfp4_exponent_bias(version) == bias


def test_read_config_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json.*not valid JSON"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"a": 1}))
    assert read_config(tmp_path) == {"a": 1}
