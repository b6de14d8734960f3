"""eval end to end on a generated tiny Kimi-K3 (stand-in remote code, MXFP4 experts, vision tower) with the real
adapter: quantize (experts W4A8, attention/shared/latent W8A8) -> AscendV1 -> `msmodelslim eval`.

What it pins down: the AscendV1 reader loads strictly through the real adapter (aux tensors hidden from keys()),
every quantized linear of the output is found and simulated from its stored integers, vision is skipped, and the
perplexities are finite and close (|delta| < 5 %; random weights make ppl ~ vocabulary size). The numerics of
the layer-wise computation are checked against whole-model references in test_eval_ppl.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / ".." / "shared" / "data" / "text" / "python_tutorial.txt"
W4A8 = {"act": {"dtype": "int8"}, "weight": {"dtype": "int4", "method": "minmax"}}
W8A8 = {"act": {"dtype": "int8"}, "weight": {"dtype": "int8", "method": "minmax"}}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tiny_k3_checkpoint):
    try:
        from msmodelslim.model.kimi_k3.adapter import KimiK3ModelAdapter
    except ImportError as exc:
        pytest.skip(f"the Kimi-K3 adapter does not import: {exc}")
    from msmodelslim.core.dist import SINGLE
    from msmodelslim.pipeline.hooks import SaveHook
    from msmodelslim.pipeline.layer_wise import LayerWiseRunner
    from msmodelslim.processor.linear_quant import LinearQuantConfig, LinearQuantProcessor
    from msmodelslim.processor.save.ascendv1_saver import AscendV1Saver, AscendV1SaverConfig

    root = tmp_path_factory.mktemp("k3")
    src, out = tiny_k3_checkpoint, root / "out"
    adapter = KimiK3ModelAdapter(src, trust_remote_code=True)
    try:
        procs = [LinearQuantProcessor(LinearQuantConfig.build(qconfig=W4A8, include=["*experts.*"],
                                                        exclude=["*shared_experts*"])),
                 LinearQuantProcessor(LinearQuantConfig.build(qconfig=W8A8, include=["*self_attn.*_proj", "*kv_a_proj_with_mqa",
                                                                                "*shared_experts.*",
                                                                                "*routed_expert_*_proj"],
                                                        exclude=["*kv_b_proj", "*.f_b_proj", "*.g_[ab]_proj"]))]
        saver = AscendV1Saver(AscendV1SaverConfig(), adapter, out, SINGLE)
        LayerWiseRunner(adapter, procs, [SaveHook([saver])], background=False).run([])  # dynamic W4A8/W8A8 needs no samples
    finally:
        adapter.close()
    return src, out


def test_eval_tiny_kimi_k3_end_to_end(quantized, capsys):
    from msmodelslim.eval import cli_main
    from msmodelslim.serving.ascendv1 import AscendV1Reader

    src, out = quantized
    if not TEXT.is_file():
        pytest.skip(f"{TEXT} not available")
    reader = AscendV1Reader(out)
    types = {reader.quant_type(n) for n in reader.quantized_linears()}
    assert types == {"W4A8_DYNAMIC", "W8A8_DYNAMIC"}
    code = cli_main(["--model_path", str(src), "--quant_path", str(out), "--dataset", str(TEXT), "--seq-len", "32",
                     "--max-windows", "2", "--trust_remote_code", "True", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["windows"] == 2 and result["tokens"] == 62
    assert result["quantized_linears"] == len(reader.quantized_linears())
    assert math.isfinite(result["ppl_orig"]) and math.isfinite(result["ppl_quant"])
    assert result["ppl_quant"] != result["ppl_orig"] and abs(result["delta_pct"]) < 5
