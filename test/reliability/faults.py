"""Broken inputs a user can hand `msmodelslim quant`, each built from a copy of a good tiny Kimi-K3 checkpoint.

A fault is a function `(model_dir, workspace) -> extra CLI arguments`: it damages the copy in `model_dir` (and may
write a practice or a calibration set into `workspace`) and returns what to add to the command line. `FAULTS`
maps a case name to (fault, a regex the one error line must match). Used by test_failure_paths.py and by
bench/failures.py (which times every case).
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
W4A8_PRACTICE = REPO / "lab_practice" / "kimi_k3" / "kimi_k3_w4a8.yaml"
INDEX = "model.safetensors.index.json"

Fault = Callable[[Path, Path], list[str]]


# --- helpers ---------------------------------------------------------------------------------------------------
def weight_map(model: Path) -> dict[str, str]:
    return json.loads((model / INDEX).read_text())["weight_map"]


def key(model: Path, pattern: str) -> str:
    """The first stored tensor name (sorted) matching `pattern`."""
    for name in sorted(weight_map(model)):
        if re.search(pattern, name):
            return name
    raise KeyError(f"no tensor matches {pattern}")


def edit_shard(model: Path, name: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Rewrite the shard holding `name` after `edit(tensors)` changed its tensor dict; the index follows."""
    wm = weight_map(model)
    shard = model / wm[name]
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    for n in [n for n, f in wm.items() if f == shard.name and n not in tensors]:
        del wm[n]
    for n in tensors:
        wm[n] = shard.name
    index = json.loads((model / INDEX).read_text())
    index["weight_map"] = dict(sorted(wm.items()))
    (model / INDEX).write_text(json.dumps(index, indent=2))
    return shard


def planted_outlier(source: Path, out: Path, linear: str, column: int, factor: float = 30.0) -> Path:
    """`source` with one input column of `linear`'s weight times `factor`, in `out` (created; the other files
    linked): a linear that quantizes badly, for tests that must find it."""
    out.mkdir()
    shard = weight_map(source)[f"{linear}.weight"]
    for f in source.iterdir():
        if f.name != shard:
            (out / f.name).symlink_to(f)
    tensors = load_file(str(source / shard))
    tensors[f"{linear}.weight"][:, column] *= factor
    save_file(tensors, str(out / shard), metadata={"format": "pt"})
    return out


def other_weights(model: Path) -> None:
    """Another training run of the same architecture: every tensor's values changed (floats doubled, MXFP4 codes
    flipped), every header, config.json and the index byte for byte as they were."""
    for shard in sorted(set(weight_map(model).values())):
        path = model / shard
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
        header = path.read_bytes()[: 8 + int.from_bytes(path.read_bytes()[:8], "little")]
        tensors = {n: t * 2 if t.is_floating_point() else t ^ 0x11 if n.endswith("weight_packed") else t
                   for n, t in load_file(str(path)).items()}
        save_file(tensors, str(path), metadata=metadata)
        assert path.read_bytes()[: len(header)] == header


def set_tensor(model: Path, name: str, value: torch.Tensor) -> None:
    edit_shard(model, name, lambda t: t.__setitem__(name, value))


def poison(model: Path, pattern: str, value: float) -> None:
    name = key(model, pattern)
    tensor = load_file(str(model / weight_map(model)[name]))[name].clone()
    tensor.view(-1)[tensor.numel() // 2] = value
    set_tensor(model, name, tensor)


def edit_config(model: Path, edit: Callable[[dict], None]) -> None:
    config = json.loads((model / "config.json").read_text())
    edit(config)
    (model / "config.json").write_text(json.dumps(config, indent=2))


def practice(workspace: Path, replace: dict[str, str], name: str = "practice.yaml") -> list[str]:
    text = W4A8_PRACTICE.read_text()
    for old, new in replace.items():
        if old not in text:
            raise KeyError(f"{W4A8_PRACTICE}: {old!r} not found")
        text = text.replace(old, new)
    path = workspace / name
    path.write_text(text)
    return ["--config_path", str(path)]


def png_claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims `width` x `height` (readers refuse it from the header alone)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00\x00\x00\x00")
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


# --- the faults ------------------------------------------------------------------------------------------------
def missing_shard(model: Path, ws: Path) -> list[str]:
    (model / weight_map(model)[key(model, r"experts\.0\.w1\.weight_packed$")]).unlink()
    return []


def truncated_shard(model: Path, ws: Path) -> list[str]:
    shard = sorted(set(weight_map(model).values()))[-1]
    data = (model / shard).read_bytes()
    (model / shard).write_bytes(data[: len(data) - 1000])
    return []


def corrupt_header(model: Path, ws: Path) -> list[str]:
    shard = model / sorted(set(weight_map(model).values()))[0]
    data = bytearray(shard.read_bytes())
    data[8:24] = b"\xff" * 16  # the JSON header starts at byte 8
    shard.write_bytes(bytes(data))
    return []


def index_points_outside(model: Path, ws: Path) -> list[str]:
    outside = model.parent / "elsewhere.safetensors"
    name = key(model, r"layers\.0\.input_layernorm\.weight$")
    wm = weight_map(model)
    tensors = load_file(str(model / wm[name]))
    save_file({name: tensors[name]}, str(outside))
    index = json.loads((model / INDEX).read_text())
    index["weight_map"][name] = "../elsewhere.safetensors"
    (model / INDEX).write_text(json.dumps(index))
    return []


def index_names_missing_tensor(model: Path, ws: Path) -> list[str]:
    index = json.loads((model / INDEX).read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"]["language_model.model.layers.0.ghost.weight"] = index["weight_map"][first]
    (model / INDEX).write_text(json.dumps(index))
    return []


def missing_tensor(model: Path, ws: Path) -> list[str]:
    name = key(model, r"layers\.1\.post_attention_layernorm\.weight$")
    edit_shard(model, name, lambda t: t.pop(name))
    return []


def missing_mxfp4_scale(model: Path, ws: Path) -> list[str]:
    name = key(model, r"experts\.3\.w2\.weight_scale$")
    edit_shard(model, name, lambda t: t.pop(name))
    return []


def nan_e8m0_scale(model: Path, ws: Path) -> list[str]:
    name = key(model, r"experts\.3\.w2\.weight_scale$")
    scale = load_file(str(model / weight_map(model)[name]))[name].clone()
    scale[0, 0] = 255
    set_tensor(model, name, scale)
    return []


def packed_width_not_multiple_of_32(model: Path, ws: Path) -> list[str]:
    packed = key(model, r"experts\.3\.w2\.weight_packed$")
    scale = packed.replace("weight_packed", "weight_scale")
    rows = load_file(str(model / weight_map(model)[packed]))[packed].shape[0]

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[packed] = torch.zeros(rows, 24, dtype=torch.uint8)  # 48 codes a row
        t[scale] = torch.full((rows, 1), 127, dtype=torch.uint8)

    edit_shard(model, packed, edit)
    return []


def wrong_dtype(model: Path, ws: Path) -> list[str]:
    name = key(model, r"layers\.1\.input_layernorm\.weight$")
    set_tensor(model, name, torch.ones(load_file(str(model / weight_map(model)[name]))[name].shape, dtype=torch.int32))
    return []


def wrong_shape(model: Path, ws: Path) -> list[str]:
    name = key(model, r"layers\.1\.input_layernorm\.weight$")
    set_tensor(model, name, torch.ones(7, dtype=torch.bfloat16))
    return []


def extra_tensor(model: Path, ws: Path) -> list[str]:
    name = key(model, r"layers\.1\.input_layernorm\.weight$")
    extra = name.replace("input_layernorm", "stray_norm")
    edit_shard(model, name, lambda t: t.__setitem__(extra, torch.ones(4, dtype=torch.bfloat16)))
    return []


def expert_out_of_range(model: Path, ws: Path) -> list[str]:
    name = key(model, r"experts\.0\.w2\.weight_packed$")
    extra = name.replace("experts.0.", "experts.99.")

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[extra] = t[name].clone()
        t[extra.replace("weight_packed", "weight_scale")] = t[name.replace("weight_packed", "weight_scale")].clone()

    edit_shard(model, name, edit)
    return []


def unknown_quant_method(model: Path, ws: Path) -> list[str]:
    edit_config(model, lambda c: c["quantization_config"].__setitem__("quant_method", "mystery-quant"))
    return []


def bad_config_value(model: Path, ws: Path) -> list[str]:
    edit_config(model, lambda c: c["text_config"].__setitem__("num_attention_heads", "two"))
    return []


def missing_config_field(model: Path, ws: Path) -> list[str]:
    edit_config(model, lambda c: c["text_config"].pop("moe_intermediate_size"))
    return []


def wrong_model_type(model: Path, ws: Path) -> list[str]:
    return ["--model_type", "Kimi-Linear"]


def nan_in_linear(model: Path, ws: Path) -> list[str]:
    poison(model, r"layers\.0\.self_attn\.q_proj\.weight$", float("nan"))
    return []


def inf_in_latent_projection(model: Path, ws: Path) -> list[str]:
    poison(model, r"routed_expert_down_proj\.weight$", float("inf"))
    return []


def nan_in_norm(model: Path, ws: Path) -> list[str]:
    poison(model, r"layers\.2\.post_attention_layernorm\.weight$", float("nan"))
    return []


def infinite_part_file_size(model: Path, ws: Path) -> list[str]:
    return practice(ws, {"part_file_size: 4 ": "part_file_size: .inf "})


def huge_part_file_size(model: Path, ws: Path) -> list[str]:
    return practice(ws, {"part_file_size: 4 ": "part_file_size: 1.0e+300 "})


def infinite_scale_min(model: Path, ws: Path) -> list[str]:
    return practice(ws, {"scale_min: 1.0e-5": "scale_min: .inf"})


def nan_score(model: Path, ws: Path) -> list[str]:
    text = W4A8_PRACTICE.read_text()
    score = re.search(r"score: [0-9.]+", text).group(0)
    return practice(ws, {score: "score: .nan"})


def no_quantizer(model: Path, ws: Path) -> list[str]:
    text = W4A8_PRACTICE.read_text()
    entries = re.findall(r"    - type: linear_quant.*\n(?:      .*\n)*", text)
    assert len(entries) == 2, entries
    return practice(ws, {e: "" for e in entries})


def include_matches_nothing(model: Path, ws: Path) -> list[str]:
    text = W4A8_PRACTICE.read_text()
    first = re.search(r"include: \[[^\]]*\]", text).group(0)
    return practice(ws, {first: 'include: ["*no_such_module*"]'})


def practice_splits_fused_group(model: Path, ws: Path) -> list[str]:
    return practice(ws, {'        - "*.self_attn.k_proj"\n': ""})


def unknown_serving_target(model: Path, ws: Path) -> list[str]:
    return practice(ws, {"  runner: auto\n": "  runner: auto\n  target: vllm-ascend-9\n"})


def per_group_w4a8_under_0_27(model: Path, ws: Path) -> list[str]:
    """Routed experts W4A8 per group of 32 (vllm-ascend 0.26 loads it) asked for vllm-ascend 0.27 (bar 20)."""
    return [*practice(ws, {"weight: {scope: per_channel, dtype: int4, symmetric: true, method: gptq}":
                           "weight: {scope: per_group, dtype: int4, symmetric: true, method: gptq, "
                           "ext: {group_size: 32}}"}), "--target", "vllm-ascend-0.27"]


def kda_gate_alone_quantized(model: Path, ws: Path) -> list[str]:
    """KDA g_proj W8A8 with q/k/v/b/f_a FLOAT: vllm-ascend 0.27's in_proj_qkvgfab takes neither of its two layouts
    (bar 20); releases/v0.26.0rc runs g_proj as its own layer."""
    kda = ['        - "*.self_attn.q_proj"          # KDA q/k/v/o and MLA q/o\n', '        - "*.self_attn.k_proj"\n',
           '        - "*.self_attn.v_proj"\n', '        - "*.self_attn.b_proj"          # KDA beta and forget-gate input: '
           'vLLM fuses them with q/k/v\n', '        - "*.self_attn.f_a_proj"        # (in_proj_qkvgfab), so they take '
           'q/k/v\'s scheme\n']
    return practice(ws, {line: "" for line in kda})


def shared_experts_w4a8_per_channel(model: Path, ws: Path) -> list[str]:
    return practice(ws, {'      exclude: ["*shared_experts*"]\n': ""})


def huge_calibration_image(model: Path, ws: Path) -> list[str]:
    data = ws / "calib"
    data.mkdir()
    (data / "big.png").write_bytes(png_claiming(20000, 20000))
    (data / "index.jsonl").write_text('{"text": "a photo"}\n{"image": "big.png", "text": "what is this?"}\n')
    return practice(ws, {"dataset: calibImages": f"dataset: {data}"})


def save_parent_is_a_file(model: Path, ws: Path) -> list[str]:
    (ws / "plain_file").write_text("not a directory")
    return ["--save_path", str(ws / "plain_file" / "out")]


def missing_remote_code(model: Path, ws: Path) -> list[str]:
    (model / "modeling_kimi_k3.py").unlink()  # config.json's auto_map names it
    return []


def practice_alias_bomb(model: Path, ws: Path) -> list[str]:
    # nine levels of nine aliases: 9^9 = 387M strings in `include` from a few hundred bytes
    levels = ['a0: &a0 ["*x*", "*x*", "*x*", "*x*", "*x*", "*x*", "*x*", "*x*", "*x*"]']
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    path = ws / "bomb.yaml"
    path.write_text("\n".join(levels) + "\n" + W4A8_PRACTICE.read_text().replace('include: ["*experts.*"]',
                                                                                "include: *a9"))
    return ["--config_path", str(path)]


def practice_is_a_fifo(model: Path, ws: Path) -> list[str]:
    os.mkfifo(ws / "practice.yaml")  # opening it would wait for a writer forever
    return ["--config_path", str(ws / "practice.yaml")]


def shard_is_a_fifo(model: Path, ws: Path) -> list[str]:
    shard = model / weight_map(model)[key(model, r"experts\.0\.w1\.weight_packed$")]
    shard.unlink()
    os.mkfifo(shard)  # reading it would wait for a writer forever: quant must refuse it before opening it
    return []


def shard_is_a_fifo_under_plan(model: Path, ws: Path) -> list[str]:
    return [*shard_is_a_fifo(model, ws), "--plan"]


def label_its_quantizers_cannot_produce(model: Path, ws: Path) -> list[str]:
    # labelled w4a8, but its expert entry now writes int8 weights: hours of compute for a W8A8 model
    return practice(ws, {"weight: {scope: per_channel, dtype: int4": "weight: {scope: per_channel, dtype: int8"})


def label_its_quantizers_cannot_produce_under_plan(model: Path, ws: Path) -> list[str]:
    return [*label_its_quantizers_cannot_produce(model, ws), "--plan"]


def practice_is_dev_zero(model: Path, ws: Path) -> list[str]:
    return ["--config_path", "/dev/zero"]


def calibration_dataset_is_dev_zero(model: Path, ws: Path) -> list[str]:
    return ["--calibration_dataset", "/dev/zero"]


def too_many_glob_patterns(model: Path, ws: Path) -> list[str]:
    globs = ", ".join(f'"*layers.{i}.*"' for i in range(600))
    return practice(ws, {'include: ["*experts.*"]': f"include: [{globs}]"})


def too_many_fallback_patterns(model: Path, ws: Path) -> list[str]:
    (ws / "names.yaml").write_text("".join(f'- "*layers.{i}.*"\n' for i in range(600)))
    return [*practice(ws, {"  dataset:": "  fallback: [{to: FLOAT, names_file: names.yaml}]\n  dataset:"}), "--plan"]


def control_characters_in_tag(model: Path, ws: Path) -> list[str]:
    return ["--tag", "Atlas_A2\x1b[2J\n12:00:00 INFO forged line"]


def save_path_not_utf8(model: Path, ws: Path) -> list[str]:
    return ["--save_path", f"{ws}/out\udcff"]  # what Python makes of a shell's $'out\xff'


def overflowing_norm(model: Path, ws: Path) -> list[str]:
    # finite weights (the checkpoint check passes) whose product overflows bf16 in the first decoder layer
    name = key(model, r"layers\.0\.input_layernorm\.weight$")
    shape = load_file(str(model / weight_map(model)[name]))[name].shape
    set_tensor(model, name, torch.full(shape, 3.0e38, dtype=torch.bfloat16))
    return []


def overflowing_norm_with_min_max_weights(model: Path, ws: Path) -> list[str]:
    overflowing_norm(model, ws)
    return practice(ws, {"method: gptq}": "method: minmax}"})


def norm_epsilon_out_of_range(model: Path, ws: Path) -> list[str]:
    edit_config(model, lambda c: c["text_config"].__setitem__("rms_norm_eps", -1.0))
    return []


def expert_count_spelled_for_another_class(model: Path, ws: Path) -> list[str]:
    # accepted spelling, but the checkpoint's config class reads num_experts only
    edit_config(model, lambda c: c["text_config"].__setitem__("n_routed_experts", c["text_config"].pop("num_experts")))
    return []


FAULTS: dict[str, tuple[Fault, str]] = {
    "missing_shard": (missing_shard, r"shard model-\d+-of-\d+\.safetensors \(holding .*\) not found"),
    "truncated_shard": (truncated_shard, r"model-\d+-of-\d+\.safetensors: cannot read safetensors shard: .*incomplete"),
    "corrupt_header": (corrupt_header, r"model-00001-of-\d+\.safetensors: cannot read safetensors shard"),
    "index_points_outside": (index_points_outside, r"shard '\.\./elsewhere\.safetensors' .* lies outside"),
    "index_names_missing_tensor": (index_names_missing_tensor, r"layers\.0\.ghost\.weight .*missing from the shard"),
    "missing_tensor": (missing_tensor, r"tensor '.*layers\.1\.post_attention_layernorm\.weight' of unit layers\.1 "
                                       r"is missing"),
    "missing_mxfp4_scale": (missing_mxfp4_scale, r"experts\.3\.w2\.weight_packed has no matching .*weight_scale"),
    "nan_e8m0_scale": (nan_e8m0_scale, r"model-\d+-of-\d+\.safetensors: tensor .*experts\.3\.w2\.weight of unit "
                                       r"layers\.\d cannot be read: .*E8M0 NaN \(255\)"),
    "packed_width_not_multiple_of_32": (packed_width_not_multiple_of_32,
                                        r"experts\.3\.w2\.weight_packed has shape \(\d+, 24\); .*divisible by 32"),
    "wrong_dtype": (wrong_dtype, r"layers\.1\.input_layernorm\.weight is stored as I32; the model expects a float"),
    "wrong_shape": (wrong_shape, r"layers\.1\.input_layernorm\.weight has shape \(7,\); \w+ expects \(\d+,\)"),
    "extra_tensor": (extra_tensor, r"tensor .*layers\.1\.stray_norm\.weight belongs to no module"),
    "expert_out_of_range": (expert_out_of_range, r"experts\.99\.w2\.weight belongs to expert 99, but config\.json "
                                                 r"has num_experts=\d+"),
    "unknown_quant_method": (unknown_quant_method, r"config\.json: .*mystery-quant"),
    "bad_config_value": (bad_config_value, r"config\.json: text_config\.num_attention_heads must be a positive "
                                           r"integer, got 'two'"),
    "missing_config_field": (missing_config_field, r"config\.json: required key text_config\.moe_intermediate_size "
                                                   r"is missing"),
    "wrong_model_type": (wrong_model_type, r"--model_type Kimi-Linear but the config describes a multimodal model"),
    "nan_in_linear": (nan_in_linear, r"tensor .*layers\.0\.self_attn\.q_proj\.weight of unit layers\.0 has 1 "
                                     r"non-finite value"),
    "inf_in_latent_projection": (inf_in_latent_projection, r"routed_expert_down_proj\.weight of unit layers\.\d has 1 "
                                                           r"non-finite value"),
    "nan_in_norm": (nan_in_norm, r"layers\.2\.post_attention_layernorm\.weight of unit layers\.2 has 1 non-finite"),
    "infinite_part_file_size": (infinite_part_file_size, r"part_file_size: expected a finite number, got inf"),
    "huge_part_file_size": (huge_part_file_size, r"part_file_size must be a number of GiB in \(0, 1024\]"),
    "infinite_scale_min": (infinite_scale_min, r"scale_min: expected a finite number, got inf"),
    "nan_score": (nan_score, r"metadata\.score: expected a finite number, got nan"),
    "no_quantizer": (no_quantizer, r"metadata\.label promises w4a8, but no processor listed quantizes linears"),
    "include_matches_nothing": (include_matches_nothing, r"include \['\*no_such_module\*'\] .* selects none of "
                                                         r"the model's \d+ linears"),
    "practice_splits_fused_group": (practice_splits_fused_group,
                                    r"spec\.process: vllm-ascend-0\.27 runs \S+layers\.0\.self_attn\."
                                    r"in_proj_qkvgfab as one layer with one scheme, or q_proj, k_proj, v_proj of one "
                                    r"quantized scheme with g_proj, b_proj, f_a_proj FLOAT, but the practice splits it "
                                    r"\(\S+q_proj is W8A8_DYNAMIC; \S+k_proj is FLOAT\); include or exclude "
                                    r"b_proj, f_a_proj, g_proj, k_proj, q_proj, v_proj together$"),
    "unknown_serving_target": (unknown_serving_target, r"spec\.target: unknown serving target 'vllm-ascend-9'; the "
                                                       r"known ones are vllm-ascend-0\.26, vllm-ascend-0\.27"),
    "per_group_w4a8_under_0_27": (per_group_w4a8_under_0_27,
                                  r"spec\.process: \S+\.experts\.\d+\.w[123] would be W4A8_DYNAMIC per group of "
                                  r"32, which vllm-ascend-0\.27 refuses at load \(its W4A8_DYNAMIC is for MoE layers, per "
                                  r"channel\); quantize it per channel; --target vllm-ascend-0\.26 loads it"),
    "kda_gate_alone_quantized": (kda_gate_alone_quantized,
                                 r"spec\.process: vllm-ascend-0\.27 runs \S+layers\.0\.self_attn\.in_proj_qkvgfab "
                                 r"as one layer .* \(\S+q_proj is FLOAT; \S+g_proj is W8A8_DYNAMIC\); .*"
                                 r"--target vllm-ascend-0\.26 loads it"),
    "shared_experts_w4a8_per_channel": (shared_experts_w4a8_per_channel,
                                        r"spec\.process: \S+\.shared_experts\.\w+ would be W4A8_DYNAMIC per channel, "
                                        r"which vllm-ascend serves for routed experts only \(its W4A8 linear is "
                                        r"weight-only and per group\); include it in a W8A8_DYNAMIC entry"),
    "huge_calibration_image": (huge_calibration_image, r"index\.jsonl:2: image 'big\.png' is 20000x20000 = 400 M "
                                                       r"pixels, above the 89 M pixel limit"),
    "save_parent_is_a_file": (save_parent_is_a_file, r"--save_path .*plain_file/out: cannot create .*plain_file"),
    "missing_remote_code": (missing_remote_code, r"--model_path .*: modeling_kimi_k3\.py missing \(config\.json names "
                            r"it"),
    "practice_alias_bomb": (practice_alias_bomb, r"bomb\.yaml:2:\d+: invalid YAML: alias \*a0 \(aliases are not "
                            r"allowed"),
    "shard_is_a_fifo": (shard_is_a_fifo, r"shard model-\d+-of-\d+\.safetensors \(holding .*\) in \S+ is not a "
                                         r"regular file"),
    "shard_is_a_fifo_under_plan": (shard_is_a_fifo_under_plan, r"shard model-\d+-of-\d+\.safetensors .* is not a "
                                                               r"regular file"),
    "label_its_quantizers_cannot_produce": (label_its_quantizers_cannot_produce,
                                            r"the practice is labelled w4a8 \(metadata.label\), but its quantizers "
                                            r"give no linear W4A8_DYNAMIC or W4A8_MXFP: they give W8A8_DYNAMIC"),
    "label_its_quantizers_cannot_produce_under_plan": (label_its_quantizers_cannot_produce_under_plan,
                                                       r"the practice is labelled w4a8 \(metadata.label\)"),
    "too_many_fallback_patterns": (too_many_fallback_patterns, r"spec.fallback\[0\].names \(with names_file "
                                                               r"names.yaml\): 600 glob patterns, above the limit "
                                                               r"of 512"),
    "practice_is_a_fifo": (practice_is_a_fifo, r"practice path \S+practice\.yaml is not a regular file"),
    "practice_is_dev_zero": (practice_is_dev_zero, r"practice path /dev/zero is not a regular file"),
    "calibration_dataset_is_dev_zero": (calibration_dataset_is_dev_zero,
                                        r"calibration dataset /dev/zero is not a regular file"),
    "too_many_glob_patterns": (too_many_glob_patterns, r"practice\.yaml: spec\.process\[2\]\.include: 600 glob "
                               r"patterns, above the limit of 512"),
    "save_path_not_utf8": (save_path_not_utf8, r"--save_path b'\S+/out\\xff': the name is not valid UTF-8"),
    "overflowing_norm": (overflowing_norm, r"unit layers\.0: calibration activations became NaN/Inf in module "
                         r"\S+ \(record \d+ of this rank\); likely cause"),
    "overflowing_norm_with_min_max_weights": (overflowing_norm_with_min_max_weights,
                                              r"unit layers\.0: calibration activations became NaN/Inf in module "
                                              r"\S+ \(record \d+ of this rank\)"),
    "norm_epsilon_out_of_range": (norm_epsilon_out_of_range, r"config\.json: text_config\.rms_norm_eps must be a "
                                  r"number in \(0, 1\)"),
    "expert_count_spelled_for_another_class": (expert_count_spelled_for_another_class,
                                               r"config\.json: KimiLinearConfig reads num_experts and finds None"),
    "control_characters_in_tag": (control_characters_in_tag, r"--tag Atlas_A2\\x1b\[2J\\n12:00:00 INFO forged"),
}
# Found by the checker (opening the checkpoint and its header walk) before any tensor is read: test_checker.py.
CHECKER_FAULTS = ("missing_shard", "truncated_shard", "corrupt_header", "index_points_outside",
                  "index_names_missing_tensor", "missing_tensor", "missing_mxfp4_scale",
                  "packed_width_not_multiple_of_32", "wrong_dtype", "wrong_shape", "extra_tensor",
                  "expert_out_of_range", "unknown_quant_method")
