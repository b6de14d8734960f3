"""The AscendV1 format (what vLLM-Ascend loads) - its names, and a reader of written outputs.

Layout of an output directory:
    quant_model_weights.safetensors                        (one shard), or
    quant_model_weights-0000k-of-0000N.safetensors         (N shards)
    quant_model_weights.safetensors.index.json             {"metadata": {"total_size"}, "weight_map": {name: file}}
    quant_model_description.json                           {name: type, "model_quant_type", "version", ...}
Per quantized linear X of an integer type (W8A8_DYNAMIC / W4A8_DYNAMIC / W4A4_DYNAMIC; symmetric, offsets zero):
    X.weight         int8 [out, in]  (W8A8)  or  int4 packed two per byte along the OUTPUT dim, int8 [out/2, in]
                     (W4A*: see quant.packing; this is the "version 1.0.0" layout of vLLM-Ascend)
    X.weight_scale   float32 [out, 1];  X.weight_offset float32 zeros [out, 1]
    X.weight_scale_second, X.weight_offset_second   float32 [out, in / group_size] (per-group W4A8_DYNAMIC: the
                     group scales and zeros; weight_scale is then 1, the kernel multiplies the two)
    X.scale_bias     (int4 weights) float32 [out, 1], or [out, 16] for row-parallel linears (w2/down_proj/o_proj)
Per quantized linear X of an MX type (W4A16_MXFP4 / W4A8_MXFP / W4A4_MXFP4 with FP4 weights, W8A8_MXFP8):
    X.weight         FP4 codes two per byte along the input dim (element 2j in the low nibble), uint8 [out, in/2],
                     or E4M3 elements, float8_e4m3fn [out, in]
    X.weight_scale   E8M0 exponents (e + 127), uint8 [out, in/32]; no offset
Either kind: X.bias, X.online_rotation when the linear has them. The header's `group_size` is the one value every
scheme present reads: 0 (per-channel W4A8_DYNAMIC, or nothing reads it), the W4A8 group size, or 32 (MX).
Per quantized attention A (fa3_quant; msModelSlim 26.1.0's layout, vllm-ascend 0.23's FAKQuant reads it):
    A.fa_{q,k,v}.scale   float32 [heads, 1] (fa_q: the attention's heads; fa_k / fa_v: the one latent cache), and
    A.fa_{q,k,v}.offset  zeros [heads, 1], int8 for int8 points, float32 for fp8 ones: both described "FAQuant",
                         written for the points quantized per head (static); a per-token point has no tensor
    "A.quant_type"       what each point is: INT8 / FP8 per group of points, `_DYNAMIC` for per token, the points
                         named unless all of Q, K, V agree (`INT8`, `Q_FP8_DYNAMIC_KV_FP8`)
    "fa_quant_type": "FAKQuant" at the top level when some point is per head (vllm-ascend enables FA quant on it).
Everything else is FLOAT (written in the source checkpoint's dtype).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from msmodelslim.errors import UserError
from msmodelslim.quant.attention import FA3_BRANCHES, AttentionQuantSpec
from msmodelslim.quant.granularity import IntDtype
from msmodelslim.quant.modules import ONLINE_ROTATION, SCHEMES, dequantize_weight, get_scheme
from msmodelslim.quant.packing import unpack_int4

WEIGHTS_NAME = "quant_model_weights.safetensors"
INDEX_NAME = "quant_model_weights.safetensors.index.json"
DESCRIPTION_NAME = "quant_model_description.json"
FORMAT_VERSION = "1.0.0"
FLOAT = "FLOAT"
QUANT_TYPES = tuple(SCHEMES)  # the integer (A2/A3) and MX (Ascend 950) schemes of quant/modules.py
FA_TENSOR = "FAQuant"  # the type of an attention point's scale and offset
FA_QUANT_TYPE = "FAKQuant"  # `fa_quant_type`: the attention scheme vllm-ascend registers for MLA (kv_c8.py:30)
ATTENTION_QUANT_KEY = ".quant_type"  # `<attention>.quant_type`
TENSOR_TYPES = (FLOAT, *QUANT_TYPES, FA_TENSOR)
# Description keys that are not tensor names.
HEADER_KEYS = ("model_quant_type", "version", "group_size", "fa_quant_type", "metadata", "optional")
# Tensors that accompany a quantized linear's `weight` (the reader hides them from keys()).
QUANT_AUX = ("weight_scale", "weight_offset", "weight_scale_second", "weight_offset_second", "scale_bias", "bias",
             ONLINE_ROTATION)
DEQUANT_DTYPE = torch.bfloat16
# The most aggressive weight scheme present names the model (model_quant_type), in msModelSlim 26.1.0's order
# (`QUANT_TYPE_PRIORITY`; it has no W4A16_MXFP4, placed after the 8-bit weights).
SEVERITY = {FLOAT: 0, "W8A8_DYNAMIC": 1, "W8A8_MXFP8": 2, "W4A16_MXFP4": 3, "W4A8_DYNAMIC": 4, "W4A8_MXFP": 5,
            "W4A4_DYNAMIC": 6, "W4A4_MXFP4": 7}


def shard_name(index: int, total: int) -> str:
    """File name of shard `index` (1-based) of `total`, numbered even when alone (as msModelSlim names it)."""
    return f"quant_model_weights-{index:05d}-of-{total:05d}.safetensors"


def is_int4(quant_type: str) -> bool:
    """Integer 4-bit weights (packed along the output dim, with scale_bias); MXFP4 is not."""
    weight = SCHEMES[quant_type].weight if quant_type in SCHEMES else None
    return isinstance(weight, IntDtype) and weight.bits == 4


class AscendV1Error(UserError):
    """A missing or malformed part of an AscendV1 output (the message names the file and key)."""


_FA_DTYPE_TAGS = {"int8": "INT8", "fp8_e4m3": "FP8"}
_FA_POINTS = {"fa_q": "Q", "fa_k": "K", "fa_v": "V"}
_FA_DTYPES = {tag: dtype for dtype, tag in _FA_DTYPE_TAGS.items()}
_FA_BRANCHES = {letter: branch for branch, letter in _FA_POINTS.items()}
_FA_PART = re.compile(r"(?:([QKV]+)_)?(INT8|FP8)(_DYNAMIC)?(?:_|$)")


def attention_quant_type(specs: dict[str, AttentionQuantSpec]) -> str:
    """`<attention>.quant_type` of its quantized points, as msModelSlim composes it (`update_fa_quant_type`):
    points with one (dtype, static/dynamic) form a group, in Q, K, V order; a group of all three is unnamed."""
    groups: dict[tuple[str, bool], str] = {}
    for branch in FA3_BRANCHES:
        if branch in specs:
            key = (_FA_DTYPE_TAGS[specs[branch].dtype], not specs[branch].static)
            groups[key] = groups.get(key, "") + _FA_POINTS[branch]
    parts = []
    for (tag, dynamic), points in groups.items():
        kind = tag + ("_DYNAMIC" if dynamic else "")
        parts.append(kind if points == "QKV" else f"{points}_{kind}")
    return "_".join(parts)


def parse_attention_quant_type(text: str) -> dict[str, AttentionQuantSpec]:
    """The points of an `<attention>.quant_type` value; ValueError for one this format does not define."""
    specs: dict[str, AttentionQuantSpec] = {}
    pos = 0
    while pos < len(text):
        match = _FA_PART.match(text, pos)
        if not match:
            raise ValueError(f"attention quant type {text!r} is not of the form [QKV_]INT8|FP8[_DYNAMIC]...")
        points, tag, dynamic = match.groups()
        for letter in points or "QKV":
            branch = _FA_BRANCHES[letter]
            if branch in specs:
                raise ValueError(f"attention quant type {text!r} names {letter} twice")
            specs[branch] = AttentionQuantSpec(_FA_DTYPES[tag], "per_token" if dynamic else "per_head")
        pos = match.end()
    return specs


class AscendV1Reader:
    """TensorReader over a written AscendV1 directory.

    `keys()` lists logical float names: a quantized linear contributes `X.weight` (and `X.bias`), its scales and
    online rotation are reached through `quantized_weight` / `online_rotation`. `get("X.weight")` of a quantized
    linear returns the dequantised weight q * weight_scale (bfloat16 unless `dtype` is given).
    """

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        desc_path = self.out_dir / DESCRIPTION_NAME
        if not desc_path.is_file():
            raise AscendV1Error(f"{desc_path}: missing (is {self.out_dir} an AscendV1 output?)")
        with open(desc_path, encoding="utf-8") as f:
            desc = json.load(f)
        self.header = {k: desc[k] for k in HEADER_KEYS if k in desc}
        self.description: dict[str, str] = {k: v for k, v in desc.items() if k not in HEADER_KEYS}
        # `<fused layer>.weight` keys and the MTP drafter's aliases are for the engine's lookup and name no tensor
        meta = self.header.get("metadata") or {}
        self.fused_layers = {k: self.description.pop(k) for k in meta.get("fused_layers", ()) if k in self.description}
        self.lookup_aliases = {k: self.description.pop(k) for k in meta.get("lookup_aliases", ())
                               if k in self.description}
        self.attention_types: dict[str, str] = {}  # attention -> its `.quant_type`
        for key in [k for k in self.description if k.endswith(ATTENTION_QUANT_KEY)]:
            self.attention_types[key[: -len(ATTENTION_QUANT_KEY)]] = value = self.description.pop(key)
            try:
                parse_attention_quant_type(value)
            except ValueError as exc:
                raise AscendV1Error(f"{desc_path}: {key}: {exc}") from None
        for name, qtype in self.description.items():
            if qtype not in TENSOR_TYPES:
                raise AscendV1Error(f"{desc_path}: tensor {name!r} has unknown type {qtype!r} "
                                    f"(expected one of {list(TENSOR_TYPES)})")
        self.weight_map = self._read_weight_map()
        undescribed = sorted(set(self.weight_map) - set(self.description))
        if undescribed:
            raise AscendV1Error(f"{desc_path}: tensor {undescribed[0]!r} is stored but not described")
        missing = sorted(set(self.description) - set(self.weight_map))
        if missing:
            raise AscendV1Error(f"{self.out_dir}: described tensor {missing[0]!r} is in no shard")
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()  # a prefetch thread may read while the main thread does
        self._quantized = {n[: -len(".weight")] for n, t in self.description.items()
                           if t in QUANT_TYPES and n.endswith(".weight")}
        hidden = {f"{lin}.{aux}" for lin in self._quantized for aux in QUANT_AUX if aux != "bias"}
        self._keys = sorted(n for n, t in self.description.items()
                            if n not in hidden and not n.endswith("." + ONLINE_ROTATION) and t != FA_TENSOR)

    def _read_weight_map(self) -> dict[str, str]:
        index_path = self.out_dir / INDEX_NAME
        if index_path.is_file():
            with open(index_path, encoding="utf-8") as f:
                index = json.load(f)
            if not isinstance(index.get("weight_map"), dict):
                raise AscendV1Error(f"{index_path}: no 'weight_map' mapping")
            weight_map = dict(index["weight_map"])
        elif (self.out_dir / WEIGHTS_NAME).is_file():
            with safe_open(self.out_dir / WEIGHTS_NAME, framework="pt") as f:
                weight_map = {k: WEIGHTS_NAME for k in f.keys()}
        else:
            raise AscendV1Error(f"{self.out_dir}: neither {INDEX_NAME} nor {WEIGHTS_NAME} exists")
        for file in sorted(set(weight_map.values())):
            if not (self.out_dir / file).is_file():
                raise AscendV1Error(f"{index_path}: shard {file!r} is missing from {self.out_dir}")
        return weight_map

    # --- TensorReader ----------------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, name: object) -> bool:
        return name in self.weight_map

    def get(self, name: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        """A tensor as stored, or for a quantized linear's `X.weight` its dequantised weight computed in float32
        and returned as `dtype` (default bfloat16, the dtype the runtime computes in)."""
        if name.endswith(".weight") and name[: -len(".weight")] in self._quantized:
            linear = name[: -len(".weight")]
            q, scale = self.quantized_weight(linear, device)
            return dequantize_weight(get_scheme(self.quant_type(linear)), q, scale, dtype or DEQUANT_DTYPE)
        t = self.get_stored(name, device)
        return t if dtype is None else t.to(dtype)

    # --- AscendV1 specifics ----------------------------------------------------------------------------------
    def get_stored(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """A tensor exactly as stored (packed int4 bytes, scales, ...)."""
        if name not in self.weight_map:
            raise KeyError(f"{self.out_dir}: no tensor {name!r}")
        file = self.weight_map[name]
        with self._lock:
            handle = self._handles.get(file)
            if handle is None:
                try:
                    handle = self._handles[file] = safe_open(str(self.out_dir / file), framework="pt", device="cpu")
                except (SafetensorError, OSError) as exc:
                    raise AscendV1Error(f"{self.out_dir / file}: cannot open shard (needed for {name}): {exc}") from exc
        try:
            t = handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise AscendV1Error(f"{self.out_dir / file}: cannot read {name!r}: {exc}") from exc
        return t.to(device)

    def quant_type(self, linear_name: str) -> str:
        """Description type of a linear (`X` or `X.weight`): FLOAT, W8A8_DYNAMIC, W4A8_DYNAMIC, W4A4_DYNAMIC."""
        key = linear_name if linear_name.endswith(".weight") else linear_name + ".weight"
        if key not in self.description:
            raise KeyError(f"{self.out_dir / DESCRIPTION_NAME}: no entry {key!r}")
        return self.description[key]

    def quantized_linears(self) -> list[str]:
        return sorted(self._quantized)

    def quantized_weight(self, linear_name: str, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(qweight, weight_scale) of a quantized linear as `QuantLinear` holds them: unpacked integers int8
        [out, in] with float32 scales [out, 1] or [out, in / group] (weight_scale * weight_scale_second), or MX
        elements uint8 with E8M0 exponents uint8 [out, in / 32]."""
        qtype = self.quant_type(linear_name)
        if qtype not in QUANT_TYPES:
            raise ValueError(f"{linear_name} is {qtype}, not a quantized linear")
        q = self.get_stored(f"{linear_name}.weight", device)
        scale = self.get_stored(f"{linear_name}.weight_scale", device)
        if get_scheme(qtype).is_mx:
            q = q.view(torch.uint8)  # E4M3 elements are stored as float8_e4m3fn
            if scale.dtype != torch.uint8 or scale.dim() != 2 or scale.shape[0] != q.shape[0]:
                raise AscendV1Error(f"{self.out_dir}: {linear_name}: {qtype} weight_scale must be uint8 E8M0 "
                                    f"[{q.shape[0]}, in/32], got {scale.dtype} {list(scale.shape)}")
            return q, scale
        if is_int4(qtype):
            q = unpack_int4(q, dim=0)
        scale = scale.to(torch.float32)
        second = f"{linear_name}.weight_scale_second"
        if second in self.weight_map:
            scale = scale * self.get_stored(second, device).to(torch.float32)
        if q.dtype != torch.int8 or scale.shape[0] != q.shape[0] or q.shape[1] % scale.shape[1]:
            raise AscendV1Error(f"{self.out_dir}: {linear_name}: weight {q.dtype} {list(q.shape)} does not match "
                                f"weight_scale {list(scale.shape)}")
        return q, scale

    def online_rotation(self, linear_name: str, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """The linear's runtime input rotation T (input is `x @ T^T` = F.linear(x, T)), or None."""
        name = f"{linear_name}.{ONLINE_ROTATION}"
        return self.get_stored(name, device) if name in self.weight_map else None

    def attention_points(self, attention: str, device: torch.device | str = "cpu") \
            -> dict[str, tuple[AttentionQuantSpec, torch.Tensor | None]]:
        """branch -> (spec, stored per-head scales float32 [heads] or None for a per-token point) of a quantized
        attention (a name in `attention_types`)."""
        points = {}
        for branch, spec in parse_attention_quant_type(self.attention_types[attention]).items():
            scale = None
            if spec.static:
                name = f"{attention}.{branch}.scale"
                if name not in self.weight_map:
                    raise AscendV1Error(f"{self.out_dir}: {attention}{ATTENTION_QUANT_KEY} says {branch} is "
                                        f"per head, but {name!r} is in no shard")
                scale = self.get_stored(name, device).to(torch.float32).reshape(-1)
            points[branch] = (spec, scale)
        return points

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> AscendV1Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_ROUTED_EXPERT = re.compile(r"(?<!shared_)experts\.\d+\.")
_MLA_LINEARS = re.compile(r"\.self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)\.weight$")


def quantize_summary(description: dict[str, str]) -> dict[str, str]:
    """msModelSlim's config.json summary of a W4A8 mix: routed experts (`moe_quantize`), MLA linears of layers that
    have `kv_a_proj_with_mqa` (`mla_quantize`; `w8a8` once attention is quantized per head, as msModelSlim's
    kimi_k2 / deepseek_v3 adapters write it for W4A8C8), every other quantized linear (`quantize`). vllm-ascend
    picks its MoE communication from `moe_quantize` (`ascend_forward_context.py:335-339`)."""
    quantized = {n: t for n, t in description.items() if t != FLOAT and n.endswith(".weight")}
    mla_layers = {n.split(".self_attn.")[0] for n in quantized if n.endswith(".kv_a_proj_with_mqa.weight")}
    groups: dict[str, set[str]] = {"moe_quantize": set(), "mla_quantize": set(), "quantize": set()}
    for name, scheme in quantized.items():
        if _ROUTED_EXPERT.search(name):
            groups["moe_quantize"].add(scheme)
        elif _MLA_LINEARS.search(name) and name.split(".self_attn.")[0] in mla_layers:
            groups["mla_quantize"].add(scheme)
        else:
            groups["quantize"].add(scheme)
    if "W4A8_DYNAMIC" not in groups["moe_quantize"]:
        return {}  # msModelSlim writes them only for a W4A8 mix, and the engine's defaults fit the rest
    flags = {key: max(s, key=lambda t: SEVERITY[t]).lower() for key, s in groups.items() if s}
    if "mla_quantize" in flags and FA_TENSOR in description.values():
        flags["mla_quantize"] = "w8a8"
    return flags
