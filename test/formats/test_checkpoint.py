"""open_checkpoint: lazy multi-shard reading with MXFP4 decoded on the fly.

References: the tensors written by the generator (dense: exact equality) and compressed-tensors 0.20's
MXFP4PackedCompressor.decompress for every MXFP4 weight (bitwise equality, no tolerance).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
import torch
from ckpt_factory import write_checkpoint
from mxfp4_ct_reference import ct_decode, same_bits
from safetensors import safe_open

from msmodelslim.model.kimi_k3.mxfp4 import convert_mxfp4_to_bf16
from msmodelslim.source.checkpoint import CheckpointError, open_checkpoint

MINI = Path(__file__).resolve().parents[2] / ".." / "shared" / "models" / "kimi-linear-mini"


@pytest.fixture
def ckpt(tmp_path):
    dense, packed = write_checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt", dense, packed


def test_keys_are_logical_names(ckpt):
    path, dense, packed = ckpt
    reader = open_checkpoint(path)
    assert set(reader.keys()) == set(dense) | {m + ".weight" for m in packed}
    assert not any(k.endswith(("weight_packed", "weight_scale")) for k in reader.keys())
    expert = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    assert reader.is_mxfp4(expert) and not reader.is_mxfp4("lm_head.weight")
    assert reader.shape(expert) == (64, 96)
    assert sorted(reader.keys_with_prefix("model.layers.0.block_sparse_moe.experts.1.")) == [
        f"model.layers.0.block_sparse_moe.experts.1.{w}.weight" for w in ("w1", "w2", "w3")]


def test_get_dense_equals_written_and_mxfp4_equals_compressed_tensors(ckpt):
    path, dense, packed = ckpt
    reader = open_checkpoint(path)
    for name, tensor in dense.items():
        got = reader.get(name, "cpu")
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
    for module, (p, s) in packed.items():
        got = reader.get(module + ".weight", "cpu")
        assert got.dtype == torch.bfloat16 and same_bits(got, ct_decode(p, s)), module


def test_get_with_dtype(ckpt):
    path, dense, packed = ckpt
    reader = open_checkpoint(path)
    module, (p, s) = next(iter(packed.items()))
    assert torch.equal(reader.get(module + ".weight", "cpu", torch.float32), ct_decode(p, s).float())
    assert reader.get("lm_head.weight", "cpu", torch.float32).dtype == torch.float32


def test_single_file_checkpoint(tmp_path):
    dense, packed = write_checkpoint(tmp_path, single_file=True)
    reader = open_checkpoint(tmp_path)
    assert len(reader.keys()) == len(dense) + len(packed)
    module, (p, s) = next(iter(packed.items()))
    assert same_bits(reader.get(module + ".weight", "cpu"), ct_decode(p, s))


def test_nested_text_config_scheme_is_used(tmp_path):
    _, packed = write_checkpoint(tmp_path, nest_in_text_config=True, version="0.13.0", exponent_shift=2)
    reader = open_checkpoint(tmp_path)
    module, (p, s) = next(iter(packed.items()))
    assert reader.quant_scheme.exponent_bias == 125
    assert same_bits(reader.get(module + ".weight", "cpu"), ct_decode(p, s))


def test_compressed_tensors_0_13_checkpoint_decodes_like_0_20(tmp_path):
    # 0.13.0 wrote exponents 2 lower than the scale it used; the reader keys on the version.
    write_checkpoint(tmp_path / "v020", version="0.20.0")
    write_checkpoint(tmp_path / "v013", version="0.13.0", exponent_shift=2)
    new, old = open_checkpoint(tmp_path / "v020"), open_checkpoint(tmp_path / "v013")
    some = "model.layers.0.block_sparse_moe.experts.0.w1"
    new_scale, old_scale = new.get_stored(some + ".weight_scale"), old.get_stored(some + ".weight_scale")
    assert new_scale.shape == old_scale.shape  # else "not equal" could not fail
    assert not torch.equal(new_scale, old_scale)
    for name in new.keys():
        assert same_bits(old.get(name, "cpu"), new.get(name, "cpu")), name


def test_convert_mxfp4_to_bf16_keys_on_scheme_version(ckpt):
    _, _, packed = ckpt
    p, s = next(iter(packed.values()))
    ref = ct_decode(p, s)
    assert same_bits(convert_mxfp4_to_bf16(p, s), ref)
    assert same_bits(convert_mxfp4_to_bf16(p, s - 2, scheme_version="0.13.0", device="cpu"), ref)


def test_concurrent_get_from_two_threads(ckpt):
    path, _, packed = ckpt
    reader = open_checkpoint(path)
    names = reader.keys()
    results: dict[int, dict] = {0: {}, 1: {}}
    errors = []

    def work(tid):
        try:
            for name in (names if tid == 0 else names[::-1]):
                results[tid][name] = reader.get(name, "cpu")
        except Exception as exc:  # reported below: the test fails with it
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for name in names:
        assert same_bits(results[0][name], results[1][name])


def test_unknown_key_is_keyerror_naming_checkpoint(ckpt):
    path, _, _ = ckpt
    with pytest.raises(KeyError, match="model.safetensors.index.json.*nope.weight"):
        open_checkpoint(path).get("nope.weight", "cpu")


def test_missing_index_and_single_file(tmp_path):
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        open_checkpoint(tmp_path)


def test_index_pointing_to_missing_shard(ckpt):
    path, _, _ = ckpt
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="index.json: shard model-00002-of-00003.safetensors.*not found"):
        open_checkpoint(path)


def test_truncated_shard_is_named_when_the_checkpoint_is_opened(ckpt):
    # every header is read up front (the safetensors library also checks the file covers it): a run fails at
    # once, not when the layer holding the shard comes up hours later
    path, _, _ = ckpt
    shard = path / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model-00003-of-00003.safetensors: cannot read safetensors shard.*"
                                              "incomplete"):
        open_checkpoint(path)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/outside.safetensors", "sub/../../x.safetensors"])
def test_index_naming_a_file_outside_the_directory_is_refused(ckpt, name):
    path, _, _ = ckpt
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = name
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"shard {re.escape(repr(name))} \\(holding {first}\\) lies outside"):
        open_checkpoint(path)


def test_corrupt_header(tmp_path):
    write_checkpoint(tmp_path, single_file=True)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors.*header"):
        open_checkpoint(tmp_path)


def test_key_missing_from_its_shard(ckpt):
    path, _, _ = ckpt
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.ghost.weight"] = "model-00001-of-00003.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00001-of-00003.safetensors: tensor model.ghost.weight .*listed "
                                              "in model.safetensors.index.json but missing from the shard"):
        open_checkpoint(path)


def test_packed_without_scale(ckpt):
    path, _, _ = ckpt
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.0.block_sparse_moe.experts.0.w1.weight_scale"]
    index_path.write_text(json.dumps(index))
    reader = open_checkpoint(path)
    with pytest.raises(CheckpointError, match="experts.0.w1.weight_packed has no matching .*experts.0.w1.weight_scale"):
        reader.get("model.layers.0.block_sparse_moe.experts.0.w1.weight", "cpu")


def test_e8m0_nan_in_checkpoint_names_key(tmp_path):
    victim = "model.layers.1.block_sparse_moe.experts.2.w3"

    def tamper(stored):
        stored[victim + ".weight_scale"][5, 1] = 255

    write_checkpoint(tmp_path, tamper=tamper)
    with pytest.raises(ValueError, match=rf"{victim}\.weight.*255.*\(5, 1\)"):
        open_checkpoint(tmp_path).get(victim + ".weight", "cpu")


def test_other_compressed_format_is_an_error_on_get(tmp_path):
    groups = {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized", "weights": {}}}
    write_checkpoint(tmp_path, config_extra={"config_groups": groups, "format": "nvfp4-pack-quantized"})
    reader = open_checkpoint(tmp_path)
    assert torch.equal(reader.get("lm_head.weight", "cpu"), reader.get("lm_head.weight", "cpu"))  # dense fine
    with pytest.raises(ValueError, match="experts.0.w1.*nvfp4-pack-quantized"):
        reader.get("model.layers.0.block_sparse_moe.experts.0.w1.weight", "cpu")


# -- the real reference checkpoint -------------------------------------------------------------------------
needs_mini = pytest.mark.skipif(not (MINI / "config.json").is_file(), reason="../shared/models/kimi-linear-mini absent")


@needs_mini
def test_kimi_linear_mini_every_expert_equals_compressed_tensors():
    reader = open_checkpoint(MINI)
    index = json.loads((MINI / "model.safetensors.index.json").read_text())["weight_map"]
    experts = [k for k in reader.keys() if reader.is_mxfp4(k)]
    assert len(experts) == sum(k.endswith("weight_packed") for k in index) > 0
    handles = {}

    def stored(key):
        f = index[key]
        handles.setdefault(f, safe_open(str(MINI / f), "pt"))
        return handles[f].get_tensor(key)

    # compressed-tensors decodes row by row, so one call per weight shape on the row-stacked experts is the
    # same reference as one call per expert (and ~100x faster than 336 calls)
    by_shape: dict[tuple, list] = {}
    for name in experts:
        module = name.removesuffix(".weight")
        packed, scale = stored(module + ".weight_packed"), stored(module + ".weight_scale")
        by_shape.setdefault(tuple(packed.shape), []).append((name, packed, scale))
    for items in by_shape.values():
        ref = ct_decode(torch.cat([p for _, p, _ in items]), torch.cat([s for _, _, s in items]))
        ours = torch.cat([reader.get(name, "cpu") for name, _, _ in items])
        assert same_bits(ours, ref)
    dense = [k for k in reader.keys() if not reader.is_mxfp4(k)]
    for name in dense:
        assert torch.equal(reader.get(name, "cpu"), stored(name)), name


def _linked_copy(dst: Path) -> Path:
    dst.mkdir()
    for f in MINI.iterdir():
        (dst / f.name).symlink_to(f.resolve())
    return dst


@needs_mini
def test_kimi_linear_mini_missing_shard_is_named(tmp_path):
    path = _linked_copy(tmp_path / "mini")
    (path / "model-00003-of-00005.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00003-of-00005.safetensors.*not found"):
        open_checkpoint(path)


@needs_mini
def test_kimi_linear_mini_truncated_shard_is_named(tmp_path):
    path = _linked_copy(tmp_path / "mini")
    shard = path / "model-00004-of-00005.safetensors"
    data = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model-00004-of-00005.safetensors: cannot read safetensors shard"):
        open_checkpoint(path)


@needs_mini
def test_kimi_linear_mini_missing_key_is_named(tmp_path):
    path = _linked_copy(tmp_path / "mini")
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index_path.unlink()
    index["weight_map"]["model.layers.0.self_attn.q_proj.weight"] = "model-00005-of-00005.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00005-of-00005.safetensors.*self_attn.q_proj.weight.*missing"):
        open_checkpoint(path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_get_decodes_on_cuda(ckpt):
    path, _, packed = ckpt
    reader = open_checkpoint(path)
    module, (p, s) = next(iter(packed.items()))
    out = reader.get(module + ".weight", "cuda")
    assert out.device.type == "cuda" and same_bits(out.cpu(), ct_decode(p, s))
