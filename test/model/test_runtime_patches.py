"""Runtime patches swap fla's Triton kernels for msmodelslim's torch kernels, and undo exactly.

(a) Remote-code style: a throwaway module written here imports fla exactly like the Kimi HF modeling file
    (`from fla.ops.kda import chunk_kda, fused_recurrent_kda`, `from fla.ops.kda.gate import fused_kda_gate`,
    `from fla.modules import ShortConvolution, FusedRMSNormGated`) and is loaded as
    `transformers_modules.<ckpt>.modeling_kimi_k3`. Reference: the same layer computed by formula in float64
    (conv1d + SiLU, fla's naive gate, float64 delta-rule recurrence, gated RMSNorm); tolerance 1e-4 relative RMS.
(b) transformers' native KimiLinearForCausalLM on the real ../shared/models/kimi-linear-mini (float32, MXFP4 experts
    decoded): logits with our kernels vs transformers' own torch fallback path (forced by rebinding the module's
    kernel names to the functions under the fla wrapper), two 128-token windows of python_tutorial.txt.
    Tolerance: relative RMS logit error < 1e-5 and max |diff| < 1e-4 * max |logit| (fp32; summation order only).
    Decode (cache: recurrent KDA + conv-state update) is checked on a small random native model: step-by-step
    logits equal the full-sequence logits within 1e-4 relative RMS.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from msmodelslim.model.kimi_k3.runtime_patches import (
    apply_runtime_patches,
    find_fla_modules,
    runtime_patches,
    should_patch,
    transformers_torch_fallback,
)
from msmodelslim.ops.kda import l2norm, naive_recurrent_kda_fp64

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared"
MINI = SHARED / "models" / "kimi-linear-mini"
TEXT = SHARED / "data" / "text" / "python_tutorial.txt"
TOL = 1e-4

REMOTE_CODE = textwrap.dedent('''
    import torch
    from torch import nn
    from fla.modules import FusedRMSNormGated, ShortConvolution
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    from fla.ops.kda.gate import fused_kda_gate


    class TinyKDA(nn.Module):
        """A KDA layer written like the Kimi HF modeling file (fla 0.4 calls)."""

        def __init__(self, hidden=32, heads=2, head_dim=16, conv=4):
            super().__init__()
            self.num_heads, self.head_dim = heads, head_dim
            d = heads * head_dim
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, d, bias=False) for _ in range(3))
            self.q_conv1d = ShortConvolution(hidden_size=d, kernel_size=conv, activation="silu")
            self.k_conv1d = ShortConvolution(hidden_size=d, kernel_size=conv, activation="silu")
            self.v_conv1d = ShortConvolution(hidden_size=d, kernel_size=conv, activation="silu")
            self.A_log = nn.Parameter(torch.empty(1, 1, heads, 1).uniform_(1, 16).log())
            self.dt_bias = nn.Parameter(torch.randn(d))
            self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)
            self.f_b_proj = nn.Linear(head_dim, d, bias=False)
            self.b_proj = nn.Linear(hidden, heads, bias=False)
            self.g_a_proj = nn.Linear(hidden, head_dim, bias=False)
            self.g_b_proj = nn.Linear(head_dim, d, bias=False)
            self.o_norm = FusedRMSNormGated(head_dim, eps=1e-5, activation="sigmoid")
            self.o_proj = nn.Linear(d, hidden, bias=False)

        def forward(self, x, state=None):
            B, T, _ = x.shape
            cq, ck, cv, rs = state if state is not None else (None, None, None, None)
            q, cq = self.q_conv1d(x=self.q_proj(x), cache=cq, output_final_state=True)
            k, ck = self.k_conv1d(x=self.k_proj(x), cache=ck, output_final_state=True)
            v, cv = self.v_conv1d(x=self.v_proj(x), cache=cv, output_final_state=True)
            g = fused_kda_gate(self.f_b_proj(self.f_a_proj(x)), self.A_log, self.head_dim, g_bias=self.dt_bias)
            beta = self.b_proj(x).float().sigmoid()
            q, k, v = (t.view(B, T, self.num_heads, self.head_dim) for t in (q, k, v))
            kda = fused_recurrent_kda if (state is not None and T <= 64) else chunk_kda
            o, rs = kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=rs, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
            o = self.o_norm(o, self.g_b_proj(self.g_a_proj(x)).view(B, T, self.num_heads, self.head_dim))
            return self.o_proj(o.reshape(B, T, -1)), (cq, ck, cv, rs)
''')


@pytest.fixture()
def remote_module(tmp_path):
    path = tmp_path / "modeling_kimi_k3.py"
    path.write_text(REMOTE_CODE)
    name = "transformers_modules.test_ckpt.modeling_kimi_k3"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(name, None)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def reference_layer(layer, x: torch.Tensor) -> torch.Tensor:
    """The TinyKDA layer by formula, float64 (fla's naive gate for the gate)."""
    from fla.ops.kda.gate import naive_kda_gate

    B, T, _ = x.shape
    H, K = layer.num_heads, layer.head_dim
    x = x.double()

    def conv(proj, conv1d):
        h = proj.weight.double() @ x.transpose(1, 2)
        w = conv1d.weight.double()
        return F.silu(F.conv1d(h, w, padding=w.shape[-1] - 1, groups=w.shape[0])[..., :T]).transpose(1, 2)

    q, k, v = (conv(p, c).view(B, T, H, K) for p, c in ((layer.q_proj, layer.q_conv1d),
                                                         (layer.k_proj, layer.k_conv1d),
                                                         (layer.v_proj, layer.v_conv1d)))
    raw = (x @ layer.f_a_proj.weight.double().T @ layer.f_b_proj.weight.double().T).view(B, T, H, K)
    g = naive_kda_gate(raw, layer.A_log.double(), layer.dt_bias.double(), output_dtype=torch.float64)
    beta = torch.sigmoid(x @ layer.b_proj.weight.double().T)
    o, _ = naive_recurrent_kda_fp64(l2norm(q), l2norm(k), v, g, beta)
    gate = (x @ layer.g_a_proj.weight.double().T @ layer.g_b_proj.weight.double().T).view(B, T, H, K)
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * layer.o_norm.weight.double() * torch.sigmoid(gate)
    return o.reshape(B, T, -1) @ layer.o_proj.weight.double().T


def test_should_patch_policy():
    assert should_patch("cpu") and should_patch("npu") and should_patch("npu:3") and should_patch(torch.device("cpu"))
    assert not should_patch("cuda") and not should_patch("cuda:1")
    assert should_patch("cuda", config_switch=True)


def test_remote_code_runs_on_cpu_for_layers_built_before_and_after_patching(remote_module):
    torch.manual_seed(0)
    before = remote_module.TinyKDA().eval()
    x = torch.randn(2, 70, 32)
    # fla's Triton kernels cannot run on CPU tensors, the reason for the patches: "0 active drivers" (RuntimeError)
    # on a CPU-only host, "cannot be accessed from Triton (cpu tensor?)" (ValueError) on a CUDA host
    with pytest.raises((RuntimeError, ValueError)):
        with torch.no_grad():
            before(x)
    with runtime_patches(remote_module, device_type="cpu") as handle, torch.no_grad():
        assert len(handle.changes) >= 5
        after = remote_module.TinyKDA().eval()
        after.load_state_dict(before.state_dict())
        ref = reference_layer(before, x)
        for layer in (before, after):
            y, _ = layer(x)
            assert rel(y, ref) < TOL
        # prefill 60 tokens then decode 10 one by one (recurrent kernel, in-place conv caches) = full prefill
        y_pre, state = after(x[:, :60])
        steps = [y_pre]
        for t in range(60, 70):
            y_t, state = after(x[:, t : t + 1], state)
            steps.append(y_t)
        assert rel(torch.cat(steps, 1), ref) < TOL


def test_undo_restores_every_fla_object(remote_module):
    import fla.modules
    import fla.ops.kda

    names = ("chunk_kda", "fused_recurrent_kda", "fused_kda_gate", "ShortConvolution", "FusedRMSNormGated")
    saved = {n: getattr(remote_module, n) for n in names}
    conv_forward = fla.modules.ShortConvolution.forward
    norm_forward = fla.modules.FusedRMSNormGated.forward
    handle = apply_runtime_patches([remote_module], device_type="npu")
    assert remote_module.chunk_kda is not fla.ops.kda.chunk_kda
    assert fla.modules.ShortConvolution.forward is not conv_forward
    handle.undo()
    handle.undo()  # idempotent
    assert {n: getattr(remote_module, n) for n in names} == saved
    assert remote_module.chunk_kda is fla.ops.kda.chunk_kda
    assert fla.modules.ShortConvolution.forward is conv_forward
    assert fla.modules.FusedRMSNormGated.forward is norm_forward


def test_cuda_keeps_fla_unless_forced(remote_module):
    import fla.ops.kda

    with runtime_patches(remote_module, device_type="cuda") as handle:
        assert not handle.changes and remote_module.chunk_kda is fla.ops.kda.chunk_kda
    with runtime_patches(remote_module, device_type="cuda", force=True) as handle:
        assert handle.changes and remote_module.chunk_kda is not fla.ops.kda.chunk_kda
    assert remote_module.chunk_kda is fla.ops.kda.chunk_kda


def test_find_fla_modules_lists_the_model_code(remote_module):
    layer = remote_module.TinyKDA()
    modules = {m.__name__ for m in find_fla_modules(layer)}
    assert remote_module.__name__ in modules
    assert "fla.modules.causal_conv1d.ops" in modules  # ShortConvolution instances' class module
    assert not any(m.startswith("torch") for m in modules)
    with runtime_patches(layer, device_type="cpu") as handle:
        assert remote_module.chunk_kda.__module__ == "msmodelslim.ops.kda"
        assert handle.changes


# ----------------------------------------------------------------------------------------------------------------------
# transformers' native Kimi-Linear


def tiny_native_model():
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    config = KimiLinearConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        kv_lora_rank=32, num_experts=4, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
        linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2, "head_dim": 32,
                            "short_conv_kernel_size": 4},
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(config).float().eval()
    with torch.no_grad():  # a real-looking forget gate (init leaves it empty/zero)
        for m in model.modules():
            if type(m).__name__ == "KimiLinearForgetGate":
                m.A_log.copy_(torch.empty_like(m.A_log).uniform_(1, 16).log())
                m.dt_bias.normal_()
    return model


def test_native_decode_with_cache_equals_full_forward():
    model = tiny_native_model()
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with transformers_torch_fallback():
            ref = model(input_ids=ids).logits
        with runtime_patches(device_type="cpu"):
            full = model(input_ids=ids).logits
            out = model(input_ids=ids[:, :36], use_cache=True)
            steps, cache = [out.logits], out.past_key_values
            for t in range(36, 40):
                out = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
                steps.append(out.logits)
                cache = out.past_key_values
    assert rel(full, ref) < 1e-5
    assert rel(torch.cat(steps, 1), full) < TOL


@pytest.mark.skipif(not MINI.is_dir(), reason=f"{MINI} not available")
def test_native_kimi_linear_mini_logits_equal_transformers_torch_fallback(tmp_path):
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from transformers import KimiLinearForCausalLM

    from msmodelslim.source.checkpoint import open_checkpoint

    # transformers cannot load the MXFP4 checkpoint itself (its compressed-tensors targets use hub names the native
    # class renames), so decode the experts and let transformers convert a dense copy.
    with open_checkpoint(MINI) as reader:
        state = {k: reader.get(k, "cpu", torch.float32) for k in reader.keys()}
    config = json.loads((MINI / "config.json").read_text())
    config.pop("quantization_config")
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = KimiLinearForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()

    tok = Tokenizer.from_file(str(MINI / "tokenizer.json"))
    ids = torch.tensor(tok.encode(TEXT.read_text(encoding="utf-8")).ids[: 2 * 128]).view(2, 128)
    with torch.no_grad():
        with transformers_torch_fallback():
            ref = model(input_ids=ids).logits
        with runtime_patches(model, device_type="cpu") as handle:
            assert "transformers.models.kimi_linear.modeling_kimi_linear.chunk_kimi_delta_attention" in handle.patched
            out = model(input_ids=ids).logits
    assert rel(out, ref) < 1e-5
    assert (out - ref).abs().max() < 1e-4 * ref.abs().max()
