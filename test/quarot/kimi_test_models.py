"""Small Kimi models for the rotation and smoothing tests (random init, float32, non-trivial norm weights)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from kimi_units import SHARED, randomize_norms, standin_package
from safetensors.torch import save_file

MINI = SHARED / "models" / "kimi-linear-mini"
TEXT = SHARED / "data" / "text" / "python_tutorial.txt"

# Sizes K * 2^m with K != 1 so the Paley matrices are exercised: hidden 96 = 12*8, latent 80 = 20*4,
# expert intermediate 48 = 12*4, dense intermediate 112 = 28*4, kv_lora 40 = 20*2, v_head_dim 24 = 12*2.
STANDIN_SETS = [
    "text_config.hidden_size=96", "text_config.routed_expert_hidden_size=80", "text_config.moe_intermediate_size=48",
    "text_config.intermediate_size=112", "text_config.kv_lora_rank=40", "text_config.v_head_dim=24",
    "text_config.num_nextn_predict_layers=0",  # MTP layers need the adapter's units (test_adapter_invariance.py)
    # SiTU without linear_beta keeps the up branch linear, so up-down smoothing exists to be tested (with the
    # released linear_beta it does not: test_adapter_invariance.py)
    "text_config.activation_situ_linear_beta=null",
]


def standin_vlm(seed: int = 0):
    """The stand-in KimiK3ForConditionalGeneration, tiny preset with the sizes above: (model, package)."""
    pkg = standin_package()
    import make_checkpoint

    cfg, _ = make_checkpoint.build_configs("tiny", STANDIN_SETS)
    conf = pkg.configuration_kimi_k3
    text = conf.KimiLinearConfig(**cfg["text_config"])
    extra = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config", "media_proc_cfg")}
    config = conf.KimiK3Config(text_config=text, vision_config=conf.KimiK3VisionConfig(**cfg["vision_config"]), **extra)
    torch.manual_seed(seed)
    model = pkg.modeling_kimi_k3.KimiK3ForConditionalGeneration(config).float().eval()
    randomize_norms(model, seed)
    return model, pkg


def standin_inputs(model, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """One image+text sample (4 merged image tokens) and one text-only batch."""
    gen = torch.Generator().manual_seed(seed)
    ph = model.config.media_placeholder_token_id
    ids = torch.randint(10, model.config.text_config.vocab_size, (1, 40), generator=gen)
    ids[0, 5:9] = ph
    image = {"input_ids": ids, "pixel_values": torch.randn(16, 3, 14, 14, generator=gen),
             "grid_thws": torch.tensor([[1, 4, 4]])}
    text = {"input_ids": torch.randint(10, model.config.text_config.vocab_size, (2, 33), generator=gen)}
    return [image, text]


def native_config():
    from transformers import KimiLinearConfig

    return KimiLinearConfig(
        vocab_size=256, hidden_size=96, intermediate_size=112, moe_intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        kv_lora_rank=40, num_experts=8, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
        linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 2, "head_dim": 32,
                            "short_conv_kernel_size": 4},
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def native_kimi_linear(seed: int = 0):
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(native_config()).float().eval()
    randomize_norms(model, seed)
    return model


def kimi_linear_mini(tmp_dir: Path):
    """The real trained kimi-linear-mini in float32 (MXFP4 experts decoded), transformers' native class."""
    from transformers import KimiLinearForCausalLM

    from msmodelslim.source.checkpoint import open_checkpoint

    reader = open_checkpoint(MINI)
    state = {k: reader.get(k, "cpu", torch.bfloat16) for k in reader.keys()}
    config = json.loads((MINI / "config.json").read_text())
    config.pop("quantization_config")
    save_file(state, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
    (tmp_dir / "config.json").write_text(json.dumps(config))
    return KimiLinearForCausalLM.from_pretrained(tmp_dir, dtype=torch.float32).eval()


def mini_tokens(n_tokens: int, offset: int = 0) -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MINI / "tokenizer.json"))
    ids = tok.encode(TEXT.read_text(encoding="utf-8")).ids
    return torch.tensor(ids[offset: offset + n_tokens])[None]
