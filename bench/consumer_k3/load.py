"""One AscendV1 output through vllm-ascend's own Kimi-K3 class (releases/v0.26.0rc, vLLM 0.26.0), on CPU: the
engine's config from the output (quantization "ascend", as vllm-ascend reads quant_model_description.json), the
model built with that config (every layer's scheme lookup runs), then its `load_weights` over every stored tensor.
Runs in the consumer venv (bench/consumer_k3/setup.sh); prints one JSON line:

    PYTHONPATH=bench/consumer_k3:DIR/vllm-ascend:DIR/meta DIR/venv/bin/python bench/consumer_k3/load.py OUT

- `lookups`: layers the quant config was asked about, `failed_lookups`: those that raised (the build stops there);
- `unused_tensors`: stored tensors that reached no parameter (the MTP layers `layers.{N + k}`, which this class
  skips, are counted apart as `skipped_mtp_tensors`);
- `unwritten_parameters`: parameters no tensor wrote (the KDA conv's `packed_conv_weights`, which the class derives
  from the three conv weights after loading, counted apart as `derived_parameters`, and the FA3 Q scale the method
  never reads, as `unread_parameters`);
- `rot_proj_kept`: whether `mm_projector.rot_proj` survived the load (the class drops it when no tensor wrote it).
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from collections import defaultdict

import stubs  # noqa: F401  (before torch, vllm and vllm_ascend)
import vllm_ascend.utils  # noqa: F401

stubs.after_vllm_ascend_import()

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from vllm import ModelRegistry  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.model_loader.utils import initialize_model  # noqa: E402
from vllm.model_executor.model_loader.weight_utils import default_weight_loader  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402
from vllm_ascend.distributed.parallel_state import init_ascend_model_parallel  # noqa: E402
from vllm_ascend.models.kimi_k3 import AscendKimiK3ForCausalLM, AscendKimiK3ForConditionalGeneration  # noqa: E402

DERIVED = re.compile(r"\.q_conv1d\.packed_conv_weights$")
# made by the FA3 method for every point, read for the K cache only (methods/kv_c8.py:38-72): a per-token Q
# (the fp8 practice) writes no Q scale
UNREAD = re.compile(r"\.fa_q\.(scale|offset)$")


def build(out: str):
    load_general_plugins()  # vllm_ascend:register_model: the Kimi-K3 config class and the model registry
    # as objects: vLLM inspects classes registered by name in a subprocess, which would lack the stubs
    ModelRegistry.register_model("KimiK3ForConditionalGeneration", AscendKimiK3ForConditionalGeneration)
    ModelRegistry.register_model("KimiK3ForCausalLM", AscendKimiK3ForCausalLM)
    config = EngineArgs(model=out, quantization="ascend", dtype="bfloat16", enforce_eager=True, max_model_len=1024,
                        load_format="safetensors", skip_tokenizer_init=True).create_engine_config()
    with set_current_vllm_config(config):  # what worker.py:1105-1117 does, over gloo
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)
        init_ascend_model_parallel(config.parallel_config)
    current_platform.current_device = lambda *a, **k: torch.device("cpu")  # the projector is moved there
    backend = torch.distributed.ProcessGroup._get_backend

    def no_npu_backend(self, device):  # w4a8.py:380-386 asks for the HCCL comm name and tolerates AttributeError
        if torch.device(device).type == "npu":
            raise AttributeError("no npu backend on a gloo group")
        return backend(self, device)

    torch.distributed.ProcessGroup._get_backend = no_npu_backend
    quant = config.quant_config
    asked, failed = [], []
    lookup = quant.get_quant_method

    def spy(layer, prefix, *args, **kwargs):
        asked.append(prefix)
        try:
            return lookup(layer, prefix, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every lookup failure is a finding
            failed.append(f"{prefix}: {type(exc).__name__}: {exc}")
            raise

    quant.get_quant_method = spy
    with set_default_torch_dtype(config.model_config.dtype), torch.device("cpu"):
        model = initialize_model(vllm_config=config, model_class=AscendKimiK3ForConditionalGeneration)
    return model, config, asked, failed


def main() -> None:
    out = sys.argv[1]
    result: dict = {"output": out}
    try:
        model, config, asked, failed = build(out)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        result.update(error=f"build: {type(exc).__name__}: {exc}")
        print(json.dumps(result))
        return
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    current: dict = {"tensor": None}
    wrote = defaultdict(set)  # tensor -> parameters

    def tracked(loader):
        def load(param, *args, **kwargs):
            wrote[current["tensor"]].add(names.get(id(param), "?"))
            return loader(param, *args, **kwargs)
        return load

    for p in params.values():
        p.weight_loader = tracked(getattr(p, "weight_loader", default_weight_loader))
    stored = []

    def tensors():
        for file in sorted(f for f in os.listdir(out) if f.endswith(".safetensors")):
            with safe_open(os.path.join(out, file), "pt") as f:
                for key in f.keys():
                    current["tensor"] = key
                    stored.append(key)
                    yield key, f.get_tensor(key)

    try:
        model.load_weights(tensors())
    except Exception as exc:  # noqa: BLE001
        result["error"] = f"load_weights: {type(exc).__name__}: {exc}"
    text = config.model_config.hf_config.text_config
    mtp = re.compile(r"\.layers\.(\d+)\.")
    n = text.num_hidden_layers
    unused = [k for k in stored if k not in wrote]
    is_mtp = [k for k in unused if (m := mtp.search(k)) and int(m.group(1)) >= n]
    written = {p for ps in wrote.values() for p in ps}
    unwritten = [p for p in dict(model.named_parameters()) if p not in written]  # rot_proj is gone when unwritten
    result.update(
        lookups=len(asked), failed_lookups=failed, tensors=len(stored),
        unused_tensors=[k for k in unused if k not in is_mtp], skipped_mtp_tensors=len(is_mtp),
        parameters=len(params),
        unwritten_parameters=[p for p in unwritten if not DERIVED.search(p) and not UNREAD.search(p)],
        derived_parameters=len([p for p in unwritten if DERIVED.search(p)]),
        unread_parameters=len([p for p in unwritten if UNREAD.search(p)]),
        rot_proj_stored=any(k.startswith("mm_projector.rot_proj.") for k in stored),
        rot_proj_kept=hasattr(model.mm_projector, "rot_proj"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
