"""Perplexity of the original checkpoint and of a written AscendV1 output, computed unit by unit.

The layer-wise runner drives it (pipeline/layer_wise.py, as a quantization run: a unit and the next one in memory,
no processor, an `EvalHook` that takes the scores off the head): for each unit in order, the original unit is loaded
from the source checkpoint and run over every window's hidden state, then the same unit is loaded from the AscendV1
output (dequantised weights) with every linear described with a quantized scheme (integer or MX) replaced by a
`QuantLinear` built from the STORED integers and scales (per-token activation quantization, online rotation if
stored), so the quantized pass computes what the runtime computes. Attentions the output quantizes
(`<attention>.quant_type`) get their FA3 points from the adapter and quantizers from the stored scales
(`install_attention_quantizers`). The `head` unit's logits give the NLL of each window's next tokens (fp32
log-softmax); ppl = exp(mean NLL over all predicted tokens). Vision units are skipped (text only).

Perplexity alone cannot rank practices whose deltas are smaller than its noise. With both models evaluated, the
head runs them side by side on each window and also gives the token-level KL divergence of the quantized model's
next-token distribution from the original's (mean over predicted tokens) and their top-1 agreement. Each comes with a
standard error over windows (the windows are of equal length: the standard deviation of the per-window means over
sqrt(windows)); the perplexity delta's is taken from the paired per-window loss differences (delta method:
ppl_quant / ppl_orig = exp(mean loss difference)).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from msmodelslim.core.dist import DistContext
from msmodelslim.errors import UserError
from msmodelslim.model.base import ModelAdapter, Unit
from msmodelslim.pipeline.hooks import UnitHook
from msmodelslim.pipeline.layer_wise import LayerWiseRunner
from msmodelslim.quant.attention import install_quantizers
from msmodelslim.quant.modules import QuantLinear, apply_online_rotation
from msmodelslim.serving.ascendv1 import QUANT_TYPES, AscendV1Reader
from msmodelslim.source.checkpoint import different_source, source_identity

logger = logging.getLogger(__name__)


@dataclass
class EvalResult:
    ppl_orig: float
    ppl_quant: float
    delta_pct: float  # 100 * (ppl_quant / ppl_orig - 1)
    windows: int
    tokens: int  # predicted tokens (windows * (seq_len - 1))
    quantized_linears: int  # linears simulated with stored integers (every quantized linear of the output)
    quantized_attentions: int = 0  # attentions simulated with their stored FA3 points
    # with the original evaluated too (module docstring); a standard error needs two windows (else None)
    ppl_delta_se: float | None = None  # percent
    kl: float | None = None  # nats per predicted token, KL(original || quantized)
    kl_se: float | None = None
    top1: float | None = None  # fraction of predicted tokens whose argmax agrees
    top1_se: float | None = None


METRICS = ("ppl", "kl", "top1")


class RotatedLinear(nn.Module):
    """A float linear whose input is rotated at run time (`x @ online_rotation^T`)."""

    def __init__(self, linear: nn.Linear, rotation: torch.Tensor) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("online_rotation", rotation)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(apply_online_rotation(x, self.online_rotation))


def make_windows(ids: Sequence[int] | torch.Tensor, seq_len: int, max_windows: int | None) -> list[torch.Tensor]:
    """Non-overlapping full windows [1, seq_len] from the start of the token stream (at most `max_windows`)."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    count = ids.numel() // seq_len
    if max_windows is not None:
        count = min(count, max_windows)
    return [ids[i * seq_len:(i + 1) * seq_len].unsqueeze(0) for i in range(count)]


def tokenize(adapter: ModelAdapter, text: str) -> list[int]:
    """The checkpoint tokenizer's ids of `text`, without special tokens."""
    tokenizer = adapter.tokenizer
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def wrap_quantized_linears(adapter: ModelAdapter, unit: Unit, module: nn.Module, reader: AscendV1Reader,
                           compute_dtype: torch.dtype) -> dict[str, str]:
    """Replace the unit's linears that the output describes as quantized (or rotated) by their runtime form.

    Returns {checkpoint name: description type} of the replaced linears.
    """
    replaced: dict[str, str] = {}
    targets = [(n, m) for n, m in module.named_modules() if n and isinstance(m, nn.Linear)]
    for live_name, linear in targets:
        ckpt = adapter.checkpoint_name(unit, live_name)
        if ckpt + ".weight" not in reader.description:
            continue
        qtype = reader.quant_type(ckpt)
        device = linear.weight.device
        rotation = reader.online_rotation(ckpt, device)
        if qtype in QUANT_TYPES:
            q, scale = reader.quantized_weight(ckpt, device)
            new: nn.Module = QuantLinear(linear.in_features, linear.out_features, qtype, q, scale,
                                         bias=None if linear.bias is None else linear.bias.detach(),
                                         online_rotation=rotation, compute_dtype=compute_dtype)
        elif rotation is not None:
            new = RotatedLinear(linear, rotation)
        else:
            continue
        parent_name, _, child = live_name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, child, new)
        replaced[ckpt] = qtype
    return replaced


def install_attention_quantizers(adapter: ModelAdapter, unit: Unit, module: nn.Module,
                                 reader: AscendV1Reader) -> list[str]:
    """Quantize the unit's attentions that the output describes (`<attention>.quant_type`) as stored; returns
    their checkpoint names."""
    if not reader.attention_types:
        return []
    wanted = set(reader.attention_types)
    live = adapter.inject_fa3_placeholders(unit, module, lambda name: name in wanted)
    device = next(module.parameters()).device
    names = []
    for live_name in live:
        ckpt = adapter.checkpoint_name(unit, live_name)
        install_quantizers(module.get_submodule(live_name), reader.attention_points(ckpt, device))
        names.append(ckpt)
    return names


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    """Sum of -log p(next token) over a window (fp32 log-softmax, float64 sum) and the number of predictions."""
    logits = logits[0, :-1].float()
    target = ids[0, 1:].to(logits.device)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, target[:, None]).squeeze(-1)
    return float(-logp.double().sum()), int(target.numel())


def _divergence(orig: torch.Tensor, quant: torch.Tensor) -> tuple[float, int]:
    """Over a window's predicted positions: the sum of KL(p_orig || p_quant) (fp32 log-softmax, float64 sums) and
    how many positions' argmax agree."""
    log_o = torch.log_softmax(orig[0, :-1].float(), dim=-1)
    log_q = torch.log_softmax(quant[0, :-1].float(), dim=-1)
    kl = (log_o.exp() * (log_o - log_q)).sum(-1)
    return float(kl.double().sum()), int((log_o.argmax(-1) == log_q.argmax(-1)).sum())


def _mean_se(values: list[float]) -> tuple[float, float | None]:
    """The mean and its standard error (None for fewer than two values)."""
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, None
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1) / n)


ORIGINAL, QUANTIZED = "orig", "quant"


class ModelPair:
    """The original checkpoint and the AscendV1 output as one model the layer-wise runner drives
    (pipeline/layer_wise.py, with `EvalHook`): each text unit twice, the original's then the output's (the runner
    holds a unit and the next one, as in a quantization run); the head both, side by side, giving each window's
    losses, KL and top-1 agreement in place of the logits. A sample's state is one window's token ids and its two
    states {"window": ids, "orig": ..., "quant": ...} (the quantized one alone with `variants`). The MTP layers the
    output holds are loaded, so their quantized linears are simulated and checked, and not forwarded: perplexity
    reads the head."""

    def __init__(self, adapter: ModelAdapter, reader: AscendV1Reader, compute_dtype: torch.dtype,
                 variants: Sequence[str]) -> None:
        self.adapter, self.reader, self.compute_dtype, self.variants = adapter, reader, compute_dtype, tuple(variants)
        self.simulated: set[str] = set()  # checkpoint names of the linears replaced by their runtime form
        self.attentions: set[str] = set()  # and of the attentions given their stored FA3 quantizers
        self._units: dict[str, tuple[Unit, str | None]] = {}  # pair unit name -> (the model's unit, variant)

    def units(self) -> list[Unit]:
        units = []
        for unit in self.adapter.units():
            if unit.kind == "vision":
                continue
            if unit.kind == "mtp" and not any(name.startswith(unit.prefix) for name in self.reader.weight_map):
                continue  # left out of the output (spec.mtp: drop)
            for variant in (None,) if unit.kind == "head" else self.variants:
                name = unit.name if variant is None else f"{unit.name} ({variant})"
                self._units[name] = (unit, variant)
                units.append(Unit(name, unit.kind, unit.prefix, unit.index))
        return units

    def _load(self, unit: Unit, variant: str, device: torch.device) -> nn.Module:
        if variant == ORIGINAL:  # a copy: the output's load of the unit fills the same skeleton (the runner loads
            # the next unit before it forwards this one, and the head holds both)
            return copy.deepcopy(self.adapter.load_unit(unit, device))
        module = self.adapter.load_unit(unit, device, reader=self.reader)
        self.simulated.update(wrap_quantized_linears(self.adapter, unit, module, self.reader, self.compute_dtype))
        self.attentions.update(install_attention_quantizers(self.adapter, unit, module, self.reader))
        return module

    def load_unit(self, unit: Unit, device: torch.device) -> nn.Module:
        model_unit, variant = self._units[unit.name]
        if variant is not None:
            return self._load(model_unit, variant, device)
        return nn.ModuleDict({v: self._load(model_unit, v, device) for v in self.variants})

    def free_unit(self, unit: Unit, module: nn.Module) -> None:
        model_unit, variant = self._units[unit.name]
        for part in (module,) if variant is not None else module.values():
            self.adapter.free_unit(model_unit, part)

    def forward_unit(self, unit: Unit, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        model_unit, variant = self._units[unit.name]
        if variant is not None:
            if variant not in state:  # past the head: nothing to forward
                return state
            return {**state, variant: self.adapter.forward_unit(model_unit, module, state[variant])}
        window = state["window"]
        logits = {v: self.adapter.forward_unit(model_unit, module[v], state[v])["logits"] for v in self.variants}
        scores: dict[str, Any] = {}
        for v in self.variants:
            scores[v], scores["count"] = _nll(logits[v], window)
        if ORIGINAL in logits:
            scores["kl"], scores["agree"] = _divergence(logits[ORIGINAL], logits[QUANTIZED])
        return {"scores": scores}

    def idle_unit(self, unit: Unit, module: nn.Module) -> None:
        raise RuntimeError("an evaluation runs on one device: no rank idles")


class EvalHook(UnitHook):
    """Takes each window's scores off the head's outputs (`ModelPair`), in window order."""

    def __init__(self) -> None:
        self.scores: list[dict[str, Any]] = []

    def reads_outputs(self, unit: Unit) -> bool:
        return unit.kind == "head"

    def keep(self, run: Any, step: int, state: Any) -> Any:
        if "scores" not in state:
            return state
        self.scores.append(state["scores"])
        return {}  # what the units after the head receive: nothing to forward


def layerwise_perplexity(adapter: ModelAdapter, windows: list[torch.Tensor], device: torch.device,
                         reader: AscendV1Reader, compute_dtype: torch.dtype = torch.bfloat16,
                         ppl_orig: float | None = None) -> EvalResult:
    """Original and quantized perplexity over `windows`, one unit in memory at a time (the layer-wise runner over a
    `ModelPair`); with `ppl_orig` (the original's, known from an earlier call on the same windows) the quantized
    one alone."""
    if not windows:
        raise UserError("no evaluation window (text shorter than one window?)")
    variants = (QUANTIZED,) if ppl_orig is not None else (ORIGINAL, QUANTIZED)
    pair, hook = ModelPair(adapter, reader, compute_dtype, variants), EvalHook()
    runner = LayerWiseRunner(pair, [], [hook], DistContext(device=device), background=False)
    runner.progress_label = "evaluating"
    runner.run([{"window": w, **{v: {"input_ids": w, "need_logits": True} for v in variants}} for w in windows])
    if not hook.scores:
        raise ValueError(f"{type(adapter).__name__}: no unit of kind 'head' produced logits")
    unmatched = sorted(set(reader.quantized_linears()) - pair.simulated)
    if unmatched:
        raise UserError(f"{reader.out_dir}: quantized linear {unmatched[0]!r} (and {len(unmatched) - 1} more) is not "
                         f"an nn.Linear of any text unit of {type(adapter).__name__}; it cannot be simulated")
    unmatched = sorted(set(reader.attention_types) - pair.attentions)
    if unmatched:
        raise UserError(f"{reader.out_dir}: quantized attention {unmatched[0]!r} (and {len(unmatched) - 1} more) is "
                         f"no attention with FA3 points of any text unit of {type(adapter).__name__}")
    count = [s["count"] for s in hook.scores]
    tokens = sum(count)
    ppl = {ORIGINAL: ppl_orig, **{v: math.exp(math.fsum(s[v] for s in hook.scores) / tokens) for v in variants}}
    logger.info("eval: %d quantized linears and %d quantized attentions simulated", len(pair.simulated),
                len(pair.attentions))
    result = EvalResult(ppl_orig=ppl[ORIGINAL], ppl_quant=ppl[QUANTIZED],
                        delta_pct=100.0 * (ppl[QUANTIZED] / ppl[ORIGINAL] - 1), windows=len(windows), tokens=tokens,
                        quantized_linears=len(pair.simulated), quantized_attentions=len(pair.attentions))
    if ORIGINAL in variants:
        loss_delta, loss_delta_se = _mean_se([(s[QUANTIZED] - s[ORIGINAL]) / s["count"] for s in hook.scores])
        result.ppl_delta_se = None if loss_delta_se is None else 100.0 * math.exp(loss_delta) * loss_delta_se
        result.kl, result.kl_se = _mean_se([s["kl"] / s["count"] for s in hook.scores])
        result.top1, result.top1_se = _mean_se([s["agree"] / s["count"] for s in hook.scores])
    return result


def check_same_source(model_path: str | Path, reader: AscendV1Reader) -> None:
    """The output must come from `model_path`: the identity `ascendv1_saver` records must match (an output
    without one, from an older version, is compared with a warning)."""
    recorded = (reader.header.get("metadata") or {}).get("source")
    if not recorded:
        logger.warning("%s records no source checkpoint; cannot check that it was made from %s", reader.out_dir,
                       model_path)
        return
    actual = source_identity(model_path)
    key = different_source(recorded, actual)
    if key is not None:
        raise UserError(f"--quant_path {reader.out_dir} was quantized from another checkpoint than --model_path "
                        f"{model_path} (source {key} {recorded[key]} != {actual.get(key)})")


def _resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    from msmodelslim.core.device import parse_device

    spec = parse_device(device)
    if spec.world_size != 1:
        raise UserError(f"--device {device!r}: eval runs on one device")
    return spec.torch_device(0)


def check_eval_args(dataset: str | Path, seq_len: int, max_windows: int | None) -> Path:
    """The evaluation's own arguments, checked before anything runs (`msmodelslim tune` checks them before its
    first quantization); the text file as a Path."""
    if seq_len < 2:
        raise UserError(f"seq_len must be at least 2, got {seq_len}")
    if max_windows is not None and max_windows < 1:
        raise UserError(f"max_windows must be at least 1, got {max_windows}")
    dataset = Path(dataset)
    if dataset.exists() and not dataset.is_file():
        raise UserError(f"{dataset}: the evaluation text is not a regular file (a pipe, device or socket cannot be "
                        f"read as one)")
    if not dataset.is_file():
        raise UserError(f"{dataset}: evaluation text file not found")
    return dataset


def eval_windows(adapter: ModelAdapter, dataset: Path, seq_len: int, max_windows: int | None) -> list[torch.Tensor]:
    """The token windows of the text file `dataset` (UserError when it is not UTF-8 or too short)."""
    try:
        text = dataset.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{dataset}: the evaluation text is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"{dataset}: cannot read the evaluation text ({exc.strerror})") from None
    windows = make_windows(tokenize(adapter, text), seq_len, max_windows)
    if not windows:
        raise UserError(f"{dataset}: fewer than seq_len={seq_len} tokens")
    return windows


def evaluate(model_path: str | Path, quant_path: str | Path, dataset: str | Path, device: str | torch.device = "cpu",
             seq_len: int = 512, max_windows: int | None = 32, trust_remote_code: bool = False,
             model_type: str = "Kimi-K3", adapter: ModelAdapter | None = None,
             ppl_orig: float | None = None) -> dict[str, Any]:
    """Perplexity of `model_path` and of the AscendV1 output `quant_path` on the text file `dataset`.

    Returns {ppl_orig, ppl_quant, delta_pct, windows, tokens, quantized_linears}. `adapter` (already built for `model_path` on
    `device`) overrides the config.ini lookup of `model_type`; `ppl_orig`, the original's perplexity from an earlier
    call with the same text and windows, spares its forward (`msmodelslim tune` evaluates every round).
    """
    dataset = check_eval_args(dataset, seq_len, max_windows)
    dev = _resolve_device(device)
    reader = AscendV1Reader(quant_path)
    check_same_source(model_path, reader)
    owned = adapter is None
    if adapter is None:
        from msmodelslim.model.registry import resolve_model_type

        cls = resolve_model_type(model_type).load_adapter_class()
        adapter = cls(model_path, trust_remote_code=trust_remote_code, dist=DistContext(device=dev))
    try:
        windows = eval_windows(adapter, dataset, seq_len, max_windows)
        compute_dtype = getattr(adapter, "dtype", torch.bfloat16)
        result = layerwise_perplexity(adapter, windows, dev, reader, compute_dtype, ppl_orig)
    finally:
        reader.close()
        if owned:
            adapter.close()  # undo the adapter's runtime patches of the checkpoint's classes
    logger.info("perplexity over %d windows x %d tokens: original %.4f, quantized %.4f (%+.2f%%)", result.windows,
                seq_len, result.ppl_orig, result.ppl_quant, result.delta_pct)
    return asdict(result)


def _bool(text: str) -> bool:
    if text not in ("True", "False"):
        raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")
    return text == "True"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="msmodelslim eval",
                                description="Perplexity of the original model and of its AscendV1 quantized output.")
    p.add_argument("--model_path", required=True, help="original weight directory")
    p.add_argument("--quant_path", required=True, help="AscendV1 output directory of `msmodelslim quant`")
    p.add_argument("--dataset", required=True, help="a UTF-8 text file")
    p.add_argument("--device", default="cpu", help="cpu, cuda[:i] or npu[:i] (one device)")
    p.add_argument("--seq-len", "--seq_len", dest="seq_len", type=int, default=512, help="tokens per window")
    p.add_argument("--max-windows", "--max_windows", dest="max_windows", type=int, default=32,
                   help="evaluate at most this many windows from the start of the text")
    p.add_argument("--trust_remote_code", type=_bool, default=False, metavar="{True,False}")
    p.add_argument("--model_type", default="Kimi-K3", help="a display name from config/config.ini")
    p.add_argument("--metrics", type=_metrics, default=METRICS, metavar="ppl,kl,top1",
                   help="what the table shows (default all; the JSON line holds every figure)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    return p


def _metrics(text: str) -> tuple[str, ...]:
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in names if m not in METRICS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(METRICS)}, got {text!r}")
    return names


def _pm(value: float | None, se: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" + ("" if se is None else f" +- {se:.{digits}f}")


def cli_main(argv: Sequence[str] | None = None) -> int:
    """`msmodelslim eval ...`: a table of the metrics asked for, then one JSON line of every figure (with --json,
    the JSON line alone); returns the exit code."""
    ns = build_parser().parse_args(None if argv is None else list(argv))
    result = evaluate(ns.model_path, ns.quant_path, ns.dataset, device=ns.device, seq_len=ns.seq_len,
                      max_windows=ns.max_windows, trust_remote_code=ns.trust_remote_code, model_type=ns.model_type)
    line = json.dumps({**result, "ppl_delta": result["delta_pct"]})
    if ns.json:
        print(line)
        return 0
    print("msmodelslim eval")
    print(f"  original   {ns.model_path}")
    print(f"  quantized  {ns.quant_path}")
    print(f"  text       {ns.dataset}: {result['windows']} windows x {ns.seq_len} tokens ({result['tokens']} "
          f"predicted); +- is one standard error over windows")
    if "ppl" in ns.metrics:
        print(f"  perplexity {result['ppl_orig']:.4f} -> {result['ppl_quant']:.4f} "
              f"({_pm(result['delta_pct'], result['ppl_delta_se'], 2)} %)")
    if "kl" in ns.metrics:
        print(f"  KL         {_pm(result['kl'], result['kl_se'], 5)} nats per token (original || quantized)")
    if "top1" in ns.metrics:
        print(f"  top-1      {_pm(result['top1'], result['top1_se'])} of next-token argmaxes agree")
    print(line)
    return 0
