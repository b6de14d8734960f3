"""Acceptance on the real consumer: every shipped Kimi-K3 practice's output of the tiny Kimi-K3 (bounded KDA gate, the
presets' default; and of an unbounded-gate tiny Kimi-K3), loaded by vllm-ascend's own Kimi-K3 classes (CPU, NPU
pieces stubbed as vllm-ascend's unit tests stub them): its scheme lookups, then its `load_weights`, and under 0.27
its MTP drafter's (bench/consumer_k3/load.py says what is counted). Two consumers, each in a venv of its own:
- vllm-ascend-0.26: branch releases/v0.26.0rc on vLLM 0.26.0 (`AscendKimiK3ForConditionalGeneration`);
- vllm-ascend-0.27: PR #14454's head e4f0a9e5 on vLLM 0.27.1 (the same class, `AscendKimiLinearForCausalLM` for the
  text, `AscendKimiK3MTP` for the drafter).

    bash bench/consumer_k3/setup.sh /work/consumer                 # once each: fetch github:vllm-project/vllm-ascend
    bash bench/consumer_k3/setup.sh /work/consumer27 e4f0a9e5484c472cabbc76583d959996356e3076 0.27.1
    python bench/consumer_k3.py --consumer /work/consumer          # outputs made with --target vllm-ascend-0.26
    python bench/consumer_k3.py --consumer /work/consumer27        # ... with --target vllm-ascend-0.27

Outputs are made for the consumer's profile (the `--target` its vllm-ascend version names) as the consumer tests
make them (test/consumer/outputs.py: 2 records of <= 64 tokens, min/max weights; names, schemes and layouts do not
depend on the integers), plus `kimi_k3_w4a8` of an unbounded-gate tiny Kimi-K3 (`gate_lower_bound: null`) and the
per-group practice (groups of 64) of a tiny Kimi-K3 whose expert linears are one and two groups wide. A practice the
profile refuses before compute is a row with its error line (`refused`). Expected of every other: 0 failed lookups,
0 unused tensors but the MTP layers' where the class skips them, 0 unwritten parameters but the derived conv ones,
rot_proj kept exactly when the output carries it, and under 0.27 the drafter's lookups, tensors and parameters all
met. The JSON line lists every output's counts.
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
from msmodelslim.errors import UserError  # noqa: E402

UNBOUNDED_GATE = "text_config.linear_attn_config.gate_lower_bound=null"  # the presets bound it (-5.0)
MIXED_WIDTHS = "text_config.moe_intermediate_size=128"  # expert w2 twice as wide as w1/w3


def output_of(checkpoint: Path, practice: Path, root: Path, target: str, group: int = TINY_GROUP) -> Path:
    shrunk = shrunken_practice(practice, root / f"{checkpoint.name}-{practice.name}", max_samples=2, max_seq_len=64,
                               plain_numerics=True)
    if "pergroup" in practice.name:  # the tiny experts have 64 inputs
        shrunk.write_text(shrunk.read_text().replace("group_size: 256", f"group_size: {group}"))
    out = root / f"{checkpoint.name}-{practice.stem}"
    quant(QuantArgs(model_path=str(checkpoint), save_path=str(out), device="cpu", model_type="Kimi-K3",
                    config_path=str(shrunk), trust_remote_code=True, target=target))
    return out


def consumer_target(consumer: Path) -> str:
    """The profile (serving/profiles.py) of the consumer's vllm-ascend: its dist-info's version, setup.sh's."""
    versions = [p.name.split("-")[1] for p in (consumer / "meta").glob("vllm_ascend-*.dist-info")]
    if len(versions) != 1:
        raise SystemExit(f"{consumer}/meta: expected one vllm_ascend dist-info, found {versions}")
    return "vllm-ascend-" + ".".join(versions[0].split(".")[:2])


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


def accepted(row: dict) -> bool:
    if row.get("refused"):
        return True  # refused before compute, naming the rule: no output to load
    met = not row.get("error") and not row["failed_lookups"] and not row["unused_tensors"] \
        and not row["unwritten_parameters"] and row["rot_proj_stored"] == row["rot_proj_kept"]
    if "mtp_lookups" in row:  # the consumer builds the drafter
        met = met and not row.get("mtp_error") and not row["mtp_failed_lookups"] and not row["mtp_unused_tensors"] \
            and not row["mtp_unwritten_parameters"]
    return met


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--consumer", type=Path, required=True, help="the directory bench/consumer_k3/setup.sh made")
    args = parser.parse_args()
    if not (args.consumer / "venv" / "bin" / "python").is_file():
        parser.error(f"{args.consumer}: no consumer venv; run bench/consumer_k3/setup.sh {args.consumer}")
    target = consumer_target(args.consumer)
    commit = (args.consumer / "vllm-ascend" / "COMMIT")
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
            label = f"{checkpoint.name} {practice.stem}"
            try:
                result = consumer_load(args.consumer, output_of(checkpoint, practice, root, target, group))
            except UserError as exc:
                rows.append({"output": label, "refused": str(exc)})
                print(f"{label}: refused under {target}: {exc}", flush=True)
                continue
            result["output"] = label
            rows.append(result)
            mtp = "" if "mtp_lookups" not in result else (
                f"; drafter {len(result['mtp_failed_lookups'])} failed of {result['mtp_lookups']} lookups, "
                f"{result.get('mtp_used_tensors')} MTP tensors used, {len(result.get('mtp_unused_tensors', []))} "
                f"unused, {len(result.get('mtp_unwritten_parameters', []))} unwritten"
                f"{', ' + result['mtp_error'] if result.get('mtp_error') else ''}")
            print(f"{label}: {result['error'] + '; ' if result.get('error') else ''}"
                  f"{len(result.get('failed_lookups', []))} failed of {result.get('lookups')} lookups, "
                  f"{len(result.get('unused_tensors', []))} unused tensors (+{result.get('skipped_mtp_tensors')} MTP), "
                  f"{len(result.get('unwritten_parameters', []))} unwritten parameters, rot_proj stored "
                  f"{result.get('rot_proj_stored')} kept {result.get('rot_proj_kept')}{mtp}", flush=True)
    consumer = f"vllm-ascend {commit.read_text().strip()[:8] if commit.is_file() else '?'} ({target}, CPU)"
    print_result({"bench": "consumer_k3", "machine": machine(), "consumer": consumer, "target": target,
                  "outputs": len(rows), "refused": sum(bool(r.get("refused")) for r in rows),
                  "all_accepted": all(accepted(r) for r in rows), "rows": rows})


if __name__ == "__main__":
    main()
