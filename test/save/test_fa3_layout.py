"""The FA3 tensors and description entries we write, against msModelSlim 26.1.0's own output.

Reference: test/consumer/msmodelslim_fa3_reference.json, what msModelSlim wrote for a tiny DeepSeek-V3 (Kimi-K2)
model with three fa3_quant practices (docs/dev/facts/msmodelslim_26.1_fa3_layout.md says how it was produced).
Compared per attention, relative to its name: every FA tensor's name, safetensors dtype and shape (the head count
of the reference model replaced by ours), every FA description entry, and the top-level `fa_quant_type` /
`model_quant_type`. Exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ascendv1_toy import UNIT, ToyAdapter, make_layer, quantize, write_source_dir
from safetensors import safe_open

from msmodelslim.core.dist import SINGLE
from msmodelslim.processor.save.ascendv1_saver import AscendV1Saver, AscendV1SaverConfig
from msmodelslim.quant.attention import AttentionFakeQuant, AttentionQuantSpec

REFERENCE = json.loads((Path(__file__).resolve().parents[1] / "consumer" / "msmodelslim_fa3_reference.json")
                       .read_text())
REF_HEADS = REFERENCE["model"]["num_attention_heads"]
REF_ATTENTION = "model.layers.0.self_attn"
HEADS = 6
INT8, FP8 = AttentionQuantSpec("int8"), AttentionQuantSpec("fp8_e4m3")
PRACTICES = {  # the reference run -> what its fa3_quant entry asked for
    "int8_per_head": {"fa_q": INT8, "fa_k": INT8, "fa_v": INT8},
    "fp8_per_head": {"fa_q": FP8, "fa_k": FP8, "fa_v": FP8},
    "details_fp8": {"fa_q": AttentionQuantSpec("fp8_e4m3", "per_token"), "fa_k": FP8, "fa_v": FP8},
}
_ST = {torch.float32: "F32", torch.int8: "I8", torch.bfloat16: "BF16"}


def _ours(tmp_path: Path, specs: dict[str, AttentionQuantSpec]) -> tuple[dict, dict]:
    adapter = ToyAdapter(write_source_dir(tmp_path / "src"))
    layer = quantize(make_layer(), adapter)
    for branch, spec in specs.items():
        heads = HEADS if branch == "fa_q" else 1
        scale = torch.linspace(0.01, 0.02, heads) if spec.static else None
        setattr(layer.self_attn, branch, AttentionFakeQuant(spec, scale, observe_only=branch == "fa_v"))
    out = tmp_path / "out"
    saver = AscendV1Saver(AscendV1SaverConfig(), adapter, out, SINGLE)
    saver.save_unit(UNIT, layer)
    saver.finalize({})
    description = json.loads((out / "quant_model_description.json").read_text())
    tensors = {}
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return description, tensors


def _relative(names: dict, attention: str) -> dict:
    return {k[len(attention) + 1:]: v for k, v in names.items()
            if k.startswith(attention + ".fa_") or k == attention + ".quant_type"}


@pytest.mark.parametrize("run", sorted(PRACTICES))
def test_fa3_entries_are_msmodelslims(tmp_path, run):
    reference = REFERENCE["runs"][run]
    description, tensors = _ours(tmp_path, PRACTICES[run])
    attention = UNIT.prefix + "self_attn"

    def heads(shape: list[int], count: int) -> list:
        return ["heads" if d == count and count > 1 else d for d in shape]

    ref_tensors = {n: (t["dtype"], heads(t["shape"], REF_HEADS))
                   for n, t in _relative(reference["tensors"], REF_ATTENTION).items()}
    our_tensors = {n: (_ST[t.dtype], heads(list(t.shape), HEADS)) for n, t in _relative(tensors, attention).items()}
    assert our_tensors == ref_tensors
    assert _relative(description, attention) == _relative(reference["description"], REF_ATTENTION)
    for key in ("fa_quant_type", "model_quant_type"):
        assert description.get(key) == reference["description"].get(key), key
    assert not {"kv_cache_type", "kv_quant_type"} & set(description)
    offsets = [t for n, t in _relative(tensors, attention).items() if n.endswith(".offset")]
    assert offsets and all(not t.any() for t in offsets)


def _out_dir(tmp_path: Path) -> Path:
    _ours(tmp_path, PRACTICES["int8_per_head"])
    return tmp_path / "out"


def test_the_reader_serves_the_points_as_written(tmp_path):
    from msmodelslim.serving.ascendv1 import AscendV1Reader

    reader = AscendV1Reader(_out_dir(tmp_path))
    attention = UNIT.prefix + "self_attn"
    assert reader.attention_types == {attention: "INT8"}
    points = reader.attention_points(attention)
    assert points["fa_q"][0] == INT8 and torch.equal(points["fa_q"][1], torch.linspace(0.01, 0.02, HEADS))
    assert points["fa_k"][0] == INT8 and points["fa_k"][1].shape == (1,)
    assert not any(".fa_" in k for k in reader.keys())  # not model tensors: load_unit never sees them


@pytest.mark.parametrize("edit, message", [
    (lambda d, a: d.__setitem__(a + ".quant_type", "INT4"), r"self_attn\.quant_type: attention quant type 'INT4'"),
    (lambda d, a: d.__setitem__(a + ".fa_q.scale", "FAQuantum"), r"has unknown type 'FAQuantum'"),
])
def test_a_malformed_attention_entry_is_an_error_naming_it(tmp_path, edit, message):
    from msmodelslim.serving.ascendv1 import AscendV1Error, AscendV1Reader

    out = _out_dir(tmp_path)
    path = out / "quant_model_description.json"
    description = json.loads(path.read_text())
    edit(description, UNIT.prefix + "self_attn")
    path.write_text(json.dumps(description))
    with pytest.raises(AscendV1Error, match=message):
        AscendV1Reader(out)
