#!/usr/bin/env python3
"""Recompute FA3 per-head scales from the activations recorded by run_fa3_check.py and compare with
the saved tensors. Usage: check_fa3_scales.py RECORD.pt OUT_DIR QMAX(127|448)"""
import json, sys
import torch
from safetensors import safe_open
from msmodelslim.core.observer.recall_window import recall_window

rec = torch.load(sys.argv[1])
out_dir, qmax = sys.argv[2], float(sys.argv[3])
ratios = {"fa_q": 0.9999, "fa_k": 0.9999, "fa_v": 1.0}
f = safe_open(f"{out_dir}/quant_model_weights-00001-of-00001.safetensors", "pt")
res = {}
for name, xs in sorted(rec.items()):
    br = name.rsplit(".", 1)[-1]
    H = xs[0].shape[1]
    mn = mx = None
    for x in xs:
        s = x.to(torch.bfloat16).contiguous().view(x.shape[1], -1)
        a, b = recall_window(s, ratios[br], dim=-1, keepdim=True)
        mn = a if mn is None else torch.minimum(mn, a)
        mx = b if mx is None else torch.maximum(mx, b)
    mn, mx = mn.squeeze(), mx.squeeze()
    amax_rw = torch.maximum(-torch.minimum(mn, torch.zeros_like(mn)), torch.maximum(mx, torch.zeros_like(mx)))
    scale_re = (amax_rw / qmax).to(torch.float32).reshape(-1)          # bf16 arithmetic, as msModelSlim
    allx = torch.cat([x.movedim(1, 0).reshape(H, -1) for x in xs], dim=1)
    absmax = allx.abs().max(dim=1).values
    saved = f.get_tensor(name + ".scale").reshape(-1)
    res[name] = dict(
        n_calls=len(xs), shapes=sorted({tuple(x.shape) for x in xs})[:3], n_shapes=len({tuple(x.shape) for x in xs}),
        saved_scale=saved.tolist(),
        recomputed_recall_window_scale=scale_re.tolist(),
        exact_match=bool(torch.equal(saved, scale_re)),
        absmax=absmax.tolist(),
        absmax_over_qmax=(absmax / qmax).tolist(),
        saved_times_qmax=(saved * qmax).tolist(),
        rel_diff_vs_absmax_over_qmax=((saved - absmax / qmax) / (absmax / qmax)).tolist(),
    )
print(json.dumps(res, indent=1))
