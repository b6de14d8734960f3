"""make_checkpoint.py writes a Kimi-K3 weight directory that loads only through trust_remote_code and runs.

References: the remote modeling code built on the meta device (which tensors must exist, with which shapes),
compressed-tensors' own FP4 unpacking (MXFP4 payload), transformers' native KimiLinearTopkRouter (routing), and
the stand-in itself in float32 (padding / cache equivalences, atol 1e-4 on logits of std ~0.2).
Forward passes run under msmodelslim.model.kimi_k3.runtime_patches (torch kernels for FLA's Triton ones).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from standin_helpers import SHARED, load_dense_state_dict, make_checkpoint_module, stored_tensor_info

from msmodelslim.model.kimi_k3.runtime_patches import runtime_patches

IMAGE = SHARED / "data" / "images" / "astronaut.jpg"


@pytest.fixture(scope="module")
def mc():
    return make_checkpoint_module()


@pytest.fixture(scope="module")
def tiny(mc, tmp_path_factory) -> tuple[Path, dict, float]:
    out = tmp_path_factory.mktemp("k3") / "Kimi-K3-tiny"
    t0 = time.process_time()  # CPU seconds: wall time depends on what else the machine runs
    summary = mc.make_checkpoint(out, preset="tiny", seed=0)
    return out, summary, time.process_time() - t0


def _load(model_dir: Path, dtype=torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    model.load_state_dict(load_dense_state_dict(model_dir, torch.bfloat16), strict=True)
    return model.to(dtype).eval()


def _small_image(size=(112, 84)):
    from PIL import Image

    if not IMAGE.is_file():
        pytest.skip(f"{IMAGE} not available")
    with Image.open(IMAGE) as im:
        return im.convert("RGB").resize(size)


# ---- directory ---------------------------------------------------------------------------------------------------
def test_tiny_generates_in_seconds_and_loads_through_auto_classes(tiny):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoProcessor, AutoTokenizer

    out, summary, seconds = tiny
    assert seconds < 20 and summary["n_shards"] >= 2
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert type(config).__name__ == "KimiK3Config" and config.model_type == "kimi_k3"
    assert type(config.get_text_config()).__name__ == "KimiLinearConfig"
    assert config.get_text_config().get_text_config() is config.text_config
    assert config.architectures == ["KimiK3ForConditionalGeneration"]
    for auto in (AutoModel, AutoModelForCausalLM):
        with torch.device("meta"):
            model = auto.from_config(config, trust_remote_code=True)
        assert type(model).__name__ == "KimiK3ForConditionalGeneration"
        assert type(model.language_model).__name__ == "KimiLinearForCausalLM"
    processor = AutoProcessor.from_pretrained(out, trust_remote_code=True)
    assert type(processor).__name__ == "KimiK3Processor" and processor.image_token == "<|kimi_image_placeholder|>"
    assert processor.media_pad_id == config.media_placeholder_token_id
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert [tok.convert_tokens_to_ids(t) for t in
            ("[PAD]", "[BOS]", "[EOS]", "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
             "<|kimi_image_placeholder|>")] == list(range(8))
    text = "def f(x):\n    return x * 2  # doubles\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 0)


def test_index_lists_every_model_tensor_with_checkpoint_shape_and_dtype(tiny):
    from transformers import AutoConfig, AutoModel

    out, _, _ = tiny
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    with torch.device("meta"):
        model = AutoModel.from_config(config, trust_remote_code=True)
    expected = {}
    for name, t in model.state_dict().items():
        if re.search(r"block_sparse_moe\.experts\.\d+\.w[123]\.weight$", name):
            o, i = t.shape
            base = name[: -len(".weight")]
            expected[base + ".weight_packed"] = ((o, i // 2), "U8")
            expected[base + ".weight_scale"] = ((o, i // 32), "U8")
        else:
            expected[name] = (tuple(t.shape), "BF16")
    stored = stored_tensor_info(out)
    assert stored == expected
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(
        torch.Size(s).numel() * (2 if d == "BF16" else 1) for s, d in stored.values())
    # Names the toolkit relies on.
    for name in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
                 "language_model.model.norm.weight", "vision_tower.patch_embed.proj.weight",
                 "vision_tower.patch_embed.pos_emb.weight", "vision_tower.encoder.blocks.1.wqkv.weight",
                 "vision_tower.encoder.final_layernorm.weight", "mm_projector.proj.0.weight",
                 "mm_projector.proj.2.weight", "mm_projector.post_norm.weight",
                 "language_model.model.layers.0.mlp.gate_proj.weight",
                 "language_model.model.layers.0.self_attn.q_conv1d.weight",
                 "language_model.model.layers.0.self_attention_res_proj.weight",
                 "language_model.model.output_attn_res_proj.weight",
                 "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
                 "language_model.model.layers.3.self_attn.g_proj.weight",
                 "language_model.model.layers.3.block_sparse_moe.routed_expert_down_proj.weight",
                 "language_model.model.layers.3.block_sparse_moe.routed_expert_norm.weight",
                 "language_model.model.layers.3.block_sparse_moe.routed_expert_up_proj.weight",
                 "language_model.model.layers.4.eh_proj.weight",
                 "language_model.model.layers.4.block_sparse_moe.experts.15.w1.weight_packed",
                 "language_model.model.layers.3.block_sparse_moe.gate.e_score_correction_bias",
                 "language_model.model.layers.3.block_sparse_moe.shared_experts.down_proj.weight",
                 "language_model.model.layers.3.block_sparse_moe.experts.15.w2.weight_packed"):
        assert name in stored, name


def test_quantization_config_targets_exactly_the_expert_linears(tiny):
    out, _, _ = tiny
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["format"], q["version"]) == ("compressed-tensors", "mxfp4-pack-quantized", "0.20.0")
    (group,) = q["config_groups"].values()
    assert group["weights"]["group_size"] == 32 and q["ignore"] == ["lm_head"]
    (target,) = group["targets"]
    pattern = re.compile(target.removeprefix("re:"))
    modules = {k.rsplit(".", 1)[0] for k in stored_tensor_info(out)}
    quantized = {m for m in modules if pattern.match(m)}
    packed = {k[: -len(".weight_packed")] for k in stored_tensor_info(out) if k.endswith(".weight_packed")}
    assert quantized == packed and len(packed) == 4 * 16 * 3  # 3 MoE layers + the MTP layer, 16 experts, w1/w2/w3
    assert cfg["auto_map"]["AutoProcessor"] == "processing_kimi_k3.KimiK3Processor"


def test_mxfp4_experts_hold_the_generated_weights(mc, tiny):
    """Decoded with compressed-tensors' own FP4 unpacking, an expert equals its generated BF16 weight to MXFP4
    precision (relative RMS error < 0.15, the E2M1 grid's)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from safetensors import safe_open

    out, _, _ = tiny
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    base = "language_model.model.layers.1.block_sparse_moe.experts.5.w2"
    with safe_open(str(out / index[base + ".weight_packed"]), "pt") as f:
        packed = f.get_tensor(base + ".weight_packed")
    with safe_open(str(out / index[base + ".weight_scale"]), "pt") as f:
        scale = f.get_tensor(base + ".weight_scale")
    o, i2 = packed.shape
    fp4 = unpack_fp4_from_uint8(packed, o, i2 * 2, dtype=torch.float32)
    decoded = fp4 * torch.exp2(scale.float() - 127).repeat_interleave(32, dim=1)
    original = mc.make_tensor(base + ".weight", (o, i2 * 2), "normal", 0, 0.02).float()
    assert float((decoded - original).norm() / original.norm()) < 0.15


# ---- forward -----------------------------------------------------------------------------------------------------
def test_tiny_forward_on_image_and_text_records_gives_finite_logits(tiny):
    from transformers import AutoProcessor

    out, _, _ = tiny
    model = _load(out, torch.bfloat16)
    processor = AutoProcessor.from_pretrained(out, trust_remote_code=True)
    record = processor(text=processor.image_token + "What is in this picture?", images=[_small_image()])
    t, h, w = record["grid_thws"][0].tolist()
    assert (t, h, w) == (1, 6, 8) and record["pixel_values"].shape == (48, 3, 14, 14)
    assert int((record["input_ids"] == processor.media_pad_id).sum()) == (h // 2) * (w // 2)
    with runtime_patches(model), torch.no_grad():
        features = model.get_image_features(record["pixel_values"].to(torch.bfloat16), record["grid_thws"])
        assert features.shape == ((h // 2) * (w // 2), model.config.text_config.hidden_size)
        logits = model(**record).logits
        text_logits = model(**processor(text="Just some text.")).logits
    for lg, n in ((logits, record["input_ids"].shape[1]), (text_logits, None)):
        assert lg.shape[-1] == model.config.text_config.vocab_size and (n is None or lg.shape[1] == n)
        assert bool(torch.isfinite(lg).all()) and float(lg.float().std()) > 1e-2
    # The image changes the text positions' predictions (features are merged, not ignored).
    with runtime_patches(model), torch.no_grad():
        blank = model(**processor(text=processor.image_token + "What is in this picture?",
                                  images=[_small_image().point(lambda v: 0)])).logits
    assert not torch.allclose(blank[0, -1], logits[0, -1])


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_equals_separate_rows(tiny, side):
    from transformers import AutoProcessor

    out, _, _ = tiny
    model = _load(out)
    processor = AutoProcessor.from_pretrained(out, trust_remote_code=True)
    processor.tokenizer.padding_side = side
    texts = ["The quick brown fox jumps over the lazy dog, twice.", "for i in range(10):"]
    batch = processor(text=texts)
    with runtime_patches(model), torch.no_grad():
        batched = model(**batch).logits
        for row, text in enumerate(texts):
            single = model(**processor(text=text)).logits[0]
            mask = batch["attention_mask"][row].bool()
            torch.testing.assert_close(batched[row][mask], single, atol=1e-4, rtol=0)


def test_decode_with_cache_equals_full_forward(tiny):
    from transformers import AutoProcessor

    out, _, _ = tiny
    model = _load(out)
    processor = AutoProcessor.from_pretrained(out, trust_remote_code=True)
    ids = processor(text="Kimi Delta Attention keeps a recurrent state per head.")["input_ids"]
    with runtime_patches(model), torch.no_grad():
        full = model(input_ids=ids).logits
        step = model(input_ids=ids[:, :-2], use_cache=True)
        cache = step.past_key_values
        logits = [step.logits]
        for t in (-2, -1):
            step = model(input_ids=ids[:, t:][:, :1], past_key_values=cache, use_cache=True)
            logits.append(step.logits)
    torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=1e-4, rtol=0)


# ---- modules -----------------------------------------------------------------------------------------------------
def test_router_matches_transformers_native_topk_router(mc):
    """Grouped top-k on biased scores, weights from unbiased scores, renormalised, scaled."""
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

    pkg = mc.load_remote_package(mc.HERE)
    kw = dict(hidden_size=64, num_experts=16, num_experts_per_token=4, num_expert_group=4, topk_group=2,
              routed_scaling_factor=2.446, moe_renormalize=True)
    ours = pkg.modeling_kimi_k3.KimiMoEGate(pkg.configuration_kimi_k3.KimiLinearConfig(**kw))
    native = KimiLinearTopkRouter(KimiLinearConfig(**kw))
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(16, 64, generator=g) * 0.1, torch.randn(16, generator=g) * 0.05
    with torch.no_grad():
        ours.weight.copy_(w), ours.e_score_correction_bias.copy_(b)
        native.weight.copy_(w), native.e_score_correction_bias.copy_(b)
    x = torch.randn(50, 64, generator=g)
    idx, weight = ours(x)
    _, n_weight, n_idx = native(x)
    order, n_order = idx.argsort(-1), n_idx.argsort(-1)
    assert torch.equal(idx.gather(1, order), n_idx.gather(1, n_order))
    torch.testing.assert_close(weight.gather(1, order), n_weight.gather(1, n_order), atol=1e-6, rtol=0)
    assert weight.dtype == torch.float32 and idx.dtype == torch.long


def test_latent_moe_block_equals_per_token_reference(mc):
    """forward = up(norm(sum_k w_k * expert_k(down(x)))) + shared(x) (vLLM 0.33 models/kimi_k3/nvidia/model.py:644-680:
    the latent norm acts on the weighted expert sum; the shared experts read x)."""
    pkg = mc.load_remote_package(mc.HERE)
    cfg = pkg.configuration_kimi_k3.KimiLinearConfig(
        hidden_size=64, num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, routed_expert_hidden_size=32,
        latent_moe_use_norm=True, num_shared_experts=1, initializer_range=0.1, hidden_act="situ",
        activation_situ_beta=4.0, activation_situ_linear_beta=25.0)
    torch.manual_seed(0)
    block = pkg.modeling_kimi_k3.KimiSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        y = block(x)
        flat = x.reshape(-1, 64)
        idx, w = block.gate(flat)
        ref = torch.stack([
            block.routed_expert_up_proj(block.routed_expert_norm(sum(
                w[n, k] * block.experts[int(idx[n, k])](block.routed_expert_down_proj(flat[n])) for k in range(2))))
            + block.shared_experts(flat[n])
            for n in range(flat.shape[0])])
    torch.testing.assert_close(y.reshape(-1, 64), ref, atol=1e-5, rtol=0)


def test_bench_preset_builds_on_meta_with_about_1p5_gb_of_mxfp4_experts(mc):
    pkg = mc.load_remote_package(mc.HERE)
    cfg, _ = mc.build_configs("bench", [])
    conf = pkg.configuration_kimi_k3
    config = conf.KimiK3Config(text_config=conf.KimiLinearConfig(**cfg["text_config"]),
                               vision_config=conf.KimiK3VisionConfig(**cfg["vision_config"]))
    with torch.device("meta"):
        model = pkg.modeling_kimi_k3.KimiK3ForConditionalGeneration(config)
    expert_bytes = sum(p.numel() * (0.5 + 1 / 32) for n, p in model.named_parameters()
                       if re.search(r"experts\.\d+\.w[123]\.weight$", n))
    assert 1.4e9 < expert_bytes < 2.1e9
    assert all(p.device.type == "meta" for p in model.parameters())


# ---- variants ----------------------------------------------------------------------------------------------------
def test_odd_shapes_via_set_generate_load_and_run(mc, tmp_path):
    out = tmp_path / "odd"
    sets = ["text_config.hidden_size=768", "text_config.num_hidden_layers=5", "text_config.num_experts=12",
            "text_config.num_expert_group=4", "text_config.topk_group=2", "text_config.num_experts_per_token=3",
            "text_config.routed_expert_hidden_size=96", "text_config.moe_intermediate_size=160",
            "text_config.linear_attn_config.num_heads=3", "vision_config.vt_hidden_size=96",
            "vision_config.qkv_hidden_size=96", "vision_config.vt_num_hidden_layers=1",
            "vision_config.vt_num_attention_heads=3"]
    summary = mc.make_checkpoint(out, preset="tiny", sets=sets, max_shard_size="2MB")
    assert summary["n_shards"] >= 2
    cfg = json.loads((out / "config.json").read_text())["text_config"]
    assert cfg["linear_attn_config"]["full_attn_layers"] == [4] and cfg["linear_attn_config"]["kda_layers"] == [
        1, 2, 3, 5]
    model = _load(out, torch.bfloat16)
    assert len(model.language_model.model.layers[1].block_sparse_moe.experts) == 12
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(out, trust_remote_code=True)
    record = processor(text=processor.image_token + "odd shapes", images=[_small_image((56, 56))])
    with runtime_patches(model), torch.no_grad():
        logits = model(**record).logits
    assert bool(torch.isfinite(logits).all())


def test_text_only_writes_a_kimi_linear_directory(mc, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "text"
    mc.make_checkpoint(out, preset="tiny", text_only=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["KimiLinearForCausalLM"] and cfg["model_type"] == "kimi_linear"
    assert "quantization_config" in cfg and "AutoProcessor" not in cfg["auto_map"]
    assert not (out / "processor_config.json").exists()
    names = set(stored_tensor_info(out))
    assert all(n.startswith(("model.", "lm_head.")) for n in names)
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in names
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert config.get_text_config() is config
    model = _load(out, torch.bfloat16)
    assert type(model).__name__ == "KimiLinearForCausalLM"
    with torch.device("meta"):
        assert type(AutoModelForCausalLM.from_config(config, trust_remote_code=True)).__name__ == \
            "KimiLinearForCausalLM"
    ids = AutoTokenizer.from_pretrained(out, trust_remote_code=True)("hello world", return_tensors="pt")["input_ids"]
    with runtime_patches(model), torch.no_grad():
        assert bool(torch.isfinite(model(input_ids=ids).logits).all())


def test_generation_is_deterministic_per_seed(mc, tmp_path):
    def build(name, seed):
        out = tmp_path / name
        mc.make_checkpoint(out, preset="tiny", seed=seed, text_only=True,
                           sets=["text_config.num_hidden_layers=2"])
        return {p.name: p.read_bytes() for p in sorted(out.iterdir())}

    a, b, c = build("a", 7), build("b", 7), build("c", 8)
    assert a == b
    assert a["tokenizer.json"] == c["tokenizer.json"]
    assert a.keys() == c.keys() and any(a[k] != c[k] for k in a if k.endswith(".safetensors"))
