"""QuaRot + IterSmooth through the real KimiK3ModelAdapter on generated tiny Kimi-K3 checkpoints (stand-in remote
code with attention residuals, SiTU, the latent norm, q-LoRA MLA with the output gate, the full-rank KDA gate and an
MTP layer; EP-patched experts, runtime-patched kernels): units loaded, processed and forwarded one at a time as the
layer-wise runner does; the head's logits and the MTP layer's logits compared with the unprocessed run of the
same adapter (float32). Tolerance: relative RMS error < 2e-5 (fp32 rounding).
- multimodal (image + text samples): the shipped practices' rotations (latent, kv_lora, online down), and with the
  residual stream rotated too (the projector ends in an RMSNorm: its rotation is the stored `mm_projector.rot_proj`);
- text-only Kimi-K3: every rotation, the residual stream through the attention residuals and the MTP layer included.
"""

from __future__ import annotations

import pytest
import torch
from kimi_units import STANDIN_DIR, rel_err

from msmodelslim.pipeline.answers import run_processor
from msmodelslim.processor.base import UnitContext
from msmodelslim.processor.iter_smooth import IterSmoothConfig, IterSmoothProcessor
from msmodelslim.processor.quarot import QuaRotConfig, QuaRotProcessor


def _make(tmp_path_factory, text_only: bool):
    import sys

    sys.path.insert(0, str(STANDIN_DIR))
    try:
        import make_checkpoint
    finally:
        sys.path.pop(0)
    out = tmp_path_factory.mktemp("k3tiny") / "ckpt"
    make_checkpoint.make_checkpoint(out, "tiny", seed=0, text_only=text_only)
    return out


@pytest.fixture(scope="module")
def text_only_checkpoint(tmp_path_factory):
    return _make(tmp_path_factory, text_only=True)


def run_units(adapter, samples, processors):
    states = [dict(s, need_logits=True) for s in samples]
    device = torch.device("cpu")
    logits = []
    for unit in adapter.units():
        module = adapter.load_unit(unit, device)

        def run_samples(u=unit, m=module, st=states):
            for s in st:
                adapter.forward_unit(u, m, s)

        ctx = UnitContext(unit, module, adapter, adapter.dist, run_samples)
        for proc in processors:
            run_processor(proc, ctx)
        with torch.no_grad():
            states = [adapter.forward_unit(unit, module, s) for s in states]
        if unit.kind == "head":
            logits = [s.pop("logits") for s in states]
        adapter.free_unit(unit, module)
    return logits, [s["logits"] for s in states]  # the last unit is the MTP layer


def _samples(adapter, image: bool):
    gen = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(10, 1000, (1, 40), generator=gen)}]
    if image:
        ids = torch.randint(10, 1000, (1, 24), generator=gen)
        ids[0, 3:7] = adapter.config.media_placeholder_token_id
        samples.append({"input_ids": ids, "pixel_values": torch.randn(16, 3, 14, 14, generator=gen),
                        "grid_thws": torch.tensor([[1, 4, 4]])})
    return samples


def _check(adapter, samples, quarot: QuaRotConfig) -> IterSmoothProcessor:
    ref_logits, ref_mtp = run_units(adapter, samples, [])
    smooth = IterSmoothProcessor(IterSmoothConfig.build())
    logits, mtp = run_units(adapter, samples, [QuaRotProcessor(quarot), smooth])
    assert len(logits) == len(samples) and len(mtp) == len(samples)
    for o, r in zip(logits + mtp, ref_logits + ref_mtp):
        assert rel_err(o, r) < 2e-5
    return smooth


def test_rotated_and_smoothed_tiny_k3_gives_the_same_logits_through_the_adapter(tiny_k3_checkpoint):
    from msmodelslim.model.kimi_k3.adapter import KimiK3ModelAdapter

    with KimiK3ModelAdapter(tiny_k3_checkpoint, trust_remote_code=True, dtype=torch.float32) as adapter:
        smooth = _check(adapter, _samples(adapter, image=True), QuaRotConfig(rotate_hidden=False, online_down=True))
    assert smooth.counts["linear-linear"] > 0 and smooth.counts["norm-linear"] > 0 and smooth.counts["ov"] > 0
    # SiTU's linear_beta clamps the up branch, so no up-down subgraph exists to smooth
    assert smooth.counts.get("up-down", 0) == 0


def test_residual_rotation_through_attention_residuals_and_mtp_keeps_the_logits(text_only_checkpoint):
    from msmodelslim.model.kimi_k3.adapter import KimiK3ModelAdapter

    with KimiK3ModelAdapter(text_only_checkpoint, trust_remote_code=True, dtype=torch.float32) as adapter:
        assert adapter.layout.attn_res and len(adapter.layout.layers) > adapter.layout.num_layers
        _check(adapter, _samples(adapter, image=False), QuaRotConfig(online_down=True))


def test_residual_rotation_of_multimodal_kimi_k3_keeps_the_logits_with_the_projector_rotation(tiny_k3_checkpoint):
    # the projector ends in an RMSNorm, so its image tokens enter the rotated stream through the stored linear
    # mm_projector.rot_proj = Q^T after it (as vllm-ascend applies it); reference: the unrotated run, < 2e-5
    from msmodelslim.model.kimi_k3.adapter import KimiK3ModelAdapter

    with KimiK3ModelAdapter(tiny_k3_checkpoint, trust_remote_code=True, dtype=torch.float32) as adapter:
        samples = _samples(adapter, image=True)
        assert "pixel_values" in samples[1]
        quarot = QuaRotConfig(online_down=True)
        _check(adapter, samples, quarot)
        hidden = adapter.text_config.hidden_size
        vision = next(u for u in adapter.units() if u.kind == "vision")
        module = adapter.load_unit(vision, torch.device("cpu"))
        processor = QuaRotProcessor(quarot)
        run_processor(processor, UnitContext(vision, module, adapter, adapter.dist, lambda: None))
        q = processor.rotation("hidden", hidden, torch.device("cpu"))
        assert torch.equal(module.mm_projector.rot_proj.weight, q.T)
        adapter.free_unit(vision, module)
        assert not hasattr(adapter.model.mm_projector, "rot_proj")  # the shared skeleton is left as it was
