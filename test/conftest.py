"""Fixtures shared by the whole suite: the one generated tiny Kimi-K3 checkpoint of a session, the session's runs
of kimi-linear-mini, a Triton kernel's PTX for Hopper; the `slow` marker.

Tiers: `make test` runs everything (CI); `make test-fast` (`pytest -m "not slow"`) leaves out the tests marked
`slow`: whole quantization runs in subprocesses or on several ranks, and the consumer tests' outputs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from standin.standin_helpers import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: a whole quantization run (subprocess, several ranks, the consumer "
                                       "outputs); left out by `make test-fast`")
MINI = REPO.parent / "shared" / "models" / "kimi-linear-mini"


@pytest.fixture
def hopper_ptx() -> Callable[..., str]:
    """`compile(kernel, signature, constexprs, aligned=())`: a Triton kernel's PTX as CUDA builds it for sm_90
    (H100 / H200), by Triton's own compiler without a GPU (4 warps, no fused multiply-add, as the kernels launch),
    with the arguments at the indices `aligned` known to be multiples of 16 (as a launch finds torch's pointers and
    such widths); the test skips where Triton's CUDA back end cannot assemble."""
    def compile_for_hopper(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any],
                           aligned: tuple[int, ...] = ()) -> str:
        pytest.importorskip("triton")
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                           attrs={(i,): [["tt.divisibility", 16]] for i in aligned} or None)
        try:
            built = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                   options={"num_warps": 4, "enable_fp_fusion": False})
        except (FileNotFoundError, RuntimeError) as exc:  # a Triton without its CUDA back end's tools
            if "ptxas" in str(exc):
                pytest.skip(f"Triton's CUDA back end cannot assemble here: {exc}")
            raise
        return built.asm["ptx"]

    return compile_for_hopper


@pytest.fixture(scope="session")
def tiny_k3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset of the stand-in (seed 0), generated once per session. Read-only: copy it to damage it."""
    out = tmp_path_factory.mktemp("ckpt") / "Kimi-K3-tiny"
    return make_tiny_checkpoint(out)


@pytest.fixture(scope="session")
def mini_runs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """kimi-linear-mini (the real trained model) quantized once per session with its shipped W4A8C8 practice cut to
    4 records of <= 64 tokens in two micro-batches (the quant report, its impact probe and the smoothing search's
    token ranges observe the first): `one` on one CPU process under the Ascend op check (`ascend_ops_checked` device ops),
    `two` on two (cpu:0,1). Shared by the end-to-end, data-parallel and resume tests. Read-only."""
    if not (MINI / "config.json").is_file():
        pytest.skip(f"{MINI} not available")
    from runner.dp_helpers import shrunken_practice

    from msmodelslim.app.quant import QuantArgs, quant
    from msmodelslim.core import ascend_check
    from msmodelslim.pipeline.launch import STATS_ENV

    root = tmp_path_factory.mktemp("mini")
    practice = shrunken_practice(REPO / "lab_practice" / "kimi_k3" / "kimi_linear_w4a8c8.yaml", root / "p.yaml",
                                 max_samples=4, max_seq_len=64)
    import yaml

    spec = yaml.safe_load(practice.read_text())
    spec["spec"]["micro_batch_tokens"] = 128  # two micro-batches of two records: one per rank of `two`
    spec["spec"]["report_tokens"] = 128  # the quant report observes the first of them only
    spec["spec"]["report_impact_tokens"] = 128  # and its impact probe forwards that one (pipeline/impact.py)
    smooth = next(step for step in spec["spec"]["process"] if step["type"] == "iter_smooth")
    smooth["search_tokens"] = 128  # and so do the smoothing search's token ranges
    practice.write_text(yaml.safe_dump(spec, sort_keys=False))
    for name, device in (("one", "cpu"), ("two", "cpu:0,1")):
        with pytest.MonkeyPatch.context() as env:
            if name == "one":  # checked (~3x the time here); checked runs on several ranks: test_data_parallel.py
                env.setenv(ascend_check.ENV, "1")
                env.setenv(STATS_ENV, str(root / "stats"))
            quant(QuantArgs(model_path=str(MINI), save_path=str(root / name), device=device,
                            model_type="Kimi-Linear", config_path=str(practice)))
    checked = json.loads((root / "stats.rank0").read_text())["ascend_ops_checked"]
    return SimpleNamespace(model=MINI, practice=practice, one=root / "one", two=root / "two",
                           ascend_ops_checked=checked)
