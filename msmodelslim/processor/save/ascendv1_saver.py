"""ascendv1_saver: write the AscendV1 format (quant_model_weights*.safetensors + index + description).

Per quantized linear X (a `QuantLinear` yielded by `adapter.checkpoint_state`), with q the integer weight and s the
per-channel scale [out, 1]:
  W8A8_DYNAMIC : X.weight int8 [out, in] = q; X.weight_scale float32 s; X.weight_offset float32 zeros [out, 1]
  W4A8_DYNAMIC / W4A4_DYNAMIC : X.weight = pack_int4(q) int8 [out/2, in] (two int4 per byte along the output dim,
      low nibble = even row: the "version 1.0.0" layout vLLM-Ascend loads), X.weight_scale, X.weight_offset, and
      X.scale_bias float32 = 8 * sum_k (q[o, k] * s[o]) over the input dim k:
        [out, 1]  for column-parallel linears, and
        [out, 16] for row-parallel ones (last name component in `row_parallel`, default w2/down_proj/o_proj):
                  column j sums the j-th of 16 contiguous input slices, so a tensor-parallel split of the input
                  dim keeps its own part (vLLM-Ascend sums the columns it gets). Their total is the [out, 1] value.
      (8 = the int4 offset the Ascend int4 kernel uses when it computes with unsigned nibbles q + 8: the bias
      removes 8 * sum_k w_deq[o, k] again.)
  W4A8_DYNAMIC per group (QuantLinear scales [out, in / g]): as above with X.weight_scale ones [out, 1] and the
      group scales as X.weight_scale_second float32 [out, in / g] (fp16 values: vllm-ascend's MoE kernel multiplies
      by fp16(weight_scale * weight_scale_second)), X.weight_offset_second zeros; scale_bias sums q * group scale.
  W4A16_MXFP4 / W4A8_MXFP / W4A4_MXFP4 : X.weight uint8 [out, in/2] (FP4 codes, element 2j in the low nibble) and
      X.weight_scale uint8 [out, in/32] (E8M0); W8A8_MXFP8 : X.weight float8_e4m3fn [out, in], X.weight_scale as
      before. No offsets (msModelSlim 26.1.0 writes none; vllm-ascend's MX schemes create none).
  X.bias (if any) in the source dtype; X.online_rotation (if any) in its own dtype: the runtime input rotation T,
  input = x @ T^T = F.linear(x, T). All of these are described with the linear's scheme name.
Per quantized attention point P = `<attention>.fa_{q,k,v}` (an `AttentionFakeQuant`): per head, P.scale float32
[heads, 1] and P.offset zeros (int8 for int8, float32 for fp8), described FAQuant; per token, nothing. Every
quantized attention gets `<attention>.quant_type`, and the header `fa_quant_type: FAKQuant` when a point is per
head (serving/ascendv1.py; what msModelSlim 26.1.0 writes).
FLOAT tensors (norms, router, convs, A_log, dt_bias, embeddings, lm_head, unquantized linears) are written in the
dtype the source checkpoint stores them in (so fp32 A_log / dt_bias / e_score_correction_bias stay fp32); tensors
the source stores as MXFP4 or does not have are written as `float_dtype` (bfloat16).

Data parallelism / EP: `adapter.checkpoint_state(unit, module)` yields what this rank holds (its local experts and
the replicated rest). Rank 0 writes everything it is given; a rank > 0 writes only names for which
`adapter.is_rank_local(name)` is true (applied to CHECKPOINT names). A name written by two ranks is an error.

Sharding: tensors are buffered on CPU up to `part_file_size` GiB, then written as a shard with a rank-unique
temporary name and fsynced; the end of a unit closes the shard too (a finished unit is on disk, which a resumable
run's state relies on: pipeline/resume.py), so a shard holds one unit or a part of one. `finalize` writes a
per-rank partial JSON, barrier, rank 0 merges in a deterministic order (shards by (rank, part); index and
description sorted by name), renames shards to their final names, writes the index and description, copies
config/tokenizer/processor/remote-code files (config.json without `quantization_config`), then a final barrier.
Nothing is written outside `work_dir`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from msmodelslim.core.files import safetensors_checksum
from msmodelslim.core.placement import HOST, host_section, on_host
from msmodelslim.errors import UserError
from msmodelslim.model.base import Unit
from msmodelslim.processor.save.base import Saver, SaverConfig, register_saver
from msmodelslim.quant.attention import AttentionFakeQuant, AttentionQuantSpec
from msmodelslim.quant.modules import ONLINE_ROTATION, QuantLinear, get_scheme
from msmodelslim.quant.packing import pack_int4
from msmodelslim.serving.ascendv1 import (
    ATTENTION_QUANT_KEY,
    DESCRIPTION_NAME,
    FA_QUANT_TYPE,
    FA_TENSOR,
    FLOAT,
    FORMAT_VERSION,
    INDEX_NAME,
    SEVERITY,
    attention_quant_type,
    is_int4,
    shard_name,
)
from msmodelslim.serving.fused import split_of
from msmodelslim.source.checkpoint import source_identity

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
# What a serving engine reads beside the weights: configuration, tokenizer, processor and chat template files by
# name, and the remote-code modules. Nothing else of the model directory is copied (no notes, no links out).
CONSUMER_FILES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "tiktoken.model",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
    "video_preprocessor_config.json",
})
CONSUMER_SUFFIXES = (".py", ".tiktoken", ".model")  # remote code; tiktoken / sentencepiece vocabularies
_PARTIAL = ".rank{rank:05d}.partial.json"
_TMP_SHARD = ".rank{rank:05d}-part{part:05d}.safetensors"
GIB = 1024**3
MAX_PART_GIB = 1024  # a shard above 1 TiB is a typo, not a plan


@dataclass
class AscendV1SaverConfig(SaverConfig):
    part_file_size: float = 4.0  # GiB per shard
    float_dtype: str = "bfloat16"  # FLOAT tensors the source checkpoint has no float dtype for
    row_parallel: list[str] = field(default_factory=lambda: ["w2", "down_proj", "o_proj"])
    row_parallel_splits: int = 16  # scale_bias columns of a row-parallel int4 linear

    def validate(self) -> None:
        if isinstance(self.part_file_size, bool) or not isinstance(self.part_file_size, (int, float)) \
                or not 0 < self.part_file_size <= MAX_PART_GIB:
            raise ValueError(f"ascendv1_saver.part_file_size must be a number of GiB in (0, {MAX_PART_GIB}], "
                             f"got {self.part_file_size!r}")
        if self.float_dtype not in _FLOAT_DTYPES:
            raise ValueError(f"ascendv1_saver.float_dtype must be one of {sorted(_FLOAT_DTYPES)}, "
                             f"got {self.float_dtype!r}")
        if not isinstance(self.row_parallel, (list, tuple)) or not all(isinstance(n, str) for n in self.row_parallel):
            raise ValueError(f"ascendv1_saver.row_parallel must be a list of names, got {self.row_parallel!r}")
        if isinstance(self.row_parallel_splits, bool) or not isinstance(self.row_parallel_splits, int) \
                or self.row_parallel_splits < 1:
            raise ValueError(f"ascendv1_saver.row_parallel_splits must be a positive integer, "
                             f"got {self.row_parallel_splits!r}")


def model_quant_type(types: set[str]) -> str:
    """The description's `model_quant_type`: the most aggressive scheme present, except that a W4A8 mix (int4
    experts with W8A8 elsewhere) is W8A8_DYNAMIC, as msModelSlim 26.1.0 labels it (only vllm-ascend's 310P loader
    reads the key)."""
    if {"W4A8_DYNAMIC", "W8A8_DYNAMIC"} <= types:
        return "W8A8_DYNAMIC"
    return max((types & set(SEVERITY)) or {FLOAT}, key=lambda t: SEVERITY[t])


def source_float_dtypes(adapter: Any) -> dict[str, torch.dtype]:
    """name -> dtype of every floating tensor stored in the adapter's source checkpoint (headers only; the
    adapter's own reader when it has one, so the shards are not opened and checked again)."""
    from msmodelslim.source.checkpoint import CheckpointError, open_checkpoint

    reader = getattr(adapter, "reader", None)
    if reader is None:
        if not getattr(adapter, "model_path", None):
            return {}
        try:
            reader = open_checkpoint(Path(adapter.model_path))
        except CheckpointError:
            return {}
    out: dict[str, torch.dtype] = {}
    for name in reader.stored_keys():
        dtype = _ST_DTYPES.get(reader.stored_dtype(name)) if name in reader else None
        if dtype is not None:
            out[name] = dtype
    reader.close()
    return out


class NonFiniteError(UserError):
    """A tensor about to be written holds NaN or Inf (from the source, or produced by a processor)."""


def check_finite(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype == torch.float8_e4m3fn:
        return  # MX elements, encoded from finite values (isfinite has no float8 kernel)
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise NonFiniteError(f"tensor {name} has {bad} non-finite value(s) (NaN/Inf) after processing; "
                             f"nothing was written (check the processors of the practice on this layer)")


def scale_bias(q: torch.Tensor, scale: torch.Tensor, splits: int = 1) -> torch.Tensor:
    """8 * sum over the input dim of the dequantised weight q * scale (scale [out, 1] or per group [out, in / g]),
    in `splits` contiguous input slices. Returns float32 [out, splits]; splits=1 is the row sum [out, 1].
    """
    out, inp = q.shape
    if inp % splits:
        raise ValueError(f"input dim {inp} is not divisible by {splits} scale_bias slices")
    scale = scale.to(torch.float32)
    if scale.shape[1] > 1:
        scale = scale.repeat_interleave(inp // scale.shape[1], dim=1)
    deq = q.to(torch.float32) * scale
    return 8.0 * deq.reshape(out, splits, inp // splits).sum(dim=-1)


def quant_tensor_bytes(out_f: int, in_f: int, scheme: str, row_parallel: bool, splits: int, bias: int,
                       group_size: int = 0) -> int:
    """Bytes `_quant_tensors` writes for one quantized linear (what `--plan` sizes an output with): the weight
    (a byte per element, or half for 4 bits), its scales (float32 scale and offset [out, 1] plus per-group ones;
    MX: a byte per 32 inputs), for int4 the float32 scale_bias ([out, splits] when row-parallel), and a bias of
    `bias` bytes."""
    sch = get_scheme(scheme)
    weight = out_f * in_f // 2 if sch.weight.bits == 4 else out_f * in_f
    if sch.is_mx:
        return weight + out_f * in_f // 32 + bias
    scales = 2 * out_f * 4 + (2 * out_f * (in_f // group_size) * 4 if group_size else 0)
    scale_bias = (out_f * (splits if row_parallel else 1) * 4) if is_int4(scheme) else 0
    return weight + scales + scale_bias + bias


@on_host("the saver's copy of a tensor into its write buffer is host memory")
def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning its memory (safetensors refuses tensors that share storage)."""
    t = t.detach()
    t = t.to("cpu") if t.device.type != "cpu" else t.clone()
    return t.contiguous()


def clean_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json without `quantization_config` at the top level and in `text_config`."""
    config = dict(config)
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = {k: v for k, v in config["text_config"].items() if k != "quantization_config"}
    return config


def consumer_files(model_dir: Path) -> list[Path]:
    """The model directory's top-level files a consumer needs, of the known kinds. A link counts by its target: the
    Hugging Face cache lays a snapshot out as links into `blobs/`, and the output gets the files' content."""
    model_dir = Path(model_dir)
    return [src for src in sorted(model_dir.iterdir())
            if (src.name in CONSUMER_FILES or src.name.endswith(CONSUMER_SUFFIXES)) and src.is_file()]


def remote_code_files(config: dict[str, Any]) -> list[str]:
    """The module files config.json's `auto_map` (top level and sub-configs) names, e.g. `modeling_kimi_k3.py` for
    "modeling_kimi_k3.KimiK3ForConditionalGeneration"; references into another repository ("repo--module.Class")
    are not the directory's to ship."""
    maps = [config.get("auto_map")] + [sub.get("auto_map") for sub in config.values() if isinstance(sub, dict)]
    refs = [ref for auto_map in maps if isinstance(auto_map, dict) for value in auto_map.values()
            for ref in (value if isinstance(value, list) else [value]) if isinstance(ref, str)]
    return sorted({ref.rsplit(".", 1)[0] + ".py" for ref in refs if "--" not in ref and "." in ref})


def missing_consumer_files(model_dir: Path, config: dict[str, Any]) -> list[str]:
    """Required files a consumer cannot load the output without: config.json and the remote code it names (checked
    before any compute; a dangling link counts as missing)."""
    return [name for name in ["config.json", *remote_code_files(config)] if not (Path(model_dir) / name).is_file()]


def copy_model_files(model_dir: Path, out_dir: Path, config_transform: Any) -> list[str]:
    """Copy config / tokenizer / processor / remote-code files of the model directory (top level only, links
    followed: real files in the output); config.json loses `quantization_config` and goes through
    `config_transform` (the adapter's output_config)."""
    config_file = Path(model_dir) / "config.json"
    missing = missing_consumer_files(model_dir, _read_json(config_file)) if config_file.is_file() else ["config.json"]
    if missing:  # checked before compute too; the directory may have changed during a long run
        raise UserError(f"--model_path {model_dir}: {', '.join(missing)} missing (a consumer cannot load the "
                        "output without it)")
    copied = []
    for src in consumer_files(model_dir):
        name = src.name
        if name == "config.json":
            with open(out_dir / name, "w", encoding="utf-8") as f:
                json.dump(config_transform(clean_config(_read_json(src))), f, indent=2, ensure_ascii=False)
                f.write("\n")
        else:
            shutil.copyfile(src, out_dir / name)  # follows a link: the content, never the link
        copied.append(name)
    return copied


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@register_saver("ascendv1_saver", AscendV1SaverConfig)
class AscendV1Saver(Saver):
    config: AscendV1SaverConfig

    def __init__(self, config: AscendV1SaverConfig, adapter: Any, work_dir: Path, dist: Any) -> None:
        super().__init__(config, adapter, work_dir, dist)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._limit = int(config.part_file_size * GIB)
        self._default_float = _FLOAT_DTYPES[config.float_dtype]
        self._source_dtypes = source_float_dtypes(adapter)
        self._fused_groups = adapter.target.lookup_groups(adapter)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        # {"file", "names", "bytes", "checksum"} per temporary shard; "checksum" is set once the shard is durable
        self._files: list[dict[str, Any]] = []
        self._writer: ThreadPoolExecutor | None = None  # with write_behind: the shards' writes, in order
        self._writing: list[Future] = []
        self._description: dict[str, str] = {}
        self._attention: dict[str, dict[str, list[str]]] = {}  # attention -> point -> [dtype, scope]
        self._group_sizes: set[int] = set()  # of the QuantLinears written (MX: 32)
        self._finalized = False

    # --- per unit --------------------------------------------------------------------------------------------
    def _owns(self, name: str) -> bool:
        return self.dist.is_main or bool(self.adapter.is_rank_local(name))

    def save_unit(self, unit: Unit, module: nn.Module) -> None:
        for name, obj in self.adapter.checkpoint_state(unit, module):
            if not self._owns(name):
                continue
            if isinstance(obj, QuantLinear):
                for tname, tensor in self._quant_tensors(name, obj).items():
                    # a bias stays float at run time: FLOAT, as msModelSlim describes it
                    self._add(tname, tensor, FLOAT if tname.endswith(".bias") else obj.scheme.name)
            elif isinstance(obj, AttentionFakeQuant):
                self._add_attention_point(name, obj)
            elif isinstance(obj, torch.Tensor):
                self._add(name, self._float_tensor(name, obj), FLOAT)
            else:
                raise TypeError(f"unit {unit.name}: checkpoint_state yielded {type(obj).__name__} for {name!r}; "
                                f"expected a Tensor, a QuantLinear or an AttentionFakeQuant")
        self._flush()  # a unit's tensors close its shard: a finished unit is on disk (a resumable run's state)

    def resume_state(self) -> dict[str, Any]:
        if self._pending:
            raise RuntimeError("ascendv1_saver: tensors still buffered at a unit boundary")
        return {"files": list(self._files), "description": dict(self._description),
                "attention": {k: dict(v) for k, v in self._attention.items()}, "group_sizes": sorted(self._group_sizes)}

    def written_files(self, state: dict[str, Any]) -> dict[str, str]:
        return {entry["file"]: entry["checksum"] for entry in state["files"]}

    def write_behind(self) -> None:
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")

    def in_flight(self) -> list[Future]:
        self._writing = [f for f in self._writing if not f.done() or f.exception() is not None]
        return list(self._writing)

    def _wait_written(self) -> None:
        """Every shard handed to the writer, durable (the first failure raised)."""
        writing, self._writing = self._writing, []
        for future in writing:
            future.result()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def restore_state(self, state: dict[str, Any]) -> None:
        self._files = [dict(entry) for entry in state["files"]]
        self._description = dict(state["description"])
        self._attention = {k: dict(v) for k, v in state["attention"].items()}
        self._group_sizes = set(state.get("group_sizes", ()))  # absent in the state of an earlier version
        kept = {entry["file"] for entry in self._files}
        prefix = _TMP_SHARD.split("-part")[0].format(rank=self.dist.rank)
        for path in self.work_dir.glob(f"{prefix}-part*.safetensors"):
            if path.name not in kept:  # written in a unit that did not finish on every rank
                path.unlink()

    def _add_attention_point(self, name: str, point: AttentionFakeQuant) -> None:
        attention, branch = name.rsplit(".", 1)
        self._attention.setdefault(attention, {})[branch] = [point.spec.dtype, point.spec.scope]
        if point.spec.static:
            scale = point.scale.to(torch.float32).reshape(-1, 1)
            offset_dtype = torch.int8 if point.spec.dtype == "int8" else torch.float32
            self._add(f"{name}.scale", scale, FA_TENSOR)
            self._add(f"{name}.offset", torch.zeros_like(scale, dtype=offset_dtype), FA_TENSOR)

    def _float_tensor(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            raise ValueError(f"{name}: tensor is on the meta device (not loaded on this rank?)")
        if not t.is_floating_point():
            return t
        return t.to(self._source_dtypes.get(name, self._default_float))

    def _quant_tensors(self, name: str, ql: QuantLinear) -> dict[str, torch.Tensor]:
        if ql.qweight.is_meta:
            raise ValueError(f"{name}: quantized weight is on the meta device")
        self._group_sizes.add(ql.group_size)
        if ql.scheme.is_mx:
            weight = ql.qweight
            if ql.scheme.weight.bits == 8:
                with host_section("the file stores E4M3 elements as float8_e4m3fn (no fp8 on an A2/A3 device)"):
                    weight = weight.to(HOST).view(torch.float8_e4m3fn)
            out = {f"{name}.weight": weight, f"{name}.weight_scale": ql.weight_scale}
            return self._linear_extras(name, ql, out)
        q, s = ql.qweight, ql.weight_scale.to(torch.float32)
        out: dict[str, torch.Tensor] = {}
        if is_int4(ql.scheme.name):
            try:
                out[f"{name}.weight"] = pack_int4(q, dim=0)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
            splits = self.config.row_parallel_splits if name.rsplit(".", 1)[-1] in self.config.row_parallel else 1
            try:
                sb = scale_bias(q, s, splits)
            except ValueError as exc:
                raise ValueError(f"{name}.scale_bias: {exc}") from None
        else:
            out[f"{name}.weight"] = q
            sb = None
        first = s if not ql.group_size else torch.ones_like(s[:, :1])
        out[f"{name}.weight_scale"] = first
        out[f"{name}.weight_offset"] = torch.zeros_like(first)
        if ql.group_size:
            out[f"{name}.weight_scale_second"] = s
            out[f"{name}.weight_offset_second"] = torch.zeros_like(s)
        if sb is not None:
            out[f"{name}.scale_bias"] = sb
        return self._linear_extras(name, ql, out)

    def _linear_extras(self, name: str, ql: QuantLinear, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The linear's bias and online rotation, beside its quantized weight."""
        if ql.bias is not None:
            out[f"{name}.bias"] = ql.bias.to(self._source_dtypes.get(f"{name}.bias", self._default_float))
        rot = getattr(ql, ONLINE_ROTATION, None)
        if rot is not None:
            out[f"{name}.{ONLINE_ROTATION}"] = rot
        return out

    def _add(self, name: str, tensor: torch.Tensor, qtype: str) -> None:
        if name in self._description:
            raise ValueError(f"tensor {name!r} was yielded twice by checkpoint_state")
        check_finite(name, tensor)
        t = _cpu_copy(tensor)
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self._limit:
            self._flush()
        self._pending[name] = t
        self._pending_bytes += nbytes
        self._description[name] = qtype

    def _flush(self) -> None:
        """The buffered tensors as the next shard: written here, or with `write_behind` by the writer thread while
        the next unit computes (the tensors are host copies no one changes; a unit's shards are on disk before the
        resumable state that counts them is written, pipeline/hooks.py)."""
        if not self._pending:
            return
        for failed in (f for f in self.in_flight() if f.done()):  # a shard the writer could not write: stop here
            failed.result()
        entry = {"file": _TMP_SHARD.format(rank=self.dist.rank, part=len(self._files)), "names": sorted(self._pending),
                 "bytes": self._pending_bytes}
        self._files.append(entry)
        tensors, self._pending, self._pending_bytes = self._pending, {}, 0
        if self._writer is None:
            self._write(tensors, entry)
        else:
            self._writing.append(self._writer.submit(self._write, tensors, entry))

    def _write(self, tensors: dict[str, torch.Tensor], entry: dict[str, Any]) -> None:
        path = self.work_dir / entry["file"]
        save_file(tensors, str(path), metadata={"format": "pt"})
        # durable before a unit's state counts it as written; the checksum is taken from memory meanwhile (both
        # let go of the interpreter: a shard's fsync and its CRC cost about as much, ~1 s per GB each)
        with open(path, "rb") as written, ThreadPoolExecutor(1) as pool:
            durable = pool.submit(os.fsync, written.fileno())
            checksum = safetensors_checksum(path, tensors)
            durable.result()
        entry["checksum"] = checksum
        logger.debug("rank %d wrote %s (%d tensors, %.2f GiB)", self.dist.rank, entry["file"], len(tensors),
                     entry["bytes"] / GIB)

    # --- finish ----------------------------------------------------------------------------------------------
    def finish_rank(self) -> None:
        if self._finalized:
            raise RuntimeError("AscendV1Saver finished twice")
        self._finalized = True
        self._flush()
        self._wait_written()
        partial = {"rank": self.dist.rank, "files": self._files, "description": self._description,
                   "attention": self._attention, "group_sizes": sorted(self._group_sizes)}
        with open(self.work_dir / _PARTIAL.format(rank=self.dist.rank), "w", encoding="utf-8") as f:
            json.dump(partial, f)

    def merge(self, metadata: dict[str, Any], extras: Any = None) -> None:
        self._merge(metadata, extras)

    def _fused_layer_keys(self, description: dict[str, str]) -> dict[str, str]:
        """`<fused layer>.weight` -> its scheme, for every layer the serving engine fuses from several tensors.

        vllm-ascend looks a fused layer up by its shards only where the engine's packed-module table lists it; for
        the others it reads `<fused layer>.weight` (`modelslim_config.py:348-382`): the routed experts (no table of
        vLLM 0.23 or 0.33 has Kimi's `experts`), and vLLM 0.23's Kimi-Linear `gate_up_proj` (that model declares
        no packed modules). These keys name no tensor; `metadata.fused_layers` lists them for readers."""
        keys = {}
        for group, shards in self._fused_groups:
            schemes = {description[f"{s}.weight"] for s in shards if f"{s}.weight" in description}
            if len(schemes) > 1 and self.adapter.target.kda_split and split_of(group):
                continue  # the split the target loads by its shards (checked before compute, serving/rules.py)
            if len(schemes) > 1:
                raise ValueError(f"{group}: its shards were written with different schemes {sorted(schemes)}")
            if schemes:
                keys[f"{group}.weight"] = schemes.pop()
        return keys

    def _merge(self, metadata: dict[str, Any], extras: Any = None) -> None:
        partials = []
        for rank in range(self.dist.world_size):
            path = self.work_dir / _PARTIAL.format(rank=rank)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: rank {rank} wrote no partial index")
            with open(path, encoding="utf-8") as f:
                partials.append(json.load(f))
        files = [(p["rank"], i, entry) for p in partials for i, entry in enumerate(p["files"])]
        files.sort(key=lambda x: (x[0], x[1]))
        total = len(files)
        weight_map: dict[str, str] = {}
        owner: dict[str, int] = {}
        total_size = 0
        for k, (rank, _, entry) in enumerate(files, start=1):
            final = shard_name(k, total)
            (self.work_dir / entry["file"]).rename(self.work_dir / final)
            total_size += entry["bytes"]
            for name in entry["names"]:
                if name in weight_map:
                    raise ValueError(f"tensor {name!r} was written by rank {owner[name]} and rank {rank}; "
                                     f"only rank 0 may write replicated tensors (adapter.is_rank_local({name!r}) "
                                     f"must be false for them)")
                weight_map[name] = final
                owner[name] = rank
        description: dict[str, str] = {}
        attention: dict[str, dict[str, list[str]]] = {}
        group_sizes: set[int] = set()
        for p in partials:
            description.update(p["description"])
            attention.update(p.get("attention", {}))
            group_sizes.update(p["group_sizes"])
        for name, points in attention.items():
            description[name + ATTENTION_QUANT_KEY] = attention_quant_type(
                {b: AttentionQuantSpec(*spec) for b, spec in points.items()})
        if total == 0:
            logger.warning("ascendv1_saver: no tensor was written")
        header: dict[str, Any] = {"model_quant_type": model_quant_type(set(description.values())),
                                  "version": FORMAT_VERSION}
        # One value for the model (vLLM-Ascend's W4A8 assumes 256 when the key is absent): the per-group W4A8 group
        # size, 32 for MX, else 0 (per channel). The practice check refused a mix (serving/rules.description_group_size).
        read = group_sizes - {0}
        if len(read) > 1:
            raise ValueError(f"quantized linears need group sizes {sorted(read)}; the description holds one")
        header["group_size"] = next(iter(read), 0)
        if FA_TENSOR in description.values():
            header["fa_quant_type"] = FA_QUANT_TYPE
        metadata = dict(metadata or {})
        if getattr(self.adapter, "model_path", None):
            metadata["source"] = source_identity(self.adapter.model_path)  # `msmodelslim eval` checks it
        tensors_described = dict(description)  # what the tensors are, without the lookup-only keys below
        fused = self._fused_layer_keys(description)
        if fused:
            metadata["fused_layers"] = sorted(fused)
        aliases = {alias: scheme for name, scheme in {**description, **fused}.items()
                   for alias in self.adapter.lookup_aliases(name)}
        if aliases:  # lookup-only too: the drafter's names of the MTP layers' entries
            metadata["lookup_aliases"] = sorted(aliases)
        if metadata:
            header["metadata"] = metadata
        description.update(fused)
        description.update(aliases)
        header["optional"] = extras.optional if extras is not None else {}  # always present, as msModelSlim
        for rel, tensors in (extras.files.items() if extras is not None else ()):
            path = self.work_dir / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            for name, tensor in tensors.items():
                check_finite(f"{rel}:{name}", tensor)
            save_file({n: _cpu_copy(t) for n, t in tensors.items()}, str(path), metadata={"format": "pt"})
        with open(self.work_dir / DESCRIPTION_NAME, "w", encoding="utf-8") as f:
            json.dump({**header, **{n: description[n] for n in sorted(description)}}, f, indent=2)
            f.write("\n")
        index = {"metadata": {"total_size": total_size}, "weight_map": {n: weight_map[n] for n in sorted(weight_map)}}
        with open(self.work_dir / INDEX_NAME, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
        copied = copy_model_files(self.adapter.model_path, self.work_dir,
                                  lambda config: self.adapter.output_config(config, tensors_described)) \
            if getattr(self.adapter, "model_path", None) and Path(self.adapter.model_path).is_dir() else []
        for rank in range(self.dist.world_size):
            (self.work_dir / _PARTIAL.format(rank=rank)).unlink()
        logger.info("ascendv1_saver: %d tensors in %d shard(s), %.2f GiB, model_quant_type %s; copied %s",
                    len(weight_map), total, total_size / GIB, header["model_quant_type"], ", ".join(copied) or "-")
