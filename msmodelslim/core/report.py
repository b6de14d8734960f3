"""The quant report file (`quant_report.json`, written by pipeline/report.py into every output and by `msmodelslim
analyze`): its name, reading it back, and ranking its linears by a metric.

```json
{"version": 1, "source": {"config_sha256": ..., "index_sha256": ...},
 "expert_coverage": {"linears": 336, "tokens_min": 0, "tokens_median": 410, "tokens_max": 2011,
                     "below_inputs": [...], "no_token": [...]},        (null for a model without routed experts)
 "linears": {"<checkpoint name>": {"unit": "layers.3", "scheme": "W4A8_DYNAMIC", "method": "gptq",
             "error": 0.0071, "weight_error": ..., "act_error": ..., "hessian": "exact" | "diagonal",
             "tokens": 2048, "inputs": 512, "weight_kurtosis": 3.1, "weight_std": ..., "act_absmax": ...,
             "act_channel_ratio": ..., "act_kurtosis": ..., "act_peak_ratio": ..., "output_energy": ...}}}
```
`error` is the linear's relative output MSE on the calibration tokens (quant/sensitivity.py); every metric is worst
when largest; a metric is null where it could not be measured (a linear no token reached).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, get_args

from msmodelslim.core.files import read_small_text
from msmodelslim.errors import UserError

REPORT_FILE = "quant_report.json"
REPORT_VERSION = 1
# What a report ranks linears by (each is worst when largest): a fallback's `metric`, analyze's `--metrics`.
ReportMetric = Literal["error", "impact", "weight_error", "act_error", "weight_kurtosis", "weight_std", "act_absmax",
                       "act_channel_ratio", "act_kurtosis", "act_peak_ratio"]
# msModelSlim's `analyze --metrics` names -> the report's fields (msModelSlim reads kurtosis, std and quantile off
# the linears' input activations, as these fields do)
METRIC_ALIASES = {"mse": "error", "kurtosis": "act_kurtosis", "std": "act_peak_ratio", "quantile": "act_channel_ratio"}
ANALYZE_METRICS: tuple[str, ...] = (*METRIC_ALIASES, *get_args(ReportMetric))
# a report holds an entry per linear: ~200 bytes each, ~150k linears in Kimi-K3 with its MTP layers
MAX_REPORT_BYTES = 256 << 20
DEFAULT_TOP_K = 15  # msModelSlim's analyze default


def read_report(path: Path) -> dict[str, Any]:
    """A quant report, checked for its shape (UserError naming the file)."""
    if not Path(path).exists():
        raise UserError(f"{path}: no such quant report")
    try:
        report = json.loads(read_small_text(Path(path), "quant report", MAX_REPORT_BYTES))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not a readable quant report ({exc})") from None
    if not isinstance(report, dict) or report.get("version") != REPORT_VERSION \
            or not isinstance(report.get("linears"), dict) or not isinstance(report.get("source"), dict):
        raise UserError(f"{path}: not a quant report of version {REPORT_VERSION} (expected the {REPORT_FILE} of a "
                        f"msmodelslim quant or analyze run)")
    return report


def ranked(linears: dict[str, dict[str, Any]], metric: str = "error") -> list[tuple[str, float]]:
    """(name, value) of the linears that have `metric`, worst (largest) first; ties by name."""
    values = [(name, e[metric]) for name, e in linears.items() if e.get(metric) is not None]
    return sorted(values, key=lambda item: (-item[1], item[0]))
