#!/usr/bin/env python3
"""Summarise the FA3 parts of msModelSlim AscendV1 outputs; compare description types with out_w4a8."""
import json, os, struct, sys, glob
import torch
from safetensors import safe_open

BASE = os.environ.get("W", "/tmp/msms_ref") + "/out_w4a8"


def st_header(d):
    hdr = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h = json.loads(fh.read(n))
        h.pop("__metadata__", None)
        for k, v in h.items():
            hdr[k] = (v["dtype"], v["shape"], f)
    return hdr


def summarise(d):
    desc = json.load(open(os.path.join(d, "quant_model_description.json")))
    hdr = st_header(d)
    keys = {}
    for k, v in desc.items():
        top = k not in hdr
        if "fa_" in k or "quant_type" in k or "self_attn" in k or top:
            keys[k] = v
    tensors = {}
    for k, (dt, shp, f) in hdr.items():
        if "fa_" in k:
            with safe_open(f, "pt") as fh:
                t = fh.get_tensor(k)
            tensors[k] = {"dtype": dt, "shape": shp, "values": t.float().flatten().tolist()}
    cfg = json.load(open(os.path.join(d, "config.json")))
    config = {k: cfg.get(k) for k in ["quantize", "moe_quantize", "mla_quantize", "mtp_quantize"]}
    base = json.load(open(os.path.join(BASE, "quant_model_description.json")))
    bcfg = json.load(open(os.path.join(BASE, "config.json")))
    changed = {k: [base[k], desc[k]] for k in desc if k in base and base[k] != desc[k] and isinstance(desc[k], str)}
    changed_nonstr = {k: [base[k], desc[k]] for k in desc if k in base and base[k] != desc[k] and not isinstance(desc[k], str)}
    added = sorted(set(desc) - set(base))
    removed = sorted(set(base) - set(desc))
    cfg_changed = {k: [bcfg.get(k), cfg.get(k)] for k in set(cfg) | set(bcfg) if cfg.get(k) != bcfg.get(k)}
    bhdr = st_header(BASE)
    dtype_changed = {k: [bhdr[k][:2], hdr[k][:2]] for k in hdr if k in bhdr and bhdr[k][:2] != hdr[k][:2]}
    return dict(description=keys, tensors=tensors, config=config,
                vs_w4a8=dict(desc_value_changed=changed, desc_nonstr_changed=changed_nonstr,
                             desc_keys_added=added, desc_keys_removed=removed,
                             config_changed=cfg_changed, tensor_dtype_shape_changed=dtype_changed,
                             n_tensors=len(hdr), n_tensors_w4a8=len(bhdr),
                             files=sorted(os.listdir(d))))


if __name__ == "__main__":
    out = {}
    for d in sys.argv[1:]:
        out[os.path.basename(d.rstrip("/"))] = summarise(d)
    print(json.dumps(out, indent=1))
