#!/usr/bin/env python
"""Write a random-weight Kimi-K3 weight directory shaped like the vendor's release.

    python example/multimodal_vlm/Kimi-K3/make_checkpoint.py --preset tiny --out DIR [--seed N]
        [--set text_config.hidden_size=768 --set vision_config.vt_num_hidden_layers=2 ...] [--text-only] [--max-shard-size 50MB]

The directory holds config.json (auto_map -> the remote code copied beside it, compressed-tensors MXFP4
quantization_config), generation_config.json, a byte-level BPE tokenizer, processor_config.json, and
size-limited safetensors shards with model.safetensors.index.json. Routed experts are MXFP4
(`weight_packed` uint8 [out, in/2], `weight_scale` E8M0 uint8 [out, in/32]); everything else BF16.

Tensor names and shapes come from the remote modeling code itself (built on the meta device); every tensor is
generated on its own from (seed, name) and streamed into shards, so `bench` never holds the model in memory.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import logging
import math
import re
import shutil
import sys
import time
import types
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
REMOTE_FILES = ("configuration_kimi_k3.py", "modeling_kimi_k3.py", "processing_kimi_k3.py")
logger = logging.getLogger("make_checkpoint")

SPECIAL_TOKENS = ["[PAD]", "[BOS]", "[EOS]", "<|media_begin|>", "<|media_content|>", "<|media_end|>",
                  "<|media_pad|>", "<|kimi_image_placeholder|>"]
PAD_ID, BOS_ID, EOS_ID, MEDIA_PAD_ID = 0, 1, 2, 6
EXPERT_RE = re.compile(r"block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
QUANT_TARGET = r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"

# Every preset has every Kimi-K3 feature: attention residuals, SiTU, the latent MoE with its norm, q-LoRA MLA with
# the output gate, the full-rank KDA gate with the released bounded ("safe") form (`gate_lower_bound` -5.0, what
# vLLM 0.33's fastest KDA kernels require; `--set text_config.linear_attn_config.gate_lower_bound=null` for the
# unbounded gate), MTP layers and the MoonViT tower. Layer lists are 1-indexed.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "max_shard_size": "1MB",
        "text_config": {
            "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
            "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 2,
                                   "head_dim": 64, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                                   "gate_lower_bound": -5.0},
            "num_attention_heads": 2, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
            "kv_lora_rank": 64, "q_lora_rank": 96, "attn_res_block_size": 2, "num_nextn_predict_layers": 1,
            "num_experts": 16, "num_experts_per_token": 4, "moe_intermediate_size": 64,
            "routed_expert_hidden_size": 64, "num_shared_experts": 2, "first_k_dense_replace": 1,
        },
        "vision_config": {"patch_size": 14, "vt_hidden_size": 64, "vt_num_hidden_layers": 2,
                          "vt_num_attention_heads": 2, "qkv_hidden_size": 64, "vt_intermediate_size": 128,
                          "init_pos_emb_height": 16, "init_pos_emb_width": 16},
        "media_proc_cfg": {"in_patch_limit": 1024, "patch_limit_on_one_side": 64},
    },
    "small": {
        "max_shard_size": "20MB",
        "text_config": {
            "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
            "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "num_heads": 4,
                                   "head_dim": 128, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                                   "gate_lower_bound": -5.0},
            "num_attention_heads": 4, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
            "kv_lora_rank": 128, "q_lora_rank": 192, "attn_res_block_size": 2, "num_nextn_predict_layers": 1,
            "num_experts": 32, "num_experts_per_token": 4, "moe_intermediate_size": 256,
            "routed_expert_hidden_size": 256, "num_shared_experts": 2, "first_k_dense_replace": 1,
        },
        "vision_config": {"patch_size": 14, "vt_hidden_size": 256, "vt_num_hidden_layers": 4,
                          "vt_num_attention_heads": 4, "qkv_hidden_size": 256, "vt_intermediate_size": 1024,
                          "init_pos_emb_height": 32, "init_pos_emb_width": 32},
        "media_proc_cfg": {"in_patch_limit": 1024, "patch_limit_on_one_side": 64},
    },
    # ~1.7 GB of MXFP4 routed experts: 7 MoE layers (+1 MTP) x 128 experts x 3 x (1024 x 1024).
    "bench": {
        "max_shard_size": "500MB",
        "text_config": {
            "vocab_size": 8192, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 8,
            "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "num_heads": 16,
                                   "head_dim": 128, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                                   "gate_lower_bound": -5.0},
            "num_attention_heads": 16, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "kv_lora_rank": 512, "q_lora_rank": 768, "attn_res_block_size": 4, "num_nextn_predict_layers": 1,
            "num_experts": 128, "num_experts_per_token": 8, "moe_intermediate_size": 1024,
            "routed_expert_hidden_size": 1024, "num_shared_experts": 2, "first_k_dense_replace": 1,
        },
        "vision_config": {"patch_size": 14, "vt_hidden_size": 512, "vt_num_hidden_layers": 4,
                          "vt_num_attention_heads": 8, "qkv_hidden_size": 512, "vt_intermediate_size": 2048,
                          "init_pos_emb_height": 32, "init_pos_emb_width": 32},
        "media_proc_cfg": {"in_patch_limit": 4096, "patch_limit_on_one_side": 128},
    },
    # One full-size Kimi-K3 MoE layer (released sizes where public: docs/dev/facts/kimi_k3_in_vllm_0.33.md section
    # 6): hidden 7168, 896 experts top-16 of 3072 x 3584 (latent), shared width 6144, KDA 96 x 128, MLA 96 heads.
    "layer": {
        "max_shard_size": "4GB",
        "text_config": {
            "vocab_size": 4096, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 1,
            "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [], "num_heads": 96,
                                   "head_dim": 128, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                                   "gate_lower_bound": -5.0},
            "num_attention_heads": 96, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "kv_lora_rank": 512, "q_lora_rank": 1536, "attn_res_block_size": 8, "num_nextn_predict_layers": 0,
            "num_experts": 896, "num_experts_per_token": 16, "moe_intermediate_size": 3072,
            "routed_expert_hidden_size": 3584, "num_shared_experts": 2, "first_k_dense_replace": 0,
        },
        "vision_config": {"patch_size": 14, "vt_hidden_size": 64, "vt_num_hidden_layers": 1,
                          "vt_num_attention_heads": 2, "qkv_hidden_size": 64, "vt_intermediate_size": 128,
                          "init_pos_emb_height": 16, "init_pos_emb_width": 16},
        "media_proc_cfg": {"in_patch_limit": 1024, "patch_limit_on_one_side": 64},
    },
}
# Released values where the public sources show them (SiTU betas, sigmoid top-k in one group, latent norm).
TEXT_COMMON = {"routed_scaling_factor": 2.446, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
               "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5,
               "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
               "latent_moe_use_norm": True, "mla_use_nope": True, "mla_use_output_gate": True,
               "initializer_range": 0.02, "tie_word_embeddings": False, "max_position_embeddings": 8192,
               "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
MEDIA_PROC_COMMON = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fixed_output_tokens": None}

# Deterministic tokenizer corpus (our own text); the shipped remote code is appended so code tokenizes well too.
CORPUS = """\
Post-training quantization turns the weights of a trained model into low-bit integers without retraining.
A calibration set of real text and images is run through the model one layer at a time; each layer records
the largest activation of every input channel, smooths outliers into the weights, rotates the hidden space
with a Hadamard matrix so no channel dominates, and finally rounds the weights to four or eight bits.
Kimi models mix linear attention (Kimi Delta Attention) with multi-head latent attention, and route every
token to a few of many experts. The experts of Kimi-K3 live in a latent space that is smaller than the hidden
size; a shared expert sees every token. Images are cut into patches of fourteen pixels, four neighbouring
patches are merged into one token, and a projector maps them to the hidden size of the language model.
The quick brown fox jumps over the lazy dog. A photograph of an astronaut, a camera, a cat named Chelsea,
a cup of coffee, some coins, the Hubble deep field, a motorcycle, a page of text, a retina and a rocket.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 8192; dates 2024-01-31, 2025-12-01.
def forward(self, hidden_states): return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
for i in range(10): print(i, i * i, "even" if i % 2 == 0 else "odd")
"""


# ----------------------------------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------------------------------
def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(cfg: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` (value parsed as JSON, else a string) to a nested dict; returns a copy."""
    cfg = copy.deepcopy(cfg)
    for item in sets:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = cfg
        for p in parts[:-1]:
            if not isinstance(node.setdefault(p, {}), dict):
                raise ValueError(f"--set {item!r}: {p!r} is not a section")
            node = node[p]
        node[parts[-1]] = _parse_value(value)
    tc = cfg["text_config"]
    lac = tc.get("linear_attn_config", {})
    n = tc["num_hidden_layers"]
    explicit = any(s.split("=", 1)[0].strip().endswith(("kda_layers", "full_attn_layers")) for s in sets)
    if not explicit and set(lac.get("kda_layers", [])) | set(lac.get("full_attn_layers", [])) != set(range(1, n + 1)):
        # Layer count changed without layer lists: every 4th layer (1-indexed) is MLA, as the hub default.
        lac["full_attn_layers"] = [i for i in range(1, n + 1) if i % 4 == 0]
        lac["kda_layers"] = [i for i in range(1, n + 1) if i % 4 != 0]
    return cfg


def build_configs(preset: str, sets: list[str]) -> tuple[dict[str, Any], str]:
    if preset not in PRESETS:
        raise ValueError(f"--preset {preset!r}: choose one of {sorted(PRESETS)}")
    p = copy.deepcopy(PRESETS[preset])
    max_shard = p.pop("max_shard_size")
    p["text_config"] = {**TEXT_COMMON, **p["text_config"]}
    p["media_proc_cfg"] = {**MEDIA_PROC_COMMON, **p["media_proc_cfg"]}
    p["media_placeholder_token_id"] = MEDIA_PAD_ID
    return apply_overrides(p, sets), max_shard


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?I?B?)\s*", text.upper())
    if not m:
        raise ValueError(f"--max-shard-size {text!r}: expected e.g. 50MB, 256KB, 2GB or a byte count")
    unit = m.group(2).rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[unit])


def load_remote_package(code_dir: Path) -> Any:
    """Import the remote code folder as a package (its modeling file uses relative imports)."""
    name = f"_kimi_k3_standin_{zlib.crc32(str(code_dir).encode()):08x}"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(code_dir)]
        sys.modules[name] = pkg
        for sub in ("configuration_kimi_k3", "modeling_kimi_k3"):
            setattr(pkg, sub, importlib.import_module(f"{name}.{sub}"))
    pkg = sys.modules[name]
    return pkg


# ----------------------------------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------------------------------
def train_tokenizer(vocab_size: int, out: Path) -> None:
    """Byte-level BPE trained on CORPUS + the remote code; special tokens get ids 0..5."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"text_config.vocab_size {vocab_size} too small for a byte-level tokenizer (>= 262)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [CORPUS] + [(HERE / f).read_text(encoding="utf-8") for f in REMOTE_FILES]
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"tokenizer: special token {t} got id {tok.token_to_id(t)}, expected {i}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]", unk_token=None,
        extra_special_tokens={"media_begin_token": "<|media_begin|>", "media_content_token": "<|media_content|>",
                              "media_end_token": "<|media_end|>", "media_pad_token": "<|media_pad|>",
                              "image_token": "<|kimi_image_placeholder|>"},
        model_max_length=8192, clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out)
    # The hub spelling; transformers 5 maps it to its tokenizers backend.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------------------------------
# tensors
# ----------------------------------------------------------------------------------------------------------------------
def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def tensor_specs(model: torch.nn.Module) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(checkpoint name, shape, kind) for every parameter / persistent buffer of the meta-built model."""
    seen: set[str] = set()
    for mod_name, mod in model.named_modules():
        cls = type(mod).__name__
        tensors = list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
        for pname, t in tensors:
            if pname in getattr(mod, "_non_persistent_buffers_set", set()):
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            if full in seen:
                continue
            seen.add(full)
            if pname in ("A_log", "dt_bias", "e_score_correction_bias"):
                kind = pname
            elif cls in ("KimiRMSNorm", "FusedRMSNormGated", "RMSNorm") and pname == "weight":
                kind = "norm"
            elif pname == "bias":
                kind = "bias"
            elif cls == "ShortConvolution":
                kind = "conv"
            else:
                kind = "normal"
            yield full, tuple(t.shape), kind


def make_tensor(name: str, shape: tuple[int, ...], kind: str, seed: int, std: float) -> torch.Tensor:
    g = _generator(seed, name)
    if kind == "A_log":  # FLA init: A ~ U(1, 16)
        t = torch.empty(shape).uniform_(1.0, 16.0, generator=g).log()
    elif kind == "dt_bias":  # FLA init: dt ~ logU(1e-3, 1e-1), stored as inverse softplus
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp().clamp_min(1e-4)
        t = dt + torch.log(-torch.expm1(-dt))
    elif kind == "e_score_correction_bias":  # non-zero so biased choice != unbiased weights is exercised
        t = torch.randn(shape, generator=g) * 0.02
    elif kind == "norm":  # near one, not one: norm fusion bugs must show
        t = 1.0 + 0.1 * torch.randn(shape, generator=g)
    elif kind == "conv":
        t = torch.randn(shape, generator=g) * (0.5 / math.sqrt(shape[-1]))
    elif kind == "bias":
        t = torch.randn(shape, generator=g) * std
    else:
        t = torch.randn(shape, generator=g) * std
    return t.to(torch.bfloat16)


class ShardWriter:
    """Streams tensors into `model-0000k-of-0000N.safetensors` files of at most max_bytes (one tensor may exceed)."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_size = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = t.contiguous()
        self.pending_bytes += nbytes
        self.total_size += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.out / f"_shard{len(self.shards):05d}.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        path.chmod(0o644)
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> int:
        self.flush()
        n = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out / f"_shard{i:05d}.tmp").rename(self.out / fname)
            weight_map.update({k: fname for k in names})
        index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return n


def quantization_config() -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "version": "0.20.0",
        "config_groups": {
            "group_0": {
                "targets": [QUANT_TARGET],
                "format": "mxfp4-pack-quantized",
                "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                            "group_size": 32, "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": None,
                            "observer": "minmax", "actorder": None, "block_structure": None, "observer_kwargs": {}},
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
    }


_GENERIC_CONFIG_KEYS = ("output_hidden_states", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
                        "id2label", "label2id", "problem_type", "transformers_version")


def _clean_config_dict(d: dict[str, Any]) -> dict[str, Any]:
    """Drop transformers' generic bookkeeping fields so config.json reads like a hub config."""
    d = {k: v for k, v in d.items() if k not in _GENERIC_CONFIG_KEYS}
    for sub in ("text_config", "vision_config"):
        if isinstance(d.get(sub), dict):
            d[sub] = {k: v for k, v in _clean_config_dict(d[sub]).items()
                      if not (k in ("architectures", "dtype") and v is None)}
    return d


# ----------------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------------
def make_checkpoint(
    out: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    sets: list[str] | None = None,
    text_only: bool = False,
    max_shard_size: str | None = None,
) -> dict[str, Any]:
    """Write the weight directory; returns a summary (config dicts, shard count, bytes, seconds)."""
    from msmodelslim.source.mxfp4 import encode_mxfp4

    t0 = time.perf_counter()
    out = Path(out)
    cfg, default_shard = build_configs(preset, sets or [])
    max_bytes = parse_size(max_shard_size or default_shard)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    for f in REMOTE_FILES:
        shutil.copyfile(HERE / f, out / f)

    pkg = load_remote_package(HERE)
    conf_mod, model_mod = pkg.configuration_kimi_k3, pkg.modeling_kimi_k3
    text_cfg = conf_mod.KimiLinearConfig(**cfg["text_config"])
    if text_only:
        config = text_cfg
        model_cls = model_mod.KimiLinearForCausalLM
        arch = "KimiLinearForCausalLM"
        auto_map = {
            "AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
            "AutoModel": "modeling_kimi_k3.KimiLinearForCausalLM",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiLinearForCausalLM",
        }
    else:
        config = conf_mod.KimiK3Config(
            text_config=text_cfg, vision_config=conf_mod.KimiK3VisionConfig(**cfg["vision_config"]),
            **{k: v for k, v in cfg.items() if k not in ("text_config", "vision_config", "media_proc_cfg")},
        )
        model_cls = model_mod.KimiK3ForConditionalGeneration
        arch = "KimiK3ForConditionalGeneration"
        auto_map = {
            "AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            "AutoModelForImageTextToText": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            "AutoProcessor": "processing_kimi_k3.KimiK3Processor",
        }
    for name in ("routed_expert_hidden_size", "hidden_size", "moe_intermediate_size"):
        v = getattr(text_cfg, name) or 0
        if v % 32:
            raise ValueError(f"text_config.{name}={v}: MXFP4 experts need in_features divisible by 32")

    with torch.device("meta"):
        model = model_cls(config)
    specs = list(tensor_specs(model))
    del model

    config_dict = _clean_config_dict(config.to_dict())
    config_dict.update({"architectures": [arch], "auto_map": auto_map, "dtype": "bfloat16",
                        "quantization_config": quantization_config()})
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=False) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False,
         "max_new_tokens": 64}, indent=2) + "\n")

    t_tok = time.perf_counter()
    train_tokenizer(text_cfg.vocab_size, out)
    t_tok = time.perf_counter() - t_tok
    if not text_only:
        vc = config.vision_config
        media = {"patch_size": vc.patch_size, "merge_kernel_size": vc.merge_kernel_size[0], **cfg["media_proc_cfg"]}
        (out / "processor_config.json").write_text(json.dumps(
            {"auto_map": {"AutoProcessor": "processing_kimi_k3.KimiK3Processor"}, "media_proc_cfg": media},
            indent=2) + "\n")

    writer = ShardWriter(out, max_bytes)
    std = text_cfg.initializer_range
    n_expert = 0
    for name, shape, kind in specs:
        w = make_tensor(name, shape, kind, seed, std)
        if EXPERT_RE.search(name):
            packed, scale = encode_mxfp4(w, name=name)
            base = name[: -len(".weight")]
            writer.add(base + ".weight_packed", packed)
            writer.add(base + ".weight_scale", scale)
            n_expert += 1
        else:
            writer.add(name, w)
    n_shards = writer.finish()
    summary = {
        "out": str(out), "preset": preset, "text_only": text_only, "n_tensors": len(specs),
        "n_expert_linears": n_expert, "n_shards": n_shards, "total_bytes": writer.total_size,
        "tokenizer_seconds": round(t_tok, 3), "seconds": round(time.perf_counter() - t0, 3),
    }
    logger.info("wrote %s", summary)
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, e.g. text_config.hidden_size=768 (value parsed as JSON)")
    ap.add_argument("--text-only", action="store_true", help="write a text-only KimiLinearForCausalLM directory")
    ap.add_argument("--max-shard-size", default=None, help="e.g. 50MB (default: per preset)")
    args = ap.parse_args(argv)
    summary = make_checkpoint(args.out, args.preset, args.seed, args.sets, args.text_only, args.max_shard_size)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.path.insert(0, str(HERE.parents[2]))  # run from a checkout without installing msmodelslim
    main()
