"""One AscendV1 output through vllm-ascend's own Kimi-K3 class on CPU (releases/v0.26.0rc on vLLM 0.26.0, or 0.27:
PR #14454 on vLLM 0.27.1): the engine's config from the output (quantization "ascend", as vllm-ascend reads
quant_model_description.json), the model built with that config (every layer's scheme lookup runs), then its
`load_weights` over every stored tensor; under 0.27 also its MTP drafter (`AscendKimiK3MTP`) as the proposer builds
it. Runs in the consumer venv (bench/consumer_k3/setup.sh); prints one JSON line:

    PYTHONPATH=bench/consumer_k3:DIR/vllm-ascend:DIR/meta DIR/venv/bin/python bench/consumer_k3/load.py OUT

- `lookups`: layers the quant config was asked about, `failed_lookups`: those that raised (the build stops there);
- `unused_tensors`: stored tensors that reached no parameter (the MTP layers `layers.{N + k}`, which the target
  class skips, are counted apart as `skipped_mtp_tensors`);
- `unwritten_parameters`: parameters no tensor wrote (the KDA conv weights the class derives after loading, counted
  apart as `derived_parameters`, and the FA3 Q scale the method never reads, as `unread_parameters`);
- `rot_proj_kept`: whether `mm_projector.rot_proj` survived the load (the class drops it when no tensor wrote it);
- 0.27, the drafter: `mtp_lookups` / `mtp_failed_lookups`, `mtp_used_tensors` / `mtp_unused_tensors` (of the MTP
  layers' tensors), `mtp_unwritten_parameters` (the embedding it shares with the target aside), `mtp_error`.
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
from vllm_ascend.models import kimi_k3  # noqa: E402

try:  # 0.27: the MTP drafter is a class of its own (models/kimi_k3_mtp.py:85); releases/v0.26.0rc skips the layers
    from vllm_ascend.models.kimi_k3_mtp import AscendKimiK3MTP  # noqa: E402
except ImportError:
    AscendKimiK3MTP = None
# the text class: 0.27 AscendKimiLinearForCausalLM (models/kimi_k3.py:735), releases/v0.26.0rc AscendKimiK3ForCausalLM
TEXT_CLASS = getattr(kimi_k3, "AscendKimiLinearForCausalLM", None) or kimi_k3.AscendKimiK3ForCausalLM

# 0.27: the KDA's kernel-layout conv weight, packed from conv1d after loading (ops/kimi_kda.py:118-135)
DERIVED = re.compile(r"\.(q_conv1d\.packed_conv_weights|self_attn\.ascend_conv1d_weight)$")
# made by the FA3 method for every point, read for the K cache only (methods/kv_c8.py:38-72): a per-token Q
# (the fp8 practice) writes no Q scale
UNREAD = re.compile(r"\.fa_q\.(scale|offset)$")


def build(out: str):
    load_general_plugins()  # vllm_ascend:register_model: the Kimi-K3 config class and the model registry
    # as objects: vLLM inspects classes registered by name in a subprocess, which would lack the stubs
    ModelRegistry.register_model("KimiK3ForConditionalGeneration", kimi_k3.AscendKimiK3ForConditionalGeneration)
    # 0.27 models/kimi_k3.py:839-844 builds the text model by the name KimiLinearForCausalLM
    ModelRegistry.register_model("KimiLinearForCausalLM", TEXT_CLASS)
    ModelRegistry.register_model("KimiK3ForCausalLM", TEXT_CLASS)
    if AscendKimiK3MTP is not None:
        ModelRegistry.register_model("KimiK3MTPModel", AscendKimiK3MTP)
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
        model = initialize_model(vllm_config=config, model_class=kimi_k3.AscendKimiK3ForConditionalGeneration)
    return model, config, asked, failed


def build_mtp(config, asked, failed):
    """0.27's MTP drafter (models/kimi_k3_mtp.py:85), as the proposer builds it: the target's vllm config and quant
    config (vLLM's _create_draft_vllm_config replaces the attention config only), prefix "" (its layers are
    `model.layers.{N+k}`). `asked`/`failed` collect its lookups apart from the target's."""
    quant = config.quant_config
    lookup = type(quant).get_quant_method.__get__(quant)

    def spy(layer, prefix, *args, **kwargs):
        asked.append(prefix)
        try:
            return lookup(layer, prefix, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            failed.append(f"{prefix}: {type(exc).__name__}: {exc}")
            raise

    quant.get_quant_method = spy
    with set_default_torch_dtype(config.model_config.dtype), torch.device("cpu"):
        return initialize_model(vllm_config=config, model_class=AscendKimiK3MTP)


def load_all(model, out):
    """`model.load_weights` over every stored tensor: (stored names, tensor -> parameters it wrote, params, error)."""
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    current: dict = {"tensor": None}
    wrote = defaultdict(set)

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

    error = None
    try:
        model.load_weights(tensors())
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
    return stored, wrote, params, error


def mtp_result(config, out, is_mtp) -> dict:
    asked, failed = [], []
    try:
        model = build_mtp(config, asked, failed)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return {"mtp_lookups": len(asked), "mtp_failed_lookups": failed, "mtp_error": f"build: {type(exc).__name__}: {exc}"}
    _, wrote, params, error = load_all(model, out)
    written = {p for ps in wrote.values() for p in ps}
    # the proposer shares the target's embedding (and head when the drafter's is absent): not the output's to write
    shared = re.compile(r"^model\.embed_tokens\.")
    unwritten = [p for p in params if p not in written]
    result = {"mtp_lookups": len(asked), "mtp_failed_lookups": failed, "mtp_parameters": len(params),
              "mtp_used_tensors": len([k for k in is_mtp if k in wrote]),
              "mtp_unused_tensors": [k for k in is_mtp if k not in wrote],
              "mtp_unwritten_parameters": [p for p in unwritten if not shared.search(p) and not DERIVED.search(p)
                                           and not UNREAD.search(p)],
              "mtp_shared_parameters": len([p for p in unwritten if shared.search(p)])}
    if error:
        result["mtp_error"] = f"load_weights: {error}"
    return result


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
    stored, wrote, params, error = load_all(model, out)
    if error:
        result["error"] = f"load_weights: {error}"
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
        # 0.27 models/kimi_k3.py:859-860 sets rot_proj to None instead of deleting it
        rot_proj_kept=getattr(model.mm_projector, "rot_proj", None) is not None)
    if AscendKimiK3MTP is not None:
        result.update(mtp_result(config, out, is_mtp))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
