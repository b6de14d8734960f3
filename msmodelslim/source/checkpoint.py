"""Lazy reader of a Hugging Face safetensors checkpoint, MXFP4 linears served as dense ``X.weight``.

``open_checkpoint(model_dir)`` reads ``model.safetensors.index.json`` (or a single ``model.safetensors``)
and returns a ``CheckpointReader`` implementing the TensorReader contract of docs/dev/architecture.md.
Nothing but headers is read up front: each ``get`` reads one tensor (an MXFP4 linear: its packed codes and
scales) from a memory-mapped shard, moves the raw bytes to the target device and decodes there.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from msmodelslim.errors import UserError
from msmodelslim.source.mxfp4 import GROUP_SIZE, decode_mxfp4
from msmodelslim.source.quant_scheme import QuantScheme, parse_quant_scheme, read_config

__all__ = ["CheckpointError", "CheckpointReader", "open_checkpoint", "read_config"]

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_PACKED = ".weight_packed"
_SCALE = ".weight_scale"
# compressed-tensors companions of a packed weight; hidden behind the logical "X.weight".
_COMPANIONS = (".weight_scale", ".weight_global_scale", ".weight_zero_point", ".weight_shape")


class CheckpointError(UserError):
    """A malformed checkpoint; the message names the offending file and key (one line, exit status 2)."""


_DTYPE_BYTES = {"F64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "U64": 8}


def _module_of(packed_key: str) -> str:
    return packed_key[: -len(_PACKED)]


def _module_of_companion(key: str) -> str:
    return key.rpartition(".weight_")[0]


class CheckpointReader:
    """TensorReader over one checkpoint directory. Safe for concurrent ``get`` from a few threads."""

    def __init__(self, model_dir: Path, weight_map: dict[str, str], index_path: Path | None,
                 config: dict[str, Any] | None, quant_scheme: QuantScheme | None) -> None:
        self.model_dir = model_dir
        self.config = config
        self.quant_scheme = quant_scheme
        self._index_path = index_path
        self._weight_map = weight_map  # stored key -> shard file name (relative to model_dir)
        self._handles: dict[str, Any] = {}
        self._shard_keys: dict[str, frozenset[str]] = {}
        self._lock = threading.Lock()
        self._logical: dict[str, str] = {}  # logical key -> stored key (packed key for MXFP4)
        packed_modules = {_module_of(k) for k in weight_map if k.endswith(_PACKED)}
        self._packed_modules = packed_modules
        for key in weight_map:
            if key.endswith(_PACKED):
                logical = _module_of(key) + ".weight"
            else:
                module, dot, _ = key.rpartition(".")
                if dot and module in packed_modules and any(key.endswith(c) for c in _COMPANIONS):
                    continue
                logical = key
            if logical in self._logical:  # "X.weight" stored both dense and packed
                raise CheckpointError(f"{self._where(key)}: {logical} is stored both dense and as {_PACKED}")
            self._logical[logical] = key

    # -- TensorReader -------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Logical tensor names: ``X.weight`` for an MXFP4 linear (its packed/scale names are hidden)."""
        return list(self._logical)

    def keys_with_prefix(self, prefix: str) -> list[str]:
        return [k for k in self._logical if k.startswith(prefix)]

    def __contains__(self, name: object) -> bool:
        return name in self._logical

    def __len__(self) -> int:
        return len(self._logical)

    def is_mxfp4(self, name: str) -> bool:
        """Whether logical ``name`` is stored as MXFP4 (``weight_packed`` + ``weight_scale``)."""
        return self._stored_key(name).endswith(_PACKED)

    def shape(self, name: str) -> tuple[int, ...]:
        """Logical (decoded) shape of ``name``, from the shard header only."""
        stored = self._stored_key(name)
        shape = tuple(self._handle_for(stored).get_slice(stored).get_shape())
        if stored.endswith(_PACKED):
            shape = (*shape[:-1], shape[-1] * 2)
        return shape

    def stored_dtype(self, name: str) -> str:
        """safetensors dtype string ("BF16", "U8", ...) of logical ``name`` as stored (packed codes for MXFP4)."""
        stored = self._stored_key(name)
        return self._handle_for(stored).get_slice(stored).get_dtype()

    def output_size_bound(self) -> int:
        """Bytes a quantized copy can take at most: MXFP4 linears as int8 (1 byte a weight), the rest as stored."""
        total = 0
        for stored in self._weight_map:
            sl = self._handle_for(stored).get_slice(stored)
            numel = 1
            for d in sl.get_shape():
                numel *= d
            if stored.endswith(_PACKED):
                total += 2 * numel  # two codes a byte
            elif not any(stored.endswith(c) and _module_of_companion(stored) in self._packed_modules
                         for c in _COMPANIONS):
                total += numel * _DTYPE_BYTES.get(sl.get_dtype(), 4)
        self.close()
        return total

    def file_of(self, name: str) -> Path:
        """The shard holding logical ``name``."""
        return self._where(self._stored_key(name))

    def check_mxfp4_layout(self, name: str) -> None:
        """Headers only: the codes and E8M0 scales of MXFP4 ``name`` have the dtypes and shapes decoding needs."""
        stored = self._stored_key(name)
        module = _module_of(stored)
        scale_key = module + _SCALE
        where = self._where(stored)
        if scale_key not in self._weight_map:
            raise CheckpointError(f"{where}: {stored} has no matching {scale_key} in the checkpoint")
        if self.quant_scheme is None:
            raise CheckpointError(f"{self.model_dir / 'config.json'}: {stored} is packed but config.json has no "
                                  f"quantization_config")
        self.quant_scheme.require_mxfp4(module)
        packed = self._handle_for(stored).get_slice(stored)
        scale = self._handle_for(scale_key).get_slice(scale_key)
        p_shape, s_shape = tuple(packed.get_shape()), tuple(scale.get_shape())
        if packed.get_dtype() != "U8" or scale.get_dtype() != "U8":
            raise CheckpointError(f"{where}: {stored} is {packed.get_dtype()} and {scale_key} is {scale.get_dtype()}; "
                                  f"MXFP4 stores both as U8 (uint8)")
        if len(p_shape) != 2 or (2 * p_shape[1]) % GROUP_SIZE:
            raise CheckpointError(f"{where}: {stored} has shape {p_shape}; MXFP4 codes are [out, in/2] with in "
                                  f"divisible by {GROUP_SIZE}")
        if s_shape != (p_shape[0], 2 * p_shape[1] // GROUP_SIZE):
            raise CheckpointError(f"{self._where(scale_key)}: {scale_key} has shape {s_shape}, expected "
                                  f"{(p_shape[0], 2 * p_shape[1] // GROUP_SIZE)} for {stored} {p_shape}")

    def get(self, name: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name`` on ``device``; MXFP4 is decoded there (to ``dtype`` or bfloat16).

        Dense tensors keep their stored dtype unless ``dtype`` is given.
        """
        stored = self._stored_key(name)
        if not stored.endswith(_PACKED):
            tensor = self._read(stored).to(device)
            return tensor if dtype is None else tensor.to(dtype)
        module = _module_of(stored)
        scale_key = module + _SCALE
        if scale_key not in self._weight_map:
            raise CheckpointError(
                f"{self._where(stored)}: {stored} has no matching {scale_key} in the checkpoint"
            )
        if self.quant_scheme is None:
            raise CheckpointError(
                f"{self.model_dir / 'config.json'}: {stored} is packed but config.json has no quantization_config"
            )
        bias = self.quant_scheme.require_mxfp4(module)
        packed = self._read(stored).to(device)
        scale = self._read(scale_key).to(device)
        return decode_mxfp4(packed, scale, dtype=dtype or torch.bfloat16, exponent_bias=bias, name=name)

    def mxfp4_bytes(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """MXFP4 ``name`` as stored: (codes uint8 [out, in/2], E8M0 exponents uint8 [out, in/32]), the exponents
        moved to the spec's bias 127 when the writer used another (compressed-tensors 0.13: the same values, no
        decoding)."""
        self.check_mxfp4_layout(name)
        stored = self._stored_key(name)
        packed, scale = self._read(stored), self._read(_module_of(stored) + _SCALE)
        shift = 127 - self.quant_scheme.exponent_bias
        if shift:
            if int(scale.max()) + shift > 254:
                raise CheckpointError(f"{self._where(stored)}: {name}: an E8M0 exponent is out of range once "
                                      f"moved to bias 127")
            scale = scale + shift
        return packed, scale

    def get_stored(self, stored_key: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """A tensor exactly as stored (e.g. ``X.weight_packed``), no decoding."""
        if stored_key not in self._weight_map:
            raise KeyError(f"{self._source()}: no stored tensor {stored_key!r}")
        return self._read(stored_key).to(device)

    def stored_keys(self) -> list[str]:
        return list(self._weight_map)

    def close(self) -> None:
        with self._lock:
            self._handles.clear()
            self._shard_keys.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------
    def _source(self) -> Path:
        return self._index_path or self.model_dir / SINGLE_NAME

    def _where(self, stored_key: str) -> Path:
        return self.model_dir / self._weight_map[stored_key]

    def _stored_key(self, name: str) -> str:
        try:
            return self._logical[name]
        except KeyError:
            raise KeyError(f"{self._source()}: no tensor {name!r} in checkpoint") from None

    def _handle_for(self, stored_key: str) -> Any:
        shard = self._weight_map[stored_key]
        handle = self._handles.get(shard)
        if handle is None:
            with self._lock:  # one open per shard even when a prefetch thread races the main thread
                handle = self._handles.get(shard)
                if handle is None:
                    path = self.model_dir / shard
                    try:
                        handle = safe_open(str(path), framework="pt", device="cpu")
                    except FileNotFoundError as exc:
                        raise CheckpointError(f"{path}: shard file missing (needed for {stored_key})") from exc
                    except (SafetensorError, OSError) as exc:
                        raise CheckpointError(
                            f"{path}: cannot read safetensors shard (needed for {stored_key}): {exc}"
                        ) from exc
                    self._shard_keys[shard] = frozenset(handle.keys())
                    self._handles[shard] = handle
        if stored_key not in self._shard_keys[shard]:
            raise CheckpointError(
                f"{self.model_dir / shard}: tensor {stored_key} is listed in {self._source().name} but missing from the shard"
            )
        return handle

    def _read(self, stored_key: str) -> torch.Tensor:
        handle = self._handle_for(stored_key)
        try:
            return handle.get_tensor(stored_key)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{self._where(stored_key)}: cannot read tensor {stored_key}: {exc}") from exc


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{index_path}: not valid JSON ({exc})") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: missing or malformed 'weight_map'")
    return weight_map


SAMPLES_PER_SHARD = 8  # evenly spaced reads of each shard's tensor bytes
SAMPLE_BYTES = 1 << 16  # 8 x 64 KiB per shard: ~0.2 GB for Kimi-K3's 1.5 TB, a few seconds


def source_identity(model_dir: str | os.PathLike[str]) -> dict[str, str]:
    """What identifies a checkpoint cheaply: sha256 of its config.json and of its shard index (or, for one
    unsharded file, of its header), and `tensors_sha256`: of every shard's size, header and evenly spaced samples
    of its tensor bytes, which tells another training run of the same architecture (same config and index) apart.
    A sample, not a hash of 1.5 TB: an edit of a few tensors in place can escape it.
    Written into every output and quant report and into the resumable state; `eval`, `--resume`, a fallback's
    report and every torchrun rank compare it (`different_source`)."""
    import hashlib

    model_dir = Path(model_dir)
    out = {}
    config = model_dir / "config.json"
    if config.is_file():
        out["config_sha256"] = hashlib.sha256(config.read_bytes()).hexdigest()
    index, single = model_dir / INDEX_NAME, model_dir / SINGLE_NAME
    shards: list[Path] = []
    if index.is_file():
        data = index.read_bytes()
        out["index_sha256"] = hashlib.sha256(data).hexdigest()
        try:
            names = json.loads(data).get("weight_map", {}).values()
            shards = [model_dir / name for name in sorted(set(names)) if isinstance(name, str)]
        except (ValueError, AttributeError):
            shards = []  # the checker names a broken index; the identity is only as good as the index
    elif single.is_file():
        with open(single, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            out["header_sha256"] = hashlib.sha256(f.read(min(length, 100 * 2**20))).hexdigest()
        shards = [single]
    if shards:
        digest = hashlib.sha256()
        for shard in shards:
            digest.update(shard.name.encode() + b"\0" + _shard_sample(shard))
        out["tensors_sha256"] = digest.hexdigest()
    return out


def _shard_sample(path: Path) -> bytes:
    """A shard's size, header and SAMPLES_PER_SHARD reads of SAMPLE_BYTES spread over its tensor bytes (b"" for a
    shard that cannot be read: the checker reports it). Only a regular file is opened: a FIFO would wait for a
    writer forever."""
    if not path.is_file():
        return b""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = int.from_bytes(f.read(8), "little")
            if length > min(size, 100 * 2**20):
                return b""
            parts = [size.to_bytes(8, "little"), f.read(length)]
            start, span = 8 + length, size - 8 - length
            step = max(span // SAMPLES_PER_SHARD, SAMPLE_BYTES)
            for offset in range(start, size, step):
                f.seek(offset)
                parts.append(f.read(SAMPLE_BYTES))
            return b"".join(parts)
    except OSError:
        return b""


def different_source(recorded: dict[str, str], actual: dict[str, str]) -> str | None:
    """The first key of a recorded identity that `actual` does not match (keys an older output lacks are not
    compared), else None."""
    return next((key for key, value in recorded.items() if actual.get(key) != value), None)


def _check_shards(model_dir: Path, weight_map: dict[str, str], index_path: Path) -> None:
    """Read every shard's header with the safetensors library (which also refuses a file shorter than its header
    says) and check that it holds the tensors the index puts there: a broken shard fails now, not hours in."""
    by_shard: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(key)
    for shard, keys in sorted(by_shard.items()):
        path = model_dir / shard
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                present = set(handle.keys())
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: cannot read safetensors shard: {exc}") from None
        missing = [k for k in keys if k not in present]
        if missing:
            raise CheckpointError(f"{path}: tensor {missing[0]} (and {len(missing) - 1} more) is listed in "
                                  f"{index_path.name} but missing from the shard")


def open_checkpoint(model_dir: str | os.PathLike[str], config: dict[str, Any] | None = None) -> CheckpointReader:
    """Open ``model_dir`` lazily: headers and config only; tensors are read by ``get``. ``config``: its config.json
    when the caller has read it already (otherwise it is read here, if there is one).

    Raises:
        CheckpointError: neither ``model.safetensors.index.json`` nor ``model.safetensors`` exists; a malformed
            index; a shard the index names is missing, outside ``model_dir`` or unreadable (header, length); an
            unsupported ``quantization_config`` (unknown quant_method, bad regex).
    """
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_NAME
    single_path = model_dir / SINGLE_NAME
    if index_path.is_file():
        weight_map = _read_index(index_path)
        first_key: dict[str, str] = {}
        for key, shard in weight_map.items():
            first_key.setdefault(shard, key)
        for shard, key in first_key.items():
            path = model_dir / shard
            # judged by the name, not by where links lead: a hub cache links its shards to blobs elsewhere
            if Path(shard).is_absolute() or os.path.normpath(shard).startswith(".."):
                raise CheckpointError(f"{index_path}: shard {shard!r} (holding {key}) lies outside {model_dir}")
            if path.exists() and not path.is_file():
                raise CheckpointError(f"{index_path}: shard {shard} (holding {key}) in {model_dir} is not a regular "
                                      f"file (a pipe, device or socket cannot be read as one)")
            if not path.is_file():
                raise CheckpointError(f"{index_path}: shard {shard} (holding {key}) not found in {model_dir}")
        _check_shards(model_dir, weight_map, index_path)
        source: Path | None = index_path
    elif single_path.is_file():
        try:
            with safe_open(str(single_path), framework="pt", device="cpu") as handle:
                weight_map = {k: SINGLE_NAME for k in handle.keys()}
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{single_path}: cannot read safetensors header: {exc}") from exc
        source = None
    else:
        raise CheckpointError(f"{model_dir}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
    try:
        if config is None and (model_dir / "config.json").is_file():
            config = read_config(model_dir)
        scheme = parse_quant_scheme(config, source=str(model_dir / "config.json")) if config is not None else None
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    reader = CheckpointReader(model_dir, weight_map, source, config, scheme)
    logger.debug("opened %s: %d tensors in %d shard(s)", model_dir, len(reader), len(set(weight_map.values())))
    return reader
