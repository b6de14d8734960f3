"""Acceptance on the real consumer: every shipped Kimi-K3 practice's output of the tiny Kimi-K3 (bounded KDA gate, the
presets' default; and of an unbounded-gate tiny Kimi-K3), loaded by vllm-ascend's own
`AscendKimiK3ForConditionalGeneration` (branch releases/v0.26.0rc, on vLLM 0.26.0, CPU, NPU pieces stubbed as that
branch's unit tests stub them): its scheme lookups, then its `load_weights` (bench/consumer_k3/load.py says what is
counted). The consumer lives in a venv of its own:

    bash bench/consumer_k3/setup.sh /work/consumer            # once: fetch github:vllm-project/vllm-ascend first
    python bench/consumer_k3.py --consumer /work/consumer

Outputs are made as the consumer tests make them (test/consumer/outputs.py: 2 records of <= 64 tokens, min/max
weights; names, schemes and layouts do not depend on the integers), plus `kimi_k3_w4a8` of an unbounded-gate tiny
Kimi-K3 (`gate_lower_bound: null`) and the per-group practice (groups of 64) of a tiny Kimi-K3 whose expert linears
are one and two groups wide. Expected: 0 failed lookups, 0 unused tensors but the MTP layers' (which this class
skips), 0 unwritten parameters but the derived conv ones, and rot_proj kept exactly when the output carries it. The
JSON line lists every output's counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MAKE_CHECKPOINT, ROOT, generated_checkpoint, machine, print_result  # noqa: E402

sys.path.insert(0, str(ROOT / "test"))
from consumer.outputs import PRACTICES, TINY_GROUP  # noqa: E402
from runner.dp_helpers import shrunken_practice  # noqa: E402

from msmodelslim.app.quant import QuantArgs, quant  # noqa: E402

UNBOUNDED_GATE = "text_config.linear_attn_config.gate_lower_bound=null"  # the presets bound it (-5.0)
MIXED_WIDTHS = "text_config.moe_intermediate_size=128"  # expert w2 twice as wide as w1/w3


def output_of(checkpoint: Path, practice: Path, root: Path, group: int = TINY_GROUP) -> Path:
    shrunk = shrunken_practice(practice, root / f"{checkpoint.name}-{practice.name}", max_samples=2, max_seq_len=64,
                               plain_numerics=True)
    if "pergroup" in practice.name:  # the tiny experts have 64 inputs
        shrunk.write_text(shrunk.read_text().replace("group_size: 256", f"group_size: {group}"))
    out = root / f"{checkpoint.name}-{practice.stem}"
    quant(QuantArgs(model_path=str(checkpoint), save_path=str(out), device="cpu", model_type="Kimi-K3",
                    config_path=str(shrunk), trust_remote_code=True))
    return out


def consumer_load(consumer: Path, out: Path) -> dict:
    # a clean environment: this process's runs leave torch.distributed variables behind, which vLLM would read
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", ""), "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "bench" / "consumer_k3"), str(consumer / "vllm-ascend"), str(consumer / "meta")])}
    done = subprocess.run([str(consumer / "venv" / "bin" / "python"), str(ROOT / "bench" / "consumer_k3" / "load.py"),
                           str(out)], capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"output": str(out), "error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--consumer", type=Path, required=True, help="the directory bench/consumer_k3/setup.sh made")
    args = parser.parse_args()
    if not (args.consumer / "venv" / "bin" / "python").is_file():
        parser.error(f"{args.consumer}: no consumer venv; run bench/consumer_k3/setup.sh {args.consumer}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-consumer-k3-") as tmp:
        root = Path(tmp)
        variants = {}
        for name, setting in (("unbounded-gate", UNBOUNDED_GATE), ("mixed-widths", MIXED_WIDTHS)):
            variants[name] = root / f"Kimi-K3-tiny-{name}"
            subprocess.run([sys.executable, str(MAKE_CHECKPOINT), "--preset", "tiny", "--out", str(variants[name]),
                            "--seed", "0", "--set", setting], check=True, capture_output=True)
        cases = [(generated_checkpoint("tiny"), p, TINY_GROUP) for p in sorted(PRACTICES.glob("kimi_k3_*.yaml"))]
        cases.append((variants["unbounded-gate"], PRACTICES / "kimi_k3_w4a8.yaml", TINY_GROUP))
        # per group of 64: w1/w3 read 64 inputs (one group, issue 32's case (a)), w2 reads 128 (two)
        cases.append((variants["mixed-widths"], PRACTICES / "kimi_k3_w4a8_pergroup.yaml", 64))
        for checkpoint, practice, group in cases:
            result = consumer_load(args.consumer, output_of(checkpoint, practice, root, group))
            result["output"] = f"{checkpoint.name} {practice.stem}"
            rows.append(result)
            print(f"{result['output']}: {result['error'] + '; ' if result.get('error') else ''}"
                  f"{len(result.get('failed_lookups', []))} failed of {result.get('lookups')} lookups, "
                  f"{len(result.get('unused_tensors', []))} unused tensors (+{result.get('skipped_mtp_tensors')} MTP), "
                  f"{len(result.get('unwritten_parameters', []))} unwritten parameters, rot_proj stored "
                  f"{result.get('rot_proj_stored')} kept {result.get('rot_proj_kept')}", flush=True)
    ok = all(not r.get("error") and not r["failed_lookups"] and not r["unused_tensors"]
             and not r["unwritten_parameters"] and r["rot_proj_stored"] == r["rot_proj_kept"] for r in rows)
    print_result({"bench": "consumer_k3", "machine": machine(), "consumer": "vllm-ascend releases/v0.26.0rc on "
                  "vLLM 0.26.0 (CPU)", "outputs": len(rows), "all_accepted": ok, "rows": rows})


if __name__ == "__main__":
    main()
