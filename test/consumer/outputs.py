"""Our outputs of kimi-linear-mini and of a tiny Kimi-K3, made with the shipped practices (fewer, shorter
calibration samples; min/max weights instead of GPTQ, which changes no name, scheme or layout): what the consumer
tests and bench/lookup.py hand to vllm-ascend. W4A8C8 is the W4A8 practice plus fa3_quant: its linears are the W4A8
output's, and its MLA attentions carry the FA3 tensors. The Ascend 950 practices (MX) and the per-group W4A8 one
are made of the tiny Kimi-K3 (its experts have 64 inputs: groups of 32 instead of the practice's 256), and of the
mini too with `every_practice` (bench/lookup.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from runner.dp_helpers import REPO, shrunken_practice

from msmodelslim.app.quant import QuantArgs, quant

MINI = REPO.parent / "shared" / "models" / "kimi-linear-mini"
PRACTICES = REPO / "lab_practice" / "kimi_k3"


MX_PRACTICES = ("w4a16_mxfp4", "w4a8_mxfp", "w4a4c8_mxfp")
TINY_GROUP = 32
MODELS = {"mini": ("Kimi-Linear", "kimi_linear"), "tiny_k3": ("Kimi-K3", "kimi_k3")}  # -> model type, stem


def build_outputs(root: Path, tiny_k3: Path, every_practice: bool = False,
                  plain_numerics: bool = True) -> dict[tuple[str, str], Path]:
    """{(model, practice): output directory}; kimi-linear-mini is left out where ../shared lacks it.
    `every_practice` adds the plain W4A8 practice of both models, and the MX and per-group ones of the mini."""
    made = {}
    for model, path in (("mini", MINI), ("tiny_k3", tiny_k3)):
        if not (path / "config.json").is_file():
            continue
        extra = (*MX_PRACTICES, "w4a8_pergroup", "w4a8_upstream") if model == "tiny_k3" or every_practice else ()
        for quant_type in ("w4a8c8", "w8a8", *extra, *(("w4a8",) if every_practice else ())):
            made[(model, quant_type)] = build_one(root, path, model, quant_type, plain_numerics)
    return made


def build_one(root: Path, path: Path, model: str, quant_type: str, plain_numerics: bool = True) -> Path:
    """`model` ("mini" or "tiny_k3", read from `path`) quantized with the shipped practice of `quant_type`, shrunk
    as `build_outputs` does, in `root/<model>_<quant_type>`."""
    model_type, stem = MODELS[model]
    root.mkdir(parents=True, exist_ok=True)
    practice = shrunken_practice(PRACTICES / f"{stem}_{quant_type}.yaml", root / f"{model}_{quant_type}.yaml",
                                 max_samples=2, max_seq_len=64, plain_numerics=plain_numerics)
    if quant_type == "w4a8_pergroup":
        practice.write_text(practice.read_text().replace("group_size: 256", f"group_size: {TINY_GROUP}"))
    out = root / f"{model}_{quant_type}"
    quant(QuantArgs(model_path=str(path), save_path=str(out), device="cpu", model_type=model_type,
                    config_path=str(practice), trust_remote_code=True))
    return out


def file_hashes(out: Path, report: bool = False) -> dict[str, str]:
    """Relative path -> SHA-256 of every file of an output directory, the quant report only with `report` (a
    diagnostic of float sums kept to 4 significant digits, which a refactor may reorder)."""
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and (report or p.name != "quant_report.json")}


# The mixed output of the fallback tests: one routed expert of layer 1 named to W8A8_DYNAMIC (its layer's experts move
# with it), a KDA q_proj, an MLA q_a_proj and an o_proj named to FLOAT (their fused groups move with the first two).
FALLBACK = [
    {"to": "W8A8_DYNAMIC", "names": ["language_model.model.layers.1.block_sparse_moe.experts.3.w2"]},
    {"to": "FLOAT", "names": ["language_model.model.layers.0.self_attn.q_proj",
                              "language_model.model.layers.3.self_attn.q_a_proj",
                              "language_model.model.layers.2.self_attn.o_proj"]},
]


def build_fallback_output(root: Path, tiny_k3: Path) -> Path:
    """The tiny Kimi-K3 with the shipped W4A8C8 practice (shrunk, min/max weights) and FALLBACK."""
    import yaml

    practice = shrunken_practice(PRACTICES / "kimi_k3_w4a8c8.yaml", root / "tiny_k3_fallback.yaml", max_samples=2,
                                 max_seq_len=64, plain_numerics=True)
    data = yaml.safe_load(practice.read_text())
    data["spec"]["fallback"] = FALLBACK
    practice.write_text(yaml.safe_dump(data, sort_keys=False))
    out = root / "tiny_k3_fallback"
    quant(QuantArgs(model_path=str(tiny_k3), save_path=str(out), device="cpu", model_type="Kimi-K3",
                    config_path=str(practice), trust_remote_code=True))
    return out
