"""eval: layer-wise perplexity of original vs AscendV1 output on a toy 2-layer model with a test-only adapter."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from msmodelslim.core.dist import SINGLE
from msmodelslim.errors import UserError
from msmodelslim.eval.perplexity import build_parser, evaluate, make_windows, wrap_quantized_linears
from msmodelslim.model.base import ModelAdapter, Unit
from msmodelslim.pipeline.answers import run_processor
from msmodelslim.processor.base import UnitContext
from msmodelslim.processor.linear_quant import LinearQuantConfig, LinearQuantProcessor
from msmodelslim.processor.save.ascendv1_saver import AscendV1Saver, AscendV1SaverConfig
from msmodelslim.quant import QuantLinear
from msmodelslim.serving.ascendv1 import AscendV1Reader

V, D, H = 64, 32, 64
W4A8 = {"act": {"dtype": "int8"}, "weight": {"dtype": "int4", "method": "ssz"}}
W8A8 = {"act": {"dtype": "int8"}, "weight": {"dtype": "int8", "method": "ssz"}}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up_proj = nn.Linear(D, H, bias=False)
        self.down_proj = nn.Linear(H, D, bias=True)

    def forward(self, x):
        return x + self.down_proj(torch.relu(self.up_proj(self.norm(x))))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)


class ByteTokenizer:
    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return {"input_ids": [b % V for b in text.encode()]}


class ToyLM(ModelAdapter):
    """embed -> layers.0 -> layers.1 -> head; weights from a safetensors file (or the given reader)."""

    def __init__(self, model_path, online: bool = False) -> None:
        super().__init__(model_path)
        self.tokenizer = ByteTokenizer()
        self.dtype = torch.float32
        self.online = online
        self.tensors = load_file(str(self.model_path / "model.safetensors"))

    def units(self):
        return [Unit("embed", "embed", "model.embed."), Unit("layers.0", "decoder", "model.layers.0.", 0),
                Unit("layers.1", "decoder", "model.layers.1.", 1), Unit("head", "head", "model.head.")]

    def _build(self, unit):
        return {"embed": Embed, "decoder": Block, "head": Head}[unit.kind]()

    def load_unit(self, unit, device, reader=None):
        module = self._build(unit)
        sd = {n: (reader.get(unit.prefix + n, device, torch.float32) if reader is not None
                  else self.tensors[unit.prefix + n].to(device)) for n in module.state_dict()}
        module.load_state_dict(sd, strict=True)
        return module.to(device)

    def prepare_samples(self, records):
        return []

    def forward_unit(self, unit, module, state):
        if unit.kind == "embed":
            return {"hidden_states": module.embed_tokens(state["input_ids"])}
        if unit.kind == "head":
            return {"logits": module.lm_head(module.norm(state["hidden_states"]))}
        return {"hidden_states": module(state["hidden_states"])}

    def checkpoint_name(self, unit, live_name):
        return unit.prefix + live_name

    def checkpoint_state(self, unit, module):
        quantized = {n: m for n, m in module.named_modules() if isinstance(m, QuantLinear)}
        yield from ((unit.prefix + n, m) for n, m in quantized.items())
        for n, t in module.state_dict().items():
            if not any(n.startswith(q + ".") for q in quantized):
                yield unit.prefix + n, t


def _make_source(path):
    torch.manual_seed(0)
    path.mkdir(parents=True)
    adapter_units = ToyLM.units(None)
    tensors = {}
    for unit in adapter_units:
        mod = ToyLM._build(None, unit)
        for n, t in mod.state_dict().items():
            tensors[unit.prefix + n] = t * 3 if n.endswith("embed_tokens.weight") else t
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    return path


def _quantize_and_save(src, out, online: bool):
    """Run the toy model unit by unit: quantize every linear except lm_head (W8A8) with up_proj W4A8; save."""
    adapter = ToyLM(src)
    saver = AscendV1Saver(AscendV1SaverConfig(float_dtype="float32"), adapter, out, SINGLE)
    procs = [LinearQuantProcessor(LinearQuantConfig.build(qconfig=W4A8, include=["*up_proj"])),
             LinearQuantProcessor(LinearQuantConfig.build(qconfig=W8A8, include=["*"]))]
    modules = {}
    for unit in adapter.units():
        module = adapter.load_unit(unit, torch.device("cpu"))
        if online and unit.kind == "decoder":  # an online rotation T on down_proj: W <- W T^T, x~ = x T^T
            t, _ = torch.linalg.qr(torch.randn(H, H, dtype=torch.float64))
            module.down_proj.weight.data = (module.down_proj.weight.double() @ t.t()).float()
            module.down_proj.register_buffer("online_rotation", t.float(), persistent=False)
        ctx = UnitContext(unit, module, adapter, SINGLE, run_samples=lambda: None)
        for p in procs:
            run_processor(p, ctx)
        saver.save_unit(unit, module)
        modules[unit.name] = module
    saver.finalize({})
    return adapter, modules


def _direct_ppl(adapter, modules, windows):
    """Reference: the whole in-memory model at once, float64 NLL sum."""
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            state = {"input_ids": w}
            for unit in adapter.units():
                state = adapter.forward_unit(unit, modules[unit.name], state)
            logp = torch.log_softmax(state["logits"][0, :-1].float(), -1).gather(-1, w[0, 1:, None])
            nll -= float(logp.double().sum())
            n += w.shape[1] - 1
    return math.exp(nll / n)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return path


@pytest.mark.parametrize("online", [False, True])
def test_layerwise_ppl_equals_whole_model_references(tmp_path, text_file, online):
    """ppl_orig == the float model run whole; ppl_quant == the in-memory QuantLinear model the quantizer built
    (same stored integers); both to 1e-5 relative."""
    src = _make_source(tmp_path / "src")
    adapter, quant_modules = _quantize_and_save(src, tmp_path / "out", online)
    windows = make_windows(adapter.tokenizer(text_file.read_text(), add_special_tokens=False)["input_ids"], 64, 5)
    orig_modules = {u.name: adapter.load_unit(u, torch.device("cpu")) for u in adapter.units()}
    result = evaluate(src, tmp_path / "out", text_file, "cpu", seq_len=64, max_windows=5, adapter=adapter)
    assert result["windows"] == 5 and result["tokens"] == 5 * 63 and result["quantized_linears"] == 4
    assert result["ppl_orig"] == pytest.approx(_direct_ppl(adapter, orig_modules, windows), rel=1e-5)
    assert result["ppl_quant"] == pytest.approx(_direct_ppl(adapter, quant_modules, windows), rel=1e-5)
    assert result["ppl_quant"] != result["ppl_orig"]
    assert result["delta_pct"] == pytest.approx(100 * (result["ppl_quant"] / result["ppl_orig"] - 1))
    assert abs(result["delta_pct"]) < 10  # W4A8/W8A8 on a random toy: small but nonzero damage


class SkeletonToyLM(ToyLM):
    """The toy as the real adapters load units: every load of a unit fills one module object (the skeleton's) with
    the reader's tensors."""

    def __init__(self, model_path) -> None:
        super().__init__(model_path)
        self.skeleton = {}

    def load_unit(self, unit, device, reader=None):
        loaded = super().load_unit(unit, device, reader)
        module = self.skeleton.setdefault(unit.name, loaded)
        module.load_state_dict(loaded.state_dict(), strict=True, assign=True)  # a freed one is on meta
        return module


def test_the_original_head_is_the_source_one_when_the_output_head_differs(tmp_path, text_file, monkeypatch):
    """The head runs original and quantized side by side: with an adapter whose loads of a unit share one module
    (hf_checkpoint's skeleton) and an output whose lm_head differs from the source's (as a rotated residual makes
    it), ppl_orig is still the float model's. Reference: the source model run whole; tolerance 1e-5 relative (a
    shared module gave the output's head to the original: 24k against 55 on kimi-linear-mini)."""
    src = _make_source(tmp_path / "src")
    _quantize_and_save(src, tmp_path / "out", online=False)
    get = AscendV1Reader.get

    def other_head(self, name, *args, **kwargs):
        tensor = get(self, name, *args, **kwargs)
        return tensor.flip(0) if name == "model.head.lm_head.weight" else tensor

    monkeypatch.setattr(AscendV1Reader, "get", other_head)
    adapter = SkeletonToyLM(src)
    windows = make_windows(adapter.tokenizer(text_file.read_text(), add_special_tokens=False)["input_ids"], 64, 5)
    reference = _direct_ppl(adapter, {u.name: ToyLM.load_unit(adapter, u, torch.device("cpu"))
                                      for u in adapter.units()}, windows)
    result = evaluate(src, tmp_path / "out", text_file, "cpu", seq_len=64, max_windows=5, adapter=adapter)
    assert result["ppl_orig"] == pytest.approx(reference, rel=1e-5)
    assert result["ppl_quant"] != pytest.approx(reference, rel=1e-2)  # the output's flipped head reached its side


def test_the_layer_wise_runner_drives_the_evaluation(tmp_path, text_file, monkeypatch):
    """eval runs through the runner (pipeline/layer_wise.py): each unit's original, then the output's, the head once
    holding both, each in one pass over the windows; with loads that fill one skeleton per unit (the runner loads the
    next unit, the same skeleton, before it forwards this one) the figures equal those of separate modules (ToyLM),
    exactly."""
    from msmodelslim.pipeline.layer_wise import LayerWiseRunner

    src = _make_source(tmp_path / "src")
    _quantize_and_save(src, tmp_path / "out", online=False)
    runners, run = [], LayerWiseRunner.run
    monkeypatch.setattr(LayerWiseRunner, "run", lambda self, samples: runners.append(self) or run(self, samples))
    result = evaluate(src, tmp_path / "out", text_file, "cpu", seq_len=64, max_windows=3, adapter=SkeletonToyLM(src))
    reference = evaluate(src, tmp_path / "out", text_file, "cpu", seq_len=64, max_windows=3, adapter=ToyLM(src))
    assert dict(runners[0].stats.passes) == {name: 1 for name in (
        "embed (orig)", "embed (quant)", "layers.0 (orig)", "layers.0 (quant)", "layers.1 (orig)", "layers.1 (quant)",
        "head")}
    assert result == reference and result["ppl_quant"] != result["ppl_orig"]


def test_wrap_uses_stored_integers_and_rotation(tmp_path):
    src = _make_source(tmp_path / "src")
    adapter, quant_modules = _quantize_and_save(src, tmp_path / "out", online=True)
    reader = AscendV1Reader(tmp_path / "out")
    unit = adapter.units()[1]
    module = adapter.load_unit(unit, torch.device("cpu"), reader=reader)
    replaced = wrap_quantized_linears(adapter, unit, module, reader, torch.float32)
    assert replaced == {"model.layers.0.up_proj": "W4A8_DYNAMIC", "model.layers.0.down_proj": "W8A8_DYNAMIC"}
    ref = quant_modules["layers.0"]
    for name in ("up_proj", "down_proj"):
        assert torch.equal(getattr(module, name).qweight, getattr(ref, name).qweight)
        assert torch.equal(getattr(module, name).weight_scale, getattr(ref, name).weight_scale)
    assert torch.equal(module.down_proj.online_rotation, ref.down_proj.online_rotation)
    assert torch.equal(module.down_proj.bias, ref.down_proj.bias)


def test_make_windows_non_overlapping_and_capped():
    ws = make_windows(list(range(10)), 3, None)
    assert [w.tolist() for w in ws] == [[[0, 1, 2]], [[3, 4, 5]], [[6, 7, 8]]]
    assert len(make_windows(list(range(10)), 3, 2)) == 2 and make_windows([1, 2], 3, 5) == []


def test_cli_arguments():
    ns = build_parser().parse_args(["--model_path", "a", "--quant_path", "b", "--dataset", "t.txt", "--seq-len", "128",
                                    "--max_windows", "4", "--trust_remote_code", "True", "--device", "cuda:1"])
    assert (ns.seq_len, ns.max_windows, ns.trust_remote_code, ns.device) == (128, 4, True, "cuda:1")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model_path", "a", "--quant_path", "b", "--dataset", "t", "--trust_remote_code",
                                   "yes"])


def test_missing_dataset_and_short_text(tmp_path, text_file):
    src = _make_source(tmp_path / "src")
    adapter, _ = _quantize_and_save(src, tmp_path / "out", online=False)
    with pytest.raises(UserError, match="nope.txt"):
        evaluate(src, tmp_path / "out", tmp_path / "nope.txt", adapter=adapter)
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(UserError, match="fewer than"):
        evaluate(src, tmp_path / "out", short, seq_len=64, adapter=adapter)


def test_quantized_linear_not_found_in_the_model_is_an_error(tmp_path, text_file):
    """A described quantized linear that no unit has would silently stay float: refused, naming it."""
    src = _make_source(tmp_path / "src")
    _quantize_and_save(src, tmp_path / "out", online=False)

    class Renamed(ToyLM):
        def checkpoint_name(self, unit, live_name):
            return unit.prefix + "renamed." + live_name

    with pytest.raises(ValueError, match=r"model\.layers\.0\.down_proj.*cannot be simulated"):
        evaluate(src, tmp_path / "out", text_file, seq_len=64, max_windows=1, adapter=Renamed(src))
