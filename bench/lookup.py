"""vllm-ascend 0.23.0.post1's own scheme lookup on our outputs: failing lookups / layers looked up, per output and
consumer class (the table of issue 14), for every shipped practice of both models (the Ascend 950 and per-group ones
too, issue 25), in each class of the serving target its practice is written for (`spec.target`, default
vllm-ascend-0.27: vLLM 0.33's packed classes; vllm-ascend-0.26: vllm-ascend's own Kimi-K3 class of
releases/v0.26.0rc, vLLM 0.23's Kimi-Linear; issues 32, 49). Same code as test/consumer (which asserts it on a
subset, the 0.26 class on the default outputs too); this prints the numbers.

    python bench/lookup.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, generated_checkpoint, machine, print_result  # noqa: E402

sys.path.insert(0, str(ROOT / "test"))
from consumer import vllm_ascend_cpu as ascend  # noqa: E402
from consumer.outputs import build_outputs  # noqa: E402
from consumer.test_vllm_ascend_lookup import lookup_failures  # noqa: E402
from consumer.vllm_layers import served_specs  # noqa: E402


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-lookup-") as root:
        outputs = build_outputs(Path(root), generated_checkpoint("tiny"), every_practice=True)
        module = ascend.import_vllm_ascend()
        for (model, quant_type), out in sorted(outputs.items()):
            for spec in served_specs(out, multimodal=model != "mini"):
                count, failures = lookup_failures(module, out, spec)
                rows.append({"output": f"{model} {quant_type}", "vllm": spec["version"], "layers": count,
                             "failing": len(failures), "first_failure": failures[0] if failures else None})
                print(f"{model} {quant_type} on {spec['version']}: {len(failures)} / {count} failing", flush=True)
        ascend.remove_stubs()
    print_result({"bench": "lookup", "machine": machine(), "vllm_ascend": ascend.VERSION, "rows": rows})


if __name__ == "__main__":
    main()
