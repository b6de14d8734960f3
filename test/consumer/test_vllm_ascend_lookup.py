"""Our AscendV1 outputs loaded by their consumer: vllm-ascend 0.23.0.post1's own scheme lookup
(`AscendModelSlimConfig.get_quant_method`, run as shipped; only vLLM / torch_npu imports are stubbed) for every
layer vLLM builds and looks up (test/consumer/vllm_layers.py: vLLM 0.23 and 0.33, and vllm-ascend's own Kimi-K3
class of `releases/v0.26.0rc`), on the outputs of kimi-linear-mini and of the tiny Kimi-K3 stand-in.

Reference: the scheme our practice gave the layer's shards (the tensor entries of the description, e.g.
`gate_proj` + `up_proj` for a `gate_up_proj` layer, `experts.{e}.w{1,2,3}` for the routed experts); expected:
every lookup succeeds (no KeyError / ValueError) and resolves to exactly that scheme.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from msmodelslim.serving.fused import FUSED_RULES

from . import vllm_ascend_cpu as ascend
from .outputs import MINI, MX_PRACTICES
from .vllm_layers import V023, V026RC, V027, V033, serving_layers

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)

_MEMBERS = {rule.name: rule.members for rule in FUSED_RULES} | {"fused_qkv_a_g_proj": FUSED_RULES[1].members}


def practice_scheme(description: dict[str, str], prefix: str) -> str:
    """The scheme our description gives the tensors a vLLM layer is loaded from."""
    proj = prefix.rsplit(".", 1)[-1]
    if proj == "experts":
        pattern = re.compile(re.escape(prefix) + r"\.\d+\.w[123]\.weight$")
        values = {v for k, v in description.items() if pattern.match(k)}
    elif proj in _MEMBERS:
        parent = prefix.rsplit(".", 1)[0]
        values = {description[f"{parent}.{m}.weight"] for m in _MEMBERS[proj]
                  if f"{parent}.{m}.weight" in description}
    else:
        values = {description[f"{prefix}.weight"]}
    assert len(values) == 1, (prefix, values)
    return values.pop()


def resolved_scheme(vllm_ascend, config, prefix: str, kind: str) -> str:
    """What vllm-ascend's get_quant_method picks for a layer of `kind` at `prefix` (FLOAT: unquantized)."""
    layer = {"linear": ascend.LinearBase, "moe": ascend.FusedMoE, "lm_head": ascend.VocabParallelEmbedding}[kind]()
    layer.moe_config = SimpleNamespace()
    method = config.get_quant_method(layer, prefix)
    scheme = getattr(method, "quant_method", None)
    if scheme is None:
        return "FLOAT"
    names = {qtype for (qtype, _), cls in vllm_ascend.SCHEME_REGISTRY.items() if cls is type(scheme)}
    assert len(names) == 1, names
    return names.pop()


def lookup_failures(vllm_ascend, out: Path, spec: dict) -> tuple[int, list[str]]:
    """(layers looked up, one line per failing lookup) for one output and one vLLM version's model."""
    description = json.loads((out / "quant_model_description.json").read_text())
    config_json = json.loads((out / "config.json").read_text())
    multimodal = "text_config" in config_json
    text = config_json["text_config"] if multimodal else config_json
    model_type = config_json.get("model_type", "kimi_linear") if multimodal else "kimi_linear"
    config = vllm_ascend.AscendModelSlimConfig(dict(description))
    ascend.set_vllm_config("kimi_k3" if multimodal else model_type, config)
    config.packed_modules_mapping = dict(spec["packed_modules_mapping"])  # what vLLM's model class puts there
    if multimodal and "k3_prefix_mapper" in spec:
        mapper = ascend.WeightsMapper(orig_to_new_prefix=spec["k3_prefix_mapper"])
        config.apply_vllm_mapper(mapper)
        description = mapper.apply_dict(description)  # the reference reads the names the engine looks up
    vision = spec is V026RC and multimodal  # that class looks the vision tower's linears up too
    layers = serving_layers(spec, text, "language_model." if multimodal else "",
                            vision_blocks=config_json["vision_config"]["vt_num_hidden_layers"] if vision else 0)
    failures = []
    for prefix, kind in layers:
        try:
            got = resolved_scheme(vllm_ascend, config, prefix, kind)
        except (KeyError, ValueError, NotImplementedError) as exc:
            failures.append(f"{prefix}: {type(exc).__name__} {exc}")
            continue
        want = "FLOAT" if kind == "lm_head" and f"{prefix}.weight" not in description else \
            practice_scheme(description, prefix)
        if got != want:
            failures.append(f"{prefix}: vllm-ascend picks {got}, the practice wrote {want}")
    return len(layers), failures


@pytest.mark.skipif(not (MINI / "config.json").is_file(), reason=f"{MINI} not available")
@pytest.mark.parametrize("spec", [V023, V033], ids=["vllm0.23", "vllm0.33"])
@pytest.mark.parametrize("quant_type", ["w4a8c8", "w8a8"])
def test_every_kimi_linear_layer_resolves_to_the_practice_scheme(vllm_ascend, outputs, spec, quant_type):
    count, failures = lookup_failures(vllm_ascend, outputs[("mini", quant_type)], spec)
    assert count > 50 and failures == [], "\n".join(failures)


@pytest.mark.parametrize("quant_type", ["w4a8c8", "w8a8"])
def test_every_tiny_kimi_k3_text_layer_resolves_to_the_practice_scheme(vllm_ascend, outputs, quant_type):
    # the stand-in follows vLLM 0.33's Kimi-K3 (latent MoE, q-LoRA MLA with the output gate, full-rank KDA gate)
    count, failures = lookup_failures(vllm_ascend, outputs[("tiny_k3", quant_type)], V033)
    assert count > 30 and failures == [], "\n".join(failures)


@pytest.mark.parametrize("quant_type", ["w4a8c8", "w8a8", "w4a8_upstream", "w4a8_pergroup", *MX_PRACTICES])
def test_every_tiny_kimi_k3_layer_resolves_in_vllm_ascends_own_kimi_k3_class(vllm_ascend, outputs, quant_type):
    # the layers of releases/v0.26.0rc's AscendKimiK3ForConditionalGeneration (vllm_layers.V026RC), vision included
    count, failures = lookup_failures(vllm_ascend, outputs[("tiny_k3", quant_type)], V026RC)
    assert count > 40 and failures == [], "\n".join(failures)


def test_a_fallback_output_resolves_every_layer_to_its_mixed_schemes(vllm_ascend, fallback_output):
    """spec.fallback (test/consumer/outputs.py FALLBACK, on the C8 practice, whose target is vllm-ascend-0.26): the
    named linears and their fused groups under that target's classes (KDA q/k/v as `fused_qkv`, MLA q_a + kv_a)
    changed scheme, one scheme per serving layer, and vllm-ascend resolves every layer to what the description
    says."""
    description = json.loads((fallback_output / "quant_model_description.json").read_text())
    lm = "language_model.model.layers"
    assert {v for k, v in description.items() if re.match(rf"{lm}\.1\..*experts\.\d+\.w[123]\.weight$", k)} \
        == {"W8A8_DYNAMIC"}
    assert {v for k, v in description.items() if re.match(rf"{lm}\.2\..*experts\.\d+\.w[123]\.weight$", k)} \
        == {"W4A8_DYNAMIC"}
    for member in ("q_proj", "k_proj", "v_proj"):  # fused_qkv; b/f_a/g are layers of their own there
        assert description[f"{lm}.0.self_attn.{member}.weight"] == "FLOAT", member
    for member in ("b_proj", "f_a_proj", "g_proj"):
        assert description[f"{lm}.0.self_attn.{member}.weight"] == "W8A8_DYNAMIC", member
    for member in ("q_a_proj", "kv_a_proj_with_mqa"):  # fused_qkv_a_proj; the MLA output gate is a layer of its own
        assert description[f"{lm}.3.self_attn.{member}.weight"] == "FLOAT", member
    assert description[f"{lm}.3.self_attn.g_proj.weight"] == "W8A8_DYNAMIC"
    assert description[f"{lm}.2.self_attn.o_proj.weight"] == "FLOAT"
    assert description[f"{lm}.1.self_attn.o_proj.weight"] == "W8A8_DYNAMIC"
    count, failures = lookup_failures(vllm_ascend, fallback_output, V026RC)  # the practice's target's classes
    assert count > 30 and failures == [], "\n".join(failures)


def mtp_drafter_layers(spec: dict, text: dict, block: str = "") -> list[tuple[str, str, str]]:
    """(drafter prefix, kind, our name of the same layer) of every layer an MTP drafter builds and looks up: MTP
    layer N+k at `model.layers.{N+k}.` (vllm-ascend 0.27's AscendKimiK3MTP, models/kimi_k3_mtp.py:49-53,69), its
    decoder block at `model.layers.{N+k}.mtp_block.` for vLLM 0.33's (`block`; models/kimi_k3/nvidia/mtp.py:71-173,
    426-457), by the same layer rules as the main model (its index selects MLA / MoE)."""
    n = int(text["num_hidden_layers"])
    extended = {**text, "num_hidden_layers": n + int(text.get("num_nextn_predict_layers", 0))}
    out = []
    for prefix, kind in serving_layers(spec, extended, "language_model."):
        match = re.match(r"language_model\.model\.layers\.(\d+)\.(.+)$", prefix)
        if match and int(match.group(1)) >= n:
            out.append((f"model.layers.{match.group(1)}.{block}{match.group(2)}", kind, prefix))
    return out


@pytest.mark.parametrize("practice", ["w4a8c8", "w4a4c8_mxfp"])
def test_every_kimi_k3_mtp_drafter_layer_resolves_to_the_practice_scheme(vllm_ascend, outputs, practice):
    # The default target's drafter (vllm-ascend 0.27, V027), looked up with the packed modules of the main model, as
    # its real class does (bench/consumer_k3.py builds AscendKimiK3MTP: its fused_qkv_a_proj resolves through them).
    out = outputs[("tiny_k3", practice)]
    description = json.loads((out / "quant_model_description.json").read_text())
    text = json.loads((out / "config.json").read_text())["text_config"]
    config = vllm_ascend.AscendModelSlimConfig(dict(description))
    ascend.set_vllm_config("kimi_k3_mtp", config)
    config.packed_modules_mapping = dict(V027["packed_modules_mapping"])
    layers = mtp_drafter_layers(V027, text)
    assert len(layers) >= 8
    failures = []
    for prefix, kind, ours in layers:
        try:
            got = resolved_scheme(vllm_ascend, config, prefix, kind)
        except (KeyError, ValueError, NotImplementedError) as exc:
            failures.append(f"{prefix}: {type(exc).__name__} {exc}")
            continue
        if got != practice_scheme(description, ours):
            failures.append(f"{prefix}: vllm-ascend picks {got}, the practice wrote {practice_scheme(description, ours)}")
    assert failures == [], "\n".join(failures)
