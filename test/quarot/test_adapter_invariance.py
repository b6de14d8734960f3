"""QuaRot + IterSmooth through the real KimiK3ModelAdapter on a generated tiny Kimi-K3 checkpoint (stand-in remote
code, EP-patched experts, runtime-patched kernels): units loaded, processed and forwarded one at a time as the
layer-wise runner does; final logits compared with the unprocessed run of the same adapter (float32).
Tolerance: relative RMS logit error < 2e-5 (fp32 rounding)."""

from __future__ import annotations

import pytest
import torch
from kimi_units import STANDIN_DIR, rel_err

from msmodelslim.core.runner.context import UnitContext
from msmodelslim.processor.iter_smooth import IterSmoothConfig, IterSmoothProcessor
from msmodelslim.processor.quarot import QuaRotConfig, QuaRotProcessor


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    import sys

    sys.path.insert(0, str(STANDIN_DIR))
    try:
        import make_checkpoint
    finally:
        sys.path.pop(0)
    out = tmp_path_factory.mktemp("k3tiny") / "ckpt"
    make_checkpoint.make_checkpoint(out, "tiny", seed=0)
    return out


def run_units(adapter, samples, processors):
    states = [dict(s) for s in samples]
    device = torch.device("cpu")
    for unit in adapter.units():
        module = adapter.load_unit(unit, device)

        def run_samples(u=unit, m=module, st=states):
            for s in st:
                adapter.forward_unit(u, m, s)

        ctx = UnitContext(unit, module, adapter, adapter.dist, run_samples)
        for proc in processors:
            proc.process_unit(ctx)
        with torch.no_grad():
            states = [adapter.forward_unit(unit, module, s) for s in states]
        adapter.free_unit(unit, module)
    return [s["logits"] for s in states]


def test_rotated_and_smoothed_tiny_k3_gives_the_same_logits_through_the_adapter(tiny_checkpoint):
    from msmodelslim.model.kimi_k3.adapter import KimiK3ModelAdapter

    adapter = KimiK3ModelAdapter(tiny_checkpoint, trust_remote_code=True, dtype=torch.float32)
    try:
        gen = torch.Generator().manual_seed(0)
        ph = adapter.config.media_placeholder_token_id
        ids = torch.randint(10, 1000, (1, 24), generator=gen)
        ids[0, 3:7] = ph
        samples = [{"input_ids": ids, "pixel_values": torch.randn(16, 3 * 14 * 14, generator=gen),
                    "image_grid_hws": torch.tensor([[4, 4]])},
                   {"input_ids": torch.randint(10, 1000, (1, 40), generator=gen)}]
        ref = run_units(adapter, samples, [])
        procs = [QuaRotProcessor(QuaRotConfig(online_down=True), adapter),
                 IterSmoothProcessor(IterSmoothConfig(), adapter)]
        out = run_units(adapter, samples, procs)
    finally:
        adapter.close()
    for o, r in zip(out, ref):
        assert rel_err(o, r) < 2e-5
    assert procs[1].counts["linear-linear"] > 0 and procs[1].skipped_online > 0
