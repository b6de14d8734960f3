"""ascendv1_saver output layout, sharding, rank-local writing + merge, and the reader round trip."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from ascendv1_toy import HIDDEN, INTER, N_EXPERTS, UNIT, ToyAdapter, make_layer, quantize, write_source_dir
from safetensors import safe_open

from msmodelslim.core.dist import SINGLE, DistContext
from msmodelslim.pipeline.answers import run_processor
from msmodelslim.processor.base import UnitContext
from msmodelslim.processor.linear_quant import LinearQuantConfig, LinearQuantProcessor
from msmodelslim.processor.save.ascendv1_saver import AscendV1Saver, AscendV1SaverConfig
from msmodelslim.processor.save.base import SAVERS
from msmodelslim.quant import QuantLinear, dequantize, unpack_int4
from msmodelslim.serving.ascendv1 import DESCRIPTION_NAME, INDEX_NAME, AscendV1Error, AscendV1Reader

P = UNIT.prefix


def _save(tmp_path: Path, part_file_size: float = 4.0, metadata: dict | None = None):
    src = write_source_dir(tmp_path / "src")
    adapter = ToyAdapter(src)
    layer = quantize(make_layer(), adapter)
    out = tmp_path / "out"
    saver = AscendV1Saver(AscendV1SaverConfig(part_file_size=part_file_size), adapter, out, SINGLE)
    saver.save_unit(UNIT, layer)
    saver.finalize(metadata or {})
    return out, layer


def _stored(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / INDEX_NAME).read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def test_registered_under_yaml_type():
    assert SAVERS["ascendv1_saver"] is AscendV1Saver and AscendV1Saver.config_cls is AscendV1SaverConfig


def test_layout_names_dtypes_shapes_and_description(tmp_path):
    """W8A8: int8 [out,in] + fp32 scale/offset [out,1]; W4A8: int8 [out/2,in] packed + scale_bias; FLOAT keeps the
    source dtype (bf16 weights, fp32 A_log); description covers every tensor; exact equality with the module."""
    out, layer = _save(tmp_path, metadata={"quarot": {"seed": 3}})
    t = _stored(out)
    desc = json.loads((out / DESCRIPTION_NAME).read_text())
    assert desc["model_quant_type"] == "W8A8_DYNAMIC"  # a W4A8 mix, labelled as msModelSlim labels it
    assert desc["version"] == "1.0.0" and desc["group_size"] == 0
    assert desc["metadata"]["quarot"] == {"seed": 3}
    # what `msmodelslim eval` checks
    assert set(desc["metadata"]["source"]) == {"config_sha256", "index_sha256", "tensors_sha256"}
    tensor_types = {k: v for k, v in desc.items()
                    if k not in ("model_quant_type", "version", "group_size", "metadata", "optional")}
    assert set(tensor_types) == set(t)

    q = P + "self_attn.q_proj"  # W8A8 with bias
    ql: QuantLinear = layer.self_attn.q_proj
    assert t[q + ".weight"].dtype == torch.int8 and t[q + ".weight"].shape == (HIDDEN, HIDDEN)
    assert torch.equal(t[q + ".weight"], ql.qweight)
    assert t[q + ".weight_scale"].dtype == torch.float32 and t[q + ".weight_scale"].shape == (HIDDEN, 1)
    assert torch.equal(t[q + ".weight_scale"], ql.weight_scale)
    assert torch.equal(t[q + ".weight_offset"], torch.zeros(HIDDEN, 1))
    assert t[q + ".bias"].dtype == torch.bfloat16 and q + ".scale_bias" not in t
    assert {tensor_types[q + s] for s in (".weight", ".weight_scale", ".weight_offset")} == {"W8A8_DYNAMIC"}
    assert tensor_types[q + ".bias"] == "FLOAT"  # the bias stays float at run time (msModelSlim describes it so)

    w1 = P + "block_sparse_moe.experts.1.w1"  # W4A8 column-parallel
    e1 = layer.block_sparse_moe.experts["1"].w1
    assert t[w1 + ".weight"].dtype == torch.int8 and t[w1 + ".weight"].shape == (INTER // 2, HIDDEN)
    assert torch.equal(unpack_int4(t[w1 + ".weight"], dim=0), e1.qweight)
    ref_sb = 8 * (e1.qweight.double() * e1.weight_scale.double()).sum(1, keepdim=True)
    assert t[w1 + ".scale_bias"].dtype == torch.float32 and t[w1 + ".scale_bias"].shape == (INTER, 1)
    torch.testing.assert_close(t[w1 + ".scale_bias"].double(), ref_sb, rtol=1e-6, atol=1e-6)
    assert tensor_types[w1 + ".weight"] == "W4A8_DYNAMIC"

    w2 = P + "block_sparse_moe.experts.0.w2"  # W4A8 row-parallel: 16 input slices, summing to 8 * row sum
    e2 = layer.block_sparse_moe.experts["0"].w2
    sb = t[w2 + ".scale_bias"]
    assert sb.shape == (HIDDEN, 16) and t[w2 + ".weight"].shape == (HIDDEN // 2, INTER)
    deq = e2.qweight.double() * e2.weight_scale.double()
    torch.testing.assert_close(sb.double(), 8 * deq.reshape(HIDDEN, 16, INTER // 16).sum(-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sb.double().sum(1, keepdim=True), 8 * deq.sum(1, keepdim=True), rtol=1e-6, atol=1e-6)

    down = P + "block_sparse_moe.shared_experts.down_proj"  # W8A8 with an online rotation
    assert torch.equal(t[down + ".online_rotation"], layer.block_sparse_moe.shared_experts.down_proj.online_rotation)
    assert tensor_types[down + ".online_rotation"] == "W8A8_DYNAMIC"

    assert t[P + "self_attn.A_log"].dtype == torch.float32 and tensor_types[P + "self_attn.A_log"] == "FLOAT"
    assert t[P + "block_sparse_moe.gate.weight"].dtype == torch.bfloat16
    assert tensor_types[P + "block_sparse_moe.gate.weight"] == "FLOAT"
    assert tensor_types[P + "input_layernorm.weight"] == "FLOAT"


def test_model_files_copied_and_quantization_config_removed(tmp_path):
    out, _ = _save(tmp_path)
    names = set(os.listdir(out))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "modeling_toy.py", "chat_template.jinja"} <= names
    assert "model.safetensors.index.json" not in names and "README.md" not in names and "model.safetensors" not in names
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]
    assert config["text_config"]["hidden_size"] == HIDDEN
    assert not [n for n in names if n.startswith(".")]  # no temporary shards or partial indexes left


def test_single_file_vs_multi_shard_by_part_file_size(tmp_path):
    """Default 4 GiB -> one shard, numbered -00001-of-00001 as msModelSlim names it; a tiny limit -> k-of-N shards,
    same tensors."""
    out1, _ = _save(tmp_path / "a")
    assert sorted(n for n in os.listdir(out1) if n.endswith(".safetensors")) == [
        "quant_model_weights-00001-of-00001.safetensors"]
    out2, _ = _save(tmp_path / "b", part_file_size=4000 / 1024**3)  # ~4 KB per shard
    shards = sorted(n for n in os.listdir(out2) if n.endswith(".safetensors"))
    total = len(shards)
    assert total > 3 and shards == [f"quant_model_weights-{k:05d}-of-{total:05d}.safetensors"
                                    for k in range(1, total + 1)]
    index = json.loads((out2 / INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    t1, t2 = _stored(out1), _stored(out2)
    assert set(t1) == set(t2) and all(torch.equal(t1[k], t2[k]) for k in t1)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in t2.values())
    assert list(index["weight_map"]) == sorted(index["weight_map"])


def test_reader_round_trip_gives_dequantised_weights_exactly(tmp_path):
    """AscendV1Reader.get('X.weight') == q * scale of the module (bit-exact float32); floats read back as saved."""
    out, layer = _save(tmp_path)
    reader = AscendV1Reader(out)
    for live, mod in layer.named_modules():
        if isinstance(mod, QuantLinear):
            name = P + live
            assert torch.equal(reader.get(name + ".weight", dtype=torch.float32),
                               dequantize(mod.qweight, mod.weight_scale))
            assert torch.equal(reader.get(name + ".weight"), dequantize(mod.qweight, mod.weight_scale, dtype=torch.bfloat16))
            q, s = reader.quantized_weight(name)
            assert torch.equal(q, mod.qweight) and torch.equal(s, mod.weight_scale)
            assert reader.quant_type(name) == mod.scheme.name
    assert torch.equal(reader.get(P + "block_sparse_moe.gate.weight"), layer.block_sparse_moe.gate.weight)
    assert reader.quant_type(P + "block_sparse_moe.gate") == "FLOAT"
    rot = reader.online_rotation(P + "block_sparse_moe.shared_experts.down_proj")
    assert torch.equal(rot, layer.block_sparse_moe.shared_experts.down_proj.online_rotation)
    assert reader.online_rotation(P + "self_attn.q_proj") is None
    keys = reader.keys()  # logical names only: what a model's state dict has
    assert P + "self_attn.q_proj.weight" in keys and P + "self_attn.q_proj.bias" in keys
    assert not [k for k in keys if k.endswith(("weight_scale", "weight_offset", "scale_bias", "online_rotation"))]


def test_reader_errors_name_the_problem(tmp_path):
    out, _ = _save(tmp_path)
    desc = json.loads((out / DESCRIPTION_NAME).read_text())
    desc[P + "self_attn.A_log"] = "W3A3"
    (out / DESCRIPTION_NAME).write_text(json.dumps(desc))
    with pytest.raises(AscendV1Error, match="W3A3"):
        AscendV1Reader(out)
    (out / DESCRIPTION_NAME).unlink()
    with pytest.raises(AscendV1Error, match=DESCRIPTION_NAME):
        AscendV1Reader(out)
    out2, _ = _save(tmp_path / "b")
    (out2 / "quant_model_weights-00001-of-00001.safetensors").unlink()
    with pytest.raises(AscendV1Error, match="missing"):
        AscendV1Reader(out2)
    with pytest.raises(AscendV1Error, match="quant_model_description"):
        AscendV1Reader(tmp_path / "nowhere")


def test_bad_saver_config_names_the_field():
    for bad, key in (({"part_file_size": 0}, "part_file_size"), ({"float_dtype": "int8"}, "float_dtype"),
                     ({"row_parallel_splits": 0}, "row_parallel_splits")):
        with pytest.raises(ValueError, match=key):
            AscendV1SaverConfig.build(**bad)


# --- two ranks (gloo on CPU): rank r holds expert r; replicated tensors only from rank 0 -----------------------
def _worker(rank: int, world: int, port: int, src: str, out: str, part: float) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch_dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dist = DistContext(rank=rank, world_size=world)
        adapter = ToyAdapter(Path(src))
        layer = quantize(make_layer(experts=[rank]), adapter, dist)
        saver = AscendV1Saver(AscendV1SaverConfig(part_file_size=part), adapter, Path(out), dist)
        saver.save_unit(UNIT, layer)
        saver.finish_rank()
        dist.barrier()  # what the runner does between the two steps
        if dist.is_main:
            saver.merge({"m": 1})
    finally:
        torch_dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("part", [4.0, 3000 / 1024**3])
def test_two_rank_output_equals_single_process_output(tmp_path, part):
    """Reference: the single-process save of the full layer; the 2-rank merge must give the same index names,
    description (byte-identical JSON) and tensors (exact)."""
    single, _ = _save(tmp_path / "single", part_file_size=part, metadata={"m": 1})
    src = write_source_dir(tmp_path / "src")
    out = tmp_path / "dp"
    mp.spawn(_worker, args=(2, _free_port(), str(src), str(out), part), nprocs=2, join=True)
    assert (out / DESCRIPTION_NAME).read_text() == (single / DESCRIPTION_NAME).read_text()
    t_dp, t_single = _stored(out), _stored(single)
    assert set(t_dp) == set(t_single)
    assert all(torch.equal(t_dp[k], t_single[k]) for k in t_single)
    index = json.loads((out / INDEX_NAME).read_text())
    assert list(index["weight_map"]) == sorted(t_single)
    assert not [n for n in os.listdir(out) if n.startswith(".")]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_tensor_from_a_processor_is_refused_by_name_and_nothing_is_written(tmp_path, value):
    from msmodelslim.processor.save.ascendv1_saver import NonFiniteError

    src = write_source_dir(tmp_path / "src")
    adapter = ToyAdapter(src)
    layer = quantize(make_layer(), adapter)
    norm = next(m for m in layer.modules() if not isinstance(m, QuantLinear) and getattr(m, "weight", None) is not None
                and m.weight.dim() == 1)
    norm.weight.data[0] = value  # what a processor dividing by a zero statistic would leave behind
    out = tmp_path / "out"
    saver = AscendV1Saver(AscendV1SaverConfig(), adapter, out, SINGLE)
    with pytest.raises(NonFiniteError, match=r"tensor \S+\.weight has 1 non-finite value\(s\) \(NaN/Inf\) after "
                                             r"processing"):
        saver.save_unit(UNIT, layer)
    assert not list(out.glob("*.safetensors"))


def test_a_per_group_linear_as_wide_as_one_group_is_written_in_the_per_group_layout(tmp_path):
    # Issue 32 case (a): the toy experts' w1 / w3 have 32 inputs, one group of 32. Reference: the header says group
    # 32, so every W4A8 per-group linear carries weight_scale_second [out, in / 32] and weight_scale ones (what
    # vllm-ascend's per-group loader reads; before, these were written per channel under a per-group header).
    src = write_source_dir(tmp_path / "src")
    adapter = ToyAdapter(src)
    layer = make_layer()
    ctx = UnitContext(UNIT, layer, adapter, SINGLE, run_samples=lambda: None)
    per_group = {"act": {"dtype": "int8"},
                 "weight": {"dtype": "int4", "method": "minmax", "scope": "per_group", "ext": {"group_size": 32}}}
    run_processor(LinearQuantProcessor(LinearQuantConfig.build(qconfig=per_group, include=["*experts.*.w1",
                                                                                            "*experts.*.w3"])), ctx)
    out = tmp_path / "out"
    saver = AscendV1Saver(AscendV1SaverConfig(), adapter, out, SINGLE)
    saver.save_unit(UNIT, layer)
    saver.finalize({})
    description = json.loads((out / DESCRIPTION_NAME).read_text())
    stored = _stored(out)
    assert description["group_size"] == 32
    for e in range(N_EXPERTS):
        for w in ("w1", "w3"):
            name = f"{P}block_sparse_moe.experts.{e}.{w}"
            assert description[f"{name}.weight"] == "W4A8_DYNAMIC"
            assert stored[f"{name}.weight_scale_second"].shape == (INTER, HIDDEN // 32)
            assert torch.equal(stored[f"{name}.weight_scale"], torch.ones(INTER, 1))
            assert torch.equal(stored[f"{name}.weight_offset_second"], torch.zeros(INTER, HIDDEN // 32))
