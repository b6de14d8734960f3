"""Fixtures of the consumer tests: our outputs (built once) and vllm-ascend's quantization package on CPU."""

from __future__ import annotations

import pytest
from runner.dp_helpers import REPO, shrunken_practice

from msmodelslim.app.quant import QuantArgs, quant

from . import vllm_ascend_cpu as ascend

MINI = REPO.parent / "shared" / "models" / "kimi-linear-mini"
PRACTICES = REPO / "lab_practice" / "kimi_k3"


@pytest.fixture(scope="package")
def vllm_ascend(outputs):  # after the outputs: while it is imported, a stub torch_npu sits in sys.modules
    module = ascend.import_vllm_ascend()
    yield module
    ascend.remove_stubs()


@pytest.fixture(scope="package")
def outputs(tmp_path_factory, tiny_k3_checkpoint):
    """{(model, quant type): output directory}, quantized with the shipped practices (fewer, shorter samples)."""
    root = tmp_path_factory.mktemp("consumer")
    made = {}
    for model, model_type, path, stem in (("mini", "Kimi-Linear", MINI, "kimi_linear"),
                                          ("tiny_k3", "Kimi-K3", tiny_k3_checkpoint, "kimi_k3")):
        if not (path / "config.json").is_file():
            continue
        for quant_type in ("w4a8", "w8a8"):
            practice = shrunken_practice(PRACTICES / f"{stem}_{quant_type}.yaml", root / f"{model}_{quant_type}.yaml",
                                         max_samples=2, max_seq_len=64)
            out = root / f"{model}_{quant_type}"
            quant(QuantArgs(model_path=str(path), save_path=str(out), device="cpu", model_type=model_type,
                            config_path=str(practice), trust_remote_code=True))
            made[(model, quant_type)] = out
    return made


